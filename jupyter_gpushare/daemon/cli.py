"""``jupyter gpushare daemon``: the node daemon's command line.

The lead's CLI calls :func:`add_arguments` on its sub-parser and :func:`run` with the parsed
arguments; ``python -m jupyter_gpushare.daemon`` does the same on its own parser. Defaults and
help texts come from :class:`DaemonConfig` (a traitlets ``Configurable``, so a Jupyter config file
can set them too: ``c.DaemonConfig.quantum_ms = 10``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

from traitlets import Float, Int, Unicode
from traitlets.config import Configurable

from .. import paths
from ..inventory import local_node_name
from ..ledger import Ledger
from .shm import StateDirError


class DaemonConfig(Configurable):
    quantum_ms = Float(20.0, help="Lease quantum in ms (10-50): the longest a GPU is held by "
                       "one kernel while others wait.").tag(config=True)
    window_ms = Float(1000.0, help="Sliding window in ms (1000-2000) over which request and "
                      "limit shares are measured.").tag(config=True)
    poll_ms = Float(250.0, help="How often a SQLite ledger is re-read, in ms (a Kubernetes "
                    "ledger is watched).").tag(config=True)
    metrics_host = Unicode("127.0.0.1", help="Address of the Prometheus endpoint (keep it on "
                           "loopback unless the network is trusted).").tag(config=True)
    metrics_port = Int(0, help="Port of the Prometheus endpoint; 0 disables it, -1 picks a "
                       "free port.").tag(config=True)
    max_connections_per_uid = Int(256, help="Connections one uid may hold open to the agent's "
                                  "socket (uid 0 and the agent's own uid are not capped); more "
                                  "are closed at once.").tag(config=True)
    max_connections_per_pod = Int(64, help="Connections one kernel pod may hold open to the "
                                  "agent's socket.").tag(config=True)
    idle_timeout_s = Float(60.0, help="Seconds after which a connection that holds no GPU "
                           "share and sent no request is closed (0: never).").tag(config=True)
    fd_reserve = Int(64, help="File descriptors kept for admins and processes that hold a GPU "
                     "share: other new connections are refused when fewer are free.").tag(
                         config=True)
    admin_group = Unicode("", help="Unix group whose members see every share in the agent's "
                          "status, as root and the agent's own user do (empty: none).").tag(
                              config=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DaemonConfig()
    parser.add_argument("--socket", type=Path, default=None,
                        help=f"unix socket to serve (default {paths.socket_path()})")
    parser.add_argument("--ledger", type=Path, default=None,
                        help=f"SQLite ledger to follow (default {paths.ledger_path()})")
    parser.add_argument("--kubernetes-namespace", default=None, metavar="NS",
                        help="follow the Kubernetes ledger (GpuLedger records in NS) instead of "
                        "a SQLite ledger (a DaemonSet on a cluster)")
    parser.add_argument("--kubeconfig", default="",
                        help="with --kubernetes-namespace: kubeconfig file (default: in-cluster "
                        "service account, else $KUBECONFIG)")
    parser.add_argument("--node", default=None,
                        help="node name whose allocations to enforce (default: this host)")
    parser.add_argument("--simulate-devices", "--simulate", dest="simulate", default=None,
                        metavar="N[xTYPE]",
                        help="enforce on simulated GPUs (e.g. 2xA100); also GPUSHARE_SIMULATE")
    parser.add_argument("--simulate-from-node-label", action="store_true",
                        help=f"with --kubernetes-namespace: simulate the GPUs named by the Node's "
                        f"{SIMULATE_LABEL} label when it has one (demo nodes without GPUs), "
                        "else use the real ones")
    parser.add_argument("--quantum-ms", type=float, default=d.quantum_ms,
                        help=DaemonConfig.quantum_ms.help)
    parser.add_argument("--window-ms", type=float, default=d.window_ms,
                        help=DaemonConfig.window_ms.help)
    parser.add_argument("--poll-ms", type=float, default=d.poll_ms, help=DaemonConfig.poll_ms.help)
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="directory of the per-GPU shared-memory files (default /dev/shm/…)")
    parser.add_argument("--metrics-host", default=d.metrics_host,
                        help=DaemonConfig.metrics_host.help)
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port,
                        help=DaemonConfig.metrics_port.help)
    parser.add_argument("--usage-interval", type=float, default=2.0, metavar="S",
                        help="with --kubernetes-namespace: seconds between writes of this node's "
                        "usage to its ConfigMap gpushare-usage-<node> (0: never)")
    parser.add_argument("--max-connections-per-uid", type=int, metavar="N",
                        default=d.max_connections_per_uid,
                        help=DaemonConfig.max_connections_per_uid.help)
    parser.add_argument("--max-connections-per-pod", type=int, metavar="N",
                        default=d.max_connections_per_pod,
                        help=DaemonConfig.max_connections_per_pod.help)
    parser.add_argument("--idle-timeout", type=float, metavar="S", default=d.idle_timeout_s,
                        help=DaemonConfig.idle_timeout_s.help)
    parser.add_argument("--fd-reserve", type=int, metavar="N", default=d.fd_reserve,
                        help=DaemonConfig.fd_reserve.help)
    parser.add_argument("--admin-group", metavar="GROUP", default=d.admin_group,
                        help=DaemonConfig.admin_group.help)
    parser.add_argument("--log-level", default="INFO", help="logging level")


#: a demo node's simulated GPUs (``--simulate-from-node-label``), e.g. ``2xA100``
SIMULATE_LABEL = "gpushare.jupyter.org/simulate"


async def _ledger(args: argparse.Namespace) -> Ledger:
    """The ledger this daemon follows: the node's GpuLedger records on Kubernetes, else SQLite."""
    if args.kubernetes_namespace:
        from ..k8s.client import connect
        from ..k8s.ledger import KubernetesLedger

        return KubernetesLedger(await connect(args.kubeconfig), args.kubernetes_namespace)
    from ..ledger.sqlite import SQLiteLedger

    return SQLiteLedger(args.ledger or paths.ledger_path())


