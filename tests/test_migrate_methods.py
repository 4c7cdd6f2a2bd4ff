"""The migration study's prototype (examples/migrate_trained_methods.py): the stream-scaled blend is exact at
both ends, as a default built from it must be (issue 20: exact at a = 0, exactly the conversion at the end)."""

from __future__ import annotations

import pytest
import torch

from _helpers_examples import load_example
from ln_lightning.demo.lightning import CharLM
from ln_lightning.placement import convert
from ln_lightning.placement.migrate import transition
from ln_lightning.placement.rewrite.scale import BranchScale

M = load_example("migrate_trained_methods")


def _trained_like(seed=0):
    torch.manual_seed(seed)
    lm = CharLM(n_layers=3, d_model=32, n_heads=2, block_size=16).eval()
    with torch.no_grad():  # norms away from their init, as training leaves them
        for n, p in lm.named_parameters():
            if ".ln" in n:
                p.add_(0.3 * torch.randn_like(p))
    return lm


def test_output_prototype_is_exact_at_both_ends():
    lm = _trained_like()
    x = torch.randint(0, 128, (4, 16))
    with torch.no_grad():
        before = lm(x)
    sites, ratios, _ = M.measure_scales(lm, x)
    report = transition.begin(lm, "output")
    sites, scales = M.converted_scales(lm, report, sites, ratios)
    patch = M.OutputScaledBlend(lm, scales, sites, x)
    assert max(scales) > 1.0 and len(patch.exits) == len(sites) == 6

    def at(a):
        transition.set_blend(lm, a)
        with torch.no_grad():
            return lm(x)

    assert torch.equal(at(0.0), before)  # the trained function, bit for bit
    assert not torch.equal(at(0.5), before)
    end = at(1.0)
    patch.remove()
    transition.finish(lm)
    assert not transition.leftovers(lm)
    with torch.no_grad():
        assert torch.equal(lm(x), end)  # the entry scales 1/C_k and the new exit norms stay: the a = 1 function


@pytest.mark.parametrize("placement,staggered", [("pre", False), ("pre", True), ("mix", False), ("peri", False)])
def test_stream_scaled_blend_is_exact_at_both_ends(placement, staggered):
    lm = _trained_like()
    x = torch.randint(0, 128, (4, 16))
    with torch.no_grad():
        before = lm(x)
    sites, ratios, _ = M.measure_scales(lm, x)
    assert len(sites) == 6
    report = transition.begin(lm, placement, branch_scale=None if placement == "peri" else 1.0,
                              **({"mix_post_blocks": 1} if placement == "mix" else {}))
    sites, scales = M.converted_scales(lm, report, sites, ratios)
    assert len(sites) == (4 if placement == "mix" else 6) and len(scales) == len(sites) + 1 and scales[0] == 1.0
    if placement == "peri":
        M.init_output_norms(lm, sites, scales, x)
    patch = M.StreamScaledBlend(lm, report, scales, sites, staggered=staggered)

    def at(a):
        transition.set_blend(lm, a)
        if staggered:
            patch.set_staggered(a, window=2.0)
        with torch.no_grad():
            return lm(x)

    assert torch.equal(at(0.0), before)  # the trained function, bit for bit
    mid = at(0.5)
    assert not torch.equal(mid, before)
    end = at(1.0)
    patch.remove()
    transition.finish(lm)
    assert not transition.leftovers(lm)
    with torch.no_grad():
        assert torch.equal(lm(x), end)  # finish leaves exactly the a = 1 function

    if placement != "pre":
        return
    # ... which is convert(model, "pre", branch_scale=1.0) with branch k's constant set to C_k
    ref = _trained_like()
    convert(ref, "pre", branch_scale=1.0)
    consts = [m for m in ref.modules() if isinstance(m, BranchScale)]
    for c, k in zip(consts, scales):
        c.c.fill_(k)
    with torch.no_grad():
        assert torch.allclose(ref(x), end, atol=1e-5, rtol=1e-5)


def test_remap_optimizer_state_keeps_moments_by_name():
    state = {"state": {0: {"m": 0}, 1: {"m": 1}}, "param_groups": [{"lr": 1e-4, "params": [0, 1]}]}
    out = M.remap_optimizer_state(state, ["a", "b"], ["a", "new", "b"])
    assert out["state"] == {0: {"m": 0}, 2: {"m": 1}} and out["param_groups"][0]["params"] == [0, 1, 2]
