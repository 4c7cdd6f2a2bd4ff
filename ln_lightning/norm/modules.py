"""The fused norm modules: ``FusedLayerNorm`` / ``FusedAddLayerNorm`` (``nn.LayerNorm`` subclasses),
``FusedRMSNorm`` / ``FusedAddRMSNorm`` (``nn.RMSNorm`` subclasses), and the forward that
:func:`~ln_lightning.norm.swap_layernorms` gives Hugging Face's RMSNorm classes.

Each class subclasses the torch class it replaces (so ``isinstance`` and ``state_dict`` stay theirs);
what they share, the backend choice for the eager shortcut and the repr of the options, is below, and
both call the one functional layer (:mod:`.functional`)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _backend, _common, functional
from .functional import fused_add_layer_norm, fused_add_rms_norm


def _runs_on_torch(module: nn.Module, input: Tensor) -> bool:
    # The torch backend serves this call: pinned, or "auto" off CUDA.
    name = module.backend or _backend.requested_backend()
    return name in ("torch", "cpu") or (name == "auto" and not input.is_cuda)


def _options_repr(module: nn.Module, text: str) -> str:
    # The non-default options of any fused norm, after torch's own extra_repr.
    if getattr(module, "residual_in_fp32", False):
        text += ", residual_in_fp32=True"
    if getattr(module, "weight_offset", 0.0):
        text += f", weight_offset={module.weight_offset}"
    if getattr(module, "cast_order", "fp32") != "fp32":
        text += f", cast_order={module.cast_order!r}"
    return text if module.backend is None else f"{text}, backend={module.backend!r}"


class FusedLayerNorm(nn.LayerNorm):
    r"""A drop-in ``nn.LayerNorm`` that runs on the fused backends.

    Same constructor (``normalized_shape, eps, elementwise_affine, bias, device, dtype``), same
    parameters (``weight``, ``bias``), same ``state_dict`` keys, same results: a checkpoint saved
    from either class loads strictly into the other. On CUDA it runs the Triton kernels (float32
    statistics, deterministic weight/bias gradients); elsewhere it runs aten's kernel.

    The optional ``backend`` attribute (``None``, ``"auto"``, ``"triton"``, ``"torch"``) pins the
    backend for this module; it is not part of the state_dict.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from ln_lightning.norm import FusedLayerNorm
        >>> ref = nn.LayerNorm(64)
        >>> ln = FusedLayerNorm(64)
        >>> ln.load_state_dict(ref.state_dict())  # strict: the keys are identical
        <All keys matched successfully>
        >>> x = torch.randn(8, 64)
        >>> torch.allclose(ln(x), ref(x))
        True
        >>> fused = FusedLayerNorm.from_layernorm(ref)  # shares ref's Parameter objects
        >>> fused.weight is ref.weight
        True
    """

    backend: Optional[str] = None
    ln_lightning_norm_forward = True  # its forward is the norm it claims to be (norm.kinds)

    def forward(self, input: Tensor) -> Tensor:
        # Fast path: where the torch backend runs, a plain LayerNorm is exactly F.layer_norm (see
        # functional.PLAIN_LAYER_NORM_VIA_ATEN); skipping the generic wrapper keeps small calls
        # as cheap as nn.LayerNorm's.
        if (
            _runs_on_torch(self, input)
            and functional.PLAIN_LAYER_NORM_VIA_ATEN
            and (torch.compiler.is_compiling() or not functional.uses_compiled_cpu_kernels(input))
        ):
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        return fused_add_layer_norm(
            input, None, self.weight, self.bias, self.eps, normalized_shape=self.normalized_shape, backend=self.backend
        )[0]

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm, *, backend: Optional[str] = None) -> "FusedLayerNorm":
        """A new ``cls`` module that uses the *very same* Parameter objects as ``ln``.

        Device, dtype, ``requires_grad`` and optimizer identity are therefore preserved, and the
        module's hooks are carried over (the hook dicts are shared, so existing handles still
        remove them). ``ln`` keeps working and stays tied to the new module. To change a module
        inside a model, prefer :func:`~ln_lightning.norm.swap_layernorms`, which converts in place.
        """
        if not isinstance(ln, nn.LayerNorm):
            raise TypeError(f"from_layernorm needs an nn.LayerNorm, got {type(ln).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = tuple(ln.normalized_shape)
        new.eps = ln.eps
        new.elementwise_affine = ln.elementwise_affine
        # Same Parameter objects (or None), registered under the same names.
        new._parameters["weight"] = ln._parameters.get("weight")
        new._parameters["bias"] = ln._parameters.get("bias")
        new.training = ln.training
        for attr in (
            "_forward_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_forward_pre_hooks",
            "_forward_pre_hooks_with_kwargs",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
            "_state_dict_pre_hooks",
            "_load_state_dict_pre_hooks",
            "_load_state_dict_post_hooks",
        ):
            if hasattr(ln, attr):
                setattr(new, attr, getattr(ln, attr))
        if backend is not None:
            new.backend = _backend.canonical_backend(backend)
        return new

    def extra_repr(self) -> str:
        return _options_repr(self, super().extra_repr())


class FusedAddLayerNorm(nn.LayerNorm):
    r"""``forward(x, residual=None) -> (layer_norm(x + residual), x + residual)`` in one pass.

    The module form of :func:`~ln_lightning.norm.fused_add_layer_norm` for pre-norm blocks:
    the residual stream's add and the next LayerNorm share one read of the activations, forward
    and backward. Parameters and ``state_dict`` are exactly ``nn.LayerNorm``'s.

    Args (beyond ``nn.LayerNorm``'s):
        residual_in_fp32: keep the returned residual stream in float32.
        backend: ``None`` | ``"auto"`` | ``"triton"`` | ``"torch"``.

    Example::

        >>> import torch
        >>> from ln_lightning.norm import FusedAddLayerNorm
        >>> norm = FusedAddLayerNorm(32)
        >>> stream = torch.randn(4, 10, 32)
        >>> branch_out = torch.randn(4, 10, 32)
        >>> normed, stream = norm(branch_out, stream)  # stream <- stream + branch_out
        >>> normed.shape, stream.shape
        (torch.Size([4, 10, 32]), torch.Size([4, 10, 32]))
    """

    backend: Optional[str] = None
    residual_in_fp32: bool = False
    ln_lightning_norm_forward = True
    ln_lightning_fused_add = True  # forward(x, residual): normalises x + residual (norm.kinds)

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        residual_in_fp32: bool = False,
        backend: Optional[str] = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.residual_in_fp32 = bool(residual_in_fp32)
        self.backend = _backend.canonical_backend(backend)

    def forward(self, input: Tensor, residual: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        return fused_add_layer_norm(
            input,
            residual,
            self.weight,
            self.bias,
            self.eps,
            residual_in_fp32=self.residual_in_fp32,
            normalized_shape=self.normalized_shape,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return _options_repr(self, super().extra_repr())


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
        if (
            not self.weight_offset and self.cast_order == "fp32"
            and _runs_on_torch(self, input)
            and input.numel() < functional.RMS_EAGER_COMPOSITE_BELOW and not torch.compiler.is_compiling()
        ):
            return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)
        return fused_add_rms_norm(
            input, None, self.weight, self.eps, weight_offset=self.weight_offset, cast_order=self.cast_order,
            normalized_shape=self.normalized_shape, backend=self.backend,
        )[0]

    def extra_repr(self) -> str:
        return _options_repr(self, super().extra_repr())


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
        return _options_repr(self, super().extra_repr())


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
