"""A test-only workaround for a PyTorch shutdown crash in spawned gloo workers.

A process that exits without `torch.distributed.destroy_process_group()` can abort with
"terminate called without an active exception" (SIGABRT) during interpreter finalisation: gloo's
worker threads still hold work objects when the interpreter is torn down (pytorch/pytorch#190489,
the abandoned fix pytorch/pytorch#179291). Lightning's ddp_spawn workers exit that way, so about
one ddp_spawn run in twenty failed *after* its work had finished, making CI flaky. Destroying the
group from an atexit handler, while the interpreter is still whole, avoids it. It is not part of
the library: the crash is PyTorch's and happens with or without ln_lightning.
"""

from __future__ import annotations

import atexit

import lightning as L
import torch

_registered = False


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class DestroyProcessGroupAtExit(L.Callback):
    """Registers (once per process) an atexit handler that destroys the default process group."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        global _registered
        if not _registered and torch.distributed.is_available() and torch.distributed.is_initialized():
            atexit.register(_destroy_process_group)
            _registered = True
