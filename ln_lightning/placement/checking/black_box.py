"""The reference a rewritten block is checked against: its original modules run as black boxes.

`checks.py` reads the rewritten block from a recorded forward, so it sees what the recording
sees. This check looks inside no branch. It runs the block's own forward with our rewrite
bypassed (the original function) and sets values only where modules meet: the block's stream
argument, a norm's output. For a post-norm sublayer `t' = N(t + F(t))`:

* the value `t` the branch receives is set: the block's stream argument for the first sublayer
  (a forward pre-hook, ahead of any of the user's), the previous sublayer's norm output for the
  others (a forward hook on that norm);
* the norm's input is then `t + F(t)` (captured by a pre-hook), hence `F(t)`.

With `t = N(s)`, one run gives `F(N(s))` however the branch reads its input (a scratch buffer
written from it, `.data`, numpy, a custom kernel on raw storage, a stash in a pre-hook), and the
pre-norm stream `s + c * F(N(s))`, which feeds the next sublayer. The last norm's output is set
to the last stream, and what the block's forward does after it runs as written. For a sublayer
written pre-norm (or peri), `s' = s + F(N(s))`: the norm's output is set to what the target
placement's branch reads, and `F` is the difference of consecutive norm inputs (peri: the output
norm's input). The same per stream, for a block that carries several (LiLT's text and layout).

What `into_branch` / `out_of_branch` / `scale` are for each placement is the rewrite's promise
(the norm at the branch input, an output norm, `c`); the branch itself is only ever the original
code. A rewrite that computes anything else differs from this reference.

`F = (t + F) - t` carries the block's rounding of `t + F`, larger than the rewrite's own where the
norm output is much larger than the stream (early layers, trained gains). Each reference comes
with that bound (`slack`: the dtype's unit roundoff times the captured sums' size, relative to the
output), which the comparison adds to its tolerance. A half-precision block runs in float64
instead (its parameters and inputs swapped for float64 copies for the call), where that bound
would be as large as the tolerance itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.checking.checks import CheckFailed


@dataclass
class ReferenceSublayer:
    """One sublayer as written, and what the target placement makes of it (paths inside the block)."""

    written: str  # "post" | "pre" | "peri"
    norm: str  # post: the norm after the add; pre / peri: the norm at the branch input
    out_norm: str | None  # peri as written: the norm on the branch's output
    into_branch: str | None  # the norm whose output the branch reads; None: the stream itself
    out_of_branch: str | None  # the norm applied to the branch's value before the add; None: none
    scale: str | None = None  # a BranchScale module: c in s + c * F


@dataclass
class _Resolved:
    written: str
    norm: nn.Module
    out_norm: nn.Module | None
    into_branch: Callable | None
    out_of_branch: Callable | None
    scale: torch.Tensor | float


@dataclass
class ReferenceStream:
    """A stream of the block: where it enters and leaves, and its sublayers in order."""

    enters: tuple  # ("arg", i) | ("kwarg", name) | ("module", path): the output of a submodule (XLM's embeddings norm)
    leaves: tuple | None  # where in the block's output; None: `hooks.stream_of(output)`
    sublayers: list[ReferenceSublayer]


def at(output: Any, where: tuple | None) -> torch.Tensor | None:
    """The tensor at `where` in a block's output (a tuple index, a dict key)."""
    if where is None:
        return hooks.stream_of(output)
    for k in where:
        if isinstance(output, dict):
            output = output[k]
        elif isinstance(output, (tuple, list)):
            output = output[k]
        else:
            return None
    return output if isinstance(output, torch.Tensor) else None


def _apply(f, x):
    return x if f is None else f(x)


def _resolve(block: nn.Module, sub: ReferenceSublayer) -> _Resolved:
    get = lambda p: block.get_submodule(p) if p else block  # noqa: E731

    def by(p):
        if p is None:
            return None
        m = get(p)
        return lambda x: hooks.reference_norm(m, x)

    scale = 1.0 if sub.scale is None else get(sub.scale).value()
    return _Resolved(sub.written, get(sub.norm), get(sub.out_norm) if sub.out_norm else None, by(sub.into_branch),
                     by(sub.out_of_branch), scale)


