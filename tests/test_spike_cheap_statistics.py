"""SpikeMonitor's per-step statistics, made cheap without changing them: a LayerNorm's amplification read from
what aten's kernel saved for the backward (no second pass over the input), computed as before where reading it
would run saved-tensor hooks (checkpointing, offloading); the per-gradient norms computed once per step for
ClipAttributionMonitor and SpikeMonitor together, and recomputed when the gradients changed in between."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ln_lightning.callbacks import SpikeMonitor, _grad_groups, spike
from ln_lightning.callbacks._grad_groups import grad_sq
from ln_lightning.callbacks.spike import _norm_rstd
from ln_lightning.norm import recognize_norm


class _Ops(TorchDispatchMode):
    """The aten ops run inside it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _reference_amp(x: torch.Tensor, eps: float, rms: bool) -> torch.Tensor:
    """1/sqrt(var + eps) per row in float64 (RMSNorm: the mean square)."""
    x = x.double()
    ms = x.square().mean(-1) if rms else x.var(-1, correction=0)
    return torch.rsqrt(ms + eps)


def _rstd_seen_by_a_hook(norm: nn.Module, x: torch.Tensor, run=lambda f, x: f(x)) -> tuple[torch.Tensor, list[str]]:
    """What `_norm_rstd` gives in a forward hook on `norm` (as SpikeMonitor calls it), and the ops it ran."""
    spec = recognize_norm(norm)
    got = {}

    def hook(module, args, output):
        with _Ops() as ops:
            got["rstd"] = _norm_rstd(spec, args[0].detach(), output)
        got["ops"] = ops.ops

    handle = norm.register_forward_hook(hook)
    try:
        run(norm, x)
    finally:
        handle.remove()
    return got["rstd"], got["ops"]


def test_a_layernorm_s_amplification_is_read_from_its_saved_statistics_with_no_pass_over_the_input():
    torch.manual_seed(0)
    norm = nn.LayerNorm(16, eps=1e-3)
    x = (torch.randn(3, 5, 16) * torch.rand(3, 5, 1)).requires_grad_()
    rstd, ops = _rstd_seen_by_a_hook(norm, x)
    torch.testing.assert_close(rstd.reshape(3, 5).double(), _reference_amp(x.detach(), 1e-3, rms=False), rtol=1e-5, atol=0)
    assert "aten.native_layer_norm" not in ops and len(ops) <= 1, ops  # at most a view of the saved tensor


def test_under_checkpointing_or_offloading_it_is_computed_instead_without_running_the_hooks():
    torch.manual_seed(0)
    norm = nn.LayerNorm(16, eps=1e-3)
    x = (torch.randn(3, 5, 16) * torch.rand(3, 5, 1)).requires_grad_()
    expected = _reference_amp(x.detach(), 1e-3, rms=False)
    recomputed = []
    norm.register_forward_pre_hook(lambda m, a: recomputed.append(1))
    for run in (lambda f, x: checkpoint(f, x, use_reentrant=False), lambda f, x: _offloaded(f, x),
                lambda f, x: checkpoint(f, x, use_reentrant=True)):
        recomputed.clear()
        rstd, ops = _rstd_seen_by_a_hook(norm, x, run)
        torch.testing.assert_close(rstd.reshape(3, 5).double(), expected, rtol=1e-5, atol=0)
        assert "aten.native_layer_norm" in ops  # computed, not unpacked
        assert len(recomputed) == 1  # the forward ran once: reading did not make checkpointing recompute it


def _offloaded(f, x):
    with torch.autograd.graph.save_on_cpu():
        return f(x)


def test_without_autograd_and_for_rmsnorm_it_is_computed_in_one_pass():
    torch.manual_seed(0)
    x = torch.randn(4, 16) * 3 + 1
    with torch.no_grad():
        rstd, _ = _rstd_seen_by_a_hook(nn.LayerNorm(16), x)
    torch.testing.assert_close(rstd.reshape(4).double(), _reference_amp(x, 1e-5, rms=False), rtol=1e-5, atol=0)
    rstd, ops = _rstd_seen_by_a_hook(nn.RMSNorm(16, eps=1e-6), x.requires_grad_())
    torch.testing.assert_close(rstd.double(), _reference_amp(x.detach(), 1e-6, rms=True), rtol=1e-5, atol=0)
    assert ops.count("aten.linalg_vector_norm") == 1


def test_gradient_norms_are_computed_once_for_the_same_gradients_and_again_when_they_change():
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7)]
    _grad_groups.forget_grad_sq()
    with _Ops() as ops:
        first = grad_sq(grads, torch.device("cpu"))
        second = grad_sq(grads, torch.device("cpu"))  # the second monitor of the step
    assert second is first and ops.ops.count("aten._foreach_norm") == 1
    torch.testing.assert_close(first, torch.stack([g.double().square().sum() for g in grads]))
    grads[1].mul_(2.0)  # changed in place in between (clipping, a callback): recomputed
    torch.testing.assert_close(grad_sq(grads, torch.device("cpu")), torch.stack([g.double().square().sum() for g in grads]))
    fresh = [g.clone() for g in grads]  # other tensors (the next step's gradients), even with equal values
    assert grad_sq(fresh, torch.device("cpu")) is not grad_sq(grads, torch.device("cpu"))
    _grad_groups.forget_grad_sq()


# ---------------------------------------------------------------------------------------------
# The record buffer: one row per step, read at the logging step; its size changes no record
# ---------------------------------------------------------------------------------------------
def _records_of(tmp_path, name, **monitor_kw):
    from test_spike_monitor import (
        N_STEPS,
        SPIKE_STEP,
        WINDOW,
        SpikeLM,
        fit,
        make_batches,
    )

    x, y = make_batches(N_STEPS, 2)
    module = SpikeLM(x, y, spike_step=SPIKE_STEP, spike_half=1, spike_block=2)
    _, records = fit(tmp_path, module, [SpikeMonitor(window=WINDOW, **monitor_kw)], name=name)
    return records


def test_a_window_outgrowing_the_row_buffer_or_overflowing_records_loses_nothing_silently(tmp_path, monkeypatch):
    reference = _records_of(tmp_path, "reference")
    assert [(r["step"], r["kind"]) for r in reference] == [(30, "grad_norm"), (31, "loss")]  # two spikes, two steps
    first_size = SpikeMonitor._row_buffer
    # A buffer of 2 rows at fit start, one window of 40 steps: it doubles as they arrive (2, 4, ..., 64), the spikes'
    # rows (30, 31) copied along.
    monkeypatch.setattr(SpikeMonitor, "_row_buffer", lambda self, cap, device: first_size(self, cap if self._rows else 2, device))
    assert _records_of(tmp_path, "grown", every_n_steps=1000) == reference
    monkeypatch.undo()
    # More steps without a logging step than the device keeps: read early, the same records.
    monkeypatch.setattr(spike, "_MAX_ROWS", 4)
    assert _records_of(tmp_path, "early", every_n_steps=1000) == reference
    monkeypatch.undo()
    # More spikes in a window than max_records: the first ones recorded, all counted, and a warning says so.
    with pytest.warns(UserWarning, match="recorded the first 1"):
        capped = _records_of(tmp_path, "capped", max_records=1, every_n_steps=1000)
    assert len(reference) > 1 and capped == reference[:1]
