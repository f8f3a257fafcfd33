"""Who reaches a kernel pod (issue 15 "Network"), without a cluster: the NetworkPolicy evaluator
of netpol.py on the Kubernetes documentation's examples, the controller's per-user policy
(controller/network.py) with the chart's controller-mode policies, and their schemas. The same
evaluator over the live cluster's policies, with two Hub users' kernels started through the
controller: tests/k8s/test_controller.py.

Where it runs: the real API server; NetworkPolicies are checked by the evaluator of netpol.py (no
registry here offers a CNI that enforces them, on the double or the real node).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from netpol import Pod, allowed, selects
from test_helm import by_key, one, render
from test_helm import helm as helm
from test_manifest_schemas import NON_DEFAULT, invalid
from test_manifests import request
from traitlets.config import Config

from jupyter_gpushare.controller.config import GpushareController
from jupyter_gpushare.controller.network import (
    KernelNetwork,
    NetworkSettings,
    check_selector,
    policy_name,
    user_policy,
)
from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.client import ApiException

#: z2jh's labels of a user's server pod and of the hub's pod
USER_POD = {"app": "jupyterhub", "component": "singleuser-server", "release": "jhub"}
HUB_POD = {"app": "jupyterhub", "component": "hub", "release": "jhub"}
KERNEL_PORT = 51234


# -- the evaluator, on the documentation's examples -----------------------------------------------

#: https://kubernetes.io/docs/concepts/services-networking/network-policies/ "test-network-policy"
DOC_EXAMPLE = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "test-network-policy", "namespace": "default"},
    "spec": {
        "podSelector": {"matchLabels": {"role": "db"}},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [
            {
                "from": [
                    {"ipBlock": {"cidr": "172.17.0.0/16", "except": ["172.17.1.0/24"]}},
                    {"namespaceSelector": {"matchLabels": {"project": "myproject"}}},
                    {"podSelector": {"matchLabels": {"role": "frontend"}}},
                ],
                "ports": [{"protocol": "TCP", "port": 6379}],
            }
        ],
        "egress": [
            {
                "to": [{"ipBlock": {"cidr": "10.0.0.0/24"}}],
                "ports": [{"protocol": "TCP", "port": 5978}],
            }
        ],
    },
}


def policy(namespace: str, spec: dict[str, Any], name: str = "p") -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def test_evaluator_on_the_documented_example() -> None:
    db = Pod("default", {"role": "db"}, "10.1.0.9")
    frontend = Pod("default", {"role": "frontend"}, "10.1.0.2")
    policies = [DOC_EXAMPLE]
    assert allowed(policies, frontend, db, 6379)
    assert not allowed(policies, frontend, db, 80)  # only the listed port
    assert not allowed(policies, frontend, db, 6379, "UDP")
    # any pod of a namespace labelled project=myproject; not a frontend of another namespace
    assert allowed(policies, Pod("team", {}, "10.2.0.1", {"project": "myproject"}), db, 6379)
    assert not allowed(policies, Pod("team", {"role": "frontend"}, "10.2.0.1"), db, 6379)
    assert not allowed(policies, Pod("default", {"role": "backend"}, "10.1.0.3"), db, 6379)
    # ipBlock, with its exception
    assert allowed(policies, Pod("x", {}, "172.17.2.5"), db, 6379)
    assert not allowed(policies, Pod("x", {}, "172.17.1.5"), db, 6379)
    # a pod no policy selects is not isolated: anything reaches it
    assert allowed(policies, Pod("x", {}, "1.2.3.4"), frontend, 80)


def test_evaluator_and_versus_or_default_deny_allow_all() -> None:
    """The documentation's "namespaceSelector and podSelector" (one peer: AND; two peers: OR),
    "Default deny all ingress traffic" and "Allow all ingress traffic"."""
    target = Pod("default", {"app": "api"})
    alice_client = Pod("a", {"role": "client"}, namespace_labels={"user": "alice"})
    alice_other = Pod("a", {"role": "web"}, namespace_labels={"user": "alice"})
    local_client = Pod("default", {"role": "client"})
    both = {"namespaceSelector": {"matchLabels": {"user": "alice"}}}
    both["podSelector"] = {"matchLabels": {"role": "client"}}
    and_policy = policy("default", {"podSelector": {}, "ingress": [{"from": [both]}]})
    either = [
        {"namespaceSelector": both["namespaceSelector"]},
        {"podSelector": both["podSelector"]},
    ]
    or_policy = policy("default", {"podSelector": {}, "ingress": [{"from": either}]})
    assert allowed([and_policy], alice_client, target, 80)
    assert not allowed([and_policy], alice_other, target, 80)
    assert not allowed([and_policy], local_client, target, 80)
    assert allowed([or_policy], alice_other, target, 80)
    assert allowed([or_policy], local_client, target, 80)
    deny = policy("default", {"podSelector": {}, "policyTypes": ["Ingress"]})
    assert not allowed([deny], local_client, target, 80)
    # policies add up: deny-all and a policy admitting clients admit clients
    assert allowed([deny, and_policy], alice_client, target, 80)
    assert not allowed([deny, and_policy], alice_other, target, 80)
    allow_all = policy("default", {"podSelector": {}, "ingress": [{}]})
    assert allowed([deny, allow_all], alice_other, target, 80)
    # an egress-only policy does not isolate for ingress; without policyTypes ingress is implied
    egress_only = policy("default", {"podSelector": {}, "policyTypes": ["Egress"]})
    assert allowed([egress_only], alice_other, target, 80)
    assert not allowed([policy("default", {"podSelector": {}})], alice_other, target, 80)
    # a policy of another namespace selects nothing here
    assert allowed([policy("other", {"podSelector": {}})], alice_other, target, 80)
    # port ranges, matchExpressions
    ranged = policy(
        "default",
        {"podSelector": {}, "ingress": [{"ports": [{"port": 50000, "endPort": 60000}]}]},
    )
    assert allowed([ranged], local_client, target, KERNEL_PORT)
    assert not allowed([ranged], local_client, target, 22)
    assert selects(
        {"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {"a": "1"}
    )
    assert not selects(
        {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"}
    )
    assert selects({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"b": "1"})


# -- the controller's per-user policy with the chart's controller-mode policies ------------------


def server_pod(user: str, namespace: str = "jhub") -> Pod:
    return Pod(namespace, {**USER_POD, manifests.LABEL_OWNER: manifests.owner_label(user)})


def kernel_pod(user: str, namespace: str = "gpushare") -> Pod:
    return kernel_pod_labeled(manifests.owner_label(user), namespace)


def kernel_pod_labeled(owner: str, namespace: str) -> Pod:
    """A kernel pod of k8s/manifests.py with the owner label ``owner``, as the controller
    builds it."""
    pod = manifests.kernel_pod(
        request(namespace=namespace, user_label=owner), manifests.PodSettings(image="img")
    )
    return Pod(namespace, pod["metadata"]["labels"])


def default_settings() -> NetworkSettings:
    return NetworkSettings.from_config(GpushareController(config=Config()))


def test_each_user_reaches_only_their_own_kernels(helm: str, tmp_path: Path) -> None:
    objs = render(helm, tmp_path, {"controller": {"enabled": True}})
    chart = [o for o in objs if o["kind"] == "NetworkPolicy"]
    controller = Pod("gpushare", one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"])
    daemon = Pod("gpushare", one(objs, "DaemonSet")["spec"]["template"]["metadata"]["labels"])
    settings = default_settings()
    # the controller's defaults are the chart's networkPolicy.servers and controller labels
    assert settings.controller_pod_labels.items() <= controller.labels.items()
    policies = chart + [user_policy(manifests.owner_label(u), "gpushare", settings) for u in "ab"]
    a_kernel, b_kernel = kernel_pod("a"), kernel_pod("b")
    for source, reaches in [
        (server_pod("a"), {"a"}),
        (server_pod("b"), {"b"}),
        (controller, {"a", "b"}),
        (Pod("jhub", USER_POD), set()),  # a server without an owner label (not the Hub's)
        (Pod("jhub", HUB_POD), set()),
        (server_pod("a", "default"), set()),  # a lookalike outside the servers' namespace
        (Pod("gpushare", {**USER_POD, manifests.LABEL_OWNER: manifests.owner_label("a")}), set()),
        (kernel_pod("a"), set()),  # a kernel, even the user's own
        (daemon, set()),
    ]:
        got = {
            u
            for u, k in (("a", a_kernel), ("b", b_kernel))
            if allowed(policies, source, k, KERNEL_PORT)
        }
        assert got == reaches, (source, got)
    # without the user's policy (controller mode), the chart's policy lets the controller only
    assert not allowed(chart, server_pod("a"), a_kernel, KERNEL_PORT)
    assert allowed(chart, controller, a_kernel, KERNEL_PORT)
    # direct mode (the default values) keeps the broad rule: any server reaches any kernel
    direct = [o for o in render(helm, tmp_path) if o["kind"] == "NetworkPolicy"]
    assert allowed(direct, server_pod("a"), b_kernel, KERNEL_PORT)
    assert allowed(direct, Pod("jhub", USER_POD), b_kernel, KERNEL_PORT)
    assert not allowed(direct, Pod("jhub", HUB_POD), b_kernel, KERNEL_PORT)


def test_non_default_servers_reach_the_per_user_policy(helm: str, tmp_path: Path) -> None:
    """networkPolicy.servers becomes the controller's selectors (its ConfigMap), and the
    per-user policy uses them: namespaces a and b (matchExpressions), pods app=jupyter-server.
    Helm merges values into the defaults: ``null`` drops a default selector's key."""
    servers = {
        "namespaceSelector": {
            "matchLabels": None,
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["a", "b"]}
            ],
        },
        "podSelector": {"matchLabels": {"app": "jupyter-server", "component": None}},
    }
    values = {**NON_DEFAULT, "networkPolicy": {**NON_DEFAULT["networkPolicy"], "servers": servers}}
    objs = render(helm, tmp_path, values)
    config = by_key(objs)[("ConfigMap", "science", "gpushare-controller")]
    loaded = json.loads(config["data"]["controller_config.json"])["GpushareController"]
    assert loaded["network_policies"] is True
    c = Config()
    for key in ("server_namespace_selector", "server_pod_selector"):
        setattr(c.GpushareController, key, loaded[key])
    settings = NetworkSettings.from_config(GpushareController(config=c))
    owner = manifests.owner_label("zoe")
    mine = user_policy(owner, "science", settings)
    assert invalid(mine) == []
    chart = [o for o in objs if o["kind"] == "NetworkPolicy"]
    kernel = kernel_pod("zoe", "science")
    server = {"app": "jupyter-server", manifests.LABEL_OWNER: owner}
    assert allowed([*chart, mine], Pod("b", server), kernel, KERNEL_PORT)
    assert not allowed([*chart, mine], Pod("c", server), kernel, KERNEL_PORT)
    assert not allowed(
        [*chart, mine], Pod("a", {**server, manifests.LABEL_OWNER: "x"}), kernel, KERNEL_PORT
    )
    # networkPolicy off: no policy, and the controller keeps none (nor has the right to)
    off = render(
        helm, tmp_path, {"controller": {"enabled": True}, "networkPolicy": {"enabled": False}}
    )
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]
    cfg = json.loads(one(off, "ConfigMap")["data"]["controller_config.json"])
    assert cfg["GpushareController"]["network_policies"] is False
    role = by_key(off)[("Role", "gpushare", "gpushare-controller")]
    assert not [r for r in role["rules"] if "networkpolicies" in r["resources"]]


