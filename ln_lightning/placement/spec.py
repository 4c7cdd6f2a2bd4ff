"""`TransitionSpec`: how a trained model is migrated, spelled and validated in one place.

``LNPlacement("pre", transition=TransitionSpec(steps=600))`` (or ``transition=600``) asks for a function-preserving
transition with a budget of 600 optimizer steps. The options that only mean something during a transition live
here, so they can't be given without one (the old ``transition_*`` keywords of ``LNPlacement`` could, and were
silently ignored).

The default is the closed loop (``tolerance=0.05``): the blend advances only while the measured drift from the
trained function (KL(trained || model) on the training batches, smoothed, the same on every rank) stays within the
tolerance, and ``steps`` is a budget. A model that can't reach the end within it says so (a warning with the blend
reached and the budget it would need, the report JSON, ``ln_placement/transition``), and stays in the blend it
reached: it never ends "finished" at a drift the user did not agree to. ``tolerance=None`` is the open loop: the blend
follows ``schedule`` and reaches 1 after ``steps`` steps, whatever the drift.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ln_lightning.placement.blend import MAX_STEPS

OPEN_SCHEDULES = ("linear", "cosine")
REFERENCES = ("trained", "current")


@dataclass(frozen=True)
class TransitionSpec:
    """A function-preserving transition from the placement a model is written in to the requested one.

    Args:
        steps: the budget, in optimizer steps. Open loop (``tolerance=None``): the transition ends after exactly
            this many. Closed loop: the blend may reach 1 sooner (after ``ramp`` of them when the drift never holds
            it) or not at all; a model still blending at the end of the budget stays there, and the run says so.
        tolerance: the closed loop's bound on the smoothed drift, in nats per predicted position
            (KL(trained || model) on the training batches). ``None``: the open loop.
        ramp: closed loop: the fraction of the budget the blend takes from 0 to 1 when nothing holds it (the slack
            is for holding and for training at the end point).
        schedule: open loop: ``"linear"`` (blend = t) or ``"cosine"`` ((1 - cos(pi t)) / 2), t = steps done / steps.
        stream_scale: with no ``branch_scale`` given to LNPlacement, the stream-scaled blend (on by default, to every
            placement). A post-norm model divides its stream by
            each norm's scale, so an older branch weighs less than a newer one; a plain pre-norm stream only adds, and the trained function
            moves by much more than the norms' move suggests (on the 12-layer study LM, KL 0.82 at the blend's end
            against 0.09 stream-scaled). Each converted branch ``k`` gets the constant ``C_k = prod sigma_i /
            |gamma_i|`` of the norms before it in its stack, measured once, on the first training batch at
            blend 0 (the mean over ranks), and the blend moves the stream between the two scalings. The
            endpoint is ``convert(model, placement, branch_scale="stream")`` with those constants (persistent
            buffers ``<branch>_scale.c``: in every checkpoint and saved model; a native Hugging Face export
            needs plain pre-norm, so such a model is exported with its remote code). Where the scales can't be
            measured (a norm that runs more than once per forward, a site that doesn't run) the plain blend runs
            and a warning says why. ``False``: the plain blend, ending at plain pre-norm. To ``"peri"`` the
            constants go into the added output norms instead: each one's gain starts at ``C_k`` times the trained
            branch output's spread (measured in the same forward), so its branch writes about what the
            pre-norm endpoint's does, and the endpoint is plain peri-norm with those gains (parameters, trained
            from there). What peri can't keep is each token's branch magnitude, which its output norms
            normalise away (on the study LM, KL 0.30 to the trained function at the end of the blend, where
            pre-norm's is 0.09). To ``"output"`` (``x + N(F(x))``) each branch reads the stream divided by a
            constant entry scale (``<branch>_in_scale.c``, ``C_k`` at the end, ``D_k = (1-a) + a C_k`` mid-way),
            and the moved norm, at the branch exit, gets the gain ``C_k`` times the trained branch output's
            spread (its gradient and optimizer state start afresh there), while its call site keeps the gain and
            bias it was trained to (buffers of the transition, taken at the measurement) until the blend ends; the
            endpoint is ``convert(model, "output", branch_scale="stream")``. Such a model saves the
            Hugging Face way once the transition has ended, not mid-way (keep the Lightning checkpoint).
        endpoint_fraction: the fraction of the transition's optimizer steps (never the first) whose training forward
            and backward run at blend 1, the function the transition ends at, while the model holds its blend for
            everything else (callbacks, validation, checkpoints). Picked by a hash of the step index: the same on every
            rank, under accumulation and after a resume. 0 trains every step at the held blend.
        distill: the weight of ``KL(trained || model)`` added to the loss ``training_step`` returns while the
            transition runs (0: not added; the closed loop still measures it). The trained function is a frozen copy
            of the model taken at the transition's start (blend 0), run on the inputs of each ``self(...)`` call in
            ``training_step``, in the model's mode and with the same random numbers (the same dropout masks: at
            blend 0 the term is exactly 0); its output's predictions (a tensor, ``logits``, or a tuple's first element)
            are compared over the last dimension. It costs a copy of the weights and one forward of it per training
            forward, during the transition only, and its weights go into the transition's checkpoints. Under manual
            optimisation, a sharded strategy (FSDP, ModelParallelStrategy) or an output without predictions it can't
            run, and a warning says so (the closed loop then ramps at the budget's pace, without a tolerance).
        reference: what the drift (and the distillation) compares the model with. ``"trained"``: a frozen copy of
            the model taken at the transition's start, the trained function (a copy of the weights in memory and in
            the transition's checkpoints). ``"current"``: the model itself at blend 0, with the weights it has now
            (no copy): the drift is then what the blend changes, not what continued training learns, which a
            copy's KL also counts and a fixed tolerance then mistakes for the blend's.
    """

    steps: int
    tolerance: float | None = 0.05
    ramp: float = 0.5
    schedule: str = "linear"
    stream_scale: bool = True
    endpoint_fraction: float = 0.25
    distill: float = 1.0
    reference: str = "trained"

    def __post_init__(self):
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"TransitionSpec: steps must be a positive int (optimizer steps) of at most 2**63 - 1, got {steps!r}.")
        tol = self.tolerance
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (0 < tol < math.inf)):
            raise ValueError(f"TransitionSpec: tolerance must be a positive number (nats of KL per position) or None "
                             f"(the open loop), got {tol!r}.")
        if isinstance(self.ramp, bool) or not isinstance(self.ramp, (int, float)) or not 0 < self.ramp <= 1:
            raise ValueError(f"TransitionSpec: ramp must be in (0, 1], got {self.ramp!r}.")
        if self.schedule not in OPEN_SCHEDULES:
            raise ValueError(f"TransitionSpec: unknown schedule {self.schedule!r}; valid: {', '.join(map(repr, OPEN_SCHEDULES))}.")
        if tol is not None and self.schedule != "linear":
            raise ValueError("TransitionSpec: schedule applies to the open loop (tolerance=None); the closed loop's blend "
                             "follows the measured drift. Drop schedule, or pass tolerance=None.")
        if not isinstance(self.stream_scale, bool):
            raise TypeError(f"TransitionSpec: stream_scale must be True or False, got {self.stream_scale!r}.")
        f = self.endpoint_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
            raise ValueError(f"TransitionSpec: endpoint_fraction must be a number in [0, 1), got {f!r}.")
        w = self.distill
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < math.inf:
            raise ValueError(f"TransitionSpec: distill must be a finite number >= 0 (0: not added to the loss), got {w!r}.")
        if self.reference not in REFERENCES:
            raise ValueError(f"TransitionSpec: reference must be one of {', '.join(map(repr, REFERENCES))}, got {self.reference!r}.")
        for name in ("tolerance", "ramp", "endpoint_fraction", "distill"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))

    @property
    def closed(self) -> bool:
        return self.tolerance is not None

    @property
    def kind(self) -> str:
        """The schedule kind the model's transition records (``"closed"`` for the closed loop)."""
        return "closed" if self.closed else self.schedule

    def rate(self) -> float:
        """The closed loop's blend increment per optimizer step that is not an endpoint step."""
        return 1.0 / max(1.0, self.ramp * self.steps * (1.0 - self.endpoint_fraction))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def coerce(cls, value: "TransitionSpec | int | None") -> "TransitionSpec | None":
        """``transition=`` as LNPlacement takes it: a TransitionSpec, an int (the budget, every default), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(steps=value)
        raise TypeError(f"LNPlacement: transition must be a TransitionSpec, an int (its steps) or None, got {value!r}.")


__all__ = ["OPEN_SCHEDULES", "REFERENCES", "TransitionSpec"]
