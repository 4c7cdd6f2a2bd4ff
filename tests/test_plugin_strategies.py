"""LNPlacement on every strategy that runs here: one CPU, ddp and ddp_spawn (2 CPU processes), two simulated
nodes on 127.0.0.1, and ModelParallelStrategy with FSDP2 `fully_shard` (2 CPU processes).

Each strategy runs one scenario (`ln_lightning.testing.plugin.run_scenario`): fit -> validate after fit -> fit(ckpt_path)
on a fresh model -> validate/test/predict(ckpt_path) on fresh models, and the per-rank records are checked
here against an independent reference: the pre-norm function written out by hand on a fresh, unhooked copy
of the weights (`prenorm_reference`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from ln_lightning.plugin import MARKER, LNPlacement
from ln_lightning.testing import plugin as h

HELPER = "ln_lightning.testing.plugin"
TOL = 1e-5


def _load(out, name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def _check_records(out: str, world_size: int) -> None:
    for tag in ("fit", "resume"):
        recs = [_load(out, f"{tag}_rank{r}.json") for r in range(world_size)]
        for rec in recs:
            assert rec["world_size"] == world_size
            # The rewrite came before configure_optimizers: the marker existed, every parameter (the added
            # final norm included) is in the optimizer, and the added parameters moved during training.
            assert rec["marker_present"], rec
            assert rec["names_in_optimizer"] == rec["all_names"]
            assert rec["added_params"] == [f"{p}.{w}" for p in rec["report_added"] for w in ("bias", "weight")], rec
            assert rec["added_params"] and all(rec["added_changed"].values()), rec["added_changed"]
        # Every rank has the same architecture (names, shapes, module classes) and the same weights.
        assert all(r["architecture"] == recs[0]["architecture"] for r in recs)
        assert all(r["module_types"] == recs[0]["module_types"] for r in recs)
        states = [torch.load(os.path.join(out, f"{tag}_rank{r}.end.pt")) for r in range(world_size)]
        for s in states[1:]:
            assert s.keys() == states[0].keys()
            assert all(torch.equal(s[k], states[0][k]) for k in s)
    # fit(ckpt_path=...) on a fresh, differently initialised model resumed the weights, optimizer and scheduler.
    for r in range(world_size):
        end = torch.load(os.path.join(out, f"fit_rank{r}.end.pt"))
        start = torch.load(os.path.join(out, f"resume_rank{r}.start.pt"))
        assert end.keys() == start.keys()
        assert all(torch.equal(end[k], start[k]) for k in end), "resumed weights differ from the checkpoint"
        rec = _load(out, f"resume_rank{r}.json")
        assert rec["global_step"] == 3 and rec["scheduler_last_epoch"] == 3
        assert rec["optimizer_steps"] and set(rec["optimizer_steps"]) == {3.0}
    for r in range(world_size):
        res = _load(out, f"scenario_rank{r}.json")
        assert res["after_fit_config"] == LNPlacement("pre").config
        assert res["after_fit_err"] < TOL  # the model fit returns computes the trained pre-norm function
        assert res["validate_after_fit"][0]["ref_err"] < TOL
        assert res["validate"][0]["ref_err"] < TOL  # validate(ckpt_path) on a fresh model
        assert res["test"][0]["ref_err"] < TOL
        if res["predict_ref_err"] is not None:
            assert res["predict_ref_err"] < TOL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_helper(mode: str, out: str, env_extra: dict | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONWARNINGS="ignore", **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", HELPER, mode, out], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait(procs, timeout=240):
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        outs.append(out)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]


def test_single_cpu(tmp_path):
    h.run_scenario(dict(accelerator="cpu", devices=1), str(tmp_path))
    _check_records(str(tmp_path), 1)


@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path):
    _wait([_run_helper("ddp", str(tmp_path))])
    _check_records(str(tmp_path), 2)


@pytest.mark.slow
def test_two_simulated_nodes(tmp_path):
    port = str(_free_port())
    procs = [
        _run_helper("nodes", str(tmp_path), {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(r),
                                             "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
        for r in (0, 1)
    ]
    _wait(procs)
    _check_records(str(tmp_path), 2)


@pytest.mark.slow
def test_model_parallel_fsdp2_two_cpu_processes(tmp_path):
    _wait([_run_helper("model_parallel", str(tmp_path))])
    _check_records(str(tmp_path), 2)
    for r in range(2):
        rec = _load(str(tmp_path), f"fit_rank{r}.json")
        assert rec["strategy"] == "ModelParallelStrategy"
        assert rec["sharded"], "parameters should be DTensors after fully_shard"
        assert rec["converted_before_configure_model"] is True
    assert os.path.isdir(tmp_path / "ckpt_fit" / "last.ckpt")  # a distributed checkpoint, resumed above


@pytest.mark.slow
def test_ddp_spawn_main_process_keeps_every_trained_weight(tmp_path):
    out = str(tmp_path)
    torch.manual_seed(0)
    spawn = dict(accelerator="cpu", devices=2, strategy="ddp_spawn")
    trainer = h.make_trainer(spawn, out, "fit", max_steps=3)
    model = h.ProbeLM()
    trainer.fit(model, train_dataloaders=h.loader(), val_dataloaders=h.loader(8, seed=1))
    # The main process never ran a training step: its model must hold rank 0's final weights, all of them
    # (the added final norm and the marker included), not the initial ones.
    rank0 = torch.load(os.path.join(out, "fit_rank0.end.pt"))
    main = h.full_state(model)
    assert main.keys() == rank0.keys() and any(k.endswith(MARKER) for k in main)
    assert all(torch.equal(main[k], rank0[k]) for k in main), [k for k in main if not torch.equal(main[k], rank0[k])]
    assert LNPlacement.applied_config(model) == LNPlacement("pre").config
    x = h.RandomTokens(4, seed=2).data[:, :-1]
    with torch.no_grad():
        assert (model(x).double() - h.prenorm_reference(rank0, x)).abs().max() < TOL

    torch.manual_seed(1)
    resume = h.make_trainer(spawn, out, "resume", max_steps=5)
    resume.fit(h.ProbeLM(), train_dataloaders=h.loader(), val_dataloaders=h.loader(8, seed=1),
               ckpt_path=os.path.join(out, "ckpt_fit", "last.ckpt"))
    evaluator = h.make_trainer(spawn, out, "eval", max_steps=1, logger=False)
    ref5 = os.path.join(out, "resume_rank0.end.pt")
    res = evaluator.validate(h.ProbeLM(reference_path=ref5), h.loader(8, seed=1),
                             ckpt_path=os.path.join(out, "ckpt_resume", "last.ckpt"))
    assert res[0]["ref_err"] < TOL
    for r in range(2):
        for tag in ("fit", "resume"):
            rec = _load(out, f"{tag}_rank{r}.json")
            assert rec["names_in_optimizer"] == rec["all_names"] and rec["added_params"]
            assert all(rec["added_changed"].values())
        end = torch.load(os.path.join(out, f"fit_rank{r}.end.pt"))
        start = torch.load(os.path.join(out, f"resume_rank{r}.start.pt"))
        assert all(torch.equal(end[k], start[k]) for k in end)
    assert _load(out, "resume_rank1.json")["architecture"] == _load(out, "resume_rank0.json")["architecture"]
