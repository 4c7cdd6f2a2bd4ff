"""Second review of PlacementSpec (issue 32, point 1): contradictions that can still be expressed. Each test is
the behaviour the spec's docstring promises ("options that contradict each other can't be built")."""

from __future__ import annotations

import pytest
import torch

from ln_lightning import PlacementSpec, TransitionSpec, convert
from ln_lightning.demo.models import PostNormTransformerLM
from ln_lightning.placement.errors import PlacementError


def test_a_stream_branch_scale_beside_a_transition_without_stream_scale_is_refused():
    with pytest.raises((PlacementError, ValueError), match="stream_scale"):
        PlacementSpec("pre", branch_scale="stream", transition=TransitionSpec(steps=5, stream_scale=False))


def test_convert_refuses_an_explicit_default_valued_keyword_beside_a_spec_that_differs():
    model = PostNormTransformerLM(vocab_size=50, d_model=16, n_layers=2, n_heads=2, block_size=8).eval()
    with pytest.raises(PlacementError, match="final_norm given beside a PlacementSpec"):
        convert(model, PlacementSpec("pre", final_norm=False), final_norm=True,
                example_input=torch.randint(0, 50, (2, 8)))


@pytest.mark.parametrize("spec", [
    PlacementSpec("pre"), PlacementSpec("mix", mix_post_blocks=2, branch_scale=0.5), PlacementSpec("post", final_norm=False),
    PlacementSpec("pre", branch_scale="layerscale", layerscale_init=1e-3),
    PlacementSpec("peri", transition=TransitionSpec(5, stream_scale=False)), PlacementSpec("output", transition=7),
    PlacementSpec("pre", transition=TransitionSpec(9, tolerance=None, schedule="cosine")),
])
def test_config_round_trip_keeps_what_the_model_computes(spec):
    back = PlacementSpec.from_config(spec.config, transition=spec.transition)
    assert back.config == spec.config and back.stream_scaled == spec.stream_scaled
    assert PlacementSpec.from_config(back.config, transition=back.transition) == back  # a fixed point after one trip
