"""What the hooks need to rewrite one post-norm sublayer, and the error for a block we can't read."""

from __future__ import annotations

from dataclasses import dataclass


class Unrecognised(Exception):
    """The block's structure is not one we can rewrite; the message says why."""


@dataclass
class EntryPlan:
    """A module where the branch reads the stream, and which of its arguments carry it."""

    module: str
    arg_positions: tuple[int, ...]
    kwarg_names: tuple[str, ...]


@dataclass
class ExitCall:
    """Which call of a branch exit module that several calls in the block share (one nn.Dropout for both
    branches) is this branch's: the one whose argument `arg` is the tensor the module `feeder` (called once in
    the block) returned (its element `feeder_index` for a tuple). `number`: that call's place among the block's
    calls of the exit module, in the recorded forward (the check reads the exit's output there)."""

    feeder: str
    feeder_index: int | None
    arg: int
    number: int


@dataclass
class RewritePlan:
    """One post-norm sublayer: its norm, the branch's entries, and the module whose output is the branch."""

    norm: str
    entries: list[EntryPlan]
    exit_module: str | None
    exit_index: int | None
    exit_reason: str = ""  # why there is no exit module
    exit_call: ExitCall | None = None  # the exit module is called more than once in the block: which call is this branch's
