"""`ln_lightning.callbacks` used alone: no Trainer patch, no plugin, no Lightning version guard.

Each check runs in a fresh interpreter (another test of this session may have installed the plugin's patch). CI runs
this file on Lightning 2.6 (.ci/run) and 2.5 (.ci/lightning-2.5).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_FIT_ALONE = """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import lightning
    from lightning.pytorch.trainer import call
    original = call._call_and_handle_interrupt
    if sys.argv[1] == "untested":
        lightning.__version__ = "2.99.0"  # outside the plugin's tested range: its version guard would refuse it

    from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor
    from ln_lightning.testing.monitors import FixedBatchLM, make_data, make_trainer, read_scalars

    x, y = make_data(world=1, accum=1)
    monitors = [StreamNormMonitor(every_n_steps=2), LayerNormInputMonitor(every_n_steps=2), ClipAttributionMonitor(every_n_steps=2)]
    trainer = make_trainer(sys.argv[2], "alone", accelerator="cpu", devices=1, max_steps=4, callbacks=monitors)
    trainer.fit(FixedBatchLM(x, y))
    logged = read_scalars(sys.argv[2] + "/alone")
    print(json.dumps({
        "lightning": lightning.__version__,
        "unwrapped": call._call_and_handle_interrupt is original and not hasattr(call._call_and_handle_interrupt, "__wrapped__"),
        "loaded": sorted(m for m in sys.modules if m in ("ln_lightning._lightning_patch", "ln_lightning.plugin")),
        "steps": {t: sorted(s for s, _ in v) for t, v in logged.items()
                  if t in ("ref/loss", "stream/rms/model.blocks.0", "ln/var_min/model.blocks.0.ln1", "clip/total_norm")},
    }))
"""


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.parametrize("version", ["installed", "untested"])
def test_the_monitors_alone_install_no_trainer_patch_and_need_no_version_guard(tmp_path, version):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FIT_ALONE), version, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["unwrapped"], "using the monitors wrapped lightning's _call_and_handle_interrupt"
    assert out["loaded"] == [], f"the monitors imported {out['loaded']}"
    assert out["steps"] == {t: [1, 3] for t in ("ref/loss", "stream/rms/model.blocks.0", "ln/var_min/model.blocks.0.ln1",
                                                 "clip/total_norm")}, out
    if version == "untested":
        assert out["lightning"] == "2.99.0"


@pytest.mark.slow  # a fresh interpreter
def test_the_check_sees_the_patch_when_the_plugin_is_used(tmp_path):
    # The same probe with LNPlacement constructed first reports the wrapped entry: the check above can fail.
    script = textwrap.dedent(_FIT_ALONE).replace(
        "from ln_lightning.callbacks import", "from ln_lightning import LNPlacement; LNPlacement('pre')\n"
        "from ln_lightning.callbacks import", 1)
    proc = subprocess.run([sys.executable, "-c", script, "installed", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["unwrapped"] and "ln_lightning._lightning_patch" in out["loaded"]


def test_the_namespace_check_the_monitors_share_with_the_plugin_imports_nothing():
    # ln_lightning._namespace is what the monitors take from the plugin's side: a leaf, without Lightning.
    import ln_lightning._namespace as leaf

    tree = ast.parse(Path(leaf.__file__).read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "typing"}, imported
