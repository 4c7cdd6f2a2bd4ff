"""Per-family knowledge that observing a forward can't replace, one file per family.

A family module may say which modules are blocks although no container holds them (`is_block`),
which classes are norms (`norm_classes`), and where a block keeps its own final norm
(`final_norm_slot`). Hugging Face's post-norm layers need none of this: they are read from a
recorded forward like any block (see `discovery.py`).
"""

from __future__ import annotations

from torch import nn

from ln_lightning.placement.families import x_transformers

FAMILIES = (x_transformers,)


def is_block(module: nn.Module) -> bool:
    return any(f.is_block(module) for f in FAMILIES)


def norm_classes() -> list[type]:
    return [c for f in FAMILIES for c in f.norm_classes()]


def final_norm_slot(block: nn.Module) -> str | None:
    for f in FAMILIES:
        slot = f.final_norm_slot(block)
        if slot is not None:
            return slot
    return None
