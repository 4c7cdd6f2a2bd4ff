"""`inspect_model` and `convert`: find the stacks of residual blocks, rewrite them, check, report."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ln_lightning.placement import hooks
from ln_lightning.placement.blocks import (
    CHECK_TOLERANCE,
    CheckFailed,
    Handler,
    HookedHandler,
    HookedSublayer,
    ScaleFactory,
    TorchLayerHandler,
    _stream_out,
    bert_handler,
)
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.registry import registered_sublayers
from ln_lightning.placement.report import (
    BlockChange,
    ConversionReport,
    NormInfo,
    PlacementReport,
    SkippedModule,
    StackInfo,
)
from ln_lightning.placement.trace import (
    RewritePlan,
    EntryPlan,
    Unrecognised,
    _LeafTracer,
    analyse,
    describe_node,
    norm_types,
    plan_post_to_pre,
    trace_block,
)

PLACEMENTS = ("pre", "post")
BRANCH_SCALES = "None, a positive float c, 'depth' (c = 1/sqrt(2L)) or 'layerscale'"
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_TRANSPARENT = (nn.Dropout, nn.Identity)
PRESERVE_TOLERANCE = 1e-6


# ---------------------------------------------------------------------------------------------
# Recognition
# ---------------------------------------------------------------------------------------------


def _contains_norm(m: nn.Module) -> bool:
    types = norm_types()
    return any(isinstance(x, types) for x in m.modules())


def _traced_handler(block: nn.Module, path: str) -> HookedHandler:
    graph = trace_block(block)
    subs = []
    for sub in analyse(block, graph):
        calls = [n for n in graph.nodes if n in sub.branch_nodes and n.op == "call_module"]
        first = next((n for n in calls if sub.stream_in in n.all_input_nodes or (sub.pre_norm is not None and sub.pre_norm in n.all_input_nodes)), None)
        name = str(first.target) if first is not None else f"sublayer{sub.index}"
        branch = " > ".join(describe_node(n) for n in calls if n is not sub.pre_norm) or "(functions)"
        plan, reason = None, ""
        if sub.placement == "post":
            try:
                plan = plan_post_to_pre(block, graph, sub)
                if plan.exit_module is None:
                    plan, reason = None, f"{plan.exit_reason}, so the rewrite can't be checked; declare the block with register_block(exit=...)"
            except Unrecognised as e:
                reason = str(e)
        norm = sub.norm_node.target if sub.norm_node is not None else None
        subs.append(HookedSublayer(name, sub.placement, norm, branch, plan, reason))
    names = [s.name for s in subs]
    for i, s in enumerate(subs):
        if names.count(s.name) > 1:
            s.name = f"{s.name}{i}"
    return HookedHandler(block, path, subs, "traced forward")


def _registered_handler(block: nn.Module, path: str, decl) -> HookedHandler:
    subs = []
    for d in decl:
        for rel in (d.norm, d.branch, d.exit or d.branch):
            try:
                block.get_submodule(rel)
            except AttributeError:
                raise Unrecognised(f"register_block declared submodule {rel!r}, which {type(block).__name__} does not have") from None
        if not isinstance(block.get_submodule(d.norm), norm_types()):
            raise Unrecognised(f"declared norm {d.norm!r} is a {type(block.get_submodule(d.norm)).__name__}, not a LayerNorm (see register_norm_class)")
        plan = RewritePlan(d.norm, [EntryPlan(d.branch, tuple(d.stream_args), tuple(d.stream_kwargs))], d.exit or d.branch, d.exit_index)
        subs.append(HookedSublayer(d.name or d.branch, d.placement, d.norm, d.branch, plan))
    return HookedHandler(block, path, subs, "register_block")


def _recognise(m: nn.Module, path: str) -> Handler | None:
    """A handler for `m` if it is a residual block; None if it is not a block; Unrecognised if it looks like one but can't be read."""
    if isinstance(m, norm_types()) or not _contains_norm(m):
        return None
    decl = registered_sublayers(m)
    if decl is not None:
        return _registered_handler(m, path, decl)
    if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return TorchLayerHandler(m, path)
    if isinstance(m, _CONTAINERS + (nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer)):
        return None
    h = bert_handler(m, path)
    if h is not None:
        return h
    return _traced_handler(m, path)


