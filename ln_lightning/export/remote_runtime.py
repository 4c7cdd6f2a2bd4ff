"""The converted function of a Hugging Face model ln_lightning rewrote, without ln_lightning: the remote code.

``ln_lightning.save_pretrained`` copies this file, followed by a few lines naming the saved model's classes, into
the model directory as ``ln_lightning_converted.py`` and points ``config.json``'s ``auto_map`` at it, so that

    AutoModelForMaskedLM.from_pretrained(directory, trust_remote_code=True)

builds the model's own Hugging Face class and re-installs, by module path, what the rewrite made of it: norms
passed through at their call sites and applied at their branch's entries, branch scales, output norms, the final
norms it added, the markers, and a transition's blend. What to install is data, written by ln_lightning from the
converted model's hooks (``config.ln_lightning["plan"]``, ``ln_lightning.export.plan``); the arithmetic below is
the same, operation for operation, as ``ln_lightning.placement.rewrite.hooks`` and ``.blend`` (a test compares the two in
a process where ln_lightning is not importable).

It imports torch and transformers only: whoever loads the directory needs nothing else.
"""

import copy
import json

import torch
from torch import nn

MESSAGE = (
    "ln_lightning: this directory holds a model that ln_lightning rewrote (its norm placement lives in hooks, not in the "
    "class's code), so the plain class would compute its old function with these weights. Load it with "
    "ln_lightning.from_pretrained(directory), or with the Auto class and trust_remote_code=True"
)
ENTRY = "ln_lightning"  # the config attribute (and config.json key) holding what ln_lightning wrote
TRANSITION = "ln_lightning_transition"
MARKER = "ln_lightning_placement"
SCHEDULES = ("linear", "cosine", "closed")


# --------------------------------------------------------------------------------------------- the blend
SITE = "_ln_lightning_site"  # on a stream-scaled site's norm: its index in the transition's scales
FINAL = "_ln_lightning_final"  # on an added final norm of a stream-scaled transition: its index
OUT = "_ln_lightning_site_out"  # on a stream-scaled peri output norm: the index of the site its branch reads
NORM_SCALE = "_ln_lightning_norm_scale"  # on a deferred norm with LayerNorm Scaling: the scale of its output


class Transition(nn.Module):
    """A transition's blend, where it stood when the model was saved (its buffers load with the weights); for the
    stream-scaled blend also the measured stream scales (per site: before and after it; per added final norm)."""

    def __init__(self, sites=0, finals=0):
        super().__init__()
        self.register_buffer("blend", torch.zeros((), dtype=torch.float32), persistent=True)
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.int64), persistent=True)
        self.register_buffer("schedule", torch.tensor([-1, 0], dtype=torch.int64), persistent=True)
        self.register_buffer("drift", torch.full((), -1.0, dtype=torch.float32), persistent=True)  # the closed loop's
        if sites:
            self.register_buffer("site_before", torch.ones(sites, dtype=torch.float32), persistent=True)
            self.register_buffer("site_after", torch.ones(sites, dtype=torch.float32), persistent=True)
            self.register_buffer("final_scale", torch.ones(finals, dtype=torch.float32), persistent=True)
            self.register_buffer("scales_state", torch.zeros((), dtype=torch.int64), persistent=True)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "drift" not in state_dict and prefix + "blend" in state_dict:  # saved before the closed loop
            state_dict[prefix + "drift"] = torch.full((), -1.0, dtype=torch.float32)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def a(self, like):
        return self.blend.to(like.dtype)

    def call_site(self, h, y, norm=None):
        a = self.a(h)
        slot = None if norm is None else norm.__dict__.get(SITE)
        if slot is None:
            return (1 - a) * y + a * h
        return (1 - a) * (_ramp(a, self.site_after[slot]) * y) + a * h

    def stream_divisor(self, norm, like):
        slot = norm.__dict__.get(SITE)
        return None if slot is None else _ramp(self.a(like), self.site_before[slot])

    def final_divisor(self, final, like):
        slot = final.__dict__.get(FINAL)
        return None if slot is None else _ramp(self.a(like), self.final_scale[slot])

    def branch_exit(self, norm, value, y):
        a = self.a(value)
        slot = norm.__dict__.get(OUT)
        if slot is None:
            return (1 - a) * value + a * y
        c = self.site_before[slot].to(a.dtype)
        d = _ramp(a, c)
        return (1 - a) * (d * value) + (a * d / c) * y


