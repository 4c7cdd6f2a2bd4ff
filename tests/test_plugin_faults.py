"""The plugin and the monitors under faults and misuse (issue 16): Lightning's debug modes and loggers other
than TensorBoard, a model rewritten before the plugin sees it, loads that bypass the marker, load_converted on
bad input, small option checks, and a fit killed with SIGKILL and resumed bitwise."""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import nn

from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor
from ln_lightning.demo.lightning import CharLM
from ln_lightning.placement.spec import PlacementSpec
from ln_lightning.plugin import CHECKPOINT_KEY, MARKER, LNPlacement, load_converted
from ln_lightning.testing import plugin as h

HERE = Path(__file__).resolve().parent
FAULTS = str(HERE / "_helpers_faults.py")


def _trainer(tmp_path, plugins=(), max_steps=2, **kw):
    kw.setdefault("logger", False)
    kw.setdefault("limit_val_batches", 1)
    return Trainer(accelerator="cpu", devices=1, max_steps=max_steps, num_sanity_val_steps=0,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                   plugins=list(plugins), **kw)


def _lm(**kw):
    return CharLM(**{**h.TINY, **kw})


def _x():
    return h.RandomTokens(4, seed=2).data[:, :-1]


def _monitors():
    return [StreamNormMonitor(every_n_steps=1), LayerNormInputMonitor(every_n_steps=1), ClipAttributionMonitor(every_n_steps=1)]


class _RecordingLogger(Logger):
    """A logger with no `experiment.add_image` (like MLflow's or a custom one): it only takes scalars."""

    def __init__(self):
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))


def _logged_tags(logger: _RecordingLogger) -> set[str]:
    return {k for _, m in logger.metrics for k in m}


# ------------------------------------------------------------------------------------------------ 1. debug modes, loggers
@pytest.mark.parametrize("fast_dev_run", [True, 3])
def test_monitors_and_plugin_run_under_fast_dev_run(tmp_path, fast_dev_run):
    # Lightning swaps the logger for a DummyLogger, whose experiment returns no file writer.
    trainer = _trainer(tmp_path, [LNPlacement("pre", fused=False)], callbacks=_monitors(), fast_dev_run=fast_dev_run,
                       logger=TensorBoardLogger(str(tmp_path)), gradient_clip_val=1.0)
    trainer.fit(_lm(), h.loader(16), h.loader(4, seed=1))
    assert trainer.global_step == int(fast_dev_run)


def test_monitors_under_limit_batches_with_csv_logger_log_scalars_and_say_once_that_images_are_skipped(tmp_path, caplog):
    logger = CSVLogger(str(tmp_path))
    trainer = _trainer(tmp_path, callbacks=_monitors(), max_steps=3, limit_train_batches=3, limit_val_batches=0,
                       logger=logger, gradient_clip_val=1.0)
    with caplog.at_level(logging.INFO, logger="ln_lightning"):
        trainer.fit(_lm(), h.loader(16))
    text = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()[0]
    for tag in ("stream/rms/model.blocks.0", "ln/var_min/model.blocks.0.ln1", "clip/total_norm"):
        assert tag in text
    skipped = [r for r in caplog.records if "takes no images" in r.getMessage()]
    assert len(skipped) == 1 and "CSVLogger" in skipped[0].getMessage()


def test_monitors_with_a_logger_without_add_image_and_with_no_logger(tmp_path):
    from ln_lightning import LNLightningWarning

    rec = _RecordingLogger()
    _trainer(tmp_path, callbacks=_monitors(), logger=rec, gradient_clip_val=1.0).fit(_lm(), h.loader(16))
    tags = _logged_tags(rec)
    assert {"stream/rms/model.blocks.1", "ln/amp_max/model.blocks.1.ln2", "clip/total_norm"} <= tags
    with pytest.warns(LNLightningWarning, match="has no logger") as caught:  # the monitors are off: said once
        _trainer(tmp_path, callbacks=_monitors(), logger=False).fit(_lm(), h.loader(16))
    assert len([w for w in caught if "has no logger" in str(w.message)]) == 1


