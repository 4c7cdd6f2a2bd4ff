"""RMSNorm's functional names at their old import path: both norms' functional code is :mod:`.functional`."""

from .functional import fused_add_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "rms_norm"]
