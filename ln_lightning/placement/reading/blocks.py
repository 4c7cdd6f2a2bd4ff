"""Block handlers: how each kind of recognised block is described, rewritten, undone and checked.

* `TorchLayerHandler`: `nn.TransformerEncoderLayer` / `nn.TransformerDecoderLayer`. Their forward
  already implements both placements behind `norm_first`; we flip it.
* `HookedHandler`: any block whose forward computes `norm(x + branch(x))` with module calls (read by
  tracing, declared with `register_block`, or known, like Hugging Face's BERT layer). Rewritten with
  the hooks of `hooks.py`; the user's forward keeps running.

Every handler checks a converted block on a probe input against the formula it promises,
`s <- s + c * F(LN(s))` per sublayer, before `convert` reports it converted: torch's layers
against the formula written with their own submodules; hooked blocks twice, from a recorded
forward of the rewritten block (`checks.py`) and against their original modules run as black
boxes (`black_box.py`), which does not depend on what the recording sees.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ln_lightning.norm import kinds
from ln_lightning.placement import families
from ln_lightning.placement.checking import black_box
from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.reading.analysis import PARALLEL
from ln_lightning.placement.checking.checks import CheckFailed, SublayerCheck, check_hooked, relative_error
from ln_lightning.placement.rewrite.fused_layers import FUSED_CLASS, PLAIN_CLASS
from ln_lightning.placement.reading.norms import norm_width
from ln_lightning.placement.rewrite.sublayer_plan import RewritePlan, Unrecognised
from ln_lightning.placement.report import BlockInfo, SublayerInfo
from ln_lightning.placement.rewrite.scale import BranchScale, InputScale, depth_scale, layerscale_init_for_depth

# On a block rewritten to DeepNorm (placement/rewrite/deepnorm.py, which imports this module): what its undo divides back.
_DEEPNORM = "_ln_lightning_deepnorm"
# On a branch_scale="stream" BranchScale (pre), added output norm (peri) or InputScale (output): the norm whose stream
# its branch reads.
STREAM_SITE_ATTR = "ln_lightning_stream_site"
# On the (deferred) norm of a post-norm sublayer that was converted to pre-norm without the branch_scale="stream" it
# was asked for (`ScaleFactory.without_scale`): its index among the block's sublayers. A stream-scaled transition
# measures that norm as a site with no scale of its own (placement/migrate/blend.py).
UNSCALED_SITE_ATTR = "ln_lightning_unscaled_site"


class ScaleFactory:
    """Makes the BranchScale for one sublayer, or None (no scaling)."""

    def __init__(self, kind, depth: int, layerscale_init: float | None):
        self.kind = kind
        self.unscaled_sites = False  # (see without_scale)
        if kind is None:
            self.value = None
        elif kind == "depth":
            self.value = depth_scale(depth)
        elif kind == "layerscale":
            self.value = layerscale_init if layerscale_init is not None else layerscale_init_for_depth(depth)
        elif kind == "stream":
            self.value = 1.0  # until a transition measures it (placement/migrate/blend.py: the stream-scaled blend)
        else:
            self.value = float(kind)

    def without_scale(self) -> "ScaleFactory":
        """No scaling, for a block whose branches can't take this one's scale (the plain form). In place of a
        branch_scale="stream" it marks the block's norms as sites without a scale (UNSCALED_SITE_ATTR)."""
        plain = ScaleFactory(None, 1, None)
        plain.unscaled_sites = self.kind == "stream"
        return plain

    def __call__(self, norm: nn.Module) -> BranchScale | None:
        if self.kind is None:
            return None

        w = next(iter(norm.parameters()), None)
        dim = norm_width(norm)
        device = w.device if w is not None else None
        dtype = w.dtype if w is not None else None
        scale = BranchScale(self.value, dim=dim, learnable=self.kind == "layerscale", device=device, dtype=dtype,
                            measured=self.kind == "stream")
        if self.kind == "stream":
            # The site whose stream this branch reads: the transition measures the scale there. An instance
            # attribute, not a submodule (no state_dict key, no second path to the norm; a copy of the norm, as
            # an added final norm is, carries nothing of it).
            scale.__dict__[STREAM_SITE_ATTR] = norm
        return scale


