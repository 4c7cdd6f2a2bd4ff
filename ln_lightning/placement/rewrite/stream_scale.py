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
(`placement.migrate.blend.Transition.begin_measurement`; `branch_scale="stream"`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ln_lightning.norm import kinds


def norm_statistics(norm: nn.Module) -> tuple[torch.Tensor | None, float, bool]:
    """(gain vector or None, eps, whether it is an RMS norm) of a norm, whatever its class spells them:
    ``weight`` (torch, Hugging Face; Gemma's ``1 + w``), ``gamma`` (x-transformers' LayerNorm, with its ``unit_offset``), ``g``
    (x-transformers' RMSNorm); ``eps`` / ``variance_epsilon`` / ``epsilon``; RMS for ``nn.RMSNorm`` and any class
    named ``*RMS*``. The stream scale divides by the mean absolute gain."""
    gain = next((v for v in (getattr(norm, a, None) for a in ("weight", "gamma", "g")) if isinstance(v, torch.Tensor)), None)
    if gain is not None and getattr(norm, "unit_offset", False):
        gain = gain + 1.0
    elif gain is not None and gain is getattr(norm, "weight", None):
        spec = kinds.recognize_norm(norm)
        if spec is not None and spec.unit_offset:  # Gemma's `(1 + w)`: the gain is 1 + weight
            gain = gain + 1.0
    eps = next((float(v) for v in (getattr(norm, a, None) for a in ("eps", "variance_epsilon", "epsilon"))
                if isinstance(v, (int, float))), 0.0)
    rms = isinstance(norm, nn.RMSNorm) or "rms" in type(norm).__name__.lower()
    return gain, eps, rms


def site_ratio(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`sigma / mean|gamma|` of one norm's input `x` (0-dim, on x's device): sigma the mean over tokens of the
    per-token std (RMS for an RMS norm), with the norm's own eps under the root."""
    gain, eps, rms = norm_statistics(norm)
    x = x.detach().float()
    spread = x.pow(2).mean(-1) if rms else x.var(-1, unbiased=False)
    sigma = (spread + eps).sqrt().mean()
    g = gain.detach().float().abs().mean() if gain is not None else torch.ones((), device=x.device)
    return sigma / g.clamp_min(1e-6)


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
        seen.setdefault(id(module), []).append(site_ratio(module, args[0]))

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
        out.append(float(got[0]))
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


__all__ = ["cumulative_scales", "norm_statistics", "site_ratio", "site_ratios"]
