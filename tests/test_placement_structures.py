"""convert() on every recognised structure, against independently built references.

Each reference is a model written the other way (pre-norm code, or torch's `norm_first=True`) that
loads the converted model's state_dict strictly: equal outputs mean the rewrite computes exactly
the promised function, and equal keys mean parameter names were kept.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ln_lightning import convert, inspect_model
from ln_lightning.demo.models import MLP, CausalSelfAttention, PostNormTransformerLM

TOL = dict(atol=1e-5, rtol=1e-5)


def _modes():
    return ["train", "eval"]


def _set_mode(m, mode):
    m.train(mode == "train")
    return m


# --------------------------------------------------------------------------------------------
# 1. The demo LM: hand-written post-norm blocks in a ModuleList (two sublayers each)
# --------------------------------------------------------------------------------------------


class RefPreNormBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.attn = CausalSelfAttention(d, h)
        self.ln1 = nn.LayerNorm(d)
        self.mlp = MLP(d, 4 * d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class RefPreNormLM(nn.Module):
    def __init__(self, vocab=128, d=32, n=3, h=4, block_size=16):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(RefPreNormBlock(d, h) for _ in range(n))
        self.blocks_final_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.blocks_final_norm(x))


@pytest.mark.parametrize("mode", _modes())
def test_demo_lm_matches_prenorm_reference(mode):
    torch.manual_seed(0)
    model = PostNormTransformerLM(128, 32, 3, 4, 16)
    idx = torch.randint(0, 128, (3, 16))
    report = convert(model, "pre")
    assert [b.status for b in report.blocks] == ["converted"] * 3
    assert report.added == ["blocks_final_norm"]
    assert not report.preserves_function and report.output_change > 0.01
    ref = RefPreNormLM()
    ref.load_state_dict(model.state_dict(), strict=True)
    _set_mode(model, mode), _set_mode(ref, mode)
    torch.testing.assert_close(model(idx), ref(idx), **TOL)


def test_post_pre_post_restores_original_exactly():
    torch.manual_seed(0)
    model = PostNormTransformerLM(128, 32, 3, 4, 16).eval()
    idx = torch.randint(0, 128, (2, 16))
    before = model(idx)
    keys = list(model.state_dict())
    convert(model, "pre")
    assert not torch.allclose(model(idx), before)
    back = convert(model, "post")
    assert [b.status for b in back.blocks] == ["converted"] * 3
    assert back.removed == ["blocks_final_norm"]
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(idx), before, atol=0, rtol=0)
    assert [b.placement for b in inspect_model(model).blocks] == ["post"] * 3


def test_gradients_flow_through_the_converted_model_like_the_reference():
    torch.manual_seed(0)
    model = PostNormTransformerLM(128, 32, 2, 4, 16)
    convert(model, "pre")
    ref = RefPreNormLM(n=2)
    ref.load_state_dict(model.state_dict())
    idx = torch.randint(0, 128, (2, 16))
    model(idx).square().mean().backward()
    ref(idx).square().mean().backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


# --------------------------------------------------------------------------------------------
# 2-4. torch's Transformer layers, against norm_first=True built by torch itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", _modes())
def test_transformer_encoder_matches_norm_first(batch_first, mode):
    torch.manual_seed(0)
    d, nhead = 32, 4
    make = lambda nf: nn.TransformerEncoder(  # noqa: E731
        nn.TransformerEncoderLayer(d, nhead, 64, dropout=0.0, batch_first=batch_first, norm_first=nf),
        3, norm=nn.LayerNorm(d) if nf else None, enable_nested_tensor=False,
    )
    model = make(False)
    report = convert(model, "pre")
    assert [b.status for b in report.blocks] == ["converted"] * 3 and report.added == ["norm"]
    ref = make(True)
    ref.load_state_dict(model.state_dict(), strict=True)
    _set_mode(model, mode), _set_mode(ref, mode)
    shape = (2, 7, d) if batch_first else (7, 2, d)
    x = torch.randn(*shape)
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, -2:] = True
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), **TOL)
        torch.testing.assert_close(model(x, mask=causal, src_key_padding_mask=pad), ref(x, mask=causal, src_key_padding_mask=pad), **TOL)


def test_transformer_decoder_and_full_transformer_match_norm_first():
    torch.manual_seed(0)
    d = 32
    model = nn.Transformer(d, 4, 2, 2, 64, dropout=0.0, batch_first=True)
    report = convert(model, "pre")
    assert len(report.blocks) == 4 and all(b.status == "converted" for b in report.blocks)
    assert report.added == []  # nn.Transformer always has encoder and decoder final norms
    ref = nn.Transformer(d, 4, 2, 2, 64, dropout=0.0, batch_first=True, norm_first=True)
    ref.load_state_dict(model.state_dict(), strict=True)
    src, tgt = torch.randn(2, 6, d), torch.randn(2, 5, d)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(5)
    for mode in _modes():
        _set_mode(model, mode), _set_mode(ref, mode)
        torch.testing.assert_close(model(src, tgt, tgt_mask=tgt_mask), ref(src, tgt, tgt_mask=tgt_mask), **TOL)
    convert(model, "post")
    plain = nn.Transformer(d, 4, 2, 2, 64, dropout=0.0, batch_first=True)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(src, tgt), plain(src, tgt), **TOL)


def test_transformer_decoder_stack_gets_final_norm():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0)
    model = nn.TransformerDecoder(layer, 2)
    report = convert(model, "pre")
    assert report.added == ["norm"] and isinstance(model.norm, nn.LayerNorm)
    ref = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, norm_first=True), 2, norm=nn.LayerNorm(16))
    ref.load_state_dict(model.state_dict())
    tgt, mem = torch.randn(5, 2, 16), torch.randn(6, 2, 16)
    torch.testing.assert_close(model(tgt, mem), ref(tgt, mem), **TOL)


def test_eval_fast_path_is_exercised_and_correct():
    """In eval with no grad, torch runs its fused fast path for pre-norm layers; it must agree."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False)
    convert(model, "pre")
    model.eval()
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True), 2, norm=nn.LayerNorm(32), enable_nested_tensor=False).eval()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 7, 32)
    with torch.inference_mode():
        fast = model(x)
    manual = x
    with torch.no_grad():
        for layer in ref.layers:  # the formula, written out
            manual = manual + layer._sa_block(layer.norm1(manual), None, None)
            manual = manual + layer._ff_block(layer.norm2(manual))
        manual = ref.norm(manual)
    torch.testing.assert_close(fast, manual, **TOL)


