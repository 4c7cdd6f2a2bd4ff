"""LayerNormInputMonitor: how small each norm's input variance (LayerNorm) or mean square (RMSNorm) gets,
and how much the norm amplifies."""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from ln_lightning.callbacks._common import MonitorBase, first_tensor, metric_safe, normalize_name
from ln_lightning.callbacks._reduce import PackedStats
from ln_lightning import _lightning_patch
from ln_lightning._warnings import info, warn

_log = logging.getLogger(__name__)

# SUM columns per norm; the MAX section holds one value per norm: -min(stat). The statistic `stat`
# is the row variance for a LayerNorm and the row mean square for an RMSNorm.
_SUM_VAR, _NONFINITE, _ROWS = range(3)
_COLS = 3
# Metric name of the statistic, by norm kind (ln_lightning.norm.NormSpec.kind).
_STAT_NAME = {"layer": "var", "rms": "ms"}


def _fused_add_classes() -> tuple[type, ...]:
    """Norm classes whose forward is `(x, residual)` and normalise `x + residual` (ln_lightning's own)."""
    try:
        from ln_lightning.norm import FusedAddLayerNorm, FusedAddRMSNorm  # noqa: PLC0415 (optional)
    except ImportError:
        return ()
    return (FusedAddLayerNorm, FusedAddRMSNorm)


def _recognize(module: nn.Module):
    """(NormSpec or None, why not: a sentence for modules named like a norm that are not recognised)."""
    try:
        from ln_lightning.norm import explain_norm, recognize_norm  # noqa: PLC0415 (optional package)
    except ImportError:
        return None, None
    spec = recognize_norm(module)
    named_like_norm = type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
    return spec, (explain_norm(module) if spec is None and named_like_norm else None)


