"""Screening loop (issue 20): continue a pretrained post-norm CharLM checkpoint through a post->pre blend.

A pure-torch reimplementation of `migrate_trained.py`'s continuation (`flm.py`: the demo CharLM as functions of
its state_dict, with the plain and the stream-scaled blends and per-sublayer blends), about 5x faster than a
Lightning arm, used to screen schedules, endpoint steps, distillation and learning rates before running the
best in the study proper. The pretrained checkpoints are the study's (`SCREEN_PRETRAINED`, default
outputs/migrate_trained: run `python examples/migrate_trained.py` first); results go to `SCREEN_OUT` (default
outputs/migrate_trained_screen) as one JSON line per run. Run: `python examples/migrate_trained_screen/exp1.py
SEED a|b` (each exp*.py holds two lists of runs, a and b, meant to run side by side). Its figures are a screen,
not the study: the study's own arms (same model, seeds and batches, through the plugin's public API) are the
measured result.

Pure torch with the functional model of flm.py; AdamW state restored from the checkpoint; lr 1e-4 (the floor);
grad clip 1.0; batches from a fixed permutation (seed 100+s), the same in every arm; held-out eval on the
study's 64 fixed windows every 20 steps (before that step's update). Compute units: forward 1, backward 2.
"""
import json
import os
import random
import time

import torch
from torch.nn import functional as F

import flm

from ln_lightning.demo.data import CharCorpus, stdlib_corpus_text

torch.set_num_threads(1)
OUT = os.environ.get("SCREEN_PRETRAINED", "outputs/migrate_trained")
LOG_DIR = os.environ.get("SCREEN_OUT", "outputs/migrate_trained_screen")
HP = dict(block_size=32, batch_size=16, max_chars=300_000, eval_batches=4, eval_every=20)


def data():
    text = stdlib_corpus_text(HP["max_chars"])
    split = int(len(text) * 0.95)
    train = CharCorpus(text[:split], HP["block_size"])
    val = CharCorpus(text[split:], HP["block_size"])
    n_eval = HP["eval_batches"] * HP["batch_size"]
    idx = [round(i * (len(val) - 1) / max(1, n_eval - 1)) for i in range(n_eval)]
    xs, ys = zip(*(val[i] for i in idx))
    return train, torch.stack(xs), torch.stack(ys)


TRAIN, EX, EY = data()


def batches(seed):
    g = torch.Generator().manual_seed(100 + seed)
    bs = HP["batch_size"]
    while True:
        perm = torch.randperm(len(TRAIN), generator=g).tolist()
        for i in range(0, len(perm) - bs + 1, bs):
            xs, ys = zip(*(TRAIN[j] for j in perm[i:i + bs]))
            yield torch.stack(xs), torch.stack(ys)


def ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def kl(teacher_logits, logits):
    """KL(teacher || student), mean over tokens."""
    t = F.log_softmax(teacher_logits.reshape(-1, teacher_logits.size(-1)), -1)
    s = F.log_softmax(logits.reshape(-1, logits.size(-1)), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


class Model:
    """Params + how to run the blend. endpoint: 'own' (convert) or 'preceding'; final: 'trained'/'fresh'."""

    def __init__(self, seed, endpoint="own", final="trained", first="fresh", scales=None, path="plain", interp="geo"):
        ck, sd = flm.load(f"{OUT}/pretrain_seed{seed}/last.ckpt")
        self.names = list(sd)
        self.p = {k: v.clone().requires_grad_(True) for k, v in sd.items()}
        self.L = flm.n_layers(sd)
        self.added = {}
        fw, fb = flm.final_norm(sd, self.L, final)
        self.added["final.weight"] = fw.clone().requires_grad_(True)
        self.added["final.bias"] = fb.clone().requires_grad_(True)
        self.endpoint = endpoint
        if endpoint == "preceding" and first == "fresh":
            self.added["first.weight"] = torch.ones(flm.D, requires_grad=True)
            self.added["first.bias"] = torch.zeros(flm.D, requires_grad=True)
        self.first = first
        self.c = scales
        self.ck = ck
        self.teacher = {k: v.clone() for k, v in sd.items()}
        self.path, self.interp = path, interp
        if path == "rescaled":
            g = torch.Generator().manual_seed(12345)
            probe = torch.randint(0, len(TRAIN), (64,), generator=g).tolist()
            px = torch.stack([TRAIN[i][0] for i in probe])
            with torch.no_grad():
                self.C = flm.scales(self.teacher, px)

    def entry(self):
        if self.endpoint == "own":
            return flm.entries(self.p, self.L, "own")
        e = flm.entries(self.p, self.L, "preceding", first=None)
        if self.first == "fresh":
            e[0] = (self.added["first.weight"], self.added["first.bias"])
        return e

    def __call__(self, idx, a, af, params=None):
        p = self.p if params is None else params
        if self.path == "rescaled":
            return flm.forward_rescaled(p, idx, a, af, self.entry(), (self.added["final.weight"], self.added["final.bias"]), self.C,
                                        interp=self.interp)
        return flm.forward(p, idx, a, af, self.entry() if params is None else None, (self.added["final.weight"], self.added["final.bias"]), c=self.c)

    def teacher_logits(self, idx):
        with torch.no_grad():
            L2 = 2 * self.L
            return flm.forward(self.teacher, idx, [0.0] * L2, 0.0, [None] * L2, (None, None))

    def optimizer(self, lr=1e-4):
        params = [self.p[k] for k in self.names] + list(self.added.values())
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        st = self.ck["optimizer_states"][0]
        st = {"state": st["state"], "param_groups": [dict(st["param_groups"][0], params=list(range(len(params))), lr=lr)]}
        opt.load_state_dict(st)
        return opt


def evaluate(m, a, af):
    with torch.no_grad():
        tot = 0.0
        for i in range(0, EX.shape[0], HP["batch_size"]):
            x, y = EX[i:i + HP["batch_size"]], EY[i:i + HP["batch_size"]]
            lg = m(x, a, af)
            tot += F.cross_entropy(lg.reshape(-1, lg.size(-1)), y.reshape(-1), reduction="sum").item()
        return tot / EY.numel()


def run(seed, name, blend_fn, budget_units=3600, steps=1200, distill=0.0, distill_steps=None, extra_kl_steps=0,
        extra_until=None, lr=1e-4, lr_fn=None, log=None, save_at=(), step_blend_fn=None, **model_kw):
    """blend_fn(step) -> (list of 2L per-sublayer blends, final blend). distill: weight of KL(teacher||student) in the
    loss while any blend < 1 (teacher: frozen copy at a=0, 1 forward). extra_kl_steps: additional optimizer steps per
    blend step on a pure KL loss on fresh batches, while step < extra_until."""
    m = Model(seed, **model_kw)
    opt = m.optimizer(lr)
    it = batches(seed)
    units, evals, blends, losses = 0.0, [], [], []
    t0 = time.process_time()
    step = 0
    while step < steps and units < budget_units - 1e-9:
        a, af = blend_fn(step)
        if step in save_at:
            torch.save({"p": {k: v.detach().clone() for k, v in m.p.items()}, "added": {k: v.detach().clone() for k, v in m.added.items()}},
                       f"{LOG_DIR}/snap_{name}_seed{seed}_{step}.pt")
        if step % HP["eval_every"] == 0:
            evals.append((step, evaluate(m, a, af)))
        if lr_fn is not None:
            for g in opt.param_groups:
                g["lr"] = lr_fn(step)
        in_transition = min(a + [af]) < 1.0
        x, y = next(it)
        ta, taf = (a, af) if step_blend_fn is None else step_blend_fn(step, a, af)
        lg = m(x, ta, taf)
        loss = ce(lg, y)
        losses.append(loss.item())
        units += 3
        if distill and in_transition and (distill_steps is None or step < distill_steps):
            tl = m.teacher_logits(x)
            units += 1
            loss = loss + distill * kl(tl, lg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*m.p.values(), *m.added.values()], 1.0)
        opt.step()
        if extra_kl_steps and (extra_until is None or step < extra_until) and in_transition:
            for _ in range(extra_kl_steps):
                x2, _y2 = next(it)
                tl = m.teacher_logits(x2)
                l2 = kl(tl, m(x2, a, af))
                units += 4
                opt.zero_grad(set_to_none=True)
                l2.backward()
                torch.nn.utils.clip_grad_norm_([*m.p.values(), *m.added.values()], 1.0)
                opt.step()
        blends.append(sum(a) / len(a))
        step += 1
    a, af = blend_fn(step)
    evals.append((step, evaluate(m, a, af)))
    pre = evals[0][1]
    worst = max(v for s, v in evals[1:]) - pre
    r = dict(name=name, seed=seed, evals=evals, pre=pre, worst=worst, final=evals[-1][1], units=units, steps=step,
             blends=blends, loss=losses, cpu_s=time.process_time() - t0,
             worst_step=max(evals[1:], key=lambda e: e[1])[0])
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(r) + "\n")
    print(f"{name} seed{seed}: worst {worst:+.4f} @ {r['worst_step']}, final {r['final']:.4f} (pre {pre:.4f}), units {units:.0f}, steps {step}, "
          f"cpu {r['cpu_s']:.0f}s", flush=True)
    return r


def uniform(fn, L2=24):
    """Same blend everywhere: fn(step) -> a."""
    def f(step):
        a = fn(step)
        return [a] * L2, a
    return f


def linear(T):
    return uniform(lambda s: min(1.0, s / T))


def anticipate(p):
    """Endpoint steps: a step trains at a = 1 with probability p (a hash of the step: the same in every run)
    while the transition is under way; otherwise at the blend the schedule gives."""
    def f(step, a, af):
        if a[0] < 1.0 and random.Random(step * 7919 + 1).random() < p:
            return [1.0] * len(a), 1.0
        return a, af
    return f
