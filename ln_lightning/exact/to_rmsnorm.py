"""`to_rmsnorm(model)`: every LayerNorm whose input is mean-zero by construction becomes an RMSNorm, exactly.

    LayerNorm(x) = g * (x - mean(x)) / sqrt(var(x) + eps) + b
    RMSNorm(x)   = g * x / sqrt(mean(x^2) + eps) + b            equal when mean(x) = 0

A pre-norm model's LayerNorms read the residual stream. Centring the weights that write into it (`stream.py`)
makes the stream mean-zero at every position, and every LayerNorm reading only it becomes an RMSNorm with the
same eps, gain and bias (Jiang et al. 2023, "Pre-RMSNorm and Pre-CRMSNorm Transformers"). The bias is kept as an
added bias (`RMSNormWithBias`). The rewrite is measured on the example input and undone if the model's output
moved by more than float error (that would be a bug of ours: it raises).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ln_lightning.exact import graph, norms, stream, ties
from ln_lightning.exact.report import ExactRewriteReport, NormRewrite
from ln_lightning.placement.reading.norms import norm_types

# Beyond this relative change of the model's output on the example input the rewrite is a bug, not float error.
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_LOW_PRECISION_TOLERANCE = 5e-2


def tolerance(out: Any) -> float:
    dtypes = [t.dtype for t in graph.output_tensors(out)]
    return max((_TOLERANCE.get(d, _LOW_PRECISION_TOLERANCE) for d in dtypes), default=1e-4)


def all_norms(model: nn.Module) -> dict[str, nn.Module]:
    types = norm_types()
    return {name: m for name, m in model.named_modules() if name and isinstance(m, types)}


def captured_outputs(model: nn.Module, example: Any, modules: dict[str, nn.Module]) -> tuple[Any, dict[str, list[torch.Tensor]]]:
    """The model's output and what each module in `modules` returned (each real call, in order)."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in modules}
    handles = []
    for name, m in modules.items():
        def hook(mod, args, out, name=name):
            if isinstance(out, torch.Tensor):
                seen[name].append(out.detach().clone())
        handles.append(m.register_forward_hook(hook))
    try:
        out = graph.run(model, example)
    finally:
        for h in handles:
            h.remove()
    return out, seen


def per_module_error(before: dict[str, list], after: dict[str, list], name: str) -> float | None:
    pairs = list(zip(after.get(name, []), before.get(name, [])))
    return max((graph.relative_error(a, b) for a, b in pairs), default=None)


def _refusal(name: str, norm: nn.Module, traced: graph.Traced) -> str | None:
    """Why `norm` is not a candidate at all (before its input is read); None where it is one."""
    if not norms.is_layernorm(norm):
        spec = None if norms.is_rmsnorm(norm) else norms.foreign_spec(norm)
        if norms.is_rmsnorm(norm) or (spec is not None and spec.kind == "rms"):
            return "already an RMSNorm"
        cls = norms.own_class(norm)
        return f"not torch's nn.LayerNorm but {cls.__module__}.{cls.__qualname__}: only torch's class is rewritten"
    why = norms.why_not_layernorm(norm) or norms.read_by_its_owner(traced.model, name)
    if why:
        return why
    if "ln_lightning_transition" in norm.__dict__:
        return "a placement transition is in progress on it: finish the migration first"
    if not traced.of(norm):
        return "not called on the example input"
    return None


