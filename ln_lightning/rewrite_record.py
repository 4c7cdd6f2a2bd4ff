"""What a placement rewrite records on the model, so that anyone can read what the model computes.

A rewritten model carries two records, written by :func:`record`:

* **the configuration**, on the root module as the attribute ``_ln_lightning_placement_config`` (it pickles
  with the model, so ``ddp_spawn`` workers see it): a dict with exactly ``LNPlacement``'s / ``convert``'s
  keyword arguments, ``{"placement": "pre"|"post", "final_norm": bool, "branch_scale": None|float|"depth"|
  "layerscale"}`` plus ``"layerscale_init": float`` when it was given. ``LNPlacement(**config)`` rebuilds
  the same rewrite on a fresh model. The paths the rewrite added (``ConversionReport.added``) go next to it
  as ``_ln_lightning_placement_added`` (a list, or absent when unknown).
* **the marker**, a persistent ``uint8`` buffer named ``ln_lightning_placement`` holding that dict as JSON
  (``json.dumps(config, sort_keys=True)``, UTF-8), on every module that owns a rewritten stack (the parent
  of the blocks' container: ``model`` for blocks ``model.blocks.3``). It travels in every ``state_dict``, so:

  - a strict load of a rewritten state_dict into the original model fails (``Unexpected key(s) ...
    ln_lightning_placement``) instead of computing the untrained post-norm function;
  - a load-state-dict pre-hook on the owner and on every module above it refuses, before any weight is
    copied and with ``strict=False`` too, a state_dict written for another configuration, and one without
    the marker (written before the rewrite) that holds weights for the owner, unless the caller opts in
    explicitly: :func:`accept_unconverted` for a raw ``load_state_dict``,
    ``LNPlacement(resume_unconverted=True)`` for a Trainer's ``ckpt_path``.

``convert`` records the configuration (``record(..., owners=())``: no marker) whenever it changes a model;
``LNPlacement`` records both. (Models rewritten by ``convert`` before it recorded anything, ln_lightning 0.1.0,
have neither: ``LNPlacement`` reads their configuration back from their structure.) This module imports
nothing else of the package, so the placement engine builds on it.

How checkpoints carry these records, and what else a run with ``LNPlacement`` writes into them, is
documented in ``ln_lightning.checkpoint``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, Iterable, Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)

MARKER = "ln_lightning_placement"
CONFIG_ATTR = "_ln_lightning_placement_config"
ADDED_ATTR = "_ln_lightning_placement_added"
_HOOK_FLAG = "_ln_lightning_load_hook"
_GUARDED_ATTR = "_ln_lightning_guarded_owners"  # on each guarded module: owner paths relative to it
_ACCEPT_FLAG = "_ln_lightning_accept_unmarked"


# ---------------------------------------------------------------------------------------------- encode
def encode_config(config: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(config, sort_keys=True).encode()), dtype=torch.uint8)


def decode_config(tensor: Any) -> dict | None:
    """The config a marker holds; None when it is not a marker this library wrote."""
    if not isinstance(tensor, torch.Tensor):
        return None
    try:
        value = json.loads(bytes(tensor.detach().cpu().to(torch.uint8).tolist()).decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def owner_path(block_path: str) -> str:
    """'model.blocks.3' -> 'model' (the module holding the stack container 'model.blocks')."""
    stack = block_path.rpartition(".")[0]
    return stack.rpartition(".")[0]


# ---------------------------------------------------------------------------------------------- write / read
def record(model: nn.Module, config: dict, block_paths: Iterable[str] = (), *, added: Iterable[str] | None = None,
           owners: Iterable[str] | None = None) -> None:
    """Record on `model` that it now computes `config`: the attribute, and a marker on each rewritten stack's owner.

    `block_paths`: the blocks the rewrite converted (``[b.path for b in report.converted]``); their owners get
    the marker, or the root when only `added` (``report.added``) is non-empty; with neither (a rewrite that
    changed nothing) no marker. `owners` (module paths) overrides that choice. Calling it again replaces
    the records.
    """
    config = dict(config)
    setattr(model, CONFIG_ATTR, config)
    if added is not None:
        setattr(model, ADDED_ATTR, list(added))
    if owners is None:  # the root holds the marker when the rewrite only added modules (a final norm)
        owners = {owner_path(p) for p in block_paths} or ({""} if added else set())
    paths = set(owners)
    for path in sorted(paths):
        _register_marker(model.get_submodule(path), config)
        # The guard sits on the owner and on every module above it: a load into any of them checks the
        # marker before torch copies a single weight (a load refused half-way would still change the model).
        parts = path.split(".") if path else []
        for i in range(len(parts) + 1):
            _guard(model.get_submodule(".".join(parts[:i])), ".".join(parts[i:]))


def recorded_config(model: nn.Module) -> dict | None:
    """The configuration recorded on `model` by a rewrite, or None."""
    value = getattr(model, CONFIG_ATTR, None)
    return dict(value) if isinstance(value, dict) else None


def recorded_added(model: nn.Module) -> list[str] | None:
    value = getattr(model, ADDED_ATTR, None)
    return list(value) if isinstance(value, list) else None


def marker_owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if MARKER in m._buffers]


def _register_marker(module: nn.Module, config: dict) -> None:
    value = encode_config(config)
    ref = next(iter(module.buffers(recurse=True)), None)
    device = ref.device if ref is not None and ref.device.type != "meta" else None
    if device is None:
        ref = next(iter(module.parameters()), None)
        device = ref.device if ref is not None and ref.device.type != "meta" else torch.device("cpu")
    if MARKER in module._buffers:
        module._buffers[MARKER] = value.to(device)
    else:
        module.register_buffer(MARKER, value.to(device), persistent=True)


def _guard(module: nn.Module, relative_owner: str) -> None:
    owners = module.__dict__.setdefault(_GUARDED_ATTR, set())
    owners.add(relative_owner)
    if not getattr(module, _HOOK_FLAG, False):
        if hasattr(module, "register_load_state_dict_pre_hook"):
            module.register_load_state_dict_pre_hook(_check_markers_on_load)
        else:  # torch < 2.5
            module._register_load_state_dict_pre_hook(_check_markers_on_load, with_module=True)
        setattr(module, _HOOK_FLAG, True)


# ---------------------------------------------------------------------------------------------- the load guard
def _check_markers_on_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: refuse weights written for another function, before any is copied.

    It raises (rather than adding to `error_msgs`, after which torch would go on copying the other weights),
    and it does so whatever `strict` is: `strict=False` and Lightning's `strict_loading = False` included.
    """
    for rel in sorted(getattr(module, _GUARDED_ATTR, ())):
        try:
            owner = module.get_submodule(rel) if rel else module
        except AttributeError:
            continue  # the module tree changed since the rewrite
        if MARKER in owner._buffers:
            _check_owner(owner, state_dict, prefix + (rel + "." if rel else ""))


