"""LayerNormInputMonitor: how small each norm's input variance (LayerNorm) or mean square (RMSNorm) gets,
and how much the norm amplifies."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from ln_lightning._warnings import info, warn
from ln_lightning.callbacks._common import ActivationMonitor, first_tensor, metric_safe, normalize_name
from ln_lightning.callbacks._reduce import MAX, SUM, PackedStats
from ln_lightning.norm import FusedAddLayerNorm, FusedAddRMSNorm, explain_norm, recognize_norm
from ln_lightning.placement.rewrite.hooks import normalization_weight

_log = logging.getLogger(__name__)

# Norms whose forward is `(x, residual)` and normalise `x + residual`.
_FUSED_ADD = (FusedAddLayerNorm, FusedAddRMSNorm)
# Metric name of the statistic, by norm kind (ln_lightning.norm.NormSpec.kind).
_STAT_NAME = {"layer": "var", "rms": "ms"}


@dataclass
class _Norm:
    """What the hook and the report need to know of one monitored norm."""

    ndim: int  # normalised trailing dimensions
    eps: float | None  # None: the input dtype's eps (nn.RMSNorm(eps=None)), filled in by the hook
    fused_add: bool
    kind: str  # "layer" or "rms"


class LayerNormInputMonitor(ActivationMonitor):
    r"""Log the variance a LayerNorm divides by, and the amplification ``1/sqrt(var + eps)`` it applies.

    For every ``nn.LayerNorm`` (which includes ``ln_lightning``'s ``FusedLayerNorm``), every
    module ``ln_lightning.norm.recognize_norm`` finds to be a LayerNorm by what it computes, and
    every module of the classes you add, with ``var`` the biased variance of each row of the input
    over the normalised dimensions (the last ``len(normalized_shape)`` dimensions):

    - ``ln/var_mean/NORM``: mean of ``var`` over all rows,
    - ``ln/var_min/NORM``: minimum of ``var`` over all rows,
    - ``ln/amp_max/NORM``: maximum over rows of ``1/sqrt(var + eps)`` with the module's own ``eps``
      (the largest factor by which the norm scales its input, and its Jacobian; bounded by ``1/sqrt(eps)``),
    - ``ln/nonfinite_count``: rows whose variance is not finite.

    A rank-zero warning, rate-limited, names the norms whose ``amp_max`` passes
    ``warn_amp_fraction * 1/sqrt(eps)``. ``NORM`` is the module path relative to the LightningModule.
    Metrics are logged at the steps, and under the step numbers, of Lightning's own ``self.log``.
    Rows of all micro-batches of the logged step on all ranks are pooled exactly (sums and row counts
    all-reduced, minimum across ranks).

    During a placement transition (``LNPlacement(transition_steps=N)``) a norm normalises twice, at its own
    call site (weighing ``1 - a`` in the function) and at its branch's entries (weighing ``a``); each row is
    weighted by that (``ln_lightning.placement.rewrite.hooks.normalization_weight``) and rows of weight 0 are left out,
    so the statistics are exactly the unconverted model's at blend 0 and the converted model's at blend 1.

    RMSNorms (``nn.RMSNorm``, ``FusedRMSNorm`` and every module ``recognize_norm`` finds to be an
    RMSNorm: Hugging Face's ``LlamaRMSNorm``, ``Gemma2RMSNorm``, ``T5LayerNorm``, ...) divide by the
    root mean square instead; for them the statistic is ``ms``, the mean of the squares of each row:
    ``ln/ms_mean/NORM``, ``ln/ms_min/NORM``, and ``ln/amp_max/NORM`` the maximum of
    ``1/sqrt(ms + eps)`` with the module's own eps (``nn.RMSNorm(eps=None)``: the input dtype's
    machine epsilon, as it uses).

    ``ln_lightning.norm.FusedAddLayerNorm`` / ``FusedAddRMSNorm`` modules, called as
    ``norm(x, residual)``, are monitored on ``x + residual``: the tensor they actually normalise.

    Args:
        norm_classes: extra module classes to monitor (a class or a sequence of them); they must have ``normalized_shape`` and ``eps``
            attributes with ``nn.LayerNorm``'s meaning.
        every_n_steps: logging interval in Lightning's logging steps (optimizer steps; training batches under
            manual optimisation); ``None`` uses ``trainer.log_every_n_steps``.
        warn_amp_fraction: warn when ``amp_max > warn_amp_fraction / sqrt(eps)``; ``None`` disables warnings.
        warn_cooldown: logging steps before the same norm is warned about again.
        log_depth_profile: also log an image of ``var_min``, ``var_mean`` and ``amp_max`` against norm index.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from ln_lightning.callbacks import LayerNormInputMonitor
        >>> trainer = Trainer(callbacks=[LayerNormInputMonitor(warn_amp_fraction=0.25)])
    """

    _PRE_HOOK = True  # the norm's input is what it divides by
    _CATEGORY = "ln-lightning: LayerNorm inputs"
    _PROFILE = ("ln/depth_profile", "LayerNorm inputs by norm", "norm index (module order)")

    def __init__(
        self,
        norm_classes: Sequence[type] = (),
        every_n_steps: int | None = None,
        warn_amp_fraction: float | None = 0.5,
        warn_cooldown: int = 100,
        log_depth_profile: bool = True,
    ):
        super().__init__(every_n_steps, log_depth_profile)
        if isinstance(norm_classes, type):  # one class given where a sequence is expected
            norm_classes = (norm_classes,)
        if isinstance(norm_classes, str) or not isinstance(norm_classes, (tuple, list, set, frozenset)):
            raise TypeError(f"norm_classes must be a sequence of nn.Module subclasses, got {norm_classes!r}")
        for cls in norm_classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(f"norm_classes must be nn.Module subclasses, got {cls!r}")
            if hasattr(nn, "RMSNorm") and issubclass(cls, nn.RMSNorm):
                raise TypeError(
                    f"{cls.__name__} is an RMSNorm: it divides by the root mean square, not the standard deviation, "
                    "so variance statistics would misdescribe it. norm_classes takes LayerNorm-like classes only."
                )
        if warn_amp_fraction is not None and not (0 < warn_amp_fraction <= 1):
            raise ValueError(f"warn_amp_fraction must be in (0, 1] or None, got {warn_amp_fraction!r}")
        self.norm_classes = (nn.LayerNorm, *norm_classes)
        self.warn_amp_fraction = warn_amp_fraction
        self.warn_cooldown = warn_cooldown
        self._norms: list[_Norm] = []
        self._last_warned: dict[str, int] = {}
        self._n_logs = 0

    @property
    def norm_paths(self) -> list[str]:
        """The monitored norms' module paths, relative to the LightningModule (known from setup)."""
        return self._paths

    def _targets(self, pl_module: LightningModule) -> list[tuple[str, nn.Module]]:
        declared = self.norm_classes  # nn.LayerNorm and the classes given: monitored by class
        seen: set[int] = set()
        targets, norms = [], []
        unrecognised: list[str] = []
        for name, module in pl_module.named_modules():
            if id(module) in seen:
                continue
            if isinstance(module, _FUSED_ADD + declared):
                shape = getattr(module, "normalized_shape", None)
                eps = getattr(module, "eps", None)
                kind = "rms" if hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm) else "layer"
                if shape is None or (eps is None and kind == "layer"):
                    raise TypeError(
                        f"LayerNormInputMonitor: {type(module).__name__} at {name!r} has no `normalized_shape` / `eps`; "
                        "norm_classes must be LayerNorm-like (normalise the last dims by their variance)."
                    )
                ndim = 1 if isinstance(shape, int) else len(tuple(shape))
            else:
                spec = recognize_norm(module)  # by what it computes: LayerNorm- or RMSNorm-like
                if spec is None:
                    if type(module).__name__.endswith(("RMSNorm", "LayerNorm")):  # named like a norm: say so, never silently
                        unrecognised.append(f"{name} ({explain_norm(module)})")
                    continue
                kind, ndim, eps = spec.kind, spec.ndim, spec.eps
            seen.add(id(module))
            targets.append((normalize_name(name, pl_module), module))
            norms.append(_Norm(ndim, None if eps is None else float(eps), isinstance(module, _FUSED_ADD), kind))
        if unrecognised:
            warn(
                "LayerNormInputMonitor: not monitoring these modules named like norms, which were not recognised "
                f"as LayerNorm or RMSNorm: {'; '.join(unrecognised)}. Pass LayerNorm-like classes as norm_classes."
            )
        self._norms = norms
        if targets:
            n_rms = sum(n.kind == "rms" for n in norms)
            info(_log, f"LayerNormInputMonitor: monitoring {len(targets)} norms ({n_rms} RMSNorm)")
        return targets

    def _stop(self) -> None:
        super()._stop()
        self._last_warned.clear()  # the warning cooldown counts this fit's logging steps
        self._n_logs = 0

    def _nothing_found(self) -> str:
        return "LayerNormInputMonitor found no LayerNorm modules and will log nothing."

    def _declare(self, stats: PackedStats, n: int) -> None:
        # Per norm, over rows of all micro-batches and ranks: the statistic's sum, non-finite rows, rows,
        # and the minimum of the statistic, stored negated so that the MAX reduction serves it.
        stats.add_state("stat_sum", n, SUM)
        stats.add_state("nonfinite", n, SUM)
        stats.add_state("rows", n, SUM)
        stats.add_state("neg_stat_min", n, MAX)

    def _make_hook(self, index: int, path: str, module: nn.Module):
        norm = self._norms[index]
        dims = tuple(range(-norm.ndim, 0))
        rms = norm.kind == "rms"

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._active:  # the whole cost on steps that do not log
                return
            x = args[0] if args else kwargs.get("input", first_tensor(kwargs))
            if not isinstance(x, torch.Tensor) or x.numel() == 0:
                return
            if norm.eps is None:  # nn.RMSNorm(eps=None) uses the input dtype's eps
                norm.eps = torch.finfo(x.dtype).eps
            s = self._stats
            with torch.no_grad():
                x = x.detach().float()
                if norm.fused_add:  # FusedAddLayerNorm(input, residual) normalises input + residual
                    residual = args[1] if len(args) > 1 else kwargs.get("residual")
                    if isinstance(residual, torch.Tensor):
                        x = x + residual.detach().float()
                # RMSNorm: the mean square it divides by; LayerNorm: the variance
                stat = x.square().mean(dim=dims) if rms else _biased_var(x, dims)
                neg_min = s["neg_stat_min"][index : index + 1]
                weight = normalization_weight(module)
                if weight is None:
                    s["stat_sum"][index] += stat.sum(dtype=torch.float64)
                    s["nonfinite"][index] += stat.numel() - torch.isfinite(stat).sum()
                    s["rows"][index] += stat.numel()
                    torch.maximum(neg_min, (-stat.amin()).to(neg_min), out=neg_min)
                else:
                    # Mid-transition: what this normalisation weighs in the function (0 where it does not count),
                    # so the statistics are the plugin-less model's at blend 0 and the converted one's at 1.
                    w = weight.detach().to(torch.float64)
                    counts = w > 0
                    s["stat_sum"][index] += torch.where(counts, stat.sum(dtype=torch.float64) * w, 0.0)
                    s["nonfinite"][index] += (stat.numel() - torch.isfinite(stat).sum()) * counts
                    s["rows"][index] += stat.numel() * w
                    torch.maximum(neg_min, torch.where(counts, -stat.amin(), -torch.inf).to(neg_min), out=neg_min)

        return hook

    def _report(self, stats: dict[str, Any], step: int):
        metrics: dict[str, float] = {}
        var_min_list, var_mean_list, amp_list = [], [], []
        nonfinite = 0.0
        over: list[str] = []
        for i, (path, norm) in enumerate(zip(self._paths, self._norms)):
            n_rows = stats["rows"][i]
            if n_rows == 0:  # norm not called in this step
                var_min_list.append(float("nan"))
                var_mean_list.append(float("nan"))
                amp_list.append(float("nan"))
                continue
            eps = norm.eps if norm.eps is not None else float("nan")  # None: never called with a tensor (not with n_rows > 0)
            var_mean = stats["stat_sum"][i] / n_rows
            var_min = -stats["neg_stat_min"][i]
            # amp is decreasing in var, so the maximum over rows is attained at the minimum variance.
            amp_max = 1.0 / math.sqrt(var_min + eps) if math.isfinite(var_min) and var_min + eps > 0 else float("nan")
            name = metric_safe(path)
            stat = _STAT_NAME[norm.kind]
            metrics[f"ln/{stat}_mean/{name}"] = var_mean
            metrics[f"ln/{stat}_min/{name}"] = var_min
            metrics[f"ln/amp_max/{name}"] = amp_max
            nonfinite += stats["nonfinite"][i]
            var_min_list.append(var_min)
            var_mean_list.append(var_mean)
            amp_list.append(amp_max)
            bound = 1.0 / math.sqrt(eps)
            if self.warn_amp_fraction is not None and amp_max > self.warn_amp_fraction * bound:
                last = self._last_warned.get(path)
                if last is None or self._n_logs - last >= self.warn_cooldown:
                    self._last_warned[path] = self._n_logs
                    over.append(f"{path} (amp_max {amp_max:.4g} = {amp_max / bound:.0%} of 1/sqrt(eps) = {bound:.4g})")
        metrics["ln/nonfinite_count"] = nonfinite
        self._n_logs += 1
        if over:
            warn(
                f"LayerNormInputMonitor at step {step}: input variance near eps, the norm amplifies its input "
                f"(and gradient) close to its 1/sqrt(eps) bound: {'; '.join(over)}. "
                "Such a norm is normalising almost-constant rows; consider a larger eps or check the layer feeding it."
            )
        panels = [
            ("input variance (RMSNorm: mean square)", {"var_min": var_min_list, "var_mean": var_mean_list}, True),
            ("amp_max = 1/sqrt(var_min+eps)", {"amp_max": amp_list}, True),
        ]
        return metrics, panels

    def _charts(self, trainer: Trainer) -> dict[str, str]:
        # "LN var_min by norm", "LN var_mean by norm", "RMSNorm ms_min by norm", "RMSNorm ms_mean by norm"
        charts = {f"{who} {stat}_{agg} by norm": f"^ln/{stat}_{agg}/" for who, stat in (("LN", "var"), ("RMSNorm", "ms"))
                  for agg in ("min", "mean")}
        return {**charts, "LN amp_max": r"^ln/amp_max/", "LN non-finite rows": r"^ln/nonfinite_count$"}


def _biased_var(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The biased variance over `dims`, two-pass (``torch.var`` is about 15x slower on CPU for rows of this size)."""
    return (x - x.mean(dim=dims, keepdim=True)).square().mean(dim=dims)
