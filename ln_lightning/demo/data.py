"""A character-level corpus with no download: the standard library's own source files."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

# A fixed, sorted list keeps the corpus identical across runs and machines of one Python version.
_DEFAULT_MODULES = (
    "argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "inspect.py",
    "json/decoder.py", "json/encoder.py", "pathlib.py", "random.py", "textwrap.py", "typing.py",
)


@functools.lru_cache(maxsize=16)  # (a study builds its data once per run: the same files, read and filtered once)
def stdlib_corpus_text(max_chars: int = 1_000_000, files: tuple[str, ...] = _DEFAULT_MODULES) -> str:
    """Concatenate standard-library source files (ASCII only), up to `max_chars` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in files:
        path = root / name
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8", errors="ignore"))
    if not parts:
        raise FileNotFoundError(
            f"none of the standard-library files {files} were found under {root}; "
            "pass a text file instead (CharCorpus.from_file)"
        )
    text = "\n".join(parts)
    # every character outside ASCII becomes "?" (the codec's replacement, one per character)
    return text.encode("ascii", errors="replace").decode("ascii")[:max_chars]


class CharCorpus(Dataset):
    """Fixed-length windows of a text, as `(input_ids, target_ids)` pairs of byte values (< 128)."""

    vocab_size = 128

    def __init__(self, text: str, block_size: int = 128, stride: int | None = None):
        # each character's code point, 127 above ASCII (the code points read from UTF-32, not a Python loop)
        data = torch.from_numpy(np.frombuffer(text.encode("utf-32-le"), dtype="<u4").clip(max=127).astype(np.int64))
        if data.numel() <= block_size + 1:
            raise ValueError(f"text of {data.numel()} characters is too short for block_size={block_size}")
        self.data = data
        self.block_size = block_size
        self.stride = stride or block_size
        self.n = (data.numel() - block_size - 1) // self.stride + 1

    @classmethod
    def from_file(cls, path: str | Path, block_size: int = 128, stride: int | None = None) -> "CharCorpus":
        return cls(Path(path).read_text(encoding="utf-8", errors="replace"), block_size, stride)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]
