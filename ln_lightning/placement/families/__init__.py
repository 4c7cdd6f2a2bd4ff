"""Per-family knowledge that observing a forward can't replace, one file per family.

Each family module exposes `handler(block, path) -> Handler | None`. Most families need none:
Hugging Face's post-norm layers are read from a recorded forward (see `discovery.py`).
"""

from __future__ import annotations

from torch import nn


def family_handler(block: nn.Module, path: str):
    from ln_lightning.placement.families import x_transformers

    for family in (x_transformers,):
        h = family.handler(block, path)
        if h is not None:
            return h
    return None
