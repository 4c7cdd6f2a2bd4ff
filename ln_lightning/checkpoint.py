"""What a run with `LNPlacement` leaves in a checkpoint, and reading it back (``load_converted``).

The format
----------
In the checkpoint dict, under ``checkpoint["ln_lightning"]`` (:data:`CHECKPOINT_KEY`), written by
``LNPlacement.on_save_checkpoint`` from the model's rewrite state (``RewriteState.checkpoint_entry``) into
every checkpoint of a run with the plugin (plain data: ``torch.load(weights_only=True)`` reads it):

* ``"format"`` (int): 2 (absent in format 1, ln_lightning 0.1).
* ``"config"`` (dict): the configuration the model computes, whoever rewrote it:
  ``{"placement": str, "final_norm": bool, "branch_scale": None | float | "depth" | "layerscale"}`` (the
  placement one of ``convert``'s: ``"pre"``, ``"post"``, ...), plus the options given explicitly that change the
  function (``"layerscale_init": float``, ``"mix_post_blocks": int``); ``LNPlacement(PlacementSpec.from_config(config))`` rebuilds it.
* ``"record"`` (dict): the whole rewrite state (``RewriteState.to_record()``): the config, the blocks converted,
  the modules added and the ones they derive from, the transition (steps, schedule, steps done, blend).
  ``load_converted`` rebuilds the model from it and checks it has the same blocks and added modules.
* ``"fused"`` (bool): whether the model's norms were ln_lightning's ``FusedLayerNorm`` when it was saved.
* ``"report"`` (dict or None): ``ConversionReport.to_dict()`` of the rewrite.
* ``"model_class"`` (str): the LightningModule's class as ``module.QualName`` (``__main__.X`` for a class
  defined in a script); ``load_converted`` refuses another class.

In ``checkpoint["state_dict"]`` (and in any ``state_dict()`` of the rewritten model), written by the rewrite
state (``ln_lightning.placement.state``, which documents the encoding and the load guard):

* ``<owner>.ln_lightning_placement``: a ``uint8`` tensor, the config as UTF-8 JSON, on each module that owns a
  rewritten stack;
* ``ln_lightning_transition.blend`` (float32 scalar), ``.steps_done`` (int64 scalar) and ``.schedule`` (int64
  ``[steps, kind]``, ``kind`` indexing ``("linear", "cosine")``): only while a placement transition
  (``transition_steps``) is under way (format 1 had ``.start_step``, the global step it started at, instead
  of ``.steps_done``: a load recovers the steps done from the blend);
* the parameters the rewrite added (a final norm, LayerScale), as ordinary entries.

Beside them, only while a transition with distillation is under way, written by ``LNPlacement`` for the fit to
resume as it would have gone on: ``checkpoint["ln_lightning_teacher"]`` (the teacher's state_dict: the trained
function it distils towards and measures its drift from) and ``checkpoint["ln_lightning_transition_run"]``
(``{"excess": float32 scalar}``: the closed loop's smoothed loss excess, ``TransitionSpec.excess_tolerance``).
``load_converted`` reads neither.

Readers take what is there: without ``"format"``/``"record"`` (format 1) the configuration is rebuilt without
the check of blocks and added modules, without ``"model_class"`` there is no class check, without ``"config"``
the marker's JSON is used. A record of a newer format, or a ``"config"`` key this version's ``LNPlacement``
does not take (a newer option), is refused by ``load_converted`` with ValueError, rather than dropped.

What each guard refuses
-----------------------
* The model's load guard (``ln_lightning.placement.state``; on every load, ``strict=False`` and Lightning's
  ``strict_loading = False`` included, before any weight is copied, so a ``ckpt_path`` too): a state_dict
  whose marker holds another configuration, and one without the marker that holds weights for a rewritten
  module, unless the caller opts in (``ln_lightning.accept_unconverted``, ``LNPlacement(resume_unconverted=
  True)``). RuntimeError.
* ``LNPlacement`` at fit start: a model in a transition (from its checkpoint, or left by an earlier fit) and
  no ``transition_steps``, or other ones than it records. PlacementError naming the values to pass.
* ``load_converted``: a missing, empty, truncated or foreign file, a directory (a distributed checkpoint),
  a checkpoint that records no rewrite or whose marker is not a record, another class than the one recorded,
  a class it would have to build with its constructor's defaults (no stored hyperparameters), a file
  ``weights_only=True`` refuses (the opt-out is named). FileNotFoundError, ValueError or TypeError, each
  naming the file.
"""