def _ramp(a, c):
    return (1 - a) + a * c.to(a.dtype)


def _mix(t, x, y):
    a = t.a(x)
    return (1 - a) * x + a * y


# --------------------------------------------------------------------------------------------- deferred norms
class DeferredNorm:
    """Mixin in front of a norm's class: its call site passes the stream through (blends, mid-transition)."""

    def forward(self, x, *args, **kwargs):
        t = self.__dict__.get(TRANSITION)
        if t is None:
            return x
        y = self.normalize(x) if not args and not kwargs else super().forward(x, *args, **kwargs)
        return t.call_site(x, y, self)

    def normalize(self, x):
        y = super().forward(x)
        scale = self.__dict__.get(NORM_SCALE)  # LayerNorm Scaling: where the norm really normalises
        return y if scale is None else scale(y)

    def __reduce_ex__(self, protocol):
        return _rebuild_deferred, (type(self).__mro__[2], self.__dict__)


_deferred_classes = {}


def _deferred_class(base):
    cls = _deferred_classes.get(base)
    if cls is None:
        cls = type(f"Deferred{base.__name__}", (DeferredNorm, base), {"__module__": __name__})
        _deferred_classes[base] = cls
    return cls


def _rebuild_deferred(base, state):
    cls = _deferred_class(base)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def defer(norm, transition):
    norm.__class__ = _deferred_class(type(norm))
    if transition is not None:
        norm.__dict__[TRANSITION] = transition


# --------------------------------------------------------------------------------------------- hooks
def _with_branch_value(output, index, value):
    if index is None:
        return value
    out = list(output)
    out[index] = value
    return type(output)(out) if isinstance(output, tuple) else out


def stream_of(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, dict) and output:
        first = next(iter(output.values()))
        return first if isinstance(first, torch.Tensor) else None
    return None


def replace_stream(output, stream, new):
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
                output[k] = new
                return output
    return None


class NormalizeBranchInput:
    """Pre-hook (with kwargs) on a branch entry: the stream arguments get the norm (blended: (1-a)x + a N(x))."""

    def __init__(self, norm, arg_positions, kwarg_names, transition):
        self.norm, self.arg_positions, self.kwarg_names, self.transition = norm, tuple(arg_positions), tuple(kwarg_names), transition

    def __call__(self, module, args, kwargs):
        cache = {}

        def norm_of(t):
            key = id(t)
            if key not in cache:
                y = self.norm.normalize(t)
                if self.transition is None:
                    cache[key] = y
                else:
                    d = self.transition.stream_divisor(self.norm, t)
                    cache[key] = _mix(self.transition, t if d is None else t / d, y)
            return cache[key]

        args = list(args)
        for i in self.arg_positions:
            if i < len(args):
                args[i] = norm_of(args[i])
        kwargs = dict(kwargs)
        for k in self.kwarg_names:
            if k in kwargs:
                kwargs[k] = norm_of(kwargs[k])
        return tuple(args), kwargs


class ScaleNormOutput:
    """Hook on a norm the model's own forward calls (pre-norm as built): its output times the LayerNorm Scaling scale."""

    def __init__(self, scale):
        self.scale = scale

    def __call__(self, module, args, output):
        return self.scale(output)


class NormalizeBranchOutput:
    """Hook on a branch exit: its value gets a norm (its own deferred one, or one the rewrite added)."""

    def __init__(self, norm, index, deferred, transition):
        self.norm, self.index, self.deferred, self.transition = norm, index, deferred, transition

    def __call__(self, module, args, output):
        value = output if self.index is None else output[self.index]
        y = self.norm.normalize(value) if self.deferred else self.norm(value)
        if self.transition is not None:
            y = self.transition.branch_exit(self.norm, value, y)
        return _with_branch_value(output, self.index, y)


