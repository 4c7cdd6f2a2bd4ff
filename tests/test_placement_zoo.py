"""The placement engine on real model code nobody here wrote: Hugging Face families from small configs.

Each converted model is compared with a reference built independently of the engine:

* RoBERTa against `RobertaPreLayerNormModel` loaded with RoBERTa's weights, mapped by hand;
* BART against mBART (the same layers written pre-norm, with a final norm) loaded the same way;
* every other family against its pre-norm formula, written here by hand per family: each
  sublayer's norm replaced by an identity at its call site and the branch modules wrapped so they
  receive `LN(x)` (module replacement, not the engine's hooks), and the final norm applied where
  this file says the stack's output leaves it.

Norms get trained-looking weights first, so a misplaced norm can't hide behind weight 1, bias 0.
Compared within 1e-5 (relative to the output's scale) in eval and in train mode with dropout 0.
The table of results prints with `pytest -s`.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn

from ln_lightning.placement import convert, inspect_model

T = pytest.importorskip("transformers")
T.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*token_id.*")

H = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=99)
NO_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SEQ2SEQ = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
               encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=99, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
W2V = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(2, 2),
           conv_kernel=(3, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
           attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0)

LLM = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, vocab_size=99)
MOBILEBERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=99, embedding_size=16,
                  intra_bottleneck_size=16, true_hidden_size=16, normalization_type="layer_norm", **NO_DROP)
FUNNEL_LAYER = [("attention.layer_norm", [("attention.q_head", (0,), ()), ("attention.k_head", (0,), ()), ("attention.v_head", (0,), ())]),
                ("ffn.layer_norm", [("ffn.linear_1", (0,), ())])]
BERT_LAYER = [("attention.output.LayerNorm", [("attention.self", (0,), ())]), ("output.LayerNorm", [("intermediate", (0,), ())])]
ENC_LAYER = [("self_attn_layer_norm", [("self_attn", (0,), ())]), ("final_layer_norm", [("fc1", (0,), ())])]
DEC_LAYER = [("self_attn_layer_norm", [("self_attn", (0,), ())]), ("encoder_attn_layer_norm", [("encoder_attn", (0,), ())]),
             ("final_layer_norm", [("fc1", (0,), ())])]


@dataclass
class Family:
    name: str
    build: Callable[[], nn.Module]
    example: Callable[[], Any]
    # stack path -> (layer sublayers: [(norm, [(entry, arg positions, kwarg names)])], module whose output the final norm
    # applies to, "layer" meaning the stack's last layer, and the final norm convert adds there)
    stacks: dict
    reference: str = "formula"
    compare_on: Callable[[], Any] | None = None  # the input the comparison runs on, when convert gets none


def _ids(n=7):
    return torch.randint(3, 99, (2, n), generator=torch.Generator().manual_seed(1))


def _families() -> list[Family]:
    bert_stack = {"encoder.layer": (BERT_LAYER, "layer", "encoder.layer_final_norm")}
    return [
        Family("bert", lambda: T.BertModel(T.BertConfig(**H, **NO_DROP)), lambda: {"input_ids": _ids()}, bert_stack),
        Family("roberta", lambda: T.RobertaModel(T.RobertaConfig(**H, **NO_DROP)), lambda: {"input_ids": _ids()}, bert_stack,
               "RobertaPreLayerNormModel"),
        Family("electra", lambda: T.ElectraModel(T.ElectraConfig(embedding_size=32, **H, **NO_DROP)), lambda: {"input_ids": _ids()}, bert_stack),
        Family("rembert", lambda: T.RemBertModel(T.RemBertConfig(input_embedding_size=16, output_embedding_size=16, **H, **NO_DROP)),
               lambda: {"input_ids": _ids()}, bert_stack),
        Family("deberta-v2 (no example: dummy inputs)", lambda: T.DebertaV2Model(T.DebertaV2Config(**H, **NO_DROP)), lambda: None, bert_stack),
        Family("deberta-v2 (example input)", lambda: T.DebertaV2Model(T.DebertaV2Config(**H, **NO_DROP)), lambda: {"input_ids": _ids()}, bert_stack),
        Family("bert-decoder-kv-cache", lambda: T.BertModel(T.BertConfig(is_decoder=True, **H, **NO_DROP)),
               lambda: {"input_ids": _ids(), "use_cache": True}, bert_stack),
        Family("mpnet", lambda: T.MPNetModel(T.MPNetConfig(**H, **NO_DROP)), lambda: {"input_ids": _ids()},
               {"encoder.layer": ([("attention.LayerNorm", [("attention.attn", (0,), ())]), ("output.LayerNorm", [("intermediate", (0,), ())])],
                                  "layer", "encoder.layer_final_norm")}),
        Family("distilbert", lambda: T.DistilBertModel(T.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=99, dropout=0.0, attention_dropout=0.0)),
               lambda: {"input_ids": _ids()},
               {"transformer.layer": ([("sa_layer_norm", [("attention", (0,), ())]), ("output_layer_norm", [("ffn", (0,), ())])],
                                      "layer", "transformer.layer_final_norm")}),
        Family("albert (one layer shared by 3)", lambda: T.AlbertModel(T.AlbertConfig(embedding_size=16, **{**H, "num_hidden_layers": 3}, **NO_DROP)),
               lambda: {"input_ids": _ids()},
               {"encoder.albert_layer_groups.0.albert_layers": (
                   [("attention.LayerNorm", [("attention.query", (0,), ()), ("attention.key", (0,), ()), ("attention.value", (0,), ())]),
                    ("full_layer_layer_norm", [("ffn", (0,), ())])],
                   "encoder", "encoder.albert_layer_groups.0.albert_layers_final_norm")}),
        Family("bart", lambda: T.BartModel(T.BartConfig(**SEQ2SEQ)), lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(5)},
               {"encoder.layers": (ENC_LAYER, "layer", "encoder.layers_final_norm"), "decoder.layers": (DEC_LAYER, "layer", "decoder.layers_final_norm")},
               "MBartModel"),
        Family("marian", lambda: T.MarianModel(T.MarianConfig(**SEQ2SEQ, decoder_start_token_id=0, pad_token_id=0)),
               lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(5)},
               {"encoder.layers": (ENC_LAYER, "layer", "encoder.layers_final_norm"), "decoder.layers": (DEC_LAYER, "layer", "decoder.layers_final_norm")}),
        Family("fsmt", lambda: T.FSMTModel(T.FSMTConfig(langs=["en", "de"], src_vocab_size=99, tgt_vocab_size=99, **{k: v for k, v in SEQ2SEQ.items() if k != "vocab_size"})),
               lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(5)},
               {"encoder.layers": ([("self_attn_layer_norm", [("self_attn", (), ("query", "key"))]), ("final_layer_norm", [("fc1", (0,), ())])],
                                   "layer", "encoder.layers_final_norm"),
                "decoder.layers": ([("self_attn_layer_norm", [("self_attn", (), ("query", "key"))]), ("encoder_attn_layer_norm", [("encoder_attn", (), ("query",))]),
                                    ("final_layer_norm", [("fc1", (0,), ())])], "layer", "decoder.layers_final_norm")}),
        Family("wav2vec2 (post-norm config)", lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(**W2V, do_stable_layer_norm=False)),
               lambda: torch.randn(2, 200, generator=torch.Generator().manual_seed(2)),
               {"encoder.layers": ([("layer_norm", [("attention", (0,), ())]), ("final_layer_norm", [("feed_forward", (0,), ())])],
                                   "layer", "encoder.layers_final_norm")}),
        Family("hubert (post-norm config)", lambda: T.HubertModel(T.HubertConfig(**W2V, do_stable_layer_norm=False)),
               lambda: torch.randn(2, 200, generator=torch.Generator().manual_seed(2)),
               {"encoder.layers": ([("layer_norm", [("attention", (0,), ())]), ("final_layer_norm", [("feed_forward", (0,), ())])],
                                   "layer", "encoder.layers_final_norm")}),
        # Funnel: the first layer of each later block pools the stream and also reads the unpooled stream
        # as key and value: refused with that reason. What remains converts: the first block's layers
        # (no final norm: their output is the pooled layer's stream) and the decoder (with one).
        Family("funnel (what can be converted)", lambda: T.FunnelModel(T.FunnelConfig(d_model=32, n_head=2, d_head=16, d_inner=64, block_sizes=[1, 1],
                                                                                   vocab_size=99, hidden_dropout=0.0, attention_dropout=0.0,
                                                                                   activation_dropout=0.0)),
               lambda: {"input_ids": _ids(8)},
               {"encoder.blocks.0": (FUNNEL_LAYER, "layer", None), "decoder.layers": (FUNNEL_LAYER, "layer", "decoder.layers_final_norm")}),
        Family("longformer", lambda: T.LongformerModel(T.LongformerConfig(attention_window=4, **H, **NO_DROP)),
               lambda: {"input_ids": _ids(8)}, bert_stack),
        # Its dummy_inputs do not run (no input_ids): each block is read alone on a probe, no final norm is
        # added (the code around the stack can't be read without a forward: the report says it is not complete,
        # test_wav2vec2_without_an_example_is_reported_not_fully_converted).
        Family("wav2vec2 (post-norm, no example: dummy inputs fail)", lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(**W2V, do_stable_layer_norm=False)),
               lambda: None,
               {"encoder.layers": ([("layer_norm", [("attention", (0,), ())]), ("final_layer_norm", [("feed_forward", (0,), ())])],
                                   "layer", None)},
               compare_on=lambda: torch.randn(2, 200, generator=torch.Generator().manual_seed(2))),
        # MobileBERT without bottlenecks: each layer's stream goes through its attention, its inner stack of
        # FFN blocks and its output, five post-norm sublayers of the layer (not an inner stack of its own).
        Family("mobilebert (layer_norm, no bottleneck)", lambda: T.MobileBertModel(T.MobileBertConfig(**{**MOBILEBERT, "use_bottleneck": False, "true_hidden_size": 32})),
               lambda: {"input_ids": _ids()},
               {"encoder.layer": ([("attention.output.LayerNorm", [("attention.self", (0, 1, 2), ())]),
                                   *[(f"ffn.{i}.output.LayerNorm", [(f"ffn.{i}.intermediate", (0,), ())]) for i in range(3)],
                                   ("output.LayerNorm", [("intermediate", (0,), ())])], "layer", "encoder.layer_final_norm")}),
        # With bottlenecks: the layer's own residual `LN(h + G(h))` around everything else (its inner
        # residuals are part of G). G reads h through the bottleneck, which hands it on as the value.
        Family("mobilebert (layer_norm, bottleneck)", lambda: T.MobileBertModel(T.MobileBertConfig(**MOBILEBERT)),
               lambda: {"input_ids": _ids()},
               {"encoder.layer": ([("output.bottleneck.LayerNorm", [("bottleneck", (0,), ())])], "layer", "encoder.layer_final_norm")}),
    ]


# ---------------------------------------------------------------------------------------------
# The reference: the pre-norm formula by module replacement, from the family table above
# ---------------------------------------------------------------------------------------------


class _NormalisedEntry(nn.Module):
    def __init__(self, inner: nn.Module, norm: nn.Module, positions, names):
        super().__init__()
        self.inner, self.norm, self.positions, self.names = inner, norm, set(positions), set(names)

    def __getattr__(self, name):  # the layer may read the wrapped module's attributes (FSMT's cache_key)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def forward(self, *args, **kwargs):
        args = [self.norm(a) if i in self.positions else a for i, a in enumerate(args)]
        kwargs = {k: self.norm(v) if k in self.names and v is not None else v for k, v in kwargs.items()}
        return self.inner(*args, **kwargs)


class _NormaliseStream(nn.Module):
    """The final norm on the module's stream output (a tensor, or the first element / value)."""

    def __init__(self, inner: nn.Module, norm: nn.Module):
        super().__init__()
        self.inner, self.norm = inner, norm

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return self.norm(out)
        if isinstance(out, tuple):
            return (self.norm(out[0]),) + out[1:]
        key = next(iter(out.keys()))
        out[key] = self.norm(out[key])
        return out


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _formula_reference(original: nn.Module, converted: nn.Module, fam: Family) -> nn.Module:
    ref = copy.deepcopy(original)
    for stack, (subs, final_at, final_path) in fam.stacks.items():
        layers = list(ref.get_submodule(stack))
        for layer in layers:
            for norm_path, entries in subs:
                norm = copy.deepcopy(layer.get_submodule(norm_path))
                _set(layer, norm_path, nn.Identity())
                for entry, pos, names in entries:
                    _set(layer, entry, _NormalisedEntry(layer.get_submodule(entry), norm, pos, names))
        if final_path is not None:
            final = copy.deepcopy(converted.get_submodule(final_path))
            final.__dict__.pop("ln_lightning_final_norm_of", None)
            final._forward_hooks.clear()
            if final_at == "layer":
                container = ref.get_submodule(stack)
                container[len(container) - 1] = _NormaliseStream(container[len(container) - 1], final)
            else:
                _set(ref, final_at, _NormaliseStream(ref.get_submodule(final_at), final))
    return ref


