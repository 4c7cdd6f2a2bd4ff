"""LayerNormInputMonitor on RMSNorm models: ms_* statistics and amp_max with each module's own eps,
read back from the event files and compared with an independent float64 recomputation
(tests/_helpers_monitors_rms.py). One process here; ddp_spawn x2 (slow) below."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers_monitors_rms import FixedBatchRMSLM, make_rms_model, reference_norm_stats  # noqa: E402
from ln_lightning.testing.monitors import compare, concat_batches, make_data, make_trainer, read_scalars  # noqa: E402

from ln_lightning.callbacks import LayerNormInputMonitor  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
HELPER = Path(__file__).parent / "_helpers_monitors_rms.py"


def _expected_tags(expected):
    rms = [t for t in expected if t.startswith("ln/ms_min/")]
    var = [t for t in expected if t.startswith("ln/var_min/")]
    return rms, var


def test_rmsnorm_monitor_values_equal_independent_float64_recomputation(tmp_path):
    x, y = make_data(world=1, accum=1)
    trainer = make_trainer(str(tmp_path), "rms", accelerator="cpu", devices=1, max_steps=4,
                       callbacks=[LayerNormInputMonitor(every_n_steps=2)])
    trainer.fit(FixedBatchRMSLM(x, y))
    logged = read_scalars(tmp_path / "rms")
    expected = reference_norm_stats(make_rms_model(), concat_batches(x))
    rms, var = _expected_tags(expected)
    # every LlamaRMSNorm (2 per layer + final) and the nn.RMSNorm; the LayerNorm keeps var_*
    assert len(rms) == 2 * 2 + 1 + 1 and var == ["ln/var_min/model.ln"], (rms, var)
    assert compare(logged, expected, rtol=1e-4, steps=[1, 3]) == []


def test_amp_max_uses_the_modules_own_eps(tmp_path):
    # Rows of mean square ~ eps: amp_max depends on eps at first order, so a wrong eps fails.
    x, y = make_data(world=1, accum=1)
    module = FixedBatchRMSLM(x, y)
    with torch.no_grad():
        module.model.llama.embed_tokens.weight.mul_(1e-3)
    trainer = make_trainer(str(tmp_path), "eps", accelerator="cpu", devices=1, max_steps=2,
                       callbacks=[LayerNormInputMonitor(every_n_steps=1, warn_amp_fraction=None)])
    trainer.fit(module)
    logged = read_scalars(tmp_path / "eps")
    model = make_rms_model()
    with torch.no_grad():
        model.llama.embed_tokens.weight.mul_(1e-3)
    expected = reference_norm_stats(model, concat_batches(x))
    # The test is sensitive to eps: with another eps (nn.RMSNorm's default, float32's machine
    # epsilon) this norm's amp_max would be off by far more than the 1e-4 tolerance.
    ms = expected["ln/ms_min/model.llama.layers.0.input_layernorm"]
    amp = expected["ln/amp_max/model.llama.layers.0.input_layernorm"]
    wrong = 1.0 / (ms + torch.finfo(torch.float32).eps) ** 0.5
    assert abs(wrong - amp) / amp > 1e-2, (ms, amp, wrong)
    assert compare(logged, expected, rtol=1e-4) == []


@pytest.mark.slow
def test_rmsnorm_monitor_ddp_spawn_equals_single_process_on_concatenated_batches(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(HELPER), "ddp", str(tmp_path)], capture_output=True, text=True,
                          timeout=400, env=env)
    assert proc.returncode == 0 and (tmp_path / "ddp.done").exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    x, _ = make_data(world=2, accum=1)
    expected = reference_norm_stats(make_rms_model(), concat_batches(x))
    assert compare(read_scalars(tmp_path / "ddp_rms"), expected, rtol=1e-4, steps=[1, 3]) == []


def test_modules_named_like_norms_but_not_recognised_are_named_in_a_warning(tmp_path):
    from torch import nn

    class OddRMSNorm(nn.Module):  # named like a norm, computes something else
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight

    x, y = make_data(world=1, accum=1)
    module = FixedBatchRMSLM(x, y)
    module.model.odd = OddRMSNorm()
    monitor = LayerNormInputMonitor(every_n_steps=1)
    with pytest.warns(UserWarning, match=r"model\.odd \(.*OddRMSNorm is not a recognised norm"):
        monitor._register(module)
    assert "model.odd" not in monitor.norm_paths and len(monitor.norm_paths) == 7
