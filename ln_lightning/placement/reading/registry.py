"""Telling `convert` about a block class it cannot read by itself.

    from ln_lightning import Sublayer, register_block

    class MyBlock(nn.Module):
        def forward(self, x, cache=None):
            h = self.attn(x, cache)                  # returns a tensor
            x = self.norm1(x + h)
            return self.norm2(x + self.ffn(x))

    register_block(MyBlock, [Sublayer(norm="norm1", branch="attn"),
                             Sublayer(norm="norm2", branch="ffn")])

Each `Sublayer` says: in `forward`, the stream `x` enters the module at `branch` (as its positional
arguments `stream_args`, default the first), the branch's value is the output of `exit` (default:
`branch` itself; `exit_index` picks an element when it returns a tuple), and `norm` is applied to
`x + branch_value` (`placement="post"`). Declared blocks are checked on a probe input like every
other block: a declaration that does not match what `forward` does is reported, not trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ln_lightning.norm import kinds
from ln_lightning.placement.errors import PlacementError


@dataclass(frozen=True)
class Sublayer:
    norm: str
    branch: str
    exit: str | None = None
    exit_index: int | None = None
    stream_args: tuple[int, ...] = (0,)
    stream_kwargs: tuple[str, ...] = ()
    placement: str = "post"
    name: str | None = None


_blocks: dict[type, tuple[Sublayer, ...]] = {}
_norms: list[type] = []


def register_block(block_class: type, sublayers: list[Sublayer]) -> None:
    """Declare how `block_class` maps onto (branch, norm) sublayers; see the module docstring."""
    if not (isinstance(block_class, type) and issubclass(block_class, nn.Module)):
        raise PlacementError(f"register_block expects an nn.Module subclass, got {block_class!r}")
    subs = tuple(sublayers)
    if not subs or not all(isinstance(s, Sublayer) for s in subs):
        raise PlacementError("register_block needs a non-empty list of ln_lightning.Sublayer(norm=..., branch=...)")
    for s in subs:
        if s.placement not in ("post", "pre"):
            raise PlacementError(f"Sublayer.placement must be 'post' or 'pre', got {s.placement!r}")
    _blocks[block_class] = subs


def unregister_block(block_class: type) -> None:
    _blocks.pop(block_class, None)


def registered_sublayers(module: nn.Module) -> tuple[Sublayer, ...] | None:
    for cls in type(module).__mro__:
        if cls in _blocks:
            return _blocks[cls]
    return None


def register_norm_class(norm_class: type) -> None:
    """Treat `norm_class` (an nn.Module normalising its input's last dimensions) as a norm (LayerNorm or RMSNorm, decided by what it computes)."""
    if not (isinstance(norm_class, type) and issubclass(norm_class, nn.Module)):
        raise PlacementError(f"register_norm_class expects an nn.Module subclass, got {norm_class!r}")
    if norm_class not in _norms:
        _norms.append(norm_class)

    kinds.register_norm_class(norm_class)  # one registry: the swap and the monitors see it too


def registered_norm_classes() -> list[type]:
    return list(_norms)
