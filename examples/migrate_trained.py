"""Migrate a *trained* post-norm model to pre-norm without throwing away what it learned (issue 11).

1. Pretrain a post-norm character LM (the demo `CharLM`, 12 layers in full mode) on the embedded corpus,
   without ln_lightning, once per seed, with the usual end of a schedule (cosine decay of the learning
   rate to a floor), and checkpoint it. "Flattened" is measured on the held-out loss: its mean over the
   last 10% of pretraining is within FLAT_TOL (1%) of its mean over the 10% before (the training loss is
   reported with the same measure).
2. Continue each seed's checkpoint (`fit(ckpt_path=...)`: weights, AdamW state, scheduler, step count)
   for the same budget of steps in four arms, with the same continuation seed (same batches, checked):
     unchanged   plain post-norm, no plugin;
     hard        `LNPlacement("pre", resume_unconverted=True)`: pre-norm from the first step;
     trans_S     `LNPlacement("pre", transition_steps=S, resume_unconverted=True)` for two lengths S.
3. Report per arm: the held-out loss of the model at the switch and the training loss of the first step
   after it, the worst excess over the pre-switch loss and where, how many steps it takes to get back to
   the pre-switch loss, the final losses; from `ClipAttributionMonitor` (every step): gradient-norm
   spikes against the pre-switch median, how often clipping fired and which parameter group dominated
   when it did; from `StreamNormMonitor`: the last block's stream rms, along the transitions too. Plots.

The held-out loss is the mean cross-entropy on a fixed set of validation windows, computed every
`eval_every` steps inside the training loop (before that step's update): it has no batch-to-batch noise,
so "the function at the switch" and "back to the pre-switch loss" are read from it.

Run:
    python examples/migrate_trained.py               # full study: 12 layers, 2 seeds, runs two at a time
    python examples/migrate_trained.py --quick       # smoke test: tiny model, a few steps, one seed, in-process
    python examples/migrate_trained.py --report-only # rebuild results.md, results.json and plots from runs/
    python examples/migrate_trained.py --schedule cosine   # the transitions with transition_schedule="cosine"

Full mode: 12 layers x d_model 64, 4 heads, context 32, batch 16, the first 300k characters of the corpus;
AdamW lr 1e-3, 100-step warmup, cosine to 1e-4 at step 3000 (pretraining), then 1200 steps per arm at
1e-4; transitions of 100 and 400 steps; seeds 0 and 1; each run a subprocess with one thread, two at a time.

Status (measured, docs/results/migrate_trained/results.md): 37 min wall on this project's shared 2-core
machine at load average 6.3; 11.5 min from the runs' own CPU time (an upper bound for 2 free cores) and
about 10 min from steps timed at load 3. Pretraining flattened on the held-out loss (+0.47%, +0.23% over
the last 10%; the training loss still fell 3-5%: 5.4 passes over the text, memorisation). The transitions
resume at exactly the trained function (held-out loss difference 0.0) where the hard switch jumps +0.72,
but the cost comes at the end of each transition, as the blend nears 1: worst held-out excess +0.49 for
100 steps and +0.26 for 400, against +0.47 for the hard switch. Every migrated arm was back at the
pre-switch held-out loss within the budget, and after 1200 steps all ended within 0.01 of continuing
unchanged on held-out loss (training loss 0.09-0.11 higher). No gradient-norm spikes in any arm.

Writes into --out (default outputs/migrate_trained): results.md, results.json, loss.png, grad_norm.png,
runs/ (one JSON per run), pretrain_seed*/last.ckpt, tb/ (TensorBoard), *.log (full mode).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from ln_lightning.demo.lightning import CharLM

FLAT_TOL = 0.01  # "flattened": last 10% of pretraining within 1% of the 10% before

FULL = dict(layers=12, d_model=64, heads=4, block_size=32, batch_size=16, max_chars=300_000, lr=1e-3,
            warmup_steps=100, lr_floor=0.1, clip=1.0, schedule="linear", pretrain=3000, budget=1200, lengths=(100, 400), seeds=2,
            eval_every=20, eval_batches=4, stream_every=20, window=50, jobs=2)
QUICK = dict(layers=2, d_model=32, heads=2, block_size=32, batch_size=8, max_chars=40_000, lr=3e-3,
             warmup_steps=5, lr_floor=0.1, clip=1.0, schedule="linear", pretrain=20, budget=12, lengths=(3, 6), seeds=1,
             eval_every=3, eval_batches=2, stream_every=3, window=3, jobs=0)
CONT_SEED = 100  # the continuation of seed s runs with seed CONT_SEED + s (a fresh data order, the same in every arm)


class DecayCharLM(CharLM):
    """The demo CharLM with the usual end of a training schedule: linear warmup, then a cosine decay of the
    learning rate to `lr_floor` x peak at step `decay_steps`, then constant at the floor (where the
    continuations run; `decay_steps=0`: constant after warmup, as CharLM)."""

    def __init__(self, *args, decay_steps: int = 0, lr_floor: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_hyperparameters()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup, decay, floor = self.hparams.warmup_steps, self.hparams.decay_steps, self.hparams.lr_floor

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if decay <= warmup:
                return 1.0
            t = min(1.0, (step - warmup) / (decay - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def arm_names(hp: dict) -> list[str]:
    return ["unchanged", "hard"] + [f"trans_{s}" for s in hp["lengths"]]


def run_name(job: str, seed: int) -> str:
    return f"{job}_seed{seed}"


# ------------------------------------------------------------------------------------------ one run


def train_one(job: str, seed: int, hp: dict, out: Path) -> dict:
    """Pretrain (job "pretrain") or continue one arm; returns everything the report reads."""
    t_wall0, t_cpu0 = time.time(), time.process_time()  # (a worker: time.process_time() counts from the process start)
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import Logger, TensorBoardLogger
    from torch.nn import functional as F

    from ln_lightning import LNPlacement
    from ln_lightning.callbacks import ClipAttributionMonitor, StreamNormMonitor
    from ln_lightning.demo.data import CharCorpus, stdlib_corpus_text
    from ln_lightning.demo.lightning import CharDataModule
    from ln_lightning.placement import transition

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class Memory(Logger):
        """Keeps what the monitors log, in memory (next to TensorBoard)."""

        def __init__(self):
            super().__init__()
            self.rows: dict[str, list[tuple[int, float]]] = {}

        @property
        def name(self):
            return "memory"

        @property
        def version(self):
            return 0

        def log_metrics(self, metrics, step=None):
            for k, v in metrics.items():
                self.rows.setdefault(k, []).append((int(step if step is not None else -1), float(v)))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    class Probe(Callback):
        """Per step: training loss, a checksum of the batch, the transition's blend; every eval_every steps
        (and at the end) the loss on fixed held-out windows, computed before that step's update."""

        def __init__(self, eval_x, eval_y):
            self.eval_x, self.eval_y = eval_x, eval_y
            self.loss, self.batch_sum, self.blend, self.evals, self.step_cpu = [], [], [], [], []
            self.start = None
            self._t = 0.0

        def _eval(self, pl_module, step):
            was = pl_module.training
            pl_module.eval()
            with torch.no_grad():
                tot = 0.0
                for x, y in zip(self.eval_x, self.eval_y):
                    logits = pl_module(x)
                    tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
            pl_module.train(was)
            self.evals.append((step, tot / sum(y.numel() for y in self.eval_y)))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = trainer.global_step
            if self.start is None:
                self.start = step
            self.batch_sum.append(int(batch[0].sum()))
            self.blend.append(transition.get_blend(pl_module))  # the plugin (first callback) has set this step's
            if (step - self.start) % hp["eval_every"] == 0:
                self._eval(pl_module, step)
            self._t = time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.loss.append(float(outputs["loss"]))
            self.step_cpu.append(time.process_time() - self._t)  # forward, backward, monitors, optimizer step

        def on_train_end(self, trainer, pl_module):
            self._eval(pl_module, trainer.global_step)

    # Fixed held-out windows: evenly spaced over the validation tail the DataModule holds out (5%).
    text = stdlib_corpus_text(hp["max_chars"])
    val = CharCorpus(text[int(len(text) * 0.95):], hp["block_size"])
    n_eval = hp["eval_batches"] * hp["batch_size"]
    idx = [round(i * (len(val) - 1) / max(1, n_eval - 1)) for i in range(n_eval)]
    xs, ys = zip(*(val[i] for i in idx))
    bs = hp["batch_size"]
    eval_x = [torch.stack(xs[i:i + bs]) for i in range(0, n_eval, bs)]
    eval_y = [torch.stack(ys[i:i + bs]) for i in range(0, n_eval, bs)]

    model_hp = dict(n_layers=hp["layers"], d_model=hp["d_model"], n_heads=hp["heads"], block_size=hp["block_size"],
                    lr=hp["lr"], warmup_steps=hp["warmup_steps"],
                    decay_steps=hp["pretrain"] if hp["lr_floor"] < 1 else 0, lr_floor=hp["lr_floor"])
    data = dict(block_size=hp["block_size"], batch_size=hp["batch_size"], max_chars=hp["max_chars"])
    name = run_name(job, seed)
    ckpt_dir = out / f"pretrain_seed{seed}"
    shutil.rmtree(out / "tb" / name, ignore_errors=True)  # a rerun must not mix in old events
    memory = Memory()
    probe = Probe(eval_x, eval_y)
    # Probe before the monitors: its eval forward runs before StreamNormMonitor opens a logging step.
    callbacks = [probe, ClipAttributionMonitor(every_n_steps=1, log_depth_profile=False),
                 StreamNormMonitor(every_n_steps=hp["stream_every"], log_depth_profile=False)]
    plugin, ckpt_path = None, None
    if job == "pretrain":
        L.seed_everything(seed, verbose=False)
        max_steps = hp["pretrain"]
        callbacks.append(ModelCheckpoint(dirpath=str(ckpt_dir), filename="last", save_top_k=1, every_n_train_steps=max_steps))
    else:
        L.seed_everything(CONT_SEED + seed, verbose=False)
        max_steps = hp["pretrain"] + hp["budget"]
        ckpt_path = str(ckpt_dir / "last.ckpt")
        if job == "hard":
            plugin = LNPlacement("pre", resume_unconverted=True, log_report=False)
        elif job.startswith("trans_"):
            plugin = LNPlacement("pre", transition_steps=int(job.split("_")[1]), transition_schedule=hp["schedule"],
                                 resume_unconverted=True, log_report=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, gradient_clip_val=hp["clip"], limit_val_batches=0,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        logger=[TensorBoardLogger(str(out / "tb"), name=name, version=""), memory], log_every_n_steps=10,
        plugins=[plugin] if plugin is not None else None, callbacks=callbacks, default_root_dir=str(out / name),
    )
    t_fit_wall, t_fit_cpu = time.time(), time.process_time()
    trainer.fit(DecayCharLM(**model_hp), datamodule=CharDataModule(**data), ckpt_path=ckpt_path)
    fit_wall, fit_cpu = time.time() - t_fit_wall, time.process_time() - t_fit_cpu
    for lg in trainer.loggers:
        lg.finalize("success")

    start = probe.start
    n = len(probe.loss)

    def per_step(tag: str) -> list[float | None]:
        got = dict(memory.rows.get(tag, []))
        return [got.get(start + i) for i in range(n)]

    groups = sorted({k.split("/", 2)[2] for k in memory.rows if k.startswith("clip/share/")})
    shares = {g: per_step(f"clip/share/{g}") for g in groups}
    dominant = [None] * n
    for g in groups:
        for i, v in enumerate(per_step(f"clip/dominant/{g}")):
            if v:
                dominant[i] = g
    stream = {k.split("/", 2)[2]: memory.rows[k] for k in memory.rows if k.startswith("stream/rms/")}
    return {
        "job": job, "seed": seed, "start_step": start, "steps": n,
        "loss": probe.loss, "batch_sum": probe.batch_sum, "step_cpu": probe.step_cpu, "blend": probe.blend, "evals": probe.evals,
        "grad_norm": per_step("clip/total_norm"), "clipped": per_step("clip/clipped"), "dominant": dominant,
        "share": shares, "stream_rms": stream,
        "fit_wall_s": fit_wall, "fit_cpu_s": fit_cpu, "wall_s": time.time() - t_wall0,
        # the whole process's CPU time (interpreter start and imports included) when it runs alone in a worker
        "cpu_s": time.process_time() if hp["jobs"] > 0 else time.process_time() - t_cpu0,
        "threads": torch.get_num_threads(),
    }


