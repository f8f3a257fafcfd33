"""The queue on Kubernetes (issue 27, DESIGN box 13): starts that do not fit wait in the controller.

Against the real API server (``control_plane``) with two controller replicas on one leader Lease
and a real JupyterHub resolving the users' tokens. Kernel pods run on the kubelet double
(``node_agent``: simulated nodes gpu-node-1 2xA100 and gpu-node-2 1xT4, whose pods run as local
processes; no real kubelet is needed to show what the queue promises: the queue acts before any
pod exists). Users' servers are represented by their Hub tokens and the server side's own client
(:class:`~jupyter_gpushare.controller.client.ControllerLedger`, what a server's provisioner waits
with), heartbeating their server Leases as a server does. The T4 node has one GPU: filling it
makes every T4 start wait.

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1),
because the queue needs several GPU nodes filled and freed quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from cluster import NAMESPACE, ControlPlane, free_port
from prometheus_client.parser import text_string_to_metric_families
from servers import spawn, stop_process
from test_controller import (  # noqa: F401 - hub: the module's JupyterHub fixture
    STUDENT_BOUND,
    Controller,
    call,
    hub,
    kernel_name,
    leader,
    start_body,
)

from jupyter_gpushare.controller.client import ControllerClient, ControllerLedger
from jupyter_gpushare.k8s.client import GROUP, VERSION, connect
from jupyter_gpushare.placement import PlacementRefused
from jupyter_gpushare.share import ShareSpec

pytestmark = pytest.mark.timeout(240)

T4 = {"gpu_request": 0.25, "gpu_limit": 0.5, "gpu_type": "T4"}


@pytest.fixture(scope="module")
def queue_controllers(
    control_plane: ControlPlane,
    node_agent: Path,
    hub: Any,  # noqa: F811 - the imported fixture
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[Controller]]:
    """Two replicas on one leader Lease (3 s), server Leases of 6 s: a waiting start whose
    server stops heartbeating is dropped within 6 + 1 s."""
    root = tmp_path_factory.mktemp("queue-controller")
    config = root / "controller_config.py"
    config.write_text(f"""
