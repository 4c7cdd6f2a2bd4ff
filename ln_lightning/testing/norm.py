"""References for the fused LayerNorm tests (CPU backend and Triton interpreter) and GPU checks.

The accuracy criterion (flash-attn's method, issue 4): for the forward output and every gradient,
max |ours - fp64| <= 2 * max |torch at the same dtype - fp64| + slack, where "torch" is the
eager pipeline ``h = x + residual; y = F.layer_norm(h, ...)`` with autograd and the slack (:func:`slack`)
is the larger of 1e-6 (times the reference's magnitude beyond 1) and one rounding unit of the dtype at
that magnitude (so in bfloat16 a result within one bf16 step of float64 always passes).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ContextManager, Optional

import torch
import torch.nn.functional as F

from ln_lightning.norm import fused_add_layer_norm

ABS_SLACK = 1e-6


@dataclasses.dataclass
class Case:
    rows: int
    hidden: int
    dtype: torch.dtype
    residual: bool
    affine: str  # "full" | "no_bias" | "none"
    offset: float
    constant_rows: int
    residual_in_fp32: bool
    seed: int

    def tensors(self):
        g = torch.Generator().manual_seed(self.seed)
        shape = (self.rows, self.hidden)
        x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + self.offset
        r = torch.randn(shape, generator=g, dtype=torch.float64) if self.residual else None
        for i in range(min(self.constant_rows, self.rows)):
            x[i] = self.offset + 0.375 * (i + 1)  # variance 0 rows (exact in every dtype)
            if r is not None:
                r[i] = 0.5
        w = b = None
        if self.affine in ("full", "no_bias"):
            w = 1 + 0.5 * torch.randn(self.hidden, generator=g, dtype=torch.float64)
        if self.affine == "full":
            b = torch.randn(self.hidden, generator=g, dtype=torch.float64)
        gy = torch.randn(shape, generator=g, dtype=torch.float64)
        gh = torch.randn(shape, generator=g, dtype=torch.float64) if self.residual or self.residual_in_fp32 else None
        cast = lambda t: None if t is None else t.to(self.dtype)
        return cast(x), cast(r), cast(w), cast(b), gy, gh


def layer_norm_formula(h: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
                       bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm written out (biased variance over the last ``len(normalized_shape)`` dims), for
    float64 references: its gradients come from autograd through these elementary ops, not from
    any LayerNorm kernel."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    centred = h - h.mean(dims, keepdim=True)
    y = centred / torch.sqrt(centred.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def rms_norm_formula(h: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
                     eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm written out (``h / sqrt(mean(h**2) + eps) * weight`` over the last
    ``len(normalized_shape)`` dims), :func:`layer_norm_formula`'s twin for float64 references."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    y = h * torch.rsqrt(h.square().mean(dims, keepdim=True) + eps)
    return y * weight if weight is not None else y


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (``want`` a float64 reference)."""
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def run_with_grads(x, r, w, b, gy, gh, fn):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    y, h = fn(*leaves)
    outs, grads = [y], [gy.to(y.dtype)]
    if gh is not None and h is not leaves[0]:
        outs.append(h)
        grads.append(gh.to(h.dtype))
    wanted = [t for t in leaves if t is not None]
    got = torch.autograd.grad(outs, wanted, grads, allow_unused=True)
    it = iter(got)
    grads_by_name = {name: (next(it) if t is not None else None) for name, t in zip("xrwb", leaves)}
    return y, h, grads_by_name


def separate_stream(case: Case) -> bool:
    """Whether the fused op returns a new residual stream distinct from ``x`` (one that receives its own
    downstream gradient): with a residual, or with ``residual_in_fp32`` for a half ``x`` (its float32 copy).
    The float64 reference must then add that gradient into ``dx`` too, although its ``x`` is float64 already."""
    return case.residual or (case.residual_in_fp32 and case.dtype not in (torch.float32, torch.float64))