def _mapped_reference(original: nn.Module, converted: nn.Module, fam: Family) -> nn.Module:
    state = converted.state_dict()
    if fam.reference == "RobertaPreLayerNormModel":
        cfg = T.RobertaPreLayerNormConfig(**{k: getattr(original.config, k) for k in (*H, *NO_DROP)})
        ref = T.RobertaPreLayerNormModel(cfg)
        mapped = {}
        for k, v in state.items():
            k2 = k.replace("attention.output.LayerNorm", "attention.LayerNorm").replace("output.LayerNorm", "intermediate.LayerNorm")
            k2 = k2.replace("encoder.layer_final_norm", "LayerNorm")
            mapped[k2] = v
    else:  # MBartModel
        ref = T.MBartModel(T.MBartConfig(**SEQ2SEQ))
        mapped = {k.replace("layers_final_norm", "layer_norm"): v for k, v in state.items()}
    missing, unexpected = ref.load_state_dict(mapped, strict=False)
    assert not unexpected and all("position_ids" in m or "embed_tokens" in m for m in missing), (missing, unexpected)
    if fam.reference == "MBartModel":  # tied embeddings
        ref.encoder.embed_tokens = ref.shared
        ref.decoder.embed_tokens = ref.shared
    return ref


def _trained_norms(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))


