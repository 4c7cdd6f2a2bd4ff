"""Which modules are norms, found by what they compute: LayerNorm-like or RMSNorm-like.

:func:`recognize_norm` returns a frozen :class:`NormSpec` for

* ``nn.LayerNorm`` and ``nn.RMSNorm`` (and ``ln_lightning``'s fused subclasses): from the class;
* subclasses of those that override ``forward``, classes named like norms (``*RMSNorm``,
  ``*LayerNorm``, ``*Norm``: Hugging Face's ``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``,
  ``Gemma2RMSNorm``/``Gemma3RMSNorm`` with their ``1 + w`` weight, ``Olmo2RMSNorm``,
  ``T5LayerNorm``, ...), and classes given to :func:`register_norm_class`: by running the module's
  own ``forward`` on a small probe input and checking which formula it matches.

The probe decides everything a drop-in must preserve: LayerNorm or RMSNorm, whether the weight
is applied as ``w`` or ``1 + w``, that ``eps`` (read from ``eps`` / ``variance_epsilon`` /
``epsilon``) is the one actually used (one probe row has mean square ~ eps), and, with a bfloat16
probe, the cast order around the weight (:data:`CAST_ORDERS`). A class that only *looks* like a
norm (a name match whose forward computes something else) is not recognised;
:func:`explain_norm` says why.

This module is part of the leaf package ``ln_lightning.norm`` and imports nothing else from
``ln_lightning``; the placement engine and the monitors build on it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor, nn

from ._common import CAST_ORDERS, round_dtype
from ._common import rms_output_dtype as output_dtype

__all__ = [
    "CAST_ORDERS",
    "NormSpec",
    "explain_norm",
    "is_norm",
    "norm_reference",
    "recognize_norm",
    "register_norm_class",
    "registered_norm_classes",
    "unregister_norm_class",
]

KINDS = ("layer", "rms")
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
_NAME_SUFFIXES = ("RMSNorm", "LayerNorm", "Norm")


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """What a norm module computes, as :func:`recognize_norm` found it.

    Attributes:
        kind: ``"layer"`` (subtract the mean, divide by the standard deviation) or ``"rms"``
            (divide by the root mean square).
        eps: added to the variance / mean square; ``None`` for ``nn.RMSNorm(eps=None)``, which
            uses ``torch.finfo(input.dtype).eps`` at call time.
        weight: the module's own weight tensor (the very object, not a copy), or ``None``.
        bias: the module's own bias tensor, or ``None``.
        unit_offset: the weight is applied as ``1 + weight`` (Gemma 2/3).
        cast_order: for RMSNorm, how the normalised value meets the weight in half precision:
            ``"fp32"`` (``(n * w.float()).to(x.dtype)``: nn.RMSNorm, Gemma, OLMo 2), ``"llama"``
            (``w * n.to(x.dtype)``: Llama, Qwen2, Mistral, ...) or ``"t5"`` (``w * n.to(w.dtype)``
            when ``w`` is half: T5LayerNorm); ``"layer"`` for LayerNorms (aten's own rule).
        normalized_shape: the normalised trailing dimensions.
        eps_attr: the attribute holding ``eps`` (``"eps"``, ``"variance_epsilon"``, ...).
        source: ``"class"`` (nn.LayerNorm / nn.RMSNorm family), ``"probe"`` (matched on the probe
            input) or ``"registered"`` (registered class, matched on the probe input).
    """

    kind: str
    eps: Optional[float]
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    unit_offset: bool
    cast_order: str
    normalized_shape: tuple[int, ...]
    eps_attr: str = "eps"
    source: str = "class"

    @property
    def weight_offset(self) -> float:
        """``1.0`` for a ``1 + w`` weight, else ``0.0``."""
        return 1.0 if self.unit_offset else 0.0

    @property
    def ndim(self) -> int:
        """How many trailing dimensions are normalised."""
        return len(self.normalized_shape)

    def eps_for(self, dtype: torch.dtype) -> float:
        """The eps used for an input of ``dtype`` (resolves nn.RMSNorm's ``eps=None``)."""
        return torch.finfo(dtype).eps if self.eps is None else self.eps


_registered: dict[type, Optional[str]] = {}


def register_norm_class(norm_class: type, kind: Optional[str] = None) -> None:
    """Have :func:`recognize_norm` consider ``norm_class`` (an nn.Module normalising its input's
    last dimensions) although its name does not look like a norm.

    Its instances are still checked on the probe input; ``kind`` (``"layer"`` | ``"rms"``)
    restricts the match to that kind, ``None`` lets the probe decide. The module needs a weight
    (``weight``) or an ``eps`` attribute to be read; otherwise the probe has nothing to fit.
    """
    if not (isinstance(norm_class, type) and issubclass(norm_class, nn.Module)):
        raise TypeError(f"register_norm_class expects an nn.Module subclass, got {norm_class!r}")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"register_norm_class: kind must be one of {KINDS} or None, got {kind!r}")
    _registered[norm_class] = kind


def unregister_norm_class(norm_class: type) -> None:
    _registered.pop(norm_class, None)


def registered_norm_classes() -> list[type]:
    return list(_registered)


def _registered_kind(cls: type) -> tuple[bool, Optional[str]]:
    for c in cls.__mro__:
        if c in _registered:
            return True, _registered[c]
    return False, None


# --------------------------------------------------------------------------- formulas

def norm_reference(spec: NormSpec, x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
    """What a norm described by ``spec`` computes on ``x``, written out in plain torch ops.

    ``weight``/``bias`` default to the spec's own tensors. For float64 inputs everything is
    float64 (the independent reference the tests and the swap compare against).
    """
    w = spec.weight if weight is None else weight
    b = spec.bias if bias is None else bias
    eps = spec.eps_for(x.dtype)
    dims = tuple(range(-spec.ndim, 0))
    cdt = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(cdt)
    if spec.kind == "layer":
        mean = xc.mean(dims, keepdim=True)
        var = (xc - mean).square().mean(dims, keepdim=True)
        n = (xc - mean) * torch.rsqrt(var + eps)
        if w is not None:
            n = n * (w.to(cdt) + spec.weight_offset)
        if b is not None:
            n = n + b.to(cdt)
        return n.to(x.dtype)
    n = xc * torch.rsqrt(xc.square().mean(dims, keepdim=True) + eps)
    wdt = None if w is None else w.dtype
    rnd = round_dtype(spec.cast_order, x.dtype, wdt)
    if rnd is not None:
        n = n.to(rnd).to(cdt)
    if w is not None:
        n = n * (w.to(cdt) + spec.weight_offset)
    if b is not None:
        n = n + b.to(cdt)
    return n.to(output_dtype(spec.cast_order, x.dtype, wdt))


# --------------------------------------------------------------------------- recognition

def _class_spec(module: nn.Module) -> Optional[NormSpec]:
    """nn.LayerNorm / nn.RMSNorm whose forward is the library's own (or ln_lightning's fused one)."""
    cls = type(module)
    own = getattr(cls, "ln_lightning_norm_forward", False) or getattr(cls, "ln_lightning_deferred", False)
    if isinstance(module, nn.LayerNorm) and (own or cls.forward is nn.LayerNorm.forward):
        return NormSpec("layer", float(module.eps), module.weight, module.bias, False, "layer",
                        tuple(module.normalized_shape))
    if hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm) and (own or cls.forward is nn.RMSNorm.forward):
        return NormSpec("rms", None if module.eps is None else float(module.eps), module.weight, None,
                        float(getattr(module, "weight_offset", 0.0)) == 1.0, getattr(module, "cast_order", "fp32"),
                        tuple(module.normalized_shape))
    return None


def _looks_like_norm(module: nn.Module) -> tuple[bool, Optional[str], str]:
    """(candidate?, kind restriction, source)."""
    cls = type(module)
    registered, kind = _registered_kind(cls)
    if registered:
        return True, kind, "registered"
    if isinstance(module, nn.LayerNorm):
        return True, None, "probe"
    if hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm):
        return True, None, "probe"
    return any(c.__name__.endswith(_NAME_SUFFIXES) for c in cls.__mro__[:-1]), None, "probe"


