"""TransitionSpec.excess_tolerance: the closed loop also gated on the training loss's excess over the trained
function's on the same batch (migrate_suite order 14).

The excess is computed from the loss's gradient with respect to the output (teacher.loss_excess); the references here
compute the two losses themselves: cross_entropy of both outputs in float64, and, in a fit, the model's loss at the
blend it held against the model pinned at blend 0 (lr 0: the weights stay the trained ones)."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
from _helpers_transition import LM, csv_column, loader, logged_trainer, trainer
from torch.nn import functional as F

from ln_lightning import LNLightningWarning, TransitionSpec, _distill
from ln_lightning.placement.migrate import transition
from ln_lightning.placement.migrate.teacher import kl_per_position, loss_excess
from ln_lightning.placement.spec import EXCESS_TOLERANCE
from ln_lightning.plugin import REPORT_FILENAME, LNPlacement


def test_the_excess_tolerance_validates_and_defaults_to_0_02_in_the_closed_loop():
    assert TransitionSpec(steps=10, excess_tolerance=1).excess_tolerance == 1.0
    assert TransitionSpec(steps=10).excess_tolerance == EXCESS_TOLERANCE == 0.02  # migrate_suite order 14
    assert TransitionSpec(steps=10, tolerance=None).excess_tolerance is None  # the open loop gates on nothing
    assert TransitionSpec(steps=10, excess_tolerance=math.inf).excess_tolerance == math.inf  # measured, never holding
    for bad in (0, -0.1, float("nan"), True, "0.02"):
        with pytest.raises(ValueError, match="excess_tolerance must be a positive number"):
            TransitionSpec(steps=10, excess_tolerance=bad)
    with pytest.raises(ValueError, match="Give a tolerance, or drop excess_tolerance"):
        TransitionSpec(steps=10, tolerance=None, excess_tolerance=0.02)


def _case(seed: int, masked: bool):
    g = torch.Generator().manual_seed(seed)
    B, T, C = 3, 7, 11
    student = (torch.randn(B, T, C, generator=g, dtype=torch.float64) * 3).requires_grad_()
    teacher = student.detach() + torch.randn(B, T, C, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, C, (B, T), generator=g)
    if masked:  # a masked LM's labels: most positions ignored
        y = torch.where(torch.rand(B, T, generator=g) < 0.7, torch.full_like(y, -100), y)
    return student, teacher, y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("masked", [False, True], ids=["every-position", "ignore-index"])
@pytest.mark.parametrize("seed", range(4))
def test_the_excess_of_a_cross_entropy_is_the_difference_of_the_two_losses(seed, masked, reduction):
    student, teacher, y = _case(seed, masked)

    def loss(z):
        return F.cross_entropy(z.reshape(-1, z.size(-1)), y.reshape(-1), ignore_index=-100, reduction=reduction)

    (grad,) = torch.autograd.grad(loss(student), student)
    expected = (loss(student) - loss(teacher)).item()
    got = loss_excess(grad.float(), student.float(), teacher.float()).item()
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("kind", ["label_smoothing", "squared_error"])
def test_any_other_convex_loss_gets_the_first_order_bound_which_is_never_below_the_difference(kind):
    for seed in range(4):
        student, teacher, y = _case(seed, masked=False)
        if kind == "label_smoothing":
            def loss(z):
                return F.cross_entropy(z.reshape(-1, z.size(-1)), y.reshape(-1), label_smoothing=0.1)
        else:
            target = torch.randn_like(student)

            def loss(z):
                return F.mse_loss(z, target)

        (grad,) = torch.autograd.grad(loss(student), student)
        got = loss_excess(grad.float(), student.float(), teacher.float()).item()
        first_order = (grad * (student - teacher)).sum().item()
        assert got == pytest.approx(first_order, rel=1e-4)
        assert got >= (loss(student) - loss(teacher)).item() - 1e-6


def _ce_case(seed: int, scale: float = 3.0):
    student, teacher, y = _case(seed, masked=True)
    student = (student.detach() * scale / 3.0).requires_grad_()

    def loss(z):
        return F.cross_entropy(z.reshape(-1, z.size(-1)), y.reshape(-1), ignore_index=-100)

    (grad,) = torch.autograd.grad(loss(student), student)
    return student.detach(), teacher, grad, (loss(student) - loss(teacher)).item()


def test_the_rows_are_taken_in_chunks_with_the_same_result(monkeypatch):
    from ln_lightning.placement.migrate import teacher as teacher_module

    student, teacher, grad, expected = _ce_case(1)
    whole = loss_excess(grad.float(), student.float(), teacher.float()).item()
    monkeypatch.setattr(teacher_module, "_EXCESS_CHUNK", 2 * student.size(-1))  # two rows a chunk
    chunked = loss_excess(grad.float(), student.float(), teacher.float()).item()
    assert chunked == pytest.approx(whole, rel=1e-5) and whole == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_a_confident_model_and_a_bfloat16_gradient_are_still_read_as_a_cross_entropy():
    # Logits 10x the size: q of the label within 1e-12 of 1 on most rows (1 - q in float32 would be 0).
    student, teacher, grad, expected = _ce_case(2, scale=30.0)
    assert loss_excess(grad.float(), student.float(), teacher.float()).item() == pytest.approx(expected, rel=1e-3, abs=1e-6)
    # Mixed precision: the gradient rounded to bfloat16 (and the logits with it) keeps the exact form, not the bound.
    student, teacher, grad, expected = _ce_case(3)
    got = loss_excess(grad.bfloat16(), student.bfloat16(), teacher.bfloat16()).item()
    bound = (grad * (student - teacher)).sum().item()
    assert abs(got - expected) < 0.05 * abs(bound - expected), (got, expected, bound)


def test_no_loss_gradient_is_no_excess():
    student, teacher, _ = _case(0, masked=False)
    assert loss_excess(None, student.float(), teacher.float()).item() == 0.0


def _trained_lm() -> LM:
    """The demo LM fitted to the tests' one batch (no plugin), then set to lr 0: a trained function the blend can
    only make worse on that batch, and weights that stay where they are."""
    torch.manual_seed(0)
    module = LM("demo", lr=1e-2)
    trainer(None, max_steps=40).fit(module, train_dataloaders=loader())
    module.hparams.lr = 0.0
    return module


def _raw(monkeypatch, method: str) -> list:
    seen = []
    original = getattr(_distill.Distillation, method)

    def take(self):
        value = original(self)
        seen.append(None if value is None else value.item())
        return value

    monkeypatch.setattr(_distill.Distillation, method, take)
    return seen


def test_in_a_fit_the_excess_is_the_models_loss_at_its_blend_minus_the_trained_functions(tmp_path, monkeypatch):
    """lr 0: every step's excess is loss(model at the blend it held) - loss(model at blend 0) on the step's batch,
    computed here by two plain forwards after the fit."""
    module = _trained_lm()
    excesses = _raw(monkeypatch, "take_excess")
    blends = []
    monkeypatch.setattr(_distill.Distillation, "take_drift",
                        lambda self, _o=_distill.Distillation.take_drift: blends.append(float(transition.get_blend(module))) or _o(self))
    spec = TransitionSpec(steps=24, tolerance=100.0, endpoint_fraction=0.0, excess_tolerance=100.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LNLightningWarning)
        trainer(tmp_path, LNPlacement("pre", transition=spec, fused=False, log_report=False), max_steps=6).fit(
            module, train_dataloaders=loader())
    monkeypatch.undo()
    x, y = next(iter(loader()))
    assert len(excesses) == len(blends) == 6 and excesses[0] == pytest.approx(0.0, abs=1e-6)

    def loss_at(a):
        transition.set_blend(module, a)
        with torch.no_grad():
            out = module(x)
        return F.cross_entropy(out.reshape(-1, out.size(-1)).double(), y.reshape(-1)).item()

    module.train()
    expected = [loss_at(a) - loss_at(0.0) for a in blends]
    assert max(abs(e) for e in expected[1:]) > 1e-4  # the blend moved the loss
    assert excesses == pytest.approx(expected, rel=1e-3, abs=1e-5)


def _logged(tmp_path, spec, steps, module):
    logged_trainer(tmp_path, LNPlacement("pre", transition=spec, fused=False, log_report=True), steps).fit(
        module, train_dataloaders=loader())


def test_an_excess_over_the_tolerance_holds_the_blend_and_the_run_says_why(tmp_path):
    """A drift tolerance nothing reaches; an excess tolerance of 1e-4 (lr 0: nothing trains the excess back): the
    blend stops short of 1, the warning and the report name the loss excess, TensorBoard's scalar shows it."""
    module = _trained_lm()
    spec = TransitionSpec(steps=12, tolerance=100.0, endpoint_fraction=0.0, excess_tolerance=1e-4)
    with pytest.warns(LNLightningWarning) as caught:
        _logged(tmp_path, spec, 12, module)
    a = transition.get_blend(module)
    assert 0.0 < a < 1.0, a
    said = [str(w.message) for w in caught if w.category is LNLightningWarning]
    assert any(re.search(r"spent its budget of 12 steps at blend .*loss excess tolerance 0\.0001\).*stays .* above the "
                         r"trained function's on the same batches", m) for m in said), said
    # the blend stopped moving, held by the excess: the fix offered doubles that tolerance (not the budget)
    assert any("TransitionSpec(steps=12, tolerance=100, excess_tolerance=0.0002)" in m for m in said), said
    logged = csv_column(tmp_path / "logs", "ln_placement/loss_excess")
    assert len(logged) == 12 and logged[0] == pytest.approx(0.0, abs=1e-6) and logged[-1] > 1e-4
    final = json.loads(next((tmp_path / "logs").rglob(REPORT_FILENAME)).read_text())["transition"]
    assert final["finished"] is False and final["excess_tolerance"] == 1e-4 and final["loss_excess"] > 1e-4


