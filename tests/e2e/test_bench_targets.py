"""The bench's targets name the processes that serve them, so that its workloads can say how
much of an operation's CPU time each one took (docs/benchmarks.md, "sixth round"): a real
mount with two real target daemons on loopback, as `rpmemfs bench` brings them up."""

from __future__ import annotations

from pathlib import Path

from rpmemfs.tools.bench.targets import RPMEMFS_2REP, replicated_target
from rpmemfs.tools.bench.workloads import CONCURRENT_JOBS, Scale, concurrent_fsync


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_a_replicated_target_names_its_daemon_and_targets_and_the_split_sees_them(work_dir: Path) -> None:
    with replicated_target(RPMEMFS_2REP, work_dir, "256M") as target:
        assert set(target.processes) == {"daemon", "target0", "target1"}
        # The daemon is the process that serves this mount, the targets are target daemons.
        daemon = _cmdline(target.processes["daemon"])
        assert "mount" in daemon and str(target.path) in daemon
        for role in ("target0", "target1"):
            assert "rpmemfs.target" in _cmdline(target.processes[role])
        (target.path / "cf").mkdir()
        result = concurrent_fsync(target.path / "cf", Scale(concurrent_seconds=0.3), target.processes)
    metrics = {m.name: m.value for m in result.metrics}
    for jobs in CONCURRENT_JOBS:
        # Every replicated fsync costs the daemon and both targets something.
        assert metrics[f"cpu_daemon_user_{jobs}j"] > 0
        assert metrics[f"cpu_daemon_kernel_{jobs}j"] > 0
        assert metrics[f"cpu_targets_{jobs}j"] > 0
