"""The mechanism that moves a norm between the places of a residual sublayer (after the add, the branch
input, the branch output), shown here for post-norm to pre-norm; peri and output-norm use the same pieces
(`NormalizeBranchOutput` at the branch's exit).

A post-norm sublayer is written in the user's `forward` as `x = norm(x + branch(x))`. We do not
rewrite that code (it may branch on masks, modes or config that a trace cannot see). Instead:

* the norm module becomes a pass-through at its call site (`DeferredNorm`): `norm(x + b)` returns
  `x + b`, so the stream is no longer normalised;
* a forward pre-hook on every module where the branch first reads `x` (its *entries*) replaces those
  arguments by `norm.normalize(x)`, so the branch computes `branch(LN(x))`;
* optionally a forward hook on the branch's last module (its *exit*) scales its output by `c` (where one
  exit module ends several branches, a `TagBranchValue` on the module that hands it this branch's value
  tells this branch's call apart).

Together: `x <- x + c * branch(LN(x))`, the pre-norm formula, with every parameter where it was
(same module paths, same tensors). Undoing the three steps restores the original function exactly.

`bypass()` switches all of it off for the current thread: the model then computes its original
function. `convert` uses that to measure how much the conversion changed the output.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict

import torch
from torch import nn


class _State(threading.local):
    # Each thread's state starts at these class defaults. With them, reading a flag no thread set is a plain
    # attribute hit: on a bare threading.local it raised (and formatted) an AttributeError that getattr's default
    # then swallowed, for every recorded call and every hook call (a few percent of a 96-block convert).
    bypass = False
    normalizing = 0
    weight = None
    capture = None


_state = _State()


def bypassed() -> bool:
    return getattr(_state, "bypass", False)


def normalizing() -> bool:
    """True inside a deferred norm's own normalisation (the recorder tells our reads from the user's)."""
    return getattr(_state, "normalizing", 0) > 0


@contextlib.contextmanager
def our_normalization():
    """Ops inside are the rewrite's own (a deferred norm's normalisation, an entry's stream scale), not the user's."""
    _state.normalizing = getattr(_state, "normalizing", 0) + 1
    try:
        yield
    finally:
        _state.normalizing -= 1


@contextlib.contextmanager
def substituted(module: nn.Module, params: dict[str, torch.Tensor] | None):
    """`module` computes with `params` (name -> tensor, nested names too) in place of its own parameters inside."""
    if not params:
        yield
        return
    saved = []
    try:
        for name, value in params.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            saved.append((owner, leaf, owner._parameters[leaf]))
            owner._parameters[leaf] = value
        yield
    finally:
        for owner, leaf, p in reversed(saved):
            owner._parameters[leaf] = p


WEIGHT_ATTR = "ln_lightning_blend_weight"  # a norm's instance attribute: its normalisations weigh the blend `a`


def normalization_weight(norm: nn.Module) -> torch.Tensor | None:
    """The weight the normalisation `norm` is doing right now has in the model's function, for monitors.

    Outside a placement transition None (weight 1). During one, a deferred norm normalises at its own call
    site (weight `1 - a`) and at its branch's entries (weight `a`), a norm the conversion added (a final norm,
    peri's output norm) weighs `a`: a monitor that weights what it sees by this reports the function being
    computed (at `a = 0` exactly the model before the conversion). A 0-dim tensor on the blend's device.
    """
    w = getattr(_state, "weight", None)
    if w is not None:
        return w
    t = norm.__dict__.get(WEIGHT_ATTR)
    return None if t is None else t.a(t.blend)


@contextlib.contextmanager
def _weighted(weight: torch.Tensor):
    old = getattr(_state, "weight", None)
    _state.weight = weight
    try:
        yield
    finally:
        _state.weight = old


def weighted(norm: nn.Module, weight: torch.Tensor):
    """A context in which `norm`'s normalisations weigh `weight` (see `normalization_weight`); the transition's.

    Only when something watches the norm (a forward pre-hook: a monitor): otherwise nothing is written, so a
    compiled or exported model has no thread-local state to trace.
    """
    watched = norm.__dict__.get("_ln_pre_hooks") or norm._forward_pre_hooks
    return _weighted(weight) if watched else contextlib.nullcontext()


@contextlib.contextmanager
def bypass():
    """Run the model's original (unconverted) function inside this block, on this thread."""
    old = bypassed()
    _state.bypass = True
    try:
        yield
    finally:
        _state.bypass = old


