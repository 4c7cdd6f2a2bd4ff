"""``FusedRMSNorm`` and ``FusedAddRMSNorm``: ``nn.RMSNorm`` subclasses on the fused backends, and
the forward that :func:`~ln_lightning.norm.swap_layernorms` gives Hugging Face's RMSNorm classes."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _backend, _common, functional
from .functional import fused_add_rms_norm


class FusedRMSNorm(nn.RMSNorm):
    r"""A drop-in ``nn.RMSNorm`` that runs on the fused backends.

    Same constructor (``normalized_shape, eps, elementwise_affine, device, dtype``), same parameter
    (``weight``), same ``state_dict``: a checkpoint saved from either class loads strictly into the
    other. On CUDA it runs the Triton kernels (float32 statistics, deterministic weight gradient);
    on CPU the compiled kernels for float32/bfloat16 (aten ops otherwise).

    Class attributes a subclass or an instance may set (none is in the state_dict):
    ``backend`` (``None`` | ``"auto"`` | ``"triton"`` | ``"torch"``), ``weight_offset`` (``1.0``
    applies the weight as ``1 + w``, Gemma's convention) and ``cast_order`` (``"fp32"`` |
    ``"llama"`` | ``"t5"``, see :func:`~ln_lightning.norm.fused_add_rms_norm`).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from ln_lightning.norm import FusedRMSNorm
        >>> ref = nn.RMSNorm(64, eps=1e-6)
        >>> norm = FusedRMSNorm(64, eps=1e-6)
        >>> norm.load_state_dict(ref.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(8, 64)
        >>> torch.allclose(norm(x), ref(x), atol=1e-6)
        True
    """

    backend: Optional[str] = None
    weight_offset: float = 0.0
    cast_order: str = "fp32"
    ln_lightning_norm_forward = True  # its forward is the norm it claims to be (norm.kinds)

    def forward(self, input: Tensor) -> Tensor:
        # Tiny eager inputs on the torch backend: nn.RMSNorm's own F.rms_norm is this module's
        # formula (offset 0, "fp32" order) and cheaper than any Python around it.
        name = self.backend or _backend.requested_backend()
        if (
            not self.weight_offset and self.cast_order == "fp32"
            and (name in ("torch", "cpu") or (name == "auto" and not input.is_cuda))
            and input.numel() < functional.RMS_EAGER_COMPOSITE_BELOW and not torch.compiler.is_compiling()
        ):
            return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)
        return fused_add_rms_norm(
            input, None, self.weight, self.eps, weight_offset=self.weight_offset, cast_order=self.cast_order,
            normalized_shape=self.normalized_shape, backend=self.backend,
        )[0]

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.weight_offset:
            text += f", weight_offset={self.weight_offset}"
        if self.cast_order != "fp32":
            text += f", cast_order={self.cast_order!r}"
        return text if self.backend is None else f"{text}, backend={self.backend!r}"


class FusedAddRMSNorm(nn.RMSNorm):
    r"""``forward(x, residual=None) -> (rms_norm(x + residual), x + residual)`` in one pass.

    The module form of :func:`~ln_lightning.norm.fused_add_rms_norm` for pre-norm blocks.
    Parameters and ``state_dict`` are exactly ``nn.RMSNorm``'s.

    Args (beyond ``nn.RMSNorm``'s):
        residual_in_fp32: keep the returned residual stream in float32.
        weight_offset: apply the weight as ``weight_offset + weight`` (``1.0`` for Gemma).
        cast_order: ``"fp32"`` | ``"llama"`` | ``"t5"``.
        backend: ``None`` | ``"auto"`` | ``"triton"`` | ``"torch"``.

    Example::

        >>> import torch
        >>> from ln_lightning.norm import FusedAddRMSNorm
        >>> norm = FusedAddRMSNorm(32, eps=1e-6)
        >>> stream, branch_out = torch.randn(4, 10, 32), torch.randn(4, 10, 32)
        >>> normed, stream = norm(branch_out, stream)  # stream <- stream + branch_out
        >>> normed.shape
        torch.Size([4, 10, 32])
    """

    backend: Optional[str] = None
    ln_lightning_norm_forward = True
    ln_lightning_fused_add = True  # forward(x, residual): normalises x + residual

    def __init__(
        self,
        normalized_shape,
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        residual_in_fp32: bool = False,
        weight_offset: float = 0.0,
        cast_order: str = "fp32",
        backend: Optional[str] = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.residual_in_fp32 = bool(residual_in_fp32)
        self.weight_offset = float(weight_offset)
        self.cast_order = _common.check_cast(cast_order)
        self.backend = _backend.canonical_backend(backend)

    def forward(self, input: Tensor, residual: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        return fused_add_rms_norm(
            input, residual, self.weight, self.eps, residual_in_fp32=self.residual_in_fp32,
            weight_offset=self.weight_offset, cast_order=self.cast_order,
            normalized_shape=self.normalized_shape, backend=self.backend,
        )

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.residual_in_fp32:
            text += ", residual_in_fp32=True"
        if self.weight_offset:
            text += f", weight_offset={self.weight_offset}"
        if self.cast_order != "fp32":
            text += f", cast_order={self.cast_order!r}"
        return text if self.backend is None else f"{text}, backend={self.backend!r}"


class FusedRMSNormForward:
    """Mixin placed in front of a foreign RMSNorm class (``LlamaRMSNorm``, ``Gemma2RMSNorm``,
    ``T5LayerNorm``, ...) by :func:`~ln_lightning.norm.swap_layernorms`: the module keeps its class's
    attributes and parameters and normalises with the fused kernel, in the numerics the swap read
    from it (instance attributes ``ln_rms_eps_attr``, ``ln_rms_offset``, ``ln_rms_cast``,
    ``ln_rms_shape``; eps is read live from the module's own attribute)."""

    backend: Optional[str] = None
    ln_lightning_norm_forward = True

    def forward(self, hidden_states: Tensor) -> Tensor:
        return fused_add_rms_norm(
            hidden_states, None, self.weight, getattr(self, self.ln_rms_eps_attr),
            weight_offset=self.ln_rms_offset, cast_order=self.ln_rms_cast,
            normalized_shape=self.ln_rms_shape, backend=self.backend,
        )[0]
