"""Who may connect to a kernel pod: one NetworkPolicy per Hub user (controller mode, issue 15).

A kernel's ZMQ ports listen on its pod's IP. The chart's policy ``gpushare-kernels`` denies
every connection into kernel pods except the controller's (controller mode), and for each Hub
user with a kernel pod the controller keeps ``gpushare-kernels-<h>``:

- it selects kernel pods labelled ``gpushare.jupyter.org/owner: <h>``, where ``h`` is
  :func:`~jupyter_gpushare.k8s.manifests.owner_label` of the Hub user the controller
  authenticated (the controller builds every kernel pod; users' servers hold no rights, so no
  user can put another's label on a pod);
- it admits pods with the same owner label in the servers' namespace(s)
  (``GpushareController.server_namespace_selector`` / ``server_pod_selector``, the chart's
  ``networkPolicy.servers``): the user's own Jupyter server, labelled by the Hub
  (:func:`jupyter_gpushare.hub.owner_labels`; KubeSpawner runs in the Hub, so that label is
  the Hub's word too), and the controller's pods (``controller_pod_labels``).

NetworkPolicies are additive, so user A's server, matching only A's policy, reaches A's kernels
and no one else's; any other pod (another user's server, a kernel, the hub) reaches none.

**Lifecycle: created by the controller, removed by its reconcile pass; no ownerReferences.**
Owner references to the user's kernel pods would have the garbage collector delete the policy
when the user's last kernel pod goes, racing a launch of that user that found the policy in
place and is creating its pod (a kernel with no policy is unreachable for its own user, the
chart's policy denying everything else), and every launch would have to rewrite the policy's
owners (an update right the controller does not otherwise need). Instead:

- :meth:`KernelNetwork.ensure` runs in every launch *before* the pod is created (create, or
  leave the one that exists: a 409 is success), so a kernel pod never exists without its
  user's policy;
- :meth:`KernelNetwork.run_once` (every reconcile interval, leader only) creates the policy of
  any owner with a kernel pod that lacks one (deleted by hand, a failover mid-launch), and
  deletes the policy of an owner with no kernel pod left, once it is older than
  ``network_policy_grace`` and was not ensured within it (a launch on this leader, or on the
  previous one, is between its ``ensure`` and its pod);
- the pass reads the policies from an informer (:class:`~jupyter_gpushare.k8s.watch.Informer`,
  label ``app.kubernetes.io/component: gpushare-kernel-access``): one LIST when the leader
  starts, then one watch resumed from its last ``resourceVersion`` (a LIST again only after
  ``410 Gone``), as the kernel pods are followed. A pass asks the API server nothing unless it
  creates or deletes a policy: at 1,000 users, no LIST of 1,000 policies every interval. The
  controller's own creates and deletes go into the cache at once (``note``), so the next pass
  and ``ensure`` see them before the watch echoes them. RBAC: ``networkpolicies``
  list/watch/create/delete in the namespace (``deploy/rbac.yaml``);
- only the controller deletes these policies, so a dead or wedged controller leaves every
  policy in place: running kernels stay reachable by their own user (starting new ones needs
  the controller anyway). A stale policy admits nothing but its owner's own pods.

Direct mode (no controller: users' servers create their own pods, so a pod's labels are the
user's word) keeps the chart's broad rule: any server pod reaches any kernel pod; documented in
the chart's README.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..k8s import manifests
from ..k8s.client import ApiException, ClusterError, Kube
from ..k8s.watch import Informer
from .errors import unavailable

log = logging.getLogger("jupyter_gpushare.controller")

POLICY_PREFIX = "gpushare-kernels-"
#: the component label of the per-user policies (what the controller's informer follows)
POLICY_COMPONENT = "gpushare-kernel-access"
POLICY_SELECTOR = f"{manifests.LABEL_COMPONENT}={POLICY_COMPONENT}"
SELECTOR_KEYS = ("matchLabels", "matchExpressions")
#: what :func:`~jupyter_gpushare.k8s.manifests.owner_label` makes (a pod labelled otherwise, by
#: anyone but the controller, gets no policy: a bad name would fail every pass's create)
OWNER_VALUE = re.compile(r"^[0-9a-f]{20}$")


def policy_name(owner: str) -> str:
    return POLICY_PREFIX + owner


def check_selector(value: Any, name: str) -> dict[str, Any]:
    """A LabelSelector from the admin's config (``matchLabels`` of strings and/or
    ``matchExpressions``), or ValueError naming the setting, the value and what is allowed."""
    allowed = "a label selector: {'matchLabels': {KEY: VALUE}, 'matchExpressions': [...]}"
    if not isinstance(value, Mapping) or not set(value) <= set(SELECTOR_KEYS):
        raise ValueError(f"{name}={value!r} is not allowed: {allowed}")
    labels = value.get("matchLabels", {})
    if not isinstance(labels, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise ValueError(f"{name}.matchLabels={labels!r} is not allowed: KEY: VALUE strings")
    if manifests.LABEL_OWNER in labels:
        raise ValueError(
            f"{name}.matchLabels names {manifests.LABEL_OWNER}: not allowed, the controller "
            "sets it per user"
        )
    expressions = value.get("matchExpressions", [])
    if not isinstance(expressions, list) or not all(
        isinstance(e, Mapping)
        and isinstance(e.get("key"), str)
        and isinstance(e.get("operator"), str)
        for e in expressions
    ):
        raise ValueError(
            f"{name}.matchExpressions={expressions!r} is not allowed: a list of "
            "{'key': ..., 'operator': In|NotIn|Exists|DoesNotExist, 'values': [...]}"
        )
    return {k: value[k] for k in SELECTOR_KEYS if k in value}


@dataclass(frozen=True)
class NetworkSettings:
    """Where users' servers and the controller run (from :class:`~.config.GpushareController`)."""

    server_namespace_selector: Mapping[str, Any] | None  # None: the kernels' own namespace
    server_pod_selector: Mapping[str, Any]
    controller_pod_labels: Mapping[str, str]

    @classmethod
    def from_config(cls, settings: Any) -> NetworkSettings:
        labels = check_selector(
            {"matchLabels": dict(settings.controller_pod_labels)},
            "GpushareController.controller_pod_labels",
        )["matchLabels"]
        namespaces = settings.server_namespace_selector
        return cls(
            None
            if namespaces is None
            else check_selector(namespaces, "GpushareController.server_namespace_selector"),
            check_selector(settings.server_pod_selector, "GpushareController.server_pod_selector"),
            labels,
        )


