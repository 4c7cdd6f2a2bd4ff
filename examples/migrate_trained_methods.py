"""The migration methods `migrate_trained.py` compares, as Lightning Callbacks on a plugin-less continuation.

Each method starts the transition with the public API (`transition.begin`) once the checkpoint's trained
weights are in the model (`Callback.on_load_checkpoint` runs after the weights are restored and before
`configure_optimizers`), so every module the rewrite adds is built from the trained weights: the final
norm is a copy of the trained last norm (issue 20, defect 1; `final_norm="fresh"` reproduces the old
start for the drift profile). The optimizer state the checkpoint holds is remapped by parameter name, the
added parameters starting fresh.

What a method decides is the blend of each optimizer step (`blend.active(model).blend`, set in
place on the device: no host synchronisation) and, for some, an extra loss term. The stream-scaled blend
(`StreamScaledBlend`) changes the blend's formulas; it was prototyped here, before it became the plugin's
default (placement/migrate/blend.py), by switching the transition's hook objects to subclasses and giving each
deferred norm its own call-site object; `remove()` undoes that before `transition.finish`. The study keeps
the prototypes so that its rows can be run again as they were measured.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.nn import functional as F

from ln_lightning.placement.migrate import blend, transition
from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.rewrite.stream_scale import cumulative_scales, site_ratios
from ln_lightning.placement.migrate.teacher import kl_to_teacher  # (re-exported for migrate_trained_drift)
from ln_lightning.placement.migrate.transition_control import BlendPlan, DriftBudgetController, FunctionSpeedSchedule

ATTR = blend.ATTR


# ------------------------------------------------------------------------------ the stream-scaled blend


def _scale(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # (1-a) + a*c: exactly 1 at a = 0 and exactly c at a = 1 (c finite), as the branch-scale ramp.
    return (1 - a) + a * c


class SublayerBlend:
    """A sublayer's own blend (staggered transitions): what the blend hooks ask a Transition for."""

    def __init__(self, blend: torch.Tensor):
        self.blend = blend

    def a(self, like: torch.Tensor) -> torch.Tensor:
        return self.blend.to(like.dtype)


class _ScaledInput(blend.BlendNormalizeBranchInput):
    """Entry: u = (1-b) * x / D + b * N(x), D = (1-a) + a*C_k (C_k: the stream scale this branch reads; a the
    transition's blend, b the sublayer's own: the same one unless staggered)."""

    def normalized(self, t):
        a, b = self.transition.a(t), self.own.a(t)
        return (1 - b) * (t / _scale(a, self.stream_scale.to(t.dtype))) + b * self.norm.normalize(t)


class _ScaledSite:
    """A deferred norm's call site: out = (1-b) * D' * N(h) + b * h, D' = (1-a) + a*C_{k+1}."""

    def __init__(self, t: blend.Transition, own, stream_scale: torch.Tensor):
        self.t, self.own, self.stream_scale = t, own, stream_scale

    @property
    def blend(self) -> torch.Tensor:  # the call site's normalisation weighs 1 - b (what the monitors read)
        return self.own.blend

    def a(self, like):  # the blend a deferred norm's call site weighs its normalisation by (hooks.DeferredNorm)
        return self.own.a(like)

    def call_site(self, h, y, norm=None):
        a, b = self.t.a(h), self.own.a(h)
        return (1 - b) * (_scale(a, self.stream_scale.to(h.dtype)) * y) + b * h

    def call_site_params(self, norm):  # the norm normalises with its own parameters here
        return None


class _ScaledOutput(blend.BlendNormalizeBranchOutput):
    """Peri's exit: D * ((1-b) * v + (b / C_k) * N_out(v)), D = (1-a) + a*C_k; N_out's gain starts at C_k times the
    trained branch output's std (`init_output_norms`), so N_out(v) / C_k is about v and every blend writes about
    D * v, what the pre-norm blend writes (at a = 1, D = C_k: exactly N_out(v)). The first form tried,
    (1-b) * D * v + b * N_out(v), wrote (1-b) * D * v + b * C_k * v mid-blend: KL 0.28 to the trained function at
    a = 0.2 (this form: 0.011)."""

    def normalized(self, value):
        a, b = self.transition.a(value), self.own.a(value)
        c = self.stream_scale.to(value.dtype)
        d = _scale(a, c)  # written out so that at a = 1 the weight of N_out(v) is c / c, exactly 1
        return (1 - b) * (d * value) + (b * d / c) * hooks.NormalizeBranchOutput.normalized(self, value)


