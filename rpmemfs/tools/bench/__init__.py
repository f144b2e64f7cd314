"""`rpmemfs bench`: rpmemfs against a pass-through FUSE filesystem and a plain directory.

Entry point for the CLI is `main(argv)`; `python -m rpmemfs.tools.bench` works as well.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from rpmemfs.tools.bench.notes import note

__all__ = ["main", "note"]


def _exit_on_sigterm() -> None:
    main_pid = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != main_pid:
            # A forked worker: die quietly, the parent does the cleaning up.
            os._exit(128 + signum)
        # Unwinds through the context managers, which unmount and stop daemons.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 if every target ran every workload, 1 otherwise."""
    # Imported here so `python -m rpmemfs.tools.bench.passthrough` stays light.
    from rpmemfs.tools.bench import options, report, runner

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        # A caller's argparse.REMAINDER keeps the separator that let options through.
        args = args[1:]
    if "--micro" in args:
        # The replication microbenchmark has options of its own (--quick among them).
        from rpmemfs.tools.bench import micro

        _exit_on_sigterm()
        return micro.main([a for a in args if a != "--micro"])
    try:
        opts = options.parse(args)
    except SystemExit as exc:  # argparse: --help or a usage error
        return exc.code if isinstance(exc.code, int) else 2

    _exit_on_sigterm()
    result = runner.run(opts)
    print(report.render(result), flush=True)
    if opts.json_path is not None:
        report.write_json(result, opts.json_path)
        print(f"numbers written to {opts.json_path}", file=sys.stderr)

    complete = all(s.available for s in result.targets.values()) and not any(
        o.error for row in result.outcomes.values() for o in row.values()
    )
    return 0 if complete else 1
