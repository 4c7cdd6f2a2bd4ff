"""`inspect_model` and `convert`: find the stacks of residual blocks, rewrite them, check, report.

The parts: `discovery.py` finds blocks and reads them from a recorded forward (`recording.py`,
`analysis.py`); `final_norm.py` decides where a stack's final norm is or goes; `checks.py` checks
each rewritten block against what its recorded forward really does, and `black_box.py` against
its original modules run as black boxes, which no recording's blind spot can fool; `isolation.py`
refuses blocks that read state set outside their call; `options.py` validates the options;
`transaction.py` puts the model back exactly as it was when anything fails. This file runs them
in order and reports.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
from typing import Any

import torch
from torch import nn

from ln_lightning.placement.rewrite import final_norm as fn
from ln_lightning.placement.checking import isolation
from ln_lightning.placement.rewrite import deepnorm, hooks, ln_scaling
from ln_lightning.placement import state as rewrite_state
from ln_lightning.placement.reading.blocks import Handler, ScaleFactory, TorchLayerHandler
from ln_lightning.placement.checking.checks import CheckFailed, relative_error, tolerance
from ln_lightning.placement.reading.discovery import (CONTAINERS, Example, Found, Stack, discover, eval_no_grad, holders_of,
                                                      synthetic_probe)
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.reading.norms import norm_types
from ln_lightning.placement.options import mix_split, validate_options
from ln_lightning.placement.rewrite.sublayer_plan import Unrecognised
from ln_lightning.placement.report import BlockChange, ConversionReport, NormInfo, PlacementReport, StackInfo
from ln_lightning.placement.spec import PlacementSpec
from ln_lightning.placement.rewrite.transaction import Snapshot

PRESERVE_TOLERANCE = 1e-6


@contextlib.contextmanager
def _one_thread():
    # Probes are tiny: a thread pool costs more than it saves, and far more on a busy machine. The
    # cyclic garbage collector waits too: a recording holds thousands of objects (none in cycles),
    # which each of its passes would walk again (a quarter of a 96-block recording's time).
    # Probes run eagerly: a torch.compile'd model or submodule would otherwise have Dynamo trace the
    # recording's TorchFunctionMode, which it gets wrong (`Tensor.device` came back a torch.Size). Only
    # where Dynamo is loaded (a compiled module needs it): importing it costs seconds.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    collecting = gc.isenabled()
    gc.disable()
    eager = torch.compiler.set_stance("force_eager") if "torch._dynamo" in sys.modules else contextlib.nullcontext()
    try:
        with eager:
            yield
    finally:
        torch.set_num_threads(n)
        if collecting:
            gc.enable()


def _check_model(model: Any, fn_name: str) -> None:
    if not isinstance(model, nn.Module):
        raise PlacementError(f"{fn_name}() expects a torch.nn.Module, got {type(model).__name__}; pass the model (or LightningModule) itself")


def example_of(model: nn.Module, example_input: Any) -> Example | None:
    """The input convert runs the model on: the argument, `example_input_array`, a Hugging Face
    model's `dummy_inputs`, or made-up token ids (see `made_up_example`)."""
    if example_input is not None:
        return Example(example_input)
    ex = getattr(model, "example_input_array", None)
    if ex is not None:
        return Example(ex, source="example_input_array")
    for path, m in model.named_modules():
        if type(m).__module__.startswith("transformers.") and hasattr(type(m), "dummy_inputs"):
            try:
                return Example(m.dummy_inputs, path, source="dummy_inputs")
            except Exception:  # noqa: BLE001 - some families have none
                break
    return made_up_example(model)


def made_up_example(model: nn.Module) -> Example | None:
    """Token ids for the model, or for its outermost submodules that hold the embeddings.

    How often a block runs, and which module reads a stack's output, can only be seen in a forward;
    without an input of the user's, a model that embeds token ids can still be run on made-up ones.
    Which module takes them is found by trying (`discovery.observe_model`), outermost first.
    """
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None
    n = min(m.num_embeddings for m in embeddings)
    ids = torch.randint(0, n, (2, 8), generator=torch.Generator().manual_seed(0)).to(embeddings[0].weight.device)
    holding = holders_of(model, nn.Embedding)
    paths = [p for p, m in model.named_modules() if not isinstance(m, (nn.Embedding, *CONTAINERS)) and id(m) in holding]
    return Example(ids, paths[0], made_up=True, fallbacks=paths[1:], source="made up") if paths else None


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


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
                out[p] = f"one norm module is shared with block(s) {', '.join(others)}; give each block its own norm"
    return out


