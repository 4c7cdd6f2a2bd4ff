"""Which implementation an eager torch-backend fused add + RMSNorm call runs (functional._rms_eager_composite):
the compiled CPU kernel where it takes the inputs, else the reference modules' own ops, except float32
forward+backward, where the custom op's aten composition (one-formula backward) is the faster one.
Speed: benchmarks/bench_norm.py ("[aten]" rows); here only the routing, and that each route is exact."""

from __future__ import annotations

import pytest
import torch

from ln_lightning.norm import _cpu_kernels, _torch_ops, functional


@pytest.fixture
def routes(monkeypatch):
    seen = []
    real_composite = functional._rms_composite
    monkeypatch.setattr(functional, "_rms_composite", lambda *a: seen.append("composite") or real_composite(*a))
    eager = _torch_ops.add_rms_norm_eager
    monkeypatch.setattr(_torch_ops, "add_rms_norm_eager", lambda *a: seen.append("op") or eager(*a))
    return seen


def _call(dtype, grad, rows=64, hidden=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_(grad)
    r = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_(grad)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).requires_grad_(grad)
    y, h = functional.fused_add_rms_norm(x, r, w, 1e-6, cast_order="llama", backend="torch")
    hd = (x.double() + r.double())
    ref = w.double() * (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    if grad:
        (y.float().square().sum() + h.float().sum()).backward()
        assert x.grad is not None and r.grad is not None and w.grad is not None


@pytest.mark.parametrize("grad", [False, True])
def test_float16_runs_the_reference_ops(routes, grad):
    _call(torch.float16, grad)
    assert routes == ["composite"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_dtypes_run_the_custom_op(routes, dtype):
    if _cpu_kernels.KERNELS.module() is None:
        pytest.skip("compiled CPU RMSNorm kernels not built")
    _call(dtype, True)
    assert routes == ["op"]


def test_tiny_inputs_run_the_reference_ops(routes):
    _call(torch.float32, True, rows=2, hidden=8)
    assert routes == ["composite"]


def test_without_the_kernel_float32_training_keeps_the_op_and_inference_the_reference_ops(routes, monkeypatch):
    monkeypatch.setattr(_torch_ops, "rms_compiled_kernel_takes", lambda *a: False)
    _call(torch.float32, True)
    assert routes == ["op"]
    routes.clear()
    _call(torch.float32, False)
    assert routes == ["composite"]
    routes.clear()
    _call(torch.bfloat16, True)
    assert routes == ["composite"]