class ScaleBranchOutput:
    """Hook on a branch exit: its value times the branch scale (ramping from 1, mid-transition)."""

    def __init__(self, scale, index, transition):
        self.scale, self.index, self.transition = scale, index, transition

    def __call__(self, module, args, output):
        value = output if self.index is None else output[self.index]
        y = self.scale(value)
        if self.transition is not None:
            y = _mix(self.transition, value, y)
        return _with_branch_value(output, self.index, y)


class ApplyFinalNorm:
    def __init__(self, norm):
        self.norm = norm

    def __call__(self, module, args, output):
        s = stream_of(output)
        return replace_stream(output, s, self.norm(s))


class BlendFinalNorm:
    """Hook on a final norm the rewrite added, mid-transition: (1-a) s + a N(s)."""

    def __init__(self, transition):
        self.transition = transition

    def __call__(self, module, args, output):
        s, d = args[0], self.transition.final_divisor(module, args[0])
        return _mix(self.transition, s if d is None else s / d, output)


class TapStream:
    """Hook on a shared last block (run several times a forward): remembers its latest stream."""

    def __init__(self):
        self.value = None

    def __call__(self, module, args, output):
        self.value = stream_of(output)

    def __deepcopy__(self, memo):
        return TapStream()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.value = None


class ApplyFinalNormAtExit:
    def __init__(self, norm, tap, stack):
        self.norm, self.tap, self.stack = norm, tap, stack

    def __call__(self, module, args, output):
        s, self.tap.value = self.tap.value, None
        if s is None:
            return None
        out = replace_stream(output, s, self.norm(s))
        if out is None:
            raise RuntimeError(f"ln_lightning remote code: the final norm of {self.stack} could not be applied in this forward")
        return out


class ApplyFinalNormAtConsumer:
    def __init__(self, norm, tap, stack):
        self.norm, self.tap, self.stack = norm, tap, stack

    def __call__(self, module, args, kwargs):
        s, self.tap.value = self.tap.value, None
        if s is None:
            return None
        if not any(a is s for a in args) and not any(v is s for v in kwargs.values()):
            raise RuntimeError(f"ln_lightning remote code: the final norm of {self.stack} could not be applied in this forward")
        y = self.norm(s)
        return tuple(y if a is s else a for a in args), {k: (y if v is s else v) for k, v in kwargs.items()}


class BranchScale(nn.Module):
    """A branch scale the rewrite added: a constant `c`, or LayerScale's learnable `gamma` (state_dict: `gamma`)."""

    def __init__(self, value, dim, learnable):
        super().__init__()
        self.learnable = learnable
        if learnable:
            self.gamma = nn.Parameter(torch.full((dim,), float(value)))
        else:
            self.c = float(value)

    def forward(self, x):
        return x * (self.gamma if self.learnable else self.c)


class InputScale(nn.Module):
    """A branch entry's stream scale the rewrite added (output placement, stream-scaled): the branch reads x / c."""

    def __init__(self, value):
        super().__init__()
        self.c = float(value)

    def forward(self, x):
        return x / self.c

    def normalize(self, x):  # what the entry hook calls, as a norm's
        return self.forward(x)


# --------------------------------------------------------------------------------------------- installing a plan
def _get(model, path):
    return model.get_submodule(path) if path else model


def _set(model, path, module):
    parent, _, name = path.rpartition(".")
    _get(model, parent).add_module(name, module)


def _added_module(model, spec):
    kind = spec["kind"]
    if kind == "layer_norm":
        return nn.LayerNorm(spec["shape"], eps=spec["eps"], elementwise_affine=spec["affine"], bias=spec["bias"])
    if kind == "rms_norm":
        return nn.RMSNorm(spec["shape"], eps=spec["eps"], elementwise_affine=spec["affine"])
    if kind == "branch_scale":
        return BranchScale(spec["value"], spec["dim"], spec["learnable"])
    if kind == "input_scale":
        return InputScale(spec["value"])
    if kind == "copy":  # a norm of the model's own class, as the one it was derived from (its weights load)
        m = copy.deepcopy(_get(model, spec["of"]))
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
        return m
    raise ValueError(f"ln_lightning remote code: unknown added module kind {kind!r}; upgrade the remote code")


