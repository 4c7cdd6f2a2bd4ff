"""`ln-lightning fit|validate|test|predict --config configs/NAME.yaml`: Lightning's own LightningCLI.

The YAML names the model, the data, the trainer and its plugins and callbacks by `class_path`, so any
LightningModule / LightningDataModule works, not only the demo:

    trainer:
      plugins:
        - class_path: ln_lightning.LNPlacement
          init_args: {placement: pre, final_norm: true}
    model:
      class_path: ln_lightning.demo.lightning.CharLM
    data:
      class_path: ln_lightning.demo.lightning.CharDataModule

Everything LightningCLI offers works as usual: `--print_config`, overrides such as `--trainer.max_steps 50`
or `--data.text_file my.txt`, several `--config` files.

A `class_path` may name a module of the current directory (`mymodels.MyLM` for `./mymodels.py`), as
`ln-lightning inspect` and `ln-lightning export` allow: the working directory is searched first, as
`python -m` does, without setting PYTHONPATH.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI


def main(argv: list[str] | None = None) -> int:
    """Run LightningCLI on `argv` (default: sys.argv[1:]), e.g. `["fit", "--config", "configs/x.yaml"]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # LightningCLI reads sys.argv when `args` is None; handing it our argv that way avoids its
    # "both args and command line arguments" warning when run as `ln-lightning fit ...`.
    saved = sys.argv
    sys.argv = [saved[0] if saved else "ln-lightning", *argv]
    # The console script's sys.path[0] is its bin folder: put the working directory first, as `python -m`
    # does, so the YAML's class_path can name the user's own module there (jsonargparse imports it).
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        LightningCLI(
            model_class=None,  # any LightningModule, chosen by class_path in the YAML
            datamodule_class=None,
            save_config_kwargs={"overwrite": True},  # re-running the demo into the same log dir is fine
        )
    finally:
        sys.argv = saved
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
