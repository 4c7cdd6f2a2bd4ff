"""`ln-lightning inspect MODULE:FACTORY` and `ln-lightning demo`."""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys


def _load_factory(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"ln-lightning inspect: expected MODULE:FACTORY (e.g. mypkg.models:build_model), got {spec!r}")
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"ln-lightning inspect: cannot import {module_name!r}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"ln-lightning inspect: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj() if callable(obj) and not hasattr(obj, "named_modules") else obj


def main(argv: list[str]) -> int:
    from ln_lightning.placement import convert, inspect_model

    if argv[0] == "demo":
        return _demo(argv[1:])
    p = argparse.ArgumentParser(prog="ln-lightning inspect", description="Print a model's residual stacks and LayerNorm placement.")
    p.add_argument("factory", help="MODULE:FACTORY, a callable returning the model (or a module attribute holding it)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--placement", choices=["pre", "post"], help="also show what convert(placement=...) would change (on a copy)")
    p.add_argument("--branch-scale", default=None, help="with --placement: None, a float, 'depth' or 'layerscale'")
    p.add_argument("--no-final-norm", action="store_true", help="with --placement: don't add final norms")
    args = p.parse_args(argv[1:])
    model = _load_factory(args.factory)
    report = inspect_model(model)
    conversion = None
    if args.placement:
        scale = args.branch_scale
        if scale not in (None, "depth", "layerscale"):
            scale = float(scale)
        conversion = convert(copy.deepcopy(model), args.placement, final_norm=not args.no_final_norm, branch_scale=scale)
    if args.json:
        out = {"inspect": report.to_dict()}
        if conversion is not None:
            out["convert"] = conversion.to_dict()
        print(json.dumps(out, indent=2))
    else:
        print(report)
        if conversion is not None:
            print("\nWhat convert would change (computed on a copy; the model was not modified):")
            print(conversion)
    return 0


def _demo(argv: list[str]) -> int:
    import torch

    from ln_lightning.demo import PostNormTransformerLM
    from ln_lightning.placement import convert, inspect_model

    torch.manual_seed(0)
    model = PostNormTransformerLM(n_layers=4)
    print(inspect_model(model))
    print()
    print(convert(model, "pre", example_input=torch.randint(0, 128, (2, 32))))
    print()
    print(inspect_model(model))
    return 0