class _ScaledFinal(blend.BlendFinalNorm):
    """Added final norm: (1-b) * s / D + b * N_f(s), D = (1-a) + a*C_K."""

    def __call__(self, module, args, output):
        if hooks.bypassed():
            return None
        s = args[0]
        a, b = self.transition.a(s), self.own.a(s)
        return (1 - b) * (s / _scale(a, self.stream_scale.to(s.dtype))) + b * output


class StreamScaledBlend:
    """The post -> pre transition with branch scales `C_k` (`stream_scale.cumulative_scales`) that keep the
    trained branches' relative weights in the pre-norm stream, and a blend that moves between the two
    without letting the stream's scale run away:

        u   = (1-a) * x / D_k     + a * N_k(x)         branch entry      (D_k = (1-a) + a*C_k)
        h   = x + D_k * F(u)                           branch exit: today's ramp, with c = C_k
        out = (1-a) * D_{k+1} * N_k(h) + a * h         the norm's call site
        fin = (1-a) * s / D_K     + a * N_f(s)         the added final norm

    At a = 0 every D is exactly 1 and each line is today's blend at 0 (the trained function, bit for bit); at
    a = 1 it is exactly `convert(model, "pre", branch_scale=1.0)` with branch k's constant set to `C_k`: a
    pre-norm model with per-branch scales. (The (1-a) terms are an exact reparameterisation of post-norm, the
    stream carrying D times the post-norm stream, so only the scale each site divides by moves with a.)

    What transition.py came to provide for this (placement/migrate/blend.py; the prototype here patches it in):
      * per sublayer the scalar C_k of the stream it reads, and C_{k+1} at its norm's call site; C_K at the
        added final norm (persistent buffers: a resume must not re-measure them on changed weights);
      * the entry blend `(1-a) * x / D_k + a * N(x)`, the call site `(1-a) * D_{k+1} * N(h) + a * h`, the
        final norm `(1-a) * s / D_K + a * N_f(s)`; the exit ramp as today with c = C_k;
      * convert(model, "pre", branch_scale=<one value per branch>), the endpoint, with the values persistent;
      * the C_k measured at begin from one batch (site_ratios), identical on every rank (measured on rank 0
        and broadcast, or all-reduced), before the first optimizer step.
    """

    def __init__(self, model: nn.Module, report, scales: list[float], sites: list[nn.Module], staggered: bool = False):
        t = blend.active(model)
        if t is None:
            raise RuntimeError("StreamScaledBlend: start the transition first")
        self.model, self.t = model, t
        dev = t.blend.device
        index = {id(n): k for k, n in enumerate(sites)}
        self.c = [torch.tensor(float(c), device=dev) for c in scales]
        # staggered: one blend per sublayer, and the final norm's (the last); else all are the transition's
        self.own = [SublayerBlend(torch.zeros((), device=dev)) for _ in range(len(sites) + 1)] if staggered else None
        own = (lambda k: self.own[k]) if staggered else (lambda k: t)
        self.patched_inputs, self.patched_sites, self.patched_final, self.patched_outputs = [], [], [], []
        for m in model.modules():
            for h in m._forward_pre_hooks.values():
                if type(h) is blend.BlendNormalizeBranchInput:
                    k = index[id(h.norm)]
                    h.__class__, h.stream_scale, h.own = _ScaledInput, self.c[k], own(k)
                    self.patched_inputs.append(h)
                    for e in m._forward_hooks.values():  # the same branch's exit: its scale ramps to C_k
                        if isinstance(e, blend.BlendScaleBranchOutput):
                            e.scale.c.fill_(float(scales[k]))
                        elif type(e) is blend.BlendNormalizeBranchOutput:  # peri's added output norm
                            e.__class__, e.stream_scale, e.own = _ScaledOutput, self.c[k], own(k)
                            self.patched_outputs.append(e)
            for h in m._forward_hooks.values():
                if type(h) is blend.BlendFinalNorm:
                    h.__class__, h.stream_scale, h.own = _ScaledFinal, self.c[len(sites)], own(len(sites))
                    self.patched_final.append(h)
            if m.__dict__.get(ATTR) is t and hooks.is_deferred(m):
                m.__dict__[ATTR] = _ScaledSite(t, own(index[id(m)]), self.c[index[id(m)] + 1])
                self.patched_sites.append(m)
        if len(self.patched_inputs) != len(sites) or len(self.patched_sites) != len(sites):
            raise RuntimeError(f"StreamScaledBlend: {len(sites)} sites, {len(self.patched_inputs)} entries and "
                               f"{len(self.patched_sites)} deferred norms patched")

    def set_staggered(self, a: float, window: float) -> None:
        """Sublayer blends for the transition's blend `a`, the last sublayer first (its final norm with it):
        sublayer k (of K) ramps over a window of `window` sublayers' worth of the blend; their mean is `a`
        only approximately near the ends, so the transition's own blend (the stream scale) stays `a`."""
        K = len(self.own) - 1
        for k, o in enumerate(self.own):
            pos = K - 1 - min(k, K - 1)  # 0 for the last sublayer and the final norm
            o.blend.fill_(min(1.0, max(0.0, (a * (K + window) - pos) / window)))

    def remove(self) -> None:
        """Back to transition.py's own objects (finish then removes them); the branch constants stay C_k."""
        for h in self.patched_inputs:
            h.__class__ = blend.BlendNormalizeBranchInput
            del h.stream_scale, h.own
        for h in self.patched_final:
            h.__class__ = blend.BlendFinalNorm
            del h.stream_scale, h.own
        for h in self.patched_outputs:
            h.__class__ = blend.BlendNormalizeBranchOutput
            del h.stream_scale, h.own
        for m in self.patched_sites:
            m.__dict__[ATTR] = self.t
        self.patched_inputs, self.patched_sites, self.patched_final, self.patched_outputs = [], [], [], []


