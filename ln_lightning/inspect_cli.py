"""`ln-lightning inspect MODULE:FACTORY` and `ln-lightning demo`.

A bad model or option is reported in one line on stderr with exit code 2, never a traceback
(set LN_LIGHTNING_TRACEBACK=1 to see one when reporting a bug).
"""

from __future__ import annotations

import copy
import importlib
import json
import sys

import torch
from torch import nn

from ln_lightning._cli_errors import CliError, OneLineParser, run
from ln_lightning.demo import PostNormTransformerLM
from ln_lightning.placement import convert, inspect_model
from ln_lightning.placement.spec import PlacementSpec


def _load_factory(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"expected MODULE:FACTORY (e.g. mypkg.models:build_model), got {spec!r}")
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CliError(f"cannot import {module_name!r}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if callable(obj) and not isinstance(obj, nn.Module):  # a factory function or a model class
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - the user's factory failed: say so in one line
            raise CliError(f"{spec}() raised {type(e).__name__}: {e}") from None

    if not isinstance(obj, nn.Module):
        raise CliError(f"{spec} is not an nn.Module (got {type(obj).__name__}); give a factory that returns the model")
    return obj


def _branch_scale(value: str | None):
    if value in (None, "None", "none"):
        return None
    if value in ("depth", "layerscale"):
        return value
    try:
        return float(value)
    except ValueError:
        raise CliError(f"--branch-scale {value!r} is not valid; use None, a positive float, 'depth' or 'layerscale'") from None


def main(argv: list[str]) -> int:
    return run(f"ln-lightning {argv[0] if argv else 'inspect'}", _main, argv)


def _main(argv: list[str]) -> int:
    if argv[0] == "demo":
        return _demo(argv[1:])
    p = OneLineParser(prog="ln-lightning inspect", description="Print a model's residual stacks and norm placement.")
    p.add_argument("factory", help="MODULE:FACTORY, a callable returning the model (or a module attribute holding it)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--placement", choices=["pre", "post", "deepnorm"], help="also show what convert(placement=...) would change (on a copy)")
    p.add_argument("--branch-scale", default=None, help="with --placement: None, a float, 'depth' or 'layerscale'")
    p.add_argument("--no-final-norm", action="store_true", help="with --placement: don't add final norms")
    p.add_argument("--norm-scale", choices=["depth"], default=None,
                   help="with --placement pre: LayerNorm Scaling, block l's norm outputs times 1/sqrt(l)")
    args = p.parse_args(argv[1:])
    if not args.placement and (args.branch_scale is not None or args.no_final_norm or args.norm_scale is not None):
        raise CliError("--branch-scale, --norm-scale and --no-final-norm describe a conversion: pass --placement pre (or post) "
                       "with them")
    # The request is checked before the model is built: a bad option fails fast, with the spec's message.
    spec = PlacementSpec(args.placement, final_norm=not args.no_final_norm, branch_scale=_branch_scale(args.branch_scale),
                         norm_scale=args.norm_scale) if args.placement else None
    model = _load_factory(args.factory)
    report = inspect_model(model)
    conversion = None
    if spec is not None:
        conversion = convert(copy.deepcopy(model), spec)
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
    torch.manual_seed(0)
    model = PostNormTransformerLM(n_layers=4)
    print(inspect_model(model))
    print()
    print(convert(model, "pre", example_input=torch.randint(0, 128, (2, 32))))
    print()
    print(inspect_model(model))
    return 0
