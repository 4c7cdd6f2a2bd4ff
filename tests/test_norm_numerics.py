"""Both norms on the torch (CPU) backend against float64, parametrised over the kind ("layer", "rms") and the
backend's eager paths (tests/_helpers_norm_paths.py): the float64 sweep, edge cases, rows independent, zero rows,
the fused residual add, the narrowest rows' backward, per-row accuracy near the row, the functional forms, bad inputs.

One kind's own tests: LayerNorm's compiled kernels (exactness, weight gradient, thresholds), their build and cache,
backends and swap in test_norm.py; RMSNorm's swap in test_norm_rms_swap.py and routing in test_norm_rms_routing.py.
Both kinds' modules: test_norm_modules.py; Triton: test_norm_triton.py; opcheck and torch.compile: test_norm_compile.py.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

from _helpers_norm_cases import cases, rms_cases
from _helpers_norm_paths import PATHS, forced_path
from ln_lightning.norm import (
    FusedLayerNorm, FusedRMSNorm, _common, _torch_ops, functional, fused_add_layer_norm, fused_add_rms_norm,
    layer_norm, rms_norm,
)
from ln_lightning.testing import norm as layer_checks
from ln_lightning.testing import norm_rms as rms_checks
from ln_lightning.testing.norm import (
    NARROW_MAGNITUDES, Case, assert_narrow_rows_accurate, layer_norm_formula, narrow_rows, narrow_rows_reference,
    rel_err, rms_norm_formula,
)
from ln_lightning.testing.norm_rms import RMSCase, assert_each_row_within_torch_error

EPS = 1e-5
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
REL_TOL = {F32: 1e-5, BF16: 1e-2}  # against float64; bfloat16: a few ulps of its 8-bit mantissa


def _layer_norm_eager_grad(h, w, dy):
    # The compiled kernel takes bfloat16 inputs only: a float32 h arrives as a float32 residual onto a zero bfloat16
    # x, so that the stream it normalises is float32.
    if h.dtype == BF16:
        leaf = x = h.clone().requires_grad_()
        r = None
    else:
        leaf = r = h.clone().requires_grad_()
        x = torch.zeros_like(h, dtype=BF16)
    y = _torch_ops.add_layer_norm_eager(x, r, w, None, EPS, False, False)[0]
    return torch.autograd.grad(y, leaf, dy.to(y.dtype))[0]


def _rms_norm_eager_grad(h, w, dy, offset=0.0):
    x = h.clone().requires_grad_()
    y = _torch_ops.add_rms_norm_eager(x, None, w, EPS, False, offset, "fp32")[0]
    return torch.autograd.grad(y, x, dy)[0]


def _rms_compiled_takes(case: RMSCase) -> bool:
    c = case.base
    wdt = None if c.affine == "none" else c.dtype
    rnd = _common.round_dtype(case.cast_order, c.dtype, wdt)
    ydt = _common.rms_output_dtype(case.cast_order, c.dtype, wdt)
    return c.dtype in (F32, BF16) and ydt == c.dtype and rnd in (None, c.dtype)


@dataclasses.dataclass(frozen=True)
class Kind:
    """What the checks call for one norm: its functions (LayerNorm's take a bias after the weight, RMSNorm's not),
    its float64 references and case tables, and when the compiled kernels run it."""

    fused_add: Callable  # (x, residual, weight[, bias], eps=...) -> (y, new residual)
    functional: Callable  # (x, shape, weight[, bias], eps=...)
    torch_functional: Callable  # torch's own, the same signature
    formula: Callable  # the float64 reference, the same signature
    module: type
    has_bias: bool
    default_eps: Callable[[torch.dtype], float]
    cases: Callable  # the sweep's hypothesis strategy
    sweep_examples: int
    edge_cases: tuple
    within_torch_error: Callable  # (case, backend): ln_lightning.testing's acceptance bound
    rows_independent: Callable  # (backend, dtype)
    compiled_takes: Callable  # case -> whether the compiled kernels run it on the "compiled" path
    compiled_dtypes: tuple  # ... and a default call (float32 weight cast order) in these dtypes
    narrow: str  # ln_lightning.testing.norm's name for it
    eager_grad: Callable  # (h, weight, dy) -> dh through the op's eager autograd.Function

    def params(self, weight, bias=None) -> tuple:
        return (weight, bias) if self.has_bias else (weight,)


KINDS = {
    "layer": Kind(
        fused_add_layer_norm, layer_norm, F.layer_norm, layer_norm_formula, FusedLayerNorm, True,
        default_eps=lambda dtype: 1e-5,
        cases=cases, sweep_examples=150,
        edge_cases=(
            Case(1, 1, F32, False, "full", 0.0, 1, False, 1),  # single element
            Case(1, 257, BF16, True, "no_bias", 1e4, 0, False, 2),  # single row, offset
            Case(5, 33, F16, False, "none", 0.0, 2, False, 3),  # constant rows, no affine
            Case(4, 96, BF16, False, "full", 1e4, 2, True, 4),  # fp32 residual from None
            Case(3, 255, BF16, True, "full", 0.0, 1, True, 5),
        ),
        within_torch_error=layer_checks.assert_within_torch_error,
        rows_independent=layer_checks.assert_rows_independent,
        compiled_takes=lambda case: case.dtype == BF16, compiled_dtypes=(BF16,),
        narrow="ln", eager_grad=_layer_norm_eager_grad,
    ),
    "rms": Kind(
        fused_add_rms_norm, rms_norm, F.rms_norm, rms_norm_formula, FusedRMSNorm, False,
        default_eps=lambda dtype: torch.finfo(dtype).eps,  # nn.RMSNorm's rule
        cases=rms_cases, sweep_examples=120,
        edge_cases=(
            RMSCase(Case(1, 1, F32, True, "full", 0.0, 0, False, 1), "fp32", False),  # width 1
            RMSCase(Case(1, 257, BF16, True, "no_bias", 1e4, 0, False, 2), "llama", False),  # one row, 1e4
            RMSCase(Case(5, 33, F16, False, "none", 0.0, 2, False, 3), "fp32", False),  # no weight
            RMSCase(Case(4, 96, BF16, False, "full", 1e4, 2, True, 4), "fp32", True),  # fp32 stream from None
            RMSCase(Case(3, 255, BF16, True, "full", 0.0, 1, True, 5), "t5", False),
            RMSCase(Case(3, 4099, F16, True, "full", 1e4, 1, False, 6), "llama", True),  # fp16 offset
            RMSCase(Case(2, 5000, F32, True, "full", 1e4, 0, True, 7), "fp32", True),
            # Width 1, found by the randomized sweep (issue 23): dx 5.8e-6 (compiled) / 6.5e-6 (aten) > allowed
            # 4.4e-6 on the textbook backward.
            RMSCase(Case(8, 1, F32, True, "none", 0.0, 0, True, 2053611722), "llama", True),
            # Width 2, a constant row with Gemma's 1 + w (issue 32): dx 1.5e-6 (compiled) > allowed 1.3e-6; 4.6e-8 now.
            RMSCase(Case(1, 2, F32, False, "no_bias", 0.0, 2, False, 1622986504), "llama", True),
        ),
        within_torch_error=rms_checks.assert_within_torch_error,
        rows_independent=rms_checks.assert_rows_independent,
        compiled_takes=_rms_compiled_takes, compiled_dtypes=(F32, BF16),
        narrow="rms", eager_grad=_rms_norm_eager_grad,
    ),
}


def _id(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, RMSCase):
        return f"{_id(value.base)}-{value.cast_order}"
    if isinstance(value, Case):
        return f"{value.rows}x{value.hidden}-{_id(value.dtype)}"
    return str(value)


def each_path(rows, paths=PATHS) -> list:
    """pytest params ``(kind, *values, path)``: each row ``(kind, *values)`` on each eager path ``paths[kind]``."""
    return [pytest.param(*row, path, id="-".join(map(_id, (*row, path)))) for row in rows for path in paths[row[0]]]


def per_kind(*values) -> list:
    """Rows ``(kind, value)``: each value for each kind."""
    return [(kind, value) for kind in KINDS for value in values]


@pytest.fixture
def path(request, monkeypatch):
    """The eager path ``request.param`` forced: yields its name and the compiled-kernel calls it makes."""
    with forced_path(request.param, monkeypatch) as calls:
        yield request.param, calls


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


# --------------------------------------------------------------------------- random cases and edge cases

# The custom autograd.Function on the compiled kernels and on aten's; every example runs the composition small
# tensors take too.
FUNCTION_PATHS = dict.fromkeys(KINDS, ("compiled", "aten"))


@pytest.mark.parametrize("kind, path", each_path([(kind,) for kind in KINDS], FUNCTION_PATHS), indirect=["path"])
def test_matches_float64_within_twice_torch_error(kind, path):
    norm, (name, calls) = KINDS[kind], path

    # Built per call: a pytest parameter cannot carry hypothesis settings, and each kind keeps its example count.
    @settings(max_examples=norm.sweep_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=norm.cases(max_rows=8, max_hidden=300))
    def on_the_function_and_the_composition(case):
        for composite_below in (0, 1 << 60):  # (the path fixture restores both at teardown)
            functional.EAGER_COMPOSITE_BELOW = functional.RMS_EAGER_COMPOSITE_BELOW = composite_below
            before = len(calls)
            norm.within_torch_error(case, backend="torch")
            ran_compiled = len(calls) > before
            expected = composite_below == 0 and name == "compiled" and norm.compiled_takes(case)
            assert ran_compiled == expected, (name, case)

    on_the_function_and_the_composition()


EDGE_CASES = [(kind, case) for kind in KINDS for case in KINDS[kind].edge_cases]


@pytest.mark.parametrize("kind, case, path", each_path(EDGE_CASES), indirect=["path"])
def test_edge_cases(kind, case, path):
    norm, (name, calls) = KINDS[kind], path
    norm.within_torch_error(case, backend="torch")
    assert bool(calls) == (name == "compiled" and norm.compiled_takes(case)), calls


# --------------------------------------------------------------------------- structure

@pytest.mark.parametrize("kind, dtype, path", each_path(per_kind(F32, BF16)), indirect=["path"])
def test_rows_are_independent(kind, dtype, path):
    norm, (name, calls) = KINDS[kind], path
    norm.rows_independent("torch", dtype)
    # and a plain norm (no residual), through the module
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 19, generator=g).to(dtype)
    x2 = x.clone()
    x2[1:] = 1e3 * torch.randn(4, 19, generator=g).to(dtype)
    module = norm.module(19, dtype=dtype)
    assert torch.equal(module(x)[0], module(x2)[0])
    assert bool(calls) == (name == "compiled" and dtype in norm.compiled_dtypes), calls


@pytest.mark.parametrize("kind, dtype, path", each_path(per_kind(F32, BF16, F16)), indirect=["path"])
def test_zero_rows(kind, dtype, path):
    norm = KINDS[kind]
    x = torch.randn(0, 3, 16, dtype=dtype, requires_grad=True)
    r = torch.randn(0, 3, 16, dtype=dtype, requires_grad=True)
    params = norm.params(*(torch.randn(16, dtype=dtype, requires_grad=True) for _ in range(2)))
    y, h = norm.fused_add(x, r, *params, eps=EPS, backend="torch")
    assert y.shape == h.shape == (0, 3, 16)
    dx, dr, *dparams = torch.autograd.grad([y, h], [x, r, *params], [torch.ones_like(y), torch.ones_like(h)])
    assert dx.shape == x.shape and dr.shape == r.shape
    assert all(torch.equal(d, torch.zeros_like(p)) for d, p in zip(dparams, params))


@pytest.mark.parametrize("kind, dtype, path", each_path(per_kind(F32, BF16)), indirect=["path"])
def test_fused_add_matches_the_float64_formula(kind, dtype, path):
    # Outputs and every gradient, with the downstream gradient of the new residual adding into the norm's input
    # gradient, against the kind's formula in float64 (autograd through elementary ops).
    norm, (name, calls) = KINDS[kind], path
    g = torch.Generator().manual_seed(0)
    x, r, gy, gh = (torch.randn(2, 7, 48, generator=g).to(dtype) for _ in range(4))
    w = (1 + 0.5 * torch.randn(48, generator=g)).to(dtype)
    params = norm.params(w, torch.randn(48, generator=g).to(dtype) if norm.has_bias else None)
    leaves = _leaves(x, r, *params)
    y, h = norm.fused_add(*leaves, eps=EPS, backend="torch")
    got = (y, h, *torch.autograd.grad([y, h], leaves, [gy, gh]))
    ref = _leaves(*(t.double() for t in (x, r, *params)))
    h64 = ref[0] + ref[1]
    y64 = norm.formula(h64, (48,), *ref[2:], eps=EPS)
    want = (y64, h64, *torch.autograd.grad([y64, h64], ref, [gy.double(), gh.double()]))
    for what, a, e in zip(("y", "h", "dx", "dresidual", "dweight", "dbias"), got, want):
        assert a.dtype == dtype, what
        assert rel_err(a, e) < REL_TOL[dtype], (what, rel_err(a, e))
    assert calls == (["forward", "backward"] if name == "compiled" and dtype in norm.compiled_dtypes else [])
    # Only the residual is used downstream: the norm contributes nothing, exactly.
    leaves = _leaves(x, r, *params)
    y, h = norm.fused_add(*leaves, eps=EPS, backend="torch")
    dx, dw = torch.autograd.grad([h], [leaves[0], leaves[2]], [gh], allow_unused=True)
    assert torch.equal(dx, gh) and (dw is None or not dw.any())


# --------------------------------------------------------------------------- the backward's cancellations

@pytest.mark.parametrize("kind", KINDS)
def test_the_narrow_rows_reference_is_their_derivative(kind):
    # The closed form the narrow-rows tests compare against equals float64 autograd of the textbook formula
    # wherever float64 autograd itself resolves 1 - x_hat**2 (magnitudes up to 10: to 1e-9).
    norm = KINDS[kind]
    h, w, dy = narrow_rows(norm.narrow)
    hh = h.clone().requires_grad_()
    (autograd,) = torch.autograd.grad(norm.formula(hh, (h.shape[-1],), *norm.params(w), eps=EPS), hh, dy)
    closed = narrow_rows_reference(norm.narrow, h, w, dy, EPS)
    rel = (autograd - closed).abs().amax(-1) / closed.abs().amax(-1)
    small = torch.tensor([m <= 10 for m in NARROW_MAGNITUDES] * 2)
    assert rel[small].max() < 1e-8, rel


# LayerNorm on the compiled kernel only: aten's kernel, being torch's, loses these rows to cancellation.
NARROW_PATHS = {"layer": ("compiled",), "rms": ("compiled", "aten")}


@pytest.mark.parametrize("kind, dtype, path", each_path(per_kind(F32, BF16), NARROW_PATHS), indirect=["path"])
def test_narrowest_rows_backward_does_not_cancel(kind, dtype, path):
    # RMSNorm at width 1: dx = eps * rstd**3 * g; LayerNorm at width 2: g - mean(g) lies along x_hat, and dx = eps *
    # rstd**3 * (g - mean(g)). The textbook forms lose both to cancellation (issue 23: 4% at h = 2 in float32, all
    # of it from h = 10 on). Every row within a few units of its own rounding, on the op itself. (Not float16: it
    # cannot hold these dx beyond h = 1, so it could not tell the two forms apart.)
    norm, (name, calls) = KINDS[kind], path
    assert_narrow_rows_accurate(norm.narrow, norm.eager_grad, dtype, rel_tol=REL_TOL[dtype], eps=EPS)
    assert calls == (["forward", "backward"] if name == "compiled" else [])


# The wide rows (1,024 of them, in float64 too) take 0.5-2 s a case: they run in the full suite (CI), not the quick run.
NEAR_ROW_QUICK_WIDTHS, NEAR_ROW_WIDE = [1, 2, 3, 4, 5, 8, 16, 64, 255], (4096, 8200)
NEAR_ROW_WIDTHS = NEAR_ROW_QUICK_WIDTHS + [pytest.param(w, marks=pytest.mark.slow) for w in NEAR_ROW_WIDE]


# RMSNorm's (weight_offset, Gemma's 1 + w, is RMSNorm's); LayerNorm's twin follows.
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("width", NEAR_ROW_WIDTHS)
@pytest.mark.parametrize("path", ["compiled", "aten"], indirect=True)
def test_each_row_within_torch_error_when_the_gradient_lies_near_the_row(path, width, offset):
    # The perpendicular part g - q n of the input gradient is a small difference of large terms when g lies near
    # n; Gemma's 1 + w makes g larger against it. Issue 32: the compiled kernel reached 1.9x the 2x-torch bound on
    # single rows at width 2 with offset 1 (the aten composition 1.3x at width 8); and on wide constant rows, whose
    # float32 mean square drifted (compiled 1.7x, aten 2.9x at width 8200). Every row is held to the bound on its
    # own, as a one-row call would be, at every width.
    name, calls = path
    assert_each_row_within_torch_error(lambda h, w, offset, dy: _rms_norm_eager_grad(h, w, dy, offset), width, offset)
    assert bool(calls) == (name == "compiled")


# LayerNorm on the compiled kernel, the stream h in float32 (a float32 residual onto bfloat16 x) or bfloat16. The aten
# path runs torch's own kernel: on a float32 stream this check would hold torch against itself (its share is at most
# 0.5 by construction), so it runs on a bfloat16 stream only (torch's mixed-precision kernel, rounded to bfloat16);
# the composite path is F.layer_norm itself. The wide rows (four seeds of 1,024, 8-20 s a case) on the float32
# stream only: a bfloat16 result's own rounding decides the bound there.
LN_NEAR_SPAN_CASES = [
    pytest.param(path, dtype, width, id=f"{path}-{_id(dtype)}-{width}")
    for path, dtype in (("compiled", F32), ("compiled", BF16), ("aten", BF16))
    for width in NEAR_ROW_QUICK_WIDTHS
] + [pytest.param("compiled", F32, width, id=f"compiled-float32-{width}", marks=pytest.mark.slow) for width in NEAR_ROW_WIDE]


@pytest.mark.parametrize("path, dtype, width", LN_NEAR_SPAN_CASES, indirect=["path"])
def test_layer_norm_each_row_within_torch_error_when_the_gradient_lies_near_its_span(path, dtype, width):
    # The perpendicular part g - mean(g) - q x_hat of the input gradient is a small difference of large terms when
    # g = dy * w lies near span{1, x_hat}; a constant in g makes mean(g) large against it, and a constant row's
    # rstd = 1/sqrt(eps) ~ 316 magnifies what it loses. Issue 32: the compiled kernel reached 5.4-6.7x the 2x-torch
    # bound on single rows at width 2 and 1.05-5.8x at 3-8 (constant rows with the constant), 1.2-1.6x at 255-8200,
    # and 35x at width 1, whose exact derivative 0 came out as rounding noise; every row within it now (worst 0.7x).
    name, calls = path
    layer_checks.assert_each_row_within_torch_error(_layer_norm_eager_grad, width, dtype)
    assert bool(calls) == (name == "compiled")


# --------------------------------------------------------------------------- functional forms and bad inputs

@pytest.mark.parametrize("kind, path", each_path([(kind,) for kind in KINDS]), indirect=["path"])
def test_functional_form_matches_the_formula_and_torchs_own(kind, path):
    norm = KINDS[kind]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 10, generator=g, dtype=torch.float64)
    params = norm.params(*(torch.randn(4, 10, generator=g, dtype=torch.float64) for _ in range(2)))
    want = norm.formula(x, (4, 10), *params, eps=1e-3)
    torch.testing.assert_close(norm.functional(x, (4, 10), *params, eps=1e-3), want)
    torch.testing.assert_close(norm.functional(x, 10), norm.formula(x, (10,), eps=norm.default_eps(x.dtype)))
    w, x = torch.randn(16, generator=g), torch.randn(2, 16, generator=g)
    torch.testing.assert_close(norm.functional(x, (16,), w, eps=1e-6), norm.torch_functional(x, (16,), w, eps=1e-6))


# (what, x, residual, weight, keywords, error, message); each for both kinds, but for the last two.
_X = torch.randn(2, 8)
BAD_INPUTS = [
    ("residual-rows", _X, torch.randn(1, 8), torch.ones(8), {}, ValueError, "residual shape .* must equal x shape"),
    ("residual-width", _X, torch.randn(2, 7), None, {}, ValueError, "residual shape .* must equal x shape"),
    ("integer-input", torch.ones(2, 8, dtype=torch.long), None, None, {}, TypeError, "floating-point"),
    ("weight-wider", torch.randn(2, 7), None, torch.ones(8), {}, ValueError, "normalized_shape .* last 1 dims"),
    ("weight-narrower", _X, None, torch.ones(7), {}, ValueError, "normalized_shape .* last 1 dims"),
    ("unknown-backend", _X, None, torch.ones(8), {"backend": "cuda"}, ValueError, "unknown LayerNorm backend"),
]
RMS_BAD_INPUTS = [
    ("cast-order", _X, None, None, {"cast_order": "gemma"}, ValueError, "cast order"),  # LayerNorm has none
    # CPU tensors: a forced Triton backend raises instead of falling back. (LayerNorm's, with a module's own backend
    # winning over the context: test_norm.py, skipped where the Triton interpreter runs on CPU.)
    ("forced-triton", _X, None, None, {"backend": "triton"}, RuntimeError, "'triton' was requested"),
]


@pytest.mark.parametrize("kind, x, residual, weight, keywords, error, message", [
    pytest.param(kind, *row[1:], id=f"{kind}-{row[0]}")
    for kind, rows in (("layer", BAD_INPUTS), ("rms", BAD_INPUTS + RMS_BAD_INPUTS)) for row in rows
])
def test_bad_inputs_get_clear_errors(kind, x, residual, weight, keywords, error, message):
    norm = KINDS[kind]
    with pytest.raises(error, match=message):
        norm.fused_add(x, residual, *norm.params(weight), **keywords)
