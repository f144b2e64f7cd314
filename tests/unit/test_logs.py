"""Logs an administrator can read: repeats held back and counted, journald's priority prefix
without a second timestamp when stderr is the journal, syslog for a mount forked off."""

from __future__ import annotations

import io
import logging
import os
import socket
import tempfile
from pathlib import Path

import pytest

from rpmemfs import logs


def _lines(stream: io.StringIO) -> list[str]:
    return [ln for ln in stream.getvalue().splitlines() if ln]


def test_a_repeating_line_goes_once_per_window_and_then_says_how_many_were_held() -> None:
    now = [0.0]
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs._KeyValue())
    handler.addFilter(logs.RepeatFilter(window=60, clock=lambda: now[0]))
    log = logging.getLogger("rpmemfs.test.repeat")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    for i in range(595):
        now[0] = i * 0.1  # 595 failures in a minute, each naming another port and count
        log.warning("replica 10.0.0.3:%d refused after %d attempts", 40000 + i, i)
        log.info("something else %d", i % 2)
    assert len(_lines(out)) == 2  # one of each kind
    now[0] = 61.0
    log.warning("replica 10.0.0.3:%d refused after %d attempts", 50000, 600)
    last = _lines(out)[-1]
    assert "repeated=594" in last and "50000" in last, last
    log.error("replica 10.0.0.3:1 refused after 1 attempts")  # another level: its own line
    assert len(_lines(out)) == 4


def test_under_systemd_lines_carry_a_priority_and_no_timestamp(monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryFile("w+") as f:
        st = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        logs.setup("info", f)
        logging.getLogger("rpmemfs.test.journal").warning("a replica fell behind")
        logging.getLogger("rpmemfs.test.journal").error("an fsync failed")
        f.seek(0)
        lines = f.read().splitlines()
    assert lines[0].startswith("<4>level=warning ") and "ts=" not in lines[0], lines
    assert lines[1].startswith("<3>level=error "), lines
    monkeypatch.delenv("JOURNAL_STREAM")
    out = io.StringIO()
    logs.setup("info", out)
    logging.getLogger("rpmemfs.test.journal").warning("elsewhere")
    assert _lines(out)[0].startswith("ts="), _lines(out)


def test_to_syslog_sends_to_the_socket_and_says_when_there_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    d = tempfile.mkdtemp(prefix="rpm-log-")
    path = os.path.join(d, "log")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(path)
    sink.settimeout(5)
    try:
        monkeypatch.setenv("RPMEMFS_SYSLOG_SOCKET", path)
        assert logs.to_syslog("info", "rpmemfs-mount")
        logging.getLogger("rpmemfs.test.syslog").warning("the pool was not unmounted cleanly")
        got = sink.recv(4096).decode()
        # <28>: facility daemon (3 << 3) | warning (4); the tag names the program and pid.
        assert got.startswith(f"<28>rpmemfs-mount[{os.getpid()}]: level=warning "), got
        assert "ts=" not in got
        monkeypatch.setenv("RPMEMFS_SYSLOG_SOCKET", os.path.join(d, "nothing-here"))
        assert not logs.to_syslog("info")
    finally:
        sink.close()
        os.unlink(path)
        os.rmdir(d)
        logs.setup("warning")


def test_destination_names_where_the_lines_go_for_a_message_to_send_its_reader_there(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = str(tmp_path / "mount.log")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(tmp_path / "syslog"))
    try:
        with open(path, "a") as f:
            logs.setup("info", f)
            assert logs.destination() == path
        with open(os.devnull, "w") as null:
            logs.setup("info", null)
            assert logs.destination().startswith("nowhere")
        logs.setup("info", io.StringIO())
        assert logs.destination() == "stderr"
        monkeypatch.setenv("RPMEMFS_SYSLOG_SOCKET", str(tmp_path / "syslog"))
        assert logs.to_syslog("info", "rpmemfs-mount")
        assert logs.destination() == f"syslog, as rpmemfs-mount[{os.getpid()}]"
    finally:
        sink.close()
        logs.setup("warning")
