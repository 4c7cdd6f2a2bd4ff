"""The one place where monitor statistics cross ranks and reach the host.

Every monitor keeps its statistics in two small float64 device buffers:

- a SUM section (sums of squares, sums of variances, element / row counts, non-finite counts), and
- a MAX section (maxima, and minima stored negated, so one MAX all-reduce serves both).

At a logging step `reduce_to_host` runs one `all_reduce(SUM)` and one `all_reduce(MAX)` on the
packed buffers (no collective at all on a single process) and then copies both to the host in a
single transfer: the only host synchronisation a monitor performs, and only on logging steps.
Because sums and counts are reduced before dividing, the result equals what one process would
compute on all ranks' data together, whatever the per-rank batch sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Number of device->host copies made by `reduce_to_host` since import. The benchmark reads it to
# show "one host synchronisation per logging step per callback" by construction.
HOST_COPIES = 0


def distributed_world() -> int:
    """World size of the default process group, 1 when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class PackedStats:
    """A SUM and a MAX accumulator on one device, reduced across ranks together.

    `sums` has shape `(n_sum,)` and starts at 0; `maxes` has shape `(n_max,)` and starts at -inf.
    Monitors take views of them (`sums.view(rows, cols)`) and update those in place inside hooks,
    so nothing but these two buffers lives between steps.
    """

    def __init__(self, n_sum: int, n_max: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        # One storage for both sections: a single host copy moves everything.
        self._packed = torch.zeros(n_sum + n_max, dtype=torch.float64, device=self.device)
        self.sums = self._packed[:n_sum]
        self.maxes = self._packed[n_sum:]
        self.reset()

    def reset(self) -> None:
        self.sums.zero_()
        self.maxes.fill_(float("-inf"))

    def reduce_to_host(self, across_ranks: bool = True, group=None) -> tuple[list[float], list[float]]:
        """All-reduce (SUM, MAX) across ranks, then ONE device->host copy. Every rank must call it.

        `across_ranks=False` (the trainer runs one process) skips the collectives even when some other
        code initialised torch.distributed in this process.
        """
        global HOST_COPIES
        if across_ranks and distributed_world() > 1:
            # NCCL/gloo reduce in place; views of one storage are contiguous, so this is safe.
            if self.sums.numel():
                dist.all_reduce(self.sums, op=dist.ReduceOp.SUM, group=group)
            if self.maxes.numel():
                dist.all_reduce(self.maxes, op=dist.ReduceOp.MAX, group=group)
        HOST_COPIES += 1
        values = self._packed.tolist()  # the single host synchronisation of this logging step
        n_sum = self.sums.numel()
        return values[:n_sum], values[n_sum:]
