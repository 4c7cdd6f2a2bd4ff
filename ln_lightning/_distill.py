"""LNPlacement's distillation while a transition blends: the Lightning side of ``placement.migrate.teacher``.

The term ``weight * KL(trained || model)`` on the LightningModule's own output is added to the loss its
``training_step`` returns, so Lightning's own handling of that loss (division under gradient accumulation,
the mixed-precision scaler, the logged loss is the user's own) applies to it unchanged. What it takes:

* automatic optimisation (under manual optimisation the plugin never sees the loss before its backward);
* a ``training_step`` that calls the LightningModule itself (``self(x)``): the teacher sees the same inputs
  through a forward hook on it, and the output's predictions (a tensor, ``logits``, or a tuple's first);
* a model each rank holds whole (one device, DDP): a sharded model's copy would not run on its own.

Where one of these fails, fitting goes on without distillation and a warning says why. The teacher's weights
go into every checkpoint written during the transition (``checkpoint["ln_lightning_teacher"]``), so a resumed
run distils towards the same function as an uninterrupted one; the teacher stays with the model's transition
between fits (a second fit of the same model uses it) and goes when the transition ends.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from ln_lightning.placement.migrate import blend
from ln_lightning.placement.migrate.teacher import (frozen_copy, kl_per_position, kl_to_teacher, logits_of, loss_excess,
                                                    mean_where_the_loss_looks, trained_output)

CHECKPOINT_KEY = "ln_lightning_teacher"
# TransitionSpec.teacher_rows: how far (KL per position, the largest, nats) the teacher's outputs on the rows alone may
# be from theirs in the batch (a different batch size rounds differently): a fiftieth of the closed loop's default
# drift tolerance, so the rows' teacher measures the drift as the batch's would, within what the loop can see.
ROWS_KL = 1e-3
_STEP = "training_step"


class Distillation:
    """One transition's distillation in one Trainer call (built by LNPlacement at the first training batch)."""

    def __init__(self, weight: float, reference: str = "trained", drift_at_loss: bool = False, excess: bool = False):
        self.weight = weight
        # TransitionSpec.drift_positions == "loss": the drift the closed loop gates on is the KL over the positions the
        # training loss depends on (its gradient with respect to the output not zero), not over every position.
        self.drift_at_loss = drift_at_loss
        # TransitionSpec.excess_tolerance: the loss's excess over the trained function's on each batch, too (teacher.loss_excess).
        self.excess = excess
        self._positions: list[tuple] = []  # this step's (KL per position, the output, the teacher's output)
        self._excesses: list[torch.Tensor] = []  # this optimizer step's loss excesses (every micro-batch)
        # "trained": a frozen copy of the model at the transition's start. "current": the model itself, pinned at
        # blend 0 (the function as written with the weights it has now): what the blend changes, not what training
        # has learnt since (a copy's KL grows with that too).
        self.live = reference == "current"
        self._in_reference = False
        self.teacher: torch.nn.Module | None = None
        self.saved_state: dict | None = None  # the teacher of the checkpoint this run resumed from
        self.off_reason: str | None = None
        self._pending: list[torch.Tensor] = []
        self._handle = None
        self._pre_handle = None
        self._rng: tuple | None = None  # the random state the module's forward started from (the teacher's masks)
        self._drift: list[torch.Tensor] = []  # this optimizer step's KLs (every micro-batch), for the closed loop
        # TransitionSpec.training_drift_factor: on the steps the run sets this, KL(trained || the model pinned at blend 0)
        # too (one more forward, no gradients): how far training alone has moved the function.
        self.measure_training_drift = False
        self._training_drift: list[torch.Tensor] = []
        self._losses: list[torch.Tensor] = []  # this optimizer step's training losses, before the term (loss_tolerance)
        self._module: LightningModule | None = None
        self._transition = None
        self._wrapper = None
        self.paused = False  # pause(): the teacher is kept for the checkpoints, not run
        # TransitionSpec.teacher_every: set by the run before each step; a skipped step runs no teacher forward and
        # adds no term, and a measured one weighs its term by `every` (the same pull per step on average).
        self.skip = False
        self.every = 1
        self.endpoint = False  # set by the run: this step trains the end point (its KL is not the held blend's)
        self._in_step = False
        self.distilled_once = False  # a KL was added in this run (checked after the first step)
        self._last_kl: torch.Tensor | None = None  # the last measured step's, logged again on steps without a teacher
        # TransitionSpec.teacher_rows: the share of the rows the teacher is asked to run on, and where that stands:
        # "check" (the next measured forward runs the teacher on the rows and on the batch), "pending" (the comparison
        # is on the device until a read step), "rows" (it runs on the rows) or "full" (on the batch; rows_reason: why)
        self.rows = 1.0
        self.rows_state = "full"
        self.rows_reason: str | None = None
        self.rows_news: str | None = None  # a decision not yet said (the run says it: rank zero, warning or info)
        self._rows_agree: torch.Tensor | None = None
        self.teacher_share = 0.0  # the last measured forward's teacher cost, in full forwards (the suite counts it)
        self._row_share = 1.0  # ... the rows' share of that forward's batch

    @property
    def active(self) -> bool:
        return self.teacher is not None

    def ask_rows(self, share: float, settled: tuple[str, str | None] | None = None) -> None:
        """Run the teacher on `share` of each batch's rows once the first measured forward shows that they compute
        the same outputs alone (TransitionSpec.teacher_rows); `settled`: as a checkpoint's fit found (state, reason)."""
        self.rows = share
        self.rows_state = "check" if share < 1.0 else "full"
        if share < 1.0 and settled is not None:
            self.rows_state, self.rows_reason = settled

    def read_rows_verdict(self) -> None:
        """On a step that reads the host (a logging step): settle a pending comparison of the rows with the batch."""
        if self.rows_state != "pending":
            return
        agree = bool(self._rows_agree)  # (one read, on a read step)
        self._rows_agree = None
        if agree:
            self.rows_state = "rows"
            self.rows_news = "rows"
        else:
            self._every_row("the teacher's outputs on the first rows alone were not its outputs for those rows in the "
                            "batch (the rows see one another, as in a batch norm, or the first dimension is not the "
                            "batch's)")

    def next_share(self) -> float:
        """What the next measured forward's teacher costs, in full forwards."""
        return {"rows": self._row_share, "check": 2.0 + self._row_share}.get(self.rows_state, 1.0)

    def _every_row(self, reason: str) -> None:
        if self.rows_state != "full":
            self.rows_state, self.rows_reason, self.rows_news = "full", reason, "full"

    def start(self, trainer: Trainer, pl_module: LightningModule, steps_done: int) -> str | None:
        """Build the teacher and hook the module; the reason it can't, else None."""
        if not pl_module.automatic_optimization:
            return "it needs automatic optimisation (the loss passes through LNPlacement only then)"
        if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
            return f"the model is sharded under {type(trainer.strategy).__name__} (the teacher is a whole copy of it)"
        t = blend.active(pl_module)
        # An earlier fit's teacher, on this model: unless the checkpoint this run resumed from brought its own.
        teacher = t.teacher if t is not None and self.saved_state is None else None
        if self.live:
            teacher = pl_module
        elif teacher is None:
            if steps_done > 0 and self.saved_state is None:
                return ("the transition is past its start and neither the model nor the checkpoint holds its teacher "
                        "(written without distillation): the trained function it started from is not there")
            try:
                teacher = frozen_copy(pl_module)
            except Exception as e:  # noqa: BLE001 - a module holding something deepcopy can't copy: a reason, not a crash
                return f"the LightningModule could not be copied for the teacher ({type(e).__name__}: {e})"
            if self.saved_state is not None:
                teacher.load_state_dict(self.saved_state)
                blend.active(teacher).set_progress(0, 0.0)
            # Kept with the transition (Transition.teacher: no state_dict key), so a second fit of this model distils
            # towards the same function; it goes when the transition ends.
            t.hold_teacher(teacher)
        device = next((p.device for p in pl_module.parameters()), None)
        if device is not None and not self.live:
            teacher.to(device)  # (kept on the CPU between fits)
        self.teacher, self.saved_state, self._module, self._transition = teacher, None, pl_module, t
        self._handle = pl_module.register_forward_hook(self._on_forward, with_kwargs=True)
        self._pre_handle = pl_module.register_forward_pre_hook(self._before_forward)
        original = type(pl_module).training_step.__get__(pl_module) if _STEP not in pl_module.__dict__ else pl_module.__dict__[_STEP]

        # functools.wraps: Lightning reads training_step's signature (whether it takes batch_idx) through __wrapped__.
        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any):
            return self._training_step(original, *args, **kwargs)

        self._wrapper = training_step
        pl_module.__dict__[_STEP] = training_step
        return None

    def pause(self) -> None:
        """Stop distilling for the rest of this fit (no teacher forward, no term in the loss), keeping the teacher,
        on the CPU, for the checkpoints: a closed loop that spent its budget holds its blend, and a later fit with a
        larger budget measures its drift against the same trained function."""
        self._unhook()
        if self.teacher is not None and not self.live:
            self.teacher.to("cpu")
        self.paused = True

    def _unhook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._pre_handle is not None:
            self._pre_handle.remove()
            self._pre_handle = None
        self._rng, self._drift, self._pending, self._positions, self._training_drift = None, [], [], [], []
        self._excesses = []
        if self._module is not None and self._module.__dict__.get(_STEP) is self._wrapper:
            del self._module.__dict__[_STEP]

    def stop(self, keep: bool = True) -> None:
        """Drop the hooks, and the teacher: kept with the model's transition on the CPU for a later fit (`keep`:
        the Trainer call ended mid-transition), or let go (the transition ended, or distillation stopped)."""
        self._unhook()
        t = self._transition
        if t is not None and not self.live:
            if keep and self.off_reason is None and self.teacher is not None:
                self.teacher.to("cpu")
            else:
                t.hold_teacher(None)
        self._module, self.teacher, self._pending, self._positions, self._transition = None, None, [], [], None

    def checkpoint_state(self) -> dict | None:
        # The teacher is frozen: its tensors as they are (torch.save copies them), no second copy on the device.
        return None if self.teacher is None or self.live else dict(self.teacher.state_dict())

    def take_drift(self) -> torch.Tensor | None:
        """The mean KL(trained || model) of this optimizer step's training forwards (a 0-dim device tensor, detached;
        None if none ran), and start the next step's."""
        drift, self._drift = self._drift, []
        return torch.stack(drift).mean() if drift else None

    def take_excess(self) -> torch.Tensor | None:
        """The mean over this optimizer step's micro-batches of the training loss's excess over the trained function's
        on the same batch (a 0-dim device tensor; None if none was measured), and start the next step's."""
        excess, self._excesses = self._excesses, []
        return torch.stack(excess).mean() if excess else None

    def take_loss(self) -> torch.Tensor | None:
        """The mean loss ``training_step`` returned in this optimizer step's micro-batches, before the distillation
        term (a 0-dim device tensor, detached; None if none was seen), and start the next step's."""
        losses, self._losses = self._losses, []
        return torch.stack(losses).mean() if losses else None

    def take_training_drift(self) -> torch.Tensor | None:
        """The mean KL(trained || the model at blend 0) of this optimizer step's training forwards, where it was
        measured (a 0-dim device tensor; else None), and start the next step's."""
        drift, self._training_drift = self._training_drift, []
        return torch.stack(drift).mean() if drift else None

    # ------------------------------------------------------------------ per step
    def _before_forward(self, module, args):
        # The teacher draws the same dropout masks (and any other random numbers) as this forward: it starts from
        # the same random state. Host-side generator state: no device synchronisation.
        if self.teacher is None or self.skip or not self._in_step or not module.training or self._in_reference:
            return None
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        cuda = device if device.type == "cuda" else None
        self._rng = (torch.get_rng_state(), cuda, torch.cuda.get_rng_state(cuda) if cuda is not None else None)
        return None

    def _teacher_output(self, module, args, kwargs, rng):
        """The trained function on this forward's inputs, in the module's mode, with this forward's random numbers
        (so at blend 0 it is this forward, bit for bit, dropout included); the random state is left as it was."""
        teacher = self.teacher
        if teacher.training != module.training:
            teacher.train(module.training)
        with _replayed(rng):
            if not self.live:
                return trained_output(teacher, *args, **kwargs)
            return self._pinned_output(teacher, args, kwargs)

    def _pinned_output(self, module, args, kwargs):
        """`module` (the model itself) at blend 0, without gradients and without these hooks' own work."""
        self._in_reference = True
        try:
            with torch.no_grad(), self._transition.pinned(0.0):
                return module(*args, **kwargs)
        finally:
            self._in_reference = False

    def _on_forward(self, module, args, kwargs, output):
        # Only the module's calls inside training_step: under DDP, Lightning also calls the module itself with
        # training_step's arguments (its forward redirected to training_step), whose hook fires after it returned.
        if (self.teacher is None or self.skip or self._in_reference or not self._in_step or not module.training
                or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1):
            return None
        student = logits_of(output)
        rng, self._rng = self._rng, None
        rows, inputs = self._rows_for(student, args, kwargs, rng)
        taught = None
        if rows is not None and self.rows_state == "rows":
            try:
                taught = logits_of(self._teacher_output(module, *inputs, rng))
                self.teacher_share = self._row_share
            except Exception as e:  # noqa: BLE001 - inputs cut wrongly (a shared tensor whose first dimension is n)
                self._every_row(f"the teacher's forward on the first rows raised {type(e).__name__}: {e}")
                rows = None
        if taught is None:
            taught = logits_of(self._teacher_output(module, args, kwargs, rng)) if student is not None else None
            self.teacher_share = 1.0
            if rows is not None and taught is not None:  # "check": compared with the rows alone, on the device
                self._check_rows(module, args, kwargs, rng, taught, rows, inputs)
                rows = None  # this step compares over the batch
        if student is None or taught is None or (student[:rows] if rows is not None else student).shape != taught.shape:
            self.off_reason = (f"the LightningModule's output has no predictions to compare (a floating tensor of "
                               f"scores over a last dimension, `logits`, or a tuple's first element: got {type(output).__name__})")
            return None
        kl = kl_per_position(student[:rows] if rows is not None else student, taught)
        self._pending.append(kl.mean())
        if self.drift_at_loss or self.excess:
            self._positions.append((kl.detach(), student, taught, rows))
        if self.measure_training_drift and not self.live:
            # The same inputs and random numbers at blend 0: what training alone changed since the transition began.
            with _replayed(rng):
                written = logits_of(self._pinned_output(module, *(args, kwargs) if rows is None else inputs))
            if written is not None and written.shape == taught.shape:
                self._training_drift.append(kl_to_teacher(written, taught).detach())
        return None

    def _check_rows(self, module, args, kwargs, rng, taught: torch.Tensor, rows: int, inputs: tuple) -> None:
        """The first measured forward (TransitionSpec.teacher_rows): whether the first rows compute alone what they
        compute in the batch, on the device (read on a logging step). Two forwards more, once: the rows alone, within
        ROWS_KL of the batch's (a different batch size rounds differently), and the batch with its other rows replaced,
        the first rows' outputs bit for bit the batch's (the same shape rounds alike: any dependence on the other
        rows shows, a batch norm's or a mix across rows)."""
        n = taught.size(0)
        swapped = (_other_rows_swapped(args, n, rows), _other_rows_swapped(kwargs, n, rows))
        try:
            alone = logits_of(self._teacher_output(module, *inputs, rng))
            again = logits_of(self._teacher_output(module, *swapped, rng))
        except Exception as e:  # noqa: BLE001 - inputs cut wrongly (a shared tensor whose first dimension is n)
            self._every_row(f"the teacher's forward on the first rows raised {type(e).__name__}: {e}")
            return
        finally:
            self.teacher_share += 1.0 + self._row_share
        if alone is None or again is None or alone.shape != taught[:rows].shape or again.shape != taught.shape:
            self._every_row("the teacher's output on the first rows alone does not have those rows' shape in the "
                            "batch's (the first dimension of the output is not the batch's)")
            return
        self._rows_agree = (_largest_kl(taught[:rows], alone) <= ROWS_KL) & (again[:rows] == taught[:rows]).all()
        self.rows_state = "pending"

    def _rows_for(self, student, args, kwargs, rng) -> tuple[int | None, tuple | None]:
        """The number of first rows the teacher runs on in this forward (TransitionSpec.teacher_rows) and its inputs
        cut to them; (None, None) where it runs on the batch."""
        if self.rows_state not in ("check", "rows") or student is None or student.dim() < 2:
            return None, None
        n = student.size(0)
        rows = math.ceil(self.rows * n)
        if rows >= n:
            return None, None
        if rng is not None and not _unchanged(rng):
            # Dropout (or any random number) in the forward: the teacher on fewer rows would draw other numbers than
            # the model did for them (a generator's stream is not cut by rows), so it would not be the trained function
            # with the model's masks.
            self._every_row("the model's forward draws random numbers (its dropout, most likely), and on fewer rows "
                            "the teacher would draw other ones than the model did")
            return None, None
        self._row_share = rows / n
        return rows, (_first_rows(args, n, rows), _first_rows(kwargs, n, rows))

    @staticmethod
    def _loss_grads(loss, positions: list[tuple]) -> list:
        # The loss's gradient with respect to each output (None where it does not depend on it), by a backward through
        # the loss alone (the outputs are not leaves: no weight gradient is computed, and the graph is kept for the
        # step's own backward).
        grads: list = [None] * len(positions)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
            wanted = [i for i, p in enumerate(positions) if p[1].requires_grad]
            if wanted:
                found = torch.autograd.grad(loss.reshape(()), [positions[i][1] for i in wanted], retain_graph=True,
                                            allow_unused=True)
                for i, g in zip(wanted, found):
                    grads[i] = g
        return grads

    def _training_step(self, original, *args: Any, **kwargs: Any):
        self._in_step = True
        try:
            out = original(*args, **kwargs)
        finally:
            self._in_step = False
        pending, self._pending = self._pending, []
        positions, self._positions = self._positions, []
        if not pending or out is None:
            if self.skip and self._last_kl is not None and out is not None:
                # (teacher_every) no teacher this step: the dashboard holds the last measurement, else every logging
                # step that falls on a step without a teacher (all of them, for an even log_every_n_steps and 2)
                # would show none
                self._module.log("ln_placement/distill_kl", self._last_kl, on_step=True, on_epoch=False)
            return out
        self.distilled_once = True
        loss = out if isinstance(out, torch.Tensor) else out.get("loss") if isinstance(out, dict) else None
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().float().reshape(()))
        kl = torch.stack(pending).mean()
        grads = self._loss_grads(loss, positions) if positions else []
        # (TransitionSpec.teacher_rows: over the first rows, the loss's gradient cut to them too)
        grads = [g if p[3] is None or g is None else g[:p[3]] for p, g in zip(positions, grads)]
        if self.drift_at_loss and positions:  # the KL over the positions the loss depends on
            self._drift.append(torch.stack([mean_where_the_loss_looks(p[0], g) for p, g in zip(positions, grads)]).mean().detach())
        else:
            self._drift.append(kl.detach())
        if self.excess and positions:  # each forward's share of the loss: their excesses add up (the rows' scaled up)
            self._excesses.append(torch.stack([_excess_of(p, g) for p, g in zip(positions, grads)]).sum())
        if not self.endpoint:  # (an endpoint step's KL is the end point's: not what a held step should show)
            self._last_kl = kl.detach()
        self._module.log("ln_placement/distill_kl", kl.detach(), on_step=True, on_epoch=False)
        if not self.weight:  # measured for the closed loop only, not trained towards
            return out
        term = self.weight * self.every * kl
        if isinstance(out, torch.Tensor):
            return out + term
        if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
            return {**out, "loss": out["loss"] + term}
        self.off_reason = f"training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss'"
        return out


