"""What the three monitors share: their lifecycle (setup, fit start, teardown or exception; off without a
logger), the logging schedule, the forward-hook lifecycle of the activation monitors, module discovery,
names, and writing to loggers."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from ln_lightning._namespace import check_same_namespace
from ln_lightning._warnings import warn
from ln_lightning.callbacks._lightning_internals import batch_ends_optimizer_step, check_readable, logging_step
from ln_lightning.callbacks._reduce import PackedStats
from ln_lightning.callbacks.dashboard import DashboardPart, DepthProfileWriter, write_layout_once
from ln_lightning.placement import inspect_model

# Path components that wrappers insert between a LightningModule and the user's modules.
_WRAPPER_SEGMENTS = ("_forward_module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def normalize_name(name: str, root: nn.Module | None = None) -> str:
    """Strip the path components DDP, FSDP, torch.compile and activation checkpointing add.

    `module.` is only stripped at the front, and only when `root` has no child called `module`
    (so a user's own submodule named `module` keeps its name).

    >>> normalize_name("module._orig_mod.blocks.0._fsdp_wrapped_module.ln1.weight")
    'blocks.0.ln1.weight'
    """
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    if parts and parts[0] == "module" and (root is None or not hasattr(root, "module")):
        parts = parts[1:]
    return ".".join(parts)


def _named_modules_normalized(root: nn.Module) -> dict[str, nn.Module]:
    """`root.named_modules()` keyed by normalised path (the first path wins for a shared module)."""
    out: dict[str, nn.Module] = {}
    for name, module in root.named_modules():
        out.setdefault(normalize_name(name, root), module)
    return out


def discover_blocks(pl_module: nn.Module) -> tuple[list[str], str]:
    """Residual block paths of `pl_module`, found by the placement engine (`inspect_model`), the same
    recognition `convert` uses; and where they came from.

    A model the engine can't read gives no blocks and the reason (the monitor then says so and asks
    for the block paths); nothing is guessed from container shapes.
    """
    try:
        report = inspect_model(pl_module)
    except Exception as err:  # noqa: BLE001 - a monitor must not stop training: report and let the user name paths
        return [], f"inspect_model could not read the model ({type(err).__name__}: {err})"
    paths = [normalize_name(p, pl_module) for p in report.block_paths()]
    if paths:
        return paths, "inspect_model"
    why = "; ".join(f"{u.path}: {u.reason}" for u in report.unrecognised[:3])
    return [], "inspect_model found no residual blocks" + (f" ({why})" if why else "")


def resolve_paths(pl_module: nn.Module, paths: Iterable[str], what: str) -> list[tuple[str, nn.Module]]:
    """Look up user-given module paths (normalised), with an error that lists what does exist."""
    modules = _named_modules_normalized(pl_module)
    out = []
    for raw in paths:
        path = normalize_name(raw, pl_module)
        if path not in modules:
            close = [n for n in modules if n and (path.split(".")[-1] in n or n.endswith(path))][:8]
            hint = f" Similar paths: {close}." if close else ""
            raise ValueError(
                f"{what}: no module at path {raw!r} in {type(pl_module).__name__}.{hint} "
                "Paths are relative to the LightningModule, as in `pl_module.named_modules()`."
            )
        out.append((path, modules[path]))
    return out


def first_tensor(value: Any) -> torch.Tensor | None:
    """The tensor a module returned or received: itself, or the first element of a tuple/list/ModelOutput."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    if isinstance(value, dict):  # Hugging Face ModelOutput is an OrderedDict
        for v in value.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def metric_safe(name: str) -> str:
    """A module path as it appears in a metric name (TensorBoard tags allow dots; drop spaces)."""
    return re.sub(r"\s+", "_", name)


