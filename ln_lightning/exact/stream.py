"""Which weights write a norm's input, and whether centring them changes anything but that input.

A pre-norm LayerNorm reads the residual stream, a sum of what the embeddings and each branch's last layer wrote
into it. Walking back from the norm's input through the sums (and the ops that keep a mean-zero vector
mean-zero: a reshape, a transpose, a concatenation along the tokens, a multiply by a number) ends at its
*writers*: a Linear (or Hugging Face's Conv1D), an Embedding, a convolution, or a parameter added as it is
(ViT's class token and position embeddings). Centring a writer (subtracting, from each output vector it can
produce, its mean over the features) subtracts from its output, per token, its mean, which is exact linear
algebra on its weights:

    Linear    W <- W - 1 mean_rows(W),   b <- b - mean(b)      (TransformerLens' center_writing_weights)
    Embedding E[i] <- E[i] - mean(E[i])

Once every writer of a norm's input is centred, that input has mean zero and LayerNorm(x) = RMSNorm(x) with the
same gain, bias and eps (Jiang et al. 2023, Pre-RMSNorm). The centring is invisible to the rest of the model
only if everything it reaches (walking forward from each writer's output through the same ops) ends in a
LayerNorm over the features, which subtracts the mean anyway. Anything else that reads the stream (a post-norm
block's attention reading it directly, the model returning it, an RMSNorm, a weight tied to another module)
would see the change: that writer is not centred, and each norm it writes into keeps its LayerNorm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from ln_lightning.exact.graph import Traced, backward_terms, forward_dim
from ln_lightning.exact import norms as norm_kinds
from ln_lightning.exact import ties
from ln_lightning.placement.reading.recording import Event


@dataclass
class Writer:
    kind: str  # "linear" | "conv1d_hf" | "embedding" | "conv" | "parameter"
    name: str  # the module's path, or the parameter's name
    module: nn.Module | None
    param: torch.Tensor | None = None  # "parameter": the tensor
    dim: int = -1  # "parameter": the dimension to centre

    @property
    def key(self) -> int:
        return id(self.module if self.module is not None else self.param)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors centring changes, by name."""
        if self.module is None:
            return {self.name: self.param}
        return {f"{self.name}.{k}": p for k, p in self.module._parameters.items() if k in ("weight", "bias") and p is not None}


