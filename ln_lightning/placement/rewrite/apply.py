"""Applying a placement configuration to a model: the fused swap, `convert`, the marker, a transition.

The one way a rewrite is done from a configuration, used by ``LNPlacement`` at fit start and, to rebuild a
saved rewrite on a freshly built model, by ``load_converted`` and ``ln_lightning.from_pretrained``
(:func:`rebuild`, which also checks that the rebuilt model has exactly the modules the saved one had).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ln_lightning.norm import swap_layernorms
from ln_lightning.placement import state as rewrite_state
from ln_lightning.placement.migrate import transition
from ln_lightning.placement.engine import convert
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.report import ConversionReport
from ln_lightning.placement.rewrite.transaction import Snapshot


@dataclass
class Applied:
    report: ConversionReport
    swap: dict | None  # what the fused swap did ({"swapped", "skipped", "backend"}); None without fused=True
    state: rewrite_state.RewriteState | None  # the model's rewrite state afterwards (None: nothing recognised)


def _merge_swaps(swaps: list) -> dict | None:
    if not swaps:
        return None
    return {
        "swapped": [p for r in swaps for p in r.swapped],
        "skipped": [{"path": k.path, "reason": k.reason} for r in swaps for k in r.skipped],
        "backend": swaps[0].backend,
    }


def apply_config(model: nn.Module, config: dict, *, fused: bool = False, strict: bool = False, example_input: Any = None,
                 mark: bool = True, transition_steps: int | None = None, transition_schedule: str = "linear") -> Applied:
    """Rewrite `model` in place to `config` (``convert``'s keyword arguments that change the function).

    With `fused`, LayerNorms are swapped for the fused implementation first (convert then wraps each norm's own
    class, which the swap leaves alone) and so is a final norm convert adds. With `mark`, the model's rewrite
    state gets its marker and load guard (``RewriteState.mark``) when the rewrite changed anything. With
    `transition_steps`, a changed model starts the transition at a = 0.
    """
    swaps = [swap_layernorms(model)] if fused else []
    report = convert(model, **config, strict=strict, example_input=example_input)
    if fused:
        for path in report.added:  # a final norm convert added is a plain nn.LayerNorm: swap it too
            try:
                added = model.get_submodule(path)
            except AttributeError:
                continue  # a parameter (LayerScale), not a module
            if type(added) is nn.LayerNorm:
                swaps.append(swap_layernorms(added))
    state = rewrite_state.of(model)
    if report.blocks and state is None:
        # Nothing to record from convert (it changed nothing, or undid a rewrite to "post"): say what the model
        # computes anyway, so a later fit or checkpoint knows it was asked for and given this configuration.
        state = rewrite_state.attach(model, rewrite_state.RewriteState(
            config, converted=[(b.path, b.from_written) for b in report.converted], added=report.added,
            derived=report.derived, report=report.to_dict()))
    elif state is not None and state.config != config:
        state.config = dict(config)  # convert's record of the same rewrite, with the request's spelling
    if state is not None and mark and report.changed:
        state.mark(model)
    if transition_steps is not None and report.changed:
        transition.start(model, report, steps=transition_steps, schedule_kind=transition_schedule)
    return Applied(report, _merge_swaps(swaps), state)


def rebuild(model: nn.Module, record: dict, *, fused: bool = False, example_input: Any = None) -> Applied:
    """Redo a saved rewrite (``RewriteState.to_record()``) on a freshly built `model`, marked, with its transition.

    Refuses (PlacementError, the model left as it was) when the rewrite would not give the same model: other
    blocks converted or other modules added than the record says (another model class or configuration, or
    another version of the engine), so that saved weights never load into a different function.
    """
    saved = rewrite_state.from_record(record)
    snapshot = Snapshot(model)
    applied = apply_config(model, saved.config, fused=fused, example_input=example_input, strict=False)
    state = applied.state
    got = (sorted(p for p, _ in state.converted), sorted(state.added)) if state is not None else ([], [])
    want = (sorted(p for p, _ in saved.converted), sorted(saved.added))
    if got != want:
        snapshot.restore()
        raise PlacementError(
            f"rebuilding the saved placement rewrite ({', '.join(f'{k}={v!r}' for k, v in saved.config.items())}) on "
            f"{type(model).__name__} gives another model: converted {got[0]} and added {got[1]}, where the saved one "
            f"converted {want[0]} and added {want[1]}. Build the model with the class and configuration it was saved "
            "from (and the same ln_lightning version)"
        )
    t = record.get("transition")
    if t:
        state.start_transition(model, t.get("steps"), t.get("schedule", "linear"))
        state.transition.set_progress(int(t.get("steps_done", 0)), float(t.get("blend", 0.0)))
    state.transition_ended = state.transition_ended or bool(record.get("transition_ended"))
    return applied


__all__ = ["Applied", "apply_config", "rebuild"]
