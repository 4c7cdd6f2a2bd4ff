"""The mechanics of a placement transition: the blend's device state and the blend-aware hooks and layers.

A sublayer has three places a norm can sit: the branch's input, the branch's output (before the add) and the
stream after the add. The placement before (`S`, as the block's forward is written) and after (`T`, what
`convert` made it) each put a norm, or nothing, at each place; during the transition each place computes

    (1-a) * f_S(v) + a * f_T(v)           (f: the identity, or the norm that place has)

and the branch scale `c` ramps from 1 (`(1-a) + a*c`). Post-norm to pre-norm (norm `LN`, branch `F`):

    u = (1-a)*x + a*LN(x)                 at the branch's entries
    h = x + ((1-a) + a*c) * F(u)
    out = (1-a)*LN(h) + a*h               at the norm's own call site

Post to peri adds `b -> (1-a)*b + a*N_out(b)` at the branch's exit; pre to output moves the norm from the input
to the exit (`(1-a)*N(x) + a*x` at the input, `(1-a)*b + a*N(b)` at the exit); peri to pre and to output drop
one norm at its call site; "mix" converts the later blocks to pre-norm, as above. A final norm that `convert`
added outputs `(1-a)*s + a*N_f(s)`. At `a = 0` every term is exact (`1*x + 0*y == x` in floating point), so
the model computes bit-for-bit the function it was trained with (an added norm is the identity); at `a = 1` it
computes exactly what `convert(model, placement)` gives.

The stream-scaled blend (`branch_scale="stream"`) measures each branch's constant `C_k` on the first training
batch and moves the stream between the two scalings, `D_k = (1-a) + a*C_k`: to pre the branch scale ramps to
`C_k`; to peri the added output norm's gain is `C_k` times the trained branch output's spread and the exit
writes `(1-a)*D_k*v + (a*D_k/C_k)*N_out(v)`; to output the branch reads `x / D_k` (an `InputScale` at its
entries), the moved norm at the exit gets that gain, and its call site normalises with the gain and bias it
had when measured, kept in `Transition.frozen` (buffers) until the blend ends. A block converted without the scale
(its branches could take none: `BlockChange.fallback`) keeps its norms as sites with no scale of their own: they are
measured with the others (the later branches' `C_k` count the division the trained model did there), its entries
and call sites blend with `D_k` as any site's, and its branches add unscaled (at a = 1 exactly its plain pre-norm form).

`start` switches a converted model into the blend; `finish` removes every piece of it, leaving the model
exactly as `convert` left it (fused torch layers included), at plain speed. The pieces:

* a :class:`Transition` module at ``root.ln_lightning_transition`` holds the blend, the optimizer steps done and
  the schedule (persistent buffers: in every state_dict and checkpoint);
* a converted block's deferred norms get the instance attribute ``ln_lightning_transition`` (consulted by
  `hooks.DeferredNorm.forward`: the one edit this needs in hooks.py);
* its entry / exit hooks switch class to the blend-aware subclasses below (same attributes);
* a torch `nn.TransformerEncoderLayer`/`DecoderLayer` switches class to `BlendEncoderLayer` /
  `BlendDecoderLayer` (its previous class is remembered);
* an added final norm gets a forward hook `BlendFinalNorm`.

Who starts and ends a transition, and what it means for checkpoints, is the rewrite state's
(``ln_lightning.placement.state``); the user-facing functions are ``ln_lightning.placement.migrate.transition``'s.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from ln_lightning.norm import kinds
from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.reading.blocks import STREAM_SITE_ATTR, UNSCALED_SITE_ATTR
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.rewrite.fused_layers import FUSED_CLASS
from ln_lightning.placement.reading.norms import norm_types
from ln_lightning.placement.rewrite.scale import BranchScale, InputScale
from ln_lightning.placement.rewrite.stream_scale import site_ratio

ATTR = "ln_lightning_transition"  # the root's submodule, and the deferred norms' instance attribute
_PREV_CLASS = "_ln_lightning_pre_transition_class"
SITE_ATTR = "_ln_lightning_site"  # on a scaled site's norm: its index in the transition's scales
FINAL_ATTR = "_ln_lightning_final"  # on an added final norm of a scaled transition: its index
OUT_ATTR = "_ln_lightning_site_out"  # on a scaled peri output norm: the index of the site its branch reads
# "closed": the blend is not a function of the steps done; the closed loop (`Transition.gate`) advances it on the
# device while the measured drift from the trained function stays within a tolerance.
SCHEDULES = ("linear", "cosine", "closed")
# The largest transition_steps the int64 step counter holds (and the schedule buffer stores).
MAX_STEPS = 2**63 - 1


def stream_sites(model: nn.Module) -> dict[str, list[list]]:
    """Which module of `model` reads which of a stream-scaled transition's scales, by path: the scaled sites' norms
    ("sites"), the added final norms ("finals") and peri's output norms ("outs") (export's plan reads them here)."""
    return {key: sorted([p, m.__dict__[attr]] for p, m in model.named_modules() if attr in m.__dict__)
            for key, attr in (("sites", SITE_ATTR), ("finals", FINAL_ATTR), ("outs", OUT_ATTR))}


def blends(norm: nn.Module) -> bool:
    """Whether the deferred norm `norm` computes its call site through a transition's blend."""
    return norm.__dict__.get(ATTR) is not None


