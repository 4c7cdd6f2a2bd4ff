"""The closed-loop transition (TransitionSpec(tolerance=...)), the held blend callbacks see, the teacher's dropout
masks, the TensorBoard scalars after the end, the deprecated keywords, and the plugin's host reads (issue 31)."""

from __future__ import annotations

import copy
import json
import math
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.overrides import TorchFunctionMode

from _helpers_transition import LM, BlendRecorder, batch, csv_by_step, csv_column, loader, logged_trainer, rel, trainer
from ln_lightning import LNLightningDeprecationWarning, LNLightningWarning, TransitionSpec
from ln_lightning import _distill
from ln_lightning.demo import PostNormTransformerLM
from ln_lightning.placement import convert
from ln_lightning.placement.migrate import transition
from ln_lightning.placement.migrate.blend import Transition
from ln_lightning.placement.rewrite import hooks
from ln_lightning.plugin import REPORT_FILENAME, LNPlacement


def _plugin(**spec) -> LNPlacement:
    return LNPlacement("pre", transition=TransitionSpec(**spec), fused=False, log_report=False)


@pytest.fixture
def teacher_runs(monkeypatch) -> list:
    """One entry per distillation comparison with the teacher (a teacher forward), counted as the fit runs."""
    runs = []
    original = _distill.kl_per_position
    monkeypatch.setattr(_distill, "kl_per_position", lambda s, t: runs.append(1) or original(s, t))
    return runs


# ---------------------------------------------------------------------------------------------- the gate itself
def test_gate_smooths_the_drift_and_advances_only_within_the_tolerance_against_a_hand_computation():
    t = Transition(steps=10, kind="closed")
    drifts = [0.0, 0.05, 0.30, 0.30, 0.01, 0.0, 0.0, 0.0]
    ema, tol, rate = 0.8, 0.1, 0.25
    smoothed, blend, expected = None, 0.0, []
    for d in drifts:
        smoothed = d if smoothed is None else ema * smoothed + (1 - ema) * d
        if smoothed <= tol:
            blend = min(1.0, blend + rate)
        expected.append((smoothed, blend))
    got = []
    for d in drifts:
        t.gate(torch.tensor(d), tol, rate, ema=ema)
        got.append((t.drift.item(), t.blend.item()))
    for (s, b), (gs, gb) in zip(expected, got):
        assert gs == pytest.approx(s, rel=1e-6) and gb == pytest.approx(b, abs=1e-7)
    assert got[-1][1] == 1.0  # clamped at exactly 1, never past it


def test_transition_spec_validates_and_spells_the_closed_loop():
    spec = TransitionSpec(steps=400)
    assert spec.closed and spec.kind == "closed" and spec.tolerance == 0.05
    assert spec.rate() == pytest.approx(1 / (0.5 * 400 * 0.75))
    assert TransitionSpec(steps=10, tolerance=None, schedule="cosine").kind == "cosine"
    with pytest.raises(ValueError, match="ramp must be in"):
        TransitionSpec(steps=10, ramp=0)
    with pytest.raises(ValueError, match="endpoint_fraction"):
        TransitionSpec(steps=10, endpoint_fraction=1.0)
    assert LNPlacement("pre", transition=50).transition == TransitionSpec(steps=50)


def test_deprecated_keywords_warn_keep_the_open_loop_and_refuse_without_steps():
    with pytest.warns(LNLightningDeprecationWarning, match=r"transition=TransitionSpec\(steps=7, distill=0.5, tolerance=None\)"):
        p = LNPlacement("pre", transition_steps=7, transition_distill=0.5)
    assert p.transition == TransitionSpec(steps=7, tolerance=None, distill=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LNLightningDeprecationWarning)
        with pytest.raises(ValueError, match="apply only with transition_steps"):
            LNPlacement("pre", transition_distill=0.5)  # silently ignored before
        with pytest.raises(ValueError, match="not both"):
            LNPlacement("pre", transition=3, transition_steps=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'transition_step'"):
        LNPlacement("pre", transition_step=3)


# ---------------------------------------------------------------------------------------------- the plugin's closed loop
def test_closed_loop_ends_at_the_rewrite_when_the_drift_allows_and_the_dashboard_shows_it_ended(tmp_path):
    module = LM("demo", lr=0.0)  # weights fixed: the end is exactly the rewrite of the trained model
    reference = copy.deepcopy(module.model)
    # A tolerance no drift reaches: the blend ramps at the budget's pace, 1 / (0.5 * 8 * 0.75) per held step.
    plugin = LNPlacement("pre", transition=TransitionSpec(steps=8, tolerance=100.0), fused=False, log_report=True)
    logged_trainer(tmp_path, plugin, 10).fit(module, train_dataloaders=loader())
    assert transition.active(module) is None and transition.leftovers(module) == []
    convert(reference, "pre", branch_scale="stream")
    for ref_scale, scale in zip([m for m in reference.modules() if hasattr(m, "c")], [m for m in module.model.modules() if hasattr(m, "c")]):
        ref_scale.c.copy_(scale.c)  # the measured C_k (the first batch's): the end point is that form exactly
    x = batch(3)
    assert rel(module.model.eval()(x), reference.eval()(x)) <= 1e-6
    blends = csv_column(tmp_path / "logs", "ln_placement/transition")
    assert blends[0] == 0.0 and 0.0 < blends[2] < 1.0
    assert blends[-1] == 1.0  # after the end it says so, not the last blend it logged
    drift = csv_column(tmp_path / "logs", "ln_placement/drift")
    assert drift and all(d >= 0.0 for d in drift)  # from the first step: the drift measured, never "-1"
    payload = json.loads(next((tmp_path / "logs").rglob(REPORT_FILENAME)).read_text())
    assert payload["transition"]["finished"] is True


def test_after_an_open_loop_transition_the_dashboard_shows_it_ended(tmp_path):
    logged_trainer(tmp_path, _plugin(steps=4, tolerance=None), 7).fit(LM("demo"), train_dataloaders=loader())
    blends = csv_column(tmp_path / "logs", "ln_placement/transition")
    assert blends[:4] == [0.0, 0.25, 0.5, 0.75] and blends[4:] == [1.0, 1.0, 1.0]
    kl = csv_column(tmp_path / "logs", "ln_placement/distill_kl")
    assert len(kl) == 7 and kl[4:] == [0.0, 0.0, 0.0]  # no term added after the end; before it, the measured KL


def test_closed_loop_that_cant_stay_within_the_tolerance_says_so_and_never_finishes(tmp_path, teacher_runs):
    module = LM("demo", lr=0.0)
    spec = TransitionSpec(steps=6, tolerance=1e-12, endpoint_fraction=0.0, distill_after_budget=False)
    plugin = LNPlacement("pre", transition=spec, fused=False)
    with pytest.warns(LNLightningWarning) as caught:
        logged_trainer(tmp_path, plugin, 8).fit(module, train_dataloaders=loader())
    said = [str(w.message) for w in caught if w.category is LNLightningWarning]
    # Before the budget's end (a quarter in, at the first read that shows the stall), then at its end.
    assert any(re.search(r"at step 2 of its 6-step budget .* stands at blend 0\.333: the blend has not moved since step 1", m)
               for m in said), said
    assert any(re.search(r"spent its budget of 6 steps at blend 0\.3333 .*not moved since step 1.*stays at that blend", m)
               for m in said), said
    # a stalled blend: the fix offered is a larger tolerance, not a larger budget (migration suite order 20: a budget
    # five times larger left such a blend short of 1)
    spent = next(m for m in said if "spent its budget" in m)
    assert "not moved by a larger budget alone" in spent and "TransitionSpec(steps=6, tolerance=2e-12, excess_tolerance=0.02)" in spent, spent
    assert "Continue with a larger budget" not in spent, spent
    t = transition.active(module)
    assert t is not None  # still blending: not "finished" at a drift nobody agreed to
    # Step 0 runs at blend 0 (drift exactly 0: it advances once); from then on the drift holds it.
    assert t.blend.item() == pytest.approx(TransitionSpec(steps=6, endpoint_fraction=0.0).rate(), rel=1e-6)
    payload = json.loads(next((tmp_path / "logs").rglob(REPORT_FILENAME)).read_text())
    final = payload["transition"]
    assert final["finished"] is False and final["budget_needed"] is None and final["stalled_since"] == 1
    assert final["tolerance"] == 1e-12
    assert final["distill_after_budget"] is False  # what the fit does at the held blend from here
    assert final["blend"] == pytest.approx(t.blend.item())
    assert csv_column(tmp_path / "logs", "ln_placement/transition")[-1] == pytest.approx(t.blend.item())
    # The budget spent, the blend is held and the teacher no longer runs (steps 6 and 7), nor adds a term.
    assert len(teacher_runs) == 6
    assert csv_column(tmp_path / "logs", "ln_placement/distill_kl")[-2:] == [0.0, 0.0]


def test_the_training_drift_factor_validates():
    assert TransitionSpec(steps=10, training_drift_factor=2).training_drift_factor == 2.0
    with pytest.raises(ValueError, match="training_drift_factor must be a positive number"):
        TransitionSpec(steps=10, training_drift_factor=0)
    with pytest.raises(ValueError, match="the open loop"):
        TransitionSpec(steps=10, tolerance=None, training_drift_factor=2.0)
    with pytest.raises(ValueError, match="reference='trained'"):
        TransitionSpec(steps=10, reference="current", training_drift_factor=2.0)
    with pytest.raises(ValueError, match="training_drift_every must be a positive int"):
        TransitionSpec(steps=10, training_drift_factor=2.0, training_drift_every=0)
    spec = TransitionSpec(steps=10, training_drift_factor=2.0, training_drift_every=3)
    assert [i for i in range(10) if spec.measures_training_drift(i)] == [3, 6, 9]  # never the first (it is 0 there)
    assert not any(TransitionSpec(steps=10).measures_training_drift(i) for i in range(10))


def test_the_tolerance_follows_the_training_drift_where_training_alone_moves_the_function(tmp_path):
    """A tolerance no blend meets (1e-12) holds a fixed closed loop after its first step (as above); with
    training_drift_factor the tolerance becomes factor x KL(trained || the model at blend 0), measured at step 2,
    and the blend goes on. Without the factor it stays held."""
    base = dict(steps=6, tolerance=1e-12, endpoint_fraction=0.0)
    runs = {}
    for name, extra in (("fixed", {}), ("follows", dict(training_drift_factor=1e9, training_drift_every=2))):
        module = LM("demo", lr=0.05)  # training moves the function from the first step on
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LNLightningWarning)
            logged_trainer(tmp_path / name, _plugin(**base, **extra), 6).fit(module, train_dataloaders=loader())
        runs[name] = module
    t = transition.active(runs["fixed"])
    assert t is not None and t.blend.item() == pytest.approx(TransitionSpec(**base).rate(), rel=1e-6)
    assert transition.active(runs["follows"]) is None  # blend 1 reached: steps 0, 2, 3 advanced (1/3 each)
    measured = csv_column(tmp_path / "follows" / "logs", "ln_placement/training_drift")
    # measured at step 2, shown again at step 3 (the transition ended there)
    assert len(measured) == 2 and measured[0] > 0.0 and measured[1] == measured[0]
    tolerance = csv_column(tmp_path / "follows" / "logs", "ln_placement/tolerance")
    assert tolerance[0] == pytest.approx(1e9 * measured[0], rel=1e-5)
    assert csv_column(tmp_path / "fixed" / "logs", "ln_placement/training_drift") == []


