"""SpikeMonitor: did the loss or the gradient norm just spike, and which block and parameter group did it come from."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from ln_lightning._warnings import info, warn
from ln_lightning.callbacks._common import MonitorBase, discover_blocks, first_tensor, resolve_paths
from ln_lightning.callbacks._grad_groups import SHARDED, GradGroups, GroupSpec, to_device
from ln_lightning.callbacks._lightning_internals import batch_ends_optimizer_step, logging_step
from ln_lightning.callbacks._reduce import MAX, SUM, PackedStats, distributed_world, read_to_host
from ln_lightning.callbacks.dashboard import STABILITY, write_text
from ln_lightning.norm import recognize_norm

_log = logging.getLogger(__name__)

KINDS = ("loss", "grad_norm")
_ACTIONS = (None, "skip", "checkpoint")
# Which rule flagged a value: bits of the record's rule code.
_SIGMA, _RATIO, _NONFINITE = 1, 2, 4
# Per kind, the columns of a step's row in the record buffer.
_META = ("value", "code", "mean", "std", "running_max", "n_window")
JSONL_NAME = "ln_spikes.jsonl"
_foreach_max = getattr(torch, "_foreach_max", None)  # torch >= 2.5
_MAX_ROWS = 1 << 16  # steps kept on the device between two reads of the records (memory bound: a few MB)


class SpikeRules:
    r"""The spike rules on one device, for several series at once (one per kind), with no host synchronisation.

    For each series, value ``v_t`` at its ``t``-th update, with ``W`` the values of the last ``window`` updates
    before it that were finite, and ``M`` the largest finite value before it:

    - sigma rule (OLMo-core): ``v_t - mean(W) > sigma * std(W)`` (``std`` with Bessel's correction, as
      ``torch.std``), once ``W`` holds at least ``warmup`` values;
    - ratio rule (Megatron-LM): ``v_t > ratio * M``, once at least ``warmup`` finite values were seen;
    - a non-finite ``v_t`` is always flagged (it never enters ``W`` or ``M``).

    Flagged finite values do enter ``W`` and ``M`` (as in OLMo-core): a lasting jump flags its first steps, then
    becomes the baseline. ``sigma=None`` or ``ratio=None`` turns that rule off.
    """

    def __init__(self, n_series: int, window: int, sigma: float | None, ratio: float | None, warmup: int,
                 device: torch.device | str = "cpu"):
        self.window, self.sigma, self.ratio, self.warmup = window, sigma, ratio, warmup
        self.history = torch.full((n_series, window), float("nan"), dtype=torch.float64, device=device)
        self.running_max = torch.full((n_series,), float("-inf"), dtype=torch.float64, device=device)
        self.n_finite = torch.zeros(n_series, dtype=torch.float64, device=device)
        self.updates = 0  # host-known: the ring position needs no device read

    def update(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Judge `values` (shape (n_series,)) against the history, then add them. Returns device tensors:
        ``code`` (rule bits, 0 = no spike), ``mean``, ``std``, ``running_max`` (the baselines judged against)
        and ``n_window`` (finite values in the window)."""
        v = values.to(self.history)
        h = self.history  # NaN where no finite value
        finite_h = ~torch.isnan(h)
        n = finite_h.sum(dim=1, dtype=torch.float64)
        mean = h.nansum(dim=1) / n.clamp(min=1)
        var = (h - mean[:, None]).square().nansum(dim=1) / (n - 1).clamp(min=1)
        std = var.sqrt()
        finite = torch.isfinite(v)
        flags = torch.zeros_like(v)
        if self.sigma is not None:
            flags += _SIGMA * ((n >= max(2, self.warmup)) & (v - mean > self.sigma * std))
        if self.ratio is not None:
            flags += _RATIO * ((self.n_finite >= max(1, self.warmup)) & (v > self.ratio * self.running_max))
        code = torch.where(finite, flags, float(_NONFINITE))
        # running_max is replaced below, never changed in place: the judged baseline needs no copy.
        out = {"code": code, "mean": mean, "std": std, "running_max": self.running_max, "n_window": n}
        kept = torch.where(finite, v, float("nan"))
        self.history[:, self.updates % self.window] = kept
        self.running_max = torch.fmax(self.running_max, kept)  # fmax: a NaN (non-finite value) leaves it as it was
        self.n_finite += finite
        self.updates += 1
        return out


