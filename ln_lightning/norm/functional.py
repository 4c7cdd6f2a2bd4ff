"""The functional fused norms: ``layer_norm`` / ``fused_add_layer_norm`` and ``rms_norm`` / ``fused_add_rms_norm``.

One path serves both norms (input checks, backend choice, the flattened call of the backend's op); the
kind only picks the op (:mod:`._torch_ops`, :mod:`._triton_ops`) and, for small eager calls on the torch
backend, the plain composition of aten ops each norm falls back to."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _backend, _common
from . import _cpu_kernels, _torch_ops

# On the torch backend a LayerNorm with nothing to fuse *is* aten's kernel: our custom op around
# the same kernel only adds dispatch overhead (benchmarks/bench_norm.py measures both). Kept as a
# switch so the benchmark can time the custom-op path too.
PLAIN_LAYER_NORM_VIA_ATEN = True

# Eager calls on the torch backend with fewer elements than this run as the plain composition
# `h = x + residual; y = F.layer_norm(h)` (the same aten kernels, so the same results): below about
# a million elements the custom autograd.Function's fixed Python cost (~0.1 ms per forward +
# backward) outweighs the activation-sized tensor it saves. Tests set it to 0 to cover both paths.
EAGER_COMPOSITE_BELOW = 1 << 20

# bfloat16 CPU calls with at least this many elements run the compiled kernels of `_cpu_kernels`
# (plain LayerNorm too): from there on they beat aten's (1.1-1.4x forward+backward in
# benchmarks/bench_norm.py) and keep float32 statistics; below it the custom autograd function's
# fixed cost (~0.1 ms per forward + backward) is larger than what they save.
COMPILED_CPU_FROM = 1 << 16


def uses_compiled_cpu_kernels(x: Tensor) -> bool:
    """Whether an eager torch-backend call on ``x`` runs the compiled CPU kernels."""
    return (
        x.dtype in _cpu_kernels.DTYPES
        and x.device.type == "cpu"
        and x.numel() >= COMPILED_CPU_FROM
        and _cpu_kernels.KERNELS.module() is not None
    )

# RMSNorm's eager torch-backend calls with fewer elements than this run as the plain composition of
# aten ops (the same formula, autograd-tracked): for tiny tensors the custom autograd.Function's fixed
# Python cost (~0.1 ms per forward + backward) is more than the fused kernel saves; from a few
# thousand elements on the kernel wins (benchmarks/bench_norm.py). Tests set it to cover both.
RMS_EAGER_COMPOSITE_BELOW = 1 << 13

_triton_ops = None


def _ops(backend: str, rms: bool):
    """The forward op of a norm for a resolved backend: the ``torch.library`` op while torch.compile
    traces, the equivalent ``autograd.Function`` in eager mode. Imports triton only when it is used."""
    global _triton_ops
    compiling = torch.compiler.is_compiling()
    if backend == "torch":
        ops, name = _torch_ops, "add_rms_norm" if rms else "add_layer_norm"
    else:
        if _triton_ops is None:
            from . import _triton_ops as module

            _triton_ops = module
        ops, name = _triton_ops, "triton_add_rms_norm" if rms else "triton_add_layer_norm"
    return getattr(ops, name if compiling else f"{name}_eager")


def _resolve(x: Tensor, residual: Optional[Tensor], backend: Optional[str]) -> str:
    """The backend that runs this call: the residual's dtype can rule Triton out too."""
    explicit = _backend.canonical_backend(backend)
    name = _backend.resolve_backend(x, explicit)
    if name == "triton" and residual is not None and residual.dtype not in _backend.TRITON_DTYPES:
        name = _backend.resolve_backend(residual, explicit)
    return name


def _run(backend: str, rms: bool, x: Tensor, residual: Optional[Tensor], shape: tuple[int, ...], stored: bool,
         weight: Optional[Tensor], *args) -> tuple[Tensor, Tensor]:
    """The backend's op on the rows of ``x`` (flattened, contiguous); ``args`` follow the weight in its schema."""
    hidden = math.prod(shape)
    x2 = x.reshape(-1, hidden).contiguous()
    r2 = None if residual is None else residual.reshape(-1, hidden).contiguous()
    w = None if weight is None else weight.reshape(-1)
    y, residual_out, *_stats = _ops(backend, rms)(x2, r2, w, *args)
    return y.view(x.shape), (residual_out.view(x.shape) if stored else x)