def _read_params(module: nn.Module) -> tuple[Optional[Tensor], Optional[Tensor], Optional[tuple[int, ...]], Optional[str], Optional[float], Optional[str]]:
    """(weight, bias, shape, eps_attr, eps, why-not)."""
    if any(True for _ in module.children()):
        return None, None, None, None, None, "it has submodules (a norm is a leaf module)"
    w = getattr(module, "weight", None)
    b = getattr(module, "bias", None)
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and not (isinstance(t, Tensor) and t.is_floating_point()):
            return None, None, None, None, None, f"its {name} is not a floating-point tensor"
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    elif w is not None:
        shape = tuple(w.shape)
    elif b is not None:
        shape = tuple(b.shape)
    if not shape:
        return None, None, None, None, None, "neither normalized_shape nor a weight tells its width"
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and tuple(t.shape) != shape:
            return None, None, None, None, None, f"its {name} has shape {tuple(t.shape)}, not {shape}"
    for attr in _EPS_ATTRS:
        if hasattr(module, attr):
            eps = getattr(module, attr)
            if eps is None or isinstance(eps, (int, float)):
                return w, b, shape, attr, (None if eps is None else float(eps)), None
    return None, None, None, None, None, f"it has no eps attribute ({', '.join(_EPS_ATTRS)})"


