"""``jupyter gpushare status --watch`` discovers once and then only reads (``cli._status_reader``):
which ledger and agent, the GPUs, the reconciliation, or the cluster connection happen before the
first drawing; every redraw reads the ledger and the live use again, so changes still show."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from rich.console import Console

from jupyter_gpushare import cli, config
from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.share import ShareSpec
from jupyter_gpushare.usage import UsageView

NODE = "watch-node"
DRAWINGS = 5


def _share(gpu: Any, request: float) -> Allocation:
    me = os.getpid()  # a live holder: reconciliation keeps it
    return Allocation(
        id=Allocation.new_id(),
        node=NODE,
        gpus=(gpu.uuid,),
        spec=ShareSpec(request, request, 2**30, gpu.type),
        memory=2**30,
        owner="run",
        pid=me,
        pid_start=psutil.Process(me).create_time(),
        user="watcher",
    )


def _record(ledger: Any, allocation: Allocation) -> None:
    for _ in range(100):
        snap = ledger.snapshot_sync()
        version = snap.versions.get(NODE, 0)
        if ledger.compare_and_swap_sync(NODE, version, [*snap.on_node(NODE), allocation]):
            return
    raise RuntimeError("ledger contention")


def _watch_until(monkeypatch: pytest.MonkeyPatch, reader: Any, between: Any = None) -> str:
    """Runs ``_watch`` into a file-like console (0.2 s interval) until ``DRAWINGS`` drawings
    are out (then SIGINT, as Ctrl-C); ``between(n)`` runs after drawing n. The output."""
    real_render = cli.render
    drawn = 0

    def render(status: Any, watching: Any = None) -> Any:
        nonlocal drawn
        drawn += 1
        if between is not None:
            between(drawn)
        if drawn == DRAWINGS:
            os.kill(os.getpid(), signal.SIGINT)  # the loop's handler stops it
        return real_render(status, watching=watching)

    monkeypatch.setattr(cli, "render", render)
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=False)
    assert asyncio.run(cli._watch(console, reader, 0.2)) == 0
    assert drawn == DRAWINGS
    return out.getvalue()


def test_local_watch_discovers_and_reconciles_once_then_reads_each_redraw(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A real SQLite ledger and simulated GPUs, no agent running: 5 drawings make one
    discovery of the GPUs, one ledger choice and one reconciliation; the ledger is read for
    each drawing (a share recorded after the second shows in the later ones)."""
    sock = tmp_path / "agent.sock"  # nobody listens: the drawings say so, and go on
    monkeypatch.setenv("GPUSHARE_SOCKET", str(sock))
    settings = config.GpuShare(
        simulate="1xA100",
        ledger_path=str(tmp_path / "ledger.sqlite"),
        socket_path=str(sock),
        node_name=NODE,
    )
    calls: Counter[str] = Counter()

    def counting(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(config, "discover_local", counting("discover", config.discover_local))
    monkeypatch.setattr(cli, "reconcile", counting("reconcile", cli.reconcile))
    monkeypatch.setattr(settings, "local_gpus", counting("local_gpus", settings.local_gpus))
    monkeypatch.setattr(settings, "local_ledger", counting("local_ledger", settings.local_ledger))
    ledger = settings.local_ledger()
    calls.clear()
    gpu = simulated_gpus("1xA100", NODE)[0]
    first = _share(gpu, 0.25)
    _record(ledger, first)
    later = _share(gpu, 0.5)

    at_first: Counter[str] = Counter()

    def between(drawn: int) -> None:
        if drawn == 1:
            at_first.update(calls)
        if drawn == 2:
            _record(ledger, later)
            calls["added"] += 1

    reader = lambda: cli._status_reader(settings)  # noqa: E731
    text = _watch_until(monkeypatch, reader, between)
    # discovery and reconciliation before the first drawing, once; nothing of them after it
    assert at_first["discover"] == at_first["reconcile"] == at_first["local_gpus"] == 1
    assert at_first["local_ledger"] >= 1
    assert calls == at_first + Counter(added=1), (at_first, calls)
    drawings = text.split("every 0.2 s")
    assert len(drawings) == DRAWINGS + 1, text[-2000:]
    assert all("25 %" in d for d in drawings[:-1])
    assert "50 %" not in "".join(drawings[:2]) and all("50 %" in d for d in drawings[2:-1])
    assert "A100" in text and "Traceback" not in text


def test_cluster_watch_connects_once_then_reads_each_redraw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With --kubernetes-namespace: one connection to the cluster for all drawings, and the
    ledger, the controller's queue and usage reports read for each."""
    import jupyter_gpushare.controller.queue as controller_queue
    import jupyter_gpushare.k8s.ledger as k8s_ledger
    import jupyter_gpushare.k8s.usage as k8s_usage

    calls: Counter[str] = Counter()
    gpus = simulated_gpus("1xA100", NODE)

    class Cluster:
        kube = object()

        async def gpus(self) -> list[Any]:
            calls["gpus"] += 1
            return gpus

        async def list(self) -> list[Allocation]:
            calls["list"] += 1
            return []

    @contextlib.asynccontextmanager
    async def cluster_ledger(namespace: str, kubeconfig: str = "") -> AsyncIterator[Cluster]:
        assert namespace == "gpushare"
        calls["connect"] += 1
        yield Cluster()
        calls["closed"] += 1

    class Usage:
        def __init__(self, reader: Any) -> None:
            calls["usage_reader"] += 1

        async def read(self, fresh: bool = False) -> UsageView:
            calls["usage_read"] += 1
            return UsageView("kubernetes")

    async def waiting_status(kube: Any, namespace: str, *_args: Any) -> list[dict[str, Any]]:
        assert kube is Cluster.kube and namespace == "gpushare"
        calls["queue"] += 1
        return []

    monkeypatch.setattr(k8s_ledger, "cluster_ledger", cluster_ledger)
    monkeypatch.setattr(controller_queue, "waiting_status", waiting_status)
    monkeypatch.setattr(k8s_usage, "KubernetesUsage", Usage)
    monkeypatch.setattr(k8s_usage, "UsageReader", lambda kube, namespace: None)
    reader = lambda: cli._status_reader(None, "gpushare", "")  # type: ignore[arg-type]  # noqa: E731
    text = _watch_until(monkeypatch, reader)
    assert calls == Counter(
        connect=1,
        closed=1,
        usage_reader=1,
        gpus=DRAWINGS,
        list=DRAWINGS,
        queue=DRAWINGS,
        usage_read=DRAWINGS,
    )
    assert text.count("every 0.2 s") == DRAWINGS and "A100" in text
