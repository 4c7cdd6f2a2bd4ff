"""Checkpoints written by an earlier main (504b1ba, the last release of the checkpoint format before
PlacementSpec) load, resume and compute what they computed when written.

tests/data/checkpoints/ holds them, with the input and the output that code's `load_converted` gave
(`make_checkpoints.py` there says how they were made; `provenance.json` which code made them). Nothing here
is recomputed by the code under test: the expected outputs are the old code's.
"""
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from ln_lightning import LNPlacement, PlacementSpec, TransitionSpec
from ln_lightning.demo.lightning import CharLM
from ln_lightning.placement.migrate import transition
from ln_lightning.plugin import load_converted
from ln_lightning.testing import plugin as h

DATA = Path(__file__).parent / "data" / "checkpoints"
NAMES = ["pre", "mid_transition"]


def _expected(name):
    return torch.load(DATA / f"{name}.expected.pt", weights_only=True)


@pytest.mark.parametrize("name", NAMES)
def test_an_old_checkpoint_loads_as_the_function_it_held(name):
    model = load_converted(CharLM, DATA / f"{name}.ckpt")
    expected = _expected(name)
    with torch.no_grad():
        torch.testing.assert_close(model(expected["x"]), expected["y"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_an_old_checkpoint_entry_reads_as_a_placement_spec(name):
    entry = torch.load(DATA / f"{name}.ckpt", weights_only=True, map_location="cpu")["ln_lightning"]
    spec = PlacementSpec.from_config(entry["config"])
    assert spec.config == entry["config"] and spec.placement == "pre" and spec.final_norm


@pytest.mark.parametrize("name, plugin", [
    ("pre", lambda: LNPlacement("pre", fused=False, log_report=False)),
    ("mid_transition", lambda: LNPlacement("pre", transition=TransitionSpec(steps=40), fused=False, log_report=False)),
], ids=NAMES)
def test_a_fit_resumes_from_an_old_checkpoint(tmp_path, name, plugin):
    saved = torch.load(DATA / f"{name}.ckpt", weights_only=True, map_location="cpu")
    model = CharLM(**h.TINY)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=saved["global_step"] + 2, num_sanity_val_steps=0,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      enable_checkpointing=False, default_root_dir=str(tmp_path), plugins=[plugin()])
    trainer.fit(model, h.loader(16), ckpt_path=str(DATA / f"{name}.ckpt"))
    assert trainer.global_step == saved["global_step"] + 2
    blend = transition.get_blend(model)
    if name == "mid_transition":  # the transition goes on from the blend it had reached, not from 0
        assert blend is not None and blend >= saved["ln_lightning"]["record"]["transition"]["blend"] - 1e-6
    else:
        assert blend is None