@dataclass
class _Stack:
    path: str  # the container's path
    container: nn.Module
    handlers: list[Handler]
    final_norm: str | None = None
    final_known: bool = True
    final_detail: str = ""


@dataclass
class _Found:
    stacks: list[_Stack] = field(default_factory=list)
    unrecognised: list[SkippedModule] = field(default_factory=list)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _discover(model: nn.Module) -> _Found:
    found = _Found()
    types = norm_types()

    def visit(m: nn.Module, path: str) -> None:
        is_container = isinstance(m, _CONTAINERS)
        handlers = []
        for name, child in m.named_children():
            cpath = _join(path, name)
            try:
                h = _recognise(child, cpath)
            except Unrecognised as e:
                # Blocks live in containers; elsewhere (embeddings, heads) a norm is not a placement question.
                if is_container:
                    found.unrecognised.append(SkippedModule(cpath, type(child).__name__, str(e)))
                h = None
            if h is not None:
                handlers.append(h)
            elif not isinstance(child, types):
                visit(child, cpath)
        if handlers:
            found.stacks.append(_Stack(path, m, handlers))

    try:
        root = _recognise(model, "")
    except Unrecognised:
        root = None
    if root is not None:
        found.stacks.append(_Stack("", model, [root]))
    else:
        visit(model, "")
    found.stacks.sort(key=lambda s: s.path)
    return found


# ---------------------------------------------------------------------------------------------
# Final norms
# ---------------------------------------------------------------------------------------------


def _owner(model: nn.Module, stack: _Stack) -> tuple[nn.Module, str, str]:
    owner_path, _, attr = stack.path.rpartition(".")
    return model.get_submodule(owner_path) if owner_path else model, owner_path, attr


def _added_final_norm(stack: _Stack) -> tuple[str, nn.Module] | None:
    """The final norm convert added to this stack (hook on the last block), if any."""
    last = stack.handlers[-1].block
    for h in last._forward_hooks.values():
        if isinstance(h, hooks.ApplyFinalNorm):
            return h.name, h.norm
    return None


