"""SpikeMonitor across processes: ddp_spawn x2 with the injected gradient spike on rank 1's batch gives the same
records (step, kind, rule, groups in order, blocks; values to float tolerance) as one process on both ranks' batches.

Run as a script (Lightning's ddp_spawn launcher spawns it): `python tests/test_spike_monitor_distributed.py OUT`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SPIKE_STEP, N_STEPS, WINDOW = 30, 40, 16


def _fit(out: str, name: str, devices: int) -> None:
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from ln_lightning.callbacks import SpikeMonitor
    from ln_lightning.testing.dist import DestroyProcessGroupAtExit
    from test_spike_monitor import SpikeLM, make_batches

    x, y = make_batches(N_STEPS, 2)
    # Two processes: rank r trains on half r (rank 1 holds the spike). One process: on both halves, the mean loss.
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, spike_half=1, spike_block=1, per_rank=devices > 1)
    strategy = "ddp_spawn" if devices > 1 else "auto"
    L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, log_every_n_steps=10,
              logger=TensorBoardLogger(out, name=name, version=0), enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, use_distributed_sampler=False,
              callbacks=[SpikeMonitor(window=WINDOW, top_groups=None), DestroyProcessGroupAtExit()]).fit(module)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "version_0" / "ln_spikes.jsonl").read_text().splitlines()]


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(u, v) for u, v in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.slow
def test_ddp_spawn_records_equal_one_process_on_the_concatenated_batches(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    one, two = _records(tmp_path / "one"), _records(tmp_path / "ddp")
    assert [(r["step"], r["kind"]) for r in one] == [(r["step"], r["kind"]) for r in two]
    grad = [r for r in two if r["kind"] == "grad_norm"]
    assert grad[0]["step"] == SPIKE_STEP and grad[0]["top_groups"][0][0] == "model.blocks.1"
    assert min(r["step"] for r in two) == SPIKE_STEP
    for a, b in zip(one, two):  # every field; numbers to float tolerance (an all-reduce sums in another order)
        assert [g for g, _ in a["top_groups"]] == [g for g, _ in b["top_groups"]]
        assert _close(a, b), (a, b)


if __name__ == "__main__":
    out_dir = sys.argv[1]
    _fit(out_dir, "one", 1)
    _fit(out_dir, "ddp", 2)