class _Chain:
    """The state of one stream while the reference run goes through its sublayers."""

    def __init__(self, block: nn.Module, stream: ReferenceStream):
        self.stream = stream
        self.subs = [_resolve(block, s) for s in stream.sublayers]
        self.s: list[torch.Tensor] = []  # the target placement's stream before each sublayer (float64)
        self.fed: list[torch.Tensor] = []  # post: what each sublayer's branch was given
        self.raw: list[torch.Tensor] = []  # pre / peri: each norm's input in this run (the original stream)
        self.branch: dict[int, torch.Tensor] = {}  # peri: each output norm's input, F(...)
        self.calls: dict = {}
        self.dtype = torch.float32  # the block's: norms on the branch output run in it, as in the rewrite
        self.sums: list[torch.Tensor] = []  # each `t + F` subtracted from: their size bounds the reference's rounding
        self.error: str | None = None

    def fail(self, msg: str) -> None:
        self.error = self.error or msg

    def step(self, k: int, f: torch.Tensor) -> torch.Tensor:
        """s_{k+1} = s_k + c * out_of_branch(F), in float64 (the block's own rounding is what the check allows for)."""
        sub = self.subs[k]
        g = f if sub.out_of_branch is None else sub.out_of_branch(f.to(self.dtype)).double()
        c = sub.scale if isinstance(sub.scale, float) else sub.scale.detach().double()
        return self.s[k] + c * g


class _Ours(Exception):
    """Carries an exception raised inside one of this module's hooks out of the user's forward."""


def _ours(hook):
    """The hook, with its own errors told apart from the user's code around it."""

    def run(*args, **kwargs):
        try:
            return hook(*args, **kwargs)
        except Exception as e:
            raise _Ours() from e

    return run


def _count(chain: _Chain, key) -> bool:
    chain.calls[key] = chain.calls.get(key, 0) + 1
    if chain.calls[key] > 1:
        chain.fail(f"{key[0]} {key[1]} ran more than once in the block")
        return False
    return True


