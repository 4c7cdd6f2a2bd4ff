"""Why migrate, measured (issue 20, item 4): what the migrated model can do that the unchanged one cannot.

Both start from the end of their continuation arm in `migrate_trained.py` (`unchanged`, and the migrated arm
named by --why-from), with their AdamW state, on the same batches:

  lr Kx     continue at K times the continuation's learning rate, constant, without warmup;
  deepen    append `deepen` blocks initialised to (as near as the placement allows) the identity, and train
            on at the continuation's learning rate. A pre-norm block `x + c*F(N(x))` with its branches'
            output projections at zero is exactly the identity; a post-norm block `N(x + F(x))` is not for
            any weights (its norm re-normalises the stream), so the new post-norm blocks get zero branch
            outputs and copies of the trained last norm, and the change of function this causes is measured.

Recorded: the held-out loss (the study's fixed windows) every eval_every steps, the training loss, and the
gradient norm before clipping (clip 1.0, as in every run). Pure torch loops (no Trainer): the same model
code, optimizer and clipping as the Lightning runs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

WHY_SEED = 200  # the why-migrate runs of seed s draw their batches with seed WHY_SEED + s, the same for both models


def save_end_state(path: Path):
    """A Callback writing, at the end of training, what a why-migrate run needs to rebuild the model."""
    from lightning.pytorch.callbacks import Callback

    from ln_lightning.placement.migrate import transition
    from ln_lightning.placement.rewrite.scale import BranchScale
    from ln_lightning.placement import state as rewrite_state

    class SaveEndState(Callback):
        def on_train_end(self, trainer, pl_module):
            if transition.active(pl_module) is not None:
                raise RuntimeError(f"{path.name}: the run ended inside its transition; no end state to start from")
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({
                "state_dict": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                "optimizer": trainer.optimizers[0].state_dict(),
                "param_names": [n for n, _ in pl_module.named_parameters()],
                "config": dict(rewrite_state.of(pl_module).config) if rewrite_state.of(pl_module) is not None else None,
                # non-persistent constants (not in the state_dict)
                "branch_scales": {n: float(m.c) for n, m in pl_module.named_modules() if isinstance(m, BranchScale) and not m.learnable},
            }, path)

    return SaveEndState()


def _rebuild(model_cls, model_hp: dict, state: dict, extra_blocks: int):
    """The saved model, with `extra_blocks` more blocks appended; returns (model, names of the new parameters,
    the placement)."""
    from ln_lightning.placement import convert

    lm = model_cls(**{**model_hp, "n_layers": model_hp["n_layers"] + extra_blocks})
    cfg = state["config"]
    if cfg is not None:
        options = {k: v for k, v in cfg.items() if k != "placement"}
        convert(lm, cfg["placement"], **options)
    mods = dict(lm.named_modules())
    n_old = model_hp["n_layers"]
    for name, c in state["branch_scales"].items():
        mods[name].c.fill_(c)
    last_scale = None
    if state["branch_scales"]:
        last_scale = state["branch_scales"].get(f"model.blocks.{n_old - 1}.mlp_scale")
    missing, unexpected = lm.load_state_dict(state["state_dict"], strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected keys {unexpected[:4]}")
    new = [k for k in missing if k.startswith("model.blocks.") and int(k.split(".")[2]) >= n_old]
    if set(missing) - set(new):
        raise RuntimeError(f"missing keys {sorted(set(missing) - set(new))[:4]}")
    with torch.no_grad():
        for i in range(n_old, n_old + extra_blocks):
            b = lm.model.blocks[i]
            for lin in (b.attn.proj, b.mlp.out):  # the branches write nothing: x + 0 (pre) / N(x + 0) (post)
                lin.weight.zero_()
                lin.bias.zero_()
            if cfg is None:  # post-norm: the norms copy the trained last norm, the nearest a post block gets to the identity
                src = lm.model.blocks[n_old - 1].ln2
                for ln in (b.ln1, b.ln2):
                    ln.weight.copy_(src.weight)
                    ln.bias.copy_(src.bias)
            elif last_scale is not None:  # the stream scale the last trained branch wrote at
                mods[f"model.blocks.{i}.attn_scale"].c.fill_(last_scale)
                mods[f"model.blocks.{i}.mlp_scale"].c.fill_(last_scale)
    return lm, new, (cfg or {}).get("placement", "post")


def run_why(source_path: Path, test: str, seed: int, hp: dict, model_cls, model_hp: dict, eval_x, eval_y, train_set) -> dict:
    """One why-migrate run: test is 'lr3', 'lr10' (K x the continuation lr, no warmup) or 'deepen'."""
    t0 = time.process_time()
    state = torch.load(source_path, map_location="cpu", weights_only=False)
    extra = hp["deepen"] if test == "deepen" else 0
    lm, new, placement = _rebuild(model_cls, model_hp, state, extra)
    base_lr = hp["lr"] * hp["lr_floor"]
    lr = base_lr * (int(test[2:]) if test.startswith("lr") else 1)
    names = [n for n, _ in lm.named_parameters()]
    params = [p for _, p in lm.named_parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=lm.hparams.weight_decay)
    old = {n: i for i, n in enumerate(state["param_names"])}
    saved = state["optimizer"]
    opt.load_state_dict({"state": {j: saved["state"][old[n]] for j, n in enumerate(names) if n in old and old[n] in saved["state"]},
                         "param_groups": [dict(saved["param_groups"][0], params=list(range(len(names))), lr=lr)]})

    def heldout():
        lm.eval()
        with torch.no_grad():
            tot = sum(F.cross_entropy(lm(x).reshape(-1, 128), y.reshape(-1), reduction="sum").item() for x, y in zip(eval_x, eval_y))
        lm.train()
        return tot / sum(y.numel() for y in eval_y)

    start_loss = heldout()
    source_end = None
    if extra:  # the function before the blocks were added, for the change the insertion makes
        src_lm, _, _ = _rebuild(model_cls, model_hp, state, 0)
        src_lm.eval()
        with torch.no_grad():
            source_end = sum(F.cross_entropy(src_lm(x).reshape(-1, 128), y.reshape(-1), reduction="sum").item()
                             for x, y in zip(eval_x, eval_y)) / sum(y.numel() for y in eval_y)
    g = torch.Generator().manual_seed(WHY_SEED + seed)
    bs = hp["batch_size"]
    order: list[int] = []
    evals, losses, grads = [(0, start_loss)], [], []
    lm.train()
    for step in range(hp["why_steps"]):
        if len(order) < bs:
            order += torch.randperm(len(train_set), generator=g).tolist()
        idx, order = order[:bs], order[bs:]
        x, y = (torch.stack(z) for z in zip(*(train_set[i] for i in idx)))
        logits = lm(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = float(nn.utils.clip_grad_norm_(params, hp["clip"]))
        opt.step()
        losses.append(float(loss))
        grads.append(gn)
        if (step + 1) % hp["eval_every"] == 0 or step + 1 == hp["why_steps"]:
            evals.append((step + 1, heldout()))
    finite = [v for _, v in evals if math.isfinite(v)]
    return {"test": test, "seed": seed, "placement": placement, "lr": lr, "extra_blocks": extra, "new_params": len(new),
            "evals": evals, "loss": losses, "grad_norm": grads, "start": start_loss,
            "source_end": source_end, "cpu_s": time.process_time() - t0, "diverged": len(finite) < len(evals)}
