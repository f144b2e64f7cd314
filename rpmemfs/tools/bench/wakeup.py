"""What a TCP send costs the sender when the peer thread sleeps, against when it runs.

    python -m rpmemfs.tools.bench.wakeup [--sends N]

A forked peer answers each 4.4 KB message (a 4 KiB write's barrier, sealed) with 32 bytes;
the sender times only its own CPU in send(), after a pause of 0, 200 or 1000 µs spent
busy, so that the peer has gone to sleep in recv() by the time the message comes. A send to
a sleeping peer on another CPU includes waking it (an inter-processor interrupt, which on a
VM may exit to the hypervisor); this is what each synchronous barrier pays per replica when
the target daemons share the machine (docs/benchmarks.md, "Why a synchronous barrier costs
the daemon so much here"). The last line is a send to a peer that drains a stream without
answering, so it rarely sleeps: the send alone.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

MESSAGE = 4400
GAPS_US = (0, 200, 1000)


def _peer(listener: socket.socket, answer: bool) -> None:
    # Forked: it must end in os._exit whatever happens, never return into the caller's code.
    try:
        _serve(listener, answer)
    finally:
        os._exit(0)


def _serve(listener: socket.socket, answer: bool) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        got = conn.recv(1 << 16)
        if not got:
            break
        if answer:
            conn.send(b"y" * 32)


def _connected(answer: bool) -> tuple[socket.socket, int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        _peer(listener, answer)
    listener.close()
    try:
        s = socket.create_connection(("127.0.0.1", port))
    except OSError:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s, pid


def measure(sends: int) -> list[tuple[str, float]]:
    """(case, the sender's CPU µs per send) for each pause, then for a stream."""
    buf = b"x" * MESSAGE
    out: list[tuple[str, float]] = []
    s, pid = _connected(answer=True)
    try:
        for gap in GAPS_US:
            spent = 0.0
            for _ in range(sends):
                until = time.perf_counter() + gap / 1e6
                while time.perf_counter() < until:
                    pass
                t0 = time.thread_time()
                s.send(buf)
                spent += time.thread_time() - t0
                s.recv(64)
            out.append((f"to a sleeping peer, {gap} us after its last answer", spent / sends * 1e6))
    finally:
        s.close()
        os.waitpid(pid, 0)
    s, pid = _connected(answer=False)
    try:
        t0 = time.thread_time()
        for _ in range(sends):
            s.sendall(buf)
        out.append(("in a stream the peer drains", (time.thread_time() - t0) / sends * 1e6))
    finally:
        s.close()
        os.waitpid(pid, 0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rpmemfs.tools.bench.wakeup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sends", type=int, default=3000, help="sends per case (default 3000)")
    args = p.parse_args(argv)
    for case, us in measure(args.sends):
        print(f"{us:7.1f} us of the sender's CPU per {MESSAGE}-byte send {case}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
