"""`LNPlacement`: the LayerNorm placement rewrite as a Lightning Trainer plugin.

    Trainer(plugins=[LNPlacement("pre")]).fit(model)

How it takes effect (Lightning 2.5-2.6): `LNPlacement` is a `LayerSync` (so the Trainer accepts it as a plugin)
and a `Callback`. Its `setup` hook runs on every strategy before `configure_model`, before checkpoint weights
are restored and before `configure_optimizers`, so parameters the rewrite adds are trained and restored like
any other. What the rewrite is lives on the model, in its rewrite state (``ln_lightning.placement.state``): the
plugin creates it (``placement.rewrite.apply.apply_config``), advances its transition once per optimizer step, and
writes it into checkpoints; loading a checkpoint is the state's load guard's work. Lightning does not call
plugins as callbacks, nor anything of a plugin's after ``configure_model``; ``ln_lightning._lightning_patch``
(every Lightning internal the plugin needs, version-guarded) does both. What checkpoints hold and the reading
behind `load_converted` (re-exported here) are ``ln_lightning.checkpoint``'s; turning LNPlacement's arguments
into the request, the deprecated keywords included, is ``ln_lightning._plugin_arguments``'.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from torch import nn

from ln_lightning import _lightning_patch
from ln_lightning._distill import CHECKPOINT_KEY as DISTILL_KEY
from ln_lightning._plugin_arguments import placement_spec
from ln_lightning._transition_run import CHECKPOINT_KEY as TRANSITION_RUN_KEY
from ln_lightning._transition_run import TransitionRun
from ln_lightning._warnings import info, warn
from ln_lightning.checkpoint import CHECKPOINT_KEY, load_converted, remap_optimizer_states
from ln_lightning.norm import FusedLayerNorm
from ln_lightning.placement import PlacementError, inspect_model
from ln_lightning.placement import state as rewrite_state
from ln_lightning.placement.rewrite.apply import apply_config
from ln_lightning.placement.checking.compare import difference
from ln_lightning.placement.options import mix_split
from ln_lightning.placement.spec import PlacementSpec, TransitionSpec
from ln_lightning.placement.state import MARKER
from ln_lightning.placement.migrate.trained_change import endpoint_change
from ln_lightning.placement.migrate.transition import check_schedule

log = logging.getLogger(__name__)

if _lightning_patch.lightning_version_supported():
    # The one place the process-wide patch is installed (undone by _lightning_patch.uninstall()); outside the tested
    # Lightning range LNPlacement() raises, naming the alternative.
    _lightning_patch.install()

REPORT_FILENAME = "ln_placement_report.json"

# Strategies under which the rewrite is tested to take effect before checkpoint restore and optimizers.
SUPPORTED_STRATEGIES: tuple[type[Strategy], ...] = (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy)


class UnsupportedStrategyError(RuntimeError):
    """`LNPlacement` cannot guarantee the rewrite under this strategy (raised at fit start)."""


def _uses_fused(model: nn.Module) -> bool:
    """Whether the model's norms are ln_lightning's fused ones (what it computes with, whoever swapped them)."""
    return any(isinstance(m, FusedLayerNorm) for m in model.modules())


def _fmt(config: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


@_lightning_patch.register_placement_class  # what the Trainer entry looks for (the patch imports nothing from here)
class LNPlacement(LayerSync, Callback):
    r"""Rewrite the LayerNorm placement of the model a Trainer fits (post-norm -> pre-norm by default).

    When fitting starts, on every process, before ``configure_model``, checkpoint restore and
    ``configure_optimizers``, it runs :func:`ln_lightning.convert` on the LightningModule and (with
    ``fused=True``) swaps its LayerNorms for the fused implementation. The rewrite stays after ``fit``
    (``revert`` does not undo it): ``validate``/``test``/``predict`` run the trained function, and so
    does a checkpoint, which records the configuration under ``checkpoint["ln_lightning"]``.

    Args:
        placement: what the rewrite computes: a :class:`~ln_lightning.PlacementSpec` (the placement, the final norm,
            the branch scale), or a placement's name as its shorthand: ``"pre"`` (``x <- x + F(LN(x))``), ``"post"``
            (``x <- LN(x + F(x))``, to migrate back), ``"peri"`` (``x + N_out(F(N(x)))``, Peri-LN), ``"output"``
            (``x + N(F(x))``, OLMo 2), ``"mix"`` (Mix-LN) or ``"deepnorm"`` (DeepNorm, exact from a post-norm model,
            no transition). ``"pre"`` is ``PlacementSpec("pre")``: a final norm
            added where a converted stack lacks one, no branch scale. The keywords ``final_norm``, ``branch_scale``,
            ``layerscale_init`` and ``mix_post_blocks`` (the spec's fields) and ``sync_batchnorm`` (``layer_sync=
            TorchSyncBatchNorm()``) still work for this release, with an LNLightningDeprecationWarning.
        fused: swap ``nn.LayerNorm`` for ``ln_lightning.norm``'s fused LayerNorm (same parameters).
        strict: raise if a block cannot be converted, instead of skipping it (the report lists skips).
        example_input: a probe input for the conversion check; default: the module's ``example_input_array``.
        layer_sync: another LayerSync plugin to compose with (applied after the rewrite, reverted at teardown), such
            as ``TorchSyncBatchNorm()`` for what ``Trainer(sync_batchnorm=True)`` does (Lightning allows one LayerSync
            plugin, so pass it here).
        log_report: at fit start, rank 0 logs the report and writes ``ln_placement_report.json`` into the
            logger's directory (and, with a TensorBoard logger, a text summary).
        resume_unconverted: let ``ckpt_path`` load a checkpoint written *without* the rewrite (no placement
            marker: a plugin-less post-norm run) into the rewritten model. Off by default: those weights were
            trained for another function, so such a checkpoint is refused at the start. On, it loads them
            and warns what that means: an added final norm starts from the checkpoint's trained norm it copies,
            other parameters the rewrite added keep their fresh values (and fresh optimizer state). With
            a ``transition`` this is how a plugin-less post-norm run continues as pre-norm: the resumed model
            computes exactly the checkpoint's function and the transition starts at the checkpoint's step.
        transition: ``None`` (the rewrite takes effect at once), a :class:`~ln_lightning.TransitionSpec`, or an int
            ``N`` (``TransitionSpec(steps=N)``): a function-preserving transition (``ln_lightning.placement.migrate.transition``).
            At fit start the model computes exactly the function it had; a blend moves it towards ``placement``
            (logged as ``ln_placement/transition``) and, at blend 1, the transition machinery is removed and the model
            is exactly what ``convert(model, placement, ...)`` gives. By default a closed loop moves the blend: only
            while the drift from the trained function (KL on the training batches, ``ln_placement/drift``) stays
            within ``tolerance``, with ``N`` steps as its budget; a model that can't get there within it says so and
            stays at the blend it reached. ``TransitionSpec(steps=N, tolerance=None)`` is the open loop: blend 1
            after exactly ``N`` steps. The steps done and the blend are part of the model (buffers in every
            checkpoint), so a resumed run, and a second ``fit`` of the same model, continue where it stood; a fit
            that ends before the transition says so. Any placement but ``"post"`` (which can't preserve a trained
            function: it only undoes a rewrite). What each option does, and what the stream-scaled blend keeps:
            :class:`~ln_lightning.TransitionSpec`. The keywords ``transition_steps``, ``transition_schedule``,
            ``transition_stream_scale``, ``transition_endpoint_fraction`` and ``transition_distill`` still work for
            this release (the open loop, as before) with an LNLightningDeprecationWarning.

    A model that is already rewritten (by an earlier ``LNPlacement`` or by ``convert``) is trained as it
    is when this ``LNPlacement`` asks for the same function (the configuration the model computes is what
    checkpoints record); when it asks for another one, fit stops at the start naming both.

    Example::

        from lightning import Trainer
        from ln_lightning import LNPlacement, load_converted
        from ln_lightning.demo.lightning import CharLM, CharDataModule

        model = CharLM()
        trainer = Trainer(max_steps=100, plugins=[LNPlacement("pre")])
        trainer.fit(model, datamodule=CharDataModule())    # rewritten at fit start, then trained
        trainer.validate(model, datamodule=CharDataModule())  # runs the trained pre-norm function
        trainer.test(ckpt_path="best", datamodule=CharDataModule())  # so does every checkpoint
        model = load_converted(CharLM, trainer.checkpoint_callback.best_model_path)  # inference, no Trainer

    Also accepted as a callback (``Trainer(callbacks=[LNPlacement()])``), which leaves the LayerSync slot to
    ``Trainer(sync_batchnorm=True)`` or another LayerSync plugin.

    Strategies: single device (CPU/GPU), ``ddp``, ``ddp_spawn``/``ddp_fork``, several nodes, ``fsdp`` and
    ``ModelParallelStrategy`` (the rewrite runs before your ``configure_model`` applies ``fully_shard``).
    Others (DeepSpeed, XLA, custom strategies) raise :class:`UnsupportedStrategyError` at fit start; convert
    the model yourself with :func:`ln_lightning.convert` before ``fit`` instead.
    """

    def __init__(
        self,
        placement: str | PlacementSpec = "pre",
        *,
        transition: TransitionSpec | int | None = None,
        fused: bool = True,
        strict: bool = False,
        example_input: Any = None,
        layer_sync: LayerSync | None = None,
        resume_unconverted: bool = False,
        log_report: bool = True,
        **deprecated: Any,
    ):
        spec, layer_sync = placement_spec(placement, transition, layer_sync, deprecated)
        for name, value in (("fused", fused), ("strict", strict), ("log_report", log_report),
                            ("resume_unconverted", resume_unconverted)):
            if not isinstance(value, bool):
                raise TypeError(f"LNPlacement: {name} must be True or False, got {value!r}.")
        if layer_sync is not None and not isinstance(layer_sync, LayerSync):
            raise TypeError(f"LNPlacement: layer_sync must be a lightning LayerSync plugin, got {type(layer_sync).__name__}.")
        if isinstance(layer_sync, LNPlacement):
            raise TypeError("LNPlacement: layer_sync cannot be another LNPlacement; a model has one placement.")
        _lightning_patch.check_version()
        _lightning_patch.check_installed()
        self.spec = spec
        self.fused = fused
        self.strict = strict
        self.example_input = example_input
        self.log_report = log_report
        self.resume_unconverted = resume_unconverted
        self.layer_sync = layer_sync
        self.report = None  # the ConversionReport of the last rewrite done in this process
        self.swap_report: dict | None = None  # what the fused swap did (None: fused=False)
        self._report_pending = False  # a report not yet logged at a fit start
        self._note: str | None = None  # a line to log at the next announce (a model rewritten before this plugin)
        self._run: _Run | None = None  # what this plugin holds during one Trainer call (setup to teardown)

    # ------------------------------------------------------------------ configuration (read from the spec)
    @property
    def placement(self) -> str:
        return self.spec.placement

    @property
    def final_norm(self) -> bool:
        return self.spec.final_norm

    @property
    def branch_scale(self) -> float | str | None:
        """The branch scale the rewrite applies (``"stream"`` where the transition measures it)."""
        return self.spec.config["branch_scale"]

    @property
    def layerscale_init(self) -> float | None:
        return self.spec.layerscale_init

    @property
    def mix_post_blocks(self) -> int | None:
        return self.spec.mix_post_blocks

    @property
    def stream_scaled(self) -> bool:
        return self.spec.stream_scaled

    @property
    def transition(self) -> TransitionSpec | None:
        return self.spec.transition

    @property
    def transition_steps(self) -> int | None:
        """The transition's steps (its budget, for the closed loop), or None without a transition."""
        return None if self.transition is None else self.transition.steps

    @property
    def transition_schedule(self) -> str:
        """The schedule kind the model's transition records: ``"closed"`` for the closed loop."""
        return "linear" if self.transition is None else self.transition.kind

    @property
    def transition_distill(self) -> float:
        return 0.0 if self.transition is None else self.transition.distill

    @property
    def transition_endpoint_fraction(self) -> float:
        return 0.25 if self.transition is None else self.transition.endpoint_fraction

    @property
    def config(self) -> dict:
        """What the rewrite computes (stored in checkpoints and in the state_dict marker): ``spec.config``."""
        return self.spec.config

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
            f"LNPlacement({self.spec.short()}, fused={self.fused}, strict={self.strict}{extra}) [built for {ours} Trainers; a {other} Trainer "
            f"needs `from {source} import LNPlacement`]"
        )

    # ------------------------------------------------------------------ the rewrite
    @staticmethod
    def applied_config(model: nn.Module) -> dict | None:
        """The placement configuration `model` computes (its rewrite state's), or None if no rewrite touched it."""
        state = rewrite_state.of(model)
        return None if state is None else dict(state.config)

    def rewrite(self, model: nn.Module):
        """Convert `model` in place. Returns the ConversionReport, or None if it was already rewritten.

        A model already rewritten to the same function is kept as it is (and marked); one rewritten to another
        configuration raises ValueError naming both.
        """
        state = rewrite_state.of(model)
        if state is not None:
            self._adopt(model, state)
            return None
        self._check_scale_applies(model)
        example = self.example_input
        if example is None:
            example = getattr(model, "example_input_array", None)
        if example is None:
            self._check_final_norms_known(model)
        if example is not None:
            ref = next(iter(model.parameters()), None)
            if ref is not None and ref.device.type != "meta":
                example = move_data_to_device(example, ref.device)
        applied = apply_config(model, self.config, fused=self.fused, strict=self.strict, example_input=example,
                               transition_steps=self.transition_steps, transition_schedule=self.transition_schedule)
        self.swap_report = applied.swap
        self.report = applied.report
        self._report_pending = True
        _refuse_no_op(applied.report, self.placement, self.transition is not None)
        return applied.report

    def _adopt(self, model: nn.Module, state: rewrite_state.RewriteState) -> None:
        """A model rewritten before: refuse a request for another function, else mark what it computes."""
        existing = state.config
        reason = difference(existing, self.config, model, state.added)
        if reason is None and self.transition_steps is not None and state.transition is None and not state.transition_ended:
            reason = (f"a transition needs the model as written to start from, but this one computes "
                      f"{existing.get('placement')!r} already (no transition under way)")
        if reason is not None:
            raise ValueError(
                f"LNPlacement: this model was already rewritten to ({_fmt(existing)}) (recorded on the model), but this "
                f"LNPlacement asks for ({_fmt(self.config)}): {reason}. Fitting would silently train the first "
                f"configuration. Use a fresh, unconverted model with this LNPlacement, or ask for what the model "
                f"computes: LNPlacement({_fmt(existing)})."
            )
        if not state.marked:
            state.mark(model)  # convert() records the rewrite, not the marker: checkpoints say what it computes
        if self.report is None:  # this plugin did not rewrite it (a worker of ddp_spawn inherits the report)
            self._note = (
                f"LNPlacement: the model was already rewritten to ({_fmt(existing)}) (recorded on the model); that is "
                f"the function this LNPlacement ({_fmt(self.config)}) asks for, so it is trained as it is, and "
                "checkpoints record its configuration."
                + ("" if _uses_fused(model) == self.fused else
                   f" Its norms stay {'fused' if _uses_fused(model) else 'torch.nn.LayerNorm'} (fused={self.fused} "
                   "applies to the models this plugin rewrites).")
            )

    def _check_scale_applies(self, model: nn.Module) -> None:
        # convert scales a branch only when it moves the branch's norm: a block already pre-norm keeps
        # scale 1, which would leave the requested branch_scale silently unapplied there.
        # (LayerNorm Scaling, norm_scale, goes on blocks already pre-norm too: it scales a norm's output where it is.)
        if self.placement not in ("pre", "mix") or self.branch_scale in (None, "stream"):
            return  # ("stream": the transition's own scale; an already-pre block has nothing to blend)
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

    def _check_final_norms_known(self, model: nn.Module) -> None:
        # Without an input the engine reads the code around a stack with torch.fx; where that fails it can't tell
        # whether the model applies a norm after the stack, and convert would leave a pre-norm stack that may have
        # no final norm (its report: not complete). A fit would train that silently: stop it, naming the fix.
        if not self.spec.final_norm or self.placement in ("post", "deepnorm"):  # (DeepNorm stays post-norm)
            return
        try:
            stacks = inspect_model(model).stacks
        except Exception:  # convert reports what it can't read; this check is only about the final norm
            return
        unknown = [s.path or "<root>" for s in stacks if s.final_norm is None and not s.final_norm_known
                   and any(b.placement != t for b, t in zip(s.blocks, mix_split(self.placement, s.depth, self.mix_post_blocks)))]
        if unknown:
            raise PlacementError(
                f"LNPlacement: without an example input it can't tell whether {type(model).__name__}'s forward applies a "
                f"norm after {', '.join(unknown)} (the code around it could not be traced), so converting would leave a "
                f"{self.placement}-norm stack that may have no final norm. Set `self.example_input_array` in your "
                "LightningModule to an input its forward takes (or pass LNPlacement(..., example_input=...)); the model "
                "is left as it was."
            )

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

    # ------------------------------------------------------------------ one Trainer call, setup to teardown
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _lightning_patch.check_same_namespace(trainer, self)
        self._end_run(pl_module)  # a run that failed before its teardown (on_exception cleans up; this is for safety)
        needs_rewrite = rewrite_state.of(pl_module) is None
        if stage == "fit" or needs_rewrite:
            self.check_strategy(trainer.strategy)
        self._run = _Run(stage)
        if not needs_rewrite:
            self.rewrite(pl_module)  # already rewritten: the request must be the same function
        else:
            lazy = _lightning_patch.overrides_configure_model(pl_module)
            try:
                self.rewrite(pl_module)
            except PlacementError:  # e.g. "no LayerNorm": the layers may not exist before configure_model
                if not lazy:
                    raise
            if rewrite_state.of(pl_module) is None and lazy:
                # No blocks yet: the layers are built in configure_model. The patch calls `after_configure_model`
                # right after it, which is still before checkpoint restore and configure_optimizers.
                self._run.after_configure_model = True
                return
        self._open_load(pl_module)
        self._announce(trainer, stage, needs_rewrite)

    def after_configure_model(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Called by the patch right after the LightningModule's ``configure_model``: the deferred rewrite."""
        if self._run is None or not self._run.after_configure_model:
            return
        self._run.after_configure_model = False
        stage = self._run.stage
        if isinstance(trainer.strategy, ModelParallelStrategy):
            # configure_model applies fully_shard / parallelize itself; the rewrite had to come first.
            found = inspect_model(pl_module).block_paths()
            if found:
                raise RuntimeError(
                    f"LNPlacement: {type(pl_module).__name__} builds its residual blocks ({', '.join(found[:3])}...) in "
                    "configure_model, where ModelParallelStrategy also shards them; the rewrite has to come before "
                    "sharding. Build the layers in __init__ (meta device is fine), or call "
                    "ln_lightning.convert(...) inside configure_model before fully_shard and drop LNPlacement."
                )
            self._announce(trainer, stage, True)  # nothing to rewrite: the report says so
            return
        if any(p.device.type == "meta" for p in pl_module.parameters()):
            return  # not materialised yet: FSDPStrategy.setup calls LayerSync.apply (our `apply`) before wrapping
        self.rewrite(pl_module)
        self._open_load(pl_module)
        self._announce(trainer, stage, True)

    def _open_load(self, pl_module: LightningModule) -> None:
        # LNPlacement(resume_unconverted=True): the ckpt_path load of this call may bring weights saved without the
        # rewrite; the model's load guard fills in what they lack (ln_lightning.placement.state).
        state = rewrite_state.of(pl_module)
        if self.resume_unconverted and state is not None and state.marked:
            state.accepting = {"warned": False, "who": "LNPlacement(resume_unconverted=True)"}
            self._run.accepting = state

    def _close_load(self) -> dict | None:
        run = self._run
        if run is None or run.accepting is None:
            return None
        accepted, run.accepting.accepting, run.accepting = run.accepting.accepting, None, None
        return accepted

    def _end_run(self, pl_module: LightningModule | None) -> None:
        """Let go of everything this Trainer call set up (after teardown, or after an exception)."""
        self._close_load()
        if self._run is not None:
            state = None if pl_module is None else rewrite_state.of(pl_module)
            t = None if state is None else state.transition
            if self._run.transition is not None:
                self._run.transition.close(t)  # perhaps inside an endpoint step or the first batch's measurement
            elif t is not None:
                t.hold()
        self._run = None

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        # After the model's weights (the guard has done its work), before the optimizer states are restored.
        if self._run is not None:
            self._run.checkpoint = checkpoint
            self._run.teacher_state = checkpoint.get(DISTILL_KEY)
            self._run.transition_state = checkpoint.get(TRANSITION_RUN_KEY)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After configure_optimizers and the checkpoint's weights, before Lightning restores the optimizer states.
        accepted = self._close_load()
        if accepted is not None and accepted.get("warned") and self._run.checkpoint is not None:
            names = dict(pl_module.named_parameters())
            fresh = [k for k in accepted.get("added", []) if k in names]
            if fresh and isinstance(self._run.checkpoint.get("optimizer_states"), list):
                remap_optimizer_states(self._run.checkpoint, trainer.optimizers, pl_module, set(fresh))
        if self._run.report_at_fit_start:
            self._run.report_at_fit_start = False
            self._report_pending = False
            if accepted is not None:  # a continuation: the rewrite was measured on freshly built weights
                self._measure_on_checkpoint(trainer, pl_module)
            self._log_report(trainer)
        state = rewrite_state.of(pl_module)
        t = None if state is None else state.transition
        if t is not None:
            if self.transition_steps is None:
                raise PlacementError(
                    f"LNPlacement: the model is in a placement transition (at {t.host_steps} of {t.steps} steps, schedule "
                    f"{t.kind!r}: written so in the checkpoint or left by an earlier fit), but this LNPlacement has no "
                    f"transition, so fitting would train a blend that never moves. Pass "
                    f"LNPlacement(..., transition={_spec_for(t)}) (the values it records)."
                )
            check_schedule(t, self.transition_steps, self.transition_schedule)
            t.scaled  # noqa: B018 - the host copies are read here, once, not during the steps
            if t.host_steps:  # a second fit or a resume: where it stands (the first fit starts at 0)
                info(log, f"LNPlacement: the transition to {self.placement}-norm continues at step {t.host_steps} of {t.steps}.")

    def _measure_on_checkpoint(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The report's output change, measured again on the checkpoint's trained weights (rank 0's copy: DDP
        ranks hold the same weights; a sharded model is not run whole, so its report says where it was measured)."""
        report = self.report
        if report is None or not report.changed:
            return
        example = self.example_input if self.example_input is not None else getattr(pl_module, "example_input_array", None)
        sharded = isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))
        change = None
        if example is not None and not sharded:
            ref = next(iter(pl_module.parameters()), None)
            change = endpoint_change(pl_module, move_data_to_device(example, ref.device) if ref is not None else example)
        if change is None:
            report.notes.append("the output change above was measured on the freshly built model, before the checkpoint's "
                                "weights loaded" + (" (a sharded model is not run whole here)" if sharded else
                                                    " (pass example_input= to measure it on the trained weights)"))
            return
        report.output_change, report.output_change_scope = change, "model"
        report.preserves_function = False if change > 1e-6 else report.preserves_function
        report.notes.append("the output change is measured on the checkpoint's trained weights" + (
            ", at the transition's end point (blend 1) against its start (blend 0); the stream scales are measured on the "
            "first training batch, so this is the end point with scale 1" if self.stream_scaled and self.transition else
            ", at the transition's end point (blend 1) against its start" if self.transition else ""))

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._run is not None and self._run.stage != "fit":
            self._close_load()

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_load()

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_load()

    # ------------------------------------------------------------------ the transition, per optimizer step
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The trained weights (and a resumed checkpoint's teacher) are in; the first step has not run.
        state = rewrite_state.of(pl_module)
        t = None if state is None else state.transition
        if t is not None and self.transition is not None and self._run is not None:
            self._run.transition = TransitionRun(self.transition, self.placement)
            self._run.transition.teacher_state = self._run.teacher_state
            self._run.transition.restore(self._run.transition_state)
            self._run.transition.start(trainer, pl_module, t)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._run is not None and self._run.transition is not None:
            self._run.transition.begin_step(pl_module)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if self._run is not None:
            self._run.stepped = True  # this batch steps an optimizer (several, under manual optimisation: one step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        run = self._run
        if run is None:
            return
        stepped, run.stepped = run.stepped, False
        if run.transition is not None:
            run.transition.end_step(trainer, pl_module, stepped)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._run is not None and self._run.transition is not None:
            self._run.transition.settle(trainer, pl_module)  # a closed loop at blend 1 since its last read ends here
        state = rewrite_state.of(pl_module)
        progress = None if state is None else state.progress()
        known = None if self._run is None or self._run.transition is None else self._run.transition.final_entry(progress)
        rows = None if self._run is None or self._run.transition is None else self._run.transition.rows_entry()
        if known is not None:  # finished, or a closed loop stopped by its budget (said when it did)
            self._log_report(trainer, final={"transition": {**known, **(rows or {})}})
            return
        if progress is None:
            return
        done, steps, a = progress
        msg = (f"LNPlacement: the fit ended during the transition to {self.placement}-norm, at step {done} of {steps} (blend "
               f"{a:.4g}): the model computes that blend, not yet its {self.placement}-norm rewrite. Its checkpoints load back "
               "into that blend; a further fit of this model (or from its checkpoint with the same LNPlacement) continues it.")
        if trainer.is_global_zero:
            warn(msg)
        final = {"steps": steps, "steps_done": done, "blend": a, "finished": False}
        if self.transition is not None and self.transition.closed:
            final["tolerance"] = self.transition.tolerance
        self._log_report(trainer, final={"transition": {**final, **(rows or {})}})

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._end_run(pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._end_run(pl_module)

    # ------------------------------------------------------------------ reporting
    def _announce(self, trainer: Trainer, stage: str, rewrote: bool) -> None:
        if self._note is not None:
            info(log, self._note)
            self._note = None
        if stage == "fit" and self.log_report and self._report_pending:
            self._run.report_at_fit_start = True  # after the checkpoint's weights: the report describes them
        elif rewrote and self.report is not None:
            info(log, f"LNPlacement ({getattr(stage, 'value', stage)}): {self.report.summary()}")

    def _log_report(self, trainer: Trainer, final: dict | None = None) -> None:
        """The report at fit start (console, JSON next to the logger's files, TensorBoard text); with `final`,
        that JSON again with what the fit's end adds (a transition still under way)."""
        if not self.log_report:
            return
        # The JSON goes next to the logger's files; without a logger there is no log dir to litter.
        log_dir = trainer.log_dir if trainer.loggers else None  # a collective (broadcast): every rank calls it
        if not trainer.is_global_zero or self.report is None:
            return
        report = self.report
        if final is None:
            info(log, f"LNPlacement {self.config}:\n{self._report_text(report)}")
            if report.blocks and not report.changed and not report.skipped:
                info(log, f"LNPlacement: the model is {self.placement}-norm already; it needed no change and is trained as it is.")
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
                   "report": report.to_dict(), "fused_swap": self.swap_report, **(final or {})}
        if log_dir:
            fs = get_filesystem(log_dir)
            fs.makedirs(log_dir, exist_ok=True)
            with fs.open(os.path.join(log_dir, REPORT_FILENAME), "w") as f:
                json.dump(payload, f, indent=2)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):  # TensorBoard: the report in the TEXT tab
                text = self._report_text(report) if final is None else json.dumps(final)
                experiment.add_text("ln_placement/report", "```\n" + text + "\n```", global_step=trainer.global_step)

    def _report_text(self, report) -> str:
        """The report as printed; under a transition its last word is the transition's, not a hard switch's."""
        text = str(report)
        spec = self.transition
        if spec is None:
            return text
        change = "" if report.output_change is None else f" (its output differs by {report.output_change:.2%} from the trained one)"
        how = (f"advances only while the drift from the trained function stays within {spec.tolerance:g} nats, within a budget "
               f"of {spec.steps} steps" if spec.closed else f"gets there in {spec.steps} steps")
        lines = [f"This is a transition: training starts at the trained function (blend 0) and {how}, towards this "
                 f"rewrite{change}." if ln.startswith("WARNING: this conversion CHANGES the function") else ln
                 for ln in text.splitlines()]
        return "\n".join(lines)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        state = rewrite_state.of(pl_module)
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = state.checkpoint_entry(pl_module, report=self.report)
        teacher = None if self._run is None or self._run.transition is None else self._run.transition.teacher_checkpoint(pl_module)
        if teacher is not None:
            checkpoint[DISTILL_KEY] = teacher
        smoothed = None if self._run is None or self._run.transition is None else self._run.transition.checkpoint_state(pl_module)
        if smoothed is not None:
            checkpoint[TRANSITION_RUN_KEY] = smoothed

    # ------------------------------------------------------------------ LayerSync (DDP / FSDP strategies)
    def apply(self, model: nn.Module) -> nn.Module:
        """Called by DDP/FSDP `setup`: the rewrite normally happened in `setup` already (idempotent)."""
        if isinstance(model, LightningModule) and rewrite_state.of(model) is None:
            # A model built in configure_model (on the meta device under FSDP): still before wrapping and optimizers.
            report = self.rewrite(model)
            if report is not None and report.blocks:
                info(log, f"LNPlacement {self.config}:\n{report}")
        if self.layer_sync is not None:
            model = self.layer_sync.apply(model)
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        """LayerSync's undo, called by DDP/FSDP at teardown: reverts `layer_sync` only. The placement rewrite is the
        model that was trained, so it stays (undoing it would make fit() return, and test() run, another function)."""
        if self.layer_sync is not None:
            model = self.layer_sync.revert(model)
        return model


def _refuse_no_op(report, placement: str, migrating: bool) -> None:
    """Stop a fit that was asked for a placement and would train the model unchanged although it has blocks in
    another placement (every one of them skipped): that is a silent no-op, not "the model needed no change"."""
    if report.changed or not report.skipped:
        return
    reasons = "; ".join(f"{b.path}: {b.reason}" for b in report.skipped[:5]) + ("; ..." if len(report.skipped) > 5 else "")
    raise PlacementError(
        f"LNPlacement({placement!r}{', transition=...' if migrating else ''}) changed nothing: {len(report.skipped)} "
        f"block(s) of the model are not {placement}-norm and none could be converted ({reasons}). Fitting would "
        "train the model as it is, not what was asked for. Fix: tell the engine how such a block computes "
        "(ln_lightning.placement.register_block), or convert the model yourself and drop LNPlacement; "
        "`ln-lightning inspect` shows what is recognised."
    )


def _spec_for(t) -> str:
    """How to ask for the transition `t` records, as a TransitionSpec."""
    if t.closed:
        return f"TransitionSpec(steps={t.steps})"
    return f"TransitionSpec(steps={t.steps}, tolerance=None" + (f", schedule={t.kind!r})" if t.kind != "linear" else ")")


class _Run:
    """What an LNPlacement holds during one Trainer call: from `setup` to `teardown` or `on_exception`."""

    def __init__(self, stage: str):
        self.stage = stage
        self.after_configure_model = False  # the rewrite waits for configure_model
        self.accepting: rewrite_state.RewriteState | None = None  # a state opened for an unconverted ckpt_path load
        self.checkpoint: dict | None = None  # the ckpt_path checkpoint (its optimizer states may need remapping)
        self.stepped = False  # an optimizer stepped in the current training batch
        self.report_at_fit_start = False  # the fit's report is logged at on_fit_start, on the weights it trains
        self.transition: TransitionRun | None = None  # the model's transition, driven from on_train_start
        self.teacher_state: dict | None = None  # the teacher the ckpt_path checkpoint holds
        self.transition_state: dict | None = None  # ... and its closed loop's smoothed loss excess


__all__ = ["LNPlacement", "load_converted", "UnsupportedStrategyError", "SUPPORTED_STRATEGIES", "REPORT_FILENAME",
           # re-exported: the keys a rewrite leaves in checkpoints (ln_lightning.checkpoint, ln_lightning.placement.state)
           "MARKER", "CHECKPOINT_KEY"]