class _OutputEntry:
    """Forward pre-hook on an "output" branch entry: the branch reads `x / D_k` (`x / C_k` once the transition
    ends, `fixed`): the stream at the post-norm scale its branch was trained on."""

    def __init__(self, t: blend.Transition | None, c: torch.Tensor):
        self.t, self.c = t, c

    def __call__(self, module, args):
        if hooks.bypassed():
            return None
        x = args[0]
        d = self.c.to(x.dtype) if self.t is None else _scale(self.t.a(x), self.c.to(x.dtype))
        return (x / d,) + tuple(args[1:])


class OutputScaledBlend:
    """Prototype (the study's demo LM blocks only: `attn` / `mlp` read the stream, `ln1` / `ln2` after them): the
    stream-scaled transition to "output", `x + N'_k(F(x / C_k))` at its end, where `N'_k` is a new norm at the
    branch exit with the gain `C_k` times the trained branch output's spread (the moved norm keeps its trained
    gain at the call site while the blend lasts). Each place computes

        u   = x / D_k                                           branch entry
        h   = x + (1-a) * D_k * v + (a * D_k / C_k) * N'_k(v)   branch exit, v = F(u)
        out = (1-a) * D_{k+1} * N_k(h) + a * h                  the moved norm's call site

    exactly the trained function at a = 0 and the endpoint at a = 1. The plugin's transition to output does this
    (placement/migrate/blend.py) with the moved norm itself at the exit, its trained gain kept for the call site."""

    def __init__(self, model: nn.Module, scales: list[float], sites: list[nn.Module], probe_x: torch.Tensor):
        t = blend.active(model)
        self.t = t
        dev = t.blend.device
        self.c = [torch.tensor(float(v), device=dev) for v in scales]
        index = {id(n): k for k, n in enumerate(sites)}
        self.entries, self.exits, self.sites, self.finals = [], [], [], []
        blocks = [b for b in model.modules() if hasattr(b, "attn") and hasattr(b, "mlp") and hasattr(b, "ln1")]
        for b in blocks:
            for name, ln in (("attn", b.ln1), ("mlp", b.ln2)):
                k = index[id(ln)]
                branch = getattr(b, name)
                entry = _OutputEntry(t, self.c[k])
                self.entries.append((branch, branch.register_forward_pre_hook(entry), k))
                ln.__dict__[ATTR] = _ScaledSite(t, t, self.c[k + 1])
                self.sites.append(ln)
                h = next(h for h in branch._forward_hooks.values() if type(h) is blend.BlendNormalizeBranchOutput)
                exit_norm = nn.LayerNorm(ln.normalized_shape, eps=ln.eps).to(ln.weight.device, ln.weight.dtype)
                b.add_module(f"{name}_exit_norm", exit_norm)
                h.__class__, h.norm, h.deferred, h.stream_scale, h.own = _ScaledOutput, exit_norm, False, self.c[k], t
                self.exits.append((branch, h, k))
        for m in model.modules():
            for h in m._forward_hooks.values():
                if type(h) is blend.BlendFinalNorm:
                    h.__class__, h.stream_scale, h.own = _ScaledFinal, self.c[len(sites)], t
                    self.finals.append(h)
        self._init_gains(model, probe_x)

    @torch.no_grad()
    def _init_gains(self, model: nn.Module, probe_x: torch.Tensor) -> None:
        spread, handles = {}, []
        for branch, h, k in self.exits:
            def grab(mod, args, out, k=k):
                spread[k] = float(out.float().std(-1, unbiased=False).mean())

            handles.append(branch.register_forward_hook(grab, prepend=True))
        old = float(self.t.blend)
        self.t.blend.fill_(0.0)
        try:
            model(probe_x)
        finally:
            for hd in handles:
                hd.remove()
            self.t.blend.fill_(old)
        for _, h, k in self.exits:
            h.norm.weight.fill_(float(self.c[k]) * spread[k])
            h.norm.bias.zero_()

    def remove(self) -> None:
        """Before `transition.finish`: the entries keep `x / C_k`, the exits apply their new norm, the call sites
        and the final norm go back to transition.py's (finish then removes them)."""
        for branch, handle, k in self.entries:
            handle.remove()
            branch.register_forward_pre_hook(_OutputEntry(None, self.c[k]))
        for branch, h, k in self.exits:
            h.__class__ = blend.BlendNormalizeBranchOutput
            del h.stream_scale, h.own
        for ln in self.sites:
            ln.__dict__[ATTR] = self.t
        for h in self.finals:
            h.__class__ = blend.BlendFinalNorm
            del h.stream_scale, h.own
        self.entries, self.exits, self.sites, self.finals = [], [], [], []


