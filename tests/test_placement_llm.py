"""The placements today's LLMs use, on Hugging Face models from small configs: Peri-LN / sandwich
(`x + N_out(F(N_in(x)))`), output-norm (`x + N(F(x))`, OLMo 2) and Mix-LN (post-norm in the first
quarter of the blocks, pre-norm after), each against its formula built by module replacement with
the original modules (independent of the engine's hooks), and back.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ln_lightning.placement import convert, inspect_model
from ln_lightning.placement.reading.blocks import fresh_norm_like

T = pytest.importorskip("transformers")
T.logging.set_verbosity_error()

from _helpers_llm import IDS, LLAMA, LLM, rel as _rel, trained as _trained  # noqa: E402



class _OutputNorm(nn.Module):
    """Reference: `norm(inner(...))` on the branch value (element `index` of a tuple output)."""

    def __init__(self, inner, norm, index):
        super().__init__()
        self.inner, self.norm, self.index = inner, norm, index

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self.index is None:
            return self.norm(out)
        return (self.norm(out[0]),) + tuple(out[1:])



def _out(model):
    return model(**IDS).last_hidden_state



def _llama():
    torch.manual_seed(0)
    return _trained(T.LlamaModel(T.LlamaConfig(**LLM)))


def test_llama_to_peri_adds_output_norms_and_goes_back_exactly():
    model = _llama().eval()
    original = copy.deepcopy(model)
    report = convert(model, "peri")
    assert [b.status for b in report.blocks] == ["converted"] * 2, str(report)
    assert report.added == [f"layers.{i}.{n}_out_norm" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    assert [b.placement for b in inspect_model(model).blocks] == ["peri", "peri"]
    ref = copy.deepcopy(original)
    for i, layer in enumerate(ref.layers):
        for norm, exit_, index in LLAMA:
            fresh = copy.deepcopy(model.get_submodule(f"layers.{i}.{norm}_out_norm"))
            setattr(layer, exit_, _OutputNorm(getattr(layer, exit_), fresh, index))
    with torch.no_grad():
        err = _rel(_out(model), _out(ref))
        assert err < 1e-5, err
        assert _rel(_out(model), _out(original)) > 1e-3  # it did change the function
    # The added norms start as the identity gain of the input norm's class (LlamaRMSNorm: weight 1).
    added = model.layers[0].input_layernorm_out_norm
    assert type(added).__name__ == "LlamaRMSNorm" and torch.equal(added.weight, torch.ones(32))
    back = convert(model, "pre")
    assert sorted(back.removed) == sorted(report.added), str(back)
    with torch.no_grad():
        torch.testing.assert_close(_out(model), _out(original), atol=0, rtol=0)


def test_llama_to_output_moves_each_norm_to_its_branch_output_and_back():
    model = _llama().eval()
    original = copy.deepcopy(model)
    report = convert(model, "output")
    assert [b.status for b in report.blocks] == ["converted"] * 2 and report.added == [], str(report)
    assert [b.placement for b in inspect_model(model).blocks] == ["output", "output"]
    ref = copy.deepcopy(original)
    for layer in ref.layers:
        for norm, exit_, index in LLAMA:
            n = getattr(layer, norm)
            setattr(layer, norm, nn.Identity())
            setattr(layer, exit_, _OutputNorm(getattr(layer, exit_), n, index))
    with torch.no_grad():
        assert _rel(_out(model), _out(ref)) < 1e-5
    convert(model, "pre")
    with torch.no_grad():
        torch.testing.assert_close(_out(model), _out(original), atol=0, rtol=0)


def test_gemma2_peri_to_pre_passes_its_output_norms_through_and_back():
    torch.manual_seed(0)
    model = _trained(T.Gemma2Model(T.Gemma2Config(**LLM, head_dim=16))).eval()
    original = copy.deepcopy(model)
    report = convert(model, "pre")
    assert [b.status for b in report.blocks] == ["converted"] * 2, str(report)
    ref = copy.deepcopy(original)
    for layer in ref.layers:
        layer.post_attention_layernorm = nn.Identity()
        layer.post_feedforward_layernorm = nn.Identity()
    with torch.no_grad():
        assert _rel(_out(model), _out(ref)) < 1e-5
    convert(model, "peri")
    with torch.no_grad():
        torch.testing.assert_close(_out(model), _out(original), atol=0, rtol=0)


def test_bert_mix_keeps_the_first_quarter_post_norm():
    torch.manual_seed(0)
    cfg = T.BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, vocab_size=99,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _trained(T.BertModel(cfg)).eval()
    original = copy.deepcopy(model)
    report = convert(model, "mix")
    assert [(b.status, b.after) for b in report.blocks] == [("already", "post")] + [("converted", "pre")] * 3, str(report)
    assert report.added == ["encoder.layer_final_norm"]
    # Reference: layers 1..3 by module replacement (norm -> identity, entry gets LN(x)), then the final norm.
    ref = copy.deepcopy(original)

    class Entry(nn.Module):
        def __init__(self, inner, norm):
            super().__init__()
            self.inner, self.norm = inner, norm

        def forward(self, x, *a, **k):
            return self.inner(self.norm(x), *a, **k)

    for layer in list(ref.encoder.layer)[1:]:
        for norm_path, entry in (("attention.output", "attention.self"), ("output", "intermediate")):
            owner = layer.get_submodule(norm_path)
            norm, owner.LayerNorm = owner.LayerNorm, nn.Identity()
            parent, _, name = entry.rpartition(".")
            holder = layer.get_submodule(parent) if parent else layer
            setattr(holder, name, Entry(getattr(holder, name), norm))
    final = copy.deepcopy(model.encoder.layer_final_norm)
    final.__dict__.pop("ln_lightning_final_norm_of", None)
    last = ref.encoder.layer[3]

    def last_with_final_norm(self, *a, **k):
        out = last(*a, **k)
        return final(out) if isinstance(out, torch.Tensor) else (final(out[0]),) + tuple(out[1:])

    ref.encoder.layer[3] = type("Last", (nn.Module,), {"forward": last_with_final_norm})()
    with torch.no_grad():
        assert _rel(_out(model), _out(ref)) < 1e-5
    back = convert(model, "post")
    with torch.no_grad():
        torch.testing.assert_close(_out(model), _out(original), atol=0, rtol=0)
    assert back.removed == ["encoder.layer_final_norm"]


def test_placement_options_are_checked():
    from ln_lightning.placement import PlacementError

    m = _llama()
    with pytest.raises(PlacementError, match="mix_post_blocks is only used with placement='mix'"):
        convert(m, "pre", mix_post_blocks=1)
    with pytest.raises(PlacementError, match="branch_scale applies"):
        convert(m, "peri", branch_scale=0.5)
    with pytest.raises(PlacementError, match="'peri'.*'output'.*'mix'"):
        convert(m, "sandwich")


def test_fresh_output_norms_start_at_the_identity_gain():
    gemma = T.Gemma2Model(T.Gemma2Config(**LLM, head_dim=16))
    n = fresh_norm_like(gemma.layers[0].input_layernorm)  # Gemma applies 1 + w: identity is w = 0
    assert torch.equal(n.weight, torch.zeros_like(n.weight))
    ln = fresh_norm_like(_trained(nn.Sequential(nn.LayerNorm(8)))[0])
    assert torch.equal(ln.weight, torch.ones(8)) and torch.equal(ln.bias, torch.zeros(8))