def test_the_training_drift_is_exactly_zero_where_the_weights_have_not_moved_dropout_included(tmp_path):
    """lr 0: the model at blend 0 is the trained function; the extra forward replays the step's dropout masks, so
    the training drift is 0 bit for bit and the tolerance stays the spec's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LNLightningWarning)
        logged_trainer(tmp_path, _plugin(steps=20, tolerance=0.5, endpoint_fraction=0.0, training_drift_factor=2.0,
                                                 training_drift_every=2), 6, log_every_n_steps=2).fit(
            DropoutLM(lr=0.0), train_dataloaders=loader())
    # Measured at steps 2 and 4; logged at steps 1, 3, 5, each the last measurement: a logging step that is never
    # a measuring one still shows it (before, none was logged here)
    assert csv_column(tmp_path / "logs", "ln_placement/training_drift") == [0.0, 0.0]  # steps 3 and 5
    assert csv_column(tmp_path / "logs", "ln_placement/tolerance") == [0.5, 0.5]


def test_closed_loop_resume_gives_the_uninterrupted_weights(tmp_path):
    spec = dict(steps=6, tolerance=0.5)
    straight = LM("demo")
    trainer(tmp_path / "a", _plugin(**spec), max_steps=8).fit(straight, train_dataloaders=loader())
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp_path / "b", _plugin(**spec), max_steps=3, callbacks=[ckpt]).fit(LM("demo"), train_dataloaders=loader())
    path = next((tmp_path / "ck").glob("*step=3*.ckpt"))
    saved = torch.load(path, weights_only=False)
    assert saved["state_dict"]["ln_lightning_transition.drift"].item() >= 0.0  # the loop's state travels with it
    resumed = LM("demo")
    trainer(tmp_path / "c", _plugin(**spec), max_steps=8).fit(resumed, train_dataloaders=loader(), ckpt_path=path)
    a, b = straight.state_dict(), resumed.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-6, atol=1e-7), k


def test_a_fit_resumed_after_the_budget_was_spent_holds_the_blend_without_distilling_as_the_uninterrupted_one(
        tmp_path, teacher_runs):
    """The budget spent short of blend 1, the uninterrupted fit pauses its distillation (no teacher forward, no term
    in the loss); a fit resumed from a checkpoint written after that must not start it again."""
    spec = dict(steps=4, tolerance=1e-12, endpoint_fraction=0.0, distill_after_budget=False)
    with pytest.warns(LNLightningWarning, match="spent its budget"):
        straight = LM("demo")
        trainer(tmp_path / "a", _plugin(**spec), max_steps=9).fit(straight, train_dataloaders=loader())
    assert len(teacher_runs) == 4  # the budget's steps only
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1)
    with pytest.warns(LNLightningWarning, match="spent its budget"):
        trainer(tmp_path / "b", _plugin(**spec), max_steps=6, callbacks=[ckpt]).fit(LM("demo"), train_dataloaders=loader())
    path = next((tmp_path / "ck").glob("*step=6*.ckpt"))
    teacher_runs.clear()
    resumed = LM("demo")
    with pytest.warns(LNLightningWarning, match="spent its budget of 4 steps"):  # said again on the second fit
        logged_trainer(tmp_path / "c", _plugin(**spec), 9).fit(resumed, train_dataloaders=loader(), ckpt_path=path)
    assert teacher_runs == []
    assert csv_column(tmp_path / "c" / "logs", "ln_placement/distill_kl") == [0.0, 0.0, 0.0]
    a, b = straight.state_dict(), resumed.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_live_reference_is_named_as_such_where_the_budget_runs_out(tmp_path):
    # reference="current" compares the model with its own function at blend 0, not a copy of the trained one: the
    # warnings must not say "the trained function" of it (they did, migration suite order 17).
    spec = dict(steps=4, tolerance=1e-12, endpoint_fraction=0.0, reference="current")
    with pytest.warns(LNLightningWarning) as said:
        trainer(tmp_path / "a", _plugin(**spec), max_steps=6).fit(LM("demo"), train_dataloaders=loader())
    budget = [str(w.message) for w in said if "spent its budget" in str(w.message)]
    assert budget and "distilling towards the model's own function at blend 0" in budget[0]
    assert not any("trained function" in m for m in budget), budget


def test_distill_after_budget_keeps_the_teacher_after_the_budget_and_on_resume(tmp_path, teacher_runs):
    spec = dict(steps=4, tolerance=1e-12, endpoint_fraction=0.0)  # distill_after_budget's default in the closed loop
    with pytest.warns(LNLightningWarning, match="goes on there, distilling towards the trained function"):
        straight = LM("demo")
        logged_trainer(tmp_path / "a", _plugin(**spec), 9).fit(straight, train_dataloaders=loader())
    assert len(teacher_runs) == 9  # every step, the budget's and after it
    assert all(k > 0.0 for k in csv_column(tmp_path / "a" / "logs", "ln_placement/distill_kl")[4:])
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1)
    with pytest.warns(LNLightningWarning, match="spent its budget"):
        trainer(tmp_path / "b", _plugin(**spec), max_steps=6, callbacks=[ckpt]).fit(LM("demo"), train_dataloaders=loader())
    teacher_runs.clear()
    resumed = LM("demo")
    plugin = LNPlacement("pre", transition=TransitionSpec(**spec), fused=False)  # (writes its report)
    with pytest.warns(LNLightningWarning, match="spent its budget of 4 steps"):
        logged_trainer(tmp_path / "c", plugin, 9).fit(
            resumed, train_dataloaders=loader(), ckpt_path=next((tmp_path / "ck").glob("*step=6*.ckpt")))
    assert len(teacher_runs) == 3
    report = json.loads(next((tmp_path / "c" / "logs").rglob(REPORT_FILENAME)).read_text())
    assert report["transition"]["finished"] is False and report["transition"]["distill_after_budget"] is True
    a, b = straight.state_dict(), resumed.state_dict()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-6, atol=1e-7), k


def test_a_raised_tolerance_is_shown_on_every_step_and_named_where_the_budget_ends(tmp_path):
    """training_drift_factor with endpoint steps and a budget spent short of blend 1 (a gated return after it):
    ln_placement/tolerance and training_drift are on every step from the first measurement (endpoint steps and steps
    after the budget included, as last measured); the budget-end warning names the tolerance the loop gated at,
    offers a spec that keeps training_drift_factor, and the report says it."""
    from ln_lightning.placement.migrate.transition_control import endpoint_step
    spec = dict(steps=10, tolerance=1e-5, endpoint_fraction=0.5, training_drift_factor=0.3, training_drift_every=2,
                revert_after_budget="gated")
    assert any(endpoint_step(i, 10, 0.5) for i in range(2, 10))  # (the fit below has endpoint steps past step 2)
    with pytest.warns(LNLightningWarning, match="spent its budget") as caught:
        plugin = LNPlacement("pre", transition=TransitionSpec(**spec), fused=False)  # (the report JSON on)
        logged_trainer(tmp_path, plugin, 14).fit(LM("demo", lr=1e-2), train_dataloaders=loader())
    tolerance = csv_by_step(tmp_path, "ln_placement/tolerance")
    drift = csv_by_step(tmp_path, "ln_placement/training_drift")
    first = min(drift)  # the first measurement (step 2), taken on the first step after it that gates
    assert first == min(i for i in range(2, 10) if not endpoint_step(i, 10, 0.5))
    assert sorted(tolerance) == sorted(drift) == list(range(first, 14))
    raised = tolerance[9]  # the last step of the budget
    assert raised > 1e-3
    message = next(str(w.message) for w in caught if "spent its budget" in str(w.message))
    assert f"drift tolerance {raised:.3g}: 1e-05 raised by training_drift_factor=0.3" in message, message
    assert "training_drift_factor=0.3, training_drift_every=2))" in message, message
    report = json.loads(next((tmp_path / "logs").rglob(REPORT_FILENAME)).read_text())
    assert report["transition"]["tolerance_reached"] == pytest.approx(raised, rel=1e-6)


def test_a_stall_is_told_from_a_slow_pace_however_sparse_the_reads_and_after_a_resume(tmp_path):
    """A blend held from step 1 on (lr 0, a tolerance no blend meets) with log_every_n_steps=50 and a 10-step
    budget: the host reads the blend only at the budget's end. The budget-end warning and the report say it has
    not moved since step 1 (before: "needs about 38 steps", from the one read and the origin, with the advice of a
    larger budget, which a stall does not take), uninterrupted and resumed from a checkpoint written at step 4."""
    spec = dict(steps=10, tolerance=1e-5, endpoint_fraction=0.0)

    def fit(root, max_steps, ckpt_path=None):
        with pytest.warns(LNLightningWarning) as caught:
            logged_trainer(root, LNPlacement("pre", transition=TransitionSpec(**spec), fused=False), max_steps,
                           log_every_n_steps=50).fit(LM("demo", lr=0.0), train_dataloaders=loader(), ckpt_path=ckpt_path)
        spent = [str(w.message) for w in caught if "spent its budget" in str(w.message)]
        assert len(spent) == 1 and "has not moved since step 1:" in spent[0] and "needs about" not in spent[0], spent
        final = json.loads(next((root / "logs").rglob(REPORT_FILENAME)).read_text())["transition"]
        assert final["stalled_since"] == 1 and final["budget_needed"] is None

    fit(tmp_path / "straight", 12)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LNLightningWarning)
        logged_trainer(tmp_path / "first", _plugin(**spec), 4, log_every_n_steps=50, callbacks=[ckpt],
                       enable_checkpointing=True).fit(
            LM("demo", lr=0.0), train_dataloaders=loader())
    fit(tmp_path / "resumed", 12, ckpt_path=next((tmp_path / "ck").glob("*step=4*.ckpt")))  # the checkpoint kept the pace


def test_holds_without_a_verdict_are_no_stall(tmp_path):
    """A blend that moves on every step whose gate runs (a tolerance that never binds) in a 15-step budget, its
    last steps endpoint steps (which hold the blend without a verdict): spent short of 1, the warning and the
    report give the pace it needs, not a stall (a second reader's case against the first form of the device count,
    which counted every step since the last move)."""
    from ln_lightning.placement.migrate.transition_control import endpoint_step
    assert endpoint_step(13, 15, 0.25) and endpoint_step(14, 15, 0.25)
    spec = TransitionSpec(steps=15, tolerance=1e9, ramp=1.0, excess_tolerance=math.inf)
    with pytest.warns(LNLightningWarning, match="spent its budget") as caught:
        logged_trainer(tmp_path, LNPlacement("pre", transition=spec, fused=False), 15, log_every_n_steps=50).fit(
            LM("demo", lr=0.0), train_dataloaders=loader())
    spent = next(str(w.message) for w in caught if "spent its budget" in str(w.message))
    assert "at its recent pace it needs about 16 steps" in spent, spent
    final = json.loads(next((tmp_path / "logs").rglob(REPORT_FILENAME)).read_text())["transition"]
    assert final["budget_needed"] == 16 and final["stalled_since"] is None


def test_a_fit_resumed_after_the_budget_keeps_the_raised_tolerance(tmp_path):
    """training_drift_factor's raised tolerance is not measured again after the budget: a fit resumed from a
    checkpoint written after it reports, logs and gates at the tolerance the uninterrupted fit does."""
    spec = dict(steps=10, tolerance=1e-5, endpoint_fraction=0.5, training_drift_factor=0.3, training_drift_every=2,
                revert_after_budget="gated")

    def fit(root, max_steps, **kw):
        plugin = LNPlacement("pre", transition=TransitionSpec(**spec), fused=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LNLightningWarning)
            ckpt_path = kw.pop("ckpt_path", None)
            logged_trainer(root, plugin, max_steps, **kw).fit(LM("demo", lr=1e-2), train_dataloaders=loader(),
                                                              ckpt_path=ckpt_path)
        final = json.loads(next((root / "logs").rglob(REPORT_FILENAME)).read_text())["transition"]
        return final["tolerance_reached"], csv_by_step(root, "ln_placement/tolerance")

    straight, straight_logged = fit(tmp_path / "straight", 16)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=11, save_top_k=-1)
    fit(tmp_path / "first", 11, callbacks=[ckpt], enable_checkpointing=True)
    resumed, resumed_logged = fit(tmp_path / "resumed", 16, ckpt_path=next((tmp_path / "ck").glob("*step=11*.ckpt")))
    assert straight is not None and resumed == pytest.approx(straight, rel=1e-6)
    assert sorted(resumed_logged) == list(range(11, 16))
    assert [resumed_logged[i] for i in range(11, 16)] == pytest.approx([straight_logged[i] for i in range(11, 16)], rel=1e-6)


def test_a_step_without_a_teacher_after_an_endpoint_step_shows_the_held_blends_kl(tmp_path):
    """teacher_every=2 with endpoint steps: an endpoint step logs its own KL (the end point's, the term it trains),
    and the step without a teacher after it shows the last KL measured at the held blend, not the end point's."""
    from ln_lightning.placement.migrate.transition_control import endpoint_step
    spec = dict(steps=16, tolerance=1e-5, endpoint_fraction=0.5, teacher_every=2)
    ends = [i for i in range(0, 16, 2) if endpoint_step(i, 16, 0.5)]
    assert ends and ends[0] > 0 and ends[0] + 1 < 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LNLightningWarning)
        logged_trainer(tmp_path, _plugin(**spec), 16).fit(LM("demo", lr=0.0), train_dataloaders=loader())
    kl = csv_by_step(tmp_path, "ln_placement/distill_kl")
    assert sorted(kl) == list(range(16))
    held = None
    for step in range(16):
        if step % 2 == 0 and not endpoint_step(step, 16, 0.5):
            held = kl[step]
        elif step % 2 == 1:
            assert kl[step] == held, (step, kl)
    assert any(kl[e] != kl[e + 1] for e in ends)  # an end point's KL differs from the held blend's


