"""Migrate an existing post-norm model to pre-norm end to end, and serve the checkpoint elsewhere.

For two models written the usual way (post-norm, no final norm), defined below:

    encoder   a character LM on `nn.TransformerEncoder` (norm_first=False, causal mask)
    bert      a character LM on Hugging Face `BertModel` from a small `BertConfig` (is_decoder=True:
              causal self-attention; random weights, nothing downloaded). Skipped, with the reason
              printed, when `transformers` is not importable (`pip install ln-lightning[hf]`).

the script
  1. runs `ln-lightning inspect migrate_post_norm:build_MODEL --placement pre` in a subprocess
     (what the blocks are, what the rewrite would change);
  2. trains with `Trainer(plugins=[LNPlacement("pre")], callbacks=[StreamNormMonitor(),
     LayerNormInputMonitor(), ClipAttributionMonitor()], gradient_clip_val=1.0)` on the embedded corpus;
  3. saves the checkpoint and computes the trained model's logits on a fixed probe batch;
  4. in a FRESH Python process (one for both models, after both trained) loads the checkpoint for inference with
     the one-liner
     `model = ln_lightning.load_converted(ModelClass, "path.ckpt")` and computes the same logits;
  5. compares them (max abs difference), and the loss before/after training.

Run:
    python examples/migrate_post_norm.py            # full: 200 steps per model
    python examples/migrate_post_norm.py --quick    # smoke test: 3 steps per model

Writes into --out (default outputs/migrate_post_norm): results.md, results.json, MODEL/inspect.txt,
MODEL/ckpt/last.ckpt, MODEL/stream_rms.png, tb/ (TensorBoard logs with the three monitors).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import lightning as L

HERE = Path(__file__).resolve().parent
VOCAB = 128
CONTEXT = 32


# ------------------------------------------------------------------------------------------ models


class EncoderLM(L.LightningModule):
    """A post-norm character LM on nn.TransformerEncoder, as existing code writes one (no final norm)."""

    def __init__(self, d_model: int = 64, n_layers: int = 4, n_heads: int = 4, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Embedding(CONTEXT, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)
        self.example_input_array = torch.zeros(2, 16, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        return self.head(self.encoder(x, mask=mask, is_causal=True))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class BertLM(L.LightningModule):
    """A character LM on Hugging Face BertModel (post-norm layers), built from a small config: no download."""

    def __init__(self, hidden_size: int = 64, n_layers: int = 4, n_heads: int = 4, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        from transformers import BertConfig, BertModel

        config = BertConfig(
            vocab_size=VOCAB, hidden_size=hidden_size, num_hidden_layers=n_layers, num_attention_heads=n_heads,
            intermediate_size=4 * hidden_size, max_position_embeddings=CONTEXT, is_decoder=True,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(hidden_size, VOCAB)
        self.example_input_array = torch.zeros(2, 16, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.bert(input_ids=idx).last_hidden_state)

    training_step = EncoderLM.training_step

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def build_encoder() -> EncoderLM:
    """Factory for `ln-lightning inspect migrate_post_norm:build_encoder`."""
    torch.manual_seed(0)
    return EncoderLM()


def build_bert() -> BertLM:
    """Factory for `ln-lightning inspect migrate_post_norm:build_bert`."""
    torch.manual_seed(0)
    return BertLM()


MODELS = {"encoder": (EncoderLM, "build_encoder"), "bert": (BertLM, "build_bert")}


def transformers_missing() -> str | None:
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        return f"transformers is not importable ({err}); install the hf extra: pip install 'ln-lightning[hf]'"
    return None


# ------------------------------------------------------------------------------------------ steps


def data_loaders(batch_size: int):
    from torch.utils.data import DataLoader

    from ln_lightning.demo import CharCorpus, stdlib_corpus_text

    text = stdlib_corpus_text(200_000)
    train = CharCorpus(text[:180_000], CONTEXT)
    probe = torch.stack([CharCorpus(text[180_000:], CONTEXT)[i][0] for i in range(8)])
    return DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True), probe


def run_inspect(kind: str, out: Path) -> str:
    """`ln-lightning inspect` in a subprocess, exactly as a user would type it (from this folder)."""
    exe = shutil.which("ln-lightning")
    cmd = [exe] if exe else [sys.executable, "-c", "import sys; from ln_lightning.cli import main; sys.exit(main())"]
    cmd += ["inspect", f"migrate_post_norm:{MODELS[kind][1]}", "--placement", "pre"]
    proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=300)
    text = proc.stdout + (f"\n[stderr]\n{proc.stderr}" if proc.returncode else "")
    (out / "inspect.txt").write_text(f"$ {' '.join(Path(cmd[0]).name if i == 0 else c for i, c in enumerate(cmd))}\n{text}")
    if proc.returncode != 0:
        raise RuntimeError(f"ln-lightning inspect failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout


def train(kind: str, steps: int, out: Path, tb: Path) -> dict:
    from lightning.pytorch.loggers import TensorBoardLogger

    from ln_lightning import LNPlacement
    from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor

    torch.manual_seed(0)  # the same initial weights and batch order on every run
    model = MODELS[kind][0]()
    loader, probe = data_loaders(batch_size=16)
    with torch.no_grad():
        model.eval()
        before = F.cross_entropy(model(probe[:, :-1]).reshape(-1, VOCAB), probe[:, 1:].reshape(-1)).item()
    model.train()
    shutil.rmtree(tb / kind, ignore_errors=True)
    logger = TensorBoardLogger(str(tb), name=kind, version="")
    placement = LNPlacement("pre", fused=False)
    monitors = [StreamNormMonitor(), LayerNormInputMonitor(), ClipAttributionMonitor()]
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=logger, plugins=[placement], callbacks=monitors,
        gradient_clip_val=1.0, log_every_n_steps=max(1, steps // 10), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=loader)
    ckpt = out / "ckpt" / "last.ckpt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(ckpt)
    model.eval()
    with torch.no_grad():
        logits = model(probe)
        after = F.cross_entropy(model(probe[:, :-1]).reshape(-1, VOCAB), probe[:, 1:].reshape(-1)).item()
    torch.save({"probe": probe, "logits": logits}, out / "probe.pt")
    logger.experiment.flush()
    return {
        "ckpt": str(ckpt), "loss_before": before, "loss_after": after, "steps": steps,
        "report": placement.report.summary() if placement.report is not None else "(no report)",
        "added": list(placement.report.added) if placement.report is not None else [],
        "monitored_blocks": monitors[0].block_paths, "monitored_norms": len(monitors[1].norm_paths),
        "log_dir": logger.log_dir,
    }


def infer_in_fresh_process(kinds: list[str], out: Path) -> dict[str, dict]:
    """One fresh process loads each model's checkpoint in turn (a process start costs more than the models' work)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--infer", ",".join(kinds), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=HERE)
    if proc.returncode != 0:
        raise RuntimeError(f"inference in a fresh process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    results = {}
    for kind in kinds:
        fresh = torch.load(out / kind / "fresh_logits.pt")
        mine = torch.load(out / kind / "probe.pt")
        said = [line for line in lines if f" loaded {MODELS[kind][0].__name__} " in line]
        results[kind] = {"max_abs_diff": (fresh - mine["logits"]).abs().max().item(),
                         "logit_scale": mine["logits"].abs().max().item(),
                         "fresh_stdout": "\n".join(said), **json.loads((out / kind / "fresh_info.json").read_text())}
    return results


def infer_main(kind: str, out: Path) -> int:
    """The fresh process: nothing here knows about the training run but the checkpoint file."""
    from ln_lightning import load_converted

    model = load_converted(MODELS[kind][0], out / "ckpt" / "last.ckpt")  # the documented one-liner
    probe = torch.load(out / "probe.pt")["probe"]
    with torch.no_grad():
        logits = model(probe)
    torch.save(logits, out / "fresh_logits.pt")
    # What loading it the usual way does: the rewrite leaves a marker buffer in the state_dict, so a strict load
    # into the unconverted class fails loudly; strict=False would silently compute the post-norm function.
    cls = MODELS[kind][0]
    try:
        cls.load_from_checkpoint(out / "ckpt" / "last.ckpt", map_location="cpu")
        plain = "loaded without error"
    except Exception as err:  # noqa: BLE001 - we report whatever it raises
        plain = f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
    loose = cls.load_from_checkpoint(out / "ckpt" / "last.ckpt", map_location="cpu", strict=False).eval()
    with torch.no_grad():
        loose_diff = (loose(probe) - logits).abs().max().item()
    (out / "fresh_info.json").write_text(json.dumps({"plain_load": plain, "strict_false_max_abs_diff": loose_diff}))
    print(f"pid {os.getpid()}: loaded {type(model).__name__} (training={model.training}), logits {tuple(logits.shape)}")
    return 0


def read_monitors(log_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    last = {t: acc.Scalars(t)[-1].value for t in tags}
    rms = {t[len("stream/rms/"):]: v for t, v in last.items() if t.startswith("stream/rms/")}
    amp = {t[len("ln/amp_max/"):]: v for t, v in last.items() if t.startswith("ln/amp_max/")}
    share = {t[len("clip/share/"):]: v for t, v in last.items() if t.startswith("clip/share/")}
    return {"n_tags": len(tags), "stream_rms": rms, "amp_max": amp, "clip_share": share,
            "clip_total_norm": last.get("clip/total_norm", float("nan")), "step": max((acc.Scalars(t)[-1].step for t in tags), default=-1)}


def plot_stream(kind: str, mon: dict, out: Path) -> None:
    from ln_lightning._extras import require

    matplotlib = require("matplotlib", "plot", "migrate_post_norm.py's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    names = list(mon["stream_rms"])
    ax.plot(range(len(names)), list(mon["stream_rms"].values()), "o-")
    ax.set_xticks(range(len(names)), [n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in names], rotation=30, fontsize=7)
    ax.set_ylabel("stream/rms (last logged step)")
    ax.set_title(f"{kind}: residual stream after migration to pre-norm")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "stream_rms.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: 3 training steps per model")
    p.add_argument("--out", default="outputs/migrate_post_norm")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200, quick 3)")
    p.add_argument("--models", default="encoder,bert", help="comma-separated: encoder, bert")
    p.add_argument("--infer", default=None, help=argparse.SUPPRESS)  # internal: the fresh inference process
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*is deprecated.*")
    if args.infer:
        return max(infer_main(kind, out / kind) for kind in args.infer.split(","))
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    steps = args.steps or (3 if args.quick else 200)
    t0 = time.time()
    results, trained = {}, []
    for kind in args.models.split(","):
        if kind == "bert" and (reason := transformers_missing()):
            print(f"SKIPPED bert: {reason}")
            results[kind] = {"skipped": reason}
            continue
        kout = out / kind
        kout.mkdir(exist_ok=True)
        t = time.time()
        inspect_text = run_inspect(kind, kout)
        print(f"== {kind}: ln-lightning inspect\n{inspect_text}")
        results[kind] = train(kind, steps, kout, out / "tb")
        results[kind]["seconds"] = time.time() - t  # inspect and training (the fresh process serves every model)
        trained.append(kind)
    fresh = infer_in_fresh_process(trained, out) if trained else {}
    for kind in trained:
        r = results[kind]
        r.update(fresh[kind])
        r["monitors"] = read_monitors(r["log_dir"])
        plot_stream(kind, r["monitors"], out / kind)
        print(f"== {kind}: {r['report']}; loss {r['loss_before']:.3f} -> {r['loss_after']:.3f}; fresh-process logits "
              f"max |diff| = {r['max_abs_diff']:.2e} (logits up to {r['logit_scale']:.2f})")
    results["run"] = {"argv": argv, "elapsed_s": time.time() - t0, "steps": steps}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    results = json.loads((out / "results.json").read_text())  # render what the file holds
    text, failures = render_markdown(results), check(results)
    (out / "results.md").write_text(text)
    print(text)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def models_of(results: dict) -> dict:
    """The per-model entries of results.json (its "run" entry holds the command, time and steps)."""
    return {kind: r for kind, r in results.items() if kind != "run"}


def check(results: dict) -> list[str]:
    """What a run must show: the fresh process serves the trained function, a plain load refuses, monitors logged."""
    failures = []
    for kind, r in models_of(results).items():
        if "skipped" in r:
            continue
        if not (r["max_abs_diff"] <= 1e-5 * max(1.0, r["logit_scale"])):
            failures.append(f"{kind}: fresh-process logits differ by {r['max_abs_diff']:.3g}")
        if r["plain_load"] == "loaded without error":
            failures.append(f"{kind}: a plain strict load of the converted checkpoint into the original class succeeded")
        if not r["monitors"]["stream_rms"] or not r["monitors"]["amp_max"]:
            failures.append(f"{kind}: a monitor logged nothing ({r['monitors']['n_tags']} scalars)")
    return failures


def render_markdown(results: dict) -> str:
    """results.md from results.json's content (the docs build renders the results page with this too)."""
    run = results["run"]
    argv, elapsed, steps = run["argv"], run["elapsed_s"], run["steps"]
    lines = [
        "# migrate_post_norm: inspect, train with LNPlacement and the monitors, serve from the checkpoint",
        "",
        f"Command: `python examples/migrate_post_norm.py {' '.join(argv)}` ({elapsed:.0f} s, {steps} steps per model).",
        "",
        "| model | conversion | probe loss before → after | fresh-process `load_converted` vs in-process logits, max abs diff | "
        "plain `load_from_checkpoint` | its `strict=False` logits vs trained, max abs diff | monitored blocks / norms | TensorBoard scalars | last clip/total_norm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in models_of(results).items():
        if "skipped" in r:
            lines.append(f"| {kind} | skipped: {r['skipped']} | | | | | | | |")
            continue
        lines.append(
            f"| {kind} | {r['report']} | {r['loss_before']:.3f} → {r['loss_after']:.3f} | {r['max_abs_diff']:.2e} | "
            f"{r['plain_load']} | {r['strict_false_max_abs_diff']:.3g} | {len(r['monitored_blocks'])} / {r['monitored_norms']} | {r['monitors']['n_tags']} | {r['monitors']['clip_total_norm']:.3g} |"
        )
    lines += [
        "",
        "Serving code in the fresh process (nothing else is shared with the training run):",
        "",
        "```python",
        "from ln_lightning import load_converted",
        "model = load_converted(EncoderLM, \"outputs/migrate_post_norm/encoder/ckpt/last.ckpt\")  # rewritten, weights loaded, eval()",
        "```",
        "",
        "`ln-lightning inspect` output: `encoder/inspect.txt`, `bert/inspect.txt`.",
    ]
    for kind, r in models_of(results).items():
        if "skipped" not in r:
            lines += ["", f"![{kind}: stream rms per block during training]({kind}/stream_rms.png)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
