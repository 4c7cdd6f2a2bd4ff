"""Hugging Face XLM (`XLMModel`): its layers are no modules.

`XLMModel.forward` loops over parallel lists (`attentions[i]`, `layer_norm1[i]`, `ffns[i]`,
`layer_norm2[i]`), so the whole model is read as one block, from its recorded forward like any other,
with the stream starting at the embeddings' own norm and
the padding mask multiplied into it between layers followed through. A final norm goes on the
model's output stream (`last_hidden_state`), stored as `layers_final_norm`.
"""

from __future__ import annotations

import sys

from torch import nn


def _cls():
    m = sys.modules.get("transformers.models.xlm.modeling_xlm")
    return getattr(m, "XLMModel", None) if m is not None else None


def norm_classes() -> list[type]:
    return []


def is_block(module: nn.Module) -> bool:
    cls = _cls()
    return cls is not None and isinstance(module, cls)


def stream_start(block: nn.Module, rec, call):
    """The embeddings' norm output: the stream before the first layer (the analysis follows the mask
    multiply from there). Not the first attention's input, which a rewrite replaces by LN(x)."""
    calls = [c for c in rec.module_calls(block.layer_norm_emb) if call.index < c.index <= call.end]
    return next((v for w, v in calls[0].outputs if w == ()), None) if calls else None


def stream_source(block: nn.Module) -> str:
    """The submodule whose output starts the stream (the black-box reference sets it there)."""
    return "layer_norm_emb"


def final_norm_on_output(block: nn.Module) -> str:
    return "layers_final_norm"