def _run(model, example):
    if isinstance(example, dict):
        out = model(**example)
    else:
        out = model(example)
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


RESULTS: list[tuple] = []


@pytest.mark.parametrize("fam", _families(), ids=lambda f: f.name)
def test_zoo_family_converts_to_its_independent_reference(fam):
    torch.manual_seed(0)
    model = fam.build()
    _trained_norms(model)
    original = copy.deepcopy(model)
    example = fam.example()
    report = convert(model, "pre", example_input=example)
    expected_blocks = sum(len(model.get_submodule(s)) for s in fam.stacks)
    assert [b.status for b in report.blocks] == ["converted"] * expected_blocks, str(report)
    assert sorted(report.added) == sorted(p for *_, p in fam.stacks.values() if p), str(report)
    if example is None:
        example = fam.compare_on() if fam.compare_on is not None else model.dummy_inputs
    ref = _mapped_reference(original, model, fam) if fam.reference != "formula" else _formula_reference(original, model, fam)
    err = 0.0
    for mode in ("eval", "train"):
        model.train(mode == "train"), ref.train(mode == "train")
        with torch.no_grad():
            err = max(err, _rel(_run(model, example), _run(ref, example)))
    RESULTS.append((fam.name, "converted", fam.reference, err))
    assert err < 1e-5, f"{fam.name}: converted model is {err:.2e} off its reference"
    # ... and back: post restores the original function exactly.
    back = convert(model, "post", example_input=example)
    assert sorted(back.removed) == sorted(report.added)
    model.eval(), original.eval()
    with torch.no_grad():
        torch.testing.assert_close(_run(model, example), _run(original, example), atol=0, rtol=0)