def test_user_policies_validate_and_name_the_owner() -> None:
    settings = default_settings()
    for user in ("alice", "Ünïcode user", "a" * 300, "x@example.org"):
        owner = manifests.owner_label(user)
        assert len(owner) == 20 and owner.isalnum()
        mine = user_policy(owner, "gpushare", settings)
        assert mine["metadata"]["name"] == f"gpushare-kernels-{owner}"
        assert invalid(mine) == []
    # a kernel pod carries the owner label; without one (direct mode) it carries none
    labeled = manifests.kernel_pod(request(user_label="abc"), manifests.PodSettings(image="i"))
    assert labeled["metadata"]["labels"][manifests.LABEL_OWNER] == "abc"
    plain = manifests.kernel_pod(request(), manifests.PodSettings(image="i"))
    assert manifests.LABEL_OWNER not in plain["metadata"]["labels"]
    assert invalid(labeled) == []


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("server_pod_selector", {"matchLabel": {"a": "b"}}, "server_pod_selector"),
        ("server_pod_selector", {"matchLabels": {"a": 1}}, "server_pod_selector.matchLabels"),
        (
            "server_pod_selector",
            {"matchLabels": {manifests.LABEL_OWNER: "x"}},
            "server_pod_selector.matchLabels",
        ),
        ("server_namespace_selector", {"matchExpressions": "x"}, "matchExpressions"),
        ("controller_pod_labels", {"a": ["b"]}, "controller_pod_labels.matchLabels"),
    ],
)
def test_bad_selectors_are_refused_by_name(key: str, value: Any, named: str) -> None:
    c = Config()
    setattr(c.GpushareController, key, copy.deepcopy(value))
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        NetworkSettings.from_config(GpushareController(config=c))


