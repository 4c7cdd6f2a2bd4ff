"""Shared pieces of the monitor tests: a deterministic LightningModule, independent references, and
a script entry point for the multi-process runs.

Deterministic setup: the data is a fixed tensor `X[rank, micro_batch]`, the optimizer is SGD with
lr 0, so every optimizer step sees the same weights and the same batches and every logging step
logs the same values. References are computed without the monitors: the model's forward written
out by hand (in float64, or under the same autocast), and gradients from a plain backward on all
ranks' micro-batches concatenated (`clip_grad_norm_` for the total).

Script use (multi-process runs need a real script: Lightning's launchers re-run or spawn it):
    python -m ln_lightning.testing.monitors ddp OUTDIR    # ddp_spawn fp32, then ddp_spawn bf16 + accumulation
    python -m ln_lightning.testing.monitors fsdp2 OUTDIR  # ModelParallelStrategy + fully_shard, 2 CPU processes
"""

from __future__ import annotations

import copy
import glob
import json
import math
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor, _reduce
from ln_lightning.demo.models import PostNormTransformerLM
from ln_lightning.testing.dist import DestroyProcessGroupAtExit

VOCAB, D, LAYERS, HEADS, T = 16, 16, 3, 2, 8
BLOCKS = [f"model.blocks.{i}" for i in range(LAYERS)]
NORMS = [f"model.blocks.{i}.ln{j}" for i in range(LAYERS) for j in (1, 2)]
# Default clip groups: one per block, plus the other top-level modules beside the block stack.
GROUPS = ["model.tok_emb", "model.pos_emb", *BLOCKS, "model.head"]
MONITOR_PREFIXES = ("stream/", "ln/", "clip/")


def make_data(world: int, accum: int, batch: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (world, accum, batch, T), generator=g)
    y = torch.randint(0, VOCAB, (world, accum, batch, T), generator=g)
    return x, y


def make_model(seed: int = 0) -> PostNormTransformerLM:
    torch.manual_seed(seed)
    return PostNormTransformerLM(VOCAB, D, LAYERS, HEADS, T)


