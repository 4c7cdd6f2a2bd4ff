"""The rewrite state (ln_lightning.placement.state) on the paths a migrating user takes (issues 20 and 23).

* Every module the rewrite adds starts from the weights the run trains from: on a plugin-less continuation
  the final norm is the checkpoint's trained norm, not the freshly built model's; on a resume and in
  `load_converted`, the checkpoint's own (each against `convert(trained model)` built independently).
* The transition survives real use: a second fit continues it, a fit that ends before it says so, a
  checkpoint written mid-transition loads back into its blend whatever the model is doing now
  (`test(ckpt_path="best")`), a transition_steps the step counter can't hold is refused when built.
* No residue after a failure, no host synchronisation per training step, checkpoints read with
  `weights_only=True`.
"""

from __future__ import annotations

import copy
import warnings
import json
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.overrides import TorchFunctionMode

from _helpers_transition import HELD, LM, BlendRecorder, batch, loader, rel, stream_reference, trainer
from ln_lightning import LNLightningWarning, TransitionSpec, convert
from ln_lightning.placement import PlacementError
from ln_lightning.placement.migrate import transition
from ln_lightning.placement import state as rewrite_state
from ln_lightning.plugin import LNPlacement, load_converted


def trained_looking(module: nn.Module, seed: int = 3) -> nn.Module:
    """Norm gains and biases away from 1 and 0 (with default norms a copy of the wrong norm goes unseen)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
                m.bias.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
    return module


def frozen_lm(kind: str = "demo", seed: int = 0) -> LM:
    """An LM at learning rate 0 (AdamW then changes nothing), with trained-looking norms."""
    return trained_looking(LM(kind, lr=0.0, seed=seed, warmup_steps=1))


def plugin_less_checkpoint(tmp_path: Path, steps: int = 2, kind: str = "demo") -> tuple[Path, dict]:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "plain", every_n_train_steps=steps, save_top_k=-1)
    trainer(tmp_path, None, max_steps=steps, callbacks=[ckpt]).fit(frozen_lm(kind), train_dataloaders=loader())
    path = next((tmp_path / "plain").glob("*.ckpt"))
    return path, torch.load(path, weights_only=True)


def converted_from(saved: dict, kind: str = "demo") -> LM:
    """The reference: the checkpoint's trained post-norm weights in a fresh model, then `convert` (no plugin)."""
    reference = LM(kind, seed=7)
    reference.load_state_dict(saved["state_dict"])
    convert(reference, "pre")
    return reference.eval()


class FirstStep(Callback):
    """The model as the first training step sees it (the plugin, first callback, has set it up)."""

    def on_train_batch_start(self, trainer, pl_module, b, batch_idx):
        if not hasattr(self, "state"):
            self.state = {k: v.clone() for k, v in pl_module.state_dict().items()}
            with torch.no_grad():
                self.output = pl_module.model(batch(3)).clone()