@torch.no_grad()
def init_output_norms(model: nn.Module, sites: list[nn.Module], scales: list[float], batch_x: torch.Tensor) -> None:
    """Peri: each added output norm's gain = C_k x the std of its branch's trained output (measured at a = 0 on
    `batch_x`), bias 0: at a = 1 the branch then writes about C_k times what it wrote in the trained model."""
    t = blend.active(model)
    index = {id(n): k for k, n in enumerate(sites)}
    exits, stds, handles = [], {}, []
    for m in model.modules():
        entry = next((h for h in m._forward_pre_hooks.values() if isinstance(h, blend.BlendNormalizeBranchInput)), None)
        out = next((h for h in m._forward_hooks.values() if isinstance(h, blend.BlendNormalizeBranchOutput)), None)
        if entry is not None and out is not None:
            exits.append((m, out, index[id(entry.norm)]))

            def grab(mod, args, output, key=id(m)):
                v = output[0] if isinstance(output, tuple) else output
                stds[key] = float(v.float().std(-1, unbiased=False).mean())

            handles.append(m.register_forward_hook(grab))
    old = float(t.blend)
    t.blend.fill_(0.0)
    try:
        model(batch_x)
    finally:
        for h in handles:
            h.remove()
        t.blend.fill_(old)
    for m, out, k in exits:
        out.norm.weight.fill_(scales[k] * stds[id(m)])
        if out.norm.bias is not None:
            out.norm.bias.zero_()


