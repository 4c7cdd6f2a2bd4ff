"""Fused LayerNorm on the torch (CPU) backend, what is LayerNorm's own: its compiled CPU kernels (exact constant
rows, the weight gradient, the size threshold, other residual dtypes) and their build and cache, multi-dim shapes and
CPU autocast, backend resolution, swap, docstrings. Both norms' numerics against float64 on every eager path,
parametrised over the kind: test_norm_numerics.py; both norms' modules as drop-ins (state_dict, fused add, swap
after convert): test_norm_modules.py.

The Triton kernels are tested under the interpreter in tests/test_norm_triton.py; the ops' opcheck and
torch.compile, for both norms, in tests/test_norm_compile.py.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from ln_lightning import LNLightningWarning
import torch
import torch.nn.functional as F
from torch import nn

from _helpers_norm_cases import compiled_cpu_kernels
from _helpers_norm_paths import forced_path
from ln_lightning.testing.norm import Case, assert_within_torch_error, layer_norm_formula, rel_err
from ln_lightning.norm import (
    FusedAddLayerNorm,
    FusedLayerNorm,
    fused_add_layer_norm,
    norm_backend,
    swap_layernorms,
    unswap_layernorms,
)
from ln_lightning.norm import _backend, _cpu_kernels, _extension, _torch_ops, functional


# --------------------------------------------------------------------------- compiled CPU kernels

@pytest.fixture
def compiled_backward_calls(monkeypatch):
    """The compiled kernels, built (or the test skipped), and a list that grows by one per
    compiled backward pass: proof that a test's computation actually ran on them."""
    compiled_cpu_kernels()
    calls = []
    real = _torch_ops._compiled_backward
    monkeypatch.setattr(_torch_ops, "_compiled_backward", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.fixture
def aten_kernels():
    """Run the torch backend on aten's kernels only (as when the compiled kernels can't build)."""
    with _cpu_kernels.KERNELS.disabled():
        yield


@pytest.fixture
def path(request, monkeypatch):
    """The eager path ``request.param`` forced (tests/_helpers_norm_paths.py): yields its name and the
    compiled-kernel calls it makes."""
    with forced_path(request.param, monkeypatch) as calls:
        yield request.param, calls


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: a few ulps of its 8-bit mantissa


@pytest.mark.parametrize("case", [
    Case(6, 257, torch.bfloat16, True, "full", 1e4, 2, False, 11),  # offset, constant rows
    Case(3, 64, torch.bfloat16, True, "no_bias", 0.0, 1, True, 12),  # float32 stream
    Case(4, 1, torch.bfloat16, True, "full", 0.0, 0, False, 13),  # hidden 1
    Case(2, 300, torch.bfloat16, False, "none", 0.0, 1, True, 14),  # float32 stream from None
    Case(5, 33, torch.bfloat16, False, "full", 3.0, 0, False, 15),  # plain, through the op
])
def test_compiled_cpu_kernels_within_torch_error_and_exact_on_constant_rows(case, compiled_backward_calls, monkeypatch):
    monkeypatch.setattr(functional, "EAGER_COMPOSITE_BELOW", 0)
    monkeypatch.setattr(functional, "PLAIN_LAYER_NORM_VIA_ATEN", False)
    assert_within_torch_error(case, backend="torch", exact_constant_rows=True)
    assert compiled_backward_calls, "the compiled kernels were not used"


@pytest.mark.parametrize("case", [
    Case(6, 257, torch.bfloat16, True, "full", 1e4, 2, False, 21),
    Case(3, 64, torch.bfloat16, True, "no_bias", 0.0, 1, True, 22),
])
def test_aten_fallback_within_torch_error(case, aten_kernels, monkeypatch):
    monkeypatch.setattr(functional, "EAGER_COMPOSITE_BELOW", 0)
    assert_within_torch_error(case, backend="torch")


def test_compiled_cpu_kernels_weight_gradient_is_float32_accurate(monkeypatch):
    # aten's bfloat16 CPU kernel loses most of the weight gradient's precision over many rows;
    # the compiled kernel accumulates in float32. Independent reference: float64 autograd on the
    # same bfloat16 stream h (the input both kernels normalise).
    compiled_cpu_kernels()
    monkeypatch.setattr(functional, "EAGER_COMPOSITE_BELOW", 0)
    g = torch.Generator().manual_seed(0)
    rows, hidden = 2048, 256
    h = (torch.randn(rows, hidden, generator=g) + 3).bfloat16()
    gy = torch.randn(rows, hidden, generator=g).bfloat16()
    w, b = torch.randn(hidden, generator=g).bfloat16(), torch.randn(hidden, generator=g).bfloat16()

    def grads(fn, *inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        return torch.autograd.grad([fn(*leaves)], leaves, [gy.to(leaves[0].dtype)])

    plain = lambda h, w, b: F.layer_norm(h, (hidden,), w, b)
    ref = grads(plain, *(t.double() for t in (h, w, b)))
    ours = grads(lambda h, w, b: fused_add_layer_norm(h, torch.zeros_like(h), w, b, backend="torch")[0], h, w, b)
    aten = grads(plain, h, w, b)
    rel = lambda a, ref: ((a.double() - ref).abs().max() / ref.abs().max()).item()
    errors = {name: (rel(o, e), rel(a, e)) for name, o, a, e in zip(("dh", "dweight", "dbias"), ours, aten, ref)}
    for name, (o, a) in errors.items():
        assert o < 1e-2 and o <= a, (name, errors)
    assert errors["dweight"][0] < errors["dweight"][1] / 4 and errors["dbias"][0] < errors["dbias"][1] / 4, errors


def test_fused_layernorm_bf16_cpu_large_uses_compiled_kernels_small_is_exactly_aten(compiled_backward_calls):
    ref = nn.LayerNorm(256, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ln = FusedLayerNorm.from_layernorm(ref)
    g = torch.Generator().manual_seed(3)
    small = torch.randn(functional.COMPILED_CPU_FROM // 256 - 1, 256, generator=g).bfloat16()
    assert torch.equal(ln(small), ref(small))  # below the threshold: F.layer_norm itself
    big = (torch.randn(2048, 256, generator=g) + 3).bfloat16()
    gy = torch.randn(2048, 256, generator=g).bfloat16()
    outs = {}
    for name, mod in (("ours", ln), ("aten", ref)):
        xx = big.clone().requires_grad_()
        y = mod(xx)
        outs[name] = (y, *torch.autograd.grad([y], [xx, ref.weight, ref.bias], [gy]))
    assert compiled_backward_calls, "FusedLayerNorm did not run the compiled kernels"
    # Forward: the same function; at most 1 bfloat16 ulp apart (different float32 summation order).
    torch.testing.assert_close(outs["ours"][0], outs["aten"][0], rtol=2**-7, atol=2**-7)
    xd = big.double().requires_grad_()
    wd, bd = ref.weight.double().detach().requires_grad_(), ref.bias.double().detach().requires_grad_()
    exact = torch.autograd.grad([F.layer_norm(xd, (256,), wd, bd)], [xd, wd, bd], [gy.double()])
    rel = lambda a, e: ((a.double() - e).abs().max() / e.abs().max()).item()
    for i, name in ((1, "dx"), (2, "dweight"), (3, "dbias")):
        assert rel(outs["ours"][i], exact[i - 1]) <= rel(outs["aten"][i], exact[i - 1]) + 1e-6, name


@pytest.mark.parametrize("residual_dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("residual_in_fp32", [False, True])
@pytest.mark.parametrize("path", ["compiled", "composite"], indirect=True)
def test_bf16_input_with_other_residual_dtypes(residual_dtype, residual_in_fp32, path):
    # Forward and backward must pick the same kernel (their mean/rstd differ in meaning); the
    # stream has the promoted dtype (float32 with residual_in_fp32) and the result is the float64
    # formula's to bfloat16 precision. The offset makes mismatched statistics show.
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(4, 40, generator=g) + 3).bfloat16()
    r = torch.randn(4, 40, generator=g).to(residual_dtype)
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    gy = torch.randn(4, 40, generator=g)
    hdt = torch.float32 if residual_in_fp32 else torch.promote_types(torch.bfloat16, residual_dtype)
    gh = torch.randn(4, 40, generator=g).to(hdt)

    leaves = _leaves(x, r, w, b)
    y, h = fused_add_layer_norm(*leaves, residual_in_fp32=residual_in_fp32, backend="torch")
    assert h.dtype == hdt and y.dtype == torch.bfloat16
    ours = (y, h, *torch.autograd.grad([y, h], leaves, [gy.bfloat16(), gh]))
    ref = _leaves(*(t.double() for t in (x, r, w, b)))
    h64 = ref[0] + ref[1]
    y64 = layer_norm_formula(h64, (40,), ref[2], ref[3])
    want = (y64, h64, *torch.autograd.grad([y64, h64], ref, [gy.bfloat16().double(), gh.double()]))
    for a, e in zip(ours, want):
        torch.testing.assert_close(a.double(), e, rtol=2e-2, atol=2e-2)


def test_cpu_kernel_build_failure_warns_once_and_falls_back(monkeypatch):
    def broken():
        raise OSError("no C++ compiler found")

    real = _cpu_kernels.KERNELS
    unbuildable = _extension.CompiledKernels(real.name, real.source, real.what, real.fallback, real.fallback_choice,
                                             build=broken)
    monkeypatch.setattr(_cpu_kernels, "KERNELS", unbuildable)
    monkeypatch.setattr(functional, "EAGER_COMPOSITE_BELOW", 0)
    x = torch.randn(3, 16).bfloat16().requires_grad_()
    r = torch.randn(3, 16).bfloat16()
    with pytest.warns(LNLightningWarning, match="no C\\+\\+ compiler found.*pip install ninja.*LN_LIGHTNING_CPU_KERNELS=0"):
        y, h = fused_add_layer_norm(x, r, None, None, backend="torch")
    assert unbuildable.state == "failed" and unbuildable.failure.startswith("OSError")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call says nothing more
        y2, _ = fused_add_layer_norm(x, r, None, None, backend="torch")
    torch.testing.assert_close(y, F.layer_norm(x + r, (16,)), rtol=0, atol=0)
    y.float().sum().backward()
    assert x.grad is not None


def test_cpu_kernel_build_retries_without_openmp(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: a finished build would load directly
    calls = []

    def fake_load(name, sources, extra_cflags, extra_ldflags=(), verbose=False):
        calls.append((name, list(extra_cflags)))
        if "-fopenmp" in extra_cflags:
            raise RuntimeError("clang: error: unsupported option '-fopenmp'")
        return "serial module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert _cpu_kernels.KERNELS.build() == "serial module"
    assert "-fopenmp" in calls[0][1] and "-fopenmp" not in calls[1][1]
    assert calls[1][0] == calls[0][0] + "_serial"  # never the same cache entry as the OpenMP build


def test_a_lock_left_by_a_killed_build_is_removed_and_said_so(tmp_path, caplog):
    # torch's build lock holds no process id: a process killed while it compiled leaves it, and torch waits forever.
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 2 * _extension.STALE_LOCK_S
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger=_extension.__name__):
        _extension._clear_stale_lock(tmp_path)
    assert not lock.exists() and "did not finish" in caplog.text


def test_a_live_builds_lock_is_waited_for_and_left_to_it(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.touch()
    release = threading.Timer(0.5, lock.unlink)  # the other process's build ends
    start = time.monotonic()
    release.start()
    with caplog.at_level(logging.WARNING, logger=_extension.__name__):
        _extension._clear_stale_lock(tmp_path)
    release.join()
    assert time.monotonic() - start >= 0.45 and "did not finish" not in caplog.text


def test_cpu_kernels_env_switch_disables_without_warning(monkeypatch):
    monkeypatch.setenv(_extension.ENV_VAR, "0")
    built = []
    kernels = _extension.CompiledKernels("unused", _cpu_kernels.KERNELS.source, "LayerNorm", "-", "-",
                                         build=lambda: built.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.module() is None
    assert kernels.failure == f"{_extension.ENV_VAR}=0" and kernels.state == "disabled" and not built


def test_cpu_kernels_switched_off_for_a_block_and_back():
    mod = compiled_cpu_kernels()
    with _cpu_kernels.KERNELS.disabled():
        assert _cpu_kernels.KERNELS.module() is None and "disabled()" in _cpu_kernels.KERNELS.failure
        assert not functional.uses_compiled_cpu_kernels(torch.zeros(1 << 16, dtype=torch.bfloat16))
    assert _cpu_kernels.KERNELS.module() is mod and _cpu_kernels.KERNELS.failure is None


# aten's F.layer_norm itself for the plain module, the composition, the autograd.Function on aten's kernels (in float32
# with the compiled ones on, which run bfloat16 only; in bfloat16 with them off) and on the compiled kernels.
@pytest.mark.parametrize("path, dtype", [
    ("shortcut", torch.float32), ("composite", torch.float32), ("compiled", torch.float32), ("aten", torch.bfloat16),
    ("compiled", torch.bfloat16),
], indirect=["path"])
def test_multi_dim_normalized_shape(path, dtype):
    _, calls = path
    g = torch.Generator().manual_seed(1)
    ref = nn.LayerNorm((4, 6))
    nn.init.normal_(ref.weight, generator=g)
    nn.init.normal_(ref.bias, generator=g)
    ln, add = FusedLayerNorm((4, 6), dtype=dtype), FusedAddLayerNorm((4, 6), dtype=dtype)
    ln.load_state_dict(ref.state_dict())
    add.load_state_dict(ref.state_dict())
    x, r = (torch.randn(3, 4, 6, generator=g).to(dtype) for _ in range(2))
    w64, b64 = ref.weight.detach().to(dtype).double(), ref.bias.detach().to(dtype).double()
    plain = layer_norm_formula(x.double(), (4, 6), w64, b64)
    assert rel_err(ln(x), plain) < _tol(dtype)
    y, h = add(x, r)
    assert rel_err(y, layer_norm_formula(x.double() + r.double(), (4, 6), w64, b64)) < _tol(dtype)
    assert torch.equal(h, x + r)
    # The gradients of the flattened (rows, 24) op, reshaped back.
    xx = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(ln(xx).square().sum(), [xx])
    x64 = x.double().requires_grad_()
    (dx64,) = torch.autograd.grad(layer_norm_formula(x64, (4, 6), w64, b64).square().sum(), [x64])
    assert dx.shape == x.shape and rel_err(dx, dx64) < _tol(dtype)
    if calls:  # the compiled path ran them for both modules
        assert calls.count("forward") == 3 and calls.count("backward") == 1


def test_from_layernorm_shares_parameters_and_hooks():
    ref = nn.LayerNorm(8)
    calls = []
    handle = ref.register_forward_hook(lambda m, i, o: calls.append(1))
    fused = FusedLayerNorm.from_layernorm(ref, backend="torch")
    assert fused.weight is ref.weight and fused.bias is ref.bias
    assert fused.backend == "torch" and "backend" not in fused.state_dict()
    fused(torch.randn(2, 8))
    assert calls == [1]
    handle.remove()
    fused(torch.randn(2, 8))
    assert calls == [1]
    with pytest.raises(TypeError, match="nn.LayerNorm"):
        FusedLayerNorm.from_layernorm(nn.Linear(2, 2))


@pytest.mark.parametrize("path", ["shortcut", "compiled"], indirect=True)
def test_cpu_autocast_keeps_nn_layernorms_dtypes(path):
    # CPU autocast leaves layer_norm alone (unlike CUDA's, which runs it in float32): nn.LayerNorm's
    # dtypes under it are the reference; the values are checked against the float64 formula.
    g = torch.Generator().manual_seed(2)
    ref = nn.LayerNorm(16)
    nn.init.normal_(ref.weight, generator=g)
    ln = FusedLayerNorm.from_layernorm(ref)
    x, r = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    w64, b64 = ref.weight.detach().double(), ref.bias.detach().double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for inp in (x, x.bfloat16()):
            out = ln(inp)
            assert out.dtype == ref(inp).dtype
            assert rel_err(out, layer_norm_formula(inp.double(), (16,), w64, b64)) < _tol(out.dtype)
        y, h = fused_add_layer_norm(x.bfloat16(), r.bfloat16(), ref.weight, ref.bias, backend="torch")
        assert y.dtype == ref(x.bfloat16() + r.bfloat16()).dtype and h.dtype == torch.bfloat16
    assert rel_err(y, layer_norm_formula(h.double(), (16,), w64, b64)) < 1e-2


# --------------------------------------------------------------------------- errors and backends

@pytest.mark.skipif(_backend.TRITON_INTERPRET, reason="the interpreter makes triton usable on CPU")
def test_forced_triton_on_cpu_raises_instead_of_falling_back():
    with pytest.raises(RuntimeError, match="backend 'triton' was requested but cannot run"):
        with norm_backend("triton"):
            FusedLayerNorm(8)(torch.randn(2, 8))
    ln = FusedLayerNorm(8)
    ln.backend = "torch"
    with norm_backend("triton"):  # the module's own choice wins over the context
        ln(torch.randn(2, 8))


def test_backend_resolution():
    x = torch.randn(2, 4)
    assert _backend.resolve_backend(x) == "torch"
    assert _backend.resolve_backend(x, "torch") == "torch"
    assert _backend.canonical_backend("CPU") == "torch"
    with norm_backend("torch"):
        assert _backend.requested_backend() == "torch"
    assert _backend.resolve_backend(x.double(), "auto") == "torch"
    with pytest.raises(ValueError, match="unknown LayerNorm backend"):
        with norm_backend("fast"):
            pass


@pytest.mark.slow
def test_environment_variable_sets_the_default_backend():
    code = (
        "import torch; from ln_lightning.norm import _backend; "
        "print(_backend.requested_backend(), _backend.resolve_backend(torch.randn(2, 2)))"
    )
    env = {**__import__("os").environ, "LN_LIGHTNING_NORM_BACKEND": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.stdout.split() == ["torch", "torch"], proc.stderr
    env["LN_LIGHTNING_NORM_BACKEND"] = "fastest"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "unknown LayerNorm backend 'fastest'" in proc.stderr


@pytest.mark.slow
def test_import_needs_neither_triton_nor_cuda():
    code = textwrap.dedent(
        """
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError("No module named 'triton' (blocked for this test)")
        sys.meta_path.insert(0, _Block())
        import torch
        from torch import nn
        import ln_lightning.norm as n
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        print(n.swap_layernorms(model))
        y = model(torch.randn(2, 8, requires_grad=True)).sum()
        y.backward()
        out, res = n.fused_add_layer_norm(torch.randn(2, 8), torch.randn(2, 8), None, None)
        assert "triton" not in sys.modules, "triton was imported"
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


# --------------------------------------------------------------------------- swap

class _KeepsInit(nn.LayerNorm):
    def __init__(self, d):
        super().__init__(d, eps=1e-6)


class _OwnForward(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.float()).type_as(x)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        _KeepsInit(16),
        _OwnForward(16),
        nn.Linear(16, 16),
        nn.LayerNorm(16, bias=False),
    )
    model[4].weight.requires_grad_(False)
    return model


def test_swap_keeps_parameters_optimizer_and_results():
    model = _model()
    reference = copy.deepcopy(model)
    params_before = {n: p for n, p in model.named_parameters()}
    keys_before = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    report = swap_layernorms(model, backend="torch")
    assert report.swapped == ["0.norm1", "0.norm2", "1", "4"]
    assert [s.path for s in report.skipped] == ["2"] and "overrides forward" in report.skipped[0].reason
    assert type(model[0].norm1) is FusedLayerNorm and model[0].norm1.backend == "torch"
    assert isinstance(model[1], FusedLayerNorm) and isinstance(model[1], _KeepsInit) and model[1].eps == 1e-6
    assert type(model[2]) is _OwnForward
    for n, p in model.named_parameters():
        assert p is params_before[n], n
    assert not model[4].weight.requires_grad
    assert list(model.state_dict()) == keys_before
    x = torch.randn(2, 5, 16)
    norm_weight_before = model[0].norm1.weight.detach().clone()
    for _ in range(2):
        for m, o in ((model, opt), (reference, opt_ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    # The optimizer built before the swap trained the swapped norms, exactly as on nn.LayerNorm.
    assert not torch.equal(model[0].norm1.weight, norm_weight_before)
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)
    reference.load_state_dict(model.state_dict(), strict=True)


def test_swap_report_revert_and_unswap():
    model = _model()
    report = swap_layernorms(model)
    text = str(report)
    assert "4 swapped, 1 skipped" in text and "0.norm1" in text and "overrides forward" in text
    d = report.to_dict()
    assert d["swapped"] == report.swapped and d["skipped"][0]["path"] == "2"
    report.revert()
    assert type(model[0].norm1) is nn.LayerNorm and type(model[1]) is _KeepsInit
    assert report.to_dict()["reverted"]
    swap_layernorms(model)
    undone = unswap_layernorms(model)
    assert undone.swapped == ["0.norm1", "0.norm2", "1", "4"]
    assert not any(isinstance(m, FusedLayerNorm) for m in model.modules())
    # root module, shared module, already fused
    ln = nn.LayerNorm(4)
    assert swap_layernorms(ln).swapped == [""] and type(ln) is FusedLayerNorm
    again = swap_layernorms(ln)
    assert again.swapped == [] and "already fused" in again.skipped[0].reason


def test_swap_keeps_hooks():
    model = nn.Sequential(nn.LayerNorm(6))
    seen = []
    handle = model[0].register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    report = swap_layernorms(model)
    assert report.with_hooks == ["0"]
    model(torch.randn(1, 6))
    assert seen == ["FusedLayerNorm"]
    handle.remove()
    model(torch.randn(1, 6))
    assert seen == ["FusedLayerNorm"]


@pytest.mark.skipif(_backend.TRITON_INTERPRET, reason="the interpreter makes triton usable on CPU")
def test_swap_skips_what_the_forced_backend_cannot_take():
    model = nn.Sequential(nn.LayerNorm(6), nn.LayerNorm(6, dtype=torch.float64))
    report = swap_layernorms(model, backend="triton")
    assert report.swapped == []
    reasons = {s.path: s.reason for s in report.skipped}
    assert "float64" in reasons["1"] and ("CUDA" in reasons["0"] or "triton" in reasons["0"])


def test_swap_skips_parametrized_modules_and_rejects_non_modules():
    model = nn.Sequential(nn.LayerNorm(6))
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", nn.Identity())
    report = swap_layernorms(model)
    assert report.swapped == [] and "parametrized" in report.skipped[0].reason
    with pytest.raises(TypeError, match="nn.Module"):
        swap_layernorms(torch.randn(3))


def test_swapped_model_pickles():
    import io

    model = _model()
    swap_layernorms(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(loaded(x), model(x))


def test_docstring_examples_run():
    import doctest

    from ln_lightning.norm import _backend as backend_module
    from ln_lightning.norm import modules, swap

    for module in (functional, modules, swap, backend_module):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, (module.__name__, result)