# ---------------------------------------------------------------------------------------------- 1. trained weights
@pytest.mark.parametrize("kind", ["demo", "bert"])
def test_plugin_less_continuation_starts_from_the_trained_norms(kind, tmp_path):
    path, saved = plugin_less_checkpoint(tmp_path, kind=kind)
    reference = converted_from(saved, kind)
    added = rewrite_state.of(reference).added
    assert added and not any(k.startswith(a + ".") for k in saved["state_dict"] for a in added)  # the checkpoint lacks them
    # A hard switch: the first step already runs convert(trained model).
    first = FirstStep()
    with pytest.warns(LNLightningWarning, match="start from the trained weights they derive from"):
        trainer(tmp_path, LNPlacement("pre", resume_unconverted=True, fused=False, log_report=False), max_steps=3,
                callbacks=[first]).fit(LM(kind, lr=0.0, seed=5), train_dataloaders=loader(), ckpt_path=path)
    ref_state = reference.state_dict()
    for a in added:  # the added final norm is the trained norm it copies, not the fresh model's
        keys = [k for k in ref_state if k.startswith(a + ".")]
        assert keys and all(torch.equal(first.state[k], ref_state[k]) for k in keys), a
        source = rewrite_state.of(reference).derived[a]
        assert not torch.equal(ref_state[source + ".weight"], torch.ones_like(ref_state[source + ".weight"]))
    with torch.no_grad():
        assert rel(first.output, reference.model(batch(3))) <= 1e-6
    # A transition: exact at the switch, and its end is convert(trained model).
    first, module = FirstStep(), LM(kind, lr=0.0, seed=5)
    trainer(tmp_path, LNPlacement("pre", transition_steps=2, resume_unconverted=True, fused=False, log_report=False),
            max_steps=4, callbacks=[first]).fit(module, train_dataloaders=loader(), ckpt_path=path)
    plain = LM(kind, seed=7)
    plain.load_state_dict(saved["state_dict"])
    # ... with the branch constants the stream-scaled blend measured on the first batch, computed here independently
    stream_ref = stream_reference(plain.model, batch(1))
    with torch.no_grad():
        assert torch.equal(first.output, plain.eval().model(batch(3)))
        assert transition.active(module) is None
        assert rel(module.eval().model(batch(3)), stream_ref.eval()(batch(3))) <= 1e-6


@pytest.mark.parametrize("placement", ["peri", "output"])
def test_a_plugin_less_transition_to_peri_or_output_ends_at_convert_of_the_trained_model(placement, tmp_path):
    # The fresh module's norms differ from the checkpoint's: output's kept call-site gains and both placements'
    # exit gains must come from the trained ones, which arrive after the rewrite.
    path, saved = plugin_less_checkpoint(tmp_path, kind="demo")
    first, module = FirstStep(), LM("demo", lr=0.0, seed=5)
    trainer(tmp_path, LNPlacement(placement, transition_steps=2, resume_unconverted=True, fused=False, log_report=False),
            max_steps=4, callbacks=[first]).fit(module, train_dataloaders=loader(), ckpt_path=path)
    plain = LM("demo", seed=7)
    plain.load_state_dict(saved["state_dict"])
    stream_ref = stream_reference(plain.model, batch(1), placement)
    with torch.no_grad():
        assert torch.equal(first.output, plain.eval().model(batch(3)))
        assert transition.active(module) is None
        assert rel(module.eval().model(batch(3)), stream_ref.eval()(batch(3))) <= 1e-6
    # Mid-way too (output's call sites normalise with the kept gains there): the trained model's own transition.
    mid = LM("demo", lr=0.0, seed=5)
    with pytest.warns(LNLightningWarning, match="ended during the transition"):
        trainer(tmp_path, LNPlacement(placement, transition_steps=4, resume_unconverted=True, fused=False, log_report=False),
                max_steps=saved["global_step"] + 2).fit(mid, train_dataloaders=loader(), ckpt_path=path)
    direct = copy.deepcopy(plain.model).eval()
    transition.begin(direct, placement, branch_scale="stream")
    assert transition.measure_stream_scales(direct, lambda: direct(batch(1))) is None
    transition.set_blend(direct, 0.5)
    with torch.no_grad():
        assert transition.get_blend(mid) == 0.5
        assert rel(mid.eval().model(batch(3)), direct(batch(3))) <= 1e-6


def test_a_raw_accepted_load_starts_the_final_norm_from_the_trained_norm():
    trained = trained_looking(LM("demo", seed=1))
    model = LM("demo", seed=2)
    LNPlacement("pre", fused=False, log_report=False).rewrite(model)
    with rewrite_state.accept_unconverted(model):
        model.load_state_dict(trained.state_dict())
    reference = copy.deepcopy(trained)
    convert(reference, "pre")
    with torch.no_grad():
        assert rel(model.eval().model(batch(3)), reference.eval().model(batch(3))) <= 1e-6


