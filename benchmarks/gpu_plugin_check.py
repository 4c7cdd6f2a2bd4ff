"""GPU check of LNPlacement: the single-GPU path and FSDP on one GPU (neither can run on CPU-only CI).

    python benchmarks/gpu_plugin_check.py [OUT_DIR]          # ~1-3 minutes on one GPU
    python benchmarks/gpu_plugin_check.py --cpu-dry-run      # this script's logic on CPU (no FSDP)

For each case it runs the same scenario as the CPU strategy tests (ln_lightning.testing.plugin.run_scenario):
fit 3 steps -> validate after fit -> fit(ckpt_path) on a fresh model -> validate/test/predict(ckpt_path) on
fresh models, and checks against the pre-norm function written out by hand (float64, on CPU):

* the rewrite happened before configure_optimizers (marker present, every parameter - the added final
  norm included - in the optimizer, the added parameters changed by training);
* the model fit returns, and every evaluation from a checkpoint, compute the trained pre-norm function;
* fit(ckpt_path) restored weights, optimizer steps and the scheduler;
* with fused=True the LayerNorms are ln_lightning's FusedLayerNorm (Triton on CUDA).

Prints one PASS/FAIL line per check and a JSON summary; exit status 1 if any check failed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

import torch  # noqa: E402

TOL = 2e-4  # float32 on GPU against a float64 CPU reference (cuBLAS/TF32-free default precision)


def _check(results: list, name: str, ok: bool, detail=""):
    results.append({"check": name, "ok": bool(ok), "detail": detail})
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def _case(results: list, label: str, strategy_kw, out: str, fused: bool, tol: float, **trainer_kw):
    from ln_lightning.testing import plugin as h

    t0 = time.perf_counter()
    try:
        res = h.run_scenario(strategy_kw, out, fused=fused, **trainer_kw)
    except Exception as err:  # report and continue with the next case
        _check(results, f"{label}: scenario ran", False, f"{type(err).__name__}: {err}")
        traceback.print_exc()
        return
    _check(results, f"{label}: scenario ran", True, f"{time.perf_counter() - t0:.1f}s")
    for tag in ("fit", "resume"):
        with open(os.path.join(out, f"{tag}_rank0.json")) as f:
            rec = json.load(f)
        _check(results, f"{label}/{tag}: rewrite before configure_optimizers", rec["marker_present"]
               and rec["names_in_optimizer"] == rec["all_names"] and bool(rec["added_params"]),
               f"added={rec['added_params']} strategy={rec['strategy']}")
        _check(results, f"{label}/{tag}: added params trained", all(rec["added_changed"].values()), rec["added_changed"])
        if fused:
            fused_types = [m for m in rec["module_types"] if "FusedLayerNorm" in m]
            _check(results, f"{label}/{tag}: fused LayerNorms in place", bool(fused_types), f"{len(fused_types)} modules")
    end = torch.load(os.path.join(out, "fit_rank0.end.pt"))
    start = torch.load(os.path.join(out, "resume_rank0.start.pt"))
    with open(os.path.join(out, "resume_rank0.json")) as f:
        rec = json.load(f)
    _check(results, f"{label}: fit(ckpt_path) restored weights/optimizer/scheduler",
           end.keys() == start.keys() and all(torch.equal(end[k], start[k]) for k in end)
           and rec["global_step"] == 3 and rec["scheduler_last_epoch"] == 3 and set(rec["optimizer_steps"]) == {3.0},
           f"global_step={rec['global_step']}")
    _check(results, f"{label}: trained function after fit", res["after_fit_err"] < tol, f"err={res['after_fit_err']:.2e}")
    for key in ("validate_after_fit", "validate", "test"):
        err = res[key][0]["ref_err"]
        _check(results, f"{label}: {key} runs the trained function", err < tol, f"err={err:.2e}")
    if res["predict_ref_err"] is not None:
        _check(results, f"{label}: predict(ckpt_path)", res["predict_ref_err"] < tol, f"err={res['predict_ref_err']:.2e}")


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out_root = args[0] if args else tempfile.mkdtemp(prefix="gpu_plugin_check_")
    results: list = []
    dry_run = "--cpu-dry-run" in sys.argv  # exercise this script's own logic on CPU (no FSDP)
    if not torch.cuda.is_available() and not dry_run:
        print("no CUDA device: nothing to check (use --cpu-dry-run to test this script on CPU)")
        return 2
    from lightning.pytorch.strategies import FSDPStrategy

    if dry_run:
        print("CPU dry run: single-device cases on CPU, FSDP skipped (Lightning refuses FSDP on CPU)", flush=True)
        cases = [
            ("cpu fused=True", dict(accelerator="cpu", devices=1), True, 1e-5, {}),
            ("cpu fused=False bf16-mixed", dict(accelerator="cpu", devices=1), False, 5e-2, {"precision": "bf16-mixed"}),
        ]
    else:
        print(f"device: {torch.cuda.get_device_name(0)}  torch {torch.__version__}", flush=True)
        cases = [  # label, strategy kwargs, fused, tolerance, extra Trainer kwargs
            ("single-gpu fused=True", dict(accelerator="gpu", devices=1), True, TOL, {}),
            # bf16 autocast against a float64 reference: a loose tolerance
            ("single-gpu fused=False bf16-mixed", dict(accelerator="gpu", devices=1), False, 5e-2,
             {"precision": "bf16-mixed"}),
            ("fsdp 1 gpu fused=True", lambda: dict(accelerator="gpu", devices=1, strategy=FSDPStrategy()), True, TOL, {}),
        ]
    for label, kw, fused, tol, extra in cases:
        out = os.path.join(out_root, label.replace(" ", "_").replace("=", ""))
        _case(results, label, kw, out, fused, tol, **extra)
    failed = [r for r in results if not r["ok"]]
    print(json.dumps({"checks": len(results), "failed": len(failed), "out": out_root}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
