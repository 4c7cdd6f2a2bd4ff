"""Exact rewrites of an existing model's norms: `to_rmsnorm` (pre-norm LayerNorm -> RMSNorm, the writing weights
centred) and `fold_norms` (each norm's gain and bias folded into the linear layers that read it)."""

from ln_lightning.exact.fold_norms import fold_norms
from ln_lightning.exact.norms import FusedRMSNormWithBias, RMSNormWithBias
from ln_lightning.exact.report import ExactRewriteReport, NormRewrite
from ln_lightning.exact.to_rmsnorm import to_rmsnorm

__all__ = ["to_rmsnorm", "fold_norms", "ExactRewriteReport", "NormRewrite", "RMSNormWithBias", "FusedRMSNormWithBias"]
