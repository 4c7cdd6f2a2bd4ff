"""Migrate a *trained* post-norm model to pre-norm without losing what it learned (issues 11 and 20).

1. Pretrain a post-norm character LM (the demo `CharLM`, 12 layers in full mode) on the embedded corpus,
   without ln_lightning, once per seed, with the usual end of a schedule (cosine decay of the learning
   rate to a floor), and checkpoint it (cached in --out: later runs reuse it). "Flattened" is measured on
   the held-out loss: its mean over the last 10% of pretraining is within FLAT_TOL (1%) of its mean over
   the 10% before.
2. The drift profile: with the trained weights fixed, the blend a swept from 0 to 1 on a fixed probe batch
   of training windows (output KL to a = 0, probe loss, held-out loss), for the plain blend with the
   final norm copied from the trained last norm, with a freshly built one (the plugin-less continuation's
   start before issue 20), and for the stream-scaled blend (`migrate_trained_methods.StreamScaledBlend`).
3. Continue each seed's checkpoint (`fit(ckpt_path=...)`: weights, AdamW state, scheduler, step count) in
   every arm, with the same continuation seed (same batches, checksummed), within the compute budget of
   continuing unchanged for `budget` steps (forward 1, backward 2 units per batch; a teacher forward or a
   probe forward counts too):
     unchanged   plain post-norm, no plugin;
     hard        `LNPlacement("pre", resume_unconverted=True)`: pre-norm from the first step;
     plugin_S    `LNPlacement("pre", transition_steps=S, resume_unconverted=True)`: the plugin's default
                 transition, the real user path;
     the candidate methods of `methods()` (Callbacks on a plugin-less continuation, public transition API).
4. Why migrate: from the end of the `unchanged` arm and of the `--why-from` arm, continue both at
   3x and 10x the learning rate without warmup, and deepen both with identity-initialised blocks and train on.
5. Report: results.md, results.json, plots; every sentence printed is computed from this run's numbers.

The held-out loss is the mean cross-entropy on fixed validation windows, computed every `eval_every` steps
inside the training loop (before that step's update) at the blend the model holds: it has no
batch-to-batch noise, so "the function at the switch" and "the worst excess" are read from it.

Run:
    python examples/migrate_trained.py               # full study: 12 layers, 2 seeds, runs two at a time
    python examples/migrate_trained.py --quick       # one arm per mechanism, the same tables and plots, small scale
    python examples/migrate_trained.py --report-only # rebuild results.md, results.json and plots from runs/
    python examples/migrate_trained.py --arms unchanged plugin_400   # only these arms (others from runs/)

Writes into --out (default outputs/migrate_trained): results.md, results.json, loss.png,
drift.png, candidates.png, why_lr.png, why_deepen.png, runs/ (one JSON per run), pretrain_seed*/last.ckpt,
end_state/ (the end of the arms the why-migrate runs start from), tb/ (TensorBoard), *.log (full mode).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from ln_lightning.demo.lightning import CharLM

FLAT_TOL = 0.01  # "flattened": last 10% of pretraining within 1% of the 10% before
GOAL_EXCESS = 0.03  # issue 20: worst held-out excess over pre-switch, both seeds

FULL = dict(layers=12, d_model=64, heads=4, block_size=32, batch_size=16, max_chars=300_000, lr=1e-3,
            warmup_steps=100, lr_floor=0.1, clip=1.0, pretrain=3000, budget=1200, unit=400, seeds=2,
            eval_every=20, eval_batches=4, stream_every=20, window=50, jobs=2, probe_windows=64,
            why_steps=600, why_lr=(3, 10), deepen=6, drift_grid=41)
QUICK = dict(layers=2, d_model=32, heads=2, block_size=32, batch_size=8, max_chars=40_000, lr=3e-3,
             warmup_steps=5, lr_floor=0.1, clip=1.0, pretrain=20, budget=12, unit=6, seeds=1,
             eval_every=3, eval_batches=2, stream_every=3, window=3, jobs=0, probe_windows=8,
             why_steps=6, why_lr=(10,), deepen=1, drift_grid=11)  # one raised learning rate: the code path, once
CONT_SEED = 100  # the continuation of seed s runs with seed CONT_SEED + s (a fresh data order, the same in every arm)
WHY_FROM = "scaled_linear_endpoint"  # the migrated arm the why-migrate runs start from (see methods())


class DecayCharLM(CharLM):
    """The demo CharLM with the usual end of a training schedule: linear warmup, then a cosine decay of the
    learning rate to `lr_floor` x peak at step `decay_steps`, then constant at the floor (where the
    continuations run; `decay_steps=0`: constant after warmup, as CharLM). A callback with a `loss_term`
    (a migration's distillation) adds to the training loss; `ce` is the cross-entropy alone."""

    def __init__(self, *args, decay_steps: int = 0, lr_floor: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_hyperparameters()

    def training_step(self, batch, batch_idx):
        logits, ce = self._logits_and_loss(batch)
        loss = ce
        for cb in self.trainer.callbacks:
            term = getattr(cb, "loss_term", None)
            extra = term(self, batch, logits) if term is not None else None
            if extra is not None:
                loss = loss + extra
        self.log("train/loss", ce, prog_bar=True)
        return {"loss": loss, "ce": ce.detach()}

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


def methods(hp: dict) -> dict:
    """The candidate migrations, name -> Migration; T = hp['unit'] (400 in full mode) sets the lengths."""
    from migrate_trained_methods import Migration

    T = hp["unit"]
    half, long = max(1, T // 2), max(2, 7 * T // 4)
    lr3 = 3 * hp["lr"] * hp["lr_floor"]
    return {
        # the plain blend (transition.py as it is), started from the trained final norm (issue 20, item 1)
        "plain_linear": Migration(T),
        "plain_cosine": Migration(T, "cosine"),
        "plain_linear_distill": Migration(T, distill=1.0),
        "plain_linear_endpoint": Migration(T, endpoint_fraction=0.25),
        # the stream-scaled blend: branch scales that keep the trained branches' weights in a pre-norm stream
        "scaled_hard": Migration(0, "hard", scaled=True),
        "scaled_linear_short": Migration(half, scaled=True),
        "scaled_linear": Migration(T, scaled=True),
        "scaled_linear_long": Migration(long, scaled=True),
        "scaled_cosine_long": Migration(long, "cosine", scaled=True),
        "scaled_speed_long": Migration(long, "speed", scaled=True),
        "scaled_staggered": Migration(T, scaled=True, staggered=True),
        "scaled_adaptive": Migration(half, "adaptive", scaled=True, budget=0.0),
        "scaled_linear_lr3x": Migration(T, scaled=True, lr=lr3),
        "scaled_linear_distill": Migration(T, scaled=True, distill=1.0),
        "scaled_linear_endpoint": Migration(T, scaled=True, endpoint_fraction=0.25),
        "scaled_linear_endpoint_half": Migration(T, scaled=True, endpoint_fraction=0.5),
        "scaled_long_endpoint": Migration(long, scaled=True, endpoint_fraction=0.5),
        "scaled_long_endpoint_distill": Migration(long, scaled=True, endpoint_fraction=0.25, distill=1.0),
        # the other placements (issue 20: the default must work for them too)
        "mix_scaled_endpoint": Migration(T, scaled=True, endpoint_fraction=0.25, placement="mix"),
        "peri_scaled_endpoint": Migration(T, scaled=True, endpoint_fraction=0.25, placement="peri"),
        "peri_scaled_distill": Migration(T, scaled=True, distill=1.0, placement="peri"),
        "peri_scaled_endpoint_distill": Migration(T, scaled=True, endpoint_fraction=0.25, distill=1.0, placement="peri"),
        "peri_scaled_long_endpoint_distill": Migration(long, scaled=True, endpoint_fraction=0.25, distill=1.0, placement="peri"),
        # "output" with an entry scale 1/C_k and new exit norms (migrate_trained_methods.OutputScaledBlend; a prototype)
        "output_scaled_endpoint_distill": Migration(T, scaled=True, endpoint_fraction=0.25, distill=1.0, placement="output"),
        "output_scaled_long_endpoint_distill": Migration(long, scaled=True, endpoint_fraction=0.25, distill=1.0, placement="output"),
    }


def arms(hp: dict) -> dict:
    """Every continuation arm, name -> spec, in report order."""
    T = hp["unit"]
    long = max(2, 7 * T // 4)
    out = {"unchanged": {"kind": "unchanged"}, "hard": {"kind": "plugin", "transition_steps": None},
           # the plugin's default: the stream-scaled blend with 25% endpoint steps
           f"plugin_{T}": {"kind": "plugin", "transition_steps": T},
           f"plugin_{long}": {"kind": "plugin", "transition_steps": long},
           # the plugin's plain blend (its default before issue 20's study): transition_stream_scale=False, no endpoint steps
           f"plugin_plain_{T}": {"kind": "plugin", "transition_steps": T,
                                 "options": {"transition_stream_scale": False, "transition_endpoint_fraction": 0.0,
                                             "transition_distill": 0.0}},
           # the default transition to the other placements (stream-scaled too; "output": the branch reads x / C_k)
           f"plugin_mix_{T}": {"kind": "plugin", "transition_steps": T, "placement": "mix"},
           f"plugin_peri_{T}": {"kind": "plugin", "transition_steps": T, "placement": "peri"},
           f"plugin_peri_{long}": {"kind": "plugin", "transition_steps": long, "placement": "peri"},
           # peri's default before its stream scales: the plain blend with endpoint steps and distillation
           f"plugin_peri_plain_{T}": {"kind": "plugin", "transition_steps": T, "placement": "peri",
                                      "options": {"transition_stream_scale": False}},
           f"plugin_output_{T}": {"kind": "plugin", "transition_steps": T, "placement": "output"},
           f"plugin_output_{long}": {"kind": "plugin", "transition_steps": long, "placement": "output"},
           # output's default before its stream scales: the plain blend with endpoint steps and distillation
           f"plugin_output_plain_{T}": {"kind": "plugin", "transition_steps": T, "placement": "output",
                                        "options": {"transition_stream_scale": False}}}
    for name, m in methods(hp).items():
        out[name] = {"kind": "method", "method": m}
    return out


def quick_arms(hp: dict) -> list[str]:
    """--quick's arms: one per distinct mechanism, not the whole study (each arm is a Lightning fit, whose fixed
    cost dominates at quick scale). The plugin's: no rewrite, the hard switch, its default, its plain blend, and
    the default to each other placement; the study's: one candidate per schedule and per method family, including
    the arm the why-migrate runs start from. The full mode runs every arm."""
    T = hp["unit"]
    return ["unchanged", "hard", f"plugin_{T}", f"plugin_plain_{T}", f"plugin_mix_{T}", f"plugin_peri_{T}",
            f"plugin_output_{T}", "plain_linear", "scaled_hard", "scaled_linear_endpoint", "scaled_adaptive",
            "scaled_staggered", "scaled_speed_long",
            "peri_scaled_endpoint_distill", "output_scaled_endpoint_distill", hp["why_from"]]


def _plugin_teacher_steps(plugin) -> int:
    """The steps in which LNPlacement's transition runs its teacher forward (transition_distill > 0)."""
    if plugin is None or not plugin.transition_steps or not plugin.transition_distill:
        return 0
    return plugin.transition_steps


def _steps_within(budget_units: float, teacher_steps: int) -> int:
    """The most steps whose forward and backward, plus a teacher forward in the first `teacher_steps`, fit the budget."""
    from migrate_trained_methods import UNITS_BWD, UNITS_FWD

    steps = int((budget_units - UNITS_FWD * teacher_steps) // (UNITS_FWD + UNITS_BWD))
    return steps if steps >= teacher_steps else int(budget_units // (UNITS_FWD + UNITS_BWD + UNITS_FWD))


def run_name(job: str, seed: int) -> str:
    return f"{job}_seed{seed}"


def eval_windows(hp: dict):
    """Fixed held-out windows, evenly spaced over the validation tail the DataModule holds out (5%), in batches;
    and the probe: fixed training windows (seeded draw), for the drift profile and the stream scales."""
    from ln_lightning.demo.data import CharCorpus, stdlib_corpus_text

    text = stdlib_corpus_text(hp["max_chars"])
    split = int(len(text) * 0.95)
    val = CharCorpus(text[split:], hp["block_size"])
    train = CharCorpus(text[:split], hp["block_size"])
    n_eval = hp["eval_batches"] * hp["batch_size"]
    idx = [round(i * (len(val) - 1) / max(1, n_eval - 1)) for i in range(n_eval)]
    xs, ys = zip(*(val[i] for i in idx))
    bs = hp["batch_size"]
    eval_x = [torch.stack(xs[i:i + bs]) for i in range(0, n_eval, bs)]
    eval_y = [torch.stack(ys[i:i + bs]) for i in range(0, n_eval, bs)]
    g = torch.Generator().manual_seed(12345)
    pidx = torch.randint(0, len(train), (hp["probe_windows"],), generator=g).tolist()
    px, py = (torch.stack(z) for z in zip(*(train[i] for i in pidx)))
    return eval_x, eval_y, px, py


def model_hparams(hp: dict) -> dict:
    return dict(n_layers=hp["layers"], d_model=hp["d_model"], n_heads=hp["heads"], block_size=hp["block_size"],
                lr=hp["lr"], warmup_steps=hp["warmup_steps"], decay_steps=hp["pretrain"] if hp["lr_floor"] < 1 else 0,
                lr_floor=hp["lr_floor"])


def heldout_loss(model, eval_x, eval_y) -> float:
    from torch.nn import functional as F

    was = model.training
    model.eval()
    with torch.no_grad():
        tot = 0.0
        for x, y in zip(eval_x, eval_y):
            logits = model(x)
            tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
    model.train(was)
    return tot / sum(y.numel() for y in eval_y)


# ------------------------------------------------------------------------------------------ one run


def train_one(job: str, seed: int, hp: dict, out: Path) -> dict:
    """Pretrain (job "pretrain") or continue one arm; returns everything the report reads."""
    t_wall0, t_cpu0 = time.time(), time.process_time()  # (a worker: time.process_time() counts from the process start)
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import Logger, TensorBoardLogger

    from ln_lightning import LNPlacement
    from ln_lightning.callbacks import ClipAttributionMonitor, StreamNormMonitor
    from ln_lightning.demo.lightning import CharDataModule
    from ln_lightning.placement.migrate import transition
    from migrate_trained_methods import UNITS_BWD, UNITS_FWD, make_callback
    from migrate_trained_why import save_end_state

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
        """Per step: training cross-entropy, a checksum of the batch, the blend the model holds; every eval_every
        steps (and at the end) the loss on fixed held-out windows, computed before that step's update."""

        def __init__(self, eval_x, eval_y):
            self.eval_x, self.eval_y = eval_x, eval_y
            self.loss, self.batch_sum, self.blend, self.evals, self.step_cpu = [], [], [], [], []
            self.start = None
            self._t = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = trainer.global_step
            if self.start is None:
                self.start = step
            self.batch_sum.append(int(batch[0].sum()))
            # The plugin (the first callback) has set the blend this step trains at: 1 on its endpoint steps. The
            # model holds the scheduled one (what a validation or a checkpoint between steps sees): evaluate that.
            t = transition.active(pl_module)
            trains_at = None if t is None else t.blend.clone()
            if t is not None and plugin is not None:
                t.hold()
            self.blend.append(transition.get_blend(pl_module))
            if (step - self.start) % hp["eval_every"] == 0:
                self.evals.append((step, heldout_loss(pl_module, self.eval_x, self.eval_y)))
            if trains_at is not None:
                t.blend.copy_(trains_at)
            self._t = time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.loss.append(float(outputs["ce"] if "ce" in outputs else outputs["loss"]))
            self.step_cpu.append(time.process_time() - self._t)  # forward, backward, monitors, optimizer step

        def on_train_end(self, trainer, pl_module):
            self.evals.append((trainer.global_step, heldout_loss(pl_module, self.eval_x, self.eval_y)))

    eval_x, eval_y, probe_x, _ = eval_windows(hp)
    name = run_name(job, seed)
    ckpt_dir = out / f"pretrain_seed{seed}"
    memory = Memory()
    probe = Probe(eval_x, eval_y)
    # Probe before the monitors: its eval forward runs before StreamNormMonitor opens a logging step.
    callbacks = [probe, ClipAttributionMonitor(every_n_steps=1, log_depth_profile=False),
                 StreamNormMonitor(every_n_steps=hp["stream_every"], log_depth_profile=False)]
    plugin, ckpt_path, migration = None, None, None
    budget_units = hp["budget"] * (UNITS_FWD + UNITS_BWD)
    spec = None
    if job == "pretrain":
        L.seed_everything(seed, verbose=False)
        max_steps = hp["pretrain"]
        callbacks.append(ModelCheckpoint(dirpath=str(ckpt_dir), filename="last", save_top_k=1, every_n_train_steps=max_steps))
    else:
        spec = arms(hp)[job]
        L.seed_everything(CONT_SEED + seed, verbose=False)
        max_steps = hp["pretrain"] + hp["budget"]
        ckpt_path = str(ckpt_dir / "last.ckpt")
        if spec["kind"] == "plugin":
            kw = {} if spec["transition_steps"] is None else {"transition_steps": spec["transition_steps"], **spec.get("options", {})}
            plugin = LNPlacement(spec.get("placement", "pre"), resume_unconverted=True, log_report=False, **kw)
            teacher_steps = _plugin_teacher_steps(plugin)
            if teacher_steps:  # its distillation runs a teacher forward per transition step: fewer steps fit the budget
                max_steps = hp["pretrain"] + _steps_within(budget_units, teacher_steps)
        elif spec["kind"] == "method":
            # after the Probe: the Probe evaluates the blend the model holds, then the method sets the one it trains at
            migration = make_callback(spec["method"], probe_x, budget_units, hp["batch_size"])
            callbacks.insert(1, migration)
    if job != "pretrain" and (job == "unchanged" or job == hp["why_from"]):
        callbacks.append(save_end_state(out / "end_state" / f"{name}.pt"))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, gradient_clip_val=hp["clip"], limit_val_batches=0,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        logger=[TensorBoardLogger(str(out / "tb"), name=name, version=""), memory], log_every_n_steps=10,
        plugins=[plugin] if plugin is not None else None, callbacks=callbacks, default_root_dir=str(out / name),
    )
    t_fit_wall, t_fit_cpu = time.time(), time.process_time()
    trainer.fit(DecayCharLM(**model_hparams(hp)), datamodule=CharDataModule(block_size=hp["block_size"], batch_size=hp["batch_size"],
                                                                             max_chars=hp["max_chars"]), ckpt_path=ckpt_path)
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
    if spec is None or spec["kind"] == "unchanged":
        units = 3.0 * n
    elif migration is not None:
        units = migration.units
    else:  # the plugin's arms: one forward and backward per step, and a teacher forward per transition step
        units = 3.0 * n + UNITS_FWD * min(n, _plugin_teacher_steps(plugin))
    return {
        "job": job, "seed": seed, "start_step": start, "steps": n,
        "loss": probe.loss, "batch_sum": probe.batch_sum, "step_cpu": probe.step_cpu, "blend": probe.blend, "evals": probe.evals,
        "trained_at": migration.trained_at if migration is not None else None,
        "scales": migration.scales if migration is not None else None,
        "units": units, "budget_units": budget_units,
        "grad_norm": per_step("clip/total_norm"), "clipped": per_step("clip/clipped"), "dominant": dominant,
        "share": shares, "stream_rms": stream,
        "fit_wall_s": fit_wall, "fit_cpu_s": fit_cpu, "wall_s": time.time() - t_wall0,
        # the whole process's CPU time (interpreter start and imports included) when it runs alone in a worker
        "cpu_s": time.process_time() if hp["jobs"] > 0 else time.process_time() - t_cpu0,
        "threads": torch.get_num_threads(),
    }


def drift_one(seed: int, hp: dict, out: Path) -> dict:
    """The drift profile of seed `seed`'s trained model (weights fixed)."""
    from migrate_trained_drift import blend_grid, profile

    t0 = time.process_time()
    ck = torch.load(out / f"pretrain_seed{seed}" / "last.ckpt", map_location="cpu", weights_only=False)

    def make():
        lm = DecayCharLM(**model_hparams(hp))
        lm.load_state_dict(ck["state_dict"])
        return lm

    eval_x, eval_y, px, py = eval_windows(hp)
    res = profile(make, px, py, eval_x, eval_y, blend_grid(hp["drift_grid"]))
    return {"job": "drift", "seed": seed, "profile": res, "cpu_s": time.process_time() - t0}


def step_cost_one(seed: int, hp: dict, out: Path) -> dict:
    """Paired step-time ratios of the migrations' steps against plain pre-norm (migrate_trained_step_cost)."""
    from migrate_trained_step_cost import measure

    t0 = time.process_time()
    ck = torch.load(out / f"pretrain_seed{seed}" / "last.ckpt", map_location="cpu", weights_only=False)
    lm = DecayCharLM(**model_hparams(hp))
    lm.load_state_dict(ck["state_dict"])
    _, _, px, _ = eval_windows(hp)
    quick = hp["layers"] < 4
    r = measure(lm, px[:hp["batch_size"]], blocks=3 if quick else 12, steps=2 if quick else 5)
    return {"job": "stepcost", "seed": seed, **r, "cpu_s": time.process_time() - t0}


def why_jobs(hp: dict) -> list[str]:
    """The why-migrate runs of a seed: K x the learning rate for each K in why_lr, and deepen; each from both models."""
    tests = [f"lr{k}" for k in hp["why_lr"]] + ["deepen"]
    return [f"why_{src}_{test}" for test in tests for src in ("unchanged", "migrated")]


def why_one(job: str, seed: int, hp: dict, out: Path) -> dict:
    from ln_lightning.demo.data import CharCorpus, stdlib_corpus_text
    from migrate_trained_why import run_why

    _, src, test = job.split("_", 2)
    arm = "unchanged" if src == "unchanged" else hp["why_from"]
    eval_x, eval_y, _, _ = eval_windows(hp)
    text = stdlib_corpus_text(hp["max_chars"])
    train = CharCorpus(text[:int(len(text) * 0.95)], hp["block_size"])
    r = run_why(out / "end_state" / f"{run_name(arm, seed)}.pt", test, seed, hp, DecayCharLM, model_hparams(hp), eval_x, eval_y, train)
    return {"job": job, "from": arm, **r}


def run_job(job: str, seed: int, hp: dict, out: Path) -> dict:
    if job == "drift":
        return drift_one(seed, hp, out)
    if job == "stepcost":
        return step_cost_one(seed, hp, out)
    if job.startswith("why_"):
        return why_one(job, seed, hp, out)
    return train_one(job, seed, hp, out)


def depends(job: str, seed: int, hp: dict) -> list[tuple[str, int]]:
    if job == "pretrain":
        return []
    if job.startswith("why_"):
        return [("unchanged", seed), (hp["why_from"], seed)]
    return [("pretrain", seed)]


# ------------------------------------------------------------------------------------------ driver


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the same tables and plots at small scale, in-process (<= 3 min)")
    p.add_argument("--out", default="outputs/migrate_trained")
    p.add_argument("--jobs", type=int, default=None, help="runs at a time, each a subprocess with one thread; 0 runs them "
                   "one after another in this process (default: 2, quick: 0)")
    p.add_argument("--pretrain", type=int, default=None, help=f"pretraining steps (default {FULL['pretrain']})")
    p.add_argument("--budget", type=int, default=None, help=f"continuation steps' compute per arm (default {FULL['budget']})")
    p.add_argument("--unit", type=int, default=None, help=f"the transitions' base length (default {FULL['unit']})")
    p.add_argument("--seeds", type=int, default=None, help=f"number of seeds (default {FULL['seeds']})")
    p.add_argument("--arms", nargs="+", default=None, help="run only these arms (the others' runs/ JSON, where present, "
                   "go into the report)")
    p.add_argument("--why-from", default=None, help=f"the migrated arm the why-migrate runs start from (default {WHY_FROM})")
    p.add_argument("--no-why", action="store_true", help="skip the why-migrate runs")
    p.add_argument("--why-only", action="store_true", help="run only the why-migrate runs (from the end states in --out)")
    p.add_argument("--repretrain", action="store_true", help="pretrain again even where --out holds a pretrained checkpoint")
    p.add_argument("--report-only", action="store_true", help="rebuild the report and plots from the runs already in --out")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one run
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    hp = dict(QUICK if args.quick else FULL)
    for k in ("pretrain", "budget", "seeds", "jobs", "unit"):
        if getattr(args, k) is not None:
            hp[k] = getattr(args, k)
    hp["why_from"] = args.why_from or WHY_FROM
    hp["why_lr"] = tuple(hp["why_lr"])
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)

    if args.worker:
        torch.set_num_threads(1)
        r = run_job(args.worker, args.seed, hp, out)
        (out / "runs" / f"{run_name(args.worker, args.seed)}.json").write_text(json.dumps(r))
        return 0

    from migrate_trained_report import report

    if args.report_only:
        prev = json.loads((out / "results.json").read_text())
        hp = {**prev["hparams"], "why_lr": tuple(prev["hparams"]["why_lr"])}
    seeds = list(range(hp["seeds"]))
    all_arms = list(arms(hp))
    if hp["why_from"] not in all_arms:
        raise SystemExit(f"--why-from {hp['why_from']!r} is not an arm: {', '.join(all_arms)}")
    if args.arms is not None:
        chosen = args.arms
    elif args.quick:
        chosen = list(dict.fromkeys(quick_arms(hp)))
    else:
        chosen = all_arms
    unknown = [a for a in chosen if a not in all_arms]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; the arms: {', '.join(all_arms)}")
    why = [] if args.no_why else why_jobs(hp)
    order = []
    for s in seeds:
        cached = (out / f"pretrain_seed{s}" / "last.ckpt").exists() and (out / "runs" / f"{run_name('pretrain', s)}.json").exists()
        if args.repretrain or not cached:
            order.append(("pretrain", s))
    # the arms the goal and the why-migrate runs need first, both seeds, then the rest
    first = ["unchanged", hp["why_from"], f"plugin_{hp['unit']}", "scaled_long_endpoint", "scaled_linear", "plain_linear", "hard"]
    chosen = sorted(chosen, key=lambda a: first.index(a) if a in first else len(first))
    # with --arms, the drift profile and the step cost are run again only where --out lacks them
    shared = [("drift", s) for s in seeds] + [("stepcost", 0)]
    if args.arms is not None:
        shared = [(j, s) for j, s in shared if not (out / "runs" / f"{run_name(j, s)}.json").exists()]
    order += shared + [(a, s) for a in chosen for s in seeds]
    if args.arms is None or any(a in chosen for a in ("unchanged", hp["why_from"])):
        order += [(j, s) for s in seeds for j in why]
    if args.why_only:
        order = [(j, s) for s in seeds for j in why_jobs(hp)]
    timing: dict = {}
    if args.report_only:
        timing = prev.get("timing") or {}
    elif hp["jobs"] == 0:
        # --quick's model is tiny (2 layers, 32 wide, batches of 8): a second intra-op thread mostly waits, and on a
        # busy 2-core machine its waiting cost more CPU than the work (issue 32: the quick run 145 CPU s with 2 threads).
        torch.set_num_threads(1 if args.quick else 2)
        t0 = time.time()
        for j, s in order:
            r = run_job(j, s, hp, out)
            (out / "runs" / f"{run_name(j, s)}.json").write_text(json.dumps(r))
            print(f"finished {run_name(j, s)} ({time.time() - t0:.0f} s)", flush=True)
        timing = {"wall_s": time.time() - t0, "jobs": 0, "cpus": os.cpu_count(), "load_mean": os.getloadavg()[0]}
    else:
        timing = run_parallel(order, hp, out, argv)
    raw = {}
    for j in ["pretrain", "drift", "stepcost", *all_arms, *why_jobs(hp)]:
        for s in seeds:
            f = out / "runs" / f"{run_name(j, s)}.json"
            if f.exists():
                raw[(j, s)] = json.loads(f.read_text())
    text = report(raw, hp, out, timing, args.quick, arms(hp))
    print(text)
    return 0


def run_parallel(order: list[tuple[str, int]], hp: dict, out: Path, argv: list[str]) -> dict:
    """Each run a subprocess with one thread, hp['jobs'] at a time, a run waiting for the runs it starts from.
    Samples the load average every second."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    forwarded = [a for a in argv if a not in ("--report-only",)]
    t0 = time.time()
    pending, running, done, failed = list(order), [], set(), []
    in_order = set(order)
    loads: list[float] = []
    while pending or running:
        while len(running) < hp["jobs"]:
            ready = [j for j in pending if all(d in done or d not in in_order for d in depends(*j, hp))]
            if not ready:
                break
            j = ready[0]
            pending.remove(j)
            cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", j[0], "--seed", str(j[1])]
            log = open(out / f"{run_name(*j)}.log", "w")
            running.append((j, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
            print(f"started {run_name(*j)} ({time.time() - t0:.0f} s)", flush=True)
        time.sleep(1.0)
        loads.append(os.getloadavg()[0])
        for item in list(running):
            j, proc, log = item
            if proc.poll() is not None:
                running.remove(item)
                log.close()
                done.add(j)
                print(f"finished {run_name(*j)}: exit {proc.returncode} ({time.time() - t0:.0f} s)", flush=True)
                if proc.returncode != 0:
                    failed.append(j)
        if failed:
            for _, proc, _ in running:
                proc.kill()
            for j in failed:
                print(f"--- {run_name(*j)}.log (last lines)\n" + "".join(open(out / f"{run_name(*j)}.log").readlines()[-30:]))
            raise SystemExit(f"migrate_trained: run(s) failed: {failed}")
    return {"wall_s": time.time() - t0, "jobs": hp["jobs"], "cpus": os.cpu_count(),
            "load_mean": sum(loads) / max(1, len(loads)), "load_max": max(loads, default=0.0)}


if __name__ == "__main__":
    sys.exit(main())
