"""One Trainer call's drive of a model's placement transition: `TransitionRun`.

The model owns the transition's state (``ln_lightning.placement.migrate.blend.Transition``: the blend, the steps done,
the smoothed drift, in persistent buffers); this object owns what one fit does with it: the distillation that
measures the drift, the stream scales' measurement on the first batch, the endpoint steps, the closed loop's
gate and pace, and what the dashboard and the report are told. The plugin calls it twice per training batch
(`begin_step`, `end_step`), once at the start of training (`start`) and once at the end (`close`); nothing else
moves the blend.
"""

from __future__ import annotations

import logging
import math

import torch
from lightning.pytorch import LightningModule, Trainer

from ln_lightning._distill import Distillation
from ln_lightning._warnings import info, warn
from ln_lightning.placement import state as rewrite_state
from ln_lightning.placement.spec import LOSS_BASELINE_STEPS, TRAINING_DRIFT_EVERY, TransitionSpec
from ln_lightning.placement.migrate.transition_control import endpoint_step

log = logging.getLogger("ln_lightning.plugin")

# A checkpoint's entry for what one fit's closed loop smooths outside the model's buffers (the loss excess), so a
# resumed fit gates as the uninterrupted one would.
CHECKPOINT_KEY = "ln_lightning_transition_run"


def _log_every(trainer: Trainer) -> int:
    """Lightning's log_every_n_steps (50 where the Trainer has none): the steps that may read the host."""
    return max(1, int(getattr(trainer, "log_every_n_steps", 50) or 50))