def test_teacher_every_shows_its_measurements_on_logging_steps_that_fall_on_steps_without_a_teacher(tmp_path, teacher_runs):
    """teacher_every=2 with log_every_n_steps=2: every logging step (Lightning's 2nd, 4th, ... batch, global_step odd)
    falls on a step without a teacher. The dashboard shows the drift, the loss excess and distill_kl as last
    measured there, not nothing (before, none of the three was ever logged)."""
    spec = dict(steps=12, tolerance=1e-12, ramp=0.5, endpoint_fraction=0.0, teacher_every=2, excess_tolerance=1.0)
    plugin = _plugin(**spec)
    logged_trainer(tmp_path, plugin, 8, log_every_n_steps=2).fit(LM("demo"), train_dataloaders=loader())
    assert len(teacher_runs) == 4  # steps 0, 2, 4, 6
    for name in ("ln_placement/distill_kl", "ln_placement/drift", "ln_placement/loss_excess"):
        values = csv_column(tmp_path / "logs", name)
        assert len(values) == 4, name  # logged at steps 1, 3, 5, 7: each the step before's measurement
    kl = csv_column(tmp_path / "logs", "ln_placement/distill_kl")
    assert kl[0] == 0.0 and all(v > 0 for v in kl[1:])  # step 0 at blend 0 is the trained function; then it moves