# ------------------------------------------------------------------------------------------------ 2. rewritten before
def _fit(tmp_path, model, placement, **kw):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)
    trainer = _trainer(tmp_path, [placement], callbacks=[ckpt], **kw)
    trainer.fit(model, h.loader(8))
    return torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)


@pytest.mark.parametrize("other", [dict(branch_scale=0.5), dict(placement="post"), dict(final_norm=False)],
                         ids=["branch_scale", "post", "final_norm"])
def test_model_rewritten_by_an_earlier_plugin_and_another_request_fails_at_fit_start(tmp_path, other):
    model = _lm()
    _fit(tmp_path / "a", model, LNPlacement("pre", fused=False))
    before = h.full_state(model)
    with pytest.raises(ValueError, match=r"already rewritten to \(placement='pre'.*asks for .*" + list(other)[0]):
        _trainer(tmp_path / "b", [LNPlacement(PlacementSpec(**other), fused=False)]).fit(model, h.loader(8))
    assert all(torch.equal(before[k], v) for k, v in h.full_state(model).items())  # not trained
    # The failed start leaves nothing that changes the next fit: the right request trains it.
    trainer = _trainer(tmp_path / "c", [LNPlacement("pre", fused=False)])
    trainer.fit(model, h.loader(8))
    assert trainer.global_step == 2 and "on_load_checkpoint" not in vars(model)


def test_model_converted_by_hand_and_another_request_fails_without_claiming_nothing_changed(tmp_path, caplog):
    from ln_lightning.placement import convert

    model = _lm()
    convert(model, "pre", branch_scale=0.5)
    with caplog.at_level(logging.INFO, logger="ln_lightning"):
        with pytest.raises(ValueError, match=r"branch_scale=0\.5.*asks for .*branch_scale=None"):
            _trainer(tmp_path, [LNPlacement("pre", fused=False)]).fit(model, h.loader(8))
    assert "Nothing changed" not in caplog.text


def test_model_converted_by_hand_with_the_same_function_trains_and_records_its_real_configuration(tmp_path, caplog):
    from ln_lightning.placement import convert

    model = _lm()
    convert(model, "pre", branch_scale=0.5)
    with caplog.at_level(logging.INFO, logger="ln_lightning"):
        ck = _fit(tmp_path, model, LNPlacement(PlacementSpec("pre", branch_scale=0.5), fused=False), logger=CSVLogger(str(tmp_path)))
    assert "Nothing changed" not in caplog.text and "already rewritten" in caplog.text
    assert ck[CHECKPOINT_KEY]["config"] == {"placement": "pre", "final_norm": True, "branch_scale": 0.5}
    markers = [k for k in ck["state_dict"] if k.endswith(MARKER)]
    assert markers
    loaded = load_converted(CharLM, tmp_path / "ck" / "last.ckpt")  # builds what the model computes, strictly
    model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(_x()), model(_x()), atol=1e-6, rtol=0)


def test_an_equivalent_request_proceeds_and_keeps_the_models_configuration(tmp_path):
    model = _lm()
    _fit(tmp_path / "a", model, LNPlacement("pre", fused=False))
    # branch_scale=1.0 is the same function as None: the model is trained as it is, recorded as it was rewritten.
    ck = _fit(tmp_path / "b", model, LNPlacement(PlacementSpec("pre", branch_scale=1.0)))
    assert ck[CHECKPOINT_KEY]["config"] == {"placement": "pre", "final_norm": True, "branch_scale": None}
    assert ck[CHECKPOINT_KEY]["fused"] is False  # the second plugin's fused=True default did not swap its norms


