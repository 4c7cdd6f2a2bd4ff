"""SpikeMonitor: the rules against hand-computed windows; an injected gradient spike reported at its step with its
block's group first and nothing before; an injected loss spike; host reads (none on steps that neither log nor
spike); Lightning's step clock under gradient accumulation and manual optimisation; the optional actions.

The fixture `SpikeLM` trains the monitors' test model (`ln_lightning.testing.monitors.make_model`) with SGD on a
fresh random batch every step. Its batch of a step is made of `halves` parts (the ranks' batches of the
distributed test); at `spike_step` the part `spike_half` is run with block `spike_block`'s parameters behind an
identity whose backward multiplies by `grad_factor` (the injected gradient spike, coming from that block only),
or its loss is multiplied by `loss_factor`.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, SpikeMonitor, StreamNormMonitor, _reduce
from ln_lightning.callbacks._lightning_internals import logging_step
from ln_lightning.callbacks.spike import SpikeRules
from ln_lightning.testing.monitors import BLOCKS, VOCAB, MicroBatchIndex, make_model, read_scalars

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def make_batches(n_steps: int, halves: int, batch: int = 4, seq: int = 8, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n_steps, halves, batch, seq), generator=g)
    # Learnable structure (next token = token + 1 mod VOCAB, 70% of the time), so the loss falls.
    y = torch.where(torch.rand(x.shape, generator=g) < 0.7, (x + 1) % VOCAB, torch.randint(0, VOCAB, x.shape, generator=g))
    return x, y


class SpikeLM(L.LightningModule):
    """Step `s` trains on `x[s, h]` for the halves `h` this process holds (all of them, or its rank's one)."""

    def __init__(self, x, y, lr=0.05, spike_step=None, spike_half=0, spike_block=1, grad_factor=1000.0, loss_factor=1.0,
                 accum=1, manual=False, per_rank=False, seed=0):
        super().__init__()
        self.model = make_model(seed)
        self.x, self.y, self.lr = x, y, lr
        self.spike_step, self.spike_half, self.spike_block = spike_step, spike_half, spike_block
        self.grad_factor, self.loss_factor = grad_factor, loss_factor
        self.accum, self.manual, self.per_rank = accum, manual, per_rank
        self.automatic_optimization = not manual

    def _loss(self, batch_idx):
        step = batch_idx // self.accum  # this batch's step on Lightning's clock (one epoch)
        halves = [self.global_rank] if self.per_rank else range(self.x.shape[1])
        losses = []
        for h in halves:
            x, y = self.x[step, h], self.y[step, h]
            at = self.spike_step if isinstance(self.spike_step, (set, frozenset, range)) else {self.spike_step}
            spiky = step in at and h == self.spike_half
            if spiky and self.grad_factor != 1.0:
                block = f"blocks.{self.spike_block}."
                params = {n: _GradScale.apply(p, self.grad_factor) for n, p in self.model.named_parameters() if n.startswith(block)}
                logits = torch.func.functional_call(self.model, params, (x,), strict=False)
            else:
                logits = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            losses.append(loss * (self.loss_factor if spiky else 1.0))
        return torch.stack(losses).mean()

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch_idx)
        self.log("ref/loss", loss)
        if not self.manual:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(MicroBatchIndex(self.x.shape[0] * self.accum), batch_size=None, shuffle=False)


def fit(tmp_path, module, monitors, name="run", every=10, **kw):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=TensorBoardLogger(str(tmp_path), name=name, version=0),
                        log_every_n_steps=every, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=monitors, **kw)
    trainer.fit(module)
    return trainer, read_records(tmp_path / name / "version_0")


def read_records(log_dir: Path) -> list[dict]:
    path = Path(log_dir) / "ln_spikes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------------------------
