"""The norm classes the exact rewrites read and write, and changing a norm's class in place.

`to_rmsnorm` turns a LayerNorm into an RMSNorm with the same `eps` and gain. A LayerNorm with a bias keeps it:
torch's `nn.RMSNorm` has none, so it becomes `RMSNormWithBias` (`nn.RMSNorm` plus an added `bias`, the same
`weight` / `bias` state_dict keys as the LayerNorm it was), or `FusedRMSNormWithBias` with `fused=True`.

The class is changed in place (`module.__class__ = ...`, as `swap_layernorms` does): the module keeps its path,
its Parameter objects (an optimizer's references stay valid), its hooks, and a norm `convert` deferred stays
deferred (the hooks at its branch's entries hold the module itself).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ln_lightning.norm import kinds
from ln_lightning.norm.modules import FusedLayerNorm
from ln_lightning.norm.modules import FusedRMSNorm
from ln_lightning.placement.rewrite import hooks


class RMSNormWithBias(nn.RMSNorm):
    """`nn.RMSNorm` followed by an added `bias` (a pre-norm LayerNorm's exact RMSNorm form keeps its bias)."""

    bias: nn.Parameter | None

    def forward(self, input: Tensor) -> Tensor:
        y = super().forward(input)
        return y if self.bias is None else y + self.bias


class FusedRMSNormWithBias(FusedRMSNorm):
    """`FusedRMSNorm` followed by an added `bias`."""

    bias: nn.Parameter | None
    # Not FusedRMSNorm's formula (the bias): `ln_lightning.norm.kinds` reads this one from its forward, bias included.
    ln_lightning_norm_forward = False

    def forward(self, input: Tensor) -> Tensor:
        y = super().forward(input)
        return y if self.bias is None else y + self.bias


_LAYERNORMS = (nn.LayerNorm, FusedLayerNorm)
_RMSNORMS = (nn.RMSNorm, FusedRMSNorm, RMSNormWithBias, FusedRMSNormWithBias)


def own_class(norm: nn.Module) -> type:
    """The norm's class, also while `convert` deferred it."""
    return hooks.original_class(norm)


def is_layernorm(norm: nn.Module) -> bool:
    """A LayerNorm whose forward is torch's (or ours, the same formula)."""
    return own_class(norm) in _LAYERNORMS


def is_rmsnorm(norm: nn.Module) -> bool:
    return own_class(norm) in _RMSNORMS


def why_not_layernorm(norm: nn.Module) -> str:
    """"" where `to_rmsnorm` can rewrite this LayerNorm's class; otherwise why not."""
    if isinstance(norm, hooks.BypassableNorm):
        return "a final norm convert put into the model's own slot: its class is left as it is"
    if len(getattr(norm, "normalized_shape", ())) != 1:
        return f"normalises over {tuple(norm.normalized_shape)}, not one feature dimension"
    return ""


def foreign_spec(norm: nn.Module) -> kinds.NormSpec | None:
    """What another class's norm computes (Hugging Face's `LlamaRMSNorm`, Gemma's `1 + w` one, ...), read by
    `ln_lightning.norm.kinds` from its forward on a probe; None where it is no norm over one feature dimension."""
    spec = kinds.recognize_norm(norm)
    return spec if spec is not None and spec.ndim == 1 else None


_READS_ITS_NORMS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def read_by_its_owner(model: nn.Module, name: str) -> str:
    """"" unless a module holding the norm reads the norm's attributes itself, so that its class and parameters
    can't change under it (torch's Transformer layers check `norm.weight` and `norm.bias` for their fast path)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:i]))
        if isinstance(owner, _READS_ITS_NORMS):
            return (f"held by torch's {type(owner).__name__} ({'.'.join(parts[:i]) or 'the model'}), which reads its "
                    "norms' weight and bias itself (its fast path): they can't change under it")
    return ""


def gain_and_bias(norm: nn.Module, spec: kinds.NormSpec | None = None) -> tuple[Tensor | None, Tensor | None]:
    """The gain (offset applied: Gemma's `1 + w`) and bias the norm multiplies and adds."""
    if spec is not None:
        w, b, offset = spec.weight, spec.bias, spec.weight_offset
    else:
        w, b, offset = norm._parameters.get("weight"), norm._parameters.get("bias"), getattr(norm, "weight_offset", 0.0)
    if w is not None and offset:
        w = w + offset
    return w, b


def make_identity(spec: kinds.NormSpec) -> None:
    """A foreign norm's gain and bias set to the identity (its class has no form without them): gain 1, bias 0."""
    with torch.no_grad():
        if spec.weight is not None:
            spec.weight.fill_(1.0 - spec.weight_offset)
        if spec.bias is not None:
            spec.bias.zero_()


def _set_class(norm: nn.Module, base: type) -> None:
    norm.__class__ = type(norm).ln_lightning_rewrap(base) if hooks.is_deferred(norm) else base


def to_rms_class(norm: nn.Module, fused: bool) -> None:
    """Make the LayerNorm `norm` an RMSNorm of the same eps, gain and bias, in place."""
    if norm._parameters.get("bias") is not None:
        base = FusedRMSNormWithBias if fused else RMSNormWithBias
    else:
        base = FusedRMSNorm if fused else nn.RMSNorm
        norm._parameters.pop("bias", None)
    # nn.RMSNorm keeps the same attributes as nn.LayerNorm (normalized_shape, eps, elementwise_affine, weight).
    _set_class(norm, base)


def restore_class(norm: nn.Module, cls: type, params: dict) -> None:
    norm.__class__ = cls
    norm._parameters.clear()
    norm._parameters.update(params)


def drop_affine(norm: nn.Module) -> None:
    """The norm without gain and bias (folded into its readers): `elementwise_affine=False`."""
    norm._parameters["weight"] = None
    if "bias" in norm._parameters:
        norm._parameters["bias"] = None
    norm.elementwise_affine = False
    if getattr(norm, "weight_offset", 0.0):
        norm.weight_offset = 0.0


__all__ = ["RMSNormWithBias", "FusedRMSNormWithBias"]
