"""The monitors under every training loop: they log at the steps, and under the step numbers, of Lightning's own
logging (`self.log`, as `ref/loss`, and `LearningRateMonitor`, as `lr-SGD`, in the same run), and their values
equal the independent references of `ln_lightning.testing.monitors`.

Loops: automatic and manual optimisation (one and two optimizers), gradient accumulation with
`limit_train_batches` (an epoch ending mid-accumulation), validation inside a logging step with two validation
dataloaders, two training dataloaders, validate-, test- and predict-only runs, a fit resumed twice, and
`trainer.should_stop` with `min_steps`.
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from torch.utils.data import DataLoader

from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor, _reduce
from ln_lightning.testing.monitors import (
    BLOCKS,
    GROUPS,
    MONITOR_PREFIXES,
    FixedBatchLM,
    ManualLM,
    all_monitors,
    compare,
    concat_batches,
    make_data,
    make_model,
    make_trainer,
    read_scalars,
    reference_forward_stats,
    reference_grad_stats,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _trainer(tmp_path, name, monitors=None, callbacks=(), **kw):
    """A Trainer logging to TensorBoard with LearningRateMonitor, the monitors (by default all three, at
    Lightning's own interval) and `callbacks`."""
    monitors = all_monitors(every=None, log_depth_profile=False) if monitors is None else monitors
    return make_trainer(str(tmp_path), name, accelerator="cpu", devices=1,
                        callbacks=[LearningRateMonitor(logging_interval="step"), *monitors, *callbacks], num_sanity_val_steps=0, **kw)


def _run(tmp_path, name, module, monitors=None, ckpt_path=None, **kw):
    trainer = _trainer(tmp_path, name, monitors, **kw)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, read_scalars(tmp_path / name)


def _steps(logged, tag) -> list[int]:
    return sorted(s for s, _ in logged.get(tag, []))


def _lightning_steps(logged) -> list[int]:
    """The steps `self.log` logged at; `LearningRateMonitor` (every optimizer) must agree. (Under gradient
    accumulation it logs once per micro-batch of a logging step, all under the step's number.)"""
    steps = _steps(logged, "ref/loss")
    for tag in (t for t in logged if t.startswith("lr-")):
        assert sorted(set(_steps(logged, tag))) == steps, (tag, _steps(logged, tag), steps)
    return steps


def _at(logged, tag, steps) -> dict[int, float]:
    """`tag`'s values at `steps`."""
    return {s: v for s, v in logged[tag] if s in steps}


def _assert_every_monitor_tag_at(logged, steps: list[int], families=("stream/", "ln/", "clip/")) -> None:
    tags = {t for t in logged if t.startswith(MONITOR_PREFIXES)}
    for family in families:
        assert any(t.startswith(family) for t in tags), f"no {family} metric logged"
    wrong = {t: _steps(logged, t) for t in tags if _steps(logged, t) != steps}
    assert wrong == {}, f"monitor metrics logged at other steps than Lightning's {steps}"


def _forward_and_grad_reference(x, y):
    model = make_model()
    expected = reference_forward_stats(model, x)
    expected.update(reference_grad_stats(model, x, y))
    return expected


# ---------------------------------------------------------------------------------------------
# Optimisation styles
# ---------------------------------------------------------------------------------------------
def test_automatic_optimisation_logs_at_lightnings_steps(tmp_path):
    x, y = make_data(world=1, accum=1)
    _, logged = _run(tmp_path, "auto", FixedBatchLM(x, y), max_steps=6)
    assert _lightning_steps(logged) == [1, 3, 5]
    _assert_every_monitor_tag_at(logged, [1, 3, 5])
    assert compare(logged, _forward_and_grad_reference(concat_batches(x), concat_batches(y)), steps=[1, 3, 5]) == []


def test_manual_optimisation_one_optimizer(tmp_path):
    x, y = make_data(world=1, accum=1)
    _, logged = _run(tmp_path, "manual1", ManualLM(x, y, n_optimizers=1, n_batches=4), max_epochs=1)
    assert _lightning_steps(logged) == [1, 3]
    _assert_every_monitor_tag_at(logged, [1, 3])
    assert compare(logged, _forward_and_grad_reference(x[0, 0], y[0, 0]), steps=[1, 3]) == []
    assert dict(logged["clip/total_norm"]) == pytest.approx(_at(logged, "ref/clip_grad_norm", [1, 3]), rel=1e-6)


def test_manual_optimisation_two_optimizers_attributes_each_optimizer_step(tmp_path):
    # The repro: StreamNormMonitor logged nothing here (global_step advances by 2 a batch), while
    # self.log logged at steps 1 and 3.
    x, y = make_data(world=1, accum=1)
    _, logged = _run(tmp_path, "manual2", ManualLM(x, y, n_optimizers=2, n_batches=4), max_epochs=1)
    assert _lightning_steps(logged) == [1, 3]
    _assert_every_monitor_tag_at(logged, [1, 3])
    expected = _forward_and_grad_reference(x[0, 0], y[0, 0])
    forward = {t: v for t, v in expected.items() if t.startswith(("stream/", "ln/"))}
    assert compare(logged, forward, steps=[1, 3], exact_tags=False) == []
    # Each optimizer over its own parameters: optimizer 0 holds the blocks, optimizer 1 the rest.
    total = expected["clip/total_norm"]
    for k, groups in enumerate((BLOCKS, [g for g in GROUPS if g not in BLOCKS])):
        own = sum(expected[f"clip/share/{g}"] for g in groups)
        prefix = f"clip/optimizer_{k}/"
        want = {f"{prefix}total_norm": total * math.sqrt(own), f"{prefix}nonfinite_steps": 0.0,
                **{f"{prefix}share/{g}": expected[f"clip/share/{g}"] / own for g in groups}}
        assert {t for t in logged if t.startswith(prefix)} == set(want)
        assert compare(logged, want, rtol=1e-4, steps=[1, 3], exact_tags=False) == []
        assert dict(logged[f"{prefix}total_norm"]) == pytest.approx(_at(logged, f"ref/optimizer_{k}/clip_grad_norm", [1, 3]), rel=1e-6)
    assert not [t for t in logged if t.startswith("clip/") and not t.startswith("clip/optimizer_")]


# ---------------------------------------------------------------------------------------------
# Accumulation, limits, validation, dataloaders
# ---------------------------------------------------------------------------------------------
class ValidatedLM(FixedBatchLM):
    """Two validation dataloaders of random tokens: statistics taken from validation would change every value."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.model(batch)

    def val_dataloader(self):
        g = torch.Generator().manual_seed(5)
        return [DataLoader(torch.randint(0, 16, (4, 2, 8), generator=g), batch_size=None) for _ in range(2)]


def test_accumulation_limit_train_batches_and_validation_inside_logging_steps(tmp_path):
    # 10 batches, limited to 5 an epoch, accumulated 2 by 2: each epoch steps on batches 1, 3 and 4 (the epoch's
    # last batch steps alone). Validation (2 loaders, 2 batches each) after every batch, inside the steps.
    x, y = make_data(world=1, accum=2)
    trainer, logged = _run(tmp_path, "accum", ValidatedLM(x, y, n_batches=10), max_epochs=2, accumulate_grad_batches=2,
                           limit_train_batches=5, limit_val_batches=2, val_check_interval=1)
    assert trainer.global_step == 6
    assert _lightning_steps(logged) == [1, 3, 5]
    _assert_every_monitor_tag_at(logged, [1, 3, 5])
    both = _forward_and_grad_reference(concat_batches(x), concat_batches(y))  # micro-batches 0 and 1
    alone = _forward_and_grad_reference(x[0, 0], y[0, 0])  # step 5: the second epoch's last batch, micro-batch 0
    # Lightning divides every micro-batch's loss by accumulate_grad_batches, this lone one's too: the gradient
    # the optimizer steps with (and clip_grad_norm_ would see) is half that of the batch's mean loss.
    alone["clip/total_norm"] /= 2
    assert compare({t: [v for v in vals if v[0] in (1, 3)] for t, vals in logged.items()}, both, steps=[1, 3]) == []
    assert compare({t: [v for v in vals if v[0] == 5] for t, vals in logged.items()}, alone, steps=[5]) == []
    assert dict(logged["clip/total_norm"]) == pytest.approx(_at(logged, "ref/clip_grad_norm", [1, 3, 5]), rel=1e-6)


class TwoTrainLoadersLM(FixedBatchLM):
    def train_dataloader(self):
        return [super().train_dataloader(), super().train_dataloader()]  # one batch: [index, index]


def test_two_training_dataloaders(tmp_path):
    x, y = make_data(world=1, accum=1)
    _, logged = _run(tmp_path, "two_loaders", TwoTrainLoadersLM(x, y), max_steps=4)
    assert _lightning_steps(logged) == [1, 3]
    _assert_every_monitor_tag_at(logged, [1, 3])
    assert compare(logged, _forward_and_grad_reference(concat_batches(x), concat_batches(y)), steps=[1, 3]) == []


class EvaluatedLM(FixedBatchLM):
    def validation_step(self, batch, batch_idx):
        self.log("ref/val_loss", self.model(self.x[0, 0]).float().mean(), batch_size=1)

    def test_step(self, batch, batch_idx):
        self.log("ref/test_loss", self.model(self.x[0, 0]).float().mean(), batch_size=1)

    def predict_step(self, batch, batch_idx):
        return self.model(self.x[0, 0])

    def val_dataloader(self):
        return DataLoader(range(3), batch_size=None)

    test_dataloader = predict_dataloader = val_dataloader


class _HooksDuringEvaluation:
    """A callback's batch hooks that record how many forward (pre-)hooks the model carries, in every stage."""

    def __init__(self):
        self.counts = []

    def __call__(self, trainer, pl_module, *args, **kwargs):
        self.counts.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in pl_module.modules()))


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_only_runs_do_no_monitor_work(tmp_path, stage):
    from lightning.pytorch import Callback

    counter = _HooksDuringEvaluation()
    hook = {"validate": "on_validation_batch_start", "test": "on_test_batch_start", "predict": "on_predict_batch_start"}[stage]
    spy = type("Spy", (Callback,), {hook: lambda self, *a, **k: counter(*a[:2])})()
    x, y = make_data(world=1, accum=1)
    module = EvaluatedLM(x, y)
    trainer = _trainer(tmp_path, stage, callbacks=[spy])
    copies = _reduce.HOST_COPIES
    getattr(trainer, stage)(module)
    assert counter.counts == [0, 0, 0], "monitors hooked the model outside fit"
    assert _reduce.HOST_COPIES == copies
    logged = read_scalars(tmp_path / stage) if stage != "predict" else {}
    if stage != "predict":
        assert f"ref/{'val' if stage == 'validate' else 'test'}_loss" in logged  # the run does log
    assert not [t for t in logged if t.startswith(MONITOR_PREFIXES)]