def _discover(model: nn.Module, example: Example | None) -> Found:
    try:
        return discover(model, example)
    except Exception as e:
        if example is None or example.source != "dummy_inputs":
            raise PlacementError(
                f"running {type(model).__name__} on its example input failed ({type(e).__name__}: {str(e)[:200]}); "
                "pass an example_input= the model's forward accepts"
            ) from e
        # Hugging Face's dummy_inputs are a guess that some families' forwards reject (Wav2Vec2 has no
        # input_ids; Pegasus and M2M100 on transformers 5.24 pass decoder ids twice). Each block can
        # still be read alone on a probe; where it can't, it is reported, and nothing changes.
        found = discover(model, None)
        example.value = None
        found.notes.append(
            f"{type(model).__name__}'s dummy_inputs did not run ({type(e).__name__}: {str(e)[:120]}), so each block was read "
            "alone on a probe tensor; pass example_input= to read them in the model's own forward"
        )
        return found


def inspect_model(model: nn.Module, *, example_input: Any = None) -> PlacementReport:
    """Describe every stack of residual blocks, their norms' placement and every norm; change nothing.

    Args:
        model: any nn.Module (a LightningModule too).
        example_input: optional input for `model(...)` (a tensor, a tuple of args or a dict of kwargs).
            The model is run once on it to read each block's structure with its real inputs, how often
            each block runs and whether a stack has a final norm. Defaults to `model.example_input_array`,
            or a Hugging Face model's `dummy_inputs`; without any, each block runs on a probe tensor.

    Example::

        >>> from ln_lightning.demo import PostNormTransformerLM
        >>> report = inspect_model(PostNormTransformerLM(n_layers=2))
        >>> [b.placement for b in report.blocks]
        ['post', 'post']
    """
    _check_model(model, "inspect_model")
    with _one_thread():
        found = _discover(model, example_of(model, example_input))
        report = PlacementReport(model=type(model).__name__, notes=list(found.notes))
        for s in found.stacks:
            fn.detect(model, s, found)
            report.stacks.append(StackInfo(s.path, [h.info() for h in s.handlers], s.final_norm, s.final_known))
    report.unrecognised = found.unrecognised
    types = norm_types()
    for path, m in model.named_modules():
        if isinstance(m, types):
            shape = tuple(getattr(m, "normalized_shape", ()) or ())
            w = getattr(m, "weight", None)
            b = getattr(m, "bias", None)
            eps = getattr(m, "eps", None) or getattr(m, "variance_epsilon", None) or 0.0
            report.layernorms.append(NormInfo(path, hooks.original_class(m).__name__, shape, float(eps), w is not None, b is not None))
    return report


