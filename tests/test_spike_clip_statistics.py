"""ClipAttributionMonitor's window statistics added for issue 33: the clip coefficient (min, mean) and each group's
gradient norm after clipping, against per-step references computed by hand from `clip_grad_norm_`'s inputs; the
starvation warning on an injected, persistent one-group gradient, and none on a clean run that clips every step."""

from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch

from ln_lightning.callbacks import ClipAttributionMonitor
from ln_lightning.testing.monitors import BLOCKS, GROUPS, read_scalars
from test_spike_monitor import SpikeLM, fit, make_batches

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _group(name: str) -> str:
    return next(g for g in GROUPS if name == g or name.startswith(g + "."))


class _PerStepGroupNorms(L.Callback):
    """Each step's squared gradient norm by group, before clipping, computed by hand."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sq = dict.fromkeys(GROUPS, 0.0)
        for n, p in pl_module.named_parameters():
            sq[_group(n)] += p.grad.double().square().sum().item()
        self.steps.append(sq)


def test_coefficient_and_update_scale_over_the_window_match_a_hand_computation(tmp_path):
    x, y = make_batches(20, 1)
    ref = _PerStepGroupNorms()
    clip_val = 0.5
    fit(tmp_path, SpikeLM(x, y), [ref, ClipAttributionMonitor(log_depth_profile=False)], gradient_clip_val=clip_val)
    logged = {t: dict(v) for t, v in read_scalars(tmp_path / "run").items()}
    for end in (9, 19):
        window = ref.steps[end - 9 : end + 1]
        coefs = [min(1.0, clip_val / math.sqrt(sum(sq.values()))) for sq in window]
        assert 0 < min(coefs) < max(coefs) <= 1, "the test needs a window with different coefficients"
        assert math.isclose(logged["clip/coef_min"][end], min(coefs), rel_tol=1e-5)
        assert math.isclose(logged["clip/coef_mean"][end], sum(coefs) / len(coefs), rel_tol=1e-5)
        assert math.isclose(logged["clip/fired_fraction"][end], sum(c < 1 for c in coefs) / len(coefs))
        for g in GROUPS:
            want = sum(c * math.sqrt(sq[g]) for c, sq in zip(coefs, window)) / len(window)
            assert math.isclose(logged[f"clip/update_scale/{g}"][end], want, rel_tol=1e-5), g


def test_one_group_starving_the_others_is_warned_about_once(tmp_path):
    x, y = make_batches(30, 1)
    module = SpikeLM(x, y, spike_step=range(10, 30), spike_block=1, grad_factor=1e4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, module, [ClipAttributionMonitor(log_depth_profile=False)], gradient_clip_val=1.0)
    starving = [str(w.message) for w in caught if "starved" in str(w.message)]
    assert len(starving) == 1 and f"group {BLOCKS[1]!r}" in starving[0] and "at step 19" in starving[0], starving


def test_a_clean_run_clipping_every_step_is_not_called_starvation(tmp_path):
    x, y = make_batches(30, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, SpikeLM(x, y), [ClipAttributionMonitor(log_depth_profile=False)], gradient_clip_val=0.01)
    logged = {t: dict(v) for t, v in read_scalars(tmp_path / "run").items()}
    assert logged["clip/coef_mean"][29] < 0.1  # clipping binds hard on every step ...
    assert not [w for w in caught if "starved" in str(w.message)]  # ... but no group holds 90% of the norm
