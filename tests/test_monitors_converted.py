"""The monitors on a model that LNPlacement converted to pre-norm (deferred norms, an added final norm).

The reference is the pre-norm forward written out by hand in float64 from the converted model's own
weights: each LayerNorm reads the stream it normalises (not the sum at the user's call site), and the
last block's stream is measured before the final norm that convert applies after it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from ln_lightning.testing.monitors import (  # noqa: E402
    BLOCKS, NORMS, FixedBatchLM, compare, concat_batches, make_data, make_trainer, read_scalars,
)

from ln_lightning import LNPlacement  # noqa: E402
from ln_lightning.callbacks import LayerNormInputMonitor, StreamNormMonitor  # noqa: E402
from ln_lightning.placement import bypass  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _prenorm_reference(model, x):
    model = copy.deepcopy(model).double()
    out = {}

    def ln(norm, t, name):
        v = t.var(dim=-1, unbiased=False)
        out[f"ln/var_mean/{name}"] = v.mean().item()
        out[f"ln/var_min/{name}"] = v.min().item()
        out[f"ln/amp_max/{name}"] = (1.0 / torch.sqrt(v + norm.eps)).max().item()
        return F.layer_norm(t, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

    with torch.no_grad(), bypass():  # bypass: the submodules without ln_lightning's hooks
        h = model.tok_emb(x) + model.pos_emb(torch.arange(x.shape[1]))
        for i, block in enumerate(model.blocks):
            a = h + block.attn(ln(block.ln1, h, f"model.blocks.{i}.ln1"))
            y = a + block.mlp(ln(block.ln2, a, f"model.blocks.{i}.ln2"))
            out[f"stream/rms/model.blocks.{i}"] = y.square().mean().sqrt().item()
            out[f"stream/update_ratio/model.blocks.{i}"] = ((y - h).square().mean().sqrt() / h.square().mean().sqrt()).item()
            h = y
        ln(model.blocks_final_norm, h, "model.blocks_final_norm")
    out["stream/nonfinite_count"] = 0.0
    out["ln/nonfinite_count"] = 0.0
    return out


def test_monitors_measure_the_converted_prenorm_model(tmp_path):
    x, y = make_data(world=1, accum=1)
    module = FixedBatchLM(x, y)
    trainer = make_trainer(str(tmp_path), "converted", accelerator="cpu", devices=1, max_steps=2, log_every_n_steps=1,
                       plugins=[LNPlacement("pre", fused=False)],
                       callbacks=[StreamNormMonitor(every_n_steps=1), LayerNormInputMonitor(every_n_steps=1)])
    trainer.fit(module)
    assert hasattr(module.model, "blocks_final_norm")
    expected = _prenorm_reference(module.model, concat_batches(x))
    assert len(expected) == 2 * len(BLOCKS) + 3 * (len(NORMS) + 1) + 2
    logged = read_scalars(tmp_path / "converted")
    assert compare(logged, expected, rtol=1e-4, steps=[0, 1]) == []