def _detect_final_norm(model: nn.Module, stack: _Stack, blocks: set, example: Any) -> None:
    if stack.path == "" and not isinstance(stack.container, _CONTAINERS):
        stack.final_norm, stack.final_known, stack.final_detail = None, False, "the model is a single block"
        return
    added = _added_final_norm(stack)
    if added is not None:
        stack.final_norm = added[0]
        return
    if isinstance(stack.container, nn.Sequential):
        # Whatever follows the last block inside the Sequential receives its output.
        names = list(stack.container._modules)
        i = names.index(stack.handlers[-1].path.rpartition(".")[2])
        if i + 1 < len(names):
            nxt = stack.container._modules[names[i + 1]]
            stack.final_norm = _join(stack.path, names[i + 1]) if isinstance(nxt, norm_types()) else None
            return
    if stack.path == "":
        stack.final_norm = None  # nothing outside the root container can follow it
        return
    owner, owner_path, attr = _owner(model, stack)
    if isinstance(owner, (nn.TransformerEncoder, nn.TransformerDecoder)) and owner.layers is stack.container:
        stack.final_norm = _join(owner_path, "norm") if owner.norm is not None else None
        return
    # 1. Read the owner's forward: does the last block's output go into a norm?
    last_name = _join(attr, stack.handlers[-1].path.rpartition(".")[2]) if attr else None
    try:
        graph = _LeafTracer().trace(owner)
        targets = {last_name, attr}
        nodes = [n for n in graph.nodes if n.op == "call_module" and n.target in targets]
        if nodes:
            n = nodes[-1]
            while True:
                users = list(n.users)
                if len(users) != 1:
                    break
                u = users[0]
                if u.op == "call_module" and isinstance(owner.get_submodule(u.target), _TRANSPARENT):
                    n = u
                    continue
                if u.op == "call_module" and isinstance(owner.get_submodule(u.target), norm_types()):
                    stack.final_norm = _join(owner_path, u.target)
                    return
                break
            stack.final_norm = None
            return
    except Exception:
        pass
    # 2. No norm outside the blocks anywhere in the model: there can be no final norm.
    types = norm_types()
    outside = [(p, m) for p, m in model.named_modules() if isinstance(m, types) and not any(id(m) in b for b in blocks)]
    if not outside:
        stack.final_norm = None
        return
    # 3. Run the model once and see whether a norm outside the blocks reads the last block's output.
    if example is not None:
        seen: dict = {}
        hits: list[str] = []

        def on_last(mod, args, out):
            seen["out"] = _stream_out(out)

        def make_pre(path):
            def pre(mod, args):
                o = seen.get("out")
                if o is not None and args and isinstance(args[0], torch.Tensor) and args[0].shape == o.shape and args[0].data_ptr() == o.data_ptr():
                    hits.append(path)
            return pre

        handles = [stack.handlers[-1].block.register_forward_hook(on_last)]
        handles += [m.register_forward_pre_hook(make_pre(p)) for p, m in outside]
        try:
            _run_model(model, example)
        except Exception as e:
            stack.final_known, stack.final_detail = False, f"running the example input failed ({type(e).__name__}: {e})"
            return
        finally:
            for h in handles:
                h.remove()
        stack.final_norm = hits[0] if hits else None
        return
    stack.final_known = False
    stack.final_detail = (
        f"the code around {stack.path} could not be traced and the model has norms outside its blocks "
        f"({', '.join(p for p, _ in outside[:3])}); pass example_input= so convert can run the model and see"
    )


def _add_final_norm(model: nn.Module, stack: _Stack) -> str:
    owner, owner_path, attr = _owner(model, stack)
    template = next((h.output_norm() for h in reversed(stack.handlers) if h.output_norm() is not None), None)
    if template is None:
        template = stack.handlers[-1].norms()[-1]
    # A copy of the norm that fed the head in the post-norm model: same class, eps and affine
    # parameters, so the head keeps receiving features on the scale and offset it was trained with.
    norm = copy.deepcopy(template)
    hooks.undefer_norm(norm)
    norm._forward_hooks.clear()
    norm._forward_pre_hooks.clear()
    if isinstance(owner, (nn.TransformerEncoder, nn.TransformerDecoder)) and owner.layers is stack.container:
        owner.norm = norm
        owner._ln_lightning_added_norm = True
        return _join(owner_path, "norm")
    name = f"{attr}_final_norm"
    if hasattr(owner, name):
        raise PlacementError(f"cannot add a final norm to {stack.path}: {_join(owner_path, name)} already exists")
    owner.add_module(name, norm)
    path = _join(owner_path, name)
    hook = hooks.ApplyFinalNorm(norm)
    hook.name = path
    stack.handlers[-1].block.register_forward_hook(hook)
    return path


def _remove_added_final_norm(model: nn.Module, stack: _Stack) -> str | None:
    owner, owner_path, attr = _owner(model, stack)
    if isinstance(owner, (nn.TransformerEncoder, nn.TransformerDecoder)) and getattr(owner, "_ln_lightning_added_norm", False):
        owner.norm = None
        del owner._ln_lightning_added_norm
        return _join(owner_path, "norm")
    added = _added_final_norm(stack)
    if added is None:
        return None
    hooks.remove_our_hooks(stack.handlers[-1].block, hooks.ApplyFinalNorm)
    name = f"{attr}_final_norm"
    if name in owner._modules:
        del owner._modules[name]
    return added[0]


