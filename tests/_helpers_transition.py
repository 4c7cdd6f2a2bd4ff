"""Shared pieces of the transition tests: three small post-norm LMs, a CharLM over them, data, a Trainer, a recorder."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ln_lightning.demo import PostNormTransformerLM
from ln_lightning.demo.lightning import CharLM
from ln_lightning.placement.migrate import transition

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, block_size=16)
SEQ = 16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------------------------------------- models
class TorchEncoderLM(nn.Module):
    def __init__(self, vocab_size=64, d_model=32, n_layers=2, n_heads=2, block_size=16):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 2 * d_model, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx):
        return self.head(self.enc(self.emb(idx)))


class BertLM(nn.Module):
    def __init__(self, vocab_size=64, d_model=32, n_layers=2, n_heads=2, block_size=16):
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                         intermediate_size=2 * d_model, max_position_embeddings=block_size, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        self.bert = BertModel(cfg, add_pooling_layer=False)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx):
        return self.head(self.bert(input_ids=idx).last_hidden_state)


KINDS = {"demo": PostNormTransformerLM, "torch": TorchEncoderLM, "bert": BertLM}


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return KINDS[kind](**TINY)


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (4, SEQ), generator=torch.Generator().manual_seed(seed))


class LM(CharLM):
    """CharLM (AdamW + LambdaLR) over any of the three models; records the loss of every training step."""

    def __init__(self, kind: str = "demo", lr: float = 1e-2, seed: int = 0, warmup_steps: int = 2):
        super().__init__(**TINY, lr=lr, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        self.model = make(kind, seed)
        self.losses: list[float] = []

    def training_step(self, b, batch_idx):
        loss = self._loss(b)
        self.losses.append(loss.item())
        self.log("train/loss", loss)
        return loss


def loader() -> DataLoader:
    x = batch(1)
    y = torch.roll(x, -1, dims=1)
    return DataLoader(TensorDataset(x, y), batch_size=4)  # one batch per epoch: resume is never mid-epoch


def loss_of(module: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        logits = module(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), torch.roll(x, -1, dims=1).reshape(-1)).item()


def trainer(tmp_path, plugin=None, max_steps=4, callbacks=(), **kw) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
                   plugins=[plugin] if plugin is not None else None, callbacks=list(callbacks),
                   enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), **kw)


def logged_trainer(tmp_path, plugin, max_steps, **kw) -> Trainer:
    """A Trainer that logs every step to a CSVLogger under `tmp_path / "logs"` (read back with csv_column)."""
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("log_every_n_steps", 1)
    return Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(tmp_path / "logs"),
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                   default_root_dir=tmp_path, plugins=[plugin], **kw)


def csv_column(root: Path, name: str) -> list[float]:
    """The values a CSVLogger under `root` logged for `name`, in step order."""
    with open(next(root.rglob("metrics.csv"))) as f:
        return [float(r[name]) for r in csv.DictReader(f) if r.get(name) not in (None, "")]


def csv_by_step(root: Path, name: str) -> dict[int, float]:
    """{step: value} of what a CSVLogger under `root` logged for `name` (one row per step: a fit's ln_placement/*)."""
    with open(next(root.rglob("metrics.csv"))) as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name) not in (None, "")}


class BlendRecorder(Callback):
    """The blend each training step ran with (after LNPlacement's per-step hook: it is the first callback)."""

    def __init__(self):
        self.blends: list[float | None] = []

    def on_train_batch_start(self, trainer, pl_module, b, batch_idx):
        self.blends.append(transition.get_blend(pl_module))


# ---------------------------------------------------------------------------------------------- stream scales
# The plain blend with every step at the held blend: what the transition tests written before the
# stream-scaled default check (the schedule itself, and an endpoint that is plain pre-norm).
PLAIN = dict(transition_stream_scale=False, transition_endpoint_fraction=0.0)
HELD = dict(transition_endpoint_fraction=0.0)  # the stream-scaled blend, every step at the held blend


