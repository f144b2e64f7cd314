"""The send-cost measure of docs/benchmarks.md (rpmemfs.tools.bench.wakeup): it runs, over a
real loopback connection to a forked peer, and reports every case with a cost."""

from __future__ import annotations

import pytest

from rpmemfs.tools.bench import wakeup


def test_every_case_is_measured_with_a_positive_cost(capsys: pytest.CaptureFixture[str]) -> None:
    cases = wakeup.measure(50)
    assert [c for c, _ in cases][:len(wakeup.GAPS_US)] == [
        f"to a sleeping peer, {g} us after its last answer" for g in wakeup.GAPS_US]
    assert len(cases) == len(wakeup.GAPS_US) + 1
    assert all(us > 0 for _, us in cases)
    assert wakeup.main(["--sends", "20"]) == 0
    assert capsys.readouterr().out.count("us of the sender's CPU per 4400-byte send") == len(cases)
