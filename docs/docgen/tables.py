"""Measured tables, rendered from results files: `{{ tables.NAME }}` in a page is `TABLES[NAME]()`.

Each function reads its results through `figures.load` (the files `figures.SOURCES` names) and returns
markdown. A table states where its numbers come from (the command that wrote the file) in its caption.
"""

from __future__ import annotations

from typing import Callable

from . import troubleshooting
from .figures import SOURCES, FigureError, load


def _caption(*sources: str) -> str:
    return "Rendered from " + ", ".join(f"`docs/{SOURCES[s]}`" for s in sources) + "."


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}x"


# ------------------------------------------------------------------ bench_norm (benchmarks/bench_norm.py --out)


def _bench_rows(source: str) -> list[dict]:
    return [r for r in load(source)["results"] if "skipped" not in r]


def _speedup(rows, *, variant, dtype, hidden, mode, key="speedup_vs_baseline"):
    for r in rows:
        if r["variant"] == variant and r["dtype"] == dtype and r["hidden"] == hidden and r["mode"] == mode:
            return r.get(key)
    return None


def _per_width(rows, widths, **kw) -> str:
    vals = [_speedup(rows, hidden=h, **kw) for h in widths]
    return "" if all(v is None for v in vals) else " / ".join(_x(v) if v is not None else "-" for v in vals)


def _widths(rows) -> list[int]:
    return sorted({r["hidden"] for r in rows})