def errors(case: Case, backend: Optional[str], exact_constant_rows: bool = False) -> dict[str, tuple[float, float, float]]:
    """{quantity: (our error, torch's error, max |reference|)} against the float64
:func:`layer_norm_formula`.

    ``exact_constant_rows``: also require a variance-0 row's output to be *exactly* the bias (our
    Triton kernels guarantee it; aten's CPU kernel, which the torch backend runs, is only within
    rounding of it, e.g. 1 ulp at offset 1e4 in bfloat16).
    """
    x, r, w, b, gy, gh = case.tensors()
    eps = 1e-5
    shape = (case.hidden,)

    def ours(x, r, w, b):
        return fused_add_layer_norm(x, r, w, b, eps, residual_in_fp32=case.residual_in_fp32, backend=backend)

    def torch_pipeline(x, r, w, b):
        if case.residual_in_fp32:
            h = x.float() + r.float() if r is not None else x.float()  # x itself when it is float32
            y = F.layer_norm(h, shape, None if w is None else w.float(), None if b is None else b.float(), eps)
            return y.to(x.dtype), h
        h = x + r if r is not None else x
        return F.layer_norm(h, shape, w, b, eps), h

    def reference(x, r, w, b):
        h = x + r if r is not None else (x.clone() if separate_stream(case) else x)
        return layer_norm_formula(h, shape, w, b, eps), h

    def f64(t):
        return None if t is None else t.double()

    yo, ho, go = run_with_grads(x, r, w, b, gy, gh, ours)
    yt, ht, gt = run_with_grads(x, r, w, b, gy, gh, torch_pipeline)
    # The reference gets the same (rounded) upstream gradients the low-precision runs received:
    # it is the exact answer to the question they were asked.
    gy = gy.to(yo.dtype).double()
    if gh is not None and ho is not None and ho.dtype != torch.float64:
        gh = gh.to(ho.dtype).double()
    yr, hr, gr = run_with_grads(f64(x), f64(r), f64(w), f64(b), gy, gh, reference)
    assert yo.dtype == x.dtype and yo.shape == x.shape
    err = lambda a, ref: (a.double() - ref).abs().max().item() if a.numel() else 0.0
    scale = lambda ref: ref.abs().max().item() if ref.numel() else 0.0
    out = {"y": (err(yo, yr), err(yt, yr), scale(yr)), "residual": (err(ho, hr), err(ht, hr), scale(hr))}
    for name, leaf in zip("xrwb", (x, r, w, b)):
        if gr[name] is not None:
            assert go[name] is not None, f"no gradient for {name}"
            assert go[name].dtype == leaf.dtype, f"d{name} has dtype {go[name].dtype}, input has {leaf.dtype}"
            out["d" + name] = (err(go[name], gr[name]), err(gt[name], gr[name]), scale(gr[name]))
    # Structural checks that an error bound would not catch.
    assert torch.isfinite(yo).all(), "non-finite output"
    if case.residual_in_fp32:
        assert ho.dtype == torch.float32
    for i in range(min(case.constant_rows, case.rows) if exact_constant_rows else 0):
        expected = b if b is not None else torch.zeros(case.hidden, dtype=x.dtype)
        assert torch.equal(yo[i], expected.to(yo.dtype)), f"constant row {i} is not exactly the bias"
    return out


def slack(dtype: torch.dtype, scale: float) -> float:
    """What the bound allows beyond 2x torch's error. ``ABS_SLACK`` is absolute for unit-scale tensors
    and grows with the reference's magnitude beyond 1: a variance-0 row has rstd = 1/sqrt(eps) ~ 316,
    its input gradient reaches ~1e3, and there float32 rounding alone (1 ulp ~ 1e-4) makes "2x
    torch's error" a coin toss between two equally rounded results. Likewise one unit of the
    output dtype's rounding at that magnitude: torch's half-precision result can land closer to
    float64 by chance (a few rows, bfloat16 weight gradient), which says nothing about ours."""
    return max(ABS_SLACK * max(1.0, scale), torch.finfo(dtype).eps * scale)


def assert_within_torch_error(case: Case, backend: Optional[str], exact_constant_rows: bool = False) -> None:
    """The acceptance bound: for every quantity, our error <= 2 x torch's + :func:`slack`."""
    for name, (ours, theirs, scale) in errors(case, backend, exact_constant_rows).items():
        allowed = slack(case.dtype, scale)
        assert ours <= 2 * theirs + allowed, f"{name}: our error {ours:.3e} > 2 x torch's {theirs:.3e} + {allowed:.1e} ({case})"