def install(model, plan):
    """Make `model` (just built by its Hugging Face class) compute what the rewrite described by `plan` computes."""
    transition = None
    stream = {"sites": [], "finals": [], "outs": [], **(plan.get("stream") or {})}
    if plan.get("transition"):
        transition = Transition(len(stream["sites"]), len(stream["finals"]))
        model.add_module(TRANSITION, transition)
    for path, spec in plan["added"]:
        _set(model, path, _added_module(model, spec))
    for path, slot in stream["sites"]:
        _get(model, path).__dict__[SITE] = slot
    for path, slot in stream["finals"]:
        _get(model, path).__dict__[FINAL] = slot
    for path, slot in stream["outs"]:
        _get(model, path).__dict__[OUT] = slot
    for owner, size in plan["markers"]:
        _get(model, owner).register_buffer(MARKER, torch.zeros(size, dtype=torch.uint8), persistent=True)
    for path, blended in plan["deferred"]:
        defer(_get(model, path), transition if blended else None)
    taps = {}  # a shared stack's tap, by number (its final norm's hook may come first)
    for h in plan["hooks"]:
        module, kind = _get(model, h["at"]), h["type"]
        t = transition if h.get("blend") else None
        if kind == "entry":
            module.register_forward_pre_hook(NormalizeBranchInput(_get(model, h["norm"]), h["args"], h["kwargs"], t), with_kwargs=True)
        elif kind == "exit_norm":
            module.register_forward_hook(NormalizeBranchOutput(_get(model, h["norm"]), h["index"], h["deferred"], t))
        elif kind == "exit_scale":
            module.register_forward_hook(ScaleBranchOutput(_get(model, h["scale"]), h["index"], t))
        elif kind == "final":
            module.register_forward_hook(ApplyFinalNorm(_get(model, h["norm"])))
        elif kind == "final_blend":
            module.register_forward_hook(BlendFinalNorm(transition))
        elif kind == "tap":
            module.register_forward_hook(taps.setdefault(h["tap"], TapStream()))
        elif kind == "final_at_exit":
            module.register_forward_hook(ApplyFinalNormAtExit(_get(model, h["norm"]), taps.setdefault(h["tap"], TapStream()), h["stack"]))
        elif kind == "final_at_consumer":
            module.register_forward_pre_hook(ApplyFinalNormAtConsumer(_get(model, h["norm"]), taps.setdefault(h["tap"], TapStream()), h["stack"]), with_kwargs=True)
        elif kind == "norm_scale":  # LayerNorm Scaling: a deferred norm scales where it normalises, another where called
            if isinstance(module, DeferredNorm):
                module.__dict__[NORM_SCALE] = _get(model, h["scale"])
            else:
                module.register_forward_hook(ScaleNormOutput(_get(model, h["scale"])))
        else:
            raise ValueError(f"ln_lightning remote code: unknown hook kind {kind!r}; upgrade the remote code")
    return model


# --------------------------------------------------------------------------------------------- the classes
class ConvertedConfig:
    """Mixin in front of the model's config class. config.json holds MESSAGE in place of a few values (`held`) so
    that the plain class refuses it; this class reads them back, and writes MESSAGE there again when saved."""

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        config_dict = dict(config_dict)
        config_dict.update(config_dict.get(ENTRY, {}).get("held", {}))
        return super().from_dict(config_dict, **kwargs)

    def to_json_string(self, use_diff=True):
        data = json.loads(super().to_json_string(use_diff))
        for key in data.get(ENTRY, {}).get("held", {}):
            data[key] = MESSAGE
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


class ConvertedModel:
    """Mixin in front of the model's class: built, then rewritten as the plan says."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        install(self, getattr(config, ENTRY)["plan"])
