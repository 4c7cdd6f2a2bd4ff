"""Recording what a forward pass really does: every module call and torch function, as data flow.

Recognition reads a model from one real (or probe) forward instead of from its source code:
Hugging Face modelling code and most research code is not symbolically traceable, but it always
runs. A `TorchFunctionMode` sees every torch function and tensor method at any depth (the top-level
call only: what a function does inside is not recorded), and hooks on every submodule see each
module call with its actual arguments and outputs. Tensors are identified by object identity;
each one gets a `Value` node, so the recording is a data-flow graph:

    value --read by--> event --produces--> value

An in-place method (`add_`, `__iadd__`, ...) makes a new version of its tensor; a method that
returns its own input (`contiguous()` of a contiguous tensor, dropout in eval) produces no new value.
Functions whose result depends only on a tensor's shape (`zeros_like`, `new_ones`, ...) are not
reads of its values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ln_lightning.placement import hooks

_ADD_NAMES = {"add", "__add__", "__radd__", "__iadd__", "add_"}
# Results that depend on a tensor's metadata only, not its values.
_SHAPE_ONLY = {
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "size", "dim", "numel", "__get__", "__len__", "stride",
    "is_floating_point", "is_complex", "element_size", "get_device", "is_contiguous",
}


@dataclass
class Value:
    index: int
    tensor: torch.Tensor
    producer: int | None  # event index; None for an input from outside the recording
    readers: list[int] = field(default_factory=list)


@dataclass
class Event:
    index: int
    kind: str  # "function" | "module"
    name: str  # function name, or the module's path
    module: nn.Module | None
    frames: tuple[int, ...]  # enclosing module events, outermost first
    inputs: list[tuple[Any, int]] = field(default_factory=list)  # (where, value index)
    outputs: list[tuple[Any, int]] = field(default_factory=list)
    end: int = -1  # module events: index of the last event inside the call
    ours: bool = False  # ln_lightning's own normalisation (inside a branch-entry hook)

    @property
    def is_add(self) -> bool:
        return self.kind == "function" and self.name in _ADD_NAMES and len({v for _, v in self.inputs}) == 2

    def input_value(self, where) -> int | None:
        return next((v for w, v in self.inputs if w == where), None)


def flatten(obj: Any, where: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(location, tensor) for every tensor in nested tuples / lists / dicts (ModelOutputs included)."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            yield from flatten(o, where + (i,))
    elif isinstance(obj, dict):
        for k, o in obj.items():
            yield from flatten(o, where + (k,))


def _func_name(func) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


class Recording:
    """The data-flow graph of one forward pass."""

    def __init__(self, paths: dict[int, str]):
        self.paths = paths  # id(module) -> path, for the modules that were hooked
        self.events: list[Event] = []
        self.values: list[Value] = []
        self._by_id: dict[int, int] = {}
        self._stack: list[int] = []

    # -- building ---------------------------------------------------------------------------------
    def value_of(self, t: torch.Tensor, producer: int | None = None) -> int:
        v = self._by_id.get(id(t))
        if v is None or self.values[v].tensor is not t:
            v = len(self.values)
            self.values.append(Value(v, t, producer))  # keeps t alive, so its id is not reused
            self._by_id[id(t)] = v
        return v

    def _new_version(self, t: torch.Tensor, producer: int) -> int:
        v = len(self.values)
        self.values.append(Value(v, t, producer))
        self._by_id[id(t)] = v
        return v

    def _event(self, kind, name, module, inputs) -> Event:
        e = Event(len(self.events), kind, name, module, tuple(self._stack), ours=hooks.normalizing())
        self.events.append(e)
        for where, t in inputs:
            v = self.value_of(t)
            e.inputs.append((where, v))
            if not (kind == "function" and name in _SHAPE_ONLY):
                self.values[v].readers.append(e.index)
        return e

    def on_function(self, func, args, kwargs, out) -> None:
        ins = list(flatten(args, ("arg",))) + list(flatten(kwargs, ("kwarg",)))
        outs = list(flatten(out))
        if not ins and not outs:
            return
        name = _func_name(func)
        e = self._event("function", name, None, ins)
        in_ids = {id(t) for _, t in ins}
        inplace = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
        for where, t in outs:
            if id(t) in in_ids and inplace:
                e.outputs.append((where, self._new_version(t, e.index)))  # in-place: a new version
            elif id(t) in in_ids:
                e.outputs.append((where, self.value_of(t)))  # returned its input unchanged
            else:
                e.outputs.append((where, self._new_version(t, e.index)))

    def enter_module(self, module, args, kwargs) -> None:
        ins = list(flatten(args, ("arg",))) + list(flatten(kwargs, ("kwarg",)))
        e = self._event("module", self.paths[id(module)], module, ins)
        self._stack.append(e.index)

    def exit_module(self, module, out) -> None:
        if not self._stack:
            return
        e = self.events[self._stack.pop()]
        e.end = len(self.events) - 1
        for where, t in flatten(out):
            v = self._by_id.get(id(t))
            if v is None or self.values[v].tensor is not t:
                v = self._new_version(t, e.index)
            e.outputs.append((where, v))

    # -- queries ----------------------------------------------------------------------------------
    def module_calls(self, module: nn.Module) -> list[Event]:
        return [e for e in self.events if e.kind == "module" and e.module is module]

    def inside(self, e: Event, frame: Event) -> bool:
        return frame.index in e.frames or e.index == frame.index

    def descendants(self, v: int, within: Event | None = None) -> set[int]:
        """Values computed from value `v` (function events only: module calls are groupings)."""
        out, todo = set(), [v]
        while todo:
            x = todo.pop()
            for r in self.values[x].readers:
                e = self.events[r]
                if e.kind != "function" or (within is not None and not self.inside(e, within)):
                    continue
                for _, o in e.outputs:
                    if o not in out and o != v:
                        out.add(o)
                        todo.append(o)
        return out

    def ancestors(self, v: int) -> set[int]:
        out, todo = set(), [v]
        while todo:
            x = todo.pop()
            p = self.values[x].producer
            if p is None:
                continue
            e = self.events[p]
            for _, i in e.inputs:
                if i not in out:
                    out.add(i)
                    todo.append(i)
        return out


class _Mode(TorchFunctionMode):
    def __init__(self, rec: Recording):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.rec.on_function(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def record(root: nn.Module, prefix: str = "") -> Iterator[Recording]:
    """Record every call of `root` and its submodules, and every torch function, inside the block."""
    paths: dict[int, str] = {}
    for name, m in root.named_modules(remove_duplicate=True):
        paths.setdefault(id(m), f"{prefix}.{name}" if prefix and name else (name or prefix))
    rec = Recording(paths)
    handles = []
    seen: set[int] = set()
    for m in root.modules():
        if id(m) in seen:
            continue
        seen.add(id(m))
        # Appended (not prepended): the call is recorded with the arguments the module really gets,
        # after any hook (ours included) has rewritten them. nn.Module's own methods, so a deferred
        # norm's call site is recorded (its override hands hooks to the normalisation instead).
        handles.append(nn.Module.register_forward_pre_hook(m, lambda mod, a, kw: rec.enter_module(mod, a, kw), with_kwargs=True))
        handles.append(nn.Module.register_forward_hook(m, lambda mod, a, out: rec.exit_module(mod, out), always_call=True))
    try:
        with _Mode(rec):
            yield rec
    finally:
        for h in handles:
            h.remove()
