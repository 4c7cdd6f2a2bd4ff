"""How long `inspect_model` and `convert` take on deep models (the issue's bar: well under a second for 96 blocks).

    python benchmarks/bench_convert.py [--blocks 96] [--width 256] [--json out.json]

Times the demo post-norm LM (hand-written blocks, read from a recorded forward) and an nn.TransformerEncoder,
each converted to pre-norm with every block's checks (the recorded one and the black-box reference), median
of a few runs. The machine's load average is printed with the figures, and the CPU time beside the wall time:
on a shared machine the wall time moves with the load, the CPU time much less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch import nn

from ln_lightning import convert, inspect_model
from ln_lightning.demo.models import PostNormTransformerLM


def _time(fn, repeats, clock=time.perf_counter):
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    builders = {
        "PostNormTransformerLM (observed blocks)": lambda: PostNormTransformerLM(128, args.width, args.blocks, 4, 64),
        "nn.TransformerEncoder": lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(args.width, 4, 4 * args.width, batch_first=True), args.blocks, enable_nested_tensor=False
        ),
    }
    rows = []
    load_start = os.getloadavg()[0]
    for name, build in builders.items():
        models = [build() for _ in range(args.repeats)]
        t_inspect = _time(lambda: inspect_model(models[0]), args.repeats)
        it = iter(models)
        t_convert = _time(lambda: convert(next(it), "pre"), args.repeats)
        more = [build() for _ in range(args.repeats)]
        it = iter(more)
        cpu_convert = _time(lambda: convert(next(it), "pre"), args.repeats, time.process_time)
        report = convert(build(), "pre")
        assert len(report.converted) == args.blocks, report.summary()
        rows.append({"model": name, "blocks": args.blocks, "width": args.width, "inspect_s": t_inspect, "convert_s": t_convert,
                     "convert_cpu_s": cpu_convert, "convert_ms_per_block": 1000 * t_convert / args.blocks})
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'model':40s} {'blocks':>6s} {'inspect (s)':>12s} {'convert (s)':>12s} {'convert CPU (s)':>16s} {'ms/block':>9s}")
    for r in rows:
        print(f"{r['model']:40s} {r['blocks']:6d} {r['inspect_s']:12.3f} {r['convert_s']:12.3f} {r['convert_cpu_s']:16.3f} "
              f"{r['convert_ms_per_block']:9.2f}")
    if args.json:  # with the machine's load (1-minute average at the start and the end): timings on a shared machine
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "load_average": [load_start, os.getloadavg()[0]], "torch_threads": torch.get_num_threads()},
                      f, indent=2)


if __name__ == "__main__":
    main()
