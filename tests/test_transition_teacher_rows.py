"""TransitionSpec(teacher_rows=...): the transition's teacher on the first rows of each batch (issue 31, order 26).

The rows are used only where they compute alone what they compute in the batch: checked on the first measured step
(the teacher both ways), read on a logging step; a forward that draws random numbers (dropout) keeps every row."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch.callbacks import ModelCheckpoint

from _helpers_transition import LM, batch, csv_by_step, loader, logged_trainer, trainer
from ln_lightning import LNLightningWarning, TransitionSpec
from ln_lightning import _distill
from ln_lightning.demo import PostNormTransformerLM
from ln_lightning.plugin import REPORT_FILENAME, LNPlacement

from test_transition_closed_loop import _Spy


def _plugin(log_report: bool = False, **spec) -> LNPlacement:
    return LNPlacement("pre", transition=TransitionSpec(**spec), fused=False, log_report=log_report)


@pytest.fixture
def teacher_rows_seen(monkeypatch) -> list:
    """The number of rows of every teacher forward, in order."""
    seen = []
    original = _distill.trained_output
    monkeypatch.setattr(_distill, "trained_output", lambda t, *a, **k: seen.append(a[0].shape[0]) or original(t, *a, **k))
    return seen


def _report(tmp_path) -> dict:
    return json.loads(next(tmp_path.rglob(REPORT_FILENAME)).read_text())


class DropoutLM(LM):
    def __init__(self):
        super().__init__("demo")
        torch.manual_seed(0)
        self.model = PostNormTransformerLM(vocab_size=64, d_model=32, n_layers=2, n_heads=2, block_size=16, dropout=0.2)


class BatchMixingLM(LM):
    """Each row's output depends on the others (the batch's mean of the logits): the rows alone compute other outputs."""

    def forward(self, idx):
        out = self.model(idx)
        return out + out.mean(0, keepdim=True)


def test_spec_takes_a_share_in_0_1():
    assert TransitionSpec(steps=4).rows_share == 1.0 and TransitionSpec(steps=4).teacher_rows is None
    assert TransitionSpec(steps=4, teacher_rows=1).teacher_rows == 1.0
    for bad in (0, 0.0, 1.5, -0.5, True, "half", math.nan):
        with pytest.raises(ValueError, match="teacher_rows"):
            TransitionSpec(steps=4, teacher_rows=bad)
    with pytest.raises(ValueError, match="runs no teacher"):
        TransitionSpec(steps=4, tolerance=None, distill=0.0, teacher_rows=0.5)


def test_the_teacher_runs_on_the_rows_after_one_step_that_compares_them_with_the_batch(tmp_path, teacher_rows_seen, caplog):
    with caplog.at_level("INFO"):
        logged_trainer(tmp_path, _plugin(log_report=True, steps=40, teacher_rows=0.5), 4).fit(
            LM("demo"), train_dataloaders=loader())
    # Step 0: the batch (its 4 rows), then the first 2 alone and the batch with its other rows swapped, to compare;
    # from step 1 (read at step 0's end) 2 rows.
    assert teacher_rows_seen == [4, 2, 4, 2, 2, 2]
    assert "teacher runs on the first 0.5 of each batch's rows from step 1 on" in caplog.text
    assert _report(tmp_path)["transition"]["teacher_rows"] == {"asked": 0.5, "ran_on": "rows", "reason": None}
    # ceil(share x rows): a third of 4 rows is 2
    seen = []
    original = _distill.trained_output
    _distill.trained_output = lambda t, *a, **k: seen.append(a[0].shape[0]) or original(t, *a, **k)
    try:
        logged_trainer(tmp_path / "third", _plugin(steps=40, teacher_rows=1 / 3), 3).fit(LM("demo"), train_dataloaders=loader())
    finally:
        _distill.trained_output = original
    assert seen == [4, 2, 4, 2, 2]


def _repeated_rows_loader() -> DataLoader:
    x = batch(1)[:1].repeat(4, 1)  # one row four times: the first 2 rows' means are the batch's
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=4)


def test_on_a_batch_of_equal_rows_the_rows_measure_and_train_what_the_batch_does(tmp_path, teacher_rows_seen):
    # The distillation term and the drift are means over the rows' positions, the loss excess a sum scaled up to the
    # batch: over rows that equal the others every one of them is the batch's, so the fit is the same fit.
    names = ("ln_placement/drift", "ln_placement/loss_excess", "ln_placement/distill_kl")
    logs, losses = {}, {}
    for rows in (None, 0.5):
        model = LM("demo")
        spec = dict(steps=12, tolerance=0.05) if rows is None else dict(steps=12, tolerance=0.05, teacher_rows=rows)
        logged_trainer(tmp_path / str(rows), _plugin(**spec), 6).fit(model, train_dataloaders=_repeated_rows_loader())
        logs[rows] = {n: csv_by_step(tmp_path / str(rows) / "logs", n) for n in names}
        losses[rows] = model.losses
    assert teacher_rows_seen == [4] * 6 + [4, 2, 4] + [2] * 5  # the default's 6, then the rows' run
    for n in names:
        full, half = logs[None][n], logs[0.5][n]
        assert full.keys() == half.keys() and len(full) >= 5, n
        for step in full:
            assert half[step] == pytest.approx(full[step], rel=1e-4, abs=1e-7), (n, step)
    assert any(abs(v) > 1e-2 for v in logs[None]["ln_placement/loss_excess"].values())  # (not a comparison of zeros)
    # the same training, seen in its losses (Adam turns the key biases' gradients, 0 but for rounding, into updates
    # that differ, so the weights are not compared)
    assert losses[0.5] == pytest.approx(losses[None], rel=1e-5)


def test_a_model_with_dropout_keeps_every_row_says_so_and_is_the_defaults_fit_bit_for_bit(tmp_path, teacher_rows_seen):
    weights = {}
    for rows in (None, 0.5):
        model = DropoutLM()
        spec = dict(steps=8) if rows is None else dict(steps=8, teacher_rows=rows)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(5)
            logged_trainer(tmp_path / str(rows), _plugin(log_report=True, **spec), 3).fit(model, train_dataloaders=loader())
        weights[rows] = model.state_dict()
        said = [str(w.message) for w in caught if issubclass(w.category, LNLightningWarning) and "teacher_rows" in str(w.message)]
        if rows is None:
            assert said == []
        else:
            assert len(said) == 1 and "draws random numbers" in said[0] and "teacher_rows=None" in said[0], said
    assert teacher_rows_seen == [4] * 6  # every row, and no comparison forward: the default's compute
    for k, v in weights[None].items():
        assert torch.equal(weights[0.5][k], v), k
    entry = _report(tmp_path / "0.5")["transition"]["teacher_rows"]
    assert entry["ran_on"] == "every row" and "draws random numbers" in entry["reason"]


def test_rows_that_see_one_another_keep_every_row_and_say_so(tmp_path, teacher_rows_seen):
    with pytest.warns(LNLightningWarning, match=r"teacher_rows=0.5 can't hold on this model: the teacher's outputs on "
                                                r"the first rows alone were not its outputs for those rows in the batch"):
        logged_trainer(tmp_path, _plugin(steps=40, teacher_rows=0.5), 3).fit(BatchMixingLM("demo"), train_dataloaders=loader())
    assert teacher_rows_seen == [4, 2, 4, 4, 4]  # compared once, then the batch


def test_a_comparison_not_yet_read_keeps_the_batch(tmp_path, teacher_rows_seen):
    # Read on a logging step only (no host read on the others): before the first one, the teacher runs on the batch.
    trainer(tmp_path, _plugin(steps=40, teacher_rows=0.5), max_steps=5, log_every_n_steps=4).fit(
        LM("demo"), train_dataloaders=loader())
    assert teacher_rows_seen == [4, 2, 4, 4, 4, 4, 2]  # read at the end of step 3 (global_step 4)


def test_the_rows_comparison_reads_the_host_on_a_logging_step_only(tmp_path):
    spy = _Spy()
    trainer(tmp_path, _plugin(steps=20, teacher_rows=0.5), max_steps=8, callbacks=[spy], log_every_n_steps=4).fit(
        LM("demo"), train_dataloaders=loader())
    ours = [c for c in spy.mode.calls if "_distill.py" in c[2]]
    assert [c[0] for c in ours] == [3], spy.mode.calls  # the one read: at the end of step 3, which logs
    assert all((step + 1) % 4 == 0 for step, _, _ in spy.mode.calls), spy.mode.calls


def test_a_resumed_fit_keeps_the_rows_as_settled_and_gives_the_uninterrupted_weights(tmp_path, teacher_rows_seen):
    spec = dict(steps=12, tolerance=0.5, teacher_rows=0.5)
    straight = LM("demo")
    trainer(tmp_path / "a", _plugin(**spec), max_steps=6, log_every_n_steps=1).fit(straight, train_dataloaders=loader())
    assert teacher_rows_seen == [4, 2, 4] + [2] * 5
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp_path / "b", _plugin(**spec), max_steps=3, log_every_n_steps=1, callbacks=[ckpt]).fit(
        LM("demo"), train_dataloaders=loader())
    path = next((tmp_path / "ck").glob("*step=3*.ckpt"))
    assert torch.load(path, weights_only=True)["ln_lightning_transition_run"]["teacher_rows"]["state"] == "rows"
    del teacher_rows_seen[:]
    resumed = LM("demo")
    trainer(tmp_path / "c", _plugin(**spec), max_steps=6, log_every_n_steps=1).fit(
        resumed, train_dataloaders=loader(), ckpt_path=str(path))
    assert teacher_rows_seen == [2, 2, 2]  # the rows as settled: no second comparison
    for k, v in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


class BatchNormLM(LM):
    """A batch norm (train mode) over the embeddings' channels: each row's output depends on the batch's statistics."""

    def __init__(self):
        super().__init__("demo")
        self.bn = torch.nn.BatchNorm1d(64)

    def forward(self, idx):
        out = self.model(idx)
        return self.bn(out.transpose(1, 2)).transpose(1, 2)