def test_teacher_every_runs_the_teacher_on_the_steps_it_names_and_a_resumed_fit_on_the_same_ones(tmp_path, teacher_runs):
    """TransitionSpec(teacher_every=2): the teacher (and the term, and the drift's measurement) on the optimizer steps
    whose global_step is even, through the budget and after it; a fit resumed at an odd step skips as the
    uninterrupted one did, to the same weights."""
    # (a budget it spends short of blend 1: it distils on after it)
    spec = dict(steps=8, tolerance=1e-12, ramp=0.5, endpoint_fraction=0.0, teacher_every=2)
    with pytest.warns(LNLightningWarning, match="spent its budget"):
        straight = LM("demo")
        logged_trainer(tmp_path / "a", _plugin(**spec), 10).fit(straight, train_dataloaders=loader())
    assert len(teacher_runs) == 5  # steps 0, 2, 4, 6, 8 of 10
    # measured on the teacher's steps, held on the others (the dashboard shows the last measurement on every step)
    kl = csv_column(tmp_path / "a" / "logs", "ln_placement/distill_kl")
    assert len(kl) == 10 and kl[1::2] == kl[0::2] and len(set(kl[2::2])) == 4
    # Step 0 measures 0 (blend 0 is the trained function) and advances; step 1, skipped, holds (no fresh measurement);
    # step 2 measures the drift over the tolerance, which holds the blend from then on.
    assert csv_column(tmp_path / "a" / "logs", "ln_placement/transition") == [0.0] + [0.25] * 9
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp_path / "b", _plugin(**spec), max_steps=3, callbacks=[ckpt]).fit(LM("demo"), train_dataloaders=loader())
    teacher_runs.clear()
    resumed = LM("demo")
    with pytest.warns(LNLightningWarning, match="spent its budget"):
        trainer(tmp_path / "c", _plugin(**spec), max_steps=10).fit(
            resumed, train_dataloaders=loader(), ckpt_path=next((tmp_path / "ck").glob("*step=3*.ckpt")))
    assert len(teacher_runs) == 3  # steps 4, 6, 8
    a, b = straight.state_dict(), resumed.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-6, atol=1e-7), k


def test_teacher_every_weights_the_term_by_it_where_the_teacher_runs():
    d = _distill.Distillation(0.5)
    d.every = 3
    d._module = type("Logs", (), {"log": lambda *a, **k: None})()
    d._pending = [torch.tensor(0.2)]
    assert d._training_step(lambda: torch.tensor(1.0)).item() == pytest.approx(1.0 + 0.5 * 3 * 0.2)


