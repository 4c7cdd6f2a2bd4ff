"""What `inspect_model` finds and what `convert` changed, as plain data.

Both reports print as readable tables (`str(report)`) and serialise to JSON (`report.to_dict()`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SublayerInfo:
    """One residual sublayer `x <- ... x + F(x) ...` of a block."""

    name: str  # "attn", "mlp", "self_attn", "cross_attn", "ff", or "sublayer0" ... for traced blocks
    placement: str  # "post" | "pre" | "sandwich" | "none"
    norm: str | None  # module path of the LayerNorm that decides the placement (None for "none")
    branch: str  # what F is: the module paths it calls, for the reader
    parallel: bool = False  # several branches summed into the stream at once (x + A(N1 x) + M(N2 x))
    stream: str | None = None  # in a block carrying several streams (LiLT's text and layout): which


@dataclass
class BlockInfo:
    path: str
    kind: str  # class name of the block
    recogniser: str  # which recogniser understood it ("torch.TransformerEncoderLayer", "traced", "registered", ...)
    sublayers: list[SublayerInfo]

    @property
    def placement(self) -> str:
        kinds = {s.placement for s in self.sublayers}
        return kinds.pop() if len(kinds) == 1 else "mixed"


@dataclass
class StackInfo:
    """A container (ModuleList / Sequential) of residual blocks."""

    path: str
    blocks: list[BlockInfo]
    final_norm: str | None  # module path of the norm applied after the last block, if any
    final_norm_known: bool = True  # False when the model's own code could not be read to tell

    @property
    def depth(self) -> int:
        return len(self.blocks)


@dataclass
class NormInfo:
    path: str
    kind: str
    shape: tuple[int, ...]
    eps: float
    affine: bool
    bias: bool


@dataclass
class SkippedModule:
    path: str
    kind: str
    reason: str


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


def _pct(v: float) -> str:
    # Small but real changes must not print as "0.0%" next to "CHANGES the function".
    return f"{v:.1%}" if v >= 1e-3 else f"{v * 100:.2g}%"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


@dataclass
class PlacementReport:
    """Everything `inspect_model` found: stacks of blocks, their norms' placement, every LayerNorm."""

    model: str
    stacks: list[StackInfo] = field(default_factory=list)
    layernorms: list[NormInfo] = field(default_factory=list)
    # Modules that look like residual blocks (they hold a LayerNorm) but could not be read, with why.
    unrecognised: list[SkippedModule] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the model was read (a fallback taken, ...)

    @property
    def blocks(self) -> list[BlockInfo]:
        return [b for s in self.stacks for b in s.blocks]

    def block_paths(self) -> list[str]:
        return [b.path for b in self.blocks]

    def to_dict(self) -> dict:
        d = _jsonable(self)
        for s, sd in zip(self.stacks, d["stacks"]):
            sd["depth"] = s.depth
            for b, bd in zip(s.blocks, sd["blocks"]):
                bd["placement"] = b.placement
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        out = [f"Placement report for {self.model}"]
        if not self.stacks:
            out.append("  no residual block stacks recognised")
        for s in self.stacks:
            fn = s.final_norm if s.final_norm else ("none" if s.final_norm_known else "unknown (model code not readable)")
            out.append(f"\nstack {s.path or '<root>'}: {s.depth} blocks, final norm: {fn}")
            rows = [
                [b.path, b.kind, b.placement, ", ".join(
                    f"{x.name}:{x.placement}" + (" parallel" if x.parallel else "")
                    + (f"({x.norm})" if x.norm else "") for x in b.sublayers)]
                for b in s.blocks
            ]
            out.append(_table(["block", "class", "placement", "sublayers (norm)"], rows))
        if self.unrecognised:
            out.append("\nnot recognised:")
            out.append(_table(["module", "class", "reason"], [[u.path, u.kind, u.reason] for u in self.unrecognised]))
        out.extend(f"note: {n}" for n in self.notes)
        out.append(f"\nLayerNorms ({len(self.layernorms)}):")
        if self.layernorms:
            out.append(
                _table(
                    ["path", "class", "shape", "eps", "affine", "bias"],
                    [[n.path, n.kind, tuple(n.shape), f"{n.eps:g}", n.affine, n.bias] for n in self.layernorms],
                )
            )
        return "\n".join(out)


