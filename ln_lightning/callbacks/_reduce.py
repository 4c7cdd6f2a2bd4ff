"""The one place where monitor statistics cross ranks and reach the host.

A monitor declares its statistics as named states, the way torchmetrics' ``Metric.add_state`` does::

    stats = PackedStats(device)
    stats.add_state("sq_out", size=n_blocks, reduction=SUM)       # sums of squares, one per block
    stats.add_state("neg_var_min", size=n_norms, reduction=MAX)   # minima, stored negated
    stats["sq_out"][i] += ...                                      # a device view, updated in hooks

All states live in one float64 device tensor: the SUM states side by side, then the MAX states. At a
logging step `reduce_to_host` runs one `all_reduce(SUM)` over the SUM part and one `all_reduce(MAX)`
over the MAX part (no collective at all on a single process, none for an empty part), then copies the
whole tensor to the host once: the only host synchronisation a monitor performs, and only on logging
steps. Because sums and counts are reduced before dividing, the result equals what one process would
compute on all ranks' data together, whatever the per-rank batch sizes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Number of device->host copies made by `reduce_to_host` since import. The benchmark reads it to
# show "one host synchronisation per logging step per callback" by construction.
HOST_COPIES = 0


class Reduction(enum.Enum):
    """How a state combines across ranks."""

    SUM = "sum"
    MAX = "max"


SUM = Reduction.SUM
MAX = Reduction.MAX


def distributed_world() -> int:
    """World size of the default process group, 1 when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


@dataclass(frozen=True)
class _State:
    shape: tuple[int, ...]
    reduction: Reduction
    default: float
    offset: int = 0  # into the packed tensor, fixed when it is built

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _nested(flat: list[float], shape: tuple[int, ...]) -> Any:
    """`flat` as nested lists of `shape` (a float for shape `()`)."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = math.prod(shape[1:])
    return [_nested(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


class PackedStats:
    """Named SUM and MAX states on one device, reduced across ranks together.

    Declare every state with :meth:`add_state` first; the packed tensor is built on first use
    (indexing, `reset`, `reduce_to_host`) and starts at each state's default. ``stats[name]`` is a
    view of shape ``size`` that hooks update in place, so nothing but this one tensor lives between
    steps.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, _State] = {}
        self._packed: torch.Tensor | None = None
        self._initial: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._n_sum = 0

    def add_state(self, name: str, size: int | tuple[int, ...], reduction: Reduction, default: float | None = None) -> None:
        """Declare state `name` of shape `size`, combined across ranks by `reduction` (SUM or MAX).

        `default` is its value after `reset` (0 for SUM, -inf for MAX unless given).
        """
        if self._packed is not None:
            raise RuntimeError(f"PackedStats: add_state({name!r}) after the states were first used; declare them all first")
        if name in self._states:
            raise ValueError(f"PackedStats: state {name!r} is declared twice")
        if not isinstance(reduction, Reduction):
            raise TypeError(f"PackedStats: reduction must be SUM or MAX, got {reduction!r}")
        shape = (size,) if isinstance(size, int) else tuple(size)
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"PackedStats: state {name!r} has an invalid size {size!r}")
        if default is None:
            default = 0.0 if reduction is SUM else float("-inf")
        self._states[name] = _State(shape, reduction, float(default))

    def _build(self) -> None:
        # SUM states first, then MAX ones: each part is contiguous, so each takes one all-reduce.
        ordered = sorted(self._states.items(), key=lambda item: item[1].reduction is MAX)
        offset, parts = 0, [torch.zeros(0, dtype=torch.float64, device=self.device)]
        for name, state in ordered:
            self._states[name] = state = _State(state.shape, state.reduction, state.default, offset)
            offset += state.numel
            # Filled on the device: no host->device copy, which could wait for the stream.
            parts.append(torch.full((state.numel,), state.default, dtype=torch.float64, device=self.device))
        self._n_sum = sum(s.numel for s in self._states.values() if s.reduction is SUM)
        self._initial = torch.cat(parts)
        self._packed = self._initial.clone()
        self._views = {n: self._packed[s.offset : s.offset + s.numel].view(s.shape) for n, s in self._states.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._packed is None:
            self._build()
        return self._views[name]

    def reset(self) -> None:
        """Every state back to its default (one copy)."""
        if self._packed is None:
            self._build()
        self._packed.copy_(self._initial)

    def reduce_to_host(self, across_ranks: bool = True, group=None) -> dict[str, Any]:
        """All-reduce (SUM part, MAX part) across ranks, then ONE device->host copy. Every rank must call it.

        Returns ``{name: value}`` with each value a float or nested lists of floats of the state's shape.
        `across_ranks=False` (the trainer runs one process) skips the collectives even when some other
        code initialised torch.distributed in this process.
        """
        global HOST_COPIES
        if self._packed is None:
            self._build()
        if across_ranks and distributed_world() > 1:
            # NCCL/gloo reduce in place; slices of one storage are contiguous, so this is safe.
            sums, maxes = self._packed[: self._n_sum], self._packed[self._n_sum :]
            if sums.numel():
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            if maxes.numel():
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        HOST_COPIES += 1
        values = self._packed.tolist()  # the single host synchronisation of this logging step
        return {n: _nested(values[s.offset : s.offset + s.numel], s.shape) for n, s in self._states.items()}


def read_to_host(tensor: torch.Tensor) -> list:
    """One device->host copy of a small tensor, counted in `HOST_COPIES` like `reduce_to_host`'s: the per-step
    read a monitor makes only when it must act on the host at once (`SpikeMonitor(on_spike=...)`)."""
    global HOST_COPIES
    HOST_COPIES += 1
    return tensor.tolist()
