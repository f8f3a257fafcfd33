"""Placement: where a share goes (DEVELOPING.md, box 4). Pure functions over plain data.

Interface (stable; the engine behind it may grow):

``place(gpus, allocations, spec, policy=Policy()) -> Placement``, or raise
:class:`PlacementRefused` (nothing fits *now*; the message says why in user terms and what would
fit) or :class:`~jupyter_gpushare.share.ShareError` (the request could never be valid on this
inventory: a type that no GPU has, or every wanted type excluded; the same affinity and
anti-affinity label; an affinity label with ``gpu_count > 1`` (whole GPUs share with nobody);
more whole GPUs than any node has of one type; more memory than the largest admitted GPU).

What may be chosen and in which order is written down in :mod:`.engine`; :class:`Policy`
(:mod:`.policy`) names the order per node and per GPU (``binpack``, ``spread``: one
:class:`~.orders.Order` each in :mod:`.orders`, the one file a new order is added to), the types
wanted and excluded (aliases, NVML product names or ``nvidia.com/gpu.product`` labels,
case-insensitive) and the cordoned nodes and GPUs; a deployment configures it with
:class:`.config.GpusharePlacement` and narrows it per request with :meth:`Policy.narrowed`. The
request itself carries one wanted type (``spec.gpu_type``) and its locality labels
(``spec.gpu_labels``).

``place`` builds a :class:`Placer` (an index over the inventory and the live allocations) per
call; a long-lived caller (a watch on the Kubernetes ledger, a benchmark) keeps one and updates it
with :meth:`Placer.add`, :meth:`Placer.remove` or :meth:`Placer.sync`. The placement rules are
written down in :mod:`.engine`; :mod:`.naive` is the same rules as a plain full scan, the baseline
and test reference. Concurrency is the ledger's job: ``Ledger.allocate`` calls ``place`` on a
snapshot and records the result with a compare-and-swap, retrying when another placer won;
:func:`allocate` wraps it and also settles affinity groups that racing placers started on two
nodes at once (see :mod:`.concurrent`).
"""

from __future__ import annotations

from ..share import format_bytes
from .concurrent import allocate, bind
from .engine import UNITS, Placement, PlacementRefused, Placer, place, to_units
from .orders import ORDERS, Order, register
from .policy import Policy, TypeFilter, resolve_types

__all__ = [
    "ORDERS",
    "UNITS",
    "Order",
    "Placement",
    "PlacementRefused",
    "Placer",
    "Policy",
    "TypeFilter",
    "allocate",
    "bind",
    "format_bytes",
    "place",
    "register",
    "resolve_types",
    "to_units",
]
