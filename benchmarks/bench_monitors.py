"""Cost of the four monitors: training-step time with all of them at log_every_n_steps=50 versus none.

The four: StreamNormMonitor, LayerNormInputMonitor, ClipAttributionMonitor and SpikeMonitor (which works on every
step: its rules, its records' statistics and its forward hooks run on the device each step; within a 50-step
on-block its 128-step window never completes its warm-up, which changes no work, only the flags' values).

One process, one Trainer, one model (the demo `CharLM` on the standard-library corpus, gradient
clipping on, TensorBoard logger, Lightning's own logging every 50 steps). The run alternates arms
in blocks of 50 steps aligned with the logging interval: in an "on" block the monitors have
their hooks registered and run (the block ends with a logging step, as every 50th step does); in
an "off" block they are torn down (hooks removed, the clip monitor returns at once), so the step
does what it would do without them. Alternating in one run makes load from other processes hit both arms
alike; each on-block is compared with the mean of its neighbouring off-blocks, and the median of
those paired ratios is the headline (robust to a noisy, shared machine), with the plain mean too.
Step time is the interval between consecutive `on_train_batch_start` calls (forward, backward,
clipping, optimizer, callbacks and logging); the first step of each block is not timed.

Host synchronisations are counted in a separate, untimed fit: every torch call made from
`ln_lightning/callbacks` code is recorded (a TorchFunctionMode), and those that make the host wait
for the device (`tolist`, `item`, `cpu`, `numpy`, `bool()`, `float()`, ...) are counted per step.

Run:
    python benchmarks/bench_monitors.py            # demo model, 12 blocks of 50 steps
    python benchmarks/bench_monitors.py --quick    # smaller model, 6 blocks (smoke test)
    python benchmarks/bench_monitors.py --json docs/results/bench_monitors/results.json   # also the figures as JSON
Target: ratio (monitors / none) <= 1.03.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.overrides import TorchFunctionMode

from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, SpikeMonitor, StreamNormMonitor
from ln_lightning.callbacks import _reduce
from ln_lightning.callbacks._lightning_internals import logging_step
from ln_lightning.demo.lightning import CharDataModule, CharLM

SYNCING = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__"}


class StepTimer(L.Callback):
    """Records each step's start time and which arm it ran in."""

    def __init__(self):
        self.starts: list[tuple[int, float, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append((trainer.global_step, time.perf_counter(), time.process_time()))


class ArmSwitch(L.Callback):
    """Turns the monitors on for odd blocks of `every` steps and fully off (hooks removed) for even ones."""

    def __init__(self, monitors, every: int):
        self.monitors = monitors
        self.every = every
        self.on = True

    def arm_of(self, step: int) -> bool:
        return (step // self.every) % 2 == 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        want = self.arm_of(trainer.global_step)
        if want == self.on:
            return
        for mon in self.monitors:
            if want:
                mon.setup(trainer, pl_module, "fit")  # re-enables: registers the forward hooks
                mon.on_fit_start(trainer, pl_module)  # re-allocates the device buffers
            else:
                mon.teardown(trainer, pl_module, "fit")  # disabled: hooks removed, the clip monitor returns at once
        self.on = want


class _Calls(TorchFunctionMode):
    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer
        self.syncs: list[int] = []  # Lightning's logging step of each syncing call made from monitor code
        self.calls: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        code = sys._getframe(1).f_code.co_filename.replace("\\", "/")
        if "ln_lightning/callbacks" in code:
            step = logging_step(self.trainer)
            self.calls.append(step)
            if getattr(func, "__name__", "") in SYNCING:
                self.syncs.append(step)
        return func(*args, **(kwargs or {}))


class SyncCounter(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.mode = _Calls(trainer)
        self.mode.__enter__()

    def on_train_end(self, trainer, pl_module):
        self.mode.__exit__(None, None, None)


class MonitorClock:
    """Wall time spent inside the monitors' own code (callback methods and forward hooks), per step.

    On a CPU the monitors' work is synchronous, so this is their cost; it is far less sensitive to
    other processes' load than the difference of two noisy step times.
    """

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self.by_monitor: dict[str, dict[int, float]] = {}  # the same, per monitor class
        self.trainer = None

    def timed(self, fn, owner: str):
        mine = self.by_monitor.setdefault(owner, {})

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                step = self.trainer.global_step if self.trainer is not None else -1
                spent = time.perf_counter() - t0
                self.seconds[step] = self.seconds.get(step, 0.0) + spent
                mine[step] = mine.get(step, 0.0) + spent

        return wrapper

    def attach(self, mon) -> None:
        owner = type(mon).__name__
        for name in ("on_train_batch_start", "on_train_batch_end", "on_before_optimizer_step", "on_before_backward", "on_train_end"):
            setattr(mon, name, self.timed(getattr(mon, name), owner))
        for factory in ("_make_hook", "_block_hook", "_norm_hook"):  # the activation monitors' and SpikeMonitor's hooks
            if hasattr(mon, factory):
                make = getattr(mon, factory)
                setattr(mon, factory, lambda *a, _make=make, **k: self.timed(_make(*a, **k), owner))


def monitors(clock: MonitorClock | None = None):
    mons = [StreamNormMonitor(), LayerNormInputMonitor(), ClipAttributionMonitor(), SpikeMonitor()]
    if clock is not None:
        for mon in mons:
            clock.attach(mon)
    return mons


def make_trainer(steps: int, every: int, callbacks, log_dir: str, accelerator: str) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator, devices=1, max_steps=steps, log_every_n_steps=every, gradient_clip_val=1.0,
        logger=TensorBoardLogger(log_dir, name="bench"), callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--blocks", type=int, default=12, help="number of alternating blocks (half on, half off)")
    parser.add_argument("--every", type=int, default=50, help="log_every_n_steps, also the block length")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--json", help="also write the figures printed below to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.layers, args.d_model, args.block_size, args.batch_size = 6, 3, 64, 64, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    L.seed_everything(0, verbose=False)
    model = CharLM(d_model=args.d_model, n_layers=args.layers, n_heads=4, block_size=args.block_size)
    data = CharDataModule(block_size=args.block_size, batch_size=args.batch_size, max_chars=400_000)
    tmp = tempfile.mkdtemp(prefix="bench_monitors_")
    steps = args.blocks * args.every + 1
    print(f"demo CharLM d_model={args.d_model} layers={args.layers} batch={args.batch_size}x{args.block_size}, "
          f"torch threads={torch.get_num_threads()}, log_every_n_steps={args.every}, gradient_clip_val=1.0, "
          f"{args.blocks} alternating blocks of {args.every} steps")

    result: dict = {"argv": sys.argv[1:] if argv is None else list(argv), "torch_threads": torch.get_num_threads(),
                    "load_average_start": os.getloadavg()[0],
                    "every": args.every, "blocks": args.blocks, "layers": args.layers, "d_model": args.d_model,
                    "batch": [args.batch_size, args.block_size]}
    clock = MonitorClock()
    mons = monitors(clock)
    timer = StepTimer()
    switch = ArmSwitch(mons, args.every)
    trainer = make_trainer(steps, args.every, [timer, *mons, switch], tmp, args.accelerator)
    clock.trainer = trainer
    trainer.fit(model, data)

    # block b covers steps [b*every, (b+1)*every); its first step (hook re-registration) is not timed.
    # Wall time is what training feels; process CPU time is less disturbed by other processes on a shared machine.
    for label, k in (("wall", 1), ("cpu", 2)):
        block_times: dict[int, list[float]] = {}
        for a, b in zip(timer.starts, timer.starts[1:]):
            if a[0] % args.every:
                block_times.setdefault(a[0] // args.every, []).append(b[k] - a[k])
        means = {b: statistics.fmean(v) for b, v in block_times.items() if len(v) == args.every - 1}
        on_blocks = [b for b in means if switch.arm_of(b * args.every)]
        paired = []
        for b in on_blocks:
            neighbours = [means[n] for n in (b - 1, b + 1) if n in means]
            if neighbours:
                paired.append(means[b] / statistics.fmean(neighbours))
        if label == "wall":
            for b, m in sorted(means.items()):
                print(f"  block {b:2d} {'on ' if switch.arm_of(b * args.every) else 'off'}: mean step {1e3 * m:.2f} ms")
        on_mean = statistics.fmean(means[b] for b in on_blocks)
        off_mean = statistics.fmean(means[b] for b in means if b not in on_blocks)
        ratio = statistics.median(paired)
        print(f"[{label}] mean step: none {1e3 * off_mean:.2f} ms, monitors {1e3 * on_mean:.2f} ms "
              f"(ratio of means {on_mean / off_mean:.4f}); paired block ratios: {', '.join(f'{r:.3f}' for r in paired)}")
        print(f"[{label}] RATIO monitors/none (median of paired blocks) = {ratio:.4f}; "
              f"target <= 1.03: {'PASS' if ratio <= 1.03 else 'FAIL'}")
        result[label] = {"ratio_median_paired": ratio, "ratio_of_means": on_mean / off_mean, "paired": paired,
                         "step_ms_none": 1e3 * off_mean, "step_ms_monitors": 1e3 * on_mean}

    # Noise floor: how much the off-blocks alone vary. A target of 3% can't be resolved below it.
    wall = {}
    for a, b in zip(timer.starts, timer.starts[1:]):
        if a[0] % args.every:
            wall.setdefault(a[0] // args.every, []).append(b[1] - a[1])
    off_means = [statistics.fmean(v) for blk, v in wall.items() if not switch.arm_of(blk * args.every)]
    if len(off_means) > 1:
        print(f"noise: off-block mean step times vary by {statistics.stdev(off_means) / statistics.fmean(off_means):.1%} "
              "(coefficient of variation); a ratio is only meaningful to about that precision")
        result["noise_cv"] = statistics.stdev(off_means) / statistics.fmean(off_means)
    # Attributed cost: time inside monitor code in the on-blocks, against the rest of those steps.
    on_steps = [a[0] for a in timer.starts[:-1] if a[0] % args.every and switch.arm_of(a[0])]
    inside = sum(clock.seconds.get(s_, 0.0) for s_ in on_steps)
    step_total = sum(b[1] - a[1] for a, b in zip(timer.starts, timer.starts[1:]) if a[0] in set(on_steps))
    log_inside = sum(clock.seconds.get(s_, 0.0) for s_ in on_steps if (s_ + 1) % args.every == 0 or s_ % args.every == 0)
    print(f"time inside monitor code: {1e3 * inside / len(on_steps):.2f} ms per step on average "
          f"({1e3 * log_inside:.1f} ms on/after logging steps), i.e. ATTRIBUTED RATIO = "
          f"{step_total / (step_total - inside):.4f} (steps without that time); target <= 1.03: "
          f"{'PASS' if step_total / (step_total - inside) <= 1.03 else 'FAIL'}")
    result["inside_ms_per_step"] = 1e3 * inside / len(on_steps)
    per_monitor = {name: 1e3 * sum(sec.get(s_, 0.0) for s_ in on_steps) / len(on_steps) for name, sec in clock.by_monitor.items()}
    print("  of which, per step: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in per_monitor.items())
          + " (wall time: a step's share of the machine's other load lands in it too)")
    result["inside_ms_per_step_by_monitor"] = per_monitor
    result["attributed_ratio"] = step_total / (step_total - inside)

    # Host synchronisations: an untimed fit with the torch-call recorder.
    counter = SyncCounter()
    before = _reduce.HOST_COPIES
    sync_steps = 2 * args.every + 1
    make_trainer(sync_steps, args.every, [*monitors(), counter], tmp, args.accelerator).fit(model, data)
    log_steps = [s for s in range(sync_steps) if (s + 1) % args.every == 0]
    syncs = counter.mode.syncs
    near_log = set(log_steps)  # every monitor reduces at its logging step's end, under that step's number
    quiet_steps = sync_steps - len(near_log)
    # SpikeMonitor reads its records once more when the fit ends (the steps after the last logging step).
    at_end = sum(1 for s in syncs if s == sync_steps)
    in_steps = [s for s in syncs if s != sync_steps]
    print(f"host synchronisations from monitor code: {len(in_steps)} in {sync_steps} steps with {len(log_steps)} logging "
          f"steps = {len(in_steps) / len(log_steps):.1f} per logging step ({len(in_steps) / len(log_steps) / 4:.1f} per callback), "
          f"{sum(1 for s in in_steps if s not in near_log)} on the {quiet_steps} other steps, {at_end} at the end of the fit; "
          f"reduce_to_host copies: {_reduce.HOST_COPIES - before}")
    print(f"monitor torch calls per non-logging step: {sum(1 for s in counter.mode.calls if s not in near_log) / quiet_steps:.1f} "
          "(the clip monitor's per-step window statistics and SpikeMonitor's detection, all on the device)")
    result["host_syncs"] = {"steps": sync_steps, "logging_steps": len(log_steps), "total": len(in_steps),
                            "per_logging_step_per_callback": len(in_steps) / len(log_steps) / 4,
                            "on_other_steps": sum(1 for s in in_steps if s not in near_log), "at_fit_end": at_end}
    if args.json:
        result["load_average_end"] = os.getloadavg()[0]
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
