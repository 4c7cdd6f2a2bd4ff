"""Shared pieces of the RMSNorm monitor tests: a tiny Llama LM with RMSNorms of three kinds, an
independent float64 reference of what LayerNormInputMonitor must log, and a script entry point
for the ddp_spawn run (Lightning's launcher needs a real script).

The model: HF ``LlamaModel`` (``LlamaRMSNorm``: eps in ``variance_epsilon``), then an
``nn.RMSNorm(eps=None)`` (eps = the input dtype's machine epsilon) and an ``nn.LayerNorm`` (which
must keep its ``var_*`` names). Data and SGD with lr 0 are fixed, so every logging step logs the
same values, as in ln_lightning/testing/monitors.py.

Script use:
    python tests/_helpers_monitors_rms.py ddp OUTDIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from ln_lightning.testing.monitors import MicroBatchIndex, make_data, make_trainer

VOCAB, D, LAYERS = 16, 16, 2


class RMSLM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=32, num_hidden_layers=LAYERS,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                          rms_norm_eps=1e-5, attn_implementation="eager")
        self.llama = LlamaModel(cfg)
        self.extra = nn.RMSNorm(D)  # eps=None
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        h = self.llama(input_ids=ids).last_hidden_state
        return self.head(self.ln(self.extra(h)))


def make_rms_model(seed: int = 0) -> RMSLM:
    torch.manual_seed(seed)
    model = RMSLM()
    with torch.no_grad():  # non-trivial weights, so a wrong weight handling would show
        for name, p in model.named_parameters():
            if "norm" in name or name.startswith(("extra", "ln")):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


class FixedBatchRMSLM(L.LightningModule):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        super().__init__()
        self.model = make_rms_model()
        self.x, self.y = x, y
        self.accum = x.shape[1]

    def training_step(self, batch, batch_idx):
        mb = batch_idx % self.accum
        logits = self.model(self.x[self.global_rank, mb])
        return F.cross_entropy(logits.reshape(-1, VOCAB), self.y[self.global_rank, mb].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(MicroBatchIndex(self.accum), batch_size=None, shuffle=False)


def reference_norm_stats(model: RMSLM, ids: torch.Tensor) -> dict[str, float]:
    """What the monitor must log for every norm of ``model`` on batch ``ids``: each norm's input
    captured by a plain forward pre-hook, its statistics in float64 by the textbook formulas, eps
    read from the module itself (not through ln_lightning's recognition)."""
    inputs: dict[str, torch.Tensor] = {}
    handles = []
    for name, m in model.named_modules():
        if type(m).__name__ in ("LlamaRMSNorm", "RMSNorm", "LayerNorm"):
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: inputs.__setitem__(name, args[0].detach().double())))
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    out = {"ln/nonfinite_count": 0.0}
    for name, x in inputs.items():
        m = model.get_submodule(name)
        tag = f"model.{name}"
        if isinstance(m, nn.LayerNorm):
            stat, eps, kind = x.var(dim=-1, unbiased=False), m.eps, "var"
        else:
            eps = m.variance_epsilon if hasattr(m, "variance_epsilon") else (m.eps or torch.finfo(torch.float32).eps)
            stat, kind = x.pow(2).mean(dim=-1), "ms"
        out[f"ln/{kind}_mean/{tag}"] = stat.mean().item()
        out[f"ln/{kind}_min/{tag}"] = stat.min().item()
        out[f"ln/amp_max/{tag}"] = (1.0 / torch.sqrt(stat + eps)).max().item()
    return out


def run_ddp(out: str) -> None:
    from ln_lightning.callbacks import LayerNormInputMonitor

    x, y = make_data(world=2, accum=1)
    make_trainer(out, "ddp_rms", accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4,
             callbacks=[LayerNormInputMonitor(every_n_steps=2)]).fit(FixedBatchRMSLM(x, y))


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    {"ddp": run_ddp}[mode](out_dir)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(out_dir, f"{mode}.done").write_text(json.dumps({"ok": True}))