def assert_rows_independent(backend: Optional[str], dtype=torch.float32, hidden: int = 37, rows: int = 6) -> None:
    """Row 0's output and input gradients must not change when the other rows do."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(4)]  # x, r, gy, gh
    w = torch.randn(hidden, generator=g).to(dtype)
    b = torch.randn(hidden, generator=g).to(dtype)
    results = []
    for variant in range(2):
        x, r, gy, gh = [t.clone() for t in base]
        if variant:
            for t in (x, r, gy, gh):
                t[1:] = 100 * torch.randn(rows - 1, hidden, generator=g).to(dtype) + 50
        x.requires_grad_()
        r.requires_grad_()
        y, h = fused_add_layer_norm(x, r, w, b, 1e-5, backend=backend)
        dx, dr = torch.autograd.grad([y, h], [x, r], [gy, gh])
        results.append((y[0], h[0], dx[0], dr[0]))
    for name, a, c in zip(("y", "new_residual", "dx", "dresidual"), *results):
        assert torch.equal(a, c), f"row 0's {name} changed when other rows changed"


def assert_fixed_order_two_stage_reduction(backward: Callable[[slice], tuple], rows: int, programs: int,
                                           one_program: Callable[[], ContextManager]) -> None:
    """The Triton backward's reduction, to the bit: each of ``programs`` programs sums its own
    contiguous range of rows (float32 partials), then one ``torch.sum`` over the programs.

    ``backward(rows_slice)`` runs the backward on those rows and returns ``(dh, *reduced_grads)``;
    inside ``one_program()`` it runs as one program. A one-pass sum over all rows (atomics into one
    buffer) or another assignment of rows rounds differently, which the last check shows this data
    can tell apart.
    """
    per = -(-rows // programs)
    ranges = [slice(p * per, min((p + 1) * per, rows)) for p in range(programs)]
    assert len(ranges) > 1 and all(s.start < s.stop for s in ranges), ranges
    full = backward(slice(None))
    with one_program():
        parts = [backward(s) for s in ranges]  # one program over one range: that program's partial sums
        serial = backward(slice(None))  # one program over every row: a single running sum
    assert torch.equal(full[0], torch.cat([part[0] for part in parts])), "dh"
    for i in range(1, len(full)):
        assert torch.equal(full[i], torch.stack([part[i] for part in parts]).sum(0)), f"reduced gradient {i}"
        assert not torch.equal(serial[i], full[i]), f"reduced gradient {i}: this data cannot tell the orders apart"


# The widths at which a norm's input gradient has no part perpendicular to the normalised row (RMSNorm: 1;
# LayerNorm: 2, once the mean is removed), so the textbook backward's cancellation along that row is all
# there is (issue 23). There the derivative has a closed form, dx = eps * (s + eps)**-1.5 * g with s = h**2
# (LayerNorm: s = d**2, d = (h[1] - h[0]) / 2, and g - mean(g) for g), about 1e-15 to 1e3 times g across
# NARROW_MAGNITUDES; a float32 `1 - x_hat**2` cannot resolve it (torch's own error reaches 100%: at magnitude
# 100, x_hat**2 rounds to 1), nor can float64 autograd from magnitude 1e3 on (1 - x_hat**2 = 1e-11, known to
# 2e-16), which is why the reference is the closed form.
NARROW_WIDTH = {"rms": 1, "ln": 2}
NARROW_MAGNITUDES = (1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0, 2.0, 10.0, 100.0, 1e3)


def narrow_rows(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``(h, weight, dy)``: one row of width ``NARROW_WIDTH[kind]`` per magnitude and sign (RMSNorm:
    ``[±m]``; LayerNorm: ``c ± [-m/2, m/2]`` around a random centre ``c``). ``dy`` is bfloat16-exact, so that
    every dtype's kernel receives the same upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    m = torch.tensor(NARROW_MAGNITUDES, dtype=torch.float64).repeat(2) * torch.tensor([1.0, -1.0]).repeat_interleave(len(NARROW_MAGNITUDES))
    if kind == "rms":
        h = m.unsqueeze(-1)
    else:
        c = 3 * torch.randn(len(m), 1, generator=g, dtype=torch.float64)
        h = c + torch.stack([-m / 2, m / 2], -1)
    w = 1 + 0.5 * torch.randn(h.shape[-1], generator=g, dtype=torch.float64)
    dy = torch.randn(h.shape, generator=g, dtype=torch.float64).bfloat16().double()
    return h, w, dy


def narrow_rows_reference(kind: str, h: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float) -> torch.Tensor:
    """The closed-form float64 input gradient of :func:`narrow_rows`' rows (see ``NARROW_WIDTH``)."""
    g = dy * w
    if kind == "rms":
        return eps * (h.square() + eps) ** -1.5 * g
    d = (h[:, 1:] - h[:, :1]) / 2
    return eps * (d.square() + eps) ** -1.5 * (g - g.mean(-1, keepdim=True))


def assert_narrow_rows_accurate(kind: str, grad: Callable, dtype: torch.dtype, rel_tol: float, eps: float = 1e-5) -> None:
    """``grad(h, weight, dy) -> dh`` (``h`` and ``dy`` in ``dtype``, ``weight`` float32) must give every row of
    :func:`narrow_rows` within ``rel_tol`` of the exact derivative at the same rounded inputs, relative to that
    row's own magnitude (the rows span 18 orders of magnitude), plus the dtype's smallest normal number (float16
    cannot hold the smallest of them)."""
    h64, w64, dy64 = narrow_rows(kind)
    h, w, dy = h64.to(dtype), w64.float(), dy64.to(dtype)
    got = grad(h, w, dy).double()
    want = narrow_rows_reference(kind, h.double(), w.double(), dy.double(), eps)
    allowed = rel_tol * want.abs().amax(-1) + torch.finfo(dtype).smallest_normal
    err = (got - want).abs().amax(-1)
    bad = [(h64[i].tolist(), f"{(err[i] / want[i].abs().max()).item():.1e}") for i in range(len(err)) if not err[i] <= allowed[i]]
    assert not bad, f"{kind} width {h.shape[-1]} {dtype}: rows (h, relative dx error) beyond {rel_tol:.0e}: {bad}"


