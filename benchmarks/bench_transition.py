"""Step time during the post->pre transition against plain pre-norm, measured side by side.

Copies of one model with the same weights: plain `convert(model, "pre")` (the reference), the plain blend
at 0.5, the stream-scaled blend at 0.5 (LNPlacement's default, `branch_scale="stream"`), the same with the
teacher forward and KL term of `transition_distill` (the default step during a transition), and the
stream-scaled model after `finish` (pre-norm with its branch scales: the step after the transition). For the demo
LM also `convert(model, "peri")` and the default step of a transition to it (a peri step after it), and the same
for "output" (`branch_scale="stream"`: the entry scales of its end). A training
step is forward + backward + AdamW step on the same batch. The arms alternate in short blocks in one process,
each block between two blocks of the plain pre-norm arm, so load from other processes hits them alike; the
median of the paired ratios is reported (robust on a shared machine).

Run:
    python benchmarks/bench_transition.py            # demo LM (4 x 128) and nn.TransformerEncoder, 20 blocks
    python benchmarks/bench_transition.py --quick    # smaller models, 6 blocks (smoke test)
Expectation: a blend a little above 1 (cheap extra terms per sublayer), the teacher's forward about a third of
a step more; finished ~ 1.
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
from ln_lightning.placement import convert
from ln_lightning.placement.migrate import transition


class TorchEncoderLM(nn.Module):
    def __init__(self, vocab=128, d=128, layers=4, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True), layers,
                                         enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.enc(self.emb(idx)))


def arms(model: nn.Module, example) -> dict[str, tuple[nn.Module, nn.Module | None]]:
    """name -> (model, teacher or None): the same weights in every arm."""
    from ln_lightning.placement.migrate.teacher import frozen_copy

    plain = copy.deepcopy(model)
    convert(plain, "pre", example_input=example)
    blended = copy.deepcopy(model)
    transition.begin(blended, example_input=example)
    transition.set_blend(blended, 0.5)
    scaled = copy.deepcopy(model)
    transition.begin(scaled, "pre", branch_scale="stream", example_input=example)
    assert transition.measure_stream_scales(scaled, lambda: scaled(example)) is None
    teacher = frozen_copy(scaled)  # LNPlacement's default: the trained function, at blend 0
    transition.set_blend(scaled, 0.5)
    finished = copy.deepcopy(scaled)
    transition.finish(finished)  # pre-norm with the measured branch scales
    out = {"pre": (plain, None), "plain blend": (blended, None), "stream-scaled blend": (scaled, None),
           "stream-scaled blend + teacher (default)": (scaled, teacher), "finished": (finished, None)}
    # To peri and output (hooked blocks only: torch's layers have no such form): the conversion (output's with its
    # entry scales, the step after its transition) and the default step of a transition to it.
    for placement, end_scale in (("peri", None), ("output", "stream")):
        converted = copy.deepcopy(model)
        if convert(converted, placement, branch_scale=end_scale, example_input=example).converted:
            moving = copy.deepcopy(model)
            transition.begin(moving, placement, branch_scale="stream", example_input=example)
            assert transition.measure_stream_scales(moving, lambda: moving(example)) is None
            moving_teacher = frozen_copy(moving)
            transition.set_blend(moving, 0.5)
            out.update({placement: (converted, None),
                        f"{placement} stream-scaled blend + teacher (default)": (moving, moving_teacher)})
    return out


def make_step(model: nn.Module, x: torch.Tensor, teacher: nn.Module | None = None):
    from ln_lightning.placement.migrate.teacher import kl_to_teacher, trained_output

    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: every arm stays at its blend's weights
    y = torch.roll(x, -1, dims=1)

    def step():
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        if teacher is not None:  # what transition_distill adds: a teacher forward and the KL term
            taught = trained_output(teacher, x)
            loss = loss + kl_to_teacher(logits, taught)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def measure(name: str, model: nn.Module, batch: int, seq: int, blocks: int, steps: int) -> dict:
    x = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))
    models = arms(model, x[:2])
    steps_of = {k: make_step(m, x, teacher) for k, (m, teacher) in models.items()}
    for s in steps_of.values():  # warm up
        for _ in range(2):
            s()
    others = [k for k in models if k != "pre"]
    times: dict[str, list[float]] = {k: [] for k in models}
    where: dict[str, list[int]] = {k: [] for k in others}  # the index of the pre block just before each of its blocks

    def block(arm):
        t0 = time.perf_counter()
        for _ in range(steps):
            steps_of[arm]()
        times[arm].append((time.perf_counter() - t0) / steps)

    for _ in range(blocks):
        for arm in others:
            block("pre")
            where[arm].append(len(times["pre"]) - 1)
            block(arm)
    block("pre")
    pre = times["pre"]
    ratio = {}
    for arm in others:  # each block against the mean of the pre blocks on either side of it
        paired = [t / statistics.mean([pre[i], pre[i + 1]]) for t, i in zip(times[arm], where[arm])]
        ratio[arm] = {"median": statistics.median(paired), "mean": statistics.mean(paired)}
    result = {"model": name, "ms_per_step": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "ratio_vs_pre": ratio}
    print(f"{name}: step ms (median) " + ", ".join(f"{k} {v:.2f}" for k, v in result["ms_per_step"].items()))
    print("  ratio vs pre (median of paired blocks): " + ", ".join(f"{k} {r['median']:.3f}" for k, r in ratio.items()))
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
