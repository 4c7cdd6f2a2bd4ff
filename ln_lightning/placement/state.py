"""The rewrite state: one object, owned by the model a placement rewrite changed, that says what it computes.

    state = ln_lightning.placement.state.of(model)      # None: no rewrite touched `model`

Every rewrite (``convert``, ``LNPlacement``, ``load_converted``, ``ln_lightning.from_pretrained``) leaves one
:class:`RewriteState` on the module it rewrote, its *root* (in ``root.__dict__``, so it pickles and deep-copies
with the model; ``ddp_spawn`` workers get it). It holds everything the rewrite is:

* ``config``: what the model computes, exactly ``LNPlacement``'s / ``convert``'s keyword arguments that change
  the function (``placement``, ``final_norm``, ``branch_scale``, and ``layerscale_init`` / ``mix_post_blocks``
  when given): ``LNPlacement(PlacementSpec.from_config(config))`` rebuilds the same rewrite on a fresh model;
* ``converted``: the blocks it converted, each with whether it was read from its forward as written (a
  transition blends from there); ``added``: the modules and parameters it added; ``derived``: for an added
  module whose weights start as a copy of another one (a final norm: the norm that fed the head before), the
  path of that one, so a load of weights saved without the rewrite starts it from *those* trained weights;
* the **marker and load guard** (:meth:`RewriteState.mark`, done by ``LNPlacement``; ``convert`` leaves a model's
  state_dict as it was): a persistent ``uint8`` buffer ``ln_lightning_placement`` (the config as sorted JSON,
  UTF-8) on each module owning a rewritten stack (the parent of the blocks' container), and a
  ``load_state_dict`` pre-hook on those owners and every module between them and the root. Before any weight
  is copied, with ``strict=False`` and Lightning's ``strict_loading = False`` too, the guard refuses a
  state_dict whose marker holds another configuration, and one without the marker (saved without the rewrite)
  that holds weights for a rewritten module, unless the caller opted in (:func:`accept_unconverted`,
  ``LNPlacement(resume_unconverted=True)``): then the missing entries are filled in (the markers; the added
  modules from the ones they are derived from, else fresh; the transition where it stands) and a warning says
  what the model computes with those weights;
* the **transition** under way (``LNPlacement(transition_steps=N)``): the :class:`~ln_lightning.placement.migrate.blend.
  Transition` module at ``root.ln_lightning_transition`` (its blend, steps done and schedule are persistent
  buffers, so every state_dict says where it stood). A load makes the model compute what the state_dict was
  saved from: a state_dict saved mid-transition puts a model whose transition ended (or never ran) back into
  that blend; one saved from the rewritten model without a transition ends the model's transition. A
  transition ends in one place, :meth:`RewriteState.end_transition`.

:func:`attach` also runs the hooks the layers above registered (``ln_lightning._attach_hooks``): export's save guard gives every
Hugging Face model holding part of the rewrite an instance ``save_pretrained`` that writes a directory nothing loads as
the old function (``ln_lightning.export.save_guard``); :func:`detach` runs their undo.

Everything else about a rewrite is derived from this object, and written only here: the marker bytes, the
checkpoint entry (:meth:`RewriteState.checkpoint_entry`) and the JSON record that export writes and reads back
(:meth:`RewriteState.to_record`, :func:`from_record`, :meth:`RewriteState.relative_to`). The plugin, the
checkpoint readers, the monitors and export read it; nothing else stores a copy.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, Iterator

import torch
from torch import nn

from ln_lightning import _attach_hooks
from ln_lightning._warnings import warn
from ln_lightning.norm import FusedLayerNorm
from ln_lightning.placement.migrate import blend
from ln_lightning.placement.errors import PlacementError

log = logging.getLogger(__name__)

MARKER = "ln_lightning_placement"
FORMAT = 2  # of the record (to_record) and the checkpoint entry; 1: ln_lightning 0.1 (no "format" key)
_STATE_ATTR = "_ln_lightning_rewrite"  # root.__dict__: its RewriteState
_OWNER_ATTR = "_ln_lightning_rewrite_owner"  # an owner's __dict__: (state, the owner's path from the root)
_GUARDED_ATTR = "_ln_lightning_guarded_owners"  # a guarded module's __dict__: owner paths relative to it
_HOOK_FLAG = "_ln_lightning_load_hook"


def _fmt(config: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def _rel(path: str, base: str) -> str | None:
    """`path` (from the root) relative to `base` (from the root); None when it is not inside `base`."""
    if not base:
        return path
    if path == base:
        return ""
    return path[len(base) + 1:] if path.startswith(base + ".") else None


def _join(prefix: str, path: str) -> str:
    return f"{prefix}{path}." if path else prefix


def encode_config(config: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(config, sort_keys=True).encode()), dtype=torch.uint8)


def decode_config(tensor: Any) -> dict | None:
    """The config a marker holds; None when it is not a marker this library wrote."""
    if not isinstance(tensor, torch.Tensor):
        return None
    try:
        value = json.loads(bytes(tensor.detach().cpu().to(torch.uint8).tolist()).decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def owner_path(block_path: str) -> str:
    """'model.blocks.3' -> 'model' (the module holding the stack container 'model.blocks')."""
    return block_path.rpartition(".")[0].rpartition(".")[0]


class RewriteState:
    """What a placement rewrite made of a model (see the module docstring). Created by the engine's ``convert``."""

    def __init__(self, config: dict, *, converted=(), added=(), derived: dict | None = None, report: dict | None = None):
        self.config = dict(config)
        self.converted: list[tuple[str, bool]] = [(str(p), bool(w)) for p, w in converted]
        self.added: list[str] = list(added)
        self.derived: dict[str, str] = dict(derived or {})
        self.report = report  # ConversionReport.to_dict() of the rewrite, when known
        self.owners: list[str] = []  # the modules holding the marker; [] until mark()
        self.transition: blend.Transition | None = None  # while one is under way (also root.ln_lightning_transition)
        self.transition_ended = False  # a transition ran on this model and ended
        self.accepting: dict | None = None  # an opt-in to load weights saved without the rewrite (accept_unconverted)

    def __repr__(self) -> str:
        t = "" if self.transition is None else f", transition at {self.transition.host_steps}/{self.transition.steps}"
        return f"RewriteState({_fmt(self.config)}; {len(self.converted)} blocks, added {self.added}{t})"

    # ------------------------------------------------------------------ the marker and the load guard
    @property
    def marked(self) -> bool:
        return bool(self.owners)

    def mark(self, root: nn.Module, owners=None) -> None:
        """Put the marker on each owner of a rewritten stack (or on the root when the rewrite only added modules)
        and the load guard on those and every module above them up to the root. Idempotent."""
        if owners is None:
            owners = self.owner_paths()
        value = encode_config(self.config)
        for path in sorted(set(owners)):
            owner = root.get_submodule(path)
            device = _device_of(owner)
            # One tensor per owner: shared storage would make safetensors (Hugging Face's save_pretrained) refuse them.
            if MARKER in owner._buffers:
                owner._buffers[MARKER] = value.to(device, copy=True)
            else:
                owner.register_buffer(MARKER, value.to(device, copy=True), persistent=True)
            owner.__dict__[_OWNER_ATTR] = (self, path)
            # The guard sits on the owner and on every module above it: a load into any of them checks the
            # marker before torch copies a single weight (a load refused half-way would still change the model).
            parts = path.split(".") if path else []
            for i in range(len(parts) + 1):
                _guard(root.get_submodule(".".join(parts[:i])), ".".join(parts[i:]))
            if path not in self.owners:
                self.owners.append(path)
        self.owners.sort()

    def owner_paths(self) -> list[str]:
        """The modules :meth:`mark` puts the marker on: each owner of a rewritten stack, else the root."""
        return sorted({owner_path(p) for p, _ in self.converted} or ({""} if self.added else set()))

    def marker_entries(self, base: str = "") -> dict[str, torch.Tensor]:
        """The marker entries (key relative to the submodule at `base` -> value) of the model marked with this
        rewrite: what a model rebuilt from :meth:`relative_to`'s record holds, whether this one is marked or not."""
        value = encode_config(self.config)
        rels = (_rel(p, base) for p in (self.owners or self.owner_paths()))
        return {(f"{r}.{MARKER}" if r else MARKER): value.clone() for r in rels if r is not None}

    # ------------------------------------------------------------------ the transition
    def start_transition(self, root: nn.Module, steps: int | None, kind: str = "linear") -> blend.Transition:
        """Switch the rewritten model into the blend at a = 0: the function it had before the rewrite."""
        self.transition = blend.start(root, self.converted, self.added, steps=steps, kind=kind)
        self.transition_ended = False
        return self.transition

    def end_transition(self, root: nn.Module) -> None:
        """End the transition: from here on the model is exactly its rewrite. The one place a transition ends."""
        blend.finish(root)
        self.transition = None
        self.transition_ended = True

    def progress(self) -> tuple[int, int | None, float] | None:
        """(optimizer steps done, steps, blend) of the transition under way, from host values; None without one."""
        t = self.transition
        if t is None:
            return None
        return t.host_steps, t.steps, t.held

    def advance(self, root: nn.Module, *, check: bool = False) -> float | None:
        """One optimizer step of the transition: the blend for the next one, ending the transition at its last
        step. Host arithmetic and device writes only (no synchronisation).

        A closed loop's blend is the device's (`Transition.gate` moved it): it is read only when `check` is asked
        for (the caller's logging steps) and at the end of the budget, and the transition ends when that read finds
        it at 1. Returns the blend when known on the host, else None."""
        t = self.transition
        if t is None or not t.steps:
            raise PlacementError("advance: no scheduled transition is under way")
        done = t.host_steps + 1
        if t.closed:
            t.set_progress(done)
            if not (check or done >= t.steps):
                return None
            a = float(t.blend)  # the one read, on a logging step or at the budget's end
            if a >= 1.0:
                self.end_transition(root)
                return 1.0
            return a
        if done >= t.steps:
            self.end_transition(root)
            return 1.0
        a = blend.schedule(done / t.steps, t.kind)
        t.set_progress(done, a)
        return a

    def settle(self, root: nn.Module) -> bool:
        """At the end of a fit: a closed loop whose blend reached 1 between the reads of `advance` ends now (one
        read of the blend). Whether the transition ended."""
        t = self.transition
        if t is None or not t.closed or float(t.blend) < 1.0:
            return False
        self.end_transition(root)
        return True

    # ------------------------------------------------------------------ derived representations
    def to_record(self) -> dict:
        """The state as JSON-able data (export writes it into config.json; :func:`from_record` reads it)."""
        t = self.transition
        return {
            "format": FORMAT,
            "config": dict(self.config),
            "converted": [[p, w] for p, w in self.converted],
            "added": list(self.added),
            "derived": dict(self.derived),
            "transition": None if t is None else {"steps": t.steps, "schedule": t.kind, "steps_done": t.host_steps,
                                                  "blend": float(t.blend)},
            "transition_ended": self.transition_ended,
        }

    def relative_to(self, base: str, *, with_transition: bool = False) -> dict:
        """The record with every path relative to the submodule at `base` (its path from the root); raises
        PlacementError when part of the rewrite lies outside it (that submodule alone does not carry it).

        A transition's blend is held by the root, so a submodule's state_dict lacks it: refused, unless the caller
        carries the blend along itself (`with_transition`: export writes the root's transition buffers with the
        submodule's weights)."""
        record = self.to_record()
        if not base:
            return record
        outside = [p for p, _ in self.converted if _rel(p, base) is None] + [a for a in self.added if _rel(a, base) is None]
        if outside or (self.transition is not None and not with_transition):
            what = (f"{', '.join(outside[:3])} lie outside {base}" if outside else
                    "the transition's blend is held by the root, outside it")
            raise PlacementError(
                f"{base} does not hold the whole placement rewrite: {what}. Export the module the rewrite was applied to "
                "(the one passed to convert, or the LightningModule), or rewrite the submodule itself"
            )
        record["converted"] = [[_rel(p, base), w] for p, w in self.converted]
        record["added"] = [_rel(a, base) for a in self.added]
        record["derived"] = {_rel(a, base): _rel(s, base) for a, s in self.derived.items() if _rel(s, base) is not None}
        return record

    def checkpoint_entry(self, root: nn.Module, *, report: Any = None) -> dict:
        """What ``LNPlacement`` writes under ``checkpoint["ln_lightning"]`` (format: ``ln_lightning.checkpoint``)."""
        return {
            "format": FORMAT,
            "config": dict(self.config),
            "fused": any(isinstance(m, FusedLayerNorm) for m in root.modules()),  # what it runs, not what was asked
            "report": report.to_dict() if report is not None else self.report,
            "model_class": qualified_name(type(root)),
            "record": self.to_record(),
        }


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def from_record(record: dict) -> RewriteState:
    """A RewriteState from :meth:`RewriteState.to_record`'s data (without its transition: that is the model's)."""
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise PlacementError(f"not a placement rewrite record: {record!r:.200}")
    if int(record.get("format", 1)) > FORMAT:
        raise PlacementError(
            f"the rewrite record has format {record['format']}, newer than this ln_lightning reads ({FORMAT}); upgrade ln_lightning"
        )
    state = RewriteState(record["config"], converted=[tuple(c) for c in record.get("converted", [])],
                         added=record.get("added", []), derived=record.get("derived", {}))
    state.transition_ended = bool(record.get("transition_ended", False))
    return state


