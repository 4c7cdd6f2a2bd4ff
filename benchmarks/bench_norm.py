#!/usr/bin/env python
"""Benchmark the fused LayerNorm and RMSNorm against eager PyTorch / Hugging Face and torch.compile.

For each device (cpu, and cuda when present), shape and dtype it times, side by side and
interleaved in one run (variants alternate, in a fresh random order, inside every repeat, all with
the same loop length). Times are medians over repeats; speedups ("x base", "x comp") are medians of
the per-repeat paired ratios, which cancel the slow drifts of a shared machine (the ratio of the
medians and of the minima are in the JSON too):

* group "norm": ``nn.LayerNorm`` vs ``FusedLayerNorm`` (on CPU also our custom-op path, to show
  why the torch backend calls aten's kernel directly for a plain float32 LayerNorm);
* group "add+norm": eager ``h = x + r; y = ln(h)`` vs ``torch.compile`` of the same vs
  ``fused_add_layer_norm`` (the new residual ``h`` also receives a gradient, as in a block); on
  CPU in bfloat16 also ours on aten's kernels ("[aten]"), to show what the compiled CPU kernels
  (ln_lightning/norm/csrc) add;
* group "add+rms": eager ``h = x + r; y = LlamaRMSNorm(h)`` (Hugging Face's own class, when
  transformers is installed; else its formula written out) vs ``torch.compile`` of the same vs
  ``fused_add_rms_norm(..., cast_order="llama")`` (the same numerics); on CPU also ours on the
  aten composition ("[aten]", the compiled CPU RMSNorm kernels off);

in two modes: forward (``torch.no_grad``) and forward+backward. Effective bandwidth counts the
bytes that must move (reads + writes of the activation-sized tensors, in the input dtype):
norm fwd 2, norm fwd+bwd 5, add+norm fwd 4, add+norm fwd+bwd 8 tensors of rows x hidden.
Peak memory: ``torch.cuda.max_memory_allocated`` above the inputs on GPU; on CPU the bytes
allocated during one step as seen by the profiler (total, not peak).

Examples::

    python benchmarks/bench_norm.py --quick                      # ~1-2 min on 2 CPU cores
    python benchmarks/bench_norm.py                              # CPU default sweep, a few minutes
    python benchmarks/bench_norm.py --rows 4096 16384 --hidden 768 1024 4096 8192 --dtype float32 bfloat16
    python benchmarks/bench_norm.py --device cuda --out bench_norm_cuda.json
    python benchmarks/bench_norm.py --groups add+rms --rows 4096 --hidden 1024 4096   # RMSNorm only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from ln_lightning.norm import FusedLayerNorm, fused_add_layer_norm, fused_add_rms_norm  # noqa: E402
from ln_lightning.norm import functional as _functional  # noqa: E402
from ln_lightning.norm import _cpu_kernels  # noqa: E402

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
BYTES_MOVED = {("norm", "fwd"): 2, ("norm", "fwd+bwd"): 5, ("add+norm", "fwd"): 4, ("add+norm", "fwd+bwd"): 8,
               ("add+rms", "fwd"): 4, ("add+rms", "fwd+bwd"): 8}
BASELINE = {"norm": "nn.LayerNorm", "add+norm": "eager add+LN", "add+rms": "eager add+LlamaRMSNorm"}
COMPILED = {"add+norm": "compiled add+LN", "add+rms": "compiled add+LlamaRMSNorm"}
GROUPS = ("norm", "add+norm", "add+rms")


class _LlamaRMSNormFormula(nn.Module):
    """HF LlamaRMSNorm's forward, verbatim, for machines without transformers."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _llama_rms_norm(hidden: int, device, dtype) -> nn.Module:
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        LlamaRMSNorm = _LlamaRMSNormFormula
    return LlamaRMSNorm(hidden, eps=1e-6).to(device=device, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _without_cpu_kernels(step: Callable[[], None], kernels=_cpu_kernels.KERNELS) -> Callable[[], None]:
    """The step (forward and backward) with the compiled CPU kernels off: aten's inside our op."""

    def run() -> None:
        with kernels.disabled():
            step()

    return run


class Case:
    """Inputs and the step functions of every variant for one (device, dtype, rows, hidden)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, rows: int, hidden: int, compile_ok: bool):
        g = torch.Generator(device="cpu").manual_seed(0)
        mk = lambda: torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)
        self.device, self.dtype, self.rows, self.hidden = device, dtype, rows, hidden
        self.x, self.r, self.gy, self.gh = mk(), mk(), mk(), mk()
        self.x.requires_grad_()
        self.r.requires_grad_()
        self.ln = nn.LayerNorm(hidden, device=device, dtype=dtype)
        with torch.no_grad():
            self.ln.weight.normal_()
            self.ln.bias.normal_()
        self.fused = FusedLayerNorm.from_layernorm(self.ln)
        self.rms = _llama_rms_norm(hidden, device, dtype)
        with torch.no_grad():
            self.rms.weight.normal_()
        self.compiled = self.compiled_rms = None
        self.compile_error: Optional[str] = None
        self.compile_error_rms: Optional[str] = None
        if compile_ok:
            self.compiled = torch.compile(self._eager_add_ln, dynamic=False)
            self.compiled_rms = torch.compile(self._eager_add_rms, dynamic=False)

    # ---- the computations
    def _eager_add_ln(self, x, r):
        h = x + r
        return F.layer_norm(h, (self.hidden,), self.ln.weight, self.ln.bias, self.ln.eps), h

    def _fused_add_ln(self, x, r):
        return fused_add_layer_norm(x, r, self.ln.weight, self.ln.bias, self.ln.eps)

    def _eager_add_rms(self, x, r):
        h = x + r
        return self.rms(h), h

    def _fused_add_rms(self, x, r):
        return fused_add_rms_norm(x, r, self.rms.weight, self.rms.variance_epsilon, cast_order="llama")

    def _custom_op_norm(self, x):
        _functional.PLAIN_LAYER_NORM_VIA_ATEN = False
        try:
            return self.fused(x)
        finally:
            _functional.PLAIN_LAYER_NORM_VIA_ATEN = True

    def steps(self, group: str, mode: str) -> dict[str, Callable[[], None]]:
        if group == "norm":
            fns = {"nn.LayerNorm": self.ln, "FusedLayerNorm": self.fused}
            if self.device.type == "cpu":
                fns["FusedLayerNorm[custom-op]"] = self._custom_op_norm

            def make(fn):
                if mode == "fwd":
                    def step():
                        with torch.no_grad():
                            fn(self.x)
                else:
                    # autograd.grad, not .backward(): see add+norm below
                    def step():
                        torch.autograd.grad([fn(self.x)], [self.x, self.ln.weight, self.ln.bias], [self.gy])
                return step
        elif group == "add+rms":
            fns = {"eager add+LlamaRMSNorm": self._eager_add_rms}
            if self.compiled_rms is not None and self.compile_error_rms is None:
                fns["compiled add+LlamaRMSNorm"] = self.compiled_rms
            fns["fused add+RMSNorm"] = self._fused_add_rms
            if self.device.type == "cpu" and _cpu_kernels.KERNELS.module() is not None:
                fns["fused add+RMSNorm[aten]"] = self._fused_add_rms

            def make(fn):
                if mode == "fwd":
                    def step():
                        with torch.no_grad():
                            fn(self.x, self.r)
                else:
                    def step():  # autograd.grad, as for add+norm below
                        y, h = fn(self.x, self.r)
                        torch.autograd.grad([y, h], [self.x, self.r, self.rms.weight], [self.gy, self.gh])
                return step
            steps = {name: make(fn) for name, fn in fns.items()}
            if "fused add+RMSNorm[aten]" in steps:
                steps["fused add+RMSNorm[aten]"] = _without_cpu_kernels(steps["fused add+RMSNorm[aten]"])
            return steps
        else:
            fns = {"eager add+LN": self._eager_add_ln}
            if self.compiled is not None and self.compile_error is None:
                fns["compiled add+LN"] = self.compiled
            fns["fused add+LN"] = self._fused_add_ln
            if self.device.type == "cpu" and self.dtype in _cpu_kernels.DTYPES and _cpu_kernels.KERNELS.module() is not None:
                fns["fused add+LN[aten]"] = self._fused_add_ln

            def make(fn):
                if mode == "fwd":
                    def step():
                        with torch.no_grad():
                            fn(self.x, self.r)
                else:
                    # autograd.grad, not .backward(): accumulating into the leaves' .grad would
                    # clone the gradient that x and r share, a copy a real block (whose x and r
                    # are not leaves) does not make.
                    def step():
                        y, h = fn(self.x, self.r)
                        torch.autograd.grad([y, h], [self.x, self.r, self.ln.weight, self.ln.bias], [self.gy, self.gh])
                return step
        steps = {name: make(fn) for name, fn in fns.items()}
        if "fused add+LN[aten]" in steps:
            steps["fused add+LN[aten]"] = _without_cpu_kernels(steps["fused add+LN[aten]"])
        return steps

    def warm_compile(self, mode: str, groups=GROUPS) -> None:
        for group, attr, fn in (("add+norm", "compile_error", self.compiled), ("add+rms", "compile_error_rms", self.compiled_rms)):
            if group not in groups or fn is None or getattr(self, attr) is not None:
                continue
            try:
                self.steps(group, mode)[COMPILED[group]]()
                _sync(self.device)
            except Exception as exc:  # noqa: BLE001 - report and carry on without it
                setattr(self, attr, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
                print(f"  torch.compile ({group}) skipped for {self.describe()}: {getattr(self, attr)}", flush=True)

    def describe(self) -> str:
        return f"{self.device.type} {str(self.dtype)[6:]} {self.rows}x{self.hidden}"


def time_interleaved(
    steps: dict[str, Callable[[], None]], device: torch.device, repeats: int, min_sample_s: float
) -> dict[str, list[float]]:
    """Seconds per call of each step, one sample per repeat; the steps alternate within every repeat."""
    inner = {}
    for name, step in steps.items():  # warm up and size the inner loop so a sample is >= min_sample_s
        step()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        once = max(time.perf_counter() - t0, 1e-7)
        inner[name] = max(1, min(1000, math.ceil(min_sample_s / once)))
    # One loop length for every variant: on CPU the first call after another variant pays for
    # the allocator's state (fresh pages of large tensors), so unequal loop lengths would amortise
    # that cost unequally and bias the ratios.
    inner = dict.fromkeys(inner, max(inner.values()))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    shuffle = random.Random(0).shuffle
    for rep in range(repeats):
        order = list(names)
        shuffle(order)  # a fresh order every repeat: no variant always follows the same neighbour
        for name in order:
            step, n = steps[name], inner[name]
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(n):
                    step()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / 1e3 / n)
            else:
                t0 = time.perf_counter()
                for _ in range(n):
                    step()
                samples[name].append((time.perf_counter() - t0) / n)
    return samples


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the profiler's C++ start/stop chatter on file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_memory(step: Callable[[], None], device: torch.device) -> Optional[float]:
    """GPU: peak bytes above what was allocated before the step. CPU: bytes allocated in the step."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        _sync(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    try:
        from torch.profiler import ProfilerActivity, profile

        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        return float(sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0 and e.cpu_parent is None))
    except Exception:  # noqa: BLE001 - memory is informative only
        return None


