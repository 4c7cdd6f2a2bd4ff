"""Writes the checkpoints tests/test_checkpoint_compat.py keeps, with the ln_lightning it is run against.

Run from an export of the commit to keep (not from this checkout, whose ln_lightning is the one under test):

    git archive 504b1ba | tar -x -C /tmp/old && cp tests/data/checkpoints/make_checkpoints.py /tmp/old/ \
        && (cd /tmp/old && python make_checkpoints.py OUT_DIR)

Two fits of the tiny demo LM: plain `LNPlacement("pre")` (2 steps), and one stopped mid-transition (3 steps of
a 40-step closed-loop budget: the blend, the schedule and the teacher are in the file). Beside each:
`<name>.expected.pt` holds an input and the loaded model's output in eval mode, computed by that same code.
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import ln_lightning
from ln_lightning import LNPlacement, TransitionSpec
from ln_lightning.demo.lightning import CharLM
from ln_lightning.plugin import load_converted
from ln_lightning.testing import plugin as h


def _fit(out: Path, name: str, plugin, steps: int) -> None:
    torch.manual_seed(0)
    model = CharLM(**h.TINY)
    ckpt = ModelCheckpoint(dirpath=str(out / "tmp" / name), save_last=True)
    Trainer(accelerator="cpu", devices=1, max_steps=steps, num_sanity_val_steps=0, logger=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            default_root_dir=str(out / "tmp"), plugins=[plugin], callbacks=[ckpt]).fit(model, h.loader(16))
    path = out / f"{name}.ckpt"
    path.write_bytes((out / "tmp" / name / "last.ckpt").read_bytes())
    x = h.RandomTokens(4, seed=2).data[:, :-1]
    loaded = load_converted(CharLM, path)
    with torch.no_grad():
        torch.save({"x": x, "y": loaded(x)}, out / f"{name}.expected.pt")


def main(out: str) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _fit(out, "pre", LNPlacement("pre", fused=False, log_report=False), 2)
    _fit(out, "mid_transition", LNPlacement("pre", transition=TransitionSpec(steps=40), fused=False, log_report=False), 3)
    commit = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (out / "provenance.json").write_text(json.dumps({"ln_lightning": ln_lightning.__file__, "version": ln_lightning.__version__,
                                                     "torch": torch.__version__, "commit": commit or sys.argv[2:]}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