PRE_NORM = [
    ("gpt2", lambda: T.GPT2Model(T.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=99)), None, "ln_f"),
    ("vit", lambda: T.ViTModel(T.ViTConfig(image_size=16, patch_size=8, **{k: v for k, v in H.items() if k != "vocab_size"})),
     lambda: torch.randn(2, 3, 16, 16), "layernorm"),
    ("roberta-prelayernorm", lambda: T.RobertaPreLayerNormModel(T.RobertaPreLayerNormConfig(**H)), None, "LayerNorm"),
    ("esm", lambda: T.EsmModel(T.EsmConfig(pad_token_id=1, **H)), None, "encoder.emb_layer_norm_after"),
    ("xlm-roberta-xl", lambda: T.XLMRobertaXLModel(T.XLMRobertaXLConfig(**H)), None, "encoder.LayerNorm"),
    ("mbart", lambda: T.MBartModel(T.MBartConfig(**SEQ2SEQ)), None, "encoder.layer_norm"),
    ("whisper", lambda: T.WhisperModel(T.WhisperConfig(**{**SEQ2SEQ, "vocab_size": 99}, num_mel_bins=8, max_source_positions=8, pad_token_id=0,
                                                         bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
     lambda: {"input_features": torch.randn(2, 8, 16), "decoder_input_ids": _ids(5)}, "encoder.layer_norm"),
    ("clip-text", lambda: T.CLIPTextModel(T.CLIPTextConfig(**H)), None, "final_layer_norm"),
    # RMSNorm families: their own norm classes, recognised by what they compute.
    ("llama", lambda: T.LlamaModel(T.LlamaConfig(**LLM)), None, "norm"),
    ("qwen2", lambda: T.Qwen2Model(T.Qwen2Config(**LLM)), None, "norm"),
    ("mistral", lambda: T.MistralModel(T.MistralConfig(**LLM)), None, "norm"),
    ("t5 (T5LayerNorm)", lambda: T.T5Model(T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=99)),
     lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(5)}, "encoder.final_layer_norm"),
]


_PIXELS = lambda: {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))}  # noqa: E731
_VISION = dict(image_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
_SWIN = dict(image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=2, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
_PERCEIVER = dict(num_latents=4, d_latents=16, d_model=16, num_blocks=1, num_self_attends_per_block=2, num_self_attention_heads=2,
                  num_cross_attention_heads=1, vocab_size=99, max_position_embeddings=16, qk_channels=16, v_channels=16)

# Already pre-norm (or output-norm: Swin v2's res-post-norm `x + N(F(x))`), the stack's output reaching its final
# norm through pooling or patch merging (issue 22: convert used to add a second one there).
BEHIND_POOLING = [
    ("beit (mean pooling)", lambda: T.BeitModel(T.BeitConfig(patch_size=8, use_mean_pooling=True, **_VISION)), _PIXELS, "pre",
     ["pooler.layernorm"]),
    ("data2vec-vision (mean pooling)", lambda: T.Data2VecVisionModel(T.Data2VecVisionConfig(patch_size=8, use_mean_pooling=True, **_VISION),
                                                                    add_pooling_layer=True), _PIXELS, "pre", ["pooler.layernorm"]),
    ("swin (patch merging)", lambda: T.SwinModel(T.SwinConfig(**_SWIN)), _PIXELS, "pre", ["encoder.layers.0.downsample.norm", "layernorm"]),
    ("swinv2 (merge, bias-free reduction, norm)", lambda: T.Swinv2Model(T.Swinv2Config(**_SWIN)), _PIXELS, "output",
     ["encoder.layers.0.downsample.norm", "layernorm"]),
    ("perceiver-mlm (latents into its decoder)", lambda: T.PerceiverForMaskedLM(T.PerceiverConfig(**_PERCEIVER)), lambda: {"inputs": _ids(8)},
     "pre", ["perceiver.decoder.decoding_cross_attention.attention.self.layernorm2"]),
]


def _tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in (out if isinstance(out, (tuple, list)) else []) for t in _tensors(o)]


@pytest.mark.parametrize("name, build, example, placement, finals", BEHIND_POOLING, ids=[p[0] for p in BEHIND_POOLING])
@pytest.mark.parametrize("with_example", [True, False])
def test_final_norms_behind_pooling_and_merging_are_found_and_nothing_is_added(name, build, example, placement, finals, with_example):
    torch.manual_seed(0)
    model = build()
    _trained_norms(model)
    model.eval()
    ex = example()
    given = ex if with_example else None
    report = inspect_model(model, example_input=given)
    if not with_example and not report.blocks:  # Swin's layers need their input's dimensions: refused alone, naming the fix
        assert report.unrecognised and all("example_input=" in u.reason for u in report.unrecognised), str(report)
    else:
        assert {b.placement for b in report.blocks} == {placement}, str(report)
    if with_example:
        assert [s.final_norm for s in report.stacks] == finals, str(report)
    else:  # their dummy_inputs take no pixels: blocks read alone, the code around them unread: said, not guessed
        assert all(st.final_norm == f or (st.final_norm is None and not st.final_norm_known) for st, f in zip(report.stacks, finals)), str(report)
    with torch.no_grad():
        before = _tensors(model(**ex))
    for target in ("pre", placement):
        conv = convert(model, target, example_input=given)
        assert not conv.changed and conv.added == [], str(conv)
        with torch.no_grad():
            after = _tensors(model(**ex))
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before)), name
    RESULTS.append((name + ("" if with_example else ", no example"), f"already {placement}", "itself (bitwise)", 0.0))


