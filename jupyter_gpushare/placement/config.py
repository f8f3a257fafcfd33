"""Deployment configuration of placement (traitlets), turned into a :class:`Policy`.

Set in ``jupyter_server_config.py`` as ``c.GpusharePlacement.node_policy = "spread"`` and so on;
the server extension builds one :class:`Policy` from it and narrows it per request.
"""

from __future__ import annotations

from typing import Any

from traitlets import List, TraitError, Unicode, validate
from traitlets.config import Configurable

from ..inventory import TypeAliases
from ..share import ShareError
from .orders import BINPACK, described, order_named
from .policy import Policy


class GpusharePlacement(Configurable):
    """Where shares go on this deployment's GPUs."""

    node_policy = Unicode(
        BINPACK.name,
        help="Which node a share goes to, by the name of a placement order: " + described() + ".",
    ).tag(config=True)

    gpu_policy = Unicode(
        BINPACK.name,
        help="Which GPU of that node, by the name of a placement order: " + described() + ".",
    ).tag(config=True)

    @validate("node_policy", "gpu_policy")
    def _known_order(self, proposal: dict[str, Any]) -> str:
        """Only a registered order (:mod:`.orders`); the error names the setting, the value
        and the registered names."""
        name = proposal["trait"].name
        try:
            return order_named(proposal["value"], f"GpusharePlacement.{name}").name
        except ShareError as exc:
            raise TraitError(str(exc)) from None

    gpu_types = List(
        Unicode(),
        default_value=[],
        help="GPU types (aliases such as A100, T4) that kernels may use; empty means all.",
    ).tag(config=True)

    exclude_types = List(
        Unicode(),
        default_value=[],
        help="GPU types never used for kernels (for example GPUs reserved for batch jobs).",
    ).tag(config=True)

    cordoned_nodes = List(
        Unicode(),
        default_value=[],
        help="Nodes that take no new shares; shares already running there keep running.",
    ).tag(config=True)

    cordoned_gpus = List(
        Unicode(),
        default_value=[],
        help="GPU UUIDs that take no new shares; shares already running there keep running.",
    ).tag(config=True)

    def policy(self, aliases: TypeAliases | None = None) -> Policy:
        """The deployment's policy; ``aliases`` are the server's GPU type aliases
        (``GpuShare.type_aliases``), the one place they are configured."""
        return Policy(
            node=self.node_policy,
            gpu=self.gpu_policy,
            gpu_types=tuple(self.gpu_types),
            exclude_types=tuple(self.exclude_types),
            cordoned_nodes=frozenset(self.cordoned_nodes),
            cordoned_gpus=frozenset(self.cordoned_gpus),
            aliases=aliases or TypeAliases(),
        )
