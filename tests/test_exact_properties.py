"""Property: on generated pre-norm stacks (with and without biases, LayerNorms with and without gain and bias,
random depth and width, an Embedding or a Linear reading float features, a position parameter or none, MLP or
attention branches), `to_rmsnorm` and `fold_norms` each leave the model's output as it was (float32, relative
1e-5, against a deep copy taken before) and every norm they don't rewrite is named with a reason.

Which norms must be rewritten is known from the generated spec, not read from the product: with a final norm and
nothing else reading the stream, every LayerNorm becomes an RMSNorm; without a final norm (the head reads the
stream) or with a branch reading the stream directly (`leaky`), none can. `fold_norms` folds every norm with a
gain or bias whose output only linear layers read, and refuses the one a block also adds to its stream
(`resid_norm`)."""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ln_lightning.exact import fold_norms, to_rmsnorm

TOL = 1e-5
V, T = 11, 5


class Block(nn.Module):
    def __init__(self, d, kind, bias, ln_affine, ln_bias, variant):
        super().__init__()
        self.kind, self.variant = kind, variant
        self.ln = nn.LayerNorm(d, elementwise_affine=ln_affine, bias=ln_bias)
        if kind == "mlp":
            self.fc1, self.fc2 = nn.Linear(d, 2 * d, bias=bias), nn.Linear(2 * d, d, bias=bias)
        else:
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=bias) for _ in range(4))
        if variant == "leaky":
            self.side = nn.Linear(d, d, bias=bias)

    def forward(self, x):
        h = self.ln(x)
        if self.kind == "mlp":
            y = self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        else:
            a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / h.shape[-1] ** 0.5, dim=-1)
            y = self.o(a @ self.v(h))
        out = x + y
        if self.variant == "leaky":
            out = out + self.side(x)  # a branch that reads the stream itself, not through a norm
        if self.variant == "resid_norm":
            out = out + h  # the norm's output is written into the stream
        return out


class Stack(nn.Module):
    def __init__(self, d, blocks, embed, pos, final_norm, ln_affine, ln_bias):
        super().__init__()
        self.embed = nn.Embedding(V, d) if embed == "embedding" else nn.Linear(3, d)
        self.pos = nn.Parameter(torch.randn(1, T, d)) if pos else None
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(d, elementwise_affine=ln_affine, bias=ln_bias) if final_norm else None
        self.head = nn.Linear(d, V)

    def forward(self, x):
        s = self.embed(x)
        if self.pos is not None:
            s = s + self.pos
        for b in self.blocks:
            s = b(s)
        return self.head(self.norm(s) if self.norm is not None else s)


@st.composite
def stacks(draw):
    d = draw(st.integers(4, 12))
    depth = draw(st.integers(1, 3))
    bias, ln_affine, ln_bias = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    variants = draw(st.lists(st.sampled_from(["plain", "plain", "leaky", "resid_norm"]), min_size=depth, max_size=depth))
    kinds = draw(st.lists(st.sampled_from(["mlp", "attn"]), min_size=depth, max_size=depth))
    embed, pos, final_norm = draw(st.sampled_from(["embedding", "linear"])), draw(st.booleans()), draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    blocks = [Block(d, k, bias, ln_affine, ln_bias, v) for k, v in zip(kinds, variants)]
    model = Stack(d, blocks, embed, pos, final_norm, ln_affine, ln_bias)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.3) + 0.5 * torch.randn(p.shape))
    x = torch.randint(0, V, (2, T)) if embed == "embedding" else torch.randn(2, T, 3)
    spec = dict(final_norm=final_norm, variants=variants, any_affine=ln_affine)  # without affine, no bias either
    return model.eval(), x, spec


def _exact(model, ref, x, report):
    # The example input (which the rewrite measures itself on) and a fresh one it never saw.
    fresh = torch.randint(0, V, x.shape) if x.dtype == torch.long else torch.randn(x.shape)
    for inp in (x, fresh):
        with torch.no_grad():
            got, want = model(inp), ref(inp)
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= TOL, f"{err:.2e}\n{report}"
    for n in report.norms:
        assert n.changed or n.reason, str(report)  # every norm left alone says why
        assert not n.changed or (n.error is not None and n.error <= TOL), str(report)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stacks())
def test_to_rmsnorm_is_exact_or_refuses(case):
    model, x, spec = case
    ref = copy.deepcopy(model)
    report = to_rmsnorm(model, x)
    _exact(model, ref, x, report)
    actions = {n.action for n in report.norms}
    if spec["final_norm"] and set(spec["variants"]) == {"plain"}:
        assert actions == {"to_rmsnorm"}, str(report)
    if not spec["final_norm"] or "leaky" in spec["variants"]:
        assert actions == {"refused"}, str(report)
    for n in report.norms:
        if n.action == "to_rmsnorm":
            assert isinstance(model.get_submodule(n.name), nn.RMSNorm)
        else:
            assert type(model.get_submodule(n.name)) is nn.LayerNorm


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stacks())
def test_fold_norms_is_exact_or_refuses(case):
    model, x, spec = case
    ref = copy.deepcopy(model)
    report = fold_norms(model, x)
    _exact(model, ref, x, report)
    rows = {n.name: n for n in report.norms}
    for i, v in enumerate(spec["variants"]):
        row = rows[f"blocks.{i}.ln"]
        if not spec["any_affine"]:
            assert row.action == "skipped", str(report)
        elif v == "resid_norm":
            assert row.action == "refused" and "`add`" in row.reason, str(report)
        else:
            assert row.action == "folded", str(report)
    if spec["final_norm"] and spec["any_affine"]:
        assert rows["norm"].action == "folded" and rows["norm"].reason == "into head", str(report)
    for n in report.norms:
        if n.action == "folded":
            m = model.get_submodule(n.name)
            assert m.weight is None and m.bias is None and not m.elementwise_affine