@pytest.mark.parametrize("name, build, example, final", PRE_NORM, ids=[p[0] for p in PRE_NORM])
def test_pre_norm_families_are_reported_already_pre_with_their_final_norm(name, build, example, final):
    torch.manual_seed(0)
    model = build()
    ex = example() if example else None
    report = inspect_model(model, example_input=ex)
    assert report.blocks and {b.placement for b in report.blocks} == {"pre"}, str(report)
    assert final in [s.final_norm for s in report.stacks], str(report)
    before = copy.deepcopy(model.state_dict())
    conv = convert(model, "pre", example_input=ex)
    assert not conv.changed and {b.status for b in conv.blocks} == {"already"}, str(conv)
    assert model.state_dict().keys() == before.keys()
    post = convert(model, "post", example_input=ex)
    assert not post.changed and all("can only undo its own rewrite" in b.reason for b in post.skipped), str(post)
    RESULTS.append((name, "already pre", "-", 0.0))


PARALLEL_FAMILIES = [
    ("gpt-j", lambda: T.GPTJModel(T.GPTJConfig(n_embd=32, n_layer=2, n_head=2, vocab_size=99, rotary_dim=8))),
    ("gpt-neox (parallel)", lambda: T.GPTNeoXModel(T.GPTNeoXConfig(**{**LLM, "num_key_value_heads": None}, use_parallel_residual=True))),
    ("falcon (parallel_attn)", lambda: T.FalconModel(T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=99,
                                                                  parallel_attn=True, new_decoder_architecture=False))),
    ("falcon (new architecture)", lambda: T.FalconModel(T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_kv_heads=2,
                                                                     vocab_size=99, new_decoder_architecture=True))),
    ("phi", lambda: T.PhiModel(T.PhiConfig(**LLM))),
    ("codegen", lambda: T.CodeGenModel(T.CodeGenConfig(n_embd=32, n_layer=2, n_head=2, vocab_size=99, rotary_dim=8))),
    ("cohere", lambda: T.CohereModel(T.CohereConfig(**LLM))),
    ("stablelm (parallel)", lambda: T.StableLmModel(T.StableLmConfig(**LLM, use_parallel_residual=True))),
]


@pytest.mark.parametrize("name, build", PARALLEL_FAMILIES, ids=[p[0] for p in PARALLEL_FAMILIES])
def test_parallel_residual_families_have_one_status(name, build):
    """Every parallel-residual family the same: each layer one sublayer, pre, parallel; "pre" leaves it
    (already), "post" is refused as for any pre-norm block, "peri" and "output" with the one parallel rule
    (analysis.PARALLEL); the model is bit for bit unchanged."""
    from ln_lightning.placement.reading.analysis import PARALLEL

    torch.manual_seed(0)
    model = build().eval()
    ids = {"input_ids": _ids()}
    report = inspect_model(model, example_input=ids)
    assert [[(x.placement, x.parallel) for x in b.sublayers] for b in report.blocks] == [[("pre", True)]] * 2, str(report)
    with torch.no_grad():
        y0 = model(**ids).last_hidden_state
    for placement, status, reason in [("pre", "already", "parallel-residual block"), ("post", "skipped", "can only undo its own rewrite"),
                                      ("peri", "skipped", PARALLEL), ("output", "skipped", PARALLEL)]:
        conv = convert(model, placement, example_input=ids)
        assert not conv.changed and [(b.status, reason in b.reason) for b in conv.blocks] == [(status, True)] * 2, (placement, str(conv))
    with torch.no_grad():
        torch.testing.assert_close(model(**ids).last_hidden_state, y0, atol=0, rtol=0)
    RESULTS.append((name, "already pre (parallel)", "itself (bitwise)", 0.0))


