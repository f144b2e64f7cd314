"""HOST:PORT as people write it (``node2:7420``, ``127.0.0.1:0``, ``[::1]:7420``)."""

from __future__ import annotations


def parse_address(text: str, default_port: int | None = None) -> tuple[str, int]:
    """(host, port) from ``text``; ValueError with the reason when it is not one."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad address {text!r}: expected [IPV6]:PORT")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    elif ":" not in text:
        host, port_text = text, ""
    else:
        raise ValueError(f"bad address {text!r}: write an IPv6 address as [ADDR]:PORT")
    if not host:
        raise ValueError(f"bad address {text!r}: no host")
    if not port_text:
        if default_port is None:
            raise ValueError(f"bad address {text!r}: no port (use HOST:PORT)")
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"bad address {text!r}: port must be a number from 0 to 65535")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
