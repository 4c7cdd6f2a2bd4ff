"""Endpoint calibration (examples/migrate_suite/endpoint_calibration.py, issue 31 point 2): it fits only the end
point's own parameters, so blend 0 stays bit for bit the trained function, and it brings the end point closer to it.

On a tiny demo LM (random weights: its end point drifts), converted to pre-norm with the stream-scaled blend (no
fused kernels), scales measured as LNPlacement measures them.
"""

from __future__ import annotations

import pytest
import torch
from _helpers_examples import load_example

from ln_lightning.demo import PostNormTransformerLM
from ln_lightning.placement.migrate import transition

ec = load_example("migrate_suite/endpoint_calibration")


def _model_in_transition(seed: int = 0):
    torch.manual_seed(seed)
    model = PostNormTransformerLM(vocab_size=32, d_model=16, n_layers=3, n_heads=2, block_size=8, dropout=0.0)
    g = torch.Generator().manual_seed(seed)
    inputs = [(torch.randint(0, 32, (8, 8), generator=g),) for _ in range(3)]
    model.train()
    transition.begin(model, "pre", branch_scale="stream")
    assert transition.measure_stream_scales(model, lambda: model(*inputs[0])) is None
    return model, inputs


@pytest.mark.parametrize("per_channel, blends", [(False, (1.0,)), (True, (1.0,)), (False, (0.5, 1.0))])
def test_calibration_keeps_blend_0_and_shrinks_the_endpoint_drift(per_channel, blends):
    model, inputs = _model_in_transition()
    t = transition.active(model)
    probe = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad(), t.pinned(0.0):
        at0 = model(probe)
    with torch.no_grad(), t.pinned(1.0):
        at1 = model(probe)
    before = ec.endpoint_kl(model, inputs[:2])
    c_before = t.site_before.clone()
    spent = []
    r = ec.calibrate(model, inputs[:2], evals=10, per_channel=per_channel, blends=blends, spend=spent.append)

    assert r["applied"] and r["kl_after"] < r["kl_before"]
    if blends == (1.0,):
        assert r["kl_before"] == pytest.approx(before, rel=1e-5)  # its first evaluation is the measured end point
        assert ec.endpoint_kl(model, inputs[:2]) == pytest.approx(r["kl_after"], rel=1e-4, abs=1e-7)  # written back
    assert ec.endpoint_kl(model, inputs[:2]) < 0.9 * before
    assert not torch.equal(t.site_before, c_before)  # the scales moved
    # counted: a teacher forward per batch, then (1 + 2) per batch per evaluation
    assert sum(spent) == r["units"] == 2 * 1 + 3 * 2 * len(blends) * r["evals"] and 2 <= r["evals"] <= 10
    model.eval()
    with torch.no_grad(), t.pinned(0.0):
        assert torch.equal(model(probe), at0)  # blend 0: bit for bit the trained function
    with torch.no_grad(), t.pinned(1.0):
        assert not torch.equal(model(probe), at1)  # the end point is what changed
    if per_channel:
        assert all(s.c.shape == (16,) for s in t.sites)
    # the blend in between stays the documented form (exactly blend 1 at the end: the plain pre-norm rewrite)
    transition.set_blend(model, 1.0)
    end = model(probe)
    transition.finish(model)
    assert torch.equal(model(probe), end)


def test_calibration_refuses_before_the_scales_are_measured():
    torch.manual_seed(0)
    model = PostNormTransformerLM(vocab_size=32, d_model=16, n_layers=2, n_heads=2, block_size=8, dropout=0.0)
    transition.begin(model, "pre", branch_scale="stream")
    with pytest.raises(ec.CalibrationError, match="not measured yet"):
        ec.calibrate(model, [(torch.zeros(2, 8, dtype=torch.long),)])