c.GpushareController.hub_url = {hub.url!r}
c.GpushareController.group_bounds = {{"students": {STUDENT_BOUND!r}}}
c.GpushareController.user_quotas = {{"alice": 1.0}}
c.GpushareController.lease_duration = 3
c.GpushareController.renew_interval = 1
c.GpushareController.retry_interval = 0.5
c.GpushareController.server_lease_duration = 6
c.GpushareController.reconcile_interval = 1
c.GpushareController.reconcile_grace = 4
c.GpushareController.network_policy_grace = 2
c.ControllerQueueSettings.server_grace = 1
c.ControllerQueueSettings.max_per_user = 2
c.KubernetesBackendConfig.kubeconfig = {str(control_plane.kubeconfig("controller"))!r}
c.KubernetesBackendConfig.namespace = {NAMESPACE!r}
c.KubernetesBackendConfig.image = "gpushare-test:local"
c.KubernetesBackendConfig.start_timeout = 60
c.KubernetesBackendConfig.resources = {{"requests": {{"cpu": "100m", "memory": "64Mi"}}}}
""")
    started: list[Controller] = []

    def start(index: int) -> Controller:
        port = free_port()
        log = root / f"controller-{index}.log"
        proc = spawn(
            [
                sys.executable,
                "-m",
                "jupyter_gpushare.controller",
                f"--config={config}",
                f"--port={port}",
                "--ip=127.0.0.1",
            ],
            log,
            {**os.environ, "POD_NAME": f"queue-controller-{index}"},
        )
        controller = Controller(proc, f"http://127.0.0.1:{port}", log)
        started.append(controller)
        return controller

    replicas = [start(0), start(1)]
    deadline = time.monotonic() + 60
    while sorted(c.health() for c in replicas) != [200, 503]:
        if time.monotonic() > deadline or any(c.proc.poll() is not None for c in replicas):
            pytest.fail(
                "no controller became leader:\n"
                + "\n".join(c.log.read_text()[-3000:] for c in replicas)
            )
        time.sleep(0.3)
    yield replicas
    for c in started:
        stop_process(c.proc)


def clear(replicas: list[Controller], admin: str) -> None:
    """No share and no waiting start left from earlier tests (an admin sees all)."""
    for entry in call(replicas, admin, "GET", "/api/queue").json()["entries"]:
        call(replicas, admin, "DELETE", f"/api/queue/{entry['id']}")
    for a in call(replicas, admin, "GET", "/api/allocations").json()["allocations"]:
        call(replicas, admin, "DELETE", f"/api/allocations/{a['id']}")


@contextlib.asynccontextmanager
async def heartbeats(client: ControllerClient, *servers: str) -> AsyncIterator[None]:
    """The servers' heartbeats, every second (a Jupyter server's, faster)."""

    async def beat() -> None:
        while True:
            for server in servers:
                with contextlib.suppress(Exception):
                    await client.request("PUT", f"/api/servers/{server}", retry=False)
            await asyncio.sleep(1.0)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def pods_of(kernel: str, pods: dict[str, Any]) -> list[str]:
    return [n for n in pods if n.startswith(f"gpushare-kernel-{kernel[:8].lower()}-")]


async def test_two_replicas_that_both_lead_start_each_entry_once(
    control_plane: ControlPlane, node_agent: Path
) -> None:
    """No pod (the kubelet double's Nodes publish the GPUs). Two controllers' services and
    queues in this process, each with its own API client, watches and caches (two replicas
    that both act as leader, as for a moment after a partition), with the controller's
    service account: with the T4 full, a start waits in the GpuQueue; when it frees, the two
    replicas each place a share for the waiting entry and record its start (the queue's own
    steps, one by one): one wins, the GpuQueue entry names its share, the other share is
    released. With the check that the entry still waits removed from the record, both won
    (seen)."""
    from jupyter_gpushare.controller.auth import HubUser
    from jupyter_gpushare.controller.bounds import Bounds
    from jupyter_gpushare.controller.kernels import KernelService
    from jupyter_gpushare.controller.queue import ControllerQueue, QueueStore
    from jupyter_gpushare.controller.servers import ServerLeases
    from jupyter_gpushare.controller.usage import NodeReports
    from jupyter_gpushare.inventory import TypeAliases
    from jupyter_gpushare.k8s import manifests
    from jupyter_gpushare.k8s.config import KubernetesBackendConfig
    from jupyter_gpushare.k8s.ledger import KubernetesLedger
    from jupyter_gpushare.placement import Policy
    from jupyter_gpushare.queue import QueuePolicy

    pods = manifests.PodSettings.from_config(KubernetesBackendConfig())
    made: list[tuple[Any, KernelService, ControllerQueue]] = []

    async def replica(name: str) -> ControllerQueue:
        kube = await connect(str(control_plane.kubeconfig("controller")))
        leases = ServerLeases(kube, NAMESPACE, 60.0, name)
        service = KernelService(
            kube,
            NAMESPACE,
            TypeAliases(),
            Policy(),
            Bounds({}, {}, None),
            leases,
            pods,
            NodeReports(),
        )
        await service.start(30)
        queue = ControllerQueue(service, QueuePolicy(), name)
        await queue.start()
        made.append((kube, service, queue))
        return queue

    admin = HubUser("carol", admin=True)
    try:
        a = await replica("replica-a")
        for r in a.waiting():
            await a.cancel(admin, r.id)
        for left in await a.service.ledger.list():
            await a.service.ledger.release(left.id)
        server = "srv-" + uuid.uuid4().hex[:8]
        full = await a.service.reserve(
            HubUser("alice"),
            {
                "kernel_id": kernel_name(),
                "server_id": server,
                "share": {"gpu_request": 1.0, "gpu_type": "T4"},
            },
        )
        body = {"kernel_id": kernel_name(), "server_id": server, "share": T4}
        entry = (await a.reserve(HubUser("alice"), body))["entry"]["id"]
        b = await replica("replica-b")
        assert [r.id for r in b.waiting()] == [entry]  # the new replica reads the queue
        for _kube, _service, queue in made:  # no runner: the race below, step by step
            assert queue._task is not None
            queue._task.cancel()
        await a.service.ledger.release(full.id)
        await b.service.ledger.ledgers.wait_until(lambda: not b.service.ledger.node_of(full.id), 10)
        # both replicas place a share for the entry, then both record its start
        gpus = await a.service.gpus()
        placed = [await q._place(q.records[entry], gpus, set()) for q in (a, b)]
        won = await asyncio.gather(
            *(q._take(entry, x, None) for q, x in zip((a, b), placed, strict=True))
        )
        assert sorted(won) == [False, True], won
        winner = placed[won.index(True)]
        stored = {r.id: r for r in (await QueueStore(a.service.kube, NAMESPACE).read())[1]}
        assert stored[entry].state == "started", stored[entry]
        assert (stored[entry].allocation or {}).get("id") == winner.id, stored[entry]
        shares = [
            x.id
            for x in (await KubernetesLedger(a.service.kube, NAMESPACE).snapshot()).allocations
            if x.extra.get("queue_entry") == entry
        ]
        assert shares == [winner.id], (shares, placed)
        # a replica that then finds the winner's share in the ledger keeps it
        assert await [a, b][won.index(False)]._take(entry, winner, None)
        # a replica that placed a share and stopped before recording it: once the entry has
        # ended (here cancelled), the sweep of the live replica gives the share back
        rest = {"gpu_request": 0.75, "gpu_type": "T4"}
        filled = await a.service.reserve(
            HubUser("alice"), {"kernel_id": kernel_name(), "server_id": server, "share": rest}
        )
        body = {"kernel_id": kernel_name(), "server_id": server, "share": T4}
        second = (await a.reserve(HubUser("alice"), body))["entry"]["id"]
        b.version, found = await b.store.read()  # b learns of it as a new leader would
        b.records = {r.id: r for r in found}
        await a.service.ledger.release(filled.id)
        await b.service.ledger.ledgers.wait_until(
            lambda: not b.service.ledger.node_of(filled.id), 10
        )
        orphan = await b._place(b.records[second], gpus, set())
        await a.cancel(HubUser("alice"), second)
        await a.service.ledger.ledgers.wait_until(
            lambda: bool(a.service.ledger.node_of(orphan.id)), 10
        )
        assert await a.sweep() == [orphan.id]
        assert await a.sweep() == []  # the started entry's share stays
    finally:
        for kube, service, queue in made:
            await queue.stop()
            for left in await service.ledger.list():
                with contextlib.suppress(Exception):
                    await service.ledger.release(left.id)
            await service.stop()
            await kube.close()


async def test_a_start_that_does_not_fit_waits_without_a_pod_and_starts_when_a_share_is_freed(
    queue_controllers: list[Controller],
    hub: Any,  # noqa: F811 - the imported fixture
    control_plane: ControlPlane,
) -> None:
    """Kubelet double. The T4 full with alice's running kernel: bob's start waits (no pod, no
    share), 1st in line with an ETA from the T4 releases the controller saw; alice's release
    starts it by itself within 1 s of the release (both seen on one watch of the GpuLedgers),
    its pod is created at once and runs. A start that can never fit is refused at once."""
    replicas = queue_controllers
    alice, bob, carol = (hub.tokens[u] for u in ("alice", "bob", "carol"))
    await asyncio.to_thread(clear, replicas, carol)
    urls = [c.url for c in replicas]
    a_server, b_server = "srv-" + uuid.uuid4().hex[:8], "srv-" + uuid.uuid4().hex[:8]
    a_client = ControllerClient(urls, alice, retry_for=30)
    b_client = ControllerClient(urls, bob, retry_for=30)
    b_ledger = ControllerLedger(b_client, b_server)
    kube = await connect(str(control_plane.kubeconfig("admin")))
    events: list[tuple[float, str, dict[str, Any]]] = []
    watches: list[asyncio.Task[None]] = []

    async def follow(kind: str) -> None:
        if kind == "pods":
            listing = await kube.list_pods(NAMESPACE)
        else:
            listing = await kube.list_ledgers(NAMESPACE)
        async for event in kube.watch(kind, NAMESPACE, listing["metadata"]["resourceVersion"]):
            events.append((time.monotonic(), kind, event))

    try:
        async with heartbeats(a_client, a_server), heartbeats(b_client, b_server):
            # three T4 shares come and go: the controller's ETA rests on their releases
            for _ in range(3):
                body = {"kernel_id": kernel_name(), "server_id": a_server, "share": T4}
                placed = await a_client.request("POST", "/api/allocations", body)
                await a_client.request("DELETE", f"/api/allocations/{placed['id']}")
            started = await a_client.request(
                "POST",
                "/api/kernels",
                start_body(kernel_name(), a_server, {"gpu_request": 1.0, "gpu_type": "T4"}),
            )
            a_alloc = started["allocation"]["id"]
            watches = [
                asyncio.create_task(follow("gpuledgers")),
                asyncio.create_task(follow("pods")),
            ]

            # never fits: refused at once with the reason, nothing queued (bigger than any
            # T4 node; more than alice's quota of 1 GPU in all, even with nothing held)
            for share, code, words in (
                ({"gpu_count": 2, "gpu_type": "T4"}, "invalid_share", "gpu_count=2"),
                ({"gpu_count": 2, "gpu_type": "A100"}, "never_fits", "quota of 1 GPU in all"),
            ):
                t0 = time.monotonic()
                reply = await asyncio.to_thread(
                    call,
                    replicas,
                    alice,
                    "POST",
                    "/api/queue",
                    {"kernel_id": kernel_name(), "server_id": a_server, "share": share},
                )
                assert time.monotonic() - t0 < 5
                assert reply.json()["error"] == code and words in reply.json()["message"], (
                    reply.text
                )
            assert (await a_client.request("GET", "/api/queue"))["entries"] == []

            # bob's start waits: the server side's own wait (the provisioner's)
            b_kernel = kernel_name()
            views: list[dict[str, Any]] = []
            waiting = asyncio.create_task(
                b_ledger.reserve_waiting(
                    ShareSpec.from_mapping(T4), None, 90.0, views.append, kernel_id=b_kernel
                )
            )
            deadline = time.monotonic() + 10
            while not views:
                assert time.monotonic() < deadline and not waiting.done(), waiting
                await asyncio.sleep(0.05)
            first = views[0]
            assert first["state"] == "waiting" and first["position"] == 1, first
            assert first["message"].startswith("1st in line for 0.25–0.5 of a T4"), first
            assert first["eta"]["hi_s"] is not None, first  # a range, from the releases seen
            assert re.match(r"\d+ releases of T4 shares", first["eta"]["basis"][0]), first
            # alice sees bob's start as capacity only
            listed = await a_client.request("GET", "/api/queue")
            assert [e["position"] for e in listed["entries"]] == [1], listed
            assert "user" not in listed["entries"][0] and "kernel_id" not in listed["entries"][0]
            # no pod and no share exist for the waiting start
            await asyncio.sleep(1.0)
            pods = {p["metadata"]["name"]: p for p in (await kube.list_pods(NAMESPACE))["items"]}
            assert not pods_of(b_kernel, pods), pods_of(b_kernel, pods)
            mine = (await b_client.request("GET", "/api/allocations"))["allocations"]
            assert not [a for a in mine if a["kernel_id"] == b_kernel], mine
            assert not waiting.done()

            # alice's release starts bob's kernel by itself
            await a_client.request("DELETE", f"/api/allocations/{a_alloc}")
            allocation = await asyncio.wait_for(waiting, 30)
            assert allocation.kernel_id == b_kernel and allocation.user == "bob"
            assert allocation.extra.get("queue_entry") == first["id"]
            launch = start_body(b_kernel, b_server, T4)
            del launch["share"]
            launch["allocation_id"] = allocation.id
            ran = await b_client.request("POST", "/api/kernels", launch)
            assert ran["allocation"]["state"] == "active", ran

            def when(kind: str, done: Any) -> float:
                return next(t for t, k, e in events if k == kind and done(e))

            def holds(e: dict[str, Any], aid: str) -> bool:
                found = (e["object"].get("spec") or {}).get("allocations") or []
                return e["type"] != "DELETED" and any(a["id"] == aid for a in found)

            released = when(
                "gpuledgers",
                lambda e: e["object"]["spec"]["node"] == "gpu-node-2" and not holds(e, a_alloc),
            )
            placed_at = when("gpuledgers", lambda e: holds(e, allocation.id))
            created = when(
                "pods",
                lambda e: e["type"] == "ADDED" and e["object"]["metadata"]["name"] == ran["pod"],
            )
            print(
                f"release -> start placed {placed_at - released:.3f} s, "
                f"release -> pod created {created - released:.3f} s"
            )
            assert placed_at - released <= 1.0, (released, placed_at)
            assert created - released <= 3.0, (released, created)
            await b_client.request("DELETE", f"/api/allocations/{allocation.id}")
    finally:
        for task in watches:
            task.cancel()
        await kube.close()


async def test_a_jupyter_server_in_controller_mode_waits_shows_its_place_and_cancels(
    queue_controllers: list[Controller],
    hub: Any,  # noqa: F811 - the imported fixture
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kubelet double. bob's real Jupyter server (controller mode, no Kubernetes credentials,
    ``GpushareProvisioner.queue_wait = 60``): with the T4 full, ``POST /gpushare/api/kernels``
    waits; its ``/gpushare/api/queue`` and the start's progress say 1st in line; a second start
    cancelled with ``DELETE /gpushare/api/queue/{id}`` is refused 409 with that reason; alice's
    release starts the first by itself and the kernel runs code."""
    from servers import start_jupyter_server
    from test_kernels import execute

    replicas = queue_controllers
    alice, carol = hub.tokens["alice"], hub.tokens["carol"]
    await asyncio.to_thread(clear, replicas, carol)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub.tokens["bob"])
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("GPUSHARE_KUBECONFIG", raising=False)
    urls = ",".join(c.url for c in replicas)
    a_server = "srv-" + uuid.uuid4().hex[:8]
    a_client = ControllerClient([c.url for c in replicas], alice, retry_for=30)
    server = await asyncio.to_thread(
        start_jupyter_server,
        tmp_path / "server",
        None,
        "kubernetes",
        extra=f"""
c.KubernetesBackendConfig.controller_url = {urls!r}
c.KubernetesBackendConfig.kubeconfig = "/nonexistent/kubeconfig"
c.KubernetesBackendConfig.lease_renew_interval = 1
c.GpushareProvisioner.queue_wait = 60.0
""",
    )
    body = {"name": "gpushare-k8s-t4", "share": {"gpu_request": 0.25, "gpu_limit": 0.5}}
    try:
        async with heartbeats(a_client, a_server):
            full = await a_client.request(
                "POST",
                "/api/allocations",
                {
                    "kernel_id": kernel_name(),
                    "server_id": a_server,
                    "share": {"gpu_request": 1.0, "gpu_type": "T4"},
                },
            )
            first = asyncio.create_task(
                asyncio.to_thread(server.request, "POST", "/gpushare/api/kernels", json=body)
            )

            async def listed(count: int) -> list[dict[str, Any]]:
                deadline = time.monotonic() + 30
                while True:
                    reply = await asyncio.to_thread(server.request, "GET", "/gpushare/api/queue")
                    assert reply.status_code == 200, reply.text
                    entries = reply.json()["entries"]
                    if len(entries) >= count:
                        assert reply.json()["enabled"] is True
                        return list(entries)
                    assert time.monotonic() < deadline, (entries, server.log_text()[-3000:])
                    await asyncio.sleep(0.2)

            (waiting,) = await listed(1)
            assert waiting["position"] == 1 and waiting["kernel_id"], waiting
            deadline = time.monotonic() + 10
            while True:
                starts = await asyncio.to_thread(server.request, "GET", "/gpushare/api/starts")
                said = [s["message"] for s in starts.json()["starts"] if "in line" in s["message"]]
                if said:
                    break
                assert time.monotonic() < deadline, starts.text
                await asyncio.sleep(0.2)
            assert said[0].startswith("waiting: 1st in line for 0.25–0.5 of a T4"), said

            second = asyncio.create_task(
                asyncio.to_thread(server.request, "POST", "/gpushare/api/kernels", json=body)
            )
            entries = await listed(2)
            assert [e["position"] for e in entries] == [1, 2], entries
            reply = await asyncio.to_thread(
                server.request, "DELETE", f"/gpushare/api/queue/{entries[1]['id']}"
            )
            assert reply.status_code == 200 and reply.json()["entry"]["state"] == "cancelled"
            refused = await asyncio.wait_for(second, 30)
            assert refused.status_code == 409 and "cancelled" in refused.json()["message"], (
                refused.text
            )
            reply = await asyncio.to_thread(
                server.request, "DELETE", "/gpushare/api/queue/q-0123456789abcdef"
            )
            assert reply.status_code == 404 and reply.json()["error"] == "unknown_entry", reply.text

            await a_client.request("DELETE", f"/api/allocations/{full['id']}")
            reply = await asyncio.wait_for(first, 60)
            assert reply.status_code == 201, reply.text + server.log_text()[-3000:]
            started = reply.json()
            assert started["allocation"]["extra"]["queue_entry"] == waiting["id"], started
            kernel_id = started["id"]
            assert (await execute(server, kernel_id, "print(6 * 7)")).strip() == "42"
            reply = await asyncio.to_thread(server.request, "DELETE", f"/api/kernels/{kernel_id}")
            assert reply.status_code == 204, reply.text
            assert "Traceback" not in server.log_text()
    finally:
        stop_process(server.proc)