def test_after_a_spent_budget_the_distilling_fit_goes_on_measuring_the_excess_and_says_what_it_ends_at(tmp_path, monkeypatch):
    """A budget of 6 steps in a fit of 12, an excess tolerance of 1e-4 the held blend stays over (lr 0: nothing trains
    it back), distilling after the budget (the closed loop's default): ln_placement/loss_excess and ln_placement/drift
    go on at every step after the budget (before, their lines stopped there), each raw excess is loss(model at the held
    blend) - loss(model at blend 0) computed here by plain forwards, and the fit's end says, in a warning and the report,
    the excess it ends at, which is over the tolerance."""
    module = _trained_lm()
    excesses = _raw(monkeypatch, "take_excess")
    spec = TransitionSpec(steps=6, tolerance=100.0, endpoint_fraction=0.0, excess_tolerance=1e-4)
    assert spec.distill_after_budget is True
    with pytest.warns(LNLightningWarning) as caught:
        _logged(tmp_path, spec, 12, module)
    monkeypatch.undo()
    held = transition.get_blend(module)
    assert 0.0 < held < 1.0
    logged = csv_column(tmp_path / "logs", "ln_placement/loss_excess")
    assert len(logged) == 12 and len(csv_column(tmp_path / "logs", "ln_placement/drift")) == 12
    x, y = next(iter(loader()))

    def loss_at(a):
        transition.set_blend(module, a)
        with torch.no_grad():
            out = module(x)
        return F.cross_entropy(out.reshape(-1, out.size(-1)).double(), y.reshape(-1)).item()

    module.train()
    at_held = loss_at(held) - loss_at(0.0)
    transition.set_blend(module, held)
    assert at_held > 1e-4 and excesses[6:] == pytest.approx([at_held] * 6, rel=1e-3, abs=1e-5)
    said = [str(w.message) for w in caught if w.category is LNLightningWarning]
    assert any(re.search(r"the fit ends with the transition to pre-norm held at blend .*training loss .* above the trained "
                         r"function's .*over the loss excess tolerance \(0\.0001\)", m) for m in said), said
    final = json.loads(next((tmp_path / "logs").rglob(REPORT_FILENAME)).read_text())["transition"]
    assert final["distill_after_budget"] is True
    assert final["loss_excess_at_end"] == pytest.approx(logged[-1], rel=1e-5) and final["loss_excess_at_end"] > 1e-4


