"""The RMSNorm GPU check script runs only when a session is lent a GPU; its CPU dry run runs here
(same flow under the Triton interpreter, tiny shapes, timing skipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_rms_check_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_rms_check.py", "--smoke", "--out", str(out)], cwd=ROOT,
        capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"}, check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    record = json.loads(out.read_text())
    assert len(record["checks"]) >= 8 and all(c["pass"] for c in record["checks"].values()), record["checks"]
    assert not record["errors"], record["errors"]
