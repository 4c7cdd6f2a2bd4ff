"""`ln-lightning` command line.

    ln-lightning inspect MODULE:FACTORY [--json] [--placement pre|post]
    ln-lightning demo                              # convert the built-in post-norm model, print the report
    ln-lightning export CHECKPOINT OUT_DIR         # a checkpoint written with LNPlacement -> a Hugging Face directory
    ln-lightning fit --config configs/NAME.yaml    # LightningCLI, with LNPlacement and the monitors
    ln-lightning validate|test|predict ...
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("inspect", "demo"):
        from ln_lightning.inspect_cli import main as inspect_main

        return inspect_main(argv)
    if argv and argv[0] == "export":
        from ln_lightning.export.cli import main as export_main

        return export_main(argv)
    if argv and argv[0] in ("fit", "validate", "test", "predict"):
        from ln_lightning.lightning_cli import main as lightning_main

        return lightning_main(argv) or 0
    print(__doc__.strip())
    return 0 if argv and argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    raise SystemExit(main())
