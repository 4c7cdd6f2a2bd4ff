"""Checking a rewritten block from what its forward really does, not from what our hooks claim.

After `x <- N(x + F(x))` has been rewritten to `x <- x + c * F(N(x))`, one recorded forward of the
block must show, for every sublayer, with the stream `s` it receives:

* every entry call of the branch gets `N(s)` at every argument that carried the stream, where
  `N(s)` is computed here through the norm's own class (no hook of ours involved);
* nothing else reads the raw stream: only the residual add (and modules that contain it) do; a
  q, k or v projection, a second stream argument, a function, a module the plan missed, would;
* the residual add produces `s + c * b`, with `b` the branch exit's output before our scale (of an exit
  module several branches share, its call for this branch by the order of the forward it was read from);
* the norm's call site passes that sum through unchanged, and it is the next sublayer's stream;
* the block's output stream is the last sum.

The same for each stream a block carries (LiLT's text and layout). A rewrite that computes anything
else fails one of these, whatever the hooks were told, as far as the recording sees the forward: what
it can't see (a kernel called out of torch function handling) `black_box.py` checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.reading.analysis import follow_layout, follow_stream_ops, stream_input, stream_output
from ln_lightning.placement.reading.recording import record

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
    # ||a - e|| / max(||e||, 1e-12), the quotient in Python: the same float64 arithmetic as in torch, with
    # four fewer dispatches (and `Tensor.norm`'s Python wrapper) for each of the few hundred checks a convert runs.
    return torch.linalg.vector_norm(a - e).item() / max(torch.linalg.vector_norm(e).item(), 1e-12)


def tolerance(dtype: torch.dtype) -> float:
    return CHECK_TOLERANCE.get(dtype, 1e-5)


class _RawExit:
    """Prepended forward hook: the exit's output before our own exit hooks touch it."""

    def __init__(self, index):
        self.index, self.values = index, []

    def __call__(self, module, args, output):
        self.values.append(output if self.index is None else output[self.index])


@dataclass
class SublayerCheck:
    """What one rewritten sublayer must show in the recorded forward."""

    entries: list  # EntryPlans that must receive in_norm(x) (our pre-norm rewrite); [] otherwise
    in_norm: nn.Module | None  # with entries: nothing else may read the raw stream
    exit_module: str | None  # the branch's exit, whose raw output b gives the add: x + c * out_norm(b)
    exit_index: int | None
    out_norm: nn.Module | None  # applied to the raw exit output (peri's added norm, output's moved norm)
    scale: nn.Module | None
    through: nn.Module | None  # a post-norm sublayer's norm: its call site must pass x + branch through
    # An exit module other branches call too: which of its calls in the block is this branch's (by the order of the
    # forward the block was read from, not by how the rewrite's hooks tell them apart); None: its last call.
    exit_call: int | None = None


def _value_at(call, outputs: bool, where) -> int | None:
    pairs = call.outputs if outputs else call.inputs
    return next((v for w, v in pairs if w == where), None)


