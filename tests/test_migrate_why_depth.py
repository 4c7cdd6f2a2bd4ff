"""Why migrate, at depth (examples/migrate_why_depth.py) end to end in its --quick mode, as CI runs it.

Checks what holds by construction, so a broken measurement fails here: both seeds are pretrained by the suite's code
and continued unchanged and migrated; the migration finished; both continuations start from the checkpoint's
function and see the same batches; every test runs from both end states on the same batches; the lr tests start
where the continuation ended; pre-norm's appended blocks are exactly the identity; the verdict is the rule applied
to the rows; results.md is the rendering of results.json.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "migrate_why_depth.py"
TESTS = {"lr3", "lr10", "deepen"}  # the issue's: the headline verdict
EXTRA = {"lr1", "lr30", "lr100"}  # the control, and past the pretraining's peak lr: their own verdict line


def _driver():
    spec = importlib.util.spec_from_file_location("_test_migrate_why_depth_driver", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_migrate_why_depth_quick(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    res = json.loads((tmp_path / "results.json").read_text())

    assert res["quick"] is True and res["seeds"] == [0, 1]
    assert set(res["pretrain"]) == {"0", "1"}
    assert (tmp_path / "pretrain" / "deep_dropout_lm_seed1.ckpt").exists()

    conts = {(r["which"], r["seed"]): r for r in res["continuations"]}
    assert set(conts) == {(w, s) for w in "um" for s in (0, 1)}
    for s in (0, 1):
        u, m = conts[("u", s)], conts[("m", s)]
        assert m["finished"] is True and m["transition_end_step"] is not None and m["plugin"]["transition"]["tolerance"] == 0.05
        assert u["budget"] == m["budget"] and u["steps"] == m["steps"] == u["budget"]
        # both start from the checkpoint's function (the migration's blend 0 is the trained function)
        assert u["start"] == pytest.approx(res["pretrain"][str(s)]["eval_end"], abs=1e-6)
        assert m["start"] == pytest.approx(u["start"], abs=1e-6)
    assert res["same_batches"] == {"continuation": True, "tests": True}
    for s in (0, 1):  # the budget the continuations used is the last one tried, and the migration finished within it
        last = [b for b in res["budgets_tried"] if b["seed"] == s][-1]
        assert last["finished"] is True and last["budget"] == conts[("m", s)]["budget"]

    rows = {(r["test"], r["which"], r["seed"]): r for r in res["tests"]}
    assert set(rows) == {(t, w, s) for t in TESTS | EXTRA for w in "um" for s in (0, 1)}
    n = res["settings"]["n_layers"]
    for (t, w, s), r in rows.items():
        assert r["placement"] == ("post" if w == "u" else "pre")
        assert r["steps"] == res["settings"]["test_steps"] and not r["diverged"]
        assert math.isfinite(r["final"]) and r["worst"] >= max(r["start"], r["final"]) - 1e-12
        assert 0.0 <= r["clipped"] <= 1.0 and r["grad_max"] >= r["grad_median"] > 0
        if t == "deepen":
            assert r["extra_blocks"] == max(1, n // 4) and r["lr"] == pytest.approx(res["settings"]["base_lr"])
            assert r["source_end"] == pytest.approx(conts[(w, s)]["final"], abs=1e-4)
            if w == "m":  # zero-output pre-norm blocks: exactly the identity
                assert r["start"] == pytest.approx(r["source_end"], abs=1e-6)
            else:  # post-norm's appended norms re-normalise the stream
                assert r["start"] != r["source_end"]
        else:
            assert r["extra_blocks"] == 0 and r["lr"] == pytest.approx(int(t[2:]) * res["settings"]["base_lr"])
            assert r["start"] == pytest.approx(conts[(w, s)]["final"], abs=1e-4)

    # the verdict is the rule applied to the rows, and the sentence says it
    driver = _driver()
    for names, key in ((TESTS, "verdict"), (EXTRA, "extra_verdict")):
        v = driver.verdict(res["tests"], res["continuations"], [0, 1], sorted(names))
        got = res[key]
        assert v["complete"] and set(v["per_test"]) == set(got["per_test"]) == names
        assert v["tolerance"] == pytest.approx(got["tolerance"]) and v["supported"] == got["supported"]
        for t in names:
            assert got["per_test"][t]["verdict"] in {"migrated better", "migrated worse", "no difference", "mixed"}
            for d in got["per_test"][t]["seeds"]:
                assert d["m_minus_u"] == pytest.approx(rows[(t, "m", d["seed"])]["final"] - rows[(t, "u", d["seed"])]["final"])
        sentence = res[f"{key}_sentence"]
        assert ": supported**" in sentence or ": not supported**" in sentence
        assert (": not supported**" in sentence) == (not got["supported"])
    assert (tmp_path / "results.md").read_text() == driver.render_markdown(res)


def test_verdict_rule_on_hand_made_rows():
    """The rule itself, on rows made by hand: better on every seed, worse on every seed, mixed, within the
    tolerance, and the divergence clause."""
    driver = _driver()

    def row(test, which, seed, final, diverged=False):
        return {"test": test, "which": which, "seed": seed, "final": final, "diverged": diverged}

    conts = [row("continuation", w, s, 2.0) for w in "um" for s in (0, 1)]
    tests = [
        row("a", "u", 0, 2.00), row("a", "u", 1, 2.00), row("a", "m", 0, 1.90), row("a", "m", 1, 1.90),  # better
        row("b", "u", 0, 2.00), row("b", "u", 1, 2.00), row("b", "m", 0, 2.10), row("b", "m", 1, 2.10),  # worse
        row("c", "u", 0, float("inf"), True), row("c", "u", 1, 2.00), row("c", "m", 0, 2.00), row("c", "m", 1, 2.00),  # mixed
        row("d", "u", 0, 2.00), row("d", "u", 1, 2.00), row("d", "m", 0, 1.995), row("d", "m", 1, 2.005),  # within
        row("e", "u", 0, float("inf"), True), row("e", "u", 1, float("inf"), True), row("e", "m", 0, 2.0), row("e", "m", 1, 2.0),
    ]
    v = driver.verdict(tests, conts, [0, 1], ["a", "b", "c", "d", "e"])
    # the largest spread over seeds is d's (0.005; groups with a non-finite final are skipped): the tolerance is the floor
    assert v["tolerance"] == pytest.approx(0.01)
    assert {t: x["verdict"] for t, x in v["per_test"].items()} == {
        "a": "migrated better", "b": "migrated worse", "c": "mixed", "d": "no difference", "e": "migrated better"}
    assert v["supported"] and v["better_in"] == ["a", "e"] and v["worse_in"] == ["b"]
    assert "supported" in driver.verdict_sentence(v) and "not supported" not in driver.verdict_sentence(v)
