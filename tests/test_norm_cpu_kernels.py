"""The compiled CPU kernels of both norms (one source, csrc/add_norm_cpu.cpp): what holds for each kind alike,
parametrised over LayerNorm and RMSNorm. Numerics against float64: test_norm_numerics.py."""

from __future__ import annotations

import pytest
import torch

from _helpers_norm_cases import compiled_cpu_kernels
from ln_lightning.norm import (
    _torch_ops,
    functional,
    fused_add_layer_norm,
    fused_add_rms_norm,
)

KINDS = ["ln", "rms"]


@pytest.fixture
def kernels():
    """The compiled module (CI must be able to build it)."""
    return compiled_cpu_kernels()


@pytest.mark.parametrize(("kind", "dtype"), [("ln", torch.bfloat16), ("rms", torch.bfloat16), ("rms", torch.float32)])
def test_deterministic_across_thread_counts(kind, dtype, kernels, monkeypatch):
    # The weight (and bias) gradients are summed per fixed block of rows, in block order: the same bits for any
    # thread count. (float32 LayerNorm runs aten's kernels, whose weight gradient is not: it is not checked.)
    monkeypatch.setattr(functional, "EAGER_COMPOSITE_BELOW", 0)
    monkeypatch.setattr(functional, "RMS_EAGER_COMPOSITE_BELOW", 0)
    name = "_compiled_backward" if kind == "ln" else "_rms_compiled_backward"
    calls, real = [], getattr(_torch_ops, name)
    monkeypatch.setattr(_torch_ops, name, lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(1)
    x, r, gy, gh = (torch.randn(300, 200, generator=g).to(dtype) for _ in range(4))
    w = (1 + 0.5 * torch.randn(200, generator=g)).to(dtype).requires_grad_()
    b = torch.randn(200, generator=g).to(dtype).requires_grad_()
    params = [w, b] if kind == "ln" else [w]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            xx, rr = x.clone().requires_grad_(), r.clone().requires_grad_()
            if kind == "ln":
                y, h = fused_add_layer_norm(xx, rr, w, b, backend="torch")
            else:
                y, h = fused_add_rms_norm(xx, rr, w, 1e-5, weight_offset=1.0, backend="torch")
            results.append((y, h, *torch.autograd.grad([y, h], [xx, rr, *params], [gy, gh])))
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3, "the compiled backward did not run"
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def _ln_bad_layouts(mod):
    x = torch.randn(4, 8).bfloat16()
    yield "residual must be a contiguous CPU tensor of shape", lambda: mod.add_layer_norm_fwd(
        x, torch.randn(8, 4).bfloat16().t(), None, None, 1e-5, False)
    yield "weight must be a contiguous float32 CPU tensor of 8", lambda: mod.add_layer_norm_fwd(
        x, None, torch.ones(8).bfloat16(), None, 1e-5, False)
    yield "x must be bfloat16", lambda: mod.add_layer_norm_fwd(x.float(), None, None, None, 1e-5, False)
    y, h, mean, rstd = mod.add_layer_norm_fwd(x, x, None, None, 1e-5, False)
    yield "mean and rstd must be contiguous float32 of 4", lambda: mod.add_layer_norm_bwd(
        y, None, h, mean[:2], rstd, None, False, False, 1e-5)


def _rms_bad_layouts(mod):
    yield "contiguous", lambda: mod.add_rms_norm_fwd(torch.randn(4, 8).t(), None, None, 1e-5, False, 0.0, False)
    yield "float32 or bfloat16", lambda: mod.add_rms_norm_fwd(
        torch.randn(4, 8, dtype=torch.float16), None, None, 1e-5, False, 0.0, False)
    x = torch.randn(4, 8)
    y, h, rstd = mod.add_rms_norm_fwd(x, x, None, 1e-5, False, 0.0, False)
    yield "rstd must be contiguous float32 of 4", lambda: mod.add_rms_norm_bwd(
        y, None, h, rstd[:2], None, 0.0, False, False, 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_reject_bad_layouts_instead_of_reading_past_them(kind, kernels):
    cases = list((_ln_bad_layouts if kind == "ln" else _rms_bad_layouts)(kernels))
    for message, call in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
