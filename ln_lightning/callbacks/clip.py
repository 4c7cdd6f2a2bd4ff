"""ClipAttributionMonitor: the gradient norm clipping sees, and which parameters it comes from."""

from __future__ import annotations

import math

import torch
from lightning.pytorch import LightningModule, Trainer

from ln_lightning._warnings import warn
from ln_lightning.callbacks._common import MonitorBase, metric_safe
from ln_lightning.callbacks._grad_groups import REPLICATED as _REPLICATED
from ln_lightning.callbacks._grad_groups import SHARDED as _SHARDED
from ln_lightning.callbacks._grad_groups import GradGroups, GroupSpec, Plan, default_group_fn, grad_sq  # noqa: F401 (default_group_fn: re-exported)
from ln_lightning.callbacks._reduce import MAX, SUM, PackedStats
from ln_lightning.callbacks.dashboard import STABILITY

class ClipAttributionMonitor(MonitorBase):
    r"""Attribute the gradient norm that clipping acts on to parameter groups.

    At each optimizer step, in ``on_before_optimizer_step`` (gradients accumulated, unscaled by AMP's
    GradScaler, not yet clipped), over the optimizer's parameters; logged at the steps, and under the
    step numbers, of Lightning's own ``self.log``:

    - ``clip/total_norm``: the 2-norm of all gradients, equal to what ``torch.nn.utils.clip_grad_norm_``
      returns (sharded FSDP/FSDP2 gradients are reduced across shards first),
    - ``clip/share/GROUP``: the group's squared gradient norm / the total squared norm,
    - with ``Trainer(gradient_clip_val=c)`` (``gradient_clip_algorithm="norm"``): ``clip/coef`` =
      ``min(1, c / total_norm)`` and ``clip/clipped`` (1 when clipping scales the step),
    - with ``gradient_clip_algorithm="value"``: ``clip/value_fraction/GROUP``, the fraction of the
      group's gradient elements with ``|g| > c``, and ``clip/clipped`` (1 when any element is clipped),
    - over the logging window (all steps since the last log, when clipping is configured):
      ``clip/fired_fraction`` (steps on which clipping changed the gradient) and
      ``clip/dominant/GROUP`` (share of those steps on which GROUP had the largest norm, or for
      value clipping the largest ``|g|``); ``clip/nonfinite_steps`` counts steps whose norm was not
      finite (the step AMP would skip); they are not counted as fired. ``clip/fired_fraction`` is the clip rate.
    - over the logging window, with norm clipping: ``clip/coef_min`` and ``clip/coef_mean``, the clip coefficient
      ``min(1, c / total_norm)`` of the window's steps (finite ones), and ``clip/update_scale/GROUP``, the mean over
      those steps of ``coef * |g_GROUP|``: the norm of the group's gradient as the optimizer receives it;
    - a warning (once per group and fit) when one group starves the others: on at least half the window's steps
      the coefficient is below ``starvation_coef`` and that group holds at least ``starvation_share`` of the squared
      norm (a huge gradient in one group driving the global coefficient to ~0, Megatron-LM#5431).

    Groups default to one per residual block (``inspect_model``) plus the other top-level modules
    (embeddings, head, final norm...). Pass ``groups`` as a mapping ``{name: regex}`` (first match on
    the parameter name wins; unmatched parameters go to ``"other"``) or a function
    ``param_name -> group name or None``. Parameter names are those of the LightningModule with
    wrapper prefixes (``_forward_module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``, a leading
    ``module.``) removed.

    With several optimizers (manual optimisation), each optimizer's step is attributed on its own, over its
    own parameters, and its metrics are named ``clip/optimizer_K/...`` (``K`` its index in
    ``trainer.optimizers``, as ``self.optimizers()`` orders them): ``clip/optimizer_1/total_norm``,
    ``clip/optimizer_1/share/GROUP``. An optimizer that did not step in a logging step logs nothing for it;
    one that stepped more than once logs its last step.

    Cost: on logging steps one ``torch._foreach_norm`` over the gradients of each optimizer step, and, for
    all optimizers together, two small all-reduces and one host copy at the end of the step; on other
    steps, only when clipping is configured, the ``_foreach_norm`` and a scatter into a device buffer (no
    collective, no host sync).

    Args:
        groups: ``None``, a ``{group: regex}`` mapping, or a ``param_name -> group`` function.
        every_n_steps: logging interval in Lightning's logging steps (optimizer steps; training batches under
            manual optimisation); ``None`` uses ``trainer.log_every_n_steps``.
        track_window: compute the per-window statistics (the only per-step work); needs clipping configured.
        log_depth_profile: also log a bar chart image of the shares by group.
        starvation_coef: the starvation warning's coefficient threshold (``None``: no warning).
        starvation_share: the share of the squared norm the starving group holds on those steps.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from ln_lightning.callbacks import ClipAttributionMonitor
        >>> monitor = ClipAttributionMonitor(groups={"attn": r"\.attn\.", "mlp": r"\.mlp\.", "embed": r"_emb\."})
        >>> trainer = Trainer(callbacks=[monitor], gradient_clip_val=1.0)

    Under manual optimization the monitor sees the gradients as they are when ``optimizer.step()``
    runs, i.e. after any clipping your ``training_step`` did. A ``configure_gradient_clipping``
    override is not visible to it: ``coef``/``clipped`` follow ``trainer.gradient_clip_val``.
    """

    _CATEGORY = "ln-lightning: gradient clipping"

    def __init__(
        self,
        groups: GroupSpec = None,
        every_n_steps: int | None = None,
        track_window: bool = True,
        log_depth_profile: bool = True,
        starvation_coef: float | None = 0.1,
        starvation_share: float = 0.9,
    ):
        super().__init__(every_n_steps, log_depth_profile)
        if starvation_coef is not None and not 0 < starvation_coef < 1:
            raise ValueError(f"ClipAttributionMonitor: starvation_coef must be in (0, 1) or None, got {starvation_coef!r}")
        if not 0 < starvation_share <= 1:
            raise ValueError(f"ClipAttributionMonitor: starvation_share must be in (0, 1], got {starvation_share!r}")
        self.starvation_coef, self.starvation_share = starvation_coef, starvation_share
        self._starved_warned: set[str] = set()
        self._groups = GradGroups(groups, type(self).__name__)
        self.track_window = track_window
        self._optimizers: list = []  # slot k: trainer.optimizers[k] (then any other optimizer seen stepping)
        self._stats: PackedStats | None = None
        self._stats_key: tuple | None = None
        self._cap = 1
        # Per slot: rows written (the next row, modulo the cap), steps since the last log, stepped in this logging step.
        self._rows: list[int] = []
        self._window_steps: list[int] = []
        self._stepped: list[bool] = []
        self._manual_warned = False

    # -- lifecycle --------------------------------------------------------------------------
    def _prepare(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._groups.prepare(pl_module)

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._groups.start(trainer, pl_module):
            self._enabled = False

    def _stop(self) -> None:
        self._groups.stop()
        self._optimizers.clear()
        self._stats = self._stats_key = None
        self._rows, self._window_steps, self._stepped = [], [], []
        self._manual_warned = False  # said once per fit
        self._starved_warned.clear()

    # -- the step ----------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if not self._enabled:
            return
        log = self._logging  # decided at the step's first batch (MonitorBase)
        clip_val = trainer.gradient_clip_val
        clipping = clip_val is not None and float(clip_val) > 0
        window = self.track_window and clipping
        if not (log or window):
            return
        if not pl_module.automatic_optimization and not self._manual_warned:
            self._manual_warned = True
            warn(
                "ClipAttributionMonitor under manual optimization sees gradients when optimizer.step() runs, "
                "after any clipping done in training_step."
            )
        value_mode = clipping and _value_clipping(trainer)
        slot = self._slot_of(trainer, optimizer)
        plan = self._groups.plan_for(pl_module, optimizer)
        n_groups = len(plan.groups)
        device = pl_module.device
        stats = self._ensure_stats(pl_module, device, value_mode, window)
        row = self._rows[slot] % self._cap
        self._rows[slot] += 1
        self._window_steps[slot] += 1
        if log:
            self._stepped[slot] = True

        grads, mask, present = self._groups.local_grads(plan)
        sq_sharded, sq_replicated = stats[f"sq_sharded/{slot}"][row], stats[f"sq_replicated/{slot}"][row]
        if grads:
            slots, weights, numels, groups = self._groups.index_tensors(plan, mask, present, device, grads)
            with torch.no_grad():
                sq = torch.zeros(2, n_groups, dtype=torch.float64, device=device)  # [_SHARDED | _REPLICATED] x groups
                sq.view(-1).index_add_(0, slots, grad_sq(grads, device) * weights)  # the norms shared with SpikeMonitor
                sq_sharded.copy_(sq[_SHARDED])
                sq_replicated.copy_(sq[_REPLICATED])
                if value_mode:
                    amax_row = stats[f"amax/{slot}"][row]
                    amax = torch.stack([n.to(device) for n in torch._foreach_norm(grads, float("inf"), dtype=torch.float32)]).double()
                    amax_row.fill_(float("-inf"))
                    amax_row.scatter_reduce_(0, groups, amax, reduce="amax")
                    if log:
                        clipped = torch.stack([(g.abs() > clip_val).sum().to(device) for g in grads]).double() * weights
                        counts = torch.zeros(2, 2, n_groups, dtype=torch.float64, device=device)  # [clipped | numel] x section x groups
                        counts[0].view(-1).index_add_(0, slots, clipped)
                        counts[1].view(-1).index_add_(0, slots, numels)
                        for k, what in enumerate(("clipped", "numel")):
                            stats[f"{what}_sharded/{slot}"].copy_(counts[k, _SHARDED])
                            stats[f"{what}_replicated/{slot}"].copy_(counts[k, _REPLICATED])
        else:
            sq_sharded.zero_()
            sq_replicated.zero_()
            if value_mode:
                stats[f"amax/{slot}"][row].fill_(float("-inf"))  # no gradient: nothing to clip
                if log:  # nor any count: this rank adds zeros to the all-reduce, not the last window's counts
                    for what in ("clipped", "numel"):
                        stats[f"{what}_sharded/{slot}"].zero_()
                        stats[f"{what}_replicated/{slot}"].zero_()

    def _end_logging_step(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        # One reduction and host copy for every optimizer step of this logging step (and the window's rows).
        if self._stats is None:  # no optimizer step yet in this fit (the same on every rank)
            return
        clip_val = trainer.gradient_clip_val
        clipping = clip_val is not None and float(clip_val) > 0
        host = self._stats.reduce_to_host(across_ranks=trainer.world_size > 1)
        for slot, optimizer in enumerate(self._optimizers):
            if self._stepped[slot]:
                plan = self._groups.plan_for(pl_module, optimizer)
                prefix = "clip/" if len(self._optimizers) == 1 else f"clip/optimizer_{slot}/"
                self._report(trainer, host, slot, plan, prefix, step, clip_val if clipping else None,
                             clipping and _value_clipping(trainer), self.track_window and clipping)
            self._rows[slot] = self._window_steps[slot] = 0
            self._stepped[slot] = False

    def _slot_of(self, trainer: Trainer, optimizer) -> int:
        if not self._optimizers:
            self._optimizers.extend(trainer.optimizers)
        slot = next((k for k, o in enumerate(self._optimizers) if o is optimizer), None)
        if slot is None:  # an optimizer the Trainer does not hold (stepped by hand): one slot more
            self._optimizers.append(optimizer)
            slot = len(self._optimizers) - 1
        return slot

    def _ensure_stats(self, pl_module: LightningModule, device: torch.device, value_mode: bool, window: bool) -> PackedStats:
        # One row per step of the logging window; per-step collectives are avoided by reducing all rows at the log.
        cap = max(1, self._every) if window else 1
        # Each optimizer's plan as its parameters are now (rebuilt only when they changed).
        plans = [self._groups.plan_for(pl_module, o) for o in self._optimizers]
        key = (tuple(len(p.groups) for p in plans), str(device), value_mode, cap)
        if self._stats is None or self._stats_key != key:
            stats = PackedStats(device)
            for slot, plan in enumerate(plans):
                n_groups = len(plan.groups)
                # Squared gradient norm per step and group. Replicated rows start at 0, not -inf: a group may be
                # absent on every rank.
                stats.add_state(f"sq_sharded/{slot}", (cap, n_groups), SUM)
                stats.add_state(f"sq_replicated/{slot}", (cap, n_groups), MAX, default=0.0)
                if value_mode:
                    stats.add_state(f"amax/{slot}", (cap, n_groups), MAX)  # largest |g| per step and group
                    for what in ("clipped", "numel"):  # elements with |g| > clip_val, and all elements, at the logging step
                        stats.add_state(f"{what}_sharded/{slot}", n_groups, SUM)
                        stats.add_state(f"{what}_replicated/{slot}", n_groups, MAX, default=0.0)
            stats.reset()
            self._stats, self._stats_key, self._cap = stats, key, cap
            n = len(plans)
            self._rows, self._window_steps, self._stepped = [0] * n, [0] * n, [False] * n
        return self._stats

    def _report(self, trainer: Trainer, host: dict, slot: int, plan: Plan, prefix: str, step: int,
                clip_val: float | None, value_mode: bool, window: bool) -> None:
        """Log the metrics of `slot`'s optimizer for logging step `step`, from the reduced statistics."""
        n_groups = len(plan.groups)
        cap = self._cap
        n_rows = min(self._window_steps[slot], cap)
        last = (self._rows[slot] - 1) % cap
        rows = [(last - k) % cap for k in range(n_rows)]  # newest first

        def group_sq(r: int) -> list[float]:
            return [a + b for a, b in zip(host[f"sq_sharded/{slot}"][r], host[f"sq_replicated/{slot}"][r])]

        current = group_sq(last)
        total_sq = sum(current)
        # As clip_grad_norm_: inf when a gradient is infinite, NaN only when one is NaN (sqrt keeps both).
        total = math.sqrt(total_sq)
        metrics: dict[str, float] = {f"{prefix}total_norm": total}
        shares: list[float] = []
        if math.isfinite(total_sq) and total_sq > 0:
            shares = [s / total_sq for s in current]
            for name, share in zip(plan.groups, shares):
                metrics[f"{prefix}share/{metric_safe(name)}"] = share
        if clip_val is not None and not value_mode:
            coef = min(1.0, clip_val / total) if total > 0 else 1.0
            metrics[f"{prefix}coef"] = coef if math.isfinite(total) else float("nan")
            metrics[f"{prefix}clipped"] = float(math.isfinite(total) and total > clip_val)
        if value_mode:
            any_clipped = False
            for g, name in enumerate(plan.groups):
                clipped = host[f"clipped_sharded/{slot}"][g] + host[f"clipped_replicated/{slot}"][g]
                numel = host[f"numel_sharded/{slot}"][g] + host[f"numel_replicated/{slot}"][g]
                metrics[f"{prefix}value_fraction/{metric_safe(name)}"] = clipped / numel if numel > 0 else 0.0
                any_clipped |= clipped > 0
            metrics[f"{prefix}clipped"] = float(any_clipped)
        if window and clip_val is not None:
            fired = 0
            nonfinite = 0
            dominant = [0] * n_groups
            if not value_mode:
                self._coef_statistics(metrics, prefix, plan, [group_sq(r) for r in rows], clip_val, step)
            for r in rows:
                if value_mode:
                    amax = host[f"amax/{slot}"][r]
                    if not all(math.isfinite(a) or a == float("-inf") for a in amax):
                        nonfinite += 1
                        continue
                    if max(amax) > clip_val:
                        fired += 1
                        dominant[max(range(n_groups), key=amax.__getitem__)] += 1
                else:
                    sq = group_sq(r)
                    t = sum(sq)
                    if not math.isfinite(t):
                        nonfinite += 1
                        continue
                    if math.sqrt(t) > clip_val:
                        fired += 1
                        dominant[max(range(n_groups), key=sq.__getitem__)] += 1
            metrics[f"{prefix}fired_fraction"] = fired / n_rows if n_rows else 0.0
            metrics[f"{prefix}nonfinite_steps"] = float(nonfinite)
            if fired:
                for name, d in zip(plan.groups, dominant):
                    metrics[f"{prefix}dominant/{metric_safe(name)}"] = d / fired
        else:
            metrics[f"{prefix}nonfinite_steps"] = float(not math.isfinite(total_sq))
        self._log(trainer, metrics, step)
        if shares:
            self._depth_profile(
                trainer,
                f"{prefix}share_profile",
                step,
                title=f"share of squared gradient norm by group (step {step})",
                panels=[("share of |g|^2", {"share": shares}, False)],
                xlabels=list(plan.groups),
                xlabel="group",
                bars=True,
            )

    def dashboard_charts(self, trainer: Trainer) -> dict[str, dict[str, list]]:
        charts = super().dashboard_charts(trainer)
        clip_val = trainer.gradient_clip_val
        if clip_val is not None and float(clip_val) > 0 and not _value_clipping(trainer):
            charts[STABILITY] = {
                "clip rate (fired fraction of the window's steps)": ["Multiline", [r"^clip/(optimizer_\d+/)?fired_fraction$"]],
                "clip coefficient (window min, mean)": ["Multiline", [r"^clip/(optimizer_\d+/)?coef_(min|mean)$"]],
            }
        return charts

    def _coef_statistics(self, metrics: dict[str, float], prefix: str, plan: Plan, window: list[list[float]],
                         clip_val: float, step: int) -> None:
        """The window's clip coefficients (min, mean), each group's gradient norm after clipping (mean), and the
        starvation warning. `window`: the squared norms by group of the window's steps, newest first."""
        steps = [(sq, math.sqrt(sum(sq))) for sq in window if math.isfinite(sum(sq))]
        if not steps:
            return
        coefs = [min(1.0, clip_val / total) if total > 0 else 1.0 for _, total in steps]
        metrics[f"{prefix}coef_min"] = min(coefs)
        metrics[f"{prefix}coef_mean"] = sum(coefs) / len(coefs)
        for g, name in enumerate(plan.groups):
            after = [c * math.sqrt(sq[g]) for c, (sq, _) in zip(coefs, steps)]
            metrics[f"{prefix}update_scale/{metric_safe(name)}"] = sum(after) / len(after)
        if self.starvation_coef is None:
            return
        # Starvation (Megatron-LM#5431): on most of the window's steps one group holds nearly all of the squared norm
        # and drives the global coefficient so low that every other group's update all but vanishes.
        low = [(sq, c) for c, (sq, _) in zip(coefs, steps) if c < self.starvation_coef]
        if 2 * len(low) < len(steps):
            return
        tops = [max(range(len(plan.groups)), key=sq.__getitem__) for sq, _ in low]
        top = max(set(tops), key=tops.count)
        shares = [sq[top] / sum(sq) for (sq, _), t in zip(low, tops) if t == top]
        if 2 * len(shares) < len(steps) or min(shares) < self.starvation_share:
            return
        name = plan.groups[top]
        if name in self._starved_warned:
            return
        self._starved_warned.add(name)
        warn(
            f"ClipAttributionMonitor at step {step}: group {name!r} holds {min(shares):.1%} or more of the squared "
            f"gradient norm on {len(shares)} of the last {len(steps)} steps and keeps the clip coefficient below "
            f"{self.starvation_coef:g} (mean {sum(c for _, c in low) / len(low):.3g}): every other group's update is "
            f"scaled down with it (starved). Look at what feeds {name!r} (clip/share, clip/update_scale), clip it "
            "separately, or lower its learning rate. Said once per group and fit."
        )

    def _charts(self, trainer: Trainer) -> dict[str, str]:
        # `(optimizer_K/)?`: with several optimizers each has its own lines in the same charts.
        charts = {"clip total norm": r"^clip/(optimizer_\d+/)?total_norm$", "clip share by group": r"^clip/(optimizer_\d+/)?share/",
                  "gradient norm after clipping by group (window mean)": r"^clip/(optimizer_\d+/)?update_scale/"}
        clip_val = trainer.gradient_clip_val
        if clip_val is not None and float(clip_val) > 0:  # automatic optimisation only: one optimizer
            charts["clip coef, clipped, fired fraction"] = r"^clip/(coef|clipped|fired_fraction)$"
            charts["clip dominant group (fired steps)"] = r"^clip/dominant/"
            if _value_clipping(trainer):
                charts["value-clipped fraction by group"] = r"^clip/value_fraction/"
        return charts


def _value_clipping(trainer: Trainer) -> bool:
    """Whether the Trainer clips by value (`gradient_clip_algorithm="value"`), not by norm."""
    return str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)) == "value"