def test_selector_check_keeps_what_it_accepts() -> None:
    given = {"matchLabels": {"a": "b"}, "matchExpressions": [{"key": "k", "operator": "Exists"}]}
    assert check_selector(given, "x") == given
    # None: the kernels' own namespace (a peer with a podSelector only)
    c = Config()
    c.GpushareController.server_namespace_selector = None
    mine = user_policy("o", "ns", NetworkSettings.from_config(GpushareController(config=c)))
    assert "namespaceSelector" not in mine["spec"]["ingress"][0]["from"][0]
    assert allowed(
        [mine],
        Pod("ns", {**USER_POD, manifests.LABEL_OWNER: "o"}),
        kernel_pod_labeled("o", "ns"),
        1,
    )
    assert not allowed(
        [mine],
        Pod("jhub", {**USER_POD, manifests.LABEL_OWNER: "o"}),
        kernel_pod_labeled("o", "ns"),
        1,
    )


# -- the controller's keeping of the policies (one namespace, an in-memory API) ------------------


class _Stream:
    """What ``on_response`` gets: closing it ends the watch as a dropped connection would."""

    def __init__(self, store: PolicyStore) -> None:
        self.store = store
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.store.wake()


class PolicyStore:
    """The NetworkPolicy calls of k8s/client.Kube over a dict, with the API server's answers
    (409 on a second create, 404 on a missing delete, ``forbid``: 403) and its LIST + watch as
    the informer calls them (``lister``, ``_json``, ``watch``: resourceVersions, a watch from a
    version older than ``oldest`` answers 410 Gone). ``calls`` records every request."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.forbid = False
        self.failures: list[Exception] = []  # raised by the next LISTs, one each
        self.version = 1
        self.oldest = 1  # the oldest version a watch may start after
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self._changed = asyncio.Event()

    def wake(self) -> None:
        self._changed.set()

    def _event(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, copy.deepcopy(obj)))
        self.wake()
        return obj

    # the calls KernelNetwork makes
    async def create_network_policy(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("create")
        if self.forbid:
            raise ApiException(status=403, reason="networkpolicies is forbidden")
        name = body["metadata"]["name"]
        if name in self.items:
            raise ApiException(status=409, reason="already exists")
        stored = copy.deepcopy(body)
        stored["metadata"]["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.items[name] = self._event("ADDED", stored)
        return copy.deepcopy(stored)

    async def delete_network_policy(self, namespace: str, name: str) -> bool:
        self.calls.append("delete")
        gone = self.items.pop(name, None)
        if gone is not None:
            self._event("DELETED", gone)
        return gone is not None

    # the informer's LIST and watch (k8s/watch.py)
    def lister(self, kind: str, namespace: str) -> tuple[Any, tuple[Any, ...]]:
        assert kind == "networkpolicies", kind
        return self._list, (namespace,)

    async def _list(self, namespace: str, label_selector: str = "", **_: Any) -> dict[str, Any]:
        self.calls.append("list")
        if self.failures:
            raise self.failures.pop(0)
        return {
            "metadata": {"resourceVersion": str(self.version)},
            "items": [copy.deepcopy(p) for p in self.items.values() if _matches(p, label_selector)],
        }

    async def _json(self, coro: Any) -> dict[str, Any]:
        return await coro

    async def watch(
        self,
        kind: str,
        namespace: str,
        resource_version: str,
        timeout_seconds: int = 240,
        on_response: Any = None,
        label_selector: str = "",
    ) -> AsyncIterator[dict[str, Any]]:
        self.calls.append("watch")
        after = int(resource_version)
        if after < self.oldest:
            raise ApiException(status=410, reason="too old resource version")
        stream = _Stream(self)
        if on_response is not None:
            on_response(stream)
        while not stream.closed:
            self._changed.clear()
            for version, kind_, obj in [e for e in self.events if e[0] > after]:
                after = version
                if _matches(obj, label_selector):
                    yield {"type": kind_, "object": copy.deepcopy(obj)}
            await self._changed.wait()

    # for the tests
    def age(self, owner: str, seconds: float) -> None:
        """Make ``owner``'s policy ``seconds`` old (a MODIFIED event, as an update would)."""
        when = time.gmtime(time.time() - seconds)
        policy = self.items[policy_name(owner)]
        policy["metadata"]["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", when)
        self._event("MODIFIED", policy)

    def add_by_hand(self, name: str, labels: dict[str, str]) -> None:
        """A policy someone else made (kubectl): no 'create' call of the controller's."""
        body = {"metadata": {"name": name, "labels": labels, "creationTimestamp": "x"}}
        self.items[name] = self._event("ADDED", body)