def check_hooked(block: nn.Module, streams: list[tuple], args: tuple, kwargs: dict, start=None) -> tuple[float, object]:
    """(largest relative error, block output); raises CheckFailed on a structural mismatch.

    `streams`: (where the stream enters, where it leaves, its SublayerChecks) per stream the block
    carries; None for the first two: the block's stream input (or `start(block, rec, call)`) and output."""
    subs = [sc for _, _, st in streams for sc in st]
    raw_exits, handles = {}, []
    for sc in subs:
        r = raw_exits[id(sc)] = _RawExit(sc.exit_index)
        if sc.exit_module is not None:
            # nn.Module's own method: on a deferred norm (peri's output norm) it sees the call site.
            handles.append(nn.Module.register_forward_hook(block.get_submodule(sc.exit_module), r, prepend=True))
    try:
        with record(block) as rec:
            out = block(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    call = next(e for e in rec.events if e.kind == "module" and e.module is block)
    inside = lambda e: call.index < e.index <= call.end  # noqa: E731
    feeds_output = _FeedsOutput(rec, call)
    # Every deferred norm's call site passes its input through, whatever placement it serves.
    for m in block.modules():
        if hooks.is_deferred(m):
            for c in rec.module_calls(m):
                if inside(c) and c.input_value(("arg", 0)) != next((v for w, v in c.outputs if w == ()), None):
                    raise CheckFailed(f"{rec.paths[id(m)]} still normalises at its call site")
    err = 0.0
    for enters, leaves, stream_subs in streams:
        if enters is None:
            s = stream_input(call) if start is None else start(block, rec, call)
        else:
            s = _value_at(call, False, enters)
        out_v = stream_output(call) if leaves is None else _value_at(call, True, leaves)
        if s is None or out_v is None:
            raise CheckFailed("the rewritten block has no stream input or output")
        err = max(err, _check_stream(rec, call, block, s, out_v, stream_subs, raw_exits, feeds_output, inside))
    return err, out


class _FeedsOutput:
    """`v in feeds_output`: is the value one the block's outputs are computed from? (Walked when first asked.)"""

    def __init__(self, rec, call):
        self.rec, self.call, self.values = rec, call, None

    def __contains__(self, v) -> bool:
        if self.values is None:
            self.values = {o for _, o in self.call.outputs}
            for o in list(self.values):
                self.values |= self.rec.ancestors(o, within=self.call)
        return v in self.values


def _check_stream(rec, call, block, s, out_v, subs, raw_exits, feeds_output, inside) -> float:
    err = 0.0
    passed_through = -1  # the previous sublayer's norm call site, which returned this stream
    for i, sc in enumerate(subs):
        raw = raw_exits[id(sc)]
        s = follow_stream_ops(rec, s, call)
        x = rec.values[s].tensor
        if sc.entries:
            ref = hooks.reference_norm(sc.in_norm, x)
            for ep in sc.entries:
                calls = [e for e in rec.module_calls(block.get_submodule(ep.module)) if inside(e)]
                if not calls:
                    raise CheckFailed(f"sublayer {i}: branch entry {ep.module} did not run")
                for c in calls:
                    for where in [("arg", p) for p in ep.arg_positions] + [("kwarg", k) for k in ep.kwarg_names]:
                        v = c.input_value(where)
                        if v is not None:  # None: an optional argument the forward did not pass
                            err = max(err, relative_error(rec.values[v].tensor, ref))
        readers = [rec.events[r] for r in rec.values[s].readers if inside(rec.events[r])]
        adds = [e for e in readers if e.is_add and not e.ours]
        if len(adds) != 1:
            raise CheckFailed(f"sublayer {i}: expected one residual add of the stream, observed {len(adds)}")
        add = adds[0]
        if sc.entries:
            for r in readers:
                if r.ours or r is add or r.index == passed_through or (r.kind == "module" and r.index <= add.index <= r.end):
                    continue
                if not r.leaves and not any(v in feeds_output for _, v in r.outputs):
                    continue  # control flow or logging on the stream: not part of the branch
                if r.kind == "module" and not any(rec.events[x].kind == "function" and r.index < x <= r.end for x in rec.values[s].readers):
                    continue  # carries the stream along without reading it
                raise CheckFailed(
                    f"sublayer {i}: `{r.name}` reads the raw stream after the rewrite, so the branch does not see "
                    f"the norm of x everywhere (entries: {', '.join(e.module for e in sc.entries)})"
                )
        a = next(v for w, v in add.outputs if w == ())
        if sc.exit_module is not None:
            if not raw.values:
                raise CheckFailed(f"sublayer {i}: branch exit {sc.exit_module} did not run")
            if sc.exit_call is not None and len(raw.values) <= sc.exit_call:
                raise CheckFailed(f"sublayer {i}: branch exit {sc.exit_module} ran {len(raw.values)} times, not its call {sc.exit_call + 1}")
            b = raw.values[-1 if sc.exit_call is None else sc.exit_call]
            if not isinstance(b, torch.Tensor):
                raise CheckFailed(f"sublayer {i}: the branch exit {sc.exit_module} returns a {type(b).__name__}, not a tensor (declare exit_index)")
            if sc.out_norm is not None:
                b = hooks.reference_norm(sc.out_norm, b)
            c = 1.0 if sc.scale is None else sc.scale.value().detach().double()
            err = max(err, relative_error(rec.values[a].tensor, x.double() + c * b.double()))
        elif sc.scale is not None or sc.out_norm is not None:
            raise CheckFailed(f"sublayer {i}: a branch scale or output norm without an exit module")
        if sc.through is not None:
            a_norm = follow_layout(rec, a, call)  # the sum as the norm receives it (OPT views it back to 3-D)
            through = [e for e in rec.module_calls(sc.through) if inside(e) and e.input_value(("arg", 0)) == a_norm]
            if len(through) != 1:
                raise CheckFailed(f"sublayer {i}: the norm is no longer applied to x + F(x) once (observed {len(through)})")
            passed_through = through[0].index
        s = a
    s = follow_stream_ops(rec, s, call)
    if s != out_v:
        err = max(err, relative_error(rec.values[out_v].tensor, rec.values[s].tensor))
    return err
