"""Finding the stacks of residual blocks in a model, and a handler for each block.

Candidates are found by structure: the children of a ModuleList / Sequential / ModuleDict that
hold a norm (and torch's own Transformer layers). Whether a candidate is a residual block, and
what its sublayers are, is then read from what it does: one recorded forward of the whole model
on its example input (so every block runs with its real arguments, and we see how often each
block runs and which norms are called outside their block), or, without an example input, one
recorded call of each block on a probe tensor. Per-family knowledge that observation can't
replace lives in `families/`, one file per family.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ln_lightning.placement import families
from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.reading.analysis import analyse, stream_input, stream_input_at, stream_output, stream_output_at
from ln_lightning.placement.reading.blocks import Handler, HookedHandler, HookedSublayer, Stream, TorchLayerHandler, required_as_none
from ln_lightning.placement.reading.norms import FINAL_NORM_MARKER, norm_types, norm_width
from ln_lightning.placement.rewrite.sublayer_plan import EntryPlan, RewritePlan, Unrecognised
from ln_lightning.placement.reading.recording import Recording, record
from ln_lightning.placement.reading.registry import registered_sublayers
from ln_lightning.placement.report import SkippedModule

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


@dataclass
class Stack:
    path: str  # the container's path ("" when the model itself is the container)
    container: nn.Module
    handlers: list[Handler]
    final_norm: str | None = None
    final_known: bool = True
    final_detail: str = ""
    continues_into: str | None = None  # a block that takes this stack's output as its stream


@dataclass
class Found:
    stacks: list[Stack] = field(default_factory=list)
    unrecognised: list[SkippedModule] = field(default_factory=list)
    observation: "ModelRun | None" = None
    notes: list[str] = field(default_factory=list)  # what the report should say about how the model was read

    @property
    def handlers(self) -> list[Handler]:
        return [h for s in self.stacks for h in s.handlers]


@dataclass
class Example:
    """An input to run the model on: `value` for the module at `path` ("" is the model itself)."""

    value: Any
    path: str = ""
    made_up: bool = False
    fallbacks: list = field(default_factory=list)  # made up: other modules to try, in order
    source: str = "argument"  # "argument" | "example_input_array" | "dummy_inputs" (Hugging Face's) | "made up"

    def run(self, model: nn.Module):
        return run_model(model.get_submodule(self.path) if self.path else model, self.value)


@dataclass
class ModelRun:
    """One recorded forward of the whole model (original function: our hooks bypassed)."""

    rec: Recording
    output: Any
    inputs: dict  # id(block) -> (args, kwargs) of its first call

    def block_output(self, block: nn.Module):
        """The stream a block returned on its first call."""
        calls = self.rec.module_calls(block)
        v = stream_output(calls[0]) if calls else None
        return None if v is None else self.rec.values[v].tensor


def _contains_norm(m: nn.Module) -> bool:
    types = norm_types()
    return any(isinstance(x, types) for x in m.modules())


def norm_holders(root: nn.Module) -> set[int]:
    """Ids of the modules under `root` (itself included) that hold a norm: one walk, not one per question."""
    return holders_of(root, norm_types())


def holders_of(root: nn.Module, types) -> set[int]:
    """Ids of the modules under `root` (itself included) that hold a module of `types`, in one walk."""
    out = set()

    def walk(m: nn.Module) -> bool:
        has = isinstance(m, types)
        for c in m.children():
            has = walk(c) or has
        if has:
            out.add(id(m))
        return has

    walk(root)
    return out


def run_model(model: nn.Module, example: Any):
    if isinstance(example, dict):
        return model(**example)
    if isinstance(example, (tuple, list)):
        return model(*example)
    return model(example)


def observe_model(model: nn.Module, example: Example, holders: set[int] | None = None) -> ModelRun:
    """Run the model once on `example` (eval, no grad, our hooks bypassed), recording everything; the
    arguments of each module's first call are kept (of the modules in `holders` only, when given: a
    block holds a norm; never of a norm itself, which is never a block)."""
    inputs: dict = {}
    target = model.get_submodule(example.path) if example.path else model

    def capture(mod, args, kwargs):
        if id(mod) not in inputs:
            # The arguments as they are at the call: a KV cache among them fills up as the forward goes
            # on, so it is copied now (tensors passed directly are shared, not copied).
            memo = {id(v): v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)}
            inputs[id(mod)] = copy.deepcopy((tuple(args), dict(kwargs)), memo)

    types = norm_types()
    handles = [m.register_forward_pre_hook(capture, with_kwargs=True, prepend=True) for m in target.modules()
               if (holders is None or id(m) in holders) and not isinstance(m, types)]
    try:
        with eval_no_grad(model), hooks.bypass(), record(target, example.path) as rec:
            out = run_model(target, example.value)
    finally:
        for h in handles:
            h.remove()
    return ModelRun(rec, out, inputs)


class eval_no_grad:
    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.modes = [(m, m.training) for m in self.model.modules()]
        # nn.Module.__setattr__ on every module of a deep model is not free: the flag is written directly,
        # unless a module has its own train() (then eval() runs, which calls it).
        self.plain = all(type(m).train is nn.Module.train for m, _ in self.modes)
        if not self.plain:
            self.model.eval()
        else:
            for m, t in self.modes:
                if t:
                    m.__dict__["training"] = False
        self.grad = torch.no_grad()
        self.grad.__enter__()

    def __exit__(self, *exc):
        self.grad.__exit__(*exc)
        for m, t in self.modes:
            if m.training != t:
                if self.plain:
                    m.__dict__["training"] = t
                else:
                    m.training = t


def synthetic_probe(block: nn.Module, dim: int) -> tuple[tuple, dict]:
    w = next(iter(block.parameters()))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, dim, generator=g, dtype=torch.float64)
    # An offset and a non-unit scale, so a misplaced norm can't go unnoticed.
    return ((3.0 * x + 0.5).to(device=w.device, dtype=w.dtype),), required_as_none(block)


def _stream_dim(block: nn.Module) -> int:
    for m in block.modules():
        if isinstance(m, norm_types()):
            width = norm_width(m)
            if width is not None:
                return width
    raise Unrecognised("could not tell the stream's width from the block's norms")


def _relative(path: str | None, block_path: str) -> str | None:
    if path is None or not block_path:
        return path
    if path == block_path:
        return ""
    return path[len(block_path) + 1:] if path.startswith(block_path + ".") else path


def _argument_name(block: nn.Module, where: tuple | None) -> str:
    if where is None:
        return "stream"
    if where[0] == "kwarg":
        return str(where[1])
    try:
        params = [p for p in inspect.signature(block.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return params[where[1]].name
    except (TypeError, ValueError, IndexError):
        return f"argument {where[1]}"


def _submodule(block: nn.Module, rel: str) -> nn.Module | None:
    try:
        return block.get_submodule(rel) if rel else block
    except AttributeError:
        return None


def _other_streams(rec: Recording, call, s_in: int | None, s_out: int | None) -> list[tuple]:
    """(where it enters, where it leaves, sublayers) for each further stream the block carries: an
    argument that reaches one of its outputs through residual sublayers (LiLT's layout stream)."""
    ins = [(w, v) for w, v in call.inputs if len(w) == 2 and v != s_in]
    outs = [(w, v) for w, v in call.outputs if len(w) <= 1 and v != s_out and v is not None]
    found, used = [], set()
    for wo, vo in outs:
        for wi, vi in ins:
            if vi in used or rec.values[vi].tensor.shape != rec.values[vo].tensor.shape:
                continue
            try:
                subs = analyse(rec, call, norm_types(), start=vi, end=vo)
            except Unrecognised:
                continue
            found.append((wi, wo, subs))
            used.add(vi)
            break
    return found


def _observed_handler(block: nn.Module, path: str, rec: Recording, call) -> HookedHandler:
    start_fn = families.stream_start_fn(block)
    source = families.stream_source(block)
    start = start_fn(block, rec, call) if start_fn else None
    enters, s_in = (("module", source), start) if source else stream_input_at(call)
    leaves, s_out = stream_output_at(call)
    streams = [Stream(source + " output" if source else _argument_name(block, enters), enters, leaves)]
    found = [(0, o) for o in analyse(rec, call, norm_types(), start=start)]
    for wi, wo, more in _other_streams(rec, call, s_in, s_out):
        streams.append(Stream(_argument_name(block, wi), wi, wo))
        found += [(len(streams) - 1, o) for o in more]
    subs = []
    for j, o in found:
        rel = lambda p: _relative(p, path)  # noqa: E731
        plan = None
        if o.plan is not None:
            call = o.plan.exit_call and dataclasses.replace(o.plan.exit_call, feeder=rel(o.plan.exit_call.feeder))
            plan = RewritePlan(rel(o.plan.norm), [EntryPlan(rel(e.module), e.arg_positions, e.kwarg_names) for e in o.plan.entries],
                               rel(o.plan.exit_module), o.plan.exit_index, o.plan.exit_reason, call)
        sep = " + " if o.parallel else " > "
        branch = sep.join(_relative(b, path) for b in o.branch.split(sep)) if o.branch != "(functions)" else o.branch
        name = plan.entries[0].module if plan is not None and plan.entries else (branch.split(sep)[0] if o.branch != "(functions)" else f"sublayer{o.index}")
        if o.parallel and o.branch != "(functions)":  # named after its branches: "attn+mlp"
            parts = [b for b in branch.split(sep) if not isinstance(_submodule(block, b), norm_types())]
            name = "+".join(parts) or name
        if j:
            name = f"{streams[j].label}.{name}"  # one namespace for the added modules of every stream
        subs.append(HookedSublayer(name, o.placement, rel(o.norm), branch, plan, o.reason, rel(o.out_norm), j, o.parallel))
    names = [s.name for s in subs]
    for i, s in enumerate(subs):
        if names.count(s.name) > 1:
            s.name = f"{s.name}{i}"
    if len(streams) == 1 and streams[0].enters in (None, ("arg", 0)) and streams[0].leaves in (None, (), (0,)):
        streams = None  # the usual one: its first argument, its first output
    return HookedHandler(block, path, subs, "observed forward", streams)


def _refuse_second_stream(rec: Recording, call) -> None:
    """A block that also gets an earlier version of its stream (Funnel's pooling layer reads the
    unpooled stream as key and value) would need that normalised as well: refuse it.

    The stream's lineage is what it was computed from by functions alone (pooling, a cast, a norm),
    back to the last residual add: a cross-attention's memory or a mask is not in it."""
    s = stream_input(call)
    if s is None:
        return
    lineage, todo = set(), [s]
    while todo:
        p = rec.values[todo.pop()].producer
        if p is None or rec.events[p].is_add:
            continue
        for _, i in rec.events[p].inputs:
            if i not in lineage and not isinstance(rec.values[i].tensor, nn.Parameter):
                lineage.add(i)
                todo.append(i)
    for where, v in call.inputs:
        if v != s and v in lineage:
            raise Unrecognised(
                f"it receives an earlier version of the residual stream as a second input ({where[0]} {where[1]!r}) "
                "besides the stream itself; a pre-norm rewrite would have to normalise both"
            )


def _registered_handler(block: nn.Module, path: str, decl) -> HookedHandler:
    subs = []
    for d in decl:
        for rel in (d.norm, d.branch, d.exit or d.branch):
            try:
                block.get_submodule(rel)
            except AttributeError:
                raise Unrecognised(f"register_block declared submodule {rel!r}, which {type(block).__name__} does not have") from None
        if not isinstance(block.get_submodule(d.norm), norm_types()):
            raise Unrecognised(f"declared norm {d.norm!r} is a {type(block.get_submodule(d.norm)).__name__}, not a norm (see register_norm_class)")
        plan = RewritePlan(d.norm, [EntryPlan(d.branch, tuple(d.stream_args), tuple(d.stream_kwargs))], d.exit or d.branch, d.exit_index)
        subs.append(HookedSublayer(d.name or d.branch, d.placement, d.norm, d.branch, plan))
    return HookedHandler(block, path, subs, "register_block")


def _handler(block: nn.Module, path: str, run: ModelRun | None) -> Handler:
    decl = registered_sublayers(block)
    if decl is not None:
        return _registered_handler(block, path, decl)
    if isinstance(block, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return TorchLayerHandler(block, path)
    if run is not None:
        calls = run.rec.module_calls(block)
        if not calls:
            raise Unrecognised("the model's forward did not call it on the example input")
        _refuse_second_stream(run.rec, calls[0])
        return _observed_handler(block, path, run.rec, calls[0])
    args, kwargs = synthetic_probe(block, _stream_dim(block))
    try:
        with eval_no_grad(block), hooks.bypass(), record(block, path) as rec:
            block(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the user's block refused our probe: say so
        raise Unrecognised(
            f"running it on a probe tensor of shape {tuple(args[0].shape)} failed ({type(e).__name__}: {str(e)[:160]}); "
            "pass example_input= so it runs with its real inputs"
        ) from None
    # Alone on one tensor, a block may skip a sublayer that needs another argument (a decoder's
    # cross-attention without encoder states): a norm that did not run means the probe saw part of it.
    ours = {id(x) for m in block.modules() if hasattr(m, FINAL_NORM_MARKER) for x in m.modules()}  # an added final norm: off in a probe
    idle = [p for p, m in block.named_modules() if isinstance(m, norm_types()) and not rec.module_calls(m) and id(m) not in ours]
    if idle:
        raise Unrecognised(
            f"its norm {join(path, idle[0])} did not run when the block ran alone on a probe tensor (a sublayer that needs "
            "another argument, like a decoder's encoder states?); pass example_input= so it runs with its real inputs"
        )
    return _observed_handler(block, path, rec, rec.events[0])


def discover(model: nn.Module, example: Example | None = None) -> Found:
    """Every stack of residual blocks. A child of a container that holds a norm is tried as a block
    (outermost first: a T5Block is one block, not its two sublayer modules); if it is not one,
    its children are searched, and the reason is reported when nothing inside is a block either."""
    found = Found()
    run = None
    holders = norm_holders(model)
    contains = lambda m: id(m) in holders  # noqa: E731
    if example is not None and example.made_up:
        for path in [example.path, *example.fallbacks]:  # the outermost module that runs on the made-up ids
            try:
                example.path = path
                run = observe_model(model, example, holders)
                break
            except Exception:  # noqa: BLE001 - that one does not take token ids alone
                continue
        example.fallbacks = []
        if run is None:
            example.value = None
    elif example is not None:
        run = observe_model(model, example, holders)
    found.observation = run
    types = norm_types()
    stacks: dict[str, Stack] = {}

    def count() -> int:
        return len(found.unrecognised) + sum(len(s.handlers) for s in stacks.values())

    def attempt(child: nn.Module, cpath: str, container_path: str, report: bool) -> None:
        h = None
        if not _always_a_candidate(child) and _holds_a_stack(child, contains):
            # A wrapper around a container of blocks (a `Stack` holding `blocks`, ALBERT's layer group):
            # the blocks are the ones inside, unless the wrapper has residual sublayers of its own
            # around them (MobileBERT's layer: its bottleneck residual holds a stack of FFN blocks).
            try:
                h = _handler(child, cpath, run)
            except Unrecognised:
                h = None
            if h is None or not _owns_a_sublayer(h, child, contains):
                h = None
                before = count()
                visit(child, cpath)
                if count() > before:
                    return
        try:
            h = h or _handler(child, cpath, run)
        except Unrecognised as e:
            before = count()
            visit(child, cpath)
            if report and before == count():
                found.unrecognised.append(SkippedModule(cpath, type(child).__name__, str(e)))
            return
        st = stacks.get(container_path)
        if st is None:
            st = stacks[container_path] = Stack(container_path, model.get_submodule(container_path) if container_path else model, [])
        st.handlers.append(h)

    def visit(m: nn.Module, path: str) -> None:
        in_container = isinstance(m, CONTAINERS)
        for name, child in m.named_children():
            cpath = join(path, name)
            if isinstance(child, types) or not contains(child):
                continue
            if isinstance(child, CONTAINERS):
                visit(child, cpath)
            elif in_container or _always_a_candidate(child):
                attempt(child, cpath, path, report=in_container)
            else:
                visit(child, cpath)

    if not isinstance(model, CONTAINERS) and _always_a_candidate(model):
        attempt(model, "", "", report=True)
    else:
        visit(model, "")
    found.stacks = sorted(stacks.values(), key=lambda s: s.path)
    # `attempt` and `visit` call each other, a reference cycle that holds `run` (the whole recording): cleared,
    # the recording is freed as soon as convert lets go of it, not by a garbage collection walking it all.
    attempt = visit = None  # noqa: F841
    return found


def _owns_a_sublayer(h: Handler, m: nn.Module, contains=_contains_norm) -> bool:
    """Is one of the handler's sublayer norms outside the blocks of the stacks `m` holds?"""
    if not isinstance(h, HookedHandler):
        return True
    inner = {id(x) for sub in m.modules() if sub is not m and isinstance(sub, CONTAINERS)
             for c in sub.children() if contains(c) for x in c.modules()}
    return any(s.norm is not None and id(h._get(s.norm)) not in inner for s in h.subs)


def _holds_a_stack(m: nn.Module, contains=_contains_norm) -> bool:
    """Does `m` hold a container of blocks: children that hold norms, all of one class? (T5's block
    holds a container of *different* sublayer modules: it is one block itself.)"""
    types = norm_types()
    for sub in m.modules():
        if sub is not m and isinstance(sub, CONTAINERS):
            inner = [c for c in sub.children() if not isinstance(c, types) and contains(c)]
            if inner and len({type(c) for c in inner}) == 1:
                return True
    return False


def _always_a_candidate(m: nn.Module) -> bool:
    return isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) or registered_sublayers(m) is not None or families.is_block(m)