def test_resume_and_load_converted_use_the_checkpoints_added_weights(tmp_path):
    module = frozen_lm()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    trainer(tmp_path, LNPlacement("pre", fused=False, log_report=False), max_steps=2, callbacks=[ckpt]).fit(
        module, train_dataloaders=loader())
    with torch.no_grad():  # the added final norm trains like any parameter: make it differ from a fresh copy
        module.model.blocks_final_norm.weight.mul_(1.5)
    path = tmp_path / "ck" / "edited.ckpt"
    saved = torch.load(next((tmp_path / "ck").glob("*.ckpt")), weights_only=True)
    saved["state_dict"] = {k: v.clone() for k, v in module.state_dict().items()}
    torch.save(saved, path)
    expected = module.eval().model(batch(3)).detach()
    loaded = load_converted(LM("demo", seed=9), path)
    assert torch.equal(loaded.model.blocks_final_norm.weight, module.model.blocks_final_norm.weight)
    assert rel(loaded.model(batch(3)), expected) <= 1e-6
    first = FirstStep()
    trainer(tmp_path, LNPlacement("pre", fused=False, log_report=False), max_steps=3, callbacks=[first]).fit(
        LM("demo", lr=0.0, seed=5), train_dataloaders=loader(), ckpt_path=path)
    assert rel(first.output, expected) <= 1e-6


# ---------------------------------------------------------------------------------------------- 3. transition state
def test_a_second_fit_continues_the_blend():
    module = LM("demo")
    plugin = lambda: LNPlacement("pre", transition=TransitionSpec(steps=4, tolerance=None, endpoint_fraction=0.0), fused=False, log_report=False)  # noqa: E731
    first, second = BlendRecorder(), BlendRecorder()
    with pytest.warns(LNLightningWarning, match="ended during the transition"):
        trainer(None, plugin(), max_steps=2, callbacks=[first]).fit(module, train_dataloaders=loader())
    with warnings.catch_warnings():
        warnings.simplefilter("error", LNLightningWarning)  # the teacher is the model's: distilled in the second fit too
        trainer(None, plugin(), max_steps=2, callbacks=[second]).fit(module, train_dataloaders=loader())
    assert first.blends == [0.0, 0.25] and second.blends == [0.5, 0.75]
    assert transition.active(module) is None and transition.leftovers(module) == []
    # Another schedule than the one it runs would make the blend jump: refused, naming the recorded one.
    module = LM("demo")
    with pytest.warns(LNLightningWarning):
        trainer(None, plugin(), max_steps=1).fit(module, train_dataloaders=loader())
    with pytest.raises(PlacementError, match="ran with 4 steps, schedule 'linear'.*not 6 steps"):
        trainer(None, LNPlacement("pre", transition_steps=6, fused=False, log_report=False), max_steps=1).fit(
            module, train_dataloaders=loader())


def test_a_run_that_ends_mid_transition_says_so_and_its_checkpoint_loads_back_into_that_blend(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module = LM("demo")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    t = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=CSVLogger(tmp_path, name="csv"), enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[ckpt],
                plugins=[LNPlacement("pre", transition_steps=5, fused=False)])
    with pytest.warns(LNLightningWarning, match=r"ended during the transition to pre-norm, at step 2 of 5 \(blend 0.4\)"):
        t.fit(module, train_dataloaders=loader())
    report = json.loads(Path(t.log_dir, "ln_placement_report.json").read_text())
    assert report["transition"] == {"steps": 5, "steps_done": 2, "blend": 0.4, "finished": False}
    loaded = load_converted(LM("demo", seed=9), tmp_path / "ck" / "last.ckpt")
    assert transition.get_blend(loaded) == pytest.approx(0.4) and transition.get_blend(loaded) == transition.get_blend(module)
    assert torch.equal(loaded.model(batch(3)), module.eval().model(batch(3)))


class _ScoredLM(LM):
    """Logs a score that is best (lowest) at step 2: the best checkpoint is one written mid-transition."""

    def training_step(self, b, batch_idx):
        self.log("score", float(abs(self.global_step - 2)))
        return super().training_step(b, batch_idx)


