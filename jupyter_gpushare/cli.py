"""``jupyter gpushare …``: lab, status, run, daemon, kernelspec install."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import getpass
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from . import paths
from .config import GpuShare
from .daemon.client import DaemonClient
from .daemon.env import local_kernel_env
from .daemon.supervisor import AgentWatch, ensure_agent
from .errors import GpushareError
from .inventory import Gpu, NoGpuError, check_spec, parse_simulate, simulate_text
from .ledger import Allocation, LedgerUnavailable
from .ledger.reconcile import process_start_time, reconcile
from .placement import PlacementRefused, allocate
from .serverext.handlers import gpu_usage
from .share import ShareError, ShareSpec, format_bytes, format_share
from .statusview import render, with_usage
from .usage import DaemonUsage, UsageView

DESCRIPTION = (
    "Fractional GPU shares for Jupyter kernels: JupyterLab with GPU shares (lab), the GPUs and "
    "who holds which share (status), any command under a GPU share (run), the node agent "
    "(daemon), the kernelspecs (kernelspec install)."
)

_log = logging.getLogger("jupyter_gpushare")


def _settings(simulate: str | None = None) -> GpuShare:
    settings = GpuShare.instance()
    if simulate:
        settings.simulate = simulate
    return settings


# -- lab -------------------------------------------------------------------------------------------


LAB_HELP = (
    "Start JupyterLab with gpushare enabled: GPU-share kernels, the GPU picker and panel. "
    "Every other option goes to JupyterLab (jupyter lab --help-all lists them), e.g. "
    "jupyter gpushare lab --simulate 2xA100 --no-browser --port 8888."
)


def cmd_lab(args: argparse.Namespace, rest: list[str]) -> int:
    """Run JupyterLab with gpushare enabled (and simulated GPUs with --simulate) until it exits;
    its exit status. JupyterLab is a child process (not exec'd) so that, when it exits, the
    user hears about the node agent it leaves running (:func:`say_agent_left_running`)."""
    env = dict(os.environ)
    argv = [sys.executable, "-m", "jupyterlab", *rest]
    argv.append("--ServerApp.jpserver_extensions=jupyter_gpushare=True")
    if not any(a.startswith("--ServerApp.kernel_manager_class") for a in rest):
        argv.append("--ServerApp.kernel_manager_class=jupyter_gpushare.pools.PoolKernelManager")
    if args.simulate:
        parse_simulate(args.simulate)
        env["GPUSHARE_SIMULATE"] = args.simulate
        argv.append(f"--GpuShare.simulate={args.simulate}")
        print(f"gpushare: SIMULATED GPUs ({args.simulate}); no real GPU is used", file=sys.stderr)
    if os.geteuid() == 0 and "--allow-root" not in rest:
        argv.append("--allow-root")
        print("gpushare: running as root, so JupyterLab gets --allow-root", file=sys.stderr)
    installed = install_kernelspecs(user=True, only_missing=True)
    if installed:
        print(f"gpushare: installed kernelspecs {', '.join(installed)}", file=sys.stderr)
    code = _run_foreground(argv, env)
    say_agent_left_running()
    return code


def _run_foreground(argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv`` as the terminal's foreground job: Ctrl-C reaches it directly from the
    terminal (JupyterLab asks to confirm), SIGTERM, SIGHUP and a SIGINT sent to us alone (``kill
    -INT``, a container's stop signal) are passed on; its exit status (128+N for signal N)."""
    proc = subprocess.Popen(argv, env=env)

    def pass_on(sig: int, _frame: Any) -> None:
        if sig == signal.SIGINT and _terminal_delivers_sigint():
            return  # Ctrl-C: the terminal sent it to JupyterLab as well
        proc.send_signal(sig)

    passed = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {sig: signal.signal(sig, pass_on) for sig in passed}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code


def _terminal_delivers_sigint() -> bool:
    """Whether a SIGINT came from this terminal's Ctrl-C (our process group is the terminal's
    foreground group, which the child shares), not from ``kill`` aimed at us."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def say_agent_left_running() -> bool:
    """When this user's node agent still runs (it outlives JupyterLab: it enforces shares of
    kernels and ``run`` commands still alive and serves the next start), say so on stderr and
    how to stop it; True if said. A system agent (a service) is not ours to mention."""
    found = paths.find_agent(fresh=True)  # JupyterLab had our environment: the same agent
    if found.system:
        return False
    try:
        pid = DaemonClient(found.socket, timeout=2.0).ping().get("pid")
    except (OSError, ValueError):
        return False
    if not isinstance(pid, int):
        return False
    print(
        f"gpushare: the node agent (pid {pid}) keeps running on {found.socket}: it enforces the "
        "GPU shares still held and serves the next start. Stop it, once no share is needed, "
        f"with: kill {pid}",
        file=sys.stderr,
    )
    return True


# -- kernelspec ------------------------------------------------------------------------------------


def kernelspec_sources() -> Path:
    packaged = Path(__file__).resolve().parent / "kernelspecs"
    return packaged if packaged.exists() else Path(__file__).resolve().parent.parent / "kernelspecs"


def install_kernelspecs(
    user: bool = True, prefix: str | None = None, only_missing: bool = False
) -> list[str]:
    from jupyter_client.kernelspec import KernelSpecManager

    ksm = KernelSpecManager()
    existing = set(ksm.find_kernel_specs())
    installed = []
    for source in sorted(kernelspec_sources().iterdir()):
        if not (source / "kernel.json").exists():
            continue
        if only_missing and source.name in existing:
            continue
        ksm.install_kernel_spec(str(source), source.name, user=user and not prefix, prefix=prefix)
        installed.append(source.name)
    return installed


def cmd_kernelspec(args: argparse.Namespace) -> int:
    names = install_kernelspecs(
        user=not args.sys_prefix and not args.prefix,
        prefix=sys.prefix if args.sys_prefix else args.prefix,
    )
    for name in names:
        print(f"installed kernelspec {name}")
    return 0


# -- status ----------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _status_reader(
    settings: GpuShare, namespace: str | None = None, kubeconfig: str = ""
) -> AsyncIterator[Callable[[], Awaitable[dict[str, Any]]]]:
    """What ``status`` shows, as a function to call for each drawing. Discovery happens once,
    here: which ledger and agent answer (the system agent's or this user's), this machine's GPUs
    (published to the ledger), the release of shares whose holder is gone (later ones are the
    agent's and the servers' to release), or the connection to the cluster with ``namespace``.
    The function reads only the ledger and the live use (the node agent's, or the nodes'
    reports), so ``--watch`` repeats only those reads."""
    if namespace:  # the cluster's ledger; its reconcilers run in the cluster
        # lazy on purpose: only --kubernetes-namespace needs the Kubernetes client
        from .controller.errors import ControllerError
        from .controller.queue import waiting_status
        from .k8s.ledger import cluster_ledger
        from .k8s.usage import KubernetesUsage, UsageReader

        async with cluster_ledger(namespace, kubeconfig) as cluster:
            reports = KubernetesUsage(UsageReader(cluster.kube, namespace))

            async def read_cluster() -> dict[str, Any]:
                gpus, allocations = await cluster.gpus(), await cluster.list()
                status = _status_of(gpus, allocations)
                try:  # the controller's queue (the GpuQueue object), in its order
                    status["queue"] = await waiting_status(
                        cluster.kube, namespace, allocations, gpus
                    )
                except ControllerError as exc:  # no CRD, or no right to read it
                    status["queue_message"] = exc.message
                return _with_view(status, await reports.read(fresh=True))

            yield read_cluster
        return
    ledger = settings.local_ledger()
    problem = None
    try:
        await settings.local_gpus()
    except NoGpuError as exc:
        problem = str(exc)
    await reconcile(ledger, settings.node_name)
    agent = DaemonUsage(str(settings.socket_path), str(settings.node_name))

    async def read_local() -> dict[str, Any]:
        gpus = await ledger.gpus()
        # "no NVIDIA GPU here" only when there is nothing else to show (simulated GPUs are)
        status = _status_of(gpus, await ledger.list(), None if gpus else problem)
        waiting = getattr(ledger, "queue", None)  # the node agent's queue (DESIGN box 13)
        if waiting is not None:
            try:
                status["queue"] = await waiting()
            except GpushareError:  # an agent without a queue
                pass
        return _with_view(status, await agent.read())

    yield read_local


async def _status(
    settings: GpuShare, namespace: str | None = None, kubeconfig: str = ""
) -> dict[str, Any]:
    """The status document of :mod:`.statusview`: this machine's ledger and its node agent's
    live use, or with ``namespace`` the cluster's ledger and the nodes' usage reports."""
    async with _status_reader(settings, namespace, kubeconfig) as read:
        return await read()


def _with_view(status: dict[str, Any], view: UsageView) -> dict[str, Any]:
    usage = {k: dict(v) for k, v in view.allocations.items()}
    return with_usage(status, usage, view.message if status["allocations"] else None)


def _status_of(
    gpus: list[Gpu], allocations: list[Allocation], problem: str | None = None
) -> dict[str, Any]:
    return {
        "simulated": any(g.simulated for g in gpus),
        "gpus": gpu_usage(gpus, allocations),
        "allocations": [a.to_json() for a in allocations],
        **({"message": problem} if problem else {}),
    }


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    settings = _settings(args.simulate)
    read = functools.partial(_status, settings, args.kubernetes_namespace, args.kubeconfig)
    if args.json:
        print(json.dumps(asyncio.run(read()), indent=2))
        return 0
    console = Console(width=None if sys.stdout.isatty() else _columns())
    if args.watch is None:
        doc = asyncio.run(read())
        console.print(render(doc))
        if doc.get("queue"):
            console.print(_queue_table(doc["queue"]))
        return 0
    reader = functools.partial(_status_reader, settings, args.kubernetes_namespace, args.kubeconfig)
    return asyncio.run(_watch(console, reader, args.watch))


def _queue_table(entries: Sequence[dict[str, Any]]) -> Any:
    """The starts waiting in the node agent's queue or the controller's (the GpuQueue), in
    order: who (where the viewer may see it), what, since when, position and ETA in words."""
    from rich.table import Table

    table = Table(title="Waiting starts (queue)", title_justify="left")
    for column in ("#", "user", "share", "since", "waiting", "where in line"):
        table.add_column(column)
    for e in entries:
        share = e.get("share") or {}
        table.add_row(
            str(e.get("position", "")),
            str(e.get("user") or "(another user)"),
            f"{share.get('gpu_request', '?')} of {share.get('gpu_type') or 'a GPU'}",
            time.strftime("%H:%M:%S", time.localtime(float(e.get("since") or 0))),
            f"{float(e.get('waited_s') or 0) / 60:.0f} min",
            str(e.get("message") or ""),
        )
    return table


def _columns() -> int:
    """Width of output that is not a terminal (a pipe, a file): $COLUMNS, else wide enough for
    a row without folding."""
    try:
        return max(40, int(os.environ.get("COLUMNS", "")))
    except ValueError:
        return 160


async def _watch(
    console: Any,
    reader: Callable[
        [], contextlib.AbstractAsyncContextManager[Callable[[], Awaitable[dict[str, Any]]]]
    ],
    interval: float,
) -> int:
    """``status --watch``: the tables redrawn in place every ``interval`` seconds (like nvitop)
    until Ctrl-C. ``reader`` (:func:`_status_reader`) discovers once; each drawing only reads."""
    from rich.live import Live

    if not 0.2 <= interval <= 3600:
        print(f"gpushare status: --watch {interval:g}: give 0.2 to 3600 seconds", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def pause() -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)

    try:
        async with reader() as read:
            if not console.is_terminal:  # a pipe or a file: one drawing after the other
                while not stop.is_set():
                    console.print(render(await read(), watching=interval))
                    console.file.flush()
                    await pause()
                return 0
            with Live(console=console, auto_refresh=False, transient=False) as live:
                while not stop.is_set():
                    live.update(render(await read(), watching=interval), refresh=True)
                    await pause()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


# -- run -------------------------------------------------------------------------------------------


async def _run(
    settings: GpuShare, spec: ShareSpec, command: Sequence[str], wait: float | None = None
) -> int:
    """Hold ``spec`` for ``command``: place and record it, run the command with the share's
    environment, pass its exit status through (a signal N as 128+N) and release the share.

    The allocation is bound to this ``run`` process (``pid``/``pid_start``) *before* the
    command starts: the command is its child, which the node agent's peer check accepts
    (``daemon/server.py``, ``_check_peer``), so a program that calls ``cuInit`` first thing is
    never refused for "no process yet"."""
    ledger = settings.local_ledger()
    inventory = await _inventory(settings)
    spec = check_spec(spec, inventory, settings.aliases())
    try:
        await ensure_agent(settings, inventory, _log)
    except (RuntimeError, OSError) as exc:  # the interposer's fail-static mode enforces alone
        print(f"gpushare: no node agent: {exc}", file=sys.stderr)
    me = os.getpid()
    extra = {
        "server_start": process_start_time(me),
        "command": list(command)[:8],
        "uid": os.getuid(),
    }  # the agent's status shows a user their own shares
    fields: dict[str, Any] = {
        "owner": "run",
        "backend": "local",
        "state": "active",
        "pid": me,
        "pid_start": process_start_time(me),
        "server_pid": me,
        "user": getpass.getuser(),
        "extra": extra,
    }
    if wait is None:
        allocation = await allocate(ledger, spec, inventory, settings.policy(), **fields)
    else:  # --wait: the node agent's queue (DESIGN box 13)
        allocation = await _wait_in_queue(settings, ledger, spec, wait, fields)
    print(f"gpushare run: {_holding(allocation, inventory)}", file=sys.stderr)
    try:
        env = {**os.environ, **local_kernel_env(allocation, inventory, settings)}
        try:
            proc = subprocess.Popen(list(command), env=env)  # noqa: ASYNC220 - returns at once
        except OSError as exc:  # not executable, a directory, …
            print(f"gpushare run: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 126
        watch = AgentWatch(settings, _log)  # an agent that dies meanwhile is started again
        if watch.enabled():
            watch.start()
        try:
            return await _wait_forwarding_signals(proc)
        finally:
            await watch.stop()
    finally:
        await ledger.release(allocation.id)


async def _wait_in_queue(
    settings: GpuShare, ledger: Any, spec: ShareSpec, wait: float, fields: dict[str, Any]
) -> Allocation:
    """Place ``spec`` now or wait in the node agent's queue up to ``wait`` seconds (inf: no
    limit), printing the position and ETA as they change; Ctrl-C cancels the wait."""
    from .ledger.agent import AgentLedger

    if not isinstance(ledger, AgentLedger):  # a per-user agent: its socket serves the queue
        ledger = AgentLedger(settings.socket_path)
    shown: list[str] = []

    def progress(entry: dict[str, Any]) -> None:
        text = str(entry.get("message") or "")
        if entry.get("state") == "waiting" and text and text != (shown[-1] if shown else None):
            shown.append(text)
            print(f"gpushare run: waiting: {text}", file=sys.stderr)

    allocation: Allocation = await ledger.reserve_waiting(
        spec,
        settings.policy(),
        None if wait == float("inf") else wait,
        progress,
        **{k: v for k, v in fields.items() if k != "user"},
    )
    if shown:
        print("gpushare run: started (a share was freed)", file=sys.stderr)
    return allocation


def parse_wait(text: str) -> float:
    """``--wait``'s TIMEOUT: seconds, or a number with ``s``, ``m`` or ``h``; ``inf`` (the
    default of a bare ``--wait``) waits as long as it takes."""
    value = text.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(value[-1:], None)
    number = value[:-1] if scale is not None else value
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds != seconds:
        raise ShareError(
            "wait", text, "a time to wait: seconds, or a number with s, m or h (90, 5m, 1h)"
        )
    return seconds


async def _inventory(settings: GpuShare) -> Sequence[Gpu]:
    """This machine's GPUs; on a machine without one, the simulated GPUs of the node agent
    that runs here (``lab --simulate``, ``daemon --simulate`` or an earlier ``run --simulate``
    started it), so ``run`` needs no ``--simulate`` again."""
    try:
        return await settings.local_gpus()
    except NoGpuError:
        if settings.simulate:
            raise
        simulate = await _running_simulation(settings)
        if simulate is None:
            raise
        settings.simulate = simulate
        return await settings.local_gpus()


async def _running_simulation(settings: GpuShare) -> str | None:
    """The ``--simulate`` value of the simulated GPUs this node's ledger lists, when a node
    agent answers here to enforce them; None otherwise (no agent, or no simulated GPUs)."""
    if not await asyncio.to_thread(DaemonClient(settings.socket_path, timeout=2.0).alive):
        return None
    gpus = [g for g in await settings.local_ledger().gpus() if g.node == settings.node_name]
    if not gpus or not all(g.simulated for g in gpus):
        return None
    return simulate_text(gpus)


def _holding(allocation: Allocation, inventory: Sequence[Gpu]) -> str:
    """One line: which GPU(s) and share the command got."""
    by_uuid = {g.uuid: g for g in inventory}
    found = [by_uuid[u] for u in allocation.gpus if u in by_uuid]
    simulated = ", simulated" if any(g.simulated for g in found) else ""
    where = ", ".join(f"{g.index} ({g.type}{simulated}, {g.uuid})" for g in found)
    spec = allocation.spec
    if spec.gpu_count > 1:
        what = f"{spec.gpu_count} whole GPUs"
    elif spec.gpu_request == spec.gpu_limit:
        what = f"{format_share(spec.gpu_request)} of the GPU"
    else:
        what = f"request {format_share(spec.gpu_request)}, limit {format_share(spec.gpu_limit)}"
    gpu_word = "GPUs" if len(found) > 1 else "GPU"
    return (
        f"share {allocation.id} on {gpu_word} {where or ', '.join(allocation.gpus)}: {what}, "
        f"memory cap {format_bytes(allocation.memory)}"
    )


async def _wait_forwarding_signals(proc: subprocess.Popen[bytes]) -> int:
    """Wait for ``proc``, passing SIGINT/SIGTERM/SIGHUP on to it; its exit status, or 128+N
    when it was ended by signal N (as a shell reports it)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, proc.send_signal, sig)
    try:
        code = await asyncio.to_thread(proc.wait)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    return code if code >= 0 else 128 - code


