"""Endpoint calibration (issue 31, point 2, the second method): before blending, fit the end point's own free
parameters to the trained function, with every trained weight frozen.

In the stream-scaled blend to pre-norm each branch writes `D_k * F_k(...)`, `D_k = (1-a) + a*C_k`, its entries
read `(1-a)*x/D_k + a*LN(x)`, a norm's call site writes `(1-a)*D_{k+1}*LN(h) + a*h`, and a final norm convert added
writes `(1-a)*s/D_K + a*LN_f(s)`. At a = 0 every `C` is multiplied by 0 (`D = 1` exactly) and `LN_f` by 0, so the
branch scales `C_k` (BranchScale.c, and the transition's site_before / site_after / final_scale that ramp with them)
and the added final norm's gain and bias are the end point's own parameters: any value leaves blend 0 bit for bit
the trained function. The plugin measures `C_k` on the first training batch (the trained stream's scale); this
fits them, and the final norm's affine, to minimise KL(trained || model at blend 1) on a few training batches:

* the reference: the model itself pinned at blend 0 (`Transition.pinned(0.0)`: the trained function with the
  weights as they are at the calibration), the model's outputs at blend 1 (`pinned(1.0)`) with the parameters
  swapped in by `torch.func.functional_call`, both in eval mode (no dropout) and under a forked random state (the
  run's random numbers, and so its dropout masks, are the unchanged run's);
* the parameters: per scaled branch `log C_k` (a scalar, or per channel: a vector over the model width), the added
  final norms' weight and bias; L-BFGS for a fixed number of evaluations; the objective the KL at blend 1, or its mean
  over several blends (`blends`: the path's middle too, where the stream divisors below move with the scales);
* written back: BranchScale.c, site_before (the scalar the branch's entries divide by: the mean over channels
  when per channel), site_after (the next site's C in the same stack; a stack's last site keeps its measured
  ratio to its C) and final_scale; the final norms' weight and bias. The blend in between stays the same form.

Cost, in the suite's units (forward 1, backward 2, teacher forward 1, in batches of the training batch's size):
one teacher forward per calibration batch, and (1 + 2) per batch and blend per L-BFGS evaluation. `EndpointCalibration` (a
Lightning Callback) adds it to the run's count through `spend`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.func import functional_call

from ln_lightning.placement.migrate import blend as _blend
from ln_lightning.placement.migrate import transition
from ln_lightning.placement.rewrite.scale import BranchScale
from ln_lightning.placement.migrate.teacher import kl_to_teacher, logits_of


class CalibrationError(RuntimeError):
    pass


def _endpoint_parts(model: nn.Module):
    """The transition, its scaled sites' BranchScale modules by name, and the added final norms by name."""
    t = transition.active(model)
    if t is None:
        raise CalibrationError("endpoint calibration: the model is not in a transition (LNPlacement starts one)")
    if not t.scaled:
        raise CalibrationError("endpoint calibration: the transition runs the plain blend (its stream scales could not be "
                               "measured), whose end point has no scales to fit")
    if t.needs_measurement:
        raise CalibrationError("endpoint calibration: the stream scales are not measured yet (LNPlacement measures them on "
                               "the first training batch); calibrate after it")
    if any(t.is_output_site(k) for k in range(len(t.sites))):
        raise CalibrationError("endpoint calibration handles the blend to pre-norm only (a site's scale is an output norm's gain)")
    names = {id(m): n for n, m in model.named_modules()}
    sites = {k: names[id(s)] for k, s in enumerate(t.sites) if isinstance(s, BranchScale) and not s.learnable}
    finals = {n: m for n, m in model.named_modules() if m.__dict__.get(_blend.FINAL_ATTR) is not None}
    return t, sites, finals


def endpoint_kl(model: nn.Module, inputs: list[tuple], overrides: dict | None = None, teacher: list | None = None) -> float:
    """Mean KL(trained || model at blend 1) over `inputs` (eval mode, no gradients)."""
    t = transition.active(model)
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            if teacher is None:
                with t.pinned(0.0):
                    teacher = [logits_of(model(*x)) for x in inputs]
            tot = 0.0
            with t.pinned(1.0):
                for x, ref in zip(inputs, teacher):
                    out = model(*x) if overrides is None else functional_call(model, overrides, x)
                    tot += float(kl_to_teacher(logits_of(out), ref))
        return tot / len(inputs)
    finally:
        model.train(was)


