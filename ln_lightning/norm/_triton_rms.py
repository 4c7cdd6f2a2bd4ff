"""RMSNorm's names for the shared Triton kernels of :mod:`._triton_ops` (one kernel pair, ``IS_RMS_NORM``).

Kept because ``benchmarks/triton_aot.py`` (and its test) address each norm's kernels as a module with
``plan_forward`` / ``plan_backward`` / ``forward_launch_config`` / ``backward_launch_config``.
"""

from __future__ import annotations

from functools import partial

from ._triton_ops import (  # noqa: F401 - re-exported
    forward_launch_config,
    rms_plan_backward as plan_backward,
    rms_plan_forward as plan_forward,
    triton_add_rms_norm,
    triton_add_rms_norm_backward,
    triton_add_rms_norm_eager,
)
from ._triton_ops import backward_launch_config as _backward_launch_config

backward_launch_config = partial(_backward_launch_config, rms=True)
