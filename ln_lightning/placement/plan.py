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
class RewritePlan:
    """One post-norm sublayer: its norm, the branch's entries, and the module whose output is the branch."""

    norm: str
    entries: list[EntryPlan]
    exit_module: str | None
    exit_index: int | None
    exit_reason: str = ""  # why there is no exit module