def is_hf_conv1d(m: nn.Module | None) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer with its weight stored as (in, out)."""
    return m is not None and type(m).__name__ == "Conv1D" and hasattr(m, "nf") and isinstance(getattr(m, "weight", None), torch.Tensor)


_CONV_OPS = {"conv1d", "conv2d", "conv3d"}


def _writer_op(e: Event, module: nn.Module) -> str | None:
    """The writer kind when `e` is the op by which `module` writes its output; else None."""
    if e.name == "linear" and isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return "linear"
    if e.name == "addmm" and is_hf_conv1d(module):
        return "conv1d_hf"
    if e.name == "embedding" and isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
        return "embedding"
    if e.name in _CONV_OPS and isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    return None


def _writer_kind(e: Event, module: nn.Module, rec) -> str | None:
    kind = _writer_op(e, module)
    return "embedding" if kind is None and _looks_up_own_weight(e, module, rec) else kind


def _looks_up_own_weight(e: Event, module: nn.Module | None, rec) -> bool:
    """An Embedding subclass whose forward computes its indices itself (OPT's learned positions add an offset) and
    looks them up in its own weight: what it writes is rows of that weight, as the plain module's is."""
    if e.name != "embedding" or not isinstance(module, nn.Embedding):
        return False
    w = e.input_value(("arg", 1))
    w = w if w is not None else e.input_value(("kwarg", "weight"))
    return w is not None and rec.values[w].tensor is module.weight


def _feature_dim(kind: str, module: nn.Module, out: torch.Tensor) -> int:
    """The output dimension a writer's features are on, as a negative index."""
    if kind == "conv":
        return -(len(module.kernel_size) + 1)
    return -1


def writer_of(t: Traced, v: int, fd: int) -> tuple[Writer | None, str]:
    """The writer whose output is value `v` (features on `fd`), or (None, why it can't be centred), or (None, "")
    when `v` is no writer's output."""
    rec = t.rec
    val = rec.values[v]
    if val.producer is None:
        names = t.param_names.get(id(val.tensor))
        if not names:
            return None, "it includes a tensor from outside the model (an input of its forward)"
        if val.tensor.dim() < -fd:
            return None, f"parameter {names[0]} is added along the features without a feature dimension"
        return Writer("parameter", names[0], None, val.tensor, val.tensor.dim() + fd), ""
    e = rec.events[val.producer]
    if not e.frames:
        return None, ""
    call = rec.events[e.frames[-1]]
    kind = _writer_kind(e, call.module, rec) if call.module is not None else None
    if kind is None:
        return None, ""
    if parametrize.is_parametrized(call.module):
        return None, f"{call.name}'s weight is computed by a parametrization (weight_norm, ...): it can't be centred"
    if fd != _feature_dim(kind, call.module, val.tensor):
        return None, f"{call.name}'s output reaches it with its features moved"
    # (a subclass may pass max_norm to the lookup itself: the lookup then writes its weight, in place)
    if kind == "embedding" and (call.module.max_norm is not None or any(w == ("written",) for w, _ in e.outputs)):
        return None, f"{call.name} renormalises its rows (max_norm): centring them changes that"
    if kind == "conv" and (call.module.groups != 1 or call.module.transposed):
        return None, f"{call.name} is a grouped or transposed convolution: its output can't be centred by its weights"
    return Writer(kind, call.name, call.module), ""


def writers_of_input(t: Traced, v: int) -> tuple[list[Writer], str]:
    """The writers whose outputs sum to value `v` (a norm's input, features last), or ([], why not centred)."""
    outputs = {n.output: n for n in t.normalisations if n.output is not None}
    found: dict[int, Writer] = {}
    seen: dict[int, int] = {}
    todo = [(v, -1)]
    while todo:
        u, fd = todo.pop()
        if u in seen:
            if seen[u] != fd:
                return [], "the same value reaches it along two different feature dimensions"
            continue
        seen[u] = fd
        if u in outputs:
            return [], (f"its input includes the output of norm {outputs[u].name}, which is not centred by construction "
                        "(a post-norm stream)")
        w, why = writer_of(t, u, fd)
        if why:
            return [], why
        if w is not None:
            found.setdefault(w.key, w)
            continue
        e = t.rec.events[t.rec.values[u].producer]
        terms, why = backward_terms(t.rec, e, u, fd)
        if terms is None:
            return [], f"{why} (in {t.where(e)})"
        todo.extend(terms)
    return list(found.values()), ""


def _start_values(t: Traced, w: Writer) -> list[tuple[int, int]]:
    """The values a writer writes (each call's), with their feature dimension."""
    if w.module is None:
        v = t.param_values.get(id(w.param))
        return [] if v is None else [(v, w.dim - w.param.dim())]
    out = []
    for call in t.rec.module_calls(w.module):
        for e in t.rec.within(call):
            if e.kind == "function" and e.frames and e.frames[-1] == call.index and _writer_kind(e, w.module, t.rec) == w.kind:
                v = e.outputs[0][1]
                out.append((v, _feature_dim(w.kind, w.module, t.value(v))))
    return out


def centring_is_invisible(t: Traced, w: Writer, untie: bool = False) -> str:
    """"" when centring `w` changes nothing but inputs of LayerNorms over the features (with `untie`: once the
    modules sharing its weights have their own copies); otherwise what would see it."""
    for name, p in w.tensors().items():
        if w.module is None:
            others = t.other_names(p, name)
            if others:  # a bare parameter under two names: its readers are followed below, its other holder isn't
                return f"{name} is also held as {others[0]}"
            continue
        _, why = ties.sharing(t, name, p, t.rec.module_calls(w.module), untie)
        if why:
            return why
    unread = unread_beside(t, w)
    if unread:
        return (f"{unread}, held beside {w.name}, was not read on the example input: a call that reads it (a mask "
                "token, ...) can write an uncentred term into the stream; the example can't show it doesn't")
    starts = _start_values(t, w)
    if not starts:
        return f"{w.name} was not seen writing on the example input"
    seen: dict[int, int] = {}
    todo = list(starts)
    while todo:
        u, fd = todo.pop()
        if seen.get(u) == fd:
            continue
        seen[u] = fd
        if u in t.root_outputs:
            return f"{w.name}'s output reaches the model's output without a LayerNorm in between"
        for e in t.readers(u):
            n = t.normalisation_reading(e, u)
            if n is not None:
                if norm_kinds.is_layernorm(n.norm) and fd == -1 and len(n.norm.normalized_shape) == 1:
                    continue  # a LayerNorm subtracts the mean itself: it does not see the centring
                return f"{w.name}'s output reaches norm {n.name}, which is not a LayerNorm over the features"
            if e.leaves:
                return f"{w.name}'s output is taken out of torch by {t.describe(e)}"
            nd, why = forward_dim(t.rec, e, u, fd)
            if nd is None:
                detail = f" (it {why})" if why else ""
                return f"{w.name}'s output is read by {t.describe(e)}, which would see the centring{detail}"
            todo.extend((o, nd) for _, o in e.outputs)
    return ""


def unread_beside(t: Traced, w: Writer) -> str:
    """A parameter of the module holding writer `w` (ViTEmbeddings' mask_token beside its patch projection, class
    token and position embeddings) that the example input never read, by name; "" where there is none."""
    path = w.name.rpartition(".")[0]
    holder = t.model.get_submodule(path)
    for k, p in holder._parameters.items():
        if p is not None and id(p) not in t.param_values:
            return f"{path}.{k}" if path else k
    return ""


def centre(w: Writer) -> None:
    """Subtract from each output vector `w` can write its mean over the features (in float64, then cast back)."""
    with torch.no_grad():
        if w.module is None:
            _centre(w.param, w.dim)
            return
        weight, bias = w.module._parameters.get("weight"), w.module._parameters.get("bias")
        _centre(weight, {"linear": 0, "conv": 0, "conv1d_hf": 1, "embedding": 1}[w.kind])
        if bias is not None and w.kind != "embedding":
            _centre(bias, 0)


def _centre(p: torch.Tensor, dim: int) -> None:
    x = p.detach().double()
    p.copy_((x - x.mean(dim, keepdim=True)).to(p.dtype))