def _probe_input(shape: tuple[int, ...], eps: float, dtype: torch.dtype, device) -> Tensor:
    g = torch.Generator().manual_seed(1234)
    rows = torch.randn((3, *shape), generator=g, dtype=torch.float64) + 0.75  # nonzero mean: LN != RMS
    rows[1] *= math.sqrt(max(eps, 1e-30))  # mean square ~ eps: a wrong eps shows here
    rows[2] = 2.0 + torch.randn((), generator=g, dtype=torch.float64)  # constant row
    return rows.to(device=device, dtype=dtype)


def _candidates(kind: Optional[str], has_bias: bool) -> list[tuple[str, bool]]:
    kinds = [kind] if kind else list(KINDS)
    return [(k, off) for k in kinds for off in (False, True) if not (k == "rms" and has_bias and off)]


def _close(a: Tensor, b: Tensor, dtype: torch.dtype) -> bool:
    if a.shape != b.shape or not torch.isfinite(a).all():
        return False
    tol = 16 * torch.finfo(dtype).eps
    scale = b.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)  # per row: row 1 is tiny
    return bool(((a.double() - b.double()).abs() <= tol * scale + 1e-30).all())


def _probe(module: nn.Module, kind: Optional[str], source: str) -> tuple[Optional[NormSpec], str]:
    w, b, shape, eps_attr, eps, why = _read_params(module)
    if why is not None:
        return None, why
    ref = w if w is not None else b
    dtype = ref.dtype if ref is not None else torch.float32
    device = ref.device if ref is not None else torch.device("cpu")
    if device.type == "meta":
        return None, "its parameters are on the meta device (nothing to probe)"
    # In the parameters' dtype (a half-precision module is checked within its own rounding: the
    # formulas told apart differ by O(1), a wrong eps by a factor on the mean-square-~-eps row).
    probe_dtype = dtype
    eps_probe = torch.finfo(probe_dtype).eps if eps is None else eps
    x = _probe_input(shape, eps_probe, probe_dtype, device)
    try:
        with torch.no_grad():
            got = _own_forward(module)(x)  # .forward, not __call__: no hooks (a monitor's) fire
    except Exception as exc:  # noqa: BLE001 - a forward that cannot take one tensor is not a norm
        return None, f"its forward failed on a probe tensor of shape {tuple(x.shape)} ({type(exc).__name__}: {exc})"
    if not isinstance(got, Tensor):
        return None, f"its forward returned a {type(got).__name__}, not a tensor"
    for k, off in _candidates(kind, b is not None):
        spec = NormSpec(k, eps, w, b, off, "layer" if k == "layer" else "fp32", shape, eps_attr, source)
        if _close(got, norm_reference(spec, x), probe_dtype):
            if k == "rms":
                spec = dataclasses.replace(spec, cast_order=_cast_order(module, spec, shape, eps_probe, device))
            return spec, ""
    return None, ("its forward on a probe input matches neither LayerNorm nor RMSNorm (with weight w or 1 + w "
                  f"and {eps_attr}={eps}); register_norm_class cannot change what it computes")


def _own_forward(module: nn.Module):
    """The module's bound forward; for a norm the placement engine deferred (its forward now
    passes the stream through), the forward of the norm class it wraps."""
    cls = type(module)
    if getattr(cls, "ln_lightning_deferred", False) and len(cls.__mro__) > 2:
        return cls.__mro__[2].forward.__get__(module)
    return module.forward


