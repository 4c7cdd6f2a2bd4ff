"""Does each block compute a function of its arguments alone?

The rewrite and both of its checks (`checks.py`, `black_box.py`) see a block through its calls:
what it is given and what it returns. A block whose branch reads the stream from somewhere else,
a global or an attribute the enclosing forward sets before calling it, computes through a path
none of them sees, and the branch would keep reading the raw stream there after the rewrite.

Only a block that reads something its recorded call cannot account for is a suspect: a tensor
made before the call and not passed to it, or one that appears from outside the recording (no
recorded producer, not a parameter or buffer), or one built inside from data out of torch (an
array, a list of numbers). The others read only their arguments, parameters and what they compute.

A suspect is tried with a second forward of the model on a shifted copy of the example input
(integer tensors rolled by one position, floating ones too): at each suspect's first call in it,
the block first runs again, original function, on the arguments it was given in the recorded
forward. A block that depends on its arguments only returns what it returned then; one that reads
state set for the current call returns something else, and is refused with the reason. Where the
shifted input does not change what a block receives, or the model does not run on it, no answer
is possible, and the report says so.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.checking.checks import relative_error, tolerance
from ln_lightning.placement.reading.discovery import Example, Found, eval_no_grad

REASON = (
    "its output on the arguments it was given changes when the rest of the model runs on another input: the block reads "
    "state set outside its call (a global, an attribute its parent sets, a stash), which no hook on it can normalise; "
    "pass the stream to the block as an argument"
)


def shifted(value: Any) -> Any:
    """The example with every tensor rolled by one position along its last dimension."""
    if isinstance(value, torch.Tensor):
        return value.roll(1, -1) if value.dim() else value
    if isinstance(value, dict):
        return {k: shifted(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(shifted(v) for v in value)
    return value


def _stream(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def reads_from_outside(run, block: nn.Module, own: set[int]) -> bool:
    """Does the block's first recorded call read a tensor its arguments, the model's parameters and
    buffers (ids in `own`), and its own computation do not account for (see the module docstring)?"""
    rec = run.rec
    calls = rec.module_calls(block)
    if not calls:
        return False
    call = calls[0]
    inputs = {v for _, v in call.inputs}
    for e in rec.within(call):
        if e.kind != "function":
            continue
        if not e.inputs and e.outputs and e.data_args:
            return True  # `torch.as_tensor(values)`, `torch.from_numpy(array)` inside the block
        for _, v in e.inputs:
            val = rec.values[v]
            if v in inputs or id(val.tensor) in own:
                continue
            if val.producer is None or val.producer < call.index:
                return True  # made before the call and not passed to it, or out of the recording's sight
    return False


def outside_state(model: nn.Module, example: Example, found: Found, paths: set[str]) -> tuple[dict[str, str], list[str]]:
    """(block path -> reason for each block among `paths` that reads state set outside its call, notes)."""
    run = found.observation
    if run is None:
        return {}, []
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    targets = {id(h.block): h for h in found.handlers if h.path in paths and reads_from_outside(run, h.block, own)}
    if not targets:
        return {}, []
    refused: dict[str, str] = {}
    unchanged: list[str] = []
    seen: set[int] = set()

    def again(mod, args, kwargs):
        h = targets.get(id(mod))
        if h is None or id(mod) in seen:
            return None
        seen.add(id(mod))  # also keeps the call below from coming back here
        probe, then = run.inputs.get(id(mod)), run.block_output(mod)
        if probe is None or then is None:
            return None
        shared = {id(v): v for v in (*probe[0], *probe[1].values()) if isinstance(v, torch.Tensor)}
        a, k = copy.deepcopy(probe, shared)
        now = hooks.stream_of(mod(*a, **k))
        if now is None or now.shape != then.shape or not relative_error(now, then) <= tolerance(then.dtype):
            refused[h.path] = REASON
        x_now, x_then = _stream(args, kwargs), _stream(*probe)
        if x_now is not None and x_then is not None and x_now.shape == x_then.shape and torch.equal(x_now, x_then):
            unchanged.append(h.path)
        return None

    handles = [nn.Module.register_forward_pre_hook(h.block, again, prepend=True, with_kwargs=True) for h in targets.values()]
    try:
        with eval_no_grad(model), hooks.bypass():
            Example(shifted(example.value), example.path).run(model)
    except Exception as e:  # noqa: BLE001 - the model refused the shifted input: say what was not checked
        return refused, [f"blocks not checked for reads of state set outside their call: the model did not run on a shifted "
                         f"copy of its example input ({type(e).__name__}: {str(e)[:120]})"]
    finally:
        for h in handles:
            h.remove()
    notes = []
    unchecked = [p for p in unchanged if p not in refused] + [h.path for i, h in targets.items() if i not in seen]
    if unchecked:
        notes.append(f"{len(unchecked)} block(s) ({', '.join(unchecked[:3])}{', ...' if len(unchecked) > 3 else ''}) not checked "
                     "for reads of state set outside their call: a shifted copy of the example input did not change what they receive")
    return refused, notes
