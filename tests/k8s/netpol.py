"""NetworkPolicy ingress, evaluated as the API's semantics define it (no CNI enforces policies
on the test control plane, so the tests ask this instead; it is checked on the Kubernetes
documentation's examples in test_network_policies.py).

The rules implemented (https://kubernetes.io/docs/concepts/services-networking/network-policies/):

- a pod is *isolated for ingress* when some NetworkPolicy in its namespace selects it
  (``spec.podSelector``; ``{}`` selects every pod) and has ``Ingress`` in ``policyTypes`` (when
  ``policyTypes`` is absent: always ``Ingress``, and ``Egress`` only with egress rules);
- a connection into a non-isolated pod is allowed; into an isolated pod it is allowed when any
  selecting policy has an ingress rule that admits it (policies are additive, never subtract);
- a rule admits when its ``ports`` (absent or empty: every port) match and its ``from``
  (absent or empty: every source) has a peer matching the source;
- a peer: ``podSelector`` alone: pods of the *policy's* namespace; ``namespaceSelector`` alone:
  every pod of the selected namespaces; both in one peer: pods selected by the pod selector in
  the selected namespaces (AND; two peers are OR); ``ipBlock``: the source's IP in ``cidr`` and
  in none of ``except``;
- a selector: every ``matchLabels`` pair and every ``matchExpressions`` term (In, NotIn,
  Exists, DoesNotExist) holds; ``{}`` selects everything;
- namespaces are told apart by their labels (``kubernetes.io/metadata.name`` is set on every
  namespace by the API server).

Egress of the source is not evaluated here (z2jh's egress rules are checked on their own).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Pod:
    """A pod as a policy sees it: its namespace (and that namespace's labels), labels, IP."""

    namespace: str
    labels: Mapping[str, str]
    ip: str = ""
    namespace_labels: Mapping[str, str] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}

    @classmethod
    def of(cls, obj: Obj, namespace_labels: Mapping[str, str] | None = None) -> Pod:
        """A Pod object read from the API server."""
        meta = obj["metadata"]
        return cls(
            meta["namespace"],
            dict(meta.get("labels") or {}),
            (obj.get("status") or {}).get("podIP") or "",
            dict(namespace_labels or {}),
        )


def selects(selector: Obj | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False  # a peer without this selector is handled by the caller
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for term in selector.get("matchExpressions") or []:
        key, op, values = term["key"], term["operator"], term.get("values") or []
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise ValueError(f"unknown selector operator {op!r}")
        if not ok:
            return False
    return True


def policy_types(policy: Obj) -> list[str]:
    spec = policy["spec"]
    if spec.get("policyTypes"):
        return list(spec["policyTypes"])
    return ["Ingress", *(["Egress"] if spec.get("egress") else [])]


def peer_matches(peer: Obj, policy_namespace: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        if not source.ip:
            return False
        address = ipaddress.ip_address(source.ip)
        block = peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except") or []
        )
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.ns_labels()):
            return False
    elif source.namespace != policy_namespace:
        return False
    if "podSelector" in peer:
        return selects(peer["podSelector"], source.labels)
    return "namespaceSelector" in peer  # a peer with neither selector is invalid: no match


def port_matches(ports: list[Obj] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for item in ports:
        if item.get("protocol", "TCP") != protocol:
            continue
        wanted = item.get("port")
        if wanted is None:
            return True
        if isinstance(wanted, str):
            raise ValueError(f"named port {wanted!r}: not evaluated here")
        if wanted <= port <= item.get("endPort", wanted):
            return True
    return False


def rule_admits(rule: Obj, policy_namespace: str, source: Pod, port: int, protocol: str) -> bool:
    if not port_matches(rule.get("ports"), port, protocol):
        return False
    peers = rule.get("from")
    return not peers or any(peer_matches(p, policy_namespace, source) for p in peers)


def selecting(policies: Iterable[Obj], target: Pod) -> list[Obj]:
    """The policies that isolate ``target`` for ingress."""
    return [
        p
        for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and "Ingress" in policy_types(p)
        and selects(p["spec"].get("podSelector") or {}, target.labels)
    ]


def allowed(
    policies: Iterable[Obj], source: Pod, target: Pod, port: int, protocol: str = "TCP"
) -> bool:
    """May ``source`` open a connection to ``target``'s ``port``, by ingress policy?"""
    isolating = selecting(list(policies), target)
    if not isolating:
        return True
    return any(
        rule_admits(rule, p["metadata"]["namespace"], source, port, protocol)
        for p in isolating
        for rule in p["spec"].get("ingress") or []
    )