async def test_the_queue_survives_a_new_leader_cancel_removes_it_a_dead_server_drops_it(
    queue_controllers: list[Controller],
    hub: Any,  # noqa: F811 - the imported fixture
    control_plane: ControlPlane,
) -> None:
    """Kubelet double (no pod is made here). bob's waiting start is in the GpuQueue object; the
    leader killed (SIGKILL), the new leader answers the same entry, still 1st; alice cannot see
    whose it is nor cancel it; bob cancels it and alice's release then starts nothing. A start
    whose server stops heartbeating is dropped, and a later release starts nothing for it."""
    replicas = queue_controllers
    alice, bob, carol = (hub.tokens[u] for u in ("alice", "bob", "carol"))
    await asyncio.to_thread(clear, replicas, carol)
    urls = [c.url for c in replicas]
    a_server, b_server = "srv-" + uuid.uuid4().hex[:8], "srv-" + uuid.uuid4().hex[:8]
    a_client = ControllerClient(urls, alice, retry_for=60)
    b_client = ControllerClient(urls, bob, retry_for=60)
    kube = await connect(str(control_plane.kubeconfig("admin")))
    try:
        async with heartbeats(a_client, a_server), heartbeats(b_client, b_server):
            full = await a_client.request(
                "POST",
                "/api/allocations",
                {
                    "kernel_id": kernel_name(),
                    "server_id": a_server,
                    "share": {"gpu_request": 1.0, "gpu_type": "T4"},
                },
            )
            b_kernel = kernel_name()
            body = {"kernel_id": b_kernel, "server_id": b_server, "share": T4}
            entry = (await b_client.request("POST", "/api/queue", body))["entry"]
            assert entry["state"] == "waiting" and entry["position"] == 1, entry
            again = (await b_client.request("POST", "/api/queue", body))["entry"]
            assert again["id"] == entry["id"]  # a retry of the same start: the same entry
            stored = await kube._json(
                kube.custom.get_namespaced_custom_object(
                    GROUP, VERSION, NAMESPACE, "gpuqueues", "gpushare-queue", _preload_content=False
                )
            )
            waiting = [e["id"] for e in stored["spec"]["entries"] if e["state"] == "waiting"]
            assert waiting == [entry["id"]], stored["spec"]

            old = leader(replicas)
            stop_process(old.proc, signal.SIGKILL)
            seen = (await b_client.request("GET", f"/api/queue/{entry['id']}"))["entry"]
            assert leader(replicas) is not old
            assert seen["state"] == "waiting" and seen["position"] == 1, seen

            reply = await asyncio.to_thread(
                call, replicas, alice, "DELETE", f"/api/queue/{entry['id']}"
            )
            assert reply.status_code == 404 and reply.json()["error"] == "unknown_entry"
            ended = (await b_client.request("DELETE", f"/api/queue/{entry['id']}"))["entry"]
            assert ended["state"] == "cancelled", ended
            assert (await b_client.request("GET", "/api/queue"))["entries"] == []

            # a server that dies: its waiting start is dropped once its Lease expires
            dead_server = "srv-" + uuid.uuid4().hex[:8]
            d_kernel = kernel_name()
            body = {"kernel_id": d_kernel, "server_id": dead_server, "share": T4}
            dying = (await b_client.request("POST", "/api/queue", body))["entry"]
            deadline = time.monotonic() + 30
            while True:
                seen = (await b_client.request("GET", f"/api/queue/{dying['id']}"))["entry"]
                if seen["state"] != "waiting":
                    break
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.5)
            assert seen["state"] == "dropped" and dead_server in seen["message"], seen

            await a_client.request("DELETE", f"/api/allocations/{full['id']}")
            await asyncio.sleep(1.5)
            mine = (await b_client.request("GET", "/api/allocations"))["allocations"]
            assert not [a for a in mine if a["kernel_id"] in (b_kernel, d_kernel)], mine
    finally:
        await kube.close()


