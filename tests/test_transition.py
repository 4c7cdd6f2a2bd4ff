"""Issue 11: the function-preserving post-norm -> pre-norm transition (ln_lightning.placement.migrate.transition).

Exactness is the point: at blend 0 the model computes the unconverted post-norm function, at blend 1
(and after `finish`) exactly `convert(model, "pre")`; `finish` leaves nothing behind.
"""

from __future__ import annotations

import copy
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ln_lightning
from ln_lightning import LNLightningWarning, PlacementSpec, TransitionSpec
from ln_lightning.demo import PostNormTransformerLM
from ln_lightning.placement import PlacementError, convert
from ln_lightning.placement.migrate import transition
from ln_lightning.placement.migrate import blend as placement_blend
from ln_lightning.placement.rewrite import hooks as placement_hooks
from ln_lightning.placement import state as rewrite_state
from ln_lightning.placement.migrate.transition_control import endpoint_step
from ln_lightning.plugin import LNPlacement, load_converted

from _helpers_transition import HELD, KINDS, LM, PLAIN, TINY, BlendRecorder, TorchEncoderLM, batch, loader, loss_of, make, rel, stream_reference, trainer


# ---------------------------------------------------------------------------------------------- the mechanism
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("branch_scale", [None, "depth", "layerscale"])
def test_blend_is_post_at_0_and_pre_at_1(kind, branch_scale):
    model = make(kind)
    x = batch()
    post = model(x)
    reference = copy.deepcopy(model)
    convert(reference, "pre", branch_scale=branch_scale)
    pre = reference(x)
    transition.begin(model, branch_scale=branch_scale, steps=4)
    assert rel(model(x), post) <= 1e-6  # in fact 0: 1*x + 0*y == x in floating point
    assert torch.equal(model(x), post)
    transition.set_blend(model, 0.5)
    half = model(x)
    assert rel(half, post) > 1e-4 and rel(half, pre) > 1e-4  # in between, not one of the ends
    transition.set_blend(model, 1.0)
    assert rel(model(x), pre) <= 1e-6
    transition.finish(model)
    assert transition.leftovers(model) == []
    assert torch.equal(model(x), pre)
    # Structurally the converted model: same classes, same state_dict keys, no blend anywhere.
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    assert list(model.state_dict()) == list(reference.state_dict())


def test_gradients_at_0_are_the_post_norm_gradients():
    model = make("demo")
    post = copy.deepcopy(model)
    x = batch()
    transition.begin(model)
    loss_of_grad = lambda m: F.cross_entropy(m(x).reshape(-1, TINY["vocab_size"]), x.reshape(-1))
    loss_of_grad(model).backward()
    loss_of_grad(post).backward()
    gm = dict(model.named_parameters())
    for name, p in post.named_parameters():
        assert torch.allclose(gm[name].grad, p.grad, rtol=1e-5, atol=1e-7), name


def test_torch_decoder_layer_blends():
    torch.manual_seed(0)

    class Dec(nn.Module):
        def __init__(self):
            super().__init__()
            self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)

        def forward(self, x):
            return self.dec(x, x.flip(1))

    model = Dec()
    x = torch.randn(2, 6, 16)
    post = model(x)
    ref = copy.deepcopy(model)
    convert(ref, "pre", example_input=x)
    transition.begin(model, example_input=x)
    assert torch.equal(model(x), post)
    transition.set_blend(model, 1.0)
    assert rel(model(x), ref(x)) <= 1e-6
    transition.finish(model)
    assert transition.leftovers(model) == []


def test_state_dict_deepcopy_and_pickle_keep_the_blend():
    model = make("demo")
    transition.begin(model)
    transition.set_blend(model, 0.25)
    x = batch()
    y = model(x)
    assert "ln_lightning_transition.blend" in model.state_dict()
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert transition.get_blend(other) == 0.25
        assert torch.equal(other(x), y)
        transition.finish(other)  # the copy's machinery is its own
        assert transition.leftovers(other) == []
    assert torch.equal(model(x), y)
    fresh = make("demo")
    transition.begin(fresh)
    fresh.load_state_dict(model.state_dict())
    assert transition.get_blend(fresh) == 0.25 and torch.equal(fresh(x), y)


def test_a_finished_state_dict_finishes_the_transition_it_is_loaded_into():
    # ddp_spawn's rank 0 sends its weights (transition finished) to the main process, still at blend 0.
    done = make("demo")
    transition.begin(done)
    transition.finish(done)
    from ln_lightning.placement import state

    state.of(done).mark(done)  # what LNPlacement does: the state_dict then says it was saved from the rewrite
    target = make("demo")
    transition.begin(target)
    state.of(target).mark(target)
    target.load_state_dict(done.state_dict(), strict=False)
    assert transition.active(target) is None and transition.leftovers(target) == []


def test_errors_name_the_problem():
    model = make("demo")
    with pytest.raises(PlacementError, match="not in a transition"):
        transition.set_blend(model, 0.5)
    transition.begin(model)
    with pytest.raises(PlacementError, match=r"\[0, 1\]"):
        transition.set_blend(model, 1.5)
    with pytest.raises(PlacementError, match="in a placement transition"):
        convert(model, "post")
    with pytest.raises(PlacementError, match="already in a transition"):
        transition.start(model, None)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        LNPlacement("pre", transition=0)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        LNPlacement("pre", transition=TransitionSpec(steps=0))
    with pytest.raises(ValueError, match="placement=.post. can.t preserve the function"):
        LNPlacement("post", transition=3)
    with pytest.raises(ValueError, match="unknown schedule"):
        LNPlacement("pre", transition=TransitionSpec(steps=3, tolerance=None, schedule="step"))
    with pytest.raises(ValueError, match="schedule applies to the open loop"):
        TransitionSpec(steps=3, schedule="cosine")  # the closed loop's blend follows the drift, not a schedule
    with pytest.raises(ValueError, match="tolerance must be a positive number"):
        TransitionSpec(steps=3, tolerance=0)
    with pytest.raises(TypeError, match="transition must be a TransitionSpec"):
        LNPlacement("pre", transition=3.0)


def test_torch_layer_subclass_is_refused():
    class MyLayer(nn.TransformerEncoderLayer):
        def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
            return super().forward(src, src_mask, src_key_padding_mask, is_causal) * 1.0

    model = TorchEncoderLM()
    model.enc.layers = nn.ModuleList(MyLayer(32, 2, 64, dropout=0.0, batch_first=True) for _ in range(2))
    report = convert(model, "pre")
    assert report.converted
    with pytest.raises(PlacementError, match="MyLayer"):
        transition.start(model, report)
    assert transition.active(model) is None and transition.leftovers(model) == []  # refused before any change


def test_schedules():
    assert transition.schedule(0) == 0.0 and transition.schedule(1) == 1.0
    assert transition.schedule(0, "cosine") == 0.0 and transition.schedule(1, "cosine") == 1.0
    assert transition.schedule(0.5, "cosine") == pytest.approx(0.5)
    assert transition.schedule(0.25, "cosine") < 0.25


