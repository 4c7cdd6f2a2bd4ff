"""`ln_lightning.to_native`: each family's native pre-norm twin against the converted model (issue 21).

Each mapping is compared with the converted model itself (the engine's hooks, not the mapping), in float32,
within 1e-6 relative, with trained-looking norms; the torch and x-transformers forms are also loaded into a model
built by hand with the native option (`norm_first=True`, `pre_norm=True`). The mapping tests can fail: a swapped
norm in the RoBERTa mapping is refused by the probe check and its outputs are off, while with default norms the
same swap gives an exact 0 error (why every test uses trained-looking norms).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

T = pytest.importorskip("transformers")

from _helpers_export import H, OPT, S2S, W2V, quiet_transformers, rel, tied, token_ids, trained_looking, waveform  # noqa: E402
from ln_lightning import PlacementError, convert, to_native  # noqa: E402
from ln_lightning.export import native_hf  # noqa: E402
from ln_lightning.placement import state as rewrite_state  # noqa: E402
from ln_lightning.placement.migrate import transition  # noqa: E402

TOL = 1e-6


@pytest.fixture(autouse=True)
def _quiet():
    quiet_transformers()


def _out(model, **inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _converted(build, **convert_kw):
    torch.manual_seed(0)
    model = trained_looking(build()).eval()
    convert(model, "pre", **convert_kw)
    return model


# ---------------------------------------------------------------------------------------------- RoBERTa, BART
FAMILIES = [
    ("RobertaModel", lambda: T.RobertaModel(T.RobertaConfig(**H)), "RobertaPreLayerNormModel"),
    ("RobertaForMaskedLM", lambda: T.RobertaForMaskedLM(T.RobertaConfig(**H)), "RobertaPreLayerNormForMaskedLM"),
    ("RobertaForSequenceClassification", lambda: T.RobertaForSequenceClassification(T.RobertaConfig(**H)),
     "RobertaPreLayerNormForSequenceClassification"),
    ("BartModel", lambda: T.BartModel(T.BartConfig(**S2S)), "MBartModel"),
    ("BartForConditionalGeneration", lambda: T.BartForConditionalGeneration(T.BartConfig(**S2S)), "MBartForConditionalGeneration"),
    ("BartForSequenceClassification", lambda: T.BartForSequenceClassification(T.BartConfig(**S2S)), "MBartForSequenceClassification"),
    ("BartForCausalLM", lambda: T.BartForCausalLM(T.BartConfig(**{**S2S, "is_decoder": True, "is_encoder_decoder": False})),
     "MBartForCausalLM"),
]


@pytest.mark.parametrize("name, build, native_name", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_the_native_twin_computes_the_converted_function(name, build, native_name):
    model = _converted(build)
    ids = token_ids()
    native = to_native(model)
    assert type(native).__name__ == native_name
    assert rewrite_state.of(native) is None and "save_pretrained" not in native.__dict__  # a plain transformers model
    assert rel(_out(native, input_ids=ids), _out(model, input_ids=ids)) <= TOL
    if native.get_output_embeddings() is not None:
        assert tied(native)


def test_bart_to_mbart_default_decoder_inputs_are_the_same_only_for_inputs_ending_in_the_start_token():
    """The documented caveat: mBART derives decoder inputs by rotating the last token, BART by prepending
    decoder_start_token_id (2, </s>): the same for inputs that end in </s>, as BART's tokenizer writes them."""
    model = _converted(lambda: T.BartModel(T.BartConfig(**S2S)))
    native = to_native(model)
    ids = token_ids()  # ends in 2
    assert rel(_out(native, input_ids=ids), _out(model, input_ids=ids)) <= TOL
    odd = ids.clone()
    odd[:, -1] = 7
    assert rel(_out(native, input_ids=odd), _out(model, input_ids=odd)) > 1e-3
    dec = token_ids()[:, :5]
    assert rel(_out(native, input_ids=odd, decoder_input_ids=dec), _out(model, input_ids=odd, decoder_input_ids=dec)) <= TOL
    form = native_hf.native_form(model, rewrite_state.of(model).to_record())
    assert any("decoder_input_ids" in n for n in form.notes)