async def test_a_wait_that_ends_unstarted_is_refused_with_the_queues_reason(
    queue_controllers: list[Controller],
    hub: Any,  # noqa: F811 - the imported fixture
) -> None:
    """No pod. With the T4 full of alice's share, alice's start waits, then bob's: bob holds
    nothing, so he is 1st (fair order between users, not arrival). The server side's wait (the
    provisioner's ``queue_wait``) ends after its bound with ``PlacementRefused`` naming the
    queue, and its entry is cancelled. A user's third waiting start is refused (cap 2); a bad
    ``wait`` is refused by name."""
    replicas = queue_controllers
    alice, bob, carol = (hub.tokens[u] for u in ("alice", "bob", "carol"))
    await asyncio.to_thread(clear, replicas, carol)
    urls = [c.url for c in replicas]
    a_server, b_server = "srv-" + uuid.uuid4().hex[:8], "srv-" + uuid.uuid4().hex[:8]
    a_client = ControllerClient(urls, alice, retry_for=30)
    b_client = ControllerClient(urls, bob, retry_for=30)
    c_client = ControllerClient(urls, carol, retry_for=30)
    async with heartbeats(a_client, a_server), heartbeats(b_client, b_server):
        full = await a_client.request(
            "POST",
            "/api/allocations",
            {
                "kernel_id": kernel_name(),
                "server_id": a_server,
                "share": {"gpu_request": 1.0, "gpu_type": "T4"},
            },
        )
        body = {"kernel_id": kernel_name(), "server_id": a_server, "share": T4}
        a_entry = (await a_client.request("POST", "/api/queue", body))["entry"]
        assert a_entry["position"] == 1, a_entry
        try:
            views: list[dict[str, Any]] = []
            waiting = asyncio.create_task(
                ControllerLedger(b_client, b_server).reserve_waiting(
                    ShareSpec.from_mapping(T4), None, 1.0, views.append, kernel_id=kernel_name()
                )
            )
            deadline = time.monotonic() + 10
            while not views:
                assert time.monotonic() < deadline and not waiting.done(), waiting
                await asyncio.sleep(0.05)
            listed = (await c_client.request("GET", "/api/queue"))["entries"]
            assert [(e["user"], e["position"]) for e in listed] == [("bob", 1), ("alice", 2)]
            with pytest.raises(PlacementRefused, match="waited 1 s in the queue: 1st in line"):
                await waiting
            listed = (await c_client.request("GET", "/api/queue"))["entries"]
            assert [e["user"] for e in listed] == ["alice"], listed

            reply = await asyncio.to_thread(
                call, replicas, bob, "GET", f"/api/queue/{a_entry['id']}?wait=nan"
            )
            assert reply.status_code == 400 and reply.json()["field"] == "wait", reply.text
            mine = []
            for _ in range(2):
                body = {"kernel_id": kernel_name(), "server_id": b_server, "share": T4}
                mine.append((await b_client.request("POST", "/api/queue", body))["entry"]["id"])
            body = {"kernel_id": kernel_name(), "server_id": b_server, "share": T4}
            reply = await asyncio.to_thread(call, replicas, bob, "POST", "/api/queue", body)
            assert reply.status_code == 409 and reply.json()["error"] == "queue_full", reply.text
            for entry_id in mine:
                await b_client.request("DELETE", f"/api/queue/{entry_id}")
        finally:
            await a_client.request("DELETE", f"/api/queue/{a_entry['id']}")
            await a_client.request("DELETE", f"/api/allocations/{full['id']}")


