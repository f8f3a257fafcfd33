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
import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from traitlets import Float, Int, Unicode
from traitlets.config import Configurable

from .. import paths
from ..inventory import TypeAliases, local_node_name
from ..ledger import Ledger
from ..placement import Policy
from ..queue import QueuePolicy
from ..share import ShareError
from . import idle_exit
from .ledger_ops import MAX_SHARES_PER_USER, Access, configure
from .lock import UnsafeDirectory, ensure_private_dir
from .lock import holder as lock_holder
from .lock import take as take_lock
from .shm import StateDirError


class DaemonConfig(Configurable):
    quantum_ms = Float(
        20.0,
        help="Lease quantum in ms (10-50): the longest a GPU is held by "
        "one kernel while others wait.",
    ).tag(config=True)
    window_ms = Float(
        1000.0,
        help="Sliding window in ms (1000-2000) over which request and limit shares are measured.",
    ).tag(config=True)
    poll_ms = Float(
        250.0, help="How often a SQLite ledger is re-read, in ms (a Kubernetes ledger is watched)."
    ).tag(config=True)
    metrics_host = Unicode(
        "127.0.0.1",
        help="Address of the Prometheus endpoint (keep it on "
        "loopback unless the network is trusted).",
    ).tag(config=True)
    metrics_port = Int(
        0, help="Port of the Prometheus endpoint; 0 disables it, -1 picks a free port."
    ).tag(config=True)
    max_connections_per_uid = Int(
        256,
        help="Connections one uid may hold open to the agent's "
        "socket (uid 0 and the agent's own uid are not capped); more "
        "are closed at once.",
    ).tag(config=True)
    max_connections_per_pod = Int(
        64, help="Connections one kernel pod may hold open to the agent's socket."
    ).tag(config=True)
    idle_timeout_s = Float(
        60.0,
        help="Seconds after which a connection that holds no GPU "
        "share and sent no request is closed (0: never).",
    ).tag(config=True)
    exit_when_idle_s = Float(
        600.0,
        help="An agent started on demand (per user, not --system, not on Kubernetes) stops "
        "after this many seconds with no share, no client and no connection; the next "
        "gpushare command starts one again (0: never). Default 600 (10 minutes).",
    ).tag(config=True)
    fd_reserve = Int(
        64,
        help="File descriptors kept for admins and processes that hold a GPU "
        "share: other new connections are refused when fewer are free.",
    ).tag(config=True)
    admin_group = Unicode(
        "",
        help="Unix group whose members see every share in the agent's "
        "status, as root and the agent's own user do (empty: none).",
    ).tag(config=True)


