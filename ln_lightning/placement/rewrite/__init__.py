"""The rewrite mechanism: the hooks that move a norm, the branch scales, the added final norm, the fused norms swapped in, and the exact reparameterisations (DeepNorm, LayerNorm Scaling)."""
