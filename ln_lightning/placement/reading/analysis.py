"""Reading a block's residual sublayers from a recording of its forward (see `recording.py`).

A sublayer is found where the stream `s` meets a value `b` computed from it in an add:

    post      s' = N(s + F(s))
    pre       s' = s + F(N(s))
    peri      s' = s + N2(F(N1(s)))        (sandwich)
    output    s' = s + N(F(s))             (OLMo 2)
    none      s' = s + F(s)

Several values computed from `s` summed into it at once, in the block's own forward and in any
order of adds, are one *parallel* sublayer (`s + A(N1 s) + M(N2 s)`, GPT-J to Cohere; see
`PARALLEL` for what each placement does with it). Between sublayers the stream may be multiplied
by a mask or have its tokens regrouped (`reshape(-1, d)`); both are followed.

For a post-norm sublayer, the rewrite needs every place where the branch reads the stream: the
outermost module calls inside the block that receive `s` as an argument and do not contain the
residual add (the branch's *entries*: all of q, k and v; every argument position or keyword that
carries it). A branch that reads `s` in any other way (a function applied to it outside a module,
a module that gets it inside a container argument, a module called again elsewhere) can't be
rewritten with hooks, and the reason says where.

Where the branch ends (its *exit*, the module call whose output the add reads) is where a branch scale or an
output norm goes. One exit module may serve several calls in the block (one `nn.Dropout`, or one activation, for
both branches): each branch's call is then told apart at run time by the tensor it is given (`ExitCall`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ln_lightning.placement.rewrite.sublayer_plan import EntryPlan, ExitCall, RewritePlan, Unrecognised
from ln_lightning.placement.reading.recording import Event, Recording

_TRANSPARENT = (nn.Dropout, nn.Identity)


@dataclass
class ObservedSublayer:
    index: int
    placement: str  # post | pre | peri | output | none
    norm: str | None  # path (relative to the block) of the norm that decides the placement
    branch: str  # the modules the branch calls, for the reader
    plan: RewritePlan | None  # post only: where the hooks go
    reason: str = ""  # post only: why it can't be rewritten (plan is None)
    out_norm: str | None = None  # peri / output: the norm on the branch's output
    parallel: bool = False  # several branches of the stream summed into it at once (see PARALLEL)


def stream_input_at(call: Event) -> tuple[tuple | None, int | None]:
    """(where, value) of the residual stream among a block call's arguments."""
    for where in (("arg", 0), ("kwarg", "hidden_states"), ("kwarg", "x"), ("kwarg", "hidden")):
        v = call.input_value(where)
        if v is not None:
            return where, v
    top = [(w, v) for w, v in call.inputs if len(w) == 2]
    return top[0] if top else (None, None)


def stream_input(call: Event) -> int | None:
    """The value that carries the residual stream into a block call."""
    return stream_input_at(call)[1]


def stream_output_at(call: Event) -> tuple[tuple | None, int | None]:
    """(where, value) of the residual stream in a block call's output."""
    for where, v in call.outputs:
        if where in ((), (0,)):
            return where, v
    if call.outputs and len(call.outputs[0][0]) == 1:
        return call.outputs[0]
    return None, None


def stream_output(call: Event) -> int | None:
    return stream_output_at(call)[1]


def _is_norm(e: Event, types) -> bool:
    return e.kind == "module" and isinstance(e.module, types)


def _first_arg(e: Event) -> int | None:
    v = e.input_value(("arg", 0))
    if v is None and e.inputs and len(e.inputs[0][0]) == 2:
        v = e.inputs[0][1]
    return v


def _out(e: Event) -> int | None:
    return next((v for w, v in e.outputs if w == ()), None)


