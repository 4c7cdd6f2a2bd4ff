"""The three monitors on the demo character LM, logged to TensorBoard.

Trains `ln_lightning.demo.lightning.CharLM` (post-norm, as written) on the standard library's source
with `StreamNormMonitor`, `LayerNormInputMonitor` and `ClipAttributionMonitor`, gradient clipping on,
and writes TensorBoard logs. With `--placement pre` (or `both`) the model is first rewritten to
pre-norm with `ln_lightning.convert`, so the two runs can be compared side by side in one dashboard.

Run:
    python examples/monitors_demo.py --quick                 # 40 steps, a small model: a minute or two on 2 CPU cores
    python examples/monitors_demo.py --placement both        # post-norm and pre-norm runs
    tensorboard --logdir outputs/monitors_demo               # then open the CUSTOM SCALARS tab

What to look for: "stream rms by block" stays near 1 for post-norm (each block ends in a LayerNorm)
and grows with depth for pre-norm; "LN amp_max" shows how close each norm gets to its
1/sqrt(eps) bound; "clip share by group" shows which blocks the clipped gradient comes from.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor
from ln_lightning.demo.lightning import CharDataModule, CharLM


def build_model(placement: str, args) -> CharLM:
    L.seed_everything(args.seed, verbose=False)
    module = CharLM(d_model=args.d_model, n_layers=args.layers, n_heads=4, block_size=args.block_size, lr=args.lr,
                    warmup_steps=args.warmup)
    if placement == "pre":
        try:
            from ln_lightning.placement import convert
        except ImportError as err:
            raise SystemExit(f"--placement pre needs ln_lightning.placement.convert ({err}); use --placement post") from err
        report = convert(module.model, "pre")
        print(report.summary())
    return module


def run(placement: str, args) -> Path:
    module = build_model(placement, args)
    data = CharDataModule(block_size=args.block_size, batch_size=args.batch_size, max_chars=args.max_chars,
                          train_windows=args.steps * args.batch_size)
    logger = TensorBoardLogger(args.out, name="", version=placement, default_hp_metric=False)
    trainer = L.Trainer(
        accelerator="cpu" if args.cpu else "auto",
        devices=1,
        max_steps=args.steps,
        log_every_n_steps=args.every,
        gradient_clip_val=args.clip,
        logger=logger,
        callbacks=[StreamNormMonitor(), LayerNormInputMonitor(), ClipAttributionMonitor()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(module, data)
    print(f"{placement}-norm: {trainer.global_step} steps in {time.perf_counter() - start:.1f} s, logs in {logger.log_dir}")
    return Path(logger.log_dir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/monitors_demo", help="TensorBoard log directory")
    parser.add_argument("--placement", choices=["post", "pre", "both"], default="post",
                        help="post: the demo model as written; pre: converted with ln_lightning.convert; both: two runs")
    parser.add_argument("--quick", action="store_true", help="a small model and 40 steps (smoke test)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10, help="log_every_n_steps (the monitors' interval)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-chars", type=int, default=400_000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--clip", type=float, default=0.5, help="gradient_clip_val (norm)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="force CPU even when a GPU is present")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.layers, args.d_model, args.max_chars = 40, 5, 3, 64, 100_000
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    placements = ["post", "pre"] if args.placement == "both" else [args.placement]
    for placement in placements:
        run(placement, args)
    print(f"view: tensorboard --logdir {args.out}   (CUSTOM SCALARS tab: one chart per metric family)")


if __name__ == "__main__":
    main()
