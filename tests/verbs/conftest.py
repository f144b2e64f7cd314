"""The verbs tier (run in the VM by scripts/test-verbs.sh): the end-to-end tier's helpers
(tests/e2e/helpers.py, for the mount test) importable, and its garbage collection per test."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from helpers import collect_garbage_in_vm  # noqa: E402, F401  (an autouse fixture in the VM)
