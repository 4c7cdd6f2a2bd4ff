"""Shared pieces of the export tests: the families (tiny configs), trained-looking norms, inputs, outputs.

Every case is a Hugging Face model built from a small config (hidden 32, 2 layers), its norms given weights
away from 1 and 0 (with default norms a swapped mapping gives an exact 0 error and goes unseen), converted to
pre-norm by the engine or put mid-transition. The reference a test compares with is that converted model's own
output: the engine's hooks, not the export code under test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

H = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=99,
         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
S2S = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
           encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=99, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
W2V = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
           conv_stride=(2, 2), conv_kernel=(3, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
           hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
           mask_time_prob=0.0, vocab_size=20)
OPT = dict(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2, vocab_size=99, word_embed_proj_dim=32,
           do_layer_norm_before=False, dropout=0.0, attention_dropout=0.0)


def token_ids() -> torch.Tensor:
    """Two rows ending in </s> (id 2; BART's sequence classifier reads it), no other 2s, no padding."""
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    ids[:, -1] = 2
    return ids


def waveform() -> torch.Tensor:
    return torch.randn(2, 200, generator=torch.Generator().manual_seed(2))


@dataclass(frozen=True)
class Case:
    name: str
    cls: str  # the transformers class converted
    config: str  # its config class
    config_kwargs: dict
    auto: str  # the Auto class plain loading would use
    route: str  # the route save_pretrained takes: "native" or "remote_code" (a transition: always remote code)
    native: str | None = None  # the native class, for route "native"
    speech: bool = False
    tied: bool = False  # input and output embeddings tied

    def build(self) -> nn.Module:
        import transformers as T

        torch.manual_seed(0)
        return getattr(T, self.cls)(getattr(T, self.config)(**self.config_kwargs)).eval()

    def inputs(self) -> dict:
        return {"input_values": waveform()} if self.speech else {"input_ids": token_ids()}

    def example_input(self):
        return waveform() if self.speech else None


CASES = [
    Case("bert", "BertForMaskedLM", "BertConfig", H, "AutoModelForMaskedLM", "remote_code", tied=True),
    Case("bert-base", "BertModel", "BertConfig", H, "AutoModel", "remote_code"),
    Case("distilbert", "DistilBertForSequenceClassification", "DistilBertConfig",
         dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=99, dropout=0.0, attention_dropout=0.0),
         "AutoModelForSequenceClassification", "remote_code"),
    Case("albert", "AlbertForMaskedLM", "AlbertConfig", dict(embedding_size=16, **{**H, "num_hidden_layers": 3}),
         "AutoModelForMaskedLM", "remote_code", tied=True),
    Case("electra", "ElectraForMaskedLM", "ElectraConfig", dict(embedding_size=32, **H), "AutoModelForMaskedLM",
         "remote_code", tied=True),
    Case("roberta", "RobertaForMaskedLM", "RobertaConfig", H, "AutoModelForMaskedLM", "native",
         "RobertaPreLayerNormForMaskedLM", tied=True),
    Case("roberta-cls", "RobertaForSequenceClassification", "RobertaConfig", H, "AutoModelForSequenceClassification",
         "native", "RobertaPreLayerNormForSequenceClassification"),
    Case("bart", "BartForConditionalGeneration", "BartConfig", S2S, "AutoModelForSeq2SeqLM", "native",
         "MBartForConditionalGeneration", tied=True),
    Case("bart-cls", "BartForSequenceClassification", "BartConfig", S2S, "AutoModelForSequenceClassification", "native",
         "MBartForSequenceClassification"),
    Case("wav2vec2", "Wav2Vec2ForCTC", "Wav2Vec2Config", {**W2V, "do_stable_layer_norm": False}, "AutoModelForCTC",
         "remote_code", speech=True),
    Case("hubert", "HubertModel", "HubertConfig", {**W2V, "do_stable_layer_norm": False}, "AutoModel", "remote_code",
         speech=True),
]
BY_NAME = {c.name: c for c in CASES}


def trained_looking(module: nn.Module, seed: int = 3) -> nn.Module:
    """Norm gains in [0.5, 1.5) and biases in [-0.5, 0.5): a misplaced or swapped norm changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
                if m.bias is not None:
                    m.bias.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
    return module


def converted(case: Case, *, transition_blend: float | None = None) -> nn.Module:
    """The case's model, trained-looking, converted to pre-norm (or mid-transition at `transition_blend`)."""
    from ln_lightning import convert
    from ln_lightning.placement import state
    from ln_lightning.placement.migrate import transition

    model = trained_looking(case.build())
    if transition_blend is None:
        convert(model, "pre", example_input=case.example_input())
    else:
        transition.begin(model, "pre", steps=10, example_input=case.example_input())
        state.of(model).transition.set_progress(3, transition_blend)
    return model.eval()


def output(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value.detach()
    raise AssertionError(f"{type(out).__name__} has no logits / last_hidden_state")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tied(model: nn.Module) -> bool:
    """Input and output embeddings are one tensor (False for a model without both: a speech model)."""
    try:
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    except NotImplementedError:
        return False
    return out is not None and inp is not None and out.weight.data_ptr() == inp.weight.data_ptr()


_isolated: list[str] = []


def isolate_hf_modules(path) -> None:
    """Have Hugging Face's remote-code loader copy modules under `path`, not the user's cache (once per process,
    before any such load: the first call wins). A child process gets HF_MODULES_CACHE in its environment instead."""
    import transformers.dynamic_module_utils as dmu

    if not _isolated:
        _isolated.append(str(path))
        dmu.HF_MODULES_CACHE = str(path)


def quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


__all__ = ["CASES", "BY_NAME", "Case", "H", "S2S", "W2V", "OPT", "converted", "isolate_hf_modules", "output",
           "quiet_transformers", "rel", "tied", "token_ids", "trained_looking", "waveform"]
