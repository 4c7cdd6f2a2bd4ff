"""Which modules count as a norm whose placement is the question.

nn.LayerNorm and nn.RMSNorm by class; classes given to `register_norm_class` or known to a family
(`families/`); and any other module that computes a LayerNorm or an RMSNorm, recognised by
`ln_lightning.norm.kinds` from what its forward computes on a probe (Hugging Face's
`LlamaRMSNorm`, `T5LayerNorm`, Gemma's `1 + w` RMSNorm, ...), decided once per class.

The decision is a property of the class, so it is made on a twin of the first instance seen: the
same attributes, made-up weights on the CPU. An instance on the meta device, or one whose own
weights happen to be degenerate, decides the same as any other.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ln_lightning.norm import kinds
from ln_lightning.placement.families import norm_classes
from ln_lightning.placement.rewrite.hooks import original_class
from ln_lightning.placement.reading.registry import registered_norm_classes

# On a norm convert added as a stack's final norm: the stack's path. Not a sublayer norm of the block that may hold it.
FINAL_NORM_MARKER = "ln_lightning_final_norm_of"


class _RecognisedNormMeta(type):
    _cache: dict[type, bool] = {}

    def __instancecheck__(cls, module) -> bool:
        if not isinstance(module, nn.Module):
            return False

        key = original_class(module)
        hit = cls._cache.get(key)
        if hit is None:
            try:
                hit = kinds.is_norm(_twin(module))
            except Exception:  # noqa: BLE001 - a module that can't even run the probe is no norm
                hit = False
            cls._cache[key] = hit
        return hit


def _twin(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` with made-up floating weights on the CPU (meta buffers as zeros)."""
    g = torch.Generator().manual_seed(0)
    twin = copy.copy(module)
    params = {}
    for name, p in module._parameters.items():
        if p is None or not p.is_floating_point():
            params[name] = p
        else:
            made = (1.0 if name == "weight" else 0.0) + 0.5 * torch.randn(tuple(p.shape), generator=g, dtype=torch.float64)
            params[name] = nn.Parameter(made.to(p.dtype), requires_grad=False)
    twin._parameters = params
    twin._buffers = {k: (torch.zeros(tuple(b.shape), dtype=b.dtype) if b is not None and b.is_meta else b) for k, b in module._buffers.items()}
    return twin


class RecognisedNorm(metaclass=_RecognisedNormMeta):
    """`isinstance(m, RecognisedNorm)`: `m` computes a LayerNorm or an RMSNorm (see the module docstring)."""


def norm_types() -> tuple[type, ...]:
    types: list[type] = [nn.LayerNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    types.extend(registered_norm_classes())
    types.extend(norm_classes())
    types.append(RecognisedNorm)
    return tuple(types)


def norm_width(norm: nn.Module) -> int | None:
    """The width a norm normalises (the stream's): its `normalized_shape`, or that of a norm inside
    it, or its gain's length (x-transformers' LayerNorm keeps a `gamma` around a bare nn.LayerNorm)."""
    for m in norm.modules():
        shape = getattr(m, "normalized_shape", None)
        if isinstance(shape, int):
            return shape
        if shape:
            return int(shape[-1])
    for t in (*norm.parameters(), *norm.buffers()):
        if t.dim() >= 1:
            return int(t.shape[-1])
    return None