class MaskedMixingLM(BatchMixingLM):
    """BatchMixingLM with one class masked at the dtype's lowest value (a padding token's logit)."""

    def forward(self, idx):
        out = super().forward(idx)
        return torch.cat([torch.full_like(out[..., :1], torch.finfo(out.dtype).min), out[..., 1:]], -1)


class MaskedLM(LM):
    """Rows that see nothing of one another, one class masked at -inf."""

    def forward(self, idx):
        out = self.model(idx)
        return torch.cat([torch.full_like(out[..., :1], -math.inf), out[..., 1:]], -1)


@pytest.mark.parametrize("model, precision", [(BatchMixingLM, "bf16-mixed"), (BatchNormLM, "bf16-mixed"),
                                              (BatchNormLM, "32-true"), (MaskedMixingLM, "32-true")],
                         ids=["mixing-bf16", "batchnorm-bf16", "batchnorm", "mixing-masked-logit"])
def test_rows_that_see_one_another_are_found_in_any_precision_and_with_a_masked_class(tmp_path, teacher_rows_seen,
                                                                                       model, precision):
    # (the comparison once scaled its tolerance by the dtype's epsilon and the largest logit: bf16 let a quarter of
    # the largest logit pass, and one masked logit let anything pass)
    with pytest.warns(LNLightningWarning, match="were not its outputs for those rows in the batch"):
        logged_trainer(tmp_path, _plugin(steps=40, teacher_rows=0.5), 3, precision=precision).fit(
            model("demo") if model is not BatchNormLM else model(), train_dataloaders=loader())
    assert teacher_rows_seen == [4, 2, 4, 4, 4]


