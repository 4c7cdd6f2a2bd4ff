"""Undo for `convert`: put every module of a model back exactly as it was.

`convert` changes modules in four ways only: their class (a deferred norm, a fused torch layer),
their hook dicts, their child modules (a final norm, a branch scale) and a few plain attributes
(`norm_first`, our markers). A snapshot keeps each module's `__dict__` entries and the contents of
every dict among them (hooks, `_modules`, `_parameters`, `_buffers`), by reference to the same
objects, so a restore also keeps the handles users hold on their own hooks working. Tensors are
never modified in place by `convert`, so they need no copy.
"""

from __future__ import annotations

from torch import nn


class Snapshot:
    def __init__(self, root: nn.Module):
        self._saved = []
        for m in root.modules():  # each module once
            attrs = m.__dict__.copy()
            # The dicts among them (hooks, children, parameters, buffers), each copied as it is now; most
            # are empty (a module's dozen hook dicts), which needs no copy: None, restored by clearing.
            dicts = [(v, v.copy() if v else None) for v in attrs.values() if isinstance(v, dict)]
            self._saved.append((m, m.__class__, attrs, dicts))

    def restore(self) -> None:
        for m, cls, attrs, dicts in self._saved:
            m.__class__ = cls
            m.__dict__.clear()
            m.__dict__.update(attrs)
            for d, items in dicts:
                d.clear()
                if items:
                    d.update(items)
