"""A fit that can be killed and resumed: the fault test's worker (`python tests/_helpers_faults.py OUT ...`).

`--kill-at STEP`: at the start of optimizer step STEP, rank 0 writes OUT/ready and waits to be killed (the test
sends SIGKILL to the process group). `--resume`: fit from OUT/ckpt/last.ckpt. Without either, an uninterrupted
run. Every run trains the same model on the same data with LNPlacement and the three monitors attached, and
writes rank 0's final weights to OUT/final.pt.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor
from ln_lightning.demo.lightning import CharLM
from ln_lightning.plugin import LNPlacement
from ln_lightning.testing import plugin as h
from ln_lightning.testing.dist import DestroyProcessGroupAtExit

STEPS_PER_EPOCH = 8  # 32 sequences, batch 4
EPOCHS = 3


class WaitForKill(Callback):
    def __init__(self, out: str, step: int):
        self.out, self.step = out, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.is_global_zero:
            Path(self.out, "ready").write_text(str(trainer.global_step))
            time.sleep(600)  # the test kills the process group now


class SaveFinal(Callback):
    def __init__(self, out: str):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
            torch.save({"state": state, "global_step": trainer.global_step}, os.path.join(self.out, "final.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--strategy", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seed_everything(0, workers=True)
    spawn = args.strategy == "ddp_spawn"
    callbacks = [
        StreamNormMonitor(every_n_steps=2),
        LayerNormInputMonitor(every_n_steps=2),
        ClipAttributionMonitor(every_n_steps=2),
        # last.ckpt at epoch ends: measured, a resume from a mid-epoch checkpoint is not bitwise here (a plain
        # DataLoader's position is not in the checkpoint).
        ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), save_last=True, every_n_epochs=1),
        SaveFinal(args.out),
        DestroyProcessGroupAtExit(),
    ]
    if args.kill_at is not None:
        callbacks.append(WaitForKill(args.out, args.kill_at))
    trainer = Trainer(
        plugins=[LNPlacement("pre", fused=False)],
        callbacks=callbacks,
        max_epochs=EPOCHS,
        gradient_clip_val=0.5,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        logger=TensorBoardLogger(args.out, name="tb"),
        default_root_dir=args.out,
        accelerator="cpu",
        devices=2 if spawn else 1,
        strategy=args.strategy,
    )
    model = CharLM(**h.TINY)
    ckpt = os.path.join(args.out, "ckpt", "last.ckpt") if args.resume else None
    trainer.fit(model, train_dataloaders=h.loader(32, batch_size=4), ckpt_path=ckpt)


if __name__ == "__main__":
    main()
