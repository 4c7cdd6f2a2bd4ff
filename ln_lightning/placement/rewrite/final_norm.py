"""A stack's final norm: is there one, and where does an added one go so it runs once per forward.

Detection follows the stack's output as the model really uses it (one recorded forward on the
example input): from the stream the last block returns on its last call, through what keeps it
the stream's features (dropout, a clamp, a cast, slicing, a mean over tokens, patch merging's
concatenation, a mask), into the modules that do only that (a pooler, a decoder, PatchMerging),
to a norm that reads it: that is the final norm (BEiT's pooled `fc_norm`, Swin's merging norm,
Perceiver's decoder normalising the latents it cross-attends to). A bias-free linear map on the
way is allowed (Swin v2 merges, then reduces, then normalises: the norm of `W x` is blind to the
stream's scale as a final norm is). The path stops at anything with parameters of its own (a
head's dense layer) and at an add of something else (a residual: the next stack's). No norm on
any path (a head, the model's output) means there is none. Without an example input the owner's
forward is traced with torch.fx instead, where it can be.

An added final norm is applied where the stack's output leaves it:

* when the last block runs once per forward, by a hook on that block (its stream element only,
  whatever else it returns);
* when it runs several times (a shared layer, ALBERT), by a hook on the innermost module whose
  call holds all those runs and returns the stream: the norm then runs once, after the last use.

It is stored on the nearest module above the stack that is not a container (a Sequential or
ModuleList would run or iterate it as a layer), or, where every module above is one (a bare
`nn.Sequential` of blocks), on the last block itself as its `final_norm`. Where none of this
applies, no norm is added and the report says why.
"""

from __future__ import annotations

import copy
from torch import fx, nn

from ln_lightning.placement import families
from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.reading.analysis import stream_input, stream_output
from ln_lightning.placement.reading.blocks import HookedHandler
from ln_lightning.placement.reading.discovery import CONTAINERS, Found, Stack, join
from ln_lightning.placement.reading.norms import FINAL_NORM_MARKER, norm_types

_TRANSPARENT = (nn.Dropout, nn.Identity)
MARKER = FINAL_NORM_MARKER  # attribute on a norm convert added: the stack's path


class NotAdded(Exception):
    """No final norm can be placed correctly; the message says why."""


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return not isinstance(m, (nn.ModuleList, nn.ModuleDict))


def added_norm(model: nn.Module, stack: Stack) -> tuple[str, nn.Module] | None:
    for path, m in model.named_modules():
        # The marker is an instance attribute (set below): read from the instance's dict, not through
        # nn.Module.__getattr__, which raises (and formats) an AttributeError for each of the model's modules.
        if m.__dict__.get(MARKER) == stack.path:
            return path, m
    owner, owner_path = _owner(model, stack)
    if isinstance(owner, (nn.TransformerEncoder, nn.TransformerDecoder)) and getattr(owner, "_ln_lightning_added_norm", False):
        return join(owner_path, "norm"), owner.norm
    return None


def _owner(model: nn.Module, stack: Stack) -> tuple[nn.Module | None, str]:
    if not stack.path:
        return None, ""
    owner_path = stack.path.rpartition(".")[0]
    return (model.get_submodule(owner_path) if owner_path else model), owner_path


def _block_module_ids(found: Found) -> dict[int, str]:
    out: dict[int, str] = {}
    for h in found.handlers:
        for m in h.block.modules():
            out.setdefault(id(m), h.path)
    return out


def detect(model: nn.Module, stack: Stack, found: Found) -> None:
    """Set stack.final_norm / final_known / final_detail."""
    added = added_norm(model, stack)
    if added is not None:
        stack.final_norm = added[0]
        return
    owner, owner_path = _owner(model, stack)
    if isinstance(owner, (nn.TransformerEncoder, nn.TransformerDecoder)) and owner.layers is stack.container:
        stack.final_norm = join(owner_path, "norm") if owner.norm is not None else None
        return
    last = stack.handlers[-1]
    slot = families.final_norm_slot(last.block)
    if slot is not None:
        stack.final_norm = join(last.path, slot) if isinstance(getattr(last.block, slot), norm_types()) else None
        return
    if families.final_norm_on_output(last.block) is not None:
        stack.final_norm = None  # the family's model has none of its own (XLM)
        return
    if found.observation is not None:
        _detect_observed(model, stack, found)
        return
    if stack.path == "" and not isinstance(stack.container, CONTAINERS):
        stack.final_norm, stack.final_known, stack.final_detail = None, False, "the model is a single block"
        return
    _detect_traced(model, stack, found)


