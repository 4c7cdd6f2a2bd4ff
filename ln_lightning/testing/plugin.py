"""Shared pieces of the LNPlacement tests: a tiny model, data, an independent pre-norm reference, recorders.

Also run as a script (`python -m ln_lightning.testing.plugin MODE OUT_DIR`) for the strategies whose launcher
re-executes the command line (ddp, ModelParallelStrategy) or that need separately started processes
(two simulated nodes): see `run_scenario`.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from ln_lightning.demo.lightning import CharLM
from ln_lightning.demo.models import PostNormTransformerLM
from ln_lightning.plugin import MARKER, LNPlacement
from ln_lightning.testing.dist import DestroyProcessGroupAtExit

TINY = dict(vocab_size=128, d_model=32, n_layers=2, n_heads=2, block_size=16, lr=3e-3, warmup_steps=3)
SEQ = 16


# ---------------------------------------------------------------------------------------------- data / model
class RandomTokens(Dataset):
    def __init__(self, n: int = 32, seq: int = SEQ, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 128, (n, seq + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


def loader(n=32, seed=0, batch_size=4, shuffle=False):
    return DataLoader(RandomTokens(n, seed=seed), batch_size=batch_size, shuffle=shuffle)


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with DTensors gathered (a collective under ModelParallel: call on every rank)."""
    out = {}
    for k, v in module.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def final_norm_path(state: dict) -> str | None:
    """The module path of the final norm convert added to `model` (keys not in an unconverted CharLM)."""
    plain = set(CharLM(**TINY).state_dict())
    extra = sorted({k.rpartition(".")[0] for k in state if k not in plain and not k.endswith(MARKER)})
    return extra[0] if extra else None


