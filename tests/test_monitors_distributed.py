"""Monitors across processes: ddp_spawn (fp32; bf16 autocast with gradient accumulation) and FSDP2.

Each run is a real script (`python -m ln_lightning.testing.monitors`) because Lightning's launchers spawn or re-run
it. The logged values are compared with single-process references on all ranks' batches concatenated.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ln_lightning.testing.monitors import (
    GROUPS,
    compare,
    concat_batches,
    make_data,
    make_model,
    read_scalars,
    reference_forward_stats,
    reference_grad_stats,
)

HELPER = "ln_lightning.testing.monitors"
pytestmark = pytest.mark.slow


def _run(mode: str, out: Path, timeout: int = 400) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", HELPER, mode, str(out)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0 and (out / f"{mode}.done").exists(), proc.stdout[-3000:] + proc.stderr[-6000:]


def _assert_in_run_total_matches(logged) -> None:
    """clip/total_norm equals what clip_grad_norm_ returned on the same run's distributed gradients."""
    ref = dict(logged["ref/clip_grad_norm"])
    assert logged["clip/total_norm"], "no clip/total_norm logged"
    for step, value in logged["clip/total_norm"]:
        assert math.isclose(value, ref[step], rel_tol=1e-4), (step, value, ref[step])


def test_ddp_spawn_equals_single_process_on_concatenated_batches(tmp_path):
    _run("ddp", tmp_path)
    model = make_model()

    # fp32, no accumulation, norm clipping configured: every metric, including coef/fired/dominant
    x, y = make_data(world=2, accum=1)
    logged = read_scalars(tmp_path / "ddp_fp32")
    expected = reference_forward_stats(model, concat_batches(x))
    expected.update(reference_grad_stats(model, concat_batches(x), concat_batches(y), clip_val=0.05))
    assert compare(logged, expected, rtol=1e-4, steps=[1, 3]) == []
    _assert_in_run_total_matches(logged)
    # Per logging step (1 and 3) and rank: one SUM all-reduce per monitor, one MAX for the LayerNorm and clip
    # monitors (the stream monitor has no MAX state), one host copy each, all at the step's end (in callback
    # order: stream, LayerNorm, clip).
    for rank in (0, 1):
        counted = json.loads((tmp_path / f"reductions_rank{rank}.json").read_text())
        per_step = [["sum"], ["sum", "max"], ["sum", "max"]]
        assert counted["all_reduces"] == [[s, op] for s in (1, 3) for ops in per_step for op in ops], counted
        assert counted["host_copies"] == 3 * 2
    # rank 0's batch alone gives different statistics: the reduction across ranks is what makes them match
    rank0 = reference_forward_stats(model, concat_batches(x[:1]))
    for tag in ("ln/var_mean/model.blocks.0.ln1", "stream/update_ratio/model.blocks.0"):
        assert compare(logged, {tag: rank0[tag]}, exact_tags=False) != [], tag

    # bf16 autocast + accumulate_grad_batches=2: 4 micro-batches (2 ranks x 2) per logged step
    x, y = make_data(world=2, accum=2)
    logged = read_scalars(tmp_path / "ddp_bf16_accum")
    forward = reference_forward_stats(model, concat_batches(x), autocast=torch.bfloat16)
    assert compare(logged, forward, rtol=1e-4, steps=[1, 3], exact_tags=False) == []
    _assert_in_run_total_matches(logged)
    # Shares: bf16 weight-gradient matmuls round per rank and micro-batch, so the concatenated
    # reference differs at bf16 precision (measured ~1.5e-4); 1e-3 is still far below any real error.
    grads = reference_grad_stats(model, concat_batches(x), concat_batches(y), autocast=torch.bfloat16)
    shares = {f"clip/share/{g}": grads[f"clip/share/{g}"] for g in GROUPS}
    assert compare(logged, shares, rtol=1e-3, steps=[1, 3], exact_tags=False) == []
    assert {t for t in logged if t.startswith("clip/")} == {"clip/total_norm", "clip/nonfinite_steps", *shares}


def test_fsdp2_sharded_gradients_equal_unsharded_values(tmp_path):
    _run("fsdp2", tmp_path)
    logged = read_scalars(tmp_path / "fsdp2")
    assert {v for _, v in logged["ref/grads_are_dtensors"]} == {1.0}, "gradients were not sharded DTensors"
    model = make_model()
    x, y = make_data(world=2, accum=1)
    expected = reference_forward_stats(model, concat_batches(x))
    expected.update(reference_grad_stats(model, concat_batches(x), concat_batches(y)))
    assert compare(logged, expected, rtol=1e-4, steps=[1, 3]) == []
    _assert_in_run_total_matches(logged)