# --------------------------------------------------------------------------------------------
# 5-8. Other user-written post-norm styles, each against its pre-norm formula written by hand
# --------------------------------------------------------------------------------------------


class SeqBlock(nn.Module):
    """One sublayer, branch is an nn.Sequential; blocks live in an nn.Sequential."""

    def __init__(self, d):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.ff(x))


class MHABlock(nn.Module):
    """nn.MultiheadAttention takes the stream three times and returns a tuple (indexed)."""

    def __init__(self, d):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)
        self.drop = nn.Dropout(0.0)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x, mask=None):
        x = self.ln(x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0])
        x = self.ln2(x + self.drop(self.fc2(torch.relu(self.fc1(x)))))
        return x


class InPlaceAddBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)

    def forward(self, x):
        h = self.lin(x)
        x = h + x  # branch first, stream second
        return self.norm(x)


def _ref_seq(block, x):
    return x + block.ff(F.layer_norm(x, block.norm.normalized_shape, block.norm.weight, block.norm.bias, block.norm.eps))


def _ln(norm, x):
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


class SeqNet(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.body = nn.Sequential(*[SeqBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.body(x))


def test_sequential_stack_of_single_sublayer_blocks():
    torch.manual_seed(0)
    d = 16
    model = SeqNet(d, 4)
    orig = copy.deepcopy(model)
    report = convert(model, "pre")
    assert [b.status for b in report.blocks] == ["converted"] * 4
    assert report.added == ["body_final_norm"]
    x = torch.randn(2, 5, d)
    s = x
    for blk in orig.body:
        s = _ref_seq(blk, s)
    expected = orig.head(_ln(model.body_final_norm, s))
    torch.testing.assert_close(model(x), expected, **TOL)
    # The added norm starts as a copy of the norm that fed the head before.
    torch.testing.assert_close(model.body_final_norm.weight, orig.body[3].norm.weight)


def test_root_sequential_stack_gets_its_final_norm_on_its_last_block():
    """The model itself is the Sequential: its last block holds the final norm (a container would run
    an added child as a layer) and applies it to its output, once, before the head."""
    torch.manual_seed(0)
    model = nn.Sequential(*[SeqBlock(8) for _ in range(3)], nn.Linear(8, 2))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.3), m.bias.normal_(0.0, 0.3)
    orig = copy.deepcopy(model)
    report = convert(model, "pre")
    assert [b.status for b in report.blocks] == ["converted"] * 3 and report.added == ["2.final_norm"], str(report)
    assert len(model) == 4 and [type(m) for m in model] == [type(m) for m in orig]
    x = torch.randn(2, 5, 8)
    s = x
    for blk in orig[:3]:
        s = s + blk.ff(F.layer_norm(s, (8,), blk.norm.weight, blk.norm.bias, blk.norm.eps))
    final = model[2].final_norm
    torch.testing.assert_close(final.weight, orig[2].norm.weight)  # a copy of the last block's norm
    expected = orig[3](F.layer_norm(s, (8,), final.weight, final.bias, final.eps))
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", _modes())
def test_mha_block_with_mask(mode):
    torch.manual_seed(0)
    d = 16
    model = nn.ModuleList([MHABlock(d) for _ in range(2)])
    orig = copy.deepcopy(model)
    report = convert(model, "pre", final_norm=False)
    assert [b.status for b in report.blocks] == ["converted"] * 2
    x = torch.randn(2, 6, d)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    for m in (model, orig):
        _set_mode(m, mode)
    s_model, s_ref = x, x
    for blk, o in zip(model, orig):
        s_model = blk(s_model, mask)
        h = _ln(o.ln, s_ref)
        s_ref = s_ref + o.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        s_ref = s_ref + o.drop(o.fc2(torch.relu(o.fc1(_ln(o.ln2, s_ref)))))
    torch.testing.assert_close(s_model, s_ref, **TOL)


def test_branch_first_add_and_no_affine_norm():
    torch.manual_seed(0)
    block = InPlaceAddBlock(8)
    orig = copy.deepcopy(block)
    report = convert(nn.ModuleList([block]), "pre", final_norm=False)
    assert report.blocks[0].status == "converted"
    x = torch.randn(3, 8) * 4 + 2
    torch.testing.assert_close(block(x), x + orig.lin(_ln(orig.norm, x)), **TOL)


# --------------------------------------------------------------------------------------------
# Branch scaling
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.5, "depth", "layerscale"])
def test_branch_scale(scale):
    torch.manual_seed(0)
    d, L = 16, 4
    model = nn.ModuleList([SeqBlock(d) for _ in range(L)])
    orig = copy.deepcopy(model)
    report = convert(model, "pre", branch_scale=scale, final_norm=False)
    assert all(b.status == "converted" for b in report.blocks)
    c = {0.5: 0.5, "depth": 1 / (2 * L) ** 0.5, "layerscale": 0.1}[scale]
    x = torch.randn(2, 3, d)
    s_model, s_ref = x, x
    for blk, o in zip(model, orig):
        s_model = blk(s_model)
        s_ref = s_ref + c * o.ff(_ln(o.norm, s_ref))
    torch.testing.assert_close(s_model, s_ref, **TOL)
    if scale == "layerscale":
        names = [n for n, _ in model.named_parameters() if "scale" in n]
        assert names == [f"{i}.ff_scale.gamma" for i in range(L)]
        assert report.added == [f"{i}.ff_scale" for i in range(L)]


