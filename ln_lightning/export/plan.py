"""What a converted model's rewrite computes, as data: the plan the remote code re-installs without ln_lightning.

Read from the model itself (its hooks, deferred norms, added modules, markers and transition), not from the
configuration it was asked for, so that the plan says what the model computes; what the rewrite tags on modules
is read through the modules that own the tags (`migrate.blend.stream_sites`, `rewrite.ln_scaling.scaled_norms`). Paths are relative to the model
given (the one being saved). Anything of the rewrite this module does not know how to describe is refused
(PlacementError): a plan that left it out would load as another function.

    {"deferred": [[norm path, blended]], "hooks": [{"at", "type", ...}], "added": [[path, spec]],
     "markers": [[owner path, bytes]], "transition": bool}
"""

from __future__ import annotations

from torch import nn

from ln_lightning.placement.migrate import blend
from ln_lightning.placement.rewrite import hooks, ln_scaling
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.rewrite.scale import BranchScale, InputScale

MARKER = "ln_lightning_placement"  # the rewrite's marker buffer (ln_lightning.placement.state.MARKER)


def _path_of(paths: dict[int, str], module: nn.Module, what: str) -> str:
    path = paths.get(id(module))
    if path is None:
        raise PlacementError(f"the rewrite's {what} ({type(module).__name__}) is not a submodule of the model being saved")
    return path


def _describe_added(model: nn.Module, path: str, derived: dict[str, str]) -> dict:
    module = model.get_submodule(path)
    cls = hooks.original_class(module)
    if isinstance(module, BranchScale):
        value = module.value()
        return {"kind": "branch_scale", "learnable": bool(module.learnable), "dim": int(value.numel()),
                "value": float(value.flatten()[0]) if not module.learnable else 0.0}
    if isinstance(module, InputScale):
        return {"kind": "input_scale", "value": float(module.value())}
    if issubclass(cls, nn.LayerNorm):  # FusedLayerNorm too: the same parameters and function
        return {"kind": "layer_norm", "shape": list(module.normalized_shape), "eps": float(module.eps),
                "affine": bool(module.elementwise_affine), "bias": module.bias is not None}
    if issubclass(cls, nn.RMSNorm):
        return {"kind": "rms_norm", "shape": list(module.normalized_shape), "eps": module.eps,
                "affine": bool(module.elementwise_affine)}
    source = derived.get(path)
    if source is not None and hooks.original_class(model.get_submodule(source)) is cls:
        return {"kind": "copy", "of": source}
    raise PlacementError(
        f"{path} ({cls.__name__}), added by the rewrite, is not a norm or branch scale the remote code can rebuild"
    )


def hook_plan(model: nn.Module, *, added: list[str], derived: dict[str, str], markers: dict[str, int],
              transition: blend.Transition | None) -> dict:
    """The plan of `model`'s rewrite. `added`, `derived`: the record's (relative to `model`); `markers`: owner
    path -> marker length; `transition`: the rewrite's transition module (also when it lives outside `model`)."""
    paths = {id(m): p for p, m in model.named_modules()}
    plan: dict = {"deferred": [], "hooks": [], "added": [], "markers": sorted([p, n] for p, n in markers.items()),
                  "transition": transition is not None}
    if transition is not None and len(transition.frozen):
        raise PlacementError(
            "the model is mid-way through a stream-scaled transition to 'output': its call sites normalise with the "
            "trained gains the transition keeps aside, which the saved model's remote code does not rebuild. Save it "
            "once the transition has ended (or finish it: ln_lightning.placement.migrate.transition.finish(model)); to "
            "continue it, keep the Lightning checkpoint (load_converted / Trainer.fit(ckpt_path=...))")
    if transition is not None and transition.scaled:
        # The stream-scaled blend: which norm reads which of the transition's scales (they load with the weights).
        plan["stream"] = blend.stream_sites(model)
        if len(plan["stream"]["sites"]) != transition.site_before.numel() or len(plan["stream"]["finals"]) != transition.final_scale.numel():
            raise PlacementError("the transition's stream-scaled sites are not all inside the model being saved (a "
                                 "submodule of the rewritten model): save the model the transition was started on")
    for path in added:
        try:
            model.get_submodule(path)
        except AttributeError:
            raise PlacementError(f"{path}, added by the rewrite, is not a module of the model being saved") from None
        plan["added"].append([path, _describe_added(model, path, derived)])
    for norm, scale in ln_scaling.scaled_norms(model):  # LayerNorm Scaling: which norm's output which scale multiplies
        plan["hooks"].append({"at": _path_of(paths, norm, "scaled norm"), "type": "norm_scale",
                              "scale": _path_of(paths, scale, "LayerNorm Scaling scale")})
    taps: dict[int, int] = {}
    for path, m in model.named_modules():
        if isinstance(m, (blend.BlendEncoderLayer, blend.BlendDecoderLayer)):
            raise PlacementError(f"{path}: a torch Transformer layer mid-transition has no Hugging Face remote-code form")
        if hooks.is_deferred(m):
            plan["deferred"].append([path, blend.blends(m)])
        for kind, table in (("pre", m._forward_pre_hooks), ("post", m._forward_hooks)):
            for h in table.values():
                entry = _describe_hook(h, path, kind, paths, taps, transition)
                if entry is not None:
                    plan["hooks"].append(entry)
    return plan


def _describe_hook(h, at: str, kind: str, paths, taps, transition) -> dict | None:
    blended = getattr(h, "transition", None) is not None
    if blended and h.transition is not transition:
        raise PlacementError(f"{at}: a hook blends with another transition than the rewrite's")
    if isinstance(h, hooks.NormalizeBranchInput):
        return {"at": at, "type": "entry", "norm": _path_of(paths, h.norm, "entry norm"), "args": list(h.arg_positions),
                "kwargs": list(h.kwarg_names), "blend": blended}
    if isinstance(h, hooks.NormalizeBranchOutput):
        return {"at": at, "type": "exit_norm", "norm": _path_of(paths, h.norm, "output norm"), "index": h.index,
                "deferred": bool(h.deferred), "blend": blended}
    if isinstance(h, hooks.ScaleBranchOutput):
        if h.scale is None:
            return None
        return {"at": at, "type": "exit_scale", "scale": _path_of(paths, h.scale, "branch scale"), "index": h.index,
                "blend": blended}
    if isinstance(h, blend.BlendFinalNorm):
        return {"at": at, "type": "final_blend"}
    if isinstance(h, hooks.ApplyFinalNorm):
        return {"at": at, "type": "final", "norm": _path_of(paths, h.norm, "final norm")}
    if isinstance(h, hooks.TapStream):
        taps.setdefault(id(h), len(taps))
        return {"at": at, "type": "tap", "tap": taps[id(h)]}
    if isinstance(h, (hooks.ApplyFinalNormAtExit, hooks.ApplyFinalNormAtConsumer)):
        tap = taps.setdefault(id(h.tap), len(taps))
        return {"at": at, "type": "final_at_exit" if isinstance(h, hooks.ApplyFinalNormAtExit) else "final_at_consumer",
                "norm": _path_of(paths, h.norm, "final norm"), "tap": tap, "stack": h.stack}
    if isinstance(h, hooks.OUR_HOOK_TYPES):  # pragma: no cover - a hook type added to the engine without a plan entry
        raise PlacementError(f"{at}: the rewrite's {type(h).__name__} has no remote-code form yet")
    return None  # not the rewrite's (a monitor's, Hugging Face's own output capture): not part of what it computes
