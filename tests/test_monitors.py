"""Monitors: every logged value against an independent recomputation, read back from the event files.

Multi-process runs (ddp_spawn, FSDP2) live in test_monitors_distributed.py.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ln_lightning.testing.monitors import (  # noqa: E402
    BLOCKS,
    GROUPS,
    NORMS,
    FixedBatchLM,
    ManualLM,
    make_trainer,
    all_monitors,
    compare,
    concat_batches,
    make_data,
    make_model,
    read_scalars,
    reference_forward_stats,
    reference_grad_stats,
)

from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor  # noqa: E402
from ln_lightning.callbacks._common import normalize_name  # noqa: E402
from ln_lightning.callbacks._lightning_internals import logging_step  # noqa: E402
from ln_lightning.callbacks.clip import default_group_fn  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _fit(tmp_path, name, module, **kw):
    kw.setdefault("callbacks", all_monitors())
    trainer = make_trainer(str(tmp_path), name, accelerator="cpu", devices=1, **kw)
    trainer.fit(module)
    return trainer, read_scalars(tmp_path / name)


# ---------------------------------------------------------------------------------------------
# Acceptance: deterministic setup, every logged metric against an independent recomputation
# ---------------------------------------------------------------------------------------------
def test_every_logged_metric_matches_independent_reference(tmp_path):
    x, y = make_data(world=1, accum=1)
    clip_val = 0.05  # below the gradient norm (about 1.8): clipping fires on every step
    _, logged = _fit(tmp_path, "single", FixedBatchLM(x, y), max_steps=4, gradient_clip_val=clip_val)
    model = make_model()
    expected = reference_forward_stats(model, concat_batches(x))
    expected.update(reference_grad_stats(model, concat_batches(x), concat_batches(y), clip_val=clip_val))
    assert set(f"stream/rms/{b}" for b in BLOCKS) <= set(expected) and len(expected) == (3 * 2 + 1) + (6 * 3 + 1) + (1 + 6 + 4 + 6 + 2 + 6)
    assert compare(logged, expected, rtol=1e-4, steps=[1, 3]) == []
    # clip/total_norm is also exactly what clip_grad_norm_ returned inside the same run
    ref_in_run = dict(logged["ref/clip_grad_norm"])
    for step, value in logged["clip/total_norm"]:
        assert math.isclose(value, ref_in_run[step], rel_tol=1e-6)
    assert dict(logged["clip/clipped"]) == {1: 1.0, 3: 1.0}


def test_value_clipping_fraction_per_group(tmp_path):
    x, y = make_data(world=1, accum=1)
    clip_val = 2e-3  # clips some but not all elements of most groups
    _, logged = _fit(tmp_path, "value", FixedBatchLM(x, y), max_steps=2,
                     gradient_clip_val=clip_val, gradient_clip_algorithm="value")
    model = make_model()
    expected = reference_grad_stats(model, concat_batches(x), concat_batches(y), clip_val=clip_val, algorithm="value")
    expected.update(reference_forward_stats(model, concat_batches(x)))
    fractions = [expected[f"clip/value_fraction/{g}"] for g in GROUPS]
    assert any(0 < f < 1 for f in fractions), "the test needs partially clipped groups"
    assert compare(logged, expected, rtol=1e-4, steps=[1]) == []


def test_no_clipping_configured_logs_norm_and_shares_only(tmp_path):
    x, y = make_data(world=1, accum=1)
    _, logged = _fit(tmp_path, "noclip", FixedBatchLM(x, y), max_steps=2, callbacks=[ClipAttributionMonitor(every_n_steps=2)])
    clip_tags = {t for t in logged if t.startswith("clip/")}
    assert clip_tags == {"clip/total_norm", "clip/nonfinite_steps", *(f"clip/share/{g}" for g in GROUPS)}
    expected = reference_grad_stats(make_model(), concat_batches(x), concat_batches(y))
    assert compare(logged, expected, rtol=1e-4, steps=[1]) == []


class AlternatingLM(FixedBatchLM):
    """Step s uses batch X[0, s % 2]: two gradient norms alternate, so a window mixes clipped and unclipped steps."""

    def training_step(self, batch, batch_idx):
        x = self.x[0, self.global_step % 2]
        y = self.y[0, self.global_step % 2]
        return F.cross_entropy(self.model(x).reshape(-1, 16), y.reshape(-1))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(1), batch_size=None)


def test_window_fired_fraction_and_dominant_group(tmp_path):
    x, y = make_data(world=1, accum=2, seed=3)
    model = make_model()
    refs = [reference_grad_stats(model, x[0, k], y[0, k]) for k in (0, 1)]
    norms = [r["clip/total_norm"] for r in refs]
    assert abs(norms[0] - norms[1]) > 0.05 * max(norms), "the two batches need distinct gradient norms"
    clip_val = sum(norms) / 2  # fires on exactly one of the two alternating batches
    fired_batch = 0 if norms[0] > norms[1] else 1
    _, logged = _fit(tmp_path, "window", AlternatingLM(x, y), max_steps=8, gradient_clip_val=clip_val,
                     callbacks=[ClipAttributionMonitor(every_n_steps=4)])
    assert dict(logged["clip/fired_fraction"]) == {3: 0.5, 7: 0.5}
    dominant = max(GROUPS, key=lambda g: refs[fired_batch][f"clip/share/{g}"])
    for g in GROUPS:
        assert dict(logged[f"clip/dominant/{g}"]) == {3: float(g == dominant), 7: float(g == dominant)}
    # the logging step itself (step 3, 7: batch 1) is what clip/total_norm and clip/clipped describe
    assert math.isclose(dict(logged["clip/total_norm"])[3], norms[1], rel_tol=1e-5)
    assert dict(logged["clip/clipped"])[3] == float(fired_batch == 1)


def test_gradients_are_unscaled_under_fp16_grad_scaler(tmp_path):
    """Lightning unscales before on_before_optimizer_step: the logged norm is the true one, not x65536."""
    from lightning.pytorch.plugins import MixedPrecision

    x, y = make_data(world=1, accum=1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    _, logged = _fit(tmp_path, "fp16", FixedBatchLM(x, y), max_steps=2, plugins=[plugin],
                     callbacks=[ClipAttributionMonitor(every_n_steps=2)])
    assert plugin.scaler.get_scale() >= 2.0**15, "the GradScaler was not active"
    fp32_total = reference_grad_stats(make_model(), concat_batches(x), concat_batches(y))["clip/total_norm"]
    logged_total = dict(logged["clip/total_norm"])[1]
    assert math.isclose(logged_total, dict(logged["ref/clip_grad_norm"])[1], rel_tol=1e-6)
    assert math.isclose(logged_total, fp32_total, rel_tol=1e-2)  # fp16 forward noise, not a factor of 2**16


@pytest.mark.slow
def test_hooks_registered_before_torch_compile_still_measure(tmp_path):
    x, y = make_data(world=1, accum=1)
    _, logged = _fit(tmp_path, "compiled", FixedBatchLM(x, y, compile_backend="aot_eager"), max_steps=4)
    model = make_model()
    expected = reference_forward_stats(model, concat_batches(x))
    expected.update(reference_grad_stats(model, concat_batches(x), concat_batches(y)))
    assert compare(logged, expected, rtol=1e-4, steps=[1, 3]) == []


# ---------------------------------------------------------------------------------------------
# Cost: no work and no host synchronisation on steps that do not log; one per logging step
# ---------------------------------------------------------------------------------------------
_SYNCING = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__"}


class _TorchCallsFromMonitors(TorchFunctionMode):
    """Records every torch function / Tensor method called directly from ln_lightning/callbacks code, with the
    logging step (Lightning's, as `self.log` uses it) it was called in."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer
        self.calls: list[tuple[int, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        if "ln_lightning/callbacks" in frame.f_code.co_filename.replace("\\", "/"):
            name = getattr(func, "__name__", str(func))
            self.calls.append((logging_step(self.trainer), name, f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"))
        return func(*args, **(kwargs or {}))


class _Spy(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.mode = _TorchCallsFromMonitors(trainer)
        self.mode.__enter__()

    def on_train_end(self, trainer, pl_module):
        self.mode.__exit__(None, None, None)

    def syncs(self) -> list[int]:
        """The logging step of each host synchronisation the monitors made; all must be in _reduce.py."""
        syncing = [c for c in self.mode.calls if c[1] in _SYNCING]
        assert {where.split(":")[0] for _, _, where in syncing} == {"_reduce.py"}, syncing
        return sorted(step for step, _, _ in syncing)


def test_one_host_sync_per_logging_step_and_no_work_otherwise(tmp_path):
    x, y = make_data(world=1, accum=1)
    spy = _Spy()
    _fit(tmp_path, "spy", FixedBatchLM(x, y), max_steps=6, callbacks=[spy, *all_monitors(every=3)])
    # Logging steps are 2 and 5: one host sync per monitor in each, none and no work at all in the others.
    assert [c for c in spy.mode.calls if c[0] in (0, 1, 3, 4)] == [], "monitors did work on a step that does not log"
    assert spy.syncs() == [2, 2, 2, 5, 5, 5]

    # With clipping on, the clip monitor works on every step (window statistics) but never syncs there.
    spy = _Spy()
    _fit(tmp_path, "spy_clip", FixedBatchLM(x, y), max_steps=6, gradient_clip_val=0.05,
         callbacks=[spy, *all_monitors(every=3)])
    # step 0 also allocates buffers; _grad_groups.py reads the gradients for clip.py
    assert {c[2].split(":")[0] for c in spy.mode.calls if c[0] in (1, 4)} == {"clip.py", "_grad_groups.py"}
    assert spy.syncs() == [2, 2, 2, 5, 5, 5]


def test_one_host_sync_per_logging_step_under_manual_optimisation_with_two_optimizers(tmp_path):
    # Two optimizer steps per batch; still one host sync per monitor and logging step (the clip monitor reduces
    # both optimizers' statistics together), at Lightning's logging steps 1 and 3.
    x, y = make_data(world=1, accum=1)
    spy = _Spy()
    _fit(tmp_path, "spy_manual", ManualLM(x, y, n_optimizers=2, n_batches=4), max_epochs=1,
         callbacks=[spy, *all_monitors(every=2)])
    assert [c for c in spy.mode.calls if c[0] in (0, 2)] == [], "monitors did work on a step that does not log"
    assert spy.syncs() == [1, 1, 1, 3, 3, 3]


def test_packed_stats_named_states_reduce_with_one_sum_one_max_and_one_host_copy(monkeypatch):
    from ln_lightning.callbacks import _reduce
    from ln_lightning.callbacks._reduce import MAX, SUM, PackedStats

    stats = PackedStats("cpu")
    stats.add_state("a", 3, SUM)
    stats.add_state("m", (2, 2), MAX)
    stats.add_state("b", (2, 2), SUM)
    stats.add_state("z", 2, MAX, default=0.0)
    assert stats["a"].shape == (3,) and stats["m"].shape == (2, 2) and stats["z"].tolist() == [0.0, 0.0]
    stats["a"].add_(torch.tensor([1.0, 2.0, 3.0]))
    stats["b"][1, 0] += 5.0
    stats["m"][0, 1] = 7.0
    with pytest.raises(RuntimeError, match="declare them all first"):
        stats.add_state("late", 1, SUM)

    calls = []
    monkeypatch.setattr(_reduce, "distributed_world", lambda: 2)
    monkeypatch.setattr(_reduce.dist, "all_reduce", lambda t, op, group=None: calls.append((op, t.data_ptr(), t.numel())))
    copies = _reduce.HOST_COPIES
    host = stats.reduce_to_host()
    # The SUM states side by side, then the MAX states: one collective each, over one storage.
    assert calls == [(_reduce.dist.ReduceOp.SUM, stats["a"].data_ptr(), 3 + 4), (_reduce.dist.ReduceOp.MAX, stats["m"].data_ptr(), 4 + 2)]
    assert _reduce.HOST_COPIES == copies + 1
    inf = float("inf")
    assert host == {"a": [1.0, 2.0, 3.0], "m": [[-inf, 7.0], [-inf, -inf]], "b": [[0.0, 0.0], [5.0, 0.0]], "z": [0.0, 0.0]}
    stats.reset()
    assert stats.reduce_to_host(across_ranks=False) == {"a": [0.0] * 3, "m": [[-inf, -inf]] * 2, "b": [[0.0, 0.0]] * 2, "z": [0.0, 0.0]}
    assert len(calls) == 2  # across_ranks=False: no collective

    sums_only = PackedStats()
    sums_only.add_state("n", 2, SUM)
    with pytest.raises(ValueError, match="declared twice"):
        sums_only.add_state("n", 2, SUM)
    sums_only.reduce_to_host()
    assert len(calls) == 3 and calls[-1][0] == _reduce.dist.ReduceOp.SUM  # no MAX state: no MAX collective
    with pytest.raises(TypeError, match="SUM or MAX"):
        PackedStats().add_state("x", 1, "sum")


class _MonitorHooks(L.Callback):
    """Counts the forward (pre-)hooks that ln_lightning/callbacks code put on the model, when training starts."""

    def on_train_start(self, trainer, pl_module):
        hooks = [h for m in pl_module.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
        files = [getattr(getattr(h, "__code__", None), "co_filename", "").replace("\\", "/") for h in hooks]  # ours are closures
        self.count = sum("ln_lightning/callbacks" in f for f in files)


def test_without_a_logger_the_monitors_do_no_work_and_say_so_once(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    from ln_lightning import LNLightningWarning

    x, y = make_data(world=1, accum=1)
    seen = {}
    for logger in (False, TensorBoardLogger(str(tmp_path), name="with_logger")):
        hooks = _MonitorHooks()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=2, gradient_clip_val=0.05,
                            logger=logger, callbacks=[hooks, *all_monitors(every=2)], enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings(record=True) as caught, _TorchCallsFromMonitors(trainer) as spy:
            warnings.simplefilter("always")
            trainer.fit(FixedBatchLM(x, y))
        said = [w for w in caught if issubclass(w.category, LNLightningWarning) and "no logger" in str(w.message)]
        seen[bool(logger)] = (hooks.count, len(spy.calls), said)
    assert seen[True][0] == len(BLOCKS) + len(NORMS) and seen[True][1] > 0 and seen[True][2] == []  # the spy sees work
    count, calls, said = seen[False]
    assert count == 0 and calls == 0, "monitors without a logger registered hooks or computed statistics"
    assert len(said) == 1, [str(w.message) for w in said]
    assert all(name in str(said[0].message) for name in ("StreamNormMonitor", "LayerNormInputMonitor", "ClipAttributionMonitor"))


# ---------------------------------------------------------------------------------------------
# Robustness
# ---------------------------------------------------------------------------------------------
class PoisonedLM(FixedBatchLM):
    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.model.tok_emb.weight[int(self.x.flatten()[0]), 0] = float("inf")  # a token of the fixed batch
        return super().training_step(batch, batch_idx)


def test_nonfinite_values_are_counted_and_training_continues(tmp_path):
    x, y = make_data(world=1, accum=1)
    trainer, logged = _fit(tmp_path, "nonfinite", PoisonedLM(x, y), max_steps=4, gradient_clip_val=1.0)
    assert trainer.global_step == 4
    assert dict(logged["stream/nonfinite_count"])[1] > 0
    assert dict(logged["ln/nonfinite_count"])[1] > 0
    assert dict(logged["clip/nonfinite_steps"])[1] == 2.0  # both steps of the window
    assert dict(logged["clip/fired_fraction"])[1] == 0.0  # a non-finite step is not a clipped step


def test_gradient_accumulation_covers_every_micro_batch(tmp_path):
    x, y = make_data(world=1, accum=2)
    _, logged = _fit(tmp_path, "accum", FixedBatchLM(x, y), max_steps=2, accumulate_grad_batches=2)
    model = make_model()
    expected = reference_forward_stats(model, concat_batches(x))
    expected.update(reference_grad_stats(model, concat_batches(x), concat_batches(y)))
    assert compare(logged, expected, rtol=1e-4, steps=[1]) == []


class TinyFusedAddModel(nn.Module):
    """Pre-norm stream using FusedAddLayerNorm(branch, stream) -> (LN(stream + branch), stream + branch)."""

    def __init__(self):
        super().__init__()
        from ln_lightning.norm import FusedAddLayerNorm

        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = FusedAddLayerNorm(8, eps=1e-3)
        self.head = nn.Linear(8, 16)

    def forward(self, idx):
        h = self.emb(idx)
        normed, _ = self.norm(self.fc(h), h)
        return self.head(normed)


class FusedAddLM(L.LightningModule):
    def __init__(self, x):
        super().__init__()
        self.model = TinyFusedAddModel()
        self.x = x

    def training_step(self, batch, batch_idx):
        return self.model(self.x).float().logsumexp(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(1), batch_size=None)


def test_fused_add_layernorm_is_monitored_on_its_summed_input(tmp_path):
    pytest.importorskip("ln_lightning.norm")
    x = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    module = FusedAddLM(x)
    _, logged = _fit(tmp_path, "fusedadd", module, max_steps=2, callbacks=[LayerNormInputMonitor(every_n_steps=2)])
    with torch.no_grad():
        m = module.model.double()
        h = m.emb(x)
        v = (m.fc(h) + h).var(-1, unbiased=False)
    assert math.isclose(dict(logged["ln/var_mean/model.norm"])[1], v.mean().item(), rel_tol=1e-4)
    assert math.isclose(dict(logged["ln/var_min/model.norm"])[1], v.min().item(), rel_tol=1e-4)
    assert math.isclose(dict(logged["ln/amp_max/model.norm"])[1], (1 / (v + 1e-3).sqrt()).max().item(), rel_tol=1e-4)


def test_amplification_warning_is_rank_zero_and_rate_limited(tmp_path):
    x, y = make_data(world=1, accum=1)
    module = FixedBatchLM(x, y)
    module.model.blocks[1].ln2.eps = 10.0  # var ~ 1 << eps: amp ~ 1/sqrt(11), 95% of the 1/sqrt(eps) bound
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, "warn", module, max_steps=6,
             callbacks=[LayerNormInputMonitor(every_n_steps=2, warn_amp_fraction=0.5, warn_cooldown=2)])
    messages = [str(w.message) for w in caught if "LayerNormInputMonitor at step" in str(w.message)]
    assert len(messages) == 2, messages  # logging steps 1, 3, 5; cooldown 2 => warned at 1 and 5
    assert all("model.blocks.1.ln2" in m and "model.blocks.0" not in m for m in messages)


def test_layout_written_once_with_every_family_and_depth_profiles(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    x, y = make_data(world=1, accum=1)
    trainer, _ = _fit(tmp_path, "layout", FixedBatchLM(x, y), max_steps=4, gradient_clip_val=0.05)
    acc = EventAccumulator(trainer.logger.log_dir, size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    events = acc.Tensors("custom_scalars__config__")
    assert len(events) == 1
    layout = layout_pb2.Layout()
    layout.ParseFromString(events[0].tensor_proto.string_val[0])
    titles = {chart.title for category in layout.category for chart in category.chart}
    assert {"stream rms by block", "update ratio by block", "LN var_min by norm", "LN amp_max",
            "clip share by group", "clip total norm", "clip dominant group (fired steps)"} <= titles
    assert set(acc.Tags()["images"]) == {"stream/depth_profile", "ln/depth_profile", "clip/share_profile"}
    assert [e.step for e in acc.Images("stream/depth_profile")] == [1, 3]


def test_depth_profile_can_be_disabled(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = make_data(world=1, accum=1)
    trainer, logged = _fit(tmp_path, "noimg", FixedBatchLM(x, y), max_steps=2,
                           callbacks=all_monitors(log_depth_profile=False))
    acc = EventAccumulator(trainer.logger.log_dir, size_guidance={"images": 0})
    acc.Reload()
    assert acc.Tags()["images"] == [] and "stream/rms/model.blocks.0" in logged


# ---------------------------------------------------------------------------------------------
# Names, groups and bad input
# ---------------------------------------------------------------------------------------------
def test_wrapper_prefixes_are_stripped():
    assert normalize_name("_forward_module.model._orig_mod.blocks.0.ln1.weight") == "model.blocks.0.ln1.weight"
    assert normalize_name("module.model._fsdp_wrapped_module.head.bias") == "model.head.bias"
    root = nn.Module()
    root.module = nn.Linear(2, 2)  # a user's own submodule called "module" keeps its name
    assert normalize_name("module.weight", root) == "module.weight"


def test_default_groups_are_blocks_plus_top_level_modules():
    module = FixedBatchLM(*make_data(1, 1))
    fn = default_group_fn(module, BLOCKS)
    names = [n for n, _ in module.named_parameters()]
    assert sorted({fn(n) for n in names}) == sorted(GROUPS)
    assert fn("model.blocks.2.mlp.fc.weight") == "model.blocks.2"
    no_blocks = default_group_fn(module, [])
    assert no_blocks("model.head.weight") == "model.head"  # descends past the single child `model`


def test_user_groups_regex_and_function(tmp_path):
    x, y = make_data(world=1, accum=1)
    groups = {"attn": r"\.attn\.", "mlp": r"\.mlp\.", "norms": r"\.ln\d\."}
    _, logged = _fit(tmp_path, "regex", FixedBatchLM(x, y), max_steps=2,
                     callbacks=[ClipAttributionMonitor(groups=groups, every_n_steps=2)])
    shares = {t.split("/", 2)[2]: v[0][1] for t, v in logged.items() if t.startswith("clip/share/")}
    assert set(shares) == {"attn", "mlp", "norms", "other"}
    assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-5)

    # the monitor pickles with its regex groups (ddp_spawn sends callbacks to the workers)
    import pickle

    fn_copy = pickle.loads(pickle.dumps(ClipAttributionMonitor(groups=groups)))._groups.user_fn
    assert [fn_copy(n) for n in ("model.blocks.0.attn.qkv.weight", "model.blocks.1.ln2.bias", "model.head.weight")] == \
        ["attn", "norms", None]

    # the same partition as a function gives the same shares
    def fn(name):
        for g, key in (("attn", ".attn."), ("mlp", ".mlp.")):
            if key in name:
                return g
        return "norms" if ".ln" in name else None

    _, logged2 = _fit(tmp_path, "fn", FixedBatchLM(x, y), max_steps=2, callbacks=[ClipAttributionMonitor(groups=fn, every_n_steps=2)])
    shares2 = {t.split("/", 2)[2]: v[0][1] for t, v in logged2.items() if t.startswith("clip/share/")}
    assert shares2.keys() == shares.keys() and all(math.isclose(shares[k], shares2[k], rel_tol=1e-6) for k in shares)


def test_user_block_paths_and_clear_errors(tmp_path):
    x, y = make_data(world=1, accum=1)
    _, logged = _fit(tmp_path, "paths", FixedBatchLM(x, y), max_steps=2,
                     callbacks=[StreamNormMonitor(blocks=["model.blocks.1"], every_n_steps=2)])
    assert {t for t in logged if t.startswith("stream/")} == {"stream/rms/model.blocks.1", "stream/update_ratio/model.blocks.1",
                                                              "stream/nonfinite_count"}
    with pytest.raises(ValueError, match=r"no module at path 'blocks\.7'.*named_modules"):
        _fit(tmp_path, "bad", FixedBatchLM(x, y), max_steps=1, callbacks=[StreamNormMonitor(blocks=["blocks.7"])])
    with pytest.raises(TypeError, match="list of module paths"):
        StreamNormMonitor(blocks="model.blocks.0")
    with pytest.raises(TypeError, match="mapping name->regex or a function"):
        ClipAttributionMonitor(groups=["a"])
    with pytest.raises(ValueError, match="invalid regex"):
        ClipAttributionMonitor(groups={"a": "("})
    with pytest.raises(ValueError, match="every_n_steps"):
        LayerNormInputMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="warn_amp_fraction"):
        LayerNormInputMonitor(warn_amp_fraction=2.0)
    with pytest.raises(TypeError, match="RMSNorm"):
        LayerNormInputMonitor(norm_classes=[nn.RMSNorm])


def test_interval_defaults_to_log_every_n_steps(tmp_path):
    x, y = make_data(world=1, accum=1)
    trainer = make_trainer(str(tmp_path), "default_every", accelerator="cpu", devices=1, max_steps=6, log_every_n_steps=3,
                       callbacks=[StreamNormMonitor(), LayerNormInputMonitor(), ClipAttributionMonitor()])
    trainer.fit(FixedBatchLM(x, y))
    logged = read_scalars(tmp_path / "default_every")
    for tag in ("stream/rms/model.blocks.0", "ln/var_min/model.blocks.0.ln1", "clip/total_norm"):
        assert [s for s, _ in logged[tag]] == [2, 5], tag
    assert set(NORMS) == {t.split("/", 2)[2] for t in logged if t.startswith("ln/var_min/")}
