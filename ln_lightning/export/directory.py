"""Writing a converted Hugging Face model as a directory that nothing loads as the old function.

Two forms, both a normal Hugging Face directory (``config.json``, safetensors weights):

* **native**, where the family has a pre-norm class computing the converted function (``native_hf``): that
  class's config and mapped weights. Plain ``AutoModel.from_pretrained(directory)`` gives the function, no
  ln_lightning needed. ``config.json["ln_lightning"]`` records where it came from (``route: "native"``).
* **remote code**, everywhere else: the converted model's own weights (its markers, added modules and transition
  buffers included: the state_dict a model rebuilt with the rewrite has), and a ``config.json`` that

  - has ``model_type`` ``ln_lightning_<type>``, which Hugging Face does not know, and an ``auto_map`` pointing at
    ``ln_lightning_converted.py`` (``remote_runtime``'s source and the saved classes): the Auto classes refuse it
    without ``trust_remote_code=True`` and with it compute the converted function, no ln_lightning needed;
  - holds ``remote_runtime.MESSAGE`` in place of one value the family's own config class checks the type of
    (``hidden_size``, ...; the real value under ``["ln_lightning"]["held"]``), so the family's class,
    ``BertModel.from_pretrained(directory)``, refuses it with that message instead of loading the old function;
  - records the rewrite (``["ln_lightning"]["record"]``: ``ln_lightning.from_pretrained`` rebuilds it with
    ``placement.rewrite.apply.rebuild``) and what its hooks compute (``["plan"]``: what the remote code installs).

This module is handed the rewrite state by its callers (``ln_lightning.export.hf`` and the converted model's own
``save_pretrained``, ``save_guard``) and reads it through its methods only.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from torch import nn

from ln_lightning._extras import require
from ln_lightning._warnings import warn
from ln_lightning.export import native_hf, plan, remote_runtime
from ln_lightning.placement.errors import PlacementError

log = logging.getLogger(__name__)

ENTRY = remote_runtime.ENTRY
FORMAT = 1  # of config.json's "ln_lightning" entry
REMOTE_FILE = "ln_lightning_converted.py"
REMOTE_MODULE = REMOTE_FILE.removesuffix(".py")
TYPE_PREFIX = "ln_lightning_"
# The value that carries remote_runtime.MESSAGE: one the family's config class checks to be an int.
_HELD_CANDIDATES = ("hidden_size", "d_model", "dim", "n_embd", "embed_dim", "num_hidden_layers", "vocab_size")


@dataclass
class Written:
    """What ``save_pretrained`` wrote: the route taken and why."""

    directory: Path
    route: str  # "native" or "remote_code"
    architecture: str  # the class plain Hugging Face loading builds (native), or the saved model's class
    source: str = ""  # the saved model's path in the module the rewrite was applied to ("": that module)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        how = ("plain AutoModel.from_pretrained loads it, no ln_lightning needed" if self.route == "native" else
               "ln_lightning.from_pretrained, or the Auto classes with trust_remote_code=True, load it")
        where = f" from {self.source}" if self.source else ""
        return (f"{self.directory}: {self.route} ({self.architecture}{where}); {how}"
                + "".join(f"\n  note: {n}" for n in self.notes))


def is_hf_model(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(module).__mro__)


def write(model: nn.Module, directory, state, base: str, *, native: bool | None = None, **hf_kwargs) -> Written:
    """Write the converted Hugging Face `model` (the submodule at `base` of the rewrite `state`'s root).

    `native`: None picks the native form where the family has one and the remote-code form elsewhere; True
    requires the native form (PlacementError with the reason when there is none); False, the remote-code form.
    `hf_kwargs` go to Hugging Face's ``save_pretrained`` (``max_shard_size``, ``safe_serialization``, ...).
    """
    if not is_hf_model(model):
        raise PlacementError(
            f"{type(model).__name__} is not a Hugging Face PreTrainedModel; save_pretrained writes Hugging Face directories. "
            "For a torch or x-transformers model use ln_lightning.to_native(model), or torch.export (see the README, "
            "'Shipping a converted model')"
        )
    if hf_kwargs.get("push_to_hub"):
        raise PlacementError(
            "push_to_hub: save to a local directory first, then upload that directory (huggingface_hub.upload_folder, "
            "or model.push_to_hub(repo_id), which saves through this function)"
        )
    if hf_kwargs.get("safe_serialization") is False or hf_kwargs.get("variant"):
        raise PlacementError(
            "save_pretrained writes model.safetensors (what ln_lightning.from_pretrained and the remote code read): "
            "drop safe_serialization=False / variant="
        )
    if native is not None and not isinstance(native, bool):
        raise TypeError(f"native must be None, True or False, got {native!r}")
    directory = Path(directory)
    if directory.is_file():
        raise PlacementError(f"{directory} is a file; save_pretrained writes a directory")
    record = state.relative_to(base, with_transition=True)
    if native is not False:
        try:
            form = native_hf.native_form(model, record)
            built = native_hf.build_checked(model, form)
        except native_hf.NoNativeForm as err:
            if native:
                raise PlacementError(f"no native form for {type(model).__name__}: {err}") from None
            log.info("ln_lightning.save_pretrained: %s; writing the remote-code form", err)
        except PlacementError as err:  # a native model that computes another function: never written
            if native:
                raise
            warn(f"ln_lightning.save_pretrained: {err}; wrote the remote-code form instead")
        else:
            written = _write_native(directory, record, form, built, model, hf_kwargs)
            written.source = base
            return written
    written = _write_remote(model, directory, state, base, record, hf_kwargs)
    written.source = base
    return written


# ---------------------------------------------------------------------------------------------- native
def _write_native(directory: Path, record: dict, form: native_hf.NativeForm, native: nn.Module, model: nn.Module,
                  hf_kwargs: dict) -> Written:
    hf_kwargs.pop("state_dict", None)  # the native model's own weights are the mapped ones
    native.save_pretrained(directory, **hf_kwargs)
    notes = list(form.notes)
    if not hf_kwargs.get("is_main_process", True):
        return Written(directory, "native", type(native).__name__, notes=notes)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    if form.closes is not None:
        refusal = form.closes(config)
        if refusal:
            notes.append(f"{form.family}'s own class refuses this directory ({refusal})")
        else:
            notes.append(f"{type(model).__name__}.from_pretrained(directory) (the family's own class) loads this directory "
                         f"as the old {form.family} function with only Hugging Face's type warning: load it with "
                         f"{type(native).__name__} or AutoModel")
            warn(f"ln_lightning.save_pretrained({directory}): {notes[-1]}")
    config[ENTRY] = {"format": FORMAT, "route": "native", "source_architecture": type(model).__name__,
                     "record": record, "notes": notes, "version": _version()}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Written(directory, "native", type(native).__name__, notes=notes)


# ---------------------------------------------------------------------------------------------- remote code
def _write_remote(model: nn.Module, directory: Path, state, base: str, record: dict, hf_kwargs: dict) -> Written:
    markers = state.marker_entries(base)
    transition = state.transition
    model_plan = plan.hook_plan(model, added=record["added"], derived=record["derived"],
                                markers={k.rpartition(".")[0] if "." in k else "": int(v.numel()) for k, v in markers.items()},
                                transition=transition)
    state_dict = hf_kwargs.pop("state_dict", None)
    state_dict = dict(model.state_dict() if state_dict is None else state_dict)
    for key, value in markers.items():
        state_dict.setdefault(key, value)
    if transition is not None:  # the root's blend, where it stands (a submodule's state_dict lacks it)
        for key, value in transition.state_dict().items():
            state_dict.setdefault(f"{remote_runtime.TRANSITION}.{key}", value.detach().clone())
    type(model).save_pretrained(model, directory, state_dict=state_dict, **hf_kwargs)
    if not hf_kwargs.get("is_main_process", True):
        return Written(directory, "remote_code", type(model).__name__)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    arch = type(model).__name__
    source_type = config["model_type"]
    held = _hold_message(model, config)
    notes = []
    if not held:
        notes.append(f"{arch}.from_pretrained(directory) is not refused: this transformers does not check the type of any "
                     f"value of {type(model.config).__name__}; it loads the old function (with Hugging Face's model-type "
                     "warning). The Auto classes still refuse it without trust_remote_code=True")
        warn(f"ln_lightning.save_pretrained({directory}): {notes[-1]}")
    config[ENTRY] = {"format": FORMAT, "route": "remote_code", "architecture": arch, "source_model_type": source_type,
                     "record": record, "plan": model_plan, "held": held, "version": _version()}
    config["model_type"] = TYPE_PREFIX + source_type
    config["architectures"] = [f"LNLightning{arch}"]
    config["auto_map"] = {"AutoConfig": f"{REMOTE_MODULE}.LNLightning{type(model.config).__name__}",
                          **{auto: f"{REMOTE_MODULE}.LNLightning{arch}" for auto in _auto_classes(source_type, arch)}}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / REMOTE_FILE).write_text(remote_source(type(model), type(model.config), TYPE_PREFIX + source_type))
    readme = directory / "README.md"
    if not readme.exists():
        readme.write_text(_model_card(arch, directory.name))
    return Written(directory, "remote_code", arch, notes=notes)


def _hold_message(model: nn.Module, config: dict) -> dict:
    """Put MESSAGE in place of the first value the family's config class refuses it for; {key: real value}."""
    config_class = type(model.config)
    plain = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")}
    candidates = [k for k in _HELD_CANDIDATES if isinstance(getattr(model.config, k, None), int)]
    for key in candidates:
        try:
            config_class.from_dict({**plain, key: remote_runtime.MESSAGE})
        except Exception as err:  # noqa: BLE001 - any refusal that shows the message will do
            if remote_runtime.MESSAGE[:40] in str(err):
                value = getattr(model.config, key)
                config[key] = remote_runtime.MESSAGE
                return {key: value}
    return {}


@functools.lru_cache(maxsize=1)
def _auto_model_names() -> tuple[str, ...]:
    # dir() of transformers' lazy module builds its whole name list (about 0.15 s): once a process is enough.
    return tuple(name for name in dir(require("transformers", "hf", "saving Hugging Face models")) if name.startswith("AutoModel"))


def _auto_classes(model_type: str, arch: str) -> list[str]:
    """The Auto classes that build `arch` for `model_type` (AutoModelForMaskedLM for BertForMaskedLM, ...)."""
    transformers = require("transformers", "hf", "saving Hugging Face models")
    found = []
    for name in _auto_model_names():
        try:
            mapping = getattr(getattr(transformers, name), "_model_mapping", None)
        except Exception:  # noqa: BLE001 - a lazily imported class that needs a missing backend
            continue
        names = getattr(mapping, "_model_mapping", None)
        if isinstance(names, dict) and names.get(model_type) == arch:
            found.append(name)
    return sorted(found)


def remote_source(model_class: type, config_class: type, model_type: str) -> str:
    """``ln_lightning_converted.py``: the runtime and the saved model's two classes."""
    runtime = inspect.getsource(remote_runtime)
    return (
        runtime.rstrip() + "\n\n\n"
        "# ---------------------------------------------------------------------------------------------\n"
        "# Written by ln_lightning.save_pretrained for this directory: the saved model's classes.\n"
        f"from transformers import {config_class.__name__} as _SourceConfig  # noqa: E402\n"
        f"from transformers import {model_class.__name__} as _SourceModel  # noqa: E402\n\n\n"
        f"class LNLightning{config_class.__name__}(ConvertedConfig, _SourceConfig):\n"
        f"    model_type = {model_type!r}\n\n\n"
        f"class LNLightning{model_class.__name__}(ConvertedModel, _SourceModel):\n"
        f"    config_class = LNLightning{config_class.__name__}\n"
    )


def _model_card(arch: str, name: str) -> str:
    return (
        f"# {name}\n\n"
        f"A `{arch}` whose LayerNorm placement was rewritten by [ln-lightning](https://github.com/) "
        "(the rewrite lives in hooks, not in the class's code). The plain class computes its old function with these "
        "weights and refuses this directory; load it with either\n\n"
        "```python\nimport ln_lightning\nmodel = ln_lightning.from_pretrained(path)\n```\n\n"
        "or, without ln_lightning, the Auto class with the remote code in `ln_lightning_converted.py`:\n\n"
        "```python\nfrom transformers import AutoModel  # or the head's Auto class\n"
        "model = AutoModel.from_pretrained(path, trust_remote_code=True)\n```\n"
    )


def _version() -> str:
    try:
        return version("ln-lightning")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def read_config(directory) -> dict:
    path = Path(os.fspath(directory)) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not a Hugging Face model directory")
    return json.loads(path.read_text())


def read_weights(directory) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors weights (one file or an index of shards)."""
    load_file = require("safetensors.torch", "hf", "reading Hugging Face weights").load_file
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory} has no safetensors weights (model.safetensors or its index)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(directory / f)))
    return out


__all__ = ["ENTRY", "FORMAT", "REMOTE_FILE", "Written", "write", "is_hf_model", "remote_source", "read_config", "read_weights"]
