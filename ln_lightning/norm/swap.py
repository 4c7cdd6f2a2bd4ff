"""``swap_layernorms``: turn a model's ``nn.LayerNorm`` modules into ``FusedLayerNorm`` in place.

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
* subclasses that override ``forward`` are skipped (we cannot know what their forward does), as are
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
from .modules import FusedAddLayerNorm, FusedLayerNorm

_FUSED_SUBCLASSES: dict[type, type] = {}


def _fused_class_for(cls: type) -> type:
    """``FusedLayerNorm`` for ``nn.LayerNorm``; a cached ``Fused<Name>(FusedLayerNorm, cls)`` otherwise."""
    if cls is nn.LayerNorm:
        return FusedLayerNorm
    fused = _FUSED_SUBCLASSES.get(cls)
    if fused is None:
        # Registered as a module global so pickling a swapped model works within this process.
        ident = f"{cls.__module__}.{cls.__qualname__}".replace(".", "_").replace("<", "_").replace(">", "_")
        name = f"_Fused__{ident}"
        fused = type(
            f"Fused{cls.__name__}",
            (FusedLayerNorm, cls),
            {"__module__": __name__, "__qualname__": name, "_ln_original_class": cls},
        )
        setattr(sys.modules[__name__], name, fused)
        _FUSED_SUBCLASSES[cls] = fused
    return fused


def _deferred_base(cls: type) -> Optional[type]:
    """For a class made by ``ln_lightning.placement`` (``Deferred<Base>(DeferredNorm, Base)``, a norm
    whose normalisation moved to its branch's input), the norm class it wraps; else None."""
    if getattr(cls, "ln_lightning_deferred", False) and len(cls.__mro__) > 2:
        return cls.__mro__[2]
    return None


def _target_class(cls: type) -> Optional[type]:
    """The fused class to give an instance of ``cls``, or None if we must not swap it."""
    base = _deferred_base(cls)
    if base is not None:
        if base is not nn.LayerNorm:
            return None
        from ln_lightning.placement import hooks  # the placement engine made this class

        return hooks._deferred_class(FusedLayerNorm)
    if cls is nn.LayerNorm or cls.forward is nn.LayerNorm.forward:
        return _fused_class_for(cls)
    return None


def _original_class(module: nn.Module) -> type:
    cls = type(module)
    return getattr(cls, "_ln_original_class", nn.LayerNorm) if cls is not FusedLayerNorm else nn.LayerNorm


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


def _skip_reason(module: nn.LayerNorm, backend: Optional[str]) -> Optional[str]:
    cls = type(module)
    if isinstance(module, (FusedLayerNorm, FusedAddLayerNorm)):
        return f"already fused ({cls.__name__})"
    if torch.nn.utils.parametrize.is_parametrized(module):
        return "parametrized module (torch.nn.utils.parametrize): its class is managed by parametrize"
    base = _deferred_base(cls)
    if base is not None and base is not nn.LayerNorm:
        return f"placement-deferred norm over {base.__qualname__}, not a plain nn.LayerNorm"
    if base is None and cls is not nn.LayerNorm and cls.forward is not nn.LayerNorm.forward:
        return (
            f"subclass {cls.__module__}.{cls.__qualname__} overrides forward(); swapping would drop "
            "its behaviour (wrap FusedLayerNorm in your subclass if its forward is a plain LayerNorm)"
        )
    shape = tuple(getattr(module, "normalized_shape", ()))
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
    """Convert every ``nn.LayerNorm`` in ``model`` (including ``model`` itself) to ``FusedLayerNorm`` in place.

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
        if not isinstance(module, nn.LayerNorm):
            continue
        reason = _skip_reason(module, backend)
        if reason is not None:
            report.skipped.append(SkippedNorm(path, type(module).__qualname__, reason))
            continue
        original = type(module)
        had_backend = "backend" in module.__dict__
        module.__class__ = _target_class(original)
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
        if isinstance(module, FusedLayerNorm):
            if _deferred_base(type(module)) is not None:
                from ln_lightning.placement import hooks

                module.__class__ = hooks._deferred_class(nn.LayerNorm)
            else:
                module.__class__ = _original_class(module)
            module.__dict__.pop("backend", None)
            report.swapped.append(path)
    return report
