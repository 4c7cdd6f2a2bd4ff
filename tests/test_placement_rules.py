"""What convert must refuse or skip (with the reason), and the guarantees it keeps."""

from __future__ import annotations

import copy
import io
import json
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ln_lightning import PlacementError, Sublayer, convert, inspect_model, register_block
from ln_lightning.demo.models import PostNormTransformerLM, PreNormBlock
from ln_lightning.placement import unregister_block


def _ln(norm, x):
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


class Post(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.fc(x))


class Sandwich(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.ln_in, self.fc, self.ln_out = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return x + self.ln_out(self.fc(self.ln_in(x)))


class Parallel(nn.Module):
    """Both branches read the same normalised stream, added one after the other (Cohere, StableLM)."""

    def __init__(self, d=8):
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.ln(x)
        return x + self.a(h) + self.b(h)


class ParallelSumFirst(Parallel):
    """GPT-J / CodeGen / Falcon: the branches' sum, then the residual."""

    def forward(self, x):
        h = self.ln(x)
        return self.a(h) + self.b(h) + x


class ParallelTwoNorms(Parallel):
    """GPT-NeoX / StableLM parallel: a norm per branch."""

    def __init__(self, d=8):
        super().__init__(d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.a(self.ln(x)) + self.b(self.ln2(x))


class FunctionFirst(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc, self.ln = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.fc(torch.tanh(x)))


class FunctionLast(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc, self.ln = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + torch.tanh(self.fc(x)))


class NoResidual(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc, self.ln = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(self.fc(x))


class DataDependent(nn.Module):
    """Control flow on values: fx can't trace it; register_block can describe it."""

    def __init__(self, d=8):
        super().__init__()
        self.attn, self.ln1 = nn.Linear(d, d), nn.LayerNorm(d)
        self.ffn, self.ln2 = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        if x.sum() > 1e9:
            x = x * 0
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


class TupleBranch(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        if x.sum() > 1e9:  # untraceable, so only a declaration can describe it
            return x
        out = self.attn(x, x, x)
        return self.ln(x + out[0])


class ReturnsExtra(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc, self.ln = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        h = self.fc(x)
        return self.ln(x + h), h


_PRE_FORMULA = {
    Sandwich: lambda o, x: x + o.fc(_ln(o.ln_in, x)),
    Post: lambda o, x: x + o.fc(_ln(o.ln, x)),
    FunctionLast: lambda o, x: x + torch.tanh(o.fc(_ln(o.ln, x))),
    DataDependent: lambda o, x: (lambda s: s + o.ffn(_ln(o.ln2, s)))(x + o.attn(_ln(o.ln1, x))),
    ReturnsExtra: lambda o, x: x + o.fc(_ln(o.ln, x)),
}


def _one(block_cls, **kw):
    report = convert(nn.ModuleList([block_cls(), block_cls()]), "pre", final_norm=False, **kw)
    return report


@pytest.mark.parametrize(
    "cls, status, reason",
    [
        (Post, "converted", ""),
        (PreNormBlock, "already", ""),
        (Sandwich, "converted", ""),  # peri (sandwich) to pre: its output norm passes through
        (FunctionFirst, "skipped", "a function, not a module"),
        # A function at the branch's end needs no hook (only a branch scale would): it converts.
        (FunctionLast, "converted", ""),
        # Control flow on the input stream (fx can't trace it) is read from the forward it runs.
        (DataDependent, "converted", ""),
        # An extra output computed by the branch is the pre-norm branch's value afterwards, like the
        # attention weights Hugging Face layers return.
        (ReturnsExtra, "converted", ""),
    ],
)
def test_block_styles_status_and_reason(cls, status, reason):
    model = nn.ModuleList([cls(8) if cls is PreNormBlock else cls() for _ in range(2)])
    for m in model.modules():  # trained-looking norms, so a misplaced one shows
        if isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1.0, 0.3), nn.init.normal_(m.bias, 0.0, 0.3)
    orig = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        y0 = [m(x) for m in model]
    report = convert(model, "pre", final_norm=False)
    assert [b.status for b in report.blocks] == [status] * 2, str(report)
    assert all(reason in b.reason for b in report.blocks)
    if status == "converted":  # against the pre-norm formula written out with the original modules
        with torch.no_grad():
            for m, o in zip(model, orig):
                y = m(x)
                torch.testing.assert_close(y[0] if isinstance(y, tuple) else y, _PRE_FORMULA[cls](o, x), atol=1e-5, rtol=1e-5)
    if status != "converted":  # untouched, bit for bit
        with torch.no_grad():
            for m, y in zip(model, y0):
                torch.testing.assert_close(m(x), y, atol=0, rtol=0)
        assert not report.changed
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v)


@pytest.mark.parametrize(
    "cls, reason",
    [
        (NoResidual, "no single residual add"),
    ],
)
def test_unreadable_blocks_are_reported_not_guessed(cls, reason):
    model = nn.ModuleList([cls(), cls()])
    report = inspect_model(model)
    assert report.stacks == []
    assert [u.path for u in report.unrecognised] == ["0", "1"]
    assert all(reason in u.reason for u in report.unrecognised), report.unrecognised
    conv = convert(model, "pre")
    assert not conv.changed and any(reason in n for n in conv.notes)
    with pytest.raises(PlacementError, match="not recognised"):
        convert(model, "pre", strict=True)


@pytest.mark.parametrize("cls", [Parallel, ParallelSumFirst, ParallelTwoNorms])
@pytest.mark.parametrize("with_example", [False, True])
def test_parallel_residual_blocks_have_one_status_and_one_rule(cls, with_example):
    """Whatever the order of the adds and whether the branches share a norm: one sublayer, pre-norm,
    parallel. 'pre' leaves it as it is; 'post' is refused (written pre-norm); 'peri' and 'output' are
    refused with the one parallel-residual reason; the model is bit for bit unchanged every time."""
    from ln_lightning.placement.reading.analysis import PARALLEL

    torch.manual_seed(0)
    model = nn.ModuleList([cls(), cls()])
    x = torch.randn(2, 5, 8)
    ex = x if with_example else None

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = model

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    holder = Holder()
    report = inspect_model(holder, example_input=ex)
    assert [[(s.placement, s.parallel) for s in b.sublayers] for b in report.blocks] == [[("pre", True)]] * 2, str(report)
    y0 = holder(x)
    state = {k: v.clone() for k, v in holder.state_dict().items()}
    for placement, status, reason in [("pre", "already", "parallel-residual block"), ("post", "skipped", "can only undo its own rewrite"),
                                      ("peri", "skipped", PARALLEL), ("output", "skipped", PARALLEL)]:
        conv = convert(holder, placement, example_input=ex, final_norm=False)
        assert [(b.status, reason in b.reason) for b in conv.blocks] == [(status, True)] * 2, (placement, str(conv))
        assert not conv.changed
        torch.testing.assert_close(holder(x), y0, atol=0, rtol=0)
        assert holder.state_dict().keys() == state.keys() and all(torch.equal(holder.state_dict()[k], v) for k, v in state.items())


def test_a_post_norm_parallel_block_converts_to_the_shared_norm_form():
    """`N(x + (A(x) + M(x)))` to pre: `x + A(N x) + M(N x)`; the same added one after the other is refused."""

    class PostParallel(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.ln, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x):
            return self.ln(x + (self.a(x) + self.b(x)))

    class PostChained(PostParallel):
        def forward(self, x):
            return self.ln(x + self.a(x) + self.b(x))

    torch.manual_seed(0)
    model = nn.ModuleList([PostParallel()])
    with torch.no_grad():
        model[0].ln.weight.normal_(1.0, 0.3), model[0].ln.bias.normal_(0.0, 0.3)
    orig = copy.deepcopy(model)
    report = convert(model, "pre", final_norm=False)
    assert [b.status for b in report.blocks] == ["converted"], str(report)
    x = torch.randn(2, 5, 8)
    o = orig[0]
    h = F.layer_norm(x, (8,), o.ln.weight, o.ln.bias, o.ln.eps)
    torch.testing.assert_close(model[0](x), x + o.a(h) + o.b(h), atol=1e-6, rtol=1e-6)
    chained = nn.ModuleList([PostChained()])
    report = convert(chained, "pre", final_norm=False)
    assert report.blocks[0].status == "skipped" and "one after another" in report.blocks[0].reason, str(report)


def test_register_block_makes_an_untraceable_block_convertible():
    register_block(DataDependent, [Sublayer(norm="ln1", branch="attn"), Sublayer(norm="ln2", branch="ffn")])
    try:
        torch.manual_seed(0)
        model = nn.ModuleList([DataDependent() for _ in range(2)])
        orig = copy.deepcopy(model)
        report = convert(model, "pre", final_norm=False)
        assert [b.status for b in report.blocks] == ["converted"] * 2
        x = torch.randn(2, 3, 8)
        s = x
        for o in orig:
            s = s + o.attn(_ln(o.ln1, s))
            s = s + o.ffn(_ln(o.ln2, s))
        y = x
        for m in model:
            y = m(y)
        torch.testing.assert_close(y, s, atol=1e-5, rtol=1e-5)
    finally:
        unregister_block(DataDependent)


def test_a_wrong_declaration_is_caught_by_the_probe_check():
    # Norms swapped: the declaration does not describe forward. convert must not report success.
    register_block(DataDependent, [Sublayer(norm="ln2", branch="attn"), Sublayer(norm="ln1", branch="ffn")])
    try:
        model = nn.ModuleList([DataDependent()])
        x = torch.randn(2, 3, 8)
        y0 = model[0](x)
        report = convert(model, "pre", final_norm=False)
        assert report.blocks[0].status == "skipped" and "probe check failed" in report.blocks[0].reason
        torch.testing.assert_close(model[0](x), y0, atol=0, rtol=0)
        with pytest.raises(PlacementError, match="probe check failed"):
            convert(model, "pre", final_norm=False, strict=True)
    finally:
        unregister_block(DataDependent)


def test_a_branch_that_returns_a_tuple_is_skipped_with_the_reason():
    # Read from its forward, it needs no declaration: all of q, k, v get LN(x) and the exit is out[0].
    torch.manual_seed(0)
    model = nn.ModuleList([TupleBranch()])
    orig = copy.deepcopy(model)
    assert convert(model, "pre", final_norm=False).blocks[0].status == "converted"
    x = torch.randn(2, 3, 8)
    o, h = orig[0], _ln(orig[0].ln, x)
    torch.testing.assert_close(model[0](x), x + o.attn(h, h, h)[0], atol=1e-5, rtol=1e-5)
    register_block(TupleBranch, [Sublayer(norm="ln", branch="attn", stream_args=(0, 1, 2))])
    try:
        report = convert(nn.ModuleList([TupleBranch()]), "pre", final_norm=False)
        assert report.blocks[0].status == "skipped"
        assert "returns a tuple" in report.blocks[0].reason
        register_block(TupleBranch, [Sublayer(norm="ln", branch="attn", stream_args=(0, 1, 2), exit_index=0)])
        report = convert(nn.ModuleList([TupleBranch()]), "pre", final_norm=False)
        assert report.blocks[0].status == "converted", str(report)
    finally:
        unregister_block(TupleBranch)


def test_shared_layernorm_between_blocks_is_skipped():
    a, b = Post(), Post()
    b.ln = a.ln
    report = convert(nn.ModuleList([a, b, Post()]), "pre", final_norm=False)
    assert [x.status for x in report.blocks] == ["skipped", "skipped", "converted"]
    assert "shared" in report.blocks[0].reason and "1" in report.blocks[0].reason


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_bad_input_errors_name_the_problem_and_the_fix():
    model = nn.ModuleList([Post()])
    with pytest.raises(PlacementError, match="unknown placement 'sandwich'.*'pre'.*'post'"):
        convert(model, "sandwich")
    with pytest.raises(PlacementError, match="expects a torch.nn.Module, got list"):
        convert([Post()])
    with pytest.raises(PlacementError, match="expects a torch.nn.Module"):
        inspect_model("model")
    with pytest.raises(PlacementError, match="has no LayerNorm.*register_norm_class"):
        convert(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(PlacementError, match="branch_scale.*'depth'"):
        convert(model, branch_scale="huge")
    with pytest.raises(PlacementError, match="branch_scale"):
        convert(model, branch_scale=-1.0)
    with pytest.raises(PlacementError, match="placement='post'"):
        convert(model, "post", branch_scale=0.5)
    with pytest.raises(PlacementError, match="layerscale_init"):
        convert(model, branch_scale=0.5, layerscale_init=0.1)
    with torch.device("meta"):
        meta = nn.ModuleList([Post()])
    with pytest.raises(PlacementError, match="meta device.*to_empty"):
        convert(meta)
    assert inspect_model(meta).blocks[0].placement == "post"  # inspecting needs no weights


# --------------------------------------------------------------------------------------------
# Guarantees
# --------------------------------------------------------------------------------------------


def test_idempotent_and_says_so():
    model = PostNormTransformerLM(128, 16, 2, 2, 8)
    first = convert(model, "pre")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    second = convert(model, "pre")
    assert first.changed and not second.changed
    assert [b.status for b in second.blocks] == ["already", "already"]
    assert "Nothing changed" in str(second)
    assert second.preserves_function
    assert sd.keys() == model.state_dict().keys()


def test_names_tensors_devices_and_dtypes_are_kept():
    model = PostNormTransformerLM(128, 16, 2, 2, 8).double()
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert(model, "pre", branch_scale="layerscale")
    after = dict(model.named_parameters())
    for name, p in params.items():
        assert after[name] is p  # the very same tensors: an optimizer built before still owns them
    new = sorted(set(after) - set(params))
    assert new == ["blocks.0.attn_scale.gamma", "blocks.0.mlp_scale.gamma", "blocks.1.attn_scale.gamma",
                   "blocks.1.mlp_scale.gamma", "blocks_final_norm.bias", "blocks_final_norm.weight"]
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in model.parameters())
    idx = torch.randint(0, 128, (2, 8))
    model(idx).sum().backward()
    opt.step()
    assert model(idx).dtype == torch.float64


def test_existing_final_norm_is_found_and_not_duplicated():
    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList([Post(), Post()])
            self.ln_f = nn.LayerNorm(8)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            for b in self.h:
                x = b(x)
            return self.ln_f(self.drop(x))

    model = GPT()
    assert inspect_model(model).stacks[0].final_norm == "ln_f"
    report = convert(model, "pre")
    assert report.added == []


def test_final_norm_found_by_running_an_untraceable_model():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb_norm = nn.LayerNorm(8)
            self.h = nn.ModuleList([Post(), Post()])
            self.out_norm = nn.LayerNorm(8)

        def forward(self, x):
            if x.sum() > 1e9:
                return x
            x = self.emb_norm(x)
            for b in self.h:
                x = b(x)
            return self.out_norm(x)

    model = Untraceable()
    stack = inspect_model(model).stacks[0]
    assert stack.final_norm is None and not stack.final_norm_known
    assert "unknown" in str(inspect_model(model))
    assert inspect_model(model, example_input=torch.randn(2, 8)).stacks[0].final_norm == "out_norm"
    report = convert(copy.deepcopy(model), "pre")
    assert report.added == [] and any("could not tell" in n for n in report.notes)
    with pytest.raises(PlacementError, match="could not tell"):
        convert(copy.deepcopy(model), "pre", strict=True)
    assert convert(model, "pre", example_input=torch.randn(2, 8)).added == []


def test_converted_model_deepcopies_pickles_and_keeps_its_function():
    torch.manual_seed(0)
    model = PostNormTransformerLM(128, 16, 2, 2, 8)
    convert(model, "pre", branch_scale=0.5)
    idx = torch.randint(0, 128, (2, 8))
    y = model(idx)
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(idx), y)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(idx), y)
    # The copy's hooks point at the copy's own norms: changing the original leaves the copy alone.
    with torch.no_grad():
        model.blocks[0].ln1.weight.mul_(3)
    torch.testing.assert_close(clone(idx), y)
    # pickle (what ddp_spawn uses) round-trips the clone: same function, hooks rebound to its own norms.
    unpickled = pickle.loads(pickle.dumps(clone))
    torch.testing.assert_close(unpickled(idx), y, rtol=0, atol=0)
    with torch.no_grad():
        unpickled.blocks[0].ln1.weight.mul_(3)
    torch.testing.assert_close(clone(idx), y, rtol=0, atol=0)
    assert not torch.equal(unpickled(idx), y)


def test_reports_print_and_serialise():
    model = PostNormTransformerLM(128, 16, 2, 2, 8)
    ins = inspect_model(model)
    text = str(ins)
    assert "blocks.0" in text and "post" in text and "LayerNorms (4)" in text
    d = json.loads(json.dumps(ins.to_dict()))
    assert d["stacks"][0]["depth"] == 2 and d["stacks"][0]["blocks"][0]["placement"] == "post"
    assert d["layernorms"][0] == {"path": "blocks.0.ln1", "kind": "LayerNorm", "shape": [16], "eps": 1e-05, "affine": True, "bias": True}
    rep = convert(model, "pre", example_input=torch.randint(0, 128, (2, 8)))
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["changed"] and d["preserves_function"] is False and d["output_change_scope"] == "model"
    assert "CHANGES the function" in str(rep)


def test_hooks_on_a_deferred_norm_see_what_it_normalises():
    """A LayerNorm monitor's forward hook must see the norm's real input after conversion."""
    torch.manual_seed(0)
    block = Post(8)
    seen_before, seen_after = [], []
    h1 = block.ln.register_forward_hook(lambda m, a, o: seen_before.append((a[0].clone(), o.clone())))
    convert(nn.ModuleList([block]), "pre", final_norm=False)
    h2 = block.ln.register_forward_hook(lambda m, a, o: seen_after.append((a[0].clone(), o.clone())))
    seen_before.clear()
    x = torch.randn(2, 3, 8)
    block(x)
    for seen in (seen_before, seen_after):
        assert len(seen) == 1  # the pass-through call at the user's call site is not reported
        inp, out = seen[0]
        torch.testing.assert_close(inp, x)  # pre-norm: the norm reads the block's input stream
        torch.testing.assert_close(out, _ln(block.ln, x))
    h1.remove(), h2.remove()
    convert(nn.ModuleList([block]), "post")
    assert len(block.ln._forward_hooks) == 0
    seen_before.clear()
    block(x)
    assert seen_before == []


@pytest.mark.slow
def test_converted_model_compiles_without_graph_breaks():
    torch.manual_seed(0)
    model = PostNormTransformerLM(128, 16, 2, 2, 8)
    convert(model, "pre", branch_scale=0.5)
    idx = torch.randint(0, 128, (2, 8))
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # fullgraph: a graph break raises
    torch.testing.assert_close(compiled(idx), model(idx))