def calibrate(model: nn.Module, inputs: list[tuple], *, evals: int = 12, per_channel: bool = False,
              blends: tuple[float, ...] = (1.0,), spend: Callable[[float], None] | None = None,
              rows_of: Callable[[tuple], float] | None = None) -> dict:
    """Fit the end point's free parameters (see the module doc) on `inputs` (a list of argument tuples of the
    model's forward); returns what it did (KL at blend 1 on `inputs` before and after, evaluations, units spent).
    `blends`: the blends whose mean KL is minimised ((1.0,): the end point alone; (0.5, 1.0): the path's middle too,
    whose stream divisors move with the scales). `spend(units)` is called with the compute as it is spent; `rows_of(inputs)`: its size in training batches (1)."""
    t, sites, finals = _endpoint_parts(model)
    if not sites and not finals:
        raise CalibrationError("endpoint calibration: the end point has no scaled branch and no added final norm")
    rows_of = rows_of or (lambda x: 1.0)
    size = sum(rows_of(x) for x in inputs)  # in training batches
    spent = [0.0]

    def pay(units: float) -> None:
        spent[0] += units
        if spend is not None:
            spend(units)

    was = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            with torch.no_grad(), t.pinned(0.0):
                teacher = [logits_of(model(*x)).detach() for x in inputs]
            pay(1 * size)
            width = None
            for n in finals.values():
                width = n.weight.numel() if getattr(n, "weight", None) is not None else width
            leaves: dict[str, torch.Tensor] = {}
            for k, name in sites.items():
                c = t.sites[k].c.detach().float()
                if per_channel:
                    d = _width_of(model, t, k) if width is None else width
                    leaves[f"{name}.c"] = torch.full((d,), math.log(float(c)), requires_grad=True)
                else:
                    leaves[f"{name}.c"] = torch.log(c).clone().requires_grad_(True)
            for n, m in finals.items():
                for p in ("weight", "bias"):
                    v = getattr(m, p, None)
                    if isinstance(v, torch.Tensor):
                        leaves[f"{n}.{p}"] = v.detach().clone().requires_grad_(True)

            t_name = next(n for n, m in model.named_modules() if m is t)
            prefix = f"{t_name}." if t_name else ""

            def overrides() -> dict:
                out = {k: (v.exp() if k.endswith(".c") else v) for k, v in leaves.items()}
                before, after, final = _path_scales(t, {k: out[f"{n}.c"].float().mean() for k, n in sites.items()})
                out.update({f"{prefix}site_before": before, f"{prefix}site_after": after, f"{prefix}final_scale": final})
                return out

            opt = torch.optim.LBFGS(list(leaves.values()), lr=1.0, max_iter=evals, max_eval=evals, history_size=10,
                                    line_search_fn="strong_wolfe")
            seen: list[tuple[float, dict]] = []  # (loss, parameters) of every evaluation; the first is the measured end point

            def closure():
                if len(seen) >= evals:  # the line search may ask for more than max_eval: the budget is the budget
                    raise _Exhausted
                over = overrides()
                loss = 0.0
                for a in blends:
                    with t.pinned(a):
                        loss = loss + sum(kl_to_teacher(logits_of(functional_call(model, over, x)), ref)
                                          for x, ref in zip(inputs, teacher)) / (len(inputs) * len(blends))
                grads = torch.autograd.grad(loss, list(leaves.values()))
                for v, g in zip(leaves.values(), grads):
                    v.grad = g
                pay(3 * size * len(blends))  # forward 1 + backward 2 per batch and blend
                seen.append((float(loss.detach()), {k: v.detach().clone() for k, v in overrides().items()}))
                return loss.detach()

            try:
                opt.step(closure)
            except _Exhausted:
                pass
            before = seen[0][0]
            after, fitted = min(seen, key=lambda e: e[0])
            if not after < before:  # never write back a worse end point
                return {"kl_before": before, "kl_after": after, "evals": len(seen), "units": spent[0], "applied": False}
            _write_back(model, t, sites, finals, fitted, per_channel)
    finally:
        model.train(was)
    return {"kl_before": before, "kl_after": after, "evals": len(seen), "units": spent[0], "applied": True,
            "scales": {k: (fitted[f"{n}.c"].mean().item()) for k, n in sites.items()}}


class _Exhausted(Exception):
    pass


def _width_of(model: nn.Module, t, k: int) -> int:
    # The model width: a site norm's weight (the norm that reads the stream before branch k).
    for m in model.modules():
        if m.__dict__.get(_blend.SITE_ATTR) == k and getattr(m, "weight", None) is not None:
            return m.weight.numel()
    raise CalibrationError("endpoint calibration per channel: no norm with a weight at the site to read the width from")


def _path_scales(t, c_of: dict[int, torch.Tensor]):
    """The transition's stream divisors for branch scales `c_of` (site -> its C, a 0-dim tensor; the others keep
    theirs), differentiably: site_before[k] = C_k; site_after[k] = the next site's C in its stack (a stack's last keeps
    its measured ratio to its C); an added final norm reads its stack's last after-scale."""
    n = len(t.sites)
    old_b, old_a = t.site_before.detach(), t.site_after.detach()
    before = [c_of[k].reshape(()).to(old_b) if k in c_of else old_b[k] for k in range(n)]
    after = list(old_a.unbind(0)) if n else []
    stacks: dict[str, list[int]] = {}
    for k in range(n):
        stacks.setdefault(t.site_stack[k], []).append(k)
    last_after = {}
    for slots in stacks.values():
        for i, k in enumerate(slots):
            if i + 1 < len(slots):
                after[k] = before[slots[i + 1]]
            else:
                after[k] = old_a[k] * before[k] / old_b[k]
                last_after[float(old_a[k])] = after[k]
    finals = [last_after.get(float(v), v) for v in t.final_scale.detach().unbind(0)] if t.final_scale.numel() else []
    stack = lambda xs, like: torch.stack(xs) if xs else like.detach().clone()  # noqa: E731
    return stack(before, t.site_before), stack(after, t.site_after), stack(finals, t.final_scale)


