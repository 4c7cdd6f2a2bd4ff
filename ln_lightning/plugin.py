"""`LNPlacement`: the LayerNorm placement rewrite as a Lightning Trainer plugin.

    Trainer(plugins=[LNPlacement("pre")]).fit(model)

How it takes effect (Lightning 2.6): `LNPlacement` is a `LayerSync` (so the Trainer accepts it as a plugin)
and a `Callback`. Its `setup` hook runs on every strategy before `configure_model`, before checkpoint weights
are restored and before `configure_optimizers`, so parameters the rewrite adds are trained and restored like
any other. The Trainer does not call plugins as callbacks; `ln_lightning._lightning_patch` (one small,
version-guarded wrapper, and every other Lightning internal the package reads) registers it, and rewrites the
main process's model under spawn launchers. What the plugin writes into checkpoints, the guards that check
them when they are loaded, and the reading behind `load_converted` are `ln_lightning.checkpoint`'s.
"""

from __future__ import annotations

import functools
import json
import math
import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from torch import nn

from ln_lightning import _lightning_patch, rewrite_record
from ln_lightning._warnings import info, warn
from ln_lightning.checkpoint import (
    CHECKPOINT_KEY,
    build_model,
    check_unconverted,
    end_transition,
    guard_loading,
    placement_config,
    placement_entry,
    read_checkpoint,
    remap_optimizer_states,
    remove_loading_guard,
    restore,
    transition_ended,
)
from ln_lightning.norm import FusedLayerNorm, swap_layernorms
from ln_lightning.placement import PlacementError, convert, inspect_model, is_deferred, transition, validate_options
from ln_lightning.placement.options import mix_split
from ln_lightning.placement.scale import BranchScale
# The state_dict marker and the config record are defined (and documented) in ln_lightning.rewrite_record.
from ln_lightning.rewrite_record import MARKER

log = logging.getLogger(__name__)

REPORT_FILENAME = "ln_placement_report.json"

# Strategies under which the rewrite is tested to take effect before checkpoint restore and optimizers.
SUPPORTED_STRATEGIES: tuple[type[Strategy], ...] = (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy)


class UnsupportedStrategyError(RuntimeError):
    """`LNPlacement` cannot guarantee the rewrite under this strategy (raised at fit start)."""


def _merge_swaps(swaps: list) -> dict | None:
    if not swaps:
        return None
    return {
        "swapped": [p for r in swaps for p in r.swapped],
        "skipped": [{"path": k.path, "reason": k.reason} for r in swaps for k in r.skipped],
        "backend": swaps[0].backend,
    }


def _configure_model_then_rewrite(placement: "LNPlacement", trainer: Trainer, stage: str, module: LightningModule,
                                  original) -> None:
    del module.configure_model  # back to the class's method (this runs once)
    if isinstance(trainer.strategy, ModelParallelStrategy):
        # configure_model applies fully_shard / parallelize itself; the rewrite must come first.
        original()
        found = _placement_inspect(module)
        if found:
            raise RuntimeError(
                f"LNPlacement: {type(module).__name__} builds its residual blocks ({', '.join(found[:3])}...) in "
                "configure_model, where ModelParallelStrategy also shards them; the rewrite has to come before "
                "sharding. Build the layers in __init__ (meta device is fine), or call "
                "ln_lightning.convert(...) inside configure_model before fully_shard and drop LNPlacement."
            )
        placement._announce(trainer, stage, True)  # nothing to rewrite: the report says so
        return
    original()
    if any(p.device.type == "meta" for p in module.parameters()):
        return  # not materialised yet: FSDPStrategy.setup calls LayerSync.apply (our `apply`) before wrapping
    placement.rewrite(module)
    placement._announce(trainer, stage, True)


def _placement_inspect(module: nn.Module) -> list[str]:
    return inspect_model(module).block_paths()


def _uses_fused(model: nn.Module) -> bool:
    """Whether the model's norms are ln_lightning's fused ones (what it computes with, whoever swapped them)."""
    return any(isinstance(m, FusedLayerNorm) for m in model.modules())


