"""How the residual stream's scale grows with depth at initialisation, measured with StreamNormMonitor.

Stacks of L = 1, 2, 4, ..., 128 blocks of the design document's shape (LayerNorm, then
Linear-GELU-Linear, width 64). For each depth and seed one post-norm stack is built,
`x <- LN(x + F(x))`, and the pre-norm variants are made from copies of it with the product's
`ln_lightning.convert` (so every variant has the same weights):

    post        LN(x + F(x))                      as built
    pre         x + F(LN(x))                      convert(..., "pre", final_norm=False)
    pre_c05    x + 0.5 * F(LN(x))                convert(..., branch_scale=0.5)
    pre_depth   x + F(LN(x)) / sqrt(2L)           convert(..., branch_scale="depth")
    pre_final   x + F(LN(x)), then a final LN     convert(..., final_norm=True)

plus `pre_direct`, the same weights loaded into `ln_lightning.demo.PreNormBlock` stacks, as a check
that the converted stack computes what a pre-norm stack written by hand computes.

The residual-stream rms per block and each block's relative update are measured by
`StreamNormMonitor` itself: one Lightning training step with learning rate 0 on a fixed random
input batch, logged to TensorBoard, read back with TensorBoard's EventAccumulator.

Run:
    python examples/depth_scaling.py            # full: L up to 128, 3 seeds (a few minutes on 2 cores)
    python examples/depth_scaling.py --quick    # smoke test: L up to 8, 1 seed

Writes into --out (default outputs/depth_scaling): results.md, results.json, rms_by_block.png,
final_rms_vs_depth.png, update_ratio_vs_depth.png and tb/ (TensorBoard logs of every run).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ln_lightning.callbacks import StreamNormMonitor
from ln_lightning.demo import PreNormBlock
from ln_lightning.placement import convert

WIDTH = 64
BRANCH_SCALE_C = 0.5


class PostNormMLPBlock(nn.Module):
    """The design document's block with the norm after the sum: `x <- LN(x + fc(x))`.

    Same submodule names as `PreNormBlock` (`ln1`, `fc`), so converted weights load into one.
    """

    def __init__(self, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.fc = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln1(x + self.fc(x))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class DepthProbe(L.LightningModule):
    """All variants of one depth and seed, fed the same input; a step at lr=0 changes nothing."""

    def __init__(self, stacks: dict[str, nn.Module], x0: torch.Tensor):
        super().__init__()
        self.variants = nn.ModuleDict(stacks)
        self.register_buffer("x0", x0)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: stack(x) for name, stack in self.variants.items()}

    def training_step(self, batch, batch_idx):
        # Forward only: the monitor measures activations, and without a loss Lightning skips the backward.
        with torch.no_grad():
            self(self.x0)
        return None

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(1, 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def build_variants(depth: int, seed: int) -> tuple[dict[str, nn.Module], torch.Tensor, dict]:
    torch.manual_seed(seed)
    post = Stack([PostNormMLPBlock(WIDTH) for _ in range(depth)])
    x0 = torch.randn(8, 16, WIDTH)
    stacks, checks = {"post": post}, {}
    options = {
        "pre": dict(final_norm=False),
        "pre_c05": dict(final_norm=False, branch_scale=BRANCH_SCALE_C),
        "pre_depth": dict(final_norm=False, branch_scale="depth"),
        "pre_final": dict(final_norm=True),
    }
    for name, opts in options.items():
        stack = copy.deepcopy(post)
        report = convert(stack, "pre", strict=True, example_input=x0, **opts)
        if len(report.converted) != depth:
            raise RuntimeError(f"{name}: convert converted {len(report.converted)} of {depth} blocks:\n{report}")
        stacks[name] = stack
    direct = Stack([PreNormBlock(WIDTH) for _ in range(depth)])
    direct.load_state_dict(post.state_dict())
    stacks["pre_direct"] = direct
    with torch.no_grad():
        checks["max_abs_diff_pre_vs_direct"] = (stacks["pre"](x0) - direct(x0)).abs().max().item()
    return stacks, x0, checks


def measure(depth: int, seed: int, tb_dir: Path) -> dict:
    """One lr=0 training step with StreamNormMonitor; the logged per-block rms and update ratio."""
    stacks, x0, checks = build_variants(depth, seed)
    probe = DepthProbe(stacks, x0)
    shutil.rmtree(tb_dir / f"L{depth:03d}" / f"seed{seed}", ignore_errors=True)  # a rerun must not mix in old events
    logger = TensorBoardLogger(str(tb_dir), name=f"L{depth:03d}", version=f"seed{seed}")
    monitor = StreamNormMonitor(every_n_steps=1, log_depth_profile=False)
    trainer = L.Trainer(
        max_steps=1, logger=logger, callbacks=[monitor], accelerator="cpu", devices=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    )
    trainer.fit(probe)
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()

    def scalar(tag: str) -> float:
        return acc.Scalars(tag)[-1].value

    out = {"depth": depth, "seed": seed, "x0_rms": x0.square().mean().sqrt().item(), **checks, "variants": {}}
    with torch.no_grad():  # what the head receives: the stack's output, after the final norm convert added
        out["pre_final_head_rms"] = stacks["pre_final"](x0).square().mean().sqrt().item()
    for name in stacks:
        paths = [p for p in monitor.block_paths if p.startswith(f"variants.{name}.blocks.")]
        if len(paths) != depth:
            raise RuntimeError(f"StreamNormMonitor found {len(paths)} blocks of {name}, expected {depth}: {monitor.block_paths}")
        paths.sort(key=lambda p: int(p.rsplit(".", 1)[1]))
        out["variants"][name] = {
            "rms": [scalar(f"stream/rms/{p}") for p in paths],
            "update_ratio": [scalar(f"stream/update_ratio/{p}") for p in paths],
        }
    return out


# ------------------------------------------------------------------------------------------ fits


def ols(x: np.ndarray, y: np.ndarray) -> dict:
    """Least-squares line y = a + b x: slope, its standard error, intercept, R^2."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    n = len(x)
    xm, ym = x.mean(), y.mean()
    sxx = ((x - xm) ** 2).sum()
    b = ((x - xm) * (y - ym)).sum() / sxx
    a = ym - b * xm
    resid = y - a - b * x
    s2 = (resid**2).sum() / max(n - 2, 1)
    ss_tot = ((y - ym) ** 2).sum()
    return {"slope": b, "slope_se": math.sqrt(s2 / sxx), "intercept": a, "r2": 1 - (resid**2).sum() / ss_tot if ss_tot > 0 else 1.0, "n": n}


