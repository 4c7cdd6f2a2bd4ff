"""The demo's LightningModule and DataModule: a post-norm character LM on the stdlib corpus."""

from __future__ import annotations

import lightning as L
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from ln_lightning.demo.data import CharCorpus, stdlib_corpus_text
from ln_lightning.demo.models import PostNormTransformerLM


class CharLM(L.LightningModule):
    """Wraps `PostNormTransformerLM` (post-norm, no final norm, as existing code writes it).

    Logs `train/loss`; in validation `val/loss` (cross-entropy), `val/ppl` (perplexity, torchmetrics'
    `Perplexity`) and `val/acc` (next-character accuracy, `MulticlassAccuracy`), each over the whole
    validation set and across ranks; `test/loss` in testing.

    Args:
        vocab_size, d_model, n_layers, n_heads, block_size, dropout: the model's shape.
        lr: AdamW learning rate. weight_decay: AdamW weight decay.
        warmup_steps: linear warmup length (0 disables it), then constant.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        block_size: int = 128,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = PostNormTransformerLM(vocab_size, d_model, n_layers, n_heads, block_size, dropout)
        self.example_input_array = torch.zeros(2, min(16, block_size), dtype=torch.long)
        # Their states are not persistent, so checkpoints and state_dict keys are as without them.
        self.val_ppl = Perplexity()
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch) -> torch.Tensor:
        return self._logits_and_loss(batch)[1]

    def _logits_and_loss(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits, loss = self._logits_and_loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        target = batch[1]
        self.val_ppl(logits, target)
        self.val_acc(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
        self.log("val/ppl", self.val_ppl)
        self.log("val/acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(-1)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup = self.hparams.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class CharDataModule(L.LightningDataModule):
    """Character windows of a text file, or of the standard library's source when `text_file` is None.

    Args:
        text_file: any UTF-8 text file; None uses the embedded standard-library corpus.
        block_size: window length. batch_size: per-process batch size.
        max_chars: corpus length cap. val_fraction: tail fraction held out for validation.
        train_windows: cap on training windows (None: all), to bound a demo's epoch.
    """

    def __init__(
        self,
        text_file: str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        max_chars: int = 400_000,
        val_fraction: float = 0.05,
        train_windows: int | None = None,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        if hp.text_file:
            with open(hp.text_file, encoding="utf-8", errors="replace") as f:
                text = f.read()[: hp.max_chars]
        else:
            text = stdlib_corpus_text(hp.max_chars)
        split = int(len(text) * (1 - hp.val_fraction))
        self.train_set = CharCorpus(text[:split], hp.block_size)
        if hp.train_windows is not None:
            self.train_set = Subset(self.train_set, range(min(hp.train_windows, len(self.train_set))))
        self.val_set = CharCorpus(text[split:], hp.block_size)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True,
                          num_workers=self.hparams.num_workers, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self):
        return self.val_dataloader()
