"""Runs the selected workloads on every target and collects the outcomes."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

from rpmemfs.bench.isolate import ChildFailed, Timeout, run_isolated
from rpmemfs.bench.machine import describe, fs_type
from rpmemfs.bench.mount100k import measure_mount_time
from rpmemfs.bench.mounts import MountError, detach_all_under, mounts_under
from rpmemfs.bench.options import MOUNT100K, Options
from rpmemfs.bench.progress import note
from rpmemfs.bench.results import Outcome, RunResult, TargetStatus
from rpmemfs.bench.stats import WorkloadResult
from rpmemfs.bench.targets import TARGET_NAMES, TARGETS
from rpmemfs.bench.workloads import WORKLOADS, Scale, Workload


def run(opts: Options) -> RunResult:
    workdir = Path(tempfile.mkdtemp(prefix="rpmemfs-bench-", dir=opts.base_dir))
    scale = Scale.quick() if opts.quick else Scale()
    result = RunResult(
        machine=describe(),
        config={
            "quick": opts.quick,
            "pool_size": opts.pool_size,
            "mount_files": opts.mount_files,
            "scale": vars(scale).copy(),
        },
        workdir=str(workdir),
        workdir_fs=fs_type(workdir),
    )
    note(f"work dir {workdir} ({result.workdir_fs})")
    try:
        if opts.workloads:
            _run_workloads(opts, scale, workdir, result)
        if opts.mount_files is not None:
            # After the other daemons are gone, so it has the machine to itself.
            result.summaries[MOUNT100K] = (
                f"`rpmemfs mount` of a pool holding {opts.mount_files:,} small files, "
                "until a stat of one answers"
            )
            result.outcomes[MOUNT100K] = {"rpmemfs": _mount_time(opts, workdir)}
    finally:
        detach_all_under(workdir)
        _remove_workdir(workdir, opts.keep)
    return result


def _run_workloads(opts: Options, scale: Scale, workdir: Path, result: RunResult) -> None:
    with ExitStack() as stack:
        dirs: dict[str, Path] = {}
        for name in TARGET_NAMES:
            note(f"bringing up {name}")
            try:
                dirs[name] = stack.enter_context(TARGETS[name](workdir, opts.pool_size))
            except MountError as exc:
                result.targets[name] = TargetStatus(False, str(exc))
                note(f"{name} is unavailable, going on without it:\n  {exc}")
            else:
                result.targets[name] = TargetStatus(True)

        # Workload by workload rather than target by target, so slow drift of a
        # noisy machine spreads over all targets instead of favouring one.
        for wname in opts.workloads:
            workload = WORKLOADS[wname]
            result.summaries[wname] = workload.summary
            row = result.outcomes.setdefault(wname, {})
            for tname in TARGET_NAMES:
                status = result.targets[tname]
                if status.available:
                    row[tname] = _measure(workload, tname, dirs[tname], scale, opts.timeout,
                                          status)
        note("stopping filesystems")


def _measure(workload: Workload, target: str, directory: Path, scale: Scale, timeout: float,
             status: TargetStatus) -> Outcome:
    note(f"{workload.name} on {target} ...")

    def job() -> WorkloadResult:
        scratch = directory / workload.name
        scratch.mkdir()
        measured = workload.run(scratch, scale)
        # Inside the time limit too: deleting through a broken filesystem can hang.
        shutil.rmtree(scratch)
        return measured

    try:
        measured = run_isolated(job, timeout)
    except Timeout as exc:
        status.available = False
        status.error = f"{workload.name} hung ({exc}); later workloads skipped"
        note(f"{workload.name} on {target}: {status.error}")
        return Outcome(error=str(exc))
    except ChildFailed as exc:
        note(f"{workload.name} on {target} failed: {exc}")
        return Outcome(error=str(exc).splitlines()[0])
    shown = ", ".join(f"{m.name} {m.value:,.1f} {m.unit}" for m in measured.metrics)
    note(f"{workload.name} on {target}: {shown}")
    return Outcome(result=measured)


def _mount_time(opts: Options, workdir: Path) -> Outcome:
    assert opts.mount_files is not None
    try:
        return Outcome(result=measure_mount_time(workdir, opts.pool_size, opts.mount_files,
                                                 opts.timeout))
    except (MountError, Timeout, ChildFailed, OSError) as exc:
        note(f"{MOUNT100K} failed: {exc}")
        return Outcome(error=str(exc))


def _remove_workdir(workdir: Path, keep: bool) -> None:
    still = mounts_under(workdir)
    if still:
        # Deleting now would delete through the mount into whatever backs it.
        note(f"not removing {workdir}: still mounted: {', '.join(map(str, still))}")
    elif keep:
        note(f"kept work dir {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