def _fmt(config: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def _rewritten_stacks(model: nn.Module, placement: str) -> list:
    """The stacks a rewrite to `placement` changed: those with a block of that placement ("mix": pre)."""
    block_placement = "pre" if placement == "mix" else placement
    return [s for s in inspect_model(model).stacks if any(b.placement == block_placement for b in s.blocks)]


def _scale_per_stack(config: dict, depths: list[int]) -> list[Any]:
    """What each stack's branches are multiplied by under `config` (None and 1.0 are the same function)."""
    bs = config.get("branch_scale")
    if bs == "depth":
        return [1.0 / math.sqrt(2 * d) for d in depths]
    if bs is None:
        return [1.0] * len(depths)
    return [float(bs) if isinstance(bs, (int, float)) else bs] * len(depths)


def _difference(existing: dict, request: dict, model: nn.Module, added: list[str] | None) -> str | None:
    """Why a model rewritten to `existing` computes another function than `request` would give it; None if it doesn't."""
    if existing.get("placement") != request["placement"]:
        return f"placement {existing.get('placement')!r} is not {request['placement']!r}"
    placement = request["placement"]
    if placement == "post":
        return None  # "post" takes no other option that changes the function
    if placement == "mix" and existing.get("mix_post_blocks") != request.get("mix_post_blocks"):
        # None is a quarter of each stack: an explicit count equal to that on every stack is the same function.
        depths = [s.depth for s in inspect_model(model).stacks]
        if [mix_split("mix", d, existing.get("mix_post_blocks")) for d in depths] != [mix_split("mix", d, request.get("mix_post_blocks")) for d in depths]:
            return (f"mix_post_blocks {existing.get('mix_post_blocks')!r} is not {request.get('mix_post_blocks')!r} "
                    "(None: a quarter of each stack)")
    stacks = None
    if existing.get("branch_scale") != request["branch_scale"]:
        stacks = _rewritten_stacks(model, placement)
        depths = [s.depth for s in stacks]
        have, want = _scale_per_stack(existing, depths), _scale_per_stack(request, depths)
        same = all(
            (math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) and isinstance(b, float) else a == b)
            for a, b in zip(have, want)
        )
        if not same:
            return f"branch_scale {existing.get('branch_scale')!r} is not {request['branch_scale']!r}"
    if request["branch_scale"] == "layerscale" and existing.get("layerscale_init") != request.get("layerscale_init"):
        return (f"layerscale_init {existing.get('layerscale_init', 'unknown')!r} is not {request.get('layerscale_init')!r} "
                "(the scales started from other values)")
    if bool(existing.get("final_norm")) != request["final_norm"]:
        stacks = stacks if stacks is not None else _rewritten_stacks(model, placement)
        finals = [s.final_norm for s in stacks]
        if request["final_norm"]:  # the request adds a final norm wherever a stack has none
            if any(f is None for f in finals):
                return "final_norm=False left a stack without a final norm; final_norm=True would add one"
        elif added is None or any(f in added for f in finals):  # unknown, or the rewrite added one
            return "final_norm=True added a final norm that final_norm=False would not have"
    return None