# ---------------------------------------------------------------------------------------------- the plugin
@pytest.mark.parametrize("blend", ["stream", "plain"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_plugin_first_loss_is_the_unconverted_loss_and_ends_at_convert(kind, blend, tmp_path):
    n = 4
    # lr 0: the weights stay, so each step's loss is the function at that step's blend.
    module = LM(kind, lr=0.0)
    unconverted = copy.deepcopy(module.model)
    rec = BlendRecorder()
    options = HELD if blend == "stream" else PLAIN
    trainer(tmp_path, LNPlacement("pre", transition_steps=n, fused=False, log_report=False, **options), max_steps=n + 1,
            callbacks=[rec]).fit(module, train_dataloaders=loader())
    x = batch(1)
    first = loss_of(unconverted, x)
    assert abs(module.losses[0] - first) <= 1e-6 * abs(first)
    assert rec.blends == [0.0, 0.25, 0.5, 0.75, None]  # finished after step N: plain pre-norm for step N+1
    assert transition.leftovers(module) == []
    if blend == "stream":  # the branch constants measured on the first batch (x), computed here independently
        reference = stream_reference(unconverted, x)
    else:
        reference = copy.deepcopy(unconverted)
        convert(reference, "pre")
    assert rel(module.model(x), reference(x)) <= 1e-6
    assert abs(module.losses[-1] - loss_of(reference, x)) <= 1e-6 * loss_of(reference, x)


@pytest.mark.parametrize("kind", ["demo", "torch"])
def test_plugin_trained_weights_end_as_their_pre_norm_rewrite(kind, tmp_path):
    n = 3
    module = LM(kind, lr=1e-2)
    fresh = copy.deepcopy(module.model)
    trainer(tmp_path, LNPlacement("pre", transition_steps=n, transition_schedule="cosine", log_report=False),
            max_steps=n).fit(module, train_dataloaders=loader())
    assert transition.active(module) is None and transition.leftovers(module) == []
    # The same weights in a model convert() rewrote (with the fused norms LNPlacement swaps in).
    from ln_lightning.norm import swap_layernorms

    swap_layernorms(fresh)
    convert(fresh, "pre", branch_scale="stream")  # its constants load with the weights
    result = fresh.load_state_dict(module.model.state_dict(), strict=False)
    assert result.missing_keys == [] and all(k.endswith("ln_lightning_placement") for k in result.unexpected_keys)  # LNPlacement's marker
    assert [type(m) for m in fresh.modules()] == [type(m) for m in module.model.modules()]
    x = batch(3)
    assert rel(module.model(x), fresh(x)) <= 1e-6


def test_plugin_resume_at_half_gives_the_uninterrupted_weights(tmp_path):
    n, total = 4, 6
    plugin = lambda: LNPlacement("pre", transition_steps=n, fused=False, log_report=False, **HELD)
    straight = LM("demo")
    trainer(tmp_path / "a", plugin(), max_steps=total).fit(straight, train_dataloaders=loader())
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=n // 2, save_top_k=-1)
    first = LM("demo")
    trainer(tmp_path / "b", plugin(), max_steps=n // 2, callbacks=[ckpt]).fit(first, train_dataloaders=loader())
    path = next((tmp_path / "ck").glob("*step=2*.ckpt"))
    saved = torch.load(path, weights_only=False)
    assert "ln_lightning_teacher" in saved  # the distillation's trained function: the resumed run distils towards it
    # After 2 of 4 steps: 2 steps done, and the blend the next step runs with.
    assert saved["state_dict"]["ln_lightning_transition.steps_done"].item() == 2
    assert saved["state_dict"]["ln_lightning_transition.blend"].item() == 0.5
    # Mid-transition, load_converted restores the blend (inference).
    loaded = load_converted(LM("demo"), path)
    assert transition.get_blend(loaded) == 0.5
    assert rel(loaded.model(batch(3)), first.model.eval()(batch(3))) <= 1e-6
    # validate(ckpt_path) on a fresh model runs the checkpoint's blend, with or without transition_steps.
    for p in (plugin(), LNPlacement(PlacementSpec("pre", branch_scale="stream"), fused=False, log_report=False)):
        evaluated = LM("demo")
        Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                plugins=[p]).validate(evaluated, dataloaders=loader(), ckpt_path=path)
        assert transition.get_blend(evaluated) == 0.5
    # Fitting from it without transition_steps would train a blend that never moves: refused, naming the values.
    with pytest.raises(PlacementError, match=r"in a placement transition.*transition=TransitionSpec\(steps=4, tolerance=None\)"):
        trainer(tmp_path / "e", LNPlacement(PlacementSpec("pre", branch_scale="stream"), fused=False, log_report=False), max_steps=total).fit(
            LM("demo"), train_dataloaders=loader(), ckpt_path=path)
    resumed = LM("demo")
    rec = BlendRecorder()
    trainer(tmp_path / "c", plugin(), max_steps=total, callbacks=[rec]).fit(resumed, train_dataloaders=loader(), ckpt_path=path)
    assert rec.blends == [0.5, 0.75, None, None]
    with pytest.raises(PlacementError, match="ran with 4 steps, schedule 'linear'.*not 5 steps"):
        trainer(tmp_path / "d", LNPlacement("pre", transition_steps=5, fused=False, log_report=False), max_steps=total).fit(
            LM("demo"), train_dataloaders=loader(), ckpt_path=path)
    a, b = straight.state_dict(), resumed.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-6, atol=1e-7), k


def test_plugin_resume_after_the_transition_ended(tmp_path):
    n = 2
    plugin = lambda: LNPlacement("pre", transition_steps=n, fused=False, log_report=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp_path, plugin(), max_steps=3, callbacks=[ckpt]).fit(LM("demo"), train_dataloaders=loader())
    path = next((tmp_path / "ck").glob("*.ckpt"))
    assert not any(k.startswith("ln_lightning_transition") for k in torch.load(path, weights_only=False)["state_dict"])
    resumed = LM("demo")
    rec = BlendRecorder()
    trainer(tmp_path, plugin(), max_steps=5, callbacks=[rec]).fit(resumed, train_dataloaders=loader(), ckpt_path=path)
    assert rec.blends == [None, None] and transition.leftovers(resumed) == []


# ---------------------------------------------------------------------------------------------- continuation
class ResumeProbe(Callback):
    """At the first step after the resume: the step, the loss on a fixed batch, the optimizer and scheduler state."""

    def __init__(self, x):
        self.x = x
        self.seen = None

    def on_train_batch_start(self, trainer, pl_module, b, batch_idx):
        if self.seen is None:
            opt = trainer.optimizers[0]
            self.seen = {
                "step": trainer.global_step,
                "blend": transition.get_blend(pl_module),
                "loss": loss_of(pl_module, self.x),
                "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in pl_module.named_parameters() if p in opt.state},
                "sched": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            }


@pytest.mark.parametrize("final_norm", [True, False])
def test_plugin_less_checkpoint_continues_as_pre_norm(final_norm, tmp_path):
    s = 3
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=s, save_top_k=-1)
    trainer(tmp_path, None, max_steps=s, callbacks=[ckpt]).fit(LM("demo"), train_dataloaders=loader())
    path = next((tmp_path / "ck").glob("*.ckpt"))
    saved = torch.load(path, weights_only=False)
    plain = LM("demo", seed=5)
    plain.load_state_dict(saved["state_dict"])
    x = batch(7)
    before = loss_of(plain, x)

    resumed = LM("demo", seed=5)
    probe = ResumeProbe(x)
    rec = BlendRecorder()
    plugin = LNPlacement(PlacementSpec("pre", final_norm=final_norm), transition_steps=4, resume_unconverted=True, fused=False, log_report=False, **HELD)
    with pytest.warns(UserWarning, match="exactly the function they were trained for and moves to pre-norm"):
        trainer(tmp_path, plugin, max_steps=s + 5, callbacks=[probe, rec]).fit(resumed, train_dataloaders=loader(), ckpt_path=path)
    seen = probe.seen
    assert seen["step"] == s and seen["blend"] == 0.0
    assert abs(seen["loss"] - before) <= 1e-6 * abs(before)
    assert seen["sched"] == saved["lr_schedulers"][0]["last_epoch"]
    # The optimizer state of every existing parameter is the checkpoint's (AdamW lists them in module order).
    old_names = [n for n, _ in plain.named_parameters()]
    saved_state = saved["optimizer_states"][0]["state"]
    for i, name in enumerate(old_names):
        assert torch.equal(seen["exp_avg"][name], saved_state[i]["exp_avg"]), name
    assert set(seen["exp_avg"]) == set(old_names)  # added parameters start fresh
    assert rec.blends == [0.0, 0.25, 0.5, 0.75, None]  # the transition starts at the checkpoint's step
    assert transition.leftovers(resumed) == []