# ---------------------------------------------------------------------------------------------
# Resume, should_stop
# ---------------------------------------------------------------------------------------------
def test_a_fit_resumed_twice_logs_where_lightning_does(tmp_path):
    # Checkpoints every 4 steps, mid-epoch (6 batches an epoch); each resume continues Lightning's step count.
    x, y = make_data(world=1, accum=1)
    checkpoints = tmp_path / "ckpt"

    def saver():
        return ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=4, save_top_k=-1, filename="{step}")

    runs, ckpt = [], None
    for i, max_steps in enumerate((4, 8, 12)):
        _, logged = _run(tmp_path, f"part{i}", FixedBatchLM(x, y, n_batches=6), ckpt_path=ckpt, max_steps=max_steps,
                         enable_checkpointing=True, callbacks=[saver()])
        ckpt = str(checkpoints / f"step={max_steps}.ckpt")
        runs.append(logged)
    _, straight = _run(tmp_path, "straight", FixedBatchLM(x, y, n_batches=6), max_steps=12)
    assert _lightning_steps(straight) == [1, 3, 5, 7, 9, 11]
    for logged, steps in zip(runs, ([1, 3], [5, 7], [9, 11])):
        assert _lightning_steps(logged) == steps
        _assert_every_monitor_tag_at(logged, steps)
        assert compare(logged, _forward_and_grad_reference(x[0, 0], y[0, 0]), steps=steps) == []