def last_call(stack: Stack, found: Found):
    calls = found.observation.rec.module_calls(stack.handlers[-1].block)
    return calls[-1] if calls else None


def _detect_observed(model: nn.Module, stack: Stack, found: Found) -> None:
    rec = found.observation.rec
    last = last_call(stack, found)
    if last is None:
        stack.final_norm, stack.final_known, stack.final_detail = None, False, "its last block did not run on the example input"
        return
    v = stream_output(last)
    stack.final_norm = None
    # Where another block takes this stream as its own, the residual stream goes on: it is not the end.
    blocks = [h.block for h in found.handlers] + [model.get_submodule(u.path) for u in found.unrecognised]
    stream_inputs = {}
    for b in blocks:
        for c in rec.module_calls(b):
            if c.index > last.end:
                stream_inputs.setdefault(stream_input(c), rec.paths[id(b)])
    types = norm_types()
    todo, seen, stopped = [v], {v}, set()  # stopped: module calls the path does not enter
    while todo:
        x = todo.pop(0)
        if x in stream_inputs:
            stack.continues_into = stream_inputs[x]
            return
        for r in rec.values[x].readers:
            e = rec.events[r]
            if e.index <= last.end or any(f in stopped for f in e.frames):
                continue  # inside the last block's own call, or inside a module the path stopped at
            if e.kind == "module":
                if isinstance(e.module, types):
                    stack.final_norm = rec.paths[id(e.module)]
                    return
                if _own_tensors(e.module) and not _bias_free_linear(e.module):
                    stopped.add(e.index)  # a head's dense layer, an embedding: the stream's features end here
                continue  # the path goes on inside it, through the functions that read the value
            if not _keeps_features(rec, e, seen):
                continue
            for _, o in e.outputs:
                if o not in seen:
                    seen.add(o)
                    todo.append(o)


def _own_tensors(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))


def _bias_free_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) and m.bias is None


def _keeps_features(rec, e, seen: set) -> bool:
    """Does the function call `e` pass the stream's features on (a slice, a mean, a concatenation, a
    mask), rather than mix them with learnt weights or add something else to them?"""
    for _, i in e.inputs:
        t = rec.values[i].tensor
        if isinstance(t, nn.Parameter):
            return e.name in ("linear",) and len([1 for _, j in e.inputs if isinstance(rec.values[j].tensor, nn.Parameter)]) == 1
    if e.is_add:
        return all(i in seen for _, i in e.inputs)  # an add of another value: a residual, a position embedding
    return True


def traced_owner(model: nn.Module, stack: Stack):
    """The fx graph of the module holding the stack's container (children as leaves), or None.
    Traced once per stack: a 96-layer owner takes a while."""
    if "graph" in stack.__dict__:
        return stack.__dict__["graph"]
    owner, _ = _owner(model, stack)
    graph = None
    if owner is not None:
        try:
            graph = _LeafTracer().trace(owner)
        except Exception:  # noqa: BLE001 - most real code is not traceable
            graph = None
    stack.__dict__["graph"] = graph
    return graph


def _rel_to_owner(path: str, owner_path: str) -> str:
    return path[len(owner_path) + 1:] if owner_path else path


def _detect_traced(model: nn.Module, stack: Stack, found: Found) -> None:
    owner, owner_path = _owner(model, stack)
    block_ids = _block_module_ids(found)
    types = norm_types()
    if owner is not None:
        last_name = _rel_to_owner(stack.handlers[-1].path, owner_path)
        container_name = _rel_to_owner(stack.path, owner_path)
        graph = traced_owner(model, stack)
        if graph is not None:
            nodes = [n for n in graph.nodes if n.op == "call_module" and n.target in (last_name, container_name)]
            if nodes:
                stack.final_norm = None
                todo, seen = [nodes[-1]], {nodes[-1]}
                while todo:
                    n = todo.pop(0)
                    for u in n.users:
                        if u in seen:
                            continue
                        seen.add(u)
                        if u.op == "call_module":
                            m = owner.get_submodule(u.target)
                            if isinstance(m, types):
                                stack.final_norm = join(owner_path, u.target)
                                return
                            if not isinstance(m, _TRANSPARENT):
                                continue
                        if u.op in ("call_module", "call_function", "call_method"):
                            todo.append(u)
                return
    outside = [p for p, m in model.named_modules() if isinstance(m, types) and id(m) not in block_ids]
    if not outside:
        stack.final_norm = None  # no norm outside the blocks anywhere: there can be no final norm
        return
    stack.final_known = False
    stack.final_detail = (
        f"the code around {stack.path or 'the model'} could not be traced and the model has norms outside its blocks "
        f"({', '.join(outside[:3])}); pass example_input= so convert can run the model and see"
    )