#: the flags that set a :class:`DaemonConfig` setting: (flag, trait, metavar); the type, default
#: and help are the trait's
CONFIG_FLAGS: tuple[tuple[str, str, str | None], ...] = (
    ("--quantum-ms", "quantum_ms", None),
    ("--window-ms", "window_ms", None),
    ("--poll-ms", "poll_ms", None),
    ("--metrics-host", "metrics_host", None),
    ("--metrics-port", "metrics_port", None),
    ("--max-connections-per-uid", "max_connections_per_uid", "N"),
    ("--max-connections-per-pod", "max_connections_per_pod", "N"),
    ("--idle-timeout", "idle_timeout_s", "S"),
    ("--exit-when-idle", "exit_when_idle_s", "S"),
    ("--fd-reserve", "fd_reserve", "N"),
    ("--admin-group", "admin_group", "GROUP"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DaemonConfig()
    parser.add_argument(
        "--socket",
        type=Path,
        default=None,
        help=f"unix socket to serve (default: $GPUSHARE_SOCKET, else "
        f"{paths.user_socket_path()}; with --system {paths.SYSTEM_SOCKET})",
    )
    parser.add_argument(
        "--ledger",
        type=Path,
        default=None,
        help=f"SQLite ledger to follow (default: $GPUSHARE_LEDGER, else "
        f"{paths.ledger_path()}; with --system {paths.SYSTEM_LEDGER}, which the "
        "agent alone opens and serves to users on its socket)",
    )
    parser.add_argument(
        "--system",
        action="store_true",
        help="run as the machine's system agent (a system service, as root): it "
        "owns the ledger and serves placement, release and resize to every "
        "user, each seeing and changing only their own shares",
    )
    parser.add_argument(
        "--group",
        default=None,
        metavar="GROUP",
        help="with --system: only members of this Unix group (and admins) may "
        "use the GPUs (socket mode 0660, group GROUP); default: every user "
        "(socket 0666, callers known by their peer credentials)",
    )
    parser.add_argument(
        "--max-share",
        default=None,
        metavar="JSON",
        help="with --system: the most any one share may hold, as JSON share "
        'keys, e.g. \'{"gpu_request": 0.5, "gpu_limit": 0.5, '
        '"gpu_memory": "40GiB"}\'; recorded on each share when it is '
        "created (with JupyterHub's GPUSHARE_MAX_SHARE: the smaller wins) and "
        "enforced on every later change",
    )
    parser.add_argument(
        "--queue-max-per-user",
        type=int,
        default=8,
        metavar="N",
        help="starts one user may have waiting in the queue at once (run --wait, the "
        "provisioner's queue_wait)",
    )
    parser.add_argument(
        "--queue-hold",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds a waiting start may be passed by later, smaller ones that fit; after "
        "that nothing of its GPU type goes ahead of it",
    )
    parser.add_argument(
        "--queue-eta-window",
        type=float,
        default=1800.0,
        metavar="S",
        help="how far back (seconds) the queue's ETA looks for releases to estimate their rate",
    )
    parser.add_argument(
        "--queue-weight",
        action="append",
        default=[],
        metavar="GROUP=W",
        help="members of GROUP count their holding divided by W in the queue's fair order "
        "(repeatable; a user has their groups' largest)",
    )
    parser.add_argument(
        "--queue-priority",
        action="append",
        default=[],
        metavar="GROUP=P",
        help="members of GROUP go ahead of every user of a lower priority in the queue "
        "(an integer, default 0; repeatable)",
    )
    parser.add_argument(
        "--max-shares-per-user",
        type=int,
        default=None,
        metavar="N",
        help="with --system: the most GPU shares one user holds on this machine at once "
        "(default 16; 0: no bound); one GPU holds at most 64 shares (its lease board's slots)",
    )
    parser.add_argument(
        "--group-max-share",
        action="append",
        default=[],
        metavar="GROUP=JSON",
        help="with --system: a bound for members of GROUP (repeatable); where "
        "several apply, the smallest of each field wins",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="Jupyter config file(s) (.py or .json) with the deployment's "
        "c.GpuShare.type_aliases and c.GpusharePlacement.* (policy, cordons, "
        "exclusions) for the agent's own placements (a kernel's reserve); "
        "default: jupyter_server_config.* on the Jupyter config path",
    )
    parser.add_argument(
        "--kubernetes-namespace",
        default=None,
        metavar="NS",
        help="follow the Kubernetes ledger (GpuLedger records in NS) instead of "
        "a SQLite ledger (a DaemonSet on a cluster)",
    )
    parser.add_argument(
        "--kubeconfig",
        default="",
        help="with --kubernetes-namespace: kubeconfig file (default: in-cluster "
        "service account, else $KUBECONFIG)",
    )
    parser.add_argument(
        "--node", default=None, help="node name whose allocations to enforce (default: this host)"
    )
    parser.add_argument(
        "--device-plugin",
        action="store_true",
        help="with --kubernetes-namespace: also serve the kubelet's device-plugin "
        "API (k8s/device_plugin): advertise 100 share units per GPU and hand "
        "kernel pods their GPU, the interposer and a socket of their own",
    )
    parser.add_argument(
        "--kubelet-socket",
        type=Path,
        metavar="PATH",
        default=Path("/var/lib/kubelet/device-plugins/kubelet.sock"),
        help="the kubelet's device-plugin registration socket; the plugin "
        "serves gpushare.sock beside it",
    )
    parser.add_argument(
        "--share-resource",
        default="gpushare.jupyter.org/gpu-share",
        metavar="NAME",
        help="extended resource the device plugin advertises",
    )
    parser.add_argument(
        "--interposer-dir",
        type=Path,
        default=Path("/opt/gpushare/lib"),
        metavar="DIR",
        help="host directory with libgpushare.so that the "
        "device plugin mounts read-only into kernel pods",
    )
    parser.add_argument(
        "--pod-socket-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="host directory of the per-pod socket directories (default: pods/ beside --socket)",
    )
    parser.add_argument(
        "--simulate-devices",
        "--simulate",
        dest="simulate",
        default=None,
        metavar="N[xTYPE]",
        help="enforce on simulated GPUs (e.g. 2xA100); also GPUSHARE_SIMULATE",
    )
    parser.add_argument(
        "--simulate-from-node-label",
        action="store_true",
        help=f"with --kubernetes-namespace: simulate the GPUs named by the Node's "
        f"{SIMULATE_LABEL} label when it has one (demo nodes without GPUs), "
        "else use the real ones",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the agent's private directory of lease memory (made 0700; one "
        "that is a symlink, another user's or open to others is refused; default "
        "$XDG_RUNTIME_DIR/gpushare/… or /dev/shm/gpushare-<uid>-…)",
    )
    parser.add_argument(
        "--usage-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="with --kubernetes-namespace: seconds between writes of this node's "
        "usage to its ConfigMap gpushare-usage-<node> (0: never)",
    )
    parser.add_argument(
        "--driver-check",
        choices=("on", "shares", "off"),
        default="on",
        help="--system and Kubernetes node agents: check what the driver (NVML) reports per "
        "process against the shares and stop or pause processes beyond a share's memory cap "
        "or compute limit, and processes of users without a share on the GPU they use (on); "
        "'shares': leave those alone (a Kubernetes node agent always does, whatever this "
        "says: other pods may use a node's GPUs); off: never. A per-user agent serves its own "
        "processes only: no check",
    )
    for flag, trait, metavar in CONFIG_FLAGS:  # one flag per DaemonConfig setting
        default = getattr(d, trait)
        parser.add_argument(
            flag,
            type=type(default),
            default=default,
            metavar=metavar,
            help=DaemonConfig.class_traits()[trait].help,
        )
    parser.add_argument("--log-level", default="INFO", help="logging level")


#: a demo node's simulated GPUs (``--simulate-from-node-label``), e.g. ``2xA100``
SIMULATE_LABEL = "gpushare.jupyter.org/simulate"


async def _ledger(args: argparse.Namespace) -> Ledger:
    """The ledger this daemon follows: the node's GpuLedger records on Kubernetes, else SQLite."""
    if args.kubernetes_namespace:
        from ..k8s.ledger import connect_ledger  # lazy on purpose: a local agent never needs it

        return await connect_ledger(args.kubernetes_namespace, args.kubeconfig)
    from ..ledger.sqlite import SQLiteLedger

    if args.system:  # the agent is the file's only writer: reads come from memory
        from ..ledger.cached import CachedSQLiteLedger

        return CachedSQLiteLedger(ledger_file(args))
    return SQLiteLedger(ledger_file(args))


def serve_path(args: argparse.Namespace) -> Path:
    """The socket this agent serves: --socket, $GPUSHARE_SOCKET, else the system or the user's
    default."""
    if args.socket:
        return Path(args.socket).absolute()
    if os.environ.get("GPUSHARE_SOCKET"):
        return Path(os.environ["GPUSHARE_SOCKET"]).absolute()
    return paths.SYSTEM_SOCKET if args.system else paths.user_socket_path().absolute()


def ledger_file(args: argparse.Namespace) -> Path:
    if args.ledger:
        return Path(args.ledger).absolute()
    if os.environ.get("GPUSHARE_LEDGER"):
        return Path(os.environ["GPUSHARE_LEDGER"]).absolute()
    return paths.SYSTEM_LEDGER if args.system else paths.ledger_path()


async def _simulate_value(args: argparse.Namespace, ledger: Ledger, node: str) -> str | None:
    simulate = args.simulate or os.environ.get("GPUSHARE_SIMULATE")
    kube = getattr(ledger, "kube", None)
    if simulate or not args.simulate_from_node_label or kube is None:
        return simulate
    labels = (await kube.read_node(node)).get("metadata", {}).get("labels") or {}
    return labels.get(SIMULATE_LABEL) or None


async def _publish_gpus(
    ledger: Ledger,
    node: str,
    simulate: str | None,
    system: bool = False,
    aliases: TypeAliases | None = None,
) -> None:
    """On Kubernetes and as a system agent the daemon publishes its node's GPUs (the inventory
    placement reads)."""
    if not hasattr(ledger, "kube") and not system:
        return  # the local server publishes a workstation's GPUs itself
    from ..inventory import discover_local

    gpus = await asyncio.to_thread(discover_local, simulate, aliases, node)
    try:
        await ledger.put_gpus(node, gpus)
    except Exception as exc:  # enforcement does not depend on it: say so and go on
        logging.error("could not publish the GPUs of node %s: %s", node, exc)
        return
    logging.info("published %d GPU(s) of node %s", len(gpus), node)


def run(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s gpushare-daemon %(levelname)s %(message)s",
    )
    if not 1 <= args.quantum_ms <= 1000 or not args.quantum_ms <= args.window_ms <= 60000:
        logging.error("need 1 <= quantum-ms <= window-ms <= 60000")
        return 2
    limits = {
        "--max-connections-per-uid": args.max_connections_per_uid,
        "--max-connections-per-pod": args.max_connections_per_pod,
        "--fd-reserve": args.fd_reserve,
    }
    for name, value in limits.items():
        if value < 1:
            logging.error("%s %s: need a whole number >= 1", name, value)
            return 2
    if not 0 <= args.idle_timeout <= 86400:
        logging.error("--idle-timeout %s: need 0 (never) to 86400 seconds", args.idle_timeout)
        return 2
    if not 0 <= args.exit_when_idle <= 31_536_000:
        logging.error(
            "--exit-when-idle %s: need 0 (never) to 31536000 seconds", args.exit_when_idle
        )
        return 2
    if args.device_plugin and not args.kubernetes_namespace:
        logging.error(
            "--device-plugin: needs --kubernetes-namespace (the plugin finds kernel "
            "pods and their allocations on the cluster)"
        )
        return 2
    if args.admin_group:
        import grp

        try:
            grp.getgrnam(args.admin_group)
        except KeyError:
            logging.error("--admin-group %s: no such group", args.admin_group)
            return 2
    try:
        access = _access(args)
        args.queue_policy = _queue_policy(args)
    except (ValueError, KeyError) as exc:
        logging.error("%s", exc)
        return 2
    path = serve_path(args)
    try:
        if args.system:
            os.umask(0o077)  # the ledger, its journal and the lock: the agent's alone
            ensure_private_dir(path.parent, 0o755)
            ensure_private_dir(ledger_file(args).parent, 0o700)
        else:
            ensure_private_dir(path.parent, 0o755, exact=False)
        held = take_lock(path)
    except (UnsafeDirectory, OSError) as exc:
        logging.error("cannot serve %s: %s", path, exc)
        return 2
    if held is None:  # another agent serves this socket: nothing to do
        print(
            f"gpushare daemon: another agent (pid {_serving_pid(path) or '?'}) already "
            f"serves {path}; exiting",
            flush=True,
        )
        return 0
    try:
        asyncio.run(_main(args, access))
    except KeyboardInterrupt:
        pass
    except StateDirError as exc:  # an unsafe lease-memory directory: say which and why
        logging.error("%s", exc)
        return 2
    finally:
        os.close(held)
    return 0


def _serving_pid(path: Path) -> int | None:
    """The pid of the agent that holds ``path``'s lock: its ping (it may still be starting),
    else what it wrote in the lock file."""
    from .client import DaemonClient

    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            pid = DaemonClient(path, timeout=1.0).ping().get("pid")
            if isinstance(pid, int):
                return pid
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return lock_holder(path)


def _queue_policy(args: argparse.Namespace) -> QueuePolicy:
    """The queue's rules (``--queue-*``; DESIGN box 13)."""

    def pairs(items: Sequence[str], flag: str, kind: type) -> dict[str, Any]:
        out = {}
        for item in items:
            group, sep, text = item.partition("=")
            try:
                value = kind(text)
            except ValueError:
                value = None
            if not sep or not group or value is None or (kind is float and not value > 0):
                what = "a weight > 0" if kind is float else "an integer"
                raise ValueError(f"{flag} {item!r}: GROUP={what}")
            out[group] = value
        return out

    if args.queue_max_per_user < 1:
        raise ValueError(f"--queue-max-per-user {args.queue_max_per_user}: at least 1")
    if not args.queue_hold >= 0:
        raise ValueError(f"--queue-hold {args.queue_hold}: seconds, 0 or more")
    if not args.queue_eta_window > 0:
        raise ValueError(f"--queue-eta-window {args.queue_eta_window}: seconds, more than 0")
    return QueuePolicy(
        weights=pairs(args.queue_weight, "--queue-weight", float),
        priorities=pairs(args.queue_priority, "--queue-priority", int),
        max_per_user=args.queue_max_per_user,
        hold_s=args.queue_hold,
        eta_window_s=args.queue_eta_window,
    )


def _access(args: argparse.Namespace) -> Access:
    """Who may do what (ledger_ops.Access) and the placement config, from the command line."""
    import grp

    from ..share import ShareSpec

    def parse_bound(text: str, what: str) -> ShareSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(
                f"{what} {text!r}: not JSON share keys, e.g. "
                '\'{"gpu_request": 0.5, "gpu_limit": 0.5}\''
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"{what} {text!r}: a JSON object of share keys")
        try:
            return ShareSpec.from_mapping(data)
        except ShareError as exc:
            raise ValueError(f"{what}: {exc}") from None

    def gid_of(name: str, what: str) -> int:
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            raise ValueError(f"{what} {name}: no such group") from None

    if args.system and args.kubernetes_namespace:
        raise ValueError(
            "--system serves a machine's own SQLite ledger; on Kubernetes the "
            "ledger is the cluster's (leave out --kubernetes-namespace or --system)"
        )
    system_only = {
        "--group": args.group,
        "--max-share": args.max_share,
        "--group-max-share": args.group_max_share,
        "--max-shares-per-user": args.max_shares_per_user is not None,
    }
    for name, value in system_only.items():
        if value and not args.system:
            raise ValueError(f"{name} needs --system (a per-user agent serves one user)")
    group_bounds = {}
    for item in args.group_max_share:
        group, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--group-max-share {item!r}: GROUP=JSON")
        group_bounds[gid_of(group, "--group-max-share")] = parse_bound(text, "--group-max-share")
    policy, aliases = _placement_config(args.config)
    return Access(
        system=args.system,
        user_gid=gid_of(args.group, "--group") if args.group else None,
        max_share=parse_bound(args.max_share, "--max-share") if args.max_share else None,
        group_bounds=group_bounds,
        max_shares_per_user=_share_count(args.max_shares_per_user),
        policy=policy,
        aliases=aliases,
    )


def _share_count(value: int | None) -> int:
    """``Access.max_shares_per_user`` from ``--max-shares-per-user`` (absent: the default)."""
    if value is None:
        return MAX_SHARES_PER_USER
    if value < 0:
        raise ValueError(f"--max-shares-per-user {value}: a number of shares, 0 or more")
    return value


def _placement_config(files: Sequence[Path]) -> tuple[Policy, TypeAliases]:
    """The deployment's placement policy and type aliases: ``c.GpusharePlacement.*`` and
    ``c.GpuShare.type_aliases`` from ``files``, else from jupyter_server_config.* on the Jupyter
    config path (what users' servers read)."""
    from jupyter_core.paths import jupyter_config_path
    from traitlets.config import Config
    from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

    from ..config import GpuShare

    if files:
        candidates = [Path(f) for f in files]
        for f in candidates:
            if not f.is_file():
                raise ValueError(f"--config {f}: no such file")
    else:
        candidates = [
            Path(d) / f"jupyter_server_config{ext}"
            for d in reversed(jupyter_config_path())
            for ext in (".json", ".py")
        ]
    config = Config()
    for f in candidates:
        if not f.is_file():
            continue
        loader_class = PyFileConfigLoader if f.suffix == ".py" else JSONFileConfigLoader
        try:
            config.merge(loader_class(f.name, path=str(f.parent)).load_config())
        except Exception as exc:
            raise ValueError(f"config file {f}: {exc}") from None
    settings = GpuShare(config=config)
    aliases = settings.aliases()
    return settings.policy(), aliases


async def _main(args: argparse.Namespace, access: Access) -> None:
    from .env import simulator_environ
    from .server import Daemon, DaemonSettings

    socket_path = serve_path(args)
    node = args.node or local_node_name()
    ledger = await _ledger(args)
    simulate = await _simulate_value(args, ledger, node)
    await _publish_gpus(ledger, node, simulate, args.system, access.aliases)
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
        socket_gid=access.user_gid if args.system else None,
        driver_check=args.driver_check != "off"
        and (args.system or bool(args.kubernetes_namespace)),
        stop_unshared=args.driver_check == "on" and not args.kubernetes_namespace,
    )
    daemon = Daemon(ledger, settings)
    configure(daemon, access)
    from . import queue_ops

    queue_ops.configure(daemon, getattr(args, "queue_policy", None) or QueuePolicy())
    await daemon.start()
    if not args.kubernetes_namespace:  # the queue lives with the SQLite ledger: kept entries
        await queue_ops.queue_of(daemon)
    reconciler = None
    if args.system:
        reconciler = asyncio.create_task(_reconcile_forever(ledger, node))
    idle = None
    if idle_exit.applies(args.system, bool(args.kubernetes_namespace), args.exit_when_idle):
        idle = asyncio.create_task(idle_exit.exit_when_idle(daemon, args.exit_when_idle))
    usage = None
    if args.kubernetes_namespace:  # the servers read this node's usage from a ConfigMap
        from ..k8s.usage import start_publisher

        usage = start_publisher(daemon, ledger, args.usage_interval)
    plugin = None
    if args.device_plugin and args.kubernetes_namespace:
        from ..k8s.device_plugin.plugin import PluginSettings, start_plugin

        plugin = await start_plugin(
            daemon,
            ledger.kube,  # type: ignore[attr-defined]  # a KubernetesLedger here
            PluginSettings(
                node=node,
                namespace=args.kubernetes_namespace,
                kubelet_socket=args.kubelet_socket,
                resource=args.share_resource,
                interposer_dir=args.interposer_dir,
                pod_socket_dir=args.pod_socket_dir or socket_path.parent / "pods",
                simulated_devices=os.environ.get("GPUSHARE_SIM_DEVICES", "") if simulate else "",
                sim_state=os.environ.get("GPUSHARE_SIM_STATE", "") if simulate else "",
            ),
        )
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
        for task in (reconciler, idle):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if usage is not None:
            await usage.stop()
        if plugin is not None:
            await plugin.close()
        with contextlib.suppress(Exception):
            await daemon.close()
        await ledger.close()


#: seconds between the system agent's reconciliations (holders gone: their shares released)
RECONCILE_S = 5.0


async def _reconcile_forever(ledger: Ledger, node: str) -> None:
    """A system agent releases the shares whose process or server died, whoever's they were
    (a user's server can release only its own)."""
    from ..ledger.reconcile import reconcile

    while True:
        try:
            await reconcile(ledger, node)
        except Exception as exc:  # a busy ledger: next round
            logging.warning("reconciliation failed: %s", exc)
        await asyncio.sleep(RECONCILE_S)


async def _status(daemon: object) -> dict:
    from . import queue_ops

    status = daemon.status()  # type: ignore[attr-defined]
    queue = queue_ops.figures_of(daemon)  # type: ignore[arg-type]
    if queue is not None:  # the queue's series (metrics.QUEUE_METRICS)
        status["queue"] = queue
    return status


def _sim_nvml() -> str | None:
    library = paths.lib_dir() / "sim" / "libnvidia-ml.so.1"
    return str(library) if library.exists() else None
