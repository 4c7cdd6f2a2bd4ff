"""`ln-lightning export CHECKPOINT OUT_DIR`: a checkpoint written with LNPlacement -> a Hugging Face directory.

The checkpoint's LightningModule is rebuilt with ``load_converted`` (its recorded class, or ``--model``), and
the converted Hugging Face model inside it is written with ``ln_lightning.save_pretrained``: the native class
where the family has one (``--native auto``, the default; ``yes`` requires it, ``no`` writes the remote-code
form). A checkpoint it cannot serve is reported in one line on stderr with exit code 2, never a traceback
(set LN_LIGHTNING_TRACEBACK=1 to see one when reporting a bug).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from ln_lightning._cli_errors import CliError, OneLineParser, run
from ln_lightning.checkpoint import CHECKPOINT_KEY, read_checkpoint
from ln_lightning.export.hf import save_pretrained
from ln_lightning.checkpoint import load_converted


def main(argv: list[str]) -> int:
    return run("ln-lightning export", _main, argv)


def _import_class(spec: str, option: str):
    module_name, sep, attr = spec.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise CliError(f"{option} {spec!r} is not MODULE:CLASS")
    if module_name == "__main__":
        raise CliError(
            f"the checkpoint was written from {spec}, a class defined in a script, which can't be imported here; "
            "pass --model MODULE:CLASS naming where that class can be imported from"
        )
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CliError(f"cannot import {module_name!r} for {option} {spec}: {e}") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise CliError(f"{module_name!r} has no class {attr!r} ({option} {spec})")
    return cls


def _main(argv: list[str]) -> int:
    p = OneLineParser(prog="ln-lightning export", description="Write the converted Hugging Face model of a checkpoint written "
                "with LNPlacement as a Hugging Face directory (native class where one exists, else remote code).")
    p.add_argument("checkpoint", help="a .ckpt written by a run with LNPlacement")
    p.add_argument("out_dir", help="a new (or empty) directory")
    p.add_argument("--model", help="MODULE:CLASS of the LightningModule, when the class the checkpoint records can't "
                   "be imported (defined in a script: __main__.X)")
    p.add_argument("--native", choices=["auto", "yes", "no"], default="auto",
                   help="auto: the native class where the family has one; yes: require it; no: the remote-code form")
    args = p.parse_args(argv[1:])

    ckpt, out = Path(args.checkpoint), Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CliError(f"{out} exists and is not an empty directory; give a new one")
    try:
        checkpoint = read_checkpoint(ckpt, "cpu")
    except (OSError, ValueError) as e:
        raise CliError(str(e).removeprefix("load_converted: ")) from None
    entry = checkpoint.get(CHECKPOINT_KEY)
    if not isinstance(entry, dict):
        raise CliError(f"{ckpt} records no placement rewrite (no checkpoint['{CHECKPOINT_KEY}']): it was not written by a "
                       "run with LNPlacement, so its model saves with its own save_pretrained")
    spec = args.model or entry.get("model_class")
    if not spec:
        raise CliError(f"{ckpt} does not record its LightningModule's class; pass --model MODULE:CLASS")
    cls = _import_class(spec, "--model" if args.model else "the recorded class")
    del checkpoint

    module = load_converted(cls, ckpt)
    written = save_pretrained(module, out, native={"auto": None, "yes": True, "no": False}[args.native])
    print(written)
    return 0
