"""What the test suite and the benchmarks share: model builders, float64 references, case tables.

Shipped with the package, like ``torch.testing``, but not part of its documented API (no
compatibility promise; it is not in ``ln_lightning.__all__`` or the API reference). It lives here,
not under ``tests/``, so that both ``tests/`` and ``benchmarks/`` import it by its name, with no
``sys.path`` edit beyond what running from a checkout needs anyway: the repository root, where
``ln_lightning`` itself is (``benchmarks/*.py`` add it; pytest's ``rootdir`` conftest does).
It imports only the package's own dependencies (no pytest or hypothesis: the hypothesis case
strategies stay in ``tests/``), so every module here imports after ``pip install ln-lightning``.

* :mod:`.norm` / :mod:`.norm_rms`: the fused norms' float64 references and accuracy criterion.
* :mod:`.monitors`: the monitors' model, data, float64 references and TensorBoard reader;
  ``python -m ln_lightning.testing.monitors MODE OUT`` runs the multi-process scenarios.
* :mod:`.plugin`: LNPlacement's scenario (fit, resume, evaluate from a checkpoint) and its
  independent pre-norm reference; ``python -m ln_lightning.testing.plugin MODE OUT`` likewise.
* :mod:`.dist`: the process-group teardown that multi-process runs need.
"""