def test_bart_class_route_is_closed_only_while_the_layerdrop_can_be_written_as_an_int(tmp_path):
    from ln_lightning import save_pretrained

    model = _converted(lambda: T.BartModel(T.BartConfig(**S2S)))
    written = save_pretrained(model, tmp_path / "a")
    assert any("refuses this directory" in n for n in written.notes)
    with pytest.raises(Exception, match="encoder_layerdrop"):
        T.BartModel.from_pretrained(tmp_path / "a")
    # A layerdrop of 0.1 has no int spelling: BartModel would load the directory as the old function. Said, and warned.
    model = _converted(lambda: T.BartModel(T.BartConfig(**{**S2S, "encoder_layerdrop": 0.1, "decoder_layerdrop": 0.1})))
    with pytest.warns(UserWarning, match="loads this directory as the old BART function"):
        written = save_pretrained(model, tmp_path / "b")
    assert written.route == "native" and any("old BART function" in n for n in written.notes)
    trap = T.BartModel.from_pretrained(tmp_path / "b").eval()
    unconverted = copy.deepcopy(model)
    convert(unconverted, "post")
    assert rel(_out(trap, input_ids=token_ids()), _out(unconverted, input_ids=token_ids())) <= TOL  # the trap, measured


# ---------------------------------------------------------------------------------------------- the mapping can fail
def _swap_roberta_norms(monkeypatch):
    """The RoBERTa mapping with its two layer norms swapped (attention's <-> the feed-forward's)."""
    real = native_hf._mapped

    def swapped(model, renames, src, dst):
        out = real(model, renames, src, dst)
        for key in [k for k in out if re.search(r"\.attention\.LayerNorm\.", k)]:
            other = key.replace(".attention.LayerNorm.", ".intermediate.LayerNorm.")
            out[key], out[other] = out[other], out[key]
        return out

    monkeypatch.setattr(native_hf, "_mapped", swapped)


def test_a_swapped_norm_in_the_mapping_is_refused_and_would_be_off(monkeypatch):
    model = _converted(lambda: T.RobertaForMaskedLM(T.RobertaConfig(**H)))
    _swap_roberta_norms(monkeypatch)
    form = native_hf.native_form(model, rewrite_state.of(model).to_record())
    wrong = form.build().eval()
    assert rel(_out(wrong, input_ids=token_ids()), _out(model, input_ids=token_ids())) > 1e-3  # 1000x the tolerance
    with pytest.raises(PlacementError, match="computes another function than the converted model"):
        to_native(model)


def test_save_pretrained_never_writes_a_native_model_that_is_off(monkeypatch, tmp_path):
    from ln_lightning import from_pretrained, save_pretrained

    model = _converted(lambda: T.RobertaForMaskedLM(T.RobertaConfig(**H)))
    _swap_roberta_norms(monkeypatch)
    with pytest.raises(PlacementError, match="computes another function"):
        save_pretrained(model, tmp_path / "native", native=True)
    with pytest.warns(UserWarning, match="wrote the remote-code form instead"):
        written = save_pretrained(model, tmp_path / "auto")
    assert written.route == "remote_code"
    assert rel(_out(from_pretrained(tmp_path / "auto"), input_ids=token_ids()), _out(model, input_ids=token_ids())) <= TOL


def test_with_default_norms_the_same_swap_goes_unseen(monkeypatch):
    torch.manual_seed(0)
    model = T.RobertaForMaskedLM(T.RobertaConfig(**H)).eval()  # norms at weight 1, bias 0
    convert(model, "pre")
    _swap_roberta_norms(monkeypatch)
    assert rel(_out(to_native(model), input_ids=token_ids()), _out(model, input_ids=token_ids())) == 0.0


# ---------------------------------------------------------------------------------------------- OPT
class _NormalisedInput(nn.Module):
    def __init__(self, inner, norm, kwarg=None):
        super().__init__()
        self.inner, self.norm, self.kwarg = inner, norm, kwarg

    def forward(self, *args, **kwargs):
        if self.kwarg is not None:
            kwargs[self.kwarg] = self.norm(kwargs[self.kwarg])
        else:
            args = (self.norm(args[0]),) + args[1:]
        return self.inner(*args, **kwargs)


