"""Reading a block's `forward` to find its residual sublayers.

We trace the block's own `forward` with torch.fx, treating every child module as a leaf: the graph
then shows exactly what the block does with its children, and nothing of their internals. The
graph is only *read*: the user's code keeps running after conversion (see `hooks.py`), so control
flow that the trace cannot see does not get frozen into the model.

A sublayer is recognised as `A = add(s, b)` where the branch value `b` depends on the stream `s`:

    post      s' = N(add(s, F(s)))
    pre       s' = add(s, F(N(s)))
    sandwich  s' = add(s, N2(F(N1(s))))
    none      s' = add(s, F(s))
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "__add__", "add_"}


def norm_types() -> tuple[type, ...]:
    types: list[type] = [nn.LayerNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    from ln_lightning.placement.registry import registered_norm_classes

    types.extend(registered_norm_classes())
    return tuple(types)


class Unrecognised(Exception):
    """The block's structure is not one we can rewrite; the message says why."""


class _LeafTracer(fx.Tracer):
    # Children are opaque: we only need the block's own wiring.
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return not isinstance(m, (nn.ModuleList, nn.ModuleDict))


def trace_block(block: nn.Module) -> fx.Graph:
    sig = inspect.signature(block.forward)
    params = list(sig.parameters.values())
    if not params:
        raise Unrecognised("forward takes no input")
    # Optional arguments are traced at their defaults, the path the probe check also runs.
    concrete = {p.name: p.default for p in params[1:] if p.default is not inspect.Parameter.empty}
    try:
        return _LeafTracer().trace(block, concrete_args=concrete or None)
    except Exception as e:  # fx raises many kinds of errors for untraceable code
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Unrecognised(f"forward could not be traced ({type(e).__name__}: {msg[:160]})") from None


@dataclass
class TracedSublayer:
    index: int
    placement: str  # post | pre | sandwich | none
    stream_in: fx.Node
    add: fx.Node
    branch_out: fx.Node
    pre_norm: fx.Node | None  # N(s) feeding the branch (pre, sandwich)
    post_norm: fx.Node | None  # N(add) (post)
    branch_nodes: set = field(default_factory=set)

    @property
    def norm_node(self) -> fx.Node | None:
        return self.post_norm or self.pre_norm


def _is_add(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target in _ADD_FUNCTIONS:
        return len(n.args) == 2 and not n.kwargs
    if n.op == "call_method" and n.target in _ADD_METHODS:
        return len(n.args) == 2 and not n.kwargs
    return False


def is_norm_node(n: fx.Node, root: nn.Module) -> bool:
    return n.op == "call_module" and isinstance(root.get_submodule(n.target), norm_types())


def _ancestors(n: fx.Node, cache: dict) -> set:
    if n in cache:
        return cache[n]
    out: set = set()
    stack = list(n.all_input_nodes)
    while stack:
        m = stack.pop()
        if m not in out:
            out.add(m)
            stack.extend(m.all_input_nodes)
    cache[n] = out
    return out


def describe_node(n: fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target))
    return f".{n.target}()" if n.op == "call_method" else n.op


