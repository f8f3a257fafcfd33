"""``jupyter gpushare …``: lab, status, run, daemon, kernelspec install."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import GpuShare
from .daemon.supervisor import AgentWatch, ensure_agent
from .inventory import Gpu, NoGpuError, check_spec, parse_simulate
from .ledger import Allocation, LedgerUnavailable
from .ledger.reconcile import process_start_time, reconcile
from .placement import PlacementRefused, allocate
from .provisioner.environment import kernel_environment
from .serverext.handlers import gpu_usage
from .share import ShareError, ShareSpec, format_bytes

_log = logging.getLogger("jupyter_gpushare")


def _settings(simulate: str | None = None) -> GpuShare:
    settings = GpuShare.instance()
    if simulate:
        settings.simulate = simulate
    return settings


# -- lab -------------------------------------------------------------------------------------------


def cmd_lab(args: argparse.Namespace, rest: list[str]) -> int:
    """Start JupyterLab with gpushare enabled (and simulated GPUs with --simulate)."""
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
    os.execvpe(argv[0], argv, env)
    return 0  # not reached


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


async def _status(
    settings: GpuShare, namespace: str | None = None, kubeconfig: str = ""
) -> dict[str, Any]:
    if namespace:  # the cluster's ledger; its reconcilers run in the cluster
        from .k8s.client import connect
        from .k8s.ledger import KubernetesLedger

        kube = await connect(kubeconfig)
        try:
            cluster = KubernetesLedger(kube, namespace)
            return _status_of(await cluster.gpus(), await cluster.list())
        finally:
            await kube.close()
    ledger = settings.local_ledger()
    problem = None
    try:
        await settings.local_gpus()
    except NoGpuError as exc:
        problem = str(exc)
    await reconcile(ledger, settings.node_name)
    return _status_of(await ledger.gpus(), await ledger.list(), problem)


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
    status = asyncio.run(
        _status(_settings(args.simulate), args.kubernetes_namespace, args.kubeconfig)
    )
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    if "message" in status:
        print(status["message"])
    for g in status["gpus"]:
        sim = " (simulated)" if g["simulated"] else ""
        print(
            f"{g['node']} GPU {g['index']} {g['type']}{sim} {g['uuid']}: "
            f"{g['allocated_request']:g} of 1 reserved, {g['free_request']:g} free; "
            f"memory {format_bytes(g['allocated_memory'])} of {format_bytes(g['memory'])}"
        )
    if not status["allocations"]:
        print("no allocations")
    for a in status["allocations"]:
        holder = f"kernel {a['kernel_id']}" if a["kernel_id"] else f"{a['owner']} pid {a['pid']}"
        if a["extra"].get("redacted"):  # a system agent shows other users' shares as capacity
            holder = "another user's share"
        elif a["owner"] == "pool":  # a warm kernel nobody has claimed yet (jupyter_gpushare.pools)
            holder = f"warm pool kernel {a['kernel_id']} (pool {a['extra'].get('pool', '?')})"
        elif a["extra"].get("claimed_from_pool"):
            holder += f" (from pool {a['extra']['claimed_from_pool']})"
        if a["extra"].get("reclaim_warning"):
            holder += ", idle: reclaim warned"
        print(
            f"  {a['id']}: {a['gpu_request']:g}–{a['gpu_limit']:g} of {a['gpu_type']} "
            f"{','.join(a['gpus'])}, {format_bytes(a['gpu_memory'])}, {holder} ({a['state']})"
        )
    return 0


# -- run -------------------------------------------------------------------------------------------


async def _run(settings: GpuShare, spec: ShareSpec, command: Sequence[str]) -> int:
    """Hold ``spec`` for ``command``: place and record it, run the command with the share's
    environment, pass its exit status through (a signal N as 128+N) and release the share.

    The allocation is bound to this ``run`` process (``pid``/``pid_start``) *before* the
    command starts: the command is its child, which the node agent's peer check accepts
    (``daemon/server.py``, ``_check_peer``), so a program that calls ``cuInit`` first thing is
    never refused for "no process yet"."""
    ledger = settings.local_ledger()
    inventory = await settings.local_gpus()
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
    allocation = await allocate(
        ledger,
        spec,
        inventory,
        settings.policy(),
        owner="run",
        backend="local",
        state="active",
        pid=me,
        pid_start=process_start_time(me),
        server_pid=me,
        user=getpass.getuser(),
        extra=extra,
    )
    try:
        env = {**os.environ, **kernel_environment(allocation, inventory, settings)}
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
    return asyncio.run(_run(settings, spec, command))


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

    parser = argparse.ArgumentParser(prog="jupyter gpushare", description=__doc__)
    sub = parser.add_subparsers(dest="command_name", required=True)

    lab = sub.add_parser("lab", help="start JupyterLab with gpushare; other options go to Lab")
    lab.add_argument("--simulate", metavar="N[xTYPE]", help="simulated GPUs, e.g. 2xA100")

    status = sub.add_parser("status", help="GPUs, shares and holders")
    status.add_argument("--json", action="store_true", help="machine-readable output")
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

    run = sub.add_parser("run", help="run a command under a GPU share on this node")
    run.add_argument("--gpu-request", metavar="R", help="guaranteed fraction of a GPU, (0, 1]")
    run.add_argument("--gpu-limit", metavar="L", help="burst limit, a fraction in (0, 1]")
    run.add_argument("--gpu-memory", metavar="M", help="memory cap, e.g. 10GiB")
    run.add_argument("--gpu-type", metavar="T", help="GPU type, e.g. A100")
    run.add_argument("--gpu-count", metavar="N", help="whole GPUs")
    run.add_argument("--simulate", metavar="N[xTYPE]", help="use simulated GPUs")
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
    except ShareError as exc:
        print(f"gpushare: {exc}", file=sys.stderr)
        return 2
    except PlacementRefused as exc:
        print(f"gpushare: {exc.message}", file=sys.stderr)
        for hint in exc.suggestions:
            print(f"  {hint}", file=sys.stderr)
        return 3
    except NoGpuError as exc:
        print(f"gpushare: {exc}", file=sys.stderr)
        return 4
    except LedgerUnavailable as exc:  # a full disk, a read-only or corrupt ledger: one line
        print(f"gpushare: {exc}", file=sys.stderr)
        return 5


if __name__ == "__main__":
    sys.exit(main())