def _matches(obj: dict[str, Any], selector: str) -> bool:
    key, _, value = selector.partition("=")
    return not key or (obj["metadata"].get("labels") or {}).get(key) == value


async def caught_up(network: KernelNetwork, store: PolicyStore) -> None:
    """Wait until the controller's informer has seen every change of the store (the watch is
    asynchronous, as it is against an API server)."""
    for _ in range(2500):
        if network.policies.resource_version == str(store.version):
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"informer at {network.policies.resource_version}, store {store.version}")


def kernel_object(owner: str) -> dict[str, Any]:
    return manifests.kernel_pod(request(user_label=owner), manifests.PodSettings(image="i"))


async def test_policies_follow_kernels_never_racing_a_launch() -> None:
    store = PolicyStore()
    now = [1000.0]
    network = KernelNetwork(store, "gpushare", default_settings(), 60.0, lambda: now[0])  # type: ignore[arg-type]
    a, b, c = (manifests.owner_label(u) for u in ("alice", "bob", "carol"))
    try:
        # a launch ensures its user's policy before its pod: one create, then none
        await network.ensure(a)
        await network.ensure(a)
        assert store.calls == ["create"] and list(store.items) == [policy_name(a)]
        # a pass while a's launch is between ensure and pod (no pod yet): kept, even when old
        store.age(a, 3600)
        assert await network.run_once([]) == ([], [])
        # a's pod exists; b's policy was deleted by hand while b's kernel runs: b's comes back;
        # a kernel pod labelled with something owner_label never makes gets none (nor fails
        # the pass)
        pods = [
            kernel_object(a),
            kernel_object(b),
            kernel_object("Not.A-Digest"),
            kernel_object(""),
        ]
        assert await network.run_once(pods) == ([b], [])
        # a's kernels are gone: once the grace since a's last launch has passed, a's policy
        # goes; b's stays (its pod is there), and a young policy of c (no pod) stays too
        await network.ensure(c)
        now[0] += 61
        store.age(a, 3600)
        await caught_up(network, store)
        assert await network.run_once([kernel_object(b)]) == ([], [a])
        assert set(store.items) == {policy_name(b), policy_name(c)}
        # the next launch of a creates it again (the pass forgot it), and the next pass, before
        # the watch's DELETED and ADDED reach it, neither deletes nor recreates anything
        await network.ensure(a)
        assert policy_name(a) in store.items
        calls = len(store.calls)
        assert await network.run_once([kernel_object(a), kernel_object(b)]) == ([], [])
        assert store.calls[calls:] == []
        # a policy another hand labels as ours but names otherwise is not the controller's
        store.add_by_hand("not-ours", {manifests.LABEL_COMPONENT: "gpushare-kernel-access"})
        await caught_up(network, store)
        assert await network.run_once([kernel_object(b)]) == ([], [])
        assert "not-ours" in store.items
    finally:
        await network.stop()