# --------------------------------------------------------------------------- the input gradient row by row

def row_shares(ours: torch.Tensor, theirs: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row's error as a share of its bound, the 2x-torch rule applied to that row alone (as to a one-row call):
    max |ours - ref| / (2 max |theirs - ref| + :func:`slack` at the row's own magnitude), ``ref`` float64. Shared by
    both norms' per-row checks (and :mod:`ln_lightning.testing.norm_rms`)."""
    scale = ref.abs().amax(-1)
    allowed = 2 * (theirs.double() - ref).abs().amax(-1) + torch.maximum(ABS_SLACK * scale.clamp(min=1.0),
                                                                          torch.finfo(dtype).eps * scale)
    return (ours.double() - ref).abs().amax(-1) / allowed


NEAR_SPAN_SEEDS = (0, 1, 2, 3)


def near_span_rows(width: int, dtype: torch.dtype, seed: int = 0, rows: int = 1024):
    """``(h, weight, dy)``: rows whose weighted upstream gradient ``g = dy * w`` lies within 1e-1 to 1e-3 of
    span{1, x_hat}, where the input gradient's part perpendicular to that span, ``g - mean(g) - q x_hat``, is a small
    difference of large terms. Every other row has ``g`` near ``x_hat`` itself, the others near ``x_hat + c`` with one
    ``c ~ N(0, 1)`` per row (``mean(g)`` large against the result); the first half are constant rows, whose
    rstd = 1/sqrt(eps) ~ 316 magnifies whatever ``g - mean(g)`` loses. ``h`` in ``dtype``, ``weight`` float32, ``dy``
    bfloat16 (the compiled kernel's output dtype: every reference gets the same ``dy``)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, width, generator=g, dtype=torch.float64)
    h[: rows // 2] = h[: rows // 2, :1]  # constant rows
    h = h.to(dtype).double()
    w = (0.5 * torch.randn(width, generator=g, dtype=torch.float64)).float().double()
    n = F.layer_norm(h, (width,), eps=1e-5)
    frac = 10.0 ** -torch.randint(1, 4, (rows, 1), generator=g).double()
    c = torch.randn(rows, 1, generator=g, dtype=torch.float64) * (torch.arange(rows).unsqueeze(-1) % 2)
    dy = (n + c + frac * torch.randn(rows, width, generator=g, dtype=torch.float64)) / w
    return h.to(dtype), w.float(), dy.bfloat16()


def assert_each_row_within_torch_error(grad: Callable, width: int, dtype: torch.dtype = torch.float32,
                                       seeds=NEAR_SPAN_SEEDS, eps: float = 1e-5) -> float:
    """The 2x-torch rule applied to every row of :func:`near_span_rows` (each of ``seeds``) on its own, as if each
    were a one-row call, for the input gradient of ``grad(h, weight, dy) -> dh``: torch is ``F.layer_norm`` in
    float32 with autograd (on ``h`` in float32, the stricter bound for a bfloat16 ``h``), the reference
    :func:`layer_norm_formula` in float64. Returns the worst row's share of its bound (issue 32 found 5.4-6.7 at
    width 2, 1.05-5.8 at 3-8 and 1.2-1.6 at 255-8200 on the compiled kernel, most on constant rows with ``c``; 35 at
    width 1, whose exact derivative is 0)."""

    def torch_grad(h, w, dy, dtype, formula=F.layer_norm):
        x = h.to(dtype).requires_grad_()
        return torch.autograd.grad(formula(x, (width,), w.to(dtype), None, eps), x, dy.to(dtype))[0]

    worst = 0.0
    for seed in seeds:
        h, w, dy = near_span_rows(width, dtype, seed)
        share = row_shares(grad(h, w, dy), torch_grad(h, w, dy, torch.float32),
                           torch_grad(h, w, dy, torch.float64, layer_norm_formula), dtype)
        bad = int(share.argmax())
        assert share[bad] <= 1, (
            f"width {width}, {dtype}, seed {seed}: {int((share > 1).sum())} of {len(share)} rows beyond 2 x torch's "
            f"error, worst {share[bad].item():.2f}x its bound (row {bad}: {'constant' if bad < len(h) // 2 else 'varying'}"
            f"{', g near x_hat + c' if bad % 2 else ', g near x_hat'}; h = {h[bad].tolist()[:8]})")
        worst = max(worst, share[bad].item())
    return worst
