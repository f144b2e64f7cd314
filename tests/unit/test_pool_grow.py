"""Growing a pool file (poolfile/grow.py): the bigger layout, and a grown pool that checks clean,
keeps its files and has the new space free."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpmemfs.fs.check import check
from rpmemfs.fs.mkfs import mkfs
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import BLOCK, PoolFormatError, plan
from rpmemfs.pool.syncmap import SyncMap
from rpmemfs.poolfile.grow import grow_file, grown


def test_the_grown_layout_keeps_the_log_and_data_offsets_and_moves_the_map_to_the_end() -> None:
    old = plan(16 << 20, b"u" * 16, 1)
    new = grown(old, 64 << 20)
    assert (new.area_size, new.data_off, new.uuid, new.epoch) == (old.area_size, old.data_off, old.uuid,
                                                                  old.epoch)
    assert new.pool_size == 64 << 20 and new.data_blocks > old.data_blocks
    assert new.data_off + new.data_blocks * BLOCK <= new.map_off < new.pool_size
    assert new.data_off + old.data_blocks * BLOCK <= old.map_off  # old data blocks all stay data
    for bad in (16 << 20, 8 << 20, (32 << 20) + 100):
        with pytest.raises(PoolFormatError):
            grown(old, bad)


def test_a_grown_pool_checks_clean_with_more_free_space_and_every_replica_marked_full(
        tmp_path: Path) -> None:
    path = str(tmp_path / "p.pool")
    old = mkfs(path, 8 << 20)
    new = grow_file(path, 24 << 20)
    assert (tmp_path / "p.pool").stat().st_size == 24 << 20
    with PoolMapping.open(path, "msync", readonly=True) as pm:
        hdr, _ = read_header(pm.buf)
        assert hdr == new
        report = check(pm.buf, path)
        assert report["clean"], report
        assert report["stats"]["data_blocks"] == new.data_blocks > old.data_blocks
        sm = SyncMap(pm.buf, hdr, lambda ranges: None)
        assert sm.full(0) and sm.full(1)  # compared in full at the next mount