def prenorm_reference(state: dict, idx: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The pre-norm function written out by hand, with a converted CharLM's weights, on a fresh (unhooked) model:
    x <- x + attn(ln1(x)); x <- x + mlp(ln2(x)); logits = head(LN_final(x))."""
    cfg = {k: TINY[k] for k in ("vocab_size", "d_model", "n_layers", "n_heads", "block_size")}
    fresh = PostNormTransformerLM(**cfg).double()
    fpath = final_norm_path(state)
    sd = {k[len("model."):]: v.double() for k, v in state.items()
          if k.startswith("model.") and not k.endswith(MARKER) and not (fpath and k.startswith(fpath + "."))}
    fresh.load_state_dict(sd, strict=True)
    with torch.no_grad():
        x = fresh.tok_emb(idx) + fresh.pos_emb(torch.arange(idx.shape[1]))
        for b in fresh.blocks:
            x = x + b.attn(b.ln1(x))
            x = x + b.mlp(b.ln2(x))
        if fpath is not None:
            x = F.layer_norm(x, (x.shape[-1],), state[fpath + ".weight"].double(), state[fpath + ".bias"].double(), eps)
        return fresh.head(x)


class ProbeLM(CharLM):
    """CharLM that records what configure_optimizers saw, and checks eval outputs against a reference state."""

    def __init__(self, reference_path: str | None = None, manual: bool = False, **kw):
        super().__init__(**{**TINY, **kw})
        self.reference_path = reference_path
        self.opt_record: dict | None = None
        if manual:
            self.automatic_optimization = False

    def configure_optimizers(self):
        out = super().configure_optimizers()
        opt = out["optimizer"]
        in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
        self.opt_record = {
            "marker_present": any(k.endswith(MARKER) for k in self.state_dict()),
            "names_in_optimizer": sorted(n for n, p in self.named_parameters() if id(p) in in_opt),
            "all_names": sorted(n for n, _ in self.named_parameters()),
        }
        self._params_at_opt = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                               for n, p in self.named_parameters()}
        return out

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        opt = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()
        self.log("train/loss", loss)

    def _ref_err(self, x):
        if not self.reference_path:
            return None
        if not hasattr(self, "_ref_state"):
            self._ref_state = torch.load(self.reference_path, weights_only=True)
        got = self(x).double().cpu()
        return (got - prenorm_reference(self._ref_state, x.cpu())).abs().max()

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        err = self._ref_err(batch[0])
        if err is not None:
            self.log("ref_err", float(err), reduce_fx="max", sync_dist=True)

    def test_step(self, batch, batch_idx):
        super().test_step(batch, batch_idx)
        err = self._ref_err(batch[0])
        if err is not None:
            self.log("ref_err", float(err), reduce_fx="max", sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x = batch[0]
        err = self._ref_err(x)
        return {"logits": self(x).detach().cpu(), "ref_err": None if err is None else float(err)}


class MPProbeLM(ProbeLM):
    """ProbeLM for ModelParallelStrategy: FSDP2 `fully_shard` applied in configure_model (after the rewrite)."""

    def configure_model(self):
        if any(hasattr(p, "full_tensor") for p in self.parameters()):
            return  # configure_model runs again for validate() after fit: Lightning asks it to be idempotent
        self.converted_before_configure_model = LNPlacement.applied_config(self) is not None
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class Recorder(Callback):
    """Writes, per rank, what the tests check: the optimizer record, the architecture, the final weights."""

    def __init__(self, out_dir: str, tag: str):
        self.out_dir = out_dir
        self.tag = tag

    def _path(self, trainer, suffix):
        return os.path.join(self.out_dir, f"{self.tag}_rank{trainer.global_rank}.{suffix}")

    def on_train_start(self, trainer, pl_module):
        torch.save(full_state(pl_module), self._path(trainer, "start.pt"))
        opt = trainer.optimizers[0]
        steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
        sched = trainer.lr_scheduler_configs[0].scheduler
        self._start = {"optimizer_steps": steps, "scheduler_last_epoch": sched.last_epoch,
                       "global_step": trainer.global_step}

    def on_train_end(self, trainer, pl_module):
        state = full_state(pl_module)
        torch.save(state, self._path(trainer, "end.pt"))
        record = dict(pl_module.opt_record or {})
        plain = set(CharLM(**TINY).state_dict())
        added = sorted(n for n in record.get("all_names", []) if n not in plain)
        record.update(
            self._start,
            rank=trainer.global_rank,
            sharded=any(hasattr(p, "full_tensor") for p in pl_module.parameters()),
            converted_before_configure_model=getattr(pl_module, "converted_before_configure_model", None),
            world_size=trainer.world_size,
            strategy=type(trainer.strategy).__name__,
            architecture=sorted((k, list(v.shape)) for k, v in state.items()),
            module_types=sorted({f"{n}:{type(m).__name__}" for n, m in pl_module.named_modules()}),
            added_params=added,
            added_changed={n: not torch.equal(pl_module._params_at_opt[n], state[n]) for n in added},
            report_added=list(getattr(_placement(trainer).report, "added", []) or []),
        )
        with open(self._path(trainer, "json"), "w") as f:
            json.dump(record, f, indent=1)


def _placement(trainer) -> LNPlacement:
    return next(cb for cb in trainer.callbacks if isinstance(cb, LNPlacement))


# ---------------------------------------------------------------------------------------------- scenario
def make_trainer(strategy_kw, out_dir: str, tag: str, max_steps: int, fused: bool = False, **kw) -> Trainer:
    ckpt = ModelCheckpoint(dirpath=os.path.join(out_dir, f"ckpt_{tag}"), save_last=True, every_n_train_steps=max_steps)
    return Trainer(
        plugins=[LNPlacement("pre", fused=fused)],
        callbacks=[Recorder(out_dir, tag), ckpt, DestroyProcessGroupAtExit()],
        max_steps=max_steps,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
        **(strategy_kw() if callable(strategy_kw) else strategy_kw),
        **kw,
    )


def run_scenario(strategy_kw, out_dir: str, model_cls=ProbeLM, fused: bool = False, **trainer_kw) -> dict:
    """fit -> fit(ckpt_path) resume -> validate/test/predict(ckpt_path) on fresh models; results per rank."""
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    trainer = make_trainer(strategy_kw, out_dir, "fit", max_steps=3, fused=fused, **trainer_kw)
    model = model_cls()
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(8, seed=1))
    last = os.path.join(out_dir, "ckpt_fit", "last.ckpt")
    results = {"rank": trainer.global_rank}
    # The trained function after fit, on this very model (rank-local forward; sharded models gather).
    x = RandomTokens(4, seed=2).data[:, :-1]
    ref = prenorm_reference(full_state(model), x)
    with torch.no_grad():
        results["after_fit_err"] = float((model(x.to(model.device)).double().cpu() - ref).abs().max())
    results["after_fit_config"] = LNPlacement.applied_config(model)
    # validate on the same trainer, no ckpt_path: the model as fit left it (LayerSync.revert ran at teardown).
    model.reference_path = os.path.join(out_dir, "fit_rank0.end.pt")
    results["validate_after_fit"] = trainer.validate(model, loader(8, seed=1))

    torch.manual_seed(1)  # the fresh model's initial weights differ from the trained ones
    resume = make_trainer(strategy_kw, out_dir, "resume", max_steps=5, fused=fused, **trainer_kw)
    resume.fit(model_cls(), train_dataloaders=loader(), val_dataloaders=loader(8, seed=1), ckpt_path=last)

    evaluator = make_trainer(strategy_kw, out_dir, "eval", max_steps=1, fused=fused, logger=False, **trainer_kw)
    ckpt_for_eval = os.path.join(out_dir, "ckpt_resume", "last.ckpt")  # written by the resumed run (step 5)
    ref5 = os.path.join(out_dir, "resume_rank0.end.pt")
    results["validate"] = evaluator.validate(model_cls(reference_path=ref5), loader(8, seed=1), ckpt_path=ckpt_for_eval)
    results["test"] = evaluator.test(model_cls(reference_path=ref5), loader(8, seed=1), ckpt_path=ckpt_for_eval)
    preds = evaluator.predict(model_cls(reference_path=ref5), loader(8, seed=1), ckpt_path=ckpt_for_eval)
    results["predict_ref_err"] = None if preds is None else max(p["ref_err"] for p in preds)
    with open(os.path.join(out_dir, f"scenario_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(results, f, indent=1, default=float)
    return results


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if mode == "ddp":
        kw = dict(accelerator="cpu", devices=2, strategy="ddp")
    elif mode == "nodes":  # one process of two simulated nodes; NODE_RANK etc. come from the environment
        kw = dict(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp")
    elif mode == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        def kw():  # a strategy object serves one Trainer
            return dict(accelerator="cpu", devices=2,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    else:
        raise SystemExit(f"unknown mode {mode}")
    run_scenario(kw, out, MPProbeLM if mode == "model_parallel" else ProbeLM)