def _excess_of(position: tuple, grad) -> torch.Tensor:
    """One forward's loss excess (teacher.loss_excess); over its first rows, scaled up to the batch's rows."""
    _, student, taught, rows = position
    if rows is None:
        return loss_excess(grad, student, taught)
    return loss_excess(grad, student[:rows], taught) * (student.size(0) / rows)


def _first_rows(value: Any, n: int, rows: int) -> Any:
    """`value` (a forward's arguments) with every tensor whose first dimension is `n` cut to its first `rows`, inside
    tuples, lists and mappings too; anything else as it is (the comparison then finds the outputs disagree)."""
    if isinstance(value, torch.Tensor):
        return value[:rows] if value.dim() >= 1 and value.size(0) == n else value
    return _map_inputs(value, lambda v: _first_rows(v, n, rows))


def _largest_kl(in_batch: torch.Tensor, alone: torch.Tensor) -> torch.Tensor:
    """The largest KL(in batch || alone) over the positions, in float32, on the device; a class both give no
    probability (a masked logit, -inf or the dtype's lowest) adds nothing."""
    return kl_per_position(alone.detach(), in_batch).amax()


def _other_rows_swapped(value: Any, n: int, rows: int) -> Any:
    """`value` (a forward's arguments) with the rows after the first `rows` of every tensor whose first dimension is
    `n` replaced by copies of its first rows (the same shapes, other contents)."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 1 and value.size(0) == n:
            return torch.cat([value[:rows], value[torch.arange(n - rows, device=value.device) % rows]])
        return value
    return _map_inputs(value, lambda v: _other_rows_swapped(v, n, rows))


def _map_inputs(value: Any, f) -> Any:
    """`f` over the items of a tuple, list or mapping (of the same type where it can be rebuilt); else `value`."""
    if isinstance(value, Mapping):
        cut = {k: f(v) for k, v in value.items()}
        try:
            return type(value)(cut)
        except TypeError:
            return cut
    if isinstance(value, tuple):
        cut = [f(v) for v in value]
        return type(value)(*cut) if hasattr(value, "_fields") else tuple(cut)
    if isinstance(value, list):
        return [f(v) for v in value]
    return value


def _unchanged(rng: tuple) -> bool:
    """Whether the random state is the one `rng` took before the forward: the forward drew no random numbers
    (host-side generator state: no device synchronisation)."""
    cpu_state, cuda, cuda_state = rng
    if not torch.equal(torch.get_rng_state(), cpu_state):
        return False
    return cuda is None or torch.equal(torch.cuda.get_rng_state(cuda), cuda_state)


@contextlib.contextmanager
def _replayed(rng: tuple | None):
    """Inside, the random state `rng` (taken before the student's forward: its dropout masks); outside, the state as
    it was (None: the random state as it is, nothing replayed)."""
    with torch.random.fork_rng(devices=[rng[1]] if rng is not None and rng[1] is not None else [], enabled=rng is not None):
        if rng is not None:
            cpu_state, cuda, cuda_state = rng
            torch.set_rng_state(cpu_state)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda_state, cuda)
        yield


__all__ = ["CHECKPOINT_KEY", "Distillation"]
