"""Placement orders: how a policy ranks the nodes and GPUs a share fits on, as data.

An :class:`Order` is one entry of :data:`ORDERS`: a name (what ``Policy.node`` / ``Policy.gpu``,
``c.GpusharePlacement.node_policy`` / ``gpu_policy`` and a policy's JSON say), a help text, and
the two sort keys it contributes, smallest first:

- ``node_key(free, name)``: a node from its free compute (integer millionths of a GPU, summed over
  its healthy, uncordoned GPUs) and its name. The engine keeps the nodes sorted by it and re-sorts
  a node when its free compute changes, so the key may read nothing else.
- ``gpu_key(free, memory_free, index)``: a GPU of the chosen node from its free compute, free
  memory (bytes) and index.

Both keys must break every tie (end with the name / the index) so that a decision is
deterministic. The engine and the naive reference placer both ask for an order by name with
:func:`order_named`, and nothing else in the package compares policy names: adding an order is one
:func:`register` call (here, or in a deployment's own code before the server starts); config
validation, :class:`~.policy.Policy` and both placers pick it up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..share import ShareError

#: a node's sort key from (free compute, node name)
NodeKey = Callable[[int, str], tuple[Any, ...]]
#: a GPU's sort key from (free compute, free memory, index)
GpuKey = Callable[[int, int, int], tuple[Any, ...]]


@dataclass(frozen=True)
class Order:
    """One way of ranking nodes and GPUs (see the module doc for what the keys may read)."""

    name: str
    help: str
    node_key: NodeKey
    gpu_key: GpuKey


#: every order, by name, in the order they were registered (the first is the default)
ORDERS: dict[str, Order] = {}


def register(order: Order) -> Order:
    """Add ``order`` under its name (replacing one of the same name); returns it."""
    ORDERS[order.name] = order
    return order


def allowed() -> str:
    """The registered names, as an error message lists them."""
    return "one of " + ", ".join(ORDERS)


def order_named(name: object, field: str) -> Order:
    """The order called ``name``; a :class:`ShareError` naming ``field``, the value and the
    registered names otherwise."""
    found = ORDERS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ShareError(field, name, allowed())
    return found


def described() -> str:
    """Every order with its help, for traitlets help strings."""
    return "; ".join(f"'{o.name}' {o.help}" for o in ORDERS.values())


BINPACK = register(
    Order(
        "binpack",
        "fills the fullest node / GPU that still fits (keeps whole nodes and GPUs free for big "
        "requests)",
        node_key=lambda free, name: (free, name),
        gpu_key=lambda free, memory, index: (free, memory, index),
    )
)

SPREAD = register(
    Order(
        "spread",
        "picks the emptiest node / GPU (least interference between kernels)",
        node_key=lambda free, name: (-free, name),
        gpu_key=lambda free, memory, index: (-free, -memory, index),
    )
)
