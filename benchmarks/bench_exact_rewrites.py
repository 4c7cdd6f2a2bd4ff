"""What `to_rmsnorm` and `fold_norms` buy in speed on a migrated model (issue 34, point 4).

    python benchmarks/bench_exact_rewrites.py [--quick] [--json out.json]

The demo post-norm LM (`ln_lightning.demo.PostNormTransformerLM`) after `convert(model, "pre")`, with torch's
LayerNorms ("eager") and after `swap_layernorms` ("fused": the package's fused norms; `to_rmsnorm(fused=True)`
there), each timed as it is and after `to_rmsnorm`, `fold_norms` and both:

- inference: an eval-mode forward under `torch.no_grad()`, every variant;
- a training step (forward, cross-entropy, backward, AdamW step): the variants one would train, i.e. the
  migrated model and `to_rmsnorm`'s (a folded model is for inference: it has no gains left to train).

All variants live in one process and are timed interleaved: each repeat runs every variant once, in an order
rotated per repeat, so a load spike on a shared machine lands on all of them. A ratio is the median over the
repeats of (variant's time / its migrated model's time in the same repeat), above 1 meaning faster. Each
variant's largest relative output error against its migrated model is recorded too (the rewrites are exact:
that column is float error). One torch thread by default; the machine's load average is printed and recorded.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from typing import Callable

import torch
from torch import nn

from ln_lightning import convert, fold_norms, to_rmsnorm
from ln_lightning.demo.models import PostNormTransformerLM
from ln_lightning.norm import swap_layernorms

REWRITES: dict[str, tuple[bool, bool]] = {  # variant -> (to_rmsnorm, fold_norms)
    "migrated": (False, False),
    "to_rmsnorm": (True, False),
    "fold_norms": (False, True),
    "to_rmsnorm + fold_norms": (True, True),
}
TRAINABLE = ("migrated", "to_rmsnorm")


def build(args, fused: bool, rewrite: str, ids: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    model = PostNormTransformerLM(args.vocab, args.width, args.blocks, args.heads, args.seq).eval()
    with torch.no_grad():  # gains and biases away from (1, 0): a fresh model's would fold without a rounding
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(0.2 * torch.randn_like(m.weight))
                m.bias.add_(0.2 * torch.randn_like(m.bias))
    report = convert(model, "pre", example_input=ids)
    assert len(report.converted) == args.blocks, report.summary()
    if fused:
        swap_layernorms(model)
    rms, fold = REWRITES[rewrite]
    if rms:
        r = to_rmsnorm(model, ids, fused=fused)
        assert not r.refused, str(r)
    if fold:
        r = fold_norms(model, ids)
        assert not r.refused, str(r)
    return model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def inference_step(model: nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    model.eval()

    def step():
        with torch.no_grad():
            model(ids)
    return step


def training_step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> Callable[[], None]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def interleaved(steps: dict[str, Callable[[], None]], repeats: int, calls: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each step, one figure per repeat; every repeat runs every step, rotated order."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            fn = steps[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls)
    return times


def paired_speedup(base: list[float], variant: list[float]) -> float:
    return statistics.median(b / v for b, v in zip(base, variant))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--calls", type=int, default=3, help="calls per timed repeat")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one: least disturbed by other load on a shared machine)")
    ap.add_argument("--quick", action="store_true", help="a small model and few repeats (a smoke run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.blocks, args.width, args.seq, args.batch, args.repeats, args.calls = 2, 64, 32, 2, 3, 2
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    load_start = os.getloadavg()[0]

    models = {(fused, rw): build(args, fused, rw, ids) for fused in (False, True) for rw in REWRITES}
    errors = {}
    with torch.no_grad():
        for (fused, rw), m in models.items():
            errors[(fused, rw)] = relative_error(m(ids), models[(fused, "migrated")](ids))

    key = lambda fused, rw: f"{'fused' if fused else 'eager'} | {rw}"  # noqa: E731
    infer = interleaved({key(*k): inference_step(m, ids) for k, m in models.items()}, args.repeats, args.calls, warmup=2)
    # Training mutates the weights: train copies, so the inference models above stay the ones measured.
    train_models = {k: copy.deepcopy(m) for k, m in models.items() if k[1] in TRAINABLE}
    train = interleaved({key(*k): training_step(m, ids, targets) for k, m in train_models.items()}, args.repeats, args.calls,
                        warmup=2)

    rows = []
    for (fused, rw) in models:
        for mode, times in (("inference", infer), ("train step", train)):
            name = key(fused, rw)
            if name not in times:
                continue
            base = times[key(fused, "migrated")]
            rows.append({"norms": "fused" if fused else "eager", "rewrite": rw, "mode": mode,
                         "median_ms": 1000 * statistics.median(times[name]),
                         "speedup_vs_migrated": paired_speedup(base, times[name]),
                         "max_rel_error_vs_migrated": errors[(fused, rw)]})
    # The fused migrated model against the eager one, for scale (same pairing).
    for mode, times in (("inference", infer), ("train step", train)):
        rows.append({"norms": "fused", "rewrite": "migrated (over eager migrated)", "mode": mode,
                     "median_ms": 1000 * statistics.median(times[key(True, "migrated")]),
                     "speedup_vs_migrated": paired_speedup(times[key(False, "migrated")], times[key(True, "migrated")]),
                     "max_rel_error_vs_migrated": relative_error(models[(True, "migrated")](ids).detach(),
                                                                 models[(False, "migrated")](ids).detach())})
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}; {args.blocks} blocks x {args.width} wide, batch {args.batch} x {args.seq} tokens, "
          f"{args.repeats} interleaved repeats of {args.calls} calls")
    print(f"{'norms':6s} {'rewrite':32s} {'mode':11s} {'median ms':>10s} {'speedup':>8s} {'max rel err':>12s}")
    for r in rows:
        print(f"{r['norms']:6s} {r['rewrite']:32s} {r['mode']:11s} {r['median_ms']:10.2f} {r['speedup_vs_migrated']:7.3f}x "
              f"{r['max_rel_error_vs_migrated']:12.1e}")
    if args.json:
        config = {k: getattr(args, k) for k in ("blocks", "width", "heads", "vocab", "seq", "batch", "repeats", "calls", "threads")}
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "config": config, "load_average": [load_start, os.getloadavg()[0]],
                       "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                       "machine": platform.machine(),
                       "command": "python benchmarks/bench_exact_rewrites.py --json " + args.json}, f, indent=2)


if __name__ == "__main__":
    main()