@dataclass
class BlockChange:
    path: str
    kind: str
    status: str  # "converted" | "already" | "skipped"
    before: str  # placement before
    after: str  # placement after
    reason: str = ""  # why skipped, or what was done
    check_error: float | None = None  # max relative error of the probe check against the target formula
    output_change: float | None = None  # relative L2 change of the block's output on the probe input
    from_written: bool = True  # converted from the placement its forward is written in (not from a rewrite of ours)
    # Relative error against the block's original modules run as black boxes (placement/checking/black_box.py);
    # None where the check above is already independent of the recording (torch's layers).
    reference_error: float | None = None
    # Converted, but not as asked: what it got instead and why ("converted without branch_scale='stream' (...): cannot
    # scale sublayer attn: the branch ends in `mul`, not a module call"); "" when it got what was asked.
    fallback: str = ""


@dataclass
class ConversionReport:
    """What `convert` did, block by block, and whether the model still computes the same function."""

    model: str
    placement: str
    options: dict
    blocks: list[BlockChange] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # paths of modules / parameters that convert added
    removed: list[str] = field(default_factory=list)  # paths convert removed (e.g. a final norm it had added)
    # An added module whose weights start as a copy of another one (a final norm: the norm that fed the head) ->
    # that module's path.
    derived: dict[str, str] = field(default_factory=dict)
    # Relative change of the output on the probe input: ||y_after - y_before|| / ||y_before||.
    # Per block always; for the whole model when an example input was available.
    output_change: float | None = None
    output_change_scope: str = "none"  # "model" (example input) | "blocks" (max over blocks) | "none"
    preserves_function: bool = True
    notes: list[str] = field(default_factory=list)
    # Stacks whose blocks were converted but which are left without the final norm the placement needs (it could
    # not be determined, or not placed): stack path -> why. Such a model is not fully converted (`complete`).
    incomplete: dict[str, str] = field(default_factory=dict)

    @property
    def converted(self) -> list[BlockChange]:
        return [b for b in self.blocks if b.status == "converted"]

    @property
    def skipped(self) -> list[BlockChange]:
        return [b for b in self.blocks if b.status == "skipped"]

    @property
    def fallbacks(self) -> list[BlockChange]:
        """Blocks converted, but not as asked (without the branch scale): `BlockChange.fallback` says how and why."""
        return [b for b in self.blocks if b.fallback]

    @property
    def changed(self) -> bool:
        return bool(self.converted or self.added or self.removed)

    @property
    def complete(self) -> bool:
        """False when a converted stack was left without the final norm its placement needs (see `incomplete`)."""
        return not self.incomplete

    def to_dict(self) -> dict:
        d = _jsonable(self)
        d["changed"] = self.changed
        d["complete"] = self.complete
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def summary(self) -> str:
        n = len(self.blocks)
        parts = [
            f"{len(self.converted)}/{n} blocks converted to {self.placement}-norm",
            f"{sum(b.status == 'already' for b in self.blocks)} already {self.placement}",
            f"{len(self.skipped)} skipped",
        ]
        if self.fallbacks:
            parts.insert(1, f"{len(self.fallbacks)} of them without the branch scale (see fallback)")
        if self.added:
            parts.append(f"added {len(self.added)} module(s)")
        if self.incomplete:
            parts.append(f"NOT fully converted: {len(self.incomplete)} stack(s) without a final norm")
        return ", ".join(parts)

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        out = [f"Conversion of {self.model} to {self.placement}-norm ({opts})", self.summary()]
        if self.blocks:
            rows = [
                [b.path, b.status, f"{b.before} -> {b.after}", "" if b.check_error is None else f"{b.check_error:.1e}",
                 "" if b.output_change is None else _pct(b.output_change), b.reason]
                for b in self.blocks
            ]
            out.append(_table(["block", "status", "placement", "check err", "output change", "note"], rows))
        for a in self.added:
            out.append(f"added: {a}")
        for r in self.removed:
            out.append(f"removed: {r}")
        for path, why in self.incomplete.items():
            out.append(f"NOT fully converted: stack {path or '<root>'} is {self.placement}-norm without a final norm: {why}")
        if not self.changed and self.skipped:
            out.append(f"Nothing changed: {len(self.skipped)} block(s) could not be converted (reasons above); the model is as it was.")
        elif not self.changed:
            out.append("Nothing changed: the model already has the requested placement.")
        elif self.preserves_function:
            out.append("The model computes the same function as before.")
        else:
            scope = {"model": "the model's output", "blocks": "a block's output (largest over blocks)"}.get(
                self.output_change_scope, "the output"
            )
            change = "" if self.output_change is None else f": {scope} changed by {_pct(self.output_change)} (relative L2) on the probe input"
            out.append(
                f"WARNING: this conversion CHANGES the function the model computes{change}. "
                "Trained weights will not give the same predictions: fine-tune or retrain after converting."
            )
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)
