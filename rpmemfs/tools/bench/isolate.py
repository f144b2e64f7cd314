"""Run one measurement in a child process with a time limit.

A filesystem under test can hang a request forever; doing the I/O in a child lets
the benchmark give up on that target, kill the child and still report the others.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TypeVar

T = TypeVar("T")


class Timeout(Exception):
    """The child did not finish in time and was killed."""


class ChildFailed(Exception):
    """The child raised; the message carries its traceback."""


def _child(conn: Connection, fn: Callable[[], T]) -> None:
    try:
        conn.send(("ok", fn()))
    except BaseException as exc:  # everything must reach the parent
        conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_isolated(fn: Callable[[], T], timeout: float) -> T:
    # fork, so closures work and the child starts in milliseconds.
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child_end, fn), daemon=True)
    proc.start()
    child_end.close()
    try:
        if not parent_end.poll(timeout):
            raise Timeout(f"no result after {timeout:.0f} s")
        try:
            status, payload = parent_end.recv()
        except EOFError:
            proc.join(5)
            raise ChildFailed(f"child died (exit code {proc.exitcode})") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        parent_end.close()
    if status != "ok":
        raise ChildFailed(payload)
    return payload  # type: ignore[no-any-return]
