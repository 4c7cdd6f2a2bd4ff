"""``swap_layernorms``: turn a model's ``nn.LayerNorm`` and RMSNorm modules into fused ones in place.

The swap changes each module's class (``module.__class__ = FusedLayerNorm``) instead of building
a new module, so *everything* about the instance is kept: the very same Parameter objects (device,
dtype, ``requires_grad``, optimizer identity), its hooks and their handles, any extra attributes,
and every reference to the module held elsewhere. ``FusedLayerNorm`` adds no state, so the
``state_dict`` is unchanged, and reverting is the reverse class assignment.

Which modules are swapped:

* exact ``nn.LayerNorm`` instances become ``FusedLayerNorm``;
* subclasses of ``nn.LayerNorm`` that do **not** override ``forward`` (e.g. a subclass that only
  changes ``__init__`` defaults) become a fused subclass of their own class, ``Fused<Name>``
  (its ``isinstance`` relations with the original class still hold);
* a norm that ``ln_lightning.placement.convert`` deferred (class ``DeferredLayerNorm``) becomes
  ``DeferredFusedLayerNorm``: it keeps the conversion and normalises with the fused kernel;
* RMSNorms: exact ``nn.RMSNorm`` instances become ``FusedRMSNorm`` (a subclass that does not
  override ``forward`` becomes ``Fused<Name>``, as above); any other module that
  :func:`~ln_lightning.norm.recognize_norm` finds to be an RMSNorm (Hugging Face's
  ``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``, ``Gemma2RMSNorm``/``Gemma3RMSNorm``,
  ``Olmo2RMSNorm``, ``T5LayerNorm``, ..., or a registered class) becomes ``Fused<Name>``, a
  subclass of its own class whose forward runs the fused kernel with the numerics read from the
  module: its eps attribute, the ``1 + w`` weight, its cast order. Nothing is added to the
  ``state_dict``; the settings live in instance attributes (``ln_rms_*``) removed on revert;
* LayerNorm subclasses that override ``forward`` are skipped (we cannot know what their forward does), as are
  parametrized modules, modules that are already fused, modules whose ``weight``/``bias`` are not
  tensors of ``normalized_shape``, and, with ``backend="triton"``, modules on a device or dtype
  the Triton kernels cannot take. Every skip is listed with its reason.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional

import torch
from torch import nn

from . import _backend
from .kinds import NormSpec, explain_norm, recognize_norm
from .modules import FusedAddLayerNorm, FusedLayerNorm
from .modules import FusedAddRMSNorm, FusedRMSNorm, FusedRMSNormForward

_FUSED_SUBCLASSES: dict[tuple[type, type], type] = {}
# Instance attributes the swap of a foreign RMSNorm class sets (and its revert removes).
_RMS_ATTRS = ("ln_rms_eps_attr", "ln_rms_offset", "ln_rms_cast", "ln_rms_shape")


def _fused_class_for(cls: type, fused_base: type = FusedLayerNorm, plain: type = nn.LayerNorm) -> type:
    """``fused_base`` for ``plain``; a cached ``Fused<Name>(fused_base, cls)`` otherwise."""
    if cls is plain:
        return fused_base
    fused = _FUSED_SUBCLASSES.get((fused_base, cls))
    if fused is None:
        # Registered as a module global so pickling a swapped model works within this process.
        ident = f"{cls.__module__}.{cls.__qualname__}".replace(".", "_").replace("<", "_").replace(">", "_")
        name = f"_Fused__{ident}"
        fused = type(
            f"Fused{cls.__name__}",
            (fused_base, cls),
            {"__module__": __name__, "__qualname__": name, "_ln_original_class": cls},
        )
        setattr(sys.modules[__name__], name, fused)
        _FUSED_SUBCLASSES[(fused_base, cls)] = fused
    return fused


def _is_nn_rms(module: nn.Module) -> bool:
    return hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm)


def _plain_rms_subclass(cls: type) -> bool:
    return cls is nn.RMSNorm or cls.forward is nn.RMSNorm.forward


def _foreign_rms_spec(module: nn.Module) -> Optional[NormSpec]:
    """The spec of a module swapped as a foreign RMSNorm class (not nn.RMSNorm's own forward)."""
    if isinstance(module, nn.LayerNorm) or (_is_nn_rms(module) and _plain_rms_subclass(type(module))):
        return None
    spec = recognize_norm(module)
    return spec if spec is not None and spec.kind == "rms" else None


def _deferred_base(cls: type) -> Optional[type]:
    """For a class made by ``ln_lightning.placement`` (``Deferred<Base>(DeferredNorm, Base)``, a norm
    whose normalisation moved to its branch's input), the norm class it wraps; else None."""
    if getattr(cls, "ln_lightning_deferred", False) and len(cls.__mro__) > 2:
        return cls.__mro__[2]
    return None


def _target_class(cls: type, foreign_rms: bool = False) -> Optional[type]:
    """The fused class to give an instance of ``cls``, or None if we must not swap it."""
    base = _deferred_base(cls)
    if base is not None:
        fused = {nn.LayerNorm: FusedLayerNorm, getattr(nn, "RMSNorm", None): FusedRMSNorm}.get(base)
        if fused is None:
            return None
        return cls.ln_lightning_rewrap(fused)  # the class placement made knows how to rebuild itself
    if foreign_rms:
        return _fused_class_for(cls, FusedRMSNormForward, None)
    if issubclass(cls, nn.LayerNorm) and (cls is nn.LayerNorm or cls.forward is nn.LayerNorm.forward):
        return _fused_class_for(cls)
    if hasattr(nn, "RMSNorm") and issubclass(cls, nn.RMSNorm) and _plain_rms_subclass(cls):
        return _fused_class_for(cls, FusedRMSNorm, nn.RMSNorm)
    return None


def _original_class(module: nn.Module) -> type:
    cls = type(module)
    if cls is FusedLayerNorm:
        return nn.LayerNorm
    if cls is FusedRMSNorm:
        return nn.RMSNorm
    return getattr(cls, "_ln_original_class", nn.LayerNorm)


def _has_hooks(module: nn.Module) -> bool:
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(len(getattr(module, n, ())) for n in names)


@dataclasses.dataclass
class SkippedNorm:
    path: str
    type: str
    reason: str


@dataclasses.dataclass
class SwapReport:
    """What :func:`swap_layernorms` (or :func:`unswap_layernorms`) did.

    Attributes:
        swapped: module paths converted (``""`` is the root module itself).
        skipped: :class:`SkippedNorm` entries (path, type, reason) for LayerNorms left alone.
        backend: the backend pinned on the swapped modules (``None``: follow the global choice).
        with_hooks: swapped paths whose hooks were kept (same module object, hooks untouched).
        reverted: whether :meth:`revert` has undone this swap.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from ln_lightning.norm import swap_layernorms
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        >>> report = swap_layernorms(model)
        >>> report.swapped
        ['1']
        >>> type(model[1]).__name__
        'FusedLayerNorm'
        >>> report.revert()
        >>> type(model[1]).__name__
        'LayerNorm'
    """

    swapped: list[str] = dataclasses.field(default_factory=list)
    skipped: list[SkippedNorm] = dataclasses.field(default_factory=list)
    backend: Optional[str] = None
    with_hooks: list[str] = dataclasses.field(default_factory=list)
    reverted: bool = False
    _modules: list[tuple[nn.Module, type, bool]] = dataclasses.field(default_factory=list, repr=False)

    def revert(self) -> None:
        """Undo this swap: each swapped module gets its original class back (same object)."""
        if self.reverted:
            return
        for module, original, had_backend in reversed(self._modules):
            module.__class__ = original
            if not had_backend:
                module.__dict__.pop("backend", None)
            for attr in _RMS_ATTRS:
                module.__dict__.pop(attr, None)
        self.reverted = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "swapped": list(self.swapped),
            "skipped": [dataclasses.asdict(s) for s in self.skipped],
            "backend": self.backend,
            "with_hooks": list(self.with_hooks),
            "reverted": self.reverted,
        }

    def __str__(self) -> str:
        lines = [
            f"swap_layernorms: {len(self.swapped)} swapped, {len(self.skipped)} skipped"
            + (f" (backend={self.backend})" if self.backend else "")
            + (" [reverted]" if self.reverted else "")
        ]
        lines += [f"  swapped  {p or '<root>'}" for p in self.swapped]
        lines += [f"  skipped  {s.path or '<root>'} ({s.type}): {s.reason}" for s in self.skipped]
        if self.with_hooks:
            lines.append(f"  hooks kept on: {', '.join(p or '<root>' for p in self.with_hooks)}")
        return "\n".join(lines)