class _Default:
    """A keyword's default that convert can tell from the same value passed explicitly (beside a PlacementSpec,
    an explicit value is a second spelling of the request, refused); it reads as the value in the signature."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _given(value) -> bool:
    return not isinstance(value, _Default)


def _value(value):
    return value.value if isinstance(value, _Default) else value


def convert(
    model: nn.Module,
    placement: str | PlacementSpec = "pre",
    *,
    final_norm: bool = _Default(True),
    branch_scale: float | str | None = _Default(None),
    strict: bool = False,
    example_input: Any = None,
    layerscale_init: float | None = _Default(None),
    mix_post_blocks: int | None = _Default(None),
    norm_scale: str | None = _Default(None),
) -> ConversionReport:
    """Rewrite the norm placement of every recognised residual block, in place.

    `"pre"` turns `x <- LN(x + F(x))` into `x <- x + c * F(LN(x))`, reusing each sublayer's own
    LayerNorm module and parameters; `"post"` undoes it (and flips torch's `norm_first` layers back).
    Either every change is checked and reported, or the model is left bit-for-bit as it was.

    Args:
        model: the model (any nn.Module, a LightningModule too). Changed in place; never moved
            between devices or dtypes. Existing parameter names are kept.
        placement: "pre" (`x + F(N(x))`), "post" (`N(x + F(x))`), "peri" (`x + N_out(F(N(x)))`:
            Peri-LN, Gemma's sandwich; the added output norms are fresh norms of the input norm's class,
            shape and eps with the identity gain), "output" (`x + N(F(x))`, OLMo 2: the sublayer's own
            norm moves to the branch output), "mix" (Mix-LN: the first `mix_post_blocks` blocks of
            each stack post-norm, by default a quarter, the rest pre-norm) or "deepnorm" (DeepNorm on a post-norm
            model, `N(alpha x + G'(x))` with alpha = (2N)^(1/4) folded into each branch's last linear layer and
            its exit scaled by 1/alpha: the same function, see placement/rewrite/deepnorm.py). Or a PlacementSpec, which then holds
            `final_norm`, `branch_scale`, `layerscale_init`, `mix_post_blocks` and `norm_scale` (leave those keywords out), and no
            transition (convert rewrites at once; a transition runs under LNPlacement).
        final_norm: for "pre": give each converted stack that lacks one a final norm where the
            stack's output leaves it, run once per forward. It is a copy of the norm that produced
            the stack's output before (same class, eps and affine parameters, so the head keeps
            receiving features on the scale and offset it was trained with). "post" removes a
            final norm that convert added.
        branch_scale: None; a float c; "depth" (c = 1/sqrt(2L) for a stack of L blocks); or
            "layerscale" (a learnable per-channel c, initialised to `layerscale_init`, by default
            CaiT's rule: 0.1 up to 18 blocks, 1e-5 up to 24, 1e-6 deeper). A block whose branches can't take
            the scale (a branch that ends in a function, not a module call) is converted without it, and its
            `BlockChange.fallback` says so and why.
        strict: raise PlacementError instead of skipping a block that can't be converted, or converting one
            without the branch scale asked for (the model is then left unchanged).
        example_input: optional input for `model(...)` (tensor, tuple of args or dict of kwargs);
            defaults to `model.example_input_array` or a Hugging Face model's `dummy_inputs`. With
            it, blocks are read and checked with their real inputs, shared blocks and final norms
            are found from what the model does, and the report measures the whole output's change.

    Returns:
        A ConversionReport: every block (converted / already / skipped, with the reason), what was
        added or removed, and whether the model's function was preserved.

    Example::

        >>> from ln_lightning.demo import PostNormTransformerLM
        >>> model = PostNormTransformerLM(n_layers=2)
        >>> report = convert(model, "pre")
        >>> [b.status for b in report.blocks], report.added
        (['converted', 'converted'], ['blocks_final_norm'])
    """
    _check_model(model, "convert")
    if isinstance(placement, PlacementSpec):
        given = [k for k, v in (("final_norm", final_norm), ("branch_scale", branch_scale),
                                 ("layerscale_init", layerscale_init), ("mix_post_blocks", mix_post_blocks),
                                 ("norm_scale", norm_scale)) if _given(v)]
        if given:
            raise PlacementError(f"convert: {', '.join(given)} given beside a PlacementSpec, which holds them; set them in "
                                 "the PlacementSpec")
        if placement.transition is not None:
            raise PlacementError("convert rewrites at once, so it takes a PlacementSpec without a transition; a transition "
                                 "runs under LNPlacement (Trainer(plugins=[LNPlacement(spec)]))")
        spec = placement
        placement, final_norm, branch_scale = spec.placement, spec.final_norm, spec.branch_scale
        layerscale_init, mix_post_blocks, norm_scale = spec.layerscale_init, spec.mix_post_blocks, spec.norm_scale
    final_norm, branch_scale = _value(final_norm), _value(branch_scale)
    layerscale_init, mix_post_blocks, norm_scale = _value(layerscale_init), _value(mix_post_blocks), _value(norm_scale)
    validate_options(placement, final_norm=final_norm, branch_scale=branch_scale, strict=strict, layerscale_init=layerscale_init,
                     mix_post_blocks=mix_post_blocks, norm_scale=norm_scale)
    # The request, spelled once: what the report's options and the model's record are (its serialised form).
    spec = PlacementSpec(placement, final_norm=final_norm, branch_scale=branch_scale, layerscale_init=layerscale_init,
                         mix_post_blocks=mix_post_blocks, norm_scale=norm_scale)
    if isinstance(model._modules.get("ln_lightning_transition"), nn.Module):
        # Mid-transition the blocks compute a blend; rewriting them now would leave it half-undone.
        raise PlacementError(
            f"{type(model).__name__} is in a placement transition (ln_lightning_transition); end it first with "
            "ln_lightning.placement.migrate.transition.finish(model), then convert"
        )
    types = norm_types()
    if not any(isinstance(m, types) for m in model.modules()):
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
    with _one_thread():  # the snapshot too: its copies of every module's dicts would set off a full collection
        snapshot = Snapshot(model)
        try:
            return _convert(model, spec, strict, example_input)
        except BaseException:
            snapshot.restore()  # whatever failed, and wherever: the model is exactly as it was
            raise


def _convert(model, spec: PlacementSpec, strict: bool, example_input) -> ConversionReport:
    placement, final_norm, branch_scale = spec.placement, spec.final_norm, spec.branch_scale
    layerscale_init, mix_post_blocks, norm_scale = spec.layerscale_init, spec.mix_post_blocks, spec.norm_scale
    config = dict(spec.config)
    del config["placement"]
    options = {"final_norm": config.pop("final_norm"), "branch_scale": config.pop("branch_scale"), "strict": strict, **config}
    report = ConversionReport(model=type(model).__name__, placement=placement, options=options)
    example = example_of(model, example_input)
    found = _discover(model, example)
    report.notes.extend(found.notes)
    if example is not None and example.made_up and found.observation is not None:
        where = f"its submodule {example.path}" if example.path else "the model"
        report.notes.append(f"read from one forward of {where} on made-up token ids; pass example_input= to read it with your inputs")
    for u in found.unrecognised:
        report.notes.append(f"{u.path} ({u.kind}) looks like a block but was not recognised: {u.reason}")
        if strict:
            raise PlacementError(f"strict conversion: {u.path} ({u.kind}) was not recognised: {u.reason}")
    handlers = found.handlers
    if not handlers:
        msg = f"no residual blocks recognised in {type(model).__name__}"
        if strict:
            raise PlacementError(msg + "; declare your block class with ln_lightning.register_block")
        report.notes.append(msg)
        return report
    model_before = None
    if found.observation is not None:
        model_before = _first_tensor(found.observation.output)
    refused = {**_shared_norms(handlers), **fn.outside_uses(model, found)}
    if found.observation is not None:
        moving = {h.path for stack in found.stacks
                  for h, t in zip(stack.handlers, mix_split(placement, len(stack.handlers), mix_post_blocks)) if h.info().placement != t}
        outside, notes = isolation.outside_state(model, example, found, moving)
        refused = {**outside, **refused}
        report.notes.extend(notes)
    for stack in found.stacks:
        fn.detect(model, stack, found)
    if placement not in ("pre", "deepnorm"):  # (DeepNorm rewrites post-norm blocks only: an added final norm stays)
        for stack in found.stacks:  # first, so the blocks are checked without our final norm after them
            removed = fn.remove(model, stack)
            if removed:
                report.removed.append(removed)
                stack.final_norm = None
    norm_scaled: list[str] = []  # the blocks LayerNorm Scaling changed (a scale other than 1)
    for stack in found.stacks:
        scales = ScaleFactory(branch_scale, len(stack.handlers), layerscale_init)
        targets = mix_split(placement, len(stack.handlers), mix_post_blocks)
        scales.alpha = deepnorm.deepnorm_alpha(len(stack.handlers))  # placement "deepnorm": DeepNorm's alpha for this stack
        for index, (h, target) in enumerate(zip(stack.handlers, targets), start=1):
            probe, observed = None, None
            if found.observation is not None:
                probe = found.observation.inputs.get(id(h.block))
                observed = found.observation.block_output(h.block)
            change = _convert_block(h, target, scales, refused.get(h.path), probe, observed, report, model)
            report.blocks.append(change)
            if change.status == "skipped" and strict:
                raise PlacementError(f"strict conversion: block {h.path} ({change.kind}) skipped: {change.reason}")
            if change.fallback and strict:
                raise PlacementError(f"strict conversion: block {h.path} ({change.kind}) can't take branch_scale={branch_scale!r}: "
                                     f"{change.fallback}")
            if norm_scale is not None and _norm_scale_step(h, index, change, probe, report, strict) not in (None, 1.0):
                norm_scaled.append(h.path)
        if targets and targets[-1] not in ("post", "deepnorm"):
            _final_norm_step(model, stack, found, final_norm, strict, report, targets)

    if found.observation is not None and report.changed:
        with eval_no_grad(model), _counting_final_norms(model, found, report) as counts:
            after = _first_tensor(example.run(model))
        for path, n in counts.items():
            if n != 1:
                raise PlacementError(f"internal check: the final norm {path} ran {n} times in one forward (expected once); please report this")
        report.output_change = relative_error(after, model_before) if model_before is not None else None
        report.output_change_scope = "model"
    elif report.changed:
        block_changes = [b.output_change for b in report.blocks if b.output_change is not None]
        if block_changes:
            report.output_change, report.output_change_scope = max(block_changes), "blocks"
        else:
            # Only a final norm was added (or removed): no block-level figure says what that does.
            report.output_change, report.output_change_scope = None, "none"
            report.notes.append("the model's change was not measured (no example input); pass example_input= to measure it")
    else:
        report.output_change, report.output_change_scope = 0.0, "model" if model_before is not None else "blocks"
    preserved = report.output_change is not None and report.output_change <= PRESERVE_TOLERANCE
    # DeepNorm's branch scales (1/alpha, with alpha folded into the weights) are part of an exact reparameterisation,
    # added or removed with it.
    deepnormed = {b.path for b in report.converted if "deepnorm" in (b.before, b.after)}
    added, removed = ([p for p in paths if (p.rsplit(".", 1)[0] if "." in p else "") not in deepnormed]
                      for paths in (report.added, report.removed))
    report.preserves_function = preserved and not added and not removed
    if norm_scale is not None and report.changed:
        # LayerNorm Scaling is a training-dynamics choice: it never keeps a trained function (a 1-block stack aside,
        # whose scale is 1), whatever the probe measured.
        scaled = norm_scaled
        if scaled:
            report.preserves_function = False
            report.notes.append(
                f"norm_scale={norm_scale!r} (LayerNorm Scaling, Sun et al. 2025) multiplies the norm outputs of block l of each "
                f"stack by 1/sqrt(l) ({len(scaled)} block(s) scaled): a training-dynamics choice that changes what a trained "
                "model computes, not a rewrite that keeps its function; train or fine-tune after converting")
    if report.changed:
        _record(model, spec, report)
    return report


def _record(model, spec: PlacementSpec, report: ConversionReport) -> None:
    """Say on the model what it now computes (its RewriteState, ln_lightning.placement.state), so LNPlacement,
    checkpoints and export can tell a converted model from a fresh one. The marker is LNPlacement's to add."""
    previous = rewrite_state.of(model)
    if spec.placement == "post" and all(b.after == "post" for b in report.blocks):
        rewrite_state.detach(model)  # back to the model as it was written
        return
    config = spec.config
    converted = [(b.path, b.from_written) for b in report.converted]
    added, derived = list(report.added), dict(report.derived)
    if previous is not None:  # converted again: what the earlier rewrite did is still there
        here = {p for p, _ in converted}
        converted = [c for c in previous.converted if c[0] not in here] + converted
        added = [a for a in previous.added if a not in report.removed and a not in added] + added
        derived = {**{a: s for a, s in previous.derived.items() if a in added}, **derived}
    rewrite_state.attach(model, rewrite_state.RewriteState(config, converted=converted, added=added, derived=derived,
                                                           report=report.to_dict()))


def _convert_block(h: Handler, placement: str, scales: ScaleFactory, refused_reason, captured, observed, report,
                   model: nn.Module | None = None) -> BlockChange:
    info = h.info()
    before = info.placement
    change = BlockChange(h.path, info.kind, "already", before, before)
    if before == placement:
        if any(s.parallel for s in info.sublayers):
            change.reason = f"parallel-residual block (x + A(N1 x) + M(N2 x)): already {placement}-norm"
        if scales.kind is not None and placement == "pre":
            change.reason = "already pre-norm: branch_scale not applied (convert to 'post' first to re-convert with a scale)"
        return change
    if refused_reason:
        change.status, change.reason = "skipped", refused_reason
        return change
    reason = deepnorm_refusal(h, before, placement) or (None if placement == "deepnorm" else h.can_convert_to(placement, None))
    if reason:
        change.status, change.reason = "skipped", reason
        return change
    probe = captured if captured is not None else h.probe_args(synthetic_probe(h.block, h.stream_dim())[0][0])
    # A fresh copy for every run: a KV cache among the arguments is written by each call. Tensors
    # passed directly are never written by a forward: they are shared, not copied.
    shared = {id(v): v for v in (*probe[0], *probe[1].values()) if isinstance(v, torch.Tensor)}
    fresh = lambda: copy.deepcopy(probe, dict(shared))  # noqa: E731
    y_before = observed  # the block's stream output in the recorded forward, when there was one
    if y_before is None:
        try:
            args, kwargs = fresh()
            with eval_no_grad(h.block):
                y_before = _first_tensor(h.block(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - the user's block refused the probe: a reason, not a crash
            change.status = "skipped"
            change.reason = f"running the block on a probe input failed ({type(e).__name__}: {e}); pass example_input= to probe it with real inputs"
            return change
    change.from_written = h.as_written()
    if placement == "deepnorm":
        _deepnorm_and_check(h, scales.alpha, fresh, y_before, change, report, model)
        return change
    # A block whose branches can't take the branch scale gets the rewrite without it, never no rewrite at all.
    why_unscaled = h.scale_refusal(placement, scales)
    done = _rewrite_and_check(h, placement, scales.without_scale() if why_unscaled else scales, fresh, y_before, change, report)
    if not done and not why_unscaled and _scales_branches(h, placement, scales):
        why_unscaled = f"the rewrite with the scale failed its check ({change.reason})"
        change.status, change.reason = "already", ""
        _rewrite_and_check(h, placement, scales.without_scale(), fresh, y_before, change, report)
    if why_unscaled and change.status == "converted":
        change.fallback = (f"converted without branch_scale={scales.kind!r} (its branches add unscaled, the plain "
                           f"{placement}-norm form): {why_unscaled}")
        change.reason = change.fallback
    return change


def _scales_branches(h: Handler, placement: str, scales: ScaleFactory) -> bool:
    """Whether the rewrite of `h` to `placement` puts `scales` on its branches (what a rewrite without them could do
    instead)."""
    return placement == "pre" and scales.kind is not None and not isinstance(h, TorchLayerHandler)


def _rewrite_and_check(h: Handler, placement: str, scales: ScaleFactory, fresh, y_before, change: BlockChange, report) -> bool:
    """Rewrite `h` to `placement` with `scales` and check it; on any failure put the block back as it was. Fills in
    `change` (converted, or skipped with the reason); True when converted."""
    args, kwargs = fresh()
    block_snapshot = Snapshot(h.block)
    try:
        deepnorm.undo(h)  # a DeepNorm block (to "post" only, see deepnorm_refusal): its linears divided back first
        removed_scales = ln_scaling.undo(h)  # LayerNorm Scaling's hooks, before the handler moves the norms' hooks
        added, removed = h.to(placement, scales)
        removed = removed_scales + removed
    except Unrecognised as e:
        block_snapshot.restore()
        change.status, change.reason = "skipped", str(e)
        return False
    try:
        with eval_no_grad(h.block):
            err, y_after = h.check(*fresh(), placement)
        stream = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        tol = tolerance(stream.dtype if stream is not None else torch.float32)  # by keyword too
        if not (err <= tol):
            raise CheckFailed(f"output differs from the {placement}-norm formula by {err:.2e} (relative; tolerance {tol:.0e})")
        with eval_no_grad(h.block):
            ref = h.reference_error(*fresh(), y_after)
        ref_err, slack = ref if ref is not None else (None, 0.0)
        if ref_err is not None and not (ref_err <= tol or ref_err <= tol + float(slack)):  # the bound only when needed
            change.status = "skipped"
            change.reason = (
                f"its output differs by {ref_err:.2e} (relative; tolerance {tol:.0e}) from its reference, the original modules "
                f"run as black boxes on the {placement}-norm inputs: the branch reads the stream somewhere the rewrite does not "
                "reach (a buffer written from it, `.data`, a copy out of torch, a kernel on raw storage); block left unchanged"
            )
            block_snapshot.restore()
            return False
    except CheckFailed as e:
        block_snapshot.restore()  # a block we can't verify is left exactly as it was
        change.status, change.reason = "skipped", f"probe check failed, block left unchanged: {e}"
        return False
    report.added.extend(added)
    report.removed.extend(removed)
    change.status, change.after = "converted", placement
    change.check_error = err if ref_err is None else max(err, ref_err)
    change.reference_error = ref_err
    change.output_change = relative_error(_first_tensor(y_after), y_before)
    return True


def _norm_scale_step(h: Handler, index: int, change: BlockChange, captured, report: ConversionReport, strict: bool) -> float | None:
    """LayerNorm Scaling (norm_scale="depth") on the block `h`, at 1-based depth `index` in its stack, once it is
    pre-norm: converted now, or pre-norm already (as written: GPT-2, ViT, torch's norm_first layers; or by an earlier
    rewrite). Checked in `ln_scaling.apply`. A block that can't take it is left pre-norm without it, and says so
    (BlockChange.fallback). Returns the scale applied (None: none)."""
    if change.status == "skipped" or change.after != "pre":
        return None
    if ln_scaling.has_norm_scale(h.block):
        return ln_scaling.depth_norm_scale(index)  # an earlier rewrite gave it the same scale (its stack, its depth)
    probe = captured if captured is not None else h.probe_args(synthetic_probe(h.block, h.stream_dim())[0][0])
    shared = {id(v): v for v in (*probe[0], *probe[1].values()) if isinstance(v, torch.Tensor)}
    fresh = lambda: copy.deepcopy(probe, dict(shared))  # noqa: E731
    stream = next((a for a in (*probe[0], *probe[1].values()) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    block_snapshot = Snapshot(h.block)
    try:
        added = ln_scaling.apply(h, index, fresh, tolerance(stream.dtype if stream is not None else torch.float32))
    except (Unrecognised, CheckFailed) as e:
        block_snapshot.restore()
        if change.status == "already":
            change.reason = f"already pre-norm; norm_scale='depth' (LayerNorm Scaling) not applied: {e}"
        else:
            change.fallback = f"converted without norm_scale='depth' (LayerNorm Scaling; plain pre-norm): {e}"
            change.reason = change.fallback
        if strict:
            raise PlacementError(f"strict conversion: block {h.path} ({change.kind}) can't take norm_scale='depth': {e}") from None
        return None
    report.added.extend(added)
    value = ln_scaling.depth_norm_scale(index)
    if change.status == "already":
        change.reason = f"already pre-norm: LayerNorm Scaling added (its norm outputs times 1/sqrt({index}) = {value:.4g})"
    return value


def deepnorm_refusal(h: Handler, before: str, placement: str) -> str | None:
    """Why `h` can't be rewritten from `before` to `placement` for DeepNorm's sake (None: it can, as far as that goes)."""
    if placement == "deepnorm" and before != "post":
        if before == "pre" and h.as_written():
            return ("DeepNorm is a post-norm form (LN(alpha*x + G(x))), and this block is pre-norm as written: a pre-norm "
                    "block has no post-norm form computing the same function, so there is no exact switch. Use "
                    "placement='pre' (with branch_scale or the LayerNorm Scaling norm_scale='depth' for depth), or "
                    "start from a post-norm model")
        return (f"DeepNorm rewrites a post-norm block, and this one computes {before}-norm now: convert the model to "
                "'post' first (ln_lightning.convert(model, 'post')), then to 'deepnorm'")
    if before == "deepnorm" and placement != "post":
        return (f"the block is DeepNorm-reparameterised (its branches' last linear layers hold alpha): convert the model to "
                f"'post' first (ln_lightning.convert(model, 'post') divides alpha back out), then to {placement!r}")
    return None


def _deepnorm_and_check(h: Handler, alpha: float, fresh, y_before, change: BlockChange, report, model) -> None:
    """Rewrite the post-norm block `h` to DeepNorm (`deepnorm.apply`) and check it; on any failure the block is put
    back as it was and reported skipped."""
    block_snapshot = Snapshot(h.block)
    args, kwargs = fresh()
    stream = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    tol = tolerance(stream.dtype if stream is not None else torch.float32)
    try:
        added, err = deepnorm.apply(h, alpha, fresh, y_before, tol, root=model)
    except (Unrecognised, CheckFailed) as e:
        block_snapshot.restore()
        change.status, change.reason = "skipped", f"not rewritten to DeepNorm, block left unchanged: {e}"
        return
    report.added.extend(added)
    change.status, change.after = "converted", "deepnorm"
    change.check_error = err
    change.output_change = err
    change.reason = f"alpha = {alpha:.4g} folded into the branches' last linear layers, their outputs scaled by 1/alpha"


def _final_norm_step(model, stack: Stack, found: Found, final_norm: bool, strict: bool, report: ConversionReport, targets: list[str]) -> None:
    converted = any(b.status == "converted" for b in report.blocks if b.path in {h.path for h in stack.handlers})
    done = all(h.info().placement == t for h, t in zip(stack.handlers, targets))
    if not final_norm:
        return
    if not done:
        if converted:
            report.notes.append(f"stack {stack.path}: not every block has the requested placement now (see the skipped blocks), so no final norm was added")
        return
    if stack.final_norm is not None:
        return
    if stack.continues_into is not None:
        report.notes.append(
            f"stack {stack.path}: final norm not added: its output is the stream of {stack.continues_into}, so the residual "
            "stream goes on there; a final norm belongs after the last block of the whole chain"
        )
        return
    if not stack.final_known:
        msg = f"stack {stack.path}: could not tell whether it has a final norm, so none was added: {stack.final_detail}"
        if strict:
            raise PlacementError("strict conversion: " + msg)
        report.notes.append(msg)
        if converted:  # its blocks now need a final norm that may be missing: not a finished conversion
            report.incomplete[stack.path] = f"could not tell whether the model applies a final norm after it: {stack.final_detail}"
        return
    template = fn.template_norm(stack)
    try:
        path = fn.add(model, stack, found)
    except fn.NotAdded as e:
        msg = f"stack {stack.path or '<root>'}: final norm not added: {e}; the converted stack has none"
        if strict:
            raise PlacementError("strict conversion: " + msg) from None
        report.notes.append(msg)
        if converted:
            report.incomplete[stack.path] = f"no final norm could be placed: {e}"
        return
    stack.final_norm = path
    report.added.append(path)
    source = next((p for p, m in model.named_modules() if m is template), None)
    if source is not None:
        report.derived[path] = source
    if not converted:
        report.notes.append(f"stack {stack.path} was already pre-norm; added its missing final norm {path}")
    streams = getattr(stack.handlers[-1], "streams", [])
    if len(streams) > 1:
        report.notes.append(
            f"stack {stack.path}: its blocks carry {len(streams)} streams ({', '.join(s.label for s in streams)}); the final norm "
            f"{path} is on the first, {streams[0].label}, only"
        )


@contextlib.contextmanager
def _counting_final_norms(model: nn.Module, found: Found, report: ConversionReport):
    """How many times each final norm convert added runs in the forward inside this block."""
    counts: dict[str, int] = {}
    handles = []
    for stack in found.stacks:
        added = fn.added_norm(model, stack)
        if added is not None and added[0] in report.added:
            path, norm = added
            counts[path] = 0

            def count(mod, args, out, path=path):
                counts[path] += 1

            handles.append(nn.Module.register_forward_hook(norm, count))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
