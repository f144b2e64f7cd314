"""Peer-supplied text is escaped wherever it is shown: in log lines, in `rpmemfs pools`'s
table, in what a mount repeats of a target's answers, and in the owner records a target keeps
(whose size stays within what it reads back)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

from rpmemfs import logs
from rpmemfs.pool.layout import next_epoch
from rpmemfs.printable import printable
from rpmemfs.replica import ReplicaSpec
from rpmemfs.replica.fencing import read_probe
from rpmemfs.target.admin import format_pools
from rpmemfs.target.owners import HOLDER_FIELDS, MAX_HOLDER_TEXT, MAX_RECORD, Owner, OwnerBook, clean_holder
from rpmemfs.target.pooldir import PoolDir

EVIL = "node\nlevel=error msg=forged\r\x1b[31m\x9b2J\x7f\x00\u2028\u202e\ud800 é 日本"


def test_control_characters_are_escaped_as_repr_does_and_the_rest_is_kept() -> None:
    shown = printable(EVIL)
    assert shown.isprintable()
    assert shown == ("node\\nlevel=error msg=forged\\r\\x1b[31m\\x9b2J\\x7f\\x00\\u2028\\u202e\\ud800"
                     " é 日本")
    assert printable("/srv/pmem/app.pool") == "/srv/pmem/app.pool"
    assert printable(shown) == shown  # escaping twice changes nothing


def test_a_log_line_stays_one_line_whatever_its_message_holds() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs._KeyValue())
    log = logging.getLogger("rpmemfs.test.printable")
    log.handlers[:] = [handler]
    log.propagate = False
    log.warning("pool app: claimed by %s", EVIL)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text[:-1].isprintable(), text


def test_the_pools_table_shows_what_a_target_says_escaped() -> None:
    holder = {"host": EVIL, "pid": 7, "pool": "/p\x1b]0;owned\x07"}
    pools = {"evil\x1b[2J": {"size": 1 << 20, "owner": {"epoch_shown": "1:00000001\n", "holder": holder},
                             "writer": "10.0.0.1:1\r", "sessions": []}}
    table = format_pools("10.0.0.2:7420", pools)
    assert all(ln.isprintable() for ln in table.splitlines()), table
    assert len(table.splitlines()) == 3  # the title, the heading, one pool
    assert "node\\nlevel=error" in table and "\\x1b]0;owned\\x07" in table


def test_what_a_mount_repeats_of_a_target_s_probe_is_escaped() -> None:
    reply = {"owner": {"epoch": 5, "described": EVIL, "resync": {}, "resync_described": EVIL},
             "writer": EVIL}
    probe = read_probe(ReplicaSpec.make("10.0.0.2:7420", "app"), reply)
    assert probe.owner.isprintable() and (probe.resync or "").isprintable()
    assert (probe.writer or "").isprintable() and probe.owned_by().isprintable()


def test_a_target_stores_holders_escaped_and_bounded_so_that_every_record_reads_back(tmp_path: Path) -> None:
    assert clean_holder({"host": EVIL})["host"] == printable(EVIL)
    # The largest record there can be: every text at its bound, in characters that take the
    # most bytes in JSON (outside the BMP: two \\uXXXX escapes each), and a long resync "by".
    wide = "\U0001f600" * 1000
    holder = {k: (wide if kind is str else 1 << 40) for k, kind in HOLDER_FIELDS.items()}
    owner = Owner(next_epoch(0, 1), holder, 1.0, {"since": 2.0, "by": wide})
    book = OwnerBook(PoolDir(str(tmp_path)))
    book.set("app", owner)
    assert (tmp_path / ".app.owner").stat().st_size <= MAX_RECORD
    again = OwnerBook(PoolDir(str(tmp_path))).get("app")  # from disk: whole, not unreadable
    assert again is not None and again.epoch == owner.epoch
    assert again.holder["host"] == wide[:MAX_HOLDER_TEXT]
    assert again.resync is not None and again.resync["by"] == wide[:MAX_HOLDER_TEXT]
    assert json.loads((tmp_path / ".app.owner").read_text())["holder"]["pool"] == wide[:MAX_HOLDER_TEXT]
