"""`ln-lightning export CHECKPOINT OUT_DIR`: a checkpoint written with LNPlacement -> a Hugging Face directory.

One fit of a LightningModule holding a Hugging Face BertModel with LNPlacement(transition_steps=4) writes a
checkpoint mid-transition (step 2) and one after it (step 4); each is exported and loaded back with
`ln_lightning.from_pretrained`, against `load_converted` of the same checkpoint. Every checkpoint it cannot serve
exits 2 with one line on stderr.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

pytest.importorskip("transformers")

from _helpers_export import output, quiet_transformers, trained_looking  # noqa: E402
from _helpers_transition import LM, batch, loader, trainer  # noqa: E402
from ln_lightning import LNLightningWarning, LNPlacement, from_pretrained, load_converted  # noqa: E402
from ln_lightning.cli import main  # noqa: E402

TOL = 1e-6


class ExportLM(LM):
    """LM, rebuilt from its checkpoint's hyperparameters as the CLI does (LM's own carry its parent's too)."""

    def __init__(self, kind: str = "bert", lr: float = 1e-3, seed: int = 0, warmup_steps: int = 2, **parents):
        super().__init__(kind, lr, seed, warmup_steps)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    quiet_transformers()
    root = tmp_path_factory.mktemp("export_cli")
    ckpt = ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    module = trained_looking(ExportLM("bert", lr=1e-3))
    trainer(root, LNPlacement("pre", transition_steps=4, fused=False, log_report=False), max_steps=4,
            callbacks=[ckpt]).fit(module, train_dataloaders=loader())
    plain = ModelCheckpoint(dirpath=root / "plain", every_n_train_steps=1, save_top_k=-1)
    trainer(root, None, max_steps=1, callbacks=[plain]).fit(LM("bert"), train_dataloaders=loader())
    return {"mid": root / "ck" / "step=2.ckpt", "end": root / "ck" / "step=4.ckpt",
            "plain": next((root / "plain").glob("*.ckpt")), "root": root}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("which", ["mid", "end"])
def test_export_writes_the_checkpoints_converted_hugging_face_model(which, checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(checkpoints[which]), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "remote_code (BertModel from model.bert)" in printed
    reference = load_converted(ExportLM, checkpoints[which]).model.bert.eval()
    ids = {"input_ids": batch(3)}
    loaded = from_pretrained(out, add_pooling_layer=False)  # LM's BertLM builds BertModel without its pooler
    assert abs(output(loaded, ids) - output(reference, ids)).max() <= TOL * output(reference, ids).abs().max()
    from ln_lightning.placement import state

    t = state.of(loaded).transition
    assert (t is not None and float(t.blend) == pytest.approx(0.5)) if which == "mid" else t is None


def test_export_refuses_what_it_cannot_serve(checkpoints, tmp_path, capsys):
    mid = str(checkpoints["mid"])
    assert main(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "o1")]) == 2
    assert "does not exist" in _one_line_error(capsys)
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint")
    assert main(["export", str(junk), str(tmp_path / "o2")]) == 2
    assert "cannot read" in _one_line_error(capsys)
    assert main(["export", str(checkpoints["plain"]), str(tmp_path / "o3")]) == 2
    assert "records no placement rewrite" in _one_line_error(capsys)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    assert main(["export", mid, str(busy)]) == 2
    assert "not an empty directory" in _one_line_error(capsys)
    assert main(["export", mid, str(tmp_path / "o4"), "--native", "yes"]) == 2
    assert "no native form for BertModel" in _one_line_error(capsys)
    assert main(["export", mid, str(tmp_path / "o5"), "--model", "no_such_module_xyz:LM"]) == 2
    assert "cannot import 'no_such_module_xyz'" in _one_line_error(capsys)
    saved = torch.load(checkpoints["mid"], weights_only=True)
    saved["ln_lightning"]["model_class"] = "__main__.LM"
    script = tmp_path / "script.ckpt"
    torch.save(saved, script)
    assert main(["export", str(script), str(tmp_path / "o6")]) == 2
    assert "a class defined in a script" in _one_line_error(capsys) and not (tmp_path / "o6").exists()
    assert main(["export", str(script), str(tmp_path / "o7"), "--model", "test_export_cli:ExportLM"]) == 0
    capsys.readouterr()
    assert main(["export", mid]) == 2
    assert "out_dir" in _one_line_error(capsys)


def test_export_refuses_a_model_without_a_hugging_face_model(tmp_path, capsys):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1)
    trainer(tmp_path, LNPlacement("pre", fused=False, log_report=False), max_steps=1, callbacks=[ckpt]).fit(
        ExportLM("demo"), train_dataloaders=loader())
    assert main(["export", str(next((tmp_path / "ck").glob("*.ckpt"))), str(tmp_path / "out")]) == 2
    assert "holds no converted Hugging Face models" in _one_line_error(capsys)


@pytest.fixture(autouse=True)
def _expected_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ended during the transition.*", category=LNLightningWarning)
        yield