@pytest.mark.parametrize("after_budget", [True, False], ids=["distilling", "paused"])
def test_a_held_blend_within_the_excess_tolerance_ends_without_a_warning_and_a_paused_one_measures_nothing(
        tmp_path, after_budget):
    """The drift holds the blend (tolerance 1e-12), the excess tolerance is loose: distilling after the budget, the fit
    ends with the excess in the report and no warning about it; paused (distill_after_budget=False), nothing measures
    it after the budget, so its line stops there and the report has no end figure."""
    module = _trained_lm()
    spec = TransitionSpec(steps=6, tolerance=1e-12, endpoint_fraction=0.0, excess_tolerance=100.0,
                          distill_after_budget=after_budget)
    with pytest.warns(LNLightningWarning) as caught:
        _logged(tmp_path, spec, 10, module)
    said = [str(w.message) for w in caught if w.category is LNLightningWarning]
    assert any("spent its budget of 6 steps" in m for m in said), said
    assert not any("the fit ends with the transition" in m for m in said), said
    final = json.loads(next((tmp_path / "logs").rglob(REPORT_FILENAME)).read_text())["transition"]
    logged = csv_column(tmp_path / "logs", "ln_placement/loss_excess")
    if after_budget:
        assert len(logged) == 10 and final["loss_excess_at_end"] == pytest.approx(logged[-1], rel=1e-5)
    else:
        assert len(logged) == 6 and "loss_excess_at_end" not in final


class _ShiftedLoss(LM):
    """From step 3 on, training_step's loss is 1 nat higher: a loss that rises for a reason the blend has no part in."""

    def training_step(self, b, batch_idx):
        return super().training_step(b, batch_idx) + (1.0 if self.global_step >= 3 else 0.0)


