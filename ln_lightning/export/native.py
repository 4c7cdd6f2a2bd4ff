"""``ln_lightning.to_native(model)``: the native pre-norm twin of a converted model, as a model object.

The families with one (each checked on a probe input against the converted model before it is returned):
Hugging Face RoBERTa, BART and post-norm OPT (``native_hf``), torch ``nn.Transformer*`` and x-transformers
(``native_torch``). Everything else raises PlacementError with the reason (BERT: no pre-norm class; Wav2Vec2:
no twin; a branch scale or a transition: no native class computes it).
"""

from __future__ import annotations

from torch import nn

from ln_lightning.export import native_hf, native_torch, save_guard
from ln_lightning.export.directory import is_hf_model
from ln_lightning.placement import state as rewrite_state
from ln_lightning.placement.errors import PlacementError


def _rewrite_of(model: nn.Module) -> tuple[rewrite_state.RewriteState, str]:
    guard = model.__dict__.get(save_guard.ATTR)
    if isinstance(guard, save_guard.SavePretrained):
        return guard.state, guard.base
    found = rewrite_state.find(model)
    if found is None:
        raise PlacementError(
            f"{type(model).__name__} was not rewritten by ln_lightning (no placement rewrite state); pass the converted "
            "model (the one given to convert, or the model inside the LightningModule LNPlacement rewrote)"
        )
    return found


def to_native(model: nn.Module) -> nn.Module:
    """The model of the family's own pre-norm class computing what the converted `model` computes, in eval mode.

    A new object with its own weights (copied); `model` is left as it is. Hugging Face RoBERTa gives
    ``RobertaPreLayerNorm*``, BART gives mBART, post-norm OPT gives OPT with ``do_layer_norm_before=True``, torch
    ``nn.Transformer*`` gives ``norm_first=True`` layers, x-transformers gives the ``pre_norm=True`` layout. Raises
    PlacementError with the reason when there is none.

    Example::

        convert(roberta, "pre")
        native = ln_lightning.to_native(roberta)       # RobertaPreLayerNormModel
        native.save_pretrained("out")                  # plain transformers loads it, no ln_lightning
    """
    state, base = _rewrite_of(model)
    record = state.relative_to(base, with_transition=True)
    if is_hf_model(model):
        native = native_hf.build_checked(model, native_hf.native_form(model, record))
    else:
        native = native_torch.native_stack(model, record)
        if native is None:
            raise native_hf.NoNativeForm(
                f"{type(model).__name__} has no native pre-norm class: to_native knows Hugging Face RoBERTa, BART and OPT, "
                "torch nn.Transformer / TransformerEncoder / TransformerDecoder and x-transformers. Ship it with "
                "torch.export (README, 'Shipping a converted model')"
            )
    return native.eval()


__all__ = ["to_native"]
