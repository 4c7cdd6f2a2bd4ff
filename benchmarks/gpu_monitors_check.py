"""GPU checks of the monitors that a CPU machine can't run. Needs CUDA; about 2-4 minutes.

1. Lightning's FSDPStrategy (FSDP1, use_orig_params=True, blocks auto-wrapped) on
   min(2, #GPUs) devices: every logged stream / LayerNorm / clip metric against the float64
   single-process reference on all ranks' batches concatenated, and clip/total_norm against FSDP's
   own `clip_grad_norm_` on the same run (torch's plain `clip_grad_norm_` would see one shard only).
   With one GPU the strategy runs unsharded (world size 1); with two it shards for real.
2. Host synchronisations on CUDA: `torch.cuda.set_sync_debug_mode("warn")` during training with all
   three monitors and gradient clipping; every synchronising call whose Python frame is in
   ln_lightning/callbacks is counted per step: expected one per callback on logging steps, none elsewhere.
3. The step-time benchmark (benchmarks/bench_monitors.py) on the GPU.

Run:  python benchmarks/gpu_monitors_check.py [--skip-bench]
Writes a JSON summary to $OUT/gpu_monitors_check.json when $OUT is set. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_monitors

import lightning as L  # noqa: E402
import torch  # noqa: E402
from ln_lightning.testing.monitors import (  # noqa: E402
    FixedBatchLM,
    all_monitors,
    compare,
    concat_batches,
    make_data,
    make_model,
    make_trainer,
    read_scalars,
    reference_forward_stats,
    reference_grad_stats,
)

from ln_lightning.demo.models import PostNormBlock  # noqa: E402


class FSDP1FixedLM(FixedBatchLM):
    def on_before_optimizer_step(self, optimizer) -> None:
        # FSDP1 keeps each rank's shard in param.grad; its own clip_grad_norm_ reduces across shards.
        fsdp_root = self.trainer.strategy.model
        total = fsdp_root.clip_grad_norm_(float("inf"))  # multiplies the gradients by 1.0
        if self.global_rank == 0 and self.logger is not None:
            self.logger.log_metrics({"ref/clip_grad_norm": float(total)}, step=self.global_step)


def check_fsdp1(out: Path) -> dict:
    from lightning.pytorch.strategies import FSDPStrategy

    devices = min(2, torch.cuda.device_count())
    x, y = make_data(world=devices, accum=1)
    strategy = FSDPStrategy(auto_wrap_policy={PostNormBlock}, sharding_strategy="FULL_SHARD")
    trainer = make_trainer(str(out), "fsdp1", accelerator="cuda", devices=devices, strategy=strategy, max_steps=4,
                       callbacks=all_monitors())
    trainer.fit(FSDP1FixedLM(x, y))
    if not trainer.is_global_zero:
        return {}
    logged = read_scalars(out / "fsdp1")
    model = make_model()
    expected = reference_forward_stats(model, concat_batches(x))
    expected.update(reference_grad_stats(model, concat_batches(x), concat_batches(y)))
    errors = compare(logged, expected, rtol=1e-4, steps=[1, 3])
    ref = dict(logged.get("ref/clip_grad_norm", []))
    for step, value in logged.get("clip/total_norm", []):
        if abs(value - ref.get(step, float("nan"))) > 1e-4 * abs(value):
            errors.append(f"clip/total_norm step {step}: {value} vs FSDP clip_grad_norm_ {ref.get(step)}")
    return {"devices": devices, "sharded": devices > 1, "errors": errors, "ok": not errors,
            "total_norm": logged.get("clip/total_norm"), "fsdp_clip_grad_norm": logged.get("ref/clip_grad_norm")}


class _StepTracker(L.Callback):
    """Placed first: records the step and turns CUDA sync debugging on for the whole step."""

    step = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _StepTracker.step = trainer.global_step
        torch.cuda.set_sync_debug_mode("warn")


class _SyncDebugOff(L.Callback):
    """Placed last: turns sync debugging off after every other callback's on_train_batch_end (the monitors' flush)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("default")


def check_cuda_syncs(out: Path) -> dict:
    x, y = make_data(world=1, accum=1)
    every, steps = 5, 10
    trainer = make_trainer(str(out), "syncs", accelerator="cuda", devices=1, max_steps=steps, gradient_clip_val=0.05,
                       callbacks=[_StepTracker(), *all_monitors(every=every), _SyncDebugOff()])
    ours: list[tuple[int, str]] = []
    total = [0]

    def on_warning(message, category, filename, lineno, file=None, line=None):
        # Called while the synchronising op is still on the stack: attribute it to monitor code if any
        # frame of the current Python stack belongs to ln_lightning/callbacks.
        if "synchroniz" not in str(message).lower():
            return
        total[0] += 1
        frame = sys._getframe(1)
        while frame is not None:
            path = frame.f_code.co_filename.replace("\\", "/")
            if "ln_lightning/callbacks" in path:
                ours.append((_StepTracker.step, f"{Path(path).name}:{frame.f_lineno}"))
                return
            frame = frame.f_back

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        trainer.fit(FixedBatchLM(x, y))
    log_steps = [s for s in range(steps) if (s + 1) % every == 0]
    ok = len(ours) == 3 * len(log_steps) and all(w.startswith("_reduce.py") for _, w in ours) \
        and all(s in log_steps for s, _ in ours)
    return {"ok": ok, "monitor_syncs": ours, "expected": f"3 per logging step {log_steps}, from _reduce.py",
            "all_sync_warnings_during_steps": total[0]}


CHECKS = {"fsdp1": check_fsdp1, "cuda_syncs": check_cuda_syncs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--only", choices=sorted(CHECKS), help="run one check in this process (used internally)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.only:  # one check per process: a distributed run leaves its process group behind
        out = Path(tempfile.mkdtemp(prefix=f"gpu_monitors_{args.only}_"))
        try:
            result = CHECKS[args.only](out)
        except Exception as err:
            result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print("RESULT " + json.dumps(result, default=str), flush=True)
        return 0

    import subprocess

    summary = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
               "lightning": L.__version__}
    failed = False
    for name in CHECKS:
        proc = subprocess.run([sys.executable, __file__, "--only", name], capture_output=True, text=True, timeout=600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        result = json.loads(lines[-1][7:]) if lines else {"ok": False, "error": f"rc={proc.returncode}",
                                                           "log": (proc.stdout + proc.stderr)[-3000:]}
        summary[name] = result
        failed |= not result.get("ok", False)
        print(f"{name}: {'PASS' if result.get('ok') else 'FAIL'} {json.dumps(result, default=str)[:3000]}", flush=True)
    if not args.skip_bench:
        import bench_monitors

        bench_monitors.main(["--blocks", "8", "--accelerator", "cuda"])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_monitors_check.json").write_text(json.dumps(summary, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
