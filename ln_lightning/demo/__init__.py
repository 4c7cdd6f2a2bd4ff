"""Built-in models and data for demos, examples and tests.

Nothing here downloads anything: the corpus is read from the Python standard library's
own source files, which every Python installation ships.
"""

from ln_lightning.demo.models import PostNormBlock, PostNormTransformerLM, PreNormBlock
from ln_lightning.demo.data import CharCorpus, stdlib_corpus_text

# The Lightning wrappers live in ln_lightning.demo.lightning (imported on demand: it pulls in Lightning).

__all__ = ["PostNormBlock", "PostNormTransformerLM", "PreNormBlock", "CharCorpus", "stdlib_corpus_text"]