def test_after_the_budget_a_step_without_a_teacher_gives_a_gated_return_no_go():
    """revert_after_budget="gated" steps back on `_observe_after_budget`'s verdict: on a step whose teacher was skipped
    (teacher_every) nothing fresh was measured, so the verdict is no, whatever the last smoothed values say."""
    from ln_lightning._transition_run import TransitionRun

    run = TransitionRun(TransitionSpec(steps=4, teacher_every=2, revert_after_budget="gated"), "pre")
    run.distill = type("Teacher", (), {"active": True, "paused": False, "skip": False})()
    strategy = type("Strategy", (), {"reduce": staticmethod(lambda x, reduce_op: x)})()
    trainer_ = type("T", (), {"strategy": strategy})()
    module = type("M", (), {"log": lambda *a, **k: None})()
    t = Transition(steps=4, kind="closed")
    assert bool(run._observe_after_budget(trainer_, module, t, torch.tensor(0.0), torch.tensor(0.0)))  # measured, within
    run.distill.skip = True
    assert not bool(run._observe_after_budget(trainer_, module, t, None, None))  # the same smoothed values, not fresh
    assert t.drift.item() == 0.0  # (kept, not observed again)


def test_teacher_every_validates():
    assert TransitionSpec(steps=4).teacher_every == 1
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="teacher_every must be a positive int"):
            TransitionSpec(steps=4, teacher_every=bad)
    with pytest.raises(ValueError, match="Drop teacher_every"):
        TransitionSpec(steps=4, teacher_every=2, training_drift_factor=2.0)
    # the blend moves once per measurement: ramp x teacher_every above 1 can't reach blend 1 within the budget
    with pytest.raises(ValueError, match=r"can't reach 1 within its budget at ramp=0.5 .* Pass ramp <= 0.333"):
        TransitionSpec(steps=4, teacher_every=3)
    assert TransitionSpec(steps=4, teacher_every=3, ramp=1 / 3).teacher_every == 3
    assert TransitionSpec(steps=4, teacher_every=3, tolerance=None).teacher_every == 3  # (the open loop has no gate)
    spec = TransitionSpec(steps=4, teacher_every=3, ramp=0.25)
    assert [spec.runs_teacher(i) for i in range(7)] == [True, False, False, True, False, False, True]


def test_distill_after_budget_validates():
    assert TransitionSpec(steps=4).distill_after_budget is True  # the closed loop's default (suite order 15)
    assert TransitionSpec(steps=4, tolerance=None).distill_after_budget is False  # the open loop has no budget's end
    assert TransitionSpec(steps=4, distill=0.0).distill_after_budget is False
    assert TransitionSpec(steps=4, distill_after_budget=False).distill_after_budget is False
    with pytest.raises(ValueError, match="distill_after_budget says what a closed loop .* needs a tolerance"):
        TransitionSpec(steps=4, tolerance=None, distill_after_budget=True)
    with pytest.raises(ValueError, match="and distill > 0"):
        TransitionSpec(steps=4, distill=0.0, distill_after_budget=True)
    with pytest.raises(ValueError, match="must be True, False or None"):
        TransitionSpec(steps=4, distill_after_budget=1)


def test_revert_after_budget_goes_back_to_blend_0_then_trains_the_model_as_written_and_resumes_so(tmp_path, teacher_runs):
    """A budget spent short of blend 1 with revert_after_budget: the blend goes back to 0 at the ramp's pace while the
    teacher distils, then the teacher pauses; the model ends computing its trained placement (the rewrite's hooks
    bypassed: the model as written), the report says where it went back, and a fit resumed after that runs no teacher
    and ends as the uninterrupted one."""
    # tolerance 1e-12: only the first step (at blend 0, drift exactly 0) advances; ramp 1 over 4 steps: blend 0.25,
    # so one step back.
    spec = dict(steps=4, tolerance=1e-12, endpoint_fraction=0.0, ramp=1.0, revert_after_budget="ramp")
    straight = LM("demo")
    plugin = LNPlacement("pre", transition=TransitionSpec(**spec), fused=False)  # (writes its report)
    with pytest.warns(LNLightningWarning, match=r"goes back to blend 0, its trained placement, over the next 1 step, "
                                                r"distilling towards the trained function"):
        logged_trainer(tmp_path / "a", plugin, 9).fit(straight, train_dataloaders=loader())
    assert len(teacher_runs) == 5  # the budget's 4 steps and the one back, none after
    blends = csv_column(tmp_path / "a" / "logs", "ln_placement/transition")
    assert blends[1:5] == [0.25] * 4 and blends[5:] == [0.0] * 4
    assert csv_column(tmp_path / "a" / "logs", "ln_placement/distill_kl")[5:] == [0.0] * 4
    assert transition.get_blend(straight) == 0.0
    report = json.loads(next((tmp_path / "a" / "logs").rglob(REPORT_FILENAME)).read_text())
    assert report["transition"]["finished"] is False and report["transition"]["blend"] == 0.0
    assert report["transition"]["revert_after_budget"] == "ramp" and report["transition"]["reverted_at_step"] == 5
    straight.eval()
    x = batch()
    with torch.no_grad():
        held = straight(x)
        with hooks.bypass():
            written = straight(x)
    assert torch.equal(held, written)  # blend 0: the trained placement, bit for bit

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1)
    with pytest.warns(LNLightningWarning, match="spent its budget"):
        trainer(tmp_path / "b", _plugin(**spec), max_steps=6, callbacks=[ckpt]).fit(LM("demo"), train_dataloaders=loader())
    teacher_runs.clear()
    resumed = LM("demo")
    with pytest.warns(LNLightningWarning, match="spent its budget of 4 steps .* The model is at blend 0, its trained placement"):
        trainer(tmp_path / "c", _plugin(**spec), max_steps=9).fit(
            resumed, train_dataloaders=loader(), ckpt_path=next((tmp_path / "ck").glob("*step=6*.ckpt")))
    assert teacher_runs == []
    a, b = straight.state_dict(), resumed.state_dict()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-6, atol=1e-7), k


def test_a_gated_revert_steps_back_only_within_the_tolerances(tmp_path, teacher_runs):
    """revert_after_budget="gated": the drift the budget ran out on stays over its tolerance, so the blend stays where it
    stopped, the teacher goes on (it measures the drift), and the report says the run never got back."""
    spec = dict(steps=4, tolerance=1e-12, endpoint_fraction=0.0, ramp=1.0, revert_after_budget="gated")
    plugin = LNPlacement("pre", transition=TransitionSpec(**spec), fused=False)
    with pytest.warns(LNLightningWarning, match="as far as the drift and the loss excess stay within their tolerances "
                                                r"allow \(in 1 step where nothing holds it\)"):
        logged_trainer(tmp_path / "a", plugin, 9).fit(LM("demo"), train_dataloaders=loader())
    assert len(teacher_runs) == 9
    assert csv_column(tmp_path / "a" / "logs", "ln_placement/transition")[1:] == [0.25] * 8
    report = json.loads(next((tmp_path / "a" / "logs").rglob(REPORT_FILENAME)).read_text())
    assert report["transition"]["blend"] == 0.25 and "reverted_at_step" not in report["transition"]


def test_revert_after_budget_validates():
    assert TransitionSpec(steps=4).revert_after_budget is None
    with pytest.raises(ValueError, match="revert_after_budget says what a closed loop .* open loop"):
        TransitionSpec(steps=4, tolerance=None, revert_after_budget="ramp")
    with pytest.raises(ValueError, match="revert_after_budget must be one of None, 'ramp', 'gated'"):
        TransitionSpec(steps=4, revert_after_budget=True)
    with pytest.raises(ValueError, match="'gated' steps back only while .* distill_after_budget"):
        TransitionSpec(steps=4, revert_after_budget="gated", distill_after_budget=False)


