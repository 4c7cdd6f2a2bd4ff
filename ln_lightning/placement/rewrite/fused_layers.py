"""Pre-norm torch Transformer layers that fuse the residual add into the next LayerNorm.

In a pre-norm layer the stream's add after self-attention feeds the next sublayer's norm:
`x = x + sa(...)`, then `norm2(x)`. With `FusedLayerNorm` norms (after `swap_layernorms`) those two
steps run as one `fused_add_layer_norm` pass, forward and backward. `convert` switches a layer to
these classes (same module, same parameter names) and back.

The fused path is taken only when it computes exactly what torch's pre-norm forward computes and
nothing observes the norm: the layer is pre-norm, its norms are `FusedLayerNorm`, the norm carries
no hooks (a LayerNorm monitor's hooks must see the norm's input, so they switch fusion off), and
torch's own eval fast path does not apply (it is faster there). Otherwise torch's forward runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ln_lightning.norm import FusedLayerNorm, fused_add_layer_norm
from ln_lightning.placement.rewrite import hooks


def _fusable(layer: nn.Module, norm: nn.Module) -> bool:
    if not layer.norm_first or hooks.bypassed() or not isinstance(norm, FusedLayerNorm):
        return False
    if norm._forward_hooks or norm._forward_pre_hooks or getattr(norm, "ln_lightning_deferred", False):
        return False
    return layer.training or torch.is_grad_enabled()


def _add_norm(branch_out: torch.Tensor, stream: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_layer_norm(
        branch_out, stream, norm.weight, norm.bias, norm.eps, normalized_shape=norm.normalized_shape, backend=getattr(norm, "backend", None)
    )


class FusedPreNormEncoderLayer(nn.TransformerEncoderLayer):
    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if not _fusable(self, self.norm2):
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        # The same mask canonicalisation as torch's forward.
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask", other_type=F._none_or_dtype(src_mask),
            other_name="src_mask", target_type=src.dtype,
        )
        src_mask = F._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None, other_name="", target_type=src.dtype, check_other=False)
        sa = self._sa_block(self.norm1(src), src_mask, src_key_padding_mask, is_causal=is_causal)
        h, x = _add_norm(sa, src, self.norm2)
        return x + self._ff_block(h)


class FusedPreNormDecoderLayer(nn.TransformerDecoderLayer):
    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        if not (_fusable(self, self.norm2) and _fusable(self, self.norm3)):
            return super().forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        sa = self._sa_block(self.norm1(tgt), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
        h, x = _add_norm(sa, tgt, self.norm2)
        ca = self._mha_block(h, memory, memory_mask, memory_key_padding_mask, memory_is_causal)
        h, x = _add_norm(ca, x, self.norm3)
        return x + self._ff_block(h)


FUSED_CLASS = {nn.TransformerEncoderLayer: FusedPreNormEncoderLayer, nn.TransformerDecoderLayer: FusedPreNormDecoderLayer}
PLAIN_CLASS = {v: k for k, v in FUSED_CLASS.items()}