def run(args) -> list[dict]:
    results = []
    devices = []
    for d in args.device:
        if d == "cuda" and not torch.cuda.is_available():
            print("cuda: not available, skipped")
            continue
        devices.append(torch.device(d))
    for device in devices:
        rows_list = args.rows or ([4096, 8192, 16384] if device.type == "cuda" else [4096])
        hidden_list = args.hidden or ([768, 1024, 4096, 8192] if device.type == "cuda" else [768, 1024, 4096])
        dtype_names = args.dtype or (["float32", "float16", "bfloat16"] if device.type == "cuda" else ["float32", "bfloat16"])
        if args.quick:
            rows_list, hidden_list = rows_list[:1], hidden_list[:2]
        for dtype_name in dtype_names:
            dtype = DTYPES[dtype_name]
            for rows in rows_list:
                for hidden in hidden_list:
                    case = Case(device, dtype, rows, hidden, compile_ok=not args.no_compile)
                    for mode in args.modes:
                        case.warm_compile(mode, args.groups)
                        for group in args.groups:
                            steps = case.steps(group, mode)
                            samples = time_interleaved(steps, device, args.repeats, args.min_sample_ms / 1e3)
                            times = {name: statistics.median(v) for name, v in samples.items()}
                            mins = {name: min(v) for name, v in samples.items()}
                            base = times[BASELINE[group]]
                            moved = BYTES_MOVED[(group, mode)] * rows * hidden * torch.finfo(dtype).bits // 8
                            for name, t in times.items():
                                row = {
                                    "device": device.type, "dtype": str(dtype)[6:], "rows": rows, "hidden": hidden,
                                    "group": group, "mode": mode, "variant": name, "time_ms": t * 1e3,
                                    "min_time_ms": mins[name] * 1e3, "speedup_of_min_vs_baseline": mins[BASELINE[group]] / mins[name],
                                    "GBps": moved / t / 1e9, "speedup_of_medians_vs_baseline": base / t,
                                    # The headline ratio: per repeat, baseline and variant ran
                                    # back to back; the median of those paired ratios cancels
                                    # the slow drifts a shared machine adds to both.
                                    "speedup_vs_baseline": statistics.median(
                                        b / o for b, o in zip(samples[BASELINE[group]], samples[name])
                                    ),
                                }
                                if COMPILED.get(group) in times:
                                    row["speedup_vs_compiled"] = statistics.median(
                                        c / o for c, o in zip(samples[COMPILED[group]], samples[name])
                                    )
                                if not args.no_memory:
                                    mem = peak_memory(steps[name], device)
                                    row["memory_MB"] = None if mem is None else mem / 2**20
                                results.append(row)
                                print(_format_row(row), flush=True)
                            error = {"add+norm": case.compile_error, "add+rms": case.compile_error_rms}.get(group)
                            if error:
                                results.append({"device": device.type, "dtype": str(dtype)[6:], "rows": rows,
                                                "hidden": hidden, "group": group, "mode": mode,
                                                "variant": COMPILED[group], "skipped": error})
                    del case
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return results


