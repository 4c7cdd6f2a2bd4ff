#!/usr/bin/env python
"""Compile every Triton kernel of the package ahead of time for real GPU targets, without a GPU.

The Triton interpreter (``TRITON_INTERPRET=1``, the CPU tests) never compiles the kernels, so it
cannot see what breaks on a GPU: lowering errors, register spills, shared-memory overflows,
launches a target cannot take. This script compiles each kernel with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` at every launch the
package's dispatch can choose, reads the cubin's resources with ``cuobjdump --dump-resource-usage``
(shipped in the triton wheel), and prints

1. a resource table: kernel, target, launch config (width bucket, block, warps), registers per
   thread, spills (local memory / stack), shared memory, occupancy, compile time;
2. a roofline table: the bytes each kernel must move at 16384x4096 and the benchmark shapes of
   ``benchmarks/bench_norm.py`` / ``gpu_norm_check.py``, and the time that implies at the H200's
   and the A100's copy bandwidth (the number a GPU run is compared with).

Exit status: 0 when everything compiled for every target with no spill and every launch fits the
target (occupancy above zero); 1 otherwise (every failure is listed, nothing is dropped); 2 for a
usage error (e.g. no cuobjdump).

Coverage. The launches come from the package itself: each registered kernel's ``cases`` function
calls the runtime's planning code (``_triton_ops.plan_forward`` / ``plan_backward`` for LayerNorm,
``_triton_rms.plan_forward`` / ``plan_backward`` for RMSNorm: the functions the ops call before
launching) on small CPU tensors, and the argument specialisation (dtypes,
16-byte divisibility, ints equal to 1) is computed by Triton's own JIT binder, as at a real launch.
Width buckets are found by asking the dispatch (``forward_launch_config`` /
``backward_launch_config``) about every width 1..65536, so a changed heuristic is covered without
editing this file. ``--subset ci`` compiles, for sm_80, sm_90 and sm_100, every bucket and dtype
with the common fused call (LayerNorm: fused add, weight and bias, gradients; RMSNorm: fused add,
weight, llama cast order, one dtype per bucket cycling fp32/fp16/bf16; 360 binaries, about 85 s
on 2 cores). ``--subset full`` (sm_80 and sm_90 by default: 3126 LayerNorm binaries, about 20
minutes, and about 3550 RMSNorm ones, 13 minutes) adds every call pattern (residual /
residual_in_fp32 / affine / autocast / frozen parameters; for RMSNorm the weight's dtype, the cast
order and the weight offset) and the specialisation variants (unaligned widths, rows_per_program
== 1 or a multiple of 16, width 1).

Adding a kernel (as the RMSNorm kernels of ``ln_lightning/norm/_triton_rms.py`` were): give its module
``plan_*`` functions returning a ``KernelLaunch`` as ``_triton_ops`` does, write a ``cases()``
generator yielding :class:`Case` objects from them (see ``layer_norm_forward_cases``) and a
``roofline(rows, cols, dtype, programs)`` function returning ``{label: bytes}``, and append one
:class:`KernelEntry` to ``REGISTRY``. Nothing else changes: compilation, resource reading, failure
rules and both tables work per entry.

Examples::

    python benchmarks/triton_aot.py                       # CI subset, sm_80 + sm_90 + sm_100
    python benchmarks/triton_aot.py --subset full         # every launch, sm_80 + sm_90
    python benchmarks/triton_aot.py --subset full --targets 100
    python benchmarks/triton_aot.py --targets 90 --kernels layer_norm_bwd --per-variant
    python benchmarks/triton_aot.py --set MAX_SINGLE_BLOCK=32768   # what if: evaluate a heuristic
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

# The interpreter replaces @triton.jit functions by Python ones that cannot be compiled; it is only
# read when triton is first imported, so it must go before that.
if os.environ.pop("TRITON_INTERPRET", "0") not in ("", "0"):
    print("note: TRITON_INTERPRET ignored: this script compiles the kernels", file=sys.stderr)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

# --------------------------------------------------------------------------- targets

K = 1024


@dataclass(frozen=True)
class Target:
    """A GPU architecture and the per-SM limits that decide occupancy (CUDA C Programming Guide,
    "Technical Specifications per Compute Capability")."""

    arch: int  # compute capability as Triton spells it: 80, 90, 100
    gpus: str
    max_warps_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int  # bytes of shared memory the blocks of one SM can share
    smem_per_block: int  # the most one block may use (opt-in)
    regs_per_sm: int = 64 * K
    max_threads_per_block: int = 1024
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of this
    warp_alloc_granularity: int = 4
    reserved_smem_per_block: int = 1 * K  # the CUDA runtime's per-block reservation (sm_80+)

    @property
    def name(self) -> str:
        return f"sm_{self.arch}"


TARGETS = {
    80: Target(80, "A100", 64, 32, 164 * K, 163 * K),
    90: Target(90, "H100/H200", 64, 32, 228 * K, 227 * K),
    100: Target(100, "B200", 64, 32, 228 * K, 227 * K),
}
CI_TARGETS = (80, 90, 100)
FULL_TARGETS = (80, 90)  # the full sweep's default: about 10 minutes per target on 2 cores

# Copy bandwidth (bytes read + written per second) for the roofline.
# H200: the device-to-device copy measured on the H200 once lent to this project.
# A100-SXM4-80GB: NVIDIA's datasheet peak is 2039 GB/s; the H200's measured copy is 4.3/4.8 = 90%
# of its datasheet peak, and the same fraction is assumed here (1.83 TB/s; not measured).
BANDWIDTH = {"H200": 4.3e12, "A100": 2039e9 * 4.3 / 4.8}
SMS = {"H200": 132, "A100": 108}  # for the backward's per-program partials

# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Case:
    """One launch the package can make, to be compiled for every target."""

    kernel: str  # the registry entry's name
    variant: str  # the call it stands for, e.g. "bf16 add w+b"
    width: int  # the row width it was planned for
    launch: object  # a KernelLaunch (kernel, grid, args, constexprs, config)
    ci: bool = False  # part of the CI subset


@dataclass(frozen=True)
class KernelEntry:
    name: str
    cases: Callable[[bool], Iterator[Case]]  # (full) -> every launch (full=False: the CI variants)
    roofline: Callable[[int, int, torch.dtype, int], dict[str, int]]  # (rows, cols, dtype, programs)


def bucket_widths(launch_config: Callable[[int], object], max_cols: int = 65536) -> dict[object, dict[str, int]]:
    """For each launch config the dispatch picks for widths 1..max_cols: representative widths.

    ``aligned``: the widest multiple of 16 (Triton specialises 16-divisible ints: vector loads);
    ``unaligned``: the widest other width; ``one``: width 1 (ints equal to 1 become constants).
    """
    buckets: dict[object, dict[str, int]] = {}
    for n in range(1, max_cols + 1):
        reps = buckets.setdefault(launch_config(n), {})
        reps["aligned" if n % 16 == 0 else "one" if n == 1 else "unaligned"] = n
    return buckets


def primary_width(reps: dict[str, int]) -> str:
    """The representative the CI subset compiles: the common, vectorised case where the bucket has
    one (buckets narrower than 16 have only unaligned widths, or only width 1)."""
    return next(kind for kind in ("aligned", "unaligned", "one") if kind in reps)


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (residual given, residual_in_fp32, residual dtype: "x" or "fp32"): the fused-add variants a
# model can call. With residual_in_fp32 the first block's stream still has x's dtype
# ("add+res_fp32(first)"); every later block's stream is float32 ("add+res_fp32").
RESIDUAL_MODES = {
    "ln": (False, False, None),
    "ln+res_fp32": (False, True, None),
    "add": (True, False, "x"),
    "add+res_fp32(first)": (True, True, "x"),
    "add+res_fp32": (True, True, "fp32"),
}
AFFINES = {"none": (False, False), "w": (True, False), "w+b": (True, True), "b": (False, True)}


def _layer_norm_calls(full: bool) -> Iterator[tuple[str, bool, dict]]:
    """(label, ci, call options) of the forward calls the sweep makes, before widths."""
    for dname, dtype in DTYPES.items():
        for rname, (has_res, res_fp32, rdt) in RESIDUAL_MODES.items():
            for aname, (has_w, has_b) in AFFINES.items():
                ci = rname == "add" and aname == "w+b"
                if not (full or ci):
                    continue
                amps = [False, True] if (dtype != torch.float32 and aname == "w+b" and rname == "add") else [False]
                for autocast in amps:
                    if autocast and not full:
                        continue
                    label = f"{dname} {rname} {aname}" + (" autocast" if autocast else "")
                    yield label, ci and not autocast, dict(
                        dtype=dtype, residual=has_res, residual_in_fp32=res_fp32,
                        residual_dtype=torch.float32 if rdt == "fp32" else dtype,
                        weight=has_w, bias=has_b,
                        # CUDA autocast: float32 parameters (the module's), float32 output
                        param_dtype=torch.float32 if autocast else dtype, y_fp32=autocast,
                    )


def _plan_forward_call(ops, rows: int, n: int, call: dict):
    dtype = call["dtype"]
    x = torch.empty(rows, n, dtype=dtype)
    r = torch.empty(rows, n, dtype=call["residual_dtype"]) if call["residual"] else None
    w = torch.empty(n, dtype=call["param_dtype"]) if call["weight"] else None
    b = torch.empty(n, dtype=call["param_dtype"]) if call["bias"] else None
    outputs, launch = ops.plan_forward(x, r, w, b, 1e-5, call["residual_in_fp32"], call["y_fp32"])
    return x, w, b, outputs, launch


def layer_norm_forward_cases(full: bool) -> Iterator[Case]:
    from ln_lightning.norm import _triton_ops as ops

    for reps in bucket_widths(ops.forward_launch_config).values():
        for label, ci, call in _layer_norm_calls(full):
            primary = primary_width(reps)
            kinds = [k for k in ("aligned", "unaligned", "one") if k in reps] if (full and ci) else [primary]
            for kind in kinds:
                n = reps[kind]
                *_, launch = _plan_forward_call(ops, 1, n, call)
                yield Case("layer_norm_fwd", label + ("" if kind == "aligned" else f" [{kind} width]"), n, launch, ci and kind == primary)


def layer_norm_backward_cases(full: bool) -> Iterator[Case]:
    """The backward of each forward call, as ``_common._backward`` calls it."""
    from ln_lightning.norm import _triton_ops as ops

    # rows -> rows_per_program on the planning device (CPU: min(rows, 4) programs): 8 -> 2 (the
    # common case), 1 -> 1 (a constant to Triton), 64 -> 16 (16-divisible); on a GPU the same three
    # specialisations occur (programs = SMs x BWD_PROGRAMS_PER_SM).
    for reps in bucket_widths(ops.backward_launch_config).values():
        for label, ci, call in _layer_norm_calls(full):
            grad_modes = [True, False] if (full and (call["weight"] or call["bias"])) else [True]
            for grads in grad_modes:
                primary = primary_width(reps)
                variants = [(primary, 8)]
                if full and ci and grads:
                    variants += [(k, 8) for k in ("aligned", "unaligned", "one") if k in reps and k != primary]
                    variants += [(primary, 1), (primary, 64)]
                for kind, rows in variants:
                    n = reps[kind]
                    x, w, b, (y, h, mean, rstd), _ = _plan_forward_call(ops, rows, n, call)
                    stored = h.numel() > 0
                    dy = torch.empty_like(y)
                    dres = torch.empty_like(h) if stored else None
                    _, launch = ops.plan_backward(dy, dres, h if stored else x, mean, rstd, w, b, grads, grads, 1e-5)
                    tag = "" if grads else " frozen"
                    if kind != "aligned":
                        tag += f" [{kind} width]"
                    if rows != 8:
                        tag += f" [rows_per_program={launch.args[-1]}]"
                    yield Case("layer_norm_bwd", label + tag, n, launch, ci and grads and (kind, rows) == (primary, 8))


def _elt(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def layer_norm_forward_roofline(rows: int, cols: int, dtype: torch.dtype, programs: int) -> dict[str, int]:
    """Compulsory DRAM bytes: activations in/out, parameters once, fp32 mean + rstd per row. (Rows
    wider than the single-block bucket re-read their row in a second pass, from L2 when it fits.)"""
    e, act, params, stats = _elt(dtype), rows * cols, 2 * cols * _elt(dtype), 8 * rows
    return {"add+LN fwd (x, r -> y, h)": 4 * act * e + params + stats, "LN fwd (x -> y)": 2 * act * e + params + stats}


def layer_norm_backward_roofline(rows: int, cols: int, dtype: torch.dtype, programs: int) -> dict[str, int]:
    """Compulsory DRAM bytes of the backward and its partial-sum reduction: activations in/out,
    weight, mean/rstd, float32 dweight/dbias partials (one row per program) written, then read and
    summed by torch.sum."""
    e, act, stats = _elt(dtype), rows * cols, 8 * rows
    partials = 2 * (2 * programs * cols * 4 + cols * 4)  # dw and db: write + read partials, write sum
    return {
        "add+LN bwd (dy, h, dh_next -> dh)": 4 * act * e + cols * e + stats + partials,
        "LN bwd (dy, x -> dx)": 3 * act * e + cols * e + stats + partials,
    }


# RMSNorm (ln_lightning/norm/_triton_rms.py): (weight given, cast order, weight dtype: "x" or
# "fp32" or the other reduced dtype). The cast order decides the ROUND constexpr: 0 (none), 1
# (round n to x's dtype: llama, or t5 with a weight of x's dtype), 2 (to the weight's: t5 with a
# reduced weight of another dtype); "offset" is Gemma's (1 + weight), a float argument.
RMS_WEIGHTS = {
    "none": (False, "fp32", "x"),
    "w": (True, "fp32", "x"),
    "w llama": (True, "llama", "x"),
    "w t5": (True, "t5", "x"),
    "w(fp32) llama": (True, "llama", "fp32"),
    "w(fp32) t5": (True, "t5", "fp32"),
    "w(other) t5": (True, "t5", "other"),
}
_OTHER_REDUCED = {torch.float32: torch.bfloat16, torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}


def _rms_calls(full: bool, bucket_index: int) -> Iterator[tuple[str, bool, bool, dict]]:
    """(label, ci, fused, call options) of the RMSNorm forward calls, before widths. ``fused``: the
    common fused call (fused add, weight of x's dtype, llama cast order), whose specialisation
    variants the full sweep compiles in every dtype. The CI subset takes it in one dtype per
    bucket, cycling fp32/fp16/bf16 over the buckets: every bucket and every dtype is compiled at
    a third of the cost (the full sweep takes every dtype in every bucket)."""
    names = list(DTYPES)
    for dname, dtype in DTYPES.items():
        for rname, (has_res, res_fp32, rdt) in RESIDUAL_MODES.items():
            for wname, (has_w, cast, wdt) in RMS_WEIGHTS.items():
                if wdt == "fp32" and dtype == torch.float32:
                    continue  # the same call as "x"
                fused = rname == "add" and wname == "w llama"
                ci = fused and dname == names[bucket_index % len(names)]
                if not (full or ci):
                    continue
                offsets = [0.0, 1.0] if (full and rname == "add" and wname == "w") else [0.0]
                for offset in offsets:
                    label = f"{dname} {rname} {wname}" + (" offset" if offset else "")
                    yield label, ci and not offset, fused and not offset, dict(
                        dtype=dtype, residual=has_res, residual_in_fp32=res_fp32,
                        residual_dtype=torch.float32 if rdt == "fp32" else dtype, weight=has_w, cast=cast,
                        param_dtype={"x": dtype, "fp32": torch.float32, "other": _OTHER_REDUCED[dtype]}[wdt],
                        offset=offset,
                    )


def _plan_rms_forward_call(ops, rows: int, n: int, call: dict):
    dtype = call["dtype"]
    x = torch.empty(rows, n, dtype=dtype)
    r = torch.empty(rows, n, dtype=call["residual_dtype"]) if call["residual"] else None
    w = torch.empty(n, dtype=call["param_dtype"]) if call["weight"] else None
    outputs, launch = ops.plan_forward(x, r, w, 1e-6, call["residual_in_fp32"], call["offset"], call["cast"])
    return x, w, outputs, launch


def rms_norm_forward_cases(full: bool) -> Iterator[Case]:
    from ln_lightning.norm import _triton_rms as ops

    for i, reps in enumerate(bucket_widths(ops.forward_launch_config).values()):
        for label, ci, fused, call in _rms_calls(full, i):
            primary = primary_width(reps)
            kinds = [k for k in ("aligned", "unaligned", "one") if k in reps] if (full and fused) else [primary]
            for kind in kinds:
                n = reps[kind]
                *_, launch = _plan_rms_forward_call(ops, 1, n, call)
                yield Case("rms_norm_fwd", label + ("" if kind == "aligned" else f" [{kind} width]"), n, launch, ci and kind == primary)


def rms_norm_backward_cases(full: bool) -> Iterator[Case]:
    """The backward of each RMSNorm forward call, as ``_common``'s autograd glue calls it."""
    from ln_lightning.norm import _triton_rms as ops

    for i, reps in enumerate(bucket_widths(ops.backward_launch_config).values()):
        for label, ci, fused, call in _rms_calls(full, i):
            grad_modes = [True, False] if (full and call["weight"]) else [True]
            for grads in grad_modes:
                primary = primary_width(reps)
                variants = [(primary, 8)]
                if full and fused and grads:
                    variants += [(k, 8) for k in ("aligned", "unaligned", "one") if k in reps and k != primary]
                    variants += [(primary, 1), (primary, 64)]
                for kind, rows in variants:
                    n = reps[kind]
                    x, w, (y, h, rstd), _ = _plan_rms_forward_call(ops, rows, n, call)
                    stored = h.numel() > 0
                    dy = torch.empty_like(y)
                    dres = torch.empty_like(h) if stored else None
                    _, launch = ops.plan_backward(dy, dres, h if stored else x, rstd, w, call["offset"], grads, 1e-6)
                    tag = "" if grads else " frozen"
                    if kind != "aligned":
                        tag += f" [{kind} width]"
                    if rows != 8:
                        tag += f" [rows_per_program={launch.args[-1]}]"
                    yield Case("rms_norm_bwd", label + tag, n, launch, ci and grads and (kind, rows) == (primary, 8))


def rms_norm_forward_roofline(rows: int, cols: int, dtype: torch.dtype, programs: int) -> dict[str, int]:
    """Compulsory DRAM bytes: activations in/out, the weight once, float32 rstd per row."""
    e, act, stats = _elt(dtype), rows * cols, 4 * rows
    return {"add+RMS fwd (x, r -> y, h)": 4 * act * e + cols * e + stats, "RMS fwd (x -> y)": 2 * act * e + cols * e + stats}


def rms_norm_backward_roofline(rows: int, cols: int, dtype: torch.dtype, programs: int) -> dict[str, int]:
    """Compulsory DRAM bytes of the backward and its dweight reduction: activations in/out, weight,
    rstd, float32 dweight partials (one row per program) written, then read and summed."""
    e, act, stats = _elt(dtype), rows * cols, 4 * rows
    partials = 2 * programs * cols * 4 + cols * 4
    return {
        "add+RMS bwd (dy, h, dh_next -> dh)": 4 * act * e + cols * e + stats + partials,
        "RMS bwd (dy, x -> dx)": 3 * act * e + cols * e + stats + partials,
    }


REGISTRY: list[KernelEntry] = [
    KernelEntry("layer_norm_fwd", layer_norm_forward_cases, layer_norm_forward_roofline),
    KernelEntry("layer_norm_bwd", layer_norm_backward_cases, layer_norm_backward_roofline),
    KernelEntry("rms_norm_fwd", rms_norm_forward_cases, rms_norm_forward_roofline),
    KernelEntry("rms_norm_bwd", rms_norm_backward_cases, rms_norm_backward_roofline),
]

# --------------------------------------------------------------------------- compiling


@dataclass
class Result:
    kernel: str
    target: str
    config: str  # the launch config (width bucket)
    variant: str
    width: int
    launch_config: dict = field(default_factory=dict)  # LaunchConfig's fields
    regs: Optional[int] = None
    stack: Optional[int] = None  # bytes per thread
    local: Optional[int] = None  # bytes per thread of local memory
    spill_stores: int = 0  # bytes, from ptxas -v (Triton's own ptxas flags)
    spill_loads: int = 0
    shared: Optional[int] = None  # bytes per block: static + Triton's dynamic allocation
    blocks_per_sm: Optional[int] = None
    occupancy: Optional[float] = None  # resident warps / the SM's maximum
    limiter: str = ""
    compile_s: float = 0.0
    problems: list[str] = field(default_factory=list)


def config_label(config) -> str:
    kind = "row" if config.single_block else "loop"
    stages = f", {config.num_stages} stages" if config.num_stages else ""
    return f"{kind} block {config.block_n}, {config.num_warps} warps{stages}"


def find_cuobjdump() -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        found = shutil.which("cuobjdump")
        if not found:
            usage_error(f"cuobjdump not found (looked for {path} and on PATH)")
        path = Path(found)
    return path


_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_RESOURCE_LINE = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def cubin_resources(cuobjdump: Path, cubin: bytes, workdir: Path) -> dict[str, dict[str, int]]:
    """``{function: {REG, STACK, SHARED, LOCAL}}`` of a cubin, from ``cuobjdump --dump-resource-usage``."""
    path = workdir / "kernel.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True).stdout
    found = {m[1]: dict(REG=int(m[2]), STACK=int(m[3]), SHARED=int(m[4]), LOCAL=int(m[5])) for m in _RESOURCE_LINE.finditer(out)}
    if not found:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{out}")
    return found


def occupancy(target: Target, regs: int, num_warps: int, shared: int) -> tuple[int, str]:
    """(resident blocks per SM, what limits them): the CUDA occupancy calculator's rules."""
    if num_warps * 32 > target.max_threads_per_block:
        return 0, "threads per block"
    limits = {"warps": target.max_warps_per_sm // num_warps, "blocks": target.max_blocks_per_sm}
    regs_per_warp = math.ceil(regs * 32 / target.reg_alloc_unit) * target.reg_alloc_unit
    warps_by_regs = target.regs_per_sm // regs_per_warp // target.warp_alloc_granularity * target.warp_alloc_granularity
    limits["registers"] = warps_by_regs // num_warps
    smem = shared + target.reserved_smem_per_block
    limits["shared memory"] = 0 if shared > target.smem_per_block else target.smem_per_sm // smem
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


class Compiler:
    def __init__(self, cuobjdump: Path, workdir: Path):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend

        self.triton, self.ASTSource, self.GPUTarget, self.make_backend = triton, ASTSource, GPUTarget, make_backend
        self.cuobjdump, self.workdir = cuobjdump, workdir
        self.backends: dict[int, object] = {}

    def specialise(self, launch, arch: int):
        """(signature, constexprs, attrs) of a launch, as JITFunction.run derives them at launch
        time (same binder, same rules: dtypes, 16-byte divisibility, ints equal to 1)."""
        from triton.runtime.jit import create_function_from_signature

        backend = self.backends.get(arch)
        if backend is None:
            backend = self.backends[arch] = self.make_backend(self.GPUTarget("cuda", arch, 32))
        fn, kwargs = launch.kernel, launch.kwargs()
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*launch.args, **kwargs)
        _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        return signature, constexprs, attrs

    def compile(self, case: Case, target: Target, specialisation) -> Result:
        cfg = case.launch.config
        res = Result(case.kernel, target.name, config_label(cfg), case.variant, case.width, asdict(cfg))
        signature, constexprs, attrs = specialisation
        src = self.ASTSource(case.launch.kernel, signature, constexprs, attrs)
        t0 = time.perf_counter()
        log = io.StringIO()
        try:
            # Triton prints ptxas's -v log when asked: the exact spill stores/loads of this binary.
            with contextlib.redirect_stdout(log):
                compiled = self.triton.compile(src, target=self.GPUTarget("cuda", target.arch, 32), options=cfg.options())
        except Exception as exc:  # noqa: BLE001 - every failure is reported, with its reason
            res.compile_s = time.perf_counter() - t0
            first = str(exc).strip().splitlines()
            res.problems.append(f"compile failed: {type(exc).__name__}: {first[-1] if first else ''}"[:300])
            return res
        res.compile_s = time.perf_counter() - t0
        name = compiled.metadata.name
        usage = cubin_resources(self.cuobjdump, compiled.asm["cubin"], self.workdir).get(name)
        if usage is None:
            res.problems.append(f"cuobjdump lists no function {name}")
            return res
        res.regs, res.stack, res.local = usage["REG"], usage["STACK"], usage["LOCAL"]
        spills = _PTXAS_SPILLS.search(log.getvalue())
        if spills:  # absent on a cache hit (--cache-dir): then STACK/LOCAL alone decide
            res.spill_stores, res.spill_loads = int(spills[1]), int(spills[2])
        res.shared = usage["SHARED"] + compiled.metadata.shared
        res.blocks_per_sm, res.limiter = occupancy(target, res.regs, cfg.num_warps, res.shared)
        res.occupancy = res.blocks_per_sm * cfg.num_warps / target.max_warps_per_sm
        if res.local or res.stack or res.spill_stores:
            res.problems.append(
                f"spills: {res.spill_stores} B spill stores, {res.spill_loads} B spill loads (ptxas), "
                f"{res.stack} B stack, {res.local} B local memory per thread (cuobjdump); {res.regs} registers"
            )
        if res.blocks_per_sm == 0:
            res.problems.append(f"cannot launch: 0 blocks per SM (limited by {res.limiter})")
        return res


# --------------------------------------------------------------------------- reports


def resource_table(results: list[Result]) -> list[str]:
    """One line per (kernel, target, launch config): the worst case over its variants."""
    groups: dict[tuple, list[Result]] = defaultdict(list)
    for r in results:
        groups[(r.kernel, r.target, r.config)].append(r)
    head = f"{'kernel':15} {'target':7} {'launch config (width bucket)':34} {'widths':>13} {'vars':>4} {'regs':>7} {'spill B':>7} {'smem B':>7} {'occupancy (limit)':>24} {'compile s':>9}"
    lines = [head, "-" * len(head)]

    def key(item):
        (kernel, target, _config), rs = item
        return kernel, int(target[3:]), min(r.width for r in rs)

    for (kernel, target, config), rs in sorted(groups.items(), key=key):
        ok = [r for r in rs if r.regs is not None]
        widths = sorted(r.width for r in rs)
        span = f"{widths[0]}-{widths[-1]}" if widths[0] != widths[-1] else str(widths[0])
        if ok:
            regs = sorted({r.regs for r in ok})
            reg_s = f"{regs[0]}-{regs[-1]}" if len(regs) > 1 else str(regs[0])
            worst = min(ok, key=lambda r: r.occupancy)
            occ = f"{worst.occupancy * 100:.0f}% {worst.blocks_per_sm} blk ({worst.limiter})"
            spill = max(r.local + r.stack for r in ok)
            smem = max(r.shared for r in ok)
        else:
            reg_s, occ, spill, smem = "-", "-", "-", "-"
        failed = len(rs) - len([r for r in rs if not r.problems])
        lines.append(
            f"{kernel:15} {target:7} {config:34} {span:>13} {len(rs):>4} {reg_s:>7} {spill:>7} {smem:>7} {occ:>24} {sum(r.compile_s for r in rs):>9.1f}"
            + (f"  FAILED x{failed}" if failed else "")
        )
    return lines


def variant_table(results: list[Result]) -> list[str]:
    lines = [f"{'kernel':15} {'target':7} {'launch config':34} {'width':>6} {'regs':>5} {'spill':>5} {'smem':>6} {'occ':>5} {'s':>5}  variant"]
    for r in results:
        occ = f"{r.occupancy * 100:.0f}%" if r.occupancy is not None else "-"
        lines.append(
            f"{r.kernel:15} {r.target:7} {r.config:34} {r.width:>6} {r.regs if r.regs is not None else '-':>5} "
            f"{(r.local or 0) + (r.stack or 0):>5} {r.shared if r.shared is not None else '-':>6} {occ:>5} {r.compile_s:>5.2f}  {r.variant}"
            + (f"  <- {'; '.join(r.problems)}" if r.problems else "")
        )
    return lines


# gpu_norm_check.py times 16384x4096 bf16; bench_norm.py's CUDA default sweep is these shapes.
ROOFLINE_SHAPES = [(16384, 4096)] + [(rows, cols) for rows in (4096, 8192, 16384) for cols in (768, 1024, 4096, 8192)]


def roofline_table(entries: list[KernelEntry], dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Every kernel at the first shape; at the others the forward + backward sums only."""
    from ln_lightning.norm import _triton_ops as ops

    head = f"{'shape':>11} {'dtype':5} {'kernel':34} {'MB moved':>9} {'H200 us':>8} {'A100 us':>8}"
    lines = [head, "-" * len(head)]
    for i, (rows, cols) in enumerate(dict.fromkeys(ROOFLINE_SHAPES)):
        moved = {}
        for gpu in ("H200", "A100"):
            programs = min(rows, SMS[gpu] * ops.BWD_PROGRAMS_PER_SM)
            moved[gpu] = {k: v for e in entries for k, v in e.roofline(rows, cols, dtype, programs).items()}
        # "<op> fwd (...)" + "<op> bwd (...)" -> "<op> fwd+bwd": what a training step pays
        for gpu in moved:
            for label in list(moved[gpu]):
                op, _, rest = label.partition(" fwd")
                bwd = next((k for k in moved[gpu] if k.startswith(op + " bwd")), None) if rest else None
                if bwd:
                    moved[gpu][f"{op} fwd+bwd"] = moved[gpu][label] + moved[gpu][bwd]
        labels = list(moved["H200"]) if i == 0 else [k for k in moved["H200"] if k.endswith("fwd+bwd")]
        for label in labels:
            h, a = moved["H200"][label], moved["A100"][label]
            lines.append(f"{f'{rows}x{cols}':>11} {str(dtype)[6:]:5} {label:34} {h / 1e6:>9.1f} "
                         f"{h / BANDWIDTH['H200'] * 1e6:>8.1f} {a / BANDWIDTH['A100'] * 1e6:>8.1f}")
    return lines


# --------------------------------------------------------------------------- main


def usage_error(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def apply_overrides(settings: list[str]) -> dict[str, int]:
    """``NAME=VALUE`` for the dispatch's tunables (``_triton_ops.LAUNCH_TUNABLES``)."""
    from ln_lightning.norm import _triton_ops as ops

    applied = {}
    for item in settings:
        name, sep, value = item.partition("=")
        if not sep or name not in ops.LAUNCH_TUNABLES or not value.lstrip("-").isdigit():
            usage_error(f"--set takes NAME=VALUE with NAME one of {', '.join(ops.LAUNCH_TUNABLES)}; got {item!r}")
        setattr(ops, name, int(value))
        applied[name] = int(value)
    return applied


def run(args) -> int:
    t_start = time.perf_counter()
    overrides = apply_overrides(args.set)
    entries = [e for e in REGISTRY if not args.kernels or e.name in args.kernels]
    unknown = set(args.kernels or ()) - {e.name for e in REGISTRY}
    if unknown:
        usage_error(f"unknown kernel(s) {sorted(unknown)}; registered: {[e.name for e in REGISTRY]}")
    full = args.subset == "full"
    arches = args.targets or list(FULL_TARGETS if full else CI_TARGETS)
    targets = [TARGETS[a] for a in arches]
    cuobjdump = find_cuobjdump()

    workdir = Path(tempfile.mkdtemp(prefix="ln_lightning_aot_"))
    # A private, fresh cache: compile times are real, and no kernel is served from another run.
    os.environ["TRITON_CACHE_DIR"] = str(args.cache_dir or workdir / "cache")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas's spill counts (captured per compile)
    # Triton 3.9 warns once that its FP-fusion default will change; the runtime uses the same
    # default, so these compiles match what runs.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    try:
        compiler = Compiler(cuobjdump, workdir)
        # Cases are generated lazily and dropped once compiled: their planning tensors (up to
        # 64 x 65536 elements) would add up to gigabytes over the full sweep.
        lo, hi = args.widths or (1, math.inf)
        cases = (
            c for e in entries for c in e.cases(full)
            if (full or c.ci) and (not args.dtypes or c.variant.split()[0] in args.dtypes) and lo <= c.width <= hi
        )
        print(f"triton {compiler.triton.__version__}, targets {', '.join(f'{t.name} ({t.gpus})' for t in targets)}, subset {args.subset}"
              + (f", overrides {overrides}" if overrides else ""), flush=True)
        results: list[Result] = []
        seen: set[tuple] = set()
        planned = 0
        for case in cases:
            planned += 1
            for target in targets:
                try:
                    spec = compiler.specialise(case.launch, target.arch)
                except Exception as exc:  # noqa: BLE001 - Triton rejects the launch itself (e.g. its options)
                    spec = exc
                key = (target.arch, case.kernel, repr(spec), repr(case.launch.config))
                if key in seen:  # a call that specialises to an already compiled binary
                    continue
                seen.add(key)
                if isinstance(spec, Exception):
                    res = Result(case.kernel, target.name, config_label(case.launch.config), case.variant, case.width,
                                 asdict(case.launch.config), problems=[f"launch rejected: {type(spec).__name__}: {spec}"[:300]])
                else:
                    res = compiler.compile(case, target, spec)
                results.append(res)
                if res.problems:
                    print(f"  FAIL {res.kernel} {res.target} {res.config} width {res.width} {res.variant}: {'; '.join(res.problems)}", flush=True)
            if args.progress and planned % 50 == 0:
                print(f"  {planned} launches planned, {len(results)} binaries, {time.perf_counter() - t_start:.0f} s", flush=True)
        print(f"{planned} launches planned, {len(results)} distinct binaries compiled", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print("\n".join(variant_table(results) if args.per_variant else resource_table(results)))
    print("\nregs: registers per thread (range over the variants); spill B: local memory + stack per thread;"
          " smem B: shared memory per block (static + dynamic); occupancy: the worst variant's resident warps"
          " per SM / the maximum, blocks per SM and what limits them")
    print(f"\nroofline: compulsory bytes and the time they take at copy bandwidth "
          f"(H200 {BANDWIDTH['H200'] / 1e12:.2f} TB/s measured; A100-SXM4-80GB {BANDWIDTH['A100'] / 1e12:.2f} TB/s, "
          "datasheet 2.04 TB/s x the H200's measured/datasheet ratio)")
    print("\n".join(roofline_table(entries)))
    failures = [r for r in results if r.problems]
    wall = time.perf_counter() - t_start
    print(f"\n{len(results)} binaries for {len(targets)} targets in {wall:.0f} s "
          f"(compile {sum(r.compile_s for r in results):.0f} s): {len(failures)} failed")
    for r in failures:
        print(f"  FAILED {r.kernel} {r.target} {r.config} width {r.width} {r.variant}: {'; '.join(r.problems)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"overrides": overrides, "wall_s": wall, "results": [asdict(r) for r in results]}, indent=1))
    return 1 if failures else 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subset", choices=["ci", "full"], default="ci")
    p.add_argument("--targets", nargs="+", type=int, choices=sorted(TARGETS), help="default: ci 80 90 100; full 80 90")
    p.add_argument("--kernels", nargs="+", help=f"registered: {', '.join(e.name for e in REGISTRY)}")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="only calls with these input dtypes")
    p.add_argument("--widths", nargs=2, type=int, metavar=("MIN", "MAX"), help="only launches planned for widths in [MIN, MAX]")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a dispatch tunable of _triton_ops (e.g. MAX_SINGLE_BLOCK=32768)")
    p.add_argument("--per-variant", action="store_true", help="one line per compiled binary")
    p.add_argument("--progress", action="store_true", help="a line every 50 planned launches")
    p.add_argument("--json", help="write every result here")
    p.add_argument("--cache-dir", help="Triton cache to use (default: a fresh temporary one)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
