"""The fresh process of tests/test_export_fresh_process.py: load what the test saved, every route, write the outcomes.

    python tests/_helpers_export_child.py plain ROOT   # ln_lightning not importable: transformers' routes, torch.export, ONNX
    python tests/_helpers_export_child.py ours ROOT    # ln_lightning.from_pretrained, and saving the result again

Reads ROOT/manifest.json and ROOT/ref.pt (inputs, the converted model's outputs and the old function's), writes
ROOT/<mode>.json: for each case and route, {"loaded": {error against the converted and the old function, tied}}
or {"refused": "Type: message"}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODE, ROOT = sys.argv[1], Path(sys.argv[2])
if MODE == "plain":
    sys.modules["ln_lightning"] = None  # a machine without ln_lightning: importing it (or anything from it) fails

import torch  # noqa: E402

from _helpers_export import output, quiet_transformers, rel, tied  # noqa: E402


def _outcome(load, ref: dict) -> dict:
    try:
        model = load()
    except Exception as err:  # noqa: BLE001 - a refusal is an outcome
        return {"refused": f"{type(err).__name__}: {' '.join(str(err).split())[:1500]}"}
    model.eval()
    out = output(model, ref["inputs"])
    return {"loaded": {"error": rel(out, ref["expected"]), "error_vs_old": rel(out, ref["old"]),
                       "tied": tied(model), "class": type(model).__name__}}


def _plain(manifest: dict, refs: dict) -> dict:
    import transformers as T

    results = {}
    try:
        import ln_lightning  # noqa: F401
        results["ln_lightning_importable"] = True
    except ImportError:
        results["ln_lightning_importable"] = False
    for c in manifest["cases"]:
        ref, auto, own = refs[c["key"]], getattr(T, c["auto"]), getattr(T, c["cls"])
        r = {}
        for label, d in (("", c["dir"]), ("own:", c["own_dir"])):
            r[label + "auto"] = _outcome(lambda: auto.from_pretrained(d), ref)
            r[label + "explicit"] = _outcome(lambda: own.from_pretrained(d), ref)
            r[label + "trust"] = _outcome(lambda: auto.from_pretrained(d, trust_remote_code=True), ref)
            if c["native"]:
                r[label + "native"] = _outcome(lambda: getattr(T, c["native"]).from_pretrained(d), ref)
        results[c["key"]] = r
    for e in manifest["exports"]:
        ref = refs[e["key"]]
        program = torch.export.load(e["file"])
        with torch.no_grad():
            out = program.module()(*ref["args"])
        out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
        results[e["key"]] = {"error": rel(out, ref["expected"])}
    for e in manifest["onnx"]:
        import onnx
        from onnx.reference import ReferenceEvaluator

        ref = refs[e["key"]]
        session = ReferenceEvaluator(onnx.load(e["file"]))
        outs = session.run(None, dict(zip(session.input_names, [a.numpy() for a in ref["args"]])))
        results[e["key"]] = {"error": rel(torch.from_numpy(outs[0]), ref["expected"])}
    return results


def _ours(manifest: dict, refs: dict) -> dict:
    import ln_lightning
    from ln_lightning.placement import state

    results = {}
    for c in manifest["cases"]:
        ref = refs[c["key"]]
        example = ref["inputs"].get("input_values")
        r = {}
        for label, d in (("", c["dir"]), ("own:", c["own_dir"])):
            r[label + "ours"] = _outcome(lambda: ln_lightning.from_pretrained(d, example_input=example), ref)
        loaded = ln_lightning.from_pretrained(c["dir"], example_input=example)
        s = state.of(loaded)
        r["blend"] = None if s is None or s.transition is None else float(s.transition.blend)
        again = Path(c["dir"] + "-again")
        loaded.save_pretrained(again)  # its own method: the safe form again
        r["again"] = _outcome(lambda: ln_lightning.from_pretrained(again, example_input=example), ref)
        results[c["key"]] = r
    return results


if __name__ == "__main__":
    quiet_transformers()
    manifest = json.loads((ROOT / "manifest.json").read_text())
    refs = torch.load(ROOT / "ref.pt", weights_only=True)
    results = _plain(manifest, refs) if MODE == "plain" else _ours(manifest, refs)
    (ROOT / f"{MODE}.json").write_text(json.dumps(results, indent=1))