def _infer_config(model: nn.Module) -> dict | None:
    """The configuration of an engine rewrite that left no record, read from the model's structure; None if none.

    A fallback for models converted by ``convert`` before it recorded itself (ln_lightning 0.1.0). Deferred
    norms or branch scales inside the blocks say a pre-norm rewrite happened; ``branch_scale`` comes from the
    scale modules (one constant, ``1/sqrt(2L)`` per stack, or learnable), ``final_norm`` is True when every
    rewritten stack ends in a norm. ``layerscale_init`` can't be recovered (the scales may have trained) and is left out.
    """
    modules = list(model.modules())
    if not any(is_deferred(m) or isinstance(m, BranchScale) for m in modules):
        return None
    stacks = [s for s in inspect_model(model).stacks if any(b.placement == "pre" for b in s.blocks)]
    if not stacks:
        return None
    per_stack: list[Any] = []
    for s in stacks:
        values = []
        for b in s.blocks:
            block = model.get_submodule(b.path)
            for m in block.modules():
                if isinstance(m, BranchScale):
                    values.append("layerscale" if getattr(m, "learnable", False) else float(m.value().detach().float().cpu()))
        kinds = set(values)
        per_stack.append(None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed")
    if all(v is None for v in per_stack):
        branch_scale: Any = None
    elif all(v == "layerscale" for v in per_stack):
        branch_scale = "layerscale"
    elif all(isinstance(v, float) for v in per_stack):
        if len(set(per_stack)) == 1:
            branch_scale = per_stack[0]
        elif all(math.isclose(v, 1 / math.sqrt(2 * s.depth), rel_tol=1e-6) for v, s in zip(per_stack, stacks)):
            branch_scale = "depth"
        else:
            branch_scale = "mixed"
    else:
        branch_scale = "mixed"  # no single configuration describes it; never equal to a request
    return {"placement": "pre", "final_norm": all(s.final_norm is not None for s in stacks), "branch_scale": branch_scale}


def _applied_config(model: nn.Module) -> tuple[dict | None, str]:
    """(configuration, source): recorded on the model ("recorded"), read from its structure ("inferred"), or (None, "")."""
    config = rewrite_record.recorded_config(model)
    if config is not None:
        return config, "recorded"
    config = _infer_config(model)
    return (config, "inferred") if config is not None else (None, "")


@_lightning_patch.register_placement_class  # what the Trainer entry looks for (the patch imports nothing from here)
class LNPlacement(LayerSync, Callback):
    r"""Rewrite the LayerNorm placement of the model a Trainer fits (post-norm -> pre-norm by default).

    When fitting starts, on every process, before ``configure_model``, checkpoint restore and
    ``configure_optimizers``, it runs :func:`ln_lightning.convert` on the LightningModule and (with
    ``fused=True``) swaps its LayerNorms for the fused implementation. The rewrite stays after ``fit``
    (``revert`` does not undo it): ``validate``/``test``/``predict`` run the trained function, and so
    does a checkpoint, which records the configuration under ``checkpoint["ln_lightning"]``.

    Args:
        placement: ``"pre"`` (``x <- x + F(LN(x))``), ``"post"`` (``x <- LN(x + F(x))``, to migrate back),
            ``"peri"`` (``x + N_out(F(N(x)))``, Peri-LN), ``"output"`` (``x + N(F(x))``, OLMo 2) or ``"mix"``
            (Mix-LN: the first ``mix_post_blocks`` blocks of each stack post-norm, the rest pre-norm).
        mix_post_blocks: with ``"mix"``, how many leading blocks of each stack stay post-norm (default: a
            quarter of the stack, as in Mix-LN).
        final_norm: add a final LayerNorm after a stack converted to pre-norm that has none.
        branch_scale: ``None``, a positive float ``c`` (``x + c*F(LN(x))``), ``"depth"`` (``c = 1/sqrt(2L)``)
            or ``"layerscale"`` (a learnable per-channel scale; adds parameters).
        layerscale_init: initial LayerScale value (default: the LayerScale paper's rule by depth).
        fused: swap ``nn.LayerNorm`` for ``ln_lightning.norm``'s fused LayerNorm (same parameters).
        strict: raise if a block cannot be converted, instead of skipping it (the report lists skips).
        example_input: a probe input for the conversion check; default: the module's ``example_input_array``.
        sync_batchnorm: also convert BatchNorm layers to SyncBatchNorm on DDP/FSDP, as
            ``Trainer(sync_batchnorm=True)`` would (Lightning allows one LayerSync plugin, so pass it here).
        layer_sync: another LayerSync plugin to compose with (applied after the rewrite, reverted at teardown).
        log_report: at fit start, rank 0 logs the report and writes ``ln_placement_report.json`` into the
            logger's directory (and, with a TensorBoard logger, a text summary).
        resume_unconverted: let ``ckpt_path`` load a checkpoint written *without* the rewrite (no placement
            marker: a plugin-less post-norm run) into the rewritten model. Off by default: those weights were
            trained for another function, so such a checkpoint is refused at the start. On, it loads them
            and warns what that means (parameters the rewrite added keep their fresh values). With
            ``transition_steps`` this is how a plugin-less post-norm run continues as pre-norm: the resumed model
            computes exactly the checkpoint's function and the transition starts at the checkpoint's step.
        transition_steps: ``None`` (the rewrite takes effect at once), or ``N``: a function-preserving transition
            (``ln_lightning.placement.transition``). At fit start the model computes exactly the function it
            had; over the next ``N`` optimizer steps a blend moves it to ``placement`` (read from
            ``trainer.global_step`` before each step, so a resumed run continues at the same point; logged as
            ``ln_placement/transition``); after step ``N`` the transition machinery is removed and the model is
            exactly what ``convert(model, placement, ...)`` gives. The blend is a buffer in every checkpoint.
            Any placement but ``"post"`` (which can't preserve a trained function: it only undoes a rewrite).
        transition_schedule: ``"linear"`` (blend = t) or ``"cosine"`` (blend = (1 - cos(pi t)) / 2), t = step / N.

    A model that is already rewritten (by an earlier ``LNPlacement`` or by ``convert``) is trained as it
    is when this ``LNPlacement`` asks for the same function (the configuration the model computes is what
    checkpoints record); when it asks for another one, fit stops at the start naming both.

    Example::

        from lightning import Trainer
        from ln_lightning import LNPlacement, load_converted
        from ln_lightning.demo.lightning import CharLM, CharDataModule

        model = CharLM()
        trainer = Trainer(max_steps=100, plugins=[LNPlacement("pre", final_norm=True)])
        trainer.fit(model, datamodule=CharDataModule())    # rewritten at fit start, then trained
        trainer.validate(model, datamodule=CharDataModule())  # runs the trained pre-norm function
        trainer.test(ckpt_path="best", datamodule=CharDataModule())  # so does every checkpoint
        model = load_converted(CharLM, trainer.checkpoint_callback.best_model_path)  # inference, no Trainer

    Also accepted as a callback (``Trainer(callbacks=[LNPlacement()])``), which leaves the LayerSync slot to
    ``sync_batchnorm=True`` or another LayerSync plugin.

    Strategies: single device (CPU/GPU), ``ddp``, ``ddp_spawn``/``ddp_fork``, several nodes, ``fsdp`` and
    ``ModelParallelStrategy`` (the rewrite runs before your ``configure_model`` applies ``fully_shard``).
    Others (DeepSpeed, XLA, custom strategies) raise :class:`UnsupportedStrategyError` at fit start; convert
    the model yourself with :func:`ln_lightning.convert` before ``fit`` instead.
    """

    def __init__(
        self,
        placement: str = "pre",
        *,
        final_norm: bool = True,
        branch_scale: float | str | None = None,
        layerscale_init: float | None = None,
        fused: bool = True,
        strict: bool = False,
        example_input: Any = None,
        sync_batchnorm: bool = False,
        layer_sync: LayerSync | None = None,
        log_report: bool = True,
        resume_unconverted: bool = False,
        transition_steps: int | None = None,
        transition_schedule: str = "linear",
        mix_post_blocks: int | None = None,
    ):
        for name, value in (("final_norm", final_norm), ("fused", fused), ("strict", strict),
                            ("sync_batchnorm", sync_batchnorm), ("log_report", log_report),
                            ("resume_unconverted", resume_unconverted)):
            if not isinstance(value, bool):
                raise TypeError(f"LNPlacement: {name} must be True or False, got {value!r}.")
        if layer_sync is not None and not isinstance(layer_sync, LayerSync):
            raise TypeError(f"LNPlacement: layer_sync must be a lightning LayerSync plugin, got {type(layer_sync).__name__}.")
        if isinstance(layer_sync, LNPlacement):
            raise TypeError("LNPlacement: layer_sync cannot be another LNPlacement; a model has one placement.")
        if layer_sync is not None and sync_batchnorm:
            raise ValueError("LNPlacement: pass sync_batchnorm=True or layer_sync=..., not both (Lightning runs one LayerSync).")
        _lightning_patch.check_version()
        try:  # one set of rules, the engine's, so the plugin accepts exactly what convert() does
            validate_options(placement, final_norm=final_norm, branch_scale=branch_scale, strict=strict, layerscale_init=layerscale_init,
                             mix_post_blocks=mix_post_blocks)
        except PlacementError as err:
            raise PlacementError(f"LNPlacement: {err}") from None
        if transition_steps is not None:
            if isinstance(transition_steps, bool) or not isinstance(transition_steps, int) or transition_steps < 1:
                raise ValueError(f"LNPlacement: transition_steps must be a positive int (optimizer steps) or None, got {transition_steps!r}.")
            try:
                transition.check_target(placement)
            except PlacementError as err:
                raise PlacementError(f"LNPlacement: {err}") from None
            if transition_schedule not in transition.SCHEDULES:
                raise ValueError(f"LNPlacement: unknown transition_schedule {transition_schedule!r}; valid: {', '.join(map(repr, transition.SCHEDULES))}.")
        _lightning_patch.install()
        self.transition_steps = transition_steps
        self.transition_schedule = transition_schedule
        self._schedule_checked = False
        self.placement = placement
        self.mix_post_blocks = mix_post_blocks
        self.final_norm = final_norm
        self.branch_scale = float(branch_scale) if isinstance(branch_scale, (int, float)) else branch_scale
        layerscale_init = None if layerscale_init is None else float(layerscale_init)
        self.layerscale_init = layerscale_init
        self.fused = fused
        self.strict = strict
        self.example_input = example_input
        self.log_report = log_report
        self.resume_unconverted = resume_unconverted
        self.layer_sync: LayerSync | None = TorchSyncBatchNorm() if sync_batchnorm else layer_sync
        self.report = None  # the ConversionReport of the last rewrite done in this process
        self.swap_report: dict | None = None  # what the fused swap did (None: fused=False)
        self._report_pending = False  # a report not yet logged at a fit start
        self._note: str | None = None  # a line to log at the next announce (a model rewritten before this plugin)

    # ------------------------------------------------------------------ configuration
    @property
    def config(self) -> dict:
        """What the rewrite computes (stored in checkpoints and in the state_dict marker)."""
        config = {"placement": self.placement, "final_norm": self.final_norm, "branch_scale": self.branch_scale}
        if self.layerscale_init is not None:
            config["layerscale_init"] = self.layerscale_init
        if self.mix_post_blocks is not None:
            config["mix_post_blocks"] = self.mix_post_blocks
        return config

    def __repr__(self) -> str:
        extra = f", layer_sync={self.layer_sync!r}" if self.layer_sync is not None else ""
        # Lightning's own "Found invalid type for plugin ..." refusal of a plugin from the other namespace
        # prints this: it names this object's namespace and where the other one's LNPlacement lives.
        # (The names are split so the pytorch_lightning copy of this module, made by renaming, keeps them.)
        lightning, pl = "lightning" ".pytorch", "pytorch" "_lightning"
        ours = _lightning_patch.namespace_of(LayerSync)
        other = pl if ours == lightning else lightning
        source = "ln_lightning." + pl if other == pl else "ln_lightning"
        return (
            f"LNPlacement({self.placement!r}, final_norm={self.final_norm}, branch_scale={self.branch_scale!r}, "
            f"fused={self.fused}, strict={self.strict}{extra}) [built for {ours} Trainers; a {other} Trainer "
            f"needs `from {source} import LNPlacement`]"
        )

    # ------------------------------------------------------------------ the rewrite
    @staticmethod
    def applied_config(model: nn.Module) -> dict | None:
        """The placement configuration `model` computes, or None if no rewrite touched it.

        Read from the record a rewrite leaves on the model (``ln_lightning.rewrite_record``), or, for a model
        converted by ``convert`` without one (ln_lightning 0.1.0), from its structure.
        """
        return _applied_config(model)[0]

    def rewrite(self, model: nn.Module):
        """Convert `model` in place. Returns the ConversionReport, or None if it was already rewritten.

        A model already rewritten to the same function is kept as it is (and its configuration recorded);
        one rewritten to another configuration raises ValueError naming both.
        """
        existing, source = _applied_config(model)
        if existing is not None:
            self._adopt(model, existing, source)
            return None
        self._check_scale_applies(model)
        # Swap first: convert wraps each norm's own class (DeferredNorm), which the swap then leaves alone.
        swaps = [swap_layernorms(model)] if self.fused else []
        example = self.example_input
        if example is None:
            example = getattr(model, "example_input_array", None)
        if example is not None:
            from lightning.fabric.utilities.apply_func import move_data_to_device

            ref = next(iter(model.parameters()), None)
            if ref is not None and ref.device.type != "meta":
                example = move_data_to_device(example, ref.device)
        report = convert(
            model,
            placement=self.placement,
            final_norm=self.final_norm,
            branch_scale=self.branch_scale,
            strict=self.strict,
            **({"layerscale_init": self.layerscale_init} if self.layerscale_init is not None else {}),
            **({"mix_post_blocks": self.mix_post_blocks} if self.mix_post_blocks is not None else {}),
            example_input=example,
        )
        if self.fused:
            for path in report.added:  # a final norm convert added is a plain nn.LayerNorm: swap it too
                try:
                    added = model.get_submodule(path)
                except AttributeError:
                    continue  # a parameter (LayerScale), not a module
                if type(added) is nn.LayerNorm:  # (convert may already build it with the swapped class)
                    swaps.append(swap_layernorms(added))
        self.swap_report = _merge_swaps(swaps)
        if report.blocks:  # nothing recognised (layers built later, in configure_model): try again then
            # Markers on the owners of what changed (none when nothing did: there is nothing to guard).
            owners = None if report.changed else set()
            rewrite_record.record(model, self.config, [b.path for b in report.converted], added=report.added, owners=owners)
        self.report = report
        self._report_pending = True
        if self.transition_steps is not None and report.changed:
            transition.start(model, report, steps=self.transition_steps, schedule_kind=self.transition_schedule)
        return report

    def _adopt(self, model: nn.Module, existing: dict, source: str) -> None:
        """A model rewritten before: refuse a request for another function, else record what it computes."""
        reason = _difference(existing, self.config, model, rewrite_record.recorded_added(model))
        how = "recorded on the model" if source == "recorded" else "read from its structure: rewritten by convert()"
        if reason is None and self.transition_steps is not None and not self._transition_known(model):
            reason = (f"transition_steps needs the model as written to start from, but this one computes "
                      f"{existing.get('placement')!r} already (no transition under way)")
        if reason is not None:
            raise ValueError(
                f"LNPlacement: this model was already rewritten to ({_fmt(existing)}) ({how}), but this LNPlacement "
                f"asks for ({_fmt(self.config)}): {reason}. Fitting would silently train the first configuration. "
                f"Use a fresh, unconverted model with this LNPlacement, or ask for what the model computes: "
                f"LNPlacement({_fmt(existing)})."
            )
        if source == "inferred" or not rewrite_record.marker_owners(model):
            # Record it (convert() records the configuration, not the marker), so checkpoints and markers say
            # what the model computes, whoever rewrote it.
            placement = existing.get("placement", "pre")
            block_placement = "pre" if placement == "mix" else placement
            blocks = [b.path for s in _rewritten_stacks(model, placement) for b in s.blocks if b.placement == block_placement]
            rewrite_record.record(model, existing, blocks)
        if self.report is None:  # this plugin did not rewrite it (a worker of ddp_spawn inherits the report)
            self._note = (
                f"LNPlacement: the model was already rewritten to ({_fmt(existing)}) ({how}); that is the function "
                f"this LNPlacement ({_fmt(self.config)}) asks for, so it is trained as it is, and checkpoints "
                "record its configuration."
                + ("" if _uses_fused(model) == self.fused else
                   f" Its norms stay {'fused' if _uses_fused(model) else 'torch.nn.LayerNorm'} (fused={self.fused} "
                   "applies to the models this plugin rewrites).")
            )

    @staticmethod
    def _transition_known(model: nn.Module) -> bool:
        return transition.active(model) is not None or transition_ended(model)

    def _check_scale_applies(self, model: nn.Module) -> None:
        # convert scales a branch only when it moves the branch's norm: a block already pre-norm keeps
        # scale 1, which would leave the requested branch_scale silently unapplied there.
        if self.placement not in ("pre", "mix") or self.branch_scale is None:
            return
        try:
            stacks = inspect_model(model).stacks
        except Exception:  # convert reports what it can't read; this check is only about the scale
            return
        # The blocks the request makes pre-norm ("mix": those after the leading post-norm ones) that already are.
        already = [b.path for s in stacks for b, target in zip(s.blocks, mix_split(self.placement, s.depth, self.mix_post_blocks))
                   if target == "pre" and b.placement == "pre"]
        if already:
            raise ValueError(
                f"LNPlacement: branch_scale={self.branch_scale!r} can't be applied to {len(already)} block(s) that are "
                f"already pre-norm ({', '.join(already[:3])}{', ...' if len(already) > 3 else ''}): convert scales a "
                "branch only when it moves its norm. Drop branch_scale, or convert the model to post-norm first "
                "(ln_lightning.convert(model, 'post'))."
            )

    def _check_checkpoint(self, module: LightningModule, checkpoint: dict) -> None:
        """Before Lightning loads a ckpt_path into the rewritten model (``checkpoint.check_unconverted``)."""
        where = getattr(_lightning_patch.attached_trainer(module), "ckpt_path", None) or "the checkpoint"
        fresh = check_unconverted(module, checkpoint, where=where, resume_unconverted=self.resume_unconverted,
                                  transition_steps=self.transition_steps)
        if fresh:
            self._optimizer_remap = (checkpoint, fresh)  # done at on_fit_start, once the optimizers exist

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After configure_optimizers, before Lightning restores the optimizer state from the checkpoint.
        remap, self._optimizer_remap = getattr(self, "_optimizer_remap", None), None
        if remap is not None:
            remap_optimizer_states(remap[0], trainer.optimizers, pl_module, set(remap[1]))

    def check_strategy(self, strategy: Strategy) -> None:
        """Raise UnsupportedStrategyError unless the rewrite is tested to take effect in time under `strategy`."""
        if type(strategy) in SUPPORTED_STRATEGIES:
            return
        names = ", ".join(s.__name__ for s in SUPPORTED_STRATEGIES)
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        raise UnsupportedStrategyError(
            f"LNPlacement cannot rewrite the model under {type(strategy).__name__}: it is tested only with {names} "
            f"(the rewrite must happen before checkpoint restore and configure_optimizers, which "
            f"{type(strategy).__name__} orders differently or was not tested with). Alternative: convert the model "
            f"yourself before fitting - `ln_lightning.convert(model, {opts})` - and remove LNPlacement from the "
            "Trainer."
        )

    # ------------------------------------------------------------------ Callback hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _lightning_patch.check_same_namespace(trainer, self)
        needs_rewrite = self.applied_config(pl_module) is None
        if stage == "fit" or needs_rewrite:
            self.check_strategy(trainer.strategy)
        # Runs before Lightning loads a ckpt_path (on every strategy), to refuse one written without the rewrite.
        # A guard left by a fit that failed before its teardown is replaced, not stacked or reused.
        guard_loading(pl_module, self._check_checkpoint)
        if not needs_rewrite:
            self.rewrite(pl_module)  # already rewritten: the request must be the same function
        else:
            lazy = _lightning_patch.overrides_configure_model(pl_module)
            try:
                self.rewrite(pl_module)
            except Exception as err:  # e.g. "no LayerNorm": the layers may not exist before configure_model
                if not (lazy and type(err).__name__ == "PlacementError"):
                    raise
            if self.applied_config(pl_module) is None and lazy:
                # No blocks yet: the layers are built in configure_model. Rewrite right after it, which is
                # still before checkpoint restore and configure_optimizers; report then.
                pl_module.configure_model = functools.partial(
                    _configure_model_then_rewrite, self, trainer, stage, pl_module, pl_module.configure_model
                )
                return
        self._announce(trainer, stage, needs_rewrite)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """The transition's blend for this optimizer step, from `trainer.global_step` (the same on every rank)."""
        t = transition.active(pl_module)
        if t is None or self.transition_steps is None:
            return
        if batch_idx == 0 or not self._schedule_checked:
            transition.check_schedule(t, self.transition_steps, self.transition_schedule)
            self._schedule_checked = True
        a = transition.step_blend(t, trainer.global_step)
        if a >= 1.0:
            self._finish_transition(pl_module)  # a run resumed past the transition's end
        else:
            t.blend.fill_(a)
        pl_module.log("ln_placement/transition", a, on_step=True, on_epoch=False)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        t = transition.active(pl_module)
        if t is not None and self.transition_steps is not None and int(t.start_step) >= 0:
            if transition.step_blend(t, trainer.global_step) >= 1.0:  # step N done: the plain conversion from here on
                self._finish_transition(pl_module)

    def _finish_transition(self, pl_module: LightningModule) -> None:
        end_transition(pl_module)
        info(log, f"LNPlacement: transition to {self.placement}-norm finished after {self.transition_steps} steps; the "
             f"model is now exactly its {self.placement}-norm rewrite.")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._optimizer_remap = None  # a checkpoint loaded by validate/test is not the next fit's
        remove_loading_guard(pl_module)  # no ckpt_path was loaded: remove the one-shot guard

    def _announce(self, trainer: Trainer, stage: str, rewrote: bool) -> None:
        if self._note is not None:
            info(log, self._note)
            self._note = None
        if stage == "fit" and self.log_report and self._report_pending:
            self._log_report(trainer)
        elif rewrote and self.report is not None:
            info(log, f"LNPlacement ({getattr(stage, 'value', stage)}): {self.report.summary()}")

    def _log_report(self, trainer: Trainer) -> None:
        # The JSON goes next to the logger's files; without a logger there is no log dir to litter.
        log_dir = trainer.log_dir if trainer.loggers else None  # a collective (broadcast): every rank calls it
        self._report_pending = False
        if not trainer.is_global_zero or self.report is None:
            return
        report = self.report
        info(log, f"LNPlacement {self.config}:\n{report}")
        if not report.converted and report.changed is False:
            info(log, "LNPlacement: the model needed no change; training proceeds with it as it is.")
        if report.skipped:
            warn(
                f"LNPlacement skipped {len(report.skipped)} block(s): "
                + "; ".join(f"{b.path}: {b.reason}" for b in report.skipped)
            )
        if not report.blocks:
            warn("LNPlacement found no residual blocks in the model: nothing was rewritten.")
        if self.swap_report is not None:
            sw = self.swap_report
            info(log, f"LNPlacement: fused LayerNorm swapped in for {len(sw['swapped'])} LayerNorm(s)"
                      + (f", skipped {len(sw['skipped'])}: {sw['skipped']}" if sw["skipped"] else ""))
        payload = {"config": self.config, "fused": self.fused, "strategy": type(trainer.strategy).__name__,
                   "report": report.to_dict(), "fused_swap": self.swap_report}
        if log_dir:
            from lightning.fabric.utilities.cloud_io import get_filesystem

            fs = get_filesystem(log_dir)
            fs.makedirs(log_dir, exist_ok=True)
            with fs.open(os.path.join(log_dir, REPORT_FILENAME), "w") as f:
                json.dump(payload, f, indent=2)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):  # TensorBoard: the report in the TEXT tab
                experiment.add_text("ln_placement/report", "```\n" + str(report) + "\n```", global_step=0)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = placement_entry(
            pl_module, config=self.applied_config(pl_module) or self.config, fused=_uses_fused(pl_module), report=self.report
        )

    # ------------------------------------------------------------------ LayerSync (DDP / FSDP strategies)
    def apply(self, model: nn.Module) -> nn.Module:
        """Called by DDP/FSDP `setup`: the rewrite normally happened in `setup` already (idempotent)."""
        if isinstance(model, LightningModule) and self.applied_config(model) is None:
            # A model built in configure_model (on the meta device under FSDP): still before wrapping and optimizers.
            report = self.rewrite(model)
            if report is not None and report.blocks:
                info(log, f"LNPlacement {self.config}:\n{report}")
        if self.layer_sync is not None:
            model = self.layer_sync.apply(model)
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        """Does not undo the placement rewrite (the trained placement is what you keep); reverts `layer_sync`."""
        if self.layer_sync is not None:
            model = self.layer_sync.revert(model)
        return model


