"""`LNPlacement`: the LayerNorm placement rewrite as a Lightning Trainer plugin.

    Trainer(plugins=[LNPlacement("pre")]).fit(model)

How it takes effect (Lightning 2.6): `LNPlacement` is a `LayerSync` (so the Trainer accepts it as a plugin)
and a `Callback`. Its `setup` hook runs on every strategy before `configure_model`, before checkpoint weights
are restored and before `configure_optimizers`, so parameters the rewrite adds are trained and restored like
any other. The Trainer does not call plugins as callbacks; `ln_lightning._lightning_patch` (one small,
version-guarded wrapper) registers it, and rewrites the main process's model under spawn launchers.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from ln_lightning import _lightning_patch
from ln_lightning.placement import PlacementError, validate_options

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "ln_lightning"
REPORT_FILENAME = "ln_placement_report.json"
# A persistent uint8 buffer holding the placement config as JSON, registered on the module that owns each
# rewritten stack. A converted state_dict therefore has a key an unconverted model lacks, so a plain strict
# `load_state_dict` into the original model fails ("Unexpected key(s) ... ln_lightning_placement") instead
# of silently computing the untrained post-norm function (post -> pre without a final norm adds no weights).
MARKER = "ln_lightning_placement"
_CONFIG_ATTR = "_ln_lightning_placement_config"  # set on the LightningModule once rewritten (pickles with it)

# Strategies under which the rewrite is tested to take effect before checkpoint restore and optimizers.
SUPPORTED_STRATEGIES: tuple[type[Strategy], ...] = (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy)


class UnsupportedStrategyError(RuntimeError):
    """`LNPlacement` cannot guarantee the rewrite under this strategy (raised at fit start)."""


_fused_unavailable_logged = False


def _placement_convert(model: nn.Module, **options: Any):
    """The conversion engine (indirection so tests can stand in for it)."""
    from ln_lightning.placement import convert

    return convert(model, **options)


def _swap_fused(model: nn.Module) -> Any:
    """Swap LayerNorms for the fused implementation; None (logged once) when it isn't available."""
    global _fused_unavailable_logged
    try:
        from ln_lightning.norm import swap_layernorms
    except ImportError as err:
        if not _fused_unavailable_logged:
            rank_zero_warn(
                f"LNPlacement(fused=True): the fused LayerNorm is not available ({err}); the model keeps "
                "torch.nn.LayerNorm. Pass fused=False to silence this."
            )
            _fused_unavailable_logged = True
        return None
    return swap_layernorms(model)


def _merge_swaps(swaps: list) -> dict | None:
    swaps = [r for r in swaps if r is not None]
    if not swaps:
        return None
    return {
        "swapped": [p for r in swaps for p in r.swapped],
        "skipped": [{"path": k.path, "reason": k.reason} for r in swaps for k in r.skipped],
        "backend": swaps[0].backend,
    }


def _encode_config(config: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(config, sort_keys=True).encode()), dtype=torch.uint8)


def _decode_config(tensor: torch.Tensor) -> dict | None:
    try:
        return json.loads(bytes(tensor.detach().cpu().to(torch.uint8).tolist()).decode())
    except (ValueError, UnicodeDecodeError):
        return None


