"""DeepNorm (placement="deepnorm") and LayerNorm Scaling (norm_scale="depth") on existing models (issue 34, point 3).

Each exactness check compares with a reference the product does not compute: the unconverted model itself, and
the formula (DeepNorm's `LN(alpha x + G'(x))`, LayerNorm Scaling's `x + F(LN(x)/sqrt(l))`) written out here in
float64 with the converted weights on fresh, unhooked modules.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F

import ln_lightning
from ln_lightning import LNPlacement, PlacementSpec, TransitionSpec, convert, inspect_model
from ln_lightning.demo import PostNormTransformerLM
from ln_lightning.demo.lightning import CharLM
from ln_lightning.placement.errors import PlacementError
from ln_lightning.plugin import load_converted
from ln_lightning.testing import plugin as h


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _lm(n_layers=3, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return PostNormTransformerLM(vocab_size=50, d_model=32, n_layers=n_layers, n_heads=2, block_size=16).to(dtype).eval()


def _deepnorm_lm_reference(state: dict, idx: torch.Tensor, n_layers: int, alpha: float, eps_factor: float) -> torch.Tensor:
    """DeepNorm's formula for the demo LM, by hand in float64 on a fresh unhooked model holding the converted weights:
    x <- LN(alpha x + attn'(x)); x <- LN(alpha x + mlp'(x)), the norms' eps times `eps_factor`."""
    fresh = PostNormTransformerLM(vocab_size=50, d_model=32, n_layers=n_layers, n_heads=2, block_size=16).double()
    fresh.load_state_dict({k: v.double() for k, v in state.items() if not k.endswith("ln_lightning_placement")})
    with torch.no_grad():
        x = fresh.tok_emb(idx) + fresh.pos_emb(torch.arange(idx.shape[1]))
        for b in fresh.blocks:
            x = F.layer_norm(alpha * x + b.attn(x), (32,), b.ln1.weight, b.ln1.bias, b.ln1.eps * eps_factor)
            x = F.layer_norm(alpha * x + b.mlp(x), (32,), b.ln2.weight, b.ln2.bias, b.ln2.eps * eps_factor)
        return fresh.head(x)


def test_deepnorm_alpha_is_the_papers():
    from ln_lightning.placement.rewrite.deepnorm import deepnorm_alpha
    assert deepnorm_alpha(6) == pytest.approx(12 ** 0.25) and deepnorm_alpha(1) == pytest.approx(math.sqrt(math.sqrt(2)))


def test_deepnorm_on_the_demo_lm_is_the_trained_function_and_deepnorms_formula():
    model = _lm(dtype=torch.float64)
    idx = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(idx)
    report = convert(model, "deepnorm", example_input=idx)
    assert [b.status for b in report.blocks] == ["converted"] * 3 and report.preserves_function, str(report)
    alpha = (2 * 3) ** 0.25
    with torch.no_grad():
        after = model(idx)
    assert _rel(after, before) < 1e-12  # the trained function at the switch (float64: rounding only)
    state = model.state_dict()
    # DeepNorm's formula with the norms' eps times alpha^2 (ln_lightning's eps handling) is the converted model.
    assert _rel(after, _deepnorm_lm_reference(state, idx, 3, alpha, alpha ** 2)) < 1e-12
    # With the norms' own eps, DeepNorm's formula differs by an eps-sized amount only.
    eps_gap = _rel(after, _deepnorm_lm_reference(state, idx, 3, alpha, 1.0))
    assert 1e-9 < eps_gap < 1e-4  # (2.8e-6 here: activations of unit scale, eps 1e-5)
    # The alpha is in the weights (G' = alpha G), not only in a constant: the training dynamics change.
    torch.testing.assert_close(model.blocks[0].mlp.out.weight, alpha * _lm(dtype=torch.float64).blocks[0].mlp.out.weight)
    assert [b.placement for b in inspect_model(model, example_input=idx).blocks] == ["deepnorm"] * 3


def test_deepnorm_float32_error_against_the_unconverted_model():
    model = _lm()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(2))
    convert(model, "deepnorm", example_input=idx)
    with torch.no_grad():
        assert _rel(model(idx), ref(idx)) < 1e-5


