"""`to_rmsnorm` and `fold_norms` against references the product does not compute: Hugging Face GPT-2 and ViT built
from small configs, and the demo LM after `convert(..., "pre")`, each compared with a deep copy of itself taken
before the rewrite (eval mode, float32). Norm gains and biases and every bias are randomised first, so that
neither the centring nor the fold is a no-op (Hugging Face initialises gains to 1 and biases to 0)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from ln_lightning import convert
from ln_lightning.demo.models import PostNormTransformerLM
from ln_lightning.exact import FusedRMSNormWithBias, RMSNormWithBias, fold_norms, stream, to_rmsnorm
from ln_lightning.norm import FusedRMSNorm

T = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

TOL = 1e-5


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # gains around 1, biases around 0.3 (a mean the centring must remove)
                base = 1.0 if name.endswith("weight") else 0.3
                p.copy_(base + 0.5 * torch.randn(p.shape, generator=g))
    return model.eval()


def rel_error(after, before) -> float:
    return float((after - before).abs().max() / before.abs().max())


def gpt2(tie: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=97, n_positions=16, n_layer=2, n_embd=32, n_head=4, tie_word_embeddings=tie,
                       use_cache=False, bos_token_id=0, eos_token_id=0)
    return randomise(T.GPT2LMHeadModel(cfg))


def vit() -> nn.Module:
    torch.manual_seed(0)
    cfg = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
                      patch_size=4, num_channels=3)
    return randomise(T.ViTModel(cfg))


def demo_pre() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = randomise(PostNormTransformerLM(vocab_size=50, d_model=32, n_layers=2, n_heads=4, block_size=16))
    x = torch.randint(0, 50, (2, 16))
    convert(model, "pre", example_input=x)
    return model, x


GPT2_INPUT = {"input_ids": torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(1))}
VIT_INPUT = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _check(model, ref, x, report, out=lambda o: o, expect=None):
    with torch.no_grad():
        got, want = out(model(**x) if isinstance(x, dict) else model(x)), out(ref(**x) if isinstance(x, dict) else ref(x))
    assert rel_error(got, want) <= TOL, str(report)
    assert report.output_error is not None and report.output_error <= TOL
    if expect is not None:
        assert [n.action for n in report.norms] == [expect] * len(report.norms), str(report)
    for n in report.changed:
        assert n.error is not None and n.error <= TOL, str(report)
    return got


# -- to_rmsnorm ----------------------------------------------------------------------------------------------


def test_to_rmsnorm_gpt2_untied_is_exact():
    model = gpt2(tie=False)
    ref = copy.deepcopy(model)
    report = to_rmsnorm(model, GPT2_INPUT)
    _check(model, ref, GPT2_INPUT, report, lambda o: o.logits, expect="to_rmsnorm")
    assert len(report.norms) == 5
    assert sum(isinstance(m, nn.RMSNorm) for m in model.modules()) == 5  # each of the 5 LayerNorms
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    assert isinstance(model.transformer.ln_f, RMSNormWithBias)  # the LayerNorm's bias is kept
    assert any("exact in eval mode" in n for n in report.notes)  # GPT-2's resid_pdrop: training is not exact
    # The writers are centred: every row of wte and of each c_proj's output has mean zero.
    assert model.transformer.wte.weight.mean(1).abs().max() < 1e-6
    assert model.transformer.h[0].mlp.c_proj.weight.mean(1).abs().max() < 1e-6


def test_to_rmsnorm_gpt2_tied_refuses_with_the_tie():
    model = gpt2(tie=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = to_rmsnorm(model, GPT2_INPUT)
    assert [n.action for n in report.norms] == ["refused"] * 5
    for n in report.norms:
        assert n.name.startswith("transformer.") and "tied" in n.reason and "wte.weight" in n.reason, n.reason
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(m) is nn.LayerNorm for m in model.modules() if isinstance(m, nn.LayerNorm))


def test_to_rmsnorm_vit_is_exact():
    model = vit()
    ref = copy.deepcopy(model)
    report = to_rmsnorm(model, VIT_INPUT)
    _check(model, ref, VIT_INPUT, report, lambda o: o.last_hidden_state, expect="to_rmsnorm")
    with torch.no_grad():
        assert rel_error(model(VIT_INPUT).pooler_output, ref(VIT_INPUT).pooler_output) <= TOL
    assert "embeddings.cls_token" in report.changed_parameters  # a parameter written into the stream as it is
    assert "embeddings.patch_embeddings.projection.weight" in report.changed_parameters  # a Conv2d writer


def test_to_rmsnorm_opt_learned_positions_are_a_centrable_writer():
    """OPT's learned positions are an Embedding subclass whose forward adds an offset to the positions before its
    lookup; what it writes is still rows of its own weight, so centring them is exact (it was refused: "`embedding`
    writes into it, and only what ... Embedding ... writes is centred"). Checked on the example input and on a
    longer one (other positions) against the model as built."""
    torch.manual_seed(0)
    cfg = T.OPTConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                      max_position_embeddings=32, word_embed_proj_dim=32, do_layer_norm_before=True)
    model = randomise(T.OPTForCausalLM(cfg))
    ref = copy.deepcopy(model)
    x = {"input_ids": torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(1))}
    report = to_rmsnorm(model, x, untie=True)
    _check(model, ref, x, report, lambda o: o.logits, expect="to_rmsnorm")
    longer = {"input_ids": torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))}
    _check(model, ref, longer, report, lambda o: o.logits)
    assert model.model.decoder.embed_positions.weight.mean(1).abs().max() < 1e-6


def test_an_embedding_that_rescales_its_weight_is_not_a_centred_writer():
    """A subclass that looks up a function of its weight (here 2 x weight, a tensor that is not the parameter): the
    rows it writes are not rows of the parameter it would centre, so the norm it feeds is refused."""

    class Doubled(nn.Embedding):
        def forward(self, ids):
            return nn.functional.embedding(ids, 2 * self.weight)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.ln, self.head = Doubled(50, 32), nn.LayerNorm(32), nn.Linear(32, 50)

        def forward(self, ids):
            return self.head(self.ln(self.emb(ids)))

    model = randomise(Model())
    report = to_rmsnorm(model, torch.randint(0, 50, (2, 8)))
    assert [n.action for n in report.norms] == ["refused"], str(report)


def test_an_embedding_subclass_that_renormalises_its_rows_itself_is_not_a_centred_writer():
    """A subclass that passes max_norm to the lookup itself (the module's own max_norm is None): the lookup rescales
    the rows it reads to that norm, in place, so centring changes how much it rescales a row the example input never
    read. The example reads only rows under the norm (exact there), so the measured error can't show it: refused."""

    class Renormed(nn.Embedding):
        def forward(self, ids):
            return nn.functional.embedding(ids, self.weight, None, 1.0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.ln, self.head = Renormed(8, 16), nn.Embedding(4, 16), nn.LayerNorm(16), nn.Linear(16, 8)

        def forward(self, ids):
            return self.head(self.ln(self.tok(ids) + self.pos(torch.arange(ids.shape[1]))))

    model = randomise(Model()).eval()
    with torch.no_grad():
        model.tok.weight[:4] *= 0.1 / model.tok.weight[:4].norm(dim=-1, keepdim=True)  # the example's rows: under max_norm
        model.tok.weight[4:] = 5 * model.tok.weight[4:] + 3  # over it, with a mean centring would take out
    ref, unread = copy.deepcopy(model), torch.tensor([[4, 5, 6, 7]])
    report = to_rmsnorm(model, torch.tensor([[0, 1, 2, 3]]))
    assert [n.action for n in report.norms] == ["refused"], str(report)
    assert "max_norm" in report.norms[0].reason
    with torch.no_grad():
        assert torch.equal(model(unread), ref(unread))


@pytest.mark.parametrize("fused", [False, True])
def test_to_rmsnorm_demo_lm_after_convert_is_exact(fused):
    model, x = demo_pre()
    ref = copy.deepcopy(model)
    report = to_rmsnorm(model, x, fused=fused)
    _check(model, ref, x, report, expect="to_rmsnorm")
    assert len(report.norms) == 5  # two per block and the final norm convert added
    want = FusedRMSNormWithBias if fused else RMSNormWithBias
    assert all(isinstance(m, want) for m in model.modules() if isinstance(m, nn.RMSNorm))
    assert isinstance(model.blocks[0].ln1, FusedRMSNorm if fused else nn.RMSNorm)
    # Still the converted model: its post-norm call sites pass the stream through.
    from ln_lightning.placement import is_deferred
    assert is_deferred(model.blocks[0].ln1)


def test_to_rmsnorm_refuses_every_norm_of_a_post_norm_model():
    torch.manual_seed(0)
    model = randomise(PostNormTransformerLM(vocab_size=50, d_model=32, n_layers=2, n_heads=4, block_size=16))
    x = torch.randint(0, 50, (2, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = to_rmsnorm(model, x)
    assert [n.name for n in report.norms] == ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2"]
    assert [n.action for n in report.norms] == ["refused"] * 4
    # The first norm: its writers are centrable, but the first block's attention reads the stream directly.
    assert "blocks.0.attn.qkv" in report.norms[0].reason
    for n, prev in zip(report.norms[1:], report.norms):
        assert f"output of norm {prev.name}" in n.reason and "post-norm" in n.reason, n.reason
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "blocks.0.ln1" in str(report) and "refused" in str(report)


def test_to_rmsnorm_undoes_an_inexact_rewrite(monkeypatch):
    """The self-check: without the centring the RMSNorms are not exact; the rewrite raises and leaves the model as it was."""
    model, x = demo_pre()
    ref = copy.deepcopy(model)
    monkeypatch.setattr(stream, "centre", lambda w: None)
    with pytest.raises(RuntimeError, match="restored"):
        to_rmsnorm(model, x)
    assert type(model.blocks_final_norm) is nn.LayerNorm
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_to_rmsnorm_needs_an_example_input():
    with pytest.raises(ValueError, match="example_input"):
        to_rmsnorm(PostNormTransformerLM(vocab_size=10, d_model=8, n_layers=1, n_heads=2, block_size=4))


# -- fold_norms ----------------------------------------------------------------------------------------------


def test_fold_norms_gpt2_untied_is_exact():
    model = gpt2(tie=False)
    ref = copy.deepcopy(model)
    report = fold_norms(model, GPT2_INPUT)
    _check(model, ref, GPT2_INPUT, report, lambda o: o.logits)
    assert [n.action for n in report.norms] == ["folded"] * 4 + ["refused"]
    # ln_f's bias would need a bias on lm_head, which GPT-2 has not: from_pretrained would drop it, silently
    assert report.norms[-1].reason.startswith("its bias would go into lm_head, which GPT2LMHeadModel builds without")
    assert model.lm_head.bias is None and not report.added_parameters
    ln = model.transformer.h[0].ln_1
    assert ln.weight is None and ln.bias is None and not ln.elementwise_affine


def test_fold_norms_gpt2_tied_refuses_the_final_norm():
    model = gpt2(tie=True)
    ref = copy.deepcopy(model)
    report = fold_norms(model, GPT2_INPUT)
    _check(model, ref, GPT2_INPUT, report, lambda o: o.logits)
    assert [n.action for n in report.norms] == ["folded"] * 4 + ["refused"]
    assert report.norms[-1].name == "transformer.ln_f"
    assert "lm_head.weight is tied to transformer.wte.weight" in report.norms[-1].reason
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight) and model.lm_head.weight is model.transformer.wte.weight


def test_fold_norms_vit_refuses_the_norm_the_model_returns():
    model = vit()
    ref = copy.deepcopy(model)
    report = fold_norms(model, VIT_INPUT)
    _check(model, ref, VIT_INPUT, report, lambda o: o.last_hidden_state)
    assert [n.action for n in report.norms] == ["folded"] * 4 + ["refused"]
    assert report.norms[0].reason == "into layers.0.attention.k_proj, layers.0.attention.q_proj, layers.0.attention.v_proj"
    assert report.norms[-1].name == "layernorm" and report.norms[-1].reason == "its output is the model's output"


def test_fold_norms_demo_lm_after_convert_is_exact():
    model, x = demo_pre()
    ref = copy.deepcopy(model)
    report = fold_norms(model, x)
    _check(model, ref, x, report, expect="folded")
    assert report.norms[0].reason == "into blocks.0.attn.qkv"


def test_to_rmsnorm_then_fold_norms_leaves_bare_rmsnorms():
    """The FlashNorm form: RMSNorms without weights, their gains and biases in the next linear layers."""
    model, x = demo_pre()
    ref = copy.deepcopy(model)
    r1 = to_rmsnorm(model, x)
    r2 = fold_norms(model, x)
    _check(model, ref, x, r2, expect="folded")
    assert len(r1.changed) == 5
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 5 and all(m.weight is None and m.bias is None for m in norms)


def test_fold_norms_refuses_a_post_norm_model():
    torch.manual_seed(0)
    model = randomise(PostNormTransformerLM(vocab_size=50, d_model=32, n_layers=2, n_heads=4, block_size=16))
    x = torch.randint(0, 50, (2, 16))
    ref = copy.deepcopy(model)
    report = fold_norms(model, x)
    # Each block's norms feed the next sublayer's residual add as well as its branch: refused. The last one
    # feeds only the head (post-norm has no final norm): that one folds.
    assert [n.action for n in report.norms] == ["refused"] * 3 + ["folded"], str(report)
    for n in report.norms[:-1]:
        assert "not only by linear layers" in n.reason and "`add`" in n.reason, n.reason
    assert report.norms[-1].name == "blocks.1.ln2" and report.norms[-1].reason == "into head"
    _check(model, ref, x, report)


def test_to_rmsnorm_refuses_when_the_model_returns_the_stream():
    """GPT2Model with output_hidden_states returns the stream itself: centring it would show; without, it converts."""
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=97, n_positions=16, n_layer=2, n_embd=32, n_head=4, use_cache=False)
    model = randomise(T.GPT2Model(cfg))
    ref = copy.deepcopy(model)
    report = to_rmsnorm(model, {**GPT2_INPUT, "output_hidden_states": True})
    assert [n.action for n in report.norms] == ["refused"] * 5
    assert all("reaches the model's output" in n.reason for n in report.norms), str(report)
    report = to_rmsnorm(model, GPT2_INPUT)
    _check(model, ref, GPT2_INPUT, report, lambda o: o.last_hidden_state, expect="to_rmsnorm")


def test_to_rmsnorm_weights_load_into_the_original_architecture():
    """The centred weights keep the LayerNorm model's state_dict keys, and its LayerNorms compute the same function
    on the now mean-zero stream: the rewritten model ships as a plain GPT-2."""
    model = gpt2(tie=False)
    ref = copy.deepcopy(model)
    to_rmsnorm(model, GPT2_INPUT)
    plain = T.GPT2LMHeadModel(model.config).eval()
    plain.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        assert rel_error(plain(**GPT2_INPUT).logits, ref(**GPT2_INPUT).logits) <= TOL


def test_fused_rmsnorm_then_fold_norms():
    model, x = demo_pre()
    ref = copy.deepcopy(model)
    to_rmsnorm(model, x, fused=True)
    report = fold_norms(model, x)
    _check(model, ref, x, report, expect="folded")
    assert all(m.weight is None for m in model.modules() if isinstance(m, FusedRMSNorm))


def test_untie_gpt2_as_built_then_both_rewrites_ship_through_hugging_face(tmp_path):
    """GPT-2 as built ties wte and lm_head: with untie=True lm_head keeps the original embedding as its own copy,
    wte is centred, every norm becomes an RMSNorm; the config no longer ties them, so save / load keeps both."""
    model = gpt2(tie=True)
    ref = copy.deepcopy(model)
    report = to_rmsnorm(model, GPT2_INPUT, untie=True)
    _check(model, ref, GPT2_INPUT, report, lambda o: o.logits, expect="to_rmsnorm")
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)
    assert model.config.tie_word_embeddings is False
    assert any("untied: lm_head.weight" in n for n in report.notes), str(report)
    model.save_pretrained(tmp_path)
    loaded = T.GPT2LMHeadModel.from_pretrained(tmp_path).eval()  # the plain LayerNorm architecture
    with torch.no_grad():
        assert rel_error(loaded(**GPT2_INPUT).logits, ref(**GPT2_INPUT).logits) <= TOL


def test_untie_lets_fold_norms_fold_the_final_norm_into_a_tied_head(tmp_path):
    model = gpt2(tie=True)
    with torch.no_grad():
        model.transformer.ln_f.bias.zero_()  # as built: lm_head gets only a zero bias, which a reload may drop
    ref = copy.deepcopy(model)
    report = fold_norms(model, GPT2_INPUT, untie=True)
    _check(model, ref, GPT2_INPUT, report, lambda o: o.logits, expect="folded")
    assert report.norms[-1].reason == "into lm_head" and report.added_parameters == ["lm_head.bias"]
    assert torch.equal(model.transformer.wte.weight, ref.transformer.wte.weight)  # the embedding is left as it was
    assert not torch.equal(model.lm_head.weight, ref.lm_head.weight)
    model.save_pretrained(tmp_path)
    loaded = T.GPT2LMHeadModel.from_pretrained(tmp_path).eval()  # missing gains load as 1 and 0: the same function
    with torch.no_grad():
        assert rel_error(loaded(**GPT2_INPUT).logits, ref(**GPT2_INPUT).logits) <= TOL


def test_fold_norms_hugging_face_llama_rmsnorm():
    """FlashNorm's case: Llama's RMSNorm class (recognised from its forward) folds into q/k/v, gate/up and the head;
    its class has no form without a gain, so the gain is set to 1. to_rmsnorm leaves it: already an RMSNorm."""
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    model = randomise(T.LlamaForCausalLM(cfg))
    ref = copy.deepcopy(model)
    assert {n.reason for n in to_rmsnorm(model, GPT2_INPUT).norms} == {"already an RMSNorm"}
    report = fold_norms(model, GPT2_INPUT)
    _check(model, ref, GPT2_INPUT, report, lambda o: o.logits, expect="folded")
    assert report.norms[0].reason.startswith("into model.layers.0.self_attn.k_proj, model.layers.0.self_attn.q_proj, "
                                             "model.layers.0.self_attn.v_proj")
    assert torch.equal(model.model.norm.weight, torch.ones(32))


def test_bert_post_norm_only_the_embedding_norm_becomes_an_rmsnorm():
    """BERT is post-norm: each block's norms read the previous norm's output and are refused, naming it. Its
    embedding LayerNorm reads the sum of three embedding tables only, which centre exactly."""
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    model = randomise(T.BertModel(cfg))
    ref = copy.deepcopy(model)
    report = to_rmsnorm(model, GPT2_INPUT)
    _check(model, ref, GPT2_INPUT, report, lambda o: o.last_hidden_state)
    assert [n.name for n in report.changed] == ["embeddings.LayerNorm"]
    assert report.norms[1].reason == ("its input includes the output of norm embeddings.LayerNorm, which is not "
                                      "centred by construction (a post-norm stream)")


def test_x_transformers_wrapped_layernorms():
    """x-transformers' LayerNorm wraps a bare nn.LayerNorm and multiplies by its own gamma: the bare one becomes an
    RMSNorm (read as the innermost normalisation), the wrapper class is refused by name."""
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = randomise(xt.TransformerWrapper(num_tokens=50, max_seq_len=16, attn_layers=xt.Decoder(dim=32, depth=2, heads=4)))
    x = torch.randint(0, 50, (2, 8))
    ref = copy.deepcopy(model)
    report = to_rmsnorm(model, x)
    _check(model, ref, x, report)
    assert {n.name for n in report.changed} == {n.name for n in report.norms if n.name.endswith(".ln")}
    assert len(report.changed) == 5
    wrappers = [n for n in report.norms if not n.name.endswith(".ln")]
    assert all("x_transformers.x_transformers.LayerNorm" in n.reason for n in wrappers)


class _TorchEncoderLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32), enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


@pytest.mark.parametrize("transform", [to_rmsnorm, fold_norms])
def test_torch_transformer_layers_keep_their_norms(transform):
    """torch's TransformerEncoderLayer reads its norms' weight and bias itself (its fast path, under no_grad): a
    norm it holds can change neither class nor parameters. Refused by name; the model still runs as before."""
    torch.manual_seed(0)
    model = randomise(_TorchEncoderLM())
    x = torch.randint(0, 50, (2, 8))
    ref = copy.deepcopy(model)
    report = transform(model, x)
    held = [n for n in report.norms if n.name.startswith("enc.layers.")]
    assert len(held) == 4 and all(n.action == "refused" and "TransformerEncoderLayer" in n.reason for n in held)
    with torch.no_grad():  # the fast path's own check reads norm1.bias: it would fail on an RMSNorm
        assert rel_error(model(x), ref(x)) <= TOL


def test_converted_then_rmsnorm_pickles_and_its_state_dict_loads_into_a_fresh_conversion():
    """The demo LM after convert and to_rmsnorm: pickled whole, and its state_dict loaded strictly into a freshly
    converted LayerNorm twin, both compute the model before to_rmsnorm (the twin's LayerNorms on a centred stream)."""
    import io

    model, x = demo_pre()
    ref = copy.deepcopy(model)
    to_rmsnorm(model, x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.manual_seed(1)
    twin = PostNormTransformerLM(vocab_size=50, d_model=32, n_layers=2, n_heads=4, block_size=16).eval()
    convert(twin, "pre", example_input=x)
    twin.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        want = ref(x)
        assert rel_error(loaded(x), want) <= TOL
        assert rel_error(twin(x), want) <= TOL
    assert isinstance(loaded.blocks[0].ln1, RMSNormWithBias) and type(twin.blocks[0].ln1).__mro__[2] is nn.LayerNorm


def test_docstring_examples_run():
    import doctest
    import importlib

    for name in ("ln_lightning.exact.to_rmsnorm", "ln_lightning.exact.fold_norms"):  # the modules, not the functions
        module = importlib.import_module(name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, name


@pytest.mark.parametrize("cls", [RMSNormWithBias, FusedRMSNormWithBias])
def test_the_biased_rmsnorms_are_recognised_with_their_bias(cls):
    """ln_lightning.norm.kinds (swap_layernorms, the monitors, fold_norms) must see the bias, not a bare RMSNorm."""
    from ln_lightning.norm import kinds

    norm = cls(8)
    norm.bias = nn.Parameter(torch.randn(8))
    spec = kinds.recognize_norm(norm)
    assert spec.kind == "rms" and spec.bias is norm.bias
    x = torch.randn(3, 8)
    assert torch.allclose(norm(x), kinds.norm_reference(spec, x), atol=1e-6)


def test_swap_layernorms_leaves_a_biased_rmsnorm_with_the_reason():
    """swap_layernorms (LNPlacement's fused=True) swapped RMSNormWithBias for a fused RMSNorm forward without a bias,
    silently changing the output; it now skips it and says why."""
    from ln_lightning.norm import swap_layernorms

    norm = RMSNormWithBias(8)
    norm.bias = nn.Parameter(torch.randn(8))
    model = nn.Sequential(norm)
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = model(x)
        report = swap_layernorms(model)
        assert torch.equal(model(x), before)
    assert type(model[0]) is RMSNormWithBias
    assert [s.reason for s in report.skipped] == ["an RMSNorm that adds a bias: the fused RMSNorm forward has none (swapping would drop it)"]


def test_lnplacement_end_point_with_fused_layernorms():
    """LNPlacement's end point: convert, then swap_layernorms (its fused=True): deferred FusedLayerNorms become
    deferred fused RMSNorms, exactly; then they fold."""
    from ln_lightning.norm import FusedLayerNorm, swap_layernorms

    model, x = demo_pre()
    swap_layernorms(model)
    assert isinstance(model.blocks[0].ln1, FusedLayerNorm)
    ref = copy.deepcopy(model)
    report = to_rmsnorm(model, x, fused=True)
    _check(model, ref, x, report, expect="to_rmsnorm")
    assert isinstance(model.blocks[0].ln1, FusedRMSNormWithBias) and type(model.blocks[0].ln1).__name__.startswith("Deferred")
    _check(model, ref, x, fold_norms(model, x), expect="folded")
