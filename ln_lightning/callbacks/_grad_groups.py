"""Gradients grouped for the clip and spike monitors: which group each parameter belongs to, and how
each gradient's squared norm crosses ranks (sharded: summed; replicated: taken once)."""

from __future__ import annotations

import operator
import re
import weakref
from typing import Callable, Mapping

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from ln_lightning._warnings import warn
from ln_lightning.callbacks._common import discover_blocks, normalize_name
from ln_lightning.callbacks._reduce import distributed_world

try:  # public since torch 2.5
    from torch.distributed.tensor import DTensor, Partial, Replicate
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor, Replicate
    from torch.distributed._tensor.placement_types import _Partial as Partial

GroupSpec = Mapping[str, str] | Callable[[str], "str | None"] | None
OTHER = "other"
# How a gradient's squared norm crosses ranks: summed (sharded: each rank holds a part), or taken once
# (replicated: every rank holds the same whole gradient, so MAX of identical values).
SHARDED, REPLICATED = 0, 1


def default_group_fn(pl_module: nn.Module, block_paths: list[str]) -> Callable[[str], str]:
    """One group per residual block; every other parameter goes to the top-level module holding it.

    "Top level" is relative to the blocks' containers: with blocks `model.blocks.0 ...`, the
    embedding `model.tok_emb.weight` is in group `model.tok_emb` and the head in `model.head`.
    Without blocks, parameters are grouped by the shallowest module level that splits them.
    """
    blocks = sorted(block_paths, key=len, reverse=True)  # longest first: nested paths resolve innermost
    ancestors = {""}
    for b in block_paths:
        parts = b.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    depth = 1
    if not block_paths:
        names = [normalize_name(n, pl_module) for n, _ in pl_module.named_parameters()]
        # Descend while a single module holds every parameter (CharLM -> model -> ...).
        while depth < 4 and len({".".join(n.split(".")[:depth]) for n in names}) == 1 and all(n.count(".") >= depth for n in names):
            depth += 1

    def group(name: str) -> str:
        for b in blocks:
            if name.startswith(b + "."):
                return b
        if not block_paths:
            return ".".join(name.split(".")[:depth])
        best = max((a for a in ancestors if a == "" or name.startswith(a + ".")), key=len)
        rest = name[len(best) + 1 :] if best else name
        head = rest.split(".")[0]
        return f"{best}.{head}" if best else head

    return group