def post_norm_sites(model: nn.Module) -> list[nn.Module]:
    """The stream's norms in the order one forward calls them (the demo LM: ln1, ln2 of each block)."""
    order: list[nn.Module] = []
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    handles = [n.register_forward_pre_hook(lambda mod, args: order.append(mod)) for n in norms]
    return order, handles


def measure_scales(model: nn.Module, batch_x: torch.Tensor) -> tuple[list[nn.Module], list[float], list[float]]:
    """On the unconverted model: the sites in stream order, their sigma/|gamma| and the cumulative C_0..C_K."""
    order, handles = post_norm_sites(model)
    try:
        with torch.no_grad():
            model(batch_x)
    finally:
        for h in handles:
            h.remove()
    ratios = site_ratios(model, order, lambda m: m(batch_x))
    return order, ratios, cumulative_scales(ratios)


def converted_scales(model: nn.Module, report, sites: list[nn.Module], ratios: list[float]) -> tuple[list[nn.Module], list[float]]:
    """The sites inside the blocks the conversion changed (all of them for "pre"; the later blocks for "mix",
    whose stream enters normalised by the last post-norm block) and their cumulative scales, C_0 = 1 at the first."""
    blocks = [model.get_submodule(b.path) if b.path else model for b in report.converted]
    inside = {id(m) for b in blocks for m in b.modules()}
    keep = [(n, r) for n, r in zip(sites, ratios) if id(n) in inside]
    return [n for n, _ in keep], cumulative_scales([r for _, r in keep])


# ------------------------------------------------------------------------------ the optimizer state


def remap_optimizer_state(state: dict, before: list[str], after: list[str]) -> dict:
    """An optimizer state_dict written for parameters `before` (names, in the optimizer's order; one group),
    re-indexed for `after`: the parameters both have keep their moments, the added ones start fresh."""
    if len(state["param_groups"]) != 1:
        raise ValueError("remap_optimizer_state: one parameter group expected")
    old = {name: i for i, name in enumerate(before)}
    new_state = {j: state["state"][old[name]] for j, name in enumerate(after) if name in old and old[name] in state["state"]}
    group = dict(state["param_groups"][0], params=list(range(len(after))))
    return {"state": new_state, "param_groups": [group]}


# ------------------------------------------------------------------------------ teacher (distillation)


class FrozenTeacher:
    """The trained function the migration starts from, for a distillation term: a frozen copy of the model
    taken before the rewrite (memory: one copy of the weights, no gradients or optimizer state; time: one
    forward per step it is asked for, no backward)."""

    def __init__(self, model: nn.Module):
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


# ------------------------------------------------------------------------------ the callback


UNITS_FWD, UNITS_BWD = 1, 2  # compute units: a forward of one batch 1, its backward 2
SPEED_GRID = 11  # blends the "speed" schedule measures the drift at, at the start