# ---------------------------------------------------------------------------------------------
# Running probes
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _one_thread():
    # Probes are tiny: a thread pool costs more than it saves, and far more on a busy machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@contextlib.contextmanager
def _eval_no_grad(model: nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, t in modes:
            m.training = t


def _run_model(model: nn.Module, example: Any):
    with _eval_no_grad(model):
        if isinstance(example, dict):
            return model(**example)
        if isinstance(example, (tuple, list)):
            return model(*example)
        return model(example)


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


def _rel_change(before: torch.Tensor, after: torch.Tensor) -> float:
    b, a = before.double(), after.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _synthetic_probe(h: Handler) -> tuple[tuple, dict]:
    w = next(iter(h.block.parameters()))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, h.stream_dim(), generator=g, dtype=torch.float64)
    # An offset and a non-unit scale, so a misplaced norm can't go unnoticed.
    x = (3.0 * x + 0.5).to(device=w.device, dtype=w.dtype)
    return h.probe_args(x)


def _run_capturing_block_inputs(model: nn.Module, handlers: list[Handler], example: Any) -> tuple[Any, dict]:
    """One run of the model on `example`: its output, and each hook-rewritable block's real inputs."""
    captured: dict = {}

    def make(h):
        def pre(mod, args, kwargs):
            if h.path not in captured:
                captured[h.path] = (tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args), dict(kwargs))
        return pre

    handles = [h.block.register_forward_pre_hook(make(h), with_kwargs=True) for h in handlers if isinstance(h, HookedHandler)]
    try:
        out = _run_model(model, example)
    finally:
        for hd in handles:
            hd.remove()
    return out, captured


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def _check_model(model: Any, fn: str) -> None:
    if not isinstance(model, nn.Module):
        raise PlacementError(f"{fn}() expects a torch.nn.Module, got {type(model).__name__}; pass the model (or LightningModule) itself")


def _example_of(model: nn.Module, example_input: Any) -> Any:
    if example_input is not None:
        return example_input
    return getattr(model, "example_input_array", None)


def _shared_norms(handlers: list[Handler]) -> dict[str, str]:
    """block path -> reason, for blocks that share a norm module with another block."""
    owners: dict[int, list[str]] = {}
    types = norm_types()
    for h in handlers:
        for m in {id(m): m for m in h.block.modules() if isinstance(m, types)}.values():
            owners.setdefault(id(m), []).append(h.path)
    out: dict[str, str] = {}
    for paths in owners.values():
        if len(paths) > 1:
            for p in paths:
                others = [q for q in paths if q != p]
                out[p] = f"one LayerNorm module is shared with block(s) {', '.join(others)}; give each block its own norm"
    return out


def inspect_model(model: nn.Module, *, example_input: Any = None) -> PlacementReport:
    """Describe every stack of residual blocks, their norms' placement and every LayerNorm; change nothing.

    Args:
        model: any nn.Module (a LightningModule too).
        example_input: optional input for `model(...)` (a tensor, a tuple of args or a dict of kwargs),
            used only to tell whether a stack has a final norm when the model's code can't be traced.
            Defaults to `model.example_input_array` when the model has one.

    Example::

        >>> from ln_lightning.demo import PostNormTransformerLM
        >>> report = inspect_model(PostNormTransformerLM(n_layers=2))
        >>> [b.placement for b in report.blocks]
        ['post', 'post']
    """
    _check_model(model, "inspect_model")
    found = _discover(model)
    blocks = [set(id(m) for m in h.block.modules()) for s in found.stacks for h in s.handlers]
    example = _example_of(model, example_input)
    report = PlacementReport(model=type(model).__name__)
    for s in found.stacks:
        _detect_final_norm(model, s, blocks, example)
        report.stacks.append(StackInfo(s.path, [h.info() for h in s.handlers], s.final_norm, s.final_known))
    report.unrecognised = found.unrecognised
    types = norm_types()
    for path, m in model.named_modules():
        if isinstance(m, types):
            shape = tuple(getattr(m, "normalized_shape", ()))
            w = getattr(m, "weight", None)
            b = getattr(m, "bias", None)
            report.layernorms.append(NormInfo(path, type(m).__name__, shape, float(getattr(m, "eps", None) or 0.0), w is not None, b is not None))
    return report