def _composite_stream(x: Tensor, residual: Optional[Tensor], rdt: torch.dtype) -> Tensor:
    """``h = x + residual`` in the residual dtype, as autograd-tracked ops (the composites')."""
    if residual is None:
        return x.to(rdt)
    if x.dtype == rdt and residual.dtype == rdt:
        return x + residual
    return x.to(rdt) + residual.to(rdt)


def _normalized_shape(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], normalized_shape: Optional[Sequence[int]],
    kind: str = "LayerNorm",
) -> tuple[int, ...]:
    """The normalised shape (LayerNorm and RMSNorm alike): ``normalized_shape``, else the weight's (or bias's),
    else ``x``'s last dim; checked against ``x`` and the parameters."""
    if (normalized_shape is None and weight is not None and weight.dim() == 1 and x.dim()
            and x.shape[-1] == weight.shape[0] and (bias is None or bias.shape == weight.shape)):
        return tuple(weight.shape)  # the usual call, checked without building tuples (tiny calls are Python-bound)
    if normalized_shape is None:
        if weight is not None:
            normalized_shape = tuple(weight.shape)
        elif bias is not None:
            normalized_shape = tuple(bias.shape)
        else:
            normalized_shape = (x.shape[-1],)
    elif isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    shape = tuple(int(s) for s in normalized_shape)
    k = len(shape)
    if k == 0 or x.dim() < k or tuple(x.shape[-k:]) != shape:
        raise ValueError(
            f"{kind} over normalized_shape {shape} needs an input whose last {k} dims are {shape}, "
            f"got input of shape {tuple(x.shape)}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(p.shape)} but normalized_shape is {shape}")
    return shape


def _autocast_to_fp32(x: Tensor) -> bool:
    # CUDA autocast runs layer_norm in float32 (float32 output); CPU autocast leaves it alone.
    # Matching that keeps FusedLayerNorm's results equal to nn.LayerNorm's under AMP.
    return x.is_cuda and torch.is_autocast_enabled("cuda") and x.dtype != torch.float64


def _check_input(x: Tensor, residual: Optional[Tensor], kind: str = "LayerNorm") -> None:
    """The input checks of both norms' fused functions."""
    if not x.is_floating_point():
        raise TypeError(f"fused {kind} needs a floating-point input, got {x.dtype}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)} "
                "(the fused add does not broadcast; expand the residual explicitly)"
            )
        if not residual.is_floating_point():
            raise TypeError(f"residual must be floating-point, got {residual.dtype}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}")