# ---------------------------------------------------------------------------------------------
# DeferredNorm: a norm whose call site passes its input through; normalisation runs at the entries.
# ---------------------------------------------------------------------------------------------


class DeferredNorm:
    """Mixin placed in front of a norm's own class (nn.LayerNorm, FusedLayerNorm, nn.RMSNorm, ...).

    The instance keeps its parameters, buffers and module path; only `forward` changes: at its
    call site in the user's code it passes its input through, and `normalize(x)` (called from the
    branch's entry) is the original normalisation.

    Hooks follow the normalisation: forward (pre-)hooks registered on a deferred norm, before or
    after it was deferred, fire when it really normalises, with the tensor it normalises, never for
    the pass-through call. Monitors and user hooks on LayerNorms so keep measuring what they meant.
    """

    ln_lightning_deferred = True

    @classmethod
    def ln_lightning_rewrap(cls, base: type) -> type:
        """The deferred class for another norm class (the norm swap turns Deferred<LayerNorm> into
        Deferred<FusedLayerNorm> through this, without knowing how placement builds its classes)."""
        return _deferred_class(base)

    def forward(self, x, *args, **kwargs):  # the call site: pass-through
        if bypassed():
            return super().forward(x, *args, **kwargs)
        # During a transition (placement/migrate/transition.py) the call site blends (1-a)*N(x) + a*x;
        # the attribute is set on the instance by transition.start and removed by transition.finish.
        t = self.__dict__.get("ln_lightning_transition")
        if t is not None:  # a real normalisation (weighted 1-a): through normalize, so hooks and monitors see it
            with weighted(self, 1 - t.a(t.blend)), substituted(self, t.call_site_params(self)):
                y = self.normalize(x) if not args and not kwargs else super().forward(x, *args, **kwargs)
            return t.call_site(x, y, self)
        return x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        d = self.__dict__
        for key, hook in list(d["_ln_pre_hooks"].items()):
            if key in d["_ln_pre_kw"]:
                r = hook(self, (x,), {})
                if r is not None:
                    x = r[0][0]
            else:
                r = hook(self, (x,))
                if r is not None:
                    x = r[0] if isinstance(r, tuple) else r
        with our_normalization():
            y = super().forward(x)
        for key, hook in list(d["_ln_post_hooks"].items()):
            r = hook(self, (x,), {}, y) if key in d["_ln_post_kw"] else hook(self, (x,), y)
            if r is not None:
                y = r
        return y

    def register_forward_hook(self, hook, *, prepend: bool = False, with_kwargs: bool = False, always_call: bool = False):
        return _add_hook(self.__dict__["_ln_post_hooks"], self.__dict__["_ln_post_kw"], hook, prepend, with_kwargs)

    def register_forward_pre_hook(self, hook, *, prepend: bool = False, with_kwargs: bool = False):
        return _add_hook(self.__dict__["_ln_pre_hooks"], self.__dict__["_ln_pre_kw"], hook, prepend, with_kwargs)

    def __reduce_ex__(self, protocol):
        # The class is made at run time; pickle the instance as "base class + state" instead. The state goes third
        # (set once the instance exists), so a cycle back to this norm (a transition listing it) finds it.
        return _new_mixed, (DeferredNorm, type(self).__mro__[2]), self.__dict__


def _add_hook(hooks_dict, kw_dict, hook, prepend, with_kwargs):
    handle = torch.utils.hooks.RemovableHandle(hooks_dict, extra_dict=kw_dict)
    hooks_dict[handle.id] = hook
    if with_kwargs:
        kw_dict[handle.id] = True
    if prepend:
        hooks_dict.move_to_end(handle.id, last=False)
    return handle


_mixed_classes: dict[tuple[type, type], type] = {}


def _mixed_class(mixin: type, base: type) -> type:
    """`<Mixin><Base>(mixin, base)`, made once per pair (made at run time: see `__reduce_ex__`)."""
    cls = _mixed_classes.get((mixin, base))
    if cls is None:
        cls = type(f"{mixin.__name__.removesuffix('Norm')}{base.__name__}", (mixin, base), {"__module__": __name__})
        _mixed_classes[(mixin, base)] = cls
    return cls


def _new_mixed(mixin: type, base: type) -> nn.Module:
    cls = _mixed_class(mixin, base)
    return cls.__new__(cls)


def _rebuild_mixed(mixin: type, base: type, state: dict) -> nn.Module:  # what earlier pickles call
    cls = _mixed_class(mixin, base)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _deferred_class(base: type) -> type:
    return _mixed_class(DeferredNorm, base)