def _validate(placement, final_norm, branch_scale, strict, layerscale_init) -> None:
    if placement not in PLACEMENTS:
        raise PlacementError(f"unknown placement {placement!r}; valid placements are 'pre' (x + F(LN(x))) and 'post' (LN(x + F(x)))")
    if not isinstance(final_norm, bool):
        raise PlacementError(f"final_norm must be True or False, got {final_norm!r}")
    if not isinstance(strict, bool):
        raise PlacementError(f"strict must be True or False, got {strict!r}")
    if branch_scale is not None:
        if isinstance(branch_scale, str):
            if branch_scale not in ("depth", "layerscale"):
                raise PlacementError(f"unknown branch_scale {branch_scale!r}; valid values are {BRANCH_SCALES}")
        elif isinstance(branch_scale, bool) or not isinstance(branch_scale, (int, float)) or not math.isfinite(branch_scale) or branch_scale <= 0:
            raise PlacementError(f"branch_scale={branch_scale!r} is not valid; valid values are {BRANCH_SCALES}")
        if placement == "post":
            raise PlacementError("branch_scale applies to pre-norm branches (x + c*F(LN(x))); use branch_scale=None with placement='post'")
    if layerscale_init is not None:
        if branch_scale != "layerscale":
            raise PlacementError("layerscale_init is only used with branch_scale='layerscale'")
        if isinstance(layerscale_init, bool) or not isinstance(layerscale_init, (int, float)) or not math.isfinite(layerscale_init) or layerscale_init <= 0:
            raise PlacementError(f"layerscale_init must be a positive finite float, got layerscale_init={layerscale_init!r}")


def validate_options(placement="pre", *, final_norm=True, branch_scale=None, strict=False, layerscale_init=None) -> None:
    """Raise PlacementError for options `convert` would reject (used by LNPlacement at construction)."""
    _validate(placement, final_norm, branch_scale, strict, layerscale_init)


def convert(
    model: nn.Module,
    placement: str = "pre",
    *,
    final_norm: bool = True,
    branch_scale: float | str | None = None,
    strict: bool = False,
    example_input: Any = None,
    layerscale_init: float | None = None,
) -> ConversionReport:
    """Rewrite the LayerNorm placement of every recognised residual block, in place.

    `"pre"` turns `x <- LN(x + F(x))` into `x <- x + c * F(LN(x))`, reusing each sublayer's own
    LayerNorm module and parameters; `"post"` undoes it (and flips torch's `norm_first` layers back).

    Args:
        model: the model (any nn.Module, a LightningModule too). Changed in place; never moved
            between devices or dtypes. Existing parameter names are kept.
        placement: "pre" or "post".
        final_norm: for "pre": give each converted stack that lacks one a final norm after its last
            block. It is a copy of the norm that produced the stack's output before (same class, eps
            and affine parameters, so the head keeps receiving features on the scale and offset it
            was trained with; for a fresh model that is weight 1, bias 0). "post" removes a final norm
            that convert added.
        branch_scale: None; a float c; "depth" (c = 1/sqrt(2L) for a stack of L blocks); or
            "layerscale" (a learnable per-channel c, initialised to `layerscale_init`, by default
            CaiT's rule: 0.1 up to 18 blocks, 1e-5 up to 24, 1e-6 deeper).
        strict: raise PlacementError instead of skipping a block that can't be converted.
        example_input: optional input for `model(...)` (tensor, tuple of args or dict of kwargs);
            defaults to `model.example_input_array`. With it, the report measures how much the
            whole model's output changed, and blocks are probed with their real inputs.

    Returns:
        A ConversionReport: every block (converted / already / skipped, with the reason), what was
        added or removed, and whether the model's function was preserved (post <-> pre is not: the
        report measures the relative change of the output on the probe input).

    Example::

        >>> from ln_lightning.demo import PostNormTransformerLM
        >>> model = PostNormTransformerLM(n_layers=2)
        >>> report = convert(model, "pre")
        >>> [b.status for b in report.blocks], report.added
        (['converted', 'converted'], ['blocks_final_norm'])
    """
    _check_model(model, "convert")
    _validate(placement, final_norm, branch_scale, strict, layerscale_init)
    types = norm_types()
    norms = [(p, m) for p, m in model.named_modules() if isinstance(m, types)]
    if not norms:
        raise PlacementError(
            f"{type(model).__name__} has no LayerNorm (nn.LayerNorm, nn.RMSNorm or a class given to "
            "ln_lightning.register_norm_class): there is no norm placement to change"
        )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise PlacementError(
            f"parameters on the meta device ({meta[0]}, ...): convert checks every rewrite on a probe input, "
            "which needs real weights. Materialise the model first (model.to_empty(device=...) and initialise it), "
            "or convert before moving it to meta"
        )

    with _one_thread():
        return _convert(model, placement, final_norm, branch_scale, strict, example_input, layerscale_init)