_FUSED = (FusedLayerNorm, FusedAddLayerNorm, FusedRMSNorm, FusedAddRMSNorm, FusedRMSNormForward)


def _skip_reason(module: nn.Module, backend: Optional[str], foreign_rms: Optional[NormSpec] = None) -> Optional[str]:
    cls = type(module)
    if isinstance(module, _FUSED):
        return f"already fused ({cls.__name__})"
    if torch.nn.utils.parametrize.is_parametrized(module):
        return "parametrized module (torch.nn.utils.parametrize): its class is managed by parametrize"
    base = _deferred_base(cls)
    if base is not None and base not in (nn.LayerNorm, getattr(nn, "RMSNorm", None)):
        return f"placement-deferred norm over {base.__qualname__}, not a plain nn.LayerNorm / nn.RMSNorm"
    if base is None and foreign_rms is None and _target_class(cls) is None:
        kind = "LayerNorm" if isinstance(module, nn.LayerNorm) else "RMSNorm"
        return (
            f"subclass {cls.__module__}.{cls.__qualname__} overrides forward() and is not recognised as an "
            f"RMSNorm by what it computes ({explain_norm(module)}); swapping would drop its behaviour "
            f"(wrap Fused{kind} in your subclass if its forward is a plain {kind})"
        )
    if foreign_rms is not None and foreign_rms.bias is not None:
        return "an RMSNorm that adds a bias: the fused RMSNorm forward has none (swapping would drop it)"
    shape = tuple(getattr(module, "normalized_shape", ())) or (foreign_rms.normalized_shape if foreign_rms else ())
    if not shape:
        return "missing or empty normalized_shape"
    tensors = []
    for name in ("weight", "bias"):
        p = getattr(module, name, None)
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            return f"{name} is a {type(p).__name__}, not a tensor"
        if tuple(p.shape) != shape:
            return f"{name} has shape {tuple(p.shape)} but normalized_shape is {shape}"
        tensors.append(p)
    if backend == "triton" and tensors:
        p = tensors[0]
        if p.dtype not in _backend.TRITON_DTYPES:
            return f"backend='triton' cannot take dtype {p.dtype} (float32/float16/bfloat16 only)"
        if not (p.is_cuda or (_backend.TRITON_INTERPRET and p.device.type == "cpu")):
            return f"backend='triton' needs CUDA parameters, these are on {p.device}"
        if not _backend.TRITON_INSTALLED:
            return "backend='triton' but triton is not installed"
    return None


