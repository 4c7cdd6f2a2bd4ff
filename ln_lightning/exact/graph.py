"""One recorded forward of a model, read for the exact rewrites: where each norm's input comes from, who reads
its output, and how a feature dimension moves through the ops between them.

The recording is `ln_lightning.placement.reading.recording`'s data-flow graph (every torch function and module call of
one real forward). On top of it this file records each *normalisation*: a norm's forward hooks fire where it
really normalises, also for a norm `convert` deferred to its branch's entry (its call site in the user's code
then only passes the stream through), so a converted model is read as the function it computes now.

A feature dimension is tracked as a negative index (`-1`: the last), so that broadcasting in an add or a
multiply keeps it: a value is *constant along* it where that dimension is missing or of size 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ln_lightning.placement.reading.discovery import eval_no_grad, run_model
from ln_lightning.placement.reading.recording import Event, Recording, flatten, record, storage_key

ADD = {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__isub__", "sub_", "subtract"}
MUL = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply", "div", "__truediv__", "__itruediv__", "div_",
       "true_divide", "divide"}
_DIV = {"div", "__truediv__", "__itruediv__", "div_", "true_divide", "divide"}
SAME_SHAPE = {"contiguous", "clone", "to", "float", "double", "half", "bfloat16", "type", "type_as", "detach",
              "dropout", "alpha_dropout", "feature_alpha_dropout", "neg", "__neg__", "negative"}
NEGATE = {"neg", "__neg__", "negative"}
RESHAPE = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze"}
PERMUTE = {"transpose", "permute", "swapaxes", "swapdims", "movedim", "moveaxis", "t"}
EXPAND = {"expand", "expand_as", "broadcast_to"}
CAT = {"cat", "concat", "concatenate"}
INDEX = {"__getitem__"}  # followed only where the result is a view that keeps the features whole (a slice of tokens)


@dataclass
class Normalisation:
    """One time a norm normalised: its input and output values and the events it ran."""

    norm: nn.Module
    name: str
    input: int | None
    output: int | None
    start: int  # first event index of the normalisation
    end: int  # one past its last event

    def reads(self, e: Event, v: int) -> bool:
        return self.input == v and self.start <= e.index < self.end


@dataclass
class Traced:
    rec: Recording
    model: nn.Module
    output: Any
    normalisations: list[Normalisation] = field(default_factory=list)
    root_outputs: set[int] = field(default_factory=set)
    param_values: dict[int, int] = field(default_factory=dict)  # id(parameter) -> its value index
    param_names: dict[int, list[str]] = field(default_factory=dict)  # id(parameter) -> every name it has

    def value(self, v: int) -> torch.Tensor:
        return self.rec.values[v].tensor

    def readers(self, v: int) -> list[Event]:
        """The function events that read value `v` (module calls only group them)."""
        return [self.rec.events[r] for r in self.rec.values[v].readers if self.rec.events[r].kind == "function"]

    def normalisation_reading(self, e: Event, v: int) -> Normalisation | None:
        """The innermost normalisation that reads `v` with event `e` (a norm class wrapping another, as
        x-transformers' LayerNorm wraps a bare nn.LayerNorm, is read as the one inside)."""
        return max((n for n in self.normalisations if n.reads(e, v)), key=lambda n: n.start, default=None)

    def of(self, norm: nn.Module) -> list[Normalisation]:
        return [n for n in self.normalisations if n.norm is norm]

    def param_readers_outside(self, p: torch.Tensor, calls: list[Event]) -> list[Event]:
        """Events reading parameter `p` outside the module calls `calls`."""
        v = self.param_values.get(id(p))
        if v is None:
            return []
        return [e for e in self.readers(v) if not any(c.index < e.index <= c.end for c in calls)]

    def other_names(self, p: torch.Tensor, name: str) -> list[str]:
        return [n for n in self.param_names.get(id(p), []) if n != name]

    def where(self, e: Event) -> str:
        """The innermost module call an event happened in, by path (the model's own forward: so named)."""
        inner = next((self.rec.events[f].name for f in reversed(e.frames) if self.rec.events[f].name), "")
        return inner or "the model's forward"

    def describe(self, e: Event) -> str:
        """An event, for a reason: `linear` in blocks.0.attn.qkv."""
        return f"`{e.name}` in {self.where(e)}"


def trace(model: nn.Module, example: Any, norms: dict[str, nn.Module]) -> Traced:
    """Record one forward of `model` on `example` (eval, no grad), with every normalisation of `norms` (path -> module)."""
    pending: dict[int, list] = {}
    found: list[Normalisation] = []
    handles = []
    with eval_no_grad(model), record(model) as rec:
        def pre(mod, args):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            pending.setdefault(id(mod), []).append((None if x is None else rec.value_of(x), len(rec.events)))

        def post(mod, args, out):
            v_in, start = pending[id(mod)].pop()
            v_out = rec.value_of(out) if isinstance(out, torch.Tensor) else None
            found.append(Normalisation(mod, names[id(mod)], v_in, v_out, start, len(rec.events)))

        names = {id(m): n for n, m in norms.items()}
        for m in norms.values():
            # The module's own registration methods: a deferred norm hands these to its real normalisation.
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
        try:
            out = run_model(model, example)
        finally:
            for h in handles:
                h.remove()
    t = Traced(rec, model, out, sorted(found, key=lambda n: n.start))
    root = rec.module_calls(model)
    if root:
        t.root_outputs = {v for _, v in root[0].outputs}
    by_id = {id(v.tensor): v.index for v in rec.values if v.producer is None}
    for name, p in model.named_parameters(remove_duplicate=False):
        t.param_names.setdefault(id(p), []).append(name)
        if id(p) in by_id:
            t.param_values[id(p)] = by_id[id(p)]
    return t


# -- how a feature dimension moves through one op -----------------------------------------------------------


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def constant_along(t: torch.Tensor, fd: int) -> bool:
    """Is `t` (as broadcast against a value whose feature dimension is `fd`) the same along that dimension?"""
    return t.dim() < -fd or t.shape[fd] == 1


def _reshape_map(src: tuple[int, ...], dst: tuple[int, ...], fd: int) -> int | None:
    """The dimension of `dst` that holds dimension `fd` of `src` after a row-major reshape, as a negative index."""
    i = len(src) + fd
    size, inner = src[i], math.prod(src[i + 1:])
    for j in range(len(dst)):
        if dst[j] == size and math.prod(dst[j + 1:]) == inner:
            return j - len(dst)
    return None


def _stride_map(src: torch.Tensor, dst: torch.Tensor, fd: int) -> int | None:
    """The dimension of the view `dst` that is dimension `fd` of `src` (a permutation keeps size and stride)."""
    size, stride = src.shape[fd], src.stride(fd)
    hits = [j for j in range(dst.dim()) if dst.shape[j] == size and dst.stride(j) == stride]
    return hits[0] - dst.dim() if len(hits) == 1 else None


def _view_map(src: torch.Tensor, dst: torch.Tensor, fd: int) -> int | None:
    """`_stride_map` for an indexing result: only a view of `src` (basic slicing), never a gathered copy."""
    key = storage_key(src)
    return _stride_map(src, dst, fd) if key is not None and key == storage_key(dst) else None


def _cat_dim(e: Event, rec: Recording) -> int | None:
    out = rec.values[e.outputs[0][1]].tensor
    ins = [rec.values[v].tensor for _, v in e.inputs]
    dims = [d for d in range(out.dim()) if any(t.dim() == out.dim() and t.shape[d] != out.shape[d] for t in ins)]
    return dims[0] - out.dim() if len(dims) == 1 else None


def forward_dim(rec: Recording, e: Event, v: int, fd: int) -> tuple[int | None, str]:
    """Where feature dimension `fd` of input `v` lands in the output of `e`, for an op that keeps a shift along
    it a shift along it (a tensor constant along `fd` added to `v` comes out as one); (None, why) if it doesn't."""
    if not e.outputs:
        return None, "returns no tensor"
    x, y = rec.values[v].tensor, rec.values[e.outputs[0][1]].tensor
    others = [rec.values[u].tensor for w, u in e.inputs if u != v and w != ("kwarg", "out")]
    name = e.name
    if name in ADD:
        return (fd if y.dim() >= -fd and y.shape[fd] == x.shape[fd] else None), "broadcasts the features"
    if name in MUL:
        if name in _DIV and e.input_value(("arg", 0)) != v:
            return None, "divides by it"
        if all(constant_along(o, fd) for o in others):
            return fd, ""
        return None, "multiplies it by a tensor that varies along the features"
    if name in SAME_SHAPE:
        return (fd if _shape(x) == _shape(y) and e.input_value(("arg", 0)) == v else None), "changes its shape"
    if name in RESHAPE:
        return _reshape_map(_shape(x), _shape(y), fd), "splits or merges the features"
    if name in PERMUTE:
        return _stride_map(x, y, fd), "moves the features in a way not read"
    if name in EXPAND:
        return (fd if y.shape[fd] == x.shape[fd] else None), "expands the features"
    if name in INDEX:
        return (_view_map(x, y, fd) if e.input_value(("arg", 0)) == v else None), "indexes the features or gathers a copy"
    if name in CAT:
        d = _cat_dim(e, rec)
        return (fd if d is not None and d != fd else None), "concatenates along the features"
    return None, ""


def backward_terms(rec: Recording, e: Event, v_out: int, fd: int) -> tuple[list[tuple[int, int]] | None, str]:
    """The inputs of `e` (with their feature dimension) that its output `v_out` is a sum of along feature dimension
    `fd`, for an op that is linear in them and keeps a mean-zero one mean-zero; (None, why) otherwise."""
    y = rec.values[v_out].tensor
    ins = [(w, u) for w, u in e.inputs if w != ("kwarg", "out")]
    name = e.name
    if name in ADD:
        terms = list(dict.fromkeys(u for _, u in ins))
        if len(ins) < 2:
            return None, f"`{name}` adds a number to it"
        out = []
        for u in terms:
            t = rec.values[u].tensor
            if constant_along(t, fd):
                return None, f"`{name}` adds a tensor that is constant along the features (its mean is not zero)"
            out.append((u, fd))
        return out, ""
    if name in MUL:
        varying = [u for _, u in ins if not constant_along(rec.values[u].tensor, fd)]
        if len(varying) != 1 or (name in _DIV and e.input_value(("arg", 0)) != varying[0]):
            return None, f"`{name}` multiplies two tensors that vary along the features"
        return [(varying[0], fd)], ""
    if not ins:
        return None, f"`{name}` makes it from no tensor"
    first = e.input_value(("arg", 0))
    if name in CAT:
        d = _cat_dim(e, rec)
        if d is None or d == fd:
            return None, f"`{name}` concatenates along the features"
        return [(u, fd) for _, u in ins], ""
    if first is None:
        return None, f"`{name}` gets it in a way not read"
    x = rec.values[first].tensor
    if name in SAME_SHAPE:
        return ([(first, fd)] if _shape(x) == _shape(y) else None), f"`{name}` changes its shape"
    if name in RESHAPE:
        back = _reshape_map(_shape(y), _shape(x), fd)
        return ([(first, back)] if back is not None else None), f"`{name}` splits or merges the features"
    if name in PERMUTE:
        back = _stride_map(y, x, fd)
        return ([(first, back)] if back is not None else None), f"`{name}` moves the features in a way not read"
    if name in EXPAND:
        ok = x.dim() >= -fd and x.shape[fd] == y.shape[fd]
        return ([(first, fd)] if ok else None), f"`{name}` expands the features"
    if name in INDEX:
        back = _view_map(y, x, fd)
        return ([(first, back)] if back is not None else None), f"`{name}` indexes the features or gathers a copy"
    return None, (f"`{name}` writes into it, and only what a Linear, Conv1D, convolution, Embedding or parameter "
                  "writes is centred by its weights")


def output_tensors(out: Any) -> list[torch.Tensor]:
    return [t for _, t in flatten(out) if t.is_floating_point()]


def relative_error(after: Any, before: Any) -> float:
    """max|after - before| / max|before| over the floating tensors of two outputs of the same structure."""
    a, b = output_tensors(after), output_tensors(before)
    if len(a) != len(b) or not b:
        return float("nan") if len(a) != len(b) else 0.0
    num = max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))
    den = max(float(y.double().abs().max()) if y.numel() else 0.0 for y in b)
    return num / den if den > 0 else num


def resolve_example(model: nn.Module, example_input: Any, what: str) -> Any:
    """The input to read the model from: `example_input`, else the model's `example_input_array` (Lightning's)."""
    if example_input is None:
        example_input = getattr(model, "example_input_array", None)
    if example_input is None:
        raise ValueError(
            f"{what} needs an example input to read the model from and to measure the rewrite: pass "
            f"example_input= (a tensor, a tuple of arguments or a dict of keyword arguments), or set the model's "
            "example_input_array"
        )
    return example_input


def run(model: nn.Module, example: Any) -> Any:
    with eval_no_grad(model):
        return run_model(model, example)