class _Block:
    """Queries on one block call inside a recording."""

    def __init__(self, rec: Recording, call: Event, types):
        self.rec, self.call, self.types = rec, call, types
        self._feeds_output: set[int] | None = None
        self.earlier_streams: list[int] = []

    @property
    def feeds_output(self) -> set[int]:
        """The values the block's outputs are computed from (walked once, when first asked)."""
        if self._feeds_output is None:
            outs = {v for _, v in self.call.outputs}
            self._feeds_output = set(outs)
            for v in outs:
                self._feeds_output |= self.rec.ancestors(v, within=self.call)
        return self._feeds_output

    def uses(self, e: Event, v: int) -> bool:
        """Does `e` really read `v`? A module call that only carries it along (inside a list argument
        it never looks at, like x-transformers' `layer_hiddens`) does not."""
        if e.kind == "function":
            return True
        return any(self.rec.events[r].kind == "function" and e.index < r <= e.end for r in self.rec.values[v].readers)

    def observer(self, e: Event) -> bool:
        """Reads a value but nothing it computes reaches the block's output: a check on the input
        that steers control flow, a logging call. It is no part of the function the block computes.
        A call that carries the values out of torch (numpy, a list, a pointer) is never one: where
        they go from there can't be seen."""
        return not e.leaves and not any(v in self.feeds_output for _, v in e.outputs)

    def readers(self, v: int) -> list[Event]:
        c = self.call
        return [self.rec.events[r] for r in self.rec.values[v].readers if c.index < r <= c.end]

    def contains(self, frame: Event, e: Event) -> bool:
        return frame.index <= e.index <= max(frame.end, frame.index)

    def calls_of(self, module: nn.Module) -> list[Event]:
        return [e for e in self.rec.module_calls(module) if self.call.index < e.index <= self.call.end]


_MASKS = {"mul", "__mul__", "__rmul__", "__imul__", "mul_"}
# Rearrangements of the tokens that keep each token's features together (a per-token norm commutes with them).
_LAYOUT = {"reshape", "view", "flatten", "unflatten", "view_as", "reshape_as", "contiguous"}


def _single_reader(rec: Recording, s: int, call: Event, pass_throughs: bool = True) -> Event | None:
    readers = [rec.events[r] for r in rec.values[s].readers if call.index < r <= call.end]
    if pass_throughs:
        readers = [r for r in readers if [v for _, v in r.outputs] != [s]]  # dropout in eval, a deferred norm
    return readers[0] if len(readers) == 1 and readers[0].kind == "function" and readers[0].outputs else None


def _layout_step(rec: Recording, r: Event, s: int) -> int | None:
    """The output of `r` if it only regroups the tokens of `s` (OPT flattens batch and sequence for its MLP)."""
    if r.name not in _LAYOUT or any(v != s for _, v in r.inputs):
        return None
    x, y = rec.values[s].tensor, rec.values[r.outputs[0][1]].tensor
    if y.numel() != x.numel() or y.dim() == 0 or x.dim() == 0 or y.shape[-1] != x.shape[-1]:
        return None
    return r.outputs[0][1]


def follow_layout(rec: Recording, s: int, call: Event) -> int:
    """`s` after the token regroupings (reshape, view) applied to it alone (a pass-through, a
    deferred norm's call site, stops it: that is where the sum is taken)."""
    for _ in range(8):
        r = _single_reader(rec, s, call, pass_throughs=False)
        nxt = _layout_step(rec, r, s) if r is not None else None
        if nxt is None:
            return s
        s = nxt
    return s


def follow_stream_ops(rec: Recording, s: int, call: Event) -> int:
    """The stream after what a forward does to it between sublayers without a branch: a multiply by a
    mask that does not depend on the stream (XLM zeroes padded positions with `tensor *= mask`), a
    regrouping of its tokens (OPT's `reshape(-1, d)` before its MLP)."""
    for _ in range(8):
        r = _single_reader(rec, s, call)
        if r is None:
            return s
        nxt = _layout_step(rec, r, s)
        if nxt is None:
            others = [v for _, v in r.inputs if v != s]
            if r.name not in _MASKS or len(others) != 1 or others[0] in rec.descendants(s, within=call):
                return s
            nxt = r.outputs[0][1]
        s = nxt
    return s


def analyse(rec: Recording, call: Event, types: tuple, start: int | None = None, end: int | None = None) -> list[ObservedSublayer]:
    """The sublayers of the block whose call is `call`, along its stream from the value `start` (by
    default the block's stream input) to the value `end` (by default its stream output); raises
    Unrecognised with the reason."""
    blk = _Block(rec, call, types)
    s, out = (stream_input(call) if start is None else start), (stream_output(call) if end is None else end)
    if s is None:
        raise Unrecognised("the block received no tensor")
    if out is None:
        raise Unrecognised("the block returned no tensor")
    subs: list[ObservedSublayer] = []
    for _ in range(call.end - call.index + 1):
        s = follow_stream_ops(rec, s, call)
        if s == out:
            break
        sub, nxt = _next_sublayer(blk, s, len(subs))
        blk.earlier_streams.append(s)
        s = nxt
        subs.append(sub)
    else:  # pragma: no cover - defensive
        raise Unrecognised("could not follow the stream to the block's output")
    if not subs:
        raise Unrecognised("the block returns its input unchanged")
    return subs


