"""Convert, save, reload in a fresh process, compare with the converted model (issue 21's acceptance).

This process converts every family (and puts each mid-transition), computes the converted model's outputs, saves
it with ``ln_lightning.save_pretrained`` and with the model's own ``save_pretrained``, and writes ``torch.export``
programs (and ONNX files, where onnx is installed) of converted and mid-transition models. Two fresh processes
(tests/_helpers_export_child.py) then load everything: one where ln_lightning is **not importable** (plain
transformers: the Auto class, the family's own class, ``trust_remote_code=True``, the native class; torch.export;
ONNX), one through ``ln_lightning.from_pretrained`` (and saving that model again). Run with ``-s`` for the table.
One test runs every check of every key and lists each failure as ``CHECK[KEY]: message``, so that one pytest-xdist
worker, not both, builds what they read.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

T = pytest.importorskip("transformers")

from _helpers_export import CASES, converted, output, quiet_transformers, trained_looking  # noqa: E402
from ln_lightning import save_pretrained  # noqa: E402
from ln_lightning.export import remote_runtime  # noqa: E402

pytestmark = pytest.mark.slow
TOL = 1e-6
CHILD = Path(__file__).parent / "_helpers_export_child.py"
VARIANTS = {"converted": None, "mid-transition": 0.3}
KEYS = [f"{c.name}/{v}" for c in CASES for v in VARIANTS]
ONNX = importlib.util.find_spec("onnx") is not None and importlib.util.find_spec("onnxscript") is not None
ONNX_SKIP = "onnx and onnxscript are not installed (pip install onnx onnxscript; not in the dev extra: they pull protobuf and ml_dtypes)"


def _run_child(mode: str, root: Path) -> dict:
    env = {**os.environ, "HF_MODULES_CACHE": str(root / "hf_modules"), "TRANSFORMERS_VERBOSITY": "error"}
    # stdin closed: Hugging Face asks whether to run remote code when it can read an answer (a terminal)
    proc = subprocess.run([sys.executable, str(CHILD), mode, str(root)], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / f"{mode}.json").read_text())


def _exports(root: Path, refs: dict, manifest: dict) -> None:
    from torch import nn

    from ln_lightning import convert

    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    am, tt = torch.ones_like(ids), torch.zeros_like(ids)
    bert = [c for c in CASES if c.name == "bert-base"][0]
    for variant, blend in VARIANTS.items():
        model = converted(bert, transition_blend=blend)
        key = f"torch.export/bert/{variant}"
        refs[key] = {"args": (ids,), "expected": output(model, {"input_ids": ids})}
        torch.export.save(torch.export.export(model, (ids,)), root / f"bert-{variant}.pt2")
        manifest["exports"].append({"key": key, "file": str(root / f"bert-{variant}.pt2")})
        if ONNX:
            key = f"onnx/bert/{variant}"
            refs[key] = {"args": (ids, am, tt), "expected": output(model, {"input_ids": ids, "attention_mask": am, "token_type_ids": tt})}
            torch.onnx.export(model, (ids, am, tt), dynamo=True, verbose=False).save(root / f"bert-{variant}.onnx")
            manifest["onnx"].append({"key": key, "file": str(root / f"bert-{variant}.onnx")})
    torch.manual_seed(0)
    enc = trained_looking(nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 2,
                                                enable_nested_tensor=False)).eval()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    convert(enc, "pre", example_input=x)
    with torch.no_grad():
        refs["torch.export/nn.TransformerEncoder/converted"] = {"args": (x,), "expected": enc(x)}
    torch.export.save(torch.export.export(enc, (x,)), root / "encoder.pt2")
    manifest["exports"].append({"key": "torch.export/nn.TransformerEncoder/converted", "file": str(root / "encoder.pt2")})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    quiet_transformers()
    root = tmp_path_factory.mktemp("export_fresh")
    manifest, refs, routes = {"cases": [], "exports": [], "onnx": []}, {}, {}
    for case in CASES:
        for variant, blend in VARIANTS.items():
            key = f"{case.name}/{variant}"
            model = converted(case, transition_blend=blend)
            inputs = case.inputs()
            refs[key] = {"inputs": inputs, "expected": output(model, inputs),
                         "old": output(trained_looking(case.build()), inputs)}
            d = root / key.replace("/", "-")
            routes[key] = save_pretrained(model, d).route
            model.save_pretrained(str(d) + "-own")
            manifest["cases"].append({"key": key, "dir": str(d), "own_dir": str(d) + "-own", "cls": case.cls, "auto": case.auto,
                                      "native": case.native if routes[key] == "native" else None})
    _exports(root, refs, manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))
    torch.save(refs, root / "ref.pt")
    out = {"plain": _run_child("plain", root), "ours": _run_child("ours", root), "routes": routes}
    _print_table(out)
    return out


def _loaded(outcome: dict, what: str) -> dict:
    assert "loaded" in outcome, f"{what}: {outcome}"
    return outcome["loaded"]


# The checks, one function per kind, each run for every key by one test. They all read `results` (the conversions
# and two fresh processes, ~80 CPU seconds); as separate tests (49), `-n 2 --maxschedchunk 1` gave some to each
# worker and both workers built it (issue 32: 104 + 102 s in a CI run).


def _plain_transformers_without_ln_lightning(key, results):
    name, variant = key.split("/")
    case = [c for c in CASES if c.name == name][0]
    plain, route = results["plain"], results["routes"][key]
    assert plain["ln_lightning_importable"] is False
    assert route == ("remote_code" if variant == "mid-transition" else case.route)
    for label in ("", "own:"):  # ln_lightning.save_pretrained, and the converted model's own save_pretrained
        r = plain[key]
        if route == "native":
            for how in ("auto", "native", "trust"):
                got = _loaded(r[label + how], f"{key} {label}{how}")
                assert got["error"] <= TOL and got["class"] == case.native, (how, got)
                assert got["tied"] or not case.tied
        else:
            assert "trust_remote_code=True" in r[label + "auto"].get("refused", ""), r[label + "auto"]
            got = _loaded(r[label + "trust"], f"{key} {label}trust")
            assert got["error"] <= TOL and (got["tied"] or not case.tied), got
        explicit = r[label + "explicit"]
        if route == "remote_code":
            assert remote_runtime.MESSAGE[:60] in explicit.get("refused", ""), explicit
        elif "loaded" in explicit:  # RobertaForMaskedLM on the RobertaPreLayerNorm directory: norms missing, reported by HF
            assert name.startswith("roberta") and explicit["loaded"]["error_vs_old"] > 1e-3 and explicit["loaded"]["error"] > 1e-3
        else:
            assert name.startswith("bart") and "encoder_layerdrop" in explicit["refused"]


def _ln_lightning_from_pretrained_in_a_fresh_process(key, results):
    name, variant = key.split("/")
    case = [c for c in CASES if c.name == name][0]
    r = results["ours"][key]
    for how in ("ours", "own:ours", "again"):
        got = _loaded(r[how], f"{key} {how}")
        assert got["error"] <= TOL, (how, got)
        assert got["tied"] or not case.tied
    assert r["blend"] == (pytest.approx(0.3) if variant == "mid-transition" else None)


def _torch_export_round_trip_without_ln_lightning(key, results):
    assert results["plain"]["ln_lightning_importable"] is False
    assert results["plain"][key]["error"] <= TOL


def _onnx_export_without_ln_lightning(key, results):
    assert results["plain"][key]["error"] <= TOL


EXPORT_KEYS = ["torch.export/bert/converted", "torch.export/bert/mid-transition", "torch.export/nn.TransformerEncoder/converted"]
ONNX_KEYS = ["onnx/bert/converted", "onnx/bert/mid-transition"]
CHECKS = [(_plain_transformers_without_ln_lightning, KEYS), (_ln_lightning_from_pretrained_in_a_fresh_process, KEYS),
          (_torch_export_round_trip_without_ln_lightning, EXPORT_KEYS)]


def test_every_family_and_export_loads_in_fresh_processes(results):
    """Every check of every key, each failure listed as CHECK[KEY]: its message (one test: one worker builds `results`)."""
    failures, ran = [], 0
    for check, keys in CHECKS:
        for key in keys:
            ran += 1
            try:
                check(key, results)
            except Exception as err:  # noqa: BLE001 - every check runs; each failure is reported below
                failures.append(f"{check.__name__.lstrip('_')}[{key}]: {type(err).__name__}: {err}")
    assert not failures, f"{len(failures)} of {ran} checks failed:\n" + "\n\n".join(failures)


@pytest.mark.skipif(not ONNX, reason=ONNX_SKIP)  # (a mark: skipped before `results` is built)
def test_onnx_export_without_ln_lightning(results):
    """The ONNX files' round trip, where onnx is installed (not in the dev extra, so not in CI; where it runs under
    pytest-xdist, it may be the second worker's build of `results`)."""
    for key in ONNX_KEYS:
        _onnx_export_without_ln_lightning(key, results)


def _describe(outcome: dict | None) -> str:
    if outcome is None:
        return "-"
    if "loaded" in outcome:
        got = outcome["loaded"]
        return f"{got['class']} {got['error']:.0e}" + (" (OLD)" if got["error_vs_old"] <= TOL else "")
    return "refused: " + outcome["refused"].split(":")[0]


def _print_table(out: dict) -> None:
    print("\nkey                          route        ours   Auto (no ln_lightning)      own class (no ln_l.)      trust_remote_code")
    for key in KEYS:
        p, o = out["plain"][key], out["ours"][key]
        ours = o["ours"]["loaded"]["error"] if "loaded" in o["ours"] else float("nan")
        print(f"{key:28s} {out['routes'][key]:12s} {ours:.0e}  {_describe(p['auto']):27s} {_describe(p['explicit']):25s} "
              f"{_describe(p['trust'])}")
    for key, value in out["plain"].items():
        if key.startswith(("torch.export", "onnx")):
            print(f"{key:44s} {value['error']:.1e}")
