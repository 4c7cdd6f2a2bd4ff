"""StreamNormMonitor: how the residual stream's scale grows with depth, and how much each block edits it."""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from ln_lightning.callbacks._common import MonitorBase, discover_blocks, first_tensor, metric_safe, resolve_paths
from ln_lightning.callbacks._reduce import PackedStats
from ln_lightning import _lightning_patch
from ln_lightning._warnings import info, warn

_log = logging.getLogger(__name__)

# Columns of the per-block SUM rows.
_SS_OUT, _SS_DELTA, _SS_IN, _NONFINITE, _N_OUT, _N_IN, _N_DELTA = range(7)
_COLS = 7


class StreamNormMonitor(MonitorBase):
    r"""Log the residual stream's root-mean-square and each block's relative update, per block.

    For every residual block (found by :func:`ln_lightning.placement.inspect_model`, or the module
    paths you pass), at the block's output ``y`` with input ``x``:

    - ``stream/rms/BLOCK`` = ``sqrt(mean(y**2))`` over all elements (batch, positions, features),
    - ``stream/update_ratio/BLOCK`` = ``rms(y - x) / rms(x)``, the size of the block's edit relative
      to the stream it received (omitted for a block whose output shape differs from its input),
    - ``stream/nonfinite_count``: non-finite elements in the monitored block outputs.

    ``BLOCK`` is the block's module path relative to the LightningModule (``model.blocks.3``).
    Values cover every micro-batch of the logged optimizer step on every rank: sums of squares and
    element counts are all-reduced before dividing, so they equal one process computing on all
    ranks' data. Forward hooks are registered once in ``setup`` (before DDP/FSDP wrapping and before
    a ``torch.compile`` in ``configure_model``) and return at once on steps that do not log.

    Args:
        blocks: module paths to monitor; ``None`` monitors every residual block ``inspect_model`` finds.
        every_n_steps: logging interval in optimizer steps; ``None`` uses ``trainer.log_every_n_steps``.
        log_depth_profile: also log an image of rms and update ratio against block index.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from ln_lightning.callbacks import StreamNormMonitor
        >>> trainer = Trainer(callbacks=[StreamNormMonitor()], log_every_n_steps=50)

    In TensorBoard the custom-scalars tab shows "stream rms by block" and "update ratio by block",
    one line per block; the images tab shows ``stream/depth_profile``.
    """

    family = "stream"

    def __init__(
        self,
        blocks: Sequence[str] | None = None,
        every_n_steps: int | None = None,
        log_depth_profile: bool = True,
    ):
        super().__init__(every_n_steps, log_depth_profile)
        if isinstance(blocks, str):
            raise TypeError(f"blocks must be a list of module paths, not a string ({blocks!r}); use blocks=[{blocks!r}]")
        self.blocks = list(blocks) if blocks is not None else None
        self.block_paths: list[str] = []
        self._handles: list[Any] = []
        self._stats: PackedStats | None = None
        self._rows: torch.Tensor | None = None
        self._shape_warned: set[str] = set()

    # -- hooks ------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _lightning_patch.check_same_namespace(trainer, self)
        if stage != "fit" or self._handles:
            return
        self._resolve_every(trainer)
        self._register(pl_module)

    def _register(self, pl_module: LightningModule) -> None:
        if self.blocks is not None:
            targets = resolve_paths(pl_module, self.blocks, type(self).__name__)
            source = "user"
        else:
            paths, source = discover_blocks(pl_module)
            targets = resolve_paths(pl_module, paths, type(self).__name__) if paths else []
        self._discovery = source
        if not targets:
            return
        self.block_paths = [p for p, _ in targets]
        for index, (path, module) in enumerate(targets):
            # prepend: see the block's own output, before hooks that post-process it (the final norm
            # convert() adds to a stack is applied by a hook on its last block).
            self._handles.append(module.register_forward_hook(self._make_hook(index, path), with_kwargs=True, prepend=True))
        info(_log, f"StreamNormMonitor: monitoring {len(targets)} blocks ({source})")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._handles:
            # The model may only exist after configure_model; hooks added now miss a torch.compile done there.
            self._register(pl_module)
            if not self._handles:
                warn(
                    f"StreamNormMonitor found no residual blocks to monitor ({getattr(self, '_discovery', 'no model')}) and will log nothing. "
                    "Pass the block module paths: StreamNormMonitor(blocks=['model.blocks.0', ...])."
                )
        if self._handles:
            self._stats = PackedStats(len(self.block_paths) * _COLS, 0, pl_module.device)
            self._rows = self._stats.sums.view(len(self.block_paths), _COLS)
        super().on_fit_start(trainer, pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._stats = self._rows = None
            self._active = False

    def _make_hook(self, index: int, path: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self._active:  # the whole cost on steps that do not log
                return
            rows = self._rows
            out = first_tensor(output)
            if out is None or rows is None:
                return
            inp = first_tensor(args) if args else None
            if inp is None and kwargs:
                inp = first_tensor(kwargs)
            with torch.no_grad():
                y = out.detach().float()
                ss_out = torch.linalg.vector_norm(y).square()
                nonfinite = y.numel() - torch.isfinite(y).sum()
                row = rows[index]
                has_delta = inp is not None and inp.shape == out.shape
                if has_delta:
                    x = inp.detach().float()
                    ss_in = torch.linalg.vector_norm(x).square()
                    ss_delta = torch.linalg.vector_norm(y - x).square()
                    row[:4] += torch.stack([ss_out, ss_delta, ss_in, nonfinite.to(ss_out.dtype)]).to(row)
                    row[_N_IN] += x.numel()
                    row[_N_DELTA] += x.numel()
                else:
                    row[_SS_OUT] += ss_out.to(row)
                    row[_NONFINITE] += nonfinite.to(row)
                    if path not in self._shape_warned:
                        self._shape_warned.add(path)
                        warn(
                            f"StreamNormMonitor: block {path!r} output shape {tuple(out.shape)} differs from its input "
                            f"({None if inp is None else tuple(inp.shape)}); logging its rms but no update ratio."
                        )
                row[_N_OUT] += y.numel()

        return hook

    # -- schedule -----------------------------------------------------------------------------
    def _begin_window(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._stats is not None:
            self._stats.reset()

    def _flush(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        if self._stats is None:
            return
        sums, _ = self._stats.reduce_to_host(across_ranks=trainer.world_size > 1)
        metrics: dict[str, float] = {}
        rms_list, ratio_list = [], []
        nonfinite = 0.0
        for i, path in enumerate(self.block_paths):
            r = sums[i * _COLS : (i + 1) * _COLS]
            if r[_N_OUT] == 0:  # block not called in this step
                rms_list.append(float("nan"))
                ratio_list.append(float("nan"))
                continue
            rms = math.sqrt(r[_SS_OUT] / r[_N_OUT]) if math.isfinite(r[_SS_OUT]) else float("nan")
            metrics[f"stream/rms/{metric_safe(path)}"] = rms
            ratio = float("nan")
            if r[_N_IN] > 0:
                rms_in = math.sqrt(r[_SS_IN] / r[_N_IN]) if math.isfinite(r[_SS_IN]) else float("nan")
                rms_delta = math.sqrt(r[_SS_DELTA] / r[_N_DELTA]) if math.isfinite(r[_SS_DELTA]) else float("nan")
                ratio = rms_delta / rms_in if rms_in > 0 else float("nan")
                metrics[f"stream/update_ratio/{metric_safe(path)}"] = ratio
            nonfinite += r[_NONFINITE] if math.isfinite(r[_NONFINITE]) else 0.0
            rms_list.append(rms)
            ratio_list.append(ratio)
        metrics["stream/nonfinite_count"] = nonfinite
        self._log(trainer, metrics, step)
        self._depth_profile(
            trainer,
            "stream/depth_profile",
            step,
            title=f"residual stream by block (step {step})",
            panels=[("rms(block output)", {"rms": rms_list}, True), ("rms(out - in) / rms(in)", {"update ratio": ratio_list}, True)],
            xlabels=[str(i) for i in range(len(self.block_paths))],
            xlabel="block index",
        )

    def dashboard_charts(self, trainer: Trainer) -> dict[str, dict[str, list]]:
        return {
            "ln-lightning: residual stream": {
                "stream rms by block": ["Multiline", [r"^stream/rms/"]],
                "update ratio by block": ["Multiline", [r"^stream/update_ratio/"]],
                "stream non-finite elements": ["Multiline", [r"^stream/nonfinite_count$"]],
            }
        }
