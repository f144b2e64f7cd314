"""Telling systemd a daemon is ready (Type=notify units): the sd_notify(3) datagram.

The protocol is one datagram of `KEY=VALUE` lines to the AF_UNIX socket named in
$NOTIFY_SOCKET (a leading `@` means the abstract namespace). It is a dozen lines; libsystemd's
Python binding would need libsystemd's headers to build, for this alone.
"""

from __future__ import annotations

import os
import socket


def notify(*fields: str) -> bool:
    """Send ``fields`` (``"READY=1"``, ``"STOPPING=1"``, ``"STATUS=..."``); False when not run
    by systemd (no $NOTIFY_SOCKET) or the socket is gone."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path or path[0] not in "/@":
        return False
    address = "\0" + path[1:] if path[0] == "@" else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall("\n".join(fields).encode())
    except OSError:
        return False
    return True