def test_plugin_less_checkpoint_without_the_opt_in_is_refused(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    trainer(tmp_path, None, max_steps=2, callbacks=[ckpt]).fit(LM("demo"), train_dataloaders=loader())
    path = next((tmp_path / "ck").glob("*.ckpt"))
    with pytest.raises(RuntimeError, match="resume_unconverted=True"):
        trainer(tmp_path, LNPlacement("pre", transition_steps=3, fused=False, log_report=False), max_steps=4).fit(
            LM("demo"), train_dataloaders=loader(), ckpt_path=path)


# ---------------------------------------------------------------------------------------------- ddp_spawn
class BlendFile(Callback):
    """Each rank writes the blend of every step it ran (the callback is pickled into the spawned workers)."""

    def __init__(self, out: str):
        self.out = out
        self.blends: list = []

    def on_train_batch_start(self, trainer, pl_module, b, batch_idx):
        self.blends.append([trainer.global_step, transition.get_blend(pl_module)])

    def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx):
        kl = trainer.callback_metrics.get("ln_placement/distill_kl")
        self.__dict__.setdefault("kl", []).append(None if kl is None else float(kl))

    def on_train_end(self, trainer, pl_module):
        import json

        Path(self.out, f"blends_rank{trainer.global_rank}.json").write_text(json.dumps(self.blends))
        Path(self.out, f"kl_rank{trainer.global_rank}.json").write_text(json.dumps(self.__dict__.get("kl", [])))
        scales = {n: b.tolist() for n, b in pl_module.named_buffers() if n.endswith("_scale.c")}
        Path(self.out, f"scales_rank{trainer.global_rank}.json").write_text(json.dumps(scales))


def _ddp_spawn_trainer(tmp_path, max_steps: int, placement: str, record) -> Trainer:
    """A ddp_spawn x2 CPU fit with a 3-step transition; `record` (a callback class) writes each rank's file."""
    from ln_lightning.testing.dist import DestroyProcessGroupAtExit

    return Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=max_steps, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
                   plugins=[LNPlacement(placement, transition_steps=3, fused=False, log_report=False)],
                   callbacks=[record(str(tmp_path)), DestroyProcessGroupAtExit()])