def _check_marker_on_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook on a rewritten module: refuse a state_dict written for another placement.

    A state_dict without the marker (saved before the rewrite) is reported by torch itself as a missing key
    under strict loading (torch passes no usable `strict` to this hook, so it adds nothing then); a marker
    with another config is an error even with strict=False: those weights were trained for another function.
    """
    key = prefix + MARKER
    if key not in state_dict:
        return
    mine, theirs = _decode_config(getattr(module, MARKER)), _decode_config(state_dict[key])
    if theirs != mine:
        error_msgs.append(
            f"ln_lightning: the state_dict was saved from a model rewritten to {theirs}, but this model is rewritten "
            f"to {mine}. Use the same LNPlacement options as the run that wrote it (they are stored in "
            f"checkpoint['{CHECKPOINT_KEY}']['config']), or ln_lightning.load_converted(...)."
        )


def _register_marker(module: nn.Module, config: dict) -> None:
    value = _encode_config(config)
    ref = next(iter(module.buffers(recurse=True)), None)
    device = ref.device if ref is not None and ref.device.type != "meta" else None
    if device is None:
        ref = next(iter(module.parameters()), None)
        device = ref.device if ref is not None and ref.device.type != "meta" else torch.device("cpu")
    if MARKER in module._buffers:
        module._buffers[MARKER] = value.to(device)
    else:
        module.register_buffer(MARKER, value.to(device), persistent=True)
    if not getattr(module, "_ln_lightning_load_hook", False):
        if hasattr(module, "register_load_state_dict_pre_hook"):
            module.register_load_state_dict_pre_hook(_check_marker_on_load)
        else:  # torch < 2.5
            module._register_load_state_dict_pre_hook(_check_marker_on_load, with_module=True)
        module._ln_lightning_load_hook = True


def _owner_path(block_path: str) -> str:
    """'model.blocks.3' -> 'model' (the module holding the stack container 'model.blocks')."""
    stack = block_path.rpartition(".")[0]
    return stack.rpartition(".")[0]


def _find_placements(trainer: Trainer) -> list["LNPlacement"]:
    found: list[LNPlacement] = []
    connector = getattr(trainer, "_accelerator_connector", None)
    layer_sync = getattr(connector, "_layer_sync", None)
    if isinstance(layer_sync, LNPlacement):
        found.append(layer_sync)
    for cb in trainer.callbacks:
        if isinstance(cb, LNPlacement) and all(cb is not f for f in found):
            found.append(cb)
    return found


def _before_trainer_entry(trainer: Trainer) -> None:
    """Called by the patch in the main process at the start of fit/validate/test/predict."""
    placements = _find_placements(trainer)
    if not placements:
        return
    if len(placements) > 1:
        raise ValueError(
            f"the Trainer holds {len(placements)} LNPlacement objects ({placements}); a model has one placement: "
            "keep one."
        )
    placement = placements[0]
    if all(cb is not placement for cb in trainer.callbacks):
        # First, so callbacks that hook LayerNorms in their own `setup` see the rewritten model.
        trainer.callbacks.insert(0, placement)
    launcher = trainer.strategy.launcher
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from lightning.pytorch.trainer.states import TrainerFn

    if (
        isinstance(launcher, _MultiProcessingLauncher)
        and trainer.state.fn == TrainerFn.FITTING
        and trainer.lightning_module is not None
    ):
        # Spawn/fork: the workers get a copy of this model and rank 0 sends its weights back at the end with
        # load_state_dict(strict=False); rewrite here first so modules the rewrite adds are not dropped.
        placement._check_strategy(trainer.strategy)
        module = trainer.lightning_module
        try:
            placement.rewrite(module)
        except Exception as err:  # layers built in configure_model, which the main process never runs
            if not (_overrides_configure_model(module) and type(err).__name__ == "PlacementError"):
                raise


def _overrides_configure_model(module: LightningModule) -> bool:
    return getattr(type(module), "configure_model", None) is not LightningModule.configure_model


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
    from ln_lightning.placement import inspect_model

    return inspect_model(module).block_paths()


class LNPlacement(LayerSync, Callback):
    r"""Rewrite the LayerNorm placement of the model a Trainer fits (post-norm -> pre-norm by default).

    When fitting starts, on every process, before ``configure_model``, checkpoint restore and
    ``configure_optimizers``, it runs :func:`ln_lightning.convert` on the LightningModule and (with
    ``fused=True``) swaps its LayerNorms for the fused implementation. The rewrite stays after ``fit``
    (``revert`` does not undo it): ``validate``/``test``/``predict`` run the trained function, and so
    does a checkpoint, which records the configuration under ``checkpoint["ln_lightning"]``.

    Args:
        placement: ``"pre"`` (``x <- x + F(LN(x))``) or ``"post"`` (``x <- LN(x + F(x))``, to migrate back).
        final_norm: add a final LayerNorm after a stack converted to pre-norm that has none.
        branch_scale: ``None``, a positive float ``c`` (``x + c*F(LN(x))``), ``"depth"`` (``c = 1/sqrt(2L)``)
            or ``"layerscale"`` (a learnable per-channel scale; adds parameters).
        layerscale_init: initial LayerScale value (default: the LayerScale paper's rule by depth).
        fused: swap ``nn.LayerNorm`` for ``ln_lightning.norm``'s fused LayerNorm (same parameters). If that
            implementation is not importable, a warning says so once and the model keeps ``nn.LayerNorm``.
        strict: raise if a block cannot be converted, instead of skipping it (the report lists skips).
        example_input: a probe input for the conversion check; default: the module's ``example_input_array``.
        sync_batchnorm: also convert BatchNorm layers to SyncBatchNorm on DDP/FSDP, as
            ``Trainer(sync_batchnorm=True)`` would (Lightning allows one LayerSync plugin, so pass it here).
        layer_sync: another LayerSync plugin to compose with (applied after the rewrite, reverted at teardown).
        log_report: at fit start, rank 0 logs the report and writes ``ln_placement_report.json`` into the
            logger's directory (and, with a TensorBoard logger, a text summary).

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
    ):
        for name, value in (("final_norm", final_norm), ("fused", fused), ("strict", strict),
                            ("sync_batchnorm", sync_batchnorm), ("log_report", log_report)):
            if not isinstance(value, bool):
                raise TypeError(f"LNPlacement: {name} must be True or False, got {value!r}.")
        if layer_sync is not None and not isinstance(layer_sync, LayerSync):
            raise TypeError(f"LNPlacement: layer_sync must be a lightning LayerSync plugin, got {type(layer_sync).__name__}.")
        if isinstance(layer_sync, LNPlacement):
            raise TypeError("LNPlacement: layer_sync cannot be another LNPlacement; a model has one placement.")
        if layer_sync is not None and sync_batchnorm:
            raise ValueError("LNPlacement: pass sync_batchnorm=True or layer_sync=..., not both (Lightning runs one LayerSync).")
        if not _lightning_patch.lightning_version_supported():
            import lightning

            raise RuntimeError(_lightning_patch._unsupported_version_message(lightning.__version__))
        try:  # one set of rules, the engine's, so the plugin accepts exactly what convert() does
            validate_options(placement, final_norm=final_norm, branch_scale=branch_scale, strict=strict, layerscale_init=layerscale_init)
        except PlacementError as err:
            raise PlacementError(f"LNPlacement: {err}") from None
        _lightning_patch.install()
        self.placement = placement
        self.final_norm = final_norm
        self.branch_scale = float(branch_scale) if isinstance(branch_scale, (int, float)) else branch_scale
        layerscale_init = None if layerscale_init is None else float(layerscale_init)
        self.layerscale_init = layerscale_init
        self.fused = fused
        self.strict = strict
        self.example_input = example_input
        self.log_report = log_report
        self.layer_sync: LayerSync | None = TorchSyncBatchNorm() if sync_batchnorm else layer_sync
        self.report = None  # the ConversionReport of the last rewrite done in this process
        self.swap_report: dict | None = None  # what the fused swap did (None: fused=False or not available)
        self._report_pending = False  # a report not yet logged at a fit start

    # ------------------------------------------------------------------ configuration
    @property
    def config(self) -> dict:
        """What the rewrite computes (stored in checkpoints and in the state_dict marker)."""
        config = {"placement": self.placement, "final_norm": self.final_norm, "branch_scale": self.branch_scale}
        if self.layerscale_init is not None:
            config["layerscale_init"] = self.layerscale_init
        return config

    def __repr__(self) -> str:
        extra = f", layer_sync={self.layer_sync!r}" if self.layer_sync is not None else ""
        return (
            f"LNPlacement({self.placement!r}, final_norm={self.final_norm}, branch_scale={self.branch_scale!r}, "
            f"fused={self.fused}, strict={self.strict}{extra})"
        )

    # ------------------------------------------------------------------ the rewrite
    @staticmethod
    def applied_config(model: nn.Module) -> dict | None:
        """The placement config a model was rewritten to by LNPlacement, or None."""
        return getattr(model, _CONFIG_ATTR, None)

    def rewrite(self, model: nn.Module):
        """Convert `model` in place (idempotent). Returns the ConversionReport, or None if it was already done."""
        done = self.applied_config(model)
        if done is not None:
            if done != self.config:
                raise ValueError(
                    f"this model was already rewritten to {done}; LNPlacement asks for {self.config}. "
                    "Use a fresh model, or the same options."
                )
            return None
        # Swap first: convert wraps each norm's own class (DeferredNorm), which the swap then leaves alone.
        swaps = [_swap_fused(model)] if self.fused else []
        example = self.example_input
        if example is None:
            example = getattr(model, "example_input_array", None)
        if example is not None:
            from lightning.fabric.utilities.apply_func import move_data_to_device

            ref = next(iter(model.parameters()), None)
            if ref is not None and ref.device.type != "meta":
                example = move_data_to_device(example, ref.device)
        report = _placement_convert(
            model,
            placement=self.placement,
            final_norm=self.final_norm,
            branch_scale=self.branch_scale,
            strict=self.strict,
            **({"layerscale_init": self.layerscale_init} if self.layerscale_init is not None else {}),
            example_input=example,
        )
        if self.fused and swaps[0] is not None:
            for path in report.added:  # a final norm convert added is a plain nn.LayerNorm: swap it too
                try:
                    added = model.get_submodule(path)
                except AttributeError:
                    continue  # a parameter (LayerScale), not a module
                if type(added) is nn.LayerNorm:  # (convert may already build it with the swapped class)
                    swaps.append(_swap_fused(added))
        self.swap_report = _merge_swaps(swaps)
        if report.changed:
            owners = sorted({_owner_path(b.path) for b in report.converted} or {""})
            for path in owners:
                _register_marker(model.get_submodule(path), self.config)
        self.report = report
        self._report_pending = True
        if report.blocks:  # nothing recognised (layers built later, in configure_model): try again then
            setattr(model, _CONFIG_ATTR, dict(self.config))
        return report

    def _check_strategy(self, strategy: Strategy) -> None:
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
        needs_rewrite = self.applied_config(pl_module) is None
        if stage == "fit" or needs_rewrite:
            self._check_strategy(trainer.strategy)
        if needs_rewrite:
            lazy = _overrides_configure_model(pl_module)
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

    def _announce(self, trainer: Trainer, stage: str, rewrote: bool) -> None:
        if stage == "fit" and self.log_report and self._report_pending:
            self._log_report(trainer)
        elif rewrote and self.report is not None:
            rank_zero_info(f"LNPlacement ({getattr(stage, 'value', stage)}): {self.report.summary()}")

    def _log_report(self, trainer: Trainer) -> None:
        # The JSON goes next to the logger's files; without a logger there is no log dir to litter.
        log_dir = trainer.log_dir if trainer.loggers else None  # a collective (broadcast): every rank calls it
        self._report_pending = False
        if not trainer.is_global_zero or self.report is None:
            return
        report = self.report
        rank_zero_info(f"LNPlacement {self.config}:\n{report}")
        if not report.converted and report.changed is False:
            rank_zero_info("LNPlacement: the model needed no change; training proceeds with it as it is.")
        if report.skipped:
            rank_zero_warn(
                f"LNPlacement skipped {len(report.skipped)} block(s): "
                + "; ".join(f"{b.path}: {b.reason}" for b in report.skipped)
            )
        if not report.blocks:
            rank_zero_warn("LNPlacement found no residual blocks in the model: nothing was rewritten.")
        if self.swap_report is not None:
            sw = self.swap_report
            rank_zero_info(f"LNPlacement: fused LayerNorm swapped in for {len(sw['swapped'])} LayerNorm(s)"
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
        checkpoint[CHECKPOINT_KEY] = {
            "config": self.applied_config(pl_module) or self.config,
            "fused": self.fused,
            "report": self.report.to_dict() if self.report is not None else None,
        }

    # ------------------------------------------------------------------ LayerSync (DDP / FSDP strategies)
    def apply(self, model: nn.Module) -> nn.Module:
        """Called by DDP/FSDP `setup`: the rewrite normally happened in `setup` already (idempotent)."""
        if isinstance(model, LightningModule) and self.applied_config(model) is None:
            # A model built in configure_model (on the meta device under FSDP): still before wrapping and optimizers.
            report = self.rewrite(model)
            if report is not None and report.blocks:
                rank_zero_info(f"LNPlacement {self.config}:\n{report}")
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

    ``model`` is the class (a LightningModule is built from the checkpoint's hyperparameters, updated with
    ``model_kwargs``; another nn.Module class from ``model_kwargs``) or an instance. The placement rewrite
    recorded in the checkpoint is applied before the weights are loaded (strictly); returns the model in
    eval mode.

    Example::

        model = load_converted(CharLM, "lightning_logs/version_0/checkpoints/last.ckpt")
    """
    path = Path(checkpoint_path)
    if path.is_dir():
        raise ValueError(
            f"{path} is a directory (a distributed checkpoint); consolidate it into one file first, e.g. "
            "ModelParallelStrategy(save_distributed_checkpoint=False), or "
            "`python -m lightning.fabric.utilities.consolidate_checkpoint PATH`."
        )
    checkpoint = torch.load(path, map_location=map_location, weights_only=False)
    state_dict = checkpoint.get("state_dict", checkpoint)
    info = checkpoint.get(CHECKPOINT_KEY)
    config = info["config"] if info else None
    if config is None:
        markers = [k for k in state_dict if k.rpartition(".")[2] == MARKER]
        if not markers:
            raise ValueError(
                f"{path} records no placement rewrite (no checkpoint['{CHECKPOINT_KEY}'] and no '{MARKER}' entry); "
                "load it the usual way (Model.load_from_checkpoint / load_state_dict)."
            )
        config = _decode_config(state_dict[markers[0]])
    if isinstance(model, type):
        if issubclass(model, LightningModule):
            hparams = dict(checkpoint.get(LightningModule.CHECKPOINT_HYPER_PARAMS_KEY, {}))
            hparams = {k: v for k, v in hparams.items() if not k.startswith("_")}
            hparams.update(model_kwargs)
            model = model(**hparams)
        else:
            model = model(**model_kwargs)
    elif model_kwargs:
        raise TypeError(f"model_kwargs {sorted(model_kwargs)} are only used when `model` is a class")
    LNPlacement(**config, fused=fused, log_report=False).rewrite(model)
    if isinstance(model, LightningModule):
        model.on_load_checkpoint(checkpoint)
    model.load_state_dict(state_dict, strict=strict)
    return model.eval()


__all__ = ["LNPlacement", "load_converted", "UnsupportedStrategyError", "SUPPORTED_STRATEGIES", "MARKER", "CHECKPOINT_KEY"]