async def test_passes_read_the_watch_not_a_list() -> None:
    """Many passes cost one LIST (at the first) and one watch; policies changed by others reach
    the passes through the watch; a dropped watch resumes without a LIST; only a 410 Gone
    lists again."""
    store = PolicyStore()
    network = KernelNetwork(store, "gpushare", default_settings(), grace=0.0)  # type: ignore[arg-type]
    owners = [manifests.owner_label(f"user{i}") for i in range(20)]
    try:
        pods = [kernel_object(o) for o in owners]
        assert await network.run_once(pods) == (sorted(owners), [])
        for _ in range(50):
            assert await network.run_once(pods) == ([], [])
        assert store.calls.count("list") == 1 and store.calls.count("watch") == 1
        assert store.calls.count("create") == 20 and len(store.items) == 20
        # deleted by hand: the watch tells the next pass, which puts it back
        await store.delete_network_policy("gpushare", policy_name(owners[3]))
        await caught_up(network, store)
        assert await network.run_once(pods) == ([owners[3]], [])
        # a dropped connection: the watch resumes from its version, no LIST
        network.policies.drop_watch()
        await store.delete_network_policy("gpushare", policy_name(owners[4]))
        await caught_up(network, store)
        assert await network.run_once(pods) == ([owners[4]], [])
        assert store.calls.count("list") == 1 and store.calls.count("watch") == 2
        # the version compacted away (410 Gone): one LIST, which also reports what went
        # meanwhile (a deletion the watch never carried)
        store.oldest = store.version + 1
        del store.items[policy_name(owners[5])]  # gone without an event the watch could give
        store.version += 1
        network.policies.drop_watch()
        for _ in range(2500):
            if network.policies.get(policy_name(owners[5])) is None:
                break
            await asyncio.sleep(0.002)
        assert store.calls.count("list") == 2
        assert await network.run_once(pods) == ([owners[5]], [])
        # the kernels end: every policy goes (grace 0), each once
        deleted = await network.run_once([])
        assert deleted == ([], sorted(owners)) and store.items == {}
        assert await network.run_once([]) == ([], [])
        assert store.calls.count("delete") == 22  # the 20 and the two deleted "by hand"
        assert store.calls.count("list") == 2
    finally:
        await network.stop()