@pytest.mark.slow
def test_ddp_spawn_every_rank_has_the_same_blend(tmp_path):
    import json

    module = LM("demo")
    t = _ddp_spawn_trainer(tmp_path, 5, "pre", BlendFile)
    unconverted = copy.deepcopy(module.model)
    t.fit(module, train_dataloaders=loader())
    ranks = [json.loads(Path(tmp_path, f"blends_rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    # The blend each step holds (what a callback sees, endpoint step or not; the same on every rank).
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()
    assert ranks[0] == [[0, 0.0], [1, f32(1 / 3)], [2, f32(2 / 3)], [3, None], [4, None]]
    # The main process got rank 0's weights (transition over) and ended its own transition with them.
    assert transition.active(module) is None and transition.leftovers(module) == []
    # The stream scales: the same on both ranks, and the mean over the ranks' first batches (the sampler gives
    # rank r the samples r, r+2), computed here from the unconverted model.
    scales = [json.loads(Path(tmp_path, f"scales_rank{r}.json").read_text()) for r in range(2)]
    assert scales[0] == scales[1] and len(scales[0]) == 4
    x = batch(1)
    order = ["blocks.0.attn_scale.c", "blocks.0.mlp_scale.c", "blocks.1.attn_scale.c", "blocks.1.mlp_scale.c"]  # stream order
    per_rank = [[dict(stream_reference(unconverted, x[r::2]).named_buffers())[k].item() for k in order] for r in range(2)]
    ratios = [[c[i + 1] / c[i] for i in range(3)] for c in per_rank]  # each rank's sigma/|gamma| per site
    want = [1.0]
    for i in range(3):
        want.append(want[-1] * (ratios[0][i] + ratios[1][i]) / 2)  # C_{k+1} = C_k x the ratio's mean over ranks
    got = [scales[0]["model." + k] for k in order]
    assert got[0] == 1.0 and all(abs(g - w) <= 1e-5 * w for g, w in zip(got, want)), (got, want)
    assert per_rank[0] != per_rank[1]  # the ranks' batches differ: the reduction is what makes them agree
    kl = [json.loads(Path(tmp_path, f"kl_rank{r}.json").read_text()) for r in range(2)]
    assert all(k[i] is not None for k in kl for i in range(3)) and kl[0][1] != kl[1][1]  # distilled on each rank's batch


class GainFile(Callback):
    """Each rank writes the gains of the norms at its branch exits (peri: the added output norms; output: the moved
    norms) and the entries' stream scales (output) at the end of the fit."""

    def __init__(self, out: str):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        import json

        gains = {n: p.tolist() for n, p in pl_module.named_parameters()
                 if n.endswith(("out_norm.weight", "ln1.weight", "ln2.weight"))}
        gains.update({n: b.tolist() for n, b in pl_module.named_buffers() if n.endswith("_in_scale.c")})
        Path(self.out, f"gains_rank{trainer.global_rank}.json").write_text(json.dumps(gains))


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["peri", "output"])
def test_ddp_spawn_exit_gains_are_the_same_on_every_rank(placement, tmp_path):
    import json

    # lr 0: the gains are what the measurement set (DDP does not synchronise parameters after its start, so ranks
    # that measured alone would keep different gains); each rank's batch differs.
    t = _ddp_spawn_trainer(tmp_path, 2, placement, GainFile)
    t.fit(LM("demo", lr=0.0), train_dataloaders=loader())  # (its "ended during the transition" warning: in the workers)
    gains = [json.loads(Path(tmp_path, f"gains_rank{r}.json").read_text()) for r in range(2)]
    exits = {k: v for k, v in gains[0].items() if k.endswith("weight") and (placement == "output") != ("out_norm" in k)}
    assert gains[0] == gains[1] and len(exits) == 4
    assert all(len(set(g)) == 1 and g[0] != 1.0 for g in exits.values())  # measured: one value per norm, not 1
    if placement == "output":
        scales = [v for k, v in gains[0].items() if k.endswith("_in_scale.c")]
        assert len(scales) == 4 and scales[0] == 1.0 and len(set(scales)) == 4


def test_blend_is_logged_and_validate_uses_it(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module = LM("demo", lr=0.0)
    unconverted = copy.deepcopy(module.model)
    t = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                limit_val_batches=0, plugins=[LNPlacement("pre", transition_steps=4, fused=False, log_report=False)])
    t.fit(module, train_dataloaders=loader())
    import csv

    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    assert [float(r["ln_placement/transition"]) for r in rows if r.get("ln_placement/transition")] == [0.0, 0.25]
    # Stopped mid-transition after 2 of 4 steps: the model is at the blend its next step would run with, in eval too.
    assert transition.get_blend(module) == 0.5
    x = batch(3)
    assert rel(module.model.eval()(x), unconverted(x)) > 1e-4  # not the post-norm function any more
    transition.set_blend(module, 0.0)
    assert torch.equal(module.model(x), unconverted.eval()(x))


def test_x_transformers_slot_final_norm_blends():
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = xt.Encoder(dim=16, depth=2, heads=2, pre_norm=False)
    x = torch.randn(2, 5, 16)
    post = model(x)
    ref = copy.deepcopy(model)
    convert(ref, "pre", example_input=x)
    report = transition.begin(model, example_input=x)
    assert report.added == ["final_norm"]
    assert torch.equal(model(x), post)
    transition.set_blend(model, 1.0)
    assert rel(model(x), ref(x)) <= 1e-6
    transition.finish(model)
    assert transition.leftovers(model) == [] and torch.equal(model(x), ref(x))


@pytest.mark.parametrize("placement", ["peri", "output"])
def test_x_transformers_stream_scaled_peri_and_output_hold_the_scale_in_gamma(placement):
    # x-transformers' LayerNorm keeps its gain in `gamma` (plus `unit_offset`) around an affine-free nn.LayerNorm.
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=64, max_seq_len=16,
                                  attn_layers=xt.Decoder(dim=32, depth=3, heads=2, pre_norm=False)).eval()
    with torch.no_grad():  # trained-looking gains: the stream's constants well above 1
        for m in model.modules():
            if isinstance(getattr(m, "gamma", None), nn.Parameter):
                m.gamma.uniform_(0.2, 0.4)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        post = model(x)
    plain = copy.deepcopy(model)
    transition.begin(model, placement, branch_scale="stream", example_input=x[:1])
    assert transition.measure_stream_scales(model, lambda: model(x[:1])) is None  # measured, not the plain fallback
    transition.begin(plain, placement, example_input=x[:1])
    with torch.no_grad():
        assert torch.equal(model(x), post)
        transition.set_blend(model, 0.5), transition.set_blend(plain, 0.5)
        assert rel(model(x), post) < 0.25 * rel(plain(x), post)  # (measured: 0.16 / 0.09 against 1.1)
        transition.set_blend(model, 1.0)
        at_one = model(x)
        transition.finish(model)
        assert torch.equal(model(x), at_one) and transition.leftovers(model) == []
    # The exit norms (peri: the added ones; output: the layers' own, moved) hold one measured value per norm.
    exit_gains = [m.gamma for n, m in model.named_modules() if isinstance(getattr(m, "gamma", None), nn.Parameter)
                  and (n.endswith("_out_norm") if placement == "peri" else n.startswith("attn_layers.layers."))]
    assert len(exit_gains) == 6 and all(len(set(g.tolist())) == 1 and g[0] != 1.0 for g in exit_gains)


def test_transition_steps_on_a_model_already_converted_is_refused(tmp_path):
    module = LM("demo")
    convert(module, "pre")
    with pytest.raises(ValueError, match="a transition needs the model as written"):
        trainer(tmp_path, LNPlacement("pre", transition_steps=3, fused=False, log_report=False, **PLAIN), max_steps=1).fit(
            module, train_dataloaders=loader())


class AdamSteps(Callback):
    """After the second optimizer step: AdamW's step count per parameter name."""

    def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx):
        if trainer.global_step == 2 and not hasattr(self, "steps"):
            state = trainer.optimizers[0].state
            self.steps = {n: int(state[p]["step"]) for n, p in pl_module.named_parameters() if p in state}


def test_output_moved_norms_start_their_exit_role_with_fresh_optimizer_state(tmp_path):
    # At the measurement (the first step) a moved norm's gain stops serving its call site (which keeps its values)
    # and starts serving the branch exit: the AdamW moments it gathered at the call site are dropped there.
    rec = AdamSteps()
    trainer(tmp_path, LNPlacement("output", transition_steps=4, fused=False, log_report=False), max_steps=3,
            callbacks=[rec]).fit(LM("demo"), train_dataloaders=loader())
    moved = {n: v for n, v in rec.steps.items() if n.endswith(("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"))}
    assert len(moved) == 8 and set(moved.values()) == {1}
    assert {v for n, v in rec.steps.items() if n not in moved} == {2}


@pytest.mark.parametrize("placement", ["pre", "output"])
def test_gradient_accumulation_keeps_one_blend_per_optimizer_step(placement, tmp_path):
    rec = BlendRecorder()
    module = LM("demo")
    x = batch(1)
    dl = DataLoader(TensorDataset(torch.cat([x, x]), torch.roll(torch.cat([x, x]), -1, dims=1)), batch_size=4)
    unconverted = copy.deepcopy(module.model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LNLightningWarning)  # the scales are measured (once: the first micro-batch)
        trainer(tmp_path, LNPlacement(placement, transition=TransitionSpec(steps=2, tolerance=None, endpoint_fraction=0.0), fused=False, log_report=False), max_steps=3,
                callbacks=[rec], accumulate_grad_batches=2).fit(module, train_dataloaders=dl)
    assert rec.blends == [0.0, 0.0, 0.5, 0.5, None, None]
    reference = stream_reference(unconverted, x, placement)  # (output: its entries' InputScale `_in_scale.c`)
    ref = dict(reference.named_buffers())
    got = {n: b for n, b in module.model.named_buffers() if n.endswith("_scale.c")}
    assert len(got) == 4 and all(abs(b.item() - ref[n].item()) <= 1e-5 * ref[n].item() for n, b in got.items())