def _rebuild_deferred(base: type, state: dict) -> nn.Module:  # what pickles written by 0.1.0 call
    return _rebuild_mixed(DeferredNorm, base, state)


def defer_norm(norm: nn.Module) -> None:
    if isinstance(norm, DeferredNorm):
        return
    # Hand the module's hook dicts (the same objects, so existing handles still remove them) to the
    # normalisation; the call site gets empty ones.
    d = norm.__dict__
    d["_ln_post_hooks"], norm._forward_hooks = norm._forward_hooks, OrderedDict()
    d["_ln_post_kw"], norm._forward_hooks_with_kwargs = norm._forward_hooks_with_kwargs, OrderedDict()
    d["_ln_pre_hooks"], norm._forward_pre_hooks = norm._forward_pre_hooks, OrderedDict()
    d["_ln_pre_kw"], norm._forward_pre_hooks_with_kwargs = norm._forward_pre_hooks_with_kwargs, OrderedDict()
    norm.__class__ = _deferred_class(type(norm))


def undefer_norm(norm: nn.Module) -> None:
    if not isinstance(norm, DeferredNorm):
        return
    norm.__class__ = type(norm).__mro__[2]
    d = norm.__dict__
    for ours, theirs in (("_ln_post_hooks", "_forward_hooks"), ("_ln_post_kw", "_forward_hooks_with_kwargs"),
                         ("_ln_pre_hooks", "_forward_pre_hooks"), ("_ln_pre_kw", "_forward_pre_hooks_with_kwargs")):
        restored = d.pop(ours)
        restored.update(getattr(norm, theirs))
        setattr(norm, theirs, restored)


class BypassableNorm:
    """Mixin for a final norm convert put into a block's own slot (x-transformers' `final_norm`):
    under `bypass()` it passes its input through, so the original function is still one switch away."""

    ln_lightning_bypassable = True

    def forward(self, x, *args, **kwargs):
        if bypassed():
            return x
        return super().forward(x, *args, **kwargs)

    def __reduce_ex__(self, protocol):
        return _new_mixed, (BypassableNorm, type(self).__mro__[2]), self.__dict__


def make_bypassable(norm: nn.Module) -> None:
    norm.__class__ = _mixed_class(BypassableNorm, type(norm))


def is_deferred(norm: nn.Module) -> bool:
    return isinstance(norm, DeferredNorm)


def original_class(norm: nn.Module) -> type:
    """The norm's own class, also while it is deferred (or bypassable)."""
    return type(norm).__mro__[2] if isinstance(norm, (DeferredNorm, BypassableNorm)) else type(norm)


