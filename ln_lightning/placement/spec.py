"""`PlacementSpec` and `TransitionSpec`: the request, spelled and validated in one place.

``PlacementSpec`` is what a rewrite computes (the placement, the final norm, the branch scale, and the transition to
it, if any). ``LNPlacement`` and ``convert`` take one (or a placement's name, its shorthand); its ``config`` is the form
that markers, checkpoint entries, the Hugging Face record and reports serialise, and ``PlacementSpec.from_config``
reads it back, old checkpoints' entries included.

``LNPlacement("pre", transition=TransitionSpec(steps=600))`` (or ``transition=600``) asks for a function-preserving
transition with a budget of 600 optimizer steps. The options that only mean something during a transition live
here, so they can't be given without one (the old ``transition_*`` keywords of ``LNPlacement`` could, and were
silently ignored).

The default is the closed loop (``tolerance=0.05``): the blend advances only while the measured drift from the
trained function (KL(trained || model) on the training batches, smoothed, the same on every rank) stays within the
tolerance, and ``steps`` is a budget. A model that can't reach the end within it says so (a warning with the blend
reached and the budget it would need, the report JSON, ``ln_placement/transition``), and stays in the blend it
reached: it never ends "finished" at a drift the user did not agree to. ``tolerance=None`` is the open loop: the blend
follows ``schedule`` and reaches 1 after ``steps`` steps, whatever the drift.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ln_lightning.placement.migrate.blend import MAX_STEPS
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.options import TARGETS, check_target, validate_options

OPEN_SCHEDULES = ("linear", "cosine")
# TransitionSpec.loss_tolerance: the held-blend optimizer steps whose mean training loss is where the transition started.
LOSS_BASELINE_STEPS = 8
REFERENCES = ("trained", "current")
# TransitionSpec.drift_positions: every output position, or those the training loss depends on.
DRIFT_POSITIONS = ("all", "loss")
# What a closed loop that spent its budget short of blend 1 does with the blend (TransitionSpec.revert_after_budget).
REVERTS = (None, "ramp", "gated")
# TransitionSpec.excess_tolerance's default in the closed loop (migrate_suite order 14: the goal's 0.03 less a third).
EXCESS_TOLERANCE = 0.02
# TransitionSpec.training_drift_every's default: the optimizer steps between two measurements of the training drift.
TRAINING_DRIFT_EVERY = 8
# TransitionSpec.teacher_every's default: the teacher on every optimizer step.
TEACHER_EVERY = 1
# TransitionSpec.teacher_rows's default: the teacher on every row of the batch.
TEACHER_ROWS = 1.0


def _positive(value) -> bool:
    """A finite number above 0 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


