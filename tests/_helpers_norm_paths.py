"""The torch backend's eager paths, forced one at a time for a test, for both norms.

An eager torch-backend call takes one of these by its size, dtype and arguments (ln_lightning/norm/functional.py);
the switches below force each on the tests' small tensors:

- ``"compiled"``: the custom autograd.Function, on the compiled CPU kernels where they take the inputs (LayerNorm
  in bfloat16; RMSNorm in float32 and bfloat16, in the cast orders that round to ``x``'s dtype), on aten's elsewhere;
- ``"aten"``: the same Function with the compiled kernels switched off (as when they cannot build);
- ``"composite"``: the plain composition of aten ops that small tensors run;
- ``"shortcut"`` (LayerNorm only: RMSNorm has no such switch): a plain norm, nothing to fuse, runs ``F.layer_norm``
  itself; fused calls route as by default (the composite, for small tensors).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from ln_lightning.norm import _cpu_kernels, _torch_ops, functional

PATHS = {"layer": ("shortcut", "compiled", "aten", "composite"), "rms": ("compiled", "aten", "composite")}

# The compiled kernels' entry points of both norms, and what a call to each is counted as.
_KERNEL_CALLS = (("_compiled_forward", "forward"), ("_compiled_backward", "backward"),
                 ("_rms_compiled_forward", "forward"), ("_rms_compiled_backward", "backward"))


@contextlib.contextmanager
def forced_path(path: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Route both norms' eager torch-backend calls down ``path``. Yields a list that grows by ``"forward"`` or
    ``"backward"`` per compiled-kernel call: the proof of which path ran."""
    if path not in PATHS["layer"]:
        raise ValueError(f"unknown eager path {path!r}: choose one of {PATHS['layer']}")
    if path == "compiled" and _cpu_kernels.KERNELS.module() is None:
        pytest.fail(f"the compiled CPU kernels did not build: {_cpu_kernels.KERNELS.failure}")
    if path != "shortcut":
        below = 1 << 60 if path == "composite" else 0
        monkeypatch.setattr(functional, "PLAIN_LAYER_NORM_VIA_ATEN", False)
        monkeypatch.setattr(functional, "EAGER_COMPOSITE_BELOW", below)
        monkeypatch.setattr(functional, "RMS_EAGER_COMPOSITE_BELOW", below)
    calls: list[str] = []
    for name, tag in _KERNEL_CALLS:
        real = getattr(_torch_ops, name)
        monkeypatch.setattr(_torch_ops, name, lambda *a, _real=real, _tag=tag: calls.append(_tag) or _real(*a))
    with _cpu_kernels.KERNELS.disabled() if path == "aten" else contextlib.nullcontext():
        yield calls