def test_deepnorm_on_torch_post_norm_layers_against_the_formula():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=False)
    enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).double().eval()
    original = copy.deepcopy(enc)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    report = convert(enc, "deepnorm", example_input=x)
    assert len(report.converted) == 4 and report.preserves_function, str(report)
    alpha = 8 ** 0.25
    with torch.no_grad():
        got = enc(x)
        assert _rel(got, original(x)) < 1e-12
        # DeepNorm by hand, on fresh layers holding the converted weights (alpha in out_proj and linear2).
        s = x
        for converted in enc.layers:
            fresh = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).double().eval()
            fresh.load_state_dict(converted.state_dict())
            eps = fresh.norm1.eps * alpha ** 2
            a = fresh.self_attn(s, s, s, need_weights=False)[0]
            s = F.layer_norm(alpha * s + a, (16,), fresh.norm1.weight, fresh.norm1.bias, eps)
            f = fresh.linear2(F.relu(fresh.linear1(s)))
            s = F.layer_norm(alpha * s + f, (16,), fresh.norm2.weight, fresh.norm2.bias, fresh.norm2.eps * alpha ** 2)
        assert _rel(got, s) < 1e-12
    torch.testing.assert_close(enc.layers[0].linear2.bias, alpha * original.layers[0].linear2.bias)


def test_deepnorm_on_a_hugging_face_bert_and_its_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100)
    bert = transformers.BertModel(cfg).eval()
    original = copy.deepcopy(bert)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    report = convert(bert, "deepnorm")
    assert len(report.converted) == 3 and report.preserves_function, str(report)
    alpha = 6 ** 0.25
    with torch.no_grad():
        got = bert(ids).last_hidden_state
        assert _rel(got, original(ids).last_hidden_state) < 1e-5
    dense = bert.encoder.layer[1].output.dense
    torch.testing.assert_close(dense.weight, alpha * original.encoder.layer[1].output.dense.weight)
    ln_lightning.save_pretrained(bert, tmp_path / "bert")
    loaded = ln_lightning.from_pretrained(tmp_path / "bert")
    assert LNPlacement.applied_config(loaded)["placement"] == "deepnorm"
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, got)


