"""Step time during the post->pre transition against plain pre-norm, measured side by side.

Three copies of one model with the same weights: (1) in the transition at blend 0.5 (every blend term
computed), (2) plain `convert(model, "pre")`, (3) the transition model after `finish`. A training step is
forward + backward + AdamW step on the same batch. The arms alternate in short blocks in one process, so
load from other processes hits them alike; each arm's block is compared with the plain arm's neighbouring
blocks and the median of those paired ratios is reported (robust on a shared machine).

Run:
    python benchmarks/bench_transition.py            # demo LM (4 x 128) and nn.TransformerEncoder, 20 blocks
    python benchmarks/bench_transition.py --quick    # smaller models, 6 blocks (smoke test)
Expectation: transition / pre a little above 1 (two cheap extra norms per sublayer); finished / pre ~ 1.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

from ln_lightning.demo import PostNormTransformerLM
from ln_lightning.placement import convert, transition


class TorchEncoderLM(nn.Module):
    def __init__(self, vocab=128, d=128, layers=4, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True), layers,
                                         enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.enc(self.emb(idx)))


def arms(model: nn.Module, example) -> dict[str, nn.Module]:
    plain = copy.deepcopy(model)
    convert(plain, "pre", example_input=example)
    blended = copy.deepcopy(model)
    transition.begin(blended, example_input=example)
    transition.set_blend(blended, 0.5)
    finished = copy.deepcopy(model)
    transition.begin(finished, example_input=example)
    transition.finish(finished)
    return {"pre": plain, "transition": blended, "finished": finished}


def make_step(model: nn.Module, x: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    y = torch.roll(x, -1, dims=1)

    def step():
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def measure(name: str, model: nn.Module, batch: int, seq: int, blocks: int, steps: int) -> dict:
    x = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))
    models = arms(model, x[:2])
    steps_of = {k: make_step(m, x) for k, m in models.items()}
    for s in steps_of.values():  # warm up
        for _ in range(2):
            s()
    times: dict[str, list[float]] = {k: [] for k in models}
    order = ["pre", "transition", "pre", "finished"]
    for _ in range(blocks):
        for arm in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                steps_of[arm]()
            times[arm].append((time.perf_counter() - t0) / steps)
    pre = times["pre"]  # two pre blocks per round: block 2i before the transition block, 2i+1 before finished
    ratio = {}
    for arm in ("transition", "finished"):
        paired = []
        for i, t in enumerate(times[arm]):
            neighbours = [pre[2 * i], pre[2 * i + 1]] if arm == "transition" else [pre[2 * i + 1]] + ([pre[2 * i + 2]] if 2 * i + 2 < len(pre) else [])
            paired.append(t / statistics.mean(neighbours))
        ratio[arm] = {"median": statistics.median(paired), "mean": statistics.mean(paired)}
    result = {"model": name, "ms_per_step": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "ratio_vs_pre": ratio}
    print(f"{name}: step ms (median) pre {result['ms_per_step']['pre']:.2f}, transition {result['ms_per_step']['transition']:.2f}, "
          f"finished {result['ms_per_step']['finished']:.2f}; ratio vs pre: transition {ratio['transition']['median']:.3f} "
          f"(mean {ratio['transition']['mean']:.3f}), finished {ratio['finished']['median']:.3f} (mean {ratio['finished']['mean']:.3f})")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one core per arm: less sensitive to the other processes on a shared machine
    torch.manual_seed(0)
    if args.quick:
        d, layers, batch, seq, blocks, steps = 64, 2, 4, 32, 6, 3
    else:
        d, layers, batch, seq, blocks, steps = 128, 4, 8, 64, 20, 5
    load_start = os.getloadavg()[0]
    results = [
        measure("demo LM", PostNormTransformerLM(128, d, layers, 4, seq), batch, seq, blocks, steps),
        measure("nn.TransformerEncoder", TorchEncoderLM(128, d, layers, 4), batch, seq, blocks, steps),
    ]
    if args.json:  # with the machine's load (1-minute average at the start and the end): timings on a shared machine
        with open(args.json, "w") as f:
            json.dump({"rows": results, "load_average": [load_start, os.getloadavg()[0]], "torch_threads": 1}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
