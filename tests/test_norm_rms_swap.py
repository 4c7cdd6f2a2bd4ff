"""swap_layernorms on RMSNorms: torch's nn.RMSNorm family, and Hugging Face RMSNorm models from tiny configs (never
from_pretrained).

nn.RMSNorm and its subclasses: those that still compute an RMSNorm are swapped, one that computes something else
and a module only named like a norm are skipped with the reason; the report reverts and the swapped model pickles.

Hugging Face: for each of LlamaModel, Qwen2Model, MistralModel, Gemma2Model, Olmo2Model and T5Model: every
RMSNorm is swapped, the swapped float32 model's output is within 2x the original's float32 error
(both measured against a float64 copy whose norms compute the textbook formula, written here
independently of ln_lightning), the state_dict is unchanged, and revert restores bitwise the
original output. In bfloat16 each fused norm keeps its class's cast order (equal to the original
module on almost every element; a wrong order differs on a large fraction).
"""

from __future__ import annotations

import copy
import pickle
import types

import pytest
import torch
from torch import nn

from ln_lightning.norm import FusedRMSNorm, functional, swap_layernorms, unswap_layernorms


@pytest.fixture
def fused_op_on_tiny_tensors(monkeypatch):
    # The swapped norms run the fused op even on these tiny tensors (the composition used under
    # functional.RMS_EAGER_COMPOSITE_BELOW is covered in test_norm_numerics.py).
    monkeypatch.setattr(functional, "RMS_EAGER_COMPOSITE_BELOW", 0)


class _RMSKeepsInit(nn.RMSNorm):
    def __init__(self, d):
        super().__init__(d, eps=1e-6)


class _RMSUpcasts(nn.RMSNorm):  # still an RMSNorm: recognised by the probe, swapped
    def forward(self, x):
        return super().forward(x.float()).type_as(x)


class _RMSClamps(nn.RMSNorm):  # computes something else: skipped, with the reason
    def forward(self, x):
        return super().forward(x).clamp(-0.5, 0.5)


def test_swap_nn_rmsnorm_family_report_revert_and_pickle(fused_op_on_tiny_tensors):
    torch.manual_seed(0)
    model = nn.Sequential(nn.RMSNorm(8), _RMSKeepsInit(8), _RMSUpcasts(8), _RMSClamps(8), nn.LayerNorm(8))
    for m in model:
        nn.init.normal_(m.weight)
    x = torch.randn(5, 8)
    before = model(x)
    state = copy.deepcopy(model.state_dict())
    report = swap_layernorms(model)
    assert report.swapped == ["0", "1", "2", "4"]
    assert [s.path for s in report.skipped] == ["3"] and "overrides forward()" in report.skipped[0].reason
    assert type(model[0]) is FusedRMSNorm and isinstance(model[1], _RMSKeepsInit) and isinstance(model[2], _RMSUpcasts)
    torch.testing.assert_close(model(x), before, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    clone = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    report.revert()
    assert [type(m) for m in model] == [nn.RMSNorm, _RMSKeepsInit, _RMSUpcasts, _RMSClamps, nn.LayerNorm]
    assert torch.equal(model(x), before)


def test_swap_reports_modules_named_like_norms_that_it_does_not_recognise(fused_op_on_tiny_tensors):
    class OddRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight

    model = nn.Sequential(OddRMSNorm(), nn.RMSNorm(8))
    report = swap_layernorms(model)
    assert report.swapped == ["1"]
    assert [s.path for s in report.skipped] == ["0"] and "matches neither LayerNorm nor RMSNorm" in report.skipped[0].reason


# --------------------------------------------------------------------------- Hugging Face models


def _transformers():
    return pytest.importorskip("transformers")  # the Hugging Face tests only: the nn.RMSNorm family needs none

# class name -> (eps attribute, weight offset): read from the HF sources, not from ln_lightning
NORM_CLASSES = {
    "LlamaRMSNorm": ("variance_epsilon", 0.0), "Qwen2RMSNorm": ("variance_epsilon", 0.0),
    "MistralRMSNorm": ("variance_epsilon", 0.0), "Gemma2RMSNorm": ("eps", 1.0),
    "Olmo2RMSNorm": ("variance_epsilon", 0.0), "T5LayerNorm": ("variance_epsilon", 0.0),
}
_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")


def _build(name: str) -> nn.Module:
    T = _transformers()
    cfg = {
        "llama": lambda: T.LlamaModel(T.LlamaConfig(**_COMMON)),
        "qwen2": lambda: T.Qwen2Model(T.Qwen2Config(**_COMMON)),
        "mistral": lambda: T.MistralModel(T.MistralConfig(**_COMMON)),
        "gemma2": lambda: T.Gemma2Model(T.Gemma2Config(**_COMMON, head_dim=8)),
        "olmo2": lambda: T.Olmo2Model(T.Olmo2Config(**_COMMON, pad_token_id=0, eos_token_id=1, bos_token_id=2)),
        "t5": lambda: T.T5Model(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                           attn_implementation="eager")),
    }[name]
    torch.manual_seed(0)
    model = cfg().eval()
    with torch.no_grad():  # non-trivial norm weights: a wrong weight handling must show
        for m in model.modules():
            if type(m).__name__ in NORM_CLASSES:
                m.weight.copy_(torch.randn_like(m.weight) * 0.3 + (0.0 if NORM_CLASSES[type(m).__name__][1] else 1.0))
    return model


