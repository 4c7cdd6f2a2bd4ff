"""Fused RMSNorm on the torch backend (compiled CPU kernels and the aten composition): numerics
against float64, cast orders. Modules (both norms): test_norm_modules.py; Triton (both norms): test_norm_triton.py; the ops' opcheck and
torch.compile: test_norm_compile.py; recognition: test_norm_kinds.py; swapping HF models: test_norm_rms_swap.py."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from torch import nn

from _helpers_norm_cases import rms_cases
from ln_lightning.testing.norm import Case, assert_narrow_rows_accurate, rms_norm_formula
from ln_lightning.testing.norm_rms import (
    EPS, RMSCase, assert_each_row_within_torch_error, assert_rows_independent, assert_within_torch_error,
)
from ln_lightning.norm import FusedRMSNorm, fused_add_rms_norm, rms_norm, swap_layernorms
from ln_lightning.norm import _cpu_kernels, _torch_ops, functional


@pytest.fixture(autouse=True)
def _fused_function_path(monkeypatch):
    # The tests below exercise the fused op even on tiny tensors (the composition used under
    # functional.RMS_EAGER_COMPOSITE_BELOW is covered by the float64 sweep).
    monkeypatch.setattr(functional, "RMS_EAGER_COMPOSITE_BELOW", 0)


@pytest.fixture(params=["compiled", "aten"])
def cpu_path(request, monkeypatch):
    """Both torch-backend paths, and a counter proving which one ran: compiled forward calls."""
    if request.param == "compiled" and _cpu_kernels.KERNELS.module() is None:
        pytest.fail(f"the compiled CPU RMSNorm kernels did not build: {_cpu_kernels.KERNELS.failure}")
    calls = []
    real = _torch_ops._rms_compiled_forward
    monkeypatch.setattr(_torch_ops, "_rms_compiled_forward", lambda *a: calls.append(1) or real(*a))
    with _cpu_kernels.KERNELS.disabled() if request.param == "aten" else contextlib.nullcontext():
        yield request.param, calls


def _compiled_expected(case: RMSCase) -> bool:
    from ln_lightning.norm import _common

    c = case.base
    wdt = None if c.affine == "none" else c.dtype
    rnd = _common.round_dtype(case.cast_order, c.dtype, wdt)
    ydt = _common.rms_output_dtype(case.cast_order, c.dtype, wdt)
    return c.dtype in (torch.float32, torch.bfloat16) and ydt == c.dtype and rnd in (None, c.dtype)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=rms_cases(max_rows=8, max_hidden=300))
def test_matches_float64_within_twice_torch_error(case, cpu_path):
    # Both eager paths: the custom autograd.Function (kernels or aten ops inside) and the plain
    # composition used for tiny tensors.
    name, calls = cpu_path
    for threshold in (0, 1 << 60):
        functional.RMS_EAGER_COMPOSITE_BELOW = threshold
        try:
            before = len(calls)
            assert_within_torch_error(case, backend="torch")
            ran_compiled = len(calls) > before
            assert ran_compiled == (threshold == 0 and name == "compiled" and _compiled_expected(case)), (name, case)
        finally:
            functional.RMS_EAGER_COMPOSITE_BELOW = 1 << 13


EDGE = [
    RMSCase(Case(1, 1, torch.float32, True, "full", 0.0, 0, False, 1), "fp32", False),  # width 1
    RMSCase(Case(1, 257, torch.bfloat16, True, "no_bias", 1e4, 0, False, 2), "llama", False),  # one row, 1e4
    RMSCase(Case(5, 33, torch.float16, False, "none", 0.0, 2, False, 3), "fp32", False),  # no weight
    RMSCase(Case(4, 96, torch.bfloat16, False, "full", 1e4, 2, True, 4), "fp32", True),  # fp32 stream from None
    RMSCase(Case(3, 255, torch.bfloat16, True, "full", 0.0, 1, True, 5), "t5", False),
    RMSCase(Case(3, 4099, torch.float16, True, "full", 1e4, 1, False, 6), "llama", True),  # fp16 offset
    RMSCase(Case(2, 5000, torch.float32, True, "full", 1e4, 0, True, 7), "fp32", True),
    # Width 1, found by the randomized sweep (issue 23): dx 5.8e-6 (compiled) / 6.5e-6 (aten) > allowed 4.4e-6 on
    # the textbook backward.
    RMSCase(Case(8, 1, torch.float32, True, "none", 0.0, 0, True, 2053611722), "llama", True),
    # Width 2, a constant row with Gemma's 1 + w (issue 32): dx 1.5e-6 (compiled) > allowed 1.3e-6; 4.6e-8 now.
    RMSCase(Case(1, 2, torch.float32, False, "no_bias", 0.0, 2, False, 1622986504), "llama", True),
]


@pytest.mark.parametrize("case", EDGE, ids=lambda c: f"{c.base.rows}x{c.base.hidden}-{str(c.base.dtype)[6:]}-{c.cast_order}")
def test_edge_cases(case, cpu_path):
    assert_within_torch_error(case, backend="torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_width_one_backward_does_not_cancel(dtype, cpu_path):
    # Width 1: dx = eps * rstd**3 * g, which the textbook rstd * g * (1 - n**2) loses to cancellation (issue 23:
    # 4% at h = 2 in float32, all of it from h = 10 on). Every row within a few units of its own rounding, on the
    # op itself (the compiled kernel, or the aten composition). (Not float16: it cannot hold these dx beyond
    # h = 1, so it could not tell the two forms apart.)
    name, calls = cpu_path

    def grad(h, w, dy):
        x = h.clone().requires_grad_()
        y, _, _ = _torch_ops.add_rms_norm_eager(x, None, w, EPS, False, 0.0, "fp32")
        return torch.autograd.grad(y, x, dy)[0]

    assert_narrow_rows_accurate("rms", grad, dtype, rel_tol=1e-5 if dtype == torch.float32 else 1e-2, eps=EPS)
    assert bool(calls) == (name == "compiled")


@pytest.mark.parametrize("offset", [0.0, 1.0])
# The wide rows (1,024 of them, in float64 too) take 0.5-2 s a case: they run in the full suite (CI), not the quick run.
@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 8, 16, 64, 255] + [pytest.param(w, marks=pytest.mark.slow) for w in (4096, 8200)])
def test_each_row_within_torch_error_when_the_gradient_lies_near_the_row(width, offset, cpu_path):
    # The perpendicular part g - q n of the input gradient is a small difference of large terms when g lies near
    # n; Gemma's 1 + w makes g larger against it. Issue 32: the compiled kernel reached 1.9x the 2x-torch bound on
    # single rows at width 2 with offset 1 (the aten composition 1.3x at width 8); and on wide constant rows, whose
    # float32 mean square drifted (compiled 1.7x, aten 2.9x at width 8200). Every row is held to the bound on its
    # own, as a one-row call would be, at every width.
    name, calls = cpu_path

    def grad(h, w, offset, dy):
        x = h.clone().requires_grad_()
        y, _, _ = _torch_ops.add_rms_norm_eager(x, None, w, EPS, False, offset, "fp32")
        return torch.autograd.grad(y, x, dy)[0]

    assert_each_row_within_torch_error(grad, width, offset)
    assert bool(calls) == (name == "compiled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_rows(dtype, cpu_path):
    x = torch.randn(0, 3, 16, dtype=dtype, requires_grad=True)
    r = torch.randn(0, 3, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(16, dtype=dtype, requires_grad=True)
    y, h = fused_add_rms_norm(x, r, w, EPS, backend="torch")
    assert y.shape == h.shape == (0, 3, 16)
    dx, dr, dw = torch.autograd.grad([y, h], [x, r, w], [torch.ones_like(y), torch.ones_like(h)])
    assert dx.shape == x.shape and dr.shape == r.shape and torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_independent(dtype, cpu_path):
    assert_rows_independent("torch", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_matches_the_float64_formula(dtype, cpu_path):
    # Outputs and every gradient (the new residual's downstream gradient adds into dx and dresidual)
    # against h / sqrt(mean(h**2) + eps) * w in float64, through autograd of elementary ops.
    name, calls = cpu_path
    g = torch.Generator().manual_seed(0)
    x, r, gy, gh = (torch.randn(2, 7, 48, generator=g).to(dtype) for _ in range(4))
    w = (1 + 0.5 * torch.randn(48, generator=g)).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    y, h = fused_add_rms_norm(*leaves, EPS, backend="torch")
    got = (y, h, *torch.autograd.grad([y, h], leaves, [gy, gh]))
    ref = [t.double().requires_grad_() for t in (x, r, w)]
    h64 = ref[0] + ref[1]
    y64 = rms_norm_formula(h64, (48,), ref[2], EPS)
    want = (y64, h64, *torch.autograd.grad([y64, h64], ref, [gy.double(), gh.double()]))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for what, a, e in zip(("y", "h", "dx", "dresidual", "dweight"), got, want):
        err = ((a.double() - e).abs().max() / e.abs().max()).item()
        assert a.dtype == dtype and err < tol, (what, err)
    assert bool(calls) == (name == "compiled")


def test_functional_rms_norm_is_f_rms_norm():
    w, x = torch.randn(16), torch.randn(2, 16)
    torch.testing.assert_close(rms_norm(x, (16,), w, 1e-6), F.rms_norm(x, (16,), w, 1e-6))



def test_bad_inputs_get_clear_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="cast order"):
        fused_add_rms_norm(x, None, None, cast_order="gemma")
    with pytest.raises(ValueError, match="last 1 dims"):
        fused_add_rms_norm(x, None, torch.ones(7))
    with pytest.raises(ValueError, match="must equal x shape"):
        fused_add_rms_norm(x, torch.randn(2, 7), None)
    if not x.is_cuda:  # CPU tensors: a forced Triton backend raises instead of falling back
        with pytest.raises(RuntimeError, match="'triton' was requested"):
            fused_add_rms_norm(x, None, None, backend="triton")


class _RMSKeepsInit(nn.RMSNorm):
    def __init__(self, d):
        super().__init__(d, eps=1e-6)


class _RMSUpcasts(nn.RMSNorm):  # still an RMSNorm: recognised by the probe, swapped
    def forward(self, x):
        return super().forward(x.float()).type_as(x)


class _RMSClamps(nn.RMSNorm):  # computes something else: skipped, with the reason
    def forward(self, x):
        return super().forward(x).clamp(-0.5, 0.5)


def test_swap_nn_rmsnorm_family_report_revert_and_pickle():
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.RMSNorm(8), _RMSKeepsInit(8), _RMSUpcasts(8), _RMSClamps(8), nn.LayerNorm(8))
    for m in model:
        nn.init.normal_(m.weight)
    x = torch.randn(5, 8)
    before = model(x)
    state = copy.deepcopy(model.state_dict())
    report = swap_layernorms(model)
    assert report.swapped == ["0", "1", "2", "4"]
    assert [s.path for s in report.skipped] == ["3"] and "overrides forward()" in report.skipped[0].reason
    assert type(model[0]) is FusedRMSNorm and isinstance(model[1], _RMSKeepsInit) and isinstance(model[2], _RMSUpcasts)
    torch.testing.assert_close(model(x), before, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    clone = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    report.revert()
    assert [type(m) for m in model] == [nn.RMSNorm, _RMSKeepsInit, _RMSUpcasts, _RMSClamps, nn.LayerNorm]
    assert torch.equal(model(x), before)


def test_swap_reports_modules_named_like_norms_that_it_does_not_recognise():
    class OddRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight

    model = nn.Sequential(OddRMSNorm(), nn.RMSNorm(8))
    report = swap_layernorms(model)
    assert report.swapped == ["1"]
    assert [s.path for s in report.skipped] == ["0"] and "matches neither LayerNorm nor RMSNorm" in report.skipped[0].reason