@pytest.mark.parametrize("cls, config", [("PegasusModel", "PegasusConfig"), ("M2M100Model", "M2M100Config")])
def test_seq2seq_families_whose_dummy_inputs_fail(cls, config):
    """Their dummy_inputs pass decoder ids twice on transformers 5.24. Without an example input each block
    is read alone on a probe: the encoder's layers (pre-norm) are reported, the decoder's refused naming
    example_input (their cross-attention does not run alone), and nothing changes; with one, both stacks are
    read in the model's forward."""
    torch.manual_seed(0)
    model = getattr(T, cls)(getattr(T, config)(**SEQ2SEQ)).eval()
    ex = {"input_ids": _ids(), "decoder_input_ids": _ids(5)}
    with torch.no_grad():
        y0 = model(**ex).last_hidden_state
    report = convert(model, "pre")
    assert not report.changed and [b.status for b in report.blocks] == ["already"] * 2, str(report)
    assert any("dummy_inputs did not run" in n for n in report.notes)
    assert sum(n.startswith("decoder.layers.") and "example_input=" in n for n in report.notes) == 2, str(report)
    with torch.no_grad():
        torch.testing.assert_close(model(**ex).last_hidden_state, y0, atol=0, rtol=0)
    inspected = inspect_model(model, example_input=ex)
    assert [s.path for s in inspected.stacks] == ["decoder.layers", "encoder.layers"] and {b.placement for b in inspected.blocks} == {"pre"}
    assert [s.final_norm for s in inspected.stacks] == ["decoder.layer_norm", "encoder.layer_norm"], str(inspected)
    RESULTS.append((cls.removesuffix("Model").lower() + " (dummy inputs fail)", "already pre / refused", "itself (bitwise)", 0.0))


@pytest.mark.parametrize("name, build, placement", [
    ("gemma2", lambda: T.Gemma2Model(T.Gemma2Config(**LLM, head_dim=16)), "peri"),
    ("gemma3", lambda: T.Gemma3TextModel(T.Gemma3TextConfig(**LLM, head_dim=16)), "peri"),
    ("olmo2", lambda: T.Olmo2Model(T.Olmo2Config(**LLM)), "output"),
])
def test_llm_placements_are_reported(name, build, placement):
    """Gemma 2/3: RMSNorm before and after each sublayer (weight stored as 1 + w); OLMo 2: on each
    sublayer's output only. Reported as such, with the final norm; `"post"` refuses them with the reason."""
    torch.manual_seed(0)
    model = build()
    report = inspect_model(model)
    assert [b.placement for b in report.blocks] == [placement] * 2, str(report)
    assert [s.final_norm for s in report.stacks] == ["norm"]
    saved = copy.deepcopy(model.state_dict())
    conv = convert(model, "post")
    assert not conv.changed and all(b.status == "skipped" and "only undo its own rewrite" in b.reason for b in conv.blocks), str(conv)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    RESULTS.append((name, f"reported {placement}", "-", 0.0))


def teardown_module(module):
    if RESULTS:
        print(f"\n{'family':52s} {'status':24s} {'reference':36s} max rel. error")
        for name, status, ref, err in RESULTS:
            print(f"{name:52s} {status:24s} {ref:36s} {err:.1e}")