def queue_series(url: str) -> dict[str, list[Any]]:
    """``/metrics`` of one replica (no token): the ``gpushare_queue_*`` samples by name."""
    reply = requests.get(url + "/metrics", timeout=10)
    assert reply.status_code == 200, reply.text
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(series: dict[str, list[Any]], name: str, **labels: str) -> float:
    found = [s.value for s in series.get(name, []) if labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, series.get(name))
    return float(found[0])


async def test_admins_see_the_queue_in_metrics_and_status(
    queue_controllers: list[Controller],
    control_plane: ControlPlane,
    hub: Any,  # noqa: F811 - the imported fixture
) -> None:
    """No pod. With the T4 full of alice's share, alice's start waits, then bob's. The leading
    replica's ``/metrics`` (no token) has the node agent's series: gpushare_queue_length 2 with
    its identity as Hostname, cancelled and started counters, the wait histogram; the standby
    exports none. ``jupyter gpushare status --kubernetes-namespace`` (an admin's kubeconfig)
    lists the waiting starts in the fair order (bob 1st: he holds nothing) with who, what,
    since and where in line; ``--json`` the same as ``queue``. Bob cancels: cancelled + 1;
    alice's share released: hers starts by itself, started + 1 and one more wait observed."""
    replicas = queue_controllers
    alice, bob, carol = (hub.tokens[u] for u in ("alice", "bob", "carol"))
    await asyncio.to_thread(clear, replicas, carol)
    urls = [c.url for c in replicas]
    head = leader(replicas)
    # a replica an earlier test stopped does not answer: the standbys that do
    standbys = [c for c in replicas if c is not head and c.health() == 503]
    a_server, b_server = "srv-" + uuid.uuid4().hex[:8], "srv-" + uuid.uuid4().hex[:8]
    a_client = ControllerClient(urls, alice, retry_for=30)
    b_client = ControllerClient(urls, bob, retry_for=30)
    identity = (await a_client.request("GET", "/api/health"))["identity"]
    before = await asyncio.to_thread(queue_series, head.url)
    async with heartbeats(a_client, a_server), heartbeats(b_client, b_server):
        full = await a_client.request(
            "POST",
            "/api/allocations",
            {
                "kernel_id": kernel_name(),
                "server_id": a_server,
                "share": {"gpu_request": 1.0, "gpu_type": "T4"},
            },
        )
        a_body = {"kernel_id": kernel_name(), "server_id": a_server, "share": T4}
        a_entry = (await a_client.request("POST", "/api/queue", a_body))["entry"]
        b_body = {"kernel_id": kernel_name(), "server_id": b_server, "share": T4}
        b_entry = (await b_client.request("POST", "/api/queue", b_body))["entry"]
        released = False
        try:
            series = await asyncio.to_thread(queue_series, head.url)
            assert value(series, "gpushare_queue_length", Hostname=identity) == 2
            for standby in standbys:
                series = await asyncio.to_thread(queue_series, standby.url)
                assert "gpushare_queue_length" not in series
            status = [
                *(sys.executable, "-m", "jupyter_gpushare", "status"),
                *("--kubernetes-namespace", NAMESPACE),
                *("--kubeconfig", str(control_plane.kubeconfig("admin"))),
            ]
            shown = await asyncio.to_thread(
                subprocess.run, [*status, "--json"], capture_output=True, text=True, timeout=120
            )
            assert shown.returncode == 0, shown.stderr
            queue = json.loads(shown.stdout)["queue"]
            assert [(e["user"], e["position"], e["id"]) for e in queue] == [
                ("bob", 1, b_entry["id"]),
                ("alice", 2, a_entry["id"]),
            ], queue
            assert queue[0]["share"]["gpu_type"] == "T4" and queue[0]["since"] > 0
            assert queue[0]["message"].startswith("1st in line for 0.25"), queue[0]
            assert queue[1]["message"].startswith("2nd in line for 0.25"), queue[1]
            table = await asyncio.to_thread(
                subprocess.run,
                status,
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "COLUMNS": "200"},
            )
            assert table.returncode == 0, table.stderr
            assert "Waiting starts (queue)" in table.stdout, table.stdout
            assert re.search(r"1 .*bob .*0\.25 of T4 .*1st in line", table.stdout), table.stdout

            await b_client.request("DELETE", f"/api/queue/{b_entry['id']}")
            await a_client.request("DELETE", f"/api/allocations/{full['id']}")
            released = True
            deadline = time.monotonic() + 20
            while True:
                view = (await a_client.request("GET", f"/api/queue/{a_entry['id']}?wait=5"))[
                    "entry"
                ]
                if view["state"] != "waiting" or time.monotonic() > deadline:
                    break
            assert view["state"] == "started", view
            after = await asyncio.to_thread(queue_series, head.url)
            for name, more in (
                ("gpushare_queue_cancelled_total", 1),
                ("gpushare_queue_started_total", 1),
                ("gpushare_queue_wait_seconds_count", 1),
            ):
                was = value(before, name, Hostname=identity) if name in before else 0.0
                assert value(after, name, Hostname=identity) == was + more, name
            assert value(after, "gpushare_queue_length", Hostname=identity) == 0
            inf = value(after, "gpushare_queue_wait_seconds_bucket", le="+Inf")
            assert inf == value(after, "gpushare_queue_wait_seconds_count")
            assert "gpushare_queue_eta_error_seconds_count" in after
        finally:
            for entry in (a_entry, b_entry):
                with contextlib.suppress(Exception):
                    await a_client.request("DELETE", f"/api/queue/{entry['id']}")
            if not released:
                await a_client.request("DELETE", f"/api/allocations/{full['id']}")
            await asyncio.to_thread(clear, replicas, carol)