def fused_add_layer_norm(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float = 1e-5,
    *,
    residual_in_fp32: bool = False,
    normalized_shape: Optional[Sequence[int]] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """``new_residual = x + residual``; ``y = layer_norm(new_residual)``; returns ``(y, new_residual)``.

    One pass forward and one backward: the gradient arriving at ``new_residual`` from later
    layers is added to the LayerNorm's input gradient inside the backward pass, and ``x`` and
    ``residual`` both receive that sum, as with ``h = x + residual; y = F.layer_norm(h, ...)``.

    Args:
        x: the sublayer output (any shape ``(..., *normalized_shape)``).
        residual: the residual stream, same shape as ``x``, or ``None``: then this is a plain
            LayerNorm and ``new_residual`` is ``x`` itself (a float32 copy if ``residual_in_fp32``).
        weight: the affine weight, of shape ``normalized_shape``, or ``None``.
        bias: the affine bias, of shape ``normalized_shape``, or ``None``.
        eps: added to the variance.
        residual_in_fp32: keep ``new_residual`` in float32 (the sum is computed in float32 too).
            Otherwise its dtype is ``torch.promote_types(x.dtype, residual.dtype)``.
        normalized_shape: defaults to ``weight.shape`` (or ``x.shape[-1:]`` without weight).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (``"cpu"``); ``None`` follows
            :func:`~ln_lightning.norm.norm_backend` / ``LN_LIGHTNING_NORM_BACKEND``.

    ``y`` has ``x``'s dtype (float32 under CUDA autocast, like ``F.layer_norm``). Statistics are
    computed in float32 for half inputs.

    Example::

        >>> import torch
        >>> from ln_lightning.norm import fused_add_layer_norm
        >>> x, stream = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
        >>> w, b = torch.ones(16), torch.zeros(16)
        >>> y, new_stream = fused_add_layer_norm(x, stream, w, b, 1e-5)
        >>> torch.equal(new_stream, x + stream)
        True
        >>> torch.allclose(y, torch.nn.functional.layer_norm(x + stream, (16,), w, b), atol=1e-5)
        True
    """
    _check_input(x, residual)
    shape = _normalized_shape(x, weight, bias, normalized_shape)
    name = _resolve(x, residual, backend)
    stored = _common.stores_residual(x, residual, residual_in_fp32)
    if name == "torch":
        compiling = torch.compiler.is_compiling()
        compiled_cpu = not compiling and uses_compiled_cpu_kernels(x)
        if not stored and PLAIN_LAYER_NORM_VIA_ATEN and not compiled_cpu:
            return F.layer_norm(x, shape, weight, bias, eps), x
        if not compiled_cpu and not compiling and x.numel() < EAGER_COMPOSITE_BELOW and not _autocast_to_fp32(x):
            return _composite_add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32, shape)
    b = None if bias is None else bias.reshape(-1)
    return _run(name, False, x, residual, shape, stored, weight, b, float(eps), residual_in_fp32, _autocast_to_fp32(x))


def _composite_add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32, shape):
    """What the torch backend's custom op computes, written as ordinary autograd-tracked ops."""
    h = _composite_stream(x, residual, _common.residual_dtype(x, residual, residual_in_fp32))
    w, b, _ = _torch_ops._params(weight, bias, h.dtype)
    y = F.layer_norm(h, shape, w, b, eps)
    return (y if y.dtype == x.dtype else y.to(x.dtype)), h


def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    backend: Optional[str] = None,
) -> Tensor:
    """Drop-in for ``F.layer_norm`` that runs on the fused backends."""
    return fused_add_layer_norm(x, None, weight, bias, eps, normalized_shape=normalized_shape, backend=backend)[0]


def _rms_eager_composite(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], residual_in_fp32: bool,
                         cast: str) -> bool:
    """Whether an eager torch-backend RMSNorm call runs as the reference modules' own ops (`_rms_composite`)
    rather than the custom op. The custom op pays off through the compiled CPU kernel; without it (float16,
    float64, another device, a failed build) its aten composition was 0.7-0.95x eager for half inputs
    and forward-only calls, and 1.2-3x for float32 forward+backward (its one-formula backward), on 2
    CPU cores (benchmarks/bench_norm.py "[aten]"): so the composition, except for that last case."""
    if x.numel() < RMS_EAGER_COMPOSITE_BELOW:
        return True
    if _torch_ops.rms_compiled_kernel_takes(x, residual, weight, residual_in_fp32, cast):
        return False
    grad = torch.is_grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad)
                                        or (weight is not None and weight.requires_grad))
    return not (grad and x.dtype in (torch.float32, torch.float64))


