"""One tiny post-norm LightningModule per Lightning namespace, for tests/test_namespaces.py.

`lightning.pytorch` and `pytorch_lightning` have separate classes, so each Trainer needs a module (and
callbacks) built from its own namespace. The classes live at module level so that ddp_spawn workers can
unpickle them.
"""

from __future__ import annotations

import atexit
import importlib
from types import SimpleNamespace

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ln_lightning.demo.models import PostNormTransformerLM

VOCAB, D, LAYERS, HEADS, T = 32, 16, 2, 2, 8
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def _destroy_process_group() -> None:  # see ln_lightning/testing/dist.py: a gloo shutdown crash in spawned workers
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _classes(pl):
    class TinyLM(pl.LightningModule):
        def __init__(self, lr: float = 1e-2):
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.model = PostNormTransformerLM(VOCAB, D, LAYERS, HEADS, T)
            self.example_input_array = torch.zeros(2, T, dtype=torch.long)

        def forward(self, idx):
            return self.model(idx)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    class DestroyProcessGroupAtExit(pl.Callback):
        def setup(self, trainer, pl_module, stage: str) -> None:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                atexit.register(_destroy_process_group)

    return TinyLM, DestroyProcessGroupAtExit


LitTinyLM, LitDestroyPG = _classes(importlib.import_module("lightning.pytorch"))
PLTinyLM, PLDestroyPG = _classes(importlib.import_module("pytorch_lightning"))
for _cls, _name in ((LitTinyLM, "LitTinyLM"), (LitDestroyPG, "LitDestroyPG"), (PLTinyLM, "PLTinyLM"), (PLDestroyPG, "PLDestroyPG")):
    _cls.__name__ = _cls.__qualname__ = _name


def namespace(name: str) -> SimpleNamespace:
    """`pl` (the Lightning namespace), `ln` (ln_lightning's objects for it), its model class and helpers."""
    if name == "pytorch_lightning":
        return SimpleNamespace(name=name, pl=importlib.import_module("pytorch_lightning"),
                               ln=importlib.import_module("ln_lightning.pytorch_lightning"), Model=PLTinyLM,
                               DestroyPG=PLDestroyPG, other="lightning.pytorch")
    return SimpleNamespace(name=name, pl=importlib.import_module("lightning.pytorch"), ln=importlib.import_module("ln_lightning"),
                           Model=LitTinyLM, DestroyPG=LitDestroyPG, other="pytorch_lightning")


def loader(n: int = 16, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (n, T), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=batch_size)