class SpikeMonitor(MonitorBase):
    r"""Detect loss and gradient-norm spikes on the device at every optimizer step, and say where they came from.

    At every step of Lightning's logging clock (optimizer steps; training batches under manual optimisation,
    as ``self.log`` counts them), after the step's backward passes:

    - ``loss``: the mean of the step's losses (the micro-batches' losses Lightning backpropagates, summed: under
      gradient accumulation each is already divided by the number of micro-batches), averaged over ranks;
    - ``grad_norm``: the 2-norm of all gradients the optimizer(s) step on, before clipping (AMP-unscaled, summed
      across shards, as ``ClipAttributionMonitor``'s ``clip/total_norm``),

    are judged by :class:`SpikeRules` (``sigma`` over ``window``, ``ratio`` to the running maximum, non-finite).
    Each flagged value is one record, one JSON line in ``ln_spikes.jsonl`` in the logger's ``log_dir`` (else the
    Trainer's ``default_root_dir``), also logged to TensorBoard as text (tag ``spike/record``)::

        {"step": 412, "kind": "grad_norm", "rule": "sigma", "value": 35.1, "baseline": 1.02, "threshold": 1.9,
         "std": 0.15, "running_max": 2.7, "n_window": 128,
         "top_groups": [["model.blocks.3", 0.97], ["model.head", 0.01], ...],
         "blocks": [{"block": "model.blocks.0", "stream_rms": 1.0, "amp_max": 3.2}, ...], "action": null}

    ``baseline`` is the window's mean for the sigma rule and the running maximum for the ratio rule;
    ``threshold`` what the value exceeded. ``top_groups``: the parameter groups (named as
    ``ClipAttributionMonitor`` names them, same ``groups`` argument) by their share of the squared pre-clip
    gradient norm at that step, largest first. ``blocks``: at that step, each residual block's output rms
    (``stream/rms``) and the largest amplification ``1/sqrt(var + eps)`` of the norms inside it (``ln/amp_max``),
    over every micro-batch on every rank. ``spike/count`` (spikes in the logging window) and ``spike/total``
    (since the fit started) are logged as scalars at each logging step.

    Host reads: detection, the records and their statistics stay on the device (one small row per step: its
    values, rule codes, baselines, group squares and block statistics); the rows are read, and the flagged ones
    written, at the next logging step (one host copy, with the step they happened at) and at the end of the fit.
    So a step that does not log costs no host read, a spike step included (after 65536 steps without a logging
    step, the rows are read then). An action (``on_spike``) must know at once: with one, the monitor reads the
    step's two flags every step (one small host copy per step).

    Cost per step: the block statistics are one norm of each block's output and, for a LayerNorm run by aten's
    kernel, the ``1/sqrt(var + eps)`` it saved for its backward (read, not recomputed; recomputed in one pass
    where saved-tensor hooks, as activation checkpointing's, would run on reading it, and for other norms); the
    gradient norms are one ``_foreach_norm``, shared with ``ClipAttributionMonitor`` when both run.

    Args:
        kinds: what to watch, any of ``"loss"`` and ``"grad_norm"``.
        sigma: the sigma rule's ``k`` (OLMo-core: 6); ``None`` turns it off.
        window: the sigma rule's window, in steps (OLMo-core: 128).
        ratio: the ratio rule's factor (Megatron-LM: 10); ``None`` turns it off.
        warmup: values needed before a rule judges (default ``window // 2``, as OLMo-core).
        groups: parameter groups, as ``ClipAttributionMonitor(groups=...)``.
        top_groups: how many groups a record lists (``None``: all).
        blocks: block module paths for the records' ``blocks``; ``None``: those ``inspect_model`` finds;
            ``[]``: no block statistics (their per-step forward hooks then cost nothing).
        on_spike: ``None``; ``"skip"``: drop the step's update (every parameter's gradient is set to ``None`` before
            the optimizer runs, so it moves neither the weights nor its state; one optimizer only);
            ``"checkpoint"``: save a checkpoint just before the update, to ``LOG_DIR/spike_checkpoints/step=S.ckpt``.
        max_records: records kept per logging window; more are counted in ``spike/count`` and a warning.
        every_n_steps: logging interval (``None``: ``trainer.log_every_n_steps``).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from ln_lightning.callbacks import ClipAttributionMonitor, SpikeMonitor
        >>> trainer = Trainer(callbacks=[SpikeMonitor(), ClipAttributionMonitor()], gradient_clip_val=1.0)
    """

    _CATEGORY = STABILITY

    def __init__(
        self,
        kinds: Sequence[str] = KINDS,
        sigma: float | None = 6.0,
        window: int = 128,
        ratio: float | None = 10.0,
        warmup: int | None = None,
        groups: GroupSpec = None,
        top_groups: int | None = 5,
        blocks: Sequence[str] | None = None,
        on_spike: str | None = None,
        max_records: int = 16,
        every_n_steps: int | None = None,
    ):
        super().__init__(every_n_steps, log_depth_profile=False)
        if isinstance(kinds, str):
            kinds = (kinds,)
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise ValueError(f"SpikeMonitor: kinds must be some of {KINDS}, got {tuple(kinds)!r}")
        if sigma is not None and not sigma > 0:
            raise ValueError(f"SpikeMonitor: sigma must be > 0 or None, got {sigma!r}")
        if ratio is not None and not ratio > 1:
            raise ValueError(f"SpikeMonitor: ratio must be > 1 or None, got {ratio!r}")
        if sigma is None and ratio is None:
            raise ValueError("SpikeMonitor: sigma and ratio are both None, so no rule would ever flag a spike")
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"SpikeMonitor: window must be an int >= 2, got {window!r}")
        if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1):
            raise ValueError(f"SpikeMonitor: warmup must be a positive int or None (window // 2), got {warmup!r}")
        if on_spike not in _ACTIONS:
            raise ValueError(f"SpikeMonitor: on_spike must be one of {_ACTIONS}, got {on_spike!r}")
        if isinstance(blocks, str):
            raise TypeError(f"blocks must be a list of module paths, not a string ({blocks!r}); use blocks=[{blocks!r}]")
        if top_groups is not None and (not isinstance(top_groups, int) or top_groups < 1):
            raise ValueError(f"SpikeMonitor: top_groups must be a positive int or None (all), got {top_groups!r}")
        if not isinstance(max_records, int) or max_records < 1:
            raise ValueError(f"SpikeMonitor: max_records must be a positive int, got {max_records!r}")
        self.kinds = tuple(k for k in KINDS if k in kinds)
        self.sigma, self.window, self.ratio = sigma, window, ratio
        self.warmup = window // 2 if warmup is None else warmup
        self.top_groups = top_groups
        self.blocks = list(blocks) if blocks is not None else None
        self.on_spike = on_spike
        self.max_records = max_records
        self._groups = GradGroups(groups, type(self).__name__)
        self._init_run_state()

    def _init_run_state(self) -> None:
        self._block_paths: list[str] = []
        self._norm_block: list[int] = []  # per hooked norm: the index of its block
        self._norm_specs: list[Any] = []
        self._handles: list[Any] = []
        self._group_names: list[str] = []
        self._group_index: dict[int, torch.Tensor] = {}  # id(optimizer) -> its plan's groups in _group_names
        self._rules: SpikeRules | None = None
        # One row per judged step since the records were last read (grown when a window outlasts it): the step's
        # values, rule codes and baselines, group squares and block statistics; the host keeps which step it is.
        self._rows: PackedStats | None = None
        self._row_steps: list[int] = []
        self._row_numel: list[list[int]] = []  # per row, the elements each block's outputs held (host-known)
        # This step's block statistics, as the hooks leave them: one 0-d tensor per call and the block or norm
        # it came from; combined once, at the judgement.
        self._block_norms: list[torch.Tensor] = []
        self._block_ids: list[int] = []
        self._block_numel: list[int] = []
        self._amp_pending: list[torch.Tensor] = []  # rstd per row, until the micro-batch's backward
        self._amps: list[torch.Tensor] = []  # their maxima, one 1-d tensor per micro-batch
        self._amp_ids: list[int] = []
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._nan: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        self._gsq: torch.Tensor | None = None  # this step's squared gradient norms, (2, groups)
        self._saw_loss = self._saw_grads = False
        self._collect = self._paused = False
        self._pending = 0  # steps judged since the records were last read (rows used)
        self._total = 0
        self._actions: dict[int, str] = {}
        self._warned_loss = False
        self._judged_step: int | None = None
        self._masks: dict[tuple[bool, bool], torch.Tensor] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    def _prepare(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._groups.prepare(pl_module)
        self._register(pl_module)

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "grad_norm" in self.kinds or self.on_spike is not None:
            if not self._groups.start(trainer, pl_module):
                self._enabled = False
                return
        if self.on_spike is not None and len(trainer.optimizers) != 1:
            raise ValueError(f"SpikeMonitor(on_spike={self.on_spike!r}) acts on one optimizer's step; this module has "
                             f"{len(trainer.optimizers)} optimizers. Use on_spike=None (records only).")
        if not self._handles and self.blocks is None:
            self._register(pl_module)  # a model built in configure_model
        device = pl_module.device
        names: list[str] = []
        for optimizer in trainer.optimizers:
            plan = self._groups.plan_for(pl_module, optimizer)
            for g in plan.groups:
                if g not in names:
                    names.append(g)
        self._group_names = names
        for optimizer in trainer.optimizers:
            self._index_of(self._groups.plan_for(pl_module, optimizer), optimizer, device)
        self._rules = SpikeRules(len(KINDS), self.window, self.sigma, self.ratio, self.warmup, device)
        self._rows = self._row_buffer(max(2, self._every + 1), device)
        self._row_steps, self._row_numel = [], []
        self._block_numel = [0] * len(self._block_paths)
        self._loss = torch.zeros((), dtype=torch.float64, device=device)
        self._gsq = torch.zeros(2, max(1, len(names)), dtype=torch.float64, device=device)
        self._nan = torch.full((), float("nan"), dtype=torch.float64, device=device)
        self._masks = {(a, b): torch.tensor([float(a and "loss" in self.kinds), float(b and "grad_norm" in self.kinds)],
                                            dtype=torch.float64).to(device) for a in (False, True) for b in (False, True)}

    def _row_buffer(self, cap: int, device: torch.device) -> PackedStats:
        n_b, n_n = len(self._block_paths), len(self._norm_block)
        rows = PackedStats(device)
        # Values, codes, baselines and group squares are the same on every rank (judged after the step's
        # all-reduce); the blocks' squares and sizes add up over ranks; the norms' amplification is a maximum.
        rows.add_state("same", (cap, len(KINDS) * len(_META) + max(1, len(self._group_names)) + n_n), MAX)
        rows.add_state("block_sq", (cap, n_b), SUM)
        rows.add_state("block_n", (cap, n_b), SUM)
        rows.reset()
        return rows

    def _stop(self) -> None:
        while getattr(self, "_handles", None):
            self._handles.pop().remove()
        self._groups.stop()
        self._init_run_state()

    def _register(self, pl_module: LightningModule) -> None:
        if self._handles or self.blocks == []:
            return
        if self.blocks is not None:
            targets = resolve_paths(pl_module, self.blocks, type(self).__name__)
        else:
            paths, why = discover_blocks(pl_module)
            targets = resolve_paths(pl_module, paths, type(self).__name__) if paths else []
            if not targets:
                info(_log, f"SpikeMonitor: no residual blocks ({why}); records carry no block statistics. "
                     "Pass SpikeMonitor(blocks=['model.blocks.0', ...]) to have them.")
                return
        self._block_paths = [p for p, _ in targets]
        seen: set[int] = set()
        for b, (path, block) in enumerate(targets):
            self._handles.append(block.register_forward_hook(self._block_hook(b), prepend=True))
            for module in block.modules():
                if id(module) in seen or module is block:
                    continue
                spec = recognize_norm(module)
                if spec is None:
                    continue
                seen.add(id(module))
                self._norm_block.append(b)
                self._norm_specs.append(spec)
                self._handles.append(module.register_forward_hook(self._norm_hook(len(self._norm_block) - 1, spec)))

    def _block_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._collect:
                return
            out = first_tensor(output)
            if out is None:
                return
            # One op on a detached tensor (no graph, so no no_grad() needed); summed with the step's others later.
            self._block_norms.append(torch.linalg.vector_norm(out.detach(), dtype=torch.float32))
            self._block_ids.append(index)
            self._block_numel[index] += out.numel()

        return hook

    def _norm_hook(self, index: int, spec: Any):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._collect or not args or not isinstance(args[0], torch.Tensor) or args[0].numel() == 0:
                return
            self._amp_pending.append(_norm_rstd(spec, args[0], output))
            self._amp_ids.append(index)

        return hook

    def _index_of(self, plan, optimizer, device: torch.device) -> torch.Tensor:
        """Where `optimizer`'s groups (its `plan`) sit in this monitor's groups, as a device index."""
        idx = self._group_index.get(id(optimizer))
        if idx is None or idx.numel() != len(plan.groups):
            for g in plan.groups:  # an optimizer not in trainer.optimizers, or whose parameters changed
                if g not in self._group_names:
                    raise RuntimeError(f"SpikeMonitor: parameter group {g!r} appeared after the fit started; "
                                       "SpikeMonitor needs the optimizers' parameters fixed at fit start.")
            idx = torch.tensor([self._group_names.index(g) for g in plan.groups], dtype=torch.long).to(device)
            self._group_index[id(optimizer)] = idx
        return idx

    # -- the step -------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        previous = self._step
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if not self._enabled or self._rules is None:
            return
        if self._step != previous:  # the step's first micro-batch: start its statistics afresh
            self._block_norms, self._block_ids, self._amps, self._amp_pending, self._amp_ids = [], [], [], [], []
            self._block_numel = [0] * len(self._block_paths)
            self._loss.zero_()
            self._gsq.zero_()
            self._saw_loss = self._saw_grads = False
            self._judged_step = None
        self._collect = bool(self._block_paths)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._paused, self._collect = self._collect, False

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._collect, self._paused = self._paused, False

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._amp_pending:
            self._reduce_amps()
        if self._enabled and self._rules is not None and trainer.training:
            self._loss += loss.detach().to(self._loss)
            self._saw_loss = True

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if not self._enabled or self._rules is None:
            return
        plan = self._groups.plan_for(pl_module, optimizer)
        sq, _, _, _ = self._groups.group_sq(plan, self._gsq.device)
        self._gsq.index_add_(1, self._index_of(plan, optimizer, self._gsq.device), sq)
        self._saw_grads = True
        if len(trainer.optimizers) <= 1:  # one optimizer: judge now, before its update (an action can still act)
            self._judge(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._enabled and self._rules is not None and batch_ends_optimizer_step(trainer):
            self._collect = False
            if self._judged_step != self._step and (self._saw_grads or self._saw_loss):
                self._judge(trainer, pl_module, None)  # several optimizers, or none stepped: judge the whole step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _judge(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        """Apply the rules to this step's loss and gradient norm; record flagged values in the device buffer."""
        step = logging_step(trainer) if self._step is None else self._step
        self._judged_step = step
        loss, gsq = self._loss.clone(), self._gsq.clone()
        if trainer.world_size > 1 and distributed_world() > 1:
            # One small all-reduce per step: the mean loss over ranks, and the sharded gradients' squares summed.
            packed = torch.cat([loss.view(1), gsq[SHARDED]])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
            loss = packed[0] / distributed_world()
            gsq[SHARDED] = packed[1:]
        if "loss" in self.kinds and not self._saw_loss and not self._warned_loss:
            self._warned_loss = True
            warn("SpikeMonitor saw no loss at this step (no backward went through Lightning: call "
                 "self.manual_backward(loss) under manual optimisation); the loss is not judged then.")
        group_sq = gsq.sum(dim=0)
        nan = self._nan
        values = torch.stack([loss if self._saw_loss else nan, group_sq.sum().sqrt() if self._saw_grads else nan])
        judged = self._rules.update(values)
        # Judged only where watched and measured at this step (precomputed masks: no host->device copy per step).
        code = judged["code"] * self._masks[(self._saw_loss, self._saw_grads)]
        if self._pending >= _MAX_ROWS:  # so many steps without a logging step (log_every_n_steps=0): read them now
            self._flush(trainer, step, log_scalars=False)
        self._record(step, values, code, judged, group_sq)
        self._pending += 1
        if self.on_spike is not None:
            flags = read_to_host(code)  # the one host read of this step: an action must know now
            if any(flags):
                self._act(trainer, pl_module, optimizer, step)

    def _record(self, step: int, values: torch.Tensor, code: torch.Tensor, judged: dict, group_sq: torch.Tensor) -> None:
        """Write the step's row: every step's, flagged or not (the host picks the flagged ones when it reads them)."""
        if self._pending == self._rows["same"].shape[0]:  # a window longer than the buffer: double it
            old = self._rows
            self._rows = self._row_buffer(2 * self._pending, old.device)
            for name in ("same", "block_sq", "block_n"):
                self._rows[name][: self._pending].copy_(old[name])
        row = self._pending
        n_b = len(self._block_paths)
        meta = torch.stack([values, code, judged["mean"], judged["std"], judged["running_max"], judged["n_window"]], dim=1)
        parts = [meta.view(-1), group_sq]
        if self._norm_block:
            amp = torch.full((len(self._norm_block),), float("-inf"), dtype=torch.float64, device=values.device)
            if self._amp_pending:
                self._reduce_amps()
            if self._amps:
                amp.scatter_reduce_(0, self._index(self._amp_ids, values.device), torch.cat(self._amps).to(amp), "amax")
            parts.append(amp)
        torch.cat(parts, out=self._rows["same"][row])
        if n_b and self._block_norms:
            norms = torch.stack(self._block_norms).double().square()
            self._rows["block_sq"][row].index_add_(0, self._index(self._block_ids, values.device), norms)
        self._row_steps.append(step)
        self._row_numel.append(list(self._block_numel))

    def _reduce_amps(self) -> None:
        """The pending rstd tensors' maxima, in one op. They wait for the micro-batch's end (not the step's: under
        gradient accumulation they would add up): a rstd has one value per row, 1/width of its norm's input."""
        with torch.no_grad():
            if _foreach_max is not None:
                maxima = torch.stack(_foreach_max(self._amp_pending))
            else:  # torch < 2.5
                maxima = torch.stack([t.amax() for t in self._amp_pending])
        self._amps.append(maxima)
        self._amp_pending = []

    def _index(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """`ids` as a device index, cached: a step calls the same modules in the same order as the last."""
        key = tuple(ids)
        idx = self._index_cache.get(key)
        if idx is None:
            if len(self._index_cache) > 64:  # call patterns that keep changing: keep the cache small
                self._index_cache.clear()
            idx = self._index_cache[key] = to_device(ids, torch.long, device)
        return idx

    def _act(self, trainer: Trainer, pl_module: LightningModule, optimizer, step: int) -> None:
        if self.on_spike == "checkpoint":
            path = os.path.join(_log_dir(trainer), "spike_checkpoints", f"step={step}.ckpt")
            trainer.save_checkpoint(path)  # every rank calls it (the flags are the same on every rank)
            self._actions[step] = f"checkpoint {path}"
            if trainer.is_global_zero:
                warn(f"SpikeMonitor: spike at step {step}; saved a checkpoint before its update: {path}")
        elif self.on_spike == "skip" and optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # torch optimizers leave parameters without a gradient alone: no update, no state change
            self._actions[step] = "skipped"
            if trainer.is_global_zero:
                warn(f"SpikeMonitor: spike at step {step}; skipped its optimizer step (gradients dropped).")

    # -- output ---------------------------------------------------------------------------------
    def _end_logging_step(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        self._flush(trainer, step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._enabled and self._pending:  # steps judged since the last logging step
            self._flush(trainer, logging_step(trainer), log_scalars=False)

    def _flush(self, trainer: Trainer, step: int, log_scalars: bool = True) -> None:
        if self._rows is None:
            return
        used = self._pending
        if used and self._block_paths:  # the blocks' sizes, known on the host, join the rows for the reduction
            self._rows["block_n"][:used].copy_(torch.tensor(self._row_numel, dtype=torch.float64))
        host = self._rows.reduce_to_host(across_ranks=trainer.world_size > 1)
        self._rows.reset()
        steps, self._row_steps, self._row_numel = self._row_steps, [], []
        self._pending = 0
        width = len(_META)
        flagged = [(r, k) for r in range(used) for k in range(len(KINDS)) if host["same"][r][k * width + 1] > 0]
        count = len(flagged)
        self._total += count
        if not trainer.is_global_zero:
            return
        records = [self._describe(host, r, k, steps[r]) for r, k in flagged[: self.max_records]]
        if count > self.max_records:
            warn(f"SpikeMonitor: {count} spikes in the logging window ending at step {step}; recorded the first "
                 f"{self.max_records} (raise max_records, or log more often, to keep them all).")
        if records:
            path = os.path.join(_log_dir(trainer), JSONL_NAME)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record) + "\n")
            for record in records:
                write_text(trainer, "spike/record", json.dumps(record), record["step"])
                warn(f"SpikeMonitor: {record['kind']} spike at step {record['step']} ({record['rule']}): "
                     f"{record['value']:.4g} against {record['baseline']:.4g}; top group "
                     f"{record['top_groups'][0][0] if record['top_groups'] else '-'}. Record in {path}.")
        if log_scalars:
            self._log(trainer, {"spike/count": float(count), "spike/total": float(self._total)}, step)

    def _describe(self, host: dict, r: int, k: int, step: int) -> dict:
        """The record of kind `k` at row `r` (step `step`) of the reduced rows."""
        same, width, n_g = host["same"][r], len(_META), max(1, len(self._group_names))
        meta = dict(zip(_META, same[k * width : (k + 1) * width]))
        code = int(meta["code"])
        rule = "nonfinite" if code & _NONFINITE else "sigma" if code & _SIGMA else "ratio"
        if rule == "sigma":
            baseline, threshold = meta["mean"], meta["mean"] + self.sigma * meta["std"]
        elif rule == "ratio":
            baseline, threshold = meta["running_max"], self.ratio * meta["running_max"]
        else:
            baseline, threshold = meta["mean"], float("nan")
        at = len(KINDS) * width
        sq = same[at : at + len(self._group_names)]
        total = sum(sq)
        shares = sorted(((g, s / total) for g, s in zip(self._group_names, sq)), key=lambda t: -t[1]) \
            if total > 0 and math.isfinite(total) else []
        blocks = []
        norm_amp = same[at + n_g :]
        for b, path in enumerate(self._block_paths):
            n = host["block_n"][r][b]
            amps = [a for a, nb in zip(norm_amp, self._norm_block) if nb == b and a != float("-inf")]
            blocks.append({"block": path, "stream_rms": math.sqrt(host["block_sq"][r][b] / n) if n > 0 else None,
                           "amp_max": max(amps) if amps else None})
        return {
            "step": step, "kind": KINDS[k], "rule": rule,
            "rules": [name for bit, name in ((_SIGMA, "sigma"), (_RATIO, "ratio"), (_NONFINITE, "nonfinite")) if code & bit],
            "value": _num(meta["value"]), "baseline": _num(baseline), "threshold": _num(threshold),
            "std": _num(meta["std"]), "running_max": _num(meta["running_max"]), "n_window": int(meta["n_window"]),
            "top_groups": [[g, s] for g, s in shares[: self.top_groups]],
            "blocks": blocks, "action": self._actions.pop(step, None),
        }

    def _charts(self, trainer: Trainer) -> dict[str, str]:
        return {"spikes per logging window (spike/count)": r"^spike/count$", "spikes since the fit started": r"^spike/total$"}


def _norm_rstd(spec: Any, x: torch.Tensor, output: Any) -> torch.Tensor:
    """``1/sqrt(var + eps)`` per row of the norm input `x` (RMSNorm: ``1/sqrt(mean(x^2) + eps)``).

    A LayerNorm run by aten's kernel saved exactly that for its backward: it is read from the output's autograd
    node, at no cost, unless saved-tensor hooks (activation checkpointing, offloading) would run on reading it.
    Otherwise it is computed, in one pass over `x`.
    """
    if spec.kind == "layer":
        saved = _saved_rstd(output)
        if saved is not None:
            return saved
    x = x.detach()  # computed below: no graph
    if spec.kind == "layer":
        dims = x.shape[x.dim() - spec.ndim :]
        return torch.ops.aten.native_layer_norm(x.float(), dims, None, None, spec.eps_for(x.dtype))[2]
    n = math.prod(x.shape[x.dim() - spec.ndim :])
    sq = torch.linalg.vector_norm(x, 2, dim=tuple(range(-spec.ndim, 0)), dtype=torch.float32).square()
    return torch.rsqrt(sq / n + spec.eps_for(x.dtype))


def _saved_rstd(output: Any) -> torch.Tensor | None:
    """The rstd aten's native_layer_norm saved for the backward of `output`, or None (not such an output, or
    reading it would unpack through saved-tensor hooks: checkpointing would recompute the forward)."""
    node = getattr(output, "grad_fn", None)
    if node is None or type(node).__name__ != "NativeLayerNormBackward0":
        return None
    try:
        if node._raw_saved_result2.unpack_hook is not None:
            return None
        return node._saved_result2
    except (AttributeError, RuntimeError):  # an autograd without these attributes, or the graph already freed
        return None


def _num(x: float) -> float | str:
    """JSON has no inf/nan: write them as strings."""
    return x if math.isfinite(x) else str(x)


def _log_dir(trainer: Trainer) -> str:
    """The logger's log_dir, else the Trainer's default_root_dir (read directly: `trainer.log_dir` broadcasts)."""
    logger = trainer.logger
    path = getattr(logger, "log_dir", None) if logger is not None else None
    return str(path) if path else str(trainer.default_root_dir)
