"""The test suite's configuration: where its helpers come from, and the `slow` rule.

Helpers: what tests and benchmarks share (model builders, float64 references, case tables, the
multi-process scenarios) is the package's own :mod:`ln_lightning.testing`, imported by its name.
The tests-only helpers (`tests/_helpers_*.py`: hypothesis strategies, the fault worker, the
namespace models) are imported by module name too: pyproject.toml's `pythonpath = ["tests"]` puts
this folder on `sys.path`, so no test edits `sys.path`. Scripts run as `python tests/_helpers_x.py`
find their siblings the same way (Python puts a script's folder first).

Marks (pyproject.toml): `slow` on every test that starts processes (subprocesses, multi-process
strategies), compiles with torch.compile, or takes more than a few seconds; `browser` on the one
that drives headless Chromium. `python -m pytest -q -m "not slow" -n 2` is the quick run. The fixture
below keeps the first part of that rule true: a test without the `slow` mark that starts a Python
subprocess or a multiprocessing child fails, naming what it started.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys

import pytest
import torch

# One intra-op thread: the tests' tensors are tiny, and on a busy 2-core machine OpenMP's waiting
# threads cost more than the work. Tests that need several threads set them (the CPU kernels' thread-count
# determinism tests). Measured (issue 32, 2026-12-06, 1,104 tests not marked slow, the compiled-kernel cache built,
# an idle 2-core machine): the quick run (`-n 2`) 44.8 and 45.1 s wall (41 s in pytest); one worker, 65-69 s (63 s in
# pytest, 8-9 s of it collecting: torch, Lightning, transformers and x-transformers imports). Measured again on
# 2026-12-07 on the same machine, slower that day (a pure-Python loop of 10**7 additions 1.53 s; importing
# lightning.pytorch 10 s), from a fresh clone and venv with the kernel cache built: 113.9 s wall (106 s in pytest,
# 1,106 tests), about 25 s of it each worker's collection. A new venv loads a finished kernel build directly
# (norm/_extension.py); before, each new venv rebuilt both kernels (75 s more). Measured again on 2026-12-07 (c02798e,
# 1,184 tests, a fresh clone from ci-fresh with its venv and the kernel cache built, a day as slow as that one: the
# same Python loop 1.51 s, importing lightning.pytorch 7.1 s, collecting alone 15 s): 68.3 and 70.0 s wall (63-65 s
# in pytest). Measured again on 2026-12-07 afternoon (33e2dc6's tests, 1,189, the checkout's venv with the kernel cache
# built, nothing else running; the Python loop 1.66 s, importing lightning.pytorch 11.4 s, a sum of 166 worker-s of test
# durations): 125 s wall (117 s in pytest). Measured again on 2026-12-07 evening (1,193 tests, nothing else running, the
# Python loop 1.16 s, importing lightning.pytorch 8.5-9.1 s of CPU, every module from its .pyc): 89.5 s wall, and 98.4 s
# in pytest on a second run. Measured again on 2026-12-07 night (a fresh boot, the checkout's venv built anew, the kernel
# cache built; 1,199 tests, nothing else running): 94.8 s wall with the Python loop at 1.07 s, then 109.6 and 101.5 s
# (94-103 s in pytest) with it at 1.77 s; importing lightning.pytorch 8.0 s; a sum of 123 worker-s of test durations
# (no test above 3.7 s: the time is spread over many) and 12.6-17 s of collection per worker (Lightning's import pulls
# in torchmetrics, transformers and matplotlib). Measured again on 2026-12-08 (1,216 tests, the checkout's venv with the
# kernel cache built, nothing else running, the Python loop 1.13 s): 115.0 s wall (107.6 s in pytest), and 107.0 s
# (98.9 s) with 1,201 tests earlier that day; collecting alone 22 s (13.4 s in pytest). The 60 s held on the
# idle day only.
torch.set_num_threads(1)

# CI (CI=true) runs the property tests on hypothesis' fixed, derandomized examples, so a run's result is
# reproducible; locally they explore new examples each run (where rare edge cases are found and kept).
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI") == "true":
        _hypothesis_settings.load_profile("ci")
except ImportError:  # hypothesis is a dev extra; the tests that use it skip without it
    pass


def _is_python(argv0) -> bool:
    name = os.path.basename(os.fsdecode(argv0))
    return os.fsdecode(argv0) == sys.executable or name.startswith("python")


@pytest.fixture(autouse=True)
def _processes_need_the_slow_mark(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(what: str):
        pytest.fail(f"{request.node.nodeid} starts {what} without the `slow` mark: add @pytest.mark.slow", pytrace=False)

    popen_init = subprocess.Popen.__init__

    def checked_popen_init(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if argv and _is_python(argv[0]) and not kwargs.get("shell"):
            refuse(f"a Python subprocess ({' '.join(map(os.fsdecode, argv))[:200]})")
        popen_init(self, args, *rest, **kwargs)

    def refuse_start(process):
        refuse(f"a child process ({type(process).__name__})")

    # Other executables (ninja and g++ building the CPU kernels on first use) stay allowed.
    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen_init)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse_start)


def pytest_collection_modifyitems(config, items):
    # The `slow` tests first (a stable sort: each group keeps its order). On two workers fed one test at a time
    # (the README's `-n 2 --maxschedchunk 1`) the minutes-long ones start early and the ~1,100 quick ones fill
    # the end, instead of one worker running a three-minute test alone after the other has finished.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