class Migration:
    """Settings of one migration method (see methods() in migrate_trained.py).

    steps: transition length (optimizer steps); schedule: a BlendPlan schedule or "adaptive"; scaled: the
    stream-scaled blend; staggered: per-sublayer blends, the last sublayer first; final_norm: "trained" (a
    copy of the trained last norm) or "fresh"; endpoint_fraction: BlendPlan's endpoint steps; distill: weight
    of KL(trained || model) in the loss while blending; lr: the learning rate during the transition (None:
    the run's); budget: the adaptive controller's drift budget (nats of cross-entropy over the teacher's).
    """

    def __init__(self, steps: int, schedule: str = "linear", scaled: bool = False, staggered: bool = False,
                 final_norm: str = "trained", endpoint_fraction: float = 0.0, distill: float = 0.0, lr: float | None = None,
                 budget: float = 0.01, placement: str = "pre"):
        self.steps, self.schedule, self.scaled, self.staggered, self.final_norm = steps, schedule, scaled, staggered, final_norm
        self.placement = placement
        self.endpoint_fraction, self.distill, self.lr, self.budget = endpoint_fraction, distill, lr, budget

    @property
    def needs_teacher(self) -> bool:
        return self.distill > 0 or self.schedule == "adaptive"

    def describe(self) -> str:
        parts = [("stream-scaled" if self.scaled else "plain") + (" staggered" if self.staggered else "") + " blend"
                 + ("" if self.placement == "pre" else f" to {self.placement!r}")]
        if self.schedule == "hard":
            parts.append("hard switch")
        elif self.schedule == "adaptive":
            parts.append(f"adaptive: +1/{self.steps} per step while the training loss over the trained model's "
                         f"(EMA) is <= {self.budget:g}")
        elif self.schedule == "speed":
            parts.append(f"constant drift speed (profile measured at the start) over {self.steps} steps")
        else:
            parts.append(f"{self.schedule} over {self.steps} steps")
        if self.final_norm != "trained":
            parts.append(f"final norm {self.final_norm}")
        if self.endpoint_fraction:
            parts.append(f"{self.endpoint_fraction:.0%} of the steps train at a = 1")
        if self.distill:
            parts.append(f"+ {self.distill:g} x KL(trained || model) while blending")
        if self.lr:
            parts.append(f"lr {self.lr:g} during the transition")
        return ", ".join(parts)


def _frozen_copy(pl_module: nn.Module) -> FrozenTeacher:
    trainer = pl_module.__dict__.get("_trainer")
    pl_module._trainer = None  # a deepcopy must not copy the Trainer
    try:
        return FrozenTeacher(pl_module)
    finally:
        pl_module._trainer = trainer