class MicroBatchIndex(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class FixedBatchLM(L.LightningModule):
    """`training_step` uses `X[global_rank, batch_idx % accum]`; SGD with lr 0 keeps the weights fixed.

    Logs its loss with `self.log` (`ref/loss`: the steps Lightning's own logging uses), and
    `ref/clip_grad_norm` (what `torch.nn.utils.clip_grad_norm_` returns on this run's own, distributed
    gradients) from `on_before_optimizer_step`, which Lightning calls after the callbacks' hook and
    before clipping. `n_batches` training batches per epoch (default: `accum`); `lr` > 0 lets weights move.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, fsdp2: bool = False, compile_backend: str | None = None,
                 n_batches: int | None = None, lr: float = 0.0):
        super().__init__()
        self.model = make_model()
        self.x, self.y = x, y
        self.accum = x.shape[1]
        self.fsdp2 = fsdp2
        self.compile_backend = compile_backend
        self.n_batches = n_batches or self.accum
        self.lr = lr

    def configure_model(self) -> None:
        if self.fsdp2:
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        if self.compile_backend and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model, backend=self.compile_backend)

    def training_step(self, batch, batch_idx):
        mb = batch_idx % self.accum
        x = self.x[self.global_rank, mb].to(self.device)
        y = self.y[self.global_rank, mb].to(self.device)
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("ref/loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        total = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=float("inf"))
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        sharded = float(any(type(p.grad).__name__ == "DTensor" for p in self.parameters() if p.grad is not None))
        if self.global_rank == 0 and self.logger is not None:
            self.logger.log_metrics({"ref/clip_grad_norm": float(total), "ref/grads_are_dtensors": sharded},
                                    step=self.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(MicroBatchIndex(self.n_batches), batch_size=None, shuffle=False)


class ManualLM(FixedBatchLM):
    """`FixedBatchLM` under manual optimisation, with one optimizer or two (the blocks' parameters, the rest),
    each stepped on every batch.

    Logs `ref/clip_grad_norm` (one optimizer) or `ref/optimizer_K/clip_grad_norm` (two): `clip_grad_norm_`'s
    total over the stepping optimizer's own parameters, under Lightning's logging step read directly.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, n_optimizers: int = 1, n_batches: int | None = None, lr: float = 0.0):
        super().__init__(x, y, n_batches=n_batches, lr=lr)
        if n_optimizers not in (1, 2):
            raise ValueError(f"n_optimizers must be 1 or 2, got {n_optimizers}")
        self.n_optimizers = n_optimizers
        self.automatic_optimization = False

    def configure_optimizers(self):
        if self.n_optimizers == 1:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        blocks = list(self.model.blocks.parameters())
        in_blocks = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if id(p) not in in_blocks]
        return [torch.optim.SGD(blocks, lr=self.lr), torch.optim.SGD(rest, lr=self.lr)]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizers = self.optimizers()
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
            optimizer.step()
            optimizer.zero_grad()

    def on_before_optimizer_step(self, optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total = float(torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf")))
        k = next(i for i, o in enumerate(self.trainer.optimizers) if o is optimizer)
        tag = "ref/clip_grad_norm" if self.n_optimizers == 1 else f"ref/optimizer_{k}/clip_grad_norm"
        if self.global_rank == 0 and self.logger is not None:
            self.logger.log_metrics({tag: total}, step=self.trainer.fit_loop.epoch_loop._batches_that_stepped)


def all_monitors(every: int | None = 2, **kw):
    return [StreamNormMonitor(every_n_steps=every, **kw), LayerNormInputMonitor(every_n_steps=every, **kw),
            ClipAttributionMonitor(every_n_steps=every, **kw)]


class CountReductions(L.Callback):
    """Records, per rank, each all-reduce made from `ln_lightning/callbacks/_reduce.py` (Lightning's logging step,
    "sum"/"max") and the number of `reduce_to_host` host copies; written to OUT/reductions_rank{R}.json when
    training ends."""

    def __init__(self, out: str):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        self.records, self.copies_at_start, original = [], _reduce.HOST_COPIES, dist.all_reduce

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if sys._getframe(1).f_code.co_filename.replace("\\", "/").endswith("ln_lightning/callbacks/_reduce.py"):
                step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step self.log would log under
                self.records.append([step, "sum" if op == dist.ReduceOp.SUM else "max"])
            return original(tensor, op=op, group=group, async_op=async_op)

        all_reduce.original = original
        dist.all_reduce = all_reduce

    def on_train_end(self, trainer, pl_module):
        dist.all_reduce = dist.all_reduce.original
        Path(self.out, f"reductions_rank{trainer.global_rank}.json").write_text(json.dumps(
            {"all_reduces": self.records, "host_copies": _reduce.HOST_COPIES - self.copies_at_start}))


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files under `log_dir`, as [(step, value)]."""
    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(glob.glob(os.path.join(str(log_dir), "**", "events.out.tfevents.*"), recursive=True)):
        acc = EventAccumulator(events, size_guidance={"scalars": 0, "tensors": 0, "images": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


# ---------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------
def reference_forward_stats(model: PostNormTransformerLM, x: torch.Tensor, autocast: torch.dtype | None = None) -> dict[str, float]:
    """Stream and LayerNorm statistics of `PostNormTransformerLM` on batch `x`, by hand.

    Float64 (a double copy of the model) when `autocast` is None; otherwise the fp32 model under
    CPU autocast of that dtype, with the statistics themselves in float64.
    """
    model = copy.deepcopy(model)
    if autocast is None:
        model = model.double()
    ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    out: dict[str, float] = {}

    def ln_stats(name: str, ln: nn.LayerNorm, inp: torch.Tensor) -> None:
        v = inp.double().var(dim=-1, unbiased=False)
        out[f"ln/var_mean/{name}"] = v.mean().item()
        out[f"ln/var_min/{name}"] = v.min().item()
        out[f"ln/amp_max/{name}"] = (1.0 / torch.sqrt(v + ln.eps)).max().item()

    with torch.no_grad(), ctx:
        pos = torch.arange(x.shape[1])
        h = model.tok_emb(x) + model.pos_emb(pos)
        for i, block in enumerate(model.blocks):
            a = h + block.attn(h)
            ln_stats(f"model.blocks.{i}.ln1", block.ln1, a)
            m = block.ln1(a)
            b = m + block.mlp(m)
            ln_stats(f"model.blocks.{i}.ln2", block.ln2, b)
            y = block.ln2(b)
            check = block(h)
            assert torch.equal(check, y), "hand-written block forward differs from the block's own"
            yd, hd = y.double(), h.double()
            out[f"stream/rms/model.blocks.{i}"] = yd.square().mean().sqrt().item()
            out[f"stream/update_ratio/model.blocks.{i}"] = ((yd - hd).square().mean().sqrt() / hd.square().mean().sqrt()).item()
            h = y
    out["stream/nonfinite_count"] = 0.0
    out["ln/nonfinite_count"] = 0.0
    return out


def _group_of(name: str) -> str:
    for g in GROUPS:
        if name == g or name.startswith(g + "."):
            return g
    raise AssertionError(f"parameter {name} has no expected group")


def reference_grad_stats(model: PostNormTransformerLM, x: torch.Tensor, y: torch.Tensor, clip_val: float | None = None,
                         algorithm: str = "norm", autocast: torch.dtype | None = None) -> dict[str, float]:
    """Clip statistics for the mean cross-entropy over the concatenated batch `x` (rows: all ranks' micro-batches).

    `clip/total_norm` is `clip_grad_norm_`'s own total on a float32 copy; shares come from a float64 copy.
    """
    out: dict[str, float] = {}
    m32 = copy.deepcopy(model)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = F.cross_entropy(m32(x).reshape(-1, VOCAB).float(), y.reshape(-1))
    loss.backward()
    out["clip/total_norm"] = float(torch.nn.utils.clip_grad_norm_(m32.parameters(), max_norm=float("inf")))
    if autocast is None:
        m64 = copy.deepcopy(model).double()
        F.cross_entropy(m64(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        named = {f"model.{n}": p.grad for n, p in m64.named_parameters()}
    else:
        named = {f"model.{n}": p.grad.double() for n, p in m32.named_parameters()}
    sq = {g: 0.0 for g in GROUPS}
    for n, g in named.items():
        sq[_group_of(n)] += g.square().sum().item()
    total_sq = sum(sq.values())
    for g in GROUPS:
        out[f"clip/share/{g}"] = sq[g] / total_sq
    out["clip/nonfinite_steps"] = 0.0
    if clip_val is not None:
        total = math.sqrt(total_sq)
        if algorithm == "norm":
            out["clip/coef"] = min(1.0, clip_val / total)
            # Window statistics: every step of these fixed-batch runs has the same gradients.
            out["clip/coef_min"] = out["clip/coef_mean"] = out["clip/coef"]
            for g in GROUPS:
                out[f"clip/update_scale/{g}"] = out["clip/coef"] * math.sqrt(sq[g])
            out["clip/clipped"] = float(total > clip_val)
            out["clip/fired_fraction"] = float(total > clip_val)
            if total > clip_val:
                top = max(GROUPS, key=sq.__getitem__)
                for g in GROUPS:
                    out[f"clip/dominant/{g}"] = float(g == top)
        else:
            amax = {g: 0.0 for g in GROUPS}
            frac_num = {g: 0 for g in GROUPS}
            frac_den = {g: 0 for g in GROUPS}
            for n, gr in named.items():
                k = _group_of(n)
                amax[k] = max(amax[k], gr.abs().max().item())
                frac_num[k] += int((gr.abs() > clip_val).sum())
                frac_den[k] += gr.numel()
            fired = max(amax.values()) > clip_val
            out["clip/clipped"] = float(fired)
            out["clip/fired_fraction"] = float(fired)
            for g in GROUPS:
                out[f"clip/value_fraction/{g}"] = frac_num[g] / frac_den[g]
            if fired:
                top = max(GROUPS, key=amax.__getitem__)
                for g in GROUPS:
                    out[f"clip/dominant/{g}"] = float(g == top)
    return out


def concat_batches(x: torch.Tensor) -> torch.Tensor:
    """(world, accum, batch, T) -> (world*accum*batch, T): every row any rank saw in one step."""
    return x.reshape(-1, x.shape[-1])


def compare(logged: dict[str, list[tuple[int, float]]], expected: dict[str, float], rtol: float = 1e-4,
            atol: float = 1e-7, steps: list[int] | None = None, exact_tags: bool = True) -> list[str]:
    """Errors (empty when all match): every monitor tag logged must be expected and equal, at every logged step."""
    errors = []
    monitor_tags = {t for t in logged if t.startswith(MONITOR_PREFIXES)}
    if exact_tags:
        for t in sorted(monitor_tags - set(expected)):
            errors.append(f"unexpected metric {t}")
    for tag, want in expected.items():
        got = logged.get(tag)
        if not got:
            errors.append(f"missing metric {tag}")
            continue
        if steps is not None and sorted(s for s, _ in got) != steps:
            errors.append(f"{tag}: logged at steps {sorted(s for s, _ in got)}, expected {steps}")
        for step, value in got:
            if not math.isclose(value, want, rel_tol=rtol, abs_tol=atol):
                errors.append(f"{tag} step {step}: logged {value!r}, reference {want!r} (rel err {abs(value - want) / max(abs(want), 1e-30):.2e})")
    return errors


# ---------------------------------------------------------------------------------------------
# Multi-process runs (script entry)
# ---------------------------------------------------------------------------------------------
def make_trainer(out: str, name: str, **kw) -> L.Trainer:
    kw.setdefault("log_every_n_steps", 2)
    kw.setdefault("enable_checkpointing", False)
    kw["callbacks"] = [*kw.get("callbacks", []), DestroyProcessGroupAtExit()]
    return L.Trainer(
        logger=TensorBoardLogger(out, name=name, version=0),
        enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, **kw,
    )


def run_ddp(out: str) -> None:
    # fp32, no accumulation, with norm clipping configured
    x, y = make_data(world=2, accum=1)
    make_trainer(out, "ddp_fp32", accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4,
                 gradient_clip_val=0.05, callbacks=[*all_monitors(), CountReductions(out)]).fit(FixedBatchLM(x, y))
    # bf16 autocast and gradient accumulation together
    x, y = make_data(world=2, accum=2)
    make_trainer(out, "ddp_bf16_accum", accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4,
             precision="bf16-mixed", accumulate_grad_batches=2, callbacks=all_monitors()).fit(FixedBatchLM(x, y))


def run_fsdp2(out: str) -> None:
    x, y = make_data(world=2, accum=1)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    make_trainer(out, "fsdp2", accelerator="cpu", devices=2, strategy=strategy, max_steps=4,
             callbacks=all_monitors()).fit(FixedBatchLM(x, y, fsdp2=True))


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    {"ddp": run_ddp, "fsdp2": run_fsdp2}[mode](out_dir)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(out_dir, f"{mode}.done").write_text(json.dumps({"ok": True}))
