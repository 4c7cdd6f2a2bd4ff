"""Which modules count as a norm whose placement is the question."""

from __future__ import annotations

from torch import nn


def norm_types() -> tuple[type, ...]:
    from ln_lightning.placement.registry import registered_norm_classes

    types: list[type] = [nn.LayerNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    types.extend(registered_norm_classes())
    return tuple(types)
