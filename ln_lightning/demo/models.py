"""Models written the way existing code bases write them: placement is fixed in `forward`.

`PostNormTransformerLM` is the "original transformer" layout, `x <- LN(x + F(x))` for the
attention and the MLP sublayer of every block, with no final norm. It is the model the
README's demo migrates to pre-norm.
"""

from __future__ import annotations

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over `(batch, time, d_model)` inputs."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.act = nn.GELU()
        self.out = nn.Linear(hidden, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(self.act(self.fc(x))))


class PostNormBlock(nn.Module):
    """`x <- LN(x + attn(x))`, then `x <- LN(x + mlp(x))`."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln1 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model, dropout)
        self.ln2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        x = self.ln2(x + self.mlp(x))
        return x


class PreNormBlock(nn.Module):
    """The design document's block: `x <- x + fc(LN(x))` (one sublayer, width `d`)."""

    def __init__(self, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.fc = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln1(x))


class PostNormTransformerLM(nn.Module):
    """A character-level post-norm transformer language model, as existing code writes one.

    Token and position embeddings, `n_layers` post-norm blocks in `self.blocks`, no final
    norm, a linear head. `forward(idx)` takes `(batch, time)` token ids and returns logits.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        block_size: int = 128,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(PostNormBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
