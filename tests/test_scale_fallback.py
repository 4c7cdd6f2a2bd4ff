"""Issue 31, point 7: blocks that reuse one exit module for both branches (one `nn.Dropout`, one activation) take
every branch scale and placement, and a block whose branches can't take the scale falls back, alone and with the
reason, to the plain form (`BlockChange.fallback`), never the whole model to nothing.

Every converted function is checked against the formula written out here by hand with the original model's own
modules (`_reference`), in eval and in training mode (the same dropout masks from the same seed), and the
stream-scaled transition's endpoint against constants computed here from a hand-run post-norm forward.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from transformers import VitsConfig
from transformers.models.vits.modeling_vits import VitsEncoderLayer

from ln_lightning import LNLightningDeprecationWarning
from ln_lightning.placement import PlacementError, convert
from ln_lightning.placement.migrate import transition
from ln_lightning.placement.rewrite.scale import BranchScale, InputScale

from _helpers_transition import rel, trainer

D, VOCAB = 16, 50


# ---------------------------------------------------------------------------------------------- blocks
class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class SharedDropout(nn.Module):
    """One `nn.Dropout` ends both branches (the issue's 16-layer char LM writes its blocks so)."""

    def __init__(self, d=D, p=0.1):
        super().__init__()
        self.attn = Attn(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(p)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        x = self.ln1(x + self.drop(self.attn(x)))
        return self.ln2(x + self.drop(self.mlp(x)))

    def branches(self):
        return [(self.ln1, lambda u: self.drop(self.attn(u))), (self.ln2, lambda u: self.drop(self.mlp(u)))]


class SharedActivation(nn.Module):
    """One activation module ends both branches and is the MLP's inner activation too (three calls)."""

    def __init__(self, d=D):
        super().__init__()
        self.attn = Attn(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.act = nn.Tanh()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        x = self.ln1(x + self.act(self.attn(x)))
        return self.ln2(x + self.act(self.fc2(self.act(self.fc1(x)))))

    def branches(self):
        return [(self.ln1, lambda u: self.act(self.attn(u))), (self.ln2, lambda u: self.act(self.fc2(self.act(self.fc1(u)))))]


class UntoldActivation(SharedActivation):
    """As SharedActivation, but the attention branch's call of the shared activation is given a product, no module's
    output: nothing tells that call from the others at run time, so the block can't take a branch scale."""

    def forward(self, x):
        x = self.ln1(x + self.act(self.attn(x) * 0.5))
        return self.ln2(x + self.act(self.fc2(self.act(self.fc1(x)))))

    def branches(self):
        return [(self.ln1, lambda u: self.act(self.attn(u) * 0.5)), (self.ln2, lambda u: self.act(self.fc2(self.act(self.fc1(u)))))]


class VitsLayer(VitsEncoderLayer):
    """Hugging Face's VITS text encoder layer (post-norm, one `self.dropout` for both branches), as it is."""

    def __init__(self):
        super().__init__(VitsConfig(hidden_size=D, num_attention_heads=2, ffn_dim=2 * D, ffn_kernel_size=3, window_size=2,
                                    hidden_dropout=0.1))

    def branches(self):
        ones = lambda u: torch.ones(*u.shape[:-1], 1)  # noqa: E731 - its padding mask, as the stack passes it
        return [(self.layer_norm, lambda u: self.dropout(self.attention(hidden_states=u)[0])),
                (self.final_layer_norm, lambda u: self.dropout(self.feed_forward(u, ones(u))))]


BLOCKS = {"dropout": SharedDropout, "activation": SharedActivation, "vits": VitsLayer}


class Stack(nn.Module):
    """A post-norm LM over blocks of the given kinds (no final norm, as post-norm code writes it)."""

    def __init__(self, kinds, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([(BLOCKS.get(k) or k)() for k in kinds])
        self.head = nn.Linear(D, VOCAB)
        with torch.no_grad():  # trained-looking gains: the stream's constants C_k well above 1, a misplaced norm shows
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.2, 0.4), m.bias.uniform_(-0.2, 0.2)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            if isinstance(b, VitsLayer):
                x = b(x, padding_mask=torch.ones(*x.shape[:-1], 1))[0]
            else:
                x = b(x)
        return self.head(x)


def ids(seed=1):
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def _added(block, kind):
    return [m for m in block.children() if isinstance(m, kind)]


# ---------------------------------------------------------------------------------------------- the hand-written forms
def _reference(orig: Stack, x, form: str, params: list, final: nn.Module | None = None):
    """The converted function written out from `orig`'s (unconverted) modules: per sublayer k with norm N and branch F,
    pre `s + c_k * F(N(s))`, peri `s + O_k(F(N(s)))`, output `s + N'_k(F(s / c_k))` (N' the norm with gain g_k, bias 0),
    post `N(s + F(s))`; `params[k]`: c_k, O_k (a callable) or (c_k, g_k)."""
    s = orig.emb(x)
    k = 0
    for block in orig.blocks:
        for norm, branch in block.branches():
            p = params[k] if params else None
            if form == "post":
                s = norm(s + branch(s))
            elif form == "pre":
                s = s + p * branch(norm(s))
            elif form == "peri":
                s = s + p(branch(norm(s)))
            else:
                c, g = p
                s = s + F.layer_norm(branch(s / c), norm.normalized_shape, g.expand(norm.normalized_shape), None, norm.eps)
            k += 1
    return orig.head(s if final is None else final(s))


def _both_modes(model, reference_fn, x, tol=1e-6):
    """The model against the hand-written reference in eval and in training mode (same seed: the same dropout masks)."""
    for training in (False, True):
        model.train(training)
        torch.manual_seed(7)
        got = model(x)
        torch.manual_seed(7)
        want = reference_fn(training)
        assert rel(got, want) <= tol, (training, rel(got, want))


CASES = [("pre", "stream"), ("pre", 0.5), ("pre", "layerscale"), ("pre", "depth"), ("peri", "stream"), ("output", "stream")]


@pytest.mark.parametrize("placement,branch_scale", CASES)
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_blocks_sharing_an_exit_module_convert_to_the_formula(kind, placement, branch_scale):
    model = Stack([kind] * 3)
    orig = copy.deepcopy(model)
    report = convert(model, placement, branch_scale=branch_scale, final_norm=False, example_input=ids())
    assert [b.status for b in report.blocks] == ["converted"] * 3, report
    assert not report.fallbacks and all(b.fallback == "" for b in report.blocks)
    # What the conversion added gets distinct values, so a scale or norm on the wrong call (or on none) shows.
    params = []
    with torch.no_grad():
        for block in model.blocks:
            if placement == "pre":
                for scale in _added(block, BranchScale):
                    v = scale.value()
                    v.copy_(torch.empty_like(v).uniform_(0.3, 2.0))
                    params.append(v.detach().clone())
            elif placement == "peri":
                for out in [m for n, m in block.named_children() if n.endswith("_out_norm")]:
                    out.weight.uniform_(0.5, 2.0), out.bias.uniform_(-0.5, 0.5)
                    params.append(_affine_norm(out.weight.clone(), out.bias.clone()))
            else:  # each branch reads x / c, its own norm (moved to the exit) gets a gain
                for entry, (norm, _) in zip(_added(block, InputScale), block.branches()):
                    entry.c.fill_(torch.empty(()).uniform_(0.5, 3.0).item())
                    norm.weight.uniform_(0.5, 2.0), norm.bias.zero_()
                    params.append((entry.c.clone(), norm.weight.detach().clone()))
    assert len(params) == 6  # one per sublayer
    _both_modes(model, lambda training: _reference(orig.train(training), ids(3), placement, params), ids(3))
    # A copy (deepcopy, pickle) computes the same: the exit's call selector travels with it.
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        clone.eval(), model.eval()
        with torch.no_grad():
            assert torch.equal(clone(ids(3)), model(ids(3)))


def _affine_norm(w, b, eps=1e-5):
    return lambda v: F.layer_norm(v, (D,), w, b, eps)


# ---------------------------------------------------------------------------------------------- the per-block fallback
def test_a_block_that_cant_take_the_scale_gets_the_plain_form_alone_with_the_reason():
    model = Stack(["dropout", UntoldActivation, "activation"])
    orig = copy.deepcopy(model)
    report = convert(model, "pre", branch_scale=0.5, final_norm=False, example_input=ids())
    assert [b.status for b in report.blocks] == ["converted"] * 3, report
    assert [b.path for b in report.fallbacks] == ["blocks.1"]
    why = report.blocks[1].fallback
    assert "without branch_scale=0.5" in why and "cannot scale sublayer attn" in why and "blocks.1.act" in why
    assert report.to_dict()["blocks"][1]["fallback"] == why  # the JSON report carries it
    assert "1 of them without the branch scale" in str(report)
    assert _added(model.blocks[1], BranchScale) == [] and len(_added(model.blocks[2], BranchScale)) == 2
    c = [0.5, 0.5, 1.0, 1.0, 0.5, 0.5]  # the fallback block's branches add unscaled
    _both_modes(model, lambda training: _reference(orig.train(training), ids(3), "pre", c), ids(3))
    # strict: the conversion is refused with the reason, and the model is left as it was.
    strict = copy.deepcopy(orig)
    with pytest.raises(PlacementError, match="blocks.1.*can't take branch_scale=0.5.*cannot scale sublayer attn"):
        convert(strict, "pre", branch_scale=0.5, strict=True, example_input=ids())
    with torch.no_grad():
        assert torch.equal(strict.eval()(ids(3)), orig.eval()(ids(3)))


def _trained_constants(orig: Stack, x):
    """From a post-norm forward run here by hand (eval): per site k the ratio sigma_k / mean|gamma_k| of its norm's
    input and the spread of its branch's output (per-token std, averaged); the stream scales C_0 = 1, C_{k+1} =
    C_k * ratio_k."""
    ratios, spreads = [], []
    with torch.no_grad():
        s = orig.emb(x)
        for block in orig.blocks:
            for norm, branch in block.branches():
                b = branch(s)
                h = s + b
                sigma = (h.var(-1, unbiased=False) + norm.eps).sqrt().mean()
                ratios.append((sigma / norm.weight.abs().mean()).item())
                spreads.append(b.std(-1, unbiased=False).mean().item())
                s = norm(h)
    c = [1.0]
    for r in ratios:
        c.append(c[-1] * r)
    return c, spreads


# (A fallback block under peri or output: no module ends its untold branch, so there is no exit for their norm;
# it is skipped with the reason, tested below.)
TRANSITION_CASES = [pytest.param(kinds, placement, id=f"{name}-{placement}")
                    for name, kinds in [("dropout", ["dropout"] * 3), ("activation", ["activation"] * 3)]
                    for placement in ("pre", "peri", "output")]
TRANSITION_CASES.append(pytest.param(["dropout", UntoldActivation, "dropout"], "pre", id="fallback-pre"))


@pytest.mark.parametrize("kinds,placement", TRANSITION_CASES)
def test_stream_scaled_transition_is_exact_at_both_ends(kinds, placement):
    model = Stack(kinds).eval()
    orig = copy.deepcopy(model)
    x, probe = ids(3), ids(1)
    torch.manual_seed(7)
    post = model.train()(x)
    report = transition.begin(model, placement, branch_scale="stream", example_input=probe)
    assert [b.status for b in report.blocks] == ["converted"] * 3, report
    assert [b.path for b in report.fallbacks] == (["blocks.1"] if UntoldActivation in kinds else [])
    model.eval()
    assert transition.measure_stream_scales(model, lambda: model(probe)) is None  # measured, not the plain blend
    torch.manual_seed(7)
    assert torch.equal(model.train()(x), post)  # blend 0, training mode (dropout): bit for bit the trained function
    transition.set_blend(model, 1.0)
    c, spreads = _trained_constants(orig.eval(), probe)
    last_norm = orig.blocks[-1].branches()[-1][0]
    final = copy.deepcopy(last_norm)  # the final norm convert adds: a copy of the norm that fed the head
    if placement == "pre":
        # Every norm is a site, the fallback block's too: its branches add unscaled, the later ones count its division.
        params = [1.0 if kinds[k // 2] is UntoldActivation else c[k] for k in range(6)]
    elif placement == "peri":
        params = [_affine_norm(torch.full((D,), c[k] * spreads[k]), torch.zeros(D)) for k in range(6)]
    else:
        params = [(c[k], torch.full((D,), c[k] * spreads[k])) for k in range(6)]
    _both_modes(model, lambda training: _reference(orig.train(training), x, placement, params, final), x, tol=1e-5)
    if UntoldActivation in kinds:  # the constants without the fallback block's norms would be another function
        skipped = [1.0, c[1], 1.0, 1.0, c[2], c[2] * c[5] / c[4]]
        with torch.no_grad():
            assert rel(model.eval()(x), _reference(orig.eval(), x, "pre", skipped, final)) > 1e-3
    model.eval()
    with torch.no_grad():
        at_one = model(x)
        transition.finish(model)
        assert torch.equal(model(x), at_one) and transition.leftovers(model) == []


@pytest.mark.parametrize("placement", ["peri", "output"])
def test_peri_and_output_skip_only_the_block_without_an_exit_and_say_why(placement):
    model = Stack(["dropout", UntoldActivation, "dropout"])
    report = convert(model, placement, branch_scale="stream", example_input=ids())
    assert [b.status for b in report.blocks] == ["converted", "skipped", "converted"], report
    assert "blocks.1.act is called 3 times" in report.blocks[1].reason and "no module whose output can be normalised" in report.blocks[1].reason


# ---------------------------------------------------------------------------------------------- the plugin
class StackLM(LightningModule):
    def __init__(self, kinds=("dropout", UntoldActivation, "dropout")):
        super().__init__()
        self.model = Stack(list(kinds))

    def forward(self, x):
        return self.model(x)

    def training_step(self, b, batch_idx):
        x, y = b
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("spelling", ["transition_steps", "open", "closed"])
def test_the_default_transition_converts_blocks_that_share_an_exit_module(spelling, tmp_path):
    import warnings

    from ln_lightning import TransitionSpec
    from ln_lightning.plugin import LNPlacement

    module = StackLM()
    x = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=4)
    options = {"transition_steps": dict(transition_steps=4),  # as the issue ran it (deprecated since)
               "open": dict(transition=TransitionSpec(steps=4, tolerance=None)),
               "closed": dict(transition=4)}[spelling]  # the closed loop, the default now
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LNLightningDeprecationWarning)
        plugin = LNPlacement("pre", fused=False, log_report=False, **options)
    trainer(tmp_path, plugin, max_steps=6).fit(module, train_dataloaders=data)
    report = plugin.report
    assert [b.status for b in report.blocks] == ["converted"] * 3, report
    assert [b.path for b in report.fallbacks] == ["model.blocks.1"]
    if spelling != "closed":  # (the closed loop ends when the drift allows)
        assert transition.active(module) is None and transition.leftovers(module) == []
    # The shared-dropout blocks took their measured stream scales (C_k > 1 after the first site), the fallback none.
    scales = [float(s.c) for b in module.model.blocks for s in _added(b, BranchScale)]
    assert len(scales) == 4 and scales[0] == 1.0 and all(v > 1.0 for v in scales[1:])
    assert _added(module.model.blocks[1], BranchScale) == []


def test_a_transition_with_a_fallback_block_resumes_and_loads_mid_way(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ln_lightning import TransitionSpec
    from ln_lightning.plugin import LNPlacement, load_converted

    def lm():  # without dropout: a resumed run draws other masks (Lightning does not restore the RNG)
        torch.manual_seed(0)
        module = StackLM()
        for m in module.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return module

    x = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=4)
    plugin = lambda: LNPlacement("pre", fused=False, log_report=False,  # noqa: E731
                                 transition=TransitionSpec(steps=4, tolerance=None, endpoint_fraction=0.0))
    straight = lm()
    trainer(tmp_path / "a", plugin(), max_steps=6).fit(straight, train_dataloaders=data)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    first = lm()
    trainer(tmp_path / "b", plugin(), max_steps=2, callbacks=[ckpt]).fit(first, train_dataloaders=data)
    path = next((tmp_path / "ck").glob("*step=2*.ckpt"))
    loaded = load_converted(lm(), path)  # mid-way: the blend, the measured scales, the unscaled sites
    assert transition.get_blend(loaded) == 0.5
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), first.eval()(x))
    resumed = lm()
    trainer(tmp_path / "c", plugin(), max_steps=6).fit(resumed, train_dataloaders=data, ckpt_path=path)
    a, b = straight.state_dict(), resumed.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-6, atol=1e-7), k