def test_deepnorm_on_bart_whose_branch_ends_in_its_linear():
    """BART's fc2 is its branch's exit (the dropout is a function): the 1/alpha hook and the folded weight sit on one
    module. Each stack (encoder, decoder: 2 blocks) gets its own alpha."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bart = transformers.BartModel(transformers.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100, max_position_embeddings=64)).eval()
    original = copy.deepcopy(bart)
    report = convert(bart, "deepnorm")
    assert len(report.converted) == 4 and report.preserves_function, str(report)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert _rel(bart(ids).last_hidden_state, original(ids).last_hidden_state) < 1e-5
    torch.testing.assert_close(bart.decoder.layers[1].fc2.weight, 4 ** 0.25 * original.decoder.layers[1].fc2.weight)


def test_deepnorm_back_to_post_is_the_model_as_written():
    model = _lm()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 50, (2, 12))
    convert(model, "deepnorm", example_input=idx)
    report = convert(model, "post", example_input=idx)
    assert len(report.converted) == 3 and report.preserves_function, str(report)
    assert not [n for n, _ in model.named_modules() if n.endswith("_scale")]
    torch.testing.assert_close(model.blocks[2].attn.proj.weight, ref.blocks[2].attn.proj.weight, rtol=1e-6, atol=0)
    assert ln_lightning.LNPlacement.applied_config(model) is None  # back to the model as written


def test_deepnorm_refuses_pre_norm_blocks_with_the_reason():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True), 2,
                                enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    report = convert(enc, "deepnorm", example_input=x)
    assert not report.changed and [b.status for b in report.blocks] == ["skipped"] * 2
    assert "pre-norm as written" in report.blocks[0].reason and "placement='pre'" in report.blocks[0].reason
    with pytest.raises(PlacementError, match="pre-norm as written"):
        convert(enc, "deepnorm", example_input=x, strict=True)
    # A model ln_lightning made pre-norm: back to post first.
    model = _lm()
    convert(model, "pre")
    report = convert(model, "deepnorm")
    assert not report.converted and "convert(model, 'post')" in report.blocks[0].reason


def test_deepnorm_blocks_refuse_other_placements_until_undone():
    model = _lm()
    convert(model, "deepnorm")
    report = convert(model, "pre")
    assert not report.converted and "divides alpha back out" in report.blocks[0].reason


def test_deepnorm_options_refused_with_the_fix():
    with pytest.raises(PlacementError, match="use branch_scale=None with placement='deepnorm'"):
        PlacementSpec("deepnorm", branch_scale="depth")
    with pytest.raises(PlacementError, match="needs no transition.*Drop the transition"):
        PlacementSpec("deepnorm", transition=TransitionSpec(steps=10))
    with pytest.raises(ValueError, match="needs no transition"):
        LNPlacement("deepnorm", transition=10)


def test_deepnorm_config_round_trips():
    spec = PlacementSpec("deepnorm")
    assert spec.config == {"placement": "deepnorm", "final_norm": True, "branch_scale": None}
    assert PlacementSpec.from_config(spec.config) == spec
    model = _lm()
    convert(model, spec)
    assert PlacementSpec.from_config(LNPlacement.applied_config(model)) == spec


def _trainer(root, steps, callbacks=()):
    return Trainer(accelerator="cpu", devices=1, max_steps=steps, num_sanity_val_steps=0, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                   enable_checkpointing=bool(callbacks), callbacks=list(callbacks), default_root_dir=str(root),
                   plugins=[LNPlacement("deepnorm", fused=False, log_report=False)])


def test_a_deepnorm_fit_resumes_from_a_checkpoint_to_the_same_function(tmp_path):
    # 12 samples in batches of 4: a checkpoint every 3 steps is an epoch's end, so the resumed fit sees the same data.
    seed_everything(0)
    model = CharLM(**h.TINY)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    _trainer(tmp_path, 6, [every]).fit(model, h.loader(12))
    mid = tmp_path / "step=3.ckpt"
    entry = torch.load(mid, weights_only=True)["ln_lightning"]
    assert entry["config"] == {"placement": "deepnorm", "final_norm": True, "branch_scale": None}
    assert PlacementSpec.from_config(entry["config"]) == PlacementSpec("deepnorm")
    seed_everything(0)
    resumed = CharLM(**h.TINY)
    _trainer(tmp_path / "again", 6).fit(resumed, h.loader(12), ckpt_path=str(mid))
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    model.eval()
    resumed.eval()
    with torch.no_grad():
        assert torch.equal(resumed(idx), model(idx))
        assert torch.equal(load_converted(CharLM, tmp_path / "step=6.ckpt")(idx), model(idx))
    alpha = 4 ** 0.25  # two blocks
    assert resumed.model.blocks[0].attn_scale.c.item() == pytest.approx(1 / alpha)


class _PreNormEncoder(CharLM):
    """A LightningModule whose blocks are pre-norm as written (torch's norm_first=True layers)."""

    def __init__(self):
        super().__init__(**h.TINY)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.example_input_array = torch.zeros(2, 16, dtype=torch.long)

    def forward(self, idx):
        return self.model.head(self.encoder(self.model.tok_emb(idx)))


def test_lnplacement_deepnorm_on_a_pre_norm_model_stops_the_fit(tmp_path):
    with pytest.raises(PlacementError, match="changed nothing.*pre-norm as written"):
        _trainer(tmp_path, 1).fit(_PreNormEncoder(), h.loader(4))


def build_encoder():
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                 enable_nested_tensor=False)


def test_inspect_cli_shows_what_deepnorm_would_change(capsys, monkeypatch):
    from pathlib import Path

    from ln_lightning.cli import main
    monkeypatch.chdir(Path(__file__).parent.parent)
    assert main(["inspect", "tests.test_deepnorm_ln_scaling:build_encoder", "--placement", "deepnorm"]) == 0
    out = capsys.readouterr().out
    assert "layers.0  converted  post -> deepnorm" in out and "The model computes the same function as before." in out


# ------------------------------------------------------------------------------------------ LayerNorm Scaling
LNS = PlacementSpec("pre", norm_scale="depth")


def _lns_lm_reference(state: dict, idx: torch.Tensor, n_layers: int) -> torch.Tensor:
    """LayerNorm Scaling's pre-norm formula for the demo LM, by hand in float64 on a fresh unhooked model holding the
    converted weights: x <- x + attn(ln1(x)/sqrt(l)); x <- x + mlp(ln2(x)/sqrt(l)); logits = head(LN_final(x))."""
    fresh = PostNormTransformerLM(vocab_size=50, d_model=32, n_layers=n_layers, n_heads=2, block_size=16).double()
    own = set(fresh.state_dict())
    fresh.load_state_dict({k: v.double() for k, v in state.items() if k in own})
    with torch.no_grad():
        x = fresh.tok_emb(idx) + fresh.pos_emb(torch.arange(idx.shape[1]))
        for l, b in enumerate(fresh.blocks, start=1):
            x = x + b.attn(b.ln1(x) / math.sqrt(l))
            x = x + b.mlp(b.ln2(x) / math.sqrt(l))
        x = F.layer_norm(x, (32,), state["blocks_final_norm.weight"].double(), state["blocks_final_norm.bias"].double(), 1e-5)
        return fresh.head(x)