def _next_sublayer(blk: _Block, s: int, index: int) -> tuple[ObservedSublayer, int]:
    rec = blk.rec
    desc = rec.descendants(s, within=blk.call)
    readers = blk.readers(s)
    adds = []
    for e in readers:
        if e.is_add:
            other = next(v for _, v in e.inputs if v != s)
            if other in desc:
                adds.append((e, other))
    if len(adds) != 1:
        if not adds:
            what = sorted({e.name for e in readers if not blk.observer(e)})
            for e in readers:
                if e.is_add and any(other in rec.descendants(p, within=blk.call) for p in blk.earlier_streams for _, other in e.inputs if other != s):
                    raise Unrecognised(
                        "a value computed from an earlier stream is added here (parallel branches, GPT-J style): "
                        "only sequential sublayers can be moved"
                    )
            if any(_is_norm(e, blk.types) and _first_arg(e) == s for e in readers) and not any(e.is_add for e in readers):
                raise Unrecognised(f"a norm is applied to the stream outside a residual add `x + F(x)` (the stream is used by: {', '.join(what) or 'nothing'})")
            raise Unrecognised(f"no single residual add `x + F(x)` follows the stream (it is used by: {', '.join(what) or 'nothing'})")
        raise Unrecognised("the stream enters several residual adds (parallel branches); only one add per sublayer is supported")
    add, b = adds[0]
    a = _out(add)
    # Parallel branches: the terms summed into the stream at the block's own level (GPT-J's
    # `attn + mlp + residual`), and later adds of more values computed from `s` but not from the
    # sum (Cohere's `residual + attn + mlp`).
    terms, chained = _terms(blk, b), False
    while True:
        readers_a = blk.readers(a)
        nxt = [e for e in readers_a if e.is_add]
        if len(nxt) != 1:
            break
        other = next(v for _, v in nxt[0].inputs if v != a)
        if other not in desc:
            break
        # Made before the sum, it can't be computed from it (the usual order: branches first, then the adds).
        made_before = _done_before(rec, other, a)
        if not made_before and other in rec.descendants(a, within=blk.call):
            break
        if any(e is not nxt[0] and not blk.observer(e) for e in readers_a):
            break
        terms += _terms(blk, other)
        chained, add, a = True, nxt[0], _out(nxt[0])
    parallel = sum(t in desc for t in terms) >= 2
    branch_vals = set()
    for t in [b, *terms]:
        branch_vals |= (rec.ancestors(t, within=blk.call) | {t}) & (desc | {s})
    # Norms around the branch (the sum as the norm receives it: OPT views it back to 3-D first).
    a_norm = follow_layout(rec, a, blk.call)
    a_readers = blk.readers(a_norm)
    post = _outermost([e for e in a_readers if _is_norm(e, blk.types) and _first_arg(e) == a_norm], blk)
    outside_post = [e for e in a_readers if not any(blk.contains(n, e) for n in post)]
    in_norm = _outermost([e for e in readers if _is_norm(e, blk.types) and _first_arg(e) == s and _out(e) in branch_vals], blk)
    out_norm = _outermost([e for e in _calls_producing(blk, b) if _is_norm(e, blk.types)], blk) if not parallel else []
    branch_modules = _branch_modules(blk, s, branch_vals, add)
    branch = (" + " if parallel else " > ").join(branch_modules) or "(functions)"
    if len(post) == 1 and not outside_post:
        norm_call = post[0]
        if in_norm:
            raise Unrecognised("a sublayer with a norm both before its branch and after its add is not supported")
        sub = ObservedSublayer(index, "post", norm_call.name, branch, None, parallel=parallel)
        if chained:
            sub.reason = ("its parallel branches are added to the stream one after another (x + A(x) + M(x) as (x + A) + M); "
                          "only a post-norm sum added at once, N(x + (A(x) + M(x))), can be moved")
            return sub, _out(norm_call)
        try:
            sub.plan = _plan(blk, s, b, add, norm_call, branch_vals)
        except Unrecognised as e:
            sub.reason = str(e)
        return sub, _out(norm_call)
    if in_norm:
        # Where the branch ends, for the placements that add or move a norm there (peri, output).
        exit_module, exit_index, why, call = _exit(blk, b, add) if not parallel else (None, None, PARALLEL, None)
        plan = RewritePlan(in_norm[0].name, [], exit_module, exit_index, why, call)
        if out_norm:
            return ObservedSublayer(index, "peri", in_norm[0].name, branch, plan, out_norm=out_norm[-1].name), a
        return ObservedSublayer(index, "pre", in_norm[0].name, branch, plan, parallel=parallel), a
    if out_norm:
        return ObservedSublayer(index, "output", out_norm[-1].name, branch, None, out_norm=out_norm[-1].name), a
    return ObservedSublayer(index, "none", None, branch, None, parallel=parallel), a