def test_retreat_lowers_the_blend_to_exactly_0():
    t = Transition(steps=4, kind="closed")
    t.blend.fill_(0.3)
    t.retreat(0.125)
    assert t.blend.item() == pytest.approx(0.175)
    t.retreat(0.5, torch.tensor(False))  # held
    assert t.blend.item() == pytest.approx(0.175)
    t.retreat(0.5, torch.tensor(True))
    assert t.blend.item() == 0.0


# ---------------------------------------------------------------------------------------------- point 4: dropout
class DropoutLM(LM):
    def __init__(self, lr: float = 1e-2):
        super().__init__("demo", lr=lr)
        torch.manual_seed(0)
        self.model = PostNormTransformerLM(vocab_size=64, d_model=32, n_layers=2, n_heads=2, block_size=16, dropout=0.2)


@pytest.mark.parametrize("spec", [dict(steps=4), dict(steps=4, tolerance=None)], ids=["closed", "open"])
def test_distillation_is_zero_at_the_first_step_of_a_model_with_dropout(tmp_path, monkeypatch, spec):
    kls = []
    original = _distill.kl_per_position
    monkeypatch.setattr(_distill, "kl_per_position", lambda s, t: kls.append(original(s, t).mean().item()) or original(s, t))
    trainer(tmp_path, _plugin(**spec), max_steps=2).fit(DropoutLM(), train_dataloaders=loader())
    # Same masks as the student's forward, at blend 0: the teacher computes the same function, bit for bit.
    assert kls[0] == 0.0
    assert kls[1] > 0.0  # (the next step is at another blend: the term is real)


def test_the_teacher_leaves_the_random_state_as_the_student_left_it(tmp_path):
    states = []

    class After(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx):
            states.append(torch.get_rng_state())

    torch.manual_seed(5)
    trainer(tmp_path / "a", _plugin(steps=4, distill=1.0), max_steps=2, callbacks=[After()]).fit(DropoutLM(lr=0.0), train_dataloaders=loader())
    with_teacher = list(states)
    states.clear()
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LNLightningWarning)
        trainer(tmp_path / "b", _plugin(steps=4, tolerance=None, distill=0.0), max_steps=2, callbacks=[After()]).fit(
            DropoutLM(lr=0.0), train_dataloaders=loader())
    assert all(torch.equal(a, b) for a, b in zip(with_teacher, states))  # the teacher drew nothing of the run's own


# ---------------------------------------------------------------------------------------------- point 5: held blend
def test_every_callback_hook_around_a_step_sees_the_held_blend(tmp_path):
    seen: dict[str, list] = {}

    class Everywhere(Callback):
        def _see(self, name, pl_module):
            seen.setdefault(name, []).append(transition.get_blend(pl_module))

        def on_train_batch_start(self, trainer, pl_module, b, i):
            self._see("batch_start", pl_module)

        def on_before_backward(self, trainer, pl_module, loss):
            self._see("before_backward", pl_module)

        def on_after_backward(self, trainer, pl_module):
            self._see("after_backward", pl_module)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._see("before_optimizer_step", pl_module)

    n = 12
    spec = TransitionSpec(steps=n, tolerance=None, endpoint_fraction=0.5)
    trainer(tmp_path, LNPlacement("pre", transition=spec, fused=False, log_report=False), max_steps=6,
            callbacks=[BlendRecorder(), Everywhere()]).fit(LM("demo"), train_dataloaders=loader())
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()
    for name, blends in seen.items():
        assert blends == [f32(i / n) for i in range(6)], name


# ---------------------------------------------------------------------------------------------- host reads
_SYNCING = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__"}
_OURS = ("ln_lightning/plugin.py", "ln_lightning/_transition_run.py", "ln_lightning/_distill.py", "ln_lightning/placement/")


