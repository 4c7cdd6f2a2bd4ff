"""Optional dependencies: import one, or fail with an error that names the extra to install.

The extras (pyproject.toml): ``triton`` (the CUDA kernels), ``hf`` (Hugging Face models in the
examples and tests), ``plot`` (the examples' matplotlib plots), ``docs`` (this API reference),
``dev`` (the test suite).

Example:
    >>> from ln_lightning._extras import require
    >>> require("json", "plot").__name__
    'json'
    >>> require("no_such_module_xyz", "plot", "the examples' plots")
    Traceback (most recent call last):
    ...
    ImportError: no_such_module_xyz is needed for the examples' plots but is not installed (No module named 'no_such_module_xyz'): pip install 'ln-lightning[plot]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = ("triton", "hf", "plot", "docs", "dev")


def require(module: str, extra: str, purpose: str | None = None) -> ModuleType:
    """Import `module`, or raise ImportError naming the pip extra `extra` that provides it."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; one of {EXTRAS}")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.partition(".")[0]
        raise ImportError(
            f"{top} is needed for {purpose or 'this feature'} but is not installed ({err}): "
            f"pip install 'ln-lightning[{extra}]'"
        ) from err
