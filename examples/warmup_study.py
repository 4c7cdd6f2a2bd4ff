"""Does post-norm need learning-rate warmup at depth, and pre-norm not? (Xiong et al. 2020)

A 12-layer character transformer LM (`ln_lightning.demo.lightning.CharLM`, post-norm as built) on
the embedded standard-library corpus, trained four ways with the same seeds, data order, steps,
batch and peak learning rate:

    post            CharLM as built,                       warmup_steps=0
    post+warmup     CharLM as built,                       linear warmup
    pre             Trainer(plugins=[LNPlacement("pre")]), warmup_steps=0
    pre+warmup      Trainer(plugins=[LNPlacement("pre")]), linear warmup

Every run has `gradient_clip_val` set and `ClipAttributionMonitor(every_n_steps=1)`, which logs the
gradient norm clipping sees (`clip/total_norm`), each group's share of it and which group dominated
the steps clipping fired on. Reported per run: final training loss (mean of the last logged values),
validation loss, divergence (a non-finite loss, or a final loss above the initial one), gradient-norm
spikes (max / median of `clip/total_norm`), clipping fired fraction and its dominant group. Everything
is read back from the runs' TensorBoard logs.

Run:
    python examples/warmup_study.py              # full: 4 configs x 2 seeds, 400 steps, lr 3e-3 (~12 min on 2 busy cores)
    python examples/warmup_study.py --lr 1e-2    # the same at a learning rate too high for post-norm either way
    python examples/warmup_study.py --quick      # smoke test: tiny model, a few steps, one seed
    python examples/warmup_study.py --configs post pre pre+lns deepnorm --layers 24 --out outputs/depth_placements
                                                 # LayerNorm Scaling and DeepNorm against pre- and post-norm at depth

Runs execute as subprocesses, `--jobs` at a time (default 2, one thread each; --quick runs them in-process). Writes into --out
(default outputs/warmup_study): results.md, results.json, loss_curves.png, grad_norm.png, tb/.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

CONFIGS = {
    "post": dict(placement="post", warmup=False),
    "post+warmup": dict(placement="post", warmup=True),
    "pre": dict(placement="pre", warmup=False),
    "pre+warmup": dict(placement="pre", warmup=True),
    # The depth-aware forms (issue 34; `--configs post pre pre+lns deepnorm`, at depth): LayerNorm Scaling on pre-norm,
    # PlacementSpec("pre", norm_scale="depth"), and DeepNorm's post-norm, LNPlacement("deepnorm").
    "pre+lns": dict(placement="pre", norm_scale="depth", warmup=False),
    "deepnorm": dict(placement="deepnorm", warmup=False),
}
WARMUP_CONFIGS = ("post", "post+warmup", "pre", "pre+warmup")  # the default: the warmup claim

FULL = dict(layers=12, d_model=64, heads=4, block_size=32, batch_size=16, steps=400, warmup_steps=100, lr=3e-3, clip=1.0, seeds=2)
QUICK = dict(layers=12, d_model=32, heads=2, block_size=16, batch_size=4, steps=6, warmup_steps=3, lr=3e-3, clip=1.0, seeds=1)


def run_name(config: str, seed: int) -> str:
    return f"{config.replace('+', '_')}_seed{seed}"


# ------------------------------------------------------------------------------------------ one run


def train_one(config: str, seed: int, hp: dict, out: Path) -> dict:
    import torch
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from ln_lightning import LNPlacement, PlacementSpec
    from ln_lightning.callbacks import ClipAttributionMonitor
    from ln_lightning.demo.lightning import CharDataModule, CharLM

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*is deprecated.*")
    spec = CONFIGS[config]
    L.seed_everything(seed, verbose=False)  # same weights, same data order for every config of a seed
    model = CharLM(
        n_layers=hp["layers"], d_model=hp["d_model"], n_heads=hp["heads"], block_size=hp["block_size"],
        lr=hp["lr"], warmup_steps=hp["warmup_steps"] if spec["warmup"] else 0,
    )
    data = CharDataModule(block_size=hp["block_size"], batch_size=hp["batch_size"], max_chars=300_000)
    plugins = []
    if spec["placement"] != "post":
        # fused=False: compare placements only, with the same nn.LayerNorm kernel in every run.
        plugins.append(LNPlacement(PlacementSpec(spec["placement"], norm_scale=spec.get("norm_scale")), fused=False))
    shutil.rmtree(out / "tb" / run_name(config, seed), ignore_errors=True)  # a rerun must not mix in old events
    logger = TensorBoardLogger(str(out / "tb"), name=run_name(config, seed), version="")
    trainer = L.Trainer(
        max_steps=hp["steps"], accelerator="cpu", devices=1, logger=logger, plugins=plugins or None,
        callbacks=[ClipAttributionMonitor(every_n_steps=1, log_depth_profile=False)],
        gradient_clip_val=hp["clip"], log_every_n_steps=1, val_check_interval=None, limit_val_batches=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, deterministic=False,
    )
    t0 = time.time()
    trainer.fit(model, datamodule=data)
    train_s = time.time() - t0
    val = []
    if hp.get("val_batches"):
        # A separate Trainer: the fit Trainer has limit_val_batches=0. The model stays rewritten after fit.
        evaluator = L.Trainer(accelerator="cpu", devices=1, logger=False, limit_val_batches=hp["val_batches"],
                              enable_progress_bar=False, enable_model_summary=False)
        val = evaluator.validate(model, datamodule=data, verbose=False)
    val_loss = val[0].get("val/loss", float("nan")) if val else float("nan")
    logger.experiment.flush()
    return {"config": config, "seed": seed, "train_seconds": train_s, "val_loss": val_loss, "log_dir": logger.log_dir}


def read_run(log_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]

    def series(tag: str) -> tuple[list[int], list[float]]:
        ev = acc.Scalars(tag) if tag in tags else []
        return [e.step for e in ev], [e.value for e in ev]

    out = {"loss": series("train/loss"), "total_norm": series("clip/total_norm"), "clipped": series("clip/clipped")}
    out["share"] = {t[len("clip/share/"):]: series(t)[1] for t in tags if t.startswith("clip/share/")}
    out["dominant"] = {t[len("clip/dominant/"):]: series(t)[1] for t in tags if t.startswith("clip/dominant/")}
    return out


def summarise(meta: dict, series: dict) -> dict:
    loss = np.array(series["loss"][1], float)
    norms = np.array(series["total_norm"][1], float)
    clipped = np.array(series["clipped"][1], float)
    tail = loss[-max(1, len(loss) // 10):]
    initial = float(loss[0]) if len(loss) else float("nan")
    final = float(np.mean(tail)) if len(tail) else float("nan")
    nonfinite = bool(len(loss) and not np.isfinite(loss).all())
    finite_norms = norms[np.isfinite(norms)]
    med = float(np.median(finite_norms)) if len(finite_norms) else float("nan")
    # dominant group over the steps clipping fired on (per-step 0/1 indicators, logged every step)
    dom_counts = {g: float(np.nansum(v)) for g, v in series["dominant"].items()}
    dom_total = sum(dom_counts.values())
    dominant = max(dom_counts, key=dom_counts.get) if dom_total > 0 else "(clipping never fired)"
    mean_share = {g: float(np.nanmean(v)) for g, v in series["share"].items() if len(v)}
    top_share = sorted(mean_share.items(), key=lambda kv: -kv[1])[:3]
    return {
        **meta,
        "initial_loss": initial,
        "final_loss": final,
        "min_loss": float(np.nanmin(loss)) if len(loss) else float("nan"),
        # against the lowest 20-step moving average: single-batch losses are too noisy for a minimum
        "rebound": final - float(np.nanmin(np.convolve(loss, np.ones(w) / w, mode="valid"))) if len(loss) >= (w := min(20, len(loss))) and len(loss) else float("nan"),
        "diverged": nonfinite or not math.isfinite(final) or final > initial,
        "nonfinite_loss": nonfinite,
        "grad_norm_median": med,
        "grad_norm_max": float(np.max(finite_norms)) if len(finite_norms) else float("nan"),
        "grad_norm_spike": float(np.max(finite_norms) / med) if len(finite_norms) and med > 0 else float("nan"),
        "grad_norm_spike_after_warmup_window": float(np.max(finite_norms[len(finite_norms) // 4:]) / med) if len(finite_norms) > 4 and med > 0 else float("nan"),
        "clipped_fraction": float(np.nanmean(clipped)) if len(clipped) else float("nan"),
        "dominant_group": dominant,
        "dominant_fraction": dom_counts.get(dominant, 0.0) / dom_total if dom_total > 0 else float("nan"),
        "top_mean_share": top_share,
    }


# ------------------------------------------------------------------------------------------ report


def render_markdown(results: dict) -> str:
    """results.md from results.json's content (the docs build renders the results page with this too)."""
    rows, hp, argv, elapsed = results["runs"], results["hparams"], results["argv"], results["elapsed_s"]
    lines = [
        "# warmup_study: post-norm vs pre-norm (LNPlacement), with and without warmup" if set(hp.get("configs", WARMUP_CONFIGS)) == set(WARMUP_CONFIGS)
        else f"# warmup_study at {hp['layers']} layers: {', '.join(hp['configs'])}",
        "",
        f"Command: `python examples/warmup_study.py {' '.join(argv)}` ({elapsed / 60:.1f} min wall, {hp['jobs']} runs at a time, "
        f"one thread each; 0 = in one process). CharLM: {hp['layers']} layers, d_model {hp['d_model']}, {hp['heads']} heads, context {hp['block_size']}, "
        f"batch {hp['batch_size']}, {hp['steps']} steps, AdamW peak lr {hp['lr']}, warmup {hp['warmup_steps']} steps (linear) "
        f"when on, gradient_clip_val {hp['clip']}, seeds {list(range(hp['seeds']))}. Pre-norm runs: "
        "`LNPlacement('pre', fused=False)` (a final norm added where a stack lacks one)"
        + ("" if set(hp.get("configs", WARMUP_CONFIGS)) <= set(WARMUP_CONFIGS) else
           "; `pre+lns`: `LNPlacement(PlacementSpec('pre', norm_scale='depth'), fused=False)` (LayerNorm Scaling, block l's "
           "norm outputs times 1/sqrt(l)); `deepnorm`: `LNPlacement('deepnorm', fused=False)` (post-norm with DeepNorm's "
           "alpha = (2N)^(1/4) on the stream, the function at initialisation unchanged)")
        + ". Same initial weights and data order for all configs of a seed.",
        "",
        "| config | seed | initial loss | final train loss | min loss | val loss | diverged | grad-norm median | max | max/median | clipped steps | dominant group when clipped | top mean shares | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shares = ", ".join(f"{g} {s:.2f}" for g, s in r["top_mean_share"])
        lines.append(
            f"| {r['config']} | {r['seed']} | {r['initial_loss']:.3f} | {r['final_loss']:.3f} | {r['min_loss']:.3f} | "
            f"{r['val_loss']:.3f} | {'yes' if r['diverged'] else 'no'} | {r['grad_norm_median']:.3g} | {r['grad_norm_max']:.3g} | "
            f"{r['grad_norm_spike']:.1f} | {r['clipped_fraction']:.0%} | {r['dominant_group']} ({r['dominant_fraction']:.0%}) | "
            f"{shares} | {r['train_seconds']:.0f} |"
        )
    lines += ["", "## Mean over seeds", "", "| config | final train loss | rebound (final - lowest 20-step mean) | val loss | diverged runs | max/median grad norm | clipped steps |", "|---|---|---|---|---|---|---|"]
    means = {}
    for c in hp.get("configs", WARMUP_CONFIGS):
        rs = [r for r in rows if r["config"] == c]
        if not rs:
            continue
        means[c] = {k: float(np.mean([r[k] for r in rs])) for k in ("final_loss", "val_loss", "grad_norm_spike", "clipped_fraction", "rebound")}
        means[c]["diverged"] = sum(r["diverged"] for r in rs)
        lines.append(
            f"| {c} | {means[c]['final_loss']:.3f} | {means[c]['rebound']:.3f} | {means[c]['val_loss']:.3f} | {means[c]['diverged']}/{len(rs)} | "
            f"{means[c]['grad_norm_spike']:.1f} | {means[c]['clipped_fraction']:.0%} |"
        )
    lines += _depth_verdict(rows, means, hp)
    if all(c in means for c in WARMUP_CONFIGS):
        spread = max(float(np.std([r["final_loss"] for r in rows if r["config"] == c])) for c in WARMUP_CONFIGS)
        tol = max(0.05, 2 * spread)
        gap_post = means["post"]["final_loss"] - means["post+warmup"]["final_loss"]
        gap_pre = means["pre"]["final_loss"] - means["pre+warmup"]["final_loss"]
        post_needs = means["post"]["diverged"] > means["post+warmup"]["diverged"] or gap_post > tol
        pre_fine = means["pre"]["diverged"] == 0 and gap_pre <= tol
        n = hp["seeds"]
        lines += [
            "",
            "## The claim, as measured",
            "",
            f"Tolerance for a loss difference: {tol:.3f} (the larger of 0.05 and twice the largest seed-to-seed std of the final loss).",
            "",
            f"- Warmup's effect on post-norm (final loss without - with): {gap_post:+.3f}; diverged without warmup "
            f"{means['post']['diverged']}/{n}, with {means['post+warmup']['diverged']}/{n}; loss rebound (final - lowest 20-step mean) "
            f"{means['post']['rebound']:.3f} without, {means['post+warmup']['rebound']:.3f} with.",
            f"- Warmup's effect on pre-norm: {gap_pre:+.3f}; diverged without {means['pre']['diverged']}/{n}, with "
            f"{means['pre+warmup']['diverged']}/{n}; rebound {means['pre']['rebound']:.3f} without, {means['pre+warmup']['rebound']:.3f} with.",
            f"- Pre-norm vs post-norm, both without warmup: final loss {means['pre']['final_loss']:.3f} vs "
            f"{means['post']['final_loss']:.3f}; max/median gradient norm {means['pre']['grad_norm_spike']:.1f} vs "
            f"{means['post']['grad_norm_spike']:.1f}.",
            f"- \"Pre-norm does not need warmup\": **{'supported' if pre_fine else 'not supported'}** at this scale.",
            f"- \"Post-norm needs warmup\": **{'supported' if post_needs else 'not supported'}** at this scale"
            + ("" if post_needs else ": this warmup did not change post-norm's outcome beyond the tolerance"
               + (" (post-norm does worse than pre-norm with or without it)" if means["post+warmup"]["final_loss"] > means["pre"]["final_loss"] + tol else ""))
            + ".",
        ]
    lines += ["", "![Training loss of every run](loss_curves.png)", "",
              "![Gradient norm before clipping (clip/total_norm)](grad_norm.png)", "",
              "TensorBoard: `tb/` (one folder per run)."]
    return "\n".join(lines) + "\n"


def _depth_verdict(rows: list[dict], means: dict, hp: dict) -> list[str]:
    """The depth-aware forms against the placement each changes (LayerNorm Scaling against pre-norm, DeepNorm against
    post-norm and pre-norm), per seed, with the same tolerance rule as the warmup claim."""
    pairs = [(a, b) for a, b in (("pre+lns", "pre"), ("deepnorm", "post"), ("deepnorm", "pre")) if a in means and b in means]
    if not pairs:
        return []
    present = sorted({c for p in pairs for c in p})
    spread = max(float(np.std([r["final_loss"] for r in rows if r["config"] == c])) for c in present)
    tol = max(0.05, 2 * spread)
    out = ["", "## The depth-aware forms, as measured", "",
           f"At {hp['layers']} layers, {hp['steps']} steps, no warmup. Tolerance for a loss difference: {tol:.3f} (the larger of 0.05 and "
           "twice the largest seed-to-seed std of the final loss). A form is better (worse) where its final training loss "
           "is lower (higher) by more than that on every seed.", ""]
    for a, b in pairs:
        diffs = []
        for seed in sorted({r["seed"] for r in rows}):
            ra = next((r for r in rows if r["config"] == a and r["seed"] == seed), None)
            rb = next((r for r in rows if r["config"] == b and r["seed"] == seed), None)
            if ra is not None and rb is not None:
                diffs.append((seed, ra["final_loss"] - rb["final_loss"], ra["val_loss"] - rb["val_loss"]))
        if all(d < -tol for _, d, _ in diffs):
            word = "better"
        elif all(d > tol for _, d, _ in diffs):
            word = "worse"
        else:
            word = "no difference beyond the tolerance"
        per_seed = "; ".join(f"seed {s}: train {d:+.3f}, val {v:+.3f}" for s, d, v in diffs)
        out.append(f"- `{a}` against `{b}`: **{word}** ({per_seed}); diverged {means[a]['diverged']} against {means[b]['diverged']}; "
                   f"max/median gradient norm {means[a]['grad_norm_spike']:.1f} against {means[b]['grad_norm_spike']:.1f}.")
    return out


def plot(rows: list[dict], all_series: dict, out: Path) -> None:
    from ln_lightning._extras import require

    matplotlib = require("matplotlib", "plot", "warmup_study.py's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"post": "C3", "post+warmup": "C1", "pre": "C0", "pre+warmup": "C2", "pre+lns": "C4", "deepnorm": "C5"}
    for key, fname, ylabel, log in [("loss", "loss_curves.png", "train/loss", False), ("total_norm", "grad_norm.png", "clip/total_norm (before clipping)", True)]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            steps, vals = all_series[run_name(r["config"], r["seed"])][key]
            ax.plot(steps, vals, color=colors[r["config"]], lw=1, alpha=0.8, ls="-" if r["seed"] == 0 else "--",
                    label=f"{r['config']} seed {r['seed']}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, a few steps, one seed")
    p.add_argument("--out", default="outputs/warmup_study")
    p.add_argument("--jobs", type=int, default=None, help="runs at a time, each a subprocess with one thread; 0 runs them "
                   "one after another in this process (default: 2, quick: 0)")
    for k, v in FULL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None, help=f"default {v} (quick: {QUICK[k]})")
    p.add_argument("--val-batches", type=int, default=None, help="validation batches at the end (default 20, quick 0)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                   help=f"which configs to run (default: {' '.join(WARMUP_CONFIGS)})")
    p.add_argument("--report-only", action="store_true", help="rebuild results.md and plots from the runs already in --out")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one config
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    hp = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    hp["val_batches"] = args.val_batches if args.val_batches is not None else (0 if args.quick else 20)
    hp["jobs"] = args.jobs if args.jobs is not None else (0 if args.quick else 2)
    hp["configs"] = list(args.configs or WARMUP_CONFIGS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.worker:
        meta = train_one(args.worker, args.seed, hp, out)
        (out / "runs").mkdir(exist_ok=True)
        (out / "runs" / f"{run_name(args.worker, args.seed)}.json").write_text(json.dumps(meta))
        return 0

    t0 = time.time()
    jobs = [(c, s) for s in range(hp["seeds"]) for c in hp["configs"]]
    forwarded = list(argv)
    pending, running, failed = list(jobs) if hp["jobs"] > 0 and not args.report_only else [], [], []
    if args.report_only:
        previous = json.loads((out / "results.json").read_text())
        hp, t0 = previous["hparams"], time.time() - previous["elapsed_s"]
        hp.setdefault("configs", list(WARMUP_CONFIGS))
        jobs = [(c, s) for s in range(hp["seeds"]) for c in hp["configs"]]
        argv = previous.get("argv", argv)
    elif hp["jobs"] == 0:
        (out / "runs").mkdir(exist_ok=True)
        for c, s in jobs:
            meta = train_one(c, s, hp, out)
            (out / "runs" / f"{run_name(c, s)}.json").write_text(json.dumps(meta))
            print(f"finished {c} seed {s} ({time.time() - t0:.0f} s)", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    while pending or running:
        while pending and len(running) < hp["jobs"]:
            c, s = pending.pop(0)
            cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", c, "--seed", str(s)]
            log = open(out / f"{run_name(c, s)}.log", "w")
            running.append(((c, s), subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
            print(f"started {c} seed {s}", flush=True)
        time.sleep(0.5)
        for item in list(running):
            (c, s), proc, log = item
            if proc.poll() is not None:
                running.remove(item)
                log.close()
                print(f"finished {c} seed {s}: exit {proc.returncode} ({time.time() - t0:.0f} s)", flush=True)
                if proc.returncode != 0:
                    failed.append((c, s))
    if failed:
        for c, s in failed:
            print(f"--- {run_name(c, s)}.log (last lines)\n" + "".join(open(out / f"{run_name(c, s)}.log").readlines()[-30:]))
        raise SystemExit(f"warmup_study: {len(failed)} run(s) failed: {failed}")
    rows, all_series = [], {}
    for c, s in jobs:
        meta = json.loads((out / "runs" / f"{run_name(c, s)}.json").read_text())
        series = read_run(meta["log_dir"])
        all_series[run_name(c, s)] = series
        rows.append(summarise(meta, series))
    elapsed = time.time() - t0
    (out / "results.json").write_text(json.dumps({"hparams": hp, "runs": rows, "elapsed_s": elapsed, "argv": argv}, indent=1))
    plot(rows, all_series, out)
    text = render_markdown(json.loads((out / "results.json").read_text()))  # render what the file holds
    (out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