HEADER = f"{'device':6} {'dtype':8} {'rows':>6} {'hidden':>6} {'group':9} {'mode':8} {'variant':28} {'ms':>9} {'GB/s':>8} {'x base':>7} {'x comp':>7} {'mem MB':>8}"


def _format_row(row: dict) -> str:
    comp = row.get("speedup_vs_compiled")
    mem = row.get("memory_MB")
    return (
        f"{row['device']:6} {row['dtype']:8} {row['rows']:>6} {row['hidden']:>6} {row['group']:9} {row['mode']:8} "
        f"{row['variant']:28} {row['time_ms']:9.3f} {row['GBps']:8.1f} {row['speedup_vs_baseline']:7.2f} "
        f"{(f'{comp:7.2f}' if comp is not None else '      -')} {(f'{mem:8.1f}' if mem is not None else '       -')}"
    )


def summarize(results: list[dict]) -> dict:
    """Geometric-mean speedups of ours over the baselines, per device and mode."""
    out: dict = {}
    for row in results:
        if "skipped" in row:
            continue
        key = f"{row['device']} {row['mode']}"
        if row["variant"] == "FusedLayerNorm":
            out.setdefault(key, {}).setdefault("FusedLayerNorm vs nn.LayerNorm", []).append(row["speedup_vs_baseline"])
        if row["variant"] == "fused add+LN":
            out.setdefault(key, {}).setdefault("fused add+LN vs eager add+LN", []).append(row["speedup_vs_baseline"])
            if "speedup_vs_compiled" in row:
                out[key].setdefault("fused add+LN vs compiled add+LN", []).append(row["speedup_vs_compiled"])
        if row["variant"] == "fused add+RMSNorm":
            out.setdefault(key, {}).setdefault("fused add+RMS vs eager HF add+RMS", []).append(row["speedup_vs_baseline"])
            if "speedup_vs_compiled" in row:
                out[key].setdefault("fused add+RMS vs compiled add+RMS", []).append(row["speedup_vs_compiled"])
    return {
        key: {name: {"geomean": math.exp(sum(map(math.log, v)) / len(v)), "min": min(v), "max": max(v), "n": len(v)}
              for name, v in d.items()}
        for key, d in out.items()
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    p.add_argument("--rows", nargs="+", type=int, help="default: cpu 4096; cuda 4096 8192 16384")
    p.add_argument("--hidden", nargs="+", type=int, help="default: cpu 768 1024 4096; cuda 768 1024 4096 8192")
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), help="default: cpu float32 bfloat16; cuda + float16")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS, help="default: all")
    p.add_argument("--quick", action="store_true", help="first rows value and first two hidden sizes only")
    p.add_argument("--repeats", type=int, default=None, help="samples per variant (default cpu 15, cuda 25)")
    p.add_argument("--min-sample-ms", type=float, default=None, help="loop a variant to fill a sample of this length (default cpu 20, cuda 2)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the CPU runs")
    p.add_argument("--out", default="bench_norm.json", help="JSON results path")
    args = p.parse_args(argv)
    on_gpu = any(d == "cuda" for d in args.device) and torch.cuda.is_available()
    args.repeats = args.repeats or (25 if on_gpu else 15)
    args.min_sample_ms = args.min_sample_ms if args.min_sample_ms is not None else (2.0 if on_gpu else 20.0)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        from torch import _dynamo

        _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 256)
    except Exception:  # noqa: BLE001
        pass
    meta = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:],
        "bytes_moved_tensors": {f"{g} {m}": n for (g, m), n in BYTES_MOVED.items()},
    }
    print(HEADER)
    results = run(args)
    summary = summarize(results)
    print("\nsummary (speedup = baseline time / our time; geometric mean over shapes and dtypes):")
    for key, d in summary.items():
        for name, s in d.items():
            print(f"  {key:12} {name:34} geomean {s['geomean']:.2f}x  (min {s['min']:.2f}, max {s['max']:.2f}, n={s['n']})")
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results, "summary": summary}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
