"""`ln-lightning fit|validate|test|predict --config configs/NAME.yaml`: Lightning's own LightningCLI.

The YAML names the model, the data, the trainer and its plugins and callbacks by `class_path`, so any
LightningModule / LightningDataModule works, not only the demo:

    trainer:
      plugins:
        - class_path: ln_lightning.LNPlacement
          init_args: {placement: pre}     # or {placement: {placement: mix, mix_post_blocks: 2}}
    model:
      class_path: ln_lightning.demo.lightning.CharLM
    data:
      class_path: ln_lightning.demo.lightning.CharDataModule

Everything LightningCLI offers works as usual: `--print_config`, overrides such as `--trainer.max_steps 50`
or `--data.text_file my.txt`, several `--config` files.

A `class_path` may name a module of the current directory (`mymodels.MyLM` for `./mymodels.py`), as
`ln-lightning inspect` and `ln-lightning export` allow: the working directory is searched first, as
`python -m` does, without setting PYTHONPATH.

A config written for an earlier release, with `LNPlacement`'s deprecated keywords (`final_norm`, `branch_scale`,
`layerscale_init`, `mix_post_blocks`, `sync_batchnorm`, `transition_*`) in its `init_args`, still runs for this
release: they are moved into the `placement` spec (`sync_batchnorm: true` into `layer_sync: TorchSyncBatchNorm`, the
`transition_*` keys into `transition: TransitionSpec(..., tolerance=None)`, the open loop they had), with a
deprecation warning naming the new spelling.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningCLI

from ln_lightning._warnings import LNLightningDeprecationWarning

_SPEC_KEYS = ("final_norm", "branch_scale", "layerscale_init", "mix_post_blocks")
_SYNC_KEY = "sync_batchnorm"  # LNPlacement's keyword of the last release: now layer_sync
# LNPlacement's transition keywords of the last release -> TransitionSpec's fields (the open loop they had).
_TRANSITION_KEYS = {"transition_steps": "steps", "transition_schedule": "schedule", "transition_stream_scale": "stream_scale",
                    "transition_endpoint_fraction": "endpoint_fraction", "transition_distill": "distill"}


def _respell(plugin: dict) -> bool:
    """Move an LNPlacement entry's deprecated keywords into its `placement` spec, and `sync_batchnorm` into
    `layer_sync` (in place); whether it had any."""
    if not (isinstance(plugin, dict) and str(plugin.get("class_path", "")).endswith("LNPlacement")):
        return False
    args = plugin.get("init_args")
    keys = (*_SPEC_KEYS, _SYNC_KEY, *_TRANSITION_KEYS)
    moved = {k: args.pop(k) for k in keys if isinstance(args, dict) and k in args and (k != _SYNC_KEY or isinstance(args[k], bool))}
    if not moved:
        return False
    spec = {k: v for k, v in moved.items() if k in _SPEC_KEYS}
    new = {}
    if spec:
        placement = args.get("placement", "pre")
        if isinstance(placement, dict):
            raise ValueError(f"LNPlacement: {', '.join(spec)} given beside a placement spec, which holds them; set them "
                             "in the spec (init_args: {placement: {placement: pre, ...}})")
        args["placement"] = new["placement"] = {"placement": placement, **spec}
    old = {_TRANSITION_KEYS[k]: v for k, v in moved.items() if k in _TRANSITION_KEYS}
    if old.get("steps", 0) is None:  # transition_steps: null, the old default: no transition
        del old["steps"]
    if old:
        if "steps" not in old:
            raise ValueError(f"LNPlacement: {', '.join(k for k in moved if k in _TRANSITION_KEYS)} apply only with "
                             "transition_steps, which is missing. Write init_args: {transition: {class_path: "
                             "ln_lightning.TransitionSpec, init_args: {steps: N, ...}}}")
        if args.get("transition") is not None:
            raise ValueError("LNPlacement: pass transition (a TransitionSpec) or the deprecated transition_* keys, not both")
        # tolerance: null keeps the open-loop schedule the keys had (TransitionSpec's default is the closed loop).
        args["transition"] = new["transition"] = {"class_path": "ln_lightning.TransitionSpec",
                                                  "init_args": {**old, "tolerance": None}}
    if _SYNC_KEY in moved:  # LNPlacement's sync_batchnorm=True was layer_sync=TorchSyncBatchNorm()
        if moved[_SYNC_KEY]:
            if args.get("layer_sync") is not None:
                raise ValueError("LNPlacement: pass sync_batchnorm=True or layer_sync=..., not both (Lightning runs one LayerSync).")
            args["layer_sync"] = new["layer_sync"] = {"class_path": "lightning.pytorch.plugins.TorchSyncBatchNorm"}
        else:
            new["layer_sync"] = args.get("layer_sync")
    spelled = yaml.safe_dump(new, default_flow_style=True, sort_keys=False).strip()
    warnings.warn(f"LNPlacement: the config's init_args {', '.join(moved)} {'is' if len(moved) == 1 else 'are'} deprecated "
                  f"and read for this release only; write them in the placement spec: init_args: {spelled}",
                  LNLightningDeprecationWarning, stacklevel=2)
    return True


def _as_list(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def _respelled_configs(argv: list[str], tmp: str) -> list[str]:
    """`argv` with each `--config` file that uses LNPlacement's deprecated keywords replaced by a respelled copy."""
    out = list(argv)
    for i, arg in enumerate(argv):
        name = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else (arg[9:] if arg.startswith("--config=") else None)
        if name is None or not Path(name).is_file():
            continue
        config = yaml.safe_load(Path(name).read_text())
        trainer = config.get("trainer") if isinstance(config, dict) else None
        if not isinstance(trainer, dict):
            continue
        entries = [e for key in ("plugins", "callbacks") for e in _as_list(trainer.get(key))]
        if not any([_respell(e) for e in entries]):  # a list: every entry is respelled
            continue
        copy = Path(tmp) / f"{i}_{Path(name).name}"
        copy.write_text(yaml.safe_dump(config, sort_keys=False))
        if arg == "--config":
            out[i + 1] = str(copy)
        else:
            out[i] = f"--config={copy}"
    return out


def main(argv: list[str] | None = None) -> int:
    """Run LightningCLI on `argv` (default: sys.argv[1:]), e.g. `["fit", "--config", "configs/x.yaml"]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="ln_lightning_config_") as tmp:
        return _main(_respelled_configs(argv, tmp))


def _main(argv: list[str]) -> int:
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
