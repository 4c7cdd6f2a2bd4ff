"""Branch scaling: `x + c * F(LN(x))` with a constant `c`, or LayerScale's learnable per-channel `c`."""

from __future__ import annotations

import math

import torch
from torch import nn

from ln_lightning.placement.rewrite import hooks


def layerscale_init_for_depth(depth: int) -> float:
    """LayerScale's rule (Touvron et al. 2021, CaiT): 0.1 up to 18 blocks, 1e-5 up to 24, 1e-6 deeper."""
    if depth <= 18:
        return 0.1
    if depth <= 24:
        return 1e-5
    return 1e-6


def depth_scale(depth: int) -> float:
    """`c = 1/sqrt(2L)`: the stream's variance then grows like `v0 + 2L * c^2 q / 2 = v0 + q` at most."""
    return 1.0 / math.sqrt(2 * depth)


class BranchScale(nn.Module):
    """Multiplies a branch's output by a constant (`learnable=False`) or a learnable per-channel vector.

    The constant is a non-persistent buffer: it follows `.to()` and dtype casts but adds no
    state_dict key (the configuration gives its value). `measured=True` (branch_scale="stream": a value a
    transition measures from the trained model, which no configuration holds) makes it persistent, so every
    checkpoint and saved model carries it. The learnable form has one parameter, `gamma`, of shape `(dim,)`.
    """

    def __init__(self, value: float, dim: int | None = None, learnable: bool = False, device=None, dtype=None,
                 measured: bool = False):
        super().__init__()
        self.learnable = learnable
        if learnable:
            if dim is None:
                raise ValueError("a learnable branch scale needs the channel dimension")
            self.gamma = nn.Parameter(torch.full((dim,), float(value), device=device, dtype=dtype))
        else:
            self.register_buffer("c", torch.tensor(float(value), device=device, dtype=dtype), persistent=measured)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.gamma if self.learnable else self.c)

    def value(self) -> torch.Tensor:
        return self.gamma if self.learnable else self.c

    def extra_repr(self) -> str:
        return f"dim={self.gamma.numel()}, learnable" if self.learnable else f"c={self.c.item():.4g}"


class InputScale(nn.Module):
    """Divides what a branch reads by a constant: `x + N(F(x / c))`, the stream-scaled "output" placement.

    The output-norm form of a post-norm model (`x + N(F(x))`) feeds each branch the raw stream, which grows
    along the stack; `c` (branch_scale="stream": measured by a transition, `C_k = prod sigma_i / |gamma_i|`) brings
    it back to the scale the trained branch read. A persistent buffer: every checkpoint and saved model carries
    it. Its entry hook calls `normalize` as a norm's would.
    """

    def __init__(self, value: float = 1.0, device=None, dtype=None):
        super().__init__()
        self.register_buffer("c", torch.tensor(float(value), device=device, dtype=dtype), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.c

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """What the entry hook calls (as a norm's): the recording tells this division from the user's reads."""
        with hooks.our_normalization():
            return self.forward(x)

    def value(self) -> torch.Tensor:
        return self.c

    def extra_repr(self) -> str:
        return f"c={self.c.item():.4g}"