@pytest.mark.parametrize("kind", ["Encoder", "Decoder"])
@pytest.mark.parametrize("with_example", [True, False])
def test_x_transformers_post_norm_stack_matches_pre_norm_true(kind, with_example):
    """x-transformers `pre_norm=False` converted against the same class built with `pre_norm=True`,
    loaded with the converted weights (each layer's norm moves from slot 2 to slot 0 of its norms).
    Without an example input too (its LayerNorm keeps a `gamma`, no `weight`: issue 22's crash)."""
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    cls = getattr(xt, kind)
    model = cls(dim=16, depth=2, heads=2, pre_norm=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gamma"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    original = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    report = convert(model, "pre", example_input=x if with_example else None)
    assert [b.status for b in report.blocks] == ["converted"] and report.added == ["final_norm"], str(report)
    ref = cls(dim=16, depth=2, heads=2, pre_norm=True)
    ref.load_state_dict({k.replace(".0.2.", ".0.0."): v for k, v in model.state_dict().items()}, strict=True)
    with torch.no_grad():
        err = _rel(model(x), ref(x))
    RESULTS.append((f"x-transformers {kind}" + ("" if with_example else ", no example"), "converted", "pre_norm=True", err))
    assert err < 1e-5
    convert(model, "post", example_input=x if with_example else None)
    with torch.no_grad():
        torch.testing.assert_close(model(x), original(x), atol=0, rtol=0)


def test_xlm_whose_layers_are_parallel_lists_converts_to_its_formula():
    """XLM loops over `attentions[i]`, `layer_norm1[i]`, `ffns[i]`, `layer_norm2[i]` in XLMModel.forward
    (no layer module): the whole model is read as one block, and the reference replaces each norm by an
    identity and gives each branch its norm's output, by module replacement."""
    torch.manual_seed(0)
    model = T.XLMModel(T.XLMConfig(emb_dim=32, n_layers=2, n_heads=2, vocab_size=99, dropout=0.0, attention_dropout=0.0))
    _trained_norms(model)
    original = copy.deepcopy(model)
    ids = {"input_ids": _ids()}
    report = convert(model, "pre", example_input=ids)
    assert [b.status for b in report.blocks] == ["converted"] and report.added == ["layers_final_norm"], str(report)
    ref = copy.deepcopy(original)
    for i in range(2):
        for norms, branches in (("layer_norm1", "attentions"), ("layer_norm2", "ffns")):
            norm = copy.deepcopy(getattr(ref, norms)[i])
            getattr(ref, norms)[i] = nn.Identity()
            getattr(ref, branches)[i] = _NormalisedEntry(getattr(ref, branches)[i], norm, (0,), ())
    final = copy.deepcopy(model.layers_final_norm)
    final.__dict__.pop("ln_lightning_final_norm_of", None)
    final._forward_hooks.clear()
    ref = _NormaliseStream(ref, final)
    err = 0.0
    for mode in (False, True):
        model.train(mode), ref.train(mode)
        with torch.no_grad():
            err = max(err, _rel(_run(model, ids), _run(ref, ids)))
    RESULTS.append(("xlm (layers as parallel lists)", "converted", "formula", err))
    assert err < 1e-5
    convert(model, "post", example_input=ids)
    model.eval(), original.eval()
    with torch.no_grad():
        torch.testing.assert_close(_run(model, ids), _run(original, ids), atol=0, rtol=0)


def test_opt_post_norm_with_projections_matches_opt_built_pre_norm():
    """OPT-350m's layout (`do_layer_norm_before=False`, `project_in` / `project_out` around the layers; it views
    the stream to 2-D for its MLP) against `OPTModel(do_layer_norm_before=True)` loaded with the converted
    weights: the added final norm is its `final_layer_norm`, before `project_out`."""
    torch.manual_seed(0)
    cfg = dict(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2, vocab_size=99, word_embed_proj_dim=16,
               dropout=0.0, attention_dropout=0.0)
    model = T.OPTModel(T.OPTConfig(**cfg, do_layer_norm_before=False))
    _trained_norms(model)
    original = copy.deepcopy(model)
    ids = {"input_ids": _ids()}
    report = convert(model, "pre", example_input=ids)
    assert [b.status for b in report.blocks] == ["converted"] * 2 and report.added == ["decoder.layers_final_norm"], str(report)
    ref = T.OPTModel(T.OPTConfig(**cfg, do_layer_norm_before=True))
    ref.load_state_dict({k.replace("decoder.layers_final_norm", "decoder.final_layer_norm"): v for k, v in model.state_dict().items()}, strict=True)
    err = 0.0
    for mode in (False, True):
        model.train(mode), ref.train(mode)
        with torch.no_grad():
            err = max(err, _rel(_run(model, ids), _run(ref, ids)))
    RESULTS.append(("opt (do_layer_norm_before=False, projections)", "converted", "OPTModel(do_layer_norm_before=True)", err))
    assert err < 1e-5
    convert(model, "post", example_input=ids)
    model.eval(), original.eval()
    with torch.no_grad():
        torch.testing.assert_close(_run(model, ids), _run(original, ids), atol=0, rtol=0)


def test_lilt_converts_its_text_and_layout_streams():
    """LiLT's layers carry two post-norm streams (text and layout; its attention mixes them). Both are
    converted, against module replacement: each of the four norms per layer an identity at its call site,
    the attention given LN_text(text) and LN_layout(layout), each FFN its stream's norm. Compared on the
    last layer's two outputs and the model's."""
    torch.manual_seed(0)
    model = T.LiltModel(T.LiltConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=99,
                                     channel_shrink_ratio=2, **NO_DROP))
    _trained_norms(model)
    original = copy.deepcopy(model)
    ex = {"input_ids": _ids(), "bbox": torch.randint(0, 1000, (2, 7, 4), generator=torch.Generator().manual_seed(5)).sort(-1).values}
    report = convert(model, "pre", example_input=ex)
    assert [b.status for b in report.blocks] == ["converted"] * 2 and report.added == ["encoder.layer_final_norm"], str(report)
    streams = {x.stream for b in inspect_model(model, example_input=ex).blocks for x in b.sublayers}
    assert streams == {"hidden_states", "layout_inputs"}
    ref = copy.deepcopy(original)
    for layer in ref.encoder.layer:
        norms = {}
        for path in ("attention.output.LayerNorm", "attention.layout_output.LayerNorm", "output.LayerNorm", "layout_output.LayerNorm"):
            norms[path] = copy.deepcopy(layer.get_submodule(path))
            _set(layer, path, nn.Identity())
        layer.attention.self = _NormalisedEntry(_NormalisedEntry(layer.attention.self, norms["attention.output.LayerNorm"], (0,), ()),
                                                norms["attention.layout_output.LayerNorm"], (1,), ())
        layer.intermediate = _NormalisedEntry(layer.intermediate, norms["output.LayerNorm"], (0,), ())
        layer.layout_intermediate = _NormalisedEntry(layer.layout_intermediate, norms["layout_output.LayerNorm"], (0,), ())
    final = copy.deepcopy(model.encoder.layer_final_norm)
    final.__dict__.pop("ln_lightning_final_norm_of", None)
    ref.encoder.layer[1] = _NormaliseStream(ref.encoder.layer[1], final)
    err = 0.0
    for mode in (False, True):
        outs = []
        for m, last in ((model, model.encoder.layer[1]), (ref, ref.encoder.layer[1])):
            m.train(mode)
            got = []
            h = last.register_forward_hook(lambda mod, a, out: got.append(out))
            with torch.no_grad():
                outs.append((_run(m, ex), *got[0][:2]))
            h.remove()
        err = max(err, *(_rel(a, b) for a, b in zip(*outs)))
    RESULTS.append(("lilt (text and layout streams)", "converted", "formula", err))
    assert err < 1e-5
    convert(model, "post", example_input=ex)
    model.eval(), original.eval()
    with torch.no_grad():
        torch.testing.assert_close(_run(model, ex), _run(original, ex), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Residue of issue 34: a stack whose final norm can't be determined; MobileBERT's bottleneck layer by hand
# ---------------------------------------------------------------------------------------------


def test_wav2vec2_without_an_example_is_reported_not_fully_converted():
    """Without an input Wav2Vec2's forward can't be run (its dummy_inputs fail) nor traced, so nobody can tell
    whether a norm follows the stack: its blocks convert, no final norm is added, and the report's status says
    the conversion is not complete (not only a note). With an example the final norm is found to be missing and
    added: complete."""
    build = lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(**W2V, do_stable_layer_norm=False))  # noqa: E731
    report = convert(build(), "pre")
    assert [b.status for b in report.blocks] == ["converted"] * 2 and report.added == [], str(report)
    assert not report.complete and list(report.incomplete) == ["encoder.layers"], str(report)
    assert "could not tell" in report.incomplete["encoder.layers"] and "example_input=" in report.incomplete["encoder.layers"]
    assert "NOT fully converted" in report.summary() and "NOT fully converted: stack encoder.layers" in str(report)
    assert report.to_dict()["complete"] is False
    done = convert(build(), "pre", example_input=torch.randn(2, 200, generator=torch.Generator().manual_seed(2)))
    assert done.complete and done.incomplete == {} and done.added == ["encoder.layers_final_norm"], str(done)
    RESULTS.append(("wav2vec2 (post-norm, no example)", "not complete", "its report", 0.0))


