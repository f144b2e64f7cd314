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