class LayerNormInputMonitor(MonitorBase):
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
    Rows of all micro-batches of the logged step on all ranks are pooled exactly (sums and row counts
    all-reduced, minimum across ranks).

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
        every_n_steps: logging interval in optimizer steps; ``None`` uses ``trainer.log_every_n_steps``.
        warn_amp_fraction: warn when ``amp_max > warn_amp_fraction / sqrt(eps)``; ``None`` disables warnings.
        warn_cooldown: logging steps before the same norm is warned about again.
        log_depth_profile: also log an image of ``var_min``, ``var_mean`` and ``amp_max`` against norm index.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from ln_lightning.callbacks import LayerNormInputMonitor
        >>> trainer = Trainer(callbacks=[LayerNormInputMonitor(warn_amp_fraction=0.25)])
    """

    family = "ln"

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
        self.norm_paths: list[str] = []
        self._eps: list[float | None] = []
        self._kinds: list[str] = []
        self._handles: list[Any] = []
        self._stats: PackedStats | None = None
        self._rows: torch.Tensor | None = None
        self._last_warned: dict[str, int] = {}
        self._n_logs = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _lightning_patch.check_same_namespace(trainer, self)
        if stage != "fit" or self._handles:
            return
        self._resolve_every(trainer)
        self._register(pl_module)

    def _register(self, pl_module: LightningModule) -> None:
        fused_add = _fused_add_classes()
        declared = self.norm_classes  # nn.LayerNorm and the classes given: monitored by class
        seen: set[int] = set()
        targets = []
        unrecognised: list[str] = []
        for name, module in pl_module.named_modules():
            if id(module) in seen:
                continue
            if isinstance(module, fused_add + declared):
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
                spec, why_not = _recognize(module)  # by what it computes: LayerNorm- or RMSNorm-like
                if spec is None:
                    if why_not:  # named like a norm but not monitored: say so, never silently
                        unrecognised.append(f"{name} ({why_not})")
                    continue
                kind, ndim, eps = spec.kind, spec.ndim, spec.eps
            seen.add(id(module))
            eps = None if eps is None else float(eps)
            targets.append((normalize_name(name, pl_module), module, ndim, eps, isinstance(module, fused_add), kind))
        if unrecognised:
            warn(
                "LayerNormInputMonitor: not monitoring these modules named like norms, which were not recognised "
                f"as LayerNorm or RMSNorm: {'; '.join(unrecognised)}. Pass LayerNorm-like classes as norm_classes."
            )
        if not targets:
            return
        self.norm_paths = [t[0] for t in targets]
        self._eps = [t[3] for t in targets]  # None: the input dtype's eps, filled in by the hook
        self._kinds = [t[5] for t in targets]
        for index, (path, module, ndim, _, is_add, kind) in enumerate(targets):
            hook = self._make_hook(index, ndim, is_add, kind)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        n_rms = self._kinds.count("rms")
        info(_log, f"LayerNormInputMonitor: monitoring {len(targets)} norms ({n_rms} RMSNorm)")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._handles:
            self._register(pl_module)
            if not self._handles:
                warn("LayerNormInputMonitor found no LayerNorm modules and will log nothing.")
        if self._handles:
            n = len(self.norm_paths)
            self._stats = PackedStats(n * _COLS, n, pl_module.device)
            self._rows = self._stats.sums.view(n, _COLS)
        super().on_fit_start(trainer, pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._stats = self._rows = None
            self._active = False

    def _make_hook(self, index: int, ndim: int, is_add: bool, kind: str = "layer"):
        dims = tuple(range(-ndim, 0))
        rms = kind == "rms"

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._active:  # the whole cost on steps that do not log
                return
            rows = self._rows
            x = args[0] if args else kwargs.get("input", first_tensor(kwargs))
            if not isinstance(x, torch.Tensor) or rows is None or x.numel() == 0:
                return
            if self._eps[index] is None:  # nn.RMSNorm(eps=None) uses the input dtype's eps
                self._eps[index] = torch.finfo(x.dtype).eps
            with torch.no_grad():
                x = x.detach().float()
                if is_add:  # FusedAddLayerNorm(input, residual) normalises input + residual
                    residual = args[1] if len(args) > 1 else kwargs.get("residual")
                    if isinstance(residual, torch.Tensor):
                        x = x + residual.detach().float()
                # RMSNorm: the mean square it divides by; LayerNorm: the variance
                var = x.square().mean(dim=dims) if rms else torch.var(x, dim=dims, correction=0)
                nonfinite = var.numel() - torch.isfinite(var).sum()
                row = rows[index]
                row[:2] += torch.stack([var.sum(dtype=torch.float64), nonfinite.to(torch.float64)])
                row[_ROWS] += var.numel()
                neg_min = self._stats.maxes[index : index + 1]
                torch.maximum(neg_min, (-var.amin()).to(neg_min), out=neg_min)

        return hook

    def _begin_window(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._stats is not None:
            self._stats.reset()

    def _flush(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        if self._stats is None:
            return
        sums, maxes = self._stats.reduce_to_host(across_ranks=trainer.world_size > 1)
        metrics: dict[str, float] = {}
        var_min_list, var_mean_list, amp_list = [], [], []
        nonfinite = 0.0
        over: list[str] = []
        for i, path in enumerate(self.norm_paths):
            sum_var, n_nonfinite, n_rows = sums[i * _COLS : (i + 1) * _COLS]
            if n_rows == 0:  # norm not called in this step
                var_min_list.append(float("nan"))
                var_mean_list.append(float("nan"))
                amp_list.append(float("nan"))
                continue
            eps = self._eps[i]
            if eps is None:  # never called with a tensor (cannot happen with n_rows > 0)
                eps = float("nan")
            var_mean = sum_var / n_rows
            var_min = -maxes[i]
            # amp is decreasing in var, so the maximum over rows is attained at the minimum variance.
            amp_max = 1.0 / math.sqrt(var_min + eps) if math.isfinite(var_min) and var_min + eps > 0 else float("nan")
            name = metric_safe(path)
            stat = _STAT_NAME[self._kinds[i]]
            metrics[f"ln/{stat}_mean/{name}"] = var_mean
            metrics[f"ln/{stat}_min/{name}"] = var_min
            metrics[f"ln/amp_max/{name}"] = amp_max
            nonfinite += n_nonfinite
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
        self._log(trainer, metrics, step)
        self._depth_profile(
            trainer,
            "ln/depth_profile",
            step,
            title=f"LayerNorm inputs by norm (step {step})",
            panels=[
                ("input variance (RMSNorm: mean square)", {"var_min": var_min_list, "var_mean": var_mean_list}, True),
                ("amp_max = 1/sqrt(var_min+eps)", {"amp_max": amp_list}, True),
            ],
            xlabels=[str(i) for i in range(len(self.norm_paths))],
            xlabel="norm index (module order)",
        )

    def dashboard_charts(self, trainer: Trainer) -> dict[str, dict[str, list]]:
        return {
            "ln-lightning: LayerNorm inputs": {
                "LN var_min by norm": ["Multiline", [r"^ln/var_min/"]],
                "LN var_mean by norm": ["Multiline", [r"^ln/var_mean/"]],
                "RMSNorm ms_min by norm": ["Multiline", [r"^ln/ms_min/"]],
                "RMSNorm ms_mean by norm": ["Multiline", [r"^ln/ms_mean/"]],
                "LN amp_max": ["Multiline", [r"^ln/amp_max/"]],
                "LN non-finite rows": ["Multiline", [r"^ln/nonfinite_count$"]],
            }
        }