def schedule(t: float, kind: str = "linear") -> float:
    """The blend at fraction `t` of the transition: linear `t`, or cosine `(1 - cos(pi t)) / 2`.

    Both are exactly 0 at t <= 0 and exactly 1 at t >= 1.
    """
    if kind not in SCHEDULES:
        raise PlacementError(f"unknown transition_schedule {kind!r}; valid schedules are {', '.join(map(repr, SCHEDULES))}")
    if kind == "closed":
        raise PlacementError("a closed-loop transition has no blend schedule: its blend is measured, not computed")
    if t <= 0:
        return 0.0
    if t >= 1:
        return 1.0
    return t if kind == "linear" else 0.5 * (1.0 - math.cos(math.pi * t))


def _fraction_of(blend: float, kind: str) -> float:
    """The inverse of `schedule`: the fraction of the transition at which it reaches `blend`."""
    blend = min(1.0, max(0.0, blend))
    return blend if kind in ("linear", "closed") else math.acos(1.0 - 2.0 * blend) / math.pi


class Transition(nn.Module):
    """The blend's device state (persistent buffers, so it is in every state_dict and checkpoint).

    ``blend`` (float32 scalar) is what the hooks read; ``steps_done`` (int64 scalar) counts the optimizer steps
    taken in the transition; ``schedule`` (int64 ``[steps, kind]``, ``kind`` indexing ``SCHEDULES``; steps -1
    when none was given). A host copy of ``steps_done`` (``host_steps``) lets a training loop advance the
    blend without reading the device: it is read from the buffer once after a load.
    """

    def __init__(self, steps: int | None = None, kind: str = "linear", device=None, sites: int = 0, finals: int = 0):
        super().__init__()
        self.steps = steps
        self.kind = kind
        self.register_buffer("blend", torch.zeros((), dtype=torch.float32, device=device), persistent=True)
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.int64, device=device), persistent=True)
        self.register_buffer("schedule", torch.tensor([steps or -1, SCHEDULES.index(kind)], dtype=torch.int64, device=device),
                             persistent=True)
        # The closed loop's smoothed drift (KL to the trained function; -1 before its first measurement).
        self.register_buffer("drift", torch.full((), -1.0, dtype=torch.float32, device=device), persistent=True)
        self._host_steps: int | None = 0
        # On an endpoint step (LNPlacement's endpoint fraction) the training forward and backward run at blend 1 while
        # `blend` keeps the held value, which is what callbacks, evaluation and checkpoints see (a host flag).
        self._at_end = False
        # The stream-scaled blend (branch_scale="stream"): per site the stream scale its branch reads (C_k) and
        # the one after it (C_{k+1}), per added final norm the one it reads (C_K); measured once, at blend 0
        # (`begin_measurement` / `end_measurement`), then held in every checkpoint: a resume must not measure
        # them again on weights that have moved. `scales_state`: 0 to measure, 1 measured, 2 not scaled (C = 1:
        # the plain blend).
        # Each site's BranchScale (pre: its c is C_k) or added output norm (peri: its gain is C_k times the trained
        # branch output's spread), or None (a block converted without the scale: its norm is measured, its branch
        # adds unscaled); filled by `start`.
        self.sites = [None] * sites
        # Per site the norm whose gain the measurement sets (peri: its added output norm, the site's own entry in
        # `sites`; output: the moved norm at the branch exit, whose trained gain and bias the call site keeps in
        # `frozen` while the blend lasts), else None.
        self.out_norms: list = [None] * sites
        self.frozen = nn.ModuleDict()
        self.site_stack: list[str] = [""] * sites  # which stack each site is in (C restarts at 1 in each)
        self.register_buffer("site_before", torch.ones(sites, dtype=torch.float32, device=device), persistent=True)
        self.register_buffer("site_after", torch.ones(sites, dtype=torch.float32, device=device), persistent=True)
        self.register_buffer("final_scale", torch.ones(finals, dtype=torch.float32, device=device), persistent=True)
        self.register_buffer("scales_state", torch.tensor(0 if sites else 2, dtype=torch.int64, device=device), persistent=True)
        self._host_scales_state: int | None = 0 if sites else 2
        self._measuring: list | None = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        old = prefix + "start_step"
        if old in state_dict and prefix + "steps_done" not in state_dict:
            # Format 1 (ln_lightning 0.1) stored the step the schedule started at instead of the steps done; the
            # blend and the schedule say how far it had gone.
            del state_dict[old]
            sched = state_dict.get(prefix + "schedule")
            blend = state_dict.get(prefix + "blend")
            if sched is not None and blend is not None:
                steps, kind = (int(v) for v in sched.tolist())
                done = round(_fraction_of(float(blend), SCHEDULES[kind]) * steps) if steps > 0 else 0
                state_dict[prefix + "steps_done"] = torch.tensor(done, dtype=torch.int64)
        if prefix + "drift" not in state_dict and prefix + "blend" in state_dict:  # written before the closed loop
            state_dict[prefix + "drift"] = torch.full((), -1.0, dtype=torch.float32)
        if prefix + "scales_state" not in state_dict and prefix + "blend" in state_dict:
            # Written before the stream-scaled blend (ln_lightning 0.2): that transition ran the plain blend.
            for name in ("site_before", "site_after", "final_scale"):
                state_dict[prefix + name] = torch.ones_like(getattr(self, name))
            state_dict[prefix + "scales_state"] = torch.tensor(2, dtype=torch.int64)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self.hold_teacher(None)  # a distillation teacher of the weights held before (LNPlacement's)
        steps, kind = (int(v) for v in self.schedule.tolist())
        self.steps, self.kind = (steps if steps > 0 else None), SCHEDULES[kind]
        self._host_steps = None
        self._host_scales_state = None

    @property
    def teacher(self) -> nn.Module | None:
        """The frozen copy of the trained function LNPlacement's distillation compares with, while the transition
        runs (None otherwise). Held outside the module tree: not in state_dict, parameters() or .to() (its weights go
        into checkpoints apart), so a second fit of the model distils towards the same function."""
        return self.__dict__.get("_teacher")

    def hold_teacher(self, teacher: nn.Module | None) -> None:
        """Keep `teacher` with the transition (None: let it go)."""
        self.__dict__["_teacher"] = teacher

    def __setstate__(self, state):
        if "_ln_lightning_teacher" in state:  # pickled before the teacher was a declared member (Transition.teacher)
            state["_teacher"] = state.pop("_ln_lightning_teacher")
        super().__setstate__(state)
        self._host_steps = None  # unpickled elsewhere (a spawned worker): read the buffer once
        self._host_scales_state = None
        self._at_end = False
        if "drift" not in self._buffers:  # pickled before the closed loop
            self.register_buffer("drift", torch.full((), -1.0, dtype=torch.float32, device=self.blend.device), persistent=True)
        if "out_norms" not in self.__dict__:  # pickled before output's stream scales: peri's sites are its out norms
            self.out_norms = [m if m is not None and m.__dict__.get(OUT_ATTR) is not None else None for m in self.sites]
        if "frozen" not in self._modules:
            self.frozen = nn.ModuleDict()

    @property
    def host_steps(self) -> int:
        """The optimizer steps done, on the host (one device read after a load or an unpickle, none after)."""
        if self._host_steps is None:
            self._host_steps = int(self.steps_done)
        return self._host_steps

    @property
    def closed(self) -> bool:
        """Whether the blend is the closed loop's (measured on the device), not a schedule of the steps done."""
        return self.kind == "closed"

    @property
    def held(self) -> float:
        """The blend the model holds between steps: the schedule's after the steps done (host arithmetic); a closed
        loop's or an unscheduled one's is read from the device (one read: for reports, not per step)."""
        return schedule(self.host_steps / self.steps, self.kind) if self.steps and not self.closed else float(self.blend)

    def hold(self) -> None:
        """Write the scheduled blend into the buffer (a device write from a host value: no synchronisation); a
        closed loop, or a transition without a schedule, keeps the blend it has."""
        if self.steps and not self.closed:
            self.blend.fill_(self.held)

    def set_progress(self, steps_done: int, blend: float | None = None) -> None:
        """Write the steps done and (unless None) the blend (device writes from host values: no synchronisation)."""
        self._host_steps = int(steps_done)
        self.steps_done.fill_(self._host_steps)
        if blend is not None:
            self.blend.fill_(float(blend))

    def train_at_end(self, on: bool) -> None:
        """An endpoint step: while `on`, forwards with gradients enabled (the training step's) compute blend 1; the
        buffer keeps the held blend for everything else (callbacks, evaluation, checkpoints, the teacher)."""
        self._at_end = bool(on)

    @torch.no_grad()
    def gate(self, drift: torch.Tensor, tolerance: float, rate: float, ema: float = 0.8,
             allow: torch.Tensor | None = None) -> None:
        """One step of the closed loop, on the device (no synchronisation): smooth the measured drift (a 0-dim
        tensor, the same on every rank), and advance the blend by `rate` only while the smoothed drift is within
        `tolerance` (and `allow`, a 0-dim bool tensor, where given: another gate's verdict). It never goes back
        and ends at exactly 1."""
        self.observe(drift, ema)
        ok = self.drift <= tolerance
        if allow is not None:
            ok = ok & allow
        self.blend.copy_(torch.clamp(self.blend + rate * ok.to(self.blend), max=1.0))

    @torch.no_grad()
    def retreat(self, rate: float, allow: torch.Tensor | None = None) -> None:
        """One step of a spent budget going back (TransitionSpec.revert_after_budget): the blend lowered by `rate`
        (where `allow`, a 0-dim bool tensor, is true, if given), to exactly 0 at the least, on the device (no
        synchronisation)."""
        step = rate if allow is None else rate * allow.to(self.blend)
        self.blend.copy_(torch.clamp(self.blend - step, min=0.0))

    @torch.no_grad()
    def observe(self, drift: torch.Tensor, ema: float = 0.8) -> None:
        """Smooth a measured drift as `gate` does, leaving the blend where it is (a spent budget holds it)."""
        d = drift.detach().to(self.drift)
        self.drift.copy_(torch.where(self.drift < 0, d, ema * self.drift + (1.0 - ema) * d))

    @contextlib.contextmanager
    def pinned(self, value: float):
        """Inside, every forward computes blend `value` (0: the function as written, with the weights as they are
        now), whatever the buffer holds: the closed loop's reference pass (TransitionSpec(reference="current"))."""
        old, self._pin = self.__dict__.get("_pin"), float(value)
        try:
            yield
        finally:
            self._pin = old

    def a(self, like: torch.Tensor) -> torch.Tensor:
        # A 0-dim tensor: no host sync, and a bf16 stream stays bf16.
        pin = self.__dict__.get("_pin")
        if pin is not None:
            return torch.full((), pin, dtype=like.dtype, device=like.device)
        if self._at_end and torch.is_grad_enabled():
            return torch.ones((), dtype=like.dtype, device=like.device)
        return self.blend.to(like.dtype)

    def extra_repr(self) -> str:
        return f"blend={float(self.blend):.4g}, steps={self.steps}, schedule={self.kind!r}"

    @property
    def scaled(self) -> bool:
        """Whether this transition scales the stream (it has sites, and found their scales measurable)."""
        if self._host_scales_state is None:
            self._host_scales_state = int(self.scales_state)
        return self._host_scales_state != 2

    @property
    def needs_measurement(self) -> bool:
        """The stream scales are still to be measured (one device read after a load, none after)."""
        return self.scaled and self._host_scales_state == 0

    # Called by hooks.DeferredNorm.forward at a deferred norm's call site (y = LN(h) computed there).
    def call_site(self, h: torch.Tensor, y: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        a = self.a(h)
        slot = None if norm is None else norm.__dict__.get(SITE_ATTR)
        if slot is None:
            return (1 - a) * y + a * h
        self._record_site(slot, norm, h)
        return (1 - a) * (_ramp(a, self.site_after[slot]) * y) + a * h

    def call_site_params(self, norm: nn.Module) -> dict[str, torch.Tensor] | None:
        """What `norm` normalises with at its call site in place of its parameters (output, once measured: the
        gains it had, its own now serving the branch exit), or None (its own)."""
        slot = norm.__dict__.get(SITE_ATTR)
        if slot is None or str(slot) not in self.frozen or not self.scaled or self.needs_measurement:
            return None
        return self.frozen[str(slot)].params_for(norm)

    def moved_parameters(self) -> list[torch.Tensor]:
        """The parameters of the norms the output transition moved to their branch exits (their role changed at the
        measurement: the plugin drops their gradient and optimizer state there)."""
        return [p for k, m in enumerate(self.out_norms) if m is not None and str(k) in self.frozen for p in m.parameters()]

    def stream_divisor(self, norm: nn.Module, like: torch.Tensor) -> torch.Tensor | None:
        """D_k = (1-a) + a*C_k for the branch reading `norm`'s site (None: not a scaled site)."""
        slot = norm.__dict__.get(SITE_ATTR)
        return None if slot is None else _ramp(self.a(like), self.site_before[slot])

    def final_divisor(self, final: nn.Module, like: torch.Tensor) -> torch.Tensor | None:
        slot = final.__dict__.get(FINAL_ATTR)  # (set only where the transition has sites; unmeasured, C = 1)
        if slot is None:
            return None
        if self._measuring is not None and _recording():
            self._measuring.append(("final", slot, None))
        return _ramp(self.a(like), self.final_scale[slot])

    def is_output_site(self, k: int) -> bool:
        """Whether site `k`'s scale is held by a norm's gain at its branch exit (peri, output)."""
        return self.out_norms[k] is not None

    # ------------------------------------------------------------------ measuring the stream scales
    def begin_measurement(self) -> None:
        """Record every site's `sigma / mean|gamma|` during the next forward (which must run at blend 0, where the
        model computes its trained function: each site's input is then exactly the trained post-norm model's)."""
        self._measuring = []

    def abandon_measurement(self) -> None:
        """Drop a measurement a forward began and no `end_measurement` closed (a Trainer call ended inside it)."""
        self._measuring = None

    def _record_site(self, slot: int, norm: nn.Module, h: torch.Tensor) -> None:
        if self._measuring is None or not _recording():
            return
        try:
            self._measure_site(slot, norm, h)
        except Exception as e:  # noqa: BLE001 - (a tensor-parallel DTensor weight, ...): the plain blend, with the reason
            self._measuring.append(("error", slot, f"{type(e).__name__}: {e}"))

    def _measure_site(self, slot: int, norm: nn.Module, h: torch.Tensor) -> None:
        with torch.no_grad():
            self._measuring.append(("site", slot, site_ratio(norm, h)))

    def branch_exit(self, norm: nn.Module, value: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A peri output norm's exit, `y = N_out(value)`: `(1-a) * value + a * y`, or on a scaled site
        `(1-a) * D_k * value + (a * D_k / C_k) * y` (D_k = (1-a) + a*C_k): about `D_k * value` at every blend, as the
        pre-norm blend's branch writes, once the norm's gain holds C_k times the branch's spread; exactly `value` at
        a = 0 and exactly `y` at a = 1 (`C_k / C_k` is 1)."""
        a = self.a(value)
        slot = norm.__dict__.get(OUT_ATTR)
        if slot is None:
            return (1 - a) * value + a * y
        if self._measuring is not None and _recording():
            with torch.no_grad():  # the trained branch output's spread per token, averaged (its a = 0 value)
                self._measuring.append(("out", slot, value.detach().float().std(-1, unbiased=False).mean()))
        c = self.site_before[slot].to(a.dtype)
        d = _ramp(a, c)
        return (1 - a) * (d * value) + (a * d / c) * y

    def end_measurement(self, reduce=None) -> str | None:
        """Turn what the forward recorded into the stream scales, the same on every rank.

        `reduce`: the mean over ranks of a tensor (data parallelism). Every rank reduces one tensor of the same
        shape whatever it saw (each site's ratio where it ran exactly once, where it did, and whether its forward
        could be used at all), so a rank whose forward skipped a layer (LayerDrop) or ran a site twice neither
        stalls the others nor ends with other scales: a site takes the mean of the ranks that saw it, and if any
        rank's forward can't be used, or a site ran on none, every rank runs the plain blend (every scale 1). One
        read from the device, once per transition, says which; with one process (`reduce=None`) the host knows it
        already and reads nothing. Returns None when the scales were set, else the reason they could not be.
        """
        events, self._measuring = self._measuring, None
        n = len(self.sites)
        dev = self.site_before.device
        events = events or []
        order = [slot for kind, slot, _ in events if kind == "site"]
        counts = {slot: order.count(slot) for slot in set(order)}
        final_of: dict[int, int] = {}  # an added final norm -> the site that ran just before it (its stack's last)
        last = None
        for kind, slot, _ in events:
            if kind == "site":
                last = slot
            elif kind == "final" and last is not None:
                final_of.setdefault(slot, last)
        reason = None  # why this rank's forward can't be used
        errors = [r for kind, _, r in events if kind == "error"]
        if not events:
            reason = "no forward was recorded in the first training batch"
        elif errors:
            reason = f"a site's statistics could not be computed ({errors[0]})"
        elif any(c != 1 for c in counts.values()):
            reason = ("a norm site ran more than once in the first training forward (a shared layer, or several forwards "
                      "per step); one scale per site can't describe it")
        elif len(final_of) != self.final_scale.numel():
            reason = "an added final norm did not run after the blocks in the first training forward"
        else:
            by_stack: dict[str, list[int]] = {}
            for slot in order:
                by_stack.setdefault(self.site_stack[slot], []).append(slot)
            if any(slots != sorted(slots) for slots in by_stack.values()):
                reason = "the blocks of a stack did not run in the order they are registered in"
        outs = [k for k in range(n) if self.is_output_site(k)]
        out_order = [slot for kind, slot, _ in events if kind == "out"]
        if reason is None and (len(out_order) != len(set(out_order)) or set(out_order) != set(outs)):
            reason = "a branch with an output norm ran more than once, or not at all, in the first training forward"
        if reason is None and outs:
            ungained = [k for k in outs if _gain_param(self.out_norms[k]) is None]
            if ungained:
                reason = ("an output norm has no gain (`weight`, or x-transformers' `gamma` / `g`; "
                          "elementwise_affine=False has none) to hold its branch's stream scale")
            elif any(not self.frozen[str(k)].fits(self.out_norms[k]) for k in outs if str(k) in self.frozen):
                reason = ("a moved norm's parameters are flattened shards (FSDP1, FSDPStrategy), so the gains its call "
                          "site keeps can't be taken whole (ModelParallelStrategy, FSDP2, can)")
        ratio_of = {slot: r for kind, slot, r in events if kind == "site" and counts.get(slot) == 1}
        spread_of = {slot: r for kind, slot, r in events if kind == "out"}
        local = torch.zeros(n, device=dev)
        seen = torch.zeros(n, device=dev)
        spread = torch.zeros(n, device=dev)
        if ratio_of and reason is None:
            idx = torch.tensor(sorted(ratio_of), device=dev)
            local[idx] = torch.stack([ratio_of[k] for k in sorted(ratio_of)]).to(dev)
            seen[idx] = 1.0
            if spread_of:
                idx = torch.tensor(sorted(spread_of), device=dev)
                spread[idx] = torch.stack([spread_of[k] for k in sorted(spread_of)]).to(dev)
        if reduce is None:  # one process: what the forward recorded is all there is, known on the host
            total, count = local, seen
            ok = reason is None and len(ratio_of) == n
        else:
            payload = torch.cat([local, seen, spread, torch.tensor([0.0 if reason is None else 1.0], device=dev)])
            payload = reduce(payload)
            total, count, spread, failed = payload[:n], payload[n:2 * n], payload[2 * n:3 * n], payload[3 * n]
            ok = bool((failed == 0) & (count > 0).all())  # the one read: the same answer on every rank
        if not ok:
            self._set_plain()
            return reason or "another rank's first training forward could not be used, or a site ran on no rank"
        ratios = total / count
        # A degenerate site (a zero or non-finite ratio) keeps scale 1 there rather than a division by zero.
        ratios = torch.where(torch.isfinite(ratios) & (ratios > 0), ratios, torch.ones_like(ratios))
        before = torch.ones(n, device=dev)
        after = torch.ones(n, device=dev)
        stacks: dict[str, list[int]] = {}
        for slot in range(n):  # slots are in module order: within a stack, the order its blocks run (checked above)
            stacks.setdefault(self.site_stack[slot], []).append(slot)
        last_of_stack = {}
        for key, slots in stacks.items():
            idx = torch.tensor(slots, device=dev)
            cp = torch.cumprod(ratios[idx], 0)
            after[idx] = cp
            before[idx] = torch.cat([torch.ones(1, device=dev), cp[:-1]])
            last_of_stack[key] = slots[-1]
        with torch.no_grad():
            self.site_before.copy_(before)
            self.site_after.copy_(after)
            for f, site in final_of.items():
                self.final_scale[f] = after[last_of_stack[self.site_stack[site]]]
            for k, scale in enumerate(self.sites):
                if str(k) in self.frozen:  # output: the call site keeps the trained gain the exit is about to take
                    self.frozen[str(k)].fill_from(self.out_norms[k])
                if self.is_output_site(k):  # N_out(v) ~ C_k * v: a gain of C_k times the spread it normalises away
                    _set_gain(self.out_norms[k], before[k] * spread[k] / count[k])
                if isinstance(scale, (BranchScale, InputScale)):
                    scale.c.copy_(before[k])
            self.scales_state.fill_(1)
        self._host_scales_state = 1
        return None

    def _set_plain(self) -> None:
        with torch.no_grad():
            for b in (self.site_before, self.site_after, self.final_scale):
                b.fill_(1.0)
            for scale in self.sites:
                if isinstance(scale, (BranchScale, InputScale)):
                    scale.c.fill_(1.0)  # (an exit norm keeps the gain it has)
            self.scales_state.fill_(2)
        self._host_scales_state = 2


class _KeptGains(nn.Module):
    """The gains (and bias) a norm the output transition moved to its branch exit had when the stream scales were
    measured, as buffers: its old call site (after the add) normalises with them while the blend lasts, and the
    norm's own gain serves the exit. Persistent (a resume gets them); buffers (no optimizer or DDP sees them); not
    a norm (monitors and the fused swap don't take it for one)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.names = [n for n, _ in norm.named_parameters()]
        for n, p in norm.named_parameters():
            self.register_buffer(n.replace(".", "__"), _full(p.detach()).clone(), persistent=True)

    def fits(self, norm: nn.Module) -> bool:
        """Whether `norm`'s parameters are whole tensors of the kept shapes (a DTensor's shape is its whole one;
        FSDP1's flattened shards are not)."""
        return all(tuple(norm.get_parameter(n).shape) == tuple(getattr(self, n.replace(".", "__")).shape) for n in self.names)

    def fill_from(self, norm: nn.Module) -> None:
        """Keep `norm`'s parameters as they are now (every rank calls this, in the same order: a DTensor gathers)."""
        for n in self.names:
            getattr(self, n.replace(".", "__")).copy_(_full(norm.get_parameter(n).detach()))

    def params_for(self, norm: nn.Module) -> dict[str, torch.Tensor]:
        """The kept values, in the dtype `norm` computes with now (FSDP2's mixed precision casts its parameters)."""
        return {n: getattr(self, n.replace(".", "__")).to(norm.get_parameter(n).dtype) for n in self.names}


def _set_gain(norm: nn.Module, gain: torch.Tensor) -> None:
    """Set an output norm's gain to `gain` (every channel), its bias to 0, whatever the class stores (Gemma's
    `1 + w` stores gain - 1)."""
    w, offset = _gain_param(norm)
    # One value for every channel: each shard of a sharded (DTensor) weight is filled with it in place.
    w = _local(w)
    w.fill_((gain - offset).to(device=w.device, dtype=w.dtype))
    b = getattr(norm, "bias", None)
    if isinstance(b, torch.Tensor):
        _local(b).zero_()


def _gain_param(norm: nn.Module) -> tuple[torch.Tensor, float] | None:
    """A norm's gain parameter and what its forward adds to it, as `stream_scale.norm_statistics` reads them:
    `weight` (torch, Hugging Face; Gemma's `1 + w` adds 1), x-transformers' `gamma` / `g` (plus `unit_offset`)."""
    for name in ("weight", "gamma", "g"):
        p = getattr(norm, name, None)
        if isinstance(p, torch.Tensor):
            if name == "weight":
                spec = kinds.recognize_norm(norm)
                return p, 1.0 if spec is not None and spec.unit_offset else 0.0
            return p, float(getattr(norm, "unit_offset", 0.0) or 0.0)
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) tensor's whole value on every rank; a plain one as it is. The frozen call-site norm
    normalises each rank's whole activations, so it holds whole gains."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _ramp(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # (1-a) + a*c: exactly 1 at a = 0 and exactly c at a = 1.
    return (1 - a) + a * c.to(a.dtype)


def _recording() -> bool:
    # A site's statistics come from the step's forward, not from a recomputation inside backward
    # (activation checkpointing runs the forward again there) or a no-grad evaluation.
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def _mix(t: Transition, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(1-a)*x + a*y for the transition `t`."""
    a = t.a(x)
    return (1 - a) * x + a * y


class BlendNormalizeBranchInput(hooks.NormalizeBranchInput):
    """Entry hook during the transition: the branch reads `(1-a)*x + a*LN(x)`."""

    def normalized(self, t: torch.Tensor) -> torch.Tensor:
        d = self.transition.stream_divisor(self.norm, t)
        if isinstance(self.norm, InputScale):  # output: x / D_k, exactly x at a = 0 and x / C_k at a = 1
            if d is None:
                return t
            with hooks.our_normalization():
                return t / d
        with hooks.weighted(self.norm, self.transition.a(self.transition.blend)):
            y = self.norm.normalize(t)
        return _mix(self.transition, t if d is None else t / d, y)


class BlendNormalizeBranchOutput(hooks.NormalizeBranchOutput):
    """Exit hook during the transition: the branch output becomes `(1-a)*b + a*N(b)` (peri's added output
    norm, or output-norm's moved one)."""

    def normalized(self, value: torch.Tensor) -> torch.Tensor:
        with hooks.weighted(self.norm, self.transition.a(self.transition.blend)):
            y = super().normalized(value)
        return self.transition.branch_exit(self.norm, value, y)


class BlendScaleBranchOutput(hooks.ScaleBranchOutput):
    """Exit hook during the transition: the branch output times `(1-a) + a*c` (1 -> c)."""

    def scaled(self, value: torch.Tensor) -> torch.Tensor:
        return _mix(self.transition, value, self.scale(value))


class BlendFinalNorm:
    """Forward hook on a final norm convert added: `(1-a)*s + a*LN_f(s)` (the identity at a = 0)."""

    def __init__(self, transition: Transition):
        self.transition = transition

    def __call__(self, module, args, output):
        if hooks.bypassed():
            return None
        s, d = args[0], self.transition.final_divisor(module, args[0])
        return _mix(self.transition, s if d is None else s / d, output)


# Each hook of a rewrite and its blend-aware subclass (same attributes, plus `transition`).
_BLEND_CLASS = {
    hooks.NormalizeBranchInput: BlendNormalizeBranchInput,
    hooks.NormalizeBranchOutput: BlendNormalizeBranchOutput,
    hooks.ScaleBranchOutput: BlendScaleBranchOutput,
}
_PLAIN_CLASS = {blend: plain for plain, blend in _BLEND_CLASS.items()}


def _blend_sublayer(t: Transition, x, norm, branch):
    a = t.a(x)
    d = t.stream_divisor(norm, x)
    with hooks.weighted(norm, t.a(t.blend)):
        u = (1 - a) * (x if d is None else x / d) + a * norm(x)
    h = x + branch(u)  # the branch scale (a hook on its dropout) is the blend-aware one
    with hooks.weighted(norm, 1 - t.a(t.blend)):
        return t.call_site(h, norm(h), norm)


class BlendEncoderLayer(nn.TransformerEncoderLayer):
    """`nn.TransformerEncoderLayer` during the transition: each sublayer blended as in the module doc."""

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        t = self.__dict__[ATTR]
        # The same mask canonicalisation as torch's forward.
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask", other_type=F._none_or_dtype(src_mask),
            other_name="src_mask", target_type=src.dtype,
        )
        src_mask = F._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None, other_name="", target_type=src.dtype, check_other=False)
        x = _blend_sublayer(t, src, self.norm1, lambda u: self._sa_block(u, src_mask, src_key_padding_mask, is_causal=is_causal))
        return _blend_sublayer(t, x, self.norm2, self._ff_block)


class BlendDecoderLayer(nn.TransformerDecoderLayer):
    """`nn.TransformerDecoderLayer` during the transition."""

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        t = self.__dict__[ATTR]
        x = _blend_sublayer(t, tgt, self.norm1, lambda u: self._sa_block(u, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = _blend_sublayer(t, x, self.norm2, lambda u: self._mha_block(u, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
        return _blend_sublayer(t, x, self.norm3, self._ff_block)


def _torch_layer_classes():
    enc = (nn.TransformerEncoderLayer, FUSED_CLASS[nn.TransformerEncoderLayer])
    dec = (nn.TransformerDecoderLayer, FUSED_CLASS[nn.TransformerDecoderLayer])
    return enc, dec


def active(model: nn.Module) -> Transition | None:
    """The model's transition module while a transition is under way, else None."""
    t = model._modules.get(ATTR)
    return t if isinstance(t, Transition) else None


def check_schedule_args(steps: int | None, kind: str) -> None:
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS):
        raise PlacementError(f"transition_steps must be a positive int of at most 2**63 - 1 (the step counter is int64), got {steps!r}")
    if kind not in SCHEDULES:
        schedule(0.0, kind)  # the error naming the valid ones


def start(model: nn.Module, converted: Iterable[tuple[str, bool]], added: Iterable[str], *, steps: int | None = None,
          kind: str = "linear") -> Transition:
    """Switch a converted model into the blend at a = 0 (its function before the conversion).

    `converted`: (block path, read from its forward as written) for each block the conversion changed; `added`:
    the paths it added. Only those are blended; blocks it left alone keep computing what they did. Checks
    everything before changing anything.
    """
    converted = list(converted)
    if active(model) is not None:
        raise PlacementError("the model is already in a transition; finish it first (transition.finish(model))")
    rewritten = [path or "<root>" for path, from_written in converted if not from_written]
    if rewritten:
        raise PlacementError(
            f"block(s) {', '.join(rewritten)} had been rewritten by ln_lightning before this conversion; the transition "
            "blends from the placement a block's forward is written in, which they no longer computed. Convert the "
            "model back with convert(model, 'post') first, or start from the unconverted model"
        )
    if ATTR in model._modules or hasattr(model, ATTR):
        raise PlacementError(f"{type(model).__name__} already has an attribute {ATTR!r}")
    check_schedule_args(steps, kind)
    enc, dec = _torch_layer_classes()
    blocks = [model.get_submodule(path) if path else model for path, _ in converted]
    for (path, _), block in zip(converted, blocks):
        if isinstance(block, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) and type(block) not in enc + dec:
            raise PlacementError(
                f"transition_steps can't blend {path} ({type(block).__name__}): it subclasses a torch Transformer layer "
                "with its own forward, which the transition would replace. Convert it without transition_steps."
            )
    ref = next(iter(model.parameters()), None)
    if ref is None:
        ref = next(iter(model.buffers()), None)
    # The stream-scaled sites (branch_scale="stream"): the deferred norms whose branch got a measured scale, in
    # module order (the order the scales are stored in; the stream's order is read by the measuring forward).
    sites, scales, stacks = [], [], []
    for (path, _), block in zip(converted, blocks):
        stack = path.rpartition(".")[0]  # the container the block sits in: its stack
        for m in block.modules():
            site = m.__dict__.get(STREAM_SITE_ATTR)
            if site is not None:
                sites.append(site)
                scales.append(m)
                stacks.append(stack)
        # A block converted without the stream scale (its branches could take none: BlockChange.fallback) still
        # divides the trained stream at its norms: they are sites with no scale of their own (None), measured like the
        # others so that the later branches' C_k count them. In the order of the block's sublayers.
        unscaled = [m for m in block.modules() if UNSCALED_SITE_ATTR in m.__dict__]
        for m in sorted(unscaled, key=lambda m: m.__dict__[UNSCALED_SITE_ATTR]):
            sites.append(m)
            scales.append(None)
            stacks.append(stack)
    if all(m is None for m in scales):  # no branch scale at all: the plain blend
        sites, scales, stacks = [], [], []
    at_exits = {id(h.norm) for block in blocks for m in block.modules() for h in m._forward_hooks.values()
                if isinstance(h, hooks.NormalizeBranchOutput)}
    finals = []
    for path in added:
        try:
            m = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(m, norm_types()) and id(m) not in at_exits:  # (branch scales: at their hooks)
            finals.append(m)
    t = Transition(steps, kind, device=ref.device if ref is not None and ref.device.type != "meta" else None,
                   sites=len(sites), finals=len(finals) if sites else 0)
    for k, m in enumerate(sites):
        t.sites[k], t.site_stack[k] = scales[k], stacks[k]
        if isinstance(scales[k], norm_types()):  # peri: the output norm whose gain the measurement sets
            scales[k].__dict__[OUT_ATTR] = k
            t.out_norms[k] = scales[k]
        elif isinstance(scales[k], InputScale):  # output: the moved norm, at the exit, and the entry's divisor
            t.frozen[str(k)] = _KeptGains(m)
            m.__dict__[OUT_ATTR] = k
            scales[k].__dict__[SITE_ATTR] = k
            t.out_norms[k] = m
        m.__dict__[SITE_ATTR] = k
    for block in blocks:
        if type(block) in enc + dec:
            block.__dict__[_PREV_CLASS] = type(block)
            block.__dict__[ATTR] = t
            block.__class__ = BlendEncoderLayer if type(block) in enc else BlendDecoderLayer
        for m in block.modules():
            if hooks.is_deferred(m):
                m.__dict__[ATTR] = t
            for d in (m._forward_pre_hooks, m._forward_hooks):
                for h in d.values():
                    blend = _BLEND_CLASS.get(type(h))
                    if blend is not None:
                        h.__class__, h.transition = blend, t
    # Peri's added output norms are blended at their exit hooks; every other norm the conversion added is a final norm.
    for f, m in enumerate(finals):
        m.register_forward_hook(BlendFinalNorm(t))
        m.__dict__[hooks.WEIGHT_ATTR] = t  # its normalisation weighs a (hooks.normalization_weight)
        if sites:
            m.__dict__[FINAL_ATTR] = f
    model.add_module(ATTR, t)
    return t


def finish(model: nn.Module) -> None:
    """Remove the transition: the model is exactly what `convert` made it, with no blend left.

    Raises if any piece of the machinery would stay behind (it would be a silent change of function).
    """
    t = active(model)
    if t is None:
        raise PlacementError("finish: the model is not in a transition")
    for m in model.modules():
        if m.__dict__.get(ATTR) is t:
            del m.__dict__[ATTR]
        m.__dict__.pop(SITE_ATTR, None)
        m.__dict__.pop(FINAL_ATTR, None)
        m.__dict__.pop(OUT_ATTR, None)
        if m.__dict__.get(hooks.WEIGHT_ATTR) is t:
            del m.__dict__[hooks.WEIGHT_ATTR]
        prev = m.__dict__.pop(_PREV_CLASS, None)
        if prev is not None:
            m.__class__ = prev
        for d in (m._forward_pre_hooks, m._forward_hooks):
            for key, h in list(d.items()):
                plain = _PLAIN_CLASS.get(type(h))
                if plain is not None:
                    h.__class__ = plain
                    del h.transition
                elif isinstance(h, BlendFinalNorm):
                    del d[key]
                    m._forward_hooks_with_kwargs.pop(key, None)
                    getattr(m, "_forward_hooks_always_called", {}).pop(key, None)
    del model._modules[ATTR]
    left = leftovers(model)
    if left:
        raise RuntimeError(f"ln_lightning: internal error, transition machinery left at {', '.join(left)}; please report this")


def leftovers(model: nn.Module) -> list[str]:
    """Module paths that still carry a piece of a transition (empty after `finish`)."""
    out = []
    for path, m in model.named_modules():
        blend_hooks = [h for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()
                       if isinstance(h, (*_PLAIN_CLASS, BlendFinalNorm))]
        if (ATTR in m.__dict__ or _PREV_CLASS in m.__dict__ or hooks.WEIGHT_ATTR in m.__dict__
                or SITE_ATTR in m.__dict__ or FINAL_ATTR in m.__dict__ or OUT_ATTR in m.__dict__
                or isinstance(m, (Transition, BlendEncoderLayer, BlendDecoderLayer))
                or blend_hooks):
            out.append(path or "<root>")
    return out


__all__ = ["ATTR", "MAX_STEPS", "OUT_ATTR", "SCHEDULES", "Transition", "active", "check_schedule_args", "finish", "leftovers", "schedule", "start"]