from __future__ import annotations

import inspect
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn

from ln_lightning.placement.rewrite.apply import apply_config, rebuild
from ln_lightning.placement.spec import PlacementSpec
from ln_lightning.placement.state import FORMAT, MARKER, decode_config, qualified_name

CHECKPOINT_KEY = "ln_lightning"


# ---------------------------------------------------------------------------------------------- resuming
def remap_optimizer_states(checkpoint: dict, optimizers: list, module: nn.Module, added: set[str]) -> None:
    """Make a plugin-less checkpoint's optimizer states fit optimizers that also hold the parameters the rewrite
    added: the saved states keep their parameters (in the order the same configure_optimizers gave them without
    the added ones), the added parameters get none (fresh). Refuses when the groups don't line up that way."""
    names = {id(p): n for n, p in module.named_parameters()}
    for k, (opt, saved) in enumerate(zip(optimizers, checkpoint["optimizer_states"])):
        groups = saved.get("param_groups", [])
        if sum(len(g["params"]) for g in groups) == sum(len(g["params"]) for g in opt.param_groups):
            continue  # this optimizer holds none of the added parameters
        kept = [[p for p in g["params"] if names.get(id(p)) not in added] for g in opt.param_groups]
        if len(groups) != len(opt.param_groups) or any(len(a) != len(g["params"]) for a, g in zip(kept, groups)):
            raise RuntimeError(
                f"LNPlacement(resume_unconverted=True): the checkpoint's optimizer {k} has parameter groups of sizes "
                f"{[len(g['params']) for g in groups]}, which are not this optimizer's groups "
                f"{[len(g['params']) for g in opt.param_groups]} without the parameters the rewrite added "
                f"({', '.join(sorted(added))}). Build the optimizer from self.parameters() (or groups that differ only "
                "by those), or pass LNPlacement(PlacementSpec(\"pre\", final_norm=False)) (no branch_scale) so the rewrite adds no parameters."
            )
        state, new_state, new_groups, index = saved.get("state", {}), {}, [], 0
        for g_new, g_old in zip(opt.param_groups, groups):
            old_ids = iter(g_old["params"])
            ids = []
            for p in g_new["params"]:
                if names.get(id(p)) not in added:
                    old = next(old_ids)
                    if old in state:
                        new_state[index] = state[old]
                ids.append(index)
                index += 1
            new_groups.append({**g_old, "params": ids})
        saved["state"], saved["param_groups"] = new_state, new_groups


