"""Recording what a forward pass really does: every module call and torch function, as data flow.

Recognition reads a model from one real (or probe) forward instead of from its source code:
Hugging Face modelling code and most research code is not symbolically traceable, but it always
runs. A `TorchFunctionMode` sees every torch function and tensor method at any depth (the top-level
call only: what a function does inside is not recorded), and hooks on every submodule see each
module call with its actual arguments and outputs. Tensors are identified by object identity;
each one gets a `Value` node, so the recording is a data-flow graph:

    value --read by--> event --produces--> value

Which tensors a call writes is read from the write annotations of the aten operators it runs, not
from its name: each argument an operator's schema marks `Tensor(a!)` has its version counter bumped
(autograd's ADInplaceOrView kernels do it, under no_grad too), so an argument whose `_version`
changed across the call was written (an operator called directly, `torch.ops...`, is also read
from its `_schema`): `buf[...] = x`, `torch.add(x, y, out=buf)`, `relu(x,
inplace=True)` and a `torch.library` op with `mutates_args` all are. A write makes a new version of
every recorded tensor on the written storage (a view's base, `x` under `x.data`), produced by the
call that wrote it. A call
that returns its own input unwritten (`contiguous()` of a contiguous tensor, dropout in eval)
produces no new value. Functions whose result depends only on a tensor's shape (`zeros_like`,
`new_ones`, ...) are not reads of its values, unless their result shares its storage (`x.data`).
A call that turns a tensor's values into something that is not a tensor (`numpy()`, `tolist()`,
`item()`, `data_ptr()`) is marked `leaves`: what is computed from it can't be followed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ln_lightning.placement.rewrite import hooks

_ADD_NAMES = {"add", "__add__", "__radd__", "__iadd__", "add_"}
# Results that depend on a tensor's metadata only, not its values.
_SHAPE_ONLY = {
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "size", "dim", "numel", "__get__", "__len__", "stride",
    "is_floating_point", "is_complex", "element_size", "get_device", "is_contiguous",
}
# Results that are metadata or control flow, not the tensor's values carried out of torch.
_IDENTITY_ONLY = {"__hash__"}
_NOT_DATA = (bool, str, torch.Size, torch.dtype, torch.device, type(None))


def storage_key(t: torch.Tensor) -> int | None:
    """Identifies the storage `t` views (the same for a view, its base and `t.data`)."""
    try:
        with torch._C.DisableTorchFunction():  # not a call of the model's: keep it out of the recording
            return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - sparse, nested or subclass tensors: no alias tracking
        return None


def _data(obj: Any) -> bool:
    """Values from out of torch, as a tensor factory is given them: an array, bytes, a list of floats."""
    if isinstance(obj, (tuple, list)) and not isinstance(obj, torch.Size):
        return any(_data(o) for o in obj)
    return isinstance(obj, float) or (_leaves_torch(obj) and not isinstance(obj, (int, slice, type(Ellipsis))))


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _versions(ins: list) -> list:
    """`_version` of each (where, tensor): one pass, falling back per tensor only when one has no counter."""
    try:
        return [t._version for _, t in ins]
    except RuntimeError:
        return [_version(t) for _, t in ins]


def _leaves_torch(out: Any) -> bool:
    """Is `out` a tensor's values in a form the recording can't follow (an array, a list, a number, a pointer)?"""
    if isinstance(out, torch.Tensor) or isinstance(out, _NOT_DATA):
        return False
    if isinstance(out, (tuple, list)):
        return any(_leaves_torch(o) for o in out)
    return True


@dataclass(slots=True)
class Value:
    index: int
    tensor: torch.Tensor
    producer: int | None  # event index; None for an input from outside the recording
    readers: list[int] = field(default_factory=list)


@dataclass(slots=True)
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
    leaves: bool = False  # function events: its result carries the values out of torch (numpy, a list, a pointer)
    data_args: bool = False  # function events without tensor inputs: given values from out of torch (an array, a list of floats)

    @property
    def is_add(self) -> bool:
        """A sum of two values (`out=` is where it is written, not a term)."""
        return self.kind == "function" and self.name in _ADD_NAMES and len({v for w, v in self.inputs if w != ("kwarg", "out")}) == 2

    def input_value(self, where) -> int | None:
        return next((v for w, v in self.inputs if w == where), None)


def flatten(obj: Any, where: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    """(location, tensor) for every tensor in nested tuples / lists / dicts (ModelOutputs included)."""
    if isinstance(obj, torch.Tensor):  # the common cases, without the recursion
        return [(where, obj)]
    if obj is None:
        return []
    out: list = []
    if type(obj) is tuple:  # a call's arguments: tensors and plain values, rarely nested
        for i, o in enumerate(obj):
            if isinstance(o, torch.Tensor):
                out.append((where + (i,), o))
            elif isinstance(o, (tuple, list, dict)):
                _flatten(o, where + (i,), out)
        return out
    _flatten(obj, where, out)
    return out


def _flatten(obj, where, out) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((where, obj))
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            if isinstance(o, torch.Tensor):  # the common case, without a call
                out.append((where + (i,), o))
            elif isinstance(o, (tuple, list, dict)):
                _flatten(o, where + (i,), out)
    elif isinstance(obj, dict):
        for k, o in obj.items():
            if isinstance(o, torch.Tensor):
                out.append((where + (k,), o))
            elif isinstance(o, (tuple, list, dict)):
                _flatten(o, where + (k,), out)


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
        self._frames: tuple[int, ...] = ()  # tuple(self._stack), shared by the events made inside the same call
        self._calls: dict[int, list[Event]] = {}  # id(module) -> its calls, in order
        self._by_storage: dict[int, set[int]] = {}  # storage key -> ids of the recorded tensors on it
        self._unindexed: list[torch.Tensor] = []  # recorded since the last write (indexed when one comes)

    # -- building ---------------------------------------------------------------------------------
    def value_of(self, t: torch.Tensor, producer: int | None = None) -> int:
        v = self._by_id.get(id(t))
        if v is None or self.values[v].tensor is not t:
            v = self._new_version(t, producer)  # keeps t alive, so its id is not reused
        return v

    def _new_version(self, t: torch.Tensor, producer: int | None) -> int:
        v = len(self.values)
        self.values.append(Value(v, t, producer))
        if id(t) not in self._by_id:
            self._unindexed.append(t)
        self._by_id[id(t)] = v
        return v

    def _index_storages(self) -> None:
        """Storage key -> tensors, brought up to date (only once a write needs it: most forwards write nothing)."""
        for t in self._unindexed:
            key = storage_key(t)
            if key is not None:
                self._by_storage.setdefault(key, set()).add(id(t))
        self._unindexed.clear()

    def _event(self, kind, name, module, inputs, reads: bool = True) -> Event:
        e = Event(len(self.events), kind, name, module, self._frames, ours=hooks.normalizing())
        self.events.append(e)
        values, e_inputs, by_id = self.values, e.inputs, self._by_id
        for where, t in inputs:
            v = by_id.get(id(t))  # `value_of`, inlined: a few thousand inputs per recorded forward
            if v is None or values[v].tensor is not t:
                v = self._new_version(t, None)
            e_inputs.append((where, v))
            if reads:
                values[v].readers.append(e.index)
        return e

    @staticmethod
    def written(ins: list, before: list, func) -> set[int]:
        """Storage keys of the arguments the call `func` wrote: those whose version counter moved, and for
        an operator called directly (`torch.ops...`, a `torch.library` op) those its schema marks written."""
        after = _versions(ins)
        out = {storage_key(t) for (_, t), v, w in zip(ins, before, after) if v is not None and w != v} if after != before else set()
        schema = getattr(func, "_schema", None)
        if schema is not None:
            marked = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
            names = {schema.arguments[i].name for i in marked}
            out |= {storage_key(t) for where, t in ins
                    if (where[0] == "arg" and where[1] in marked) or (where[0] == "kwarg" and where[1] in names)}
        return out - {None}

    def on_function(self, func, ins, args, kwargs, out, written: set[int]) -> None:
        outs = flatten(out)
        if not ins and not outs:
            return
        name = _func_name(func)
        in_ids = {id(t) for _, t in ins}
        reads = True
        if name in _SHAPE_ONLY:
            # Metadata only, unless the result is the input's storage under another name (`x.data`, `x.T`).
            fresh = [t for _, t in outs if id(t) not in in_ids]
            in_keys = {storage_key(t) for _, t in ins} - {None} if fresh else set()
            reads = any(storage_key(t) in in_keys for t in fresh)
        e = self._event("function", name, None, ins, reads)
        if not outs:
            e.leaves = reads and name not in _IDENTITY_ONLY and _leaves_torch(out)
        if not ins:
            e.data_args = any(_data(a) for a in (*args, *kwargs.values()))
        versioned = set()
        for where, t in outs:
            if written and id(t) in in_ids and storage_key(t) in written:
                e.outputs.append((where, self._new_version(t, e.index)))  # written in place: a new version
                versioned.add(id(t))
            elif id(t) in in_ids:
                e.outputs.append((where, self.value_of(t)))  # returned its input unchanged
            else:
                e.outputs.append((where, self._new_version(t, e.index)))
                versioned.add(id(t))
        if not written:
            return
        # Every other recorded tensor on a written storage (the buffer of `buf[...] = x`, a view's base).
        self._index_storages()
        for key in written:
            for tid in sorted(self._by_storage.get(key, ())):
                if tid not in versioned:
                    t = self.values[self._by_id[tid]].tensor
                    e.outputs.append((("written",), self._new_version(t, e.index)))

    def enter_module(self, module, args, kwargs) -> None:  # a forward pre-hook (with kwargs)
        ins = flatten(args, ("arg",)) + flatten(kwargs, ("kwarg",))
        e = self._event("module", self.paths[id(module)], module, ins)
        self._calls.setdefault(id(module), []).append(e)
        self._stack.append(e.index)
        self._frames = tuple(self._stack)

    def exit_module(self, module, args, out) -> None:  # a forward hook
        if not self._stack:
            return
        e = self.events[self._stack.pop()]
        self._frames = tuple(self._stack)
        e.end = len(self.events) - 1
        for where, t in flatten(out):
            v = self._by_id.get(id(t))
            if v is None or self.values[v].tensor is not t:
                v = self._new_version(t, e.index)
            e.outputs.append((where, v))

    # -- queries ----------------------------------------------------------------------------------
    def module_calls(self, module: nn.Module) -> list[Event]:
        return list(self._calls.get(id(module), ()))

    def within(self, call: Event) -> list[Event]:
        """The events inside a module call, in order."""
        return self.events[call.index + 1: call.end + 1]

    def inside(self, e: Event, frame: Event) -> bool:
        return frame.index in e.frames or e.index == frame.index

    def descendants(self, v: int, within: Event | None = None) -> set[int]:
        """Values computed from value `v` (function events only: module calls are groupings)."""
        out, todo = set(), [v]
        while todo:
            x = todo.pop()
            for r in self.values[x].readers:
                e = self.events[r]
                if e.kind != "function" or (within is not None and not (within.index < e.index <= within.end)):
                    continue
                for _, o in e.outputs:
                    if o not in out and o != v:
                        out.add(o)
                        todo.append(o)
        return out

    def ancestors(self, v: int, within: Event | None = None) -> set[int]:
        """Values `v` was computed from (inside the call `within` only, when given)."""
        out, todo = set(), [v]
        while todo:
            x = todo.pop()
            p = self.values[x].producer
            if p is None or (within is not None and not (within.index < p <= within.end)):
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
        ins = flatten(args, ("arg",)) + flatten(kwargs, ("kwarg",)) if kwargs else flatten(args, ("arg",))
        before = _versions(ins)
        out = func(*args, **kwargs)
        self.rec.on_function(func, ins, args, kwargs, out, self.rec.written(ins, before, func))
        return out


@contextlib.contextmanager
def record(root: nn.Module, prefix: str = "") -> Iterator[Recording]:
    """Record every call of `root` and its submodules, and every torch function, inside the block."""
    paths: dict[int, str] = {}
    modules = []
    for name, m in root.named_modules(remove_duplicate=True):
        paths[id(m)] = f"{prefix}.{name}" if prefix and name else (name or prefix)
        modules.append(m)
    rec = Recording(paths)
    handles = []
    for m in modules:
        # Appended (not prepended): the call is recorded with the arguments the module really gets,
        # after any hook (ours included) has rewritten them. nn.Module's own methods, so a deferred
        # norm's call site is recorded (its override hands hooks to the normalisation instead).
        handles.append(nn.Module.register_forward_pre_hook(m, rec.enter_module, with_kwargs=True))
        handles.append(nn.Module.register_forward_hook(m, rec.exit_module, always_call=True))
    try:
        with _Mode(rec):
            yield rec
    finally:
        for h in handles:
            h.remove()