# ---------------------------------------------------------------------------------------------- finding it
def of(model: nn.Module) -> RewriteState | None:
    """The state of the rewrite applied to `model` itself (its root), or None."""
    state = model.__dict__.get(_STATE_ATTR)
    return state if isinstance(state, RewriteState) else None


def find(module: nn.Module) -> tuple[RewriteState, str] | None:
    """The rewrite `module` takes part in and `module`'s path from that rewrite's root: `module` is the root
    (path ""), or a module between the root and a marked owner (a LightningModule's Hugging Face model when
    LNPlacement rewrote the LightningModule). None when there is none."""
    state = of(module)
    if state is not None:
        return state, ""
    for name, m in module.named_modules():
        ref = m.__dict__.get(_OWNER_ATTR)
        if ref is None:
            continue
        state, path = ref
        base = path[: len(path) - len(name)].rstrip(".") if name else path
        if name and not (path == name or path.endswith("." + name)):
            continue
        return state, base
    return None


def attach(root: nn.Module, state: RewriteState) -> RewriteState:
    """Make `state` the record of `root`'s rewrite (replacing one there)."""
    previous = of(root)
    if previous is not None:
        state.owners, state.transition, state.transition_ended = previous.owners, previous.transition, previous.transition_ended
        for path in state.owners:
            owner = root.get_submodule(path)
            owner.__dict__[_OWNER_ATTR] = (state, path)
        if state.owners:
            state.mark(root, state.owners)  # the markers say the new configuration
    root.__dict__[_STATE_ATTR] = state
    for install in _attach_hooks.installs():  # export's save guard (registered by the package root)
        install(root, state)
    return state