async def test_a_policy_that_cannot_be_made_refuses_the_launch_by_name() -> None:
    from jupyter_gpushare.controller.errors import ControllerError

    store = PolicyStore()
    store.forbid = True
    network = KernelNetwork(store, "gpushare", default_settings())  # type: ignore[arg-type]
    with pytest.raises(ControllerError) as refused:
        await network.ensure("a")
    assert refused.value.status == 503 and refused.value.code == "kernel_network_failed"
    assert policy_name("a") in str(refused.value) and "deploy/rbac.yaml" in str(refused.value)
    assert "watch" in str(refused.value)  # the rights it needs, all named


async def test_the_pass_outlives_failures(caplog: pytest.LogCaptureFixture) -> None:
    """The API server away or refusing: the informer retries its LIST, the pass logs each
    distinct error once and keeps going, and puts the missing policy of a running kernel in
    place once it can; cancelled, it stops its watch."""
    store = PolicyStore()
    store.failures = [ConnectionError("api server away"), ApiException(status=500)]
    store.forbid = True
    network = KernelNetwork(store, "gpushare", default_settings())  # type: ignore[arg-type]
    owner = manifests.owner_label("alice")
    informer = network.policies
    task = asyncio.create_task(network.run_forever(0.01, lambda: [kernel_object(owner)]))
    try:
        for _ in range(1000):
            if store.calls.count("create") >= 5:
                store.forbid = False
            if policy_name(owner) in store.items:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert policy_name(owner) in store.items
    assert store.calls.count("list") == 3  # two failed, then one
    failed = [r.getMessage() for r in caplog.records if "pass failed" in r.getMessage()]
    assert failed == [
        "gpushare controller: NetworkPolicy pass failed: 403 networkpolicies is forbidden"
    ]
    assert informer.synced and informer._task is None  # its informer stopped with it
    assert network.policies is not informer and not network.policies.synced  # a new term lists