class MonitorBase(DashboardPart, Callback):
    """The lifecycle, logging schedule and output shared by the monitors.

    The schedule is Lightning's own. The step number is the one `self.log` and `LearningRateMonitor` log
    under (`_lightning_internals.logging_step`: optimizer steps under automatic optimisation, with gradient
    accumulation too; training batches under manual optimisation, whatever the number of optimizers; restored
    on resume). Step `s` is a logging step when `(s + 1) % every_n_steps == 0`, or when `trainer.should_stop`
    is set, the rule `self.log` follows. It is decided at the step's first training batch, as
    `LearningRateMonitor` decides, and the step ends with its last micro-batch: statistics of a logging step
    cover every micro-batch of it on every rank, and none of a validation run inside it.

    A monitor is enabled from `setup("fit")` to `teardown("fit")`, or to `on_exception` (Lightning calls
    no `teardown` after an exception), and only when the Trainer has a logger: with ``logger=False``
    nothing would record its metrics, so it does no work at all (the first monitor says so, once). Both
    ends release everything of the run (`_stop`), and so does `setup` before it starts: a second fit, after
    a failed one too, starts as in a fresh process. Subclasses implement `_prepare` (at setup), `_start` (at
    fit start, the model wrapped and on its device), `_begin_logging_step` / `_end_logging_step` and `_stop`,
    and log through `_log` and `_depth_profile`.
    """

    _CATEGORY = ""  # this monitor's category in the custom-scalars layout

    def __init__(self, every_n_steps: int | None = None, log_depth_profile: bool = True):
        # bool is an int subclass: every_n_steps=True would silently mean "every step".
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be a positive int or None (trainer.log_every_n_steps), got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.log_depth_profile = log_depth_profile
        self._every = 0  # resolved at setup; 0 = never log
        self._enabled = False
        self._step: int | None = None  # the logging clock at the current step's first batch
        self._logging = False  # the current step is a logging step
        self._images = log_depth_profile  # this run's: off once an image fails
        self._profiles = DepthProfileWriter(type(self).__name__)

    def dashboard_charts(self, trainer: Trainer) -> dict[str, dict[str, list]]:
        return {self._CATEGORY: {title: ["Multiline", [regex]] for title, regex in self._charts(trainer).items()}}

    def _charts(self, trainer: Trainer) -> dict[str, str]:
        """{chart title: regex of the tags it draws}, one line per tag."""
        return {}

    # -- lifecycle ------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_same_namespace(trainer, self)
        if stage != "fit":
            return
        self._release()  # whatever an earlier fit left, had it ended without teardown or on_exception
        check_readable(trainer)
        self._every = self.every_n_steps if self.every_n_steps is not None else int(trainer.log_every_n_steps or 0)
        self._images = self.log_depth_profile
        self._enabled = bool(trainer.loggers)
        if not self._enabled:
            _say_no_logger(trainer, self)
            return
        self._prepare(trainer, pl_module)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._enabled:
            self._start(trainer, pl_module)
            write_layout_once(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown after an exception: let go here (in any stage; a no-op when not fitting).
        self._release()

    def _release(self) -> None:
        self._enabled = self._logging = False
        self._step = None
        self._stop()

    def _prepare(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """At setup("fit"), with a logger: what can be done before the model is wrapped."""

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """At fit start: what needs the final model and its device."""

    def _stop(self) -> None:
        """At the end of a fit (teardown or exception) and before the next: let go of hooks, buffers and every
        per-run state, so that the next fit starts as in a fresh process. Must not raise."""

    # -- schedule -------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._enabled:
            return
        step = logging_step(trainer)
        if step == self._step:  # a later micro-batch of the same optimizer step
            return
        self._step = step
        self._logging = self._every > 0 and ((step + 1) % self._every == 0 or bool(trainer.should_stop))
        if self._logging:
            self._begin_logging_step(trainer, pl_module, step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._logging and batch_ends_optimizer_step(trainer):
            self._logging = False
            self._end_logging_step(trainer, pl_module, self._step)

    def _begin_logging_step(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        """At the first training batch of logging step `step`."""

    def _end_logging_step(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        """At the last training batch of logging step `step`, after its optimizer step(s): log."""

    # -- output ---------------------------------------------------------------------------------
    def _log(self, trainer: Trainer, metrics: dict[str, float], step: int) -> None:
        if trainer.is_global_zero and metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _depth_profile(self, trainer: Trainer, tag: str, step: int, **plot_kwargs) -> None:
        """A depth-profile image (see `dashboard.DepthProfilePlot.render_image` for the arguments)."""
        if self._images:
            self._images = self._profiles.write(trainer, tag, step, **plot_kwargs)


def _say_no_logger(trainer: Trainer, monitor: MonitorBase) -> None:
    """One warning per fit, from the first monitor, naming them all."""
    monitors = [cb for cb in trainer.callbacks if isinstance(cb, MonitorBase)]
    if monitors and monitors[0] is not monitor:
        return
    names = ", ".join(type(m).__name__ for m in monitors) or type(monitor).__name__
    warn(f"ln_lightning monitors ({names}): the Trainer has no logger (logger=False), so nothing would record their "
         "metrics; they are off for this run (no hooks, no statistics). Pass a logger (TensorBoardLogger, "
         "CSVLogger, ...) to record them.")


class ActivationMonitor(MonitorBase):
    """A monitor that reads activations with forward hooks, on logging steps only.

    Hooks are registered once, at setup (before DDP/FSDP wrapping and a `torch.compile` in
    `configure_model`), or at fit start for a model that only exists after `configure_model`. They read
    `self._active`, a plain bool that is True only inside a logging step's training batches (not during
    validation), so a step that does not log costs one attribute check per hook. The statistics live
    in one `PackedStats`, allocated at fit start, reset at the start of each logging step and reduced
    across ranks at its end. The hooks are removed when the fit ends, by teardown or by an exception.

    Subclasses implement `_targets` (the modules to hook), `_make_hook`, `_declare` (the statistics'
    states) and `_report` (metrics and depth-profile panels from the reduced statistics), and set
    `_PRE_HOOK` and `_PROFILE`.
    """

    _PRE_HOOK = False  # True: forward pre-hooks (the module's input); False: forward hooks, run first
    _PROFILE = ("", "", "")  # the depth-profile image's tag, title and x label (x: index into self._paths)

    def __init__(self, every_n_steps: int | None = None, log_depth_profile: bool = True):
        super().__init__(every_n_steps, log_depth_profile)
        self._paths: list[str] = []  # the hooked modules' normalised paths (public as block_paths, norm_paths)
        self._handles: list[Any] = []
        self._stats: PackedStats | None = None
        self._active = False  # the gate the hooks read
        self._paused = False  # the gate's value while a validation run inside a logging step has it closed

    # -- subclass API ---------------------------------------------------------------------------
    def _targets(self, pl_module: LightningModule) -> list[tuple[str, nn.Module]]:
        """(normalised path, module) of every module to hook, in logging order."""
        raise NotImplementedError

    def _make_hook(self, index: int, path: str, module: nn.Module) -> Callable:
        """The hook for `self._paths[index]`: update `self._stats` while `self._active`."""
        raise NotImplementedError

    def _declare(self, stats: PackedStats, n: int) -> None:
        """Declare the states (`stats.add_state`) for `n` hooked modules."""
        raise NotImplementedError

    def _report(self, stats: dict[str, Any], step: int) -> tuple[dict[str, float], list[tuple[str, dict[str, list[float]], bool]]]:
        """From the reduced statistics (`PackedStats.reduce_to_host`): the metrics of logging step `step`,
        and the depth-profile panels (`dashboard.DepthProfilePlot.render_image`'s)."""
        raise NotImplementedError

    def _nothing_found(self) -> str:
        """The warning when there is nothing to hook."""
        raise NotImplementedError

    # -- lifecycle ------------------------------------------------------------------------------
    def _prepare(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._register(pl_module)  # setup released any earlier fit's hooks

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._handles:
            # The model may only exist after configure_model; hooks added now miss a torch.compile done there.
            self._register(pl_module)
            if not self._handles:
                warn(self._nothing_found())
                return
        self._stats = PackedStats(pl_module.device)
        self._declare(self._stats, len(self._paths))
        self._stats.reset()  # allocates now, not in the first logging step

    def _stop(self) -> None:
        self._active = self._paused = False
        while self._handles:
            self._handles.pop().remove()
        self._stats = None

    def _register(self, pl_module: LightningModule) -> None:
        targets = self._targets(pl_module)
        self._paths = [path for path, _ in targets]
        for index, (path, module) in enumerate(targets):
            hook = self._make_hook(index, path, module)
            if self._PRE_HOOK:
                handle = module.register_forward_pre_hook(hook, with_kwargs=True)
            else:
                # prepend: see the module's own output, before hooks that post-process it (the final norm
                # convert() adds to a stack is applied by a hook on its last block).
                handle = module.register_forward_hook(hook, with_kwargs=True, prepend=True)
            self._handles.append(handle)

    # -- schedule -------------------------------------------------------------------------------
    def _begin_logging_step(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        if self._stats is not None:
            self._stats.reset()
            self._active = True

    def _end_logging_step(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        if self._stats is None:
            return
        self._active = False
        metrics, panels = self._report(self._stats.reduce_to_host(across_ranks=trainer.world_size > 1), step)
        self._log(trainer, metrics, step)
        tag, title, xlabel = self._PROFILE
        self._depth_profile(trainer, tag, step, title=f"{title} (step {step})", panels=panels,
                            xlabels=[str(i) for i in range(len(self._paths))], xlabel=xlabel)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._paused, self._active = self._active, False

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._active, self._paused = self._paused, False
