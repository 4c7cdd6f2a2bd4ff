"""SpikeMonitor on clean runs of the demo LM (`CharLM` on the standard-library corpus, 300 steps, two seeds, default
rules: 6 sigma over 128 steps, 10x the running maximum): every record is one the rule defines, and the rule flags
nothing the monitor missed. The per-step losses and gradient norms are recorded by hand (the loss Lightning
backpropagates; the 2-norm of every gradient before clipping) and judged by the rule written out in Python.

`python tests/test_spike_clean_runs.py` prints each seed's records (the figures the monitors guide quotes).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import lightning as L
import pytest
import torch

from ln_lightning.callbacks import SpikeMonitor
from ln_lightning.demo.lightning import CharDataModule, CharLM
from test_spike_monitor import _by_hand, read_records

STEPS = 300


class _Recorder(L.Callback):
    def __init__(self):
        self.loss: list[float] = []
        self.grad: list[float] = []

    def on_before_backward(self, trainer, pl_module, loss):
        self.loss.append(float(loss))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grad.append(math.sqrt(sum(float(p.grad.float().norm()) ** 2 for p in pl_module.parameters() if p.grad is not None)))


def clean_run(seed: int, out: str) -> tuple[list[dict], _Recorder]:
    L.seed_everything(seed, verbose=False)
    model = CharLM(d_model=64, n_layers=3, n_heads=4, block_size=64)
    data = CharDataModule(block_size=64, batch_size=16, max_chars=200_000)
    recorder = _Recorder()
    from lightning.pytorch.loggers import TensorBoardLogger

    L.Trainer(accelerator="cpu", max_steps=STEPS, log_every_n_steps=50, gradient_clip_val=1.0, limit_val_batches=0,
              logger=TensorBoardLogger(out, name=f"seed{seed}", version=0), enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False,
              callbacks=[recorder, SpikeMonitor(top_groups=3)]).fit(model, data)
    return read_records(Path(out) / f"seed{seed}" / "version_0"), recorder


def _expected(recorder: _Recorder) -> set[tuple[int, str]]:
    out = set()
    for kind, series in (("loss", recorder.loss), ("grad_norm", recorder.grad)):
        for step, flags in enumerate(_by_hand(series, window=128, sigma=6.0, ratio=10.0, warmup=64)):
            if flags:
                out.add((step, kind))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_every_record_of_a_clean_run_is_one_the_rule_defines(tmp_path, seed):
    records, recorder = clean_run(seed, str(tmp_path))
    assert len(recorder.loss) == len(recorder.grad) == STEPS
    assert {(r["step"], r["kind"]) for r in records} == _expected(recorder)
    for r in records:  # and each says why: its value passed its threshold
        assert r["value"] > r["threshold"], r


if __name__ == "__main__":
    torch.set_num_threads(1)
    for seed in (0, 1):
        recs, rec = clean_run(seed, tempfile.mkdtemp())
        print(json.dumps({"seed": seed, "steps": STEPS, "records": [{k: r[k] for k in ("step", "kind", "rule", "value", "baseline",
              "threshold")} for r in recs], "expected_by_hand": sorted(_expected(rec))}))
    sys.stdout.flush()