def analyse(block: nn.Module, graph: fx.Graph) -> list[TracedSublayer]:
    """Walk the stream from the block's input to its output, one residual sublayer at a time."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    anc: dict = {}
    s = placeholders[0]
    sublayers: list[TracedSublayer] = []
    for _ in range(len(nodes)):
        users = list(s.users)
        if users == [output] and output.args[0] is s:
            break
        adds = [u for u in users if _is_add(u) and s in u.args]
        adds = [a for a in adds if s in _ancestors(a.args[1] if a.args[0] is s else a.args[0], anc)]
        if len(adds) != 1:
            if users == [output]:
                raise Unrecognised("the block returns more than its residual stream (a tuple or a transformed stream)")
            if len(users) == 1 and is_norm_node(users[0], block):
                raise Unrecognised(f"norm {users[0].target} is applied to the stream outside a residual add")
            what = ", ".join(describe_node(u) for u in users)
            raise Unrecognised(f"no single residual add `x + F(x)` follows the stream (it is used by: {what})")
        a = adds[0]
        b = a.args[1] if a.args[0] is s else a.args[0]
        pre = [u for u in users if u is not a and is_norm_node(u, block) and u.args and u.args[0] is s and u in _ancestors(b, anc) | {b}]
        pre_norm = pre[0] if len(pre) == 1 else None
        branch_in = pre_norm if pre_norm is not None else s
        # The branch: everything between its input and its output.
        branch_nodes = {m for m in _ancestors(b, anc) | {b} if branch_in in _ancestors(m, anc) or m is branch_in}
        branch_nodes.discard(s)
        for u in users:
            if u is not a and u not in branch_nodes:
                raise Unrecognised(f"the stream also feeds `{describe_node(u)}` outside the sublayer (parallel branches?)")
        for m in branch_nodes:
            if m is b:
                continue
            leaks = [u for u in m.users if u not in branch_nodes]
            if leaks:
                raise Unrecognised(
                    f"an intermediate value of the branch (`{describe_node(m)}`) is also used outside it "
                    f"(by `{describe_node(leaks[0])}`)"
                )
        if len(b.users) != 1:
            raise Unrecognised(f"the branch output `{describe_node(b)}` is used outside the residual add")
        post_norm = None
        a_users = list(a.users)
        if len(a_users) == 1 and is_norm_node(a_users[0], block) and a_users[0].args[0] is a:
            post_norm = a_users[0]
        if pre_norm is not None and post_norm is not None:
            raise Unrecognised("a sublayer with a norm both before the branch and after the add is not supported")
        if post_norm is not None:
            placement = "post"
        elif pre_norm is not None:
            placement = "sandwich" if is_norm_node(b, block) else "pre"
        else:
            placement = "none"
        sublayers.append(TracedSublayer(len(sublayers), placement, s, a, b, pre_norm, post_norm, branch_nodes))
        s = post_norm if post_norm is not None else a
    else:  # pragma: no cover - defensive
        raise Unrecognised("could not follow the stream to the block's output")
    if not sublayers:
        raise Unrecognised("no residual add `x + F(x)` in forward")
    return sublayers


def _contains(arg, node) -> bool:
    found = []
    fx.node.map_arg(arg, lambda a: found.append(a is node))
    return any(found)


@dataclass
class EntryPlan:
    module: str
    arg_positions: tuple[int, ...]
    kwarg_names: tuple[str, ...]


@dataclass
class RewritePlan:
    """What the hooks need for one post-norm sublayer: the norm, the branch entries, the branch exit."""

    norm: str
    entries: list[EntryPlan]
    exit_module: str | None
    exit_index: int | None
    exit_reason: str = ""  # why there is no exit module


def plan_post_to_pre(block: nn.Module, graph: fx.Graph, sub: TracedSublayer) -> RewritePlan:
    """Check a post-norm sublayer can be rewritten with hooks, and say where they go."""
    module_calls: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            module_calls[n.target] = module_calls.get(n.target, 0) + 1
    norm = sub.post_norm.target
    if module_calls[norm] != 1:
        raise Unrecognised(f"norm {norm} is called {module_calls[norm]} times in forward (shared between sublayers)")
    entries = []
    for n in sub.branch_nodes:
        if sub.stream_in not in n.all_input_nodes:
            continue
        if n.op != "call_module":
            raise Unrecognised(
                f"the branch first applies `{describe_node(n)}` (a function, not a module) to the stream; "
                "declare the block with ln_lightning.register_block"
            )
        if module_calls[n.target] != 1:
            raise Unrecognised(f"branch module {n.target} is called {module_calls[n.target]} times in forward")
        pos = tuple(i for i, a in enumerate(n.args) if a is sub.stream_in)
        kws = tuple(k for k, v in n.kwargs.items() if v is sub.stream_in)
        nested = [a for a in list(n.args) + list(n.kwargs.values()) if isinstance(a, (tuple, list, dict)) and _contains(a, sub.stream_in)]
        if nested:
            raise Unrecognised(f"branch module {n.target} receives the stream inside a container argument")
        entries.append(EntryPlan(n.target, pos, kws))
    b = sub.branch_out
    exit_module, exit_index, reason = None, None, ""
    if b.op == "call_module":
        exit_module = b.target
    elif b.op == "call_function" and b.target is operator.getitem and isinstance(b.args[1], int) and b.args[0].op == "call_module":
        exit_module, exit_index = b.args[0].target, b.args[1]
    else:
        reason = f"the branch ends in `{describe_node(b)}`, not a module call"
    if exit_module is not None and module_calls[exit_module] != 1:
        exit_module, reason = None, f"branch exit {exit_module} is called more than once"
    return RewritePlan(norm, sorted(entries, key=lambda e: e.module), exit_module, exit_index, reason)