def final_stream_rms(run: dict, variant: str) -> float:
    """rms of the stream after the last block (for pre_final: the input of the final norm)."""
    # For pre_final the monitor's last-block value is the stream entering the final norm (its hook on the
    # block runs before the final norm's).
    return run["variants"][variant]["rms"][-1]


def analyse(runs: list[dict]) -> dict:
    depths = sorted({r["depth"] for r in runs})
    res: dict = {"depths": depths, "seeds": sorted({r["seed"] for r in runs})}

    def pts(variant, fn):
        return np.array([r["depth"] for r in runs], float), np.array([fn(r, variant) for r in runs], float)

    last = lambda r, v: r["variants"][v]["rms"][-1]  # noqa: E731
    big = [d for d in depths if d >= 16]
    for v in ["pre", "pre_c05", "pre_depth", "post"]:
        x, y = pts(v, last)
        entry = {"loglog_all": ols(np.log(x), np.log(y))}
        if len(big) >= 2:
            m = x >= 16
            entry["loglog_L>=16"] = ols(np.log(x[m]), np.log(y[m]))
        entry["var_linear"] = ols(x, y**2)  # additive model: rms^2 = v0 + q L
        # The accumulated part alone, sqrt(rms^2 - rms(x0)^2): sqrt(L q) under the additive model, slope 0.5 at every L.
        v0s = np.array([r["x0_rms"] ** 2 for r in runs])
        acc = y**2 - v0s
        if (acc > 0).all():
            entry["loglog_accumulated"] = ols(np.log(x), 0.5 * np.log(acc))
        entry["max_rms_any_block"] = max(max(r["variants"][v]["rms"]) for r in runs)
        entry["final_rms_by_depth"] = {d: float(np.mean([last(r, v) for r in runs if r["depth"] == d])) for d in depths}
        res[v] = entry
    # q from the single-block update: rms(F(LN x0))^2 = (update_ratio of block 0 * rms(x0))^2.
    q1 = np.mean([(r["variants"]["pre"]["update_ratio"][0] * r["x0_rms"]) ** 2 for r in runs])
    v0 = np.mean([r["x0_rms"] ** 2 for r in runs])
    res["q_from_block0"] = float(q1)
    res["v0"] = float(v0)
    res["pre_predicted_final_rms"] = {d: math.sqrt(v0 + d * q1) for d in depths}
    res["pre_depth_predicted_bound"] = math.sqrt(v0 + q1 / 2)
    # Relative update of the last block, and the mean over the stack's blocks, vs depth.
    for v in ["pre", "pre_c05"]:
        x = np.array([r["depth"] for r in runs], float)
        y_last = np.array([r["variants"][v]["update_ratio"][-1] for r in runs])
        y_mean = np.array([np.mean(r["variants"][v]["update_ratio"]) for r in runs])
        res[f"{v}_update_last"] = {"all": ols(np.log(x), np.log(y_last))}
        res[f"{v}_update_mean"] = {"all": ols(np.log(x), np.log(y_mean))}
        if len(big) >= 2:
            m = x >= 16
            res[f"{v}_update_last"]["L>=16"] = ols(np.log(x[m]), np.log(y_last[m]))
            res[f"{v}_update_mean"]["L>=16"] = ols(np.log(x[m]), np.log(y_mean[m]))
        res[f"{v}_update_last"]["by_depth"] = {d: float(np.mean([r["variants"][v]["update_ratio"][-1] for r in runs if r["depth"] == d])) for d in depths}
    res["pre_update_predicted"] = {d: math.sqrt(q1 / (v0 + (d - 1) * q1)) for d in depths}
    res["pre_update_inv2"] = ols(
        np.array([r["depth"] for r in runs], float), np.array([r["variants"]["pre"]["update_ratio"][-1] ** -2 for r in runs])
    )
    res["pre_final_last_block_rms"] = float(np.mean([r["variants"]["pre_final"]["rms"][-1] for r in runs]))
    res["pre_final_last_block_rms_by_depth"] = {d: float(np.mean([r["variants"]["pre_final"]["rms"][-1] for r in runs if r["depth"] == d])) for d in depths}
    res["pre_final_head_rms_by_depth"] = {d: float(np.mean([r["pre_final_head_rms"] for r in runs if r["depth"] == d])) for d in depths}
    res["pre_final_vs_pre_max_rel"] = float(max(abs(r["variants"]["pre_final"]["rms"][-1] / r["variants"]["pre"]["rms"][-1] - 1) for r in runs))
    res["pre_final_last_block_update_ratio"] = float(np.mean([r["variants"]["pre_final"]["update_ratio"][-1] for r in runs if r["depth"] > 1]) if max(depths) > 1 else float("nan"))
    res["post_update_last_by_depth"] = {d: float(np.mean([r["variants"]["post"]["update_ratio"][-1] for r in runs if r["depth"] == d])) for d in depths}
    res["max_abs_diff_pre_vs_direct"] = max(r["max_abs_diff_pre_vs_direct"] for r in runs)
    res["max_rel_diff_monitor_pre_vs_direct"] = max(
        abs(a - b) / b for r in runs for a, b in zip(r["variants"]["pre"]["rms"], r["variants"]["pre_direct"]["rms"])
    )
    return res