def required_as_none(block: nn.Module) -> dict:
    """None for each argument of the block's forward after the stream that has no default (Pegasus'
    encoder layer requires `attention_mask`, which may be None): a probe passes only the stream."""
    try:
        params = list(inspect.signature(block.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    return {p.name: None for p in params
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _scale_value(scale: nn.Module | None):
    return 1.0 if scale is None else scale.value().detach().double()


class Handler:
    recogniser = ""

    def __init__(self, block: nn.Module, path: str):
        self.block = block
        self.path = path

    # -- description --------------------------------------------------------------------------
    def sublayers(self) -> list[SublayerInfo]:
        raise NotImplementedError

    def info(self) -> BlockInfo:
        subs = self.sublayers()
        if _DEEPNORM in self.block.__dict__:  # post-norm with DeepNorm's alpha (placement/rewrite/deepnorm.py)
            subs = [dataclasses.replace(s, placement="deepnorm") for s in subs]
        return BlockInfo(self.path, type(self.block).__name__, self.recogniser, subs)

    def norms(self) -> list[nn.Module]:
        raise NotImplementedError

    def output_norm(self) -> nn.Module | None:
        """The norm that produced the block's output when post-norm (used to initialise a final norm)."""
        return self.norms()[-1]

    def stream_dim(self) -> int:
        return self.norms()[0].normalized_shape[-1]

    def probe_args(self, x: torch.Tensor) -> tuple[tuple, dict]:
        return (x,), required_as_none(self.block)

    # -- rewriting ------------------------------------------------------------------------------
    def can_convert_to(self, placement: str, scales=None) -> str | None:
        """None if possible, else the reason."""
        return None

    def scale_refusal(self, placement: str, scales) -> str | None:
        """Why the block can be rewritten to `placement` but not with the branch scale `scales` (None: it can).
        convert then rewrites it without the scale, and says so (BlockChange.fallback)."""
        return None

    def as_written(self) -> bool:
        """Whether the block computes the placement its forward is written in (no rewrite of ours on it).
        A transition blends from the placement as written, so it needs this (torch layers: always)."""
        return True

    def to(self, placement: str, scales: ScaleFactory) -> tuple[list[str], list[str]]:
        """Rewrite to `placement`: (paths added, paths removed)."""
        if placement == "pre":
            return self.to_pre(scales), []
        if placement == "post":
            return [], self.to_post()
        raise Unrecognised(f"{type(self.block).__name__} can't be rewritten to {placement}-norm")

    def to_pre(self, scales: ScaleFactory) -> list[str]:
        raise NotImplementedError

    def to_post(self) -> list[str]:
        raise NotImplementedError

    def check(self, args: tuple, kwargs: dict, placement: str) -> tuple[float, object]:
        """(relative error of the block's output against its formula, the output)."""
        raise NotImplementedError

    def reference_error(self, args: tuple, kwargs: dict, output) -> tuple[float, float] | None:
        """(relative error of `output`, the rewritten block's on these arguments, against the block's
        original modules run as black boxes (`black_box.py`), the reference's own rounding bound);
        None where the handler's own check is already independent of any recording (torch's layers)."""
        return None

    def _add_scale(self, name: str, scale: BranchScale) -> str:
        if hasattr(self.block, name):
            raise Unrecognised(f"block already has an attribute {name!r}; cannot add a branch scale there")
        self.block.add_module(name, scale)
        return f"{self.path}.{name}" if self.path else name

    def _remove_scale(self, name: str) -> str | None:
        if name in self.block._modules and isinstance(self.block._modules[name], BranchScale):
            del self.block._modules[name]
            return f"{self.path}.{name}" if self.path else name
        return None


# ---------------------------------------------------------------------------------------------
# torch.nn.TransformerEncoderLayer / TransformerDecoderLayer
# ---------------------------------------------------------------------------------------------


class TorchLayerHandler(Handler):
    def __init__(self, block, path):
        super().__init__(block, path)
        self.decoder = isinstance(block, nn.TransformerDecoderLayer)
        self.recogniser = f"torch.{type(block).__name__}" if type(block) in (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer) else "torch transformer layer"
        # (name, norm, dropout at the branch's end)
        if self.decoder:
            self.parts = [("self_attn", "norm1", "dropout1"), ("cross_attn", "norm2", "dropout2"), ("ff", "norm3", "dropout3")]
        else:
            self.parts = [("self_attn", "norm1", "dropout1"), ("ff", "norm2", "dropout2")]

    def sublayers(self):
        p = "pre" if self.block.norm_first else "post"
        branches = {"self_attn": "self_attn", "cross_attn": "multihead_attn", "ff": "linear1 > activation > linear2"}
        return [SublayerInfo(n, p, f"{self.path}.{norm}", branches[n]) for n, norm, _ in self.parts]

    def norms(self):
        return [getattr(self.block, norm) for _, norm, _ in self.parts]

    def can_convert_to(self, placement, scales=None):
        if placement in ("pre", "post"):
            return None
        return f"torch's Transformer layers implement pre and post only (norm_first); {placement}-norm would need their forward rewritten"

    def probe_args(self, x):
        if self.decoder:
            return (x, x.flip(0).contiguous()), {}
        return (x,), {}

    def _scale_name(self, name):
        return f"{name}_scale"

    def to_pre(self, scales):
        added = []
        if scales.kind is not None:
            for name, norm, drop in self.parts:
                scale = scales(getattr(self.block, norm))
                added.append(self._add_scale(self._scale_name(name), scale))
                # A hook on the module disables torch's eval fast path, which would skip the scale.
                getattr(self.block, drop).register_forward_hook(hooks.ScaleBranchOutput(scale, None))
        self.block.norm_first = True

        # Exact torch layers switch to the subclass that can fuse the stream's add into the next norm.
        if type(self.block) in FUSED_CLASS:
            self.block.__class__ = FUSED_CLASS[type(self.block)]
        return added

    def to_post(self):
        removed = []
        for name, _, drop in self.parts:
            hooks.remove_our_hooks(getattr(self.block, drop), hooks.ScaleBranchOutput)
            r = self._remove_scale(self._scale_name(name))
            if r:
                removed.append(r)
        self.block.norm_first = False

        if type(self.block) in PLAIN_CLASS:
            self.block.__class__ = PLAIN_CLASS[type(self.block)]
        return removed

    def check(self, args, kwargs, placement):
        """The layer's output against its formula written out with its own submodules."""
        layer = self.block
        bound = inspect.signature(layer.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        x = args[0]
        with hooks.bypass():
            if self.decoder:
                mem = a["memory"]

                def sa(z):
                    return layer.dropout1(layer.self_attn(z, z, z, attn_mask=a["tgt_mask"], key_padding_mask=a["tgt_key_padding_mask"], need_weights=False, is_causal=a["tgt_is_causal"])[0])

                def ca(z):
                    return layer.dropout2(layer.multihead_attn(z, mem, mem, attn_mask=a["memory_mask"], key_padding_mask=a["memory_key_padding_mask"], need_weights=False, is_causal=a["memory_is_causal"])[0])

                def ff(z):
                    return layer.dropout3(layer.linear2(layer.dropout(layer.activation(layer.linear1(z)))))

                fns = [sa, ca, ff]
            else:

                def sa(z):
                    return layer.dropout1(layer.self_attn(z, z, z, attn_mask=a["src_mask"], key_padding_mask=a["src_key_padding_mask"], need_weights=False, is_causal=a["is_causal"])[0])

                def ff(z):
                    return layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(z)))))

                fns = [sa, ff]
            s = x
            for (name, norm, _), f in zip(self.parts, fns):
                scale = getattr(layer, self._scale_name(name), None)
                n = getattr(layer, norm)
                if placement == "pre":
                    b = f(n(s))
                    s = s + (b if scale is None else scale(b))
                else:
                    s = n(s + f(s))
        out = layer(*args, **kwargs)
        return relative_error(out, s), out


