"""Which modules count as a norm whose placement is the question.

nn.LayerNorm and nn.RMSNorm by class; classes given to `register_norm_class` or known to a family
(`families/`); and any other module that computes a LayerNorm or an RMSNorm, recognised by
`ln_lightning.norm.kinds` from what its forward computes on a probe (Hugging Face's
`LlamaRMSNorm`, `T5LayerNorm`, Gemma's `1 + w` RMSNorm, ...), decided once per class.
"""

from __future__ import annotations

from torch import nn


class _RecognisedNormMeta(type):
    _cache: dict[type, bool] = {}

    def __instancecheck__(cls, module) -> bool:
        if not isinstance(module, nn.Module):
            return False
        from ln_lightning.norm import kinds
        from ln_lightning.placement.hooks import original_class

        key = original_class(module)
        hit = cls._cache.get(key)
        if hit is None:
            try:
                hit = kinds.is_norm(module)
            except Exception:  # noqa: BLE001 - a module that can't even run the probe is no norm
                hit = False
            cls._cache[key] = hit
        return hit


class RecognisedNorm(metaclass=_RecognisedNormMeta):
    """`isinstance(m, RecognisedNorm)`: `m` computes a LayerNorm or an RMSNorm (see the module docstring)."""


def norm_types() -> tuple[type, ...]:
    from ln_lightning.placement.families import norm_classes
    from ln_lightning.placement.registry import registered_norm_classes

    types: list[type] = [nn.LayerNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    types.extend(registered_norm_classes())
    types.extend(norm_classes())
    types.append(RecognisedNorm)
    return tuple(types)
