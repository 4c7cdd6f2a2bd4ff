"""Per-family knowledge that observing a forward can't replace, one file per family.

A family module may say which modules are blocks although no container holds them (`is_block`),
which classes are norms (`norm_classes`), and where a block keeps its own final norm
(`final_norm_slot`). Hugging Face's post-norm layers need none of this: they are read from a
recorded forward like any block (see `discovery.py`).
"""

from __future__ import annotations

from torch import nn

from ln_lightning.placement.families import x_transformers, xlm

FAMILIES = (x_transformers, xlm)


def is_block(module: nn.Module) -> bool:
    return any(f.is_block(module) for f in FAMILIES)


def norm_classes() -> list[type]:
    return [c for f in FAMILIES for c in f.norm_classes()]


def stream_start_fn(block: nn.Module):
    """For a block whose stream is not its first input (a whole model whose loop runs over parallel
    lists of modules, XLM), a function (block, recording, call) -> the stream's value; else None."""
    for f in FAMILIES:
        fn = getattr(f, "stream_start", None)
        if fn is not None and f.is_block(block):
            return fn
    return None


def stream_source(block: nn.Module) -> str | None:
    """For such a block: the submodule whose output is the stream's start (relative path)."""
    for f in FAMILIES:
        fn = getattr(f, "stream_source", None)
        if fn is not None and f.is_block(block):
            return fn(block)
    return None


def final_norm_on_output(block: nn.Module) -> str | None:
    """For such a block: the child name for a final norm applied to its output stream."""
    for f in FAMILIES:
        fn = getattr(f, "final_norm_on_output", None)
        if fn is not None and f.is_block(block):
            return fn(block)
    return None


def final_norm_slot(block: nn.Module) -> str | None:
    for f in FAMILIES:
        slot = getattr(f, "final_norm_slot", lambda b: None)(block)
        if slot is not None:
            return slot
    return None
