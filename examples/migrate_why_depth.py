"""Why migrate, at depth (issue 31, point 6): what the migrated deep model can do that the unchanged one cannot.

The model is the migration suite's deep one, `deep_dropout_lm` (examples/migrate_suite/suite_models.py: 24 post-norm
blocks, d 32, a dropout module per branch, no final norm), pretrained by the suite's own code (`train_one(...,
"pretrain", ...)`) until its held-out loss is flat; its checkpoints are read from --out/pretrain (the suite's seed 0
is copied there; a missing one is pretrained).

Per seed s:
1. Two continuations of the plain Lightning checkpoint, `fit(ckpt_path=...)`, for the same number of steps at the
   pretraining's final (floor) learning rate, on the same batches (seed CONT_SEED + s, checksummed):
     (u) unchanged post-norm, no plugin;
     (m) migrated: LNPlacement("pre", transition=TransitionSpec(steps=B, tolerance=0.05), resume_unconverted=True).
   The migration must have finished (`transition.active(module) is None` at the end). If it did not within the
   budget B, the run says so and both continuations are redone with a doubled budget (and as many steps), up to
   MAX_BUDGET_DOUBLINGS times; results.json records every budget tried.
2. From each end state (weights and AdamW state), on the same batches (seed WHY_SEED + s) and dropout masks, for
   `test_steps` steps, pure torch loops with the suite model's loss, clipping at 1.0:
     lr3, lr10   K x the continuation's learning rate, constant, no warmup (and lr1, the control: both models
                 continued as before; lr30 and lr100, past the pretraining's peak lr: their own verdict line);
     deepen      a quarter of the blocks appended, initialised as migrate_trained_why.py does: pre-norm blocks with
                 zero branch outputs (exactly the identity, with the stream scale of the last trained branch);
                 post-norm blocks with zero branch outputs and copies of the trained last norm (the nearest a post
                 block gets: it re-normalises the stream, and the change is measured), trained at the base lr.
   Recorded per run: held-out loss at the start, worst, final; the gradient norm before clipping (max, median);
   the fraction of steps clipped; diverged (a non-finite loss, or a held-out loss above ln(128), a uniform guess).
3. The verdict, in migrate_trained.py's rule: the tolerance is max(0.01, 2 x the largest spread (population stdev)
   over seeds of a run's final held-out loss); a test favours the migrated model only if, on every seed, it ends
   lower than the unchanged one by more than the tolerance, or stays finite where the unchanged one diverges.
   The headline verdict is over the issue's tests (lr3, lr10, deepen); the others get their own line.

Run:
    python examples/migrate_why_depth.py            # full: 2 seeds, 600-step continuations and tests (~40 min, 1 CPU)
    python examples/migrate_why_depth.py --skip-done --lr-mults 1 3 10 30 100 300   # add a test, reusing the runs done
    python examples/migrate_why_depth.py --quick    # tiny model and steps, into --out (<= 60 s)
    python examples/migrate_why_depth.py --report-only

Writes into --out (default outputs/migrate_why_depth): runs/ (one JSON per run), end_state/ (the continuations'
ends), results.json, results.md; full mode also copies results.json / results.md into docs/results/migrate_why_depth.
One training process at a time, one thread.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "deep_dropout_lm"
WHY_SEED = 200  # the tests of seed s draw their batches and dropout masks with seed WHY_SEED + s, the same for both models
TOLERANCE = 0.05  # the migration's closed-loop tolerance (nats per position)
MAX_BUDGET_DOUBLINGS = 2
CLIP = 1.0
DOCS = ROOT / "docs" / "results" / "migrate_why_depth"
ISSUE_TESTS = ("lr3", "lr10", "deepen")  # what issue 31 asks; other lr multiples (--lr-mults) get their own verdict line

# lr3 and lr10 are the issue's; lr1 is the control (both continue as before), lr30 and lr100 look past the
# pretraining's peak (10x)
FULL = dict(seeds=(0, 1), cont_steps=600, test_steps=600, lr_mults=(1, 3, 10, 30, 100), eval_every=50)
QUICK = dict(seeds=(0, 1), cont_steps=12, test_steps=6, lr_mults=(1, 3, 10, 30, 100), eval_every=3)


def load_suite():
    """examples/migrate_suite.py, by path (its models module is found by the suite's own `_suite()`)."""
    name = "migrate_suite"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "migrate_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def settings(quick: bool) -> dict:
    ms = load_suite()
    sm = ms._suite()
    hp = sm.SUITE[MODEL].hp(quick)
    arch = {**sm.SUITE[MODEL].arch, **hp.get("arch", {})}
    s = dict(QUICK if quick else FULL)
    s.update(base_lr=hp["lr"] * hp["lr_floor"], deepen=max(1, arch["n_layers"] // 4), n_layers=arch["n_layers"], clip=CLIP,
             tolerance=TOLERANCE, diverge_above=math.log(sm.VOCAB))
    return {"suite_hp": hp, "arch": arch, **s}


# ------------------------------------------------------------------------------------------ pretraining


def ensure_pretrained(seed: int, cfg: dict, out: Path) -> dict:
    """The seed's pretrained checkpoint in out/pretrain (the suite's train_one where it is missing); its analysis."""
    ms = load_suite()
    ckpt = out / "pretrain" / f"{MODEL}_seed{seed}.ckpt"
    rec = out / "runs" / f"{MODEL}_pretrain_seed{seed}.json"
    if not ckpt.exists() or not rec.exists():
        print(f"pretraining {MODEL} seed {seed} with the suite's train_one", flush=True)
        r = ms.train_one(MODEL, "pretrain", None, seed, cfg["suite_hp"], out)
        rec.write_text(json.dumps(r))
    return ms.analyse_pretrain(json.loads(rec.read_text()))


# ------------------------------------------------------------------------------------------ continuations


def continue_one(which: str, seed: int, budget: int, cfg: dict, out: Path) -> dict:
    """Continue the seed's checkpoint for `budget` steps, unchanged (u) or migrated (m); saves the end state."""
    import lightning as L
    import logging
    import torch
    from lightning.pytorch.callbacks import Callback

    from ln_lightning import LNPlacement, TransitionSpec
    from ln_lightning.placement import state as rewrite_state
    from ln_lightning.placement.migrate import transition
    from ln_lightning.placement.rewrite.scale import BranchScale

    ms = load_suite()
    sm = ms._suite()
    m = sm.SUITE[MODEL]
    hp = cfg["suite_hp"]
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    eval_b = sm.eval_batches(m, hp)
    every = cfg["eval_every"]
    end_path = out / "end_state" / f"{which}_seed{seed}.pt"
    t0 = time.time()

    class Probe(Callback):
        """The held-out loss every `every` steps before that step's update, at the blend the model holds (as the
        suite's Probe); batch checksums; the end state."""

        def __init__(self):
            self.evals, self.batch_sum, self.blend, self.loss, self.start = [], [], [], [], None
            self.finished, self.ended = None, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = trainer.global_step
            if self.start is None:
                self.start = step
            self.batch_sum.append(int(batch[0].sum()))
            t = transition.active(pl_module)
            trains_at = None if t is None else t.blend.clone()
            if t is not None:
                t.hold()
            self.blend.append(transition.get_blend(pl_module))
            if (step - self.start) % every == 0:
                self.evals.append((step - self.start, sm.heldout_loss(pl_module, eval_b)))
            if trains_at is not None:
                t.blend.copy_(trains_at)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.loss.append(float(pl_module.last_loss))
            if which == "m" and self.ended is None and transition.active(pl_module) is None:
                self.ended = trainer.global_step - self.start  # steps done when the transition machinery was gone

        def on_train_end(self, trainer, pl_module):
            self.evals.append((trainer.global_step - self.start, sm.heldout_loss(pl_module, eval_b)))
            self.final_blend = transition.get_blend(pl_module)
            self.finished = transition.active(pl_module) is None
            if not self.finished:
                return
            opt = trainer.optimizers[0]
            names = {id(p): n for n, p in pl_module.named_parameters()}
            opt_names = [names[id(p)] for g in opt.param_groups for p in g["params"]]
            st = rewrite_state.of(pl_module)
            end_path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({
                "state_dict": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                "optimizer": opt.state_dict(), "opt_param_names": opt_names,
                "config": dict(st.config) if st is not None else None,
                # constants the state_dict may not hold (a non-measured BranchScale's buffer is not persistent)
                "branch_scales": {n: float(b.c) for n, b in pl_module.named_modules() if isinstance(b, BranchScale) and not b.learnable},
                "eval_end": self.evals[-1][1],
            }, end_path)

    plugin = None
    if which == "m":
        plugin = LNPlacement("pre", transition=TransitionSpec(steps=budget, tolerance=cfg["tolerance"]), resume_unconverted=True,
                             log_report=False)
    L.seed_everything(ms.CONT_SEED + seed, verbose=False)
    probe = Probe()
    module = m.build(hp)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=hp["pretrain"] + budget, gradient_clip_val=CLIP,
                        limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, logger=False, plugins=[plugin] if plugin else None, callbacks=[probe],
                        default_root_dir=str(out / "lightning"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=sm.SuiteData(m.task, hp), ckpt_path=str(out / "pretrain" / f"{MODEL}_seed{seed}.ckpt"))
    said = list(dict.fromkeys(str(w.message) for w in caught if "transition" in str(w.message).lower() or "ln_lightning" in (w.filename or "")))
    return {"which": which, "seed": seed, "budget": budget, "steps": len(probe.loss), "evals": probe.evals,
            "batch_sum": probe.batch_sum, "loss": probe.loss, "finished": probe.finished, "final_blend": probe.final_blend,
            "transition_end_step": probe.ended, "warnings": said[:10], "wall_s": time.time() - t0,
            "plugin": None if plugin is None else {"placement": "pre", "transition": plugin.transition.to_dict(),
                                                   "resume_unconverted": True}}


# ------------------------------------------------------------------------------------------ tests


def rebuild(state: dict, cfg: dict, extra_blocks: int):
    """The saved end state as a fresh module with `extra_blocks` more blocks appended (migrate_trained_why's
    initialisation); returns (module, names of the new parameters, placement)."""
    import torch

    from ln_lightning.placement import convert

    ms = load_suite()
    sm = ms._suite()
    m = sm.SUITE[MODEL]
    hp = cfg["suite_hp"]
    n_old = cfg["n_layers"]
    module = m.build({**hp, "arch": {**hp.get("arch", {}), "n_layers": n_old + extra_blocks}})
    c = state["config"]
    if c is not None:
        convert(module, c["placement"], **{k: v for k, v in c.items() if k != "placement"})
    mods = dict(module.named_modules())
    for name, v in state["branch_scales"].items():
        mods[name].c.fill_(v)
    missing, unexpected = module.load_state_dict(state["state_dict"], strict=False)
    unexpected = [k for k in unexpected if k != "ln_lightning_placement"]  # the plugin's marker (convert writes none)
    if unexpected:
        raise RuntimeError(f"rebuild: keys the rebuilt model lacks: {unexpected[:4]}")
    new = [k for k in missing if k.startswith("blocks.") and int(k.split(".")[1]) >= n_old]
    if set(missing) - set(new):
        raise RuntimeError(f"rebuild: trained keys missing from the end state: {sorted(set(missing) - set(new))[:4]}")
    scales = {n: b for n, b in module.named_modules() if n.startswith("blocks.") and hasattr(b, "c") and not getattr(b, "learnable", True)}
    with torch.no_grad():
        for i in range(n_old, n_old + extra_blocks):
            b = module.blocks[i]
            for lin in (b.attn.proj, b.mlp[2]):  # the branches write nothing: x + 0 (pre) / LN(x + 0) (post)
                lin.weight.zero_()
                lin.bias.zero_()
            if c is None:  # post-norm: the new norms copy the trained last norm
                src = module.blocks[n_old - 1].ln2
                for ln in (b.ln1, b.ln2):
                    ln.weight.copy_(src.weight)
                    ln.bias.copy_(src.bias)
            else:  # the stream scale the last trained branch wrote at
                last = [v for n, v in scales.items() if n.startswith(f"blocks.{n_old - 1}.")]
                for n, s in scales.items():
                    if n.startswith(f"blocks.{i}.") and last:
                        s.c.copy_(last[-1].c)
    return module, new, "post" if c is None else c["placement"]


def run_test(which: str, test: str, seed: int, cfg: dict, out: Path) -> dict:
    """One test from the end state of continuation `which`: 'lr3', 'lr10' or 'deepen'."""
    import torch
    from torch import nn

    ms = load_suite()
    sm = ms._suite()
    m = sm.SUITE[MODEL]
    hp = cfg["suite_hp"]
    t0 = time.time()
    state = torch.load(out / "end_state" / f"{which}_seed{seed}.pt", map_location="cpu", weights_only=False)
    extra = cfg["deepen"] if test == "deepen" else 0
    module, new, placement = rebuild(state, cfg, extra)
    lr = cfg["base_lr"] * (int(test[2:]) if test.startswith("lr") else 1)
    names = [n for n, _ in module.named_parameters()]
    params = [p for _, p in module.named_parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=module.hparams.get("weight_decay", 0.0))
    old = {n: i for i, n in enumerate(state["opt_param_names"])}
    saved = state["optimizer"]
    kept = {j: saved["state"][old[n]] for j, n in enumerate(names) if n in old and old[n] in saved["state"]}
    group = {k: v for k, v in saved["param_groups"][0].items() if k not in ("initial_lr",)}
    opt.load_state_dict({"state": kept, "param_groups": [dict(group, params=list(range(len(names))), lr=lr)]})
    eval_b = sm.eval_batches(m, hp)
    start = sm.heldout_loss(module, eval_b)
    source_end = None
    if extra:
        src, _, _ = rebuild(state, cfg, 0)
        source_end = sm.heldout_loss(src, eval_b)
    # the rebuilt model computes the continuation's end function (a silent mismatch would void the comparison);
    # pre-norm's appended blocks are exactly the identity
    rebuilt = source_end if extra else start
    if abs(rebuilt - state["eval_end"]) > 1e-4:
        raise RuntimeError(f"{which} seed {seed}: the rebuilt model's held-out loss {rebuilt:.6f} is not the continuation's end "
                           f"{state['eval_end']:.6f}")
    if extra and placement != "post" and abs(start - source_end) > 1e-5:
        raise RuntimeError(f"{which} seed {seed}: appending identity blocks changed the held-out loss {source_end:.6f} -> {start:.6f}")
    train_set, _ = sm.datasets(m.task, hp)
    g = torch.Generator().manual_seed(WHY_SEED + seed)
    torch.manual_seed(WHY_SEED + seed)  # dropout masks
    bs = hp["batch_size"]
    order: list[int] = []
    evals, losses, grads, sums = [(0, start)], [], [], []
    module.train()
    for step in range(cfg["test_steps"]):
        if len(order) < bs:
            order += torch.randperm(len(train_set), generator=g).tolist()
        idx, order = order[:bs], order[bs:]
        x, y = (torch.stack(z) for z in zip(*(train_set[i] for i in idx)))
        sums.append(int(x.sum()))
        loss = module.batch_loss((x, y), sm.step_generator(step, module.salt))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = float(nn.utils.clip_grad_norm_(params, cfg["clip"]))
        opt.step()
        losses.append(float(loss.detach()))
        grads.append(gn)
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["test_steps"]:
            evals.append((step + 1, sm.heldout_loss(module, eval_b)))
        if not math.isfinite(float(loss)):
            evals.append((step + 1, sm.heldout_loss(module, eval_b)))
            break
    return {"which": which, "test": test, "seed": seed, "placement": placement, "lr": lr, "extra_blocks": extra,
            "new_params": len(new), "kept_opt_state": len(kept), "evals": evals, "loss": losses, "grad_norm": grads,
            "batch_sum": sums, "start": start, "source_end": source_end, "continuation_end": state["eval_end"],
            "wall_s": time.time() - t0}


# ------------------------------------------------------------------------------------------ analysis


def summarize_test(r: dict, cfg: dict) -> dict:
    ev = [v for _, v in r["evals"]]
    g = [x for x in r["grad_norm"] if math.isfinite(x)]
    k = max(1, len(g) // 10)
    finite = all(math.isfinite(v) for v in ev) and all(math.isfinite(x) for x in r["loss"])
    worst = max(ev) if finite else float("inf")
    return {"which": r["which"], "test": r["test"], "seed": r["seed"], "placement": r["placement"], "lr": r["lr"],
            "extra_blocks": r["extra_blocks"], "start": r["start"], "source_end": r["source_end"],
            "continuation_end": r["continuation_end"], "worst": worst, "final": ev[-1] if finite else float("inf"),
            "steps": len(r["loss"]), "grad_max": max(g) if g else float("nan"), "grad_median": statistics.median(g) if g else float("nan"),
            "grad_median_last10": statistics.median(g[-k:]) if g else float("nan"),
            "clipped": sum(x > cfg["clip"] for x in g) / len(g) if g else float("nan"),
            "diverged": (not finite) or worst > cfg["diverge_above"], "evals": [[s, v] for s, v in r["evals"]],
            "wall_s": r["wall_s"]}


def summarize_cont(r: dict) -> dict:
    ev = [v for _, v in r["evals"]]
    return {"which": r["which"], "seed": r["seed"], "budget": r["budget"], "steps": r["steps"], "start": ev[0], "worst": max(ev),
            "worst_excess": max(ev) - ev[0], "final": ev[-1], "finished": r["finished"], "final_blend": r["final_blend"],
            "transition_end_step": r["transition_end_step"], "warnings": r["warnings"], "plugin": r["plugin"],
            "evals": [[s, v] for s, v in r["evals"]], "wall_s": r["wall_s"]}


def verdict(tests: list[dict], conts: list[dict], seeds: list[int], names: list[str]) -> dict:
    """migrate_trained.py's rule: tolerance max(0.01, 2 x the largest seed spread of a run's final held-out loss);
    per test, the migrated model is better only if it ends lower by more than the tolerance on every seed, or stays
    finite where the unchanged one diverges; worse symmetrically; otherwise no difference (every seed within the
    tolerance) or mixed."""
    groups: dict = {}
    for r in (r for r in tests if r["test"] in names):
        groups.setdefault((r["test"], r["which"]), []).append(r["final"])
    for r in conts:
        groups.setdefault(("continuation", r["which"]), []).append(r["final"])
    spreads = {k: statistics.pstdev(v) for k, v in groups.items() if len(v) > 1 and all(math.isfinite(x) for x in v)}
    widest = max(spreads, key=spreads.get, default=None)
    tol = max(0.01, 2 * max(spreads.values(), default=0.0))
    per_test = {}
    for t in names:
        rows = []
        for s in seeds:
            u = next((r for r in tests if (r["test"], r["which"], r["seed"]) == (t, "u", s)), None)
            m = next((r for r in tests if (r["test"], r["which"], r["seed"]) == (t, "m", s)), None)
            if u is None or m is None:
                continue
            d = m["final"] - u["final"] if math.isfinite(m["final"]) and math.isfinite(u["final"]) else None
            better = (u["diverged"] and not m["diverged"]) or (d is not None and not m["diverged"] and d < -tol)
            worse = (m["diverged"] and not u["diverged"]) or (d is not None and not u["diverged"] and d > tol)
            rows.append({"seed": s, "m_minus_u": d, "better": better, "worse": worse, "u_diverged": u["diverged"], "m_diverged": m["diverged"]})
        if len(rows) < len(seeds):
            per_test[t] = {"verdict": "incomplete", "seeds": rows}
            continue
        v = ("migrated better" if all(r["better"] for r in rows) else "migrated worse" if all(r["worse"] for r in rows)
             else "no difference" if not any(r["better"] or r["worse"] for r in rows) else "mixed")
        per_test[t] = {"verdict": v, "seeds": rows}
    better = [t for t, v in per_test.items() if v["verdict"] == "migrated better"]
    worse = [t for t, v in per_test.items() if v["verdict"] == "migrated worse"]
    return {"tolerance": tol, "tolerance_from": None if widest is None or 2 * spreads[widest] < 0.01 else f"{widest[0]} {LABEL[widest[1]]}",
            "per_test": per_test, "supported": bool(better), "better_in": better, "worse_in": worse,
            "complete": all(v["verdict"] != "incomplete" for v in per_test.values()) and len(per_test) == len(names)}


def verdict_sentence(v: dict, label: str = "Why migrate, at depth") -> str:
    def ds(t):
        return ", ".join("—" if r["m_minus_u"] is None else f"{r['m_minus_u']:+.4f}" for r in v["per_test"][t]["seeds"])

    parts = "; ".join(f"{t}: {v['per_test'][t]['verdict']} (final migrated − unchanged per seed {ds(t)})" for t in v["per_test"])
    if v["supported"]:
        head = f"**{label}: supported** in {', '.join(v['better_in'])}"
    else:
        head = (f"**{label}: not supported** as measured: in no test did the migrated model end better than the "
                "unchanged one by more than the tolerance on every seed (or stay finite where the unchanged one diverged)")
    if v["worse_in"]:
        head += f"; the migrated model is worse in {', '.join(v['worse_in'])}"
    src = f", set by the seed spread of {v['tolerance_from']}" if v.get("tolerance_from") else ""
    return f"{head}. Tolerance {v['tolerance']:.3f}{src}. {parts}."


# ------------------------------------------------------------------------------------------ report


def render_markdown(res: dict) -> str:
    c = res["settings"]
    L = ["# Why migrate, at depth (issue 31, point 6)", ""]
    if res["quick"]:
        L += ["**Quick mode** (tiny model and steps, for CI): these numbers say nothing about the question.", ""]
    L += ["## Setup", "",
          f"- Model: the migration suite's `{MODEL}` ({res['model']['kind']}; {c['arch']}), no final norm, pretrained by "
          f"the suite's own code ({c['suite_hp']['pretrain']} steps, peak lr {c['suite_hp']['lr']:g} cosine to a floor of "
          f"{c['suite_hp']['lr_floor']:g}, batch {c['suite_hp']['batch_size']} x {c['suite_hp']['block_size']} characters). "
          "Seeds " + ", ".join(str(s) for s in res["seeds"]) + ".",
          "- Pretraining: " + "; ".join(f"seed {s}: held-out {p['eval_end']:.4f} at the end, last 10% vs the 10% before "
                                       f"{p['flat_rel'] * 100:.2f}% ({'flat' if p['flat'] else 'NOT flat'})" for s, p in res["pretrain"].items()) + ".",
          f"- Continuations from the plain Lightning checkpoint, same batches (checksummed: "
          f"{'the same' if res['same_batches']['continuation'] else 'NOT the same'}), lr {c['base_lr']:g} (the floor), clip {CLIP}: "
          f"(u) unchanged post-norm; (m) `LNPlacement(\"pre\", transition=TransitionSpec(steps=B, tolerance={c['tolerance']}), "
          "resume_unconverted=True)` (stream-scaled blend, closed loop, the plugin's defaults otherwise; adds a final norm). "
          "Budgets tried: " + "; ".join(f"seed {b['seed']}: B={b['budget']} {'finished' if b['finished'] else 'did NOT finish'}"
                                       for b in res["budgets_tried"]) + ".",
          f"- Tests from each end state (weights and AdamW state), {c['test_steps']} steps, same batches and dropout masks for "
          f"both models (checksummed: {'the same' if res['same_batches']['tests'] else 'NOT the same'}): "
          + ", ".join(f"lr{k}: {k} x {c['base_lr']:g}, constant, no warmup" + (" (the control)" if k == 1 else "")
                      for k in c["lr_mults"])
          + f"; deepen: {c['deepen']} blocks (a quarter of {c['n_layers']}) appended and trained at {c['base_lr']:g} — pre-norm: "
          "zero branch outputs, with the last trained branch's stream scale (exactly the identity); post-norm: zero branch "
          "outputs and copies of the trained last norm (not the identity: it re-normalises the stream; the change is the "
          "jump from `source end` to `start`).",
          f"- Held-out: the suite's fixed windows, eval mode. Diverged: a non-finite loss, or a held-out loss above "
          f"ln 128 = {c['diverge_above']:.3f} (a uniform guess). Gradient norm before clipping at {CLIP}.", "",
          "## The continuations", "",
          "| model | seed | budget | held-out at the start | worst excess | final | transition ended at step | wall s |",
          "|---|---|---|---|---|---|---|---|"]
    for r in res["continuations"]:
        te = "—" if r["which"] == "u" else (str(r["transition_end_step"]) if r["finished"] else f"not finished (blend {r['final_blend']:.3f})")
        L.append(f"| {LABEL[r['which']]} | {r['seed']} | {r['budget']} | {r['start']:.4f} | {r['worst_excess']:+.4f} | "
                 f"{r['final']:.4f} | {te} | {r['wall_s']:.0f} |")
    L += ["", "## The tests", "",
          "| test | model | seed | source end | held-out at the start | worst | final | final − start | "
          "grad norm max / median (last 10%) | clipped | diverged |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["tests"]:
        se = "" if r["source_end"] is None else f"{r['source_end']:.4f}"
        L.append(f"| {r['test']} | {LABEL[r['which']]} | {r['seed']} | {se} | {r['start']:.4f} | {r['worst']:.4f} | {r['final']:.4f} | "
                 f"{r['final'] - r['start']:+.4f} | {r['grad_max']:.2f} / {r['grad_median_last10']:.2f} | {r['clipped']:.0%} | {'YES' if r['diverged'] else 'no'} |")
    v = res["verdict"]
    L += ["", "## Verdict", "", "- " + res["verdict_sentence"]]
    if res.get("extra_verdict_sentence"):
        L.append("- " + res["extra_verdict_sentence"] + (
            " (lr1 is the control: both models continued as before; a difference there comes from the end states, not from "
            "a test.)" if "lr1" in res["extra_verdict"]["per_test"] else ""))
    L += [
          f"- Rule (migrate_trained.py's): tolerance = max(0.01, 2 x the largest spread over seeds of a run's final held-out "
          f"loss) = {v['tolerance']:.3f}; a test favours the migrated model only if it ends lower by more than that on every "
          "seed, or stays finite where the unchanged one diverges."]
    if res.get("notes"):
        L += ["", "## What limits it", ""] + [f"- {n}" for n in res["notes"]]
    L += ["", f"Wall time of the runs: {res['timing']['runs_wall_s']:.0f} s in all (both seeds' pretrainings included: seed 0 by the suite, the rest here)"
          f", one training process at a time, one thread, on 2 CPUs shared with other jobs."]
    return "\n".join(L) + "\n"


LABEL = {"u": "unchanged (post)", "m": "migrated (pre)"}

def unigram_xent(cfg: dict) -> float:
    """The held-out cross-entropy of predicting each character by its frequency in the training text: where a model
    that has forgotten its context lands."""
    import torch

    sm = load_suite()._suite()
    m = sm.SUITE[MODEL]
    train, _ = sm.datasets(m.task, cfg["suite_hp"])
    counts = torch.bincount(train.data, minlength=sm.VOCAB).double() + 1.0
    logp = (counts / counts.sum()).log()
    ys = torch.cat([y.reshape(-1) for _, y in sm.eval_batches(m, cfg["suite_hp"])])
    return float(-logp[ys].mean())


def limits(cfg: dict, conts: list[dict], rows: list[dict], seeds: list[int], tests: list[str]) -> list[str]:
    """What limits the result, with the numbers that say so."""
    def fmt(xs, f="{:+.4f}"):
        return " / ".join(f.format(x) for x in xs)

    cont = {(r["which"], r["seed"]): r for r in conts}
    row = {(r["test"], r["which"], r["seed"]): r for r in rows}
    clipped = [r["clipped"] for r in rows if math.isfinite(r["clipped"])]
    ends = [cont[("m", s)]["final"] - cont[("u", s)]["final"] for s in seeds]
    m_end = [cont[("m", s)]["transition_end_step"] for s in seeds]
    out = [
        "One model (the suite's deep one), two seeds, one continuation length and one test length "
        f"({cfg['test_steps']} steps): a difference smaller than the tolerance, or one that needs thousands of steps to "
        "show, is not resolved.",
        f"The learning rates are multiples of the continuation's floor ({cfg['base_lr']:g}, the pretraining's final lr, "
        f"{cfg['suite_hp']['lr_floor']:g} of its peak {cfg['suite_hp']['lr']:g}): "
        f"{round(1 / cfg['suite_hp']['lr_floor'])}x is the pretraining's peak, reached here without warmup. The largest "
        f"multiple tried is {max(cfg['lr_mults'])}x; " + (
            "none diverged (non-finite, or above ln 128)" if not any(r["diverged"] for r in rows)
            else "diverged: " + ", ".join(f"{r['test']} {LABEL[r['which']]} seed {r['seed']}" for r in rows if r["diverged"]))
        + ". Divergence is judged on the held-out loss every eval_every steps and on the training loss's finiteness; a run "
        "that degrades without crossing ln 128 counts as finite, and only its final loss enters the verdict. Predicting "
        f"each character by its training frequency scores {cfg['unigram_xent']:.3f} on the held-out windows; runs that "
        "end within 0.1 of it have lost their context: " + (", ".join(
            f"{r['test']} {LABEL[r['which']]} seed {r['seed']} ({r['final']:.3f})" for r in rows
            if abs(r["final"] - cfg["unigram_xent"]) < 0.1) or "none") + ".",
        f"Gradients are clipped at {cfg['clip']} in every run (as in pretraining). In {sum(c > 0.75 for c in clipped)} of "
        f"{len(clipped)} runs the norm before clipping was above it on more than 75% of the steps: nearly every update "
        "there is a clipped one, whose size the clip sets, so a larger gradient shows in the grad-norm and clipped "
        "columns, not as a larger step" + ("" if all(c > 0.75 for c in clipped) else " (the others: " + ", ".join(
            f"{r['test']} {LABEL[r['which']]} seed {r['seed']} {r['clipped']:.0%}" for r in rows if r["clipped"] <= 0.75) + ")")
        + ". These are tests of clipped training, the way it is run, not of unclipped training.",
        "Deepening compares two different initialisations: pre-norm's new blocks are exactly the identity (their start "
        "is the source end); post-norm's cannot be (their norms re-normalise the stream): its start is "
        + fmt([row[("deepen", "u", s)]["start"] - row[("deepen", "u", s)]["source_end"] for s in seeds]) +
        " above its source end, and what is measured is how far it recovers.",
        f"The two end states are not equally trained: the migrated continuation spent {fmt(m_end, '{}')} of its "
        f"{fmt([cont[('m', s)]['budget'] for s in seeds], '{}')} steps in the transition and ended "
        f"{fmt(ends)} (per seed) from the unchanged one. The verdict compares where each model ends, as the rule says; "
        "the `final − start` column shows what each test's training itself did.",
    ]
    def gain(t, w, s):  # what the test's training did, from the model it started from (deepen: before the blocks)
        r = row[(t, w, s)]
        return r["final"] - (r["source_end"] if r["source_end"] is not None else r["start"])

    complete = [t for t in tests if all((t, w, s) in row for w in "um" for s in seeds)]
    if complete:
        out.append("Read from each test's starting model instead (not the rule; the migrated model's final minus its end "
                   "state's held-out loss, minus the same for the unchanged one, per seed): "
                   + "; ".join(f"{t} {fmt([gain(t, 'm', s) - gain(t, 'u', s) for s in seeds])}" for t in complete)
                   + ". Negative: the migrated model gained more; part of it may be that it started higher.")
    lr_tests = [t for t in complete if t.startswith("lr")]
    if lr_tests:
        out.append("The gradient before clipping, unchanged → migrated, per seed (clipped fraction; median over the last 10% "
                   "of steps; max): " + "; ".join(
                       f"{t} " + " → ".join(fmt([row[(t, w, s)]['clipped'] for s in seeds], '{:.0%}') + ", "
                                           + fmt([row[(t, w, s)]['grad_median_last10'] for s in seeds], '{:.2f}') + ", "
                                           + fmt([row[(t, w, s)]['grad_max'] for s in seeds], '{:.2f}') for w in "um")
                       for t in lr_tests) + ". It says how hard the clip worked, not how the loss ended.")
    if "lr1" in complete and "deepen" in complete:
        out.append("Deepening against its control (lr1: the same steps at the same lr, no blocks added), final held-out "
                   "deepened − not, per seed: unchanged (post) "
                   + fmt([row[("deepen", "u", s)]["final"] - row[("lr1", "u", s)]["final"] for s in seeds])
                   + "; migrated (pre) " + fmt([row[("deepen", "m", s)]["final"] - row[("lr1", "m", s)]["final"] for s in seeds]) + ".")
    return out


# ------------------------------------------------------------------------------------------ driver


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model and steps (<= 60 s), for CI")
    p.add_argument("--out", default=None, help="output folder (default outputs/migrate_why_depth, quick: outputs/migrate_why_depth_quick)")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--lr-mults", type=int, nargs="+", default=None, help="the lr tests' multiples of the base lr (default 3 10)")
    p.add_argument("--skip-done", action="store_true", help="reuse the runs already in --out/runs (run only the missing ones)")
    p.add_argument("--report-only", action="store_true", help="rebuild results.json / results.md from runs/")
    p.add_argument("--no-docs", action="store_true", help="full mode: don't copy the results into docs/results/migrate_why_depth")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    cfg = settings(args.quick)
    if args.lr_mults:
        cfg["lr_mults"] = tuple(args.lr_mults)
    seeds = list(args.seeds if args.seeds is not None else cfg["seeds"])
    out = Path(args.out or ("outputs/migrate_why_depth_quick" if args.quick else "outputs/migrate_why_depth"))
    (out / "runs").mkdir(parents=True, exist_ok=True)
    tests = [f"lr{k}" for k in cfg["lr_mults"]] + ["deepen"]
    budgets_tried = []
    done = json.loads((out / "budgets_tried.json").read_text()) if (out / "budgets_tried.json").exists() else []
    if not args.report_only:
        for s in seeds:
            ensure_pretrained(s, cfg, out)
            if args.skip_done and all((out / "runs" / f"cont_{w}_seed{s}.json").exists() for w in "um") and any(
                    b["seed"] == s for b in done):
                budgets_tried += [b for b in done if b["seed"] == s]
                budget = None
            else:
                budget = cfg["cont_steps"]
            for attempt in range(MAX_BUDGET_DOUBLINGS + 1 if budget is not None else 0):
                rm = continue_one("m", s, budget, cfg, out)
                budgets_tried.append({"seed": s, "budget": budget, "finished": rm["finished"], "final_blend": rm["final_blend"]})
                (out / "runs" / f"cont_m_seed{s}.json").write_text(json.dumps(rm))
                print(f"seed {s}: migrated continuation, budget {budget}: "
                      f"{'finished at step ' + str(rm['transition_end_step']) if rm['finished'] else 'NOT finished, blend ' + format(rm['final_blend'], '.3f')} "
                      f"({time.time() - t0:.0f} s)", flush=True)
                if rm["finished"]:
                    break
                print(f"seed {s}: the migration did not finish within {budget} steps; doubling the budget", flush=True)
                budget *= 2
            else:
                if budget is not None:
                    raise SystemExit(f"seed {s}: the migration did not finish within {budget // 2} steps; no end state to test from")
            if budget is not None:
                ru = continue_one("u", s, budget, cfg, out)
                (out / "runs" / f"cont_u_seed{s}.json").write_text(json.dumps(ru))
                print(f"seed {s}: unchanged continuation, {budget} steps ({time.time() - t0:.0f} s)", flush=True)
            for t in tests:
                for which in ("u", "m"):
                    if args.skip_done and (out / "runs" / f"test_{t}_{which}_seed{s}.json").exists():
                        continue
                    r = run_test(which, t, s, cfg, out)
                    (out / "runs" / f"test_{t}_{which}_seed{s}.json").write_text(json.dumps(r))
                    print(f"seed {s}: {t} {LABEL[which]}: start {r['start']:.4f} final {r['evals'][-1][1]:.4f} "
                          f"({time.time() - t0:.0f} s)", flush=True)
        budgets_tried = [b for b in done if b["seed"] not in seeds] + budgets_tried
        (out / "budgets_tried.json").write_text(json.dumps(budgets_tried))
    elif (out / "budgets_tried.json").exists():
        budgets_tried = json.loads((out / "budgets_tried.json").read_text())
    res = report(out, cfg, seeds, tests, budgets_tried, args.quick, {"wall_s": time.time() - t0})
    text = render_markdown(res)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(text)
    if not args.quick and not args.no_docs:
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "results.json", DOCS / "results.json")
        shutil.copy(out / "results.md", DOCS / "results.md")
    print(text)
    return 0


def report(out: Path, cfg: dict, seeds: list[int], tests: list[str], budgets_tried: list, quick: bool, timing: dict) -> dict:
    ms = load_suite()
    sm = ms._suite()
    pre = {s: ms.analyse_pretrain(json.loads((out / "runs" / f"{MODEL}_pretrain_seed{s}.json").read_text())) for s in seeds}
    raw_c = {(w, s): json.loads((out / "runs" / f"cont_{w}_seed{s}.json").read_text()) for s in seeds for w in ("u", "m")}
    raw_t = {(t, w, s): json.loads((out / "runs" / f"test_{t}_{w}_seed{s}.json").read_text()) for s in seeds for t in tests for w in ("u", "m")}
    conts = [summarize_cont(raw_c[(w, s)]) for s in seeds for w in ("u", "m")]
    rows = [summarize_test(raw_t[(t, w, s)], cfg) for t in tests for w in ("u", "m") for s in seeds]
    same_c = all(raw_c[("m", s)]["batch_sum"] == raw_c[("u", s)]["batch_sum"] for s in seeds)
    same_t = all(raw_t[(t, "m", s)]["batch_sum"] == raw_t[(t, "u", s)]["batch_sum"][:len(raw_t[(t, "m", s)]["batch_sum"])]
                 for t in tests for s in seeds)
    v = verdict(rows, conts, seeds, [t for t in tests if t in ISSUE_TESTS])
    extra = [t for t in tests if t not in ISSUE_TESTS]
    v_extra = verdict(rows, conts, seeds, extra) if extra else None
    cfg = {**cfg, "unigram_xent": unigram_xent(cfg)}
    notes = limits(cfg, conts, rows, seeds, tests)
    timing = {**timing, "runs_wall_s": sum(r["wall_s"] for r in [*raw_c.values(), *raw_t.values()])
              + sum(json.loads((out / "runs" / f"{MODEL}_pretrain_seed{s}.json").read_text())["wall_s"] for s in seeds)}
    if any(not b["finished"] for b in budgets_tried):
        notes.insert(0, "The migration did not finish within the first budget on " + ", ".join(
            f"seed {b['seed']} (B={b['budget']}, blend {b['final_blend']:.3f})" for b in budgets_tried if not b["finished"])
            + "; the continuations (both models) used the doubled budget that finished.")
    return {"issue": 31, "point": 6, "quick": quick, "model": {"name": MODEL, "kind": sm.SUITE[MODEL].kind}, "seeds": seeds,
            "settings": cfg, "pretrain": pre, "budgets_tried": budgets_tried, "continuations": conts, "tests": rows,
            "same_batches": {"continuation": same_c, "tests": same_t}, "verdict": v, "verdict_sentence": verdict_sentence(v),
            "extra_verdict": v_extra, "extra_verdict_sentence": None if v_extra is None else verdict_sentence(
                v_extra, "Beyond the issue's tests (" + ", ".join(extra) + ")"),
            "notes": notes, "timing": timing}


if __name__ == "__main__":
    sys.exit(main())