def _convert(model, placement, final_norm, branch_scale, strict, example_input, layerscale_init) -> ConversionReport:
    options = {"final_norm": final_norm, "branch_scale": branch_scale, "strict": strict}
    if layerscale_init is not None:
        options["layerscale_init"] = layerscale_init
    report = ConversionReport(model=type(model).__name__, placement=placement, options=options)
    found = _discover(model)
    for u in found.unrecognised:
        report.notes.append(f"{u.path} ({u.kind}) looks like a block but was not recognised: {u.reason}")
        if strict:
            raise PlacementError(f"strict conversion: {u.path} ({u.kind}) was not recognised: {u.reason}")
    all_handlers = [h for s in found.stacks for h in s.handlers]
    if not all_handlers:
        msg = f"no residual blocks recognised in {type(model).__name__}"
        if strict:
            raise PlacementError(msg + "; declare your block class with ln_lightning.register_block")
        report.notes.append(msg)
        return report
    blocks_ids = [set(id(m) for m in h.block.modules()) for h in all_handlers]
    example = _example_of(model, example_input)
    model_before, captured = None, {}
    if example is not None:
        out, captured = _run_capturing_block_inputs(model, all_handlers, example)
        model_before = _first_tensor(out)
    shared = _shared_norms(all_handlers)

    done: list[tuple[Handler, str]] = []  # for undo under strict
    try:
        for stack in found.stacks:
            _detect_final_norm(model, stack, blocks_ids, example)
            scales = ScaleFactory(branch_scale, len(stack.handlers), layerscale_init)
            for h in stack.handlers:
                change = _convert_block(h, placement, scales, shared.get(h.path), captured.get(h.path), report)
                report.blocks.append(change)
                if change.status == "skipped" and strict:
                    raise PlacementError(f"strict conversion: block {h.path} ({change.kind}) skipped: {change.reason}")
                if change.status == "converted":
                    done.append((h, change.before))
            _final_norm_step(model, stack, placement, final_norm, strict, report)
    except PlacementError:
        for h, before in reversed(done):  # leave the model as it was
            if before == "post":
                h.to_post()
            elif before == "pre":
                h.to_pre(ScaleFactory(None, 1, None))
        raise

    block_change = max(_block_changes(report), default=0.0)
    if model_before is not None and report.changed:
        after = _first_tensor(_run_model(model, example))
        report.output_change = _rel_change(model_before, after)
        report.output_change_scope = "model"
    elif report.changed:
        report.output_change = block_change
        report.output_change_scope = "blocks"
    else:
        report.output_change, report.output_change_scope = 0.0, "model" if model_before is not None else "blocks"
    report.preserves_function = (report.output_change or 0.0) <= PRESERVE_TOLERANCE and not report.added and not report.removed
    return report


