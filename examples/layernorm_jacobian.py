"""LayerNorm's Jacobian grows like |gamma|/sigma as the input's spread sigma shrinks, up to |gamma|/sqrt(eps).

Part 1 (the function): for single rows x = sigma * z (z a fixed standard-normal row of width H,
centred and scaled to unit standard deviation), the spectral norm of d LN(x) / d x, computed with
`torch.autograd.functional.jacobian` in float64, for sigma from 1e-4 to 10 and two gains. The
exact value is |gamma| / sqrt(sigma^2 + eps) for a constant gain (the Jacobian is
(gamma/s) (I - 11^T/H - y y^T/H) with s = sqrt(sigma^2 + eps), whose largest singular value is 1/s
times the gain), so the plot shows the two asymptotes |gamma|/sigma and |gamma|/sqrt(eps).

Part 2 (the monitor): a tiny LightningModule whose block's LayerNorm receives the residual sum
`x + F(x)` with a branch `F(x) = -a * x` that the objective drives to cancel the stream (a -> 1), so
the norm's input variance collapses step by step. Trained with `LayerNormInputMonitor`, the logged
`ln/amp_max/NORM` climbs to 1/sqrt(eps) and the monitor's warning fires; the script captures the
warning, and plots the logged (sqrt(var_min), amp_max) points on part 1's curve.

Run:
    python examples/layernorm_jacobian.py          # full: 41 sigmas at H=64, 11 at H=768, gains 1 and 0.1
    python examples/layernorm_jacobian.py --quick  # smoke test: 9 sigmas, H=64

Writes into --out (default outputs/layernorm_jacobian): results.md, results.json, jacobian_norm.png, tb/.
"""

from __future__ import annotations

import argparse
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

EPS = 1e-5  # nn.LayerNorm's default


