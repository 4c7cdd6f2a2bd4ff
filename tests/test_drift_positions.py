"""The drift-positions diagnostic (examples/migrate_suite/drift_positions.py, issue 31): the KL over the loss's
positions is the KL over every position where the loss counts them all, and over the masked ones for a masked LM;
at blend 0 both are 0 exactly (the trained function), on tiny untrained suite models with trained-looking norms."""

from __future__ import annotations

import pytest
import torch
from _helpers_examples import load_example
from torch import nn

dp = load_example("migrate_suite/drift_positions")
sm = dp.sm


def _model(name: str):
    m = sm.SUITE[name]
    hp = m.hp(True)
    torch.manual_seed(0)
    module = m.build(hp)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norm gains away from 1, so the end point computes something else
        for mod in module.modules():
            if isinstance(mod, nn.LayerNorm) and mod.weight is not None:
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=g))
        for p in module.parameters():
            if p.dim() == 2:
                p.mul_(3.0)  # sharper logits than at init
    return module, sm.eval_batches(m, hp)


@pytest.mark.parametrize("name, masked", [("charlm", False), ("bert_mlm", True)])
def test_kl_over_the_loss_positions(name, masked):
    module, batches = _model(name)
    at0, at1 = dp.measure(module, batches, blends=(0.0, 1.0))
    assert at0["kl_all"] == 0.0 and at0["kl_loss_positions"] == 0.0 and at0["heldout_rise"] == 0.0
    assert at1["kl_all"] > 1e-4
    if masked:
        assert 0.05 < at1["loss_share"] < 0.4 and at1["kl_loss_positions"] != at1["kl_all"]
    else:
        assert at1["loss_share"] == 1.0 and at1["kl_loss_positions"] == pytest.approx(at1["kl_all"], rel=1e-9)

