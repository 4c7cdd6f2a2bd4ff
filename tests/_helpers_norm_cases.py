"""What the fused-norm tests share: Hypothesis strategies for random :class:`Case` / :class:`RMSCase` tables,
and the compiled CPU kernels (built, or the test skipped; a failure in CI).

Kept in tests/ (hypothesis and pytest are test dependencies); the cases themselves and the float64
references are in :mod:`ln_lightning.testing.norm` / :mod:`ln_lightning.testing.norm_rms`.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import strategies as st

from ln_lightning.norm import _cpu_kernels
from ln_lightning.testing.norm import Case
from ln_lightning.testing.norm_rms import RMSCase

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def cases(draw, max_rows: int = 8, max_hidden: int = 300, dtypes=DTYPES):
    hidden = draw(st.one_of(st.sampled_from([1, 2, 3, 7, 31, 64, 127, 255, 256]), st.integers(1, max_hidden)))
    return Case(
        rows=draw(st.integers(1, max_rows)),
        hidden=min(hidden, max_hidden),
        dtype=draw(st.sampled_from(dtypes)),
        residual=draw(st.booleans()),
        affine=draw(st.sampled_from(["full", "no_bias", "none"])),
        offset=draw(st.sampled_from([0.0, 0.0, 1e4])),
        constant_rows=draw(st.integers(0, 2)),
        residual_in_fp32=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def rms_cases(draw, max_rows: int = 8, max_hidden: int = 300, dtypes=DTYPES):
    base = draw(cases(max_rows=max_rows, max_hidden=max_hidden, dtypes=dtypes))
    return RMSCase(base, draw(st.sampled_from(["fp32", "llama", "t5"])), draw(st.booleans()))


def compiled_cpu_kernels():
    """The compiled CPU kernels' module; CI must be able to build it (it installs g++ and ninja)."""
    mod = _cpu_kernels.KERNELS.module()
    if mod is None:
        if os.environ.get("CI"):
            pytest.fail(f"the compiled CPU kernels did not build in CI: {_cpu_kernels.KERNELS.failure}")
        pytest.skip(f"compiled CPU kernels unavailable: {_cpu_kernels.KERNELS.failure}")
    return mod
