"""The ahead-of-time compile check of the Triton kernels (benchmarks/triton_aot.py).

Each test runs the script in a subprocess, as CI does: it needs ``TRITON_INTERPRET`` unset when
triton is imported, while other test modules set it in this process. Measured on the project's
2-core machine (shared): the CI subset (LayerNorm and RMSNorm, 360 binaries, sm_80/sm_90/sm_100)
85 s, this file without ``slow`` 2 min 1 s; the full sweep (``slow``, sm_80/sm_90: 3126 LayerNorm
binaries, about 20 minutes, and about 3550 RMSNorm ones, 13 minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ln_lightning.norm import _backend

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "triton_aot.py"

pytestmark = [pytest.mark.skipif(not _backend.TRITON_INSTALLED, reason="triton is not installed"), pytest.mark.slow]


def run_aot(*args: str, timeout: int, tmp_path: Path, interpret: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # the script must ignore it (it compiles, never interprets)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return proc, (json.loads(out.read_text()) if out.exists() else {})


def dispatch_buckets() -> dict[str, set[tuple]]:
    """The launch configs the runtime dispatch picks for widths 1..65536, asked in a fresh process
    (importing triton here would pre-empt the interpreter tests' TRITON_INTERPRET)."""
    code = (
        "import json; from dataclasses import astuple\n"
        "from ln_lightning.norm import _triton_ops as o, _triton_rms as r\n"
        "print(json.dumps({k: sorted({astuple(f(n)) for n in range(1, 65537)}) for k, f in "
        "(('layer_norm_fwd', o.forward_launch_config), ('layer_norm_bwd', o.backward_launch_config),"
        " ('rms_norm_fwd', r.forward_launch_config), ('rms_norm_bwd', r.backward_launch_config))}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True)
    return {k: {tuple(c) for c in v} for k, v in json.loads(proc.stdout).items()}


def compiled_buckets(results: list[dict], target: str) -> dict[str, set[tuple]]:
    found: dict[str, set[tuple]] = {}
    for r in results:
        if r["target"] == target:
            c = r["launch_config"]
            found.setdefault(r["kernel"], set()).add((c["block_n"], c["single_block"], c["num_warps"], c["num_stages"]))
    return found


def assert_clean_sweep(proc, record, targets) -> None:
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    results = record["results"]
    assert {r["target"] for r in results} == set(targets)
    bad = [r for r in results if r["problems"] or r["regs"] is None]
    assert not bad, bad[:5]
    assert all(r["spill_stores"] == 0 and r["stack"] == 0 and r["local"] == 0 for r in results)
    assert all(r["occupancy"] > 0 for r in results)
    expected = dispatch_buckets()
    for target in targets:  # every bucket the dispatch can choose was compiled, nothing more
        assert compiled_buckets(results, target) == expected, target
    assert "roofline" in proc.stdout and "16384x4096" in proc.stdout


def test_ci_subset_compiles_every_bucket_without_spills(tmp_path):
    proc, record = run_aot(timeout=600, tmp_path=tmp_path)
    assert_clean_sweep(proc, record, ["sm_80", "sm_90", "sm_100"])
    for kernel in ("layer_norm_fwd", "layer_norm_bwd", "rms_norm_fwd", "rms_norm_bwd"):
        dtypes = {r["variant"].split()[0] for r in record["results"] if r["kernel"] == kernel}
        assert dtypes == {"fp32", "fp16", "bf16"}, kernel
    print(f"CI subset: {len(record['results'])} binaries in {record['wall_s']:.0f} s")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LN_LIGHTNING_AOT_FULL") != "1",
                    reason="the full sweep takes about 20 minutes: run it with LN_LIGHTNING_AOT_FULL=1 (CI runs the subset)")
def test_full_sweep_compiles_every_launch_without_spills(tmp_path):
    proc, record = run_aot("--subset", "full", timeout=3600, tmp_path=tmp_path)
    assert_clean_sweep(proc, record, ["sm_80", "sm_90"])
    variants = {r["variant"] for r in record["results"]}
    for needed in ("bf16 add+res_fp32 w+b", "bf16 add+res_fp32(first) w", "fp16 ln+res_fp32 none", "bf16 add w+b autocast",
                   "fp32 add b frozen", "bf16 add w+b [unaligned width]", "bf16 add w+b [rows_per_program=1]",
                   "bf16 add w offset", "fp32 add w(other) t5", "fp16 add+res_fp32 w(fp32) llama", "bf16 ln none",
                   "bf16 add w llama [unaligned width]", "fp16 add w llama [rows_per_program=16]", "bf16 add w t5 frozen"):
        assert needed in variants, needed
    print(f"full sweep: {len(record['results'])} binaries in {record['wall_s']:.0f} s")


def test_a_row_bucket_past_the_register_budget_fails_the_check(tmp_path):
    # Rows up to 32768 held in registers: 64 float32 values per thread per row-sized tensor at
    # 16 warps, far past the 128 registers a 512-thread block may use, so ptxas spills.
    proc, record = run_aot("--set", "MAX_SINGLE_BLOCK=32768", "--targets", "90", "--kernels", "layer_norm_fwd",
                           "--dtypes", "bf16", "--widths", "16385", "65536", timeout=300, tmp_path=tmp_path, interpret=True)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    failed = [r for r in record["results"] if r["problems"]]
    assert [r["launch_config"]["block_n"] for r in failed] == [32768]
    assert failed[0]["spill_stores"] > 0 and failed[0]["regs"] <= 128
    assert "FAILED layer_norm_fwd sm_90 row block 32768, 16 warps" in proc.stdout
    # the loop kernel that still serves 65536 compiled cleanly and is reported too
    assert any(not r["problems"] and not r["launch_config"]["single_block"] for r in record["results"])


@pytest.mark.parametrize(
    "setting, reason",
    [("FWD_NUM_WARPS=3", "launch rejected: AssertionError: num_warps must be a power of 2"),
     ("FWD_NUM_WARPS=64", "cannot launch: 0 blocks per SM (limited by threads per block)")],
)
def test_a_launch_the_target_cannot_take_is_reported_not_dropped(tmp_path, setting, reason):
    proc, record = run_aot("--set", setting, "--targets", "80", "--kernels", "layer_norm_fwd", "--dtypes", "bf16",
                           "--widths", "4096", "4096", timeout=300, tmp_path=tmp_path)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert [r["problems"] for r in record["results"]] == [[reason]]
    assert reason in proc.stdout


def test_unknown_tunable_is_a_usage_error(tmp_path):
    proc, _ = run_aot("--set", "NUM_WARPZ=4", timeout=120, tmp_path=tmp_path)
    assert proc.returncode == 2 and "--set takes NAME=VALUE" in proc.stderr