# ---------------------------------------------------------------------------------------------- reading
def read_checkpoint(path: Path, map_location: Any, *, weights_only: bool = True) -> dict:
    """torch.load, with every way a file can fail to be a checkpoint turned into one message naming it."""
    if not path.exists():
        raise FileNotFoundError(f"load_converted: {path} does not exist.")
    if path.is_dir():
        raise ValueError(
            f"load_converted: {path} is a directory (a distributed checkpoint); consolidate it into one file first, "
            "e.g. ModelParallelStrategy(save_distributed_checkpoint=False), or "
            "`python -m lightning.fabric.utilities.consolidate_checkpoint PATH`."
        )
    if path.stat().st_size == 0:
        raise ValueError(f"load_converted: {path} is empty (0 bytes), not a checkpoint (was its run killed while saving?).")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if weights_only and refused is not None:  # a real checkpoint holding an object outside torch's allowlist
            raise ValueError(
                f"load_converted: {path} holds an object torch.load(weights_only=True) refuses to unpickle, "
                f"{refused.group(1)} (usually a hyperparameter of a class of yours). If you trust the file, pass "
                f"load_converted(..., weights_only=False), or allowlist the class with "
                f"torch.serialization.add_safe_globals([{refused.group(1).rpartition('.')[2]}])."
            ) from None
        raise ValueError(
            f"load_converted: cannot read {path} as a PyTorch checkpoint: {type(err).__name__}: {str(err).rstrip('.')}. It may be "
            "truncated (a run killed while saving) or another kind of file."
        ) from None
    except Exception as err:  # zip/pickle/EOF/unpickling errors: one message, not torch's internals
        raise ValueError(
            f"load_converted: cannot read {path} as a PyTorch checkpoint: {type(err).__name__}: {str(err).rstrip('.')}. It may be "
            "truncated (a run killed while saving) or another kind of file."
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict", checkpoint), dict):
        raise ValueError(
            f"load_converted: {path} holds a {type(checkpoint).__name__}, not a checkpoint (a dict with a "
            "'state_dict', or a state_dict)."
        )
    return checkpoint


def _entry(checkpoint: dict) -> dict:
    entry = checkpoint.get(CHECKPOINT_KEY)
    return entry if isinstance(entry, dict) else {}


def placement_record(checkpoint: dict, path: Path) -> dict:
    """The rewrite `checkpoint` (read from `path`) records, as ``RewriteState.to_record()`` data: the entry's
    record; for format 1, ``{"config": ...}`` only (from the entry, else from the marker)."""
    entry = _entry(checkpoint)
    if int(entry.get("format", 1)) > FORMAT:
        raise ValueError(
            f"load_converted: {path} was written in checkpoint format {entry['format']}, newer than this ln_lightning "
            f"reads ({FORMAT}); upgrade ln_lightning."
        )
    record = entry.get("record")
    if isinstance(record, dict) and isinstance(record.get("config"), dict):
        return record
    config = entry.get("config")
    if config is None:
        state_dict = checkpoint.get("state_dict", checkpoint)
        markers = [k for k in state_dict if k.rpartition(".")[2] == MARKER]
        if not markers:
            raise ValueError(
                f"load_converted: {path} records no placement rewrite (no checkpoint['{CHECKPOINT_KEY}'] and no "
                f"'{MARKER}' entry); load it the usual way (Model.load_from_checkpoint / load_state_dict)."
            )
        config = decode_config(state_dict[markers[0]])
        if config is None:
            raise ValueError(f"load_converted: {path}: the '{markers[0]}' entry is not a placement record.")
    return {"config": config}


def _takes_arguments(cls: type) -> bool:
    try:
        return bool(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return True


def _class_matches(cls: type, recorded: str) -> bool:
    for c in cls.__mro__:
        name = qualified_name(c)
        # A class defined in a script is recorded as __main__.X and imported elsewhere as module.X.
        if name == recorded or ("__main__" in (c.__module__, recorded.rpartition(".")[0])
                                and c.__qualname__ == recorded.rpartition(".")[2]):
            return True
    return False


def build_model(model: type[nn.Module] | nn.Module, checkpoint: dict, path: Path, model_kwargs: dict) -> nn.Module:
    """The model `load_converted` loads into: `model` itself (an instance) or built from the class, after
    checking it is the class the checkpoint records (see ``load_converted`` for the rules)."""
    recorded_class = _entry(checkpoint).get("model_class")
    cls = model if isinstance(model, type) else type(model)
    if recorded_class and not _class_matches(cls, recorded_class):
        raise ValueError(
            f"load_converted: {path} was written from {recorded_class}, not {qualified_name(cls)}: its weights (and "
            f"hyperparameters) belong to that class. Pass {recorded_class.rpartition('.')[2]} or an instance of it."
        )
    if isinstance(model, type):
        source = "model_kwargs"
        if issubclass(model, LightningModule):
            hparams = checkpoint.get(LightningModule.CHECKPOINT_HYPER_PARAMS_KEY) or {}
            kwargs = {k: v for k, v in dict(hparams).items() if not k.startswith("_")}
            if kwargs:
                source = "the hyperparameters stored in the checkpoint" + (" and model_kwargs" if model_kwargs else "")
            elif not model_kwargs and _takes_arguments(model):
                raise ValueError(
                    f"load_converted: {path} stores no hyperparameters (the module did not call "
                    f"self.save_hyperparameters()), so {model.__name__} would be built with its constructor defaults, "
                    "which may describe another model whose weights happen to fit. Pass an instance, "
                    f"load_converted({model.__name__}(...), path), or the constructor arguments, "
                    f"load_converted({model.__name__}, path, d_model=..., ...)."
                )
            kwargs.update(model_kwargs)
        else:
            if not model_kwargs and _takes_arguments(model):
                raise ValueError(
                    f"load_converted: {model.__name__} is a plain nn.Module class and a checkpoint stores no constructor "
                    f"arguments for it; pass them (load_converted({model.__name__}, path, ...)) or an instance."
                )
            kwargs = dict(model_kwargs)
        try:
            model = model(**kwargs)
        except TypeError as err:
            raise TypeError(
                f"load_converted: building {model.__name__}(**{sorted(kwargs)}) from {source} ({path}) failed: {err}."
                + (f" The checkpoint was written from {recorded_class}." if recorded_class else
                   " Is it a checkpoint of this class?")
            ) from None
    elif model_kwargs:
        raise TypeError(f"load_converted: model_kwargs {sorted(model_kwargs)} are only used when `model` is a class")
    return model



def load_converted(
    model: type[nn.Module] | nn.Module,
    checkpoint_path: str | os.PathLike,
    *,
    map_location: Any = "cpu",
    fused: bool = False,
    strict: bool = True,
    weights_only: bool = True,
    **model_kwargs: Any,
) -> nn.Module:
    """Load a checkpoint written by a run with `LNPlacement` into the original model class, for inference.

    ``model`` is the class or an instance. A LightningModule class is built from the checkpoint's
    hyperparameters (``save_hyperparameters()``), updated with ``model_kwargs``; a checkpoint without them
    needs ``model_kwargs`` or an instance (building with the defaults could give another model whose
    weights happen to fit, so it is refused). Another nn.Module class is built from ``model_kwargs``. The
    class must be the one the checkpoint records (or a subclass). The placement rewrite recorded in the
    checkpoint is applied before the weights are loaded (strictly), including a transition under way when it
    was written; returns the model in eval mode. The file is read with ``torch.load(weights_only=True)``, as
    Lightning reads a ``ckpt_path``; ``weights_only=False`` is for a trusted file whose hyperparameters hold
    objects that refuses.

    Example::

        model = load_converted(CharLM, "lightning_logs/version_0/checkpoints/last.ckpt")
    """
    path = Path(checkpoint_path)
    checkpoint = read_checkpoint(path, map_location, weights_only=weights_only)
    record = placement_record(checkpoint, path)
    model = build_model(model, checkpoint, path, model_kwargs)
    try:
        PlacementSpec.from_config(record["config"])  # the serialised spec: what this version can build
    except (TypeError, ValueError) as err:
        raise ValueError(f"load_converted: {path} records a placement configuration LNPlacement can't build: {err}") from None
    if record.get("converted") is None:  # format 1: only the configuration is known
        apply_config(model, record["config"], fused=fused)
    else:
        rebuild(model, {**record, "transition": None}, fused=fused)  # a transition: from the weights, at the load
    if isinstance(model, LightningModule):
        model.on_load_checkpoint(checkpoint)
    model.load_state_dict(checkpoint.get("state_dict", checkpoint), strict=strict)
    return model.eval()

__all__ = ["load_converted", "CHECKPOINT_KEY", "remap_optimizer_states", "read_checkpoint", "placement_record", "build_model"]