def user_policy(owner: str, namespace: str, settings: NetworkSettings) -> dict[str, Any]:
    """The NetworkPolicy of the Hub user whose :func:`~.manifests.owner_label` is ``owner``
    (pure): their kernel pods accept connections from their own servers and the controller."""
    server_pods = dict(settings.server_pod_selector)
    server_pods["matchLabels"] = {
        **dict(settings.server_pod_selector.get("matchLabels") or {}),
        manifests.LABEL_OWNER: owner,
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": policy_name(owner),
            "namespace": namespace,
            "labels": {
                manifests.LABEL_COMPONENT: POLICY_COMPONENT,
                manifests.LABEL_OWNER: owner,
            },
        },
        "spec": {
            "podSelector": {
                "matchLabels": {
                    manifests.LABEL_COMPONENT: manifests.KERNEL_COMPONENT,
                    manifests.LABEL_OWNER: owner,
                }
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {
                            **(
                                {}
                                if settings.server_namespace_selector is None
                                else {"namespaceSelector": dict(settings.server_namespace_selector)}
                            ),
                            "podSelector": server_pods,
                        },
                        {"podSelector": {"matchLabels": dict(settings.controller_pod_labels)}},
                    ]
                }
            ],
        },
    }


class KernelNetwork:
    """The per-user NetworkPolicies of one namespace (see the module's docstring).

    ``policies`` is the informer of the namespace's per-user policies: started by the first
    pass (:meth:`run_once`, waiting at most ``sync_timeout`` seconds for its listing), stopped
    by :meth:`stop` (``run_forever`` stops it when it is cancelled: leadership lost)."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        settings: NetworkSettings,
        grace: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        sync_timeout: float = 30.0,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.settings = settings
        self.grace = grace
        self.clock = clock
        self.sync_timeout = sync_timeout
        self.policies = self._informer()
        self._known: set[str] = set()  # owners whose policy exists (created or in the cache)
        self._ensured: dict[str, float] = {}  # owner -> clock() of its last launch's ensure
        self._lock = asyncio.Lock()  # ensure's create vs the pass's delete of one policy
        self._errors: set[str] = set()

    async def ensure(self, owner: str) -> None:
        """Make sure ``owner``'s policy exists before their kernel pod is created (one API call
        the first time per owner and leader; none after)."""
        self._ensured[owner] = self.clock()
        if owner in self._known:
            return
        async with self._lock:
            if owner in self._known:
                return
            try:
                created = await self.kube.create_network_policy(
                    self.namespace, user_policy(owner, self.namespace, self.settings)
                )
                await self.policies.note(created)
            except ApiException as exc:
                if exc.status != 409:  # 409: it is there already
                    raise unavailable(
                        "kernel_network_failed",
                        f"the NetworkPolicy {policy_name(owner)} that lets this user's server "
                        f"reach its kernels could not be created: {exc.reason} (the controller "
                        "needs networkpolicies create/list/watch/delete in its namespace: "
                        "deploy/rbac.yaml)",
                    ) from None
            self._known.add(owner)

    async def start(self, timeout: float | None = None) -> None:
        """Start following the namespace's policies (one LIST, then a watch); returns once the
        listing is in (:class:`~jupyter_gpushare.k8s.watch.ClusterUnavailable` after
        ``timeout`` seconds without one). Returns at once when already following."""
        await self.policies.start(timeout)

    async def stop(self) -> None:
        """Stop following; the next :meth:`start` (a later leadership term) lists afresh."""
        await self.policies.stop()
        self.policies = self._informer()

    def _informer(self) -> Informer:
        return Informer(self.kube, "networkpolicies", self.namespace, POLICY_SELECTOR)

    async def run_once(self, pods: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
        """One pass over the kernel pods the controller's watch holds and the policies its
        informer holds (started here when it is not yet): the owners whose policy was created
        and those whose policy was deleted. Asks the API server only to create or delete."""
        await self.start(self.sync_timeout)
        policies: dict[str, dict[str, Any]] = {}
        for policy in self.policies.values():
            owner = (policy["metadata"].get("labels") or {}).get(manifests.LABEL_OWNER)
            if isinstance(owner, str) and policy["metadata"]["name"].startswith(POLICY_PREFIX):
                policies[owner] = policy
        wanted = _owners(pods)
        self._known = set(policies)  # what is there now (an ensure() since: a 409, no harm)
        created = []
        for owner in sorted(wanted - set(policies)):
            async with self._lock:
                if owner in self._known:
                    continue
                try:
                    made = await self.kube.create_network_policy(
                        self.namespace, user_policy(owner, self.namespace, self.settings)
                    )
                    await self.policies.note(made)
                    created.append(owner)
                except ApiException as exc:
                    if exc.status != 409:  # 409: an ensure() was first
                        raise
                self._known.add(owner)
        deleted = []
        now = self.clock()
        for owner, policy in sorted(policies.items()):
            if owner in wanted or _age(policy) < self.grace:
                continue
            async with self._lock:
                if now - self._ensured.get(owner, -1e18) < self.grace:
                    continue  # a launch of this owner is between its ensure and its pod
                self._known.discard(owner)
                await self.kube.delete_network_policy(self.namespace, policy["metadata"]["name"])
                await self.policies.note_deleted(policy)
                self._ensured.pop(owner, None)
                deleted.append(owner)
        for owner in created:
            log.info("gpushare controller: created NetworkPolicy %s", policy_name(owner))
        for owner in deleted:
            log.info(
                "gpushare controller: deleted NetworkPolicy %s (no kernel pod of its user left)",
                policy_name(owner),
            )
        return created, deleted

    async def run_forever(
        self, interval: float, pods: Callable[[], Iterable[Mapping[str, Any]]]
    ) -> None:
        """A pass every ``interval`` seconds until cancelled; then the informer stops."""
        try:
            while True:
                try:
                    await self.run_once(pods())
                    self._errors.clear()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the API server away, a refusal: the next pass retries
                    if isinstance(exc, ApiException):
                        text = f"{exc.status} {exc.reason}"
                    else:
                        text = str(exc) if isinstance(exc, ClusterError) else repr(exc)
                    if text not in self._errors:  # each distinct error once
                        self._errors.add(text)
                        log.warning("gpushare controller: NetworkPolicy pass failed: %s", text)
                await asyncio.sleep(interval)
        finally:
            await self.stop()


def _owners(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    owners = set()
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        if labels.get(manifests.LABEL_COMPONENT) == manifests.KERNEL_COMPONENT:
            owner = labels.get(manifests.LABEL_OWNER)
            if isinstance(owner, str) and OWNER_VALUE.match(owner):  # only what owner_label makes
                owners.add(owner)
    return owners


def _age(policy: Mapping[str, Any]) -> float:
    created = manifests.parse_time(policy["metadata"].get("creationTimestamp"))
    if created is None:
        return 0.0
    return (datetime.now(timezone.utc) - created).total_seconds()


__all__ = [
    "KernelNetwork",
    "NetworkSettings",
    "check_selector",
    "policy_name",
    "user_policy",
]
