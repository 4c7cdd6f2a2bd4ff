"""The compiled CPU kernels' build: one :class:`CompiledKernels` object per C++ extension.

The extension (``csrc/add_norm_cpu.cpp``, LayerNorm and RMSNorm from one source: :mod:`._cpu_kernels`) is built
on first use with ``torch.utils.cpp_extension`` (a C++ compiler
and ninja; about 30 s once, cached in ``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``; concurrent processes wait for one build). Flags follow the CPU
capability PyTorch itself dispatches to (AVX512, AVX2 or the baseline), and the capability is part
of the extension's name, so a cache shared between different machines never loads code built for
another instruction set. So is a hash of the source: two installed versions of ln_lightning (two
venvs, an upgrade while a run goes on) never load each other's build, whose functions may take
other arguments. So is torch's version and the flags, and a build directory that already holds the built
module loads it directly: ninja's build file names the venv's torch headers, so going through ninja made every
new venv (a fresh clone's, CI's second Lightning version) rebuild, and two venvs take turns rebuilding. The
build compiles a copy of the source kept in its build directory, so checkouts at different paths share one build.

When the build is impossible (no compiler, no ninja, a failed compile) the torch backend keeps
using aten and one warning says why and how to fix it. ``LN_LIGHTNING_CPU_KERNELS=0`` turns the
compiled kernels off without a warning; :meth:`CompiledKernels.disabled` does so for a block of
code (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from ln_lightning._warnings import LNLightningWarning, user_stacklevel

ENV_VAR = "LN_LIGHTNING_CPU_KERNELS"
CSRC = Path(__file__).parent / "csrc"
_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_log = logging.getLogger(__name__)
# A build's lock file older than this was left by a build that did not finish (a process killed while it compiled:
# torch's lock holds no process id). torch waits for such a lock forever; the build takes about 30 s.
STALE_LOCK_S = 600.0


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def _capability() -> str:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch or an unknown platform: baseline flags
        return "DEFAULT"
    return cap if cap in _FLAGS else "DEFAULT"


def build_extension(name: str, source: Path, what: str):
    """Build (or load from the cache) the extension ``name`` from ``source`` for this CPU's capability."""
    from torch.utils.cpp_extension import _get_build_directory, load

    cap = _capability()
    flags = ["-O3", *_FLAGS.get(cap, [])]
    digest = hashlib.sha256(source.read_bytes() + f"\0{torch.__version__}\0{' '.join(flags)}".encode()).hexdigest()[:10]
    name = f"{name}_{cap.lower()}_{digest}"
    serial = f"{name}_serial"
    build_dir = Path(_get_build_directory(name, verbose=False))
    # The serial build's directory is its sibling (torch's _get_build_directory would create it, unused, each time).
    for built, where in ((name, build_dir), (serial, build_dir.with_name(serial))):  # OpenMP, or serial where it failed
        module = _load_built(built, where)
        if module is not None:
            return module
    # Announce the one-time stall (a changed source or torch gets a new name, so it is announced too).
    _log.warning("ln_lightning: compiling the CPU %s kernels for %s (once per machine and torch version, about 30 s; "
                 "set %s=0 to use aten's kernels instead)", what, cap, ENV_VAR)
    _clear_stale_lock(build_dir)
    try:
        return load(name=name, sources=[str(source_in_build_dir(name, source))], extra_cflags=[*flags, "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - e.g. Apple clang has no -fopenmp: build the serial kernels
        _log.warning("ln_lightning: building the CPU kernels with OpenMP failed (%s); building them single-threaded",
                     str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__)
        return load(name=serial, sources=[str(source_in_build_dir(serial, source))], extra_cflags=flags, verbose=False)


def _load_built(name: str, build_dir: Path):
    """The module a finished build of ``name`` left in ``build_dir``, or None (none there, a build under way, or a
    file that does not load: the build through torch then runs and replaces it)."""
    built = build_dir / f"{name}.so"
    if not built.exists() or (build_dir / "lock").exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - e.g. a link cut short by a killed process
        _log.warning("ln_lightning: the built CPU kernels %s did not load (%s); building them again", built,
                     str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__)
        return None
    return module


def _clear_stale_lock(build_dir: Path, stale_after: float | None = None) -> None:
    """Wait for another process's build (its lock file in `build_dir`) while the lock is younger than
    `stale_after` (STALE_LOCK_S); remove an older one, saying so, so the build starts again instead of waiting forever."""
    stale_after = STALE_LOCK_S if stale_after is None else stale_after
    lock = build_dir / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            _log.warning("ln_lightning: removing %s, left %.0f s ago by a CPU kernel build that did not finish (a "
                         "process killed while it compiled); building again", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.2)


def source_in_build_dir(name: str, source: Path) -> Path:
    """A copy of ``source`` inside the extension's build directory, which the build compiles instead.

    ninja's build file records the source's path, so compiling the checkout's own file made every checkout at
    another path (a fresh clone, a CI workspace, a second worktree) rebuild both kernels (about 50 s each). The
    build directory's name holds the source's hash, so its copy is written once and never changes (rewriting it
    would touch its mtime and make ninja rebuild); concurrent writers go through a rename, so none reads half a file.
    """
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    copy = build_dir / source.name
    data = source.read_bytes()
    if not copy.exists() or copy.read_bytes() != data:
        tmp = build_dir / f".{source.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, copy)
    return copy


class CompiledKernels:
    """One C++ extension, built once on first use (thread-safe), or ``None`` with the reason.

    Args:
        name: the extension's name (the capability is appended).
        source: its C++ file.
        what: what it computes, for messages (``"fused LayerNorm"``).
        fallback: what runs without it, completing "... could not be built, so " in the warning.
        fallback_choice: what ``ENV_VAR=0`` chooses, for the warning's fix ("aten's kernels").
        build: replaces the build (tests simulate a failing compiler with it).
    """

    def __init__(self, name: str, source: Path, what: str, fallback: str, fallback_choice: str,
                 build: Optional[Callable[[], Any]] = None):
        self.name, self.source, self.what = name, source, what
        self.fallback, self.fallback_choice = fallback, fallback_choice
        self.build = build if build is not None else self.build_default
        self.state = "unloaded"  # "unloaded" | "loaded" | "disabled" | "failed"
        self.failure: Optional[str] = None  # why the kernels are not in use, when they are not
        self._module: Any = None
        self._lock = threading.Lock()

    def build_default(self):
        return build_extension(self.name, self.source, self.what)

    def module(self) -> Any:
        """The compiled module, or ``None`` (:attr:`failure` says why)."""
        if self.state == "loaded":
            return self._module
        if self.state in ("disabled", "failed"):
            return None
        with self._lock:
            if self.state == "unloaded":
                self._load()
        return self._module if self.state == "loaded" else None

    def _load(self) -> None:
        if not enabled_by_env():
            self.state, self.failure = "disabled", f"{ENV_VAR}=0"
            return
        try:
            self._module, self.state = self.build(), "loaded"
        except Exception as exc:  # noqa: BLE001 - any build problem: fall back, say so once
            first = str(exc).strip().splitlines()
            self.failure = f"{type(exc).__name__}: {first[0][:300] if first else ''}"
            self.state = "failed"
            warnings.warn(
                f"ln_lightning: the compiled CPU {self.what} kernels could not be built, so {self.fallback} "
                f"({self.failure}). Fix: install a C++ compiler and `pip install ninja`; or set "
                f"{ENV_VAR}=0 to choose {self.fallback_choice} and silence this warning.",
                LNLightningWarning,
                stacklevel=user_stacklevel(),
            )

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Inside the block, :meth:`module` is ``None``: the torch backend runs aten, as without a build."""
        with self._lock:
            saved = self.state, self.failure
            self.state, self.failure = "disabled", "switched off by CompiledKernels.disabled()"
        try:
            yield
        finally:
            with self._lock:
                self.state, self.failure = saved