# -- against the real API server, as the controller's service account ------------------------------


def test_the_controller_follows_its_policies_with_one_list(control_plane: Any) -> None:
    """As the controller (its service account and deploy/rbac.yaml's rights, watch included):
    many passes cost the API server one LIST of NetworkPolicies (every request of the
    controller's client counted as it is sent: the API server's own count includes the
    controller manager's), a policy deleted by hand comes back through the watch, and a dropped
    watch resumes without a LIST. (A 410 Gone needs a compaction this API server does not make
    in a test's time: the in-memory test above covers it.)"""
    from cluster import NAMESPACE

    from jupyter_gpushare.k8s.client import connect

    owners = [manifests.owner_label(f"np-watch-{i}") for i in range(3)]
    ours = {policy_name(o) for o in owners}

    async def scenario() -> dict[str, int]:
        kube = await connect(str(control_plane.kubeconfig("controller")))
        admin = await connect(str(control_plane.kubeconfig("admin")))
        sent: dict[str, int] = {}
        for method in ("list", "create", "delete"):
            name = f"{method}_namespaced_network_policy"
            func = getattr(kube.networking, name)

            def counted(*args: Any, _func: Any = func, _method: str = method, **kw: Any) -> Any:
                verb = "watch" if kw.get("watch") else _method
                # creates and deletes of this test's policies only: in a whole-suite run the
                # namespace may hold other tests' leftover kernel policies, which the last pass
                # (no kernels, no grace) deletes as well
                name = {"create": lambda: args[1]["metadata"]["name"], "delete": lambda: args[0]}
                if verb not in name or name[verb]() in ours:
                    sent[verb] = sent.get(verb, 0) + 1
                return _func(*args, **kw)

            setattr(kube.networking, name, counted)
        network = KernelNetwork(kube, NAMESPACE, default_settings(), grace=0.0, sync_timeout=20)
        pods = [kernel_object(o) for o in owners]

        async def deleted_by_hand(owner: str) -> None:
            await admin.delete_network_policy(NAMESPACE, policy_name(owner))
            deadline = time.monotonic() + 20
            while network.policies.get(policy_name(owner)) is not None:
                assert time.monotonic() < deadline, "the watch never told the deletion"
                await asyncio.sleep(0.02)

        try:
            created, _ = await network.run_once(pods)
            assert set(owners) <= set(created)
            for _ in range(20):
                assert await network.run_once(pods) == ([], [])
            await deleted_by_hand(owners[0])
            assert await network.run_once(pods) == ([owners[0]], [])
            network.policies.drop_watch()  # a connection lost: resumed from its version
            await deleted_by_hand(owners[1])
            assert await network.run_once(pods) == ([owners[1]], [])
            assert await network.run_once([]) == ([], sorted(owners))
            return sent
        finally:
            await network.stop()
            for owner in owners:
                with contextlib.suppress(Exception):
                    await admin.delete_network_policy(NAMESPACE, policy_name(owner))
            await kube.close()
            await admin.close()

    sent = asyncio.run(scenario())
    print("the controller's NetworkPolicy requests over 25 passes:", sent)
    # one LIST and two watches (the first, the resumed one); 3 creates, and the 2 deleted by
    # hand made again; the 3 deleted once their kernels are gone
    assert sent == {"list": 1, "watch": 2, "create": 5, "delete": 3}, sent