class _Reads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.step = -1
        self.calls: list[tuple[int, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        name = getattr(func, "__name__", str(func))
        path = frame.f_code.co_filename.replace("\\", "/")
        if name in _SYNCING and any(o in path for o in _OURS):
            self.calls.append((self.step, name, f"{Path(path).name}:{frame.f_lineno}"))
        return func(*args, **(kwargs or {}))


class _Spy(Callback):
    def on_train_start(self, trainer, pl_module):
        self.mode = _Reads()
        self.mode.__enter__()

    def on_train_batch_start(self, trainer, pl_module, b, i):
        self.mode.step = trainer.global_step

    def on_train_end(self, trainer, pl_module):
        self.mode.__exit__(None, None, None)


@pytest.mark.parametrize("spec", [dict(steps=20), dict(steps=20, tolerance=None), dict(steps=20, loss_tolerance=0.5),
                                  dict(steps=20, drift_positions="loss"), dict(steps=20, excess_tolerance=0.5),
                                  dict(steps=20, teacher_every=2)],
                         ids=["closed", "open", "loss-gate", "drift-at-the-loss", "loss-excess", "teacher-every-2"])
def test_no_host_read_from_the_plugin_on_transition_steps_that_do_not_log(tmp_path, spec):
    spy = _Spy()
    trainer(tmp_path, _plugin(**spec), max_steps=8, callbacks=[spy], log_every_n_steps=1000).fit(
        LM("demo"), train_dataloaders=loader())
    # Step 0 measures the stream scales: on one process without a read (the host knows what the forward recorded).
    assert spy.mode.calls == [], spy.mode.calls


# ---------------------------------------------------------------------------------------------- point 7 and the report
def _chained_lm():
    """A LightningModule whose post-norm blocks the engine can't convert (two branch terms added one after another)."""
    from torch import nn

    class Chained(nn.Module):
        def __init__(self, d=32):
            super().__init__()
            self.ln, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x):
            return self.ln(x + self.a(x) + self.b(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.blocks, self.head = nn.Embedding(64, 32), nn.ModuleList([Chained(), Chained()]), nn.Linear(32, 64)

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    module = LM("demo")
    module.model = Model()
    return module


@pytest.mark.parametrize("transition_", [None, 4], ids=["placement", "migration"])
def test_a_plugin_that_would_change_nothing_on_a_post_norm_model_stops_the_fit(tmp_path, transition_):
    module = _chained_lm()
    before = copy.deepcopy(module.state_dict())
    with pytest.raises(Exception, match=r"changed nothing: 2 block\(s\).*not pre-norm.*one after another.*register_block"):
        trainer(tmp_path, LNPlacement("pre", transition=transition_, fused=False), max_steps=2).fit(module, train_dataloaders=loader())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # not trained as it is


def test_a_pre_norm_model_needs_no_change_and_says_so(tmp_path, caplog):
    module = LM("demo")
    convert(module.model, "pre")
    module.model = copy.deepcopy(module.model)  # no rewrite state of its own: a model written pre-norm
    from ln_lightning.placement import state as rewrite_state

    rewrite_state.detach(module.model)
    with caplog.at_level("INFO", logger="ln_lightning"):
        trainer(tmp_path, LNPlacement("pre", fused=False), max_steps=1).fit(module, train_dataloaders=loader())
    assert "pre-norm already; it needed no change" in caplog.text


def test_a_continuations_report_describes_the_trained_model_it_continues(tmp_path):
    torch.manual_seed(0)
    trained = LM("demo", lr=3e-2)
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    trainer(tmp_path / "a", None, max_steps=30, callbacks=[ck]).fit(trained, train_dataloaders=loader())
    path = tmp_path / "ck" / "last.ckpt"
    plugin = LNPlacement("pre", transition=TransitionSpec(steps=4, stream_scale=False), resume_unconverted=True, fused=False)
    logs = tmp_path / "b"
    with pytest.warns(LNLightningWarning):  # (the unconverted checkpoint's warning)
        logged_trainer(logs, plugin, 31).fit(LM("demo"), train_dataloaders=loader(), ckpt_path=path)
    payload = json.loads(next((logs / "logs").rglob(REPORT_FILENAME)).read_text())
    # Independently: the trained model, and the same weights converted by convert() (the plain end point).
    reference = LM("demo")
    reference.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    x = reference.example_input_array
    converted = copy.deepcopy(reference.model)
    convert(converted, "pre")
    expected = rel(converted.eval()(x), reference.model.eval()(x))
    fresh = copy.deepcopy(LM("demo").model)
    fresh_before = fresh.eval()(x)
    convert(fresh, "pre")
    assert payload["report"]["output_change"] == pytest.approx(expected, rel=1e-3)
    assert expected > 2 * rel(fresh.eval()(x), fresh_before)  # the fresh model's figure would have been far off
    assert any("checkpoint's trained weights" in n for n in payload["report"]["notes"])
    text = plugin._report_text(plugin.report)
    assert "retrain" not in text and "This is a transition" in text


def test_the_pace_projects_the_budget_from_the_recent_reads_and_names_a_stall():
    from ln_lightning._transition_run import _Pace

    pace = _Pace()  # a budget of 100: the pace is judged over 10 steps at least
    assert pace.update(10, 0.2, 100) == 50  # 0.2 in 10 steps: 40 more
    assert pace.update(20, 0.3, 100) == 90  # slower lately: 0.1 in 10 steps, 0.7 to go
    assert pace.update(30, 0.3, 100) is None and pace.still_since == 20
    assert pace.update(40, 0.3, 100) is None and pace.still_since == 20
    assert pace.update(50, 0.5, 100) == 75 and pace.still_since is None


def test_a_held_step_between_reads_every_step_is_not_a_stall():
    """Read every step (log_every_n_steps=1), an endpoint step holds the blend for one step: not a stall (the
    first version said "has not moved since step 13" here, a false warning)."""
    from ln_lightning._transition_run import _Pace

    pace = _Pace()
    blend = [min(1.0, 0.01 * k) for k in range(1, 15)] + [0.14] + [0.01 * k for k in range(15, 30)]  # step 15 holds
    for done, a in enumerate(blend, start=1):
        assert pace.update(done, a, 100) is not None, done
    assert pace.still_since is None
    for done in range(31, 42):  # held for a tenth of the budget and more: a stall
        need = pace.update(done, 0.29, 100)
    assert need is None and pace.still_since == 30


def test_a_closed_loop_that_reached_blend_1_between_reads_ends_at_the_fits_end_and_says_finished(tmp_path):
    """The blend is read on logging steps and at the budget's end only; a fit that ends between them at blend 1
    ends the transition there (one read at the fit's end), instead of warning that it ended 'during' it."""
    model = LM()
    plugin = _plugin(steps=10, tolerance=100.0, endpoint_fraction=0.0, distill=0.0)  # rate 1/5: blend 1 after 5 steps
    with warnings.catch_warnings():
        warnings.simplefilter("error", LNLightningWarning)  # no "the fit ended during the transition"
        trainer(tmp_path, plugin, max_steps=7, log_every_n_steps=50).fit(model, loader())
    assert transition.get_blend(model) is None  # the machinery is gone: the model is its pre-norm rewrite


# ---------------------------------------------------------------------------------------------- the loss gate
def test_the_loss_tolerance_validates():
    assert TransitionSpec(steps=10, loss_tolerance=1).loss_tolerance == 1.0
    with pytest.raises(ValueError, match="loss_tolerance must be a positive number"):
        TransitionSpec(steps=10, loss_tolerance=0)
    with pytest.raises(ValueError, match="Give a tolerance, or drop loss_tolerance"):
        TransitionSpec(steps=10, tolerance=None, loss_tolerance=0.02)


def test_the_loss_gate_smooths_the_rise_over_the_start_against_a_hand_computation():
    from ln_lightning._transition_run import _LossGate

    gate = _LossGate(0.1, steps=8)  # a start over 8 // 4 = 2 held steps
    losses = [2.0, 2.2, 2.3, 2.5, 2.05, 2.0]
    start, smoothed, expected = (2.0 + 2.2) / 2, None, [None, None]
    for loss in losses[2:]:
        rise = loss - start
        smoothed = rise if smoothed is None else 0.9 * smoothed + 0.1 * rise
        expected.append(smoothed <= 0.1)
    got = [gate.update(torch.tensor(v)) for v in losses]
    assert got[:2] == [None, None]
    assert [bool(g) for g in got[2:]] == expected[2:] and expected[2:] == [False, False, False, False]
    assert gate.read() == pytest.approx(smoothed, rel=1e-6)


class _RisingLoss(LM):
    """lr 0 (the weights stay the trained ones); from step 3 on, training_step's loss is 1 nat higher."""

    def training_step(self, b, batch_idx):
        return super().training_step(b, batch_idx) + (1.0 if self.global_step >= 3 else 0.0)


def test_a_rising_training_loss_holds_the_blend_and_the_run_says_why(tmp_path):
    """The drift's tolerance is one nothing reaches; the loss gate's start is the mean of steps 0-2 (12 // 4 = 3),
    the loss is 1 nat above it from step 3 on: the blend advances on steps 0-2 only (1/6 each), then holds, the
    warning and the report name the loss, and ln_placement/loss_rise shows the rise."""
    module = _RisingLoss("demo", lr=0.0)
    spec = TransitionSpec(steps=12, tolerance=100.0, endpoint_fraction=0.0, loss_tolerance=0.5)
    plugin = LNPlacement("pre", transition=spec, fused=False, log_report=True)
    with pytest.warns(LNLightningWarning) as caught:
        logged_trainer(tmp_path, plugin, 12).fit(module, train_dataloaders=loader())
    t = transition.active(module)
    assert t is not None and t.blend.item() == pytest.approx(3 * spec.rate(), rel=1e-6) and spec.rate() == pytest.approx(1 / 6)
    said = [str(w.message) for w in caught if w.category is LNLightningWarning]
    assert any(re.search(r"spent its budget of 12 steps at blend 0\.5 \(drift tolerance 100, loss tolerance 0\.5, loss excess tolerance "
                         r"0\.02\).*training "
                         r"loss stays 1(\.\d+)? above where the transition started", m) for m in said), said
    rises = csv_column(tmp_path / "logs", "ln_placement/loss_rise")
    assert len(rises) == 9 and all(r == pytest.approx(1.0, abs=0.05) for r in rises)  # steps 3-11
    final = json.loads(next((tmp_path / "logs").rglob(REPORT_FILENAME)).read_text())["transition"]
    assert final["finished"] is False and final["loss_tolerance"] == 0.5 and final["loss_rise"] == pytest.approx(1.0, abs=0.05)


def test_a_loss_that_does_not_rise_leaves_the_closed_loop_as_without_the_gate(tmp_path):
    """lr 0 and the same batches: with a loss tolerance no rise reaches, the blends are those of the drift alone."""
    blends = {}
    for name, extra in (("drift", {}), ("both", dict(loss_tolerance=10.0))):
        module = LM("demo", lr=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LNLightningWarning)
            logged_trainer(tmp_path / name, _plugin(steps=12, tolerance=0.05, **extra), 10).fit(module, train_dataloaders=loader())
        blends[name] = csv_column(tmp_path / name / "logs", "ln_placement/transition")
    assert blends["both"] == blends["drift"] and len(set(blends["drift"])) > 2


def test_a_non_finite_loss_is_left_out_of_the_loss_gate():
    """One NaN or inf loss (a bad batch) must not make the start or the smoothed rise NaN, which would hold the blend
    for good while the warning blamed the drift: the step is left out, and the gate judges the finite ones."""
    from ln_lightning._transition_run import _LossGate

    gate = _LossGate(0.1, steps=8)  # a start over 8 // 4 = 2 held steps
    verdicts = [gate.update(torch.tensor(v)) for v in (2.0, float("nan"), 2.05, float("inf"), 2.5, 3.0)]
    assert verdicts[:2] == [None, None]
    assert gate.total.item() == 2.0 and gate.count.item() == 1.0  # the start is 2.0: the NaN step counted for nothing
    # rises: 0.05 (the first), the inf step left out (0.05 kept), then 0.9 * 0.05 + 0.1 * 0.5, then that x 0.9 + 0.1 x 1
    expected = [0.05, 0.05, 0.9 * 0.05 + 0.1 * 0.5]
    expected.append(0.9 * expected[-1] + 0.1 * 1.0)
    assert [bool(v) for v in verdicts[2:]] == [r <= 0.1 for r in expected] == [True, True, True, False]
    assert gate.read() == pytest.approx(expected[-1], rel=1e-6)


class _RankRisingLoss(LM):
    """lr 0; from step 3 on, rank 1's training_step loss is 1 nat higher (rank 0's unchanged): a rise of 0.5 over ranks."""

    def training_step(self, b, batch_idx):
        bump = 1.0 if self.global_rank == 1 and self.global_step >= 3 else 0.0
        return super().training_step(b, batch_idx) + bump


class _BlendFile(Callback):
    def __init__(self, out: str):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        t = transition.active(pl_module)
        Path(self.out, f"blend_rank{trainer.global_rank}.json").write_text(json.dumps(None if t is None else t.blend.item()))


@pytest.mark.slow
@pytest.mark.parametrize("loss_tolerance, holds", [(0.4, True), (0.6, False)])
def test_the_loss_gate_judges_the_mean_over_ranks_alike_on_every_rank(tmp_path, loss_tolerance, holds):
    """Two processes (ddp_spawn, gloo): the loss rises on rank 1 only, by 1, so the mean over ranks rises by 0.5. At a
    loss tolerance of 0.4 the blend holds after the start's 3 steps (12 // 4), at 0.6 it goes on; either way every
    rank holds the same blend (a rank gating on its own loss would split them)."""
    from lightning.pytorch import Trainer

    spec = TransitionSpec(steps=12, tolerance=100.0, endpoint_fraction=0.0, loss_tolerance=loss_tolerance)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LNLightningWarning)
        Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=8, logger=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False,
                default_root_dir=tmp_path, plugins=[LNPlacement("pre", transition=spec, fused=False, log_report=False)],
                callbacks=[_BlendFile(str(tmp_path))]).fit(_RankRisingLoss("demo", lr=0.0), train_dataloaders=loader())
    blends = [json.loads(Path(tmp_path, f"blend_rank{r}.json").read_text()) for r in range(2)]
    assert blends[0] == blends[1]
    if holds:
        assert blends[0] == pytest.approx(3 * spec.rate(), rel=1e-6)
    else:  # 1/6 a step from step 0: blend 1 by step 6 (the transition then ends at its next read, or stays at 1)
        assert blends[0] is None or blends[0] == 1.0


# ---------------------------------------------------------------------------------------------- drift_positions
def test_drift_positions_validates():
    # The default: the loss's positions in the closed loop (migrate_suite orders 12-13), none to gate in the open loop.
    assert TransitionSpec(steps=10).drift_positions == "loss"
    assert TransitionSpec(steps=10, tolerance=None).drift_positions == "all"
    assert TransitionSpec(steps=10, drift_positions="all").drift_positions == "all"
    assert TransitionSpec(steps=10, drift_positions="loss").drift_positions == "loss"
    with pytest.raises(ValueError, match="drift_positions must be one of 'all', 'loss'"):
        TransitionSpec(steps=10, drift_positions="masked")
    with pytest.raises(ValueError, match="the open loop \\(tolerance=None\\) gates on none"):
        TransitionSpec(steps=10, tolerance=None, drift_positions="loss")


class _FirstPositionLM(LM):
    """The demo LM whose loss counts the first position of each sequence only: through an ignore_index on the full
    output (`sliced=False`), or on an output cut to that position (`sliced=True`, the independent reference)."""

    def __init__(self, sliced: bool):
        super().__init__("demo", lr=0.0)
        self.sliced = sliced

    def forward(self, idx):
        out = self.model(idx)
        return out[:, :1] if self.sliced else out

    def training_step(self, b, batch_idx):
        x, y = b
        logits = self(x)
        target = y[:, :1] if self.sliced else torch.where(torch.arange(y.size(1)) == 0, y, torch.full_like(y, -100))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100)