def fused_add_rms_norm(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    eps: Optional[float] = None,
    *,
    residual_in_fp32: bool = False,
    weight_offset: float = 0.0,
    cast_order: str = "fp32",
    normalized_shape: Optional[Sequence[int]] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """``new_residual = x + residual``; ``y = rms_norm(new_residual)``; returns ``(y, new_residual)``.

    One pass forward and one backward, as :func:`~ln_lightning.norm.fused_add_layer_norm`: the
    gradient arriving at ``new_residual`` is added to the norm's input gradient in the same pass.

    Args:
        x: the sublayer output (any shape ``(..., *normalized_shape)``).
        residual: the residual stream, same shape as ``x``, or ``None`` (a plain RMSNorm;
            ``new_residual`` is then ``x`` itself, or its float32 copy with ``residual_in_fp32``).
        weight: of shape ``normalized_shape``, or ``None``.
        eps: added to the mean square; ``None`` uses ``torch.finfo(x.dtype).eps`` (nn.RMSNorm's rule).
        residual_in_fp32: keep ``new_residual`` in float32 (summed in float32 too).
        weight_offset: the weight is applied as ``weight_offset + weight`` (``1.0`` for Gemma's ``1 + w``).
        cast_order: ``"fp32"`` (``(n * w).to(x.dtype)``, nn.RMSNorm / Gemma / OLMo 2), ``"llama"``
            (``w * n.to(x.dtype)``) or ``"t5"`` (``w * n.to(w.dtype)`` for a half ``w``); it decides
            the rounding and the output dtype for half inputs, exactly as those modules do.
        normalized_shape: defaults to ``weight.shape`` (``x.shape[-1:]`` without weight).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (``"cpu"``); ``None`` follows
            :func:`~ln_lightning.norm.norm_backend` / ``LN_LIGHTNING_NORM_BACKEND``.

    Statistics are float32 (float64 for float64 input).

    Example::

        >>> import torch
        >>> from ln_lightning.norm import fused_add_rms_norm
        >>> x, stream, w = torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.rand(16)
        >>> y, new_stream = fused_add_rms_norm(x, stream, w, 1e-6)
        >>> torch.equal(new_stream, x + stream)
        True
        >>> torch.allclose(y, torch.nn.functional.rms_norm(x + stream, (16,), w, 1e-6), atol=1e-5)
        True
    """
    _check_input(x, residual, "RMSNorm")
    _common.check_cast(cast_order)
    shape = _normalized_shape(x, weight, None, normalized_shape, "RMSNorm")
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    name = _resolve(x, residual, backend)
    stored = _common.stores_residual(x, residual, residual_in_fp32)
    composite = name == "torch" and not torch.compiler.is_compiling()
    if composite and _rms_eager_composite(x, residual, weight, residual_in_fp32, cast_order):
        y, h = _rms_composite(x, residual, weight, eps, residual_in_fp32, weight_offset, cast_order, len(shape))
        return y, (h if stored else x)
    return _run(name, True, x, residual, shape, stored, weight, float(eps), residual_in_fp32, float(weight_offset),
                cast_order)


def _rms_composite(x, residual, weight, eps, residual_in_fp32, offset, cast, ndim):
    """What the torch backend's op computes, as ordinary autograd-tracked ops over the last
    ``ndim`` dims: op for op the reference modules' own code where it applies (as cheap as they are)."""
    h = _composite_stream(x, residual, _common.residual_dtype(x, residual, residual_in_fp32))
    cdt = _common.compute_dtype(h.dtype, True)
    hc = h if h.dtype == cdt else h.to(cdt)
    dims = -1 if ndim == 1 else tuple(range(-ndim, 0))
    n = hc * torch.rsqrt(hc.pow(2).mean(dims, keepdim=True) + eps)
    wdt = None if weight is None else weight.dtype
    ydt = _common.rms_output_dtype(cast, x.dtype, wdt)
    if weight is None:
        return (n if n.dtype == ydt else n.to(ydt)), h
    rnd = _common.round_dtype(cast, x.dtype, wdt)
    if not offset and cast != "fp32":  # HF Llama / T5: w * n.to(dtype), PyTorch's own half multiply
        y = weight * (n if rnd is None else n.to(rnd))
    else:  # nn.RMSNorm / Gemma / OLMo 2: (n * (offset + w.float())).to(dtype)
        if rnd is not None:
            n = n.to(rnd).to(cdt)
        w = weight if weight.dtype == cdt else weight.to(cdt)
        y = n * (w + offset if offset else w)
    return (y if y.dtype == ydt else y.to(ydt)), h


def rms_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor] = None,
    eps: Optional[float] = None,
    *,
    weight_offset: float = 0.0,
    cast_order: str = "fp32",
    backend: Optional[str] = None,
) -> Tensor:
    """Drop-in for ``F.rms_norm`` that runs on the fused backends."""
    return fused_add_rms_norm(
        x, None, weight, eps, weight_offset=weight_offset, cast_order=cast_order,
        normalized_shape=normalized_shape, backend=backend,
    )[0]
