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
        example = model.dummy_inputs
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
        print("\nfamily                                 status           reference                  max rel. error")
        for name, status, ref, err in RESULTS:
            print(f"{name:38s} {status:16s} {ref:26s} {err:.1e}")


@pytest.mark.parametrize("kind", ["Encoder", "Decoder"])
def test_x_transformers_post_norm_stack_matches_pre_norm_true(kind):
    """x-transformers `pre_norm=False` converted against the same class built with `pre_norm=True`,
    loaded with the converted weights (each layer's norm moves from slot 2 to slot 0 of its norms)."""
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
    report = convert(model, "pre", example_input=x)
    assert [b.status for b in report.blocks] == ["converted"] and report.added == ["final_norm"], str(report)
    ref = cls(dim=16, depth=2, heads=2, pre_norm=True)
    ref.load_state_dict({k.replace(".0.2.", ".0.0."): v for k, v in model.state_dict().items()}, strict=True)
    with torch.no_grad():
        err = _rel(model(x), ref(x))
    RESULTS.append((f"x-transformers {kind}", "converted", "pre_norm=True", err))
    assert err < 1e-5
    convert(model, "post", example_input=x)
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