def bench_norm_layernorm() -> str:
    t1, t2 = _bench_rows("bench_norm_cpu_threads1"), _bench_rows("bench_norm_cpu_threads2")
    widths = _widths(t1)
    rows_n = sorted({r["rows"] for r in t1})
    lines = [
        f"Forward + backward on CPU, {' / '.join(map(str, rows_n))} rows × {' / '.join(map(str, widths))} wide "
        "(one figure per width); speedup = the median of per-repeat paired time ratios.",
        "",
        "| speedup of | fp32, 1 thread | bf16, 1 thread | fp32, 2 threads | bf16, 2 threads |",
        "|---|---|---|---|---|",
    ]
    spec = [
        ("`FusedLayerNorm` over `nn.LayerNorm`", "FusedLayerNorm", "speedup_vs_baseline"),
        ("fused add + norm over eager add + `nn.LayerNorm`", "fused add+LN", "speedup_vs_baseline"),
        ("fused add + norm over `torch.compile`(add + norm)", "fused add+LN", "speedup_vs_compiled"),
        ("bf16 fused add + norm on aten's kernels (`LN_LIGHTNING_CPU_KERNELS=0`) over eager", "fused add+LN[aten]", "speedup_vs_baseline"),
    ]
    for label, variant, key in spec:
        cells = [_per_width(rows, widths, variant=variant, dtype=dt, mode="fwd+bwd", key=key)
                 for rows in (t1, t2) for dt in ("float32", "bfloat16")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    fwd = [_per_width(t1, widths, variant=v, dtype=dt, mode="fwd") for v in ("FusedLayerNorm", "fused add+LN")
           for dt in ("float32", "bfloat16")]
    lines += [
        "",
        f"Forward only, 1 thread: `FusedLayerNorm` {fwd[0]} (fp32), {fwd[1]} (bf16); fused add + norm {fwd[2]} (fp32), "
        f"{fwd[3]} (bf16).",
        "",
        _caption("bench_norm_cpu_threads1", "bench_norm_cpu_threads2"),
    ]
    return "\n".join(lines)


def bench_norm_rms() -> str:
    runs = [_bench_rows("bench_norm_rms_cpu_run1"), _bench_rows("bench_norm_rms_cpu_run2")]
    widths = _widths(runs[0])
    nrows = sorted({r["rows"] for r in runs[0]})
    cols = [(dt, h) for dt in ("float32", "bfloat16") for h in widths]
    head = " | ".join(f"{'fp32' if dt == 'float32' else 'bf16'} × {h}" for dt, h in cols)
    lines = [
        f"`h = x + r; y = norm(h)` on CPU, {' / '.join(map(str, nrows))} rows, both outputs receiving a gradient; "
        "two runs (run 1 / run 2), speedup = the median of paired ratios.",
        "",
        f"| {'/'.join(map(str, nrows))} rows | {head} |",
        "|---|" + "---|" * len(cols),
    ]
    spec = [
        ("fwd + bwd: `fused_add_rms_norm(cast_order=\"llama\")` over eager HF `LlamaRMSNorm` + add", "fused add+RMSNorm", "fwd+bwd", "speedup_vs_baseline"),
        ("fwd + bwd: the same over `torch.compile`(add + `LlamaRMSNorm`)", "fused add+RMSNorm", "fwd+bwd", "speedup_vs_compiled"),
        ("fwd + bwd: compiled kernels off (aten) over eager", "fused add+RMSNorm[aten]", "fwd+bwd", "speedup_vs_baseline"),
        ("forward: fused over eager", "fused add+RMSNorm", "fwd", "speedup_vs_baseline"),
        ("forward: fused over `torch.compile`", "fused add+RMSNorm", "fwd", "speedup_vs_compiled"),
    ]
    for label, variant, mode, key in spec:
        cells = []
        for dt, h in cols:
            vals = [_speedup(rows, variant=variant, dtype=dt, hidden=h, mode=mode, key=key) for rows in runs]
            cells.append(" / ".join(_x(v) if v is not None else "-" for v in vals))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", _caption("bench_norm_rms_cpu_run1", "bench_norm_rms_cpu_run2")]
    return "\n".join(lines)


# ------------------------------------------------------------------ benchmarks with --json


def _load_note(d: dict) -> str:
    start, end = d["load_average"]
    return f"Load average (1 minute) at the start and the end of the run: {start:.1f}, {end:.1f} on 2 cores. "


def bench_convert() -> str:
    d = load("bench_convert")
    rows = d["rows"]
    lines = ["| model | blocks | width | `inspect_model` (s) | `convert` to pre-norm (s) | its CPU time (s) | per block (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = f"{r['convert_cpu_s']:.2f}" if "convert_cpu_s" in r else ""
        lines.append(f"| {r['model']} | {r['blocks']} | {r['width']} | {r['inspect_s']:.2f} | {r['convert_s']:.2f} | {cpu} | "
                     f"{r['convert_ms_per_block']:.1f} |")
    return "\n".join(lines + ["", "Median of a few runs, every block read from a recorded forward and every rewrite checked. "
                              + _load_note(d) + _caption("bench_convert")])


def bench_exact_rewrites() -> str:
    runs = [load("bench_exact_rewrites_run1"), load("bench_exact_rewrites_run2")]
    cfg = runs[0]["config"]

    def row(d, norms, rewrite, mode):
        return next((r for r in d["rows"] if r["norms"] == norms and r["rewrite"] == rewrite and r["mode"] == mode), None)

    def cell(norms, rewrite, mode):
        rs = [row(d, norms, rewrite, mode) for d in runs]
        return "—" if any(r is None for r in rs) else " / ".join(_x(r["speedup_vs_migrated"]) for r in rs)

    lines = [
        f"The demo LM after `convert(..., \"pre\")`, {cfg['blocks']} blocks × {cfg['width']} wide, a batch of {cfg['batch']} × "
        f"{cfg['seq']} tokens, on CPU (torch threads: {runs[0]['torch_threads']}; {runs[0]['cpu_count']} cores). Speedup over the migrated model with the "
        "same norms (above 1: faster), run 1 / run 2; each the median of "
        f"{cfg['repeats']} interleaved repeats' paired ratios. Inference is an eval-mode forward under `no_grad`; a training "
        "step is forward, cross-entropy, backward and an AdamW step (a folded model has no gains to train: —).",
        "",
        "| rewrite | inference, torch norms | inference, fused norms | train step, torch norms | train step, fused norms | "
        "largest relative output error |",
        "|---|---|---|---|---|---|",
    ]
    for rewrite in ("to_rmsnorm", "fold_norms", "to_rmsnorm + fold_norms"):
        err = max(row(d, n, rewrite, "inference")["max_rel_error_vs_migrated"] for d in runs for n in ("eager", "fused"))
        lines.append(f"| `{rewrite}` | " + " | ".join(cell(n, rewrite, m) for m in ("inference", "train step")
                                                        for n in ("eager", "fused")) + f" | {err:.0e} |")
    base = [[row(d, n, "migrated", m)["median_ms"] for d in runs] for m in ("inference", "train step") for n in ("eager", "fused")]
    ms = [" / ".join(f"{v:.1f}" for v in b) for b in base]
    lines += [
        "",
        f"The migrated model itself, in ms (run 1 / run 2): inference {ms[0]} with torch's norms, {ms[1]} fused; a training "
        f"step {ms[2]} and {ms[3]}. The fused norms over torch's on the migrated model: inference "
        f"{cell('fused', 'migrated (over eager migrated)', 'inference')}, train step "
        f"{cell('fused', 'migrated (over eager migrated)', 'train step')}.",
        "",
        " ".join(f"Run {i + 1}: load average {d['load_average'][0]:.1f} at the start, {d['load_average'][1]:.1f} at the end."
                 for i, d in enumerate(runs)) + " " + _caption("bench_exact_rewrites_run1", "bench_exact_rewrites_run2"),
    ]
    return "\n".join(lines)


def bench_transition() -> str:
    d = load("bench_transition")
    rows = d["rows"]
    arms = list(dict.fromkeys(a for r in rows for a in r["ratio_vs_pre"]))  # in the order the benchmark ran them
    lines = ["| model | ms per step: pre-norm | " + " | ".join(f"{a} / pre-norm" for a in arms) + " |",
             "|---|---|" + "---|" * len(arms)]
    for r in rows:  # (an arm a model has no form for: —)
        ms, ratio = r["ms_per_step"], r["ratio_vs_pre"]
        lines.append(f"| {r['model']} | {ms['pre']:.2f} | "
                     + " | ".join(f"{ratio[a]['median']:.3f}" if a in ratio else "—" for a in arms) + " |")
    return "\n".join(lines + ["", "A training step is forward, backward and an AdamW step, one thread; ratios are medians of "
                              "paired blocks (each arm's block between two pre-norm blocks). The default step during a "
                              "transition is the stream-scaled blend with the teacher's forward and KL term; `finished` is the "
                              "step after it. " + _load_note(d) + _caption("bench_transition")])


def bench_monitors() -> str:
    r = load("bench_monitors")
    w, c = r["wall"], r["cpu"]
    syncs = r["host_syncs"]
    noise = f"{r['noise_cv']:.0%}" if "noise_cv" in r else "not measured"
    lines = [
        "| what | measured |",
        "|---|---|",
        f"| time inside the monitors' code, per training step | {r['inside_ms_per_step']:.1f} ms: an attributed ratio of {r['attributed_ratio']:.4f} |",
        *(["| of which, per monitor | " + ", ".join(f"`{name}` {ms:.2f} ms" for name, ms in r["inside_ms_per_step_by_monitor"].items()) + " |"]
          if "inside_ms_per_step_by_monitor" in r else []),
        f"| host synchronisations | {syncs['per_logging_step_per_callback']:.1f} per logging step per callback, {syncs['on_other_steps']} on the other steps |",
        f"| step time with the four monitors over none, median of paired blocks | {w['ratio_median_paired']:.3f} wall clock, {c['ratio_median_paired']:.3f} process CPU time |",
        f"| the blocks' own noise (coefficient of variation of the blocks without monitors) | {noise} |",
        "",
        f"Demo `CharLM` {r['d_model']} wide, {r['layers']} layers, batch {r['batch'][0]} × {r['batch'][1]}, gradient clipping on, "
        f"`log_every_n_steps={r['every']}`, {r['blocks']} alternating blocks with and without the monitors, "
        f"{r['torch_threads']} torch threads; load average (1 minute) {r['load_average_start']:.1f} at the start and "
        f"{r['load_average_end']:.1f} at the end. A paired ratio resolves the monitors' cost only down to the blocks' noise; "
        "the attributed ratio (the time spent inside monitor code against the rest of the step) does not depend on it.",
        "",
        _caption("bench_monitors"),
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ examples


def _seeds(values, fmt: str) -> str:
    return ", ".join(format(v, fmt) for v in values)


def migrate_trained_arms() -> str:
    """One row per arm of examples/migrate_trained.py's study (whatever arms results.json holds), per seed."""
    return _arms_table("migrate_trained")


def migrate_trained_plugin_arms() -> str:
    """The same table for the plugin's own arms, run after the study's method became LNPlacement's default."""
    return _arms_table("migrate_trained_plugin")


def migrate_trained_plugin_setup() -> str:
    """What the plugin run measured, from its results.json (examples/migrate_trained.py --arms ...)."""
    d = load("migrate_trained_plugin")
    h = d["hparams"]
    return (f"The same study (a {h['layers']}-layer post-norm character LM pretrained for {h['pretrain']} steps, continued "
            f"within the compute of {h['budget']} more steps, {h['seeds']} seeds, the same batches), run again with "
            f"LNPlacement's own transition: " + ", ".join(f"`{a}`" for a in d["runs"]) + ". A teacher forward counts 1 "
            "unit, so a distilling arm takes fewer steps. " + _caption("migrate_trained_plugin"))


def _arms_table(source: str) -> str:
    d = load(source)
    runs, arms = d["runs"], d["arms"]
    u = {r["seed"]: r["final_eval"] for r in runs["unchanged"]}
    lines = [
        "| arm | what it does | held-out at the switch | worst excess over pre-switch | final − unchanged | compute / budget | goal: excess; final; compute |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, rs in runs.items():
        goal = arms[arm]["goal"]
        verdict = "—" if goal is None else " ; ".join("yes" if goal[k] else "**no**" for k in ("excess", "final", "compute"))
        final = [r["final_eval"] - u[r["seed"]] for r in rs if r["seed"] in u]
        method = arms[arm]['method'].replace("|", "\\|")  # `KL(trained || model)` must not split the cell
        lines.append(f"| `{arm}` | {method} | {_seeds((r['eval_at_switch'] for r in rs), '.4f')} | "
                     f"{_seeds((r['eval_peak_excess'] for r in rs), '+.4f')} | {_seeds(final, '+.4f')} | "
                     f"{_seeds((r['units'] / r['budget_units'] for r in rs), '.3f')} | {verdict} |")
    return "\n".join(lines + ["", f"One figure per seed. Goal: worst excess at most {d['goal_excess']:+.2f} on every seed, final within "
                              f"{d['tolerance']:.3f} of continuing unchanged, within the budget. " + _caption(source)])


def _plugin_arms(d: dict) -> list[str]:
    """The arms that run the plugin's own transition (`plugin_S`)."""
    return [a for a in d["runs"] if a.startswith("plugin_")]


def migrate_trained_setup() -> str:
    """The study's set-up in one paragraph, from results.json's hparams and arms (examples/migrate_trained.py)."""
    d = load("migrate_trained")
    h = d["hparams"]
    plugin = " and ".join(a.partition("_")[2] for a in _plugin_arms(d)) or "no"
    others = [a for a in d["runs"] if a != "unchanged" and not a.startswith("plugin_")]
    return (f"A {h['layers']}-layer post-norm character LM (width {h['d_model']}) pretrained for {h['pretrain']} steps "
            f"until its held-out loss flattened, then continued within the compute of {h['budget']} more steps from the same "
            f"checkpoint and the same batches: unchanged, through the plugin's transition of {plugin} steps "
            f"(`LNPlacement(\"pre\", transition_steps=N, resume_unconverted=True)`), and through "
            f"{len(others)} candidate migration(s) built on the public transition API; {h['seeds']} seeds. " + _caption("migrate_trained"))


def migrate_trained_claims() -> str:
    """The claims table's two rows on migrating a trained model, their verdicts computed from the figures."""
    d = load("migrate_trained")
    h, runs, goal = d["hparams"], d["runs"], d["goal_excess"]
    u = {r["seed"]: r for r in runs["unchanged"]}
    moving = [a for a in runs if a != "unchanged"]
    at_switch = max(abs(r["eval_at_switch"] - u[r["seed"]]["eval_at_switch"]) for a in moving for r in runs[a])
    exact = at_switch == 0.0
    row1 = (f"| A transition resumes a trained post-norm model at exactly its function | {h['layers']}-layer char LM pretrained "
            f"until its held-out loss flattened, resumed from its plugin-less checkpoint, {h['seeds']} seeds: every transition's "
            f"held-out loss at the switch differs from continuing unchanged by {at_switch:.1e} at most | "
            f"{'supported' if exact else '**not supported**'} |")
    worst = {a: max(r["eval_peak_excess"] for r in runs[a]) for a in moving}
    met = [a for a in moving if all(d["arms"][a]["goal"].values())]
    best = min(moving, key=lambda a: worst[a])
    # The plugin's default since the study's method became it: its own run (migrate_trained_plugin).
    p = load("migrate_trained_plugin")
    default = [a for a in _plugin_arms(p) if "plain" not in a]
    p_worst = {a: max(r["eval_peak_excess"] for r in p["runs"][a]) for a in default}
    p_met = [a for a in default if all(p["arms"][a]["goal"].values())]
    verdict = ("supported by the plugin's default (" + ", ".join(f"`{a}`" for a in p_met) + ")" if p_met else
               "**partly**: " + (f"`{met[0]}` meets the goal, the plugin's default does not" if met else
                                 "no arm meets the goal on every seed; the best comes closest"))
    row2 = (f"| ... and so migrates without giving up what it learned (worst held-out excess at most {goal:+.2f} on every seed) | "
            f"study: best `{best}` {worst[best]:+.3f} (worst seed); the plugin's default: "
            + ", ".join(f"`{a}` {p_worst[a]:+.3f}" for a in default) + f" | {verdict} |")
    return row1 + "\n" + row2


def migrate_trained_drift() -> str:
    """The drift profile at a few blends (trained weights fixed): KL to the trained function and held-out change."""
    d = load("migrate_trained")
    at = (0.5, 0.8, 0.9, 1.0)
    seeds = sorted(d["drift"])
    variants = list(d["drift"][seeds[0]])
    lines = ["| blend | " + " | ".join(f"a = {a}: KL; held-out change" for a in at) + " |", "|---" * (len(at) + 1) + "|"]
    for v in variants:
        cells = []
        for a in at:
            per_seed = []
            for s in seeds:
                rows = d["drift"][s][v]["rows"]
                r = min(rows, key=lambda r: abs(r["a"] - a))
                per_seed.append(f"{r['kl']:.3f}; {r['heldout'] - rows[0]['heldout']:+.3f}")
            cells.append(" / ".join(per_seed))
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", "Per seed (separated by /), on a fixed probe batch with no training. " + _caption("migrate_trained")])


def migrate_trained_why() -> str:
    """What the migrated model can do that the unchanged one can't: higher learning rates, added blocks."""
    d = load("migrate_trained")
    why = d["why"]
    lines = ["| test | model | held-out at the start | worst | final | diverged | clipped |", "|---|---|---|---|---|---|---|"]
    for key, rs in why.items():
        test, _, model = key.partition("/")
        lines.append(f"| {test} | {model} | {_seeds((r['start'] for r in rs), '.4f')} | {_seeds((r['worst'] for r in rs), '.4f')} | "
                     f"{_seeds((r['final'] for r in rs), '.4f')} | {', '.join('yes' if r['diverged'] else 'no' for r in rs)} | "
                     f"{_seeds((r['clipped'] for r in rs), '.0%')} |")
    v = d["why_verdict"]
    def tests(pairs):  # (test, final held-out migrated − unchanged per seed)
        return ", ".join(f"{t} ({_seeds(diff, '+.4f')})" for t, diff in pairs)

    said = ("the migrated model ends lower on: " + tests(v["advantages"]) if v["advantages"] else
            "no test shows the migrated model ahead beyond the tolerance on every seed")
    if v["against"]:
        said += "; higher on: " + tests(v["against"])
    return "\n".join(lines + ["", f"One figure per seed. As measured: {said} (tolerance {v['tolerance']:.3f}). "
                              + _caption("migrate_trained")])


def migrate_trained_screen() -> str:
    """The screen's runs (examples/migrate_trained_screen), best first within each seed."""
    d = load("migrate_trained_screen")
    lines = ["| run | seed | worst excess (step) | final − unchanged | compute units | steps |", "|---|---|---|---|---|---|"]
    for r in sorted(d["rows"], key=lambda r: (r["seed"], r["name"] != "unchanged", r["worst"])):
        fu = "—" if r["final_minus_unchanged"] is None else f"{r['final_minus_unchanged']:+.4f}"
        lines.append(f"| `{r['name']}` | {r['seed']} | {r['worst']:+.4f} ({r['worst_step']}) | {fu} | {r['units']:.0f} | {r['steps']} |")
    return "\n".join(lines + ["", "A screen (a pure-torch reimplementation of the continuation), not the study. " + _caption("migrate_trained_screen")])


EXAMPLES = [
    # (results source, script, what it shows)
    ("depth_scaling", "depth_scaling.py", "stream rms and relative update per block at initialisation, depth 1 to 128, five placements (`StreamNormMonitor`)"),
    ("warmup_study", "warmup_study.py", "12-layer char LM: post-norm against `LNPlacement(\"pre\")`, with and without warmup, 2 seeds (`ClipAttributionMonitor`)"),
    ("warmup_study_lr1e_2", "warmup_study.py", "the same at a higher learning rate"),
    ("depth_placements", "warmup_study.py", "24-layer char LM: LayerNorm Scaling (`norm_scale=\"depth\"`) and DeepNorm (`\"deepnorm\"`) against pre- and post-norm, no warmup, 2 seeds"),
    ("layernorm_jacobian", "layernorm_jacobian.py", "LayerNorm's Jacobian norm against the input's spread; `LayerNormInputMonitor` catching a collapsing norm"),
    ("migrate_post_norm", "migrate_post_norm.py", "`ln-lightning inspect`, training with the plugin and monitors, `load_converted` in a fresh process (`nn.TransformerEncoder`, HF BERT)"),
    ("migrate_trained", "migrate_trained.py", "a trained post-norm model continued unchanged, through the plugin's `transition_steps` and through candidate migrations (stream-scaled blend, endpoint steps, distillation)"),
]


# ------------------------------------------------------------------ migrate_suite (examples/migrate_suite.py)

_SUITE_ARMS = ("hard", "default", "closed_S0.6_t0.05", "closed_S0.6_t0.05_lp_x0.02", "closed_S0.6_t0.05_lp_x0.02_kd")


def _suite_cell(r: dict | None) -> str:
    if r is None:
        return "not run"
    if "final" not in r:
        return "failed"
    v = r.get("verdict") or {}
    blend = "" if r["blend_reached"] in (None, 1.0) else f", blend {r['blend_reached']:.2f}"
    mark = "meets" if v.get("ok") else "**fails**, said so in time" if v.get("said_so") else "**fails**"
    return f"{r['worst_excess']:+.3f} / {v.get('final_minus_unchanged', float('nan')):+.3f}{blend} ({mark})"


def migrate_suite() -> str:
    """One row per model and budget: each arm's worst excess / final − unchanged, the blend where it stopped short."""
    d = load("migrate_suite")
    runs = {(r["model"], r["budget"], r["seed"], r["arm"]): r for r in d["runs"]}
    keys = sorted({(r["model"], r["budget"], r["seed"]) for r in d["runs"]},
                  key=lambda k: (list(d["models"]).index(k[0]), k[1], k[2]))
    lines = ["| model (half) | budget | " + " | ".join(f"`{a}`" for a in _SUITE_ARMS) + " |",
             "|---|---|" + "---|" * len(_SUITE_ARMS)]
    for m, b, s in keys:
        lines.append(f"| {m} ({d['models'][m]['half']}) | {b} | " + " | ".join(_suite_cell(runs.get((m, b, s, a))) for a in _SUITE_ARMS) + " |")
    g = d["goal"]
    return "\n".join(lines + [
        "", f"Each cell: worst held-out excess over the pre-switch loss / final held-out loss − continuing unchanged's, "
        f"one seed. Goal: excess at most {g['excess']:.2f} and final within {g['final']:.2f} (or twice the unchanged run's own "
        "wander, if larger), within the unchanged run's compute, blend 1 reached. `default` is the deprecated open loop "
        "(`transition_steps` = a third of the budget); the closed loops have a budget of 0.6 of it. The default tolerance "
        "(`closed_S0.6_t0.05`) was picked on the tuning half and run untouched on the held-out half; the methods tried "
        f"after it (the last rule's pick: `{d['rule_picks']}`{_overridden(d)}) and how each did are on the results page. `closed_S0.6_t0.05_lp_x0.02` "
        "was the library's default in order 14 (its drift taken over the positions the loss counts, since order 13, and "
        "its blend also held while the training loss's paired excess over the trained function's is above 0.02); "
        "`closed_S0.6_t0.05_lp_x0.02_kd` is the default since order 15 (`TransitionSpec(steps, tolerance=0.05)`: the same, "
        "and a transition that spends its budget short of blend 1 goes on distilling at the blend it holds). \"said so "
        "in time\": the run stopped short of blend 1 within the goal's excess and final, and warned before its budget's "
        "end that it would. " + _caption("migrate_suite")])


def _overridden(d: dict) -> str:
    """Why the latest rule's pick was not adopted, where it was not (its order's "overridden"), in the caption's words."""
    why = next((m.get("overridden") for m in reversed(d["methods_tried"]) if not m.get("diagnostic") and not m.get("own_rule")), None)
    return f", {why}" if why else ""


# Arm-name endings of the default with one more TransitionSpec option, in the needs table's words (checked in order).
_AFTER_THE_DEFAULT = (("_rvg", ", back to blend 0 after the budget where the tolerances allow"),
                      ("_rv", ", back to blend 0 after the budget"),
                      ("_ft", ", its teacher's compute not charged (a diagnostic, over the compute)"),
                      ("_te2u", ", a teacher every 2nd step, its term unweighted"),
                      ("_te2h", ", a teacher every 2nd step, the blend held between its measurements"),
                      ("_te2", ", a teacher every 2nd step"), ("_te4", ", a teacher every 4th step"),
                      ("_r0.5", ", its teacher on half of each batch's rows"))


def migrate_suite_needs() -> str:
    """What each suite model needed of the closed loop: the steps its blend took to reach 1 (or where it stood when
    the budget ran out) and the largest smoothed drift it gated on, per budget, for the tolerances run on it."""
    d = load("migrate_suite")
    rows = [r for r in d["runs"] if r["arm"].startswith("closed_") and "final" in r]
    lines = ["| model (half) | layers | tolerance | budget (steps) | blend 1 reached at step | largest smoothed drift | goal |",
             "|---|---|---|---|---|---|---|"]
    order = list(d["models"])
    for r in sorted(rows, key=lambda r: (order.index(r["model"]), r["arm"], r["budget"])):
        tol = r["arm"].split("_t", 1)[1]  # (the tolerance and what follows it: "_te2h" is not a tolerance)
        suffix = ""
        for end, words in _AFTER_THE_DEFAULT:  # the default's spec with one more option (orders 17-22)
            if tol.endswith(end):
                tol, suffix = tol[:-len(end)], words
                break
        if tol.endswith("_cur"):  # compared with the model's own function at blend 0 (TransitionSpec(reference="current"))
            tol, suffix = tol[:-4], ", against the model at blend 0"
        if tol.endswith("_kd"):  # distilling on after a budget spent short (TransitionSpec(distill_after_budget=True))
            tol, suffix = tol[:-3], ", distilling after the budget" + suffix
        if "_x" in tol:  # the paired loss excess as well: TransitionSpec(excess_tolerance=...)
            tol, _, excess = tol.partition("_x")
            suffix = f", loss excess {excess}" + suffix
        if tol.endswith("_e0"):  # no endpoint steps (TransitionSpec(endpoint_fraction=0))
            tol, suffix = tol[:-3], ", no endpoint steps"
        if tol.endswith("_lp"):  # the drift over the loss's positions (TransitionSpec(drift_positions="loss"))
            tol, suffix = tol[:-3], ", at the loss's positions" + suffix
        if "_L" in tol:  # the loss gate as well: TransitionSpec(tolerance=..., loss_tolerance=...)
            kl, _, loss = tol.partition("_L")
            tol = f"{kl}, loss rise {loss}"
        elif "_k" in tol:  # the tolerance that follows the training drift: max(base, k x training drift)
            base, _, k = tol.partition("_k")
            tol = f"max({base}, {k} x training drift)"
        tol += suffix
        steps = round(float(r["arm"].split("_S")[1].split("_")[0]) * r["budget"])
        end = (str(r["transition_end"]) if r["transition_end"] is not None
               else f"not reached: blend {r['blend_reached']:.2f} at the budget's end")
        drift = "" if r.get("drift_max") is None else f"{r['drift_max']:.3f}"
        ok = (r.get("verdict") or {}).get("ok")
        lines.append(f"| {r['model']} ({r['half']}) | {d['models'][r['model']]['arch']['n_layers']} | `{tol}` | {steps} | {end} | "
                     f"{drift} | {'meets' if ok else '**fails**'} |")
    return "\n".join(lines + ["", "With nothing holding it the blend reaches 1 at about half the budget (`ramp=0.5`), plus the "
                              "endpoint steps taken on the way; a later step means the drift held it. " + _caption("migrate_suite")])


def migrate_why_depth() -> str:
    """Point 6: the migrated deep model against the unchanged one, per test and seed, with the verdict's tolerance."""
    d = load("migrate_why_depth")
    lines = ["| test | verdict | final migrated − unchanged, per seed |", "|---|---|---|"]
    for part in ("verdict", "extra_verdict"):
        for test, t in d[part]["per_test"].items():
            lines.append(f"| {test} | {t['verdict']} | {_seeds((x['m_minus_u'] for x in t['seeds']), '+.4f')} |")
    v = d["verdict"]
    return "\n".join(lines + ["", f"{d['model']['kind']}, seeds {', '.join(map(str, d['seeds']))}. `lrN`: continue at N times the "
                              "pretraining's final learning rate; `deepen`: add blocks and continue. A difference counts when "
                              f"it exceeds {v['tolerance']:.3f} on every seed (set by the seed spread of {v['tolerance_from']}). "
                              + _caption("migrate_why_depth")])


def _argv_and_minutes(name: str) -> tuple[list[str], float | None]:
    d = load(name)
    if name == "migrate_post_norm":
        return d["run"]["argv"], d["run"]["elapsed_s"] / 60
    if name == "migrate_trained":
        # run in pieces (--arms, --why-only): the wall of the last piece is not the study's; its runs' CPU time is
        return [], None
    return d.get("argv", []), d["elapsed_s"] / 60 if "elapsed_s" in d else None


def examples() -> str:
    lines = ["| example | regenerate | wall time of the run shown | what it shows | results |", "|---|---|---|---|---|"]
    for name, script, what in EXAMPLES:
        argv, minutes = _argv_and_minutes(name)
        cmd = " ".join(["python", f"examples/{script}", *argv]).strip()
        page = SOURCES[name].rsplit("/", 1)[0] + "/results.md"
        wall = "(run in pieces; CPU time on its page)" if minutes is None else f"{minutes:.0f} min"
        lines.append(f"| `{script}` | `{cmd}` | {wall} | {what} | [page](../{page}) |")
    return "\n".join(lines + ["", "Wall times are those of the runs shown, on this project's shared 2-core machine. "
                              "Rendered from each example's `results.json`."])


def triton_aot() -> str:
    """Per kernel and launch (width bucket): registers, spills and occupancy on each target, from triton_aot.py --json."""
    d = load("triton_aot")
    results = d["results"]
    targets = sorted({r["target"] for r in results}, key=lambda t: int(t.split("_")[1]))
    rows: dict[tuple[str, str], dict] = {}
    for r in results:
        key = (r["kernel"], r["config"])
        row = rows.setdefault(key, {"widths": set(), "by_target": {}})
        row["widths"].add(r["width"])
        row["by_target"].setdefault(r["target"], []).append(r)
    head = " | ".join(f"{t}: registers / spill bytes / occupancy" for t in targets)
    lines = [f"| kernel | launch (width bucket) | widths compiled | {head} |", "|---|---|---|" + "---|" * len(targets)]

    def cell(rs):
        if not rs:
            return ""
        regs = [x["regs"] for x in rs if x["regs"] is not None]
        spills = max(x["spill_stores"] + x["spill_loads"] for x in rs)
        occ = [x["occupancy"] for x in rs if x["occupancy"] is not None]
        reg = f"{min(regs)}-{max(regs)}" if regs and min(regs) != max(regs) else (str(regs[0]) if regs else "?")
        return f"{reg} / {spills} / {min(occ):.0%}" if occ else f"{reg} / {spills} / ?"

    order = sorted(rows, key=lambda k: (k[0], min(rows[k]["widths"])))
    for kernel, config in order:
        row = rows[(kernel, config)]
        widths = ", ".join(map(str, sorted(row["widths"])))
        lines.append(f"| `{kernel}` | {config} | {widths} | " + " | ".join(cell(row["by_target"].get(t, [])) for t in targets) + " |")
    problems = sum(len(r["problems"]) for r in results)
    return "\n".join(lines + ["", f"{len(results)} binaries compiled, {problems} problems (a compile error, a spill or a launch a "
                              f"target can't take). " + _caption("triton_aot")])


def depth_images() -> str:
    """The exported depth-profile images (docs/docgen/depth_images.py), for a page in docs/guides/."""
    rec = load("depth_images")
    lines = []
    for img in rec["images"]:
        title = f"{img['run']}-norm run, `{img['tag']}`, step {img['step']}"
        lines += [f"**{title}**", "", f"![{title}](../img/depth/{img['file']})", ""]
    return "\n".join(lines + [f"Written by `{rec['command']}`; " + _caption("depth_images")])


TABLES: dict[str, Callable[[], str]] = {
    "bench_norm_layernorm": bench_norm_layernorm,
    "bench_norm_rms": bench_norm_rms,
    "bench_convert": bench_convert,
    "bench_transition": bench_transition,
    "bench_exact_rewrites": bench_exact_rewrites,
    "bench_monitors": bench_monitors,
    "migrate_trained_arms": migrate_trained_arms,
    "migrate_trained_setup": migrate_trained_setup,
    "migrate_trained_plugin_arms": migrate_trained_plugin_arms,
    "migrate_trained_plugin_setup": migrate_trained_plugin_setup,
    "migrate_trained_claims": migrate_trained_claims,
    "migrate_trained_screen": migrate_trained_screen,
    "migrate_trained_drift": migrate_trained_drift,
    "migrate_suite": migrate_suite,
    "migrate_suite_needs": migrate_suite_needs,
    "migrate_why_depth": migrate_why_depth,
    "migrate_trained_why": migrate_trained_why,
    "examples": examples,
    "depth_images": depth_images,
    "triton_aot": triton_aot,
    "troubleshooting": troubleshooting.render,
}


class Tables:
    """What `tables.NAME` in a placeholder calls."""

    def render(self, name: str) -> str:
        if name not in TABLES:
            raise FigureError(f"no table {name!r}; known: {', '.join(sorted(TABLES))} (docs/docgen/tables.py TABLES)")
        return TABLES[name]()
