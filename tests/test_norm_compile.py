"""Both norms' torch-backend ops under torch.library's checks and torch.compile, parametrised over the kind
("ln", "rms"): a pre-norm block of the fused modules compiles with no graph break and matches eager.
(The Triton ops: tests/test_norm_triton.py; the op schemas: tests/test_norm_op_schemas.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ln_lightning.norm import FusedAddLayerNorm, FusedAddRMSNorm, FusedLayerNorm, FusedRMSNorm, _torch_ops

KINDS = ["ln", "rms"]


def _opcheck_args(kind: str) -> list[tuple]:
    x, r, w, b = torch.randn(3, 10), torch.randn(3, 10), torch.randn(10), torch.randn(10)
    if kind == "ln":
        return [(x, r, w, b, 1e-5, False, False), (x.bfloat16(), None, w, None, 1e-5, True, False)]
    return [(x, r, w, 1e-5, False, 0.0, "fp32"), (x.bfloat16(), None, w.bfloat16(), 1e-5, True, 1.0, "llama"),
            (x.half(), r.half(), w, 1e-5, False, 0.0, "t5")]


@pytest.mark.slow  # opcheck traces the ops through AOTAutograd, torch.compile's front end (conftest's rule)
@pytest.mark.parametrize("kind", KINDS)
def test_custom_ops_pass_opcheck(kind):
    op = _torch_ops.add_layer_norm if kind == "ln" else _torch_ops.add_rms_norm
    for args in _opcheck_args(kind):
        args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(op, args)


class _PreNormBlock(nn.Module):
    """A plain norm on the branch input and a fused add + norm on the stream (RMSNorm with Gemma's 1 + w)."""

    def __init__(self, kind: str, d: int = 32):
        super().__init__()
        if kind == "ln":
            self.n1, self.add_norm = FusedLayerNorm(d), FusedAddLayerNorm(d)
        else:
            self.n1, self.add_norm = FusedRMSNorm(d, eps=1e-6), FusedAddRMSNorm(d, eps=1e-6, weight_offset=1.0)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, stream):
        branch = self.fc1(self.n1(stream))
        normed, stream = self.add_norm(branch, stream)
        return stream + self.fc2(normed)


def _compiled_matches_eager(block: nn.Module, compiled, params: list) -> None:
    x = torch.randn(4, 5, 32, requires_grad=True)
    out = compiled(x)
    got = torch.autograd.grad(out.sum(), [x, *params])
    ref = block(x)
    want = torch.autograd.grad(ref.sum(), [x, *params])
    torch.testing.assert_close(out, ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_torch_compile_fullgraph_no_graph_break(kind):
    torch.manual_seed(0)
    block = _PreNormBlock(kind)
    explanation = torch._dynamo.explain(block)(torch.randn(4, 5, 32, requires_grad=True))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    _compiled_matches_eager(block, torch.compile(block, fullgraph=True, backend="aot_eager"), [block.add_norm.weight])


@pytest.mark.slow
def test_torch_compile_inductor_matches_eager():
    torch.manual_seed(0)
    block = _PreNormBlock("ln")
    compiled = torch.compile(block, fullgraph=True)  # inductor: needs a C++ compiler on CPU
    _compiled_matches_eager(block, compiled, [block.add_norm.weight, block.n1.bias])
