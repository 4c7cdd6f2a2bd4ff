"""The screen's runs as one table: results.json and results.md from the JSON lines in SCREEN_OUT.

Run: `python examples/migrate_trained_screen/summary.py [OUT_DIR]` (default: SCREEN_OUT, where the exp*.py
runs wrote). Each row: the worst held-out excess over the loss at the switch, the final held-out loss minus
continuing unchanged's (same seed), and the compute spent (forward 1, backward 2, a teacher forward 1).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

GOAL_EXCESS = 0.03  # issue 20


def rows(out: Path) -> list[dict]:
    runs: dict[tuple[str, int], dict] = {}
    for f in sorted(out.glob("exp*_seed*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            runs[(r["name"], r["seed"])] = {k: r[k] for k in ("name", "seed", "pre", "worst", "worst_step", "final", "units", "steps")}
            runs[(r["name"], r["seed"])]["file"] = f.name
    unchanged = {s: r["final"] for (n, s), r in runs.items() if n == "unchanged"}
    out_rows = []
    for (n, s), r in sorted(runs.items(), key=lambda kv: (kv[0][0] != "unchanged", kv[1]["worst"])):
        r["final_minus_unchanged"] = r["final"] - unchanged[s] if s in unchanged else None
        r["meets_excess_goal"] = r["worst"] <= GOAL_EXCESS
        out_rows.append(r)
    return out_rows


def render_markdown(results: dict) -> str:
    lines = ["# Migration screen (issue 20): pure-torch continuations of the study's checkpoints", "",
             "A screen, not the study: `examples/migrate_trained_screen/` reimplements the continuation in plain torch to "
             "try many schedules fast; the study's own arms (`results.md`) are the measured result.", "",
             "| run | seed | worst excess (step) | final − unchanged | compute units | steps | worst ≤ goal |",
             "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        fu = "—" if r["final_minus_unchanged"] is None else f"{r['final_minus_unchanged']:+.4f}"
        lines.append(f"| {r['name']} | {r['seed']} | {r['worst']:+.4f} ({r['worst_step']}) | {fu} | {r['units']:.0f} | {r['steps']} | "
                     f"{'yes' if r['meets_excess_goal'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else os.environ.get("SCREEN_OUT", "outputs/migrate_trained_screen"))
    results = {"goal_excess": GOAL_EXCESS, "rows": rows(out)}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(render_markdown(results))
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
