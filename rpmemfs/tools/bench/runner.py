"""Runs the selected workloads on every target and collects the outcomes."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

from rpmemfs.mountinfo import fs_type, mounts_under
from rpmemfs.tools.bench.isolate import ChildFailed, Timeout, run_isolated
from rpmemfs.tools.bench.machine import describe
from rpmemfs.tools.bench.mount100k import measure_mount_time
from rpmemfs.tools.bench.notes import note
from rpmemfs.tools.bench.options import MOUNT100K, Options
from rpmemfs.tools.bench.results import Outcome, RunResult, TargetStatus
from rpmemfs.tools.bench.settle import IDLE, TIMEOUT, wait_until_quiet
from rpmemfs.tools.bench.stats import WorkloadResult, combine_rounds
from rpmemfs.tools.bench.targets import TARGETS, Target
from rpmemfs.tools.bench.workloads import WORKLOADS, Scale, Workload
from rpmemfs.tools.processes import SpawnError, detach_all_under, log_tail


def run(opts: Options) -> RunResult:
    workdir = Path(tempfile.mkdtemp(prefix="rpmemfs-bench-", dir=opts.base_dir))
    scale = Scale.quick() if opts.quick else Scale()
    result = RunResult(
        machine=describe(),
        config={
            "quick": opts.quick,
            "pool_size": opts.pool_size,
            "mount_files": opts.mount_files,
            "rounds": opts.rounds,
            "targets": list(opts.targets),
            "scale": vars(scale).copy(),
        },
        workdir=str(workdir),
        workdir_fs=fs_type(workdir),
        load_before=os.getloadavg(),
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
    result.load_after = os.getloadavg()
    return result


def _run_workloads(opts: Options, scale: Scale, workdir: Path, result: RunResult) -> None:
    measured: dict[tuple[str, str], list[WorkloadResult]] = {}
    errors: dict[tuple[str, str], str] = {}
    with ExitStack() as stack:
        targets = _bring_up(stack, workdir, opts.targets, opts.pool_size, result)
        note("waiting for the daemons to map their pools in (the machine going quiet)")
        waited = wait_until_quiet()
        note(f"quiet after {waited:.1f}s" if waited is not None else
             f"not {IDLE:.0%} idle within {TIMEOUT:g}s: measuring anyway (other load on the machine?)")
        for round_no in range(opts.rounds):
            # Workload by workload rather than target by target, and a different target
            # first in every round, so drifting background load on a shared machine
            # spreads over all targets instead of favouring one.
            shift = round_no % len(opts.targets)
            order = opts.targets[shift:] + opts.targets[:shift]
            for wname in opts.workloads:
                for tname in order:
                    if result.targets[tname].available and (wname, tname) not in errors:
                        label = f"round {round_no + 1}/{opts.rounds}: {wname} on {tname}"
                        got = _measure_or_record(WORKLOADS[wname], targets[tname], scale,
                                                 opts.timeout, label, result.targets[tname])
                        if isinstance(got, str):
                            errors[(wname, tname)] = got
                        else:
                            measured.setdefault((wname, tname), []).append(got)
        note("stopping filesystems")

    for wname in opts.workloads:
        result.summaries[wname] = WORKLOADS[wname].summary
        row = result.outcomes.setdefault(wname, {})
        for tname in opts.targets:
            rounds = measured.get((wname, tname))
            error = errors.get((wname, tname))
            if rounds or error:
                row[tname] = Outcome(result=combine_rounds(rounds) if rounds else None,
                                     error=error)


def _bring_up(stack: ExitStack, workdir: Path, names: tuple[str, ...], pool_size: str,
              result: RunResult) -> dict[str, Target]:
    """Every target that comes up; the others are marked unavailable with the reason."""
    targets: dict[str, Target] = {}
    for name in names:
        note(f"bringing up {name}")
        try:
            targets[name] = stack.enter_context(TARGETS[name](workdir, pool_size))
        except (SpawnError, OSError) as exc:
            result.targets[name] = TargetStatus(False, str(exc))
            note(f"{name} is unavailable, going on without it:\n  {exc}")
        else:
            result.targets[name] = TargetStatus(True)
    return targets


def _measure_or_record(workload: Workload, target: Target, scale: Scale, timeout: float,
                       label: str, status: TargetStatus) -> WorkloadResult | str:
    """The measurement, or the error to report in its place."""
    try:
        return _measure(workload, target, scale, timeout, label)
    except Timeout as exc:
        # A hung filesystem stays hung: stop sending it work.
        status.available = False
        status.error = f"{workload.name} hung ({exc}); later workloads skipped" + log_tail(
            target.log)
        note(f"{label}: {status.error}")
        return str(exc)
    except ChildFailed as exc:
        note(f"{label} failed: {exc}{log_tail(target.log)}")
        return str(exc).splitlines()[0] + log_tail(target.log)


def _measure(workload: Workload, target: Target, scale: Scale, timeout: float,
             label: str) -> WorkloadResult:
    note(f"{label} ...")

    def job() -> WorkloadResult:
        scratch = target.path / workload.name
        scratch.mkdir()
        measured = workload.run(scratch, scale, target.processes)
        # Inside the time limit too: deleting through a broken filesystem can hang.
        shutil.rmtree(scratch)
        return measured

    measured = run_isolated(job, timeout)
    shown = ", ".join(f"{m.name} {m.value:,.1f} {m.unit}" for m in measured.metrics)
    note(f"{label}: {shown}")
    return measured


def _mount_time(opts: Options, workdir: Path) -> Outcome:
    assert opts.mount_files is not None
    try:
        return Outcome(result=measure_mount_time(workdir, opts.pool_size, opts.mount_files,
                                                 opts.timeout))
    except (SpawnError, Timeout, ChildFailed, OSError) as exc:
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
