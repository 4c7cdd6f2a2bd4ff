"""What each optimizer step of a transition trains at (issue 20): pure, deterministic, resumable objects.

`BlendPlan` answers, for the i-th optimizer step of a transition, the blend the model *holds* (what an
evaluation or a checkpoint between steps sees) and the blend that step *trains* at. They differ on
*endpoint steps*: a fixed fraction of the transition's steps (never the first), picked by a hash of the step
index, train at a = 1. Measured on a trained 12-layer post-norm LM (examples/migrate_trained.py), a model trained only at
the blend it holds leans on the part of the function the blend is about to remove: the held-out loss rises
at the transition's end whatever its length or shape, and more for longer transitions or a higher learning
rate. Endpoint steps train the function the transition ends at, at no extra cost.

Every answer is a function of (i, the plan's settings): the same on every rank and under gradient
accumulation (every micro-batch of an optimizer step asks with the same i), and after a resume.

Schedules: "linear" (t), "cosine" ((1 - cos(pi t)) / 2), "hard" (1 from the first step), and "speed"
(`FunctionSpeedSchedule`: the blend at which the drift measured at the start, with the weights fixed, has
covered the fraction t of its total: constant speed of the function, not of the blend).

`DriftBudgetController` is the adaptive alternative: it advances the blend only while a measured drift
stays within a budget, on the device (a 0-dim tensor in, the blend buffer updated in place; no host
synchronisation).

`LNPlacement` uses `endpoint_step` (its `transition_endpoint_fraction`); the schedules and the controller are the
study's candidates (`examples/migrate_trained_methods.py`), measured and not made defaults.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import torch

SCHEDULES = ("linear", "cosine", "hard", "speed")


class FunctionSpeedSchedule:
    """a(t) with drift(a(t)) = t * drift(1), from a drift profile measured at the start (weights fixed).

    `blends`: increasing, from 0 to 1; `drift`: the drift at each (e.g. KL to a = 0), made monotone here by its
    running maximum. Piecewise linear; exactly 0 at t <= 0 and exactly 1 at t >= 1.
    """

    def __init__(self, blends: Sequence[float], drift: Sequence[float]):
        if len(blends) != len(drift) or len(blends) < 2:
            raise ValueError("FunctionSpeedSchedule: blends and drift need the same length, at least 2")
        if blends[0] != 0.0 or blends[-1] != 1.0 or any(b >= c for b, c in zip(blends, blends[1:])):
            raise ValueError("FunctionSpeedSchedule: blends must increase from 0.0 to 1.0")
        env, top = [], 0.0
        for d in drift:
            if not math.isfinite(d):
                raise ValueError(f"FunctionSpeedSchedule: drift must be finite, got {d!r}")
            top = max(top, float(d) - float(drift[0]))
            env.append(top)
        self.blends, self.total = [float(b) for b in blends], env[-1]
        self.cum = env

    def __call__(self, t: float) -> float:
        if t <= 0:
            return 0.0
        if t >= 1:
            return 1.0
        if self.total <= 0:
            return t  # no drift measured: the blend's own speed
        target = t * self.total
        j = bisect.bisect_left(self.cum, target)  # the first point at or past the target (j >= 1: cum[0] = 0 < target)
        lo, hi = self.cum[j - 1], self.cum[j]
        f = 0.0 if hi == lo else (target - lo) / (hi - lo)
        return self.blends[j - 1] + f * (self.blends[j] - self.blends[j - 1])

    def state_dict(self) -> dict:
        return {"blends": list(self.blends), "cum": list(self.cum)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "FunctionSpeedSchedule":
        return cls(state["blends"], state["cum"])


def endpoint_step(i: int, steps: int | None, fraction: float, salt: int = 0) -> bool:
    """Whether optimizer step `i` (0-based) of a transition of `steps` is an endpoint step: never the first (it
    trains the trained function, as the transition promises) nor past the end; else a hash of (i, salt) below
    `fraction` (splitmix64)."""
    if steps is None or not 1 <= i < steps:
        return False
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    h = (int(i) * 0x9E3779B97F4A7C15 + int(salt) * 0xBF58476D1CE4E5B9 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 31
    return h / 2.0**64 < fraction


class BlendPlan:
    """The blends of a transition of `steps` optimizer steps.

    held(i): the blend the model holds before step i (0-based): schedule(i / steps); 0.0 at i = 0, exactly
    1.0 from i = steps on. trained(i): the blend step i trains at: 1.0 on an endpoint step, else held(i).
    finished(i): the transition is over once `i` steps are done (finish() then leaves the plain conversion).
    """

    def __init__(self, steps: int, schedule: str = "linear", endpoint_fraction: float = 0.0, salt: int = 0,
                 speed: FunctionSpeedSchedule | None = None):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"BlendPlan: steps must be a non-negative int, got {steps!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"BlendPlan: unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
        if schedule == "speed" and speed is None:
            raise ValueError("BlendPlan: schedule 'speed' needs the FunctionSpeedSchedule measured at the start")
        if not (0.0 <= endpoint_fraction <= 1.0):
            raise ValueError(f"BlendPlan: endpoint_fraction must be in [0, 1], got {endpoint_fraction!r}")
        self.steps, self.schedule, self.endpoint_fraction, self.salt, self.speed = steps, schedule, endpoint_fraction, salt, speed

    def held(self, i: int) -> float:
        if self.schedule == "hard" or i >= self.steps:
            return 1.0
        t = i / self.steps
        if self.schedule == "linear":
            return t
        if self.schedule == "cosine":
            return 0.5 * (1.0 - math.cos(math.pi * t))
        return self.speed(t)

    def is_endpoint_step(self, i: int) -> bool:
        # never the first step: it trains at the trained function, as the transition promises
        return endpoint_step(i, self.steps, self.endpoint_fraction, self.salt)

    def trained(self, i: int) -> float:
        return 1.0 if self.is_endpoint_step(i) else self.held(i)

    def finished(self, i: int) -> bool:
        return i >= self.steps

    def state_dict(self) -> dict:
        return {"steps": self.steps, "schedule": self.schedule, "endpoint_fraction": self.endpoint_fraction, "salt": self.salt,
                "speed": None if self.speed is None else self.speed.state_dict()}

    @classmethod
    def from_state_dict(cls, state: dict) -> "BlendPlan":
        speed = None if state.get("speed") is None else FunctionSpeedSchedule.from_state_dict(state["speed"])
        return cls(state["steps"], state["schedule"], state["endpoint_fraction"], state["salt"], speed)


class DriftBudgetController:
    """Adaptive: advance the blend by `rate` per optimizer step while the measured drift, smoothed
    (`ema`), is within `budget`; hold it otherwise. Never goes back, ends at exactly 1.0.

    `update(blend, drift)`: `blend` the transition's buffer (updated in place), `drift` a 0-dim tensor on the
    same device (e.g. the training batch's cross-entropy over the trained function's, from a teacher
    forward; all-reduce it first under data parallelism, so every rank moves alike). No host sync: read
    `done(blend)` on logging steps only. State (the smoothed drift) is a tensor for the checkpoint.
    """

    def __init__(self, rate: float, budget: float, ema: float = 0.9, device=None):
        if not (0 < rate <= 1):
            raise ValueError(f"DriftBudgetController: rate must be in (0, 1], got {rate!r}")
        if not (0 <= ema < 1):
            raise ValueError(f"DriftBudgetController: ema must be in [0, 1), got {ema!r}")
        self.rate, self.budget, self.ema = float(rate), float(budget), float(ema)
        self.smoothed = torch.zeros((), device=device)
        self.started = torch.zeros((), dtype=torch.bool, device=device)

    @torch.no_grad()
    def update(self, blend: torch.Tensor, drift: torch.Tensor) -> None:
        d = drift.detach().to(self.smoothed)
        self.smoothed.copy_(torch.where(self.started, self.ema * self.smoothed + (1 - self.ema) * d, d))
        self.started.fill_(True)
        go = (self.smoothed <= self.budget).to(blend.dtype)
        blend.copy_(torch.clamp(blend + self.rate * go, max=1.0))

    @staticmethod
    def done(blend: torch.Tensor) -> bool:
        """A host read (a sync): call it on logging steps only."""
        return bool(blend >= 1.0)

    def state_dict(self) -> dict:
        return {"smoothed": self.smoothed.clone(), "started": self.started.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.smoothed.copy_(state["smoothed"])
        self.started.copy_(state["started"])


__all__ = ["BlendPlan", "DriftBudgetController", "FunctionSpeedSchedule", "SCHEDULES", "endpoint_step"]
