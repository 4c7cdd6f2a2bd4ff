"""A function-preserving transition between norm placements, for a model that is already trained.

`convert(model, "pre")` changes what a trained post-norm model computes (by 27% on the demo LM). The
transition instead blends the two placements with one number `a` in [0, 1]. A sublayer has three places a
norm can sit: the branch's input, the branch's output (before the add) and the stream after the add. The
placement before (`S`, as the block's forward is written) and after (`T`, what `convert` made it) each put
a norm, or nothing, at each place; during the transition each place computes

    (1-a) * f_S(v) + a * f_T(v)           (f: the identity, or the norm that place has)

and the branch scale `c` ramps from 1 (`(1-a) + a*c`). Post-norm to pre-norm (norm `LN`, branch `F`):

    u = (1-a)*x + a*LN(x)                 at the branch's entries
    h = x + ((1-a) + a*c) * F(u)
    out = (1-a)*LN(h) + a*h               at the norm's own call site

Post to peri adds `b -> (1-a)*b + a*N_out(b)` at the branch's exit; pre to output moves the norm from
the input to the exit (`(1-a)*N(x) + a*x` at the input, `(1-a)*b + a*N(b)` at the exit); peri to pre and
to output drop one norm at its call site; "mix" converts the later blocks to pre-norm, as above. A final
norm that `convert` added outputs `(1-a)*s + a*N_f(s)`. At `a = 0` every term is exact (`1*x + 0*y == x`
in floating point), so the model computes bit-for-bit the function it was trained with (an added norm is
the identity); at `a = 1` it computes exactly what `convert(model, placement)` gives. `finish(model)`
then removes every piece of the machinery, leaving the model exactly as `convert` left it (fused torch
layers included), at plain speed.

What can't be blended is refused: a block an earlier rewrite of ours changed (the blend starts from the
placement the forward is written in), a conversion that removed modules, placement "post" (ln_lightning
only undoes its own rewrites, which never needs a transition).

Usage without a Trainer::

    from ln_lightning.placement.migrate import transition
    report = transition.begin(model, "pre", final_norm=True)   # convert(model, "pre", ...) at a = 0
    for step in range(n):
        transition.set_blend(model, transition.schedule((step + 1) / n))
        ...train...
    transition.finish(model)                                   # plain pre-norm from here on

With a Trainer: `LNPlacement(placement, transition_steps=N, transition_schedule="linear"|"cosine")`, which by
default also scales the stream (below), trains a quarter of the steps at blend 1 and distils towards the trained
function (`transition_stream_scale`, `transition_endpoint_fraction`, `transition_distill`).

The stream-scaled blend (`branch_scale="stream"`, post-norm to "pre", "mix" or "peri"): a post-norm model divides its
stream by every norm's scale, so an older branch weighs less than a newer one; a plain pre-norm stream only adds.
Branch k gets the constant `C_k = prod sigma_i / |gamma_i|` over the norms before it in its stack (measured once,
at blend 0: `measure_stream_scales`), and with `D = (1-a) + a*C` each place computes

    u = (1-a) * x / D_k + a * LN(x)        at the branch's entries
    h = x + D_k * F(u)                     (the branch scale ramps from 1 to C_k)
    out = (1-a) * D_{k+1} * LN(h) + a * h  at the norm's call site
    fin = (1-a) * s / D_K + a * LN_f(s)    at an added final norm

exact at both ends as above: at a = 1 it is `convert(model, "pre", branch_scale="stream")` with the measured
constants (persistent buffers). To "peri" the branch's value `v` instead enters as

    D_k * ((1-a) * v + (a / C_k) * N_out(v))   at the branch's exit (exactly N_out(v) at a = 1)

with the output norm's gain set, by the same measurement, to C_k times the trained `v`'s per-token spread: the
end is plain peri-norm with those gains. Without a Trainer::

    transition.begin(model, "pre", branch_scale="stream")
    transition.measure_stream_scales(model, lambda: model(batch))

State: the transition is part of the model's rewrite state (``ln_lightning.placement.state``): the blend,
the optimizer steps done and the schedule are persistent buffers of ``root.ln_lightning_transition``, so a
checkpoint written mid-transition resumes at the same point, and loading it into the rewritten model (or
``load_converted``) puts the model back into that blend. The mechanics (what each place computes, the
blend-aware hooks and layers) are ``ln_lightning.placement.migrate.blend``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ln_lightning.placement import state as rewrite_state
from ln_lightning.placement.migrate.blend import ATTR, MAX_STEPS, SCHEDULES, Transition, active, leftovers, schedule
from ln_lightning.placement.engine import convert
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.options import TARGETS, check_target  # the request's rules, re-exported


def get_blend(model: nn.Module) -> float | None:
    t = active(model)
    return None if t is None else float(t.blend)


def set_blend(model: nn.Module, a: float) -> None:
    """Set the blend: 0 is the function the model was trained with, 1 is what `convert` made it."""
    t = active(model)
    if t is None:
        raise PlacementError("set_blend: the model is not in a transition; start one with ln_lightning.placement.migrate.transition.begin(model)")
    a = float(a)
    if not (0.0 <= a <= 1.0):
        raise PlacementError(f"set_blend: the blend must be in [0, 1], got {a!r}")
    t.set_progress(t.host_steps, a)  # the Transition writes its own blend


def begin(model: nn.Module, placement: str = "pre", *, steps: int | None = None, schedule_kind: str = "linear",
          **convert_options: Any):
    """`convert(model, placement, **convert_options)`, then the transition at a = 0 (the model's own function).

    `placement` is one of TARGETS ("pre", "peri", "output", "mix"). Returns the ConversionReport. Set the
    blend with `set_blend`, end with `finish`.
    """
    check_target(placement)
    recorded = rewrite_state.of(model)
    if recorded is not None:
        raise PlacementError(
            f"{type(model).__name__} was already converted (to {recorded.config.get('placement')!r}); a transition blends from "
            "the placement the model's forward is written in. Start from the unconverted model, or convert it back "
            "with convert(model, 'post') first"
        )
    report = convert(model, placement, **convert_options)
    start(model, report, steps=steps, schedule_kind=schedule_kind)
    return report


def measure_stream_scales(model: nn.Module, run, reduce=None) -> str | None:
    """Measure a stream-scaled transition's branch constants (``begin(model, "pre", branch_scale="stream")``)
    on one forward, `run()` (e.g. ``lambda: model(batch)``), at blend 0: each branch gets ``C_k = prod sigma_i /
    |gamma_i|`` of the norms before it in its stack (to "peri": each output norm's gain, ``C_k`` times its branch's
    trained per-token spread, from the same forward). `reduce`: the mean over ranks of a tensor, under data
    parallelism. Returns None, or the reason the scales could not be measured (the transition then runs the
    plain blend). LNPlacement does this on the first training batch.
    """
    t = active(model)
    if t is None or not t.scaled:
        raise PlacementError("measure_stream_scales: the model is not in a stream-scaled transition; start one with "
                             "transition.begin(model, 'pre', branch_scale='stream')")
    if float(t.blend) != 0.0:
        raise PlacementError("measure_stream_scales: the scales are measured at blend 0, where the model computes its "
                             f"trained function; the blend is {float(t.blend):.4g}")
    t.begin_measurement()
    with torch.enable_grad():  # the recording skips no-grad forwards (evaluations) and recomputations in backward
        run()
    return t.end_measurement(reduce)


def start(model: nn.Module, report, *, steps: int | None = None, schedule_kind: str = "linear") -> Transition:
    """Switch a model `convert` just rewrote (with `report`) into the transition at a = 0.

    Only what that conversion changed is blended (blocks it converted, final norms it added); blocks it
    left alone keep computing what they did.
    """
    if active(model) is not None:
        raise PlacementError("the model is already in a transition; finish it first (transition.finish(model))")
    state = rewrite_state.of(model)
    if report is None or report.placement not in TARGETS or state is None or not report.changed:
        raise PlacementError(
            "a transition starts from the report of the conversion that rewrote the model, to one of "
            f"{', '.join(map(repr, TARGETS))} (transition.begin(model, placement) does both); a model rewritten "
            "earlier can't tell what its blocks computed before"
        )
    if report.removed:
        raise PlacementError(
            f"the conversion removed {', '.join(report.removed)}: what they computed can't be blended back in. "
            "Start the transition from the unconverted model"
        )
    t = state.start_transition(model, steps, schedule_kind)
    report.notes.append(
        "a transition is under way: at blend 0 the model computes exactly its function from before this conversion; "
        "the change above is where it ends (blend 1)"
    )
    return t


def finish(model: nn.Module) -> None:
    """End the transition: the model is exactly what `convert` made it, with no blend left.

    Raises if any piece of the machinery would stay behind (it would be a silent change of function).
    """
    state = rewrite_state.of(model)
    if state is None or state.transition is None:
        raise PlacementError("finish: the model is not in a transition")
    state.end_transition(model)


def check_schedule(t: Transition, steps: int, kind: str) -> None:
    """Refuse to go on with another schedule than the one the transition (perhaps from a checkpoint) ran with:
    the blend would jump, changing the function between two steps."""
    if t.closed and kind == "closed":
        if t.steps != steps:  # a closed loop's blend does not depend on its budget: a new one applies from here
            t.steps = steps
            t.schedule[0] = steps
        return
    if t.steps is not None and (t.steps, t.kind) != (steps, kind):
        raise PlacementError(
            f"this transition ran with {t.steps} steps, schedule {t.kind!r} (recorded in the model and its checkpoints), "
            f"not {steps} steps, schedule {kind!r}: continuing with another schedule would make the blend jump. Resume with "
            "the recorded values (LNPlacement(..., transition=TransitionSpec(steps=..., tolerance=None, schedule=...)); "
            "a closed loop, schedule 'closed', is TransitionSpec(steps=...), whose budget may change)."
        )


__all__ = ["ATTR", "MAX_STEPS", "SCHEDULES", "TARGETS", "Transition", "active", "begin", "check_schedule", "check_target",
           "finish", "get_blend", "leftovers", "measure_stream_scales", "schedule", "set_blend", "start"]
