"""What a run with `LNPlacement` leaves in a checkpoint, the guards that read it, and reading it back.

`LNPlacement` (``ln_lightning.plugin``) writes and checks the records below; ``load_converted`` reads them
(:func:`read_checkpoint`, :func:`placement_config`, :func:`build_model`, then the plugin's rewrite, then
:func:`restore`).

The format
----------
In the checkpoint dict, under ``checkpoint["ln_lightning"]`` (:data:`CHECKPOINT_KEY`), written by
``LNPlacement.on_save_checkpoint`` (:func:`placement_entry`) into every checkpoint of a run with the plugin:

* ``"config"`` (dict): the configuration the model computes, whoever rewrote it (``LNPlacement.config``):
  ``{"placement": str, "final_norm": bool, "branch_scale": None | float | "depth" | "layerscale"}`` (the
  placement one of ``convert``'s: ``"pre"``, ``"post"``, ...), plus the options given explicitly that
  change the function (``"layerscale_init": float``); ``LNPlacement(**config)`` rebuilds the same rewrite.
* ``"fused"`` (bool): whether the model's norms were ln_lightning's ``FusedLayerNorm`` when it was saved.
* ``"report"`` (dict or None): ``ConversionReport.to_dict()`` of the rewrite the plugin did in that
  process; None when it trained a model rewritten before it.
* ``"model_class"`` (str): the LightningModule's class as ``module.QualName`` (``__main__.X`` for a class
  defined in a script); ``load_converted`` refuses another class.

In ``checkpoint["state_dict"]`` (and in any ``state_dict()`` of the rewritten model):

* ``<owner>.ln_lightning_placement`` (``rewrite_record.MARKER``): a ``uint8`` tensor, the config above as
  UTF-8 JSON (``json.dumps(config, sort_keys=True)``), on each module that owns a rewritten stack. Its
  encoding and its ``load_state_dict`` guard are ``ln_lightning.rewrite_record``'s.
* ``ln_lightning_transition.blend`` (float32 scalar), ``.start_step`` (int64 scalar, -1 before the first
  step) and ``.schedule`` (int64 ``[steps, kind]``, ``kind`` indexing ``("linear", "cosine")``): only while
  a placement transition (``transition_steps``) is under way (``ln_lightning.placement.transition``).
* the parameters the rewrite added (a final norm, LayerScale), as ordinary entries.

Versions: there is no version field. ln_lightning 0.1.0 wrote ``"config"``, ``"fused"`` (then: what the
plugin asked for), ``"report"`` and the marker, with the same encoding; ``"model_class"`` and the
transition buffers came after it. The readers here take what is there: without ``"model_class"`` there is
no class check, without ``"config"`` the marker's JSON is used, so 0.1.0 checkpoints load. A ``"config"``
key this version's ``LNPlacement`` does not take (a newer option) is refused by ``load_converted`` with
ValueError, rather than dropped.

What each guard refuses
-----------------------
* The marker's ``load_state_dict`` pre-hook (``rewrite_record``; on every load, ``strict=False`` and
  Lightning's ``strict_loading = False`` included, before any weight is copied): a state_dict whose marker
  holds another configuration, and one without the marker that holds weights for a rewritten module,
  unless the caller opts in (``ln_lightning.accept_unconverted``). RuntimeError.
* The ``ckpt_path`` guard (:func:`guard_loading` with :func:`check_unconverted`, right after the module's
  own ``on_load_checkpoint``): a checkpoint written without the rewrite (no marker), unless
  ``LNPlacement(resume_unconverted=True)`` (then it is loaded on purpose, with a warning), and one written
  mid-transition into a plugin without ``transition_steps``. RuntimeError naming the options to pass.
* ``load_converted``: a missing, empty, truncated or foreign file, a directory (a distributed checkpoint),
  a checkpoint that records no rewrite or whose marker is not a record, another class than the one recorded,
  and a class it would have to build with its constructor's defaults (no stored hyperparameters).
  FileNotFoundError, ValueError or TypeError, each naming the file.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch import LightningModule
from torch import nn

from ln_lightning import rewrite_record
from ln_lightning._warnings import warn
from ln_lightning.placement import transition
from ln_lightning.rewrite_record import MARKER

CHECKPOINT_KEY = "ln_lightning"
_TRANSITION_ENDED = "_ln_lightning_transition_finished"  # instance attribute: a transition ran on this model and ended


# ---------------------------------------------------------------------------------------------- writing
def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def placement_entry(model: nn.Module, *, config: dict, fused: bool, report: Any) -> dict:
    """What `LNPlacement` writes under ``checkpoint[CHECKPOINT_KEY]`` for `model` (see the module docstring)."""
    return {
        # What the model computes, whoever rewrote it (this plugin, an earlier one, or convert).
        "config": config,
        "fused": fused,  # what the model runs, not what this plugin asked for
        "report": report.to_dict() if report is not None else None,
        "model_class": qualified_name(type(model)),  # load_converted checks the class it is given
    }


# ---------------------------------------------------------------------------------------------- the ckpt_path guard
def _is_guard(fn: Any) -> bool:
    return isinstance(fn, functools.partial) and fn.func is _guarded_on_load_checkpoint


def _guarded_on_load_checkpoint(check: Callable, module: LightningModule, original, checkpoint: dict) -> None:
    if _is_guard(vars(module).get("on_load_checkpoint")):
        del module.on_load_checkpoint  # back to the previous method (this runs once)
    original(checkpoint)
    check(module, checkpoint)


def guard_loading(module: LightningModule, check: Callable[[LightningModule, dict], None]) -> None:
    """Run `check(module, checkpoint)` once, right after `module`'s own ``on_load_checkpoint``, the next time
    Lightning loads a checkpoint into it (a Trainer's ``ckpt_path``: before any weight is restored).

    A guard left by a run that failed before :func:`remove_loading_guard` is replaced, not stacked or reused.
    """
    current = vars(module).get("on_load_checkpoint")
    original = current.args[2] if _is_guard(current) else module.on_load_checkpoint
    module.on_load_checkpoint = functools.partial(_guarded_on_load_checkpoint, check, module, original)


def remove_loading_guard(module: nn.Module) -> None:
    """Remove the guard :func:`guard_loading` left, if no checkpoint was loaded since."""
    if _is_guard(vars(module).get("on_load_checkpoint")):
        del module.on_load_checkpoint


def _fmt(config: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def check_unconverted(module: nn.Module, checkpoint: dict, *, where: str, resume_unconverted: bool,
                      transition_steps: int | None) -> list[str]:
    """Before Lightning loads a ckpt_path into the rewritten model: one without the marker is refused or,
    with `resume_unconverted`, loaded on purpose (markers and the rewrite's added weights filled in).

    Returns the parameters the rewrite added that keep their fresh values, when the checkpoint's optimizer
    states have to be fitted to them (:func:`remap_optimizer_states`, once the optimizers exist); else [].
    """
    state = checkpoint.get("state_dict")
    owners = rewrite_record.marker_owners(module)
    if not isinstance(state, dict) or not owners:
        return []
    transition_fill = _transition_before_load(module, state, resume_unconverted)
    missing = []
    for name, _ in owners:
        prefix = f"{name}." if name else ""
        if prefix + MARKER not in state and any(k.startswith(prefix) for k in state):
            missing.append(prefix + MARKER)
    if not missing:
        return []  # markers present: the load-state-dict hook compares their configurations
    config = rewrite_record.recorded_config(module)  # there: whoever placed the markers recorded it
    if not resume_unconverted:
        raise RuntimeError(
            f"LNPlacement: {where} was written without the placement rewrite (no '{MARKER}' entry): its weights "
            f"were trained for the model before the rewrite, and this model is rewritten to ({_fmt(config or {})}), "
            "which computes another function with them. To migrate a trained post-norm model, load its weights "
            "into the unconverted model and fit with LNPlacement without ckpt_path; to load this checkpoint into "
            "the rewritten model on purpose, pass LNPlacement(..., resume_unconverted=True)."
        )
    own = module.state_dict()
    for key in missing + transition_fill:
        state[key] = own[key].detach().cpu().clone()
    added = rewrite_record.recorded_added(module) or []
    fresh = [k for k in own if k not in state and any(k == a or k.startswith(a + ".") for a in added)]
    for key in fresh:
        state[key] = own[key].detach().cpu().clone()
    fresh_params = [k for k in fresh if k in dict(module.named_parameters())]
    warn(
        f"LNPlacement(resume_unconverted=True): {where} was written without the placement rewrite; its weights are "
        f"loaded into the model rewritten to ({_fmt(config or {})}), which computes "
        + (f"exactly the function they were trained for at the resume and moves to "
           f"{(config or {}).get('placement')}-norm over the next {transition_steps} optimizer steps "
           "(transition_steps); the optimizer state of existing parameters is kept." if transition_fill else
           f"{(config or {}).get('placement')}-norm with them from the first step, not the function they were "
           "trained for.")
        + (f" Parameters the rewrite added keep their fresh values ({', '.join(fresh)})"
           + ("; they start with fresh optimizer state, the existing parameters keep theirs." if fresh_params else ".")
           if fresh else "")
    )
    return fresh_params if isinstance(checkpoint.get("optimizer_states"), list) else []


def end_transition(module: nn.Module) -> None:
    """End the transition under way on `module` (``transition.finish``), and note that it ran and ended."""
    transition.finish(module)
    module.__dict__[_TRANSITION_ENDED] = True


def transition_ended(module: nn.Module) -> bool:
    """Whether a transition ran on `module` and ended (:func:`end_transition`): its converted model is the transition's."""
    return module.__dict__.get(_TRANSITION_ENDED, False)


def _transition_before_load(module: nn.Module, state: dict, resume_unconverted: bool) -> list[str]:
    """A transition under way meets a checkpoint: the keys to fill from the model (a plugin-less checkpoint:
    the transition starts at its step), or none. A rewritten model's checkpoint without the transition's
    buffers was written after the transition ended: the model ends it too before the load."""
    if transition.active(module) is None:
        sched = state.get(transition.ATTR + ".schedule")
        if sched is not None:
            steps, kind = (int(v) for v in sched.tolist())
            raise RuntimeError(
                f"LNPlacement: the checkpoint was written during a placement transition (blend "
                f"{float(state.get(transition.ATTR + '.blend', float('nan'))):.4g}), but this LNPlacement has no "
                f"transition_steps, so its model would compute another function with those weights. Pass "
                f"LNPlacement(..., transition_steps={steps}, transition_schedule={transition.SCHEDULES[kind]!r}) "
                "(the values it records)."
            )
        return []
    keys = [k for k in module.state_dict() if k.startswith(transition.ATTR + ".")]
    if all(k in state for k in keys):
        return []
    if any(k.rpartition(".")[2] == MARKER for k in state):
        end_transition(module)
        return []
    return keys if resume_unconverted else []


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
                "by those), or pass LNPlacement(final_norm=False, branch_scale=None) so the rewrite adds no parameters."
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
def read_checkpoint(path: Path, map_location: Any) -> dict:
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
        checkpoint = torch.load(path, map_location=map_location, weights_only=False)
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


def placement_config(checkpoint: dict, path: Path) -> dict:
    """The placement configuration `checkpoint` (read from `path`) records: its entry's, else its marker's."""
    config = _entry(checkpoint).get("config")
    if config is None:
        state_dict = checkpoint.get("state_dict", checkpoint)
        markers = [k for k in state_dict if k.rpartition(".")[2] == MARKER]
        if not markers:
            raise ValueError(
                f"load_converted: {path} records no placement rewrite (no checkpoint['{CHECKPOINT_KEY}'] and no "
                f"'{MARKER}' entry); load it the usual way (Model.load_from_checkpoint / load_state_dict)."
            )
        config = rewrite_record.decode_config(state_dict[markers[0]])
        if config is None:
            raise ValueError(f"load_converted: {path}: the '{markers[0]}' entry is not a placement record.")
    return config


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


def restore(model: nn.Module, checkpoint: dict, report: Any, *, strict: bool = True) -> nn.Module:
    """Load `checkpoint` into `model`, already rewritten as it records (`report`: that rewrite's report): a
    transition under way when it was written, the module's own ``on_load_checkpoint``, then the weights
    (strictly by default). Returns the model in eval mode."""
    state_dict = checkpoint.get("state_dict", checkpoint)
    if any(k.startswith(transition.ATTR + ".") for k in state_dict):  # written mid-transition: restore its blend
        transition.start(model, report)
    if isinstance(model, LightningModule):
        model.on_load_checkpoint(checkpoint)
    model.load_state_dict(state_dict, strict=strict)
    return model.eval()


__all__ = ["CHECKPOINT_KEY", "placement_entry", "qualified_name", "guard_loading", "remove_loading_guard",
           "check_unconverted", "end_transition", "transition_ended", "remap_optimizer_states", "read_checkpoint", "placement_config", "build_model", "restore"]