def _check_owner(owner: nn.Module, state_dict, prefix: str) -> None:
    key = prefix + MARKER
    mine = decode_config(owner._buffers.get(MARKER))
    if key in state_dict:
        theirs = decode_config(state_dict[key])
        if theirs != mine:
            raise RuntimeError(
                f"ln_lightning: the state_dict was saved from a model rewritten to {theirs}, but this model is rewritten "
                f"to {mine}. Use the same LNPlacement options as the run that wrote it (they are stored in "
                "checkpoint['ln_lightning']['config']), or ln_lightning.load_converted(...)."
            )
        return
    if not any(k.startswith(prefix) for k in state_dict):
        return  # a partial load that holds nothing for this module's weights
    where = prefix.rstrip(".") or "<root>"
    accepted = getattr(owner, _ACCEPT_FLAG, None)
    if accepted is not None:
        if accepted["warned"]:  # once per accept_unconverted block (the owner's ancestors check it too)
            return
        accepted["warned"] = True
        log.warning(
            "ln_lightning: loading a state_dict without the placement marker into %s, rewritten to %s "
            "(accept_unconverted): its weights come from a model without this rewrite, and this model computes "
            "%s-norm with them; its output differs from the model that wrote them.", where, mine, (mine or {}).get("placement")
        )
        return
    raise RuntimeError(
        f"ln_lightning: the state_dict has no '{key}' entry: it was saved from a model without the placement "
        f"rewrite, but this model ({where}) is rewritten to {mine}, so its weights would compute another function "
        "than the one they were trained for. Load them into the unconverted model first and let LNPlacement "
        "rewrite it (fit without ckpt_path), or, to load them into this rewritten model on purpose, opt in: "
        "`with ln_lightning.accept_unconverted(model): model.load_state_dict(...)`, or "
        "LNPlacement(..., resume_unconverted=True) for a Trainer's ckpt_path."
    )


@contextlib.contextmanager
def accept_unconverted(model: nn.Module) -> Iterator[nn.Module]:
    """Let `model` (rewritten) load state_dicts saved without the rewrite, inside this block only.

    The first such load in the block logs a warning saying what it does. A state_dict written for *another*
    rewrite is still refused.

        with accept_unconverted(model):
            model.load_state_dict(post_norm_state_dict, strict=False)
    """
    owners = [m for _, m in marker_owners(model)]
    previous = [vars(m).get(_ACCEPT_FLAG) for m in owners]
    for m in owners:
        setattr(m, _ACCEPT_FLAG, {"warned": False})
    try:
        yield model
    finally:
        for m, old in zip(owners, previous):
            if old is not None:
                setattr(m, _ACCEPT_FLAG, old)
            else:
                vars(m).pop(_ACCEPT_FLAG, None)


__all__ = ["MARKER", "CONFIG_ATTR", "ADDED_ATTR", "record", "recorded_config", "recorded_added", "accept_unconverted",
           "marker_owners", "owner_path", "encode_config", "decode_config"]