def jacobian_spectral_norm(width: int, sigma: float, gain: float, eps: float = EPS, seed: int = 0) -> float:
    """Largest singular value of d LN(x)/dx at x = sigma * z (z centred, unit std), float64."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(width, generator=g, dtype=torch.float64)
    z = (z - z.mean()) / z.std(correction=0)
    ln = nn.LayerNorm(width, eps=eps).double()
    with torch.no_grad():
        ln.weight.fill_(gain)
    jac = torch.autograd.functional.jacobian(lambda v: ln(v), sigma * z, vectorize=True)
    return torch.linalg.matrix_norm(jac, ord=2).item()


def part1(sigmas_by_width: dict[int, list[float]], gains: list[float]) -> list[dict]:
    rows = []
    for width, sigmas in sigmas_by_width.items():
        for gain in gains:
            for sigma in sigmas:
                measured = jacobian_spectral_norm(width, sigma, gain)
                exact = abs(gain) / math.sqrt(sigma**2 + EPS)
                rows.append({"width": width, "gain": gain, "sigma": sigma, "jac_norm": measured, "exact": exact,
                             "one_over_sigma": abs(gain) / sigma, "bound": abs(gain) / math.sqrt(EPS)})
    return rows


# ------------------------------------------------------------------------------------------ part 2


class CancellingBlock(nn.Module):
    """`LN(x - a * x)`: a residual sum whose branch, `-a * x`, learns to cancel the stream (a -> 1)."""

    def __init__(self, d: int, a0: float = 0.5):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a0)))
        self.ln = nn.LayerNorm(d)
        self.last_sum: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_sum = x - self.a * x  # the penalised sum; the norm gets the same values with `a` detached:
        # the task gradient reaching `a` through a near-degenerate norm is itself amplified like 1/sigma (this
        # example's point) and throws `a` back from 1, which would turn the collapse into oscillation.
        return self.ln(x - self.a.detach() * x)


def part2(out: Path, steps: int, width: int = 64) -> dict:
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ln_lightning.callbacks import LayerNormInputMonitor

    class Collapsing(L.LightningModule):
        """A regression model whose objective rewards the residual sum cancelling (an auxiliary penalty on it).

        With SGD at lr 0.375 the penalty shrinks (1 - a) by 4x per step, so the norm's input variance falls 16x
        per step and its amplification climbs to 1/sqrt(eps).
        """

        def __init__(self):
            super().__init__()
            self.inp = nn.LayerNorm(width)  # a healthy norm, for contrast
            self.blocks = nn.ModuleList([CancellingBlock(width)])
            self.head = nn.Linear(width, 1)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            task = nn.functional.mse_loss(self(x).squeeze(-1), y)
            return task + self.blocks[0].last_sum.square().mean()

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(512, width, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, 0]), batch_size=64)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.375)

    torch.manual_seed(0)
    model = Collapsing()
    monitor = LayerNormInputMonitor(every_n_steps=1, warn_amp_fraction=0.5, warn_cooldown=1000)
    shutil.rmtree(out / "tb" / "collapsing_ln", ignore_errors=True)  # a rerun must not mix in old events
    logger = TensorBoardLogger(str(out / "tb"), name="collapsing_ln", version="")
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=logger, callbacks=[monitor],
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    logger.experiment.flush()
    fired = [str(w.message) for w in caught if "LayerNormInputMonitor" in str(w.message)]
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    res = {"steps": steps, "bound": 1 / math.sqrt(EPS), "warnings": fired, "norms": {}}
    for path in monitor.norm_paths:
        amp = [e.value for e in acc.Scalars(f"ln/amp_max/{path}")] if f"ln/amp_max/{path}" in tags else []
        var_min = [e.value for e in acc.Scalars(f"ln/var_min/{path}")] if f"ln/var_min/{path}" in tags else []
        # The Jacobian norm of part 1 at the logged minimum variance, for the monitored quantity's meaning.
        jac = jacobian_spectral_norm(width, math.sqrt(max(var_min[-1], 0.0)), 1.0) if var_min else float("nan")
        res["norms"][path] = {"amp_max": amp, "var_min": var_min, "jacobian_norm_at_var_min": jac}
    return res


# ------------------------------------------------------------------------------------------ report


def plot(rows: list[dict], out: Path, mon: dict | None = None) -> None:
    from ln_lightning._extras import require

    matplotlib = require("matplotlib", "plot", "layernorm_jacobian.py's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    keys = sorted({(r["width"], r["gain"]) for r in rows})
    for i, (w, g) in enumerate(keys):
        rs = [r for r in rows if r["width"] == w and r["gain"] == g]
        s = np.array([r["sigma"] for r in rs])
        ax.loglog(s, [r["jac_norm"] for r in rs], "o", ms=4, color=f"C{i}", label=f"measured, H={w}, gamma={g}")
        ax.loglog(s, abs(g) / s, ":", color=f"C{i}", lw=1)
        ax.axhline(abs(g) / math.sqrt(EPS), color=f"C{i}", ls="--", lw=1)
    if mon is not None:
        for j, (path, n) in enumerate(mon["norms"].items()):
            ax.loglog(np.sqrt(np.maximum(n["var_min"], 1e-30)), n["amp_max"], "x-", ms=7, color=f"C{len(keys) + j}",
                      label=f"LayerNormInputMonitor: {path} (sqrt(var_min), amp_max) per step")
    ax.plot([], [], "k:", label="|gamma| / sigma")
    ax.plot([], [], "k--", label="|gamma| / sqrt(eps)")
    ax.axvline(math.sqrt(EPS), color="grey", lw=0.8)
    ax.text(math.sqrt(EPS) * 1.1, ax.get_ylim()[0] * 2, "sigma = sqrt(eps)", color="grey", fontsize=8)
    ax.set_xlabel("input standard deviation sigma")
    ax.set_ylabel("spectral norm of d LN(x) / dx")
    ax.set_title(f"LayerNorm Jacobian vs input spread (eps = {EPS:g})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "jacobian_norm.png", dpi=110)
    plt.close(fig)


def render_markdown(results: dict) -> str:
    """results.md from results.json's content (the docs build renders the results page with this too)."""
    rows, mon, argv, elapsed = results["jacobian"], results["monitor"], results["argv"], results["elapsed_s"]
    max_rel = max(abs(r["jac_norm"] - r["exact"]) / r["exact"] for r in rows)
    big = [r for r in rows if r["sigma"] >= 100 * math.sqrt(EPS)]
    small = [r for r in rows if r["sigma"] <= math.sqrt(EPS) / 10]
    lines = [
        "# layernorm_jacobian: the 1/sigma amplification and its 1/sqrt(eps) bound",
        "",
        f"Command: `python examples/layernorm_jacobian.py {' '.join(argv)}` ({elapsed:.0f} s). eps = {EPS:g}, "
        "spectral norms of `torch.autograd.functional.jacobian` of `nn.LayerNorm` on single rows, float64.",
        "",
        "| H | gamma | sigma | ‖J‖₂ measured | |gamma|/sqrt(sigma²+eps) | |gamma|/sigma | |gamma|/sqrt(eps) |",
        "|---|---|---|---|---|---|---|",
    ]
    decades = {10.0**k for k in range(-4, 2)}
    for r in rows:
        if any(math.isclose(r["sigma"], d, rel_tol=1e-9) for d in decades):
            lines.append(f"| {r['width']} | {r['gain']} | {r['sigma']:.0e} | {r['jac_norm']:.4g} | {r['exact']:.4g} | "
                         f"{r['one_over_sigma']:.4g} | {r['bound']:.4g} |")
    lines += [
        "",
        f"- Measured vs |gamma|/sqrt(sigma²+eps): max relative difference {max_rel:.1e} over {len(rows)} points.",
    ]
    if big:
        lines.append(f"- For sigma ≥ 100·sqrt(eps): ‖J‖·sigma/|gamma| = {min(r['jac_norm'] * r['sigma'] / abs(r['gain']) for r in big):.4f}"
                     f" .. {max(r['jac_norm'] * r['sigma'] / abs(r['gain']) for r in big):.4f} (the 1/sigma law).")
    if small:
        lines.append(f"- For sigma ≤ sqrt(eps)/10: ‖J‖·sqrt(eps)/|gamma| = {min(r['jac_norm'] * math.sqrt(EPS) / abs(r['gain']) for r in small):.4f}"
                     f" .. {max(r['jac_norm'] * math.sqrt(EPS) / abs(r['gain']) for r in small):.4f} (the plateau at 1/sqrt(eps)).")
    lines += [
        "",
        f"## LayerNormInputMonitor on a collapsing norm ({mon['steps']} steps, bound 1/sqrt(eps) = {mon['bound']:.1f})",
        "",
        "`blocks.0.ln` normalises `x - a*x` while the objective drives a -> 1; `inp` is a healthy norm. Per logged step:",
        "",
        "| step | " + " | ".join(f"{p} var_min | {p} amp_max (÷ bound)" for p in mon["norms"]) + " |",
        "|---|" + "---|---|" * len(mon["norms"]),
    ]
    n_steps = max(len(n["amp_max"]) for n in mon["norms"].values())
    for i in range(n_steps):
        cells = []
        for n in mon["norms"].values():
            if i < len(n["amp_max"]):
                cells.append(f"{n['var_min'][i]:.3g} | {n['amp_max'][i]:.4g} ({n['amp_max'][i] / mon['bound']:.0%})")
            else:
                cells.append(" | ")
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines += ["", "Check: ‖J‖₂ of part 1 at the last logged var_min (the monitor's amp_max is the Jacobian's norm for gamma = 1): "
              + "; ".join(f"{p}: amp_max {n['amp_max'][-1]:.4g} vs ‖J‖₂ {n['jacobian_norm_at_var_min']:.4g}" for p, n in mon["norms"].items() if n["amp_max"])]
    lines += ["", f"Warnings captured: {len(mon['warnings'])}."]
    for w in mon["warnings"][:2]:
        lines += ["", "```", w, "```"]
    if not mon["warnings"]:
        lines.append("**The monitor's warning did not fire** (expected: amp_max above half the bound).")
    lines += ["", "![LayerNorm Jacobian norm against the input's standard deviation](jacobian_norm.png)", "",
              "TensorBoard: `tb/collapsing_ln`."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: 9 sigmas, H=64, 6 monitored steps")
    p.add_argument("--out", default="outputs/layernorm_jacobian")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    t0 = time.time()
    if args.quick:
        sigmas = {64: list(np.logspace(-4, 1, 9))}
    else:  # the SVD of a 768x768 Jacobian takes a second or two: fewer points at BERT-base width
        sigmas = {64: list(np.logspace(-4, 1, 41)), 768: list(np.logspace(-4, 1, 11))}
    rows = part1(sigmas, gains=[1.0, 0.1] if not args.quick else [1.0])
    mon = part2(out, steps=6 if args.quick else 12)
    plot(rows, out, mon)
    elapsed = time.time() - t0
    results = {"jacobian": rows, "monitor": mon, "argv": argv, "elapsed_s": elapsed}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = render_markdown(results)
    (out / "results.md").write_text(text)
    print(text)
    if not mon["warnings"]:
        print("layernorm_jacobian: LayerNormInputMonitor did not warn on the collapsing norm", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
