"""How much a rewrite changes the function of the weights a model holds *now*.

`convert` measures the change on the model it is given. A continuation (``LNPlacement(resume_unconverted=True)``
with a plugin-less checkpoint) is rewritten on freshly built weights, before the checkpoint loads: measured there,
the change describes an untrained model (0.015% on a demo LM whose trained weights change by 1.4%). This measures
it again once the trained weights are in: the model as written against the rewrite's end point, on the same probe.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ln_lightning.placement.migrate import blend
from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.checking.checks import relative_error
from ln_lightning.placement.reading.discovery import run_model


def _tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    values = list(out.values()) if isinstance(out, dict) else out
    if isinstance(values, (tuple, list)):
        return next((t for t in map(_tensor, values) if t is not None), None)
    return None


@torch.no_grad()
def endpoint_change(model: nn.Module, example: Any) -> float | None:
    """Relative L2 change of `model`'s output on `example` between the function it was written with and the
    rewrite's end point, at its current weights (eval mode; its mode is restored, its blend never written). In a transition the
    two ends are blend 0 (bit for bit the model as written) and blend 1; otherwise the model with the rewrite's
    hooks bypassed and the model itself. None when the output holds no tensor."""
    t = blend.active(model)
    was_training = model.training
    model.eval()
    try:
        if t is not None:
            with t.pinned(0.0):  # the two ends, without writing the blend the model holds
                before = _tensor(run_model(model, example))
            with t.pinned(1.0):
                after = _tensor(run_model(model, example))
        else:
            with hooks.bypass():
                before = _tensor(run_model(model, example))
            after = _tensor(run_model(model, example))
    finally:
        model.train(was_training)
    if before is None or after is None or before.shape != after.shape:
        return None
    return relative_error(after.float(), before.float())


__all__ = ["endpoint_change"]
