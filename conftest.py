"""Repository-level pytest configuration, for the doctest run: `python -m pytest --doctest-modules ln_lightning`.

Doctest collection imports every module of the package. `ln_lightning/norm/_triton_ops.py` and `_triton_rms.py` import
triton at module level (it is the Triton backend: the `triton` extra, used on CUDA machines) and has no
docstring examples, so it is left out where triton is not installed instead of failing to import; likewise
`ln_lightning/pytorch_lightning.py` where pytorch_lightning is not installed.
No docstring example needs CUDA: they all run on the CPU backends.
"""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if importlib.util.find_spec("triton") is None:
    collect_ignore += ["ln_lightning/norm/_triton_ops.py", "ln_lightning/norm/_triton_rms.py"]
if importlib.util.find_spec("pytorch_lightning") is None:
    # The pytorch_lightning namespace (the `pytorch-lightning` extra) refuses to import without it.
    collect_ignore.append("ln_lightning/pytorch_lightning.py")
