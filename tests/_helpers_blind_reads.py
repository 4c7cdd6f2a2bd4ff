"""Ways a branch can read the residual stream that a recording of torch calls sees badly or not at all.

Each `read(kind, h)` returns a tensor equal to `h` (bit for bit) that reached the caller another way
than by passing `h` along: written into a buffer, through `out=`, a view, `.data`, numpy, a Python
list, a custom autograd Function, a `torch.library` op that mutates its argument, raw storage, or a
kernel call with torch function handling off (as a C++ extension or a Triton launch sees the
tensor); `call(kind, module, h)` applies a module to such a read, or calls it inside an activation
checkpoint. The placement tests use them as branches: read at the block's own
level (where a hook on a module can't normalise them) and inside a module (where it can).
"""

from __future__ import annotations

import ctypes

import torch
from torch.utils.checkpoint import checkpoint

KINDS = ["setitem", "index_put", "out_arg", "view_of_clone", "data", "numpy", "tolist", "autograd_fn", "custom_op",
         "raw_storage", "checkpoint", "opaque_kernel"]


@torch.library.custom_op("ln_lightning_tests::fill_from", mutates_args=("out",))
def fill_from(out: torch.Tensor, x: torch.Tensor) -> None:
    """`out[...] = x`, declared to torch as mutating `out` (its schema says `Tensor(a!) out`)."""
    out.copy_(x)


class ThroughNumpy(torch.autograd.Function):
    """A custom autograd Function whose forward computes in numpy."""

    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(x.detach().float().cpu().numpy().copy()).to(dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, g):
        return g


def _numpy(h):
    return torch.from_numpy(h.detach().float().cpu().numpy().copy()).to(dtype=h.dtype, device=h.device)


def _raw_storage(h):
    assert h.is_contiguous()  # no `.contiguous()` call: that one the recording would see
    out = torch.empty_like(h)
    ctypes.memmove(out.data_ptr(), h.data_ptr(), h.numel() * h.element_size())
    return out


def _opaque_kernel(h):
    with torch._C.DisableTorchFunction():  # what a C++ extension's kernel call looks like from Python
        out = torch.empty_like(h)
        out.copy_(h)
    return out


def read(kind: str, h: torch.Tensor) -> torch.Tensor:
    if kind == "setitem":
        buf = torch.zeros_like(h)
        buf[...] = h
        return buf
    if kind == "index_put":
        buf = torch.zeros_like(h)
        buf.index_put_((torch.arange(h.shape[0], device=h.device),), h)
        return buf
    if kind == "out_arg":
        buf = torch.empty_like(h)
        torch.add(h, 0, out=buf)
        return buf
    if kind == "view_of_clone":
        buf = torch.zeros_like(h)
        buf.view(-1).copy_(h.reshape(-1))
        return buf
    if kind == "data":
        return h.data
    if kind == "numpy":
        return _numpy(h)
    if kind == "tolist":
        return torch.as_tensor(h.tolist(), dtype=h.dtype, device=h.device)
    if kind == "autograd_fn":
        return ThroughNumpy.apply(h)
    if kind == "custom_op":
        buf = torch.empty_like(h)
        fill_from(buf, h)
        return buf
    if kind == "raw_storage":
        return _raw_storage(h)
    if kind == "opaque_kernel":
        return _opaque_kernel(h)
    raise ValueError(kind)


def call(kind: str, module: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """`module` applied to `h` read through `kind`; for "checkpoint", `module` called inside
    `torch.utils.checkpoint` (a module call there is still a module call: its hooks run)."""
    if kind == "checkpoint":
        return checkpoint(module, h, use_reentrant=False)
    return module(read(kind, h))