def test_ln_scaling_on_the_demo_lm_is_the_papers_formula_and_says_it_changes_the_function():
    model = _lm(n_layers=4, dtype=torch.float64)
    idx = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(5))
    report = convert(model, LNS, example_input=idx)
    assert [b.status for b in report.blocks] == ["converted"] * 4
    with torch.no_grad():
        got = model(idx)
    assert _rel(got, _lns_lm_reference(model.state_dict(), idx, 4)) < 1e-12
    # Not function-preserving, and the report says so plainly.
    assert not report.preserves_function and report.output_change > 1e-3
    text = str(report)
    assert "CHANGES the function" in text and "training-dynamics choice" in text and "1/sqrt(l)" in text
    assert model.blocks[3].ln2_norm_scale.c.item() == pytest.approx(0.5)


def test_ln_scaling_on_torch_layers_against_the_formula():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 3,
                                enable_nested_tensor=False).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    report = convert(enc, LNS, example_input=x)
    assert len(report.converted) == 3 and not report.preserves_function
    with torch.no_grad():
        got = enc(x)
        s = x
        for l, converted in enumerate(enc.layers, start=1):
            fresh = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).double().eval()
            fresh.load_state_dict(converted.state_dict())
            z = fresh.norm1(s) / math.sqrt(l)
            s = s + fresh.self_attn(z, z, z, need_weights=False)[0]
            s = s + fresh.linear2(F.relu(fresh.linear1(fresh.norm2(s) / math.sqrt(l))))
        s = F.layer_norm(s, (16,), enc.norm.weight, enc.norm.bias, enc.norm.eps)
        assert _rel(got, s) < 1e-12


def test_branch_scale_depth_keeps_its_meaning():
    model = _lm(n_layers=8)
    convert(model, PlacementSpec("pre", branch_scale="depth"))
    assert model.blocks[5].attn_scale.c.item() == pytest.approx(1 / math.sqrt(16))  # 1/sqrt(2L), every block
    assert not [n for n, _ in model.named_modules() if n.endswith("_norm_scale")]


def test_ln_scaling_config_round_trips_and_old_configs_read_without_it():
    assert LNS.config == {"placement": "pre", "final_norm": True, "branch_scale": None, "norm_scale": "depth"}
    assert PlacementSpec.from_config(LNS.config) == LNS
    assert PlacementSpec.from_config({"placement": "pre", "final_norm": True, "branch_scale": None}).norm_scale is None
    model = _lm()
    convert(model, LNS)
    assert PlacementSpec.from_config(LNPlacement.applied_config(model)) == LNS
    # Back to post-norm: the scales go with the rewrite.
    convert(model, "post")
    assert not [n for n, _ in model.named_modules() if "norm_scale" in n] and LNPlacement.applied_config(model) is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(placement="post"), "use one of those, or drop norm_scale with placement='post'"),
    (dict(placement="deepnorm"), "drop norm_scale with placement='deepnorm'"),
    (dict(placement="peri"), "with placement 'pre' or 'mix'"),
    (dict(branch_scale="depth"), "two depth scalings of the same branches: drop branch_scale"),
    (dict(branch_scale="stream"), "drop branch_scale"),
    (dict(transition=10), "drop the transition"),
])
def test_ln_scaling_contradictions_are_refused_with_the_fix(kwargs, match):
    with pytest.raises(PlacementError, match=match):
        PlacementSpec(**{"placement": "pre", "norm_scale": "depth", **kwargs})


def test_ln_scaling_unknown_value_is_refused():
    with pytest.raises(PlacementError, match="unknown norm_scale 'sqrt'; valid values are None and 'depth'"):
        PlacementSpec("pre", norm_scale="sqrt")