# The one rule for parallel-residual blocks, whatever the family (the README's "What is recognised" says
# the same): reported as one sublayer, placement as written (pre for every family, each branch reading a
# normalised stream), marked parallel; "pre": already; "post": refused (written pre-norm); "peri" /
# "output": refused with this reason; a post-norm one `N(x + (A(x) + M(x)))` converts to the shared-norm form.
PARALLEL = (
    "a parallel-residual sublayer (x + A(N1(x)) + M(N2(x)), or one norm shared by the branches) has no single branch "
    "output: peri and output placements would need a norm on each branch's output, which ln_lightning does not add"
)


def _done_before(rec: Recording, v: int, w: int) -> bool:
    """Was value `v` complete before `w` was made (so it can't depend on `w`)?"""
    pv, pw = rec.values[v].producer, rec.values[w].producer
    if pv is None or pw is None:
        return pv is None and pw is not None
    e = rec.events[pv]
    return (e.end if e.kind == "module" else e.index) < pw


def _terms(blk: _Block, v: int) -> list[int]:
    """The values summed into `v` by adds in the block's own forward (not inside a branch module)."""
    p = blk.rec.values[v].producer
    if p is not None:
        e = blk.rec.events[p]
        if e.is_add and e.frames and e.frames[-1] == blk.call.index:
            return [t for _, i in e.inputs for t in _terms(blk, i)]
    return [v]


def _outermost(calls: list[Event], blk: _Block) -> list[Event]:
    """Norm calls not nested in another of them (a norm class that wraps nn.LayerNorm, x-transformers')."""
    return [e for e in calls if not any(o is not e and blk.contains(o, e) for o in calls)]


def _calls_producing(blk: _Block, v: int) -> list[Event]:
    return [e for e in blk.rec.within(blk.call) if e.kind == "module" and _out(e) == v]


def _branch_modules(blk: _Block, s: int, branch_vals: set, add: Event) -> list[str]:
    """The outermost module calls of the branch (those that don't contain its add), in call order."""
    names: list[str] = []
    for e in blk.rec.within(blk.call):
        if e.kind != "module" or blk.contains(e, add):
            continue
        if not any(v in branch_vals for _, v in e.outputs):
            continue
        if any(f != blk.call.index and not blk.contains(blk.rec.events[f], add) for f in e.frames if f > blk.call.index):
            continue  # nested inside a module already listed
        if isinstance(e.module, _TRANSPARENT):
            continue
        if e.name not in names:
            names.append(e.name)
    return names


def _plan(blk: _Block, s: int, b: int, add: Event, norm_call: Event, branch_vals: set) -> RewritePlan:
    if len(blk.calls_of(norm_call.module)) != 1:
        raise Unrecognised(f"norm {norm_call.name} is called {len(blk.calls_of(norm_call.module))} times in the block (shared between sublayers)")
    entries: dict[int, Event] = {}
    for r in blk.readers(s):
        if r is add or r.kind == "module" and blk.contains(r, add):
            continue  # the residual add itself, or a module holding it (which gets `s` as the residual)
        if not blk.uses(r, s):
            continue
        if blk.observer(r):
            continue  # control flow or logging on the input: unchanged by the rewrite
        if r.leaves and _entry_frame(blk, r, s, add) is None:
            raise Unrecognised(
                f"the branch takes the stream out of torch with `{r.name}` (a copy of its values the recording can't "
                "follow), so there is no module call to hand LN(x) to; do that step inside a module"
            )
        if not r.leaves and not any(v in branch_vals for _, v in r.outputs):
            raise Unrecognised(f"the stream also feeds `{r.name}` outside the sublayer (parallel branches, or an extra output)")
        entry = _entry_frame(blk, r, s, add)
        if entry is None:
            raise Unrecognised(
                f"the branch first applies `{r.name}` (a function, not a module) to the stream, so there is no module "
                "call to hand LN(x) to; wrap that step in a module"
            )
        entries[entry.index] = entry
    if not entries:
        raise Unrecognised("the branch never reads the stream")
    plans: dict[str, EntryPlan] = {}
    for e in entries.values():
        calls = blk.calls_of(e.module)
        if any(c.index not in entries for c in calls):
            raise Unrecognised(f"branch module {e.name} is called {len(calls)} times in the block, not only as the branch's entry")
        pos, kws = [], []
        for where, v in e.inputs:
            if v != s:
                continue
            if len(where) != 2:
                raise Unrecognised(f"branch module {e.name} receives the stream inside a container argument ({where[0]} {where[1]!r})")
            (pos if where[0] == "arg" else kws).append(where[1])
        p = EntryPlan(e.name, tuple(pos), tuple(kws))
        old = plans.get(e.name)
        if old is not None and (old.arg_positions, old.kwarg_names) != (p.arg_positions, p.kwarg_names):
            raise Unrecognised(f"branch module {e.name} receives the stream at different arguments on different calls")
        plans[e.name] = p
    exit_module, exit_index, reason, call = _exit(blk, b, add)
    return RewritePlan(norm_call.name, sorted(plans.values(), key=lambda p: p.module), exit_module, exit_index, reason, call)


