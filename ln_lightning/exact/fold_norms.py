"""`fold_norms(model)`: each norm's gain and bias folded into the linear layers that read its output (inference).

A norm computes `y = g * n(x) + beta` (`n`: LayerNorm's or RMSNorm's normalisation). Where every reader of `y`
is a linear layer `W y + b`, that is

    W (g * n + beta) + b = (W diag(g)) n + (W beta + b)

so each reader gets `W' = W diag(g)` (its weight's input columns scaled) and `b' = b + W beta`, and the norm
keeps only its normalisation: `elementwise_affine=False`, no weight and no bias, so nothing multiplies at run
time and nothing is left to train by mistake (FlashNorm; TransformerLens' `fold_ln`). A reader without a bias
gets one where the norm has a bias. A norm whose output anything else reads (a residual add, an activation,
the model's output), or whose reader's weight is tied to another module (GPT-2's `lm_head` and `wte`), is
refused with the reason. The model's output is measured on the example input; a change beyond float error
undoes the rewrite and raises (a bug of ours).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ln_lightning.exact import graph, norms, ties
from ln_lightning.exact.report import ExactRewriteReport, NormRewrite
from ln_lightning.exact.stream import is_hf_conv1d
from ln_lightning.exact.to_rmsnorm import all_norms, captured_outputs, per_module_error, tolerance


def _foldable_reader(m: nn.Module | None) -> bool:
    return (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward) or is_hf_conv1d(m)


# Ops readers_of follows from a norm's output to its linear readers: they pass it on unchanged (no negation: a
# negated output would fold its bias with the wrong sign).
_PASSED_ON = graph.RESHAPE | (graph.SAME_SHAPE - graph.NEGATE) | graph.INDEX


def _hf_model_holding(model: nn.Module, path: str) -> str:
    """The class name of the Hugging Face model (a module with a `config` and `save_pretrained`) holding `path`."""
    parts = path.split(".")
    for i in range(len(parts)):
        m = model.get_submodule(".".join(parts[:i]))
        if hasattr(m, "config") and callable(getattr(type(m), "save_pretrained", None)):
            return type(m).__name__
    return ""


def _identity(spec) -> bool:
    """A foreign norm (its class keeps a gain) already folded: gain 1 (offset applied), no bias or a zero one."""
    if spec is None or spec.weight is None:
        return False
    gain = spec.weight.detach() + spec.weight_offset
    return bool((gain == 1).all()) and (spec.bias is None or not bool(spec.bias.detach().ne(0).any()))


def _call_input(call) -> int | None:
    v = call.input_value(("arg", 0))
    return v if v is not None else call.input_value(("kwarg", "input"))


def readers_of(t: graph.Traced, out: int) -> tuple[dict[int, tuple[str, nn.Module]], set[int], str]:
    """The linear layers reading value `out` (a norm's output) with the values they read it as, or why not only they."""
    found: dict[int, tuple[str, nn.Module]] = {}
    reached: set[int] = set()
    todo = [out]
    while todo:
        u = todo.pop()
        if u in reached:
            continue
        reached.add(u)
        if u in t.root_outputs:
            return {}, reached, "its output is the model's output"
        for e in t.readers(u):
            call = next((t.rec.events[f] for f in e.frames
                         if _foldable_reader(t.rec.events[f].module) and _call_input(t.rec.events[f]) == u), None)
            if call is not None:
                found[id(call.module)] = (call.name, call.module)
                continue
            if e.name in _PASSED_ON and e.input_value(("arg", 0)) == u:
                nd, _ = graph.forward_dim(t.rec, e, u, -1)
                if nd == -1:
                    todo.extend(o for _, o in e.outputs)
                    continue
            return {}, reached, f"its output is read by {t.describe(e)}, not only by linear layers"
    if not found:
        return {}, reached, "no linear layer reads its output"
    return found, reached, ""


def _fold_into(module: nn.Module, gain: torch.Tensor | None, beta: torch.Tensor | None) -> bool:
    """Fold into one reader; True where it had no bias and got one."""
    w = module.weight
    wd = w.detach().double()
    conv1d = is_hf_conv1d(module)  # weight (in, out)
    added = False
    with torch.no_grad():
        if beta is not None:
            shift = beta.detach().double() @ wd if conv1d else wd @ beta.detach().double()
            if module.bias is None:
                module.bias = nn.Parameter(shift.to(w.dtype), requires_grad=w.requires_grad)
                added = True
            else:
                module.bias.copy_((module.bias.detach().double() + shift).to(module.bias.dtype))
        if gain is not None:
            g = gain.detach().double()
            w.copy_((wd * (g[:, None] if conv1d else g[None, :])).to(w.dtype))
    return added


def fold_norms(model: nn.Module, example_input: Any = None, *, untie: bool = False) -> ExactRewriteReport:
    """Fold, in place, each norm's gain and bias into the linear layers that alone read its output; the norm then has
    `elementwise_affine=False`. Returns the report: per norm the readers it went into, or why it was refused, and
    the largest relative change of those readers' outputs and of the model's output on the example input.

    For inference: a folded model computes the same function, but the gain no longer exists as its own parameter.

    Args:
        model: the model (torch `nn.LayerNorm` / `nn.RMSNorm`, ln_lightning's fused ones and `to_rmsnorm`'s norms
            are folded; readers are `nn.Linear` and Hugging Face's `Conv1D`).
        example_input: what to call the model with; by default the model's `example_input_array`.
        untie: a reader whose weight another module shares (GPT-2's `lm_head` and `wte`) gets its own copy and is
            folded into (reported; a Hugging Face config then says `tie_word_embeddings=False`); by default that
            norm is refused.

    Example::

        >>> import torch
        >>> from ln_lightning import fold_norms
        >>> from ln_lightning.demo.models import PostNormTransformerLM
        >>> lm = PostNormTransformerLM(vocab_size=64, d_model=32, n_layers=2, n_heads=4, block_size=16).eval()
        >>> report = fold_norms(lm, torch.randint(0, 64, (2, 16)))  # post-norm: a residual add reads each norm
        >>> [(n.action, n.reason) for n in report.norms][-2:]
        [('refused', 'its output is read by `add` in blocks.1, not only by linear layers'), ('folded', 'into head')]
    """
    example = graph.resolve_example(model, example_input, "fold_norms")
    found = all_norms(model)
    traced = graph.trace(model, example, found)
    report = ExactRewriteReport(type(model).__name__, "fold_norms")

    reasons: dict[str, str] = {}
    targets: dict[str, dict[int, tuple[str, nn.Module]]] = {}
    specs: dict[str, object] = {}  # foreign norm classes: what they compute
    for name, norm in found.items():
        why = ""
        if not (norms.is_layernorm(norm) or norms.is_rmsnorm(norm)):
            specs[name] = norms.foreign_spec(norm)
            if specs[name] is None:
                why = f"{norms.own_class(norm).__name__} was not recognised as a LayerNorm or RMSNorm over the features"
        why = why or norms.read_by_its_owner(model, name)
        if why:
            pass
        elif all(p is None for p in norms.gain_and_bias(norm, specs.get(name))) or _identity(specs.get(name)):
            why = "no gain or bias to fold"
        elif "ln_lightning_transition" in norm.__dict__:
            why = "a placement transition is in progress on it: finish the migration first"
        elif not traced.of(norm):
            why = "not called on the example input"
        readers: dict[int, tuple[str, nn.Module]] = {}
        reached: set[int] = set()
        for n in traced.of(norm) if not why else ():
            if n.output is None:
                why = "it returned no tensor"
                break
            rs, seen, why = readers_of(traced, n.output)
            if why:
                break
            readers.update(rs)
            reached |= seen
        beta = None if why else norms.gain_and_bias(norm, specs.get(name))[1]
        for rname, module in readers.values() if not why else ():
            calls = traced.rec.module_calls(module)
            for k, p in module._parameters.items():
                if p is not None and not why:
                    why = ties.sharing(traced, f"{rname}.{k}", p, calls, untie)[1]
            if not why and any(_call_input(c) not in reached for c in traced.rec.module_calls(module)):
                why = f"{rname} is also called on another input"
            if not why and parametrize.is_parametrized(module):
                why = f"{rname}'s weight is computed by a parametrization (weight_norm, ...): it can't be folded into"
            adds_bias = beta is not None and bool(beta.detach().ne(0).any()) and module._parameters.get("bias") is None
            hf = _hf_model_holding(model, rname) if adds_bias and not why else ""
            if hf:  # from_pretrained would drop the bias fold_norms adds there, without an error (a zero one: harmless)
                why = (f"its bias would go into {rname}, which {hf} builds without a bias: a model saved with "
                       "save_pretrained would load without it, as another function")
            if why:
                break
        if why:
            reasons[name] = why
        else:
            targets[name] = readers
    claimed: dict[int, list[str]] = {}
    for name, readers in targets.items():
        for key in readers:
            claimed.setdefault(key, []).append(name)
    for name, readers in targets.items():
        shared = next((readers[k][0] for k in readers if len(claimed[k]) > 1), None)
        if shared is not None:
            reasons[name] = f"{shared} also reads another norm's output"
    chosen = [n for n in targets if n not in reasons]

    modules = {rname: m for n in chosen for rname, m in targets[n].values()}
    saved = {rname: {k: (None if p is None else p.detach().clone()) for k, p in m._parameters.items()} for rname, m in modules.items()}
    had_bias = {rname: m._parameters.get("bias") is not None for rname, m in modules.items()}
    saved_norms = {n: (dict(found[n]._parameters), found[n].__dict__.get("elementwise_affine"), found[n].__dict__.get("weight_offset"))
                   for n in chosen if specs.get(n) is None}
    saved_foreign = {n: {k: p.detach().clone() for k, p in found[n]._parameters.items() if p is not None}
                     for n in chosen if specs.get(n) is not None}
    before_out, before = captured_outputs(model, example, modules)
    tied = {f"{rname}.{k}": traced.other_names(p, f"{rname}.{k}") for rname, m in modules.items()
            for k, p in m._parameters.items() if p is not None and traced.other_names(p, f"{rname}.{k}")}
    undo_ties: list = []
    try:
        undo_ties = ties.own_copies(model, list(tied))  # the reader gets its own copy; the other holder keeps the original
        for n in chosen:
            gain, beta = norms.gain_and_bias(found[n], specs.get(n))
            for rname, m in targets[n].values():
                if _fold_into(m, gain, beta):
                    report.added_parameters.append(f"{rname}.bias")
                if gain is not None:
                    report.changed_parameters.append(f"{rname}.weight")
                if beta is not None and f"{rname}.bias" not in report.added_parameters:
                    report.changed_parameters.append(f"{rname}.bias")
            if specs.get(n) is not None:
                norms.make_identity(specs[n])
                report.changed_parameters.extend(f"{n}.{k}" for k, p in found[n]._parameters.items() if p is not None)
            else:
                norms.drop_affine(found[n])
        after_out, after = captured_outputs(model, example, modules)
        report.output_error = graph.relative_error(after_out, before_out)
        if not report.output_error <= tolerance(before_out):
            raise RuntimeError(
                f"fold_norms changed {type(model).__name__}'s output by {report.output_error:.2e} (relative) on the "
                "example input, more than float error: the model was restored. This is a bug of ln_lightning's; "
                "please report it with the model"
            )
    except BaseException:
        ties.restore(undo_ties)
        with torch.no_grad():
            for rname, m in modules.items():
                for k, p in saved[rname].items():
                    if p is not None:
                        m._parameters[k].copy_(p)
                if not had_bias[rname] and m._parameters.get("bias") is not None:
                    m.bias = None
        with torch.no_grad():
            for n, values in saved_foreign.items():
                for k, v in values.items():
                    found[n]._parameters[k].copy_(v)
        for n, (params, affine, offset) in saved_norms.items():
            found[n]._parameters.update(params)
            if affine is not None:
                found[n].elementwise_affine = affine
            if offset is not None:
                found[n].weight_offset = offset
            else:
                found[n].__dict__.pop("weight_offset", None)
        raise

    for name, norm in found.items():
        kind = norms.own_class(norm).__name__
        if name in reasons:
            action = "skipped" if reasons[name] in ("no gain or bias to fold",) else "refused"
            report.norms.append(NormRewrite(name, kind, action, reasons[name]))
        else:
            into = sorted(r for r, _ in targets[name].values())
            err = max((e for e in (per_module_error(before, after, r) for r in into) if e is not None), default=None)
            detail = "into " + ", ".join(into)
            if specs.get(name) is not None:
                detail += f" (its class keeps a gain: set to {1.0 - specs[name].weight_offset:g})"
            report.norms.append(NormRewrite(name, kind, "folded", detail, err))
    report.changed_parameters.sort()
    for name, others in tied.items():
        report.notes.append(f"untied: {name} got its own copy (it was shared with {', '.join(others)})")
    if tied and ties.untie_config(model, list(tied)):
        report.notes.append("config.tie_word_embeddings set to False: saving and loading keep the untied copies apart")
    return report