# The rules, against windows computed by hand
# ---------------------------------------------------------------------------------------------
def _by_hand(series: list[float], window: int, sigma: float, ratio: float, warmup: int) -> list[set[str]]:
    out = []
    for t, v in enumerate(series):
        past = [u for u in series[:t] if math.isfinite(u)]
        win = [u for u in series[max(0, t - window) : t] if math.isfinite(u)]
        flags = set()
        if not math.isfinite(v):
            flags.add("nonfinite")
        else:
            if len(win) >= max(2, warmup) and v - statistics.fmean(win) > sigma * statistics.stdev(win):
                flags.add("sigma")
            if len(past) >= warmup and v > ratio * max(past):
                flags.add("ratio")
        out.append(flags)
    return out


def _rules_on(series: list[float], **kw) -> list[set[str]]:
    rules = SpikeRules(1, kw["window"], kw["sigma"], kw["ratio"], kw["warmup"])
    out = []
    for v in series:
        code = int(rules.update(torch.tensor([v], dtype=torch.float64))["code"][0])
        out.append({name for bit, name in ((1, "sigma"), (2, "ratio"), (4, "nonfinite")) if code & bit})
    return out


def test_sigma_rule_matches_a_hand_computed_window():
    # window 4, warm-up 3: steps 0-2 are never judged. Step 7 (5.0) is far above its window [1.0, 1.2, 0.9, 1.1]
    # (mean 1.05, stdev 0.129: threshold 1.05 + 3 * 0.129 = 1.44). Step 8 (1.4) is judged against [1.2, 0.9, 1.1,
    # 5.0], which the spike itself widened (mean 2.05, stdev 1.96): not flagged. Step 11 is NaN: flagged, not kept.
    series = [1.0, 1.1, 0.9, 1.0, 1.2, 0.9, 1.1, 5.0, 1.4, 1.0, 1.05, float("nan"), 1.1]
    kw = dict(window=4, sigma=3.0, ratio=None, warmup=3)
    want = _by_hand(series, **{**kw, "ratio": math.inf})
    assert _rules_on(series, **kw) == want
    assert [t for t, f in enumerate(want) if f] == [7, 11]
    assert want[7] == {"sigma"} and want[11] == {"nonfinite"}
    # By hand, step 7: window [1.0, 1.2, 0.9, 1.1]
    win = [1.0, 1.2, 0.9, 1.1]
    assert 5.0 - statistics.fmean(win) > 3.0 * statistics.stdev(win)


def test_ratio_rule_matches_a_hand_computed_running_max():
    # ratio 10, warm-up 2: step 1's 50 is not judged (one value seen); step 4's 600 > 10 * 50; step 6's 5000 < 10 * 600.
    series = [3.0, 50.0, 2.0, 4.0, 600.0, 1.0, 5000.0, 6001.0 * 10 + 1]
    kw = dict(window=8, sigma=None, ratio=10.0, warmup=2)
    got = _rules_on(series, **kw)
    assert got == _by_hand(series, **{**kw, "sigma": math.inf})
    assert [t for t, f in enumerate(got) if f] == [4, 7]


def test_both_rules_on_random_series_match_the_hand_computation():
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        series = (torch.randn(200, generator=g).abs() + 1).tolist()
        for t in torch.randint(0, 200, (6,), generator=g).tolist():
            series[t] *= float(torch.empty(1).uniform_(2, 30, generator=g))
        series[int(torch.randint(0, 200, (1,), generator=g))] = float("inf")
        kw = dict(window=32, sigma=4.0, ratio=6.0, warmup=16)
        assert _rules_on(series, **kw) == _by_hand(series, **kw), trial


# ---------------------------------------------------------------------------------------------
# Injected spikes in a real fit
# ---------------------------------------------------------------------------------------------
N_STEPS, SPIKE_STEP, WINDOW = 40, 30, 16


