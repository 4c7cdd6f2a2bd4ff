"""The migration suite's six post-norm models, each a LightningModule on a task derived from the embedded corpus
(`ln_lightning.demo.data.stdlib_corpus_text`), with fixed held-out batches and a held-out loss.

Every module's `forward` returns the logits (the tensor the plugin's distillation compares), and its
`training_step` calls `self(...)` (the distillation's teacher runs on those inputs). Random masks are drawn from a
generator keyed by the optimizer step, so every continuation arm trains on the same masked batches; the held-out
batches' masks are fixed. The learning rate warms up linearly, decays by a cosine to `lr_floor` x peak at
`decay_steps` (the end of pretraining) and stays at that floor, where the continuations run.

TUNING half (methods may be chosen on these): charlm, bert_mlm, encoder_cls; xt_encoder_mlm and marian_seq2seq added
2026-12-06 after order 10 (the three could no longer tell methods apart).
HELD-OUT half (reported untouched by the choice; order 10 ran the loss gate there as a diagnostic): deep_dropout_lm,
bart_denoise, xt_decoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from ln_lightning.demo.data import CharCorpus, stdlib_corpus_text

VOCAB = 128  # the corpus's characters (CharCorpus: byte values < 128)
MASK_ID = 128  # [MASK] in the masked / denoising models
BOS_ID = 129  # the seq2seq decoder's start token
VAL_FRACTION = 0.05  # the tail of the corpus held out (as CharDataModule)
CLS_FILES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "inspect.py", "pathlib.py", "typing.py")


def lr_factor(step: int, warmup: int, decay: int, floor: float) -> float:
    """Linear warmup, cosine decay to `floor` at step `decay`, then constant at the floor (as the study's DecayCharLM)."""
    if step < warmup:
        return (step + 1) / warmup
    if decay <= warmup:
        return 1.0
    t = min(1.0, (step - warmup) / (decay - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def step_generator(step: int, salt: int) -> torch.Generator:
    """The masks' generator at an optimizer step: the same in every arm, whatever else draws random numbers."""
    return torch.Generator().manual_seed(1_000_003 * int(step) + salt)


def span_mask(shape: tuple[int, int], fraction: float, max_span: int, g: torch.Generator) -> torch.Tensor:
    """Boolean mask over (batch, time) of spans of 1..max_span positions covering about `fraction` of each row."""
    b, t = shape
    m = torch.zeros(b, t, dtype=torch.bool)
    n_spans = max(1, round(fraction * t / ((1 + max_span) / 2)))
    starts = torch.randint(0, t, (b, n_spans), generator=g)
    lens = torch.randint(1, max_span + 1, (b, n_spans), generator=g)
    pos = torch.arange(t)
    for j in range(n_spans):
        s, n = starts[:, j:j + 1], lens[:, j:j + 1]
        m |= (pos >= s) & (pos < s + n)
    return m


def mlm_corrupt(x: torch.Tensor, g: torch.Generator, p: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: p of the positions are predicted; of those 80% become [MASK], 10% a random char, 10% stay."""
    pick = torch.rand(x.shape, generator=g) < p
    pick[:, 0] |= ~pick.any(1)  # at least one target per row
    r = torch.rand(x.shape, generator=g)
    rand_char = torch.randint(0, VOCAB, x.shape, generator=g)
    inp = torch.where(pick & (r < 0.8), torch.full_like(x, MASK_ID), x)
    inp = torch.where(pick & (r >= 0.8) & (r < 0.9), rand_char, inp)
    return inp, torch.where(pick, x, torch.full_like(x, -100))


# ------------------------------------------------------------------------------------------ data


class ClassWindows(Dataset):
    """Windows of `block` characters labelled with the source file they come from (one of CLS_FILES)."""

    def __init__(self, texts: list[str], block: int, stride: int):
        self.items = []
        for label, text in enumerate(texts):
            data = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)
            for s in range(0, data.numel() - block + 1, stride):
                self.items.append((data[s:s + block], label))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        x, y = self.items[i]
        return x, torch.tensor(y)


def class_texts(chars_per_file: int) -> tuple[list[str], list[str]]:
    """Each file's first `chars_per_file` characters, split into its training head and held-out tail."""
    train, val = [], []
    for f in CLS_FILES:
        t = stdlib_corpus_text(chars_per_file, files=(f,))
        split = int(len(t) * 0.9)
        train.append(t[:split])
        val.append(t[split:])
    return train, val


WORD_BREAKS = (ord(" "), ord("\n"), ord("\t"))


def reverse_words(x: torch.Tensor) -> torch.Tensor:
    """marian_seq2seq's target: each window with every run of non-blank characters reversed in place (a word cut by
    the window's edge is reversed as far as it shows); blanks stay where they are."""
    out = x.clone()
    for i, row in enumerate(x.tolist()):
        j, n = 0, len(row)
        while j < n:
            if row[j] in WORD_BREAKS:
                j += 1
                continue
            k = j
            while k < n and row[k] not in WORD_BREAKS:
                k += 1
            out[i, j:k] = torch.tensor(row[j:k][::-1])
            j = k
    return out


def datasets(task: str, hp: dict) -> tuple[Dataset, Dataset]:
    if task == "cls":
        tr, va = class_texts(hp["chars_per_file"])
        # overlapping training windows (stride 4: a random crop of each file); with stride 32 the classifier memorised them
        return ClassWindows(tr, hp["block_size"], 4), ClassWindows(va, hp["block_size"], hp["block_size"] // 4)
    text = stdlib_corpus_text(hp["max_chars"])
    split = int(len(text) * (1 - VAL_FRACTION))
    return CharCorpus(text[:split], hp["block_size"]), CharCorpus(text[split:], hp["block_size"])


class SuiteData(L.LightningDataModule):
    """The training windows of a task, shuffled (the order set by the seed before `fit`)."""

    def __init__(self, task: str, hp: dict):
        super().__init__()
        self.task, self.hp = task, hp

    def setup(self, stage=None):
        self.train_set, _ = datasets(self.task, self.hp)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hp["batch_size"], shuffle=True, drop_last=True)


# ------------------------------------------------------------------------------------------ modules


class SuiteModule(L.LightningModule):
    """Shared training loop: `batch_loss(batch, g)` with a step-keyed generator, AdamW with the decayed schedule."""

    salt = 0

    def __init__(self, lr: float, warmup_steps: int, decay_steps: int, lr_floor: float, weight_decay: float = 0.0):
        super().__init__()

    def batch_loss(self, batch, g: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        loss = self.batch_loss(batch, step_generator(self.global_step, self.salt))
        self.last_loss = loss.detach()  # the task loss (the plugin's distillation adds its term to the returned loss)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.get("weight_decay", 0.0))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, hp.warmup_steps, hp.decay_steps, hp.lr_floor))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


class CharLMSuite(SuiteModule):
    """(a) The study's char LM: the demo `PostNormTransformerLM` (what `CharLM` wraps), post-norm, no final norm."""

    def __init__(self, n_layers: int, d_model: int, n_heads: int, block_size: int, **opt):
        super().__init__(**opt)
        self.save_hyperparameters()
        from ln_lightning.demo.models import PostNormTransformerLM

        self.model = PostNormTransformerLM(VOCAB, d_model, n_layers, n_heads, block_size, 0.0)

    def forward(self, idx):
        return self.model(idx)

    def batch_loss(self, batch, g):
        x, y = batch
        return _lm_loss(self(x), y)


class BertMLMSuite(SuiteModule):
    """(b) Hugging Face `BertForMaskedLM` from a small config (character vocabulary + [MASK]), BERT's 15% masking."""

    salt = 1

    def __init__(self, n_layers: int, d_model: int, n_heads: int, block_size: int, dropout: float, **opt):
        super().__init__(**opt)
        self.save_hyperparameters()
        import transformers as T

        cfg = T.BertConfig(vocab_size=VOCAB + 2, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                           intermediate_size=4 * d_model, max_position_embeddings=block_size, hidden_dropout_prob=dropout,
                           attention_probs_dropout_prob=dropout, pad_token_id=VOCAB + 1)
        self.bert = T.BertForMaskedLM(cfg)

    def forward(self, ids):
        return self.bert(input_ids=ids).logits

    def batch_loss(self, batch, g):
        inp, target = mlm_corrupt(batch[0], g)
        return _lm_loss(self(inp), target)


class EncoderClassifierSuite(SuiteModule):
    """(c) `nn.TransformerEncoder` (post-norm layers, norm_first=False, no final norm) classifying which of
    CLS_FILES a window of characters comes from; mean-pooled."""

    salt = 2

    def __init__(self, n_layers: int, d_model: int, n_heads: int, block_size: int, dropout: float, **opt):
        super().__init__(**opt)
        self.save_hyperparameters()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, len(CLS_FILES))

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        return self.head(self.encoder(h).mean(1))

    def batch_loss(self, batch, g):
        x, y = batch
        return F.cross_entropy(self(x), y)


class DeepBlock(nn.Module):
    """Post-norm block with one dropout module per branch (nothing shared): x <- LN(x + drop(attn(x))), same for the MLP."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        from ln_lightning.demo.models import CausalSelfAttention

        self.attn = CausalSelfAttention(d, heads)
        self.attn_drop = nn.Dropout(dropout)
        self.ln1 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.mlp_drop = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x):
        x = self.ln1(x + self.attn_drop(self.attn(x)))
        return self.ln2(x + self.mlp_drop(self.mlp(x)))


class DeepDropoutLMSuite(SuiteModule):
    """(d) A deep narrow post-norm char LM written by hand, dropout in every branch, no final norm."""

    salt = 3

    def __init__(self, n_layers: int, d_model: int, n_heads: int, block_size: int, dropout: float, **opt):
        super().__init__(**opt)
        self.save_hyperparameters()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(DeepBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def batch_loss(self, batch, g):
        x, y = batch
        return _lm_loss(self(x), y)


class BartDenoiseSuite(SuiteModule):
    """(e) Hugging Face `BartForConditionalGeneration` (post-norm, as BART is) from a small config, denoising:
    spans covering about 30% of a window are replaced by [MASK] (same length); the decoder reconstructs the window
    (teacher forcing, loss over every position, as BART's)."""

    salt = 4

    def __init__(self, n_layers: int, d_model: int, n_heads: int, block_size: int, dropout: float, **opt):
        super().__init__(**opt)
        self.save_hyperparameters()
        import transformers as T

        cfg = T.BartConfig(vocab_size=VOCAB + 3, d_model=d_model, encoder_layers=n_layers, decoder_layers=n_layers,
                           encoder_attention_heads=n_heads, decoder_attention_heads=n_heads, encoder_ffn_dim=4 * d_model,
                           decoder_ffn_dim=4 * d_model, max_position_embeddings=block_size + 2, dropout=dropout,
                           pad_token_id=VOCAB + 2, bos_token_id=BOS_ID, eos_token_id=VOCAB + 2, decoder_start_token_id=BOS_ID,
                           forced_eos_token_id=None)
        self.bart = T.BartForConditionalGeneration(cfg)

    def forward(self, input_ids, decoder_input_ids):
        return self.bart(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits

    @staticmethod
    def corrupt(x: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        noisy = torch.where(span_mask(tuple(x.shape), 0.3, 5, g), torch.full_like(x, MASK_ID), x)
        dec = torch.cat([torch.full_like(x[:, :1], BOS_ID), x[:, :-1]], 1)
        return noisy, dec

    def batch_loss(self, batch, g):
        x = batch[0]
        noisy, dec = self.corrupt(x, g)
        return _lm_loss(self(noisy, dec), x)


class XTDecoderSuite(SuiteModule):
    """(f) An x-transformers post-norm decoder LM: `TransformerWrapper(attn_layers=Decoder(..., pre_norm=False))`."""

    salt = 5

    def __init__(self, n_layers: int, d_model: int, n_heads: int, block_size: int, **opt):
        super().__init__(**opt)
        self.save_hyperparameters()
        import x_transformers as X

        self.xt = X.TransformerWrapper(num_tokens=VOCAB, max_seq_len=block_size,
                                       attn_layers=X.Decoder(dim=d_model, depth=n_layers, heads=n_heads, pre_norm=False))

    def forward(self, idx):
        return self.xt(idx)

    def batch_loss(self, batch, g):
        x, y = batch
        return _lm_loss(self(x), y)


class XTEncoderMLMSuite(SuiteModule):
    """(g) An x-transformers post-norm encoder masked char LM: `TransformerWrapper(attn_layers=Encoder(...,
    pre_norm=False))`, BERT's 15% masking (as bert_mlm). Added to the TUNING half after order 10."""

    salt = 6

    def __init__(self, n_layers: int, d_model: int, n_heads: int, block_size: int, **opt):
        super().__init__(**opt)
        self.save_hyperparameters()
        import x_transformers as X

        self.xt = X.TransformerWrapper(num_tokens=VOCAB + 2, max_seq_len=block_size,
                                       attn_layers=X.Encoder(dim=d_model, depth=n_layers, heads=n_heads, pre_norm=False))

    def forward(self, ids):
        return self.xt(ids)

    def batch_loss(self, batch, g):
        inp, target = mlm_corrupt(batch[0], g)
        return _lm_loss(self(inp), target)


class MarianSeq2SeqSuite(SuiteModule):
    """(h) Hugging Face `MarianMTModel` from a small `MarianConfig` (post-norm: its layers add the branch to the stream,
    then normalise; the config of this transformers has no `normalize_before`, which older ones left False), on a
    char-level "translation": each window to itself with every word reversed (`reverse_words`), the decoder fed the
    target shifted right (teacher forcing, loss over every position). Added to the TUNING half after order 10."""

    salt = 7

    def __init__(self, n_layers: int, d_model: int, n_heads: int, block_size: int, dropout: float, **opt):
        super().__init__(**opt)
        self.save_hyperparameters()
        import transformers as T

        cfg = T.MarianConfig(vocab_size=VOCAB + 3, decoder_vocab_size=VOCAB + 3, d_model=d_model, encoder_layers=n_layers,
                             decoder_layers=n_layers, encoder_attention_heads=n_heads, decoder_attention_heads=n_heads,
                             encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model, max_position_embeddings=block_size + 2,
                             dropout=dropout, pad_token_id=VOCAB + 2, eos_token_id=VOCAB + 2, decoder_start_token_id=BOS_ID,
                             forced_eos_token_id=None)
        if getattr(cfg, "normalize_before", False):
            raise ValueError("MarianConfig.normalize_before is True here: this model would be pre-norm, not the suite's post-norm")
        self.marian = T.MarianMTModel(cfg)

    def forward(self, input_ids, decoder_input_ids):
        return self.marian(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits

    @staticmethod
    def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's input (BOS, then the target shifted right) and the target, for source windows `x`."""
        target = reverse_words(x)
        return torch.cat([torch.full_like(target[:, :1], BOS_ID), target[:, :-1]], 1), target

    def batch_loss(self, batch, g):
        x = batch[0]
        dec, target = self.pair(x)
        return _lm_loss(self(x, dec), target)


# ------------------------------------------------------------------------------------------ the suite


@dataclass(frozen=True)
class SuiteModel:
    """One model of the suite: its class, shape, task, schedule and sizes (full and quick)."""

    name: str
    half: str  # "tuning" or "held-out"
    kind: str  # what it is, in words
    cls: type
    task: str  # "lm", "mlm", "cls", "denoise", "reverse"
    arch: dict
    full: dict  # pretrain, lr, warmup, batch_size, block_size, data sizes, budgets
    quick: dict = field(default_factory=dict)

    def hp(self, quick: bool) -> dict:
        return {**self.full, **(self.quick if quick else {})}

    def build(self, hp: dict) -> SuiteModule:
        arch = {**self.arch, **hp.get("arch", {})}
        return self.cls(**arch, block_size=hp["block_size"], lr=hp["lr"], warmup_steps=hp["warmup"],
                        decay_steps=hp["pretrain"], lr_floor=hp["lr_floor"])


_LM_DATA = dict(block_size=32, batch_size=16, max_chars=300_000, lr_floor=0.1, eval_batches=4, eval_every=20)
_QUICK = dict(pretrain=16, warmup=4, max_chars=30_000, chars_per_file=4_000, batch_size=8, eval_batches=1, eval_every=3,
              budgets=(6, 12), arch=dict(n_layers=2, d_model=16, n_heads=2))

XT_ENC_LAYERS, XT_ENC_PRETRAIN, MARIAN_PRETRAIN = 6, 3000, 3000  # (sized so each pretrains in <= ~6 min here)

SUITE: dict[str, SuiteModel] = {m.name: m for m in [
    SuiteModel("charlm", "tuning", "the study's char LM (demo PostNormTransformerLM), no final norm", CharLMSuite, "lm",
               dict(n_layers=8, d_model=64, n_heads=4),
               dict(_LM_DATA, pretrain=2400, lr=1e-3, warmup=100, budgets=(300, 600)), _QUICK),
    SuiteModel("bert_mlm", "tuning", "Hugging Face BertForMaskedLM, char vocabulary, 15% masking, dropout 0.1", BertMLMSuite, "mlm",
               dict(n_layers=6, d_model=64, n_heads=4, dropout=0.1),
               # NOT flat: 2,400 and 5,000 steps at lr 1e-3 left the held-out loss falling (1.3%, 1.8% between the last two
               # tenths), 6,000 at lr 2e-3 too (2.3%, and higher); the suite uses the 5,000-step model
               dict(_LM_DATA, pretrain=5000, lr=1e-3, warmup=200, budgets=(300, 600)), {**_QUICK, "arch": {**_QUICK["arch"], "dropout": 0.1}}),
    SuiteModel("encoder_cls", "tuning", "nn.TransformerEncoder (norm_first=False) classifying which of 6 stdlib files a window is from",
               # (36,000 chars a file, windows at stride 32, no dropout: it memorised them, held-out loss rising from step ~1,000)
               EncoderClassifierSuite, "cls", dict(n_layers=6, d_model=64, n_heads=4, dropout=0.1),
               dict(block_size=64, batch_size=32, chars_per_file=48_000, lr=1e-3, warmup=100, lr_floor=0.1, eval_batches=4,
                    eval_every=20, pretrain=2000, budgets=(300, 600)), {**_QUICK, "arch": {**_QUICK["arch"], "dropout": 0.1}}),
    SuiteModel("deep_dropout_lm", "held-out", "24-layer narrow char LM written by hand, a dropout 0.1 module per branch",
               DeepDropoutLMSuite, "lm", dict(n_layers=24, d_model=32, n_heads=4, dropout=0.1),
               dict(_LM_DATA, pretrain=2400, lr=1e-3, warmup=200, budgets=(300, 600)),
               {**_QUICK, "arch": dict(n_layers=4, d_model=16, n_heads=2, dropout=0.1)}),
    SuiteModel("bart_denoise", "held-out", "Hugging Face BartForConditionalGeneration, span denoising (30% masked), dropout 0.1",
               BartDenoiseSuite, "denoise", dict(n_layers=3, d_model=64, n_heads=4, dropout=0.1),
               # 2,400 steps left the held-out loss falling (1.9% between the last two tenths)
               dict(_LM_DATA, pretrain=4800, lr=1e-3, warmup=100, budgets=(300, 600)), {**_QUICK, "arch": {**_QUICK["arch"], "dropout": 0.1}}),
    SuiteModel("xt_decoder", "held-out", "x-transformers TransformerWrapper(Decoder(pre_norm=False)) char LM", XTDecoderSuite, "lm",
               dict(n_layers=6, d_model=64, n_heads=4),
               dict(_LM_DATA, pretrain=2400, lr=1e-3, warmup=100, budgets=(300, 600)), _QUICK),
    # added to the TUNING half 2026-12-06, after order 10 (see HALVES_ADDED in migrate_suite.py), before any of their runs
    SuiteModel("xt_encoder_mlm", "tuning", "x-transformers TransformerWrapper(Encoder(pre_norm=False)) masked char LM, 15% masking",
               XTEncoderMLMSuite, "mlm", dict(n_layers=XT_ENC_LAYERS, d_model=64, n_heads=4),
               dict(_LM_DATA, pretrain=XT_ENC_PRETRAIN, lr=1e-3, warmup=200, budgets=(300, 600)), _QUICK),
    SuiteModel("marian_seq2seq", "tuning", "Hugging Face MarianMTModel, char-level: each window to itself with every word reversed, dropout 0.1",
               MarianSeq2SeqSuite, "reverse", dict(n_layers=3, d_model=64, n_heads=4, dropout=0.1),
               dict(_LM_DATA, pretrain=MARIAN_PRETRAIN, lr=1e-3, warmup=100, budgets=(300, 600)),
               {**_QUICK, "arch": {**_QUICK["arch"], "dropout": 0.1}}),
]}


# ------------------------------------------------------------------------------------------ held-out loss


def eval_batches(m: SuiteModel, hp: dict) -> list[tuple]:
    """Fixed held-out batches: windows evenly spaced over the held-out data, with fixed masks (seeded)."""
    _, val = datasets(m.task, hp)
    n = hp["eval_batches"] * hp["batch_size"]
    idx = [round(i * (len(val) - 1) / max(1, n - 1)) for i in range(n)]
    xs, ys = zip(*(val[i] for i in idx))
    bs = hp["batch_size"]
    out = []
    for k, i in enumerate(range(0, n, bs)):
        x, y = torch.stack(xs[i:i + bs]), torch.stack(ys[i:i + bs])
        g = torch.Generator().manual_seed(777 + k)
        if m.task == "mlm":
            inp, target = mlm_corrupt(x, g)
            out.append(((inp,), target))
        elif m.task == "reverse":
            dec, target = MarianSeq2SeqSuite.pair(x)
            out.append(((x, dec), target))
        elif m.task == "denoise":
            noisy, dec = BartDenoiseSuite.corrupt(x, g)
            out.append(((noisy, dec), x))
        else:
            out.append(((x,), y))
    return out


def heldout_loss(module: nn.Module, batches: list[tuple]) -> float:
    """Mean cross-entropy over the held-out targets, in eval mode (no dropout), without gradients."""
    was = module.training
    module.eval()
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for inputs, target in batches:
            logits = module(*inputs)
            tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="sum",
                                   ignore_index=-100).item()
            cnt += int((target != -100).sum())
    module.train(was)
    return tot / cnt
