"""A fit after a failed fit behaves exactly like the same fit in a fresh process (issue 23, point 2).

The failed fit (plugin with a transition, the three monitors, clipping, TensorBoard) raises on a logging step;
then the same process fits a fresh seeded model. A fresh Python process runs only that second fit. Weights and
every logged scalar must be equal, bit for bit: anything left behind (a hook, an open gate, a patch on a
module, a cache) shows as a difference.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ln_lightning.testing.second_fit import after_a_failure


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_a_fit_after_a_failed_fit_equals_the_same_fit_in_a_fresh_process(tmp_path):
    here, fresh = tmp_path / "here", tmp_path / "fresh"
    here.mkdir()
    fresh.mkdir()
    after_a_failure(str(here))
    left = json.loads((here / "left.json").read_text())
    assert left["after_step_failure"] == [] and left["after_setup_failure"] == []  # no monitor hooks outlive a failed fit
    # Only the rewrite itself (its state and load guard, ln_lightning.placement.state); nothing patched onto the module.
    assert left["attributes"] == ["_ln_lightning_guarded_owners", "_ln_lightning_load_hook", "_ln_lightning_rewrite"]
    subprocess.run([sys.executable, "-m", "ln_lightning.testing.second_fit", "clean", str(fresh)], check=True, timeout=600)
    a, b = torch.load(here / "clean_weights.pt"), torch.load(fresh / "clean_weights.pt")
    assert list(a) == list(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    sa, sb = json.loads((here / "clean_scalars.json").read_text()), json.loads((fresh / "clean_scalars.json").read_text())
    assert any(k.startswith("stream/") for k in sa) and any(k.startswith("ln/") for k in sa) and "ln_placement/transition" in sa
    assert sa == sb
