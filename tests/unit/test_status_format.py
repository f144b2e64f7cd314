"""What `rpmemfs status` decides and prints from a status document alone (mountd/status.py)."""

from __future__ import annotations

from typing import Any

from rpmemfs.mountd.status import Health, format_status, health


def _doc(**replica: Any) -> dict[str, Any]:
    return {"pool": "/p.pool", "mountpoint": "/mnt", "min_replicas": 1,
            "replicas": [{"address": "10.0.0.2:7420", "name": "app", "state": "stale", **replica}]}


def test_an_answer_that_is_only_an_error_is_unknown_not_healthy() -> None:
    h, why = health({"error": "internal error in status: KeyError('x')"})
    assert h is Health.UNKNOWN
    assert "internal error in status" in why


def test_a_last_error_without_a_time_is_shown_without_one() -> None:
    # A mount fenced at start (-o min_replicas=0) has errors with no time: no bare "UTC".
    row = format_status(_doc(last_error="fenced: replica ... is held by b")).splitlines()[-1]
    assert row.endswith("  fenced: replica ... is held by b"), row
    assert "UTC" not in row, row
    row = format_status(_doc(last_error="refused", last_error_at="2026-11-25T04:29:40.1+00:00")
                        ).splitlines()[-1]
    assert row.endswith("  2026-11-25 04:29:40 UTC refused"), row
    assert format_status(_doc()).splitlines()[-1].endswith("  -")