def detach(root: nn.Module) -> None:
    """Forget the rewrite of `root` (it computes its forward as written again): the state, markers and guards."""
    state = of(root)
    root.__dict__.pop(_STATE_ATTR, None)
    for uninstall in _attach_hooks.uninstalls():
        uninstall(root)
    if state is None:
        return
    for path in state.owners:
        try:
            owner = root.get_submodule(path)
        except AttributeError:
            continue
        owner._buffers.pop(MARKER, None)
        owner.__dict__.pop(_OWNER_ATTR, None)
    for m in root.modules():
        m.__dict__.pop(_GUARDED_ATTR, None)  # the hook stays registered but guards nothing


def _device_of(module: nn.Module) -> torch.device:
    for t in (*module.buffers(), *module.parameters()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _guard(module: nn.Module, relative_owner: str) -> None:
    module.__dict__.setdefault(_GUARDED_ATTR, set()).add(relative_owner)
    if not module.__dict__.get(_HOOK_FLAG, False):
        module.register_load_state_dict_pre_hook(_on_load)
        module.__dict__[_HOOK_FLAG] = True


# ---------------------------------------------------------------------------------------------- the load guard
def _state_and_base(module: nn.Module) -> tuple[RewriteState, str] | None:
    """The state a guarded module belongs to and the module's path from the root."""
    state = of(module)
    if state is not None:
        return state, ""
    for rel in sorted(module.__dict__.get(_GUARDED_ATTR, ())):
        try:
            owner = module.get_submodule(rel) if rel else module
        except AttributeError:
            continue
        ref = owner.__dict__.get(_OWNER_ATTR)
        if ref is not None:
            state, path = ref
            return state, (path[: len(path) - len(rel)].rstrip(".") if rel else path)
    return None


def _on_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: make the model compute what the state_dict was saved from, or refuse it.

    It raises (rather than adding to `error_msgs`, after which torch would go on copying the other weights),
    and it does so whatever `strict` is. The first guarded module of a load (the one `load_state_dict` was
    called on, or the outermost guarded one below it) does the work for everything below it.
    """
    found = _state_and_base(module)
    if found is None:
        return
    state, base = found
    owners = [(p, _rel(p, base)) for p in state.owners if _rel(p, base) is not None]
    mine = encode_config(state.config)
    unmarked = []
    for path, rel in owners:
        key = _join(prefix, rel) + MARKER
        if key in state_dict:
            theirs = decode_config(state_dict[key])
            if theirs != state.config:
                stream = [c.get("branch_scale") == "stream" for c in (theirs or {}, state.config)]
                hint = ""
                if stream == [False, True]:  # written before the stream-scaled default, or with it turned off
                    hint = (" LNPlacement(..., transition=N) scales the stream by default (branch_scale='stream'); "
                            "to go on with a model written without it, pass transition=TransitionSpec(..., stream_scale=False).")
                elif stream == [True, False]:  # migrated by the default transition, loaded by a plain LNPlacement
                    hint = (" That model was migrated with the stream-scaled transition: pass branch_scale='stream' (its "
                            "measured constants load with the weights).")
                raise RuntimeError(
                    f"ln_lightning: the state_dict was saved from a model rewritten to {theirs}, but this model is rewritten "
                    f"to {state.config}. Use the same LNPlacement options as the run that wrote it (they are stored in "
                    "checkpoint['ln_lightning']['config']), or ln_lightning.load_converted(...)." + hint
                )
        elif any(k.startswith(_join(prefix, rel)) for k in state_dict):  # it holds weights for this owner
            unmarked.append((path, rel, key))
    if unmarked:
        if state.accepting is None:
            where = unmarked[0][0] or "<root>"
            raise RuntimeError(
                f"ln_lightning: the state_dict was written without the placement rewrite (no '{unmarked[0][2]}' entry), but this model ({where}) is rewritten to {state.config}, so its weights would compute "
                "another function than the one they were trained for. Load them into the unconverted model first and let "
                "LNPlacement rewrite it (fit without ckpt_path), or, to load them into this rewritten model on purpose, opt in: "
                "`with ln_lightning.accept_unconverted(model): model.load_state_dict(...)`, or "
                "LNPlacement(..., resume_unconverted=True) for a Trainer's ckpt_path."
            )
        _fill_unconverted(module, state, base, state_dict, prefix, [k for _, _, k in unmarked], mine)
    if base == "":
        _reconcile_transition(module, state, state_dict, prefix)


def _fill_unconverted(module, state: RewriteState, base: str, state_dict, prefix: str, marker_keys: list[str],
                      marker: torch.Tensor) -> None:
    """An accepted load of weights saved without the rewrite: fill in what the rewrite has and they lack."""
    own = None
    for key in marker_keys:
        state_dict[key] = marker.clone()
    derived, fresh = [], []
    for path in state.added:
        rel = _rel(path, base)
        if rel is None:
            continue
        own = module.state_dict() if own is None else own
        src = _rel(state.derived.get(path, ""), base) if path in state.derived else None
        for key in [k for k in own if k == rel or k.startswith(rel + ".")]:
            if prefix + key in state_dict:
                continue
            suffix = key[len(rel):]
            src_key = prefix + src + suffix if src is not None else None
            if src_key is not None and src_key in state_dict:
                state_dict[prefix + key] = state_dict[src_key].detach().clone()  # the trained weights it derives from
                derived.append(f"{prefix + key} <- {src_key}")
            else:
                state_dict[prefix + key] = own[key].detach().cpu().clone()
                fresh.append(prefix + key)
    in_transition = state.transition is not None and base == ""
    if in_transition:
        own = module.state_dict() if own is None else own
        for key in [k for k in own if k.startswith(blend.ATTR + ".")]:
            state_dict.setdefault(prefix + key, own[key].detach().cpu().clone())
    accepting = state.accepting
    # Every entry filled in for an added module: their optimizer states (if any are loaded) are fresh too.
    accepting["added"] = sorted(set(accepting.get("added", [])) | set(fresh) | {d.partition(" <- ")[0] for d in derived})
    if accepting.get("warned"):
        return
    accepting["warned"] = True
    placement = state.config.get("placement")
    t = state.transition
    msg = (
        f"{accepting.get('who', 'accept_unconverted')}: the state_dict was written without the placement rewrite; its weights "
        f"are loaded into the model rewritten to ({_fmt(state.config)}), which computes "
        + ((f"exactly the function they were trained for and moves to {placement}-norm as fast as its drift from "
            f"that function allows, within a budget of {t.steps} optimizer steps (the closed loop)." if t.closed else
            f"exactly the function they were trained for and moves to {placement}-norm over the next "
            f"{t.steps} optimizer steps (the open loop).") if in_transition and t.host_steps == 0 else
           f"{placement}-norm with them, not the function they were trained for.")
        + (f" Added modules start from the trained weights they derive from ({'; '.join(derived)})." if derived else "")
        + (f" Parameters the rewrite added keep their fresh values ({', '.join(fresh)})." if fresh else "")
        + (" Added parameters start with fresh optimizer state; the existing ones keep theirs." if fresh or derived else "")
    )
    if accepting.get("emit") == "log":  # an explicit accept_unconverted block: the caller asked for it, a log line
        log.warning(msg)
    else:
        warn(msg)


def _reconcile_transition(root: nn.Module, state: RewriteState, state_dict, prefix: str) -> None:
    """At the root: make the model's transition what the state_dict says (saved mid-transition or not)."""
    mine = prefix + blend.ATTR + "."
    incoming = [k for k in state_dict if k.startswith(mine)]
    t = blend.active(root)
    if incoming and t is None:
        sched = state_dict.get(mine + "schedule")
        steps, kind = (int(v) for v in sched.tolist()) if sched is not None else (-1, 0)
        b = state_dict.get(mine + "blend")
        state.start_transition(root, steps if steps > 0 else None, blend.SCHEDULES[kind])
        log.info("ln_lightning: the state_dict was saved during a placement transition (blend %.4g); the model computes "
                 "that blend again.", float(b) if b is not None else float("nan"))
    elif not incoming and t is not None and state.marked:
        # Saved from the rewritten model after (or without) a transition: the model computes its rewrite as well.
        state.end_transition(root)


@contextlib.contextmanager
def accept_unconverted(model: nn.Module) -> Iterator[nn.Module]:
    """Let `model` (rewritten) load state_dicts saved without the rewrite, inside this block only.

    Missing entries are filled in: the markers, the modules the rewrite added (from the trained weights they
    derive from, a final norm from the norm that fed the head, else their fresh values), the transition where it
    stands. The first such load in the block warns what the model then computes. A state_dict written for
    *another* rewrite is still refused.

        with accept_unconverted(model):
            model.load_state_dict(post_norm_state_dict)
    """
    found = find(model)
    if found is None:
        yield model
        return
    state = found[0]
    previous, state.accepting = state.accepting, {"warned": False, "who": "accept_unconverted", "emit": "log"}
    try:
        yield model
    finally:
        state.accepting = previous


__all__ = ["MARKER", "FORMAT", "RewriteState", "of", "find", "attach", "detach", "from_record", "accept_unconverted",
           "owner_path", "encode_config", "decode_config", "qualified_name"]