@dataclass(frozen=True)
class TransitionSpec:
    """A function-preserving transition from the placement a model is written in to the requested one.

    Args:
        steps: the budget, in optimizer steps. Open loop (``tolerance=None``): the transition ends after exactly
            this many. Closed loop: the blend may reach 1 sooner (after ``ramp`` of them when the drift never holds
            it) or not at all; a model still blending at the end of the budget stays there, and the run says so.
        tolerance: the closed loop's bound on the smoothed drift, in nats per predicted position
            (KL(trained || model) on the training batches). ``None``: the open loop.
        ramp: closed loop: the fraction of the budget the blend takes from 0 to 1 when nothing holds it (the slack
            is for holding and for training at the end point).
        schedule: open loop: ``"linear"`` (blend = t) or ``"cosine"`` ((1 - cos(pi t)) / 2), t = steps done / steps.
        stream_scale: with no ``branch_scale`` given to LNPlacement, the stream-scaled blend (on by default, to every
            placement). A post-norm model divides its stream by
            each norm's scale, so an older branch weighs less than a newer one; a plain pre-norm stream only adds, and the trained function
            moves by much more than the norms' move suggests (on the 12-layer study LM, KL 0.82 at the blend's end
            against 0.09 stream-scaled). Each converted branch ``k`` gets the constant ``C_k = prod sigma_i /
            |gamma_i|`` of the norms before it in its stack, measured once, on the first training batch at
            blend 0 (the mean over ranks), and the blend moves the stream between the two scalings. The
            endpoint is ``convert(model, placement, branch_scale="stream")`` with those constants (persistent
            buffers ``<branch>_scale.c``: in every checkpoint and saved model; a native Hugging Face export
            needs plain pre-norm, so such a model is exported with its remote code). Where the scales can't be
            measured (a norm that runs more than once per forward, a site that doesn't run) the plain blend runs
            and a warning says why. ``False``: the plain blend, ending at plain pre-norm. To ``"peri"`` the
            constants go into the added output norms instead: each one's gain starts at ``C_k`` times the trained
            branch output's spread (measured in the same forward), so its branch writes about what the
            pre-norm endpoint's does, and the endpoint is plain peri-norm with those gains (parameters, trained
            from there). What peri can't keep is each token's branch magnitude, which its output norms
            normalise away (on the study LM, KL 0.30 to the trained function at the end of the blend, where
            pre-norm's is 0.09). To ``"output"`` (``x + N(F(x))``) each branch reads the stream divided by a
            constant entry scale (``<branch>_in_scale.c``, ``C_k`` at the end, ``D_k = (1-a) + a C_k`` mid-way),
            and the moved norm, at the branch exit, gets the gain ``C_k`` times the trained branch output's
            spread (its gradient and optimizer state start afresh there), while its call site keeps the gain and
            bias it was trained to (buffers of the transition, taken at the measurement) until the blend ends; the
            endpoint is ``convert(model, "output", branch_scale="stream")``. Such a model saves the
            Hugging Face way once the transition has ended, not mid-way (keep the Lightning checkpoint).
        endpoint_fraction: the fraction of the transition's optimizer steps (never the first) whose training forward
            and backward run at blend 1, the function the transition ends at, while the model holds its blend for
            everything else (callbacks, validation, checkpoints). Picked by a hash of the step index: the same on every
            rank, under accumulation and after a resume. 0 trains every step at the held blend.
        distill: the weight of ``KL(trained || model)`` added to the loss ``training_step`` returns while the
            transition runs (0: not added; the closed loop still measures it). The trained function is a frozen copy
            of the model taken at the transition's start (blend 0), run on the inputs of each ``self(...)`` call in
            ``training_step``, in the model's mode and with the same random numbers (the same dropout masks: at
            blend 0 the term is exactly 0); its output's predictions (a tensor, ``logits``, or a tuple's first element)
            are compared over the last dimension. It costs a copy of the weights and one forward of it per training
            forward, during the transition only, and its weights go into the transition's checkpoints. Under manual
            optimisation, a sharded strategy (FSDP, ModelParallelStrategy) or an output without predictions it can't
            run, and a warning says so (the closed loop then ramps at the budget's pace, without a tolerance).
        reference: what the drift (and the distillation) compares the model with. ``"trained"``: a frozen copy of
            the model taken at the transition's start, the trained function (a copy of the weights in memory and in
            the transition's checkpoints). ``"current"``: the model itself at blend 0, with the weights it has now
            (no copy): the drift is then what the blend changes, not what continued training learns, which a
            copy's KL also counts and a fixed tolerance then mistakes for the blend's. Not for migrating a trained
            model you judge against continuing it unchanged: the model's own function at blend 0 moves with the
            weights the transition trains, so it anchors nothing. On the migration suite's Marian model it let the
            held-out loss rise about eight times as far as ``"trained"`` did, and it did no better on the
            x-transformers encoder (order 17).
        training_drift_factor: closed loop: ``None``, the tolerance is fixed. A number ``k``: the tolerance follows what
            continued training alone moves the function by, ``max(tolerance, k * training drift)``, the training drift
            being KL(trained || the model at blend 0 with the weights it has now), measured every
            ``training_drift_every`` optimizer steps (one more forward, without gradients, with the step's random
            numbers) and smoothed. A migration is judged against continuing unchanged; a model whose own continued
            training moves it far from the trained function (an unsettled one) then gets a tolerance as loose as that,
            and a settled one keeps ``tolerance``. Needs ``reference="trained"``. Logged as
            ``ln_placement/training_drift`` and ``ln_placement/tolerance``; a resumed fit starts again from
            ``tolerance`` until its first measurement.
        training_drift_every: the optimizer steps between two measurements of the training drift (the step index
            in the transition a multiple of it, never the first, where it is 0).
        loss_tolerance: closed loop: ``None``, the blend is gated on the drift alone. A number: the blend also holds
            while the training loss has risen more than this above where the transition started, in the loss's
            own units (nats for a cross-entropy): the loss ``training_step`` returns, before the distillation
            term, averaged over each optimizer step's micro-batches and the ranks, its start the mean over the
            transition's first ``LOSS_BASELINE_STEPS`` held-blend steps (a quarter of a shorter budget; the drift
            alone gates the blend during them), its rise smoothed; a step whose loss is not finite is left out.
            The drift bounds how far the function moves; this bounds what the move costs, which is what a
            migration is judged by (a KL of 0.05 cost one held-out model +0.037). Endpoint steps (which train at
            blend 1) are not counted. Logged as ``ln_placement/loss_rise``. A resumed fit measures its start
            again (said at INFO): a rise before the resume is then part of the new start, so across resumes the
            loss can rise by more than this. It needs the distillation's hooks (automatic optimisation, a
            ``training_step`` that calls the module, an unsharded model); where they can't run, a warning says
            the closed loop runs without its tolerances.
        drift_positions: closed loop: where the drift it gates on is averaged. ``None`` (the default): ``"loss"`` in
            the closed loop, ``"all"`` in the open loop (which gates on none). ``"all"``: every position of the
            output. ``"loss"``: the positions the training loss depends on, those where its gradient with respect
            to the output is not zero (a masked LM's masked positions, a padded batch's real tokens), found by one
            backward through the loss alone (no weight gradients; the step's own backward is untouched); where the
            loss depends on no position of the output (or ``training_step`` returns no loss tensor) every position
            counts. A masked LM's loss counts about a sixth of its positions, and the mean over all of them read
            half the drift that costs loss on the suite's two masked LMs (docs/results/migrate_drift_positions). Where
            the loss counts every position the two are the same number. ``"loss"`` became the default after the
            migration suite's orders 12-13: the same figures as ``"all"`` on every model whose loss counts every
            position, and on the x-transformers masked LM, which every method fails, a transition that stops short
            and says so where ``"all"`` finished at three times the goal's excess (+0.096). The distillation term and
            ``ln_placement/distill_kl`` stay the mean over every position.
        excess_tolerance: closed loop: the blend also holds while the training loss's excess over the trained
            function's on the same batch (the same inputs and dropout masks: the teacher's forward
            the drift already runs) is above this, in the loss's own units (nats for a cross-entropy), smoothed as
            the drift is. It is what a migration is judged by (the loss it adds), measured where the loss is,
            paired, so neither the batch's own difficulty nor training's progress moves it (``loss_tolerance``'s
            loss trajectory has both). Computed from the loss's gradient with respect to the output (the backward
            ``drift_positions="loss"`` runs): exactly for a softmax cross-entropy with hard labels, whatever its
            weights or ignored positions; for any other loss the first-order term, an upper bound for a loss convex
            in the output, so the blend holds earlier, never later. Endpoint steps are not counted. Logged as
            ``ln_placement/loss_excess``; its smoothed value travels in checkpoints
            (``checkpoint["ln_lightning_transition_run"]``), so a resumed fit gates as the uninterrupted one would.
            It needs the distillation's hooks, as ``loss_tolerance`` does. ``None`` (the
            default): ``0.02`` (``EXCESS_TOLERANCE``) in the closed loop, off in the open loop; ``math.inf``: measured
            and logged, never holding the blend (the closed loop before it). The default since the migration suite's
            order 14: the held-out loss stayed within the goal's excess on all 16 runs of both halves (the closed
            loop before it: 12), the largest worst excess on the tuning half fell from 1.65 to 0.79 of the goal's
            band, and 5 runs that can't finish in their budget stop short within the goal and say so (1 before; 4
            with the suite's compute count corrected since); one run that finished within the goal before now stops
            short (docs/results/migrate_suite).
        distill_after_budget: closed loop: what a transition that spends its budget short of blend 1 does for the
            rest of the fit, at the blend it holds. ``True``: it goes on distilling towards the trained function (a
            teacher forward per step), which pulls the held blend's function back towards it; the excess the loop
            allowed while blending is otherwise carried to the fit's end. ``False``: it stops distilling (no teacher
            forward, no term in the loss; the teacher is kept for checkpoints). ``None`` (the default): ``True`` in
            the closed loop with ``distill > 0``, else ``False``. The default since the migration suite's order 15:
            14 of its 16 runs meet the goal or stop short within it and say so before the budget's end, against 13
            (docs/results/migrate_suite).
        revert_after_budget: closed loop: whether a transition that spends its budget short of blend 1 goes back to
            blend 0 (the placement the model was trained in, with the weights it has now), distilling towards the
            trained function as it goes where ``distill_after_budget`` is on; from blend 0 the teacher is paused and
            the fit trains the model as written (its function bit for bit that of the trained placement). ``"ramp"``:
            at the ramp's pace (``rate()`` per step), whatever the drift; ``"gated"``: at that pace only while the
            smoothed drift and loss excess stay within their tolerances (it needs ``distill_after_budget``, whose
            teacher measures them). ``None`` (the default): it stays at the blend it reached. On the migration
            suite's two models the default fails (orders 18 and 19, docs/results/migrate_suite) neither helps: the
            x-transformers encoder ends a little nearer continuing unchanged, and the Marian model's held-out loss
            rises as it steps back (its weights, trained through the transition, compute a worse function at a lower
            blend), so both end further above it than the default.
        teacher_every: how often the teacher runs, in optimizer steps: on the steps whose index (Lightning's
            ``global_step``, the same on every rank and after a resume) is a multiple of it, with the distillation
            term weighted by it there, so the pull towards the trained function per step is the same on average.
            The closed loop measures the drift and the loss excess on those steps and gates its blend there only
            (it holds on the others: every move rests on a fresh measurement, so ``ramp * teacher_every`` must be at
            most 1, or it could not reach blend 1 within its budget); on the others the dashboard's
            ``ln_placement/drift``, ``loss_excess`` and ``distill_kl`` show the last measurement, so a logging step
            that falls on one still shows them. The teacher's forward costs about a
            third of a training step (a forward against a forward and a backward); a run within a fixed compute
            trains that many more steps. ``None`` (the default): 1 (every step). Not with ``training_drift_factor``
            (whose measurements ride on the teacher's forwards on steps of their own). On the migration suite
            (orders 22-25, docs/results/migrate_suite) 2 gives back most of the steps the teacher costs (in continuing
            unchanged's compute) and keeps the held-out loss within the goal, but its blend moves at half the pace:
            on the tuning half it finished 2 of 10 runs where every step's teacher finishes 6.
        teacher_rows: the share of each training batch's rows the teacher runs on, on every step it runs: its forward
            costs that share of a full one, and the distillation term, the drift and the loss excess are taken over
            those rows (the excess scaled up to the batch). The rows are the first ``ceil(teacher_rows * n)`` of every
            tensor argument of the LightningModule's forward whose first dimension is the output's ``n``. It holds
            only where those rows compute alone what they compute in the batch, which is checked, not assumed: where
            the model's forward draws random numbers (dropout: the teacher's masks on fewer rows are not the model's)
            the teacher runs on every row; else the first measured step of each fit runs the teacher twice more (on
            the rows alone, which must be within 1e-3 nats of their outputs in the batch, and on the batch with its
            other rows replaced, which must leave theirs unchanged bit for bit), and the rows are used from the first
            logging step on (where the comparison is read: no host read on other steps); rows that see one another (a
            batch norm, a mix across rows) or inputs it can't cut run on every row. The run says which, the report
            JSON records it, and a checkpoint keeps it for a resumed fit. The first dimension is taken to be the
            batch's: a time-first causal model passes the check and is then measured on the first positions of every
            sequence. The check is made on one batch: a dependence between rows that batch does not show (a
            mixture of experts' capacity, overflowing on other batches) is not seen. Under DDP each rank checks its
            own batches (rank zero reports). ``None`` (the default): 1
            (every row). Not adopted as the default: on the migration suite (order 26) it ended the x-transformers
            encoder further above continuing unchanged than a teacher on every row, in the same compute.
    """

    steps: int
    tolerance: float | None = 0.05
    ramp: float = 0.5
    schedule: str = "linear"
    stream_scale: bool = True
    endpoint_fraction: float = 0.25
    distill: float = 1.0
    reference: str = "trained"
    training_drift_factor: float | None = None
    training_drift_every: int = TRAINING_DRIFT_EVERY
    loss_tolerance: float | None = None
    drift_positions: str | None = None  # "loss" in the closed loop, "all" in the open loop
    excess_tolerance: float | None = None  # EXCESS_TOLERANCE in the closed loop, off in the open loop
    distill_after_budget: bool | None = None  # True in the closed loop with distillation, else False
    revert_after_budget: str | None = None  # None (hold the blend reached), "ramp" or "gated"
    teacher_every: int | None = None  # TEACHER_EVERY
    teacher_rows: float | None = None  # TEACHER_ROWS (kept None when not given: a fallback to every row is then no news)

    def __post_init__(self):
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"TransitionSpec: steps must be a positive int (optimizer steps) of at most 2**63 - 1, got {steps!r}.")
        tol = self.tolerance
        if tol is not None and not _positive(tol):
            raise ValueError(f"TransitionSpec: tolerance must be a positive number (nats of KL per position) or None "
                             f"(the open loop), got {tol!r}.")
        if isinstance(self.ramp, bool) or not isinstance(self.ramp, (int, float)) or not 0 < self.ramp <= 1:
            raise ValueError(f"TransitionSpec: ramp must be in (0, 1], got {self.ramp!r}.")
        if self.schedule not in OPEN_SCHEDULES:
            raise ValueError(f"TransitionSpec: unknown schedule {self.schedule!r}; valid: {', '.join(map(repr, OPEN_SCHEDULES))}.")
        if tol is not None and self.schedule != "linear":
            raise ValueError("TransitionSpec: schedule applies to the open loop (tolerance=None); the closed loop's blend "
                             "follows the measured drift. Drop schedule, or pass tolerance=None.")
        if not isinstance(self.stream_scale, bool):
            raise TypeError(f"TransitionSpec: stream_scale must be True or False, got {self.stream_scale!r}.")
        f = self.endpoint_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
            raise ValueError(f"TransitionSpec: endpoint_fraction must be a number in [0, 1), got {f!r}.")
        w = self.distill
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < math.inf:
            raise ValueError(f"TransitionSpec: distill must be a finite number >= 0 (0: not added to the loss), got {w!r}.")
        if self.reference not in REFERENCES:
            raise ValueError(f"TransitionSpec: reference must be one of {', '.join(map(repr, REFERENCES))}, got {self.reference!r}.")
        k = self.training_drift_factor
        if k is not None:
            if not _positive(k):
                raise ValueError(f"TransitionSpec: training_drift_factor must be a positive number or None (a fixed "
                                 f"tolerance), got {k!r}.")
            if tol is None:
                raise ValueError("TransitionSpec: training_drift_factor scales the closed loop's tolerance; the open loop "
                                 "(tolerance=None) has none. Give a tolerance, or drop training_drift_factor.")
            if self.reference != "trained":
                raise ValueError("TransitionSpec: training_drift_factor measures how far training alone moved the model "
                                 "from the trained function, which reference='current' does not keep. Pass "
                                 "reference='trained', or drop training_drift_factor.")
        every = self.training_drift_every
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_STEPS:
            raise ValueError(f"TransitionSpec: training_drift_every must be a positive int (optimizer steps), got {every!r}.")
        lt = self.loss_tolerance
        if lt is not None:
            if not _positive(lt):
                raise ValueError(f"TransitionSpec: loss_tolerance must be a positive number (the loss's units) or None "
                                 f"(the drift alone gates the blend), got {lt!r}.")
            if tol is None:
                raise ValueError("TransitionSpec: loss_tolerance gates the closed loop's blend; the open loop "
                                 "(tolerance=None) follows its schedule. Give a tolerance, or drop loss_tolerance.")
        xt = self.excess_tolerance
        if xt is None:
            object.__setattr__(self, "excess_tolerance", None if tol is None else EXCESS_TOLERANCE)
        else:
            if not (_positive(xt) or (isinstance(xt, float) and xt == math.inf)):
                raise ValueError(f"TransitionSpec: excess_tolerance must be a positive number (the loss's units), math.inf "
                                 f"(measured, never holding the blend) or None (the default), got {xt!r}.")
            if tol is None:
                raise ValueError("TransitionSpec: excess_tolerance gates the closed loop's blend; the open loop "
                                 "(tolerance=None) follows its schedule. Give a tolerance, or drop excess_tolerance.")
        if self.distill_after_budget is None:
            object.__setattr__(self, "distill_after_budget", tol is not None and self.distill > 0)
        elif not isinstance(self.distill_after_budget, bool):
            raise ValueError(f"TransitionSpec: distill_after_budget must be True, False or None (the default), got "
                             f"{self.distill_after_budget!r}.")
        elif self.distill_after_budget and (tol is None or self.distill <= 0):
            raise ValueError("TransitionSpec: distill_after_budget says what a closed loop that spent its budget short of "
                             "blend 1 does next; it needs a tolerance (the closed loop) and distill > 0. Give both, or "
                             "drop distill_after_budget.")
        if self.revert_after_budget not in REVERTS:
            raise ValueError(f"TransitionSpec: revert_after_budget must be one of {', '.join(map(repr, REVERTS))}, got "
                             f"{self.revert_after_budget!r}.")
        if self.revert_after_budget is not None and tol is None:
            raise ValueError("TransitionSpec: revert_after_budget says what a closed loop that spent its budget short of "
                             "blend 1 does next; the open loop (tolerance=None) always ends at blend 1. Give a tolerance, "
                             "or drop revert_after_budget.")
        if self.revert_after_budget == "gated" and not self.distill_after_budget:
            raise ValueError("TransitionSpec: revert_after_budget='gated' steps back only while the drift and the loss "
                             "excess are within their tolerances, which the teacher of distill_after_budget measures. Drop "
                             "distill_after_budget=False, or pass revert_after_budget='ramp'.")
        every = self.teacher_every
        if every is None:
            object.__setattr__(self, "teacher_every", TEACHER_EVERY)
        elif isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_STEPS:
            raise ValueError(f"TransitionSpec: teacher_every must be a positive int (optimizer steps) or None (the "
                             f"default), got {every!r}.")
        if self.teacher_every > 1 and tol is not None and self.ramp * self.teacher_every > 1:
            raise ValueError(f"TransitionSpec: the closed loop's blend moves only on the steps the teacher runs, and with "
                             f"teacher_every={self.teacher_every} it can't reach 1 within its budget at ramp={self.ramp:g} "
                             f"(it would need {self.ramp * self.teacher_every:g} budgets). Pass ramp <= "
                             f"{1 / self.teacher_every:.3g}, or a smaller teacher_every.")
        if self.teacher_every > 1 and self.training_drift_factor is not None:
            raise ValueError("TransitionSpec: training_drift_factor measures the training drift on every "
                             "training_drift_every-th step, alongside the teacher's forward, and teacher_every skips that "
                             "forward on other steps. Drop teacher_every (every step), or drop training_drift_factor.")
        rows = self.teacher_rows
        if rows is not None:
            if isinstance(rows, bool) or not isinstance(rows, (int, float)) or not 0 < rows <= 1:
                raise ValueError(f"TransitionSpec: teacher_rows must be a share of the batch's rows in (0, 1] or None "
                                 f"(every row), got {rows!r}.")
            if self.distill <= 0 and tol is None:
                raise ValueError("TransitionSpec: teacher_rows says how much of each batch the teacher runs on, and the "
                                 "open loop without distillation (tolerance=None, distill=0) runs no teacher. Drop "
                                 "teacher_rows, or give a tolerance or distill > 0.")
            object.__setattr__(self, "teacher_rows", float(rows))
        if self.drift_positions is None:
            object.__setattr__(self, "drift_positions", "all" if tol is None else "loss")
        if self.drift_positions not in DRIFT_POSITIONS:
            raise ValueError(f"TransitionSpec: drift_positions must be one of {', '.join(map(repr, DRIFT_POSITIONS))}, "
                             f"got {self.drift_positions!r}.")
        if self.drift_positions != "all" and tol is None:
            raise ValueError("TransitionSpec: drift_positions says where the closed loop measures the drift it gates on; "
                             "the open loop (tolerance=None) gates on none. Give a tolerance, or drop drift_positions.")
        for name in ("tolerance", "ramp", "endpoint_fraction", "distill", "training_drift_factor", "loss_tolerance",
                     "excess_tolerance"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))

    @property
    def closed(self) -> bool:
        return self.tolerance is not None

    @property
    def kind(self) -> str:
        """The schedule kind the model's transition records (``"closed"`` for the closed loop)."""
        return "closed" if self.closed else self.schedule

    def rate(self) -> float:
        """The closed loop's blend increment per optimizer step that is not an endpoint step."""
        return 1.0 / max(1.0, self.ramp * self.steps * (1.0 - self.endpoint_fraction))

    def measures_training_drift(self, i: int) -> bool:
        """Whether the ``i``-th optimizer step of the transition (0-based) measures the training drift (one more
        forward): with ``training_drift_factor`` set, every ``training_drift_every``-th step but the first."""
        return self.training_drift_factor is not None and i > 0 and i % self.training_drift_every == 0

    def runs_teacher(self, global_step: int) -> bool:
        """Whether the teacher runs in the optimizer step Lightning counts as ``global_step`` (``teacher_every``)."""
        return global_step % self.teacher_every == 0

    @property
    def rows_share(self) -> float:
        """The share of each batch's rows the teacher is asked to run on (``teacher_rows``, 1 where not given)."""
        return TEACHER_ROWS if self.teacher_rows is None else self.teacher_rows

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def coerce(cls, value: "TransitionSpec | int | None") -> "TransitionSpec | None":
        """``transition=`` as LNPlacement takes it: a TransitionSpec, an int (the budget, every default), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(steps=value)
        raise TypeError(f"LNPlacement: transition must be a TransitionSpec, an int (its steps) or None, got {value!r}.")


# Placements whose transition scales the stream by default (TransitionSpec.stream_scale): every target.
_STREAM_SCALED = TARGETS


@dataclass(frozen=True)
class PlacementSpec:
    """What a placement rewrite computes: the one spelling of the request, validated when built.

    ``LNPlacement(PlacementSpec("mix", mix_post_blocks=2))``; ``LNPlacement("pre")`` is short for
    ``LNPlacement(PlacementSpec("pre"))``, and ``LNPlacement("pre", transition=TransitionSpec(steps=600))`` for
    ``LNPlacement(PlacementSpec("pre", transition=TransitionSpec(steps=600)))``. ``convert(model, spec)`` takes one
    too (without a transition: ``convert`` rewrites at once). Options that contradict each other can't be built:
    the error names the option and the fix.

    Args:
        placement: ``"pre"`` (``x + F(N(x))``), ``"post"`` (``N(x + F(x))``), ``"peri"`` (``x + N_out(F(N(x)))``),
            ``"output"`` (``x + N(F(x))``), ``"mix"`` (the first ``mix_post_blocks`` blocks post-norm, the rest pre) or
            ``"deepnorm"`` (DeepNorm's ``N(alpha x + G'(x))``, ``alpha = (2N)^(1/4)``: exact from a post-norm model,
            alpha folded into each branch's last linear layer; no branch scale, no transition).
        final_norm: add a final norm after a stack converted to pre-norm that has none.
        branch_scale: ``None``, a positive float ``c`` (``x + c*F(N(x))``), ``"depth"`` (``c = 1/sqrt(2L)``),
            ``"layerscale"`` (a learnable per-channel scale) or ``"stream"`` (constants a transition measures).
        layerscale_init: the initial LayerScale value (with ``branch_scale="layerscale"``; default: by depth).
        mix_post_blocks: with ``"mix"``, how many leading blocks of each stack stay post-norm (default: a quarter).
        transition: ``None`` (the rewrite takes effect at once), a :class:`TransitionSpec`, or an int ``N``
            (``TransitionSpec(steps=N)``): a function-preserving transition from the trained model to this placement.
        norm_scale: ``None``, or ``"depth"``: LayerNorm Scaling (Sun et al. 2025, "The Curse of Depth"), each norm
            output of block ``l`` (1-based, in its stack) times ``1/sqrt(l)``: ``x + F(LN(x)/sqrt(l))``, on every
            block that is pre-norm after the rewrite (converted, or pre-norm already: GPT-2 as built). A training-dynamics choice that changes a trained model's function
            (so no transition). Not a ``branch_scale`` value: ``branch_scale`` multiplies a branch's output, and
            ``branch_scale="depth"`` is one constant ``1/sqrt(2L)`` for every block.
    """

    placement: str = "pre"
    final_norm: bool = True
    branch_scale: float | str | None = None
    layerscale_init: float | None = None
    mix_post_blocks: int | None = None
    transition: TransitionSpec | int | None = None
    norm_scale: str | None = None

    def __post_init__(self):
        transition = TransitionSpec.coerce(self.transition)
        object.__setattr__(self, "transition", transition)
        validate_options(self.placement, final_norm=self.final_norm, branch_scale=self.branch_scale,
                         layerscale_init=self.layerscale_init, mix_post_blocks=self.mix_post_blocks,
                         norm_scale=self.norm_scale)
        if transition is not None:
            check_target(self.placement)
            if self.norm_scale is not None:
                raise PlacementError("norm_scale='depth' (LayerNorm Scaling) changes the trained function, and a transition "
                                     "keeps it: drop the transition (the scale applies at once, training takes it from "
                                     "there) or drop norm_scale")
            if self.branch_scale == "stream" and not transition.stream_scale:
                raise PlacementError("branch_scale='stream' is the stream-scaled transition's end point, and the "
                                     "TransitionSpec asks for stream_scale=False (the plain blend): drop one of the two")
        scale = self.branch_scale
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            object.__setattr__(self, "branch_scale", float(scale))
        if self.layerscale_init is not None:
            object.__setattr__(self, "layerscale_init", float(self.layerscale_init))

    @property
    def stream_scaled(self) -> bool:
        """Whether the rewrite ends at the stream-scaled form: asked for, or a transition's default."""
        t = self.transition
        return self.branch_scale == "stream" or (
            t is not None and t.stream_scale and self.branch_scale is None and self.placement in _STREAM_SCALED)

    @property
    def config(self) -> dict:
        """What the model computes, serialised (markers, checkpoint entries, reports): the resolved branch scale,
        and the optional keys only where set (so an older checkpoint's entry reads back equal)."""
        config = {"placement": self.placement, "final_norm": self.final_norm,
                  "branch_scale": "stream" if self.stream_scaled else self.branch_scale}
        if self.layerscale_init is not None:
            config["layerscale_init"] = self.layerscale_init
        if self.mix_post_blocks is not None:
            config["mix_post_blocks"] = self.mix_post_blocks
        if self.norm_scale is not None:
            config["norm_scale"] = self.norm_scale
        return config

    @classmethod
    def from_config(cls, config: dict, transition: "TransitionSpec | int | None" = None) -> "PlacementSpec":
        """The spec a serialised ``config`` (a marker's, a checkpoint entry's) describes."""
        unknown = sorted(set(config) - {"placement", "final_norm", "branch_scale", "layerscale_init", "mix_post_blocks",
                                        "norm_scale"})
        if unknown:
            raise PlacementError(f"a placement record with unknown keys {unknown}: written by a newer ln_lightning? "
                                 "Upgrade ln_lightning to read it")
        return cls(**config, transition=transition)

    def short(self) -> str:
        """The spec as LNPlacement's repr shows it."""
        parts = [repr(self.placement)] + [f"{k}={v!r}" for k, v in self.config.items() if k != "placement"]
        if self.transition is not None:
            parts.append(f"transition={self.transition!r}")
        return ", ".join(parts)


def coerce_placement(value: "PlacementSpec | str", transition: "TransitionSpec | int | None" = None,
                     where: str = "LNPlacement") -> PlacementSpec:
    """``placement=`` as LNPlacement and convert take it: a PlacementSpec, or a placement's name (its shorthand).
    A ``transition`` given beside a spec that has its own is a contradiction, refused."""
    if isinstance(value, PlacementSpec):
        if transition is not None:
            if value.transition is not None:
                raise ValueError(f"{where}: the transition is given twice, in the PlacementSpec and as transition=; "
                                 "pass it once")
            value = PlacementSpec(**{**_fields(value), "transition": transition})
        return value
    if isinstance(value, str):
        return PlacementSpec(value, transition=transition)
    raise TypeError(f"{where}: placement must be a placement's name ('pre', 'post', 'peri', 'output', 'mix') or a "
                    f"PlacementSpec, got {type(value).__name__}.")


def _fields(spec: PlacementSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


__all__ = ["OPEN_SCHEDULES", "REFERENCES", "PlacementSpec", "TransitionSpec", "coerce_placement"]