class TransitionRun:
    """What one fit of a model in a transition holds, from `on_train_start` to the end of the Trainer call."""

    def __init__(self, spec: TransitionSpec, placement: str):
        self.spec, self.placement = spec, placement
        self.teacher_state: dict | None = None  # the teacher the ckpt_path checkpoint holds
        self.distill: Distillation | None = None  # the transition's distillation (TransitionSpec.distill)
        self.measuring = False  # the stream scales are being recorded in this batch's forward
        self.measured = False  # ... and were, in this run
        self.endpoint = False  # the current optimizer step trains at blend 1
        self.over_budget = False  # a closed loop spent its budget short of blend 1 (it holds the blend it reached)
        self.warned_pace = False  # ... and said, past a quarter of its budget, that it would
        self.pace = _Pace()  # its blend as read, for that
        # ... and, on the device, the steps done when the blend last moved, so a stall is told from a slow pace
        # however far apart the reads are (None until the closed loop's fit starts)
        self.moved_at: torch.Tensor | None = None
        self.holds: torch.Tensor | None = None  # ... and the steps since that gated and held it (endpoint and
        # teacher_every's steps without a teacher hold it without a verdict: not counted, so they are no stall)
        self._blend_seen: torch.Tensor | None = None
        self.unfinished: dict | None = None  # what the report JSON adds for a closed loop stopped by its budget
        # TransitionSpec.revert_after_budget: a spent budget going back to blend 0 ("ramp": the steps that takes, counted
        # on the host; "gated": None, the blend is read on logging steps), and the steps since the budget's end.
        self.reverting = False
        self.retreat_left: int | None = None
        self.after_budget_steps = 0
        self.finished: torch.Tensor | None = None  # 1, logged as ln_placement/transition once the transition ended
        self.distilled = False  # ... and whether ln_placement/distill_kl was logged during it (then logged 0)
        self.training_drift: torch.Tensor | None = None  # TransitionSpec.training_drift_factor: its smoothed measurement
        self.last_training_drift: torch.Tensor | None = None  # ... and its last measurement (device), as logged
        self.last_tolerance: torch.Tensor | None = None  # ... and the drift tolerance it raised (device), as logged
        self.loss_gate = _LossGate(spec.loss_tolerance, spec.steps) if spec.loss_tolerance is not None else None
        self.excess: torch.Tensor | None = None  # TransitionSpec.excess_tolerance: the smoothed loss excess (device)
        self.logged_drift = False  # the closed loop's drift was measured and logged in this fit (teacher_every holds it)
        # TransitionSpec.teacher_rows as the checkpoint this fit resumed from settled it (rows_state, rows_reason): a
        # resumed fit goes on as the uninterrupted one does, without comparing the rows again
        self.rows_settled: tuple[str, str | None] | None = None

    # ------------------------------------------------------------------ the plugin's calls
    def start(self, trainer: Trainer, pl_module: LightningModule, t) -> None:
        """Training starts (the trained weights and a resumed checkpoint's teacher are in; no step has run)."""
        spec = self.spec
        if t.closed:
            self._start_pace(t)
        if t.closed and t.host_steps >= t.steps:  # a second fit of a transition that spent its budget
            self._warn_over_budget(trainer, t, float(t.blend))
        if self.loss_gate is not None and t.host_steps > 0:
            info(log, f"LNPlacement: the transition resumes at step {t.host_steps}; its loss gate (loss_tolerance="
                 f"{spec.loss_tolerance:g}) measures where the loss starts again, over this fit's first "
                 f"{self.loss_gate.baseline_steps} held-blend steps.")
        if spec.distill <= 0 and not t.closed:
            return
        self.distill = Distillation(spec.distill, spec.reference, drift_at_loss=spec.drift_positions == "loss",
                                    excess=spec.excess_tolerance is not None)
        self.distill.saved_state = self.teacher_state
        self.distill.every = spec.teacher_every
        self.distill.ask_rows(spec.rows_share, self.rows_settled)
        reason = self.distill.start(trainer, pl_module, t.host_steps)
        if reason is not None:
            self.distill.off_reason = reason
            self._warn_no_distillation(trainer, reason, t, self.spec.loss_tolerance, self.spec.excess_tolerance)
        elif self.over_budget and (not spec.distill_after_budget or (spec.revert_after_budget and not self.reverting)):
            self.distill.pause()  # as the fit that spent the budget did: the teacher kept for checkpoints, not run
        if self.unfinished is not None:  # (said before the distillation started: what it does now)
            self.unfinished["distill_after_budget"] = self._distills_after_budget()

    def _distills_after_budget(self) -> bool:
        """Whether this fit distils at the blend a spent budget holds (TransitionSpec.distill_after_budget, and a
        distillation that runs)."""
        return bool(self.spec.distill_after_budget and self.distill is not None and self.distill.off_reason is None)

    def begin_step(self, pl_module: LightningModule) -> None:
        """Before a training batch: hold the blend, log it, and say whether this step trains at the end point."""
        state = rewrite_state.of(pl_module)
        if state is None or state.transition is None:
            if self.finished is not None:  # the dashboard shows the transition ended, not its last values
                pl_module.log("ln_placement/transition", self.finished, on_step=True, on_epoch=False)
                if self.distilled:  # no term is added to the loss any more
                    pl_module.log("ln_placement/distill_kl", self.finished * 0, on_step=True, on_epoch=False)
            return
        t = state.transition
        done = t.host_steps
        # The blend the model holds, written from host arithmetic (a closed loop's is on the device already) and
        # logged as the device tensor it is: no synchronisation per step.
        t.hold()
        pl_module.log("ln_placement/transition", t.blend.clone(), on_step=True, on_epoch=False)
        if self.distill is not None and self.distill.paused:  # a spent budget: no term is added to the loss any more
            pl_module.log("ln_placement/distill_kl", t.blend.new_zeros(()), on_step=True, on_epoch=False)
        if done == 0 and t.needs_measurement and not self.measured:
            t.begin_measurement()  # this forward runs at blend 0: the trained function's own statistics
            self.measuring = True
        # An endpoint step trains the function the transition ends at (every micro-batch of it), while the model
        # holds its blend for everything else: callbacks, evaluation and checkpoints see the held blend.
        self.endpoint = not self.over_budget and endpoint_step(done, t.steps, self.spec.endpoint_fraction)
        t.train_at_end(self.endpoint)
        if self.distill is not None:
            self.distill.measure_training_drift = not self.over_budget and self.spec.measures_training_drift(done)
            # (from the step's index alone: the same on every rank, whether or not that rank's teacher still runs)
            self.distill.skip = not self.spec.runs_teacher(pl_module.trainer.global_step)
            self.distill.endpoint = self.endpoint

    def end_step(self, trainer: Trainer, pl_module: LightningModule, stepped: bool) -> None:
        """After a training batch: end the first batch's measurement, and, if an optimizer stepped, move the blend."""
        state = rewrite_state.of(pl_module)
        t = None if state is None else state.transition
        if t is not None:
            t.train_at_end(False)
        if t is not None and self.measuring:
            self._end_measurement(trainer, t)
        distill = self.distill
        if (distill is not None and distill.active and distill.off_reason is None and not distill.distilled_once
                and not distill.skip):
            # The first batch ran without a call of the LightningModule itself inside training_step (in train mode).
            distill.off_reason = (
                "the LightningModule was in eval mode in training_step (Lightning keeps the mode it was given: call "
                "model.train() before fit), and the comparison runs on training forwards only" if not pl_module.training
                else "training_step did not call the LightningModule itself (self(...)) in its first batch, so there "
                     "was nothing to compare with the trained function")
        if distill is not None and distill.active and distill.off_reason is not None:
            distill.stop(keep=False)
            self._warn_no_distillation(trainer, distill.off_reason, t, self.spec.loss_tolerance, self.spec.excess_tolerance)
        if distill is not None and distill.rows_state == "pending" and stepped:
            # (TransitionSpec.teacher_rows) the rows' comparison is read once, on a logging step
            if trainer.global_step % _log_every(trainer) == 0:
                distill.read_rows_verdict()
        if distill is not None and distill.rows_news is not None:
            self._say_rows(trainer)
        if t is None:
            return
        if not stepped:
            t.hold()  # held between micro-batches
            return
        a = self._closed_loop_step(trainer, state, t, pl_module) if t.closed else state.advance(pl_module)
        if a is not None and a >= 1.0:
            self._finished(t)

    def settle(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """At the fit's end: a closed loop that reached blend 1 since its last read ends now, and says so; one that
        spent its budget short of it and distilled on says what its training loss costs now (one host read)."""
        state = rewrite_state.of(pl_module)
        t = None if state is None else state.transition
        if t is not None and self.finished is None and state.settle(pl_module):
            self._finished(t)
        elif (t is not None and self.unfinished is not None and self._distills_after_budget()
              and not (self.spec.revert_after_budget and not self.reverting)):  # (back at blend 0: nothing held)
            a = float(t.blend)
            if self.reverting and a == 0.0:  # a gated return that reached blend 0 after its last read
                self._back_at_zero(trainer, t)
            else:
                self._say_excess_at_end(trainer, a)

    def _say_excess_at_end(self, trainer: Trainer, a: float) -> None:
        """The smoothed loss excess a spent budget's fit ends with: in the report, and a warning where it is over the
        tolerance (the model then computes a training loss further above the trained function's than was agreed)."""
        tol = self.spec.excess_tolerance
        excess = self._excess_read() if tol is not None else None
        if excess is None:
            return
        self.unfinished["loss_excess_at_end"] = excess
        reference = self._reference
        words = (f"LNPlacement: the fit ends with the transition to {self.placement}-norm held at blend {a:.4g}, its "
                 f"training loss {excess:.3g} above {reference}'s on the same batches (smoothed)")
        if excess <= tol:
            info(log, words + f", within the loss excess tolerance ({tol:g}).")
        elif trainer.is_global_zero:
            warn(words + f", over the loss excess tolerance ({tol:g}): distilling at that blend did not bring it back "
                 "within what was agreed. Fit on (it goes on distilling there), or keep the checkpoint the transition "
                 "started from; a held-out evaluation tells which is better for this model.")

    def _finished(self, t) -> None:
        if self.distill is not None:
            self.distilled = self.distill.distilled_once
            self.distill.stop(keep=False)  # the teacher's memory goes back
        self.finished = torch.ones((), device=t.blend.device)
        info(log, f"LNPlacement: transition to {self.placement}-norm finished after {t.host_steps} steps; the model is "
             f"now exactly its {self.placement}-norm rewrite.")

    def teacher_checkpoint(self, pl_module: LightningModule) -> dict | None:
        """The teacher's tensors for a checkpoint, while the model is in the transition and a teacher runs."""
        state = rewrite_state.of(pl_module)
        if state is None or state.transition is None or self.distill is None or not self.distill.active:
            return None
        return self.distill.checkpoint_state()

    def checkpoint_state(self, pl_module: LightningModule) -> dict | None:
        """What a resumed fit needs to go on as this one would, while the model is in a transition: the smoothed
        loss excess, the closed loop's pace (the host's reads; the step the blend last moved at and the gated steps
        that held it since), training_drift_factor's raised tolerance (device tensors: no host read) and where
        teacher_rows settled."""
        state = rewrite_state.of(pl_module)
        if state is None or state.transition is None:
            return None
        entry = {}
        if self.excess is not None:
            entry["excess"] = self.excess.detach().clone()
        if self.moved_at is not None:
            entry["pace"] = {"reads": [list(r) for r in self.pace.reads], "still_since": self.pace.still_since,
                             "moved_at": self.moved_at.detach().clone(), "holds": self.holds.detach().clone()}
        d = self.distill
        if d is not None and d.rows < 1.0 and d.rows_state in ("rows", "full"):  # (teacher_rows: as settled)
            entry["teacher_rows"] = {"share": d.rows, "state": d.rows_state, "reason": d.rows_reason}
        if self.last_tolerance is not None:  # training_drift_factor: not measured again after the budget
            entry["tolerance"] = {"training_drift": self.training_drift.detach().clone(),
                                  "last_training_drift": self.last_training_drift.detach().clone(),
                                  "last_tolerance": self.last_tolerance.detach().clone()}
        return entry or None

    def restore(self, entry: dict | None) -> None:
        """The ckpt_path checkpoint's `checkpoint_state`, before the first step (None: this fit starts afresh; a
        checkpoint written before the pace was kept: its reads start at the resume, see `start`)."""
        if entry and isinstance(entry.get("excess"), torch.Tensor):
            self.excess = entry["excess"].detach().float()
        pace = entry.get("pace") if entry else None
        if isinstance(pace, dict) and isinstance(pace.get("moved_at"), torch.Tensor):
            self.pace.reads = [(int(d), float(a)) for d, a in pace["reads"]]
            self.pace.still_since = pace["still_since"]
            self.moved_at = pace["moved_at"].detach()
            held = pace.get("holds")  # (a89f17c's entry had none: counted from the resume)
            self.holds = held.detach() if isinstance(held, torch.Tensor) else torch.zeros_like(self.moved_at)
        rows = entry.get("teacher_rows") if entry else None
        if isinstance(rows, dict) and rows.get("state") in ("rows", "full") and rows.get("share") == self.spec.rows_share:
            self.rows_settled = (rows["state"], rows.get("reason"))
        raised = entry.get("tolerance") if entry else None
        if isinstance(raised, dict) and all(isinstance(v, torch.Tensor) for v in raised.values()):
            self.training_drift = raised["training_drift"].detach()
            self.last_training_drift = raised["last_training_drift"].detach()
            self.last_tolerance = raised["last_tolerance"].detach()

    def _say_rows(self, trainer: Trainer) -> None:
        """Say where TransitionSpec.teacher_rows settled: the teacher on the rows (info), or on every row (a warning:
        only a teacher_rows that was asked for is compared)."""
        d = self.distill
        news, d.rows_news = d.rows_news, None
        if not trainer.is_global_zero:
            return
        share = f"{d.rows:g}"
        if news == "rows":
            info(log, f"LNPlacement: the transition's teacher runs on the first {share} of each batch's rows from step "
                      f"{trainer.global_step} on (teacher_rows={share}): their outputs alone were the batch's.")
        else:
            warn(f"LNPlacement: teacher_rows={share} can't hold on this model: {d.rows_reason}. The transition's teacher "
                 "runs on every row of the batch instead, its forward a full one (as teacher_rows=None asks; pass that "
                 "to silence this).")

    def rows_entry(self) -> dict | None:
        """The report JSON's account of TransitionSpec.teacher_rows, where it was asked for."""
        d = self.distill
        if self.spec.teacher_rows is None or d is None:
            return None
        reason = {"pending": "compared, but no logging step came to read the comparison before the fit ended",
                  "check": "no measured batch had more rows than teacher_rows keeps"}.get(d.rows_state, d.rows_reason)
        return {"teacher_rows": {"asked": d.rows, "ran_on": "rows" if d.rows_state == "rows" else "every row",
                                 "reason": reason}}

    def final_entry(self, progress: tuple[int, int, float] | None) -> dict | None:
        """The report JSON's "transition" entry at the fit's end, where this run knows it (else None)."""
        if progress is None:
            return {"finished": True, "blend": 1.0} if self.finished is not None else None
        if self.unfinished is not None:  # a closed loop stopped by its budget (said when it did)
            return {**self.unfinished, "blend": progress[2]}
        return None

    def close(self, t) -> None:
        """The Trainer call ended (after teardown, or an exception or interrupt, perhaps mid-step)."""
        if self.distill is not None:
            self.distill.stop()
        if t is not None:
            t.abandon_measurement()
            t.hold()

    # ------------------------------------------------------------------ the closed loop
    def _closed_loop_step(self, trainer: Trainer, state, t, pl_module: LightningModule) -> float | None:
        """One optimizer step of the closed loop: gate the blend on this step's measured drift (on the device, the
        same on every rank), count the step against the budget, and read the blend on logging steps and at the
        budget's end only. Returns the blend where it was read, else None."""
        spec, distill = self.spec, self.distill
        # (TransitionSpec.teacher_every; whether a Distillation exists is the same on every rank, so every rank reduces
        # below on the same steps, whichever rank's teacher has stopped)
        skipped = distill is not None and distill.skip
        drift = distill.take_drift() if distill is not None and distill.active else None
        loss = distill.take_loss() if distill is not None and distill.active else None
        excess = distill.take_excess() if distill is not None and distill.active else None
        if self.over_budget:
            allow = self._observe_after_budget(trainer, pl_module, t, drift, excess)
            self.after_budget_steps += 1
            if self.reverting:
                self._revert_step(trainer, t, allow)
            return None
        # An endpoint step's drift (and loss) is the end point's, not the held blend's; a step whose teacher was skipped
        # (teacher_every) measured nothing, so the blend holds there: it moves only on a fresh measurement.
        if not self.endpoint and not skipped:
            if drift is None:  # nothing measures it (the reason was given): the blend ramps at the budget's pace
                drift = torch.zeros((), device=t.blend.device)
            drift = trainer.strategy.reduce(drift, reduce_op="mean")  # every rank gates alike
            allow = None
            if self.loss_gate is not None:
                if loss is None:  # no loss seen on this rank: NaN, which the gate leaves out (every rank reduces alike)
                    loss = torch.full((), float("nan"), device=t.blend.device)
                allow = self.loss_gate.update(trainer.strategy.reduce(loss, reduce_op="mean"))
                if self.loss_gate.rise is not None:
                    pl_module.log("ln_placement/loss_rise", self.loss_gate.rise.clone(), on_step=True, on_epoch=False)
            if spec.excess_tolerance is not None:
                held = self._excess_gate(trainer, excess, t.blend.device)
                pl_module.log("ln_placement/loss_excess", self.excess.clone(), on_step=True, on_epoch=False)
                allow = held if allow is None else allow & held
            t.gate(drift, self._tolerance(trainer, pl_module, distill), spec.rate(), allow=allow)
            # the smoothed drift the loop just gated on (logged after the gate: never the -1 of "not measured yet")
            pl_module.log("ln_placement/drift", t.drift.clone(), on_step=True, on_epoch=False)
            self.logged_drift = True
        elif self.logged_drift:
            # (an endpoint step, or teacher_every's step without a teacher) the loop gated on nothing: the dashboard
            # holds what it holds, else a logging step that falls on such a step (every one, for teacher_every 2 and
            # an even log_every_n_steps) would show no drift
            self._log_held(pl_module, t)
        self._track_move(t, gated=not self.endpoint and not skipped)
        every = _log_every(trainer)
        done = t.host_steps + 1
        a = state.advance(pl_module, check=done % every == 0)
        if a is None or a >= 1.0:
            return a
        steps = state.transition.steps
        # the budget the recent pace needs (None: the blend has stopped moving); where it last moved: a second read,
        # on the steps that read the blend only
        need = self.pace.update(done, a, steps, self._moves())
        if done >= steps:
            self._warn_over_budget(trainer, t, a)
            if distill is not None and distill.active and (
                    not spec.distill_after_budget or (spec.revert_after_budget and not self.reverting)):
                distill.pause()  # the blend is held from here: no teacher forward, the teacher kept for checkpoints
        elif not self.warned_pace and done >= steps // 4 and (need is None or need > steps):
            self.warned_pace = True
            if trainer.is_global_zero:
                warn(f"LNPlacement: at step {done} of its {steps}-step budget the closed-loop transition to "
                     f"{self.placement}-norm stands at blend {a:.3g}: {self._pace_words(need)}. Unless "
                     "that changes it will stop where it stands at the budget's end, not finish.")
        return a

    def _start_pace(self, t) -> None:
        """A closed loop's pace at the fit's start: as the checkpoint kept it, else from where the transition stands
        (one read, for a transition resumed from a checkpoint that did not keep it)."""
        if self.moved_at is not None:
            self.moved_at, self.holds = self.moved_at.to(t.blend.device), self.holds.to(t.blend.device)
            if self.last_tolerance is not None:
                self.training_drift = self.training_drift.to(t.blend.device)
                self.last_training_drift = self.last_training_drift.to(t.blend.device)
                self.last_tolerance = self.last_tolerance.to(t.blend.device)
        else:
            self.moved_at, self.holds = t.steps_done.clone(), torch.zeros_like(t.steps_done)
            if t.host_steps > 0:  # (not known when it last moved before: from the resume on)
                self.pace.reads = [(t.host_steps, float(t.blend))]
                self.pace.origin = t.host_steps
        self._blend_seen = t.blend.clone()

    def _track_move(self, t, gated: bool) -> None:
        """After a step that gated the blend, on the device: the step count at which it last moved, and the gated
        steps since that held it."""
        if not gated:
            return
        moved = t.blend != self._blend_seen
        self.moved_at = torch.where(moved, t.steps_done + 1, self.moved_at)  # (+1: this step, counted below)
        self.holds = torch.where(moved, torch.zeros_like(self.holds), self.holds + 1)
        self._blend_seen = t.blend.clone()

    def _moves(self) -> tuple[int, int] | None:
        """(the step the blend last moved at, the gated steps that held it since): one host read."""
        if self.moved_at is None:
            return None
        moved_at, holds = torch.stack([self.moved_at, self.holds]).tolist()
        return int(moved_at), int(holds)

    def _log_held(self, pl_module: LightningModule, t) -> None:
        """Log the closed loop's smoothed measurements as it holds them, on a step that measured nothing."""
        pl_module.log("ln_placement/drift", t.drift.clone(), on_step=True, on_epoch=False)
        if self.excess is not None:
            pl_module.log("ln_placement/loss_excess", self.excess.clone(), on_step=True, on_epoch=False)
        if self.loss_gate is not None and self.loss_gate.rise is not None:
            pl_module.log("ln_placement/loss_rise", self.loss_gate.rise.clone(), on_step=True, on_epoch=False)
        self._log_held_tolerance(pl_module)

    def _log_held_tolerance(self, pl_module: LightningModule) -> None:
        """training_drift_factor: the last training drift measured and the tolerance it set, as the loop holds them."""
        if self.last_training_drift is not None:
            pl_module.log("ln_placement/training_drift", self.last_training_drift, on_step=True, on_epoch=False)
        if self.last_tolerance is not None:
            pl_module.log("ln_placement/tolerance", self.last_tolerance.clone(), on_step=True, on_epoch=False)

    def _drift_tolerance(self):
        """The drift tolerance the loop gated at last: the spec's, or the one training_drift_factor raised it to (a
        device tensor)."""
        return self.spec.tolerance if self.last_tolerance is None else self.last_tolerance

    def _revert_step(self, trainer: Trainer, t, allow: torch.Tensor | None) -> None:
        """A spent budget going back to blend 0 (TransitionSpec.revert_after_budget), one step, on the device: "ramp"
        lowers the blend by the ramp's rate, "gated" only where `allow` (the drift and the loss excess within their
        tolerances; None: nothing measures them, so as "ramp"), read on logging steps. Back at 0, the teacher pauses
        and the fit trains the model as written."""
        if self.retreat_left is not None:
            self.retreat_left -= 1
            if self.retreat_left > 0:
                t.retreat(self.spec.rate())
                return
            t.retreat(1.0)  # the last step: exactly 0 (the blend is at most 1)
        else:
            t.retreat(self.spec.rate(), allow)
            every = _log_every(trainer)
            if self.after_budget_steps % every or float(t.blend) > 0.0:  # (the read: on logging steps only)
                return
        self._back_at_zero(trainer, t)

    def _back_at_zero(self, trainer: Trainer, t) -> None:
        self.reverting = False
        if self.distill is not None and self.distill.active and not self.distill.paused:
            self.distill.pause()
        at = trainer.global_step  # (Lightning's count: a resumed fit's goes on from its checkpoint's)
        if self.unfinished is not None:
            self.unfinished["reverted_at_step"] = at
        info(log, f"LNPlacement: the transition to {self.placement}-norm is back at blend 0 at step {at}: the model "
             "computes its trained placement with the weights it has now, and the fit trains it so.")

    def _observe_after_budget(self, trainer: Trainer, pl_module: LightningModule, t, drift,
                              excess) -> torch.Tensor | None:
        """A spent budget, distilling at the held blend (distill_after_budget): the teacher's forward still measures
        the drift and the loss excess, so they are smoothed and logged as before, and the dashboard and the fit's end
        show whether the held blend comes back towards the trained function. Returns whether both are within their
        tolerances (a 0-dim bool tensor: what a gated return to blend 0 may step on), or None where nothing measures."""
        if self.distill is None or not self.distill.active or self.distill.paused:  # nothing measured (alike on every rank)
            return None
        if drift is None and not self.distill.skip:
            drift = torch.zeros((), device=t.blend.device)
        if drift is not None:  # (a step whose teacher was skipped, teacher_every, keeps the smoothed drift)
            t.observe(trainer.strategy.reduce(drift, reduce_op="mean"))
        pl_module.log("ln_placement/drift", t.drift.clone(), on_step=True, on_epoch=False)
        self._log_held_tolerance(pl_module)  # (training_drift_factor: no new measurement after the budget)
        allow = t.drift <= self._drift_tolerance()
        if self.spec.excess_tolerance is not None:
            allow = allow & self._excess_gate(trainer, excess, t.blend.device)
            pl_module.log("ln_placement/loss_excess", self.excess.clone(), on_step=True, on_epoch=False)
        if self.distill.skip:  # (teacher_every) nothing fresh measured: a gated return holds, as the forward gate does
            allow = torch.zeros_like(allow)
        return allow

    def _excess_gate(self, trainer: Trainer, excess: torch.Tensor | None, device) -> torch.Tensor:
        """TransitionSpec.excess_tolerance's verdict on this step (a 0-dim bool tensor, the same on every rank): the
        loss excess over the trained function's, reduced over the ranks and smoothed as the drift is (EMA 0.8, from
        the first measurement). A step that measured none (a rank with no loss seen: NaN, left out) keeps the
        smoothed value."""
        if excess is None:
            excess = torch.full((), float("nan"), device=device)
        excess = trainer.strategy.reduce(excess.float(), reduce_op="mean")
        finite = torch.isfinite(excess)
        if self.excess is not None and self.excess.device != excess.device:  # restored from a checkpoint
            self.excess = self.excess.to(excess.device)
        if self.excess is None:
            self.excess = torch.where(finite, excess, torch.zeros_like(excess))
        else:
            self.excess = torch.where(finite, 0.8 * self.excess + 0.2 * excess, self.excess)
        return self.excess <= self.spec.excess_tolerance  # (math.inf: never holds)

    def _tolerance(self, trainer: Trainer, pl_module: LightningModule, distill: Distillation | None):
        """The tolerance this step gates at: the spec's, or (training_drift_factor) at least that factor times the
        smoothed training drift, a 0-dim device tensor (no host synchronisation)."""
        spec = self.spec
        if spec.training_drift_factor is None:
            return spec.tolerance
        measured = distill.take_training_drift() if distill is not None and distill.active else None
        if measured is not None:
            measured = trainer.strategy.reduce(measured, reduce_op="mean")  # every rank gates alike
            self.last_training_drift = measured.clone()
            # smoothed over measurements, which are steps apart: the last two weigh alike
            self.training_drift = measured.float() if self.training_drift is None else 0.5 * self.training_drift + 0.5 * measured.float()
        if self.last_training_drift is not None:
            # the last measurement, on every step: measured on every training_drift_every-th step only, it would
            # miss every logging step (8 and Lightning's 50: a logging step's index is never a multiple of 8)
            pl_module.log("ln_placement/training_drift", self.last_training_drift, on_step=True, on_epoch=False)
        if self.training_drift is None:
            return spec.tolerance
        tolerance = torch.clamp(spec.training_drift_factor * self.training_drift, min=spec.tolerance)
        self.last_tolerance = tolerance.detach()
        pl_module.log("ln_placement/tolerance", tolerance.clone(), on_step=True, on_epoch=False)
        return tolerance

    def _warn_over_budget(self, trainer: Trainer, t, a: float) -> None:
        spec = self.spec
        need = self.pace.update(t.host_steps, a, t.steps, self._moves())
        self.over_budget = True
        self.reverting = bool(spec.revert_after_budget) and a > 0.0
        if self.reverting and spec.revert_after_budget == "ramp":  # (host arithmetic from the one read at the budget's end)
            self.retreat_left = self._ramp_steps(a)
        self.unfinished = {"steps": t.steps, "steps_done": t.host_steps, "blend": a, "finished": False,
                           "tolerance": spec.tolerance, "budget_needed": need, "stalled_since": self.pace.still_since,
                           # (training_drift_factor: the tolerance the loop gated at last, one read)
                           "tolerance_reached": None if self.last_tolerance is None else float(self.last_tolerance),
                           "distill_after_budget": self._distills_after_budget(),
                           "revert_after_budget": spec.revert_after_budget}
        if self.loss_gate is not None:
            self.unfinished.update(loss_tolerance=spec.loss_tolerance, loss_rise=self.loss_gate.read())
        if spec.excess_tolerance is not None:  # (JSON has no infinity: an excess tolerance that never holds is null)
            self.unfinished.update(excess_tolerance=spec.excess_tolerance if math.isfinite(spec.excess_tolerance) else None,
                                   loss_excess=self._excess_read())
        if not trainer.is_global_zero:
            return
        why = f"({self._tolerances()}); {self._pace_words(need)}."
        # (spelled out here, not by a helper: the troubleshooting page reads this assignment into the warnings' text)
        larger = (f"LNPlacement(..., transition=TransitionSpec(steps={need or 2 * t.steps}, tolerance={spec.tolerance:g}"
                  + (f", loss_tolerance={spec.loss_tolerance:g}" if spec.loss_tolerance is not None else "")
                  + (f", excess_tolerance={spec.excess_tolerance:g}" if spec.excess_tolerance not in (None, math.inf) else "")
                  + (f", teacher_every={spec.teacher_every}" if spec.teacher_every != 1 else "")
                  + (f", teacher_rows={spec.teacher_rows:g}" if spec.teacher_rows is not None else "")
                  + (f", training_drift_factor={spec.training_drift_factor:g}" if spec.training_drift_factor is not None else "")
                  + (f", training_drift_every={spec.training_drift_every}" if spec.training_drift_every != TRAINING_DRIFT_EVERY else "")
                  + "))")
        distilling = f", distilling towards {self._reference}" if spec.distill_after_budget else ""
        if spec.revert_after_budget is None and need is None:  # the blend stopped moving: more steps alone did not help
            warn(f"LNPlacement: the closed-loop transition to {self.placement}-norm spent its budget of {t.steps} steps at "
                 f"blend {a:.4g} {why} The model stays at that blend (it computes it, not yet the {self.placement}-norm "
                 f"rewrite; its checkpoints load back into it), and the fit goes on there{distilling}. A blend that has "
                 "stopped moving is not moved by a larger budget alone (on the migration suite, a budget five times "
                 f"larger left such a blend short of 1): accept more with a larger tolerance, {self._looser(t.steps)}, at the "
                 "held-out loss it costs, or keep the checkpoint the transition started from.")
        elif spec.revert_after_budget is None:
            warn(f"LNPlacement: the closed-loop transition to {self.placement}-norm spent its budget of {t.steps} steps at "
                 f"blend {a:.4g} {why} The model stays at that blend (it computes it, not yet the {self.placement}-norm "
                 "rewrite; its "
                 f"checkpoints load back into it), and the fit goes on there{distilling}. Continue with a larger budget, "
                 f"{larger}, or accept more drift with a larger tolerance.")
        elif self.reverting:
            n = self._ramp_steps(a)  # (the "ramp" way back's length, retreat_left)
            steps_words = f"{n} step{'s' if n != 1 else ''}"
            pace = (f"over the next {steps_words}" if self.retreat_left is not None else
                    "as far as the drift and the loss excess stay within their tolerances allow (in "
                    f"{steps_words} where nothing holds it)")
            warn(f"LNPlacement: the closed-loop transition to {self.placement}-norm spent its budget of {t.steps} steps at "
                 f"blend {a:.4g} {why} The model goes back to blend 0, its trained placement, {pace}{distilling}, and the "
                 "fit goes on "
                 f"with it as written (revert_after_budget={spec.revert_after_budget!r}). Migrate with a larger budget, "
                 f"{larger}, or accept more drift with a larger tolerance.")
        else:
            warn(f"LNPlacement: the closed-loop transition to {self.placement}-norm spent its budget of {t.steps} steps at "
                 f"blend {a:.4g} {why} The model is at blend 0, its trained placement, and the fit goes on with it as written "
                 f"(revert_after_budget={spec.revert_after_budget!r}). Migrate with a larger budget, {larger}, or accept "
                 "more drift with a larger tolerance.")

    def _looser(self, steps: int) -> str:
        """The spec with the tolerance that holds the blend (the one _pace_words names) doubled, in a user's words."""
        spec = self.spec
        tolerance, loss, excess = spec.tolerance, spec.loss_tolerance, spec.excess_tolerance
        measured = None if excess is None else self._excess_read()
        rise = None if self.loss_gate is None else self.loss_gate.read()
        if measured is not None and measured > excess:
            excess = 2 * excess
        elif rise is not None and rise > loss:
            loss = 2 * loss
        else:
            tolerance = 2 * tolerance
        return (f"LNPlacement(..., transition=TransitionSpec(steps={steps}, tolerance={tolerance:g}"
                + (f", loss_tolerance={loss:g}" if loss is not None else "")
                + (f", excess_tolerance={excess:g}" if excess not in (None, math.inf) else "")
                + (f", teacher_every={spec.teacher_every}" if spec.teacher_every != 1 else "")
                + (f", teacher_rows={spec.teacher_rows:g}" if spec.teacher_rows is not None else "")
                + (f", training_drift_factor={spec.training_drift_factor:g}" if spec.training_drift_factor is not None else "")
                + (f", training_drift_every={spec.training_drift_every}" if spec.training_drift_every != TRAINING_DRIFT_EVERY else "") + "))")

    def _ramp_steps(self, a: float) -> int:
        return max(1, math.ceil(a / self.spec.rate() - 1e-6))

    @property
    def _reference(self) -> str:
        """What the drift, the loss excess and the distillation compare the model with, in a warning's words."""
        return "the model's own function at blend 0" if self.spec.reference == "current" else "the trained function"

    def _drift_tolerance_words(self) -> str:
        """The drift tolerance the loop gated at, in a warning's words (training_drift_factor: one host read)."""
        spec = self.spec
        if self.last_tolerance is None:
            return f"{spec.tolerance:g}"
        return (f"{float(self.last_tolerance):.3g}: {spec.tolerance:g} raised by training_drift_factor="
                f"{spec.training_drift_factor:g} to follow the training drift")

    def _tolerances(self) -> str:
        spec = self.spec
        words = f"drift tolerance {self._drift_tolerance_words()}"
        if spec.loss_tolerance is not None:
            words += f", loss tolerance {spec.loss_tolerance:g}"
        if spec.excess_tolerance is not None and math.isfinite(spec.excess_tolerance):
            words += f", loss excess tolerance {spec.excess_tolerance:g}"
        return words

    def _excess_read(self) -> float | None:
        """The smoothed loss excess on the host (one read: for warnings and the report, never per step)."""
        return None if self.excess is None else float(self.excess)

    def _pace_words(self, need: int | None) -> str:
        """Why the blend moves as it does (a host read of the loss gate's state: only when a warning is written)."""
        if need is not None:
            return f"at its recent pace it needs about {need} steps in all"
        since = "" if self.pace.still_since is None else f" since step {self.pace.still_since}"
        if self.pace.origin and self.pace.still_since == self.pace.origin:
            since += " (where this fit started: the steps before are not known to it)"
        rise = None if self.loss_gate is None else self.loss_gate.read()
        excess = None if self.spec.excess_tolerance is None else self._excess_read()
        if excess is not None and excess > self.spec.excess_tolerance:
            return (f"the blend has not moved{since}: the training loss stays {excess:.3g} above {self._reference}'s "
                    f"on the same batches, over the loss excess tolerance ({self.spec.excess_tolerance:g}), faster than "
                    "training brings it back")
        if rise is not None and rise > self.spec.loss_tolerance:
            return (f"the blend has not moved{since}: the training loss stays {rise:.3g} above where the transition "
                    f"started, over the loss tolerance ({self.spec.loss_tolerance:g}), faster than training brings it back")
        return (f"the blend has not moved{since}: the drift from {self._reference} stays above the tolerance "
                f"({self._drift_tolerance_words()}) faster than training brings it back")

    @staticmethod
    def _warn_no_distillation(trainer: Trainer, reason: str, t=None, loss_tolerance: float | None = None,
                              excess_tolerance: float | None = None) -> None:
        if not trainer.is_global_zero:
            return
        if t is not None and t.closed:
            excess = excess_tolerance is not None
            loss = ("" if loss_tolerance is None else ", nor its training loss's rise (loss_tolerance)") + (
                ", nor its loss excess (excess_tolerance)" if excess else "")
            off = "tolerance=None" + ("" if loss_tolerance is None else ", loss_tolerance=None") + ", distill=0"
            warn(f"LNPlacement: the closed-loop transition can't measure its drift from the trained function{loss}: "
                 f"{reason}. Its blend ramps at the budget's pace instead, without a tolerance (as TransitionSpec(..., "
                 f"{off}) would; pass that to ask for it and silence this).")
        else:
            warn(f"LNPlacement: the transition runs without distillation towards the trained function: {reason}. "
                 "Pass TransitionSpec(..., distill=0) to ask for that and silence this.")

    # ------------------------------------------------------------------ the stream scales (first batch)
    def _end_measurement(self, trainer: Trainer, t) -> None:
        self.measuring, self.measured = False, True
        # Several processes agree on the scales (one read from the device, once per transition); one needs no read.
        reduce = None if trainer.world_size == 1 else (lambda x: trainer.strategy.reduce(x, reduce_op="mean"))
        reason = t.end_measurement(reduce)
        if reason is None:  # (the values stay on the device: ln_lightning_transition.site_before, the branches' c)
            # Output: a moved norm's parameters now serve its branch exit (its call site keeps what they were), so
            # the gradient and optimizer state they gathered at the call site go (a fresh parameter's, from here).
            for p in t.moved_parameters():
                if p.grad is not None:
                    p.grad.zero_()
                for opt in trainer.optimizers:
                    opt.state.pop(p, None)
            info(log, f"LNPlacement: stream scales measured on the first training batch ({t.site_before.numel()} branches); "
                 "the branches keep their trained weights in the stream"
                 + {"peri": " (each output norm's gain set from its branch).",
                    "output": " (each branch reads the stream divided by its scale; each moved norm's gain set from its branch)."
                    }.get(self.placement, "."))
        elif trainer.is_global_zero:
            warn(f"LNPlacement: the stream scales could not be measured ({reason}); the transition runs the plain blend "
                 "(every branch scale 1), whose function moves more near its end. Pass TransitionSpec(..., "
                 "stream_scale=False) to ask for the plain blend and silence this.")


class _Pace:
    """How fast a closed loop's blend moves, from the host's reads of it (logging steps, the budget's end): the
    budget it needs at its recent pace, which a stall (the drift holding it) makes None."""

    def __init__(self):
        self.reads: list[tuple[int, float]] = [(0, 0.0)]
        self.still_since: int | None = None  # the step from which the blend has not moved
        self.origin = 0  # the step the reads start at (a resume from a checkpoint that did not keep them)

    def update(self, done: int, blend: float, budget: int, moves: tuple[int, int] | None = None) -> int | None:
        """The pace over the last tenth of the budget at least (so an endpoint step, which holds the blend, or
        a short hold is not a stall), from the latest read at or before that span's start. `moves` (the steps done
        when the blend last moved, and the steps since whose gate held it, counted on the device): a blend its gate
        held for that span is stalled since it last moved, however far apart the reads are (a budget shorter than
        log_every_n_steps reads only at its end)."""
        if done > self.reads[-1][0]:
            self.reads.append((done, blend))
        d1, a1 = self.reads[-1]
        span = max(1, budget // 10)
        if moves is not None and moves[1] >= span:
            self.still_since = moves[0]
            return None
        d0, a0 = next(((d, a) for d, a in reversed(self.reads[:-1]) if d <= d1 - span), self.reads[0])
        if a1 > a0:
            self.still_since = None
            return int(math.ceil(d1 + (1.0 - a1) * (d1 - d0) / (a1 - a0) - 1e-6))  # (- 1e-6: float noise)
        if self.still_since is None:
            self.still_since = d0
        return None


class _LossGate:
    """TransitionSpec.loss_tolerance: the training loss's rise over where the transition started, on the device.

    The start is the mean loss of the first held-blend optimizer steps (LOSS_BASELINE_STEPS, a quarter of a shorter
    budget; the drift alone gates the blend meanwhile, which has barely moved then), the rise each later step's loss
    minus it, smoothed (a single batch's loss is noisier than the rise it would gate on). A step whose loss is not
    finite is left out of both (one NaN would otherwise hold the blend for good, blaming nothing)."""

    EMA = 0.9

    def __init__(self, tolerance: float, steps: int):
        self.tolerance = tolerance
        self.baseline_steps = max(1, min(LOSS_BASELINE_STEPS, steps // 4))
        self.seen = 0  # held-blend steps the start was measured over (host count: the same on every rank)
        self.total: torch.Tensor | None = None  # their finite losses' sum, and how many were finite (device)
        self.count: torch.Tensor | None = None
        self.rise: torch.Tensor | None = None

    def update(self, loss: torch.Tensor) -> torch.Tensor | None:
        """Count one held-blend step's loss; the gate's verdict (a 0-dim bool tensor), or None while the start is
        being measured."""
        loss = loss.detach().float()
        finite = torch.isfinite(loss)
        if self.seen < self.baseline_steps:
            value, one = torch.where(finite, loss, torch.zeros_like(loss)), finite.float()
            self.total = value if self.total is None else self.total + value
            self.count = one if self.count is None else self.count + one
            self.seen += 1
            return None
        rise = loss - self.total / self.count.clamp(min=1.0)
        finite = finite & (self.count > 0)
        if self.rise is None:
            self.rise = torch.where(finite, rise, torch.zeros_like(rise))
        else:
            self.rise = torch.where(finite, self.EMA * self.rise + (1.0 - self.EMA) * rise, self.rise)
        return self.rise <= self.tolerance

    def read(self) -> float | None:
        """The smoothed rise on the host (one read: for warnings and the report, never per step)."""
        return None if self.rise is None else float(self.rise)