def swap_layernorms(model: nn.Module, *, backend: Optional[str] = None) -> SwapReport:
    """Convert every ``nn.LayerNorm`` and RMSNorm in ``model`` (including ``model`` itself) to a fused one in place.

    Each module keeps its identity, Parameter objects, hooks and attributes; only its class
    changes (see the module docstring for the rules on subclasses and skips). Swap before
    ``torch.compile`` or wrapping for distributed training; otherwise the compiled graph recompiles.

    Args:
        model: any module.
        backend: pin ``"auto"`` | ``"triton"`` | ``"torch"`` on the swapped modules; ``None`` lets
            them follow :func:`~ln_lightning.norm.norm_backend` / ``LN_LIGHTNING_NORM_BACKEND``.

    Returns:
        A :class:`SwapReport`; ``report.revert()`` or :func:`unswap_layernorms` undoes the swap.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from ln_lightning.norm import swap_layernorms
        >>> layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        >>> weight = layer.norm1.weight
        >>> report = swap_layernorms(layer)
        >>> print(report)
        swap_layernorms: 2 swapped, 0 skipped
          swapped  norm1
          swapped  norm2
        >>> layer.norm1.weight is weight
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap_layernorms needs an nn.Module, got {type(model).__name__}")
    backend = _backend.canonical_backend(backend)
    report = SwapReport(backend=backend)
    for path, module in model.named_modules():
        foreign = None
        if not (isinstance(module, nn.LayerNorm) or _is_nn_rms(module)):
            if isinstance(module, _FUSED):
                continue  # a swapped foreign RMSNorm met again (shared module): swapped once
            foreign = _foreign_rms_spec(module)
            if foreign is None:
                if type(module).__name__.endswith(("RMSNorm", "LayerNorm")):  # named like one: say why not
                    report.skipped.append(SkippedNorm(path, type(module).__qualname__, explain_norm(module)))
                continue
        elif _is_nn_rms(module) and _deferred_base(type(module)) is None and not isinstance(module, _FUSED):
            foreign = _foreign_rms_spec(module)  # an nn.RMSNorm subclass with its own forward
        reason = _skip_reason(module, backend, foreign)
        if reason is not None:
            report.skipped.append(SkippedNorm(path, type(module).__qualname__, reason))
            continue
        original = type(module)
        had_backend = "backend" in module.__dict__
        module.__class__ = _target_class(original, foreign_rms=foreign is not None)
        if foreign is not None:
            d = module.__dict__
            d["ln_rms_eps_attr"], d["ln_rms_offset"] = foreign.eps_attr, foreign.weight_offset
            d["ln_rms_cast"], d["ln_rms_shape"] = foreign.cast_order, foreign.normalized_shape
        if backend is not None:
            module.backend = backend
        report._modules.append((module, original, had_backend))
        report.swapped.append(path)
        if _has_hooks(module):
            report.with_hooks.append(path)
    return report


def unswap_layernorms(model: nn.Module) -> SwapReport:
    """Turn every ``FusedLayerNorm`` in ``model`` back into its original class (``nn.LayerNorm``
    or the subclass it was swapped from), in place. Returns a report whose ``swapped`` lists the
    reverted paths."""
    report = SwapReport(reverted=True)
    for path, module in model.named_modules():
        if isinstance(module, (FusedLayerNorm, FusedRMSNorm)) and type(module) not in (FusedAddLayerNorm, FusedAddRMSNorm):
            if _deferred_base(type(module)) is not None:
                plain = nn.LayerNorm if isinstance(module, FusedLayerNorm) else nn.RMSNorm
                module.__class__ = type(module).ln_lightning_rewrap(plain)
            else:
                module.__class__ = _original_class(module)
        elif isinstance(module, FusedRMSNormForward) and hasattr(type(module), "_ln_original_class"):
            module.__class__ = type(module)._ln_original_class
            for attr in _RMS_ATTRS:
                module.__dict__.pop(attr, None)
        else:
            continue
        module.__dict__.pop("backend", None)
        report.swapped.append(path)
    return report