def load_converted(
    model: type[nn.Module] | nn.Module,
    checkpoint_path: str | os.PathLike,
    *,
    map_location: Any = "cpu",
    fused: bool = False,
    strict: bool = True,
    **model_kwargs: Any,
) -> nn.Module:
    """Load a checkpoint written by a run with `LNPlacement` into the original model class, for inference.

    ``model`` is the class or an instance. A LightningModule class is built from the checkpoint's
    hyperparameters (``save_hyperparameters()``), updated with ``model_kwargs``; a checkpoint without them
    needs ``model_kwargs`` or an instance (building with the defaults could give another model whose
    weights happen to fit, so it is refused). Another nn.Module class is built from ``model_kwargs``. The
    class must be the one the checkpoint records (or a subclass). The placement rewrite recorded in the
    checkpoint is applied before the weights are loaded (strictly); returns the model in eval mode.

    Example::

        model = load_converted(CharLM, "lightning_logs/version_0/checkpoints/last.ckpt")
    """
    path = Path(checkpoint_path)
    checkpoint = read_checkpoint(path, map_location)
    config = placement_config(checkpoint, path)
    model = build_model(model, checkpoint, path, model_kwargs)
    try:
        placement = LNPlacement(**config, fused=fused, log_report=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"load_converted: {path} records a placement configuration LNPlacement can't build: {err}") from None
    placement.rewrite(model)
    return restore(model, checkpoint, placement.report, strict=strict)


__all__ = ["LNPlacement", "load_converted", "UnsupportedStrategyError", "SUPPORTED_STRATEGIES", "REPORT_FILENAME",
           # re-exported: the keys a rewrite leaves in checkpoints (ln_lightning.checkpoint, ln_lightning.rewrite_record)
           "MARKER", "CHECKPOINT_KEY"]