def test_rows_that_see_nothing_of_one_another_pass_with_a_class_masked_at_minus_inf(tmp_path, teacher_rows_seen):
    logged_trainer(tmp_path, _plugin(steps=40, teacher_rows=0.5), 3).fit(MaskedLM("demo"), train_dataloaders=loader())
    assert teacher_rows_seen == [4, 2, 4, 2, 2]


def test_inputs_cut_wrongly_fall_back_to_every_row_instead_of_failing_the_fit(tmp_path, teacher_rows_seen):
    class Shared(LM):
        def forward(self, idx, shared=None):
            # an (n, n) table every row uses whole (as an attention bias over a sequence as long as the batch is wide)
            assert shared is None or shared.shape == (4, 4), shared.shape
            return self.model(idx)

        def training_step(self, b, batch_idx):
            x, y = b
            logits = self(x, torch.zeros(4, 4))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    with pytest.warns(LNLightningWarning, match=r"teacher's forward on the first rows raised AssertionError"):
        logged_trainer(tmp_path, _plugin(steps=40, teacher_rows=0.5), 3).fit(Shared("demo"), train_dataloaders=loader())
    assert teacher_rows_seen == [4, 2, 4, 4]  # the rows' forward failed (not counted): every row from then on


def test_the_budget_end_warning_names_teacher_rows_once(tmp_path):
    with pytest.warns(LNLightningWarning) as caught:
        logged_trainer(tmp_path, _plugin(steps=4, tolerance=1e-12, teacher_rows=0.5), 6).fit(
            LM("demo"), train_dataloaders=loader())
    said = [str(w.message) for w in caught if "TransitionSpec(steps=" in str(w.message)]
    assert said and all(m.count("teacher_rows=0.5") == 1 for m in said), said