# ---------------------------------------------------------------------------------------------
# Hook-rewritten blocks (traced, registered, Hugging Face BERT family)
# ---------------------------------------------------------------------------------------------


@dataclass
class HookedSublayer:
    name: str
    written: str  # placement as the forward computes it: post | pre | peri | output | none
    norm: str | None
    branch: str  # for the report
    plan: RewritePlan | None
    reason: str = ""  # why it cannot be rewritten (when plan is None)
    out_norm: str | None = None  # peri / output: the norm on the branch's output
    stream: int = 0  # which of the block's streams (HookedHandler.streams) it is on
    parallel: bool = False  # parallel branches summed into the stream at once (analysis.PARALLEL)


@dataclass
class Stream:
    """A residual stream a block carries (LiLT's blocks carry two: text and layout)."""

    label: str  # the block's argument that carries it, for the reader
    enters: tuple | None  # ("arg", i) | ("kwarg", name) | ("module", path): a submodule's output (XLM); None: the first argument
    leaves: tuple | None  # where in the block's output; None: its stream element (`hooks.stream_of`)


PRIMARY = Stream("stream", None, None)


_STATE = "_ln_lightning_sublayers"  # on a rewritten block: each sublayer's placement now
_ADDED = "_ln_lightning_added"  # on a rewritten block: the child modules the rewrite added