def _opt_prenorm_formula(model: nn.Module) -> nn.Module:
    """Post-norm OPT computed as pre-norm by module replacement (no engine): each sublayer's norm an identity at its
    call site and applied to the branch's input, a final norm (a copy of the last layer's) on the decoder output."""
    ref = copy.deepcopy(model)
    decoder = ref.model.decoder
    for layer in decoder.layers:
        n1, n2 = layer.self_attn_layer_norm, layer.final_layer_norm
        layer.self_attn_layer_norm, layer.final_layer_norm = nn.Identity(), nn.Identity()
        layer.self_attn = _NormalisedInput(layer.self_attn, n1, kwarg="hidden_states")
        layer.fc1 = _NormalisedInput(layer.fc1, n2)
    final = copy.deepcopy(n2)
    last = decoder.layers[-1]
    decoder.layers[-1] = _FinalNorm(last, final)
    return ref, final


class _FinalNorm(nn.Module):
    def __init__(self, inner, norm):
        super().__init__()
        self.inner, self.norm = inner, norm

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        return (self.norm(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else self.norm(out)


def test_the_opt_mapping_against_the_pre_norm_formula():
    """The mapping on its own, independently of the engine (the test below checks the engine's conversion): the
    weights a conversion would leave (the model's, plus the final norm it adds as decoder.layers_final_norm) mapped
    to do_layer_norm_before=True, against the formula computed by hand."""
    torch.manual_seed(0)
    model = trained_looking(T.OPTForCausalLM(T.OPTConfig(**OPT))).eval()
    ref, final = _opt_prenorm_formula(model)
    with torch.no_grad():
        final.weight.mul_(1.3)  # the added norm's own (trained) weights, not a copy the mapping could take by chance
    model.model.decoder.layers_final_norm = copy.deepcopy(final)
    record = {"config": {"placement": "pre", "final_norm": True, "branch_scale": None},
              "converted": [[f"model.decoder.layers.{i}", True] for i in range(2)],
              "added": ["model.decoder.layers_final_norm"], "derived": {}, "transition": None}
    native = native_hf.native_form(model, record).build().eval()
    assert native.config.do_layer_norm_before and not native.config._remove_final_layer_norm
    ids = token_ids()
    assert rel(_out(native, input_ids=ids), _out(ref.eval(), input_ids=ids)) <= TOL
    assert rel(_out(native, input_ids=ids), _out(model, input_ids=ids)) > 1e-2  # not the post-norm function
    assert tied(native)


def test_opt_converted_by_the_engine_maps_to_do_layer_norm_before():
    torch.manual_seed(0)
    model = trained_looking(T.OPTForCausalLM(T.OPTConfig(**OPT))).eval()
    report = convert(model, "pre")
    # A regression in the engine fails here (it used to be a skip): both post-norm layers convert, the final norm is added.
    assert [(c.path, c.status) for c in report.converted] == [(f"model.decoder.layers.{i}", "converted") for i in range(2)]
    assert report.added == ["model.decoder.layers_final_norm"]
    native = to_native(model)
    assert native.config.do_layer_norm_before
    assert rel(_out(native, input_ids=token_ids()), _out(model, input_ids=token_ids())) <= TOL


# ---------------------------------------------------------------------------------------------- the speech family
@pytest.mark.parametrize("cls, config", [(T.Wav2Vec2Model, T.Wav2Vec2Config), (T.HubertModel, T.HubertConfig),
                                         (T.UniSpeechModel, T.UniSpeechConfig)], ids=["wav2vec2", "hubert", "unispeech"])
def test_speech_post_norm_has_no_twin_and_the_naive_mapping_is_measurably_off(cls, config):
    model = _converted(lambda: cls(config(**W2V, do_stable_layer_norm=False)), example_input=waveform())
    with pytest.raises(PlacementError, match="no twin: .*encoder.layer_norm to the stream before its layers"):
        to_native(model)
    # The naive twin: the stable-layer-norm config with the same weights, the added final norm dropped (it has
    # the same key's norm after the layers instead).
    stable = cls(config(**W2V, do_stable_layer_norm=True)).eval()
    sd = {k: v for k, v in model.state_dict().items() if "layers_final_norm" not in k}
    stable.load_state_dict(sd, strict=False)
    assert rel(_out(stable, input_values=waveform()), _out(model, input_values=waveform())) > 0.1


def test_sew_has_no_pre_norm_configuration():
    model = _converted(lambda: T.SEWModel(T.SEWConfig(**{k: v for k, v in W2V.items() if k != "vocab_size"}, squeeze_factor=2)),
                       example_input=torch.randn(2, 400, generator=torch.Generator().manual_seed(2)))
    with pytest.raises(PlacementError, match="SEW has no pre-norm"):
        to_native(model)


# ---------------------------------------------------------------------------------------------- torch, x-transformers
def _layer(cls, norm_first=False):
    return cls(32, 2, 64, dropout=0.0, batch_first=True, norm_first=norm_first)


TORCH = [
    ("encoder", lambda nf: nn.TransformerEncoder(_layer(nn.TransformerEncoderLayer, nf), 2, enable_nested_tensor=False,
                                                  norm=nn.LayerNorm(32) if nf else None), 1),
    ("decoder", lambda nf: nn.TransformerDecoder(_layer(nn.TransformerDecoderLayer, nf), 2, norm=nn.LayerNorm(32) if nf else None), 2),
    ("transformer", lambda nf: nn.Transformer(32, 2, 2, 2, 64, dropout=0.0, batch_first=True, norm_first=nf), 2),
]


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # torch, building nn.Transformer(norm_first=True)
@pytest.mark.parametrize("name, build, n_inputs", TORCH, ids=[t[0] for t in TORCH])
def test_torch_transformers_map_to_norm_first(name, build, n_inputs):
    g = torch.Generator().manual_seed(4)
    args = tuple(torch.randn(2, 5, 32, generator=g) for _ in range(n_inputs))
    torch.manual_seed(0)
    model = trained_looking(build(False)).eval()
    convert(model, "pre", example_input=args if n_inputs > 1 else args[0])
    with torch.no_grad():
        expected = model(*args)
        native = to_native(model)
        assert rel(native(*args), expected) <= TOL
        by_hand = build(True).eval()  # built with norm_first=True by the user
        by_hand.load_state_dict(native.state_dict(), strict=True)
        assert rel(by_hand(*args), expected) <= TOL


def test_torch_encoder_without_final_norm_maps_to_norm_first_without_norm():
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    model = trained_looking(nn.TransformerEncoder(_layer(nn.TransformerEncoderLayer), 2, enable_nested_tensor=False)).eval()
    convert(model, "pre", final_norm=False, example_input=x)
    native = to_native(model)
    assert native.norm is None
    with torch.no_grad():
        assert rel(native(x), model(x)) <= TOL


@pytest.mark.parametrize("kind", ["Encoder", "Decoder"])
def test_x_transformers_map_to_pre_norm(kind):
    X = pytest.importorskip("x_transformers")
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    model = getattr(X, kind)(dim=32, depth=2, heads=2, pre_norm=False).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gamma"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    convert(model, "pre", example_input=x)
    with torch.no_grad():
        expected = model(x)
        native = to_native(model)
        assert rel(native(x), expected) <= TOL
        by_hand = getattr(X, kind)(dim=32, depth=2, heads=2, pre_norm=True).eval()
        by_hand.load_state_dict(native.state_dict(), strict=True)
        assert rel(by_hand(x), expected) <= TOL
    assert rewrite_state.of(model) is not None and rewrite_state.of(native) is None  # the converted model is untouched


# ---------------------------------------------------------------------------------------------- refusals
def test_what_to_native_refuses():
    with pytest.raises(PlacementError, match="BertModel's family has no pre-norm class"):
        to_native(_converted(lambda: T.BertModel(T.BertConfig(**H))))
    with pytest.raises(PlacementError, match="branch_scale=0.5"):
        to_native(_converted(lambda: T.RobertaModel(T.RobertaConfig(**H)), branch_scale=0.5))
    mid = trained_looking(T.RobertaModel(T.RobertaConfig(**H)))
    transition.begin(mid, "pre", steps=4)
    with pytest.raises(PlacementError, match="mid-transition"):
        to_native(mid)
    with pytest.raises(PlacementError, match="was not rewritten by ln_lightning"):
        to_native(T.RobertaModel(T.RobertaConfig(**H)))
    with pytest.raises(PlacementError, match="has no native pre-norm class"):
        to_native(_converted(lambda: nn.Sequential(nn.TransformerEncoder(_layer(nn.TransformerEncoderLayer), 2, enable_nested_tensor=False)),
                             example_input=torch.randn(2, 5, 32)))
