"""transition_control (the blend of each transition step) and stream_scale (branch scales for a pre-norm stream)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ln_lightning.placement.rewrite.stream_scale import cumulative_scales, site_ratios
from ln_lightning.placement.migrate.transition_control import BlendPlan, DriftBudgetController, FunctionSpeedSchedule, endpoint_step


@pytest.mark.parametrize("schedule", ["linear", "cosine", "speed"])
def test_plan_is_exact_at_both_ends_and_monotone(schedule):
    speed = FunctionSpeedSchedule([0.0, 0.5, 0.9, 1.0], [0.0, 0.01, 0.2, 0.5]) if schedule == "speed" else None
    plan = BlendPlan(37, schedule, speed=speed)
    held = [plan.held(i) for i in range(40)]
    assert held[0] == 0.0 and all(h == 1.0 for h in held[37:])
    assert all(a <= b for a, b in zip(held, held[1:]))
    assert not plan.finished(36) and plan.finished(37)


def test_hard_plan_is_the_endpoint_from_the_first_step():
    plan = BlendPlan(0, "hard")
    assert plan.held(0) == 1.0 and plan.trained(0) == 1.0 and plan.finished(1)


def test_endpoint_steps_train_at_one_and_hold_the_schedule():
    plan = BlendPlan(400, "linear", endpoint_fraction=0.25)
    hits = [i for i in range(400) if plan.is_endpoint_step(i)]
    assert 70 <= len(hits) <= 130  # about a quarter
    for i in range(400):
        assert plan.held(i) == i / 400
        assert plan.trained(i) == (1.0 if i in hits else i / 400)
    assert not any(plan.is_endpoint_step(i) for i in range(400, 500))  # none after the transition
    assert not BlendPlan(10, endpoint_fraction=1.0).is_endpoint_step(0)  # the first step trains the trained function


def test_endpoint_steps_are_a_function_of_the_step_only():
    a = [endpoint_step(i, 1000, 0.3) for i in range(1000)]
    assert a == [endpoint_step(i, 1000, 0.3) for i in range(1000)]  # every rank, every resume, every micro-batch
    assert a != [endpoint_step(i, 1000, 0.3, salt=1) for i in range(1000)]
    assert not any(endpoint_step(i, 100, 0.0) for i in range(100)) and all(endpoint_step(i, 100, 1.0) for i in range(1, 100))
    assert not endpoint_step(0, 100, 1.0) and not endpoint_step(100, 100, 1.0) and not endpoint_step(5, None, 1.0)
    assert abs(sum(a) / 1000 - 0.3) < 0.05


def test_plan_state_round_trip():
    speed = FunctionSpeedSchedule([0.0, 0.5, 1.0], [0.0, 0.1, 0.4])
    plan = BlendPlan(50, "speed", endpoint_fraction=0.5, salt=3, speed=speed)
    back = BlendPlan.from_state_dict(plan.state_dict())
    assert [back.trained(i) for i in range(60)] == [plan.trained(i) for i in range(60)]


@pytest.mark.parametrize("bad", [dict(steps=-1), dict(steps=True), dict(schedule="exp"), dict(schedule="speed"),
                                 dict(endpoint_fraction=1.5)])
def test_plan_refuses_bad_settings(bad):
    kw = dict(steps=10, schedule="linear") | bad
    with pytest.raises(ValueError):
        BlendPlan(**kw)


def test_function_speed_covers_the_drift_at_constant_speed():
    blends = [0.0, 0.25, 0.5, 0.75, 1.0]
    drift = [0.0, 0.01, 0.03, 0.1, 0.4]
    s = FunctionSpeedSchedule(blends, drift)
    assert s(0.0) == 0.0 and s(1.0) == 1.0
    for t in (0.1, 0.3, 0.6, 0.9):
        a = s(t)
        # the piecewise-linear drift at a(t) is t of the total
        j = max(i for i in range(4) if blends[i] <= a)
        d = drift[j] + (a - blends[j]) / 0.25 * (drift[j + 1] - drift[j])
        assert d == pytest.approx(t * 0.4, rel=1e-9)
    assert s(0.5) > 0.75  # most of the drift sits at the end: the blend spends half the time beyond 0.75


def test_function_speed_makes_the_drift_monotone_and_handles_none():
    s = FunctionSpeedSchedule([0.0, 0.5, 1.0], [0.0, 0.2, 0.1])  # measured noise: the running max is used
    assert s(1.0) == 1.0 and s(0.999) <= 0.5 + 1e-9
    flat = FunctionSpeedSchedule([0.0, 1.0], [0.0, 0.0])
    assert flat(0.3) == 0.3
    with pytest.raises(ValueError):
        FunctionSpeedSchedule([0.1, 1.0], [0.0, 0.1])


def test_drift_budget_controller_advances_only_within_budget_and_ends_at_one():
    blend = torch.zeros(())
    c = DriftBudgetController(rate=0.3, budget=0.05, ema=0.0)
    c.update(blend, torch.tensor(0.01))
    assert float(blend) == pytest.approx(0.3)
    c.update(blend, torch.tensor(0.2))  # over budget: hold
    assert float(blend) == pytest.approx(0.3)
    for _ in range(5):
        c.update(blend, torch.tensor(0.0))
    assert float(blend) == 1.0 and DriftBudgetController.done(blend)


def test_drift_budget_controller_smooths_and_restores():
    blend = torch.zeros(())
    c = DriftBudgetController(rate=0.1, budget=0.05, ema=0.9)
    c.update(blend, torch.tensor(0.0))
    c.update(blend, torch.tensor(0.3))  # smoothed 0.03: still within the budget
    assert float(blend) == pytest.approx(0.2)
    d = DriftBudgetController(rate=0.1, budget=0.05, ema=0.9)
    d.load_state_dict(c.state_dict())
    assert float(d.smoothed) == pytest.approx(float(c.smoothed))


class _Stack(nn.Module):
    """x -> LN1(k1 * x) -> LN2(k2 * .): norms whose inputs have known scales."""

    def __init__(self, k1, k2):
        super().__init__()
        self.k1, self.k2 = k1, k2
        self.ln1, self.ln2 = nn.LayerNorm(256), nn.LayerNorm(256)
        with torch.no_grad():
            self.ln2.weight.fill_(2.0)

    def forward(self, x):
        return self.ln2(self.k2 * self.ln1(self.k1 * x))


def test_site_ratios_measure_std_over_gain():
    torch.manual_seed(0)
    m = _Stack(3.0, 5.0)
    x = torch.randn(64, 256)
    r = site_ratios(m, [m.ln1, m.ln2], lambda mod: mod(x))
    assert r[0] == pytest.approx(3.0, rel=0.02)  # std 3 over |gamma| 1
    assert r[1] == pytest.approx(5.0 / 2.0, rel=0.02)  # LN1's output has std 1, times 5, over |gamma| 2
    assert not m.ln1._forward_pre_hooks  # the measurement leaves no hook behind


def test_site_ratios_refuse_a_norm_that_runs_twice():
    ln = nn.LayerNorm(8)
    with pytest.raises(ValueError, match="ran 2 times"):
        site_ratios(ln, [ln], lambda mod: (mod(torch.randn(2, 8)), mod(torch.randn(2, 8))))


def test_cumulative_scales():
    assert cumulative_scales([2.0, 1.5, 0.5]) == [1.0, 2.0, 3.0, 1.5]
    with pytest.raises(ValueError):
        cumulative_scales([1.0, 0.0])
    with pytest.raises(ValueError):
        cumulative_scales([math.inf])
