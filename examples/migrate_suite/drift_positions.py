"""Where the closed loop's drift is measured, against what the goal measures (issue 31, after order 11).

The closed loop gates its blend on KL(trained || model), averaged over every position of the LightningModule's
output. The goal measures the held-out loss, which a masked LM counts on its masked positions only (15% of them in
the suite's MLMs). This measures, on each suite model's pretrained checkpoint and its fixed held-out batches, at a
few blends of the stream-scaled transition to pre-norm (scales measured as LNPlacement measures them, eval mode, no
training): the KL over every position, the KL over the positions the loss counts, and the held-out loss's rise.

    python examples/migrate_suite/drift_positions.py --out outputs/migrate_suite   # its pretrain/ checkpoints
    python examples/migrate_suite/drift_positions.py --quick                        # tiny untrained models

A diagnostic, not a method: nothing is chosen on it. Full mode writes docs/results/migrate_drift_positions/.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script: its sibling suite_models.py
    sys.path.insert(0, str(HERE))
import suite_models as sm  # noqa: E402

from ln_lightning.placement.migrate import transition  # noqa: E402

BLENDS = (0.25, 0.5, 0.75, 1.0)
RESULTS = HERE.parents[1] / "docs" / "results" / "migrate_drift_positions"


def kl_by_position(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) at each position (the distillation's kl_to_teacher before its mean)."""
    t = F.log_softmax(teacher.float(), -1)
    return (t.exp() * (t - F.log_softmax(student.float(), -1))).sum(-1)


def measure(module: torch.nn.Module, batches: list[tuple], blends=BLENDS) -> list[dict]:
    """Per blend: KL over every position, KL over the loss's positions (target != -100), their share, the held-out
    loss's rise over the trained model's."""
    module.eval()
    with torch.no_grad():
        taught = [module(*inputs) for inputs, _ in batches]
    base = sm.heldout_loss(module, batches)
    student = copy.deepcopy(module)
    transition.begin(student, "pre", branch_scale="stream")
    first = batches[0][0]
    assert transition.measure_stream_scales(student, lambda: student(*first)) is None
    rows = []
    for a in blends:
        transition.set_blend(student, a)
        student.eval()
        sums = {"all": 0.0, "loss": 0.0}
        counts = {"all": 0, "loss": 0}
        with torch.no_grad():
            for (inputs, target), t in zip(batches, taught):
                kl = kl_by_position(t, student(*inputs))
                sums["all"] += kl.sum().item()
                counts["all"] += kl.numel()
                counted = (target != -100) if target.shape == kl.shape else torch.ones_like(kl, dtype=torch.bool)
                sums["loss"] += kl[counted].sum().item()
                counts["loss"] += int(counted.sum())
        rows.append({"blend": a, "kl_all": sums["all"] / counts["all"], "kl_loss_positions": sums["loss"] / counts["loss"],
                     "loss_share": counts["loss"] / counts["all"], "heldout_rise": sm.heldout_loss(student, batches) - base})
    return rows


def render_markdown(results: dict) -> str:
    lines = ["# Where the drift is measured (issue 31, a diagnostic after order 11)", "",
             "The closed loop gates on KL(trained || model) averaged over every output position; the goal counts the "
             "held-out loss, which a masked LM takes on its masked positions only. On each model's pretrained "
             "checkpoint (seed 0) and the suite's fixed held-out batches, the stream-scaled blend to pre-norm at fixed "
             "weights (no training), eval mode. Written by `examples/migrate_suite/drift_positions.py`; nothing was "
             "chosen on it.", "",
             "| model | blend | KL, every position | KL, the loss's positions | their share | held-out loss rise |",
             "|---|---|---|---|---|---|"]
    for name, rows in results["models"].items():
        for r in rows:
            lines.append(f"| {name} | {r['blend']:g} | {r['kl_all']:.4f} | {r['kl_loss_positions']:.4f} | "
                         f"{r['loss_share']:.0%} | {r['heldout_rise']:+.4f} |")
    lines += ["", "Checkpoints: " + results["checkpoints"], ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="outputs/migrate_suite", help="the suite's --out (its pretrain/ checkpoints)")
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--quick", action="store_true", help="tiny untrained models, no results written")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = args.models or list(sm.SUITE)
    results = {"models": {}, "checkpoints": "none (--quick: untrained)" if args.quick else str(Path(args.out) / "pretrain")}
    for name in names:
        m = sm.SUITE[name]
        hp = m.hp(args.quick)
        torch.manual_seed(0)
        module = m.build(hp)
        if not args.quick:
            ckpt = Path(args.out) / "pretrain" / f"{name}_seed0.ckpt"
            module.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"])
        rows = measure(module, sm.eval_batches(m, hp))
        results["models"][name] = rows
        for r in rows:
            print(f"{name} blend {r['blend']:g}: KL every position {r['kl_all']:.4f}, the loss's positions "
                  f"{r['kl_loss_positions']:.4f} ({r['loss_share']:.0%}); held-out rise {r['heldout_rise']:+.4f}", flush=True)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (RESULTS / "results.md").write_text(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