def _stack_of(path: str) -> str:
    # The module path up to the block index ("blocks.0.ln1" -> "blocks"): the stack, read from the names
    # (the product reads it from the converted blocks' containers).
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[:i])
    return ""


def stream_reference(unconverted: nn.Module, x: torch.Tensor, placement: str = "pre", **convert_kw) -> nn.Module:
    """The stream-scaled endpoint built independently of the transition's own recording: a copy converted with
    branch_scale="stream", each branch's constant C_k = prod sigma_i / mean|gamma_i| over the sites before it in
    its stack, measured by forward pre-hooks on the *unconverted* model's norms (stream_scale.site_ratios) in a
    training-mode forward on `x` (the tests' models have no dropout)."""
    import copy

    from ln_lightning import convert
    from ln_lightning.placement.reading.blocks import STREAM_SITE_ATTR
    from ln_lightning.placement.rewrite.stream_scale import cumulative_scales, site_ratios

    ref = copy.deepcopy(unconverted)
    convert(ref, placement, branch_scale="stream", **convert_kw)
    paths = {id(m): p for p, m in ref.named_modules()}
    scaled = {paths[id(m.__dict__[STREAM_SITE_ATTR])]: m for m in ref.modules() if STREAM_SITE_ATTR in m.__dict__}
    norms = dict(unconverted.named_modules())
    order: list[str] = []
    handles = [norms[p].register_forward_pre_hook(lambda mod, args, p=p: order.append(p)) for p in scaled]
    spreads: dict = {}
    ref_modules = dict(ref.named_modules())
    # The norm whose gain holds the scale: peri's added output norm; output's moved norm (at the branch exit).
    gained = {"peri": scaled, "output": {p: ref_modules[p] for p in scaled}}.get(placement)
    if gained is not None:  # in the same forward: each trained branch output's spread
        handles += _branch_spread_hooks(ref, unconverted, gained, spreads)
    was = unconverted.training
    unconverted.train()
    try:
        with torch.no_grad():
            unconverted(x)
    finally:
        for h in handles:
            h.remove()
    assert sorted(order) == sorted(scaled), "each site runs once"
    assert gained is None or sorted(spreads) == sorted(scaled), "each branch exit runs once"
    ratios = site_ratios(unconverted, [norms[p] for p in order], lambda m: m(x))
    unconverted.train(was)
    stacks: dict[str, list[int]] = {}
    for i, p in enumerate(order):
        stacks.setdefault(_stack_of(p), []).append(i)
    with torch.no_grad():
        for idx in stacks.values():
            c = cumulative_scales([ratios[i] for i in idx])
            for j, i in enumerate(idx):
                if gained is not None:  # the exit norm's gain: C_k times the trained branch output's spread
                    gained[order[i]].weight.fill_(c[j] * spreads[order[i]])
                    if getattr(gained[order[i]], "bias", None) is not None:
                        gained[order[i]].bias.zero_()
                if placement != "peri":  # pre's branch scale c, output's entry x / c
                    scaled[order[i]].c.fill_(c[j])
    return ref


def _branch_spread_hooks(ref: nn.Module, unconverted: nn.Module, scaled: dict, spreads: dict) -> list:
    """Forward hooks on the *unconverted* model's exit modules (where `ref`'s output norms are applied) that put
    each site's trained branch output spread (per-token standard deviation, averaged) into `spreads`."""
    from ln_lightning.placement.rewrite import hooks

    exit_of = {id(h.norm): p for p, m in ref.named_modules() for h in m._forward_hooks.values()
               if isinstance(h, hooks.NormalizeBranchOutput)}
    modules = dict(unconverted.named_modules())
    handles = []
    for site, out_norm in scaled.items():
        def grab(mod, args, out, site=site):
            v = out[0] if isinstance(out, tuple) else out
            spreads[site] = v.float().std(-1, unbiased=False).mean().item()

        handles.append(modules[exit_of[id(out_norm)]].register_forward_hook(grab))
    return handles
