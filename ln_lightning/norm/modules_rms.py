"""RMSNorm's modules at their old import path: both norms' modules are :mod:`.modules`."""

from .modules import FusedAddRMSNorm, FusedRMSNorm, FusedRMSNormForward

__all__ = ["FusedAddRMSNorm", "FusedRMSNorm", "FusedRMSNormForward"]