def fmt_fit(f: dict) -> str:
    return f"{f['slope']:.3f} ± {f['slope_se']:.3f} (R² {f['r2']:.3f}, n={f['n']})"


def render_markdown(results: dict) -> str:
    """results.md from results.json's content (the docs build renders the results page with this too)."""
    res, argv, elapsed = analyse(results["runs"]), results["argv"], results["elapsed_s"]
    d = res["depths"]
    pre, c05, dep, post = res["pre"], res["pre_c05"], res["pre_depth"], res["post"]
    lines = [
        "# depth_scaling: residual-stream rms at initialisation vs depth",
        "",
        f"Command: `python examples/depth_scaling.py {' '.join(argv)}` ({elapsed:.0f} s). Width {WIDTH}, input "
        f"`randn(8, 16, {WIDTH})` (v0 = {res['v0']:.3f}), seeds {res['seeds']}, depths {d}. "
        "Values: StreamNormMonitor's `stream/rms/BLOCK` and `stream/update_ratio/BLOCK`, read back from TensorBoard. "
        "Slopes: least squares over all (depth, seed) points, ± one standard error.",
        "",
        "## Final-block stream rms (mean over seeds)",
        "",
        "| L | post | pre | pre, c=0.5 | pre, depth (1/sqrt(2L)) | pre + final norm: head input | additive prediction sqrt(v0 + L q) |",
        "|---|---|---|---|---|---|---|",
    ]
    for L_ in d:
        lines.append(
            f"| {L_} | {post['final_rms_by_depth'][L_]:.3f} | {pre['final_rms_by_depth'][L_]:.3f} | "
            f"{c05['final_rms_by_depth'][L_]:.3f} | {dep['final_rms_by_depth'][L_]:.3f} | "
            f"{res['pre_final_head_rms_by_depth'][L_]:.3f} | {res['pre_predicted_final_rms'][L_]:.3f} |"
        )
    q = res["q_from_block0"]
    big = "loglog_L>=16" in pre

    def verdict(ok: bool) -> str:
        return "**supported**" if ok else "**not supported**"

    claims = [
        ("Pre-norm stream variance grows additively, v0 + L·q",
         f"rms² vs L is linear: q = {pre['var_linear']['slope']:.4f} ± {pre['var_linear']['slope_se']:.4f}, "
         f"v0 = {pre['var_linear']['intercept']:.3f}, R² {pre['var_linear']['r2']:.4f}; q predicted from block 0's "
         f"own update = {q:.4f}",
         pre["var_linear"]["r2"] > 0.98 and abs(pre["var_linear"]["slope"] - q) < 0.25 * q),
        ("...so the rms grows like sqrt(L): log-log slope of the final rms vs L is 0.5",
         (f"slope over L≥16: {fmt_fit(pre['loglog_L>=16'])}; over all L: {fmt_fit(pre['loglog_all'])}. "
          f"v0 dominates until L·q ≫ v0, i.e. L ≫ {res['v0'] / q:.0f} here, so at these depths the slope is below 0.5")
         if big else f"slope over all L: {fmt_fit(pre['loglog_all'])}",
         big and abs(pre["loglog_L>=16"]["slope"] - 0.5) < 0.1),
        ("...the accumulated part sqrt(rms² - v0) grows like sqrt(L): slope 0.5",
         f"slope over all L: {fmt_fit(pre['loglog_accumulated'])}" if "loglog_accumulated" in pre else "rms² ≤ v0 at some depth: not measurable",
         "loglog_accumulated" in pre and abs(pre["loglog_accumulated"]["slope"] - 0.5) < 0.1),
        ("Post-norm stays bounded",
         f"max rms of any block output at any depth: {post['max_rms_any_block']:.4f}; log-log slope {fmt_fit(post['loglog_all'])}",
         post["max_rms_any_block"] < 1.01),
        ("Constant branch scale c < 1 slows the growth",
         f"c = {BRANCH_SCALE_C}: q_c = {c05['var_linear']['slope']:.4f} vs q = {pre['var_linear']['slope']:.4f} "
         f"(ratio {c05['var_linear']['slope'] / pre['var_linear']['slope']:.3f}, c² = {BRANCH_SCALE_C ** 2})",
         c05["var_linear"]["slope"] < pre["var_linear"]["slope"]),
        ("...bounding the accumulated variance by a geometric sum (design doc)",
         f"the variance still grows linearly in L (R² {c05['var_linear']['r2']:.4f}); log-log slope over "
         + (f"L≥16 {fmt_fit(c05['loglog_L>=16'])}" if big else f"all L {fmt_fit(c05['loglog_all'])}")
         + ". With a normalised branch input each branch adds c²q whatever the stream's size, an arithmetic sum; "
         "a geometric bound needs the stream itself scaled (x <- c·x + F), which convert does not do",
         False),
        ("Depth scaling c = 1/sqrt(2L) bounds the total variance (v0 + q/2)",
         f"final rms over depths: {min(dep['final_rms_by_depth'].values()):.3f} .. {max(dep['final_rms_by_depth'].values()):.3f}; "
         f"predicted bound sqrt(v0 + q/2) = {res['pre_depth_predicted_bound']:.3f}; log-log slope {fmt_fit(dep['loglog_all'])}",
         max(dep["final_rms_by_depth"].values()) < 1.1 * res["pre_depth_predicted_bound"]),
        ("Each block's relative update shrinks like 1/sqrt(L): slope -0.5",
         (f"last block's stream/update_ratio, L≥16: {fmt_fit(res['pre_update_last']['L>=16'])}; all L: "
          f"{fmt_fit(res['pre_update_last']['all'])}; mean over a stack's blocks, L≥16: {fmt_fit(res['pre_update_mean']['L>=16'])}. "
          f"The additive model predicts sqrt(q / (v0 + (L-1) q)): {res['pre_update_predicted'][res['depths'][-1]]:.4f} at "
          f"L={res['depths'][-1]}, measured {res['pre_update_last']['by_depth'][res['depths'][-1]]:.4f}; its slope reaches -0.5 only for L ≫ v0/q")
         if big else f"last block, all L: {fmt_fit(res['pre_update_last']['all'])}",
         big and abs(res["pre_update_last"]["L>=16"]["slope"] + 0.5) < 0.1),
        ("...with the 1/sqrt(L) law holding for the accumulated stream: 1/ratio² = (v0 + (L-1) q)/q is linear in L",
         f"1/ratio² of the last block vs L: slope {res['pre_update_inv2']['slope']:.2f} ± {res['pre_update_inv2']['slope_se']:.2f} "
         f"(R² {res['pre_update_inv2']['r2']:.4f}); predicted slope 1, intercept v0/q - 1 = {res['v0'] / q - 1:.1f} "
         f"(measured {res['pre_update_inv2']['intercept']:.1f})",
         abs(res["pre_update_inv2"]["slope"] - 1) < max(0.1, 2 * res["pre_update_inv2"]["slope_se"])),
        ("A final norm gives the head a controlled input",
         "the head's input (the stack's output after the final norm convert added) has rms "
         f"{min(res['pre_final_head_rms_by_depth'].values()):.3f} .. {max(res['pre_final_head_rms_by_depth'].values()):.3f} over depths, "
         f"while the stream entering it grows like the pre column",
         all(abs(v - 1) < 0.05 for v in res["pre_final_head_rms_by_depth"].values())),
    ]
    lines += ["", f"## The design's claims (q = {q:.4f} per block, measured)", "", "| claim | measured | verdict |", "|---|---|---|"]
    for claim, figure, ok in claims:
        lines.append(f"| {claim} | {figure} | {verdict(ok)} |")
    lines += [
        "",
        "## Checks and notes",
        "",
        f"- convert's pre-norm stack vs the same weights in hand-written `PreNormBlock`s: max |Δ output| = "
        f"{res['max_abs_diff_pre_vs_direct']:.2e}; StreamNormMonitor's rms for the two differs by at most "
        f"{res['max_rel_diff_monitor_pre_vs_direct']:.1e} (relative).",
        "- With `final_norm=True`, StreamNormMonitor's last-block values are the stream entering the final norm "
        f"(they equal the pre column's to {res['pre_final_vs_pre_max_rel']:.1e} relative); the head's input is measured "
        "directly as the stack's output.",
        "- Post-norm's last-block update ratio rms(LN(x+F(x)) - x)/rms(x) is "
        f"{min(res['post_update_last_by_depth'].values()):.3f} .. {max(res['post_update_last_by_depth'].values()):.3f} over depths "
        "(the stream is reset every block): the 1/sqrt(L) dilution is a pre-norm property.",
        f"- The design's \"a stack of a hundred blocks is a factor of ten\" assumes q ≈ v0. With nn.Linear's default "
        f"initialisation the branch adds q = {q:.4f} = {q / res['v0']:.3f}·v0 per block, so the pre-norm stream's rms at "
        f"L = {d[-1]} is {pre['final_rms_by_depth'][d[-1]] / math.sqrt(res['v0']):.2f}× its input's, as sqrt(1 + L q/v0) predicts "
        f"({math.sqrt(1 + d[-1] * q / res['v0']):.2f}).",
        "",
        "![Final residual-stream rms against depth, per placement](final_rms_vs_depth.png)",
        "",
        "![Stream rms per block](rms_by_block.png)",
        "",
        "![The last block's relative update against depth](update_ratio_vs_depth.png)",
        "",
        "TensorBoard: `tb/`.",
    ]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], res: dict, out: Path) -> None:
    from ln_lightning._extras import require

    matplotlib = require("matplotlib", "plot", "depth_scaling.py's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = res["depths"]
    seed0 = res["seeds"][0]
    shown = ["post", "pre", "pre_c05", "pre_depth", "pre_final"]
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.6), sharey=True)
    cmap = plt.get_cmap("viridis")
    for ax, v in zip(axes, shown):
        for i, d in enumerate(depths):
            r = next(r for r in runs if r["depth"] == d and r["seed"] == seed0)
            ax.plot(range(1, d + 1), r["variants"][v]["rms"], marker="." if d <= 8 else None, color=cmap(i / max(len(depths) - 1, 1)), label=f"L={d}")
        ax.set_title(v)
        ax.set_xscale("log")
        ax.set_xlabel("block index (1-based)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("stream/rms (StreamNormMonitor)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"residual-stream rms by block at initialisation (seed {seed0})")
    fig.tight_layout()
    fig.savefig(out / "rms_by_block.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    xs = np.array(depths, float)
    for v, color in zip(["post", "pre", "pre_c05", "pre_depth"], ["k", "C0", "C1", "C2"]):
        ys = [[r["variants"][v]["rms"][-1] for r in runs if r["depth"] == d] for d in depths]
        ax.errorbar(xs, [np.mean(y) for y in ys], yerr=[np.std(y) for y in ys], fmt="o", color=color, label=v, capsize=2)
        key = "loglog_L>=16" if "loglog_L>=16" in res[v] else "loglog_all"
        f = res[v][key]
        fx = xs[xs >= 16] if key == "loglog_L>=16" else xs  # draw each fit over the depths it was fitted on
        ax.plot(fx, np.exp(f["intercept"]) * fx ** f["slope"], "--", color=color, lw=1, label=f"{v} fit ({key[7:]}): slope {f['slope']:.3f}±{f['slope_se']:.3f}")
    ax.plot(xs, [res["pre_predicted_final_rms"][d] for d in depths], ":", color="C0", label="sqrt(v0 + L q), q from block 0")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("depth L")
    ax.set_ylabel("final stream rms")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "final_rms_vs_depth.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for v, color in zip(["post", "pre", "pre_c05"], ["k", "C0", "C1"]):
        ys = [np.mean([r["variants"][v]["update_ratio"][-1] for r in runs if r["depth"] == d]) for d in depths]
        ax.plot(xs, ys, "o-", color=color, label=f"{v}: last block")
    if "L>=16" in res["pre_update_last"]:
        f = res["pre_update_last"]["L>=16"]
        fx = xs[xs >= 16]
        ax.plot(fx, np.exp(f["intercept"]) * fx ** f["slope"], "--", color="C0", lw=1, label=f"pre fit L≥16: slope {f['slope']:.3f}±{f['slope_se']:.3f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("depth L")
    ax.set_ylabel("stream/update_ratio = rms(out-in)/rms(in)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "update_ratio_vs_depth.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: depths 1..8, one seed")
    p.add_argument("--out", default="outputs/depth_scaling", help="output folder")
    p.add_argument("--max-depth", type=int, default=None, help="largest depth (a power of 2; default 128, quick 8)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, quick 1)")
    p.add_argument("--report-only", action="store_true", help="rebuild results.md and plots from --out's results.json")
    args = p.parse_args(argv)
    max_depth = args.max_depth or (8 if args.quick else 128)
    n_seeds = args.seeds or (1 if args.quick else 3)
    depths = [2**k for k in range(int(math.log2(max_depth)) + 1)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # tiny matmuls: more threads only add synchronisation
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*is deprecated.*")
    warnings.filterwarnings("ignore", ".*`training_step` returned `None`.*")
    t0 = time.time()
    runs = []
    if args.report_only:
        previous = json.loads((out / "results.json").read_text())
        runs, argv = previous["runs"], previous.get("argv", argv)
        t0 -= previous.get("elapsed_s", 0.0)
        depths = []
    for d in depths:
        for seed in range(n_seeds):
            runs.append(measure(d, seed, out / "tb"))
            print(f"L={d:4d} seed={seed}: final rms post {runs[-1]['variants']['post']['rms'][-1]:.3f}  "
                  f"pre {runs[-1]['variants']['pre']['rms'][-1]:.3f}  depth {runs[-1]['variants']['pre_depth']['rms'][-1]:.3f}", flush=True)
    res = analyse(runs)
    elapsed = time.time() - t0
    (out / "results.json").write_text(json.dumps({"runs": runs, "analysis": res, "elapsed_s": elapsed, "argv": argv}, indent=1, default=float))
    plot(runs, res, out)
    text = render_markdown(json.loads((out / "results.json").read_text()))  # render what the file holds
    (out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
