"""Both norms' modules, parametrised over the kind (LayerNorm, RMSNorm): drop-in for the torch class
(signature, state_dict both ways, results against float64), the fused-add module, and a swap after
`convert` keeping the conversion. Numerics of each backend path: test_norm_numerics.py."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Callable, Optional

import pytest
import torch
from torch import nn

from ln_lightning.norm import FusedAddLayerNorm, FusedAddRMSNorm, FusedLayerNorm, FusedRMSNorm, swap_layernorms
from ln_lightning.testing.norm import layer_norm_formula, rel_err, rms_norm_formula


def _rms_formula(h, shape, weight=None, bias=None, eps=1e-5):
    # layer_norm_formula's signature (`bias` is always None for an RMSNorm)
    return rms_norm_formula(h, shape, weight, eps)


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    torch_class: type
    fused: type
    fused_add: type
    formula: Callable
    variants: tuple  # constructor kwargs each drop-in check covers

    def params(self, module: nn.Module) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        as64 = lambda p: None if p is None else p.detach().double()
        return as64(module.weight), as64(getattr(module, "bias", None))


KINDS = [
    Kind("ln", nn.LayerNorm, FusedLayerNorm, FusedAddLayerNorm, layer_norm_formula,
         ({}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-3, "dtype": torch.float64})),
    Kind("rms", nn.RMSNorm, FusedRMSNorm, FusedAddRMSNorm, _rms_formula,
         ({"eps": 1e-6}, {"eps": 1e-6, "elementwise_affine": False}, {"eps": 1e-3, "dtype": torch.float64})),
]
kinds = pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)


@kinds
def test_drop_in_for_the_torch_class_in_signature_state_and_results(kind):
    assert inspect.signature(kind.fused.__init__) == inspect.signature(kind.torch_class.__init__)
    for kwargs in kind.variants:
        ref, fused = kind.torch_class(16, **kwargs), kind.fused(16, **kwargs)
        assert list(fused.state_dict()) == list(ref.state_dict())
        assert [n for n, _ in fused.named_parameters()] == [n for n, _ in ref.named_parameters()]
        for p in ref.parameters():
            nn.init.normal_(p)
        fused.load_state_dict(ref.state_dict(), strict=True)
        assert all(torch.equal(fused.state_dict()[k], v) for k, v in ref.state_dict().items())
        x = torch.randn(4, 16, dtype=kwargs.get("dtype", torch.float32))
        # the loaded values are the ones it computes with, against the float64 formula
        assert rel_err(fused(x), kind.formula(x.double(), (16,), *kind.params(ref), fused.eps)) < 1e-5
        back = kind.torch_class(16, **kwargs)
        back.load_state_dict(fused.state_dict(), strict=True)
        assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())
    # against the torch module itself, at float32 and bfloat16 (same output dtype)
    torch.manual_seed(0)
    ref = kind.torch_class(48, **kind.variants[0])
    for p in ref.parameters():
        nn.init.normal_(p)
    fused = kind.fused(48, **kind.variants[0])
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 48)
    for dtype in (torch.float32, torch.bfloat16):
        r_, f_ = copy.deepcopy(ref).to(dtype), copy.deepcopy(fused).to(dtype)
        y_ref, y = r_(x.to(dtype)), f_(x.to(dtype))
        assert y.dtype == y_ref.dtype == dtype
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(y, y_ref, **tol)
    add = kind.fused_add(16)
    assert list(add.state_dict()) == list(kind.torch_class(16).state_dict())
    kind.torch_class(16).load_state_dict(add.state_dict(), strict=True)


def test_rmsnorm_eps_none_is_the_dtypes_machine_epsilon_as_nn_rmsnorm():
    ref, fused = nn.RMSNorm(8, elementwise_affine=False), FusedRMSNorm(8, elementwise_affine=False)
    tiny = torch.full((2, 8), 1e-5)
    torch.testing.assert_close(fused(tiny), ref(tiny))


@kinds
def test_fused_add_module_residual_in_fp32_and_none_residual(kind):
    norm = kind.fused_add(12, residual_in_fp32=True)
    x, r = torch.randn(3, 12, dtype=torch.bfloat16), torch.randn(3, 12, dtype=torch.bfloat16)
    y, h = norm(x, r)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    torch.testing.assert_close(h, x.float() + r.float(), rtol=0, atol=0)
    assert rel_err(y, kind.formula(h.double(), (12,), *kind.params(norm))) < 1e-2
    x32 = torch.randn(3, 12)
    y, h = kind.fused_add(12)(x32)
    assert h is x32  # residual=None: the plain norm, the input is the new residual
    assert "residual_in_fp32=True" in repr(norm)


def test_fused_add_rmsnorm_options_gemma_offset_and_llama_order():
    norm = FusedAddRMSNorm(16, eps=1e-6, weight_offset=1.0, cast_order="llama")
    nn.init.normal_(norm.weight)
    x, r = torch.randn(2, 16), torch.randn(2, 16)
    y, h = norm(x, r)
    assert torch.equal(h, x + r)
    want = _rms_formula((x + r).double(), (16,), 1 + norm.weight.double(), eps=1e-6)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    assert "weight_offset=1.0" in repr(norm) and "cast_order='llama'" in repr(norm)


class _PostNormBlock(nn.Module):
    def __init__(self, d, norm_class):
        super().__init__()
        self.f = nn.Linear(d, d)
        self.n = norm_class(d, eps=1e-6)

    def forward(self, x):
        return self.n(x + self.f(x))


def _demo_lm():
    from ln_lightning.demo import PostNormTransformerLM

    model = PostNormTransformerLM(vocab_size=50, d_model=32, n_layers=2, n_heads=2, block_size=16)
    return model, torch.randint(0, 50, (2, 16)), "blocks.0.ln1", lambda m: m.blocks[0].ln1


def _blocks(kind):
    model = nn.Sequential(*[_PostNormBlock(16, kind.torch_class) for _ in range(3)])
    return model, torch.randn(4, 16), "0.n", lambda m: m[0].n


@pytest.mark.parametrize("kind, build", [(KINDS[0], _blocks), (KINDS[1], _blocks), (KINDS[0], lambda k: _demo_lm())],
                         ids=["ln-blocks", "rms-blocks", "ln-demo-lm"])
def test_swap_after_placement_convert_keeps_the_conversion(kind, build):
    placement = pytest.importorskip("ln_lightning.placement")
    torch.manual_seed(0)
    model, x, name, norm_of = build(kind)
    placement.convert(model, "pre")
    deferred_type = type(norm_of(model))
    first = lambda out: out[0] if isinstance(out, tuple) else out
    before = first(model(x))
    report = swap_layernorms(model)
    assert name in report.swapped and not report.skipped
    norm = norm_of(model)
    assert isinstance(norm, kind.fused) and getattr(norm, "ln_lightning_deferred", False)
    # On the CPU both fused modules take torch's own kernel at this size: the same bits.
    torch.testing.assert_close(first(model(x)), before, rtol=0, atol=0)
    report.revert()
    assert type(norm_of(model)) is deferred_type