def test_an_injected_gradient_spike_is_reported_at_its_step_with_its_block_first(tmp_path):
    x, y = make_batches(N_STEPS, 2)
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, spike_half=1, spike_block=1)
    monitor = SpikeMonitor(window=WINDOW)
    trainer, records = fit(tmp_path, module, [monitor])
    grad = [r for r in records if r["kind"] == "grad_norm"]
    assert [r["step"] for r in grad] == [SPIKE_STEP], records  # nothing before it, warm-up included
    record = grad[0]
    assert record["top_groups"][0][0] == BLOCKS[1] and record["top_groups"][0][1] > 0.9, record["top_groups"]
    assert record["rule"] == "sigma" and "ratio" in record["rules"]  # 1000x also passes 10x the running max
    assert record["value"] > record["threshold"] > record["baseline"] > 0
    assert [b["block"] for b in record["blocks"]] == BLOCKS
    assert all(b["stream_rms"] > 0 and b["amp_max"] > 0 for b in record["blocks"])
    # Nothing before the spike, on either kind. After it, the 1000x update it made can spike the next steps' loss.
    assert min(r["step"] for r in records) == SPIKE_STEP
    logged = read_scalars(tmp_path / "run")
    assert dict(logged["spike/count"]) == {9: 0.0, 19: 0.0, 29: 0.0, 39: float(len(records))}
    assert dict(logged["spike/total"])[39] == len(records)


def test_the_record_s_blocks_and_groups_are_the_step_s_exact_statistics(tmp_path):
    # A logging step that is also the spike step: the other monitors measure the same step; the values agree.
    x, y = make_batches(N_STEPS, 2)
    module = SpikeLM(x, y, spike_step=29, spike_half=1, spike_block=2)
    monitors = [SpikeMonitor(window=WINDOW, top_groups=None), StreamNormMonitor(log_depth_profile=False),
                LayerNormInputMonitor(log_depth_profile=False), ClipAttributionMonitor(log_depth_profile=False)]
    _, records = fit(tmp_path, module, monitors)
    record = next(r for r in records if r["kind"] == "grad_norm")
    assert record["step"] == 29
    logged = {tag: dict(v) for tag, v in read_scalars(tmp_path / "run").items()}
    assert math.isclose(record["value"], logged["clip/total_norm"][29], rel_tol=1e-5)
    for group, share in record["top_groups"]:
        assert math.isclose(share, logged[f"clip/share/{group}"][29], rel_tol=1e-5, abs_tol=1e-9), group
    assert record["top_groups"][0][0] == BLOCKS[2]
    for b in record["blocks"]:
        assert math.isclose(b["stream_rms"], logged[f"stream/rms/{b['block']}"][29], rel_tol=1e-5)
        amps = [logged[f"ln/amp_max/{b['block']}.ln{j}"][29] for j in (1, 2)]
        assert math.isclose(b["amp_max"], max(amps), rel_tol=1e-5)


def test_an_injected_loss_spike_is_reported_by_the_loss_rule(tmp_path):
    x, y = make_batches(N_STEPS, 1)
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, grad_factor=1.0, loss_factor=20.0)
    _, records = fit(tmp_path, module, [SpikeMonitor(kinds=["loss"], window=WINDOW)])
    assert [(r["step"], r["kind"]) for r in records] == [(SPIKE_STEP, "loss")]
    r = records[0]
    assert r["value"] > 15 * r["baseline"] and set(r["rules"]) == {"sigma", "ratio"}
    assert r["top_groups"] and r["blocks"]  # a loss record names the step's groups and blocks too


def test_the_loss_value_and_window_are_the_steps_own_losses(tmp_path):
    # Log every step: the record's baseline and std are the mean and stdev of the 16 logged losses before it.
    x, y = make_batches(N_STEPS, 1)
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, grad_factor=1.0, loss_factor=20.0)
    _, records = fit(tmp_path, module, [SpikeMonitor(kinds=["loss"], window=WINDOW)], every=1)
    logged = dict(read_scalars(tmp_path / "run")["ref/loss"])
    r = records[0]
    window = [logged[s] for s in range(SPIKE_STEP - WINDOW, SPIKE_STEP)]
    assert math.isclose(r["value"], logged[SPIKE_STEP], rel_tol=1e-6)
    assert math.isclose(r["baseline"], statistics.fmean(window), rel_tol=1e-6)
    assert math.isclose(r["std"], statistics.stdev(window), rel_tol=1e-5)
    assert r["n_window"] == WINDOW