class _EncoderWithNormLM(LightningModule):
    """A post-norm nn.TransformerEncoder that has its own final norm: final_norm=True adds none."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.emb = nn.Embedding(128, 32)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32), enable_nested_tensor=False)
        self.head = nn.Linear(32, 128)

    def forward(self, idx):
        return self.head(self.encoder(self.emb(idx)))


def test_same_function_rules_for_scales_and_final_norm():
    placement = LNPlacement(PlacementSpec("pre", branch_scale="depth"), fused=False)
    model = _lm()
    placement.rewrite(model)
    LNPlacement(PlacementSpec("pre", branch_scale=0.5), fused=False).rewrite(model)  # 1/sqrt(2*2 blocks): the same function
    assert LNPlacement.applied_config(model)["branch_scale"] == "depth"
    with pytest.raises(ValueError, match=r"branch_scale 'depth' is not 0\.25"):
        LNPlacement(PlacementSpec("pre", branch_scale=0.25), fused=False).rewrite(model)
    with pytest.raises(ValueError, match="final_norm=True added a final norm"):  # CharLM's final norm was added
        LNPlacement(PlacementSpec("pre", branch_scale="depth", final_norm=False), fused=False).rewrite(model)
    model = _lm()
    LNPlacement(PlacementSpec("pre", branch_scale="layerscale"), fused=False).rewrite(model)
    with pytest.raises(ValueError, match="layerscale_init"):
        LNPlacement(PlacementSpec("pre", branch_scale="layerscale", layerscale_init=0.5), fused=False).rewrite(model)
    # A stack with its own final norm: final_norm True and False are the same function.
    model = _EncoderWithNormLM()
    report = LNPlacement("pre", fused=False).rewrite(model)
    assert report.converted and not report.added
    LNPlacement(PlacementSpec("pre", final_norm=False), fused=False).rewrite(model)
    assert LNPlacement.applied_config(model)["final_norm"] is True


class _NativePreLM(LightningModule):
    """Pre-norm from the start (torch's norm_first layers): no rewrite ever touched it."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.emb = nn.Embedding(128, 32)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32), enable_nested_tensor=False)
        self.head = nn.Linear(32, 128)

    def forward(self, idx):
        return self.head(self.encoder(self.emb(idx)))


def test_branch_scale_on_an_already_pre_norm_model_is_refused_not_ignored():
    model = _NativePreLM()
    with pytest.raises(ValueError, match=r"branch_scale=0\.5 can't be applied to 2 block\(s\) that are already pre-norm"):
        LNPlacement(PlacementSpec("pre", branch_scale=0.5), fused=False).rewrite(model)
    assert LNPlacement.applied_config(model) is None  # untouched


# ------------------------------------------------------------------------------------------------ 3. the marker guard
def test_strict_false_load_of_unconverted_weights_into_a_rewritten_model_is_refused_unless_opted_in(caplog):
    import ln_lightning

    plain = _lm().state_dict()
    model = _lm()
    LNPlacement(PlacementSpec("pre", final_norm=False), fused=False).rewrite(model)  # adds no weights: everything else fits
    before = h.full_state(model)
    with pytest.raises(RuntimeError, match=f"no 'model.{MARKER}' entry.*accept_unconverted"):
        model.load_state_dict(plain, strict=False)
    with pytest.raises(RuntimeError, match=f"no '{MARKER}' entry"):  # into the inner module too
        model.model.load_state_dict({k[len("model."):]: v for k, v in plain.items()}, strict=False)
    assert all(torch.equal(before[k], v) for k, v in h.full_state(model).items())
    with caplog.at_level(logging.WARNING, logger="ln_lightning"):
        with ln_lightning.accept_unconverted(model):
            model.load_state_dict(plain, strict=False)
    assert len([r for r in caplog.records if "accept_unconverted" in r.getMessage()]) == 1
    assert torch.equal(model.model.tok_emb.weight, plain["model.tok_emb.weight"])
    with pytest.raises(RuntimeError, match=MARKER):  # the opt-in ends with the block
        model.load_state_dict(plain, strict=False)


class _LooseLM(CharLM):
    strict_loading = False


def test_lightning_strict_loading_false_ckpt_without_marker_is_refused_unless_resume_unconverted(tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "plain"), save_last=True)
    _trainer(tmp_path, callbacks=[ckpt]).fit(_LooseLM(**h.TINY), h.loader(8))
    path = tmp_path / "plain" / "last.ckpt"
    with pytest.raises(RuntimeError, match=f"written without the placement rewrite.*{MARKER}.*resume_unconverted=True"):
        _trainer(tmp_path, [LNPlacement(PlacementSpec("pre", final_norm=False), fused=False)], max_steps=4).fit(
            _LooseLM(**h.TINY), h.loader(8), ckpt_path=path)
    with pytest.raises(RuntimeError, match="written without the placement rewrite"):
        _trainer(tmp_path, [LNPlacement(PlacementSpec("pre", final_norm=False), fused=False)]).validate(
            _LooseLM(**h.TINY), h.loader(4), ckpt_path=path)
    # Opted in: it loads the post-norm weights into the pre-norm model, says so, and continues from the checkpoint.
    model = _LooseLM(**h.TINY)
    trainer = _trainer(tmp_path, [LNPlacement(PlacementSpec("pre", final_norm=False), fused=False, resume_unconverted=True)], max_steps=4)
    with pytest.warns(UserWarning, match=r"resume_unconverted=True.*written without the placement rewrite"):
        trainer.fit(model, h.loader(8), ckpt_path=path)
    assert trainer.global_step == 4