def test_a_loss_that_rises_for_another_reason_is_no_excess(tmp_path):
    """The excess is paired (the same batch through both functions): a constant added to the loss moves neither its
    gradient nor the excess, so the blends are those of the drift alone (the loss gate, loss_tolerance, holds there)."""
    blends = {}
    for name, extra in (("drift", {}), ("excess", {"excess_tolerance": 10.0})):
        torch.manual_seed(0)
        module = _ShiftedLoss("demo", lr=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LNLightningWarning)
            _logged(tmp_path / name, TransitionSpec(steps=12, tolerance=0.05, **extra), 10, module)
        blends[name] = csv_column(tmp_path / name / "logs", "ln_placement/transition")
    assert blends["excess"] == blends["drift"] and len(set(blends["drift"])) > 2


def test_a_resumed_fit_smooths_the_excess_from_where_the_uninterrupted_one_was(tmp_path, monkeypatch):
    """The smoothed excess travels in the checkpoint (checkpoint["ln_lightning_transition_run"]): a fit resumed at step
    4 logs the same ln_placement/loss_excess at every later step as the uninterrupted fit (so its gate decides alike),
    and ends with the same weights. Without it (`restore` a no-op) the resumed fit starts its smoothing again and the
    logged excess parts at the first resumed step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ln_lightning._transition_run import CHECKPOINT_KEY, TransitionRun

    spec = TransitionSpec(steps=40, tolerance=100.0, endpoint_fraction=0.0, excess_tolerance=1.0)

    def fit(root, steps, ckpt_path=None, callbacks=()):
        module = _trained_lm()
        module.hparams.lr = 1e-3  # the weights train: the excess moves from step to step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LNLightningWarning)
            logged_trainer(root, LNPlacement("pre", transition=spec, fused=False, log_report=False), steps,
                           callbacks=list(callbacks), enable_checkpointing=bool(callbacks)).fit(
                module, train_dataloaders=loader(), ckpt_path=ckpt_path)
        return module, csv_column(root / "logs", "ln_placement/loss_excess")

    straight, logged = fit(tmp_path / "a", 10)
    assert len(logged) == 10 and len(set(logged)) == 10
    fit(tmp_path / "b", 4, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=-1)])
    path = next((tmp_path / "ck").glob("*step=4*.ckpt"))
    assert torch.load(path, weights_only=False)[CHECKPOINT_KEY]["excess"].item() == pytest.approx(logged[3], rel=1e-5)
    resumed, resumed_logged = fit(tmp_path / "c", 10, ckpt_path=path)
    assert resumed_logged == pytest.approx(logged[4:], rel=1e-5, abs=1e-9)
    for k, v in straight.state_dict().items():
        assert torch.allclose(v.float(), resumed.state_dict()[k].float(), rtol=1e-6, atol=1e-7), k

    monkeypatch.setattr(TransitionRun, "restore", lambda self, entry: None)
    _, afresh = fit(tmp_path / "d", 10, ckpt_path=path)
    assert afresh[0] != pytest.approx(logged[4], rel=1e-3)  # the check above can fail


def test_a_class_both_mask_at_minus_inf_adds_nothing_to_the_kl_or_the_excess():
    # (a logit masked at -inf in both outputs made the distillation term and the excess NaN: -inf - -inf)
    student, teacher, y = _case(0, False)
    y = torch.where(y == 0, torch.ones_like(y), y)  # no label on the masked class
    masked_s = torch.cat([torch.full_like(student[..., :1], -math.inf), student[..., 1:]], -1)
    masked_t = torch.cat([torch.full_like(teacher[..., :1], -math.inf), teacher[..., 1:]], -1)

    def loss(z):
        return F.cross_entropy(z.reshape(-1, z.size(-1)), y.reshape(-1))

    # references without the masked class, in float64 (the masked class has no probability in either)
    p = F.log_softmax(teacher[..., 1:], -1)
    expected_kl = (p.exp() * (p - F.log_softmax(student[..., 1:], -1))).sum(-1).reshape(-1)
    kl = kl_per_position(masked_s.float(), masked_t.float())
    torch.testing.assert_close(kl, expected_kl.float(), rtol=1e-4, atol=1e-6)
    (g,) = torch.autograd.grad(kl.sum(), masked_s)
    assert torch.isfinite(g).all() and (g[..., 0] == 0).all()

    (grad,) = torch.autograd.grad(loss(masked_s), masked_s)
    got = loss_excess(grad.float(), masked_s.float(), masked_t.float()).item()
    expected = (F.cross_entropy(student[..., 1:].reshape(-1, 10), y.reshape(-1) - 1)
                - F.cross_entropy(teacher[..., 1:].reshape(-1, 10), y.reshape(-1) - 1)).item()
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)
