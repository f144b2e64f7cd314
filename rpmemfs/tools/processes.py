"""Run a target daemon as a child process and learn where it listens (for demo and tests)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Self

READY_PREFIX = "rpmemfs target listening on "


class SpawnError(RuntimeError):
    pass


class TargetProcess:
    """``python -m rpmemfs.target`` with the given options, listening on a port of its choice.

    ``prefix`` runs it through another command first (``ip netns exec NS``, say). Its log
    (stderr) goes to ``log_path``, or to a scratch file read by :meth:`log_text`.
    """

    def __init__(
        self,
        pool_dir: str | os.PathLike[str],
        *,
        listen: str = "127.0.0.1:0",
        token_file: str | os.PathLike[str] | None = None,
        persist: str | None = None,
        pmem: str | None = None,
        extra: Sequence[str] = (),
        prefix: Sequence[str] = (),
        log_level: str = "info",
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        argv = [*prefix, sys.executable, "-m", "rpmemfs.target", "--listen", listen,
                "--pool-dir", os.fspath(pool_dir), "--log-level", log_level]
        if token_file is not None:
            argv += ["--token-file", os.fspath(token_file)]
        if persist is not None:
            argv += ["--persist", persist]
        if pmem is not None:
            argv += ["--pmem", pmem]
        self.argv = [*argv, *extra]
        self._log_path = os.fspath(log_path) if log_path is not None else None
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def start(self, timeout: float = 20.0) -> str:
        """Start it and wait for its listening line; returns HOST:PORT. SpawnError if it fails."""
        if self._log_path is not None:
            self._log = open(self._log_path, "w+b")  # noqa: SIM115 - lives as long as the process
        else:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                self.kill()
                raise SpawnError(f"target did not start within {timeout:g}s\n{self.log_text()}")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                code = self.proc.wait()
                raise SpawnError(f"target exited with {code} before listening\n{self.log_text()}")
            line += chunk
        text = line.decode().strip()
        if not text.startswith(READY_PREFIX):
            self.kill()
            raise SpawnError(f"unexpected first line from the target: {text!r}")
        self.address = text[len(READY_PREFIX) :]
        return self.address

    def respawn(self, log_path: str | os.PathLike[str] | None = None) -> TargetProcess:
        """The same daemon again (options, prefix), listening where this one did; not started."""
        again = TargetProcess.__new__(TargetProcess)
        argv = list(self.argv)
        argv[argv.index("--listen") + 1] = self.address
        again.argv = argv
        again._log_path = os.fspath(log_path) if log_path is not None else None
        again._log = None
        again.proc = None
        again.address = ""
        return again

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, and SIGKILL if it has not exited within ``timeout``; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def close(self) -> None:
        self.kill()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self.close()