def to_rmsnorm(model: nn.Module, example_input: Any = None, *, fused: bool = False, untie: bool = False) -> ExactRewriteReport:
    """Rewrite, in place, every LayerNorm of `model` whose input is mean-zero once the weights writing into it are
    centred, into an RMSNorm with the same eps, gain and bias; return the report.

    The writing weights (each embedding table's rows, each Linear's output rows and bias, a parameter added to
    the stream) are centred first; that changes the model's function nowhere else, or the writer is left alone
    and the norms it writes into stay LayerNorms (refused in the report, with the reason). Each rewritten norm's
    output and the model's output are measured against the original on the example input.

    Args:
        model: the model (a `convert`-ed one computes its converted function and stays converted).
        example_input: what to call the model with (a tensor, a tuple of arguments, a dict of keyword
            arguments); by default the model's `example_input_array`.
        fused: the RMSNorms are `ln_lightning.norm.FusedRMSNorm` (with a bias: `FusedRMSNormWithBias`)
            instead of `torch.nn.RMSNorm` (`RMSNormWithBias`).
        untie: a writer whose weight another module shares (GPT-2's `wte` and `lm_head`) is centred after that
            module gets its own copy of the weight (reported; a Hugging Face config then says
            `tie_word_embeddings=False`); by default the norms it writes into are refused.

    Example::

        >>> import torch
        >>> from ln_lightning import convert, to_rmsnorm
        >>> from ln_lightning.demo.models import PostNormTransformerLM
        >>> lm = PostNormTransformerLM(vocab_size=64, d_model=32, n_layers=2, n_heads=4, block_size=16).eval()
        >>> ids = torch.randint(0, 64, (2, 16))
        >>> _ = convert(lm, "pre", example_input=ids)  # pre-norm, with a final norm
        >>> report = to_rmsnorm(lm, ids)
        >>> [(n.name, n.action) for n in report.norms][-1]
        ('blocks_final_norm', 'to_rmsnorm')
        >>> len(report.changed), report.output_error < 1e-5
        (5, True)
    """
    example = graph.resolve_example(model, example_input, "to_rmsnorm")
    found = all_norms(model)
    traced = graph.trace(model, example, found)
    report = ExactRewriteReport(type(model).__name__, "to_rmsnorm")

    # Which norms could become RMSNorms, and the writers each needs centred.
    needs: dict[str, list[stream.Writer]] = {}
    reasons: dict[str, str] = {}
    for name, norm in found.items():
        why = _refusal(name, norm, traced) or ""
        its_writers: dict[int, stream.Writer] = {}
        for n in traced.of(norm) if not why else ():
            ws, why = stream.writers_of_input(traced, n.input) if n.input is not None else ([], "it got no tensor")
            if why:
                break
            its_writers.update((w.key, w) for w in ws)
        if not why and not its_writers:
            why = "nothing writes its input"
        if why:
            reasons[name] = why
        else:
            needs[name] = list(its_writers.values())
    verdicts: dict[int, str] = {}
    for name, ws in needs.items():
        for w in ws:
            if w.key not in verdicts:
                verdicts[w.key] = stream.centring_is_invisible(traced, w, untie)
        blocked = next((w for w in ws if verdicts[w.key]), None)
        if blocked is not None:
            reasons[name] = f"its input is not centred by construction: {verdicts[blocked.key]}"
    chosen = [name for name in needs if name not in reasons]
    writers = {w.key: w for name in chosen for w in needs[name]}

    saved_params = {name: p.detach().clone() for w in writers.values() for name, p in w.tensors().items()}
    # The other holders of a writer's weight get its original values as their own; the writer is centred in place.
    tied = {name: traced.other_names(p, name) for w in writers.values() if w.module is not None
            for name, p in w.tensors().items() if traced.other_names(p, name)}
    undo_ties: list = []
    saved_classes = {name: (type(found[name]), dict(found[name]._parameters)) for name in chosen}
    before_out, before = captured_outputs(model, example, {n: found[n] for n in chosen})
    try:
        undo_ties = ties.own_copies(model, [o for others in tied.values() for o in others])
        for w in writers.values():
            stream.centre(w)
        for name in chosen:
            norms.to_rms_class(found[name], fused)
        after_out, after = captured_outputs(model, example, {n: found[n] for n in chosen})
        report.output_error = graph.relative_error(after_out, before_out)
        if not report.output_error <= tolerance(before_out):
            raise RuntimeError(
                f"to_rmsnorm changed {type(model).__name__}'s output by {report.output_error:.2e} (relative) on the "
                "example input, more than float error: the model was restored. This is a bug of ln_lightning's; "
                "please report it with the model"
            )
    except BaseException:
        ties.restore(undo_ties)
        _restore(writers, saved_params, found, saved_classes)
        raise

    for name, norm in found.items():
        if name in reasons:
            action = "skipped" if reasons[name] == "already an RMSNorm" else "refused"
            report.norms.append(NormRewrite(name, norms.own_class(norm).__name__, action, reasons[name]))
        else:
            cls = saved_classes[name][0]
            report.norms.append(NormRewrite(
                name, _plain_name(cls), "to_rmsnorm", f"now {norms.own_class(norm).__name__}",
                per_module_error(before, after, name)))
    report.changed_parameters = sorted(saved_params)
    if writers:
        names = ", ".join(sorted(w.name for w in writers.values()))
        report.notes.append(f"the weights writing into the stream were centred: {names}")
    if chosen and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        report.notes.append("exact in eval mode: in training, dropout on a branch's output leaves the stream not exactly "
                            "centred, so the RMSNorms then compute slightly other values than the LayerNorms did")
    for name, others in tied.items():
        report.notes.append(f"untied: {', '.join(others)} got its own copy of {name}, which was centred")
    if tied and ties.untie_config(model, [o for others in tied.values() for o in others]):
        report.notes.append("config.tie_word_embeddings set to False: saving and loading keep the untied copies apart")
    return report


def _plain_name(cls: type) -> str:
    return cls.__mro__[2].__name__ if getattr(cls, "ln_lightning_deferred", False) else cls.__name__


def _restore(writers, saved_params, found, saved_classes) -> None:
    with torch.no_grad():
        for w in writers.values():
            for name, p in w.tensors().items():
                p.copy_(saved_params[name])
    for name, (cls, params) in saved_classes.items():
        norms.restore_class(found[name], cls, params)
