"""Transitions to the LLM placements (issues 11 and 12): `transition.begin(model, placement)` and
`LNPlacement(placement, transition_steps=N)` for "peri", "output" and "mix", from pre-norm (Llama),
post-norm (BERT, the demo LM) and peri-norm (Gemma 2) models.

At blend 0 the model computes exactly what it did (bit for bit), at blend 1 and after `finish` exactly
what `convert(copy, placement)` gives, and in between what the per-place blend formula says, checked
against a reference built by module replacement with the original modules (not the engine's hooks).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ln_lightning.demo import PostNormTransformerLM
from ln_lightning.placement import PlacementError, convert, inspect_model
from ln_lightning.placement.migrate import transition
from ln_lightning.placement.spec import PlacementSpec
from ln_lightning.plugin import LNPlacement

T = pytest.importorskip("transformers")
T.logging.set_verbosity_error()

from _helpers_llm import IDS, LLAMA, LLM, rel as _rel, trained as _trained  # noqa: E402




def _llama() -> nn.Module:
    torch.manual_seed(0)
    return _trained(T.LlamaModel(T.LlamaConfig(**LLM))).eval()


def _gemma2() -> nn.Module:
    torch.manual_seed(0)
    return _trained(T.Gemma2Model(T.Gemma2Config(**LLM, head_dim=16))).eval()


def _bert(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    cfg = T.BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64, vocab_size=99,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _trained(T.BertModel(cfg, add_pooling_layer=False)).eval()


def _out(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**IDS).last_hidden_state



class _BlendOutput(nn.Module):
    """Reference for a branch exit mid-transition: `(1-a)*b + a*norm(b)` on the branch value b."""

    def __init__(self, inner, norm, index, a, norm_first=False):
        super().__init__()
        self.inner, self.norm, self.index, self.a, self.norm_first = inner, norm, index, a, norm_first

    def _blend(self, b):
        if self.norm_first:  # the norm was at this place before: (1-a)*norm(b) + a*b
            return (1 - self.a) * self.norm(b) + self.a * b
        return (1 - self.a) * b + self.a * self.norm(b)

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self.index is None:
            return self._blend(out)
        return (self._blend(out[0]),) + tuple(out[1:])


@pytest.mark.parametrize("model_fn, placement", [(_llama, "peri"), (_llama, "output"), (_gemma2, "pre"), (_gemma2, "output"),
                                                 (_bert, "peri"), (_bert, "output"), (lambda: _bert(4), "mix")],
                         ids=["llama-peri", "llama-output", "gemma2-pre", "gemma2-output", "bert-peri", "bert-output", "bert-mix"])
def test_blend_keeps_the_function_at_0_and_is_the_conversion_at_1(model_fn, placement):
    model = model_fn()
    before = _out(model)
    target = copy.deepcopy(model)
    convert(target, placement)
    report = transition.begin(model, placement)
    assert report.converted, str(report)
    assert torch.equal(_out(model), before)  # a = 0: bit for bit what it computed
    transition.set_blend(model, 0.5)
    mid = _out(model)
    transition.set_blend(model, 1.0)
    torch.testing.assert_close(_out(model), _out(target), atol=0, rtol=1e-6)
    assert _rel(mid, before) > 1e-4 and _rel(mid, _out(target)) > 1e-4  # the blend does move between the two
    transition.finish(model)
    assert transition.leftovers(model) == []
    torch.testing.assert_close(_out(model), _out(target), atol=0, rtol=1e-6)
    assert [b.placement for b in inspect_model(model).blocks] == [b.placement for b in inspect_model(target).blocks]


@pytest.mark.parametrize("a", [0.25, 0.7])
def test_llama_pre_to_peri_mid_blend_matches_module_replacement(a):
    model = _llama()
    original = copy.deepcopy(model)
    transition.begin(model, "peri")
    transition.set_blend(model, a)
    ref = copy.deepcopy(original)
    for i, layer in enumerate(ref.layers):
        for norm, exit_, index in LLAMA:
            added = copy.deepcopy(model.get_submodule(f"layers.{i}.{norm}_out_norm"))  # a fresh LlamaRMSNorm, weight 1
            setattr(layer, exit_, _BlendOutput(getattr(layer, exit_), added, index, a))
    assert _rel(_out(model), _out(ref)) < 1e-6


@pytest.mark.parametrize("a", [0.3])
def test_llama_pre_to_output_mid_blend_matches_module_replacement(a):
    model = _llama()
    original = copy.deepcopy(model)
    transition.begin(model, "output")
    transition.set_blend(model, a)
    ref = copy.deepcopy(original)

    class BlendInput(nn.Module):  # the norm leaves the input: (1-a)*N(x) + a*x
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return (1 - a) * self.norm(x) + a * x

    for layer in ref.layers:
        for norm, exit_, index in LLAMA:
            n = getattr(layer, norm)
            setattr(layer, norm, BlendInput(n))
            setattr(layer, exit_, _BlendOutput(getattr(layer, exit_), n, index, a))
    assert _rel(_out(model), _out(ref)) < 1e-6


def test_gemma2_peri_to_pre_mid_blend_matches_module_replacement():
    a = 0.4
    model = _gemma2()
    original = copy.deepcopy(model)
    transition.begin(model, "pre")
    transition.set_blend(model, a)
    ref = copy.deepcopy(original)

    class Fade(nn.Module):  # the output norm's call site: (1-a)*N(b) + a*b
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def forward(self, b):
            return (1 - a) * self.norm(b) + a * b

    for layer in ref.layers:
        layer.post_attention_layernorm = Fade(layer.post_attention_layernorm)
        layer.post_feedforward_layernorm = Fade(layer.post_feedforward_layernorm)
    assert _rel(_out(model), _out(ref)) < 1e-6


def test_refusals_name_the_combination():
    with pytest.raises(PlacementError, match="a transition to placement='post' can't preserve the function"):
        LNPlacement("post", transition_steps=3)
    with pytest.raises(PlacementError, match="mix_post_blocks is only used with placement='mix'"):
        LNPlacement(PlacementSpec("pre", mix_post_blocks=1))
    with pytest.raises(PlacementError, match="branch_scale applies"):
        LNPlacement(PlacementSpec("peri", branch_scale=0.5), transition_steps=3)
    model = _llama()
    convert(model, "peri")
    with pytest.raises(PlacementError, match=r"already converted \(to 'peri'\).*written in"):
        transition.begin(model, "output")
    # A block our rewrite changed before can't be blended from what it computes now.
    bert = _bert()
    convert(bert, "pre", final_norm=False)
    report = convert(bert, "peri", final_norm=False)
    with pytest.raises(PlacementError, match="had been rewritten by ln_lightning before"):
        transition.start(bert, report)
    assert transition.leftovers(bert) == []
    with pytest.raises(PlacementError, match="a transition ends at one of"):
        transition.check_target("sandwich")


def test_plugin_transition_to_peri_keeps_the_loss_then_ends_at_the_conversion(tmp_path):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from ln_lightning.demo.lightning import CharLM

    tiny = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, block_size=16)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=4)

    class LM(CharLM):
        def __init__(self):
            super().__init__(**tiny, lr=0.0, warmup_steps=1)
            torch.manual_seed(0)
            self.model = PostNormTransformerLM(**tiny)
            self.losses = []

        def training_step(self, b, batch_idx):
            loss = self._loss(b)
            self.losses.append(loss.item())
            return loss

    def loss_of(m):
        with torch.no_grad():
            logits = m(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), torch.roll(x, -1, dims=1).reshape(-1)).item()

    lm = LM()
    unconverted = copy.deepcopy(lm.model)
    target = copy.deepcopy(lm.model)
    convert(target, "peri")
    steps = 4
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps + 1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
                      default_root_dir=tmp_path,
                      # the plain blend, ending at identity output norms (the stream-scaled default: test_transition.py)
                      plugins=[LNPlacement("peri", transition_steps=steps, fused=False, transition_stream_scale=False)])
    trainer.fit(lm, data)
    assert abs(lm.losses[0] - loss_of(unconverted)) <= 1e-6 * abs(loss_of(unconverted))
    assert transition.active(lm.model) is None and transition.leftovers(lm.model) == []
    with torch.no_grad():
        torch.testing.assert_close(lm.model(x), target(x), atol=0, rtol=1e-6)
    assert LNPlacement.applied_config(lm)["placement"] == "peri"


def test_plugin_mix_post_blocks_is_recorded_and_compared():
    plugin = LNPlacement(PlacementSpec("mix", mix_post_blocks=1), fused=False)
    model = PostNormTransformerLM(vocab_size=64, d_model=32, n_layers=4, n_heads=2, block_size=16)
    report = plugin.rewrite(model)
    assert [b.status for b in report.blocks] == ["already"] + ["converted"] * 3, str(report)
    assert LNPlacement.applied_config(model)["mix_post_blocks"] == 1
    with pytest.raises(ValueError, match="mix_post_blocks 1 is not 2"):
        LNPlacement(PlacementSpec("mix", mix_post_blocks=2), fused=False).rewrite(model)
    LNPlacement(PlacementSpec("mix", mix_post_blocks=1), fused=False).rewrite(model)  # the same function: adopted


def test_plugin_mix_checks_the_scale_and_resolves_the_default_count():
    with pytest.raises(ValueError, match=r"branch_scale=0.5 can't be applied to 2 block\(s\) that are already pre-norm"):
        LNPlacement(PlacementSpec("mix", branch_scale=0.5), fused=False).rewrite(_llama())
    model = PostNormTransformerLM(vocab_size=64, d_model=32, n_layers=4, n_heads=2, block_size=16)
    LNPlacement("mix", fused=False).rewrite(model)  # None: a quarter of 4 blocks = 1
    LNPlacement(PlacementSpec("mix", mix_post_blocks=1), fused=False).rewrite(model)  # the same function: adopted, not refused


def test_norm_hooks_see_the_call_site_normalisation_during_a_transition():
    model = _bert()
    transition.begin(model, "pre")
    norm = model.encoder.layer[0].attention.output.LayerNorm
    seen = []
    norm.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    transition.set_blend(model, 0.5)
    _out(model)
    assert len(seen) == 2  # the branch entry's normalisation and the call site's (weighted 1-a)
    transition.finish(model)
    seen.clear()
    _out(model)
    assert len(seen) == 1  # plain pre-norm: the entry only
