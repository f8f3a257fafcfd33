"""An agent started on demand stops once nobody needs it (``--exit-when-idle``).

The first gpushare command on a one-person machine starts a per-user node agent (the server, a
kernel, ``jupyter gpushare run``, a test); it used to run until the machine stopped. It now stops
after :attr:`~jupyter_gpushare.daemon.cli.DaemonConfig.exit_when_idle_s` seconds with no share in
its ledger for this node, no client connected and no connection made: a Jupyter server keeps its
agent alive (its agent watch connects every 2 s), and the next gpushare command starts a new one.
A system agent (``--system``) and an agent on Kubernetes never stop this way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

log = logging.getLogger("jupyter_gpushare.daemon")

#: seconds between two looks
POLL_S = 1.0


class _Agent(Protocol):
    clients: Any  # a set of connected clients
    allocations: Any  # the node's shares, by id
    accepted: int  # connections accepted so far

    def stop(self) -> None: ...


def applies(system: bool, kubernetes: bool, idle_s: float) -> bool:
    """Whether an agent stops when idle: only a per-user agent on a machine, with a time set."""
    return not system and not kubernetes and idle_s > 0


def busy(agent: _Agent) -> bool:
    return bool(agent.clients) or bool(agent.allocations)


async def exit_when_idle(agent: _Agent, idle_s: float, poll_s: float = POLL_S) -> None:
    """Stop ``agent`` once it has been idle (:func:`busy` false, no connection accepted) for
    ``idle_s`` seconds in a row."""
    loop = asyncio.get_running_loop()
    since = loop.time()
    accepted = agent.accepted
    while True:
        await asyncio.sleep(min(poll_s, idle_s))
        now = loop.time()
        if busy(agent) or agent.accepted != accepted:
            accepted = agent.accepted
            since = now
            continue
        if now - since >= idle_s:
            log.info(
                "no share and no client for %g s: this agent, started on demand, stops (the "
                "next gpushare command starts one again; --exit-when-idle 0 keeps it)",
                idle_s,
            )
            agent.stop()
            return