# ------------------------------------------------------------------------------------------------ 4. load_converted
class _NoHparamsLM(CharLM):
    def __init__(self, d_model: int = 64, **kw):
        super().__init__(**{**h.TINY, "d_model": d_model, **kw})

    def on_save_checkpoint(self, checkpoint):
        checkpoint.pop("hyper_parameters", None)  # as if save_hyperparameters() was never called


@pytest.fixture(scope="module")
def converted_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conv")
    ckpt = ModelCheckpoint(dirpath=str(tmp), save_last=True)
    model = _NoHparamsLM(d_model=32)
    _trainer(tmp, [LNPlacement("pre", fused=False)], callbacks=[ckpt]).fit(model, h.loader(8))
    return tmp / "last.ckpt", model


def test_load_converted_refuses_to_guess_hyperparameters(converted_ckpt):
    path, trained = converted_ckpt
    assert not torch.load(path, weights_only=False).get("hyper_parameters")
    with pytest.raises(ValueError, match=r"stores no hyperparameters.*Pass an instance"):
        load_converted(_NoHparamsLM, path)
    model = load_converted(_NoHparamsLM(d_model=32), path)
    trained.eval()
    with torch.no_grad():
        assert torch.equal(model(_x()), trained(_x()))
    assert load_converted(_NoHparamsLM, path, d_model=32) is not None


class _OtherLM(LightningModule):
    def __init__(self, width: int = 8):
        super().__init__()
        self.lin = nn.Linear(width, width)


def test_load_converted_checks_the_recorded_class(tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    _trainer(tmp_path, [LNPlacement("pre", fused=False)], callbacks=[ckpt]).fit(_lm(), h.loader(8))
    with pytest.raises(ValueError, match=r"written from ln_lightning\.demo\.lightning\.CharLM, not .*_OtherLM"):
        load_converted(_OtherLM, tmp_path / "last.ckpt")
    # A checkpoint without the class record (older ones): the failing constructor says where its arguments came from.
    ck = torch.load(tmp_path / "last.ckpt", weights_only=False)
    ck[CHECKPOINT_KEY].pop("model_class", None)
    torch.save(ck, tmp_path / "old.ckpt")
    with pytest.raises(TypeError, match=r"hyperparameters stored in the checkpoint"):
        load_converted(_OtherLM, tmp_path / "old.ckpt")


@pytest.mark.parametrize("kind", ["empty", "truncated", "text", "list"])
def test_load_converted_turns_unreadable_files_into_one_message(converted_ckpt, tmp_path, kind):
    path, _ = converted_ckpt
    bad = tmp_path / f"{kind}.ckpt"
    if kind == "empty":
        bad.write_bytes(b"")
    elif kind == "truncated":
        data = path.read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    elif kind == "text":
        bad.write_text("not a checkpoint\n")
    else:
        torch.save([1, 2, 3], bad)
    with pytest.raises(ValueError, match=r"load_converted: .*" + re.escape(str(bad))) as info:
        load_converted(_NoHparamsLM(d_model=32), bad)
    assert {"empty": "empty (0 bytes)", "truncated": "zip archive", "text": "cannot read", "list": "holds a list"}[kind] in str(info.value)
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)


