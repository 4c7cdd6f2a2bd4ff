"""Fresh environments for the tests that check the package as users install it (tests/test_packaging.py,
tests/test_warning_category.py): a clean subprocess environment, a checked run, and a venv with the package
installed from its wheel.

:func:`installed_wheel_venv` is the cheap variant of test_packaging's fresh-venv test: it builds the wheel
(no build isolation: the test environment's setuptools), installs it into a new venv's site-packages, and
makes the test environment's own packages (torch, Lightning, pytest) importable through a ``.pth`` line, the
way site-packages are: at ``site`` time, after the interpreter's start-up. No ``PYTHONPATH``, no editable
install: the package is importable exactly when an installed one is, from its installed copy.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def clean_env(venv: Path | None = None) -> dict[str, str]:
    """``os.environ`` without what would put other code on the path (``PYTHONPATH``, ``PYTHONHOME``, ...),
    activating ``venv`` when given."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd``; fail (with both streams' tails) unless it exits 0."""
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-6000:]}"
    return r


@dataclasses.dataclass(frozen=True)
class InstalledVenv:
    venv: Path
    python: Path
    site_packages: Path
    env: dict[str, str]

    def run(self, args: list[str], cwd: Path, timeout: float = 300, extra_env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """``python *args`` in the venv, from ``cwd``; the exit status is the caller's to check."""
        env = dict(self.env, **(extra_env or {}))
        return subprocess.run([str(self.python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def installed_wheel_venv(dest: Path) -> InstalledVenv:
    """A venv under ``dest`` with ln_lightning installed (not editable) from a wheel of this checkout."""
    wheels = dest / "wheel"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        dest, clean_env(), 600)
    (wheel,) = wheels.glob("ln_lightning-*.whl")
    venv = dest / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], dest, clean_env(), 300)
    python = venv / "bin" / "python"
    site_packages = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             dest, clean_env(venv), 120).stdout.strip())
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site_packages), str(wheel)],
        dest, clean_env(), 600)
    # The test environment's packages, as a path line (its own .pth files, the editable install's among them, are not
    # processed: only the directory is added).
    (site_packages / "_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    return InstalledVenv(venv, python, site_packages, clean_env(venv))