def test_ln_scaling_on_a_model_pre_norm_as_built_against_scaled_gains():
    """GPT-2 as built is pre-norm: LayerNorm Scaling goes on its blocks where they are. Reference: the same model with
    each block's ln_1 / ln_2 gain and bias multiplied by 1/sqrt(l), by hand (LN(x) s = (w s) x_hat + b s)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=4, n_head=2, vocab_size=100,
                                                          n_positions=32)).double().eval()
    reference = copy.deepcopy(gpt2)
    with torch.no_grad():
        for l, block in enumerate(reference.h, start=1):
            for norm in (block.ln_1, block.ln_2):
                norm.weight.mul_(1 / math.sqrt(l))
                norm.bias.mul_(1 / math.sqrt(l))
    report = convert(gpt2, LNS)
    assert [b.status for b in report.blocks] == ["already"] * 4 and len(report.added) == 8
    assert "LayerNorm Scaling added" in report.blocks[3].reason and not report.preserves_function
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert _rel(gpt2(ids).last_hidden_state, reference(ids).last_hidden_state) < 1e-12
    assert LNPlacement.applied_config(gpt2)["norm_scale"] == "depth"


def test_lnplacement_puts_ln_scaling_on_a_pre_norm_model(tmp_path):
    model = _PreNormEncoder()
    Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
            plugins=[LNPlacement(LNS, fused=False, log_report=False)]).fit(model, h.loader(4))
    layer = model.encoder.layers[1]
    assert layer.norm1_norm_scale.c.item() == pytest.approx(1 / math.sqrt(2))
    x = torch.randn(2, 5, 32)
    model.eval()
    with torch.no_grad():
        got = layer(x)
        fresh = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=True).eval()
        fresh.load_state_dict(layer.state_dict())
        z = fresh.norm1(x) / math.sqrt(2)
        s = x + fresh.self_attn(z, z, z, need_weights=False)[0]
        s = s + fresh.linear2(F.relu(fresh.linear1(fresh.norm2(s) / math.sqrt(2))))
    assert _rel(got, s) < 1e-5


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_ln_scaling_exports_and_loads_back(tmp_path, family):
    """A converted BERT (norms moved to the branch input) and GPT-2 as built (norms where its forward calls them):
    ln_lightning.from_pretrained and the remote code (trust_remote_code) give the saved function, LN Scaling included."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "bert":
        model = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                                               intermediate_size=64, vocab_size=100)).eval()
    else:
        model = transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=100,
                                                               n_positions=32, bos_token_id=0, eos_token_id=0)).eval()
    unscaled = copy.deepcopy(model)
    convert(model, LNS if family == "gpt2" else PlacementSpec("pre", final_norm=False, norm_scale="depth"))
    ln_lightning.save_pretrained(model, tmp_path / family)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(8))
    loaded = ln_lightning.from_pretrained(tmp_path / family)
    remote = transformers.AutoModel.from_pretrained(tmp_path / family, trust_remote_code=True).eval()
    with torch.no_grad():
        want = model(ids).last_hidden_state
        assert torch.equal(loaded(ids).last_hidden_state, want)
        assert torch.equal(remote(ids).last_hidden_state, want)
        if family == "gpt2":  # the scale is in what was saved: without it the same weights give another function
            assert _rel(unscaled(ids).last_hidden_state, want) > 1e-2
    assert LNPlacement.applied_config(loaded)["norm_scale"] == "depth"


def _lns_trainer(root, steps, callbacks=()):
    return Trainer(accelerator="cpu", devices=1, max_steps=steps, num_sanity_val_steps=0, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                   enable_checkpointing=bool(callbacks), callbacks=list(callbacks), default_root_dir=str(root),
                   plugins=[LNPlacement(LNS, fused=False, log_report=False)])


def test_an_ln_scaling_fit_resumes_from_a_checkpoint_to_the_same_function(tmp_path):
    seed_everything(0)
    model = CharLM(**h.TINY)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    _lns_trainer(tmp_path, 6, [every]).fit(model, h.loader(12))
    mid = tmp_path / "step=3.ckpt"
    entry = torch.load(mid, weights_only=True)["ln_lightning"]
    assert PlacementSpec.from_config(entry["config"]) == LNS
    seed_everything(0)
    resumed = CharLM(**h.TINY)
    _lns_trainer(tmp_path / "again", 6).fit(resumed, h.loader(12), ckpt_path=str(mid))
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    model.eval()
    resumed.eval()
    with torch.no_grad():
        assert torch.equal(resumed(idx), model(idx))
        loaded = load_converted(CharLM, tmp_path / "step=6.ckpt")
        assert torch.equal(loaded(idx), model(idx))
    assert loaded.model.blocks[1].ln1_norm_scale.c.item() == pytest.approx(1 / math.sqrt(2))


def test_inspect_cli_takes_norm_scale(capsys, monkeypatch):
    from pathlib import Path

    from ln_lightning.cli import main
    monkeypatch.chdir(Path(__file__).parent.parent)
    assert main(["inspect", "tests.test_deepnorm_ln_scaling:build_encoder", "--placement", "pre", "--norm-scale", "depth"]) == 0
    out = capsys.readouterr().out
    assert "norm_scale='depth'" in out and "training-dynamics choice" in out
