"""The soak command, short: writers, killed and restarted targets, every acknowledged write
checked on the local pool and on both replicas mounted on their own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_a_short_soak_passes_with_faults_injected(work_dir: Path) -> None:
    out = work_dir / "soak.json"
    res = subprocess.run(
        [sys.executable, "-m", "rpmemfs.tools.soak", "--seconds", "10", "--writers", "2", "--kill-every", "2",
         "--dir", str(work_dir / "soak"), "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["result"] == "PASS", report
    assert report["faults"] >= 1 and report["operations"] > 0 and report["failed_fsyncs"] == 0, report
    # Three copies (local pool, two replicas) of every byte the acknowledged writes cover.
    assert report["bytes_checked"] > 0 and report["bytes_checked"] % 3 == 0, report
    assert report["replica_states"] == ["in-sync", "in-sync"], report
