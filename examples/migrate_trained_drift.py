"""The drift profile: where a transition moves the trained function, with the trained weights held fixed.

For a grid of blends a in [0, 1], on a fixed probe batch of training windows: the output KL to a = 0
(KL(p_0 || p_a), per token) and the probe's cross-entropy; and the held-out loss on the study's fixed
windows. Three blends: the plain one (transition.py as it is) with the added final norm copied from the
trained last norm, the same with a freshly built final norm (the start a plugin-less continuation had
before issue 20), and the stream-scaled blend (`migrate_trained_methods.StreamScaledBlend`).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ln_lightning.placement.migrate import transition
from migrate_trained_methods import StreamScaledBlend, converted_scales, init_output_norms, kl_to_teacher, measure_scales

VARIANTS = {"plain, trained final norm": dict(scaled=False, fresh=False),
            "plain, fresh final norm": dict(scaled=False, fresh=True),
            "stream-scaled": dict(scaled=True, fresh=False),
            # the other placements a transition can end at (plain blend; "mix" also stream-scaled)
            "peri, plain": dict(scaled=False, fresh=False, placement="peri"),
            "peri, stream-scaled": dict(scaled=True, fresh=False, placement="peri"),
            "output, plain": dict(scaled=False, fresh=False, placement="output"),
            "mix, plain": dict(scaled=False, fresh=False, placement="mix"),
            "mix, stream-scaled": dict(scaled=True, fresh=False, placement="mix")}


def blend_grid(n: int) -> list[float]:
    """n evenly spaced points in [0, 1], and every hundredth above 0.9 (where the plain blend moves most)."""
    pts = {round(i / (n - 1), 6) for i in range(n)} | {round(0.9 + i / 100, 6) for i in range(11)}
    return sorted(pts)


def begin_variant(lm, probe_x, scaled: bool, fresh: bool, placement: str = "pre"):
    """Start a transition on `lm` (trained, unconverted); returns the stream scales (None for the plain blend)."""
    scales = sites = None
    if scaled:
        sites, ratios, _ = measure_scales(lm, probe_x)
    report = transition.begin(lm, placement, branch_scale=1.0 if scaled and placement in ("pre", "mix") else None)
    if scaled:
        sites, scales = converted_scales(lm, report, sites, ratios)
        if placement == "peri":
            init_output_norms(lm, sites, scales, probe_x)
    if fresh:
        with torch.no_grad():
            for p in report.added:
                n = lm.get_submodule(p)
                if isinstance(n, torch.nn.LayerNorm):
                    n.weight.fill_(1.0)
                    n.bias.zero_()
    if scaled:
        StreamScaledBlend(lm, report, scales, sites)
    return scales


@torch.no_grad()
def profile(make_model, probe_x, probe_y, eval_x, eval_y, grid: list[float]) -> dict:
    """{variant: [{a, kl, probe_ce, heldout}, ...]} for a model `make_model()` returns (trained, unconverted)."""
    out = {}
    for name, v in VARIANTS.items():
        lm = make_model().eval()
        scales = begin_variant(lm, probe_x, **v)
        transition.set_blend(lm, 0.0)
        ref = lm(probe_x)
        rows = []
        for a in grid:
            transition.set_blend(lm, a)
            logits = lm(probe_x)
            tot = sum(F.cross_entropy(lm(x).reshape(-1, 128), y.reshape(-1), reduction="sum").item() for x, y in zip(eval_x, eval_y))
            rows.append({"a": a, "kl": float(kl_to_teacher(logits, ref)),
                         "probe_ce": float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), probe_y.reshape(-1))),
                         "heldout": tot / sum(y.numel() for y in eval_y)})
        out[name] = {"rows": rows, "scales": scales}
    return out
