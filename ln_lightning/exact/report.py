"""What `to_rmsnorm` and `fold_norms` did, norm by norm, and how far the model's output moved.

Both transforms are exact in real arithmetic; the figures are what float arithmetic made of them on the
example input. An error is the largest absolute difference over the largest absolute value of the
reference (the tensor before the rewrite): `max|after - before| / max|before|`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field


@dataclass
class NormRewrite:
    """One norm: what was done to it, or why not."""

    name: str  # the norm's module path
    kind: str  # its class before the rewrite
    action: str  # "to_rmsnorm" | "folded" | "refused" | "skipped"
    reason: str = ""  # refused / skipped: why; otherwise what was done (e.g. "into attn.qkv")
    error: float | None = None  # max relative error of what changed (the norm's output / its readers' outputs)

    @property
    def changed(self) -> bool:
        return self.action in ("to_rmsnorm", "folded")


@dataclass
class ExactRewriteReport:
    """The report of one exact rewrite (`transform` is "to_rmsnorm" or "fold_norms")."""

    model: str
    transform: str
    norms: list[NormRewrite] = field(default_factory=list)
    changed_parameters: list[str] = field(default_factory=list)  # parameters rewritten in place (centred, folded)
    added_parameters: list[str] = field(default_factory=list)  # parameters the rewrite created (a bias to fold into)
    output_error: float | None = None  # max relative error of the model's output on the example input
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> list[NormRewrite]:
        return [n for n in self.norms if n.changed]

    @property
    def refused(self) -> list[NormRewrite]:
        return [n for n in self.norms if n.action == "refused"]

    def to_dict(self) -> dict:
        """Plain data; a NaN (an error that could not be measured) is None, as JSON has none."""
        d = dataclasses.asdict(self)
        d["output_error"] = _finite(d["output_error"])
        for n in d["norms"]:
            n["error"] = _finite(n["error"])
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        done = len(self.changed)
        out = [f"{self.transform} on {self.model}: {done}/{len(self.norms)} norms rewritten"]
        if self.output_error is not None:
            out.append(f"model output: max relative error {self.output_error:.2e} on the example input")
        if self.norms:
            rows = [[n.name, n.kind, n.action, "" if n.error is None else f"{n.error:.1e}", n.reason] for n in self.norms]
            out.append(_table(["norm", "class", "action", "error", "reason / detail"], rows))
        if self.changed_parameters:
            out.append(f"parameters rewritten in place: {len(self.changed_parameters)}")
        if self.added_parameters:
            out.append("parameters added: " + ", ".join(self.added_parameters))
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)


def _finite(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else v


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])
