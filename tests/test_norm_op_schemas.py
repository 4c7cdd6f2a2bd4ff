"""The fused norms' torch.library ops: their schemas are pinned to the versioned namespace (`_common.OPS`).

torch.compile's caches key a compiled backward on the forward graph, which names only the forward op; after
an op's schema changes, a cached backward of the old schema is replayed and fails ("missing value for
argument 'eps'", seen when the backward ops gained `eps`). So a schema change must come with a new namespace:
this test fails until both the namespace and the table below are updated together.
"""

from __future__ import annotations

import torch

from ln_lightning.norm import _common, _torch_ops  # noqa: F401  (registers the ops)

SCHEMAS = {
    "ln_lightning_v2": [
        "add_layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool residual_in_fp32, bool y_fp32) -> (Tensor, Tensor, Tensor, Tensor)",
        "add_layer_norm_backward(Tensor dy, Tensor? dresidual, Tensor h, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, bool need_weight_grad, bool need_bias_grad, float eps) -> (Tensor, Tensor, Tensor)",
        "add_rms_norm(Tensor x, Tensor? residual, Tensor? weight, float eps, bool residual_in_fp32, float offset, str cast) -> (Tensor, Tensor, Tensor)",
        "add_rms_norm_backward(Tensor dy, Tensor? dresidual, Tensor h, Tensor rstd, Tensor? weight, float offset, bool need_weight_grad, float eps) -> (Tensor, Tensor)",
    ],
}
TRITON = {"triton_add_layer_norm": "add_layer_norm", "triton_add_layer_norm_backward": "add_layer_norm_backward",
          "triton_add_rms_norm": "add_rms_norm", "triton_add_rms_norm_backward": "add_rms_norm_backward"}


def _schema(name: str) -> str:
    return str(getattr(getattr(torch.ops, _common.OPS), name).default._schema).split("::", 1)[1]


def test_a_schema_change_comes_with_a_new_namespace():
    assert _common.OPS in SCHEMAS, f"namespace {_common.OPS} has no recorded schemas: add them here"
    got = sorted(_schema(s.split("(", 1)[0]) for s in SCHEMAS[_common.OPS])
    assert got == sorted(SCHEMAS[_common.OPS]), (
        "an op's schema changed: bump _common.OPS (compile caches would replay the old backward) and record the new schemas")


def test_the_triton_ops_share_the_torch_ops_schemas():
    try:
        from ln_lightning.norm import _triton_ops, _triton_rms  # noqa: F401
    except ImportError:
        import pytest

        pytest.skip("triton is not installed")
    for triton_name, torch_name in TRITON.items():
        assert _schema(triton_name).split("(", 1)[1] == _schema(torch_name).split("(", 1)[1], triton_name