# ---------------------------------------------------------------------------------------------
# Host reads, as the monitors' tests count them
# ---------------------------------------------------------------------------------------------
_SYNCING = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__"}


class _SyncSpy(TorchFunctionMode, L.Callback):
    """Records every host-synchronising torch call made from ln_lightning/callbacks code, with Lightning's step."""

    def __init__(self):
        TorchFunctionMode.__init__(self)
        self.calls: list[tuple[int, str]] = []
        self.trainer = None

    def on_train_start(self, trainer, pl_module):
        self.trainer = trainer
        self.__enter__()

    def on_train_end(self, trainer, pl_module):
        self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        name = getattr(func, "__name__", str(func))
        if "ln_lightning/callbacks" in frame.f_code.co_filename.replace("\\", "/") and name in _SYNCING:
            assert frame.f_code.co_filename.endswith("_reduce.py"), (name, frame.f_code.co_filename, frame.f_lineno)
            self.calls.append((logging_step(self.trainer), name))
        return func(*args, **(kwargs or {}))


def test_no_host_read_on_steps_that_do_not_log_a_spike_step_included(tmp_path):
    x, y = make_batches(N_STEPS, 2)
    spy = _SyncSpy()
    copies = _reduce.HOST_COPIES
    _, records = fit(tmp_path, SpikeLM(x, y, spike_step=SPIKE_STEP + 3, spike_half=1), [spy, SpikeMonitor(window=WINDOW)])
    assert [r["step"] for r in records if r["kind"] == "grad_norm"] == [SPIKE_STEP + 3]
    # Logging steps 9, 19, 29, 39: one read each; none on the other 36 steps, the spike's step 33 included.
    assert [s for s, _ in spy.calls] == [9, 19, 29, 39]
    assert _reduce.HOST_COPIES - copies == 4


def test_with_an_action_one_host_read_per_step(tmp_path):
    x, y = make_batches(20, 1)
    spy = _SyncSpy()
    fit(tmp_path, SpikeLM(x, y), [spy, SpikeMonitor(window=WINDOW, on_spike="checkpoint")])
    steps = [s for s, _ in spy.calls]
    assert steps == sorted(list(range(20)) + [9, 19])  # the flags every step, the records at the logging steps


# ---------------------------------------------------------------------------------------------
# Lightning's step clock
# ---------------------------------------------------------------------------------------------
def test_gradient_accumulation_reports_the_optimizer_step(tmp_path):
    x, y = make_batches(N_STEPS, 1)
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, accum=2)
    _, records = fit(tmp_path, module, [SpikeMonitor(window=WINDOW)], accumulate_grad_batches=2)
    assert [r["step"] for r in records if r["kind"] == "grad_norm"] == [SPIKE_STEP]
    assert read_scalars(tmp_path / "run")["spike/count"][-1][0] == 39


def test_gradient_accumulation_loss_is_the_mean_over_micro_batches(tmp_path):
    x, y = make_batches(N_STEPS, 1)
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, accum=2, grad_factor=1.0, loss_factor=20.0)
    _, records = fit(tmp_path, module, [SpikeMonitor(kinds=["loss"], window=WINDOW)], accumulate_grad_batches=2, every=1)
    logged = dict(read_scalars(tmp_path / "run")["ref/loss"])  # self.log's epoch-less mean over the step's micro-batches
    assert [r["step"] for r in records] == [SPIKE_STEP]
    assert math.isclose(records[0]["value"], logged[SPIKE_STEP], rel_tol=1e-6)


def test_manual_optimisation_reports_lightnings_step(tmp_path):
    x, y = make_batches(N_STEPS, 2)
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, spike_half=0, spike_block=0, manual=True)
    _, records = fit(tmp_path, module, [SpikeMonitor(window=WINDOW)])
    grad = [r for r in records if r["kind"] == "grad_norm"]
    assert [r["step"] for r in grad] == [SPIKE_STEP] and grad[0]["top_groups"][0][0] == BLOCKS[0]