def make_callback(method: Migration, probe_x: torch.Tensor, budget_units: float, batch_size: int):
    """A Lightning Callback running `method` on a plugin-less continuation (fit(ckpt_path=...)). Its `units`
    count the compute spent (forward 1, backward 2 per batch; probe forwards by their size in batches)."""
    from lightning.pytorch.callbacks import Callback

    probe_units = UNITS_FWD * probe_x.shape[0] / batch_size

    class MigrationCallback(Callback):
        def __init__(self):
            self.m = method
            self.units = 0.0
            self.teacher = None
            self.patch = None
            self.scales = None
            self.plan = None
            self.controller = None
            self.start = None
            self.base_lr = None
            self.trained_at: list[float | None] = []
            self.speed_profile = None

        # The trained weights are in the model here, and the optimizers don't exist yet.
        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            before = [n for n, _ in pl_module.named_parameters()]
            if self.m.needs_teacher:
                self.teacher = _frozen_copy(pl_module)
            sites = None
            if self.m.scaled:
                sites, ratios, _ = measure_scales(pl_module, probe_x)
                self.units += probe_units
            scaled_branches = self.m.scaled and self.m.placement in ("pre", "mix")
            report = transition.begin(pl_module, self.m.placement, branch_scale=1.0 if scaled_branches else None)
            if self.m.scaled:
                sites, self.scales = converted_scales(pl_module, report, sites, ratios)
                if self.m.placement == "peri":
                    init_output_norms(pl_module, sites, self.scales, probe_x)
                    self.units += probe_units
            if self.m.final_norm == "fresh":  # what a norm built with the model holds (issue 20, defect 1)
                with torch.no_grad():
                    for p in report.added:
                        n = pl_module.get_submodule(p)
                        if isinstance(n, nn.LayerNorm):
                            n.weight.fill_(1.0)
                            n.bias.zero_()
            if self.m.scaled and self.m.placement == "output":
                self.patch = OutputScaledBlend(pl_module, self.scales, sites, probe_x)
                self.units += probe_units
            elif self.m.scaled:
                self.patch = StreamScaledBlend(pl_module, report, self.scales, sites, staggered=self.m.staggered)
            speed = None
            if self.m.schedule == "speed":
                speed = self._measure_speed(pl_module)
            if self.m.schedule == "adaptive":
                self.controller = DriftBudgetController(1.0 / self.m.steps, self.m.budget)
            else:
                self.plan = BlendPlan(self.m.steps, "hard" if self.m.schedule == "hard" else self.m.schedule,
                                      self.m.endpoint_fraction, speed=speed)
            after = [n for n, _ in pl_module.named_parameters()]
            checkpoint["optimizer_states"] = [remap_optimizer_state(checkpoint["optimizer_states"][0], before, after)]

        @torch.no_grad()
        def _measure_speed(self, pl_module):
            was = pl_module.training
            pl_module.eval()
            blends = [i / (SPEED_GRID - 1) for i in range(SPEED_GRID)]
            self._set(pl_module, 0.0)
            ref = pl_module(probe_x)
            drift = []
            for a in blends:
                self._set(pl_module, a)
                drift.append(float(kl_to_teacher(pl_module(probe_x), ref)))
            self.units += probe_units * (SPEED_GRID + 1)
            self._set(pl_module, 0.0)
            pl_module.train(was)
            self.speed_profile = list(zip(blends, drift))
            return FunctionSpeedSchedule(blends, drift)

        def _t(self, pl_module):
            return blend.active(pl_module)

        def _set(self, pl_module, a: float):
            t = self._t(pl_module)
            t.blend.fill_(a)  # a host -> device copy, no synchronisation
            if self.patch is not None and self.m.staggered:
                self.patch.set_staggered(a, window=4.0)

        def on_train_start(self, trainer, pl_module):
            self.start = trainer.global_step
            if self.plan is not None:
                self._set(pl_module, self.plan.held(0))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # listed after the study's Probe, which has evaluated the blend the model holds
            i = trainer.global_step - self.start
            t = self._t(pl_module)
            if t is None:
                self.trained_at.append(None)
            else:
                if self.plan is not None:
                    a = self.plan.trained(i)
                    self._set(pl_module, a)
                    self.trained_at.append(a)
                else:
                    self.trained_at.append(float(t.blend))  # (the study's record; a sync a user's run need not make)
                if self.m.lr is not None:
                    opt = trainer.optimizers[0]
                    if self.base_lr is None:
                        self.base_lr = [g["lr"] for g in opt.param_groups]
                    for g in opt.param_groups:
                        g["lr"] = self.m.lr
            self.units += UNITS_FWD + UNITS_BWD

        def loss_term(self, pl_module, batch, logits):
            """The term the study's LightningModule adds to its loss (None: nothing to add)."""
            if self.teacher is None or self._t(pl_module) is None:
                return None
            x, y = batch
            self.units += UNITS_FWD
            teacher = self.teacher.logits(x)
            if self.controller is not None:  # drift: this batch's cross-entropy over the trained function's
                self._drift = (F.cross_entropy(logits.detach().reshape(-1, logits.size(-1)), y.reshape(-1))
                               - F.cross_entropy(teacher.reshape(-1, teacher.size(-1)), y.reshape(-1)))
            return self.m.distill * kl_to_teacher(logits, teacher) if self.m.distill else None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            i = trainer.global_step - self.start  # steps done
            t = self._t(pl_module)
            if t is not None:
                if self.controller is not None:
                    self.controller.update(t.blend, self._drift)
                    over = i % 20 == 0 and DriftBudgetController.done(t.blend)  # a host read on logging steps only
                else:
                    over = self.plan.finished(i)
                    if not over:
                        self._set(pl_module, self.plan.held(i))
                if over:
                    if self.patch is not None:
                        self.patch.remove()
                    transition.finish(pl_module)
                    self.teacher = None  # its memory goes back
                    if self.base_lr is not None:
                        for g, lr in zip(trainer.optimizers[0].param_groups, self.base_lr):
                            g["lr"] = lr
            per_step = UNITS_FWD + UNITS_BWD + (UNITS_FWD if self.teacher is not None and self._t(pl_module) is not None else 0)
            if self.units + per_step > budget_units + 1e-9:
                trainer.should_stop = True

    return MigrationCallback()