def _hooks_post(block: nn.Module, chain: _Chain, handles: list) -> None:
    subs = chain.subs

    def feed(k: int, s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        chain.dtype = like.dtype
        chain.s.append(s)
        t = _apply(subs[k].into_branch, s.to(like.dtype)).to(like.dtype)
        chain.fed.append(t)  # the object handed on: an in-place op of the block on it (XLM's mask) shows here
        return t

    kind, where = chain.stream.enters[0], chain.stream.enters[1]
    if kind == "module":
        def source(mod, args, out):
            if not _count(chain, ("source", where)):
                return None
            return feed(0, out.double(), out)

        handles.append(nn.Module.register_forward_hook(block.get_submodule(where), _ours(source), prepend=True))
    else:
        def source(mod, args, kwargs):
            if not _count(chain, ("source", where)):
                return None
            x = (args[where] if where < len(args) else None) if kind == "arg" else kwargs.get(where)
            if not isinstance(x, torch.Tensor):
                chain.fail(f"the block was not given its stream as {'argument' if kind == 'arg' else 'keyword'} {where!r}")
                return None
            t = feed(0, x.double(), x)
            # Every argument that is the stream gets it (Funnel passes it as query, key and value).
            return tuple(t if a is x else a for a in args), {k: (t if v is x else v) for k, v in kwargs.items()}

        handles.append(nn.Module.register_forward_pre_hook(block, _ours(source), prepend=True, with_kwargs=True))

    for k, sub in enumerate(subs):
        captured: dict = {}

        def capture(mod, args, k=k, captured=captured):
            if args and isinstance(args[0], torch.Tensor):
                captured["u"] = args[0].detach().clone()

        def after(mod, args, out, k=k, captured=captured):
            if not _count(chain, ("norm", k)):
                return None
            if len(chain.fed) != k + 1 or "u" not in captured:
                chain.fail(f"sublayer {k}'s norm ran before its branch was given its input")
                return None
            u = captured.pop("u").double()
            chain.sums.append(u)
            f = u - chain.fed[k].double()
            s_next = chain.step(k, f)
            if k + 1 < len(subs):
                return feed(k + 1, s_next, out)
            chain.s.append(s_next)
            return s_next.to(out.dtype)  # the last stream: what the forward does after its last norm runs as written

        handles.append(nn.Module.register_forward_pre_hook(sub.norm, _ours(capture)))
        handles.append(nn.Module.register_forward_hook(sub.norm, _ours(after), prepend=True))


def _hooks_pre(block: nn.Module, chain: _Chain, handles: list) -> None:
    subs = chain.subs
    for k, sub in enumerate(subs):
        def before(mod, args, k=k):
            if len(chain.raw) != k or not args or not isinstance(args[0], torch.Tensor):
                chain.fail(f"sublayer {k}'s norm ran out of order, or without a tensor")
                return
            x = args[0].detach().clone()
            chain.dtype = x.dtype
            chain.raw.append(x)
            if k == 0:
                chain.s.append(x.double())
            else:
                chain.s.append(chain.step(k - 1, _branch_value(chain, k - 1, x)))

        def after(mod, args, out, k=k):
            if not _count(chain, ("norm", k)) or len(chain.s) != k + 1:
                return None
            return _apply(subs[k].into_branch, chain.s[k].to(out.dtype)).to(out.dtype)

        handles.append(nn.Module.register_forward_pre_hook(sub.norm, _ours(before)))
        handles.append(nn.Module.register_forward_hook(sub.norm, _ours(after), prepend=True))
        if sub.written == "peri":
            def branch_out(mod, args, k=k):
                chain.branch[k] = args[0].detach().clone()

            handles.append(nn.Module.register_forward_pre_hook(sub.out_norm, _ours(branch_out)))


def _branch_value(chain: _Chain, k: int, next_raw: torch.Tensor) -> torch.Tensor:
    """F of sublayer k in the reference run: what its output norm received (peri), or the next raw
    stream minus this one (pre: the original add `x + F`)."""
    if chain.subs[k].written == "peri":
        if k not in chain.branch:
            chain.fail(f"sublayer {k}'s output norm did not run")
            return torch.zeros_like(next_raw, dtype=torch.float64)
        return chain.branch[k].double()
    chain.sums.append(next_raw)
    return next_raw.double() - chain.raw[k].double()


def _float64(obj, memo: dict):
    """`obj` with its floating tensors in float64; one tensor passed twice stays one (Funnel's q, k, v)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.double() if obj.is_floating_point() else obj
        return memo[id(obj)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_float64(o, memo) for o in obj)
    if isinstance(obj, list):
        return [_float64(o, memo) for o in obj]
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _float64(v, memo) for k, v in obj.items()}
    return obj


def _run_in_float64(block: nn.Module, args: tuple, kwargs: dict):
    """The block's output on `args` / `kwargs` with its floating parameters, buffers and arguments in
    float64 (swapped in for the call, the module itself untouched)."""
    memo: dict = {}
    state = {n: _float64(t, memo) for n, t in (*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False))}
    return torch.func.functional_call(block, state, _float64(args, memo), _float64(kwargs, memo), tie_weights=True, strict=False)


def _half(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.dtype in (torch.float16, torch.bfloat16)
    if isinstance(obj, (tuple, list)):
        return any(_half(o) for o in obj)
    if isinstance(obj, dict):
        return any(_half(o) for o in obj.values())
    return False


def reference_outputs(block: nn.Module, streams: list[ReferenceStream], args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, "_Slack"]]:
    """(output, slack) of each stream under the target placement, from one run of the block's original
    function on `args` / `kwargs` (slack: its rounding bound, `float(slack)`); raises CheckFailed when
    the block does not run as its sublayers say."""
    chains = [_Chain(block, st) for st in streams]
    # The inputs' and the norms' dtype say the block's (a walk over all its parameters costs a block forward's tenth).
    in_float64 = _half((args, kwargs)) or any(_half(t) for c in chains for sub in c.subs for t in sub.norm.parameters())
    handles: list = []
    for chain in chains:
        kinds = {s.written for s in chain.subs}
        if kinds == {"post"}:
            _hooks_post(block, chain, handles)
        elif kinds <= {"pre", "peri"}:
            _hooks_pre(block, chain, handles)
        else:
            raise CheckFailed(f"its sublayers are written as {', '.join(sorted(kinds))}: a block mixing post-norm with "
                              "pre-norm sublayers has no black-box reference here")
    try:
        with hooks.bypass():
            out = _run_in_float64(block, args, kwargs) if in_float64 else block(*args, **kwargs)
    except _Ours as e:  # a bug of ours, not the block's: raised as it is
        raise e.__cause__ from None
    except Exception as e:  # noqa: BLE001 - the user's block refused the reference inputs: a reason to refuse it
        raise CheckFailed(f"the block's original forward failed on the reference's inputs ({type(e).__name__}: {str(e)[:160]})") from None
    finally:
        for h in handles:
            h.remove()
    results = []
    for chain in chains:
        if chain.error:
            raise CheckFailed(f"reference run: {chain.error}")
        got = at(out, chain.stream.leaves)
        if got is None:
            raise CheckFailed("reference run: the block returned no stream where it did before")
        n = len(chain.subs)
        if chain.subs[0].written == "post":
            if len(chain.s) != n + 1:
                raise CheckFailed(f"reference run: {len(chain.s) - 1} of the block's {n} sublayer norms ran")
            # The forward's own steps after the last norm (a mask, a view) included.
        else:
            if len(chain.raw) != n:
                raise CheckFailed(f"reference run: {len(chain.raw)} of the block's {n} sublayer norms ran")
            got = chain.step(n - 1, _branch_value(chain, n - 1, got)).to(got.dtype)
        unit = torch.finfo(torch.float64 if in_float64 else chain.dtype).eps
        results.append((got, _Slack(unit, chain.sums, got)))
    return results


class _Slack:
    """The reference's rounding bound, relative to its output: 4 u sum ||t + F|| / ||output||; computed
    only when a comparison needs it (float(...))."""

    def __init__(self, unit: float, sums: list, out: torch.Tensor):
        self.unit, self.sums, self.out = unit, sums, out

    def __float__(self) -> float:
        total = sum(t.double().norm().item() for t in self.sums)
        return 4 * self.unit * total / max(self.out.double().norm().item(), 1e-30)