def _raw_drifts(tmp_path, module, monkeypatch, **spec) -> list[float]:
    """The drift of each optimizer step, before the loop smooths it (Distillation.take_drift's values)."""
    seen = []
    original = _distill.Distillation.take_drift

    def take(self):
        d = original(self)
        seen.append(None if d is None else d.item())
        return d

    monkeypatch.setattr(_distill.Distillation, "take_drift", take)
    # A tolerance no drift reaches: the blend follows the budget's pace whatever the drift reads, lr 0: the weights stay.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LNLightningWarning)
        trainer(tmp_path, _plugin(steps=12, tolerance=100.0, endpoint_fraction=0.0, **spec), max_steps=6).fit(
            module, train_dataloaders=loader())
    monkeypatch.undo()
    return seen


def test_the_drift_at_the_loss_positions_is_the_drift_of_an_output_cut_to_them(tmp_path, monkeypatch):
    """A loss over the first position only: drift_positions="loss" reads the KL there, as an output cut to that
    position reads it over every position; "all" reads the whole output's, another number."""
    torch.manual_seed(0)
    loss_pos = _raw_drifts(tmp_path / "loss", _FirstPositionLM(sliced=False), monkeypatch, drift_positions="loss")
    torch.manual_seed(0)
    cut = _raw_drifts(tmp_path / "cut", _FirstPositionLM(sliced=True), monkeypatch)
    torch.manual_seed(0)
    every = _raw_drifts(tmp_path / "all", _FirstPositionLM(sliced=False), monkeypatch, drift_positions="all")
    assert len(loss_pos) == len(cut) == len(every) == 6 and loss_pos[0] == cut[0] == every[0] == 0.0  # blend 0
    assert loss_pos[1:] == pytest.approx(cut[1:], rel=1e-5) and min(cut[1:]) > 0
    assert all(abs(a - b) > 1e-3 * b for a, b in zip(every[1:], cut[1:]))


def test_where_the_loss_counts_every_position_the_two_drifts_are_the_same_bit_for_bit(tmp_path, monkeypatch):
    torch.manual_seed(0)
    at_loss = _raw_drifts(tmp_path / "loss", LM("demo", lr=0.0), monkeypatch, drift_positions="loss")
    torch.manual_seed(0)
    every = _raw_drifts(tmp_path / "all", LM("demo", lr=0.0), monkeypatch, drift_positions="all")
    assert at_loss == every and max(every) > 0