HELD_BY_BLOCK = "final_norm"  # the name of a final norm its stack's last block holds


def _holder(model: nn.Module, stack: Stack) -> tuple[nn.Module, str, str]:
    """(module, its path, the child name) that holds the stack's added final norm."""
    parts = stack.path.split(".") if stack.path else []
    for k in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:k])
        m = model.get_submodule(path) if path else model
        if not isinstance(m, CONTAINERS):
            rel = stack.path[len(path) + 1:] if path else stack.path
            return m, path, f"{rel.replace('.', '_')}_final_norm"
    # Every module above is a container, which would run or iterate an added norm as a layer: the
    # last block (never a container) holds it, and its forward hook applies it.
    last = stack.handlers[-1]
    return last.block, last.path, HELD_BY_BLOCK


def template_norm(stack: Stack) -> nn.Module:
    """The norm an added final norm copies: the one that produced the stack's output in the model as written."""
    template = next((h.output_norm() for h in reversed(stack.handlers) if h.output_norm() is not None), None)
    return template if template is not None else stack.handlers[-1].norms()[-1]


def add(model: nn.Module, stack: Stack, found: Found) -> str:
    """Add and wire a final norm; raises NotAdded with the reason."""
    owner, owner_path = _owner(model, stack)
    template = template_norm(stack)
    # A copy of the norm that fed the head in the post-norm model: same class, eps and affine
    # parameters, so the head keeps receiving features on the scale and offset it was trained with.
    norm = copy.deepcopy(template)
    hooks.undefer_norm(norm)
    norm._forward_hooks.clear()
    norm._forward_pre_hooks.clear()
    if isinstance(owner, (nn.TransformerEncoder, nn.TransformerDecoder)) and owner.layers is stack.container:
        owner.norm = norm
        owner._ln_lightning_added_norm = True
        return join(owner_path, "norm")
    last = stack.handlers[-1]
    slot = families.final_norm_slot(last.block)
    if slot is not None:  # the block's own final-norm slot, where its pre-norm configuration keeps one
        setattr(norm, MARKER, stack.path)
        norm.ln_lightning_slot_was = type(getattr(last.block, slot))
        hooks.make_bypassable(norm)
        setattr(last.block, slot, norm)
        return join(last.path, slot)
    child = families.final_norm_on_output(last.block)
    if child is not None:  # a whole model read as one block: on its output stream, once per forward
        if hasattr(last.block, child):
            raise NotAdded(f"{join(last.path, child)} already exists")
        setattr(norm, MARKER, stack.path)
        last.block.add_module(child, norm)
        last.block.register_forward_hook(hooks.ApplyFinalNorm(norm))
        return join(last.path, child)
    holder, holder_path, name = _holder(model, stack)
    if hasattr(holder, name):
        raise NotAdded(f"{join(holder_path, name)} already exists")
    last = stack.handlers[-1].block
    hook_target, hook = last, hooks.ApplyFinalNorm(norm)
    pre_hook = False
    if found.observation is not None:
        calls = found.observation.rec.module_calls(last)
        if len(calls) > 1:
            hook_target, hook = _exit_hook(model, stack, found, norm)
            pre_hook = isinstance(hook, hooks.ApplyFinalNormAtConsumer)
            last.register_forward_hook(hook.tap)
    else:
        runs = _traced_runs(model, stack)
        if runs != 1:
            why = "could not be read" if runs is None else f"calls its last block {runs} times"
            raise NotAdded(
                f"without an example input, the forward around the stack {why}, so a norm after its last block might not "
                "run exactly once per forward; pass example_input= so convert can see how the stack is used"
            )
    setattr(norm, MARKER, stack.path)
    holder.add_module(name, norm)
    if pre_hook:
        hook_target.register_forward_pre_hook(hook, with_kwargs=True)
    else:
        hook_target.register_forward_hook(hook)
    return join(holder_path, name)


def _traced_runs(model: nn.Module, stack: Stack) -> int | None:
    owner, owner_path = _owner(model, stack)
    if owner is None:  # the model is the stack
        return 1 if isinstance(stack.container, nn.Sequential) else None
    if isinstance(owner, CONTAINERS):
        return 1 if isinstance(owner, nn.Sequential) else None  # a Sequential runs each child once
    graph = traced_owner(model, stack)
    if graph is None:
        return None
    last = _rel_to_owner(stack.handlers[-1].path, owner_path)
    if isinstance(stack.container, nn.Sequential):  # called as one module, which runs each block once
        last = _rel_to_owner(stack.path, owner_path)
    return sum(1 for n in graph.nodes if n.op == "call_module" and n.target == last)


