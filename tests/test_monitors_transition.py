"""LayerNormInputMonitor mid-transition reports the function being computed (issue 23, point 8).

During a transition a norm normalises at its call site (weight 1 - a) and at its branch's entries (weight a).
At blend 0 the statistics must be the plugin-less model's, at blend 1 the converted model's: each compared
with a run that has no transition at all (the references don't go through the weighting).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ln_lightning import LNPlacement
from ln_lightning.callbacks import LayerNormInputMonitor
from ln_lightning.placement.migrate import transition
from ln_lightning.testing.monitors import read_scalars

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class _DistilBertLM(LightningModule):
    def __init__(self):
        super().__init__()
        from transformers import DistilBertConfig, DistilBertModel

        torch.manual_seed(0)
        cfg = DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=16,
                               dropout=0.0, attention_dropout=0.0)
        self.model = DistilBertModel(cfg)
        self.head = nn.Linear(32, 64)
        with torch.no_grad():  # trained-looking norms
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.head(self.model(input_ids=x).last_hidden_state)

    def training_step(self, b, i):
        x, y = b
        return nn.functional.cross_entropy(self(x).reshape(-1, 64), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 16), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=4)


class _SetBlend(Callback):
    def __init__(self, a):
        self.a = a

    def on_train_batch_start(self, trainer, pl_module, b, i):
        transition.set_blend(pl_module, self.a)


def _ln_stats(tmp_path, name, plugin, extra=()):
    t = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=TensorBoardLogger(str(tmp_path), name=name, version=""),
                log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                plugins=[plugin] if plugin else None, callbacks=[*extra, LayerNormInputMonitor(every_n_steps=1)])
    t.fit(_DistilBertLM(), train_dataloaders=_loader())
    return {k: v[0][1] for k, v in read_scalars(tmp_path / name).items() if k.startswith("ln/")}


def test_layernorm_monitor_reports_the_function_being_computed_mid_transition(tmp_path):
    plain = _ln_stats(tmp_path, "plain", None)
    converted = _ln_stats(tmp_path, "converted", LNPlacement("pre", fused=False, log_report=False))
    at0 = _ln_stats(tmp_path, "at0", LNPlacement("pre", transition_steps=4, fused=False, log_report=False))
    at1 = _ln_stats(tmp_path, "at1", LNPlacement("pre", transition_steps=4, fused=False, log_report=False), [_SetBlend(1.0)])
    assert plain and converted and set(plain) != set(converted)  # the converted model has its final norm too
    # Blend 0: the plugin-less run's statistics, the added final norm (weight 0) not reported.
    assert set(at0) == set(plain)
    for k, v in plain.items():
        assert at0[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    # Blend 1: the converted model's.
    assert set(at1) == set(converted)
    for k, v in converted.items():
        assert at1[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    var_means = [k for k in plain if k.startswith("ln/var_mean/")]
    assert any(abs(plain[k] - converted[k]) > 1e-3 * abs(plain[k]) for k in var_means)  # the two ends differ