def _norms(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if type(m).__name__ in NORM_CLASSES]


def _textbook_rms(self, x):
    eps_attr, offset = NORM_CLASSES[type(self).__name__]
    x64 = x.double()
    n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + getattr(self, eps_attr))
    return n * (offset + self.weight.double())


def _reference64(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).double()
    for m in ref.modules():
        if type(m).__name__ in NORM_CLASSES:  # HF's own forward would compute in float32
            m.forward = types.MethodType(_textbook_rms, m)
    return ref


def _out(model, ids):
    kw = {"decoder_input_ids": ids} if isinstance(model, _transformers().T5Model) else {}
    with torch.no_grad():
        return model(input_ids=ids, **kw).last_hidden_state


MODELS = ["llama", "qwen2", "mistral", "gemma2", "olmo2", "t5"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", MODELS)
def test_swap_keeps_output_within_twice_float32_rounding_and_swaps_every_rmsnorm(name):
    model = _build(name)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = _out(_reference64(model), ids)
    orig = _out(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    norms = _norms(model)
    assert norms
    report = swap_layernorms(model)
    assert sorted(report.swapped) == sorted(norms) and report.skipped == []
    assert all(type(model.get_submodule(p)).__name__.startswith("Fused") for p in norms)
    swapped = _out(model, ids)
    err_orig = (orig.double() - ref).abs().max().item()
    err_swapped = (swapped.double() - ref).abs().max().item()
    assert err_swapped <= 2 * err_orig + 1e-7, (err_swapped, err_orig)
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    report.revert()
    assert all(type(model.get_submodule(p)).__name__ in NORM_CLASSES for p in norms)
    assert not any(k.startswith("ln_rms_") for p in norms for k in vars(model.get_submodule(p)))
    assert torch.equal(_out(model, ids), orig)
    swap_layernorms(model)
    assert sorted(unswap_layernorms(model).swapped) == sorted(norms)
    assert torch.equal(_out(model, ids), orig)


@pytest.mark.parametrize("path", ["kernel", "composite"])
@pytest.mark.parametrize("name", MODELS)
def test_bf16_fused_norms_keep_each_class_cast_order(name, path, monkeypatch):
    # these tensors are small: force the fused op (the compiled CPU kernel) or the composition
    monkeypatch.setattr(functional, "RMS_EAGER_COMPOSITE_BELOW", 0 if path == "kernel" else 1 << 60)
    model = _build(name)
    g = torch.Generator().manual_seed(2)
    for norm_path in _norms(model)[:3]:
        original = model.get_submodule(norm_path).to(torch.bfloat16)
        fused = copy.deepcopy(original)
        swap_layernorms(fused)
        x = (torch.randn(64, original.weight.shape[0], generator=g) * 3).bfloat16()
        with torch.no_grad():
            want, got = original(x), fused(x)
        assert got.dtype == want.dtype
        equal = (got == want).float().mean().item()
        # rstd may differ by a float32 ulp (another summation order), rarely moving a bf16 rounding
        assert equal >= 0.98, f"{norm_path}: only {equal:.1%} of elements equal the original's"
        ulp = (want.float().abs() * 2**-7).clamp_min(2**-126)
        assert ((got.float() - want.float()).abs() <= ulp).all()
