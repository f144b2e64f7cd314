"""Text from a peer, made fit to print: control characters escaped as ``repr`` escapes them.

What an initiator says about itself (the holder of a claim: host, pool, mountpoint, command)
and what a target answers are strings another machine chose. Written raw, a newline in one
forges a log line of its own, and an escape sequence (ESC, CSI) reaches an administrator's
terminal through `rpmemfs pools` or a log viewer. ``printable`` keeps such text on one line
and inert: every character Python does not call printable (C0 and C1 controls, DEL, line and
paragraph separators, format characters such as bidi overrides, lone surrogates) becomes
``\\n``, ``\\r``, ``\\t`` or ``\\xNN``/``\\uNNNN``/``\\UNNNNNNNN``. Backslashes are left as
they are: a peer that writes ``\\n`` as two characters only gets those two characters shown,
still on one line, and messages that quote a ``repr`` are not escaped twice.
"""

from __future__ import annotations

_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped (see the module's text)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)