def test_endpoint_steps_train_at_blend_1_and_the_model_holds_the_schedule(tmp_path):
    n, fraction = 12, 0.4
    rec, held = BlendRecorder(), []

    class Held(Callback):  # after LNPlacement's end-of-batch hook: the blend validation and checkpoints see
        def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx):
            held.append(transition.get_blend(pl_module))

    trained_at = []

    class TrainedAt(Callback):  # the blend the training forward computes with (read inside it)
        def on_train_start(self, trainer, pl_module):
            pl_module.model.register_forward_pre_hook(
                lambda m, args: trained_at.append(transition.active(pl_module).a(torch.zeros(())).item()))

    spec = TransitionSpec(steps=n, tolerance=None, endpoint_fraction=fraction)
    trainer(tmp_path, LNPlacement("pre", transition=spec, fused=False, log_report=False), max_steps=n - 1,
            callbacks=[rec, Held(), TrainedAt()]).fit(LM("demo"), train_dataloaders=loader())
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()
    endpoint = [endpoint_step(i, n, fraction) for i in range(n - 1)]
    assert 2 <= sum(endpoint) <= n - 3 and not endpoint[0]  # some, never the first
    assert trained_at == [1.0 if e else f32(i / n) for i, e in enumerate(endpoint)]
    # What a callback sees, in every hook around the step, is the blend the model holds (issue 31, point 5).
    assert rec.blends == [f32(i / n) for i in range(n - 1)]
    assert held == [f32((i + 1) / n) for i in range(n - 1)]


def test_stream_scales_that_cant_be_measured_fall_back_to_the_plain_blend_with_a_warning(tmp_path):
    class TwoForwards(LM):  # two forwards in a step: a site runs twice, one scale can't describe it
        def training_step(self, b, batch_idx):
            return self._loss(b) + 0.0 * self._loss(b)

    module = TwoForwards("demo", lr=0.0)
    unconverted = copy.deepcopy(module.model)
    with pytest.warns(LNLightningWarning, match="stream scales could not be measured.*ran more than once.*plain blend"):
        trainer(tmp_path, LNPlacement("pre", transition_steps=2, fused=False, log_report=False), max_steps=3).fit(
            module, train_dataloaders=loader())
    reference = copy.deepcopy(unconverted)
    convert(reference, "pre")
    x = batch(3)
    assert rel(module.model.eval()(x), reference.eval()(x)) <= 1e-6  # every scale 1: plain pre-norm


def test_bf16_blend_is_exact_at_both_ends():
    model = make("demo").to(torch.bfloat16)
    x = batch()
    post = model(x)
    ref = copy.deepcopy(model)
    convert(ref, "pre")
    transition.begin(model)
    assert model(x).dtype == torch.bfloat16 and torch.equal(model(x), post)
    transition.set_blend(model, 1.0)
    assert torch.equal(model(x), ref(x))


# ---------------------------------------------------------------------------------------------- ddp / FSDP2 (scripts)
class MPLM(LM):
    """LM for ModelParallelStrategy: FSDP2 `fully_shard` in configure_model (after the rewrite)."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if any(hasattr(p, "full_tensor") for p in self.parameters()):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _script(mode: str, out: str) -> None:
    """Run as `python tests/test_transition.py MODE OUT` (ddp and ModelParallelStrategy re-run the command line)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from ln_lightning.testing.dist import DestroyProcessGroupAtExit

    import json

    torch.set_num_threads(1)
    strategy = "ddp" if mode == "ddp" else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    placement = "output" if mode.endswith("-output") else "pre"
    # (output at lr 0: the gains its call sites keep, taken after the first step, are the trained ones)
    module = LM("demo") if mode == "ddp" else MPLM("demo", **({"lr": 0.0} if placement == "output" else {}))
    kept = KeptGainsFile(out)
    if placement == "output":  # trained-looking gains, the same on both ranks: what the call sites must keep
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for m in module.model.blocks.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
        kept.trained = sorted(m.weight.tolist() for m in module.model.blocks.modules() if isinstance(m, nn.LayerNorm))
    t = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=5, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
                default_root_dir=out, plugins=[LNPlacement(placement, transition_steps=3, fused=False, log_report=False)],
                callbacks=[BlendFile(out), kept, DestroyProcessGroupAtExit()])
    t.fit(module, train_dataloaders=loader())
    Path(out, f"left_rank{t.global_rank}.json").write_text(json.dumps(transition.leftovers(module)))


class KeptGainsFile(Callback):
    """After the first step, each rank writes the gains output's call sites keep (whole, on FSDP2) and the trained ones."""

    def __init__(self, out: str):
        self.out, self.trained = out, None

    def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx):
        import json

        if trainer.global_step == 1 and self.trained is not None:  # (the first step: measured, mid-blend)
            kept = sorted(v.tolist() for n, v in pl_module.named_buffers() if ".frozen." in n and n.endswith(".weight"))
            Path(self.out, f"kept_rank{trainer.global_rank}.json").write_text(json.dumps([kept, self.trained]))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "fsdp2-output"])