def _mobilebert_pre_norm_by_hand(original: nn.Module, final: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """MobileBERT (bottleneck, layer_norm) in pre-norm form, written out from Hugging Face's own modules.

    Each layer as written is `h <- N(h + G(h))`, N = output.bottleneck.LayerNorm and G everything from the input
    bottleneck to the output bottleneck's dense layer (its inner post-norm residuals are part of G). Pre-norm is
    `h <- h + G(N(h))`, then `final` after the last layer. Nothing here comes from the engine but `final`'s
    weights (which norm convert copies for the new final norm is its choice; where it goes is not)."""
    h = original.embeddings(input_ids=ids)
    for layer in original.encoder.layer:
        x = layer.output.bottleneck.LayerNorm(h)
        q, k, v, layer_input = layer.bottleneck(x)
        att, _ = layer.attention(q, k, v, layer_input, None)
        if layer.num_feedforward_networks != 1:
            for ffn in layer.ffn:
                att = ffn(att)
        out = layer.output.LayerNorm(layer.output.dense(layer.intermediate(att)) + att)
        h = h + layer.output.bottleneck.dense(out)
    return final(h)


def test_mobilebert_bottleneck_layer_converts_to_its_pre_norm_form_written_by_hand():
    """The engine's MobileBERT rewrite against the bottleneck layer's pre-norm form built by hand from the
    layer's modules (not the generic module replacement above), in float64, eval and train mode (dropout 0)."""
    torch.manual_seed(0)
    model = T.MobileBertModel(T.MobileBertConfig(**MOBILEBERT)).double()
    _trained_norms(model)
    original = copy.deepcopy(model)
    ids = _ids()
    report = convert(model, "pre", example_input={"input_ids": ids})
    assert [b.status for b in report.blocks] == ["converted"] * 2 and report.complete, str(report)
    read = inspect_model(original, example_input={"input_ids": ids})
    assert [s.norm for b in read.blocks for s in b.sublayers] == [f"encoder.layer.{i}.output.bottleneck.LayerNorm" for i in (0, 1)]
    final = copy.deepcopy(model.get_submodule("encoder.layer_final_norm"))
    final._forward_hooks.clear()
    err = 0.0
    for mode in (False, True):
        model.train(mode), original.train(mode)
        with torch.no_grad():
            want = _mobilebert_pre_norm_by_hand(original, final, ids)
            err = max(err, _rel(model(input_ids=ids).last_hidden_state, want))
            # The written-out form is not the post-norm model (so the comparison can fail).
            assert _rel(original(input_ids=ids).last_hidden_state, want) > 1e-2
    RESULTS.append(("mobilebert (bottleneck), by hand", "converted", "pre-norm layer written out", err))
    assert err < 1e-12, f"MobileBERT converted is {err:.2e} off its hand-written pre-norm form"