def run_command(given: Sequence[str]) -> list[str]:
    """The command of ``run [options] -- CMD ARGS…``: everything after the first ``--``,
    verbatim (later ``--`` belong to the command)."""
    given = list(given)
    return given[1:] if given[:1] == ["--"] else given


def cmd_run(args: argparse.Namespace) -> int:
    command = run_command(args.command)
    if not command:
        print("gpushare run: give a command after --", file=sys.stderr)
        return 2
    if shutil.which(command[0]) is None and not Path(command[0]).exists():
        print(f"gpushare run: command not found: {command[0]}", file=sys.stderr)
        return 127
    settings = _settings(args.simulate)
    spec = ShareSpec.from_args(
        args.gpu_request,
        args.gpu_limit,
        args.gpu_memory,
        args.gpu_type,
        args.gpu_count,
        defaults=settings.default_spec(),
    )
    wait = parse_wait(args.wait) if args.wait is not None else None
    try:
        return asyncio.run(_run(settings, spec, command, wait))
    except KeyboardInterrupt:  # Ctrl-C while waiting in the queue: the wait was cancelled
        print("gpushare run: cancelled", file=sys.stderr)
        return 130


# -- daemon ----------------------------------------------------------------------------------------


def _daemon_parser(sub: Any) -> None:
    parser = sub.add_parser("daemon", help="run the node daemon (token scheduler, memory caps)")
    with contextlib.suppress(ImportError):
        from .daemon import cli as daemon_cli

        daemon_cli.add_arguments(parser)
        parser.set_defaults(func=daemon_cli.run)