def reference_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm`'s normalisation of `x` through its own class's forward: no hooks, deferred or not."""
    return original_class(norm).forward(norm, x)


# ---------------------------------------------------------------------------------------------
# Hooks. They are small top-level classes (not closures) so that deepcopy and pickle of a converted
# model keep working, and so `convert(placement="post")` can find and remove exactly its own hooks.
# ---------------------------------------------------------------------------------------------


class NormalizeBranchInput:
    """Forward pre-hook on a branch entry: the arguments that carried the stream get `norm.normalize`."""

    def __init__(self, norm: nn.Module, arg_positions: tuple[int, ...], kwarg_names: tuple[str, ...]):
        self.norm = norm
        self.arg_positions = arg_positions
        self.kwarg_names = kwarg_names

    def __call__(self, module, args, kwargs):
        if bypassed():
            return None
        # One normalisation per call even when the stream is passed several times (q, k, v); none for
        # a tensor that already is this norm's output (an earlier entry returned its normalised input
        # and the forward passes it on: MobileBERT's bottleneck hands the stream to its attention).
        cache: dict[int, torch.Tensor] = {}

        def norm_of(t):
            key = id(t)
            if key not in cache:
                done = _normalized_by.get(id(self.norm))
                cache[key] = t if done is not None and done() is t else self.normalized(t)
                if isinstance(cache[key], torch.Tensor):
                    _normalized_by[id(self.norm)] = weakref.ref(cache[key])
            return cache[key]

        capture = getattr(_state, "capture", None)
        if capture is not None:
            first = args[self.arg_positions[0]] if self.arg_positions else kwargs[self.kwarg_names[0]]
            capture.append(("entry", self.norm, first))
        args = list(args)
        for i in self.arg_positions:
            if i < len(args):
                args[i] = norm_of(args[i])
        kwargs = dict(kwargs)
        for k in self.kwarg_names:
            if k in kwargs:
                kwargs[k] = norm_of(kwargs[k])
        return tuple(args), kwargs

    def normalized(self, t: torch.Tensor) -> torch.Tensor:
        # Overridden by transition.BlendNormalizeBranchInput: (1-a)*t + a*normalize(t).
        return self.norm.normalize(t)


# id(norm) -> the tensor its latest branch-entry normalisation returned (weakly: no tensor is kept alive).
_normalized_by: dict[int, "weakref.ref[torch.Tensor]"] = {}


def _with_branch_value(output, index: int | None, value):
    """A branch exit's output with its branch value (the output, or `output[index]`) replaced."""
    if index is None:
        return value
    out = list(output)
    out[index] = value
    return type(output)(out) if isinstance(output, tuple) else out


class TagBranchValue:
    """Forward hook on the module that hands a shared branch exit its value (the exit's *feeder*: `attn` in
    `drop(attn(x))` where one `drop` ends both branches): remembers, weakly, the tensor it returned, so the exit's
    hooks act on that call of the exit only (`BranchCall`)."""

    def __init__(self, index: int | None):
        self.index = index
        self._last = None

    def __call__(self, module, args, output):
        value = output if self.index is None else output[self.index]
        self._last = weakref.ref(value) if isinstance(value, torch.Tensor) else None
        return None

    def returned(self, t) -> bool:
        last = self._last
        return last is not None and last() is t

    # A copy (deepcopy, pickle) remembers nothing: the tensor belongs to the forward that made it.
    def __deepcopy__(self, memo):
        return TagBranchValue(self.index)

    def __getstate__(self):
        return {"index": self.index}

    def __setstate__(self, state):
        self.index, self._last = state["index"], None


class BranchCall:
    """Picks a branch's call of a shared exit module: the one whose positional argument `arg` is the tensor its
    feeder's `TagBranchValue` remembers (the same tensor object in training and in eval, whatever the exit does)."""

    def __init__(self, tag: TagBranchValue, arg: int):
        self.tag = tag
        self.arg = arg

    def selects(self, args: tuple) -> bool:
        return self.arg < len(args) and self.tag.returned(args[self.arg])


def _is_this_branch(hook, args) -> bool:
    call = hook.__dict__.get("call")  # (absent on hooks pickled before shared exits)
    return call is None or call.selects(args)


class NormalizeBranchOutput:
    """Forward hook on a branch exit: output (or `output[index]`) -> a norm of it.

    `deferred=True`: the branch's own norm, deferred at its call site, normalises here (`"output"`
    placement, OLMo 2's `x + N(F(x))`); `False`: an output norm the rewrite added (`"peri"`).
    `call`: on an exit module other branches call too, the `BranchCall` that picks this branch's call."""

    def __init__(self, norm: nn.Module, index: int | None, deferred: bool, call: BranchCall | None = None):
        self.norm = norm
        self.index = index
        self.deferred = deferred
        self.call = call

    def __call__(self, module, args, output):
        if bypassed() or not _is_this_branch(self, args):
            return None
        value = output if self.index is None else output[self.index]
        return _with_branch_value(output, self.index, self.normalized(value))

    def normalized(self, value: torch.Tensor) -> torch.Tensor:
        # Overridden by transition.BlendNormalizeBranchOutput: (1-a)*value + a*N(value).
        return self.norm.normalize(value) if self.deferred else self.norm(value)


class ScaleBranchOutput:
    """Forward hook on a branch exit: output (or `output[index]`) times `scale` (a module); `call` as for
    `NormalizeBranchOutput`."""

    def __init__(self, scale: nn.Module | None, index: int | None, call: BranchCall | None = None):
        self.scale = scale
        self.index = index
        self.call = call

    def __call__(self, module, args, output):
        if bypassed():
            return None
        if self.scale is None or not _is_this_branch(self, args):
            return None
        value = output if self.index is None else output[self.index]
        return _with_branch_value(output, self.index, self.scaled(value))

    def scaled(self, value: torch.Tensor) -> torch.Tensor:
        # Overridden by transition.BlendScaleBranchOutput: the scale ramps from 1 to c.
        return self.scale(value)


def replace_stream(output, stream: torch.Tensor, new: torch.Tensor):
    """`output` with its top-level element that *is* `stream` replaced by `new`; None if absent.

    Top level only: a tensor, an element of a tuple/list, a value of a dict or ModelOutput. The
    nested `hidden_states` tuples Hugging Face returns keep the stream as the blocks produced it.
    """
    if output is stream:
        return new
    if isinstance(output, (tuple, list)):
        for i, o in enumerate(output):
            if o is stream:
                items = list(output)
                items[i] = new
                if isinstance(output, list):
                    return items
                return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
        return None
    if isinstance(output, dict):
        for k, o in output.items():
            if o is stream:
                output[k] = new  # ModelOutput keeps its attribute in step with the key
                return output
    return None


def stream_of(output) -> torch.Tensor | None:
    """A block's residual stream: the output itself, its first element, or its first value."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, dict) and output:
        first = next(iter(output.values()))
        return first if isinstance(first, torch.Tensor) else None
    return None


class ApplyFinalNorm:
    """Forward hook on a stack's last block, called once per forward: its stream -> final_norm(stream)."""

    def __init__(self, norm: nn.Module):
        self.norm = norm

    def __call__(self, module, args, output):
        if bypassed():
            return None
        s = stream_of(output)
        return replace_stream(output, s, self.norm(s))


class TapStream:
    """Forward hook on a shared last block (called several times per forward): remembers its latest stream."""

    def __init__(self):
        self.value = None

    def __call__(self, module, args, output):
        self.value = None if bypassed() else stream_of(output)
        return None

    def __deepcopy__(self, memo):
        return TapStream()  # a deep copy of the model must not share the remembered tensor

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.value = None


class ApplyFinalNormAtExit:
    """Forward hook on the module whose output carries a shared stack's final stream out.

    Applies the final norm once, to the stream the shared last block produced on its last call.
    """

    def __init__(self, norm: nn.Module, tap: TapStream, stack: str):
        self.norm = norm
        self.tap = tap
        self.stack = stack

    def __call__(self, module, args, output):
        if bypassed():
            return None
        s, self.tap.value = self.tap.value, None
        if s is None:
            return None
        out = replace_stream(output, s, self.norm(s))
        if out is None:
            raise RuntimeError(
                f"ln_lightning: the final norm of stack {self.stack} could not be applied: this forward returned the "
                "stack's output in a different place than when the model was converted. Convert with an example_input "
                "that takes the same path, or convert with final_norm=False."
            )
        return out


class ApplyFinalNormAtConsumer:
    """Forward pre-hook on the module that reads a shared stack's final stream (a head): the final norm
    is applied to that argument, once, after the shared last block's last run."""

    def __init__(self, norm: nn.Module, tap: TapStream, stack: str):
        self.norm = norm
        self.tap = tap
        self.stack = stack

    def __call__(self, module, args, kwargs):
        if bypassed():
            return None
        s, self.tap.value = self.tap.value, None
        if s is None:
            return None
        hit = [i for i, a in enumerate(args) if a is s] + [k for k, v in kwargs.items() if v is s]
        if not hit:
            raise RuntimeError(
                f"ln_lightning: the final norm of stack {self.stack} could not be applied: {type(module).__name__} did not "
                "receive the stack's output in this forward as it did when the model was converted. Convert with an "
                "example_input that takes the same path, or convert with final_norm=False."
            )
        y = self.norm(s)
        args = tuple(y if a is s else a for a in args)
        kwargs = {k: (y if v is s else v) for k, v in kwargs.items()}
        return args, kwargs


OUR_HOOK_TYPES = (NormalizeBranchInput, NormalizeBranchOutput, ScaleBranchOutput, TagBranchValue, ApplyFinalNorm, TapStream,
                  ApplyFinalNormAtExit, ApplyFinalNormAtConsumer)


def remove_our_hooks(module: nn.Module, kind: type) -> int:
    """Remove this package's hooks of `kind` from `module`; returns how many."""
    n = 0
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, h in hooks.items() if isinstance(h, kind)]:
            del hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)
            getattr(module, "_forward_hooks_with_kwargs", {}).pop(key, None)
            getattr(module, "_forward_hooks_always_called", {}).pop(key, None)
            n += 1
    return n


def our_hooks(module: nn.Module) -> list:
    return [h for d in (module._forward_pre_hooks, module._forward_hooks) for h in d.values() if isinstance(h, OUR_HOOK_TYPES)]


@contextlib.contextmanager
def capture():
    """Record (kind, owner, tensor) at every entry/exit hook that fires in this block, in order."""
    old = getattr(_state, "capture", None)
    records: list = []
    _state.capture = records
    try:
        yield records
    finally:
        _state.capture = old