def _cast_order(module: nn.Module, spec: NormSpec, shape, eps: float, device) -> str:
    """The cast order whose result on a bfloat16 input equals the module's own, bit for bit.

    Run on a shallow copy holding a random float32 weight (the module itself is untouched): with
    float32 weights the three orders give different results (different output dtype, or a
    rounding before the multiply or not), whatever the module's current weights are.
    """
    x = _probe_input(shape, eps, torch.bfloat16, device)
    if spec.weight is None:
        return "fp32"  # without a weight the orders coincide
    g = torch.Generator().manual_seed(99)
    probe_w = (1 + 0.5 * torch.randn(shape, generator=g)).to(device)
    twin = copy.copy(module)
    twin._parameters = dict(module._parameters)
    twin._parameters["weight"] = nn.Parameter(probe_w, requires_grad=False)
    try:
        with torch.no_grad():
            got = _own_forward(twin)(x)
    except Exception:  # noqa: BLE001 - cannot run bfloat16 with a float32 weight: keep the default
        return "fp32"
    best, best_err = "fp32", math.inf
    for order in CAST_ORDERS:
        want = norm_reference(dataclasses.replace(spec, cast_order=order), x, probe_w)
        if not isinstance(got, Tensor) or got.dtype != want.dtype:
            continue
        # Exact for HF's modules; a module with another reduction order gets the closest one.
        err = (got.double() - want.double()).abs().max().item()
        if err < best_err:
            best, best_err = order, err
    return best


def _recognize(module: nn.Module) -> tuple[Optional[NormSpec], str]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"recognize_norm needs an nn.Module, got {type(module).__name__}")
    spec = _class_spec(module)
    if spec is not None:
        return spec, ""
    candidate, kind, source = _looks_like_norm(module)
    if not candidate:
        return None, "neither a LayerNorm/RMSNorm class, nor named like a norm, nor registered (register_norm_class)"
    return _probe(module, kind, source)


def recognize_norm(module: nn.Module) -> Optional[NormSpec]:
    """The :class:`NormSpec` of ``module`` if it is a LayerNorm-like or RMSNorm-like norm, else None.

    Decided by what the module computes (see the module docstring): ``nn.LayerNorm`` and
    ``nn.RMSNorm`` from their class; anything else that is named like a norm or registered with
    :func:`register_norm_class` by running its ``forward`` on a 3-row probe input (no hooks fire,
    the module is not changed; a few small tensor ops). :func:`explain_norm` says why not.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from ln_lightning.norm import recognize_norm
        >>> class MyRMSNorm(nn.Module):  # HF style: its own class, its own eps attribute
        ...     def __init__(self, d):
        ...         super().__init__()
        ...         self.weight, self.variance_epsilon = nn.Parameter(torch.ones(d)), 1e-6
        ...     def forward(self, x):
        ...         h = x.float()
        ...         h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        ...         return self.weight * h.to(x.dtype)
        >>> spec = recognize_norm(MyRMSNorm(8))
        >>> spec.kind, spec.eps, spec.unit_offset, spec.cast_order, spec.normalized_shape
        ('rms', 1e-06, False, 'llama', (8,))
        >>> recognize_norm(nn.LayerNorm(8)).kind
        'layer'
        >>> recognize_norm(nn.Linear(8, 8)) is None
        True
    """
    return _recognize(module)[0]


def is_norm(module: nn.Module) -> bool:
    """``recognize_norm(module) is not None``."""
    return _recognize(module)[0] is not None


def explain_norm(module: nn.Module) -> str:
    """One sentence: what :func:`recognize_norm` found, or why ``module`` is not recognised."""
    spec, why = _recognize(module)
    name = type(module).__qualname__
    if spec is None:
        return f"{name} is not a recognised norm: {why}"
    what = "LayerNorm" if spec.kind == "layer" else "RMSNorm"
    extra = ", weight applied as 1 + w" if spec.unit_offset else ""
    order = f", cast order {spec.cast_order!r}" if spec.kind == "rms" else ""
    return f"{name} is a {what} over {spec.normalized_shape} with {spec.eps_attr}={spec.eps}{extra}{order} ({spec.source})"