def test_ddp_and_fsdp2_every_rank_has_the_same_blend(mode, tmp_path):
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__, mode, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads(Path(tmp_path, f"blends_rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] and [b for _, b in ranks[0]][-2:] == [None, None] and ranks[0][0] == [0, 0.0]
    assert all(json.loads(Path(tmp_path, f"left_rank{r}.json").read_text()) == [] for r in range(2))
    scales = [json.loads(Path(tmp_path, f"scales_rank{r}.json").read_text()) for r in range(2)]
    assert scales[0] == scales[1] and len(scales[0]) == 4 and sum(v != 1.0 for v in scales[0].values()) == 3  # measured, alike
    kl = [json.loads(Path(tmp_path, f"kl_rank{r}.json").read_text()) for r in range(2)]
    if mode == "ddp":  # distilled on every rank; FSDP2 shards the model: the transition runs without (it warns)
        assert all(k[i] is not None for k in kl for i in range(3))
    else:
        assert all(v is None for k in kl for v in k)
    if mode == "fsdp2-output":  # the call sites kept the trained gains, gathered whole from their shards on each rank
        for r in range(2):
            kept, trained = json.loads(Path(tmp_path, f"kept_rank{r}.json").read_text())
            assert len(kept) == 4 and kept == trained


if __name__ == "__main__":
    _script(sys.argv[1], sys.argv[2])


def test_dashboard_shows_the_transition_next_to_the_stream_charts(tmp_path):
    from ln_lightning.callbacks import StreamNormMonitor
    from ln_lightning.callbacks.dashboard import monitor_layout

    # The chart follows the model's rewrite state: there while its transition runs (here: 1 of 3 steps done).
    t = trainer(tmp_path, LNPlacement("pre", transition_steps=3, fused=False, log_report=False), max_steps=1,
                callbacks=[StreamNormMonitor()])
    with pytest.warns(UserWarning, match="ended during the transition"):
        t.fit(LM("demo"), train_dataloaders=loader())
    stream = monitor_layout(t)["ln-lightning: residual stream"]
    assert stream["placement transition (0 as trained, 1 converted)"] == ["Multiline", ["ln_placement/transition"]]
    plain = trainer(tmp_path, LNPlacement("pre", fused=False, log_report=False), max_steps=1, callbacks=[StreamNormMonitor()])
    plain.fit(LM("demo"), train_dataloaders=loader())
    assert not any("transition" in title for cat in monitor_layout(plain).values() for title in cat)


def test_stream_monitor_sees_the_transition(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from ln_lightning.callbacks import StreamNormMonitor

    module = LM("demo", lr=0.0)
    t = Trainer(accelerator="cpu", devices=1, max_steps=4, logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                limit_val_batches=0, plugins=[LNPlacement("pre", transition_steps=2, fused=False, log_report=False)],
                callbacks=[StreamNormMonitor(every_n_steps=1, log_depth_profile=False)])
    t.fit(module, train_dataloaders=loader())
    rows = [r for r in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()) if r.get("stream/rms/model.blocks.1")]
    rms = [float(r["stream/rms/model.blocks.1"]) for r in rows]
    assert len(rms) == 4
    # Blend 0: the block's output is its LayerNorm's (weight 1, bias 0): rms 1. Pre-norm after step 2: the raw stream.
    assert abs(rms[0] - 1.0) < 1e-3 and abs(rms[3] - 1.0) > 1e-2 and rms[1] != rms[0]


# ---------------------------------------------------------------------------------------------- distillation
class KLRecorder(Callback):
    def __init__(self):
        self.kl, self.loss = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx):
        kl = trainer.callback_metrics.get("ln_placement/distill_kl")
        self.kl.append(None if kl is None else float(kl))
        self.loss.append(float(outputs["loss"]))


def test_distillation_adds_the_kl_to_the_trained_function_to_the_loss(tmp_path):
    n, w = 4, 0.7
    module = LM("demo", lr=0.0)  # the weights stay: the model at step i is the blend i/n of the trained function
    unconverted = copy.deepcopy(module.model)
    rec = KLRecorder()
    trainer(tmp_path, LNPlacement("pre", transition_steps=n, transition_distill=w, fused=False, log_report=False, **PLAIN),
            max_steps=n + 1, callbacks=[rec]).fit(module, train_dataloaders=loader())
    x = batch(1)
    with torch.no_grad():
        teacher = F.log_softmax(unconverted(x).double(), -1)
        for i in range(n):  # an independent reference of the blend (the plain blend: transition.begin on a copy)
            ref = copy.deepcopy(unconverted)
            transition.begin(ref, "pre")
            transition.set_blend(ref, i / n)
            student = F.log_softmax(ref(x).double(), -1)
            kl = F.kl_div(student.reshape(-1, 64), teacher.reshape(-1, 64), log_target=True, reduction="batchmean").item()
            assert abs(rec.kl[i] - kl) <= 1e-5 + 1e-4 * kl, (i, rec.kl[i], kl)
            assert abs(rec.loss[i] - (module.losses[i] + w * rec.kl[i])) <= 1e-5  # the user's loss + w * KL
    assert rec.kl[0] <= 1e-7 and rec.kl[n - 1] > 1e-4
    assert rec.loss[n] == pytest.approx(module.losses[n])  # after the transition: the user's loss alone
    assert "training_step" not in vars(module) and not module._forward_hooks  # nothing left behind


def test_distillation_is_skipped_with_a_reason_where_it_cant_run(tmp_path):
    class NoLogits(LM):  # forward returns something without predictions to compare
        def forward(self, x):
            return {"hidden": super().forward(x)}

        def _logits_and_loss(self, b):
            x, y = b
            logits = self(x)["hidden"]
            return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    with pytest.warns(LNLightningWarning, match="without distillation.*no predictions to compare"):
        trainer(tmp_path, LNPlacement("pre", transition_steps=3, fused=False, log_report=False), max_steps=2).fit(
            NoLogits("demo"), train_dataloaders=loader())


@pytest.mark.parametrize("kind", list(KINDS))
def test_stream_scaled_blend_without_a_trainer_is_exact_at_both_ends(kind):
    model = make(kind)
    unconverted = copy.deepcopy(model)
    x, probe = batch(3), batch(1)
    with torch.no_grad():
        post = model(x)
    transition.begin(model, "pre", branch_scale="stream")
    assert transition.measure_stream_scales(model, lambda: model(probe)) is None
    with torch.no_grad():
        assert torch.equal(model(x), post)  # a = 0: bit for bit the trained function
        transition.set_blend(model, 1.0)
        at_one = model(x)
    reference = stream_reference(unconverted, probe)  # the constants computed independently
    with torch.no_grad():
        assert rel(at_one, reference(x)) <= 1e-6
        transition.finish(model)
        assert torch.equal(model(x), at_one) and transition.leftovers(model) == []
    with pytest.raises(PlacementError, match="not in a stream-scaled transition"):
        transition.measure_stream_scales(model, lambda: model(probe))


def _trained_looking_case(kind: str):
    """A model with trained-looking gains (the stream's constants C_k well above 1), its unconverted copy, an input,
    a probe batch and the model's post-norm output on the input."""
    model = make(kind)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.2, 0.4)
    x, probe = batch(3), batch(1)
    with torch.no_grad():
        post = model(x)
    return model, copy.deepcopy(model), x, probe, post


@pytest.mark.parametrize("kind", ["demo", "bert"])
def test_stream_scaled_peri_blend_is_exact_at_both_ends_and_keeps_the_function_mid_way(kind):
    model, unconverted, x, probe, post = _trained_looking_case(kind)
    transition.begin(model, "peri", branch_scale="stream")
    assert transition.measure_stream_scales(model, lambda: model(probe)) is None
    model_mid = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(model(x), post)  # a = 0: bit for bit the trained function
        transition.set_blend(model, 0.5)
        mid = model(x)
        transition.set_blend(model, 1.0)
        at_one = model(x)
    # The endpoint: peri-norm whose output norms' gains are C_k times the trained branch's spread, computed here
    # from hooks on the unconverted model.
    reference = stream_reference(unconverted, probe, "peri")
    with torch.no_grad():
        assert rel(at_one, reference(x)) <= 1e-5
        transition.finish(model)
        assert torch.equal(model(x), at_one) and transition.leftovers(model) == []
    # Mid-way each branch writes about D_k times what it wrote before (D_k = (1-a) + a*C_k), as the pre-norm
    # stream-scaled blend's branches do: the two blends stay close (the first form tried, (1-a)*D_k*v + a*N_out(v),
    # was 0.14 off at a = 0.25 on the demo LM; this one 0.017).
    pre = copy.deepcopy(unconverted)
    transition.begin(pre, "pre", branch_scale="stream")
    assert transition.measure_stream_scales(pre, lambda: pre(probe)) is None
    for a in (0.25, 0.5):
        transition.set_blend(pre, a)
        transition.set_blend(model_mid, a)
        with torch.no_grad():
            assert rel(model_mid(x), pre(x)) <= 0.1 * a
    # The plain blend, with identity output norms, moves the function far more.
    plain = copy.deepcopy(unconverted)
    transition.begin(plain, "peri", steps=4)
    transition.set_blend(plain, 0.5)
    with torch.no_grad():
        assert rel(mid, post) < 0.5 * rel(plain(x), post)


@pytest.mark.parametrize("placement", ["peri", "output"])
def test_stream_scaled_peri_and_output_without_exit_gains_run_the_plain_blend_and_say_why(placement):
    model = make("demo")
    for block in model.blocks:  # norms without an affine gain: the exit norms can't hold a stream scale
        block.ln1, block.ln2 = nn.LayerNorm(32, elementwise_affine=False), nn.LayerNorm(32, elementwise_affine=False)
    plain = copy.deepcopy(model)
    transition.begin(model, placement, branch_scale="stream")
    reason = transition.measure_stream_scales(model, lambda: model(batch(1)))
    assert reason is not None and "has no gain" in reason
    transition.begin(plain, placement)
    x = batch(3)
    for a in (0.5, 1.0):
        transition.set_blend(model, a), transition.set_blend(plain, a)
        with torch.no_grad():
            assert torch.equal(model(x), plain(x))


