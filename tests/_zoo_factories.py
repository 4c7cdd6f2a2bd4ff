"""Small models for the CLI tests (`ln-lightning inspect tests._zoo_factories:NAME`)."""

from __future__ import annotations

import transformers as T

H = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=99)


def bert():
    return T.BertModel(T.BertConfig(**H))


def deberta():
    return T.DebertaV2Model(T.DebertaV2Config(**H))


def t5():
    return T.T5Model(T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=99))


def not_a_model():
    return 42
