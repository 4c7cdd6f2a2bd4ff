"""`ln-lightning fit --config configs/demo_migrate_prenorm.yaml`: LightningCLI builds the Trainer with
LNPlacement (and the callbacks) from YAML; a shortened run writes the report, TensorBoard events and a
checkpoint that records the placement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ln_lightning.cli import main as cli_main
from ln_lightning.plugin import CHECKPOINT_KEY, MARKER, REPORT_FILENAME

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo_migrate_prenorm.yaml"


def _small(tmp_path) -> list[str]:
    # The demo config, shrunk: tiny model, 3 steps, logs under tmp_path.
    return [
        "--config", str(CONFIG),
        "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.logger.init_args.save_dir", str(tmp_path / "tb"),
        "--model.d_model", "16", "--model.n_layers", "2", "--model.n_heads", "2", "--model.block_size", "16",
        "--data.block_size", "16", "--data.batch_size", "4", "--data.max_chars", "20000",
    ]


@pytest.mark.slow  # jsonargparse's stub lookup (typeshed_client) starts a Python subprocess
def test_demo_config_parses_with_plugin_and_callbacks(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(CONFIG), "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    plugins = cfg["trainer"]["plugins"]
    plugins = plugins if isinstance(plugins, list) else [plugins]
    assert any(p["class_path"].endswith("LNPlacement") and p["init_args"]["placement"] == "pre" for p in plugins)
    assert cfg["model"]["class_path"] == "ln_lightning.demo.lightning.CharLM"
    assert cfg["data"]["class_path"] == "ln_lightning.demo.lightning.CharDataModule"
    assert cfg["trainer"]["logger"]["class_path"].endswith("TensorBoardLogger")


@pytest.mark.slow  # jsonargparse's stub lookup, as above
def test_a_config_with_the_deprecated_keywords_still_runs_and_warns(tmp_path, capsys):
    from ln_lightning import LNLightningDeprecationWarning

    config = yaml.safe_load(CONFIG.read_text())
    (plugin,) = [p for p in config["trainer"]["plugins"] if p["class_path"].endswith("LNPlacement")]
    plugin["init_args"].update(final_norm=False, branch_scale=0.5)  # the spelling of the last release
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(config))
    with pytest.warns(LNLightningDeprecationWarning, match=r"final_norm, branch_scale are deprecated.*"
                                                           r"init_args: \{placement: \{.*final_norm: false"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["fit", "--config", str(old), "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    (printed,) = [p for p in cfg["trainer"]["plugins"] if p["class_path"].endswith("LNPlacement")]
    spec = printed["init_args"]["placement"]
    assert (spec["placement"], spec["final_norm"], spec["branch_scale"]) == ("pre", False, 0.5)
    assert yaml.safe_load(old.read_text()) == config  # the user's file is not rewritten


@pytest.mark.slow  # jsonargparse's stub lookup, as above
@pytest.mark.parametrize("sync", [True, False])
def test_a_config_with_the_last_releases_sync_batchnorm_still_runs_and_warns(tmp_path, capsys, sync):
    """sync_batchnorm was an explicit LNPlacement keyword of the last release and still works for this one in
    Python; in a config file LightningCLI refused it (it is no longer in the signature) until it was respelled."""
    from ln_lightning import LNLightningDeprecationWarning

    config = yaml.safe_load(CONFIG.read_text())
    (plugin,) = [p for p in config["trainer"]["plugins"] if p["class_path"].endswith("LNPlacement")]
    plugin["init_args"]["sync_batchnorm"] = sync
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(config))
    with pytest.warns(LNLightningDeprecationWarning, match=r"sync_batchnorm is deprecated.*layer_sync"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["fit", "--config", str(old), "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    (printed,) = [p for p in cfg["trainer"]["plugins"] if p["class_path"].endswith("LNPlacement")]
    layer_sync = printed["init_args"].get("layer_sync")
    if sync:
        assert layer_sync["class_path"].endswith("TorchSyncBatchNorm"), printed
    else:
        assert layer_sync is None, printed
    assert "sync_batchnorm" not in printed["init_args"]


@pytest.mark.slow  # jsonargparse's stub lookup, as above
def test_a_config_with_the_last_releases_transition_keys_runs_the_open_loop_they_had(tmp_path, capsys):
    from ln_lightning import LNLightningDeprecationWarning

    config = yaml.safe_load(CONFIG.read_text())
    (plugin,) = [p for p in config["trainer"]["plugins"] if p["class_path"].endswith("LNPlacement")]
    plugin["init_args"].update(transition_steps=40, transition_schedule="cosine", transition_distill=0.0)
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(config))
    with pytest.warns(LNLightningDeprecationWarning, match=r"transition_steps.*deprecated.*TransitionSpec"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["fit", "--config", str(old), "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    (printed,) = [p for p in cfg["trainer"]["plugins"] if p["class_path"].endswith("LNPlacement")]
    t = printed["init_args"]["transition"]
    t = t.get("init_args", t)  # jsonargparse prints a dataclass as its fields
    assert (t["steps"], t["schedule"], t["distill"], t["tolerance"]) == (40, "cosine", 0.0, None), t
    assert not any(k.startswith("transition_") for k in printed["init_args"])


def test_transition_keys_without_transition_steps_are_refused_in_a_config():
    from ln_lightning.lightning_cli import _respell

    with pytest.raises(ValueError, match="apply only with transition_steps"):
        _respell({"class_path": "ln_lightning.LNPlacement", "init_args": {"transition_schedule": "cosine"}})


@pytest.mark.slow
def test_demo_fit_writes_report_tensorboard_and_placement_checkpoint(tmp_path):
    assert cli_main(["fit", *_small(tmp_path)]) == 0
    (log_dir,) = (tmp_path / "tb" / "demo_migrate_prenorm").iterdir()
    report = json.loads((log_dir / REPORT_FILENAME).read_text())
    assert report["config"]["placement"] == "pre" and report["report"]["changed"]
    assert report["report"]["added"]  # the final norm the post-norm demo model lacked
    assert list(log_dir.glob("events.out.tfevents.*"))
    (ckpt,) = (log_dir / "checkpoints").glob("last.ckpt")
    data = torch.load(ckpt, weights_only=False)
    assert data[CHECKPOINT_KEY]["config"]["placement"] == "pre"
    assert any(k.endswith(MARKER) for k in data["state_dict"])
    # the CLI's own validate, from that checkpoint, on a fresh model built from the same YAML
    assert cli_main(["validate", *_small(tmp_path), "--ckpt_path", str(ckpt)]) == 0


# A user's own LightningModule, in a file of the working directory (not a package, not on PYTHONPATH).
_USER_MODULE = '''
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ln_lightning.demo import PostNormTransformerLM


class MyLM(L.LightningModule):
    def __init__(self, d_model: int = 16):
        super().__init__()
        self.net = PostNormTransformerLM(vocab_size=32, d_model=d_model, n_layers=2, n_heads=2, block_size=8)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self.net(idx[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1))

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randint(0, 32, (8, 8))), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''

_USER_CONFIG = '''
trainer:
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  plugins:
    - class_path: ln_lightning.LNPlacement
      init_args: {placement: pre}
model:
  class_path: mymodels.MyLM
  init_args: {d_model: 16}
'''


@pytest.mark.slow  # starts the `ln-lightning` console script
def test_fit_imports_the_users_model_from_the_working_directory(tmp_path):
    """`ln-lightning fit --config` finds `mymodels.MyLM` in the current directory, as `inspect` and `export` do,
    with no PYTHONPATH (the console script's sys.path[0] is its bin folder, not the working directory)."""
    script = Path(sys.executable).with_name("ln-lightning")
    assert script.is_file(), f"{script}: the package's console script is not installed in this venv"
    (tmp_path / "mymodels.py").write_text(_USER_MODULE, encoding="utf-8")
    (tmp_path / "config.yaml").write_text(_USER_CONFIG, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(script), "fit", "--config", "config.yaml"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert "2/2 blocks converted to pre-norm" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]  # the plugin ran on it