class StopsAtStep2(FixedBatchLM):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.fit_loop.epoch_loop._batches_that_stepped == 2:
            self.trainer.should_stop = True  # min_steps keeps the fit going: Lightning then logs every step


def test_should_stop_with_min_steps_logs_every_step_as_learning_rate_monitor_does(tmp_path):
    # The schedule is decided at a step's first batch, as LearningRateMonitor decides it: step 2, on which
    # should_stop is set, is logged by self.log (which decides after the step) but by neither of them.
    x, y = make_data(world=1, accum=1)
    _, logged = _run(tmp_path, "stop", StopsAtStep2(x, y, n_batches=8), max_steps=8, min_steps=6)
    assert _steps(logged, "ref/loss") == [1, 2, 3, 4, 5, 6, 7]
    assert _steps(logged, "lr-SGD") == [1, 3, 4, 5, 6, 7]
    _assert_every_monitor_tag_at(logged, [1, 3, 4, 5, 6, 7])


def test_explicit_interval_counts_lightnings_logging_steps(tmp_path):
    # every_n_steps=3 under manual optimisation with two optimizers: batches 2 and 5 (not optimizer steps).
    x, y = make_data(world=1, accum=1)
    monitors = [StreamNormMonitor(every_n_steps=3), LayerNormInputMonitor(every_n_steps=3), ClipAttributionMonitor(every_n_steps=3)]
    _, logged = _run(tmp_path, "every3", ManualLM(x, y, n_optimizers=2, n_batches=6), monitors=monitors, max_epochs=1,
                     log_every_n_steps=1)
    assert _lightning_steps(logged) == [0, 1, 2, 3, 4, 5]
    _assert_every_monitor_tag_at(logged, [2, 5])