# ------------------------------------------------------------------------------------------ analysis


def mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.mean(xs) if xs else float("nan")


def median(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else float("nan")


def smooth(xs: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def flatness(loss: list[float]) -> dict:
    """Mean of the last 10% of steps against the 10% before: relative decrease, and whether it is < FLAT_TOL."""
    k = max(1, len(loss) // 10)
    last, prev = mean(loss[-k:]), mean(loss[-2 * k:-k])
    rel = (prev - last) / prev
    return {"last10": last, "prev10": prev, "rel_decrease": rel, "flat": abs(rel) < FLAT_TOL}


def analyse_pretrain(r: dict) -> dict:
    k = max(1, r["steps"] // 10)
    return {
        "seed": r["seed"], "steps": r["steps"], "train": flatness(r["loss"]),
        **flatness([v for _, v in r["evals"]]),  # the criterion: on the held-out loss
        "eval_end": r["evals"][-1][1], "train_last10": mean(r["loss"][-k:]), "grad_median_last10": median(r["grad_norm"][-k:]),
        "ms_step": 1000 * median(r["step_cpu"]),
        "clipped_last10": mean(r["clipped"][-k:]), "fit_wall_s": r["fit_wall_s"], "fit_cpu_s": r["fit_cpu_s"],
        "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
    }


def recovery(points: list[tuple[int, float]], level: float, band: float) -> dict:
    """`points`: (steps after the switch, loss), the switch first. The worst point after the switch, the first point
    at or after it back at or below `level`, and the first after which every point stays within `level + band`."""
    after = [(s, v) for s, v in points if s > 0]
    i_peak = max(range(len(after)), key=lambda i: after[i][1])
    back = next((s for s, v in after[i_peak:] if v <= level), None)
    for_good = None
    for j in range(i_peak, len(after)):
        if all(v <= level + band for _, v in after[j:]):
            for_good = after[j][0]
            break
    return {"peak_step": after[i_peak][0], "peak_excess": after[i_peak][1] - level, "back": back, "for_good": for_good,
            "min": min(v for _, v in after)}


def dominant_counts(dominant: list[str | None]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for d in dominant:
        if d is not None:
            counts[d] = counts.get(d, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])


def analyse_arm(r: dict, pre: dict, hp: dict, band: float) -> dict:
    """`pre` is the seed's pretraining summary: the pre-switch loss is its held-out loss at the end (the last 10%
    mean for the training loss); `band` is how far above it continuing unchanged went anyway (that seed)."""
    evals = [(s - r["start_step"], v) for s, v in r["evals"]]
    held = recovery(evals, pre["eval_end"], band)
    w = hp["window"]
    train = recovery(list(enumerate(smooth(r["loss"], w))), pre["train_last10"], 0.0)
    k = max(1, r["steps"] // 10)
    g = r["grad_norm"]
    gmed = pre["grad_median_last10"]
    gi = [x for x in g if x is not None]
    share_first = {gname: mean(v[:k]) for gname, v in r["share"].items()}
    rms = r["stream_rms"]
    last_block = max(rms, key=lambda b: int(b.rsplit(".", 1)[-1]) if b.rsplit(".", 1)[-1].isdigit() else -1) if rms else None
    during = [c for c, b in zip(r["step_cpu"], r["blend"]) if b is not None]
    after = [c for c, b in zip(r["step_cpu"], r["blend"]) if b is None]
    # Along a transition: the last block's stream rms and the held-out loss where the blend passes 0.5 and 0.9, and
    # at its end (the first logged step of plain pre-norm).
    along = {}
    if r["job"].startswith("trans_") and last_block:
        logged = [(st - r["start_step"], v) for st, v in rms[last_block]]
        marks = {"0.5": lambda j, b: b is not None and b >= 0.5, "0.9": lambda j, b: b is not None and b >= 0.9,
                 "end": lambda j, b: b is None}
        for label, hit in marks.items():
            at, v = next(((j, x) for j, x in logged if 0 <= j < len(r["blend"]) and hit(j, r["blend"][j])), (None, None))
            if at is not None:
                ev = next((e for st, e in evals if st >= at), None)
                along[label] = {"step": at, "blend": r["blend"][at], "rms": v, "eval": ev}
    return {
        "along_transition": along,
        "last_block_rms_max": max(v for _, v in rms[last_block]) if last_block else None,
        "seed": r["seed"],
        "first_loss": r["loss"][0],
        "eval_at_switch": evals[0][1],
        "eval_peak_excess": held["peak_excess"], "eval_peak_step": held["peak_step"], "eval_min": held["min"],
        "steps_to_recover": held["back"], "steps_to_recover_for_good": held["for_good"], "band": band,
        "train_peak_excess": train["peak_excess"], "steps_to_recover_train": train["back"],
        "final_loss": mean(r["loss"][-k:]),
        "final_eval": evals[-1][1],
        "max_grad_over_pre_median": max(gi) / gmed if gi else float("nan"),
        "max_grad_first10_over_pre_median": max((x for x in g[:k] if x is not None), default=float("nan")) / gmed,
        "min_grad_over_pre_median": min(gi) / gmed if gi else float("nan"),
        "clipped_first10": mean(r["clipped"][:k]),
        "clipped_all": mean(r["clipped"]),
        "dominant_first10": dominant_counts(r["dominant"][:k])[:2],
        "dominant_last10": dominant_counts(r["dominant"][-k:])[:2],
        "dominant_when_clipped": dominant_counts(r["dominant"])[:3],
        "top_share_first10": sorted(share_first.items(), key=lambda kv: -kv[1])[:3],
        "last_block": last_block,
        "last_block_rms_first": rms[last_block][0][1] if last_block else None,
        "last_block_rms_end": rms[last_block][-1][1] if last_block else None,
        "ms_step_transition": 1000 * median(during) if during else None,
        "ms_step_plain": 1000 * median(after) if after else None,
        "fit_wall_s": r["fit_wall_s"], "fit_cpu_s": r["fit_cpu_s"], "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
    }


def step_times(raw: dict, hp: dict) -> dict[str, float]:
    """Median CPU time of one training step (forward, backward, monitors, optimizer), by kind of step."""
    seeds = range(hp["seeds"])
    kinds = {"post-norm (pretraining, unchanged)": [c for j in ("pretrain", "unchanged") for s in seeds for c in raw[(j, s)]["step_cpu"]],
             "pre-norm (hard; transitions after their end)": [c for j in arm_names(hp)[1:] for s in seeds
                                                              for c, b in zip(raw[(j, s)]["step_cpu"], raw[(j, s)]["blend"]) if b is None],
             "during a transition": [c for j in arm_names(hp)[2:] for s in seeds
                                     for c, b in zip(raw[(j, s)]["step_cpu"], raw[(j, s)]["blend"]) if b is not None]}
    return {k: 1000 * median(v) for k, v in kinds.items() if v}


def simulate(durations: dict[tuple[str, int], float], order: list[tuple[str, int]], lanes: int) -> float:
    """The study's wall time if each run took `durations` (the same greedy two-lane schedule, dependencies kept)."""
    done_at: dict[tuple[str, int], float] = {}
    free = [0.0] * max(1, lanes)
    pending = list(order)
    while pending:
        lane = min(range(len(free)), key=free.__getitem__)
        t = free[lane]
        ready = [j for j in pending if j[0] == "pretrain" or ("pretrain", j[1]) in done_at]
        # a run whose pretraining has not finished waits for it
        j = min(ready, key=lambda j: 0 if j[0] == "pretrain" else done_at[("pretrain", j[1])])
        begin = t if j[0] == "pretrain" else max(t, done_at[("pretrain", j[1])])
        done_at[j] = free[lane] = begin + durations[j]
        pending.remove(j)
    return max(done_at.values())


# ------------------------------------------------------------------------------------------ report


def fmt_list(xs, f="{}"):
    return "[" + ", ".join("—" if x is None else f.format(x) for x in xs) + "]"


def report(raw: dict, hp: dict, out: Path, timing: dict, quick: bool) -> str:
    arms = arm_names(hp)
    trans = [a for a in arms if a.startswith("trans_")]
    seeds = list(range(hp["seeds"]))
    pre = {s: analyse_pretrain(raw[("pretrain", s)]) for s in seeds}
    # How far above the pre-switch held-out loss continuing unchanged goes anyway: the band "recovered" allows.
    band = {}
    for s in seeds:
        u = raw[("unchanged", s)]
        band[s] = max(0.0, max(v for st, v in u["evals"] if st > u["start_step"]) - pre[s]["eval_end"])
    res = {a: [analyse_arm(raw[(a, s)], pre[s], hp, band[s]) for s in seeds] for a in arms}
    same_batches = all(raw[(a, s)]["batch_sum"] == raw[("unchanged", s)]["batch_sum"] for a in arms for s in seeds)
    exact_start = {a: max(abs(r["eval_at_switch"] - u["eval_at_switch"]) for r, u in zip(res[a], res["unchanged"])) for a in arms}
    first_diff = {a: max(abs(r["first_loss"] - u["first_loss"]) / u["first_loss"] for r, u in zip(res[a], res["unchanged"])) for a in arms}
    # the switch resumes the checkpoint: the unchanged arm's held-out loss at the switch is pretraining's last one
    resume_exact = max(abs(res["unchanged"][i]["eval_at_switch"] - pre[s]["eval_end"]) for i, s in enumerate(seeds))
    from ln_lightning.demo.data import stdlib_corpus_text

    n_text = len(stdlib_corpus_text(hp["max_chars"]))
    n_windows = (int(n_text * 0.95) - hp["block_size"] - 1) // hp["block_size"] + 1
    epochs = hp["pretrain"] * hp["batch_size"] / n_windows

    def per_seed(rs, key, f="{:.4f}"):
        return fmt_list([r[key] for r in rs], f)

    summary = {a: {k: mean([r[k] for r in res[a]]) for k in (
        "eval_at_switch", "first_loss", "eval_peak_excess", "eval_min", "final_loss", "final_eval", "train_peak_excess",
        "max_grad_first10_over_pre_median", "max_grad_over_pre_median", "min_grad_over_pre_median", "clipped_first10",
        "clipped_all")} for a in arms}
    pre_eval = mean([pre[s]["eval_end"] for s in seeds])

    L = [f"# Continuing a trained post-norm model as pre-norm ({hp['layers']} layers, {hp['pretrain']} pretraining steps, "
         f"then {hp['budget']} more per arm; seeds {seeds})", ""]
    if quick:
        L += ["(--quick: a smoke test of the pipeline; its figures say nothing about the method.)", ""]
    L += [f"CharLM: {hp['layers']} layers, d_model {hp['d_model']}, {hp['heads']} heads, context {hp['block_size']}, batch "
          f"{hp['batch_size']}, the first {n_text:,} characters of the embedded standard-library corpus (95% train: "
          f"{n_windows:,} windows, so pretraining sees each about {epochs:.1f} times). AdamW lr "
          f"{hp['lr']:g}: {hp['warmup_steps']}-step linear warmup, " + (
              f"cosine decay to {hp['lr_floor']:g} x peak at the end of pretraining, then constant there: the continuations "
              f"run at lr {hp['lr'] * hp['lr_floor']:g}" if hp["lr_floor"] < 1 else "then constant") +
          f" (a continuation resumes weights, AdamW state, scheduler and step count from the checkpoint), gradient_clip_val "
          f"{hp['clip']}. Pretraining: seed s; continuation: seed {CONT_SEED}+s in every arm. Held-out loss: "
          f"{hp['eval_batches'] * hp['batch_size']} fixed validation windows, every {hp['eval_every']} steps, before that "
          f"step's update. Monitors: `ClipAttributionMonitor(every_n_steps=1)`, `StreamNormMonitor(every_n_steps="
          f"{hp['stream_every']})`. Arms: `unchanged` (no plugin), `hard` = `LNPlacement(\"pre\", resume_unconverted=True)`, "
          f"`trans_S` = the same with `transition_steps=S` ({hp.get('schedule', 'linear')} schedule); the final norm is added (the default).", "",
          "## Pretraining (post-norm, no plugin)", "",
          f"Flattened = the mean held-out loss over the last 10% of pretraining is within {FLAT_TOL:.0%} of its mean over the "
          "10% before. The training loss is shown with the same measure.", "",
          "| seed | steps | held-out loss, previous 10% → last 10% | relative decrease | flattened | training loss, previous 10% → last 10% | relative decrease | held-out loss at the switch | grad-norm median, last 10% | clipped, last 10% |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for s in seeds:
        p = pre[s]
        L.append(f"| {s} | {p['steps']} | {p['prev10']:.4f} → {p['last10']:.4f} | {p['rel_decrease']:.2%} | "
                 f"{'**yes**' if p['flat'] else '**no**'} | {p['train']['prev10']:.4f} → {p['train']['last10']:.4f} | "
                 f"{p['train']['rel_decrease']:.2%} | {p['eval_end']:.4f} | {p['grad_median_last10']:.3g} | {p['clipped_last10']:.0%} |")
    L += ["", "## Continuation: the same budget per arm", "",
          "Mean over seeds, each seed in brackets. Pre-switch = the seed's held-out loss at the end of pretraining (for the "
          f"training loss: its mean over the last 10% of pretraining; training curves are {hp['window']}-step means). "
          "Worst excess: the highest point after the switch, above pre-switch, and its step. Back: the first step at or after "
          "the worst point where the loss is at or below pre-switch again. For good: the first step from which it stays within "
          "the band continuing unchanged spans anyway (the unchanged arm's own worst excess: "
          + fmt_list([band[s] for s in seeds], "{:+.4f}") + f"). Resolution {hp['eval_every']} steps (held-out); — = not "
          "within the budget.", "",
          "### Held-out loss", "",
          "| arm | at the switch | worst excess (step) | back at pre-switch | within the unchanged band for good | lowest after the switch | final |",
          "|---|---|---|---|---|---|---|"]
    for a in arms:
        rs, m = res[a], summary[a]
        L.append(f"| {a} | {m['eval_at_switch']:.4f} {per_seed(rs, 'eval_at_switch')} | {m['eval_peak_excess']:+.4f} "
                 f"{per_seed(rs, 'eval_peak_excess', '{:+.4f}')} ({per_seed(rs, 'eval_peak_step', '{}')}) | "
                 f"{'n/a (sets the band)' if a == 'unchanged' else per_seed(rs, 'steps_to_recover', '{}')} | "
                 f"{'n/a' if a == 'unchanged' else per_seed(rs, 'steps_to_recover_for_good', '{}')} | "
                 f"{m['eval_min']:.4f} {per_seed(rs, 'eval_min')} | {m['final_eval']:.4f} {per_seed(rs, 'final_eval')} |")
    L += ["", "### Training loss and gradients", "",
          "Gradient norms: `clip/total_norm` (before clipping) over the seed's median in the last 10% of pretraining; "
          "\"first 10%\": the first tenth of the budget.", "",
          "| arm | first step after the switch | worst excess | back at pre-switch | final (last 10%) | max grad norm / pre-switch median (first 10%; all) | min | clipped steps (first 10%; all) |",
          "|---|---|---|---|---|---|---|---|"]
    for a in arms:
        rs, m = res[a], summary[a]
        L.append(f"| {a} | {m['first_loss']:.4f} {per_seed(rs, 'first_loss')} | {m['train_peak_excess']:+.4f} | "
                 f"{per_seed(rs, 'steps_to_recover_train', '{}')} | {m['final_loss']:.4f} {per_seed(rs, 'final_loss')} | "
                 f"{m['max_grad_first10_over_pre_median']:.2f}; {m['max_grad_over_pre_median']:.2f} | {m['min_grad_over_pre_median']:.2f} | "
                 f"{m['clipped_first10']:.0%}; {m['clipped_all']:.0%} |")

    def merged(key):
        counts: dict[str, int] = {}
        for a_r in key:
            for g, c in a_r:
                counts[g] = counts.get(g, 0) + c
        return ", ".join(f"{g} ({c})" for g, c in sorted(counts.items(), key=lambda kv: -kv[1])[:2]) or "no clipping"

    L += ["", "### Where clipping acts (`ClipAttributionMonitor`) and the stream (`StreamNormMonitor`)", "",
          "Dominant group: the parameter group with the largest share of the squared gradient norm on the steps clipping "
          "fired (`clip/dominant/*`), with the number of such steps, both seeds together; mean shares (`clip/share/*`) over "
          "the first 10% of the budget; the last block's residual-stream rms at the first and the last logged step.", "",
          "| arm | dominant when clipped, first 10% | last 10% | top mean shares, first 10% | last block's stream rms, first → last |",
          "|---|---|---|---|---|"]
    for a in arms:
        rs = res[a]
        shares: dict[str, list[float]] = {}
        for r in rs:
            for g, v in r["top_share_first10"]:
                shares.setdefault(g, []).append(v)
        top = ", ".join(f"{g} {statistics.mean(v):.2f}" for g, v in sorted(shares.items(), key=lambda kv: -statistics.mean(kv[1]))[:3])
        rms = "; ".join(f"{r['last_block_rms_first']:.2f} → {r['last_block_rms_end']:.2f}" for r in rs if r["last_block"])
        L.append(f"| {a} | {merged([r['dominant_first10'] for r in rs])} | {merged([r['dominant_last10'] for r in rs])} | {top} | {rms} |")

    # The conclusion, from the figures above.
    u = summary["unchanged"]
    spread = max(statistics.pstdev([r["final_eval"] for r in res[a]]) if len(res[a]) > 1 else 0.0 for a in arms)
    tol = max(0.01, 2 * spread)
    better = [a for a in arms if a != "unchanged" and summary[a]["final_eval"] < u["final_eval"] - tol]
    worse = [a for a in arms if a != "unchanged" and summary[a]["final_eval"] > u["final_eval"] + tol]
    even = [a for a in arms if a != "unchanged" and a not in better and a not in worse]
    peaks_at_end = all(abs(r["eval_peak_step"] - int(a.split("_")[1])) <= 2 * hp["eval_every"] for a in trans for r in res[a])
    L += ["", "## As measured", "",
          f"- Same batches in every arm of a seed (checksums of every batch): {'yes' if same_batches else '**no**'}. Resuming "
          f"the checkpoint reproduces pretraining's last held-out loss to {resume_exact:.1e}.",
          "- Pretraining flattened (held-out loss, last 10% vs the 10% before): "
          + ", ".join(f"seed {s} {pre[s]['rel_decrease']:+.2%} ({'yes' if pre[s]['flat'] else 'no'})" for s in seeds)
          + "; the training loss was still falling (" + ", ".join(f"{pre[s]['train']['rel_decrease']:+.2%}" for s in seeds)
          + f"): at {epochs:.1f} passes over the training text the model keeps memorising it (training "
          f"{mean([pre[s]['train_last10'] for s in seeds]):.3f} vs held-out {pre_eval:.3f}).",
          f"- **At the switch** the transitions compute the trained function: their held-out loss equals the unchanged model's "
          f"(largest difference {max(exact_start[a] for a in trans):.1e}; first training loss {max(first_diff[a] for a in trans):.1e} "
          f"relative). The hard switch's held-out loss jumps {u['eval_at_switch']:.4f} → {summary['hard']['eval_at_switch']:.4f} "
          f"({summary['hard']['eval_at_switch'] - u['eval_at_switch']:+.4f}); its first training loss "
          f"{summary['hard']['first_loss']:.4f} vs {u['first_loss']:.4f}.",
          "- **Worst held-out excess** over pre-switch: " + ", ".join(
              f"{a} {summary[a]['eval_peak_excess']:+.4f} (step {fmt_list([r['eval_peak_step'] for r in res[a]])})" for a in arms)
          + "." + (" Each transition's worst point is at its end (within two evaluations of step S): the loss is held while "
                   "the blend is low and rises as it approaches 1." if peaks_at_end and trans else ""),
          "- **Lowest held-out loss** after the switch, against pre-switch: " + ", ".join(
              f"{a} {summary[a]['eval_min'] - pre_eval:+.4f}" for a in arms) + ".",
          "- **Back at the pre-switch held-out loss** (first time after the worst point; then for good within the unchanged "
          "band): " + ", ".join(f"{a} {fmt_list([r['steps_to_recover'] for r in res[a]])}, "
                                 f"{fmt_list([r['steps_to_recover_for_good'] for r in res[a]])}" for a in arms if a != "unchanged") + ".",
          f"- **Final held-out loss** (tolerance {tol:.3f}: the larger of 0.01 and twice the largest seed-to-seed std): " +
          ", ".join(f"{a} {summary[a]['final_eval']:.4f} ({summary[a]['final_eval'] - u['final_eval']:+.4f})" for a in arms)
          + f": against continuing unchanged, better {better or 'none'}, within the tolerance {even or 'none'}, worse "
          f"{worse or 'none'}. Final training loss: " + ", ".join(
              f"{a} {summary[a]['final_loss']:.4f} ({summary[a]['final_loss'] - u['final_loss']:+.4f})" for a in arms) + ".",
          "- **Gradient norms**: largest / pre-switch median " + ", ".join(
              f"{a} {summary[a]['max_grad_over_pre_median']:.2f}" for a in arms) + "; smallest " + ", ".join(
              f"{a} {summary[a]['min_grad_over_pre_median']:.2f}" for a in arms) + ". Clipping fired on " + ", ".join(
              f"{a} {summary[a]['clipped_all']:.0%}" for a in arms) + " of the continuation's steps.",
          "- **Clipping attribution** (dominant group on clipped steps, first → last 10% of the budget): " + "; ".join(
              f"{a} {merged([r['dominant_first10'] for r in res[a]]).split(' (')[0]} → {merged([r['dominant_last10'] for r in res[a]]).split(' (')[0]}"
              for a in arms) + "."]
    if trans and all(res[a][0]["along_transition"] for a in trans):
        L.append("- **The stream along a transition** (`StreamNormMonitor`, last block's rms, and the held-out loss, at the "
                 "first logged step where the blend passes 0.5, then 0.9, and after the end; seed 0; the pre-switch held-out loss is "
                 f"{pre[0]['eval_end']:.3f}): " + "; ".join(
                     f"{a}: " + ", ".join((f"step {d['step']} (a={d['blend']:.2f})" if d["blend"] is not None else f"step {d['step']} (done)")
                                          + f" rms {d['rms']:.2f}, loss {d['eval']:.3f}"
                                          for d in res[a][0]["along_transition"].values() if d["eval"] is not None)
                     for a in trans) + f". Unchanged: {res['unchanged'][0]['last_block_rms_first']:.2f} → "
                 f"{res['unchanged'][0]['last_block_rms_end']:.2f}; hard: {res['hard'][0]['last_block_rms_first']:.2f} at the "
                 f"switch → {res['hard'][0]['last_block_rms_end']:.2f}.")
    L += ["", "Plots: `loss.png` (training loss, smoothed, and held-out loss around the switch), `grad_norm.png` "
          "(`clip/total_norm`). TensorBoard: `tb/`."]
    if timing:
        ms = timing["ms_per_step"]
        L += ["", "## Time", "", "| phase | runs | wall (s) | CPU of its runs (s) | load average during it (1-min, mean; max) |", "|---|---|---|---|---|"]
        for ph in timing["phases"]:
            L.append(f"| {ph['name']} | {ph['runs']} | {ph['wall_s']:.0f} | {ph['cpu_s']:.0f} | {ph['load_mean']:.1f}; {ph['load_max']:.1f} |")
        L += ["", f"Whole study: {timing['wall_s']:.0f} s wall ({timing['wall_s'] / 60:.1f} min) with {timing['jobs']} runs at a time, one thread "
              f"each, on {timing['cpus']} CPUs shared with other jobs (load average, 1-min, mean {timing['load_mean']:.1f}, max {timing['load_max']:.1f}). "
              f"The same schedule with every run taking its own CPU time (interpreter start included): "
              f"**{timing['free_estimate_s']:.0f} s ({timing['free_estimate_s'] / 60:.1f} min)** on 2 free cores; an upper bound, since "
              "CPU time itself grows when other processes share the cores' caches. Median CPU time of a training step: "
              + ", ".join(f"{k} {v:.0f} ms" for k, v in ms.items()) + "."]
    text = "\n".join(L) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(rounded({
        "hparams": hp, "flat_tol": FLAT_TOL, "pretrain": pre, "runs": res, "summary": summary, "same_batches": same_batches,
        "band": band, "tolerance": tol, "timing": timing,
        "curves": {run_name(j, s): {"start_step": r["start_step"], "loss": r["loss"], "evals": r["evals"], "grad_norm": r["grad_norm"],
                                    "blend": r["blend"]} for (j, s), r in raw.items()},
    }), indent=None, separators=(",", ":")))
    # The quick test reads runs[arm][0]["first_loss"]; the per-arm lists are that shape.
    plot(raw, hp, pre, out)
    return text


def rounded(x):
    if isinstance(x, float):
        return round(x, 5) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    return x


def plot(raw: dict, hp: dict, pre: dict, out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): no plots")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = arm_names(hp)
    colors = {"unchanged": "C7", "hard": "C3"}
    for i, a in enumerate(a for a in arms if a.startswith("trans_")):
        colors[a] = ("C0", "C2", "C4")[i % 3]
    w = hp["window"]
    seeds = list(range(hp["seeds"]))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    for s in seeds:
        ls = "-" if s == 0 else "--"
        p = raw[("pretrain", s)]
        ax.plot(range(1, p["steps"] + 1), smooth(p["loss"], w), color="k", lw=0.8, ls=ls, label=f"pretrain seed {s}")
        for a in arms:
            r = raw[(a, s)]
            ax.plot(range(r["start_step"] + 1, r["start_step"] + r["steps"] + 1), smooth(r["loss"], w), color=colors[a], lw=1,
                    ls=ls, label=f"{a} seed {s}")
    ax.axvline(hp["pretrain"], color="gray", lw=0.5)
    lo = min(min(smooth(raw[(a, s)]["loss"], w)) for a in arms for s in seeds)
    ax.set_ylim(lo - 0.1, lo + 1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"training loss ({w}-step mean)")
    ax.set_title("pretraining (post-norm) and the four continuations")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    ax = axes[1]
    for s in seeds:
        ls = "-" if s == 0 else "--"
        p = raw[("pretrain", s)]
        tail = [(st, v) for st, v in p["evals"] if st >= hp["pretrain"] - hp["budget"] // 4]
        ax.plot([st - hp["pretrain"] for st, _ in tail], [v for _, v in tail], color="k", lw=0.8, ls=ls, marker=".", ms=2)
        ax.axhline(pre[s]["eval_end"], color="k", lw=0.4, ls=ls)
        for a in arms:
            r = raw[(a, s)]
            ax.plot([st - r["start_step"] for st, _ in r["evals"]], [v for _, v in r["evals"]], color=colors[a], lw=1, ls=ls,
                    marker=".", ms=2, label=f"{a} seed {s}")
    for a in arms:
        if a.startswith("trans_"):
            ax.axvline(int(a.split("_")[1]), color=colors[a], lw=0.5, ls=":")
    evs = [v for a in arms for s in seeds for _, v in raw[(a, s)]["evals"]]
    base = min(pre[s]["eval_end"] for s in seeds)
    ax.set_ylim(min(evs) - 0.05, max(base + 0.6, min(evs) + 0.3))
    ax.set_xlabel("steps after the switch (dotted: end of each transition)")
    ax.set_ylabel("held-out loss (fixed windows)")
    ax.set_title("held-out loss around the switch (horizontal: pre-switch)")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in seeds:
        ls = "-" if s == 0 else "--"
        for a in arms:
            r = raw[(a, s)]
            g = [x if x is not None else float("nan") for x in r["grad_norm"]]
            ax.plot(range(1, len(g) + 1), g, color=colors[a], lw=0.6, ls=ls, alpha=0.8, label=f"{a} seed {s}")
        ax.axhline(pre[s]["grad_median_last10"], color="k", lw=0.5, ls=ls)
    ax.axhline(hp["clip"], color="gray", lw=0.8, ls=":", label="gradient_clip_val")
    ax.set_yscale("log")
    ax.set_xlabel("steps after the switch")
    ax.set_ylabel("clip/total_norm (before clipping)")
    ax.set_title("gradient norm (horizontal: pretraining median, last 10%)")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "grad_norm.png", dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ driver


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, a few steps, one seed, in-process")
    p.add_argument("--out", default="outputs/migrate_trained")
    p.add_argument("--jobs", type=int, default=None, help="runs at a time, each a subprocess with one thread; 0 runs them "
                   "one after another in this process (default: 2, quick: 0)")
    p.add_argument("--pretrain", type=int, default=None, help=f"pretraining steps (default {FULL['pretrain']})")
    p.add_argument("--budget", type=int, default=None, help=f"continuation steps per arm (default {FULL['budget']})")
    p.add_argument("--lengths", type=int, nargs=2, default=None, help=f"the two transition lengths (default {FULL['lengths']})")
    p.add_argument("--schedule", choices=("linear", "cosine"), default=None, help="the transitions' transition_schedule (default linear)")
    p.add_argument("--seeds", type=int, default=None, help=f"number of seeds (default {FULL['seeds']})")
    p.add_argument("--report-only", action="store_true", help="rebuild the report and plots from the runs already in --out")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one run
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    hp = dict(QUICK if args.quick else FULL)
    for k in ("pretrain", "budget", "seeds", "jobs", "schedule"):
        if getattr(args, k) is not None:
            hp[k] = getattr(args, k)
    if args.lengths is not None:
        hp["lengths"] = tuple(args.lengths)
    hp["lengths"] = tuple(hp["lengths"])
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)

    import torch

    if args.worker:
        torch.set_num_threads(1)
        r = train_one(args.worker, args.seed, hp, out)
        (out / "runs" / f"{run_name(args.worker, args.seed)}.json").write_text(json.dumps(r))
        return 0

    seeds = list(range(hp["seeds"]))
    order = [("pretrain", s) for s in seeds] + [(a, s) for s in seeds for a in arm_names(hp)]
    timing: dict = {}
    if args.report_only:
        prev = json.loads((out / "results.json").read_text())
        hp = {**prev["hparams"], "lengths": tuple(prev["hparams"]["lengths"])}
        timing = prev.get("timing") or {}
        seeds = list(range(hp["seeds"]))
        order = [("pretrain", s) for s in seeds] + [(a, s) for s in seeds for a in arm_names(hp)]
    elif hp["jobs"] == 0:
        torch.set_num_threads(2)
        t0 = time.time()
        for j, s in order:
            r = train_one(j, s, hp, out)
            (out / "runs" / f"{run_name(j, s)}.json").write_text(json.dumps(r))
            print(f"finished {run_name(j, s)} ({time.time() - t0:.0f} s)", flush=True)
    else:
        timing = run_parallel(order, hp, out, argv)
    raw = {}
    for j, s in order:
        r = json.loads((out / "runs" / f"{run_name(j, s)}.json").read_text())
        r["evals"] = [tuple(e) for e in r["evals"]]
        raw[(j, s)] = r
    if timing:  # derived from the runs (so --report-only recomputes it too)
        cpu = {k: v["cpu_s"] for k, v in raw.items()}
        timing["free_estimate_s"] = simulate(cpu, order, 2)
        for ph in timing["phases"]:
            ph["cpu_s"] = sum(raw[tuple(j)]["cpu_s"] for j in ph["jobs"])
        timing["ms_per_step"] = step_times(raw, hp)
    text = report(raw, hp, out, timing, args.quick)
    print(text)
    return 0


def run_parallel(order: list[tuple[str, int]], hp: dict, out: Path, argv: list[str]) -> dict:
    """Each run a subprocess with one thread, hp['jobs'] at a time; a continuation waits for its seed's pretraining.
    Samples the load average every second, per phase (pretraining: until the last pretraining run ends)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    forwarded = [a for a in argv if a not in ("--report-only",)]
    t0 = time.time()
    pending, running, done, failed = list(order), [], set(), []
    loads: list[tuple[float, float]] = []
    marks = {}
    spans: dict[str, list] = {}  # run -> [start, end] seconds from the study's start (the process's whole life)
    while pending or running:
        while len(running) < hp["jobs"]:
            ready = [j for j in pending if j[0] == "pretrain" or ("pretrain", j[1]) in done]
            if not ready:
                break
            j = ready[0]
            pending.remove(j)
            cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", j[0], "--seed", str(j[1])]
            log = open(out / f"{run_name(*j)}.log", "w")
            running.append((j, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
            spans[run_name(*j)] = [time.time() - t0, None]
            print(f"started {run_name(*j)} ({time.time() - t0:.0f} s)", flush=True)
        time.sleep(1.0)
        loads.append((time.time() - t0, os.getloadavg()[0]))
        for item in list(running):
            j, proc, log = item
            if proc.poll() is not None:
                running.remove(item)
                log.close()
                done.add(j)
                spans[run_name(*j)][1] = time.time() - t0
                print(f"finished {run_name(*j)}: exit {proc.returncode} ({time.time() - t0:.0f} s)", flush=True)
                if proc.returncode != 0:
                    failed.append(j)
                if j[0] == "pretrain" and all(("pretrain", s) in done for s in range(hp["seeds"])):
                    marks["pretrain_end"] = time.time() - t0
        if failed:
            for _, proc, _ in running:
                proc.kill()
            for j in failed:
                print(f"--- {run_name(*j)}.log (last lines)\n" + "".join(open(out / f"{run_name(*j)}.log").readlines()[-30:]))
            raise SystemExit(f"migrate_trained: run(s) failed: {failed}")
    wall = time.time() - t0

    def phase(name, a, b, jobs):
        ls = [l for t, l in loads if a <= t <= b] or [l for _, l in loads]
        return {"name": name, "runs": len(jobs), "wall_s": b - a, "load_mean": statistics.mean(ls), "load_max": max(ls), "jobs": jobs}

    pre_jobs = [j for j in order if j[0] == "pretrain"]
    cont_jobs = [j for j in order if j[0] != "pretrain"]
    # Continuations of an early seed may start before the last pretraining run ends; the phases split at that end.
    pend = marks.get("pretrain_end", wall)
    phases = [phase("pretraining (both seeds, in parallel)", 0, pend, pre_jobs),
              phase("continuations (after the last pretraining)", pend, wall, cont_jobs)]
    return {"wall_s": wall, "jobs": hp["jobs"], "cpus": os.cpu_count(), "phases": phases, "spans": spans,
            "load_mean": statistics.mean(l for _, l in loads), "load_max": max(l for _, l in loads)}


if __name__ == "__main__":
    sys.exit(main())
