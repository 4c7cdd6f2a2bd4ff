"""x-transformers (lucidrains): `Encoder` / `Decoder` / any `AttentionLayers`.

Its residual loop lives in `AttentionLayers.forward` itself, not in a block module: each layer is a
`ModuleList([norms, branch, residual])` that is never called. So the whole `AttentionLayers` is read
as one block, from its recorded forward like any other (with `pre_norm=False` each sublayer is
`post_main_norm(x + branch(x))`), and its own `final_norm` slot (an `Identity` when post-norm)
receives the final norm, where `pre_norm=True` keeps it: the converted model then has the same
state_dict layout for the final norm as one built with `pre_norm=True`.
Its norm classes (a LayerNorm with a `gamma`, RMSNorm, ScaleNorm, ...) count as norms.
"""

from __future__ import annotations

import sys

from torch import nn


def _module():
    return sys.modules.get("x_transformers.x_transformers")  # only if the user imported it


def norm_classes() -> list[type]:
    m = _module()
    if m is None:
        return []
    return [getattr(m, n) for n in ("LayerNorm", "RMSNorm", "SimpleRMSNorm", "ScaleNorm") if isinstance(getattr(m, n, None), type)]


def is_block(module: nn.Module) -> bool:
    m = _module()
    return m is not None and isinstance(module, m.AttentionLayers)


def final_norm_slot(block: nn.Module) -> str | None:
    """The attribute a final norm goes in, for blocks that have one."""
    return "final_norm" if is_block(block) else None
