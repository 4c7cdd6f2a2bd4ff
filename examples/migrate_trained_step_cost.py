"""Step cost of each migration's training step against a plain pre-norm step, on the study's model and batch.

Copies of one trained model with the same weights: plain pre-norm (`convert(model, "pre")`), the plain blend
at a = 0.5, the stream-scaled blend at a = 0.5 (every term computed; an endpoint step runs the same code at
a = 1), and a pre-norm step plus a teacher forward (a distillation step). A step is forward, backward,
clipping and the AdamW step on one batch, timed as the thread's CPU time. The arms alternate in short blocks in one process, so load from
other processes hits them alike; each block is compared with the plain pre-norm blocks on either side of it
and the median of those paired ratios is reported (as benchmarks/bench_transition.py does).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch.nn import functional as F

from ln_lightning.placement import convert
from ln_lightning.placement.migrate import transition
from migrate_trained_methods import FrozenTeacher, StreamScaledBlend, converted_scales, measure_scales


def _step(model, x, teacher=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    y = torch.roll(x, -1, dims=1)

    def step():
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        if teacher is not None:
            t = F.log_softmax(teacher.logits(x).reshape(-1, logits.size(-1)), -1)
            loss = loss + (t.exp() * (t - F.log_softmax(logits.reshape(-1, logits.size(-1)), -1))).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def measure(trained, x: torch.Tensor, blocks: int, steps: int) -> dict:
    pre = copy.deepcopy(trained)
    convert(pre, "pre")
    plain = copy.deepcopy(trained)
    transition.begin(plain, "pre")
    transition.set_blend(plain, 0.5)
    scaled = copy.deepcopy(trained)
    sites, ratios, _ = measure_scales(scaled, x)
    report = transition.begin(scaled, "pre", branch_scale=1.0)
    sites, scales = converted_scales(scaled, report, sites, ratios)
    StreamScaledBlend(scaled, report, scales, sites)
    transition.set_blend(scaled, 0.5)
    teacher = FrozenTeacher(trained)
    distill = copy.deepcopy(pre)
    steps_of = {"pre": _step(pre, x), "plain blend": _step(plain, x), "stream-scaled blend": _step(scaled, x),
                "pre + teacher forward": _step(distill, x, teacher)}
    for s in steps_of.values():  # warm up
        for _ in range(2):
            s()
    others = [k for k in steps_of if k != "pre"]
    times: dict[str, list[float]] = {k: [] for k in steps_of}
    for _ in range(blocks):
        for arm in ["pre", *others, "pre"]:
            t0 = time.thread_time()  # CPU time of this thread: waiting for a core on a shared machine is not counted
            for _ in range(steps):
                steps_of[arm]()
            times[arm].append((time.thread_time() - t0) / steps)
    p = times["pre"]  # two pre blocks per round, around the others
    ratio = {arm: statistics.median(t / statistics.mean([p[2 * i], p[2 * i + 1]]) for i, t in enumerate(times[arm])) for arm in others}
    return {"ms_per_step": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "ratio_vs_pre": ratio,
            "blocks": blocks, "steps_per_block": steps, "batch": list(x.shape)}