@pytest.mark.parametrize("placement", ["peri", "output"])
def test_plugin_peri_and_output_transitions_measure_the_exit_gains_and_resume(placement, tmp_path):
    module = LM("demo", lr=0.0)  # lr 0: the weights stay, so the end is the measured endpoint itself
    unconverted = copy.deepcopy(module.model)
    trainer(tmp_path / "a", LNPlacement(placement, transition_steps=2, fused=False, log_report=False, **HELD), max_steps=3).fit(
        module, train_dataloaders=loader())
    assert transition.active(module) is None and transition.leftovers(module) == []
    reference = stream_reference(unconverted, batch(1), placement)
    x = batch(3)
    with torch.no_grad():
        assert rel(module.model.eval()(x), reference.eval()(x)) <= 1e-5
    # Resumed mid-way (the gains are parameters; the constants, and output's kept trained gains, the transition's
    # buffers): the uninterrupted weights.
    plugin = lambda: LNPlacement(placement, transition_steps=4, fused=False, log_report=False)  # noqa: E731
    straight = LM("demo")
    trainer(tmp_path / "b", plugin(), max_steps=6).fit(straight, train_dataloaders=loader())
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    first = LM("demo")
    trainer(tmp_path / "c", plugin(), max_steps=2, callbacks=[ckpt]).fit(first, train_dataloaders=loader())
    path = next((tmp_path / "ck").glob("*step=2*.ckpt"))
    loaded = load_converted(LM("demo"), path)  # mid-way, for inference: the blend and the measured gains
    assert transition.get_blend(loaded) == 0.5
    with torch.no_grad():
        assert rel(loaded.model(batch(3)), first.model.eval()(batch(3))) <= 1e-6
    resumed = LM("demo")
    trainer(tmp_path / "d", plugin(), max_steps=6).fit(resumed, train_dataloaders=loader(), ckpt_path=path)
    a, b = straight.state_dict(), resumed.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-6, atol=1e-7), k
    gains = [v for k, v in a.items() if k.endswith("out_norm.weight" if placement == "peri" else ("ln1.weight", "ln2.weight"))]
    assert len(gains) == 4 and all(not torch.allclose(g, torch.ones_like(g)) for g in gains)
    if placement == "output":  # each branch reads the stream divided by its measured C_k (the first branch's is 1)
        scales = [float(v) for k, v in a.items() if k.endswith("_in_scale.c")]
        assert len(scales) == 4 and scales[0] == 1.0 and len(set(scales)) == 4


def test_the_output_endpoint_is_the_hand_written_formula():
    """x <- x + N'_k(F_k(x / C_k)), written out for the demo LM from its post-norm forward, with C_k and the exit
    gains computed here by hand (not with the product's helpers): C_{k+1} = C_k * sigma_k / mean|gamma_k|, sigma_k
    the mean over tokens of sqrt(var + eps) of norm k's input, and N'_k's gain C_k times the mean over tokens of
    the trained branch output's std, its bias 0."""
    model = make("demo").eval()
    with torch.no_grad():  # trained-looking gains and biases
        g = torch.Generator().manual_seed(3)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(0.2 + 0.3 * torch.rand(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    unconverted = copy.deepcopy(model)
    x, probe = batch(3), batch(1)
    transition.begin(model, "output", branch_scale="stream")
    assert transition.measure_stream_scales(model, lambda: model(probe)) is None
    transition.finish(model)
    sublayers = [pair for b in unconverted.blocks for pair in ((b.attn, b.ln1), (b.mlp, b.ln2))]
    with torch.no_grad():
        h, c, scales, gains = unconverted.tok_emb(probe) + unconverted.pos_emb(torch.arange(probe.shape[1])), 1.0, [], []
        for f, norm in sublayers:  # the trained post-norm forward, measured
            v = f(h)
            s = h + v
            scales.append(c)
            gains.append(c * v.std(-1, unbiased=False).mean().item())
            c *= ((s.var(-1, unbiased=False) + norm.eps).sqrt().mean() / norm.weight.abs().mean()).item()
            h = norm(s)
        last = unconverted.blocks[-1].ln2  # the final norm convert adds: a copy of the stack's last norm
        h = unconverted.tok_emb(x) + unconverted.pos_emb(torch.arange(x.shape[1]))
        for (f, norm), ck, gk in zip(sublayers, scales, gains):
            v = f(h / ck)
            h = h + F.layer_norm(v, v.shape[-1:], torch.full_like(norm.weight, gk), torch.zeros_like(norm.bias), norm.eps)
        expected = unconverted.head(F.layer_norm(h, h.shape[-1:], last.weight, last.bias, last.eps))
        assert rel(model(x), expected) <= 1e-5


def test_plugin_mix_transition_scales_the_converted_blocks_only(tmp_path):
    # "mix" keeps the first quarter post-norm: the stream the later blocks read enters normalised (C = 1 there).
    module = LM("demo", lr=0.0)
    module.model = PostNormTransformerLM(**{**TINY, "n_layers": 4})
    unconverted = copy.deepcopy(module.model)
    trainer(tmp_path, LNPlacement("mix", transition_steps=2, fused=False, log_report=False), max_steps=3).fit(
        module, train_dataloaders=loader())
    scaled = {n: b.item() for n, b in module.model.named_buffers() if n.endswith("_scale.c")}
    assert sorted(scaled) == [f"blocks.{i}.{s}_scale.c" for i in (1, 2, 3) for s in ("attn", "mlp")]
    reference = stream_reference(unconverted, batch(1), "mix")
    x = batch(3)
    with torch.no_grad():
        assert rel(module.model.eval()(x), reference.eval()(x)) <= 1e-6


@pytest.mark.parametrize("style", [pytest.param("compile_inner", marks=pytest.mark.slow), "bf16-mixed"])
def test_the_default_transition_under_compile_and_mixed_precision(style, tmp_path):
    module = LM("demo")
    kw = {}
    if style == "compile_inner":
        module.model = torch.compile(module.model, backend="eager")
    else:
        kw["precision"] = style
    rec = KLRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LNLightningWarning)  # measured, distilled: no fallback warning
        trainer(tmp_path, LNPlacement("pre", transition=TransitionSpec(steps=3, tolerance=None), fused=False, log_report=False), max_steps=4,
                callbacks=[rec], **kw).fit(module, train_dataloaders=loader())
    scales = [b.item() for n, b in module.named_buffers() if n.endswith("_scale.c")]
    assert len(scales) == 4 and scales[0] == 1.0 and all(c != 1.0 for c in scales[1:])
    assert all(k is not None for k in rec.kl[:3]) and transition.active(module) is None
    assert transition.leftovers(module) == []


@pytest.mark.slow  # torch.export and torch.compile (conftest's rule)
def test_a_stream_scaled_transition_exports_and_compiles_mid_way():
    model = make("demo")
    x = batch(3)
    transition.begin(model, "pre", branch_scale="stream")
    assert transition.measure_stream_scales(model, lambda: model(batch(1))) is None
    transition.set_blend(model, 0.4)
    model.eval()
    with torch.no_grad():
        want = model(x)
    program = torch.export.export(model, (x,))
    assert torch.equal(program.module()(x), want)
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # no graph break from the blend
    with torch.no_grad():
        assert torch.equal(compiled(x), want)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_teacher_computes_the_trained_function_bit_for_bit(kind):
    from ln_lightning.placement.migrate.teacher import frozen_copy, trained_output

    model = make(kind)
    x = batch(3)
    with torch.no_grad():
        trained = model.eval()(x)
    model.train()
    transition.begin(model, "pre", branch_scale="stream")
    assert transition.measure_stream_scales(model, lambda: model(batch(1))) is None
    transition.set_blend(model, 0.7)
    teacher = frozen_copy(model)
    assert torch.equal(trained_output(teacher, x), trained)  # the rewrite's hooks bypassed: the model as written
    with torch.no_grad():
        assert torch.equal(teacher(x), trained)  # and its blend, pinned at 0, is the same function
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training



def test_the_default_transition_takes_a_training_step_without_batch_idx(tmp_path):
    class NoBatchIdx(LM):  # Lightning passes batch_idx only to a training_step that takes it
        def training_step(self, b):
            loss = self._loss(b)
            self.losses.append(loss.item())
            return loss

    module = NoBatchIdx("demo")
    rec = KLRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LNLightningWarning)
        trainer(tmp_path, LNPlacement("pre", transition=TransitionSpec(steps=2, tolerance=None), fused=False, log_report=False), max_steps=3,
                callbacks=[rec]).fit(module, train_dataloaders=loader())
    assert rec.kl[1] is not None and "training_step" not in vars(module)


