"""Native pre-norm forms of converted torch and x-transformers stacks: modules that compute the converted function
as their own code, with no rewrite (no hooks, no ln_lightning classes), whose state_dict a plain construction loads.

* torch ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` / ``nn.Transformer`` -> the same with
  ``norm_first=True`` layers (and the stack's ``norm``: the final norm the rewrite added, or the one it had);
* x-transformers ``Encoder`` / ``Decoder`` (any ``AttentionLayers``) built with ``pre_norm=False`` -> the layout
  ``pre_norm=True`` builds: each layer's norm moved from its post-main slot to its pre-branch slot, the added final
  norm in ``final_norm``. Its state_dict loads into ``Encoder(..., pre_norm=True)`` built with the same arguments.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from ln_lightning.export import native_hf
from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement import state as rewrite_state
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.rewrite.fused_layers import FUSED_CLASS

_PLAIN_LAYERS = {*FUSED_CLASS, *FUSED_CLASS.values()}


def _require(record: dict, what: str, *, final_norm_free: bool) -> None:
    config = record["config"]
    allowed = {"placement", "final_norm", "branch_scale"}
    if config.get("placement") != "pre" or config.get("branch_scale") is not None or set(config) - allowed:
        raise native_hf.NoNativeForm(
            f"{what} computes plain pre-norm; this rewrite is {', '.join(f'{k}={v!r}' for k, v in config.items())}"
        )
    if record.get("transition"):
        raise native_hf.NoNativeForm(f"the model is mid-transition (a blend of post- and pre-norm), which no {what} computes")
    if not final_norm_free and not config.get("final_norm"):
        raise native_hf.NoNativeForm(f"{what} adds a final norm; this rewrite has final_norm=False")


def _plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.rpartition(".")[2] != rewrite_state.MARKER}


def _layer_args(layer: nn.Module) -> dict:
    if type(layer) not in _PLAIN_LAYERS:
        raise native_hf.NoNativeForm(f"{type(layer).__name__} subclasses a torch Transformer layer with its own code")
    if not layer.norm_first:
        raise native_hf.NoNativeForm(f"{type(layer).__name__} was not converted (norm_first=False)")
    attn = layer.self_attn
    return dict(d_model=attn.embed_dim, nhead=attn.num_heads, dim_feedforward=layer.linear1.out_features,
                dropout=layer.dropout.p, activation=layer.activation, layer_norm_eps=layer.norm1.eps,
                batch_first=attn.batch_first, norm_first=True, bias=layer.linear1.bias is not None)


def _norm_like(norm: nn.Module | None) -> nn.Module | None:
    if norm is None:
        return None
    return nn.LayerNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine,
                        bias=getattr(norm, "bias", None) is not None)


def _torch_stack(stack: nn.Module) -> nn.Module:
    first = stack.layers[0]
    args = _layer_args(first)
    if any(_layer_args(layer) != args for layer in stack.layers):
        raise native_hf.NoNativeForm("the stack's layers are not all built alike")
    if isinstance(stack, nn.TransformerEncoder):
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(**args), len(stack.layers), norm=_norm_like(stack.norm),
                                     enable_nested_tensor=False, mask_check=stack.mask_check)
    return nn.TransformerDecoder(nn.TransformerDecoderLayer(**args), len(stack.layers), norm=_norm_like(stack.norm))


def torch_transformer(model: nn.Module, record: dict) -> nn.Module:
    _require(record, "a torch Transformer with norm_first=True", final_norm_free=True)
    if isinstance(model, nn.Transformer):
        args = _layer_args(model.encoder.layers[0])
        native = nn.Transformer(num_encoder_layers=len(model.encoder.layers), num_decoder_layers=len(model.decoder.layers),
                                custom_encoder=_torch_stack(model.encoder), custom_decoder=_torch_stack(model.decoder), **args)
    elif isinstance(model, (nn.TransformerEncoder, nn.TransformerDecoder)):
        native = _torch_stack(model)
    else:
        raise native_hf.NoNativeForm(f"{type(model).__name__} is not a torch nn.Transformer / TransformerEncoder / TransformerDecoder")
    native.load_state_dict(_plain_state(model), strict=True)
    return native


def _x_transformers_classes():
    m = sys.modules.get("x_transformers.x_transformers")
    return (m.AttentionLayers,) if m is not None else ()


def x_transformers(model: nn.Module, record: dict) -> nn.Module:
    _require(record, "x-transformers with pre_norm=True", final_norm_free=True)
    if [p for p, _ in record["converted"]] != [""]:
        raise native_hf.NoNativeForm("the rewrite converted more than this AttentionLayers")
    native = copy.deepcopy(model)
    rewrite_state.detach(native)
    for m in native.modules():  # what the rewrite put on the copy: hooks, deferred and bypassable norms
        for kind in hooks.OUR_HOOK_TYPES:
            hooks.remove_our_hooks(m, kind)
        if hooks.is_deferred(m):
            hooks.undefer_norm(m)
        elif isinstance(m, hooks.BypassableNorm):
            m.__class__ = hooks.original_class(m)
        for attr in ("ln_lightning_final_norm_of", "ln_lightning_slot_was"):
            m.__dict__.pop(attr, None)
    for i, layer in enumerate(native.layers):
        norms = layer[0]
        if norms[0] is not None or norms[1] is not None or norms[2] is None:
            raise native_hf.NoNativeForm(f"layer {i} does not have x-transformers' post-norm layout (one post-main norm)")
        norms[0], norms[2] = norms[2], None
    native.pre_norm = True
    return native


def native_stack(model: nn.Module, record: dict) -> nn.Module | None:
    """The native form of a converted torch / x-transformers stack, or None when `model` is neither."""
    if isinstance(model, (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder)):
        native = torch_transformer(model, record)
    elif _x_transformers_classes() and isinstance(model, _x_transformers_classes()):
        native = x_transformers(model, record)
    else:
        return None
    _check(model, native)
    return native


def _probe(model: nn.Module):
    g = torch.Generator().manual_seed(0)
    p = next(model.parameters())
    if isinstance(model, (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder)):
        layer = model.encoder.layers[0] if isinstance(model, nn.Transformer) else model.layers[0]
        d, first = layer.self_attn.embed_dim, layer.self_attn.batch_first
        shape = (2, 5, d) if first else (5, 2, d)
        x = torch.randn(shape, generator=g).to(p)
        return (x,) if isinstance(model, nn.TransformerEncoder) else (x, torch.randn(shape, generator=g).to(p))
    dim = model.layers[0][1].to_q.in_features if hasattr(model.layers[0][1], "to_q") else p.shape[-1]
    return (torch.randn(2, 5, dim, generator=g).to(p),)


def _check(model: nn.Module, native: nn.Module) -> None:
    args = _probe(model)
    was = model.training
    model.eval(), native.eval()
    try:
        with torch.no_grad():
            err = native_hf.relative_error([native(*args)], [model(*args)])
    finally:
        model.train(was)
    if not err <= native_hf.TOLERANCE:
        raise PlacementError(
            f"the native {type(native).__name__} computes another function than the converted model (relative error "
            f"{err:.2e} on a probe input): refused. Please report this, with how the model was built"
        )