# -- main ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from .k8s import cli as k8s_cli

    parser = argparse.ArgumentParser(prog="jupyter gpushare", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command_name", required=True)

    lab = sub.add_parser(
        "lab",
        help="start JupyterLab with gpushare; other options go to JupyterLab",
        description=LAB_HELP,
        usage="jupyter gpushare lab [--simulate N[xTYPE]] [JupyterLab options …]",
    )
    lab.add_argument("--simulate", metavar="N[xTYPE]", help="simulated GPUs, e.g. 2xA100")

    status = sub.add_parser(
        "status",
        help="GPUs, shares and holders",
        description="The GPUs and, per share, its user, notebook or command, GPU, request, "
        "limit, achieved share and memory (used / cap). Through the machine's system agent a "
        "user sees their own shares and the free capacity; admins see every share.",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="S",
        help="refresh in place every S seconds (default 2) until Ctrl-C",
    )
    status.add_argument(
        "--kubernetes-namespace",
        metavar="NS",
        default=None,
        help="the cluster's GPUs and shares (GpuLedgers in NS) instead of this machine's",
    )
    status.add_argument(
        "--kubeconfig",
        default="",
        help="with --kubernetes-namespace: kubeconfig (default: in-cluster, else $KUBECONFIG)",
    )
    status.add_argument("--simulate", metavar="N[xTYPE]", help=argparse.SUPPRESS)
    status.set_defaults(func=cmd_status)

    run = sub.add_parser(
        "run",
        help="run a command under a GPU share on this node",
        description="Run CMD under a GPU share on this node and release the share when it "
        "exits (its exit status is passed through). Without --simulate on a machine with no "
        "GPU, the simulated GPUs of the node agent running here are used.",
    )
    run.add_argument(
        "--gpu-request",
        metavar="R",
        help="guaranteed fraction of a GPU, 0.01 to 1 in steps of 0.01 (default: the default "
        "share's request, 0.25 unless GpuShare.default_share says otherwise)",
    )
    run.add_argument(
        "--gpu-limit",
        metavar="L",
        help="burst limit, a fraction of a GPU up to 1 (default: the larger of the request and "
        "the default share's limit, 0.5 unless GpuShare.default_share says otherwise: "
        "--gpu-request 0.3 gets limit 0.5, --gpu-request 0.75 gets 0.75)",
    )
    run.add_argument("--gpu-memory", metavar="M", help="memory cap, e.g. 10GiB")
    run.add_argument("--gpu-type", metavar="T", help="GPU type, e.g. A100")
    run.add_argument("--gpu-count", metavar="N", help="whole GPUs")
    run.add_argument(
        "--simulate",
        metavar="N[xTYPE]",
        help="use simulated GPUs (not needed while a simulated node agent runs here)",
    )
    run.add_argument(
        "--wait",
        nargs="?",
        const="inf",
        metavar="TIMEOUT",
        help="when the share does not fit now, wait in the node agent's queue (position and "
        "ETA are printed) up to TIMEOUT (seconds, or 5m, 1h; no TIMEOUT: as long as it "
        "takes); Ctrl-C cancels. A share that can never fit is refused at once",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS…")
    run.set_defaults(func=cmd_run)

    kernelspec = sub.add_parser("kernelspec", help="install the gpushare kernelspecs")
    ks = kernelspec.add_subparsers(dest="action", required=True)
    install = ks.add_parser("install", help="install gpushare-python kernelspecs")
    install.add_argument("--sys-prefix", action="store_true", help="into this environment")
    install.add_argument("--prefix", help="into this prefix")
    install.set_defaults(func=cmd_kernelspec)

    _daemon_parser(sub)
    k8s_cli.add_parser(sub)  # jupyter gpushare k8s kernel-pod (jupyter_gpushare/k8s/cli.py)
    sub.add_parser(
        "controller",
        add_help=False,
        help="run the cluster controller (Kubernetes; "
        "its options: jupyter gpushare controller --help-all)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["lab"]:
        args, rest = parser.parse_known_args(argv)
        return cmd_lab(args, rest)
    if argv[:1] == ["controller"]:  # a traitlets application: its own options and config
        from .controller.app import main as controller_main

        controller_main(argv[1:])
        return 0
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ShareError as exc:  # named by the flag the user typed (--gpu-request)
        print(f"gpushare: {exc.for_flags()}", file=sys.stderr)
        return 2
    except PlacementRefused as exc:  # the message ends with what would fit: said once
        print(f"gpushare: {exc.message}", file=sys.stderr)
        for hint in exc.suggestions:
            if hint not in exc.message:
                print(f"  {hint}", file=sys.stderr)
        return 3
    except NoGpuError as exc:
        print(f"gpushare: {exc}", file=sys.stderr)
        return 4
    except LedgerUnavailable as exc:  # a full disk, a read-only or corrupt ledger: one line
        print(f"gpushare: {exc}", file=sys.stderr)
        return 5
    except GpushareError as exc:  # the agent's refusal (a start that can never fit, …)
        print(f"gpushare: {exc.message or exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
