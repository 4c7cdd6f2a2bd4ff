"""ln_lightning.norm.kinds: norms recognised by what they compute (probe input), not by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ln_lightning.norm import FusedAddRMSNorm, FusedLayerNorm, FusedRMSNorm, explain_norm, recognize_norm
from ln_lightning.norm.kinds import register_norm_class, unregister_norm_class

transformers = pytest.importorskip("transformers")


def _hf(module_name: str, cls_name: str):
    import importlib

    return getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"), cls_name)


# (module, class, expected kind, eps attribute, unit offset, cast order): from the HF sources
HF = [
    ("llama", "LlamaRMSNorm", "variance_epsilon", False, "llama"),
    ("qwen2", "Qwen2RMSNorm", "variance_epsilon", False, "llama"),
    ("mistral", "MistralRMSNorm", "variance_epsilon", False, "llama"),
    ("gemma2", "Gemma2RMSNorm", "eps", True, "fp32"),
    ("gemma3", "Gemma3RMSNorm", "eps", True, "fp32"),
    ("olmo2", "Olmo2RMSNorm", "variance_epsilon", False, "fp32"),
    ("t5", "T5LayerNorm", "variance_epsilon", False, "t5"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mod,cls,eps_attr,offset,cast", HF, ids=[h[1] for h in HF])
def test_hf_rmsnorm_classes_are_recognised_with_their_numerics(mod, cls, eps_attr, offset, cast, dtype):
    module = _hf(mod, cls)(24, eps=3e-6).to(dtype)
    before = module.weight.detach().clone()
    spec = recognize_norm(module)
    assert spec is not None, explain_norm(module)
    assert (spec.kind, spec.eps, spec.eps_attr, spec.unit_offset, spec.cast_order, spec.normalized_shape) == (
        "rms", 3e-6, eps_attr, offset, cast, (24,))
    assert spec.weight is module.weight and spec.source == "probe"
    assert torch.equal(module.weight, before)  # the probe changes nothing


def test_torch_classes_and_fused_ones():
    assert recognize_norm(nn.LayerNorm(8)).kind == "layer"
    spec = recognize_norm(nn.RMSNorm(8))
    assert (spec.kind, spec.eps, spec.source) == ("rms", None, "class")
    assert spec.eps_for(torch.bfloat16) == torch.finfo(torch.bfloat16).eps
    assert recognize_norm(FusedLayerNorm(8)).kind == "layer"
    assert recognize_norm(FusedRMSNorm(8)).kind == "rms"
    add = recognize_norm(FusedAddRMSNorm(8, eps=1e-6, weight_offset=1.0, cast_order="llama"))
    assert (add.kind, add.unit_offset, add.cast_order) == ("rms", True, "llama")
    for m in (nn.Linear(8, 8), nn.BatchNorm1d(8), nn.GroupNorm(2, 8), nn.Sequential(nn.LayerNorm(8))):
        assert recognize_norm(m) is None


class _LooksLikeRMSNorm(nn.Module):
    """Named like a norm, but scales by the max, not the root mean square."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * x / (x.abs().amax(-1, keepdim=True) + self.eps)


class _WrongEpsRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):  # uses 1e-2, not its eps attribute
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2)


class Scaler(nn.Module):  # an RMSNorm under a name that does not say so
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.full((d,), 0.5))
        self.epsilon = 1e-5

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon)


def test_name_alone_is_not_enough_and_the_reason_is_given():
    assert recognize_norm(_LooksLikeRMSNorm(8)) is None
    assert "matches neither LayerNorm nor RMSNorm" in explain_norm(_LooksLikeRMSNorm(8))
    assert recognize_norm(_WrongEpsRMSNorm(8)) is None  # the mean-square ~ eps probe row shows it


def test_register_norm_class_for_unnamed_norms():
    assert recognize_norm(Scaler(8)) is None
    register_norm_class(Scaler)
    try:
        spec = recognize_norm(Scaler(8))
        assert (spec.kind, spec.unit_offset, spec.eps_attr, spec.source) == ("rms", True, "epsilon", "registered")
        register_norm_class(Scaler, kind="layer")  # a wrong declaration is not trusted
        assert recognize_norm(Scaler(8)) is None
    finally:
        unregister_norm_class(Scaler)
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_norm_class(int)
    with pytest.raises(ValueError, match="kind"):
        register_norm_class(Scaler, kind="batch")


def test_probe_fires_no_hooks():
    module = _hf("llama", "LlamaRMSNorm")(8)
    calls = []
    module.register_forward_pre_hook(lambda *a: calls.append(1))
    assert recognize_norm(module) is not None and calls == []


def test_docstring_examples_run():
    import doctest

    from ln_lightning.norm import kinds

    for module in (kinds,):  # functional and modules: test_norm.py
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, (module.__name__, result)
