"""Stream scales that let a post-norm model's trained branches keep their weight in a pre-norm stream.

A post-norm model divides its stream by the norm's per-token std `sigma_k` at every site `k` and multiplies
it by the norm's gain `gamma_k`, so an older branch's contribution is down-weighted, relative to the
newest, by the product of the `gamma/sigma` of the sites in between. A pre-norm stream only adds: every
branch keeps its full weight, and the trained function changes by much more than the norms' move suggests
(the plain transition's loss rises by +0.6 at a = 1 on the 12-layer demo LM, most of it in the last tenth).

Giving branch `k` the scale `C_k = prod_{i<k} sigma_i / |gamma_i|` (`C_0 = 1`, the embedding's weight)
restores those relative weights in the pre-norm stream, up to what one scalar per site can't hold (the
per-token spread of sigma, the per-channel spread of gamma, the norms' biases). The stream then grows
like `C`; the branches read it through their own norm, which removes the scale, and the final norm does
the same before the head.

`site_ratios` measures `sigma_k / mean|gamma_k|` on a batch with the model as it is (post-norm, trained);
`cumulative_scales` turns them into `C_0 .. C_K` (`C_K`: the stream scale the final norm reads).

These are the measurement as a standalone function, on an unconverted model: `examples/migrate_trained_methods.py`
builds the study's candidate migrations from them, and the tests compute the scales independently with them.
`LNPlacement`'s transition measures the same quantities itself, inside the blend, on its first training batch
(`placement.blend.Transition.begin_measurement`; `branch_scale="stream"`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


@torch.no_grad()
def site_ratios(model: nn.Module, norms: Sequence[nn.Module], run: Callable[[nn.Module], object]) -> list[float]:
    """`sigma_k / mean|gamma_k|` for each norm in `norms` (the sites, in the order the stream passes them),
    from one call `run(model)` (a forward on a batch, no gradient).

    sigma_k: the mean over tokens of the per-token std of the norm's input (the norm's own eps added under
    the root, as it normalises with). A norm without a weight counts |gamma| = 1. Each norm must run
    exactly once in `run`.
    """
    seen: dict[int, torch.Tensor] = {}

    def hook(module, args):
        x = args[0].detach().float()
        eps = float(getattr(module, "eps", 0.0) or 0.0)
        seen.setdefault(id(module), []).append((x.var(-1, unbiased=False) + eps).sqrt().mean())

    handles = [n.register_forward_pre_hook(hook) for n in norms]
    try:
        run(model)
    finally:
        for h in handles:
            h.remove()
    out = []
    for n in norms:
        got = seen.get(id(n), [])
        if len(got) != 1:
            raise ValueError(f"site_ratios: norm {type(n).__name__} ran {len(got)} times in one forward; each site must run once")
        w = getattr(n, "weight", None)
        gain = w.detach().float().abs().mean() if isinstance(w, torch.Tensor) else torch.ones(())
        out.append(float(got[0] / gain.clamp_min(1e-6)))
    return out


def cumulative_scales(ratios: Sequence[float]) -> list[float]:
    """`C_0 = 1`, `C_{k+1} = C_k * ratios[k]`: the branch scale of sublayer k is `C_k`, the stream scale
    after its site `C_{k+1}`; the last, `C_K`, is the scale the final norm reads."""
    c = [1.0]
    for r in ratios:
        if not (r > 0 and r < float("inf")):
            raise ValueError(f"cumulative_scales: every ratio must be positive and finite, got {r!r}")
        c.append(c[-1] * float(r))
    return c


__all__ = ["cumulative_scales", "site_ratios"]