@torch.no_grad()
def _write_back(model, t, sites: dict, finals: dict, fitted: dict, per_channel: bool) -> None:
    for k, name in sites.items():
        c = fitted[f"{name}.c"]
        scale = t.sites[k]
        if per_channel:
            scale._buffers["c"] = c.to(scale.c)  # (a persistent buffer: a vector now)
        else:
            scale.c.copy_(c.reshape(()))
    for buf in ("site_before", "site_after", "final_scale"):
        getattr(t, buf).copy_(next(v for k, v in fitted.items() if k.rpartition(".")[2] == buf or k == buf))
    for n, m in finals.items():
        for p in ("weight", "bias"):
            key = f"{n}.{p}"
            if key in fitted:
                getattr(m, p).copy_(fitted[key])


class EndpointCalibration(Callback):
    """Calibrates the end point once, at the start of training batch `batches` (the plugin measured the stream
    scales on batch 0), on the model's forward inputs of the `batches` training batches before it (recorded by a
    forward pre-hook on the LightningModule inside training_step). `spend(units)`: the run's compute counter.
    `budget_left()`: the compute the run can still give it; the evaluations are cut to fit (fewer than two: not calibrated, with the reason)."""

    def __init__(self, batches: int = 2, evals: int = 12, per_channel: bool = False, blends: tuple[float, ...] = (1.0,),
                 spend: Callable[[float], None] | None = None,
                 heldout: Callable[[nn.Module], float] | None = None,
                 budget_left: Callable[[], float] | None = None):
        self.budget_left = budget_left  # the units the run may still spend on calibration (None: no limit)
        self.heldout = heldout  # a diagnostic (not counted): the held-out loss, taken at blend 1 before and after
        self.batches, self.evals, self.per_channel, self.blends, self.spend = batches, evals, per_channel, tuple(blends), spend
        self.inputs: list[tuple] = []
        self.results: list[dict] = []
        self._handle = None
        self._in_step = False
        self._recorded_this_step = False
        self._done = False

    def on_train_start(self, trainer, pl_module):
        self._handle = pl_module.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        if module.training and torch.is_grad_enabled() and self._in_step and not self._recorded_this_step and not self._done:
            self.inputs.append(tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args))
            self.inputs = self.inputs[-self.batches:]
            self._recorded_this_step = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        t = transition.active(pl_module)
        if t is None and not self._done:  # never a silent no-op: the run says why it was not calibrated
            self._done = True
            self.results.append({"step": trainer.global_step, "blend": None, "error": "endpoint calibration: the transition "
                                 f"ended (or never started) before batch {self.batches}, where calibration would run"})
        if t is not None and not t.needs_measurement and t.scaled and len(self.inputs) >= self.batches:
            a = float(t.blend)
            if not self._done:
                self._done = True
                diag = {}
                if self.heldout is not None:
                    with t.pinned(1.0):
                        diag["heldout_a1_before"] = self.heldout(pl_module)
                evals = self.evals
                if self.budget_left is not None:  # a teacher forward per batch, then (1 + 2) per batch per evaluation
                    evals = min(evals, int((self.budget_left() - len(self.inputs)) // (3 * len(self.inputs) * len(self.blends))))
                spent = [0.0]

                def spend(units):  # what this calibration spent, recorded even where it stops with an error
                    spent[0] += units
                    if self.spend is not None:
                        self.spend(units)

                try:
                    if evals < 2:
                        raise CalibrationError(f"endpoint calibration: the run's compute left ({self.budget_left():.0f} units) "
                                               "does not pay for two evaluations")
                    r = calibrate(pl_module, list(self.inputs), evals=evals, per_channel=self.per_channel, blends=self.blends,
                                  spend=spend)
                except CalibrationError as e:  # (a fit that stops part-way has spent compute: counted, and said)
                    r = {"error": str(e), "units": spent[0]}
                if self.heldout is not None:
                    with t.pinned(1.0):
                        diag["heldout_a1_after"] = self.heldout(pl_module)
                r.pop("scales", None)
                self.results.append({"step": trainer.global_step, "blend": a, **r, **diag})
        self._in_step, self._recorded_this_step = True, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._in_step = False

    def on_train_end(self, trainer, pl_module):
        if not self._done:
            self._done = True
            self.results.append({"step": trainer.global_step, "blend": None,
                                 "error": f"endpoint calibration: the fit ended before batch {self.batches}"})
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
