"""``ln_lightning.save_pretrained`` and ``ln_lightning.from_pretrained``: converted Hugging Face models in and
out of normal Hugging Face directories, with exactly the function they compute.

    ln_lightning.save_pretrained(model, "out")          # native class where one exists, else remote code
    model = ln_lightning.from_pretrained("out")         # the same function: classes, weights, rewrite, blend

What each directory form is and which loader does what with it: ``export.directory`` and the README section
"Shipping a converted model".
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from torch import nn

from ln_lightning._extras import require
from ln_lightning.export import directory as hf_directory
from ln_lightning.export import save_guard
from ln_lightning.placement import state as rewrite_state
from ln_lightning.placement.rewrite.apply import rebuild
from ln_lightning.placement.errors import PlacementError


def _target(model: nn.Module) -> tuple[nn.Module, rewrite_state.RewriteState, str]:
    """The Hugging Face model to save, the rewrite it takes part in and its path from that rewrite's root."""
    guard = model.__dict__.get(save_guard.ATTR)
    if isinstance(guard, save_guard.SavePretrained):
        return model, guard.state, guard.base
    found = rewrite_state.find(model)
    if found is not None and hf_directory.is_hf_model(model):
        return model, found[0], found[1]
    state = rewrite_state.of(model)
    if state is not None:  # a LightningModule (or other wrapper) whose rewrite lies in one Hugging Face model
        held = [m for m in model.modules() if isinstance(m.__dict__.get(save_guard.ATTR), save_guard.SavePretrained)]
        inner = {id(s) for o in held for s in o.modules() if s is not o}
        outermost = [m for m in held if id(m) not in inner]
        if len(outermost) == 1:
            guard = outermost[0].__dict__[save_guard.ATTR]
            return outermost[0], guard.state, guard.base
        raise PlacementError(
            f"{type(model).__name__} is not a Hugging Face model and holds "
            f"{'no' if not outermost else len(outermost)} converted Hugging Face models; pass the one to save"
        )
    raise PlacementError(
        f"{type(model).__name__} was not rewritten by ln_lightning (no placement rewrite state): its own save_pretrained "
        "writes exactly what it computes. If it is part of a model that was converted, pass that model"
    )


def save_pretrained(model: nn.Module, directory: str | os.PathLike, *, native: bool | None = None,
                    **hf_kwargs: Any) -> hf_directory.Written:
    """Save a converted Hugging Face model so that no loader computes the old function with its weights.

    ``model``: the converted Hugging Face model (by ``convert``, ``LNPlacement``, ``load_converted`` or
    ``from_pretrained``, mid-transition included, but not mid-way through the stream-scaled transition to
    ``"output"``, which is refused with the reason), or a LightningModule holding one. ``native``: ``None`` (default)
    writes the family's native pre-norm class where it has one (RoBERTa -> RobertaPreLayerNorm, BART -> mBART,
    post-norm OPT -> pre-norm OPT; plain ``AutoModel.from_pretrained`` then loads the converted function without
    ln_lightning) and the remote-code form elsewhere; ``True`` requires the native class (PlacementError with the
    reason); ``False`` always writes the remote-code form. ``hf_kwargs`` go to Hugging Face's ``save_pretrained``.

    The converted model's own ``model.save_pretrained(directory)`` does the same. Returns what was written
    (``.route``, ``.architecture``, ``.notes``).
    """
    target, state, base = _target(model)
    return hf_directory.write(target, directory, state, base, native=native, **hf_kwargs)