@pytest.mark.parametrize("stage", ["test", "validate"])
def test_best_checkpoint_written_mid_transition_gives_its_function_after_the_transition(stage, tmp_path):
    module = _ScoredLM("demo")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="score", mode="min", save_top_k=1, every_n_train_steps=1)
    t = trainer(tmp_path, LNPlacement("pre", transition_steps=4, fused=False, log_report=False), max_steps=6, callbacks=[ckpt])
    t.fit(module, train_dataloaders=loader())
    assert transition.active(module) is None  # the transition ended at step 4
    best = torch.load(ckpt.best_model_path, weights_only=True)
    assert best["state_dict"]["ln_lightning_transition.steps_done"].item() == 3  # written after step 2, mid-transition
    getattr(t, stage)(module, dataloaders=loader(), ckpt_path="best")
    reference = load_converted(_ScoredLM("demo", seed=9), ckpt.best_model_path)
    assert transition.get_blend(module) == transition.get_blend(reference) == 0.75
    assert torch.equal(module.eval().model(batch(3)), reference.model(batch(3)))


def test_transition_steps_beyond_the_step_counter_are_refused_when_built():
    LNPlacement("pre", transition_steps=2**63 - 1)
    with pytest.raises(ValueError, match=r"at most 2\*\*63 - 1"):
        LNPlacement("pre", transition_steps=2**63)


# ---------------------------------------------------------------------------------------------- no residue
class _Lazy(LM):
    """Builds its layers in configure_model (the rewrite then waits for it)."""

    def __init__(self):
        super().__init__("demo")
        self.model = None

    def configure_model(self):
        if self.model is None:
            from _helpers_transition import make

            self.model = make("demo")


class _FailIn(Callback):
    def __init__(self, hook: str):
        self.hook = hook

    def setup(self, trainer, pl_module, stage):
        if self.hook == "setup":
            raise RuntimeError("boom in setup")

    def on_train_batch_start(self, trainer, pl_module, b, batch_idx):
        if self.hook == "train":
            raise RuntimeError("boom in training")


@pytest.mark.parametrize("hook", ["setup", "train"])
def test_a_failed_fit_leaves_nothing_on_the_users_module(hook, tmp_path):
    module = _Lazy()
    before = set(vars(module))
    plugin = LNPlacement("pre", fused=False, log_report=False, resume_unconverted=True)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, plugin, max_steps=2, callbacks=[_FailIn(hook)]).fit(module, train_dataloaders=loader())
    added = set(vars(module)) - before
    # configure_model / on_load_checkpoint were patched onto the instance before; nothing of that kind now.
    assert not {"configure_model", "on_load_checkpoint"} & added, added
    assert plugin._run is None
    state = rewrite_state.of(module)
    assert state is None or state.accepting is None
    trainer(tmp_path, plugin, max_steps=2).fit(module, train_dataloaders=loader())  # a second fit just works
    assert rewrite_state.of(module) is not None


# ---------------------------------------------------------------------------------------------- no host syncs
_SYNCING = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__", "__repr__"}


