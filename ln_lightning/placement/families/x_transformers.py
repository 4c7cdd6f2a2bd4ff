"""x-transformers: placeholder until its AttentionLayers adapter lands (see handler)."""

from __future__ import annotations


def handler(block, path):
    return None
