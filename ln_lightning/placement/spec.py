"""`TransitionSpec`: how a trained model is migrated, spelled and validated in one place.

``LNPlacement("pre", transition=TransitionSpec(steps=600))`` (or ``transition=600``) asks for a function-preserving
transition with a budget of 600 optimizer steps. The options that only mean something during a transition live
here, so they can't be given without one (the old ``transition_*`` keywords of ``LNPlacement`` could, and were
silently ignored).

The default is the closed loop (``tolerance=0.02``): the blend advances only while the measured drift from the
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
        stream_scale: the stream-scaled blend (branches keep their trained weight in the stream; see
            ``LNPlacement``); ``False``: the plain blend, ending at the plain rewrite.
        endpoint_fraction: the fraction of the transition's steps (never the first) that train at blend 1, while
            the model holds the current blend between steps.
        distill: the weight of KL(trained || model) added to the loss while blending (0: not added; the closed loop
            still measures it).
    """

    steps: int
    tolerance: float | None = 0.02
    ramp: float = 0.5
    schedule: str = "linear"
    stream_scale: bool = True
    endpoint_fraction: float = 0.25
    distill: float = 1.0

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


__all__ = ["OPEN_SCHEDULES", "TransitionSpec"]
