"""What the three monitors share: the logging schedule, module discovery, names, and writing to loggers."""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from ln_lightning._warnings import info, warn

_log = logging.getLogger(__name__)

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


def named_modules_normalized(root: nn.Module) -> dict[str, nn.Module]:
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
    from ln_lightning.placement import inspect_model  # noqa: PLC0415 (keeps `import ln_lightning.callbacks` light)

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
    modules = named_modules_normalized(pl_module)
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



class MonitorBase(Callback):
    """The logging schedule shared by the monitors.

    Step `s` (0-based optimizer steps, `trainer.global_step` while it runs) is a logging step when
    `(s + 1) % every_n_steps == 0`: the same steps on which Lightning logs its own training metrics,
    logged under the same step number. Statistics of a logging step cover every micro-batch of it
    (gradient accumulation) on every rank.
    """

    family = ""  # metric prefix, "stream" / "ln" / "clip"

    def __init__(self, every_n_steps: int | None = None, log_depth_profile: bool = True):
        # bool is an int subclass: every_n_steps=True would silently mean "every step".
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be a positive int or None (trainer.log_every_n_steps), got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.log_depth_profile = log_depth_profile
        self._every = 0  # resolved at setup; 0 = never log
        # The gate the hooks read: a plain Python bool, so a step that does not log costs one attribute check.
        self._active = False
        self._step_at_start = -1
        self._log_step = -1
        self._paused_active = False
        self._profile_plot = None

    # -- schedule -------------------------------------------------------------------------------
    def _resolve_every(self, trainer: Trainer) -> None:
        self._every = self.every_n_steps if self.every_n_steps is not None else int(trainer.log_every_n_steps or 0)

    def _is_log_step(self, step: int) -> bool:
        return self._every > 0 and (step + 1) % self._every == 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._is_log_step(step) and not self._active:
            self._begin_window(trainer, pl_module)
            self._active = True
            self._log_step = step
        self._step_at_start = step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The step is complete once the optimizer has stepped (not after a mere accumulation micro-batch).
        if self._active and trainer.global_step != self._step_at_start:
            self._active = False
            self._flush(trainer, pl_module, self._log_step)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._paused_active, self._active = self._active, False

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._active, self._paused_active = self._paused_active, False

    # -- subclass API ---------------------------------------------------------------------------
    def _begin_window(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Zero the device accumulators for the logging step about to run."""

    def _flush(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        """Reduce across ranks, copy to host once, log."""

    def dashboard_charts(self, trainer: Trainer) -> dict[str, dict[str, list]]:
        """This monitor's part of the TensorBoard custom-scalars layout: {category: {chart: [kind, regexes]}}."""
        return {}

    # -- output ---------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from ln_lightning.callbacks.dashboard import write_layout_once  # noqa: PLC0415 (import cycle)

        write_layout_once(trainer)

    def _log(self, trainer: Trainer, metrics: dict[str, float], step: int) -> None:
        if not trainer.is_global_zero or not metrics:
            return
        if not trainer.loggers:
            _say_once(trainer, "no_logger", f"ln_lightning monitors: the Trainer has no logger (logger=False), so "
                      f"{type(self).__name__}'s metrics are computed but recorded nowhere; pass a logger "
                      "(TensorBoardLogger, CSVLogger, ...) to keep them.")
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _depth_profile(self, trainer: Trainer, tag: str, step: int, **plot_kwargs) -> None:
        """Log a depth-profile image to every logger that takes images (a TensorBoard SummaryWriter)."""
        if not (self.log_depth_profile and trainer.is_global_zero and trainer.loggers):
            return
        writers = _image_writers(trainer)
        if not writers:
            return
        try:
            from ln_lightning.callbacks.dashboard import DepthProfilePlot  # noqa: PLC0415
            import PIL  # noqa: F401, PLC0415 (TensorBoard's add_image needs it too)
        except ImportError as err:
            warn(
                f"{type(self).__name__}: depth-profile images need Pillow ({err}); "
                "install it or pass log_depth_profile=False. Scalars are still logged."
            )
            self.log_depth_profile = False
            return
        if self._profile_plot is None:
            self._profile_plot = DepthProfilePlot()
        try:
            png, height, width = self._profile_plot.render_png(**plot_kwargs)
            for writer in writers:
                get_file_writer = getattr(writer, "_get_file_writer", None)
                file_writer = get_file_writer() if callable(get_file_writer) else None
                if file_writer is not None:
                    # The PNG is already encoded (palette, fast zlib): hand it over as an image summary, as add_image would.
                    from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: PLC0415

                    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
                    file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
                else:
                    writer.add_image(tag, self._profile_plot.render(**plot_kwargs), global_step=step, dataformats="HWC")
        except Exception as err:  # an image must never stop training: turn images off, keep the scalars
            warn(f"{type(self).__name__}: logging the depth-profile image failed ({type(err).__name__}: {err}); "
                 "images are off for the rest of this run, scalars are still logged.")
            self.log_depth_profile = False


def _say_once(trainer: Trainer, key: str, message: str) -> None:
    """One info line per Trainer and topic, however many monitors run into it."""
    said = trainer.__dict__.setdefault("_ln_lightning_said", set())
    if key not in said:
        said.add(key)
        info(_log, message)


def _image_writers(trainer: Trainer) -> list[Any]:
    """The loggers' experiments that take images; one message names the loggers that don't."""
    from lightning.pytorch.loggers.logger import DummyLogger  # noqa: PLC0415

    writers, others = [], []
    for logger in trainer.loggers:
        if isinstance(logger, DummyLogger):
            continue  # fast_dev_run: Lightning turned logging off, and said so
        try:
            experiment = logger.experiment
        except Exception:  # a logger whose experiment can't start here gets scalars only, through log_metrics
            experiment = None
        if callable(getattr(experiment, "add_image", None)):
            writers.append(experiment)
        else:
            others.append(type(logger).__name__)
    if others:
        _say_once(trainer, "no_images", f"ln_lightning monitors: {', '.join(sorted(set(others)))} takes no images, so the "
                  "depth-profile images are skipped there (the scalars are logged); a TensorBoardLogger shows them.")
    return writers


def metric_safe(name: str) -> str:
    """A module path as it appears in a metric name (TensorBoard tags allow dots; drop spaces)."""
    return re.sub(r"\s+", "_", name)
