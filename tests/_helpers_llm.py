"""What the LLM-placement tests share: small Hugging Face configs, fixed token ids, Llama's sublayer
table, and trained-looking norm gains (away from 1, so moving or adding a norm changes the function)."""

from __future__ import annotations

import torch
from torch import nn

LLM = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, vocab_size=99,
           attention_dropout=0.0)
IDS = {"input_ids": torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))}
# Llama layer: (input norm, module whose output is the branch, its output index)
LLAMA = [("input_layernorm", "self_attn", 0), ("post_attention_layernorm", "mlp", None)]


def trained(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
