"""StreamNormMonitor: how the residual stream's scale grows with depth, and how much each block edits it."""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from ln_lightning._warnings import info, warn
from ln_lightning.callbacks._common import ActivationMonitor, discover_blocks, first_tensor, metric_safe, resolve_paths
from ln_lightning.callbacks._reduce import SUM, PackedStats

_log = logging.getLogger(__name__)

# Per block, summed over elements, micro-batches and ranks: squares of the output, of the input and of
# their difference, non-finite output elements, and the element counts to divide by (n_in also counts
# the difference: both exist only where the output has the input's shape).
_STATES = ("sq_out", "sq_in", "sq_delta", "nonfinite", "n_out", "n_in")


class StreamNormMonitor(ActivationMonitor):
    r"""Log the residual stream's root-mean-square and each block's relative update, per block.

    For every residual block (found by :func:`ln_lightning.placement.inspect_model`, or the module
    paths you pass), at the block's output ``y`` with input ``x``:

    - ``stream/rms/BLOCK`` = ``sqrt(mean(y**2))`` over all elements (batch, positions, features),
    - ``stream/update_ratio/BLOCK`` = ``rms(y - x) / rms(x)``, the size of the block's edit relative
      to the stream it received (omitted for a block whose output shape differs from its input),
    - ``stream/nonfinite_count``: non-finite elements in the monitored block outputs.

    ``BLOCK`` is the block's module path relative to the LightningModule (``model.blocks.3``).
    Metrics are logged at the steps, and under the step numbers, of Lightning's own ``self.log``. Values
    cover every micro-batch of the logged optimizer step on every rank: sums of squares and
    element counts are all-reduced before dividing, so they equal one process computing on all
    ranks' data. Forward hooks are registered once in ``setup`` (before DDP/FSDP wrapping and before
    a ``torch.compile`` in ``configure_model``) and return at once on steps that do not log.

    Args:
        blocks: module paths to monitor; ``None`` monitors every residual block ``inspect_model`` finds.
        every_n_steps: logging interval in Lightning's logging steps (optimizer steps; training batches under
            manual optimisation); ``None`` uses ``trainer.log_every_n_steps``.
        log_depth_profile: also log an image of rms and update ratio against block index.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from ln_lightning.callbacks import StreamNormMonitor
        >>> trainer = Trainer(callbacks=[StreamNormMonitor()], log_every_n_steps=50)

    In TensorBoard the custom-scalars tab shows "stream rms by block" and "update ratio by block",
    one line per block; the images tab shows ``stream/depth_profile``.
    """

    _CATEGORY = "ln-lightning: residual stream"
    _PROFILE = ("stream/depth_profile", "residual stream by block", "block index")

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
        self._discovery = "no model"
        self._shape_warned: set[str] = set()

    @property
    def block_paths(self) -> list[str]:
        """The monitored blocks' module paths, relative to the LightningModule (known from setup)."""
        return self._paths

    def _targets(self, pl_module: LightningModule) -> list[tuple[str, nn.Module]]:
        if self.blocks is not None:
            targets = resolve_paths(pl_module, self.blocks, type(self).__name__)
            self._discovery = "user"
        else:
            paths, self._discovery = discover_blocks(pl_module)
            targets = resolve_paths(pl_module, paths, type(self).__name__) if paths else []
        if targets:
            info(_log, f"StreamNormMonitor: monitoring {len(targets)} blocks ({self._discovery})")
        return targets

    def _stop(self) -> None:
        super()._stop()
        self._shape_warned.clear()  # warned once per fit

    def _nothing_found(self) -> str:
        return (f"StreamNormMonitor found no residual blocks to monitor ({self._discovery}) and will log nothing. "
                "Pass the block module paths: StreamNormMonitor(blocks=['model.blocks.0', ...]).")

    def _declare(self, stats: PackedStats, n: int) -> None:
        for name in _STATES:
            stats.add_state(name, n, SUM)

    def _make_hook(self, index: int, path: str, module: nn.Module):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self._active:  # the whole cost on steps that do not log
                return
            out = first_tensor(output)
            if out is None:
                return
            inp = first_tensor(args) if args else None
            if inp is None and kwargs:
                inp = first_tensor(kwargs)
            s = self._stats
            with torch.no_grad():
                y = out.detach().float()
                s["sq_out"][index] += torch.linalg.vector_norm(y).square()
                s["nonfinite"][index] += y.numel() - torch.isfinite(y).sum()
                s["n_out"][index] += y.numel()
                if inp is not None and inp.shape == out.shape:
                    x = inp.detach().float()
                    s["sq_in"][index] += torch.linalg.vector_norm(x).square()
                    s["sq_delta"][index] += torch.linalg.vector_norm(y - x).square()
                    s["n_in"][index] += x.numel()
                elif path not in self._shape_warned:
                    self._shape_warned.add(path)
                    warn(
                        f"StreamNormMonitor: block {path!r} output shape {tuple(out.shape)} differs from its input "
                        f"({None if inp is None else tuple(inp.shape)}); logging its rms but no update ratio."
                    )

        return hook

    def _report(self, stats: dict[str, Any], step: int):
        metrics: dict[str, float] = {}
        rms_list, ratio_list = [], []
        nonfinite = 0.0
        for i, path in enumerate(self._paths):
            r = {name: stats[name][i] for name in _STATES}
            if r["n_out"] == 0:  # block not called in this step
                rms_list.append(float("nan"))
                ratio_list.append(float("nan"))
                continue
            rms = _rms(r["sq_out"], r["n_out"])
            metrics[f"stream/rms/{metric_safe(path)}"] = rms
            ratio = float("nan")
            if r["n_in"] > 0:
                rms_in = _rms(r["sq_in"], r["n_in"])
                ratio = _rms(r["sq_delta"], r["n_in"]) / rms_in if rms_in > 0 else float("nan")
                metrics[f"stream/update_ratio/{metric_safe(path)}"] = ratio
            nonfinite += r["nonfinite"] if math.isfinite(r["nonfinite"]) else 0.0
            rms_list.append(rms)
            ratio_list.append(ratio)
        metrics["stream/nonfinite_count"] = nonfinite
        panels = [("rms(block output)", {"rms": rms_list}, True), ("rms(out - in) / rms(in)", {"update ratio": ratio_list}, True)]
        return metrics, panels

    def _charts(self, trainer: Trainer) -> dict[str, str]:
        return {"stream rms by block": r"^stream/rms/", "update ratio by block": r"^stream/update_ratio/",
                "stream non-finite elements": r"^stream/nonfinite_count$"}


def _rms(sum_sq: float, n: float) -> float:
    return math.sqrt(sum_sq / n) if math.isfinite(sum_sq) else float("nan")