def test_the_charts_queue_values_are_what_the_controller_reads(tmp_path: Path) -> None:
    """No cluster: ``controller.queue`` of the chart's values reaches the controller's
    ``ControllerQueueSettings`` through the ConfigMap the real ControllerApp loads."""
    import subprocess

    import yaml
    from test_helm import helm_binary

    from jupyter_gpushare.controller.app import ControllerApp
    from jupyter_gpushare.controller.queue import ControllerQueueSettings

    binary = helm_binary()
    if binary is None:
        pytest.skip("no helm binary (.ci/setup.d/helm.sh)")
    values = tmp_path / "values.yaml"
    queue = {"groupWeights": {"course": 2.0}, "groupPriorities": {"course": 1}, "maxPerUser": 3}
    values.write_text(yaml.safe_dump({"controller": {"enabled": True, "queue": queue}}))
    chart = Path(__file__).resolve().parents[2] / "deploy/helm/jupyter-gpushare"
    out = subprocess.run(
        [binary, "template", "x", str(chart), "--namespace", "gpushare", "-f", str(values)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    objs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    config = tmp_path / "controller_config.json"
    config.write_text(objs[("ConfigMap", "gpushare-controller")]["data"][config.name])
    app = ControllerApp()
    app.initialize([f"--config={config}"])
    policy = ControllerQueueSettings(config=app.config).policy()
    assert policy.weight_of(["course"]) == 2.0 and policy.priority_of(["course"]) == 1
    assert policy.max_per_user == 3 and policy.hold_s == 300.0


async def test_only_the_controller_may_read_or_write_the_queue(control_plane: ControlPlane) -> None:
    """No pod. The identities of a direct-mode server and of the node daemon hold no rights on
    GpuQueues (least privilege: only the controller keeps the queue); the queue's store says
    so in the admin's words instead of failing with the API's status."""
    from jupyter_gpushare.controller.errors import ControllerError
    from jupyter_gpushare.controller.queue import QueuedStart, QueueStore

    entry = QueuedStart("q-0123456789abcdef", "mallory", [], "srv-x", "k1", "kernel", T4, None, 0.0)
    for identity in ("server", "daemon"):
        kube = await connect(str(control_plane.kubeconfig(identity)))
        try:
            store = QueueStore(kube, NAMESPACE)
            for attempt in (store.read(), store.write(None, [entry]), store.write("1", [entry])):
                with pytest.raises(ControllerError, match="lacks get/update/create of gpuqueues"):
                    await attempt
        finally:
            await kube.close()
