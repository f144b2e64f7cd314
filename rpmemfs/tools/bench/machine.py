"""A description of the machine, so numbers from different hosts are not confused."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def describe() -> dict[str, str | int]:
    return {
        "kernel": platform.release(),
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "python": platform.python_version(),
        "pyfuse3": _version("pyfuse3"),
        "executable": sys.executable,
    }


def one_line(info: dict[str, str | int]) -> str:
    return (f"machine: Linux {info['kernel']}, CPU {info['cpu']}, {info['cores']} cores, "
            f"Python {info['python']}, pyfuse3 {info['pyfuse3']}")
