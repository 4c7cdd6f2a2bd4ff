"""What ``ln-lightning inspect`` and ``ln-lightning export`` share: a problem is reported in one line on stderr with
exit code 2, never a traceback (set LN_LIGHTNING_TRACEBACK=1 to see one when reporting a bug)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable


class CliError(Exception):
    """A problem with what the user asked for: one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and exits 2; keep it to one line
        raise CliError(message)


def run(prog: str, body: Callable[[list[str]], int], argv: list[str]) -> int:
    """``body(argv)``, with what it raises said in one line as ``prog: ...`` and exit code 2."""
    try:
        return body(argv)
    except CliError as e:
        print(f"{prog}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - what we can't serve is the user's to see, in one line
        if os.environ.get("LN_LIGHTNING_TRACEBACK"):
            raise
        print(f"{prog}: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
