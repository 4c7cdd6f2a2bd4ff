"""The GPU check scripts run only when a session is lent a GPU (15 minutes, all tries included),
so a typo or a renamed helper there would waste that time. Their CPU dry runs run here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, **env):
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_gpu_norm_check_smoke(tmp_path):
    # Same flow as on the GPU (compile check, Triton numerics, determinism, row independence) on
    # CPU under the Triton interpreter with tiny shapes; the timing part needs CUDA and is skipped.
    out = tmp_path / "smoke.json"
    stdout = _run(["benchmarks/gpu_norm_check.py", "--smoke", "--out", str(out)], TRITON_INTERPRET="1")
    assert "[FAIL]" not in stdout
    record = json.loads(out.read_text())
    assert len(record["checks"]) >= 4 and all(c["pass"] for c in record["checks"].values()), record["checks"]
    assert not record["errors"], record["errors"]


@pytest.mark.slow
def test_gpu_plugin_check_cpu_dry_run(tmp_path):
    stdout = _run(["benchmarks/gpu_plugin_check.py", "--cpu-dry-run", str(tmp_path)])
    summary = json.loads(stdout[stdout.rindex("{"):])
    assert summary["failed"] == 0 and summary["checks"] > 0, summary


def test_gpu_monitors_check_imports():
    # Lightning's FSDPStrategy refuses CPU, so this script has no dry run: at least every helper it
    # imports must still exist.
    spec = importlib.util.spec_from_file_location("gpu_monitors_check", ROOT / "benchmarks" / "gpu_monitors_check.py")
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)  # as `python benchmarks/gpu_monitors_check.py` would import it
    finally:
        sys.path[:] = path  # the script puts the repository root first
    assert set(module.CHECKS) == {"fsdp1", "cuda_syncs"}