# ------------------------------------------------------------------------------------------------ 5. small items
class _InfGrad(Callback):
    """Makes one gradient infinite before the monitor sees it, then records clip_grad_norm_'s own total."""

    def __init__(self):
        self.totals = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        p = pl_module.model.head.weight
        p.grad[0, 0] = float("inf")
        grads = [q.grad for g in optimizer.param_groups for q in g["params"] if q.grad is not None]
        self.totals[trainer.global_step] = float(torch.nn.utils.get_total_norm(grads, 2.0))


def test_clip_total_norm_is_inf_like_clip_grad_norm_not_nan(tmp_path):
    rec, inf = _RecordingLogger(), _InfGrad()
    monitor = ClipAttributionMonitor(every_n_steps=1)
    _trainer(tmp_path, callbacks=[inf, monitor], logger=rec, max_steps=1).fit(_lm(), h.loader(8))
    logged = [m["clip/total_norm"] for _, m in rec.metrics if "clip/total_norm" in m]
    assert inf.totals[0] == float("inf")
    assert logged == [float("inf")]


def test_norm_classes_takes_a_single_class():
    monitor = LayerNormInputMonitor(norm_classes=nn.GroupNorm)
    assert monitor.norm_classes == (nn.LayerNorm, nn.GroupNorm)
    with pytest.raises(TypeError, match="norm_classes"):
        LayerNormInputMonitor(norm_classes="LayerNorm")


@pytest.mark.parametrize("cls", [StreamNormMonitor, LayerNormInputMonitor, ClipAttributionMonitor])
def test_every_n_steps_true_is_refused(cls):
    with pytest.raises(ValueError, match="every_n_steps must be a positive int"):
        cls(every_n_steps=True)


# ------------------------------------------------------------------------------------------------ the fault test
def _run_faults(out: Path, *args: str, kill: bool = False) -> None:
    import ln_lightning

    # The worker imports the same ln_lightning as this test.
    root = str(Path(ln_lightning.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, FAULTS, str(out), *args]
    if not kill:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
        return
    # A session of its own, so SIGKILL reaches the spawned workers too.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "ready").exists():
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "the run never reached the kill step"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def _killed_and_resumed_equals_uninterrupted(tmp_path: Path, strategy: str, kill_at: int) -> None:
    full, cut = tmp_path / "full", tmp_path / "cut"
    _run_faults(full, "--strategy", strategy)
    _run_faults(cut, "--strategy", strategy, "--kill-at", str(kill_at), kill=True)
    assert not (cut / "final.pt").exists() and (cut / "ckpt" / "last.ckpt").exists()
    _run_faults(cut, "--strategy", strategy, "--resume")
    a, b = torch.load(full / "final.pt"), torch.load(cut / "final.pt")
    assert a["global_step"] == b["global_step"] > kill_at
    assert a["state"].keys() == b["state"].keys() and any(k.endswith(MARKER) for k in a["state"])
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]), "resumed weights differ"


@pytest.mark.slow
def test_fit_killed_with_sigkill_resumes_bitwise_from_last_ckpt(tmp_path):
    # 8 steps an epoch, last.ckpt at epoch ends: killed in the second epoch, at step 13 of 24.
    _killed_and_resumed_equals_uninterrupted(tmp_path, "auto", kill_at=13)


@pytest.mark.slow
def test_fit_killed_with_sigkill_resumes_bitwise_ddp_spawn(tmp_path):
    # 2 processes: 4 steps an epoch, killed at step 7 of 12.
    _killed_and_resumed_equals_uninterrupted(tmp_path, "ddp_spawn", kill_at=7)
