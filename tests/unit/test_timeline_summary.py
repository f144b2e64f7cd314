"""The timeline tool's arithmetic and outputs on a made-up recording (the real run is
tests/e2e/test_timeline.py): its summary, the hint when matplotlib is missing, the plot when
it is there, and the options it refuses."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rpmemfs.tools import fsync_writer, timeline, timeline_plot
from rpmemfs.tools.timeline_record import Event, Fsync, ReplicaSample, Sample, Timeline, write_outputs

A, B = "127.0.0.1:7421", "127.0.0.1:7422"


def _made_up() -> Timeline:
    tl = Timeline(settings={"steady_s": 1.0, "dead_s": 1.0, "after_s": 1.0, "interval_s": 0.5,
                            "replica_timeout_s": 10.0, "min_replicas": 1, "pool_size": "64M",
                            "write_size": 4096, "span_bytes": 1 << 20, "pmem": "force"},
                  started_at=1000.0, replicas=[A, B], victim=B)
    tl.events = [Event(1.0, "kill", B), Event(1.1, "dead", B), Event(2.0, "restart", B),
                 Event(2.2, "listening", B), Event(3.0, "in-sync", B), Event(4.0, "end", B)]
    tl.fsyncs = [Fsync(t / 10, 0.001 if t != 10 else 0.2) for t in range(40)]
    states = [(0.0, "in-sync", 0, None), (0.5, "in-sync", 0, None), (1.5, "stale", 1 << 16, 1001.05),
              (2.0, "stale", 3 << 16, 1001.05), (2.5, "resyncing", 1 << 16, 1001.05),
              (3.0, "in-sync", 0, None), (3.5, "in-sync", 0, None)]
    tl.samples = [Sample(t, "healthy" if st == "in-sync" else "degraded",
                         {A: ReplicaSample("in-sync", 0, None),
                          B: ReplicaSample(st, lag, since, None, "gone" if since else None)})
                  for t, st, lag, since in states]
    tl.samples.insert(3, Sample(1.7, "unknown", error="timed out"))
    return tl


def test_the_summary_reads_the_kill_the_lag_and_the_resync_off_the_recording() -> None:
    s = _made_up().summary()
    assert s["fsyncs"] == 40 and s["failed_fsyncs"] == 0
    assert s["fault"] == "kill"
    assert s["fsync_max_at_fault_s"] == pytest.approx(0.2) and s["fsync_max_at_fault_t"] == pytest.approx(1.0)
    assert s["left_in_sync_after_s"] == pytest.approx(0.05)  # the daemon's behind_since
    assert s["kill_reaped_after_s"] == pytest.approx(0.1)
    assert s["fsyncs_while_down"] == 10
    assert s["victim_max_lag_bytes"] == 3 << 16
    assert s["in_sync_after_recovery_s"] == pytest.approx(1.0)
    assert s["target_start_s"] == pytest.approx(0.2)


def test_without_matplotlib_the_tool_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(timeline, "run", lambda out, **kw: _made_up())
    monkeypatch.setattr(timeline_plot, "available", lambda: False)
    assert timeline.main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "scripts/install.sh --plot" in err and "no plot was drawn" in err
    assert not (tmp_path / "timeline.png").exists()
    assert (tmp_path / "timeline.json").exists() and (tmp_path / "samples.csv").exists()
    assert f"{B} left in-sync 0.050 s after the kill -9: gone" in out


def test_a_replica_never_back_in_sync_is_a_failed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    tl = _made_up()
    tl.events = [e for e in tl.events if e.what != "in-sync"]
    monkeypatch.setattr(timeline, "run", lambda out, **kw: tl)
    monkeypatch.setattr(timeline_plot, "available", lambda: False)
    assert timeline.main([str(tmp_path)]) == 1
    assert "NOT in sync again" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--dead", "0"], ["--interval", "-1"], ["--plot", "x.jpg"],
                                  ["--fault", "reboot"], ["--pool-size", "lots"]])
def test_bad_options_are_refused_before_anything_starts(tmp_path: Path, args: list[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeline, "run", lambda out, **kw: pytest.fail("started"))
    with pytest.raises(SystemExit) as exc:
        timeline.main([str(tmp_path), *args])
    assert exc.value.code == 2


def test_the_recording_reads_back_as_it_was_written(tmp_path: Path) -> None:
    tl = _made_up()
    write_outputs(tl, tmp_path)
    again = Timeline.from_json(json.loads((tmp_path / "timeline.json").read_text()))
    assert again.summary() == tl.summary()
    assert again.samples == tl.samples and again.events == tl.events


def test_the_plot_is_drawn_small_and_again_from_the_recording(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # an optional extra: the tool runs without it
    for name in ("t.png", "t.svg"):
        timeline_plot.draw(_made_up(), tmp_path / name)
        assert 0 < (tmp_path / name).stat().st_size < 150_000
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_outputs(_made_up(), tmp_path)
    assert timeline.main([str(tmp_path), "--replot", "--plot", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_writer_records_survive_a_torn_last_record(tmp_path: Path) -> None:
    path = tmp_path / "records"
    path.write_bytes(fsync_writer.RECORD.pack(1.5, 0.001, 0) + fsync_writer.RECORD.pack(1.6, 0.002, 5)
                     + struct.pack("<d", 9.0))
    assert fsync_writer.read_records(str(path)) == [(1.5, 0.001, 0), (1.6, 0.002, 5)]