def _entry_frame(blk: _Block, r: Event, s: int, add: Event) -> Event | None:
    """The outermost module call inside the block, around (or equal to) `r`, that receives `s` and not the add."""
    chain = [blk.rec.events[f] for f in r.frames if f > blk.call.index] + ([r] if r.kind == "module" else [])
    for f in chain:
        if blk.contains(f, add):
            continue
        if any(v == s for _, v in f.inputs):
            return f
    return None


def _exit(blk: _Block, b: int, add: Event) -> tuple[str | None, int | None, str, ExitCall | None]:
    found = []
    for e in blk.rec.within(blk.call):
        if e.kind != "module" or blk.contains(e, add):
            continue
        for where, v in e.outputs:
            if v == b and (where == () or (len(where) == 1 and isinstance(where[0], int))):
                found.append((e, None if where == () else where[0]))
    if not found:
        producer = blk.rec.values[b].producer
        name = blk.rec.events[producer].name if producer is not None else "?"
        return None, None, f"the branch ends in `{name}`, not a module call", None
    # The outermost of the modules that return the branch value; of siblings (a linear, then a
    # dropout that returned its input in eval) the last, which is what the add reads in training too.
    outer = [f for f in found if not any(g is not f and blk.contains(g[0], f[0]) for g in found)]
    e, index = max(outer, key=lambda f: f[0].index)
    calls = blk.calls_of(e.module)
    if len(calls) == 1:
        return e.name, index, "", None
    call, why = _exit_call(blk, e, calls, add)
    if call is None:
        return None, None, f"branch exit {e.name} is called {len(calls)} times in the block and {why}", None
    return e.name, index, "", call


def _exit_call(blk: _Block, e: Event, calls: list[Event], add: Event) -> tuple[ExitCall | None, str]:
    """Which of the exit module's calls is this branch's, told at run time by the tensor it is given: the output
    of the module call (its *feeder*, called once in the block) that hands the branch's value to the exit, as in
    `drop(attn(x))` and `drop(mlp(x))` with one `drop`. (ExitCall, "") or (None, why it can't be told)."""
    number = next(i for i, c in enumerate(calls) if c.index == e.index)
    given_to_others = {v for c in calls if c is not e for _, v in c.inputs}
    why = "its call for this branch gets no argument that a module called once in the block returned"
    for where, v in e.inputs:
        if len(where) != 2 or where[0] != "arg" or v in given_to_others:
            continue
        feeders = []
        for f in blk.rec.within(blk.call):
            if f.kind != "module" or f.end >= e.index or blk.contains(f, add) or f.module is e.module:
                continue
            for w, o in f.outputs:
                if o == v and (w == () or (len(w) == 1 and isinstance(w[0], int))):
                    feeders.append((f, None if w == () else w[0]))
        if not feeders:
            continue
        # The one that ran last hands the value on (a module that returned its input in eval, a dropout, does so
        # in training with a new tensor): it alone is told apart by identity in every mode.
        f, index = max(feeders, key=lambda g: g[0].end)
        n = len(blk.calls_of(f.module))
        if n != 1:
            why = f"the module {f.name} that hands it the branch's value is called {n} times as well"
            continue
        return ExitCall(f.name, index, where[1], number), ""
    return None, why