def _exit_hook(model: nn.Module, stack: Stack, found: Found, norm: nn.Module):
    rec = found.observation.rec
    calls = rec.module_calls(stack.handlers[-1].block)
    first, last = calls[0], calls[-1]
    v = stream_output(last)
    for f in reversed(last.frames):
        e = rec.events[f]
        if e.index > first.index or e.end < last.end:
            continue  # does not hold every run of the shared block
        if not any(o == v and len(w) <= 1 for w, o in e.outputs):
            continue
        if len(rec.module_calls(e.module)) != 1:
            break
        return e.module, hooks.ApplyFinalNormAtExit(norm, hooks.TapStream(), stack.path)
    # Or the one module that reads the final stream after the last run, called once (a head).
    readers = [rec.events[r] for r in rec.values[v].readers if rec.events[r].index > last.end]
    modules = [e for e in readers if e.kind == "module" and not any(f > last.end for f in e.frames)]
    if len(modules) == 1 and len(readers) == len([e for e in readers if e is modules[0] or modules[0].index in e.frames]):
        if len(rec.module_calls(modules[0].module)) == 1:
            return modules[0].module, hooks.ApplyFinalNormAtConsumer(norm, hooks.TapStream(), stack.path)
    raise NotAdded(
        f"its last block {stack.handlers[-1].path} runs {len(calls)} times per forward and no module returns its final "
        "stream once, so there is no place where a final norm would run exactly once"
    )


def remove(model: nn.Module, stack: Stack) -> str | None:
    owner, owner_path = _owner(model, stack)
    if isinstance(owner, (nn.TransformerEncoder, nn.TransformerDecoder)) and getattr(owner, "_ln_lightning_added_norm", False):
        owner.norm = None
        del owner._ln_lightning_added_norm
        return join(owner_path, "norm")
    added = added_norm(model, stack)
    if added is None:
        return None
    path, norm = added
    for m in model.modules():
        for d in (m._forward_hooks,):
            for key in [k for k, h in list(d.items()) + list(m._forward_pre_hooks.items())
                        if isinstance(h, (hooks.ApplyFinalNorm, hooks.ApplyFinalNormAtExit, hooks.ApplyFinalNormAtConsumer)) and h.norm is norm]:
                hook = d.pop(key, None) or m._forward_pre_hooks.pop(key)
                m._forward_pre_hooks_with_kwargs.pop(key, None)
                if isinstance(hook, (hooks.ApplyFinalNormAtExit, hooks.ApplyFinalNormAtConsumer)):
                    for mm in model.modules():
                        for k2 in [k for k, h in mm._forward_hooks.items() if h is hook.tap]:
                            del mm._forward_hooks[k2]
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    was = getattr(norm, "ln_lightning_slot_was", None)
    if was is not None:
        setattr(parent, name, was())  # the slot held an identity before
    else:
        del parent._modules[name]
    return path


def outside_uses(model: nn.Module, found: Found) -> dict[str, str]:
    """block path -> reason, for blocks whose norm is also called outside the block's own calls."""
    out: dict[str, str] = {}
    if found.observation is None:
        for stack in found.stacks:
            if not any(isinstance(h, HookedHandler) for h in stack.handlers):
                continue  # torch's own layers: their norms are theirs, and torch's stacks don't reuse them
            graph = traced_owner(model, stack)
            if graph is None:
                continue
            _, owner_path = _owner(model, stack)
            for h in stack.handlers:
                inner = _rel_to_owner(h.path, owner_path) + "."
                for n in graph.nodes:
                    if n.op == "call_module" and str(n.target).startswith(inner) and isinstance(model.get_submodule(join(owner_path, n.target)), norm_types()):
                        out[h.path] = (
                            f"its norm {join(owner_path, n.target)} is also called outside the block (for example as the model's "
                            "final norm); moving it into the branch would change that call too: give the model its own final norm module"
                        )
        return out
    rec = found.observation.rec
    types = norm_types()
    for h in found.handlers:
        calls = rec.module_calls(h.block)
        spans = [(c.index, c.end) for c in calls]
        for m in h.block.modules():
            if not isinstance(m, types):
                continue
            for e in rec.module_calls(m):
                if not any(a <= e.index <= b for a, b in spans):
                    out[h.path] = (
                        f"its norm {rec.paths[id(m)]} is also called outside the block (for example as the model's final norm); "
                        "moving it into the branch would change that call too: give the model its own final norm module"
                    )
    return out