def _block_changes(report: ConversionReport):
    return [b.output_change for b in report.blocks if b.output_change is not None]


def _convert_block(h: Handler, placement: str, scales: ScaleFactory, shared_reason, captured, report) -> BlockChange:
    info = h.info()
    before = info.placement
    change = BlockChange(h.path, info.kind, "already", before, before)
    if shared_reason:
        change.status, change.reason = "skipped", shared_reason
        return change
    if before == placement:
        if scales.kind is not None:
            change.reason = "already pre-norm: branch_scale not applied (convert to 'post' first to re-convert with a scale)"
        return change
    reason = h.can_convert_to(placement)
    if reason:
        change.status, change.reason = "skipped", reason
        return change
    try:
        args, kwargs = captured if captured is not None else _synthetic_probe(h)
        with _eval_no_grad(h.block):
            if placement == "pre" and isinstance(h, HookedHandler):
                try:  # the plan against the user's forward, before anything changes
                    y_before = h.verify_written(args, kwargs)
                except CheckFailed as e:
                    change.status, change.reason = "skipped", f"probe check failed, block left unchanged: {e}"
                    return change
            else:
                y_before = _first_tensor(h.block(*args, **kwargs))
    except Exception as e:
        change.status, change.reason = "skipped", f"running the block on a probe input failed ({type(e).__name__}: {e}); pass example_input= to probe it with real inputs"
        return change
    try:
        added = h.to_pre(scales) if placement == "pre" else h.to_post()
    except Unrecognised as e:
        change.status, change.reason = "skipped", str(e)
        return change
    try:
        with _eval_no_grad(h.block):
            err, y_after = h.check(args, kwargs, placement)
        tol = CHECK_TOLERANCE.get(args[0].dtype if args and isinstance(args[0], torch.Tensor) else torch.float32, 1e-5)
        if not (err <= tol):
            raise CheckFailed(f"output differs from the {placement}-norm formula by {err:.2e} (relative; tolerance {tol:.0e})")
    except Exception as e:
        # Undo: a block we can't verify is left exactly as it was.
        if placement == "pre":
            h.to_post()
        else:
            h.to_pre(ScaleFactory(None, 1, None))
        reason = str(e) if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"
        change.status, change.reason = "skipped", f"probe check failed, block left unchanged: {reason}"
        return change
    if placement == "pre":
        report.added.extend(added)
    else:
        report.removed.extend(added)
    change.status, change.after, change.check_error = "converted", placement, err
    change.output_change = _rel_change(_first_tensor(y_before), _first_tensor(y_after))
    return change


def _final_norm_step(model, stack: _Stack, placement, final_norm, strict, report) -> None:
    converted = any(b.status == "converted" for b in report.blocks if b.path in {h.path for h in stack.handlers})
    pre = all(h.info().placement == "pre" for h in stack.handlers)
    if placement == "post":
        removed = _remove_added_final_norm(model, stack)
        if removed:
            report.removed.append(removed)
        return
    if not final_norm:
        return
    if not pre:
        if converted:
            report.notes.append(f"stack {stack.path}: not every block is pre-norm now (see the skipped blocks), so no final norm was added")
        return
    if stack.final_norm is not None:
        return
    if not stack.final_known:
        msg = f"stack {stack.path}: could not tell whether it has a final norm, so none was added: {stack.final_detail}"
        if strict:
            raise PlacementError("strict conversion: " + msg)
        report.notes.append(msg)
        return
    if stack.path == "":
        msg = f"the model itself is the stack ({type(stack.container).__name__}); there is no module to hold a final norm without renumbering its layers: wrap it in a module and convert that"
        if strict:
            raise PlacementError("strict conversion: " + msg)
        report.notes.append(msg)
        return
    path = _add_final_norm(model, stack)
    stack.final_norm = path
    report.added.append(path)
    if not converted:
        report.notes.append(f"stack {stack.path} was already pre-norm; added its missing final norm {path}")