@contextlib.contextmanager
def _quiet_transformers():
    """Hugging Face's load report lists the rewrite's entries as unexpected; they are loaded right after."""
    hf_logging = require("transformers.utils.logging", "hf", "loading Hugging Face models")
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def from_pretrained(directory: str | os.PathLike, *, example_input: Any = None, fused: bool = False,
                    **hf_kwargs: Any) -> nn.Module:
    """Load a directory ``ln_lightning.save_pretrained`` wrote, computing exactly the function that was saved.

    ``directory``: a local directory (a Hub repository: download it first, ``huggingface_hub.snapshot_download``).

    A remote-code directory gives the saved class (``BertForMaskedLM``, ...) with its weights, rebuilt with the
    saved rewrite (``placement.rewrite.apply.rebuild``, which checks the rebuilt model converts and adds exactly what was
    saved), its added modules' weights and, saved mid-transition, its blend. A native directory gives the native
    class (it computes the function with no rewrite). ``example_input``: a probe input for the rebuild, for models
    Hugging Face's dummy inputs do not fit (speech models: a waveform); ``fused``: ln_lightning's fused LayerNorm;
    ``hf_kwargs`` go to Hugging Face's ``from_pretrained`` (``dtype``, ``attn_implementation``, ...). Returns the
    model in eval mode.
    """
    transformers = require("transformers", "hf", "loading Hugging Face models")
    config = hf_directory.read_config(directory)
    entry = config.get(hf_directory.ENTRY)
    if not isinstance(entry, dict):
        return _unwritten(directory)
    if int(entry.get("format", 1)) > hf_directory.FORMAT:
        raise PlacementError(f"{directory} was written by a newer ln_lightning (format {entry['format']}); upgrade ln_lightning")
    if entry.get("route") == "native":
        cls = getattr(transformers, config["architectures"][0])
        return cls.from_pretrained(directory, **hf_kwargs).eval()
    arch = entry["architecture"]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise PlacementError(f"{directory} holds a {arch}, which this transformers ({transformers.__version__}) does not have")
    plain = {k: v for k, v in config.items() if k not in (hf_directory.ENTRY, "auto_map")}
    plain.update(entry.get("held", {}))
    plain["model_type"], plain["architectures"] = entry["source_model_type"], [arch]
    with _quiet_transformers():
        model = cls.from_pretrained(directory, config=cls.config_class.from_dict(plain), **hf_kwargs)
    record = entry["record"]
    rebuild(model, {**record, "transition": None}, fused=fused, example_input=example_input)
    weights = hf_directory.read_weights(directory)
    # The rewrite's entries (markers, added modules, the transition's buffers: the load guard puts the model back
    # into that blend) and, again, the weights Hugging Face loaded.
    missing, unexpected = model.load_state_dict(weights, strict=False)
    sd = model.state_dict(keep_vars=True)
    loaded = {sd[k].data_ptr() for k in weights if k in sd}
    untied = [k for k in missing if sd[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise PlacementError(
            f"{directory}'s weights do not fit the rebuilt {arch}: missing {untied[:5]}, unexpected {unexpected[:5]}. "
            "If the saved model was built with constructor arguments its config does not record (BertModel's "
            "add_pooling_layer=False, ...), pass them: from_pretrained(directory, add_pooling_layer=False)"
        )
    t = record.get("transition")
    if t and rewrite_state.of(model).transition is None:
        raise PlacementError(f"{directory} was saved mid-transition but its weights hold no transition blend")
    return model.eval()


def _unwritten(directory) -> nn.Module:
    """A directory ln_lightning did not write: refuse it when its weights hold a rewrite (saved by Hugging Face's
    own save_pretrained of a converted model: its config.json says nothing of it)."""
    try:
        weights = hf_directory.read_weights(directory)
    except FileNotFoundError:
        weights = {}
    markers = sorted(k for k in weights if k.rpartition(".")[2] == rewrite_state.MARKER)
    if markers:
        found = rewrite_state.decode_config(weights[markers[0]])
        raise PlacementError(
            f"{directory} holds the weights of a model rewritten to {found} (its '{markers[0]}' entry), saved without "
            "ln_lightning.save_pretrained: its config.json does not say so, so Hugging Face loads it as the old function. "
            "Build the model, convert it with that configuration, load these weights into it, and save it with "
            "ln_lightning.save_pretrained"
        )
    raise PlacementError(
        f"{directory} was not written by ln_lightning.save_pretrained (its config.json has no '{hf_directory.ENTRY}' "
        "entry); load it with transformers (AutoModel.from_pretrained)"
    )


__all__ = ["save_pretrained", "from_pretrained"]