def test_distillation_of_a_module_left_in_eval_mode_says_so(tmp_path):
    """A LightningModule handed to fit in eval mode stays in it (Lightning keeps the mode): the distillation, which
    compares training forwards, can't run, and the warning names the mode, not a missing self(...) call."""
    module = LM("demo").eval()
    with pytest.warns(LNLightningWarning, match="without distillation.*in eval mode in training_step.*model.train"):
        trainer(tmp_path, LNPlacement("pre", transition=TransitionSpec(steps=3, tolerance=None), fused=False,
                                      log_report=False), max_steps=2).fit(module, train_dataloaders=loader())


def test_distillation_without_a_call_of_the_module_itself_is_reported(tmp_path):
    class CallsInner(LM):  # training_step calls self.model(x), not self(x): no output of the module to distil
        def _logits_and_loss(self, b):
            x, y = b
            logits = self.model(x)
            return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    module = CallsInner("demo")
    with pytest.warns(LNLightningWarning, match="without distillation.*did not call the LightningModule itself"):
        trainer(tmp_path, LNPlacement("pre", transition_steps=3, fused=False, log_report=False), max_steps=2).fit(
            module, train_dataloaders=loader())
    assert rewrite_state.of(module).transition.teacher is None  # its memory let go


class _TwiceOnRank1(LM):
    """On rank 1 only, the first step runs the model twice: that rank can't measure, the other can."""

    def training_step(self, b, batch_idx):
        loss = self._loss(b)
        if self.global_rank == 1 and self.trainer.global_step == 0:
            loss = loss + 0.0 * self._loss(b)
        return loss


@pytest.mark.slow
def test_a_rank_that_cant_measure_sends_every_rank_to_the_plain_blend(tmp_path):
    import json

    t = _ddp_spawn_trainer(tmp_path, 4, "pre", BlendFile)
    t.fit(_TwiceOnRank1("demo"), train_dataloaders=loader())  # no hang: both ranks reduce the same tensor
    scales = [json.loads(Path(tmp_path, f"scales_rank{r}.json").read_text()) for r in range(2)]
    assert scales[0] == scales[1] and set(scales[0].values()) == {1.0}  # the plain blend, on both ranks


@pytest.mark.parametrize("kind", ["demo", "bert"])
def test_stream_scaled_output_blend_is_exact_at_both_ends_and_keeps_the_function_mid_way(kind):
    model, unconverted, x, probe, post = _trained_looking_case(kind)
    transition.begin(model, "output", branch_scale="stream")
    with torch.no_grad():  # pickled as ddp_spawn does, before measuring: the moved norms are reached from the transition too
        assert torch.equal(pickle.loads(pickle.dumps(model))(x), post)
    assert transition.measure_stream_scales(model, lambda: model(probe)) is None
    model_mid = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(model(x), post)  # a = 0: bit for bit the trained function (the call site's kept gains)
        transition.set_blend(model, 1.0)
        at_one = model(x)
    # The endpoint x + N'_k(F(x / C_k)): each branch reads the stream divided by C_k, and the moved norm's gain is C_k
    # times the trained branch's spread, computed here from hooks on the unconverted model.
    reference = stream_reference(unconverted, probe, "output")
    with torch.no_grad():
        assert rel(at_one, reference(x)) <= 1e-5
        transition.finish(model)
        assert torch.equal(model(x), at_one) and transition.leftovers(model) == []
    # Mid-way each branch reads x / D_k and writes about D_k times what it wrote before, as the pre-norm blend's
    # branches do: the function moves far less than under the plain output blend (identity entries, the moved norm
    # with its trained gain at the exit).
    transition.set_blend(model_mid, 0.5)  # and pickled mid-way
    restored = pickle.loads(pickle.dumps(model_mid))
    with torch.no_grad():
        assert torch.equal(restored(x), model_mid(x))
    plain = copy.deepcopy(unconverted)
    transition.begin(plain, "output", steps=4)
    for a in (0.25, 0.5, 0.75):
        transition.set_blend(model_mid, a), transition.set_blend(plain, a)
        with torch.no_grad():
            scaled_err, plain_err = rel(model_mid(x), post), rel(plain(x), post)
        assert scaled_err < (0.75 if a < 0.5 else 0.5) * plain_err, (a, scaled_err, plain_err)


def test_only_the_transition_writes_its_blend():
    """Issue 32: the Transition (placement/migrate/blend.py) is the one writer of its blend buffer; everything else asks it
    (`set_progress`, `gate`, `hold`, `pinned` for a forward at another blend). The study's DriftBudgetController
    (placement/migrate/transition_control.py) updates a buffer it is handed, for the examples that drive a blend by hand."""
    import pathlib
    import re

    write = re.compile(r"\.blend\.(fill_|copy_|zero_|add_|sub_|mul_|clamp_|data)\b|\.blend\s*=[^=]|\.blend\[[^\]]*\]\s*=[^=]")
    assert write.search("t.blend.fill_(1.0)") and write.search("self.transition.blend.copy_(x)") and not write.search("t.blend == 1")
    root = pathlib.Path(ln_lightning.__file__).parent
    writers = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p.name != "blend.py" or p.parent.name != "migrate"
               for i, line in enumerate(p.read_text().splitlines(), 1) if write.search(line)]
    assert not writers, writers
