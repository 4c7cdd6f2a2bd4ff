"""Native pre-norm forms of converted Hugging Face models: a class of the family that computes the converted
function with no rewrite at all, so that plain Hugging Face loading (no ln_lightning) gives that function.

One small function per family, each taking the converted model and its rewrite record (relative to the model):

* RoBERTa -> ``RobertaPreLayerNorm*`` (its layers written pre-norm, a final ``LayerNorm``);
* BART -> mBART (the same layers written pre-norm, final ``layer_norm``s in encoder and decoder);
* OPT ``do_layer_norm_before=False`` -> ``True`` (the same class; its ``final_layer_norm``);
* Wav2Vec2, HuBERT, UniSpeech(-SAT), WavLM: **no twin**. The post-norm encoder applies ``encoder.layer_norm``
  to the stream before its layers and the stable-layer-norm encoder after them, under the same key, so no
  stable-layer-norm configuration computes the converted function. SEW has no pre-norm configuration at all.

A form is built only for the rewrite it matches exactly (plain pre-norm, the final norm(s) added, no branch
scale, every layer converted, no transition) and is then checked on a probe input against the converted model:
a native model that computes another function is refused, never written. What cannot be served raises
:class:`NoNativeForm` with the reason; ``save_pretrained`` then writes the remote-code form instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ln_lightning._extras import require
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.spec import PlacementSpec

MARKER = "ln_lightning_placement"
PLAIN_PRE = PlacementSpec("pre").config  # what a native pre-norm class computes, in the request's serialised form
TOLERANCE = 1e-5  # relative L2 of the native model's outputs against the converted model's, on the probe


def _transformers():
    return require("transformers", "hf", "native Hugging Face classes of converted models")


class NoNativeForm(PlacementError):
    """This converted model has no native pre-norm form (the reason says why)."""


@dataclass
class NativeForm:
    """How to build the native twin of a converted model: class, configuration and mapped weights."""

    cls: type
    config: object
    state_dict: dict[str, torch.Tensor]
    family: str
    notes: list[str] = field(default_factory=list)
    closes: Callable[[dict], str | None] | None = None  # config.json dict -> how the trap class refuses it, or None

    def build(self) -> nn.Module:
        model = self.cls(self.config)
        missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
        tied = _tied_to_loaded(model, missing, self.state_dict)
        if unexpected or set(missing) - tied:
            raise PlacementError(
                f"internal: the {self.family} mapping does not cover {self.cls.__name__}: missing {sorted(set(missing) - tied)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}; please report this"
            )
        return model


def _tied_to_loaded(model: nn.Module, missing, loaded: dict) -> set[str]:
    """The missing keys whose tensors are tied to a loaded one (the same storage)."""
    sd = model.state_dict(keep_vars=True)
    loaded_ptrs = {sd[k].data_ptr() for k in loaded if k in sd}
    return {k for k in missing if k in sd and sd[k].data_ptr() in loaded_ptrs}


def _source_prefix(model: nn.Module) -> str:
    """'bert.' for a head class holding its base model, '' for the base model itself."""
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model else ""


def _require_plain(record: dict, family: str, native: str, *, any_final_norm: bool = False) -> None:
    """Plain pre-norm with the final norm added (or, `any_final_norm`, without), no transition."""
    config = dict(record["config"])
    if any_final_norm and config.get("final_norm") is False:
        config["final_norm"] = True
    if {k: config.get(k) for k in PLAIN_PRE} != PLAIN_PRE or set(config) - set(PLAIN_PRE):
        raise NoNativeForm(
            f"{native} computes plain pre-norm with a final norm; this {family} rewrite is "
            f"{', '.join(f'{k}={v!r}' for k, v in config.items())}"
        )
    if record.get("transition"):
        raise NoNativeForm(f"the model is mid-transition (a blend of post- and pre-norm), which no {family} class computes")


def _require_layers(model: nn.Module, record: dict, stacks: list[str], added: list[str], family: str) -> None:
    want = sorted(f"{s}.{i}" for s in stacks for i in range(len(model.get_submodule(s))))
    got = sorted(p for p, _ in record["converted"])
    if got != want:
        raise NoNativeForm(f"the {family} rewrite converted {got}, not every layer of {', '.join(stacks)}")
    if sorted(record["added"]) != sorted(added):
        raise NoNativeForm(f"the {family} rewrite added {sorted(record['added'])}, not the final norm(s) {sorted(added)}")


def _mapped(model: nn.Module, renames: list[tuple[str, str]], src_prefix: str, dst_prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        if key.rpartition(".")[2] == MARKER:
            continue
        if src_prefix and key.startswith(src_prefix):
            inner = key[len(src_prefix):]
            for pattern, repl in renames:
                inner = re.sub(pattern, repl, inner)
            key = dst_prefix + inner
        elif not src_prefix:
            for pattern, repl in renames:
                key = re.sub(pattern, repl, key)
        out[key] = value.detach().clone()
    return out


def _config_dict(model: nn.Module) -> dict:
    d = model.config.to_dict()
    for k in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path", "ln_lightning"):
        d.pop(k, None)
    return d


def _transformers_class(name: str, family: str) -> type:
    transformers = _transformers()

    cls = getattr(transformers, name, None)
    if cls is None:
        raise NoNativeForm(f"{family}: transformers has no class {name} (the native twin of this head)")
    return cls


# ---------------------------------------------------------------------------------------------- the families
def roberta(model: nn.Module, record: dict) -> NativeForm:
    transformers = _transformers()

    arch = type(model).__name__
    native_name = "RobertaPreLayerNorm" + arch.removeprefix("Roberta")
    _require_plain(record, "RoBERTa", native_name)
    if model.config.add_cross_attention or model.config.is_decoder:
        raise NoNativeForm("RoBERTa as a decoder (is_decoder / add_cross_attention): its native twin is not verified")
    src = _source_prefix(model)
    _require_layers(model, record, [f"{src}encoder.layer"], [f"{src}encoder.layer_final_norm"], "RoBERTa")
    cls = _transformers_class(native_name, "RoBERTa")
    config = transformers.RobertaPreLayerNormConfig.from_dict(_config_dict(model))
    renames = [
        (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"encoder.layer.\1.attention.LayerNorm."),
        (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"encoder.layer.\1.intermediate.LayerNorm."),
        (r"^encoder\.layer_final_norm\.", "LayerNorm."),
    ]
    dst = f"{cls.base_model_prefix}." if src else ""
    return NativeForm(cls, config, _mapped(model, renames, src, dst), "RoBERTa")


def _bart_class_route(config_json: dict) -> str | None:
    """How BartConfig refuses the mBART config.json (strict field types: an int layerdrop), or None."""
    transformers = _transformers()

    try:
        transformers.BartConfig.from_dict({k: v for k, v in config_json.items() if k != "model_type"})
    except Exception as err:  # noqa: BLE001 - any refusal closes the route; its type is reported
        return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
    return None


def bart(model: nn.Module, record: dict) -> NativeForm:
    transformers = _transformers()

    arch = type(model).__name__
    native_name = "M" + arch
    _require_plain(record, "BART", native_name)
    src = _source_prefix(model)
    base = model.get_submodule(src.rstrip(".")) if src else model
    stacks = [s for s in ("encoder", "decoder") if hasattr(base, s)]
    _require_layers(model, record, [f"{src}{s}.layers" for s in stacks], [f"{src}{s}.layers_final_norm" for s in stacks], "BART")
    cls = _transformers_class(native_name, "BART")
    d = _config_dict(model)
    notes = ["mBART's default decoder inputs (decoder_input_ids not given) rotate the last non-pad token to the front, "
             "BART's start with decoder_start_token_id: the same when inputs end with that token (</s>, as BART's "
             "tokenizer writes them); pass decoder_input_ids otherwise"]
    # BartConfig types layerdrop as `float | None`, MBartConfig as `float | int`: written as an int, a layerdrop of
    # 0 makes BartModel.from_pretrained(directory) refuse the mBART directory instead of loading it as the old
    # BART function (which the weights, the same keys, would give silently).
    for key in ("encoder_layerdrop", "decoder_layerdrop"):
        if d.get(key) == 0:
            d[key] = 0
    config = transformers.MBartConfig.from_dict(d)
    renames = [(r"(^|\.)(encoder|decoder)\.layers_final_norm\.", r"\1\2.layer_norm.")]
    return NativeForm(cls, config, _mapped(model, renames, src, src), "BART", notes, closes=_bart_class_route)


def opt(model: nn.Module, record: dict) -> NativeForm:
    transformers = _transformers()

    if model.config.do_layer_norm_before:
        raise NoNativeForm("OPT with do_layer_norm_before=True is pre-norm already; nothing was converted to map")
    final = bool(record["config"].get("final_norm"))
    _require_plain(record, "OPT", "OPT (do_layer_norm_before=True)", any_final_norm=True)  # _remove_final_layer_norm
    src = _source_prefix(model)
    stack = f"{src}decoder.layers"
    added = [a for a in record["added"] if a.startswith(f"{src}decoder.") and not a.startswith(stack + ".")]
    _require_layers(model, record, [stack], added if final else [], "OPT")
    if final and len(added) != 1:
        raise NoNativeForm(f"the OPT rewrite added {record['added']}, not one final norm after decoder.layers")
    d = _config_dict(model)
    d["do_layer_norm_before"] = True
    d["_remove_final_layer_norm"] = not final
    config = transformers.OPTConfig.from_dict(d)
    renames = [(rf"^{re.escape(added[0][len(src):])}\.", "decoder.final_layer_norm.")] if final else []
    return NativeForm(type(model), config, _mapped(model, renames, src, src), "OPT")


_SPEECH = ("Wav2Vec2", "Hubert", "UniSpeechSat", "UniSpeech", "WavLM", "Data2VecAudio")


def speech(model: nn.Module, record: dict) -> NativeForm:
    name = type(model).__name__
    family = next(f for f in _SPEECH + ("SEW",) if name.startswith(f))
    if family == "SEW" or not hasattr(model.config, "do_stable_layer_norm"):
        raise NoNativeForm(f"{family} has no pre-norm (stable-layer-norm) configuration in transformers")
    raise NoNativeForm(
        f"no twin: {family}'s post-norm encoder applies encoder.layer_norm to the stream before its layers, the "
        "stable-layer-norm encoder after them, under the same key, so no do_stable_layer_norm=True configuration "
        "computes the converted function"
    )


def _family(model: nn.Module) -> Callable | None:
    name = type(model).__name__
    if name.startswith("RobertaPreLayerNorm"):
        return None
    if name.startswith("Roberta"):
        return roberta
    if name.startswith("Bart") and not name.startswith("Bartpho"):
        return bart
    if name.startswith("OPT"):
        return opt
    if name.startswith(_SPEECH + ("SEW",)) and not name.startswith("SEWD"):
        return speech
    return None


def native_form(model: nn.Module, record: dict) -> NativeForm:
    """The native twin of the converted Hugging Face `model` (its rewrite `record`, relative to it), unbuilt.
    Raises NoNativeForm with the reason when it has none."""
    family = _family(model)
    if family is None:
        raise NoNativeForm(f"{type(model).__name__}'s family has no pre-norm class in transformers")
    return family(model, record)


def probe_inputs(model: nn.Module) -> dict:
    inputs = dict(model.dummy_inputs)
    return {k: v.to(next(model.parameters()).device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def outputs(model: nn.Module, inputs: dict) -> list[torch.Tensor]:
    """Every tensor a Hugging Face model returns at the top level of its output (caches aside)."""
    with torch.no_grad():
        out = model(**inputs)
    values = out.to_tuple() if hasattr(out, "to_tuple") else (out if isinstance(out, tuple) else (out,))
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, tuple) and all(isinstance(t, torch.Tensor) for t in v):
            found.extend(v)
    return found


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")
    err = 0.0
    for x, y in zip(a, b):
        scale = y.double().norm().item() or 1.0
        err = max(err, (x.double() - y.double()).norm().item() / scale)
    return err


def build_checked(model: nn.Module, form: NativeForm) -> nn.Module:
    """Build `form` and check it computes what the converted `model` computes on a probe input (eval mode)."""
    native = form.build()
    was_training = model.training
    model.eval(), native.eval()
    try:
        inputs = probe_inputs(model)
        err = relative_error(outputs(native, inputs), outputs(model, inputs))
    finally:
        model.train(was_training)
    if not err <= TOLERANCE:
        raise PlacementError(
            f"the native {form.cls.__name__} built from this {form.family} model computes another function than the "
            f"converted model (relative error {err:.2e} on a probe input, above {TOLERANCE:g}): refused. Please report "
            "this, with the model's configuration"
        )
    return native


__all__ = ["NativeForm", "NoNativeForm", "native_form", "build_checked", "probe_inputs", "outputs", "relative_error"]