# (placement as written, placement asked for) -> what the rewrite does; anything else is refused.
_MOVES = {
    ("post", "pre"): "the norm moves to the branch input",
    ("post", "peri"): "the norm moves to the branch input, an output norm is added",
    ("post", "output"): "the norm moves to the branch output",
    ("pre", "peri"): "an output norm is added",
    ("pre", "output"): "the input norm moves to the branch output",
    ("peri", "pre"): "the output norm is removed (passed through)",
    ("peri", "output"): "the input norm is removed (passed through)",
}


class HookedHandler(Handler):
    def __init__(self, block, path, subs: list[HookedSublayer], recogniser: str, streams: list[Stream] | None = None):
        super().__init__(block, path)
        self.subs = subs
        self.recogniser = recogniser
        self.streams = streams or [PRIMARY]

    def _get(self, rel: str) -> nn.Module:
        return self.block.get_submodule(rel) if rel else self.block

    def _full(self, rel: str | None) -> str | None:
        if rel is None:
            return None
        return f"{self.path}.{rel}" if self.path else rel

    def _current(self, i: int, sub: HookedSublayer) -> str:
        state = self.block.__dict__.get(_STATE)
        if state is not None:
            return state[i]
        return sub.written

    def sublayers(self):
        return [SublayerInfo(s.name, self._current(i, s), self._full(s.norm), s.branch, s.parallel,
                             self.streams[s.stream].label if len(self.streams) > 1 else None)
                for i, s in enumerate(self.subs)]

    def as_written(self) -> bool:
        return _STATE not in self.block.__dict__

    def norms(self):
        return [self._get(s.norm) for s in self.subs if s.norm is not None]

    def output_norm(self):
        last = [s for s in self.subs if s.stream == 0][-1]  # the stack's stream is the first one
        return self._get(last.norm) if last.norm is not None and last.written == "post" else None

    def stream_dim(self) -> int:
        width = norm_width(self.norms()[0])
        if width is None:
            raise Unrecognised(f"could not tell the stream's width from the norm {self.subs[0].norm}")
        return width

    def _scale_name(self, sub: HookedSublayer) -> str:
        return f"{sub.name.replace('.', '_')}_scale"

    def _out_norm_name(self, sub: HookedSublayer) -> str:
        return f"{sub.name.replace('.', '_')}_out_norm"

    def _in_scale_name(self, sub: HookedSublayer) -> str:
        return f"{sub.name.replace('.', '_')}_in_scale"

    def can_convert_to(self, placement, scales: ScaleFactory | None = None):
        reason = self._refusal(placement, scales)
        if reason and len(self.streams) > 1:
            return f"{reason} (the block carries {len(self.streams)} streams, {', '.join(s.label for s in self.streams)}: all are converted or none)"
        return reason

    def _refusal(self, placement, scales: ScaleFactory | None = None):
        for s in self.subs:
            where = f"stream {self.streams[s.stream].label}: " if len(self.streams) > 1 else ""
            if s.written == placement:
                continue
            if s.parallel and placement in ("peri", "output"):
                return where + PARALLEL
            if placement == "post":
                return (
                    f"the block is written as {s.written}-norm in its own forward; ln_lightning moves norms with hooks "
                    "and can only undo its own rewrite"
                )
            if (s.written, placement) not in _MOVES:
                shown = "peri (sandwich)" if s.written == "peri" else s.written
                if placement == "pre":
                    return f"its sublayers are written as {shown}; only post-norm (and peri) sublayers can be moved to pre-norm"
                return f"a sublayer written as {shown}-norm can't be made {placement}-norm"
            if s.plan is None:
                return where + (s.reason or f"sublayer {s.name}: no plan for the rewrite")
            if placement in ("peri", "output") and s.written in ("post", "pre") and s.plan.exit_module is None:
                return f"sublayer {s.name}: {s.plan.exit_reason}, so there is no module whose output can be normalised"
        return self.scale_refusal(placement, scales)

    def scale_refusal(self, placement, scales: ScaleFactory | None) -> str | None:
        """Why the block, which can be rewritten to `placement`, can't take the branch scale `scales` (None if it can):
        a sublayer whose branch ends in no module call a hook can scale."""
        if scales is None or scales.kind is None or placement != "pre":
            return None
        for s in self.subs:
            if s.written != placement and s.plan is not None and s.plan.exit_module is None:
                where = f"stream {self.streams[s.stream].label}: " if len(self.streams) > 1 else ""
                return f"{where}cannot scale sublayer {s.name}: {s.plan.exit_reason}"
        return None

    # -- rewriting ------------------------------------------------------------------------------
    def _undo(self) -> list[str]:
        """Back to the block as written: every hook, deferral and module of ours goes."""
        removed = []
        for m in self.block.modules():
            for kind in (hooks.NormalizeBranchInput, hooks.ScaleBranchOutput, hooks.NormalizeBranchOutput, hooks.TagBranchValue):
                hooks.remove_our_hooks(m, kind)
            hooks.undefer_norm(m)
            m.__dict__.pop(UNSCALED_SITE_ATTR, None)
        for name in self.block.__dict__.pop(_ADDED, []):
            if name in self.block._modules:
                del self.block._modules[name]
                removed.append(self._full(name))
        self.block.__dict__.pop(_STATE, None)
        return removed

    def _add(self, name: str, module: nn.Module) -> str:
        if hasattr(self.block, name):
            raise Unrecognised(f"block already has an attribute {name!r}; cannot add {type(module).__name__} there")
        self.block.add_module(name, module)
        self.block.__dict__.setdefault(_ADDED, []).append(name)
        return self._full(name)

    def to(self, placement: str, scales: ScaleFactory) -> tuple[list[str], list[str]]:
        """Rewrite to `placement` (from whatever our last rewrite was): (paths added, paths removed)."""
        removed = self._undo()
        added: list[str] = []
        state = []
        for i, s in enumerate(self.subs):
            target = s.written if placement == "post" else placement
            state.append(target)
            if target == s.written:
                continue
            p = s.plan
            if (s.written, target) == ("peri", "pre"):
                hooks.defer_norm(self._get(s.out_norm))
                continue
            if (s.written, target) == ("peri", "output"):
                hooks.defer_norm(self._get(s.norm))
                continue
            norm = self._get(s.norm)
            if target in ("pre", "peri") and s.written == "post":
                for e in p.entries:
                    self._get(e.module).register_forward_pre_hook(hooks.NormalizeBranchInput(norm, e.arg_positions, e.kwarg_names), with_kwargs=True)
                hooks.defer_norm(norm)
            if target == "peri":
                out = fresh_norm_like(norm)
                if scales.kind == "stream" and s.written == "post":
                    # The stream-scaled transition to peri (placement/migrate/blend.py) measures this norm's gain: the
                    # stream's constant C_k there times the trained branch output's spread.
                    out.__dict__[STREAM_SITE_ATTR] = norm
                added.append(self._add(self._out_norm_name(s), out))
                self._get(p.exit_module).register_forward_hook(hooks.NormalizeBranchOutput(out, p.exit_index, deferred=False, call=self._branch_call(p)))
            if target == "output":
                hooks.defer_norm(norm)
                self._get(p.exit_module).register_forward_hook(hooks.NormalizeBranchOutput(norm, p.exit_index, deferred=True, call=self._branch_call(p)))
                if scales.kind == "stream" and s.written == "post":
                    # The stream-scaled transition to output (placement/migrate/blend.py): the branch reads x / C_k, and the
                    # moved norm's gain becomes C_k times the trained branch output's spread.
                    w = next(iter(norm.parameters()), None)
                    entry = InputScale(1.0, device=None if w is None else w.device, dtype=None if w is None else w.dtype)
                    entry.__dict__[STREAM_SITE_ATTR] = norm
                    added.append(self._add(self._in_scale_name(s), entry))
                    for e in p.entries:
                        self._get(e.module).register_forward_pre_hook(hooks.NormalizeBranchInput(entry, e.arg_positions, e.kwarg_names), with_kwargs=True)
            scale = scales(norm) if target == "pre" else None
            if scale is not None:
                added.append(self._add(self._scale_name(s), scale))
                self._get(p.exit_module).register_forward_hook(hooks.ScaleBranchOutput(scale, p.exit_index, call=self._branch_call(p)))
            elif target == "pre" and s.written == "post" and scales.unscaled_sites:
                # Converted without the stream scale it was asked for (see ScaleFactory.without_scale): the transition
                # still measures this norm, whose division the later branches' scales must count.
                norm.__dict__[UNSCALED_SITE_ATTR] = i
        if state != [s.written for s in self.subs]:
            self.block.__dict__[_STATE] = state
        return added, removed

    def _branch_call(self, plan: RewritePlan) -> hooks.BranchCall | None:
        """Where the exit module ends other branches too: the tag on its feeder, and the selector for the exit's hooks."""
        c = plan.exit_call
        if c is None or plan.exit_module is None:
            return None
        tag = hooks.TagBranchValue(c.feeder_index)
        self._get(c.feeder).register_forward_hook(tag)
        return hooks.BranchCall(tag, c.arg)

    def to_pre(self, scales):
        return self.to("pre", scales)[0]

    def to_post(self):
        return self.to("post", ScaleFactory(None, 1, None))[1]

    def _undone(self, placement) -> bool:
        return placement == "post" or all(placement == s.written for s in self.subs)

    def check(self, args, kwargs, placement):
        if self._undone(placement):
            # Undoing our hooks must give back the user's own forward exactly: no hook of ours may be
            # left, and the output must equal the bypassed (original) function.
            left = [p for p, m in self.block.named_modules() if hooks.our_hooks(m) or hooks.is_deferred(m)]
            if left:
                raise CheckFailed(f"ln_lightning hooks are still attached at {', '.join(left)}")
            fresh = copy.deepcopy((args, kwargs))  # a KV cache among the arguments is written by each call
            out = self.block(*args, **kwargs)
            with hooks.bypass():
                return relative_error(hooks.stream_of(out), hooks.stream_of(self.block(*fresh[0], **fresh[1]))), out
        specs: list[list[SublayerCheck]] = [[] for _ in self.streams]
        for i, s in enumerate(self.subs):
            target = self._current(i, s)
            p = s.plan
            ours = s.written == "post" and target in ("pre", "peri")
            out_norm = self._get(self._out_norm_name(s)) if (target == "peri" and s.written != "peri") else None
            if target == "output" and s.written in ("post", "pre"):
                out_norm = self._get(s.norm)
            in_norm = self._get(s.norm) if ours else self._in_scale(s, target)
            specs[s.stream].append(SublayerCheck(
                entries=p.entries if in_norm is not None else [], in_norm=in_norm,
                exit_module=p.exit_module if p is not None else None, exit_index=p.exit_index if p is not None else None,
                exit_call=p.exit_call.number if p is not None and p.exit_call is not None else None,
                out_norm=out_norm, scale=getattr(self.block, self._scale_name(s), None),
                through=self._get(s.norm) if s.written == "post" else None,
            ))

        streams = [(None if st.enters is None or st.enters[0] == "module" else st.enters, st.leaves, sc)
                   for st, sc in zip(self.streams, specs)]
        return check_hooked(self.block, streams, args, kwargs, start=families.stream_start_fn(self.block))

    def reference_error(self, args, kwargs, output) -> float | None:
        if self.as_written():
            return None  # nothing of ours on it: `check` compared it with the original function itself
        refs = []
        for j, st in enumerate(self.streams):
            subs = [self._reference_sublayer(s, self._current(i, s)) for i, s in enumerate(self.subs) if s.stream == j]
            refs.append(black_box.ReferenceStream(st.enters or ("arg", 0), st.leaves, subs))
        expected = black_box.reference_outputs(self.block, refs, args, kwargs)
        err, bounds = 0.0, []
        for st, (want, bound) in zip(self.streams, expected):
            got = black_box.at(output, st.leaves)
            if got is None:
                raise CheckFailed(f"the rewritten block returned no {st.label} stream")
            err = max(err, relative_error(got, want))
            bounds.append(bound)
        return err, _MaxOf(bounds)

    def _in_scale(self, s: HookedSublayer, target: str) -> InputScale | None:
        """The stream-scaled output placement's entry scale of sublayer `s` (x / C_k), if it has one."""
        m = getattr(self.block, self._in_scale_name(s), None) if target == "output" and s.written == "post" else None
        return m if isinstance(m, InputScale) else None

    def _reference_sublayer(self, s: HookedSublayer, target: str) -> black_box.ReferenceSublayer:
        """What the target placement makes of sublayer `s`: the norm at its branch input, the norm on its
        branch output, its scale (see `_MOVES`), as paths inside the block."""
        if s.written not in ("post", "pre", "peri") or target not in ("pre", "peri", "output") or (s.written, target) == ("post", "post"):
            raise CheckFailed(f"sublayer {s.name}: no black-box reference for {s.written} -> {target}")
        into = s.norm if target in ("pre", "peri") else (self._in_scale_name(s) if self._in_scale(s, target) is not None else None)
        out = {
            "pre": None,
            "peri": s.out_norm if s.written == "peri" else self._out_norm_name(s),
            "output": s.out_norm if s.written == "peri" else s.norm,
        }[target]
        scale = self._scale_name(s) if isinstance(getattr(self.block, self._scale_name(s), None), nn.Module) else None
        return black_box.ReferenceSublayer(s.written, s.norm, s.out_norm if s.written == "peri" else None, into, out, scale)


class _MaxOf:
    """The largest of some lazily computed bounds: `float(...)` computes them."""

    def __init__(self, bounds):
        self.bounds = bounds

    def __float__(self) -> float:
        return max((float(b) for b in self.bounds), default=0.0)


def fresh_norm_like(norm: nn.Module) -> nn.Module:
    """A new norm of `norm`'s class, shape and eps, with the identity gain: weight 1 (0 where the class
    applies `1 + w`, Gemma's), bias 0. Peri-LN (Kim et al. 2025) starts its output norms there: each
    branch output enters the stream at unit root-mean-square per token, whatever the branch's scale."""
    out = copy.deepcopy(norm)
    hooks.undefer_norm(out)
    out._forward_hooks.clear()
    out._forward_pre_hooks.clear()
    spec = kinds.recognize_norm(out)
    with torch.no_grad():
        w, b = getattr(out, "weight", None), getattr(out, "bias", None)
        if isinstance(w, torch.Tensor):
            w.fill_(0.0 if spec is not None and spec.unit_offset else 1.0)
        if isinstance(b, torch.Tensor):
            b.zero_()
    return out
