"""Deployment configuration of placement (traitlets), turned into a :class:`Policy`.

Set in ``jupyter_server_config.py`` as ``c.GpusharePlacement.node_policy = "spread"`` and so on;
the server extension builds one :class:`Policy` from it and narrows it per request.
"""

from __future__ import annotations

from traitlets import Enum, List, Unicode
from traitlets.config import Configurable

from ..inventory import TypeAliases
from .policy import POLICIES, Policy


class GpusharePlacement(Configurable):
    """Where shares go on this deployment's GPUs."""

    node_policy = Enum(
        list(POLICIES),
        default_value="binpack",
        help="Which node a share goes to: 'binpack' fills the fullest node that fits (keeps "
        "whole nodes free for multi-GPU kernels), 'spread' the emptiest.",
    ).tag(config=True)

    gpu_policy = Enum(
        list(POLICIES),
        default_value="binpack",
        help="Which GPU of that node: 'binpack' the fullest that fits (keeps whole GPUs free), "
        "'spread' the emptiest (least interference between kernels).",
    ).tag(config=True)

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