def test_layerscale_default_init_follows_depth_rule():
    for depth, init in [(12, 0.1), (24, 1e-5), (36, 1e-6)]:
        model = nn.ModuleList([SeqBlock(4) for _ in range(depth)])
        convert(model, "pre", branch_scale="layerscale", final_norm=False)
        assert torch.all(model[0].ff_scale.gamma == torch.tensor(init))
    model = nn.ModuleList([SeqBlock(4) for _ in range(3)])
    convert(model, "pre", branch_scale="layerscale", layerscale_init=0.3, final_norm=False)
    assert torch.allclose(model[2].ff_scale.gamma, torch.full((4,), 0.3))


def test_scaled_torch_layers_match_formula_in_eval_and_train():
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False)
    orig = copy.deepcopy(model)
    convert(model, "pre", branch_scale=0.25, final_norm=False)
    x = torch.randn(2, 5, 16)
    for mode in _modes():
        _set_mode(model, mode), _set_mode(orig, mode)
        s = x
        for layer in orig.layers:
            s = s + 0.25 * layer._sa_block(layer.norm1(s), None, None)
            s = s + 0.25 * layer._ff_block(layer.norm2(s))
        with torch.no_grad():
            torch.testing.assert_close(model(x), s, **TOL)


# --------------------------------------------------------------------------------------------
# Hugging Face BERT (hf extra)
# --------------------------------------------------------------------------------------------


def test_hf_bert_encoder_matches_prenorm_formula():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(cfg).eval()
    orig = copy.deepcopy(model)
    ids = torch.randint(0, 50, (2, 7))
    report = convert(model, "pre", example_input={"input_ids": ids})
    assert [b.status for b in report.blocks] == ["converted", "converted"], str(report)
    assert report.added == ["encoder.layer_final_norm"]
    # At BERT's init (std 0.02) branches are small, so the change is small, but it is measured and reported.
    assert report.output_change_scope == "model" and report.output_change > 0 and not report.preserves_function
    assert report.notes == []
    with torch.no_grad():
        s = orig.embeddings(input_ids=ids)
        for layer in orig.encoder.layer:
            a = layer.attention
            h = a.self(_ln(a.output.LayerNorm, s))[0]
            s = s + a.output.dropout(a.output.dense(h))
            i = layer.intermediate(_ln(layer.output.LayerNorm, s))
            s = s + layer.output.dropout(layer.output.dense(i))
        s = _ln(model.encoder.layer_final_norm, s)
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, s, **TOL)
    convert(model, "post")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, orig(input_ids=ids).last_hidden_state, atol=0, rtol=0)
