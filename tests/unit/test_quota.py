"""Quotas of pools tokens (issue 30, item 8): what counts toward a token, and what a create or
grow over its limits is told, over a real pool directory without a daemon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rpmemfs.target.authz import Grant
from rpmemfs.target.pools import PoolError, PoolStore
from rpmemfs.target.quota import Quotas, Usage

MIB = 1 << 20


@pytest.fixture
def pools(tmp_path: Path) -> PoolStore:
    tmp_path.chmod(0o700)
    store = PoolStore(str(tmp_path), "force", 1 << 40)
    for name, size in (("alice-1", 2 * MIB), ("shared", MIB), ("bob-1", 8 * MIB), (".alice-1.owner", 99)):
        fd = store.dir.create(name, os.O_WRONLY)
        os.ftruncate(fd, size)
        os.close(fd)
    return store


def test_a_tokens_usage_is_every_pool_its_patterns_name_whoever_made_it(pools: PoolStore) -> None:
    q = Quotas(pools)
    alice = Grant("alice", False, ("alice-*", "shared"), quota=4 * MIB, max_pools=3)
    bob = Grant("bob", False, ("bob-*", "shared"))
    assert q.usage(alice) == Usage(3 * MIB, 2)
    assert q.usage(bob) == Usage(9 * MIB, 2)  # "shared" counts toward both
    assert q.report([alice, bob, Grant("default", True)]) == {
        "alice": {"quota": 4 * MIB, "max_pools": 3, "used": 3 * MIB, "pools": 2}}


def _make(q: Quotas, grant: Grant, name: str, size: int, *, grow: bool = False) -> None:
    with q.making(grant, name, size, grow=grow):
        pass


def test_a_create_or_grow_over_the_limits_is_refused_with_code_quota(pools: PoolStore) -> None:
    q = Quotas(pools)
    alice = Grant("alice", False, ("alice-*", "shared"), quota=4 * MIB, max_pools=4)
    with q.making(alice, "alice-2", MIB, grow=False):
        # Under way: counted at the size it will have, so a second create cannot take that room.
        assert q.usage(alice) == Usage(4 * MIB, 3)
        with pytest.raises(PoolError, match=r"may hold 4\.0 MiB on this target and its pools hold "
                           r"4\.0 MiB: pool 'alice-3' at 4\.0 KiB would take them") as err:
            _make(q, alice, "alice-3", 4096)
        assert err.value.code == "quota"
    assert q.usage(alice) == Usage(3 * MIB, 2)  # the first was never made here
    with pytest.raises(PoolError, match=r"pool 'alice-1' at 3\.5 MiB would take them to 4\.5 MiB"):
        _make(q, alice, "alice-1", 7 * MIB // 2, grow=True)
    _make(q, alice, "alice-1", 3 * MIB, grow=True)  # up to the quota exactly: let in
    two = Grant("alice", False, ("alice-*", "shared"), max_pools=2)
    with pytest.raises(PoolError, match="may have at most 2 pools on this target and has 2") as err:
        _make(q, two, "alice-2", 4096)
    assert err.value.code == "quota"
    _make(q, two, "alice-1", 64 * MIB, grow=True)  # no space quota: grows are not limited
    # Admins have no quota; a create of an existing name is left for the store to refuse.
    _make(q, Grant("default", True), "alice-9", 1 << 40)
    _make(q, alice, "alice-1", 1 << 40)
