"""Converted torch Transformer layers use the fused add + LayerNorm when their norms are fused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ln_lightning import convert
from ln_lightning.norm import FusedLayerNorm, swap_layernorms
from ln_lightning.placement.rewrite import fused_layers


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_fused_prenorm_layers_match_torch_norm_first_with_gradients(kind, monkeypatch):
    torch.manual_seed(0)
    d = 32
    if kind == "encoder":
        make = lambda nf: nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=nf), 2, enable_nested_tensor=False)  # noqa: E731
        inputs = (torch.randn(2, 6, d),)
        kw = {"mask": nn.Transformer.generate_square_subsequent_mask(6)}
    else:
        make = lambda nf: nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=nf), 2)  # noqa: E731
        inputs = (torch.randn(2, 6, d), torch.randn(2, 4, d))
        kw = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(6)}
    model = make(False)
    swap = swap_layernorms(model)
    assert swap.swapped and all(isinstance(l.norm2, FusedLayerNorm) for l in model.layers)
    convert(model, "pre", final_norm=False)
    assert all(type(l) in fused_layers.PLAIN_CLASS for l in model.layers)
    ref = make(True)
    ref.load_state_dict(model.state_dict(), strict=True)

    calls = []
    real = fused_layers._add_norm
    monkeypatch.setattr(fused_layers, "_add_norm", lambda *a: calls.append(1) or real(*a))
    x = [t.clone().requires_grad_() for t in inputs]
    xr = [t.clone().requires_grad_() for t in inputs]
    y, yr = model(*x, **kw), ref(*xr, **kw)
    assert len(calls) == (2 if kind == "encoder" else 4)  # the fused path really ran
    torch.testing.assert_close(y, yr, atol=1e-5, rtol=1e-5)
    y.square().sum().backward()
    yr.square().sum().backward()
    for a, b in zip(x, xr):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
    refp = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, refp[name].grad, atol=1e-4, rtol=1e-4, msg=name)
    convert(model, "post")
    assert all(type(l) in fused_layers.FUSED_CLASS for l in model.layers)


def test_a_hook_on_the_norm_switches_fusion_off_so_monitors_see_its_input(monkeypatch):
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1, enable_nested_tensor=False)
    swap_layernorms(model)
    convert(model, "pre", final_norm=False)
    seen = []
    model.layers[0].norm2.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    calls = []
    monkeypatch.setattr(fused_layers, "_add_norm", lambda *a: calls.append(1))
    model(torch.randn(2, 3, 16))
    assert calls == [] and len(seen) == 1
