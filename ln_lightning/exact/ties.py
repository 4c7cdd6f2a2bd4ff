"""Weights shared by two modules (GPT-2's `wte` and `lm_head`): found, refused, or given their own copies.

Both rewrites change weights in place. A weight another module also holds would change that module too, so by
default the norm it concerns is refused with the tie named. With `untie=True` the module that must not change
gets its own copy of the weight first (and a Hugging Face config says `tie_word_embeddings=False`, so that saving
and loading keep the two apart); a weight read anywhere else than in the calls of the modules holding it (a
functional use) can't be untied and stays a refusal.
"""

from __future__ import annotations

import torch
from torch import nn

from ln_lightning.exact.graph import Traced


def sharing(t: Traced, name: str, p: torch.Tensor, calls: list, untie: bool) -> tuple[list[str], str]:
    """(the other names of `p`, why the rewrite can't change it: "" where it can, after untying those names)."""
    others = t.other_names(p, name)
    if others and not untie:
        return others, f"{name} is tied to {others[0]}: rewriting it would change that module too (untie=True gives it its own copy)"
    owners = [t.model.get_submodule(n.rpartition(".")[0]) for n in others]
    outside = t.param_readers_outside(p, calls + [c for m in owners for c in t.rec.module_calls(m)])
    if outside:
        return others, f"{name} is also read by {t.describe(outside[0])}"
    return others, ""


def own_copies(model: nn.Module, names: list[str]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Give each parameter slot in `names` its own copy of the tensor it holds; what `restore` needs to undo it."""
    undo = []
    for n in names:
        path, _, leaf = n.rpartition(".")
        owner = model.get_submodule(path)
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
        undo.append((owner, leaf, old))
    return undo


def untie_config(model: nn.Module, names: list[str]) -> bool:
    """Where a Hugging Face config ties the embeddings of a model holding one of the parameter slots `names` (the
    model itself, or one inside it: a LightningModule's), untie it, so that save / load and a later
    `tie_weights()` keep the copies apart."""
    untied = False
    for n in names:
        parts = n.split(".")[:-1]
        for i in range(len(parts) + 1):
            m = model.get_submodule(".".join(parts[:i]))
            cfg = getattr(m, "config", None)
            for c in (cfg, getattr(cfg, "get_text_config", lambda: None)() if cfg is not None else None):
                if c is not None and getattr(c, "tie_word_embeddings", False):
                    c.tie_word_embeddings = False
                    untied = True
    return untied


def restore(undo: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    for owner, leaf, old in reversed(undo):
        owner._parameters[leaf] = old