async def _simulate_value(args: argparse.Namespace, ledger: Ledger, node: str) -> str | None:
    simulate = args.simulate or os.environ.get("GPUSHARE_SIMULATE")
    kube = getattr(ledger, "kube", None)
    if simulate or not args.simulate_from_node_label or kube is None:
        return simulate
    labels = (await kube.read_node(node)).get("metadata", {}).get("labels") or {}
    return labels.get(SIMULATE_LABEL) or None


async def _publish_gpus(ledger: Ledger, node: str, simulate: str | None) -> None:
    """On Kubernetes the daemon publishes its node's GPUs (the inventory placement reads)."""
    if not hasattr(ledger, "kube"):
        return  # the local server publishes a workstation's GPUs itself
    from ..inventory import discover_local

    gpus = await asyncio.to_thread(discover_local, simulate, None, node)
    try:
        await ledger.put_gpus(node, gpus)
    except Exception as exc:  # enforcement does not depend on it: say so and go on
        logging.error("could not publish the GPUs of node %s: %s", node, exc)
        return
    logging.info("published %d GPU(s) of node %s", len(gpus), node)


def run(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s gpushare-daemon %(levelname)s %(message)s")
    if not 1 <= args.quantum_ms <= 1000 or not args.quantum_ms <= args.window_ms <= 60000:
        logging.error("need 1 <= quantum-ms <= window-ms <= 60000")
        return 2
    limits = {"--max-connections-per-uid": args.max_connections_per_uid,
              "--max-connections-per-pod": args.max_connections_per_pod,
              "--fd-reserve": args.fd_reserve}
    for name, value in limits.items():
        if value < 1:
            logging.error("%s %s: need a whole number >= 1", name, value)
            return 2
    if not 0 <= args.idle_timeout <= 86400:
        logging.error("--idle-timeout %s: need 0 (never) to 86400 seconds", args.idle_timeout)
        return 2
    if args.admin_group:
        import grp

        try:
            grp.getgrnam(args.admin_group)
        except KeyError:
            logging.error("--admin-group %s: no such group", args.admin_group)
            return 2
    try:
        asyncio.run(_main(args))
    except KeyboardInterrupt:
        pass
    except StateDirError as exc:  # an unsafe lease-memory directory: say which and why
        logging.error("%s", exc)
        return 2
    return 0


async def _main(args: argparse.Namespace) -> None:
    from .env import simulator_environ
    from .server import Daemon, DaemonSettings

    socket_path = (args.socket or paths.socket_path()).absolute()
    node = args.node or local_node_name()
    ledger = await _ledger(args)
    simulate = await _simulate_value(args, ledger, node)
    await _publish_gpus(ledger, node, simulate)
    nvml_library = None
    if simulate:
        from ..inventory import simulated_gpus

        os.environ.update(simulator_environ(simulated_gpus(simulate, node), socket_path))
        nvml_library = _sim_nvml()
    settings = DaemonSettings(
        socket_path=socket_path,
        node=node,
        quantum_ns=int(args.quantum_ms * 1e6),
        window_ns=int(args.window_ms * 1e6),
        poll_ns=int(args.poll_ms * 1e6),
        state_dir=args.state_dir,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port or None,
        nvml_library=nvml_library,
        max_connections_per_uid=args.max_connections_per_uid,
        max_connections_per_pod=args.max_connections_per_pod,
        fd_reserve=args.fd_reserve,
        idle_timeout_s=args.idle_timeout,
        admin_group=args.admin_group or None,
    )
    daemon = Daemon(ledger, settings)
    await daemon.start()
    usage = None
    if args.kubernetes_namespace:  # the servers read this node's usage from a ConfigMap
        from ..k8s.usage import start_publisher

        usage = start_publisher(daemon, ledger, args.usage_interval)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stop)
    if settings.metrics_port is not None:
        from .metrics import serve

        def status() -> dict:
            future = asyncio.run_coroutine_threadsafe(_status(daemon), loop)
            return future.result(timeout=5)

        port = serve(status, settings.metrics_host, max(settings.metrics_port, 0))
        daemon.metrics_port = port
        logging.info("metrics on http://%s:%d/metrics", settings.metrics_host, port)
    print(f"gpushare daemon ready on {socket_path}", flush=True)
    try:
        await daemon.serve_forever()
    finally:
        if usage is not None:
            await usage.stop()
        with contextlib.suppress(Exception):
            await daemon.close()
        await ledger.close()


async def _status(daemon: object) -> dict:
    return daemon.status()  # type: ignore[attr-defined]


def _sim_nvml() -> str | None:
    library = paths.lib_dir() / "sim" / "libnvidia-ml.so.1"
    return str(library) if library.exists() else None
