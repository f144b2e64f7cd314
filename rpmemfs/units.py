"""Sizes as people write them (64M, 4G, 1.5T, 4096), and counts as people read them (1 replica,
2 replicas)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {text!r}: use a number with an optional K, M, G or T suffix")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun, plural (``plural``, else the noun and an s) unless ``n`` is 1."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"