class _CallsFromPlacement(TorchFunctionMode):
    """Every torch function / Tensor method called directly from the plugin or the placement package."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer
        self.calls: list[tuple[int, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        name = frame.f_code.co_filename.replace("\\", "/")
        if any(ours in name for ours in ("ln_lightning/plugin.py", "ln_lightning/_transition_run.py", "ln_lightning/_distill.py",
                                         "ln_lightning/placement/")):
            self.calls.append((self.trainer.global_step, getattr(func, "__name__", str(func)),
                               f"{Path(name).name}:{frame.f_lineno}"))
        return func(*args, **(kwargs or {}))


class _Spy(Callback):
    def on_train_start(self, trainer, pl_module):
        self.mode = _CallsFromPlacement(trainer)
        self.mode.__enter__()

    def on_train_end(self, trainer, pl_module):
        self.mode.__exit__(None, None, None)


@pytest.mark.parametrize("resumed", [False, True])
def test_the_plugin_and_the_transition_add_no_host_synchronisation_per_step(resumed, tmp_path):
    spy = _Spy()
    plugin = lambda: LNPlacement("pre", transition_steps=4, fused=False, log_report=False)  # noqa: E731
    path = None
    if resumed:
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1)
        with pytest.warns(LNLightningWarning):
            trainer(tmp_path, plugin(), max_steps=1, callbacks=[ckpt]).fit(LM("demo"), train_dataloaders=loader())
        path = next((tmp_path / "ck").glob("*.ckpt"))
    trainer(tmp_path, plugin(), max_steps=6, callbacks=[spy]).fit(LM("demo"), train_dataloaders=loader(), ckpt_path=path)
    calls = spy.mode.calls
    assert any(name == "fill_" for _, name, _ in calls)  # the spy sees the transition's per-step writes
    syncs = [c for c in calls if c[1] in _SYNCING]
    # None at all, the first step's stream-scale measurement included: on one process the host knows what the
    # forward recorded (several ranks agree on it with one read, once per transition).
    assert syncs == [], syncs


# ---------------------------------------------------------------------------------------------- safe loading
class _Opaque:
    """A hyperparameter value torch.load(weights_only=True) refuses (not on its allowlist)."""

    def __init__(self, v=1):
        self.v = v


class _HparamLM(LM):
    def __init__(self, kind: str = "demo", extra=None, **kw):
        super().__init__(kind, **kw)
        self.save_hyperparameters()


def test_load_converted_reads_with_weights_only_and_names_the_opt_out(tmp_path, monkeypatch):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    trainer(tmp_path, LNPlacement("pre", fused=False, log_report=False), max_steps=1, callbacks=[ckpt]).fit(
        _HparamLM(extra=_Opaque()), train_dataloaders=loader())
    path = tmp_path / "ck" / "last.ckpt"
    with pytest.raises(ValueError, match=r"weights_only=True\) refuses.*_Opaque.*load_converted\(\.\.\., weights_only=False\)"):
        load_converted(_HparamLM(), path)
    assert rewrite_state.of(load_converted(_HparamLM(), path, weights_only=False)) is not None  # trusted: it loads
    seen = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: seen.append(kw.get("weights_only")) or real(*a, **kw))
    plain = tmp_path / "plain.ckpt"
    saved = real(path, weights_only=False)
    saved["hyper_parameters"] = {"kind": "demo"}
    torch.save(saved, plain)
    load_converted(_HparamLM(), plain)
    assert seen == [True]


class _TwoOptimizersManual(LM):
    """Manual optimisation, two optimizers (model parameters split in two), and every third batch steps neither
    (it accumulates): the optimizer steps are then neither the batch index nor global_step."""

    def __init__(self):
        super().__init__("demo")
        self.automatic_optimization = False
        self.batches = 0  # the loader has one batch per epoch: batch_idx is always 0

    def configure_optimizers(self):
        params = list(self.parameters())
        return torch.optim.SGD(params[::2], lr=1e-3), torch.optim.SGD(params[1::2], lr=1e-3)

    def training_step(self, b, batch_idx):
        loss = self._loss(b)
        self.manual_backward(loss)
        if self.batches % 3 != 2:
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()
        self.batches += 1


def test_the_transition_advances_once_per_batch_that_steps_under_manual_optimisation_with_two_optimizers():
    clock = BlendRecorder()
    module = _TwoOptimizersManual()
    t = Trainer(accelerator="cpu", devices=1, max_epochs=6, logger=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False,
                plugins=[LNPlacement("pre", transition_steps=4, fused=False, log_report=False, **HELD)], callbacks=[clock])
    with pytest.warns(LNLightningWarning, match="without distillation.*automatic optimisation"):
        t.fit(module, train_dataloaders=loader())
    # Batches 0, 1, 3, 4 step (both optimizers: one step of the transition each); 2 and 5 step neither (Lightning's
    # batches-that-stepped counter counts every batch under manual optimisation, so it can't be the clock here).
    assert clock.blends == [0.0, 0.25, 0.5, 0.5, 0.75, None]  # k/N after k stepping batches; ended at the 4th
    assert t.global_step == 8  # Lightning counts each optimizer's step: the transition must not
    assert transition.active(module) is None and transition.leftovers(module) == []
