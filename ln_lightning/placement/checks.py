"""Checking a rewritten block from what its forward really does, not from what our hooks claim.

After `x <- N(x + F(x))` has been rewritten to `x <- x + c * F(N(x))`, one recorded forward of the
block must show, for every sublayer, with the stream `s` it receives:

* every entry call of the branch gets `N(s)` at every argument that carried the stream, where
  `N(s)` is computed here through the norm's own class (no hook of ours involved);
* nothing else reads the raw stream: only the residual add (and modules that contain it) do; a
  q, k or v projection, a second stream argument, a function, a module the plan missed, would;
* the residual add produces `s + c * b`, with `b` the branch exit's output before our scale;
* the norm's call site passes that sum through unchanged, and it is the next sublayer's stream;
* the block's output stream is the last sum.

A rewrite that computes anything else fails one of these, whatever the hooks were told.
"""

from __future__ import annotations

import torch
from torch import nn

from ln_lightning.placement import hooks
from ln_lightning.placement.analysis import stream_input, stream_output
from ln_lightning.placement.recording import record

# Relative tolerances per dtype: a few units of the format's rounding (float32 2^-24, bfloat16 2^-8,
# float16 2^-11) accumulated over the handful of ops a check compares, measured against float64 in
# tests/test_placement_zoo.py.
CHECK_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


class CheckFailed(Exception):
    pass


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        raise CheckFailed(f"shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    return ((a - e).norm() / e.norm().clamp_min(1e-12)).item()


def tolerance(dtype: torch.dtype) -> float:
    return CHECK_TOLERANCE.get(dtype, 1e-5)


class _RawExit:
    """Prepended forward hook: the exit's output before our scale hook touches it."""

    def __init__(self, index):
        self.index, self.values = index, []

    def __call__(self, module, args, output):
        self.values.append(output if self.index is None else output[self.index])


def check_hooked_pre(block: nn.Module, plans: list, scales: list, args: tuple, kwargs: dict) -> tuple[float, torch.Tensor]:
    """(largest relative error, block output); raises CheckFailed on a structural mismatch."""
    raw_exits, handles = [], []
    for p in plans:
        r = _RawExit(p.exit_index)
        raw_exits.append(r)
        if p.exit_module is not None:
            handles.append(block.get_submodule(p.exit_module).register_forward_hook(r, prepend=True))
    try:
        with record(block) as rec:
            out = block(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    call = next(e for e in rec.events if e.kind == "module" and e.module is block)
    s, out_v = stream_input(call), stream_output(call)
    if s is None or out_v is None:
        raise CheckFailed("the rewritten block has no stream input or output")
    inside = lambda e: call.index in e.frames  # noqa: E731
    feeds_output = {v for _, v in call.outputs}
    for v in list(feeds_output):
        feeds_output |= rec.ancestors(v)
    err = 0.0
    passed_through = -1  # the previous sublayer's norm call site, which returned this stream
    for i, (plan, scale, raw) in enumerate(zip(plans, scales, raw_exits)):
        x = rec.values[s].tensor
        norm = block.get_submodule(plan.norm)
        ref = hooks.reference_norm(norm, x)
        entry_calls = 0
        for ep in plan.entries:
            calls = [e for e in rec.module_calls(block.get_submodule(ep.module)) if inside(e)]
            if not calls:
                raise CheckFailed(f"sublayer {i}: branch entry {ep.module} did not run")
            for c in calls:
                entry_calls += 1
                for where in [("arg", p) for p in ep.arg_positions] + [("kwarg", k) for k in ep.kwarg_names]:
                    v = c.input_value(where)
                    if v is None:
                        continue  # an optional argument the forward did not pass
                    err = max(err, relative_error(rec.values[v].tensor, ref))
        readers = [rec.events[r] for r in rec.values[s].readers if inside(rec.events[r])]
        adds = [e for e in readers if e.is_add and not e.ours]
        if len(adds) != 1:
            raise CheckFailed(f"sublayer {i}: expected one residual add of the stream, observed {len(adds)}")
        add = adds[0]
        for r in readers:
            if r.ours or r is add or r.index == passed_through or (r.kind == "module" and (add.index in range(r.index, r.end + 1))):
                continue
            if not any(v in feeds_output for _, v in r.outputs):
                continue  # control flow or logging on the stream: not part of the branch
            raise CheckFailed(
                f"sublayer {i}: `{r.name}` reads the raw stream after the rewrite, so the branch does not see "
                f"{plan.norm}(x) everywhere (entries: {', '.join(e.module for e in plan.entries)})"
            )
        a = next(v for w, v in add.outputs if w == ())
        if plan.exit_module is not None:
            if not raw.values:
                raise CheckFailed(f"sublayer {i}: branch exit {plan.exit_module} did not run")
            b = raw.values[-1]
            if not isinstance(b, torch.Tensor):
                raise CheckFailed(f"sublayer {i}: the branch exit {plan.exit_module} returns a {type(b).__name__}, not a tensor (declare exit_index)")
            c = 1.0 if scale is None else scale.value().detach().double()
            err = max(err, relative_error(rec.values[a].tensor, x.double() + c * b.double()))
        elif scale is not None:
            raise CheckFailed(f"sublayer {i}: a branch scale without an exit module")
        norm_calls = [e for e in rec.module_calls(norm) if inside(e)]
        through = [e for e in norm_calls if e.input_value(("arg", 0)) == a]
        if len(through) != 1:
            raise CheckFailed(f"sublayer {i}: {plan.norm} is no longer applied to x + F(N(x)) once (observed {len(through)})")
        nxt = next((v for w, v in through[0].outputs if w == ()), None)
        if nxt != a:
            raise CheckFailed(f"sublayer {i}: {plan.norm} still normalises at its call site")
        s, passed_through = a, through[0].index
    if s != out_v:
        err = max(err, relative_error(rec.values[out_v].tensor, rec.values[s].tensor))
    return err, hooks.stream_of(out)
