"""The bench's concurrent_fsync plot (rpmemfs.tools.bench.plot): what it reads from a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpmemfs.tools.bench import plot

RUN = {
    "config": {"rounds": 3},
    "load_before": [1.0, 1.0, 1.0],
    "workloads": {"concurrent_fsync": {"metrics": {
        "iops_1j": {"values": {"a": 10.0, "b": None}},
        "iops_16j": {"values": {"a": 30.0, "b": 5.0}},
        "iops_4j": {"values": {"a": 20.0, "b": 4.0}},
        "other": {"values": {"a": 1.0}},
    }}},
}


def test_series_by_target_in_process_order_without_missing_values() -> None:
    assert plot.series(RUN) == {"a": [(1, 10.0), (4, 20.0), (16, 30.0)], "b": [(4, 4.0), (16, 5.0)]}
    assert plot.series({}) == {}


def test_picture(tmp_path: Path) -> None:
    if not plot.available():
        pytest.skip("matplotlib is an optional extra")
    out = tmp_path / "c.png"
    plot.draw(RUN, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        plot.draw({}, out)


def test_cpu_split_by_target_and_processes_only_where_every_part_is_known() -> None:
    metrics = {f"cpu_{part}_{j}j": {"values": {"a": float(j + i), "b": None if part == "targets" else 1.0}}
               for j in (4, 16) for i, (part, _) in enumerate(plot.PARTS)}
    metrics["cpu_per_op_4j"] = {"values": {"a": 99.0}}
    run = {"workloads": {"concurrent_fsync": {"metrics": metrics}}}
    assert plot.cpu_split(run) == {
        ("a", 4): {"daemon_user": 4.0, "daemon_kernel": 5.0, "targets": 6.0, "other": 7.0},
        ("a", 16): {"daemon_user": 16.0, "daemon_kernel": 17.0, "targets": 18.0, "other": 19.0},
    }  # b lacks its targets' part: left out rather than drawn short
    if plot.available():
        out = Path(__file__).parent / "never-written.png"
        with pytest.raises(ValueError):
            plot.draw_cpu({}, out)
        assert not out.exists()