# ---------------------------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------------------------
def _fit_with_action(tmp_path, on_spike: str, name: str):
    """A run spiking at its last step with `on_spike`, and a reference run of the steps before it (no spike, no
    monitor). Returns (the run's module, the reference's module, the run's records)."""
    x, y = make_batches(SPIKE_STEP + 1, 2)
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, spike_half=1)
    reference = SpikeLM(x, y, spike_step=None)
    fit(tmp_path, reference, [], name="ref", max_steps=SPIKE_STEP)
    _, records = fit(tmp_path, module, [SpikeMonitor(window=WINDOW, on_spike=on_spike)], name=name)
    return module, reference, records


def test_skip_leaves_the_weights_as_they_were_and_says_so(tmp_path):
    module, reference, records = _fit_with_action(tmp_path, "skip", "skip")
    assert [(r["step"], r["action"]) for r in records if r["kind"] == "grad_norm"] == [(SPIKE_STEP, "skipped")]
    for (n, a), (_, b) in zip(module.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), n  # the spike's update was not applied


def test_checkpoint_is_saved_before_the_spike_s_update(tmp_path):
    _, reference, records = _fit_with_action(tmp_path, "checkpoint", "ckpt")
    grad = [r for r in records if r["kind"] == "grad_norm"]
    path = tmp_path / "ckpt" / "version_0" / "spike_checkpoints" / f"step={SPIKE_STEP}.ckpt"
    assert grad[0]["action"] == f"checkpoint {path}" and path.exists()
    state = torch.load(path, weights_only=False)["state_dict"]
    for n, p in reference.named_parameters():
        assert torch.equal(state[n], p), n


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="kinds"):
        SpikeMonitor(kinds=["losses"])
    with pytest.raises(ValueError, match="no rule"):
        SpikeMonitor(sigma=None, ratio=None)
    with pytest.raises(ValueError, match="on_spike"):
        SpikeMonitor(on_spike="kill")
    with pytest.raises(ValueError, match="window"):
        SpikeMonitor(window=1)


def test_the_guide_s_worked_example_is_what_this_run_records(tmp_path):
    # docs/guides/monitors.md, "Something went wrong": the records quoted there (rounded) come from this run.
    text = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "monitors.md").read_text(encoding="utf-8")
    block = text.split("## Something went wrong", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    decoder, quoted, at = json.JSONDecoder(), [], 0
    while block[at:].strip():
        at += len(block[at:]) - len(block[at:].lstrip())
        record, at = decoder.raw_decode(block, at)
        quoted.append(record)
    x, y = make_batches(N_STEPS, 2)
    _, records = fit(tmp_path, SpikeLM(x, y, spike_step=SPIKE_STEP, spike_half=1, spike_block=1), [SpikeMonitor(window=WINDOW, top_groups=3)])
    assert len(quoted) == len(records)

    def close(a, b):
        if isinstance(a, float) or isinstance(b, float):
            return math.isclose(a, b, rel_tol=5e-3, abs_tol=1e-9) or (abs(b) < 1e-4 and math.isclose(a, b, rel_tol=0.05))
        if isinstance(a, list):
            return len(a) == len(b) and all(close(u, v) for u, v in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        return a == b

    for q, r in zip(quoted, records):
        assert close(q, r), (q, r)


def test_a_fit_leaves_no_hook_behind_and_a_second_fit_starts_afresh(tmp_path):
    x, y = make_batches(N_STEPS, 2)
    monitor = SpikeMonitor(window=WINDOW)
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, spike_half=1)
    fit(tmp_path, module, [monitor], name="first")
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules()) == 0
    # The same monitor on a fresh module: its window starts empty again, so the same spike is found at the same step.
    _, records = fit(tmp_path, SpikeLM(x, y, spike_step=SPIKE_STEP, spike_half=1), [monitor], name="second")
    assert min(r["step"] for r in records) == SPIKE_STEP and records[0]["kind"] == "grad_norm"