class RegexGroups:
    """`{group: regex}` as a `param_name -> group` function (first match wins); a class, so that the monitor
    pickles (ddp_spawn sends callbacks to the workers)."""

    def __init__(self, mapping: Mapping[str, str]):
        self._compiled = []
        for group, pattern in mapping.items():
            try:
                self._compiled.append((group, re.compile(pattern)))
            except re.error as err:
                raise ValueError(f"ClipAttributionMonitor: group {group!r} has an invalid regex {pattern!r}: {err}") from None

    def __call__(self, name: str) -> str | None:
        return next((g for g, rx in self._compiled if rx.search(name)), None)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without a host sync (a pageable blocking copy would wait for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# The last per-gradient squared norms computed, shared by the monitors that read the same step's gradients
# (ClipAttributionMonitor and SpikeMonitor both need them at every step: one `_foreach_norm`, not two). Kept as
# weak references and version counters: a hit needs the very same gradient tensors, unchanged since.
_last_norms: tuple[torch.device, list, list[int], torch.Tensor] | None = None


def grad_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared 2-norm of each gradient in `grads`, a float64 tensor on `device` (no host synchronisation).

    Computed once per set of gradients: a second monitor asking for the same tensors, not modified in place
    since (same ``_version``), gets the first one's result.
    """
    global _last_norms
    last = _last_norms
    if last is not None and last[0] == device and len(last[1]) == len(grads) and all(
        r() is g and v == g._version for r, v, g in zip(last[1], last[2], grads)
    ):
        return last[3]
    with torch.no_grad():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        sq = torch.stack([n.to(device) for n in norms]).double().square()
    _last_norms = (device, [weakref.ref(g) for g in grads], [g._version for g in grads], sq)
    return sq


def forget_grad_sq() -> None:
    """Drop the shared norms (a fit ended)."""
    global _last_norms
    _last_norms = None


class Plan:
    """Per optimizer: parameter order, group of each parameter, and how its squared norm crosses ranks."""

    def __init__(self, params: list[nn.Parameter], groups: list[str], group_of: list[int]):
        self.params = params
        self.groups = groups
        self.group_of = group_of
        self.meta: list[tuple[int, float] | None] = [None] * len(params)  # (SHARDED/REPLICATED, weight) once a grad is seen
        self.cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.partial_warned = False


class GradGroups:
    """The parameter groups of a monitor (`groups` as `ClipAttributionMonitor` takes it), per optimizer a `Plan`,
    and each gradient's local part with its cross-rank rule. `owner` names the monitor in messages."""

    def __init__(self, groups: GroupSpec, owner: str):
        self.owner = owner
        if groups is None or callable(groups):
            self.user_fn = groups
        elif isinstance(groups, Mapping):
            if not groups:
                raise ValueError(f"{owner}: groups mapping is empty; pass None for the default groups")
            self.user_fn = RegexGroups(groups)
        else:
            raise TypeError(f"groups must be None, a mapping name->regex or a function name->group, got {type(groups).__name__}")
        self._group_fn: Callable[[str], str | None] | None = None
        self._plans: dict[int, Plan] = {}
        self._plain_grads_sharded = False
        self._plain_weight = 1.0

    def prepare(self, pl_module: LightningModule) -> None:
        """At setup: the group function (the default one needs the model's blocks)."""
        if self.user_fn is None:
            blocks, _ = discover_blocks(pl_module)
            self._group_fn = default_group_fn(pl_module, blocks)
        else:
            self._group_fn = self.user_fn

    def stop(self) -> None:
        forget_grad_sq()
        self._plans.clear()
        self._plain_grads_sharded, self._plain_weight = False, 1.0

    def start(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        """At fit start, the model wrapped: how plain gradients cross ranks. False when the strategy hides them."""
        strategy = type(trainer.strategy).__name__
        if "DeepSpeed" in strategy:
            warn(
                f"{self.owner} does not support DeepSpeed: its gradients live in DeepSpeed's partitioned "
                "buffers, not in param.grad. The monitor is disabled for this run."
            )
            return False
        # FSDP1 (Lightning's FSDPStrategy, use_orig_params=True): param.grad holds this rank's shard as a plain
        # tensor, so squared norms are summed over the shard group, once per replica group.
        self._plain_grads_sharded = strategy == "FSDPStrategy" or any(
            type(m).__name__ == "FullyShardedDataParallel" for m in (trainer.strategy.model or pl_module).modules()
        )
        if self._plain_grads_sharded:
            world = distributed_world()
            pg = getattr(trainer.strategy.model, "process_group", None)
            shard = torch.distributed.get_world_size(pg) if pg is not None and world > 1 else world
            self._plain_weight = shard / world
        return True

    def plan_for(self, pl_module: LightningModule, optimizer) -> Plan:
        plan = self._plans.get(id(optimizer))
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if plan is not None and len(plan.params) == len(params) and all(map(operator.is_, plan.params, params)):
            return plan
        names_by_id = {id(p): normalize_name(n, pl_module) for n, p in pl_module.named_parameters(remove_duplicate=False)}
        group_names, group_of = [], []
        index: dict[str, int] = {}
        for i, p in enumerate(params):
            name = names_by_id.get(id(p), f"<unnamed param {i}>")
            g = self._group_fn(name) if id(p) in names_by_id else None
            g = OTHER if g is None else str(g)
            if g not in index:
                index[g] = len(group_names)
                group_names.append(g)
            group_of.append(index[g])
        plan = Plan(params, group_names, group_of)
        self._plans[id(optimizer)] = plan
        return plan

    def grad_meta(self, plan: Plan, i: int, grad: torch.Tensor) -> tuple[int, float]:
        """(SHARDED or REPLICATED, weight): how this gradient's squared norm crosses ranks, and its weight there."""
        meta = plan.meta[i]
        if meta is None:
            world = distributed_world()
            if isinstance(grad, DTensor):
                mesh = grad.device_mesh
                copies = world // max(1, mesh.size())  # identical copies of the mesh (replicas outside it)
                for dim, placement in enumerate(grad.placements):
                    if isinstance(placement, Replicate):
                        copies *= mesh.size(dim)
                meta = (SHARDED, 1.0 / copies)
            elif self._plain_grads_sharded:
                meta = (SHARDED, self._plain_weight)
            else:
                meta = (REPLICATED, 1.0)  # DDP / single device: every rank holds the whole, identical gradient
            plan.meta[i] = meta
        return meta

    def local_grads(self, plan: Plan) -> tuple[list[torch.Tensor], tuple[bool, ...], list[int]]:
        grads, mask, present = [], [], []
        for i, p in enumerate(plan.params):
            g = p.grad
            if g is None or g.is_sparse:
                mask.append(False)
                continue
            if isinstance(g, DTensor):
                if any(isinstance(pl, Partial) for pl in g.placements):
                    # Partial sums can't be squared locally; make them whole first (rare: not FSDP2/TP's output).
                    if not plan.partial_warned:
                        plan.partial_warned = True
                        warn(f"{self.owner}: a gradient has Partial placement; redistributing it costs a collective.")
                    g = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
                self.grad_meta(plan, i, g)
                g = g.to_local()
            else:
                self.grad_meta(plan, i, g)
            mask.append(True)
            present.append(i)
            grads.append(g)
        return grads, tuple(mask), present

    def index_tensors(self, plan: Plan, mask: tuple, present: list[int], device: torch.device, grads: list[torch.Tensor]):
        key = mask
        cached = plan.cache.get(key)
        if cached is None:
            n_groups = len(plan.groups)
            slots = [plan.group_of[i] + n_groups * plan.meta[i][0] for i in present]  # into (2, n_groups) scratch rows
            weights = [plan.meta[i][1] for i in present]
            numels = [g.numel() * plan.meta[i][1] for g, i in zip(grads, present)]
            groups = [plan.group_of[i] for i in present]
            cached = (
                to_device(slots, torch.long, device),
                to_device(weights, torch.float64, device),
                to_device(numels, torch.float64, device),
                to_device(groups, torch.long, device),
            )
            plan.cache[key] = cached
        return cached

    def group_sq(self, plan: Plan, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor], tuple, list[int]]:
        """This rank's squared gradient norms of `plan`'s groups on `device`, as a float64 (2, n_groups) tensor:
        row SHARDED (to be summed across ranks) and row REPLICATED (the same on every rank); with the local
        gradients, their mask and the indices present (for further statistics). No host synchronisation."""
        grads, mask, present = self.local_grads(plan)
        sq = torch.zeros(2, len(plan.groups), dtype=torch.float64, device=device)
        if grads:
            slots, weights, _, _ = self.index_tensors(plan, mask, present, device, grads)
            sq.view(-1).index_add_(0, slots, grad_sq(grads, device) * weights)
        return sq, grads, mask, present
