"""The chart's optional PodMonitor (``daemon.metrics.podMonitor.enabled``) against the Prometheus
Operator's own PodMonitor CRD (``schemas/monitoring.coreos.com_podmonitors.yaml``, v0.93.0,
unmodified; provenance in ``schemas/README.md``): its ``openAPIV3Schema`` with jsonschema,
unknown fields refused as the API server's strict field validation refuses them, and the real
kube-apiserver with the CRD installed, which validates the object itself (structural schema,
patterns, enums; unknown fields refused with ``fieldValidation=Strict`` where the server has it,
pruned where it has not: then the stored object must equal the rendered one). Each check is
shown to refuse a broken PodMonitor (a misspelt field, an interval Prometheus cannot read)."""

from __future__ import annotations

import copy
import hashlib
import time
from pathlib import Path
from typing import Any

import jsonschema
import requests
import yaml
from cluster import NAMESPACE, ControlPlane
from test_helm import helm as helm
from test_helm import one, render

CRD = Path(__file__).with_name("schemas") / "monitoring.coreos.com_podmonitors.yaml"
CRD_SHA256 = "45a93443daa687d3654f7e9631909ff7edcdf3ec09c5e60251b74aa2722aee5d"
API_VERSIONS = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor"]
VALUES = {
    "daemon": {
        "metrics": {
            "podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}}
        }
    }
}


def crd() -> dict[str, Any]:
    data = CRD.read_bytes()
    assert hashlib.sha256(data).hexdigest() == CRD_SHA256, "schemas/README.md: update the hash"
    return dict(yaml.safe_load(data))


def strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    properties (and does not keep unknown fields): what strict field validation enforces."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def without_empty_defaults(schema: Any) -> Any:
    """``schema`` without its ``default: ""`` entries: the test API server (Kubernetes 1.20)
    reads an empty-string default as null and refuses the CRD (newer servers accept it). A
    default only fills in an absent field; the validation is unchanged."""
    if isinstance(schema, list):
        return [without_empty_defaults(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        k: without_empty_defaults(v) for k, v in schema.items() if not (k == "default" and v == "")
    }


def validator() -> jsonschema.Draft4Validator:
    [version] = [v for v in crd()["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def broken(monitor: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Two PodMonitors the schema must refuse: a misspelt field, an unreadable interval."""
    misspelt = copy.deepcopy(monitor)
    misspelt["spec"]["podMetricsEndpoints"][0]["honourLabels"] = True
    unreadable = copy.deepcopy(monitor)
    unreadable["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    return [("honourLabels", misspelt), ("interval", unreadable)]


def test_rendered_pod_monitor_matches_the_operators_schema(helm: str, tmp_path: Path) -> None:
    check = validator()
    for values in (VALUES, {"daemon": {"metrics": {"podMonitor": {"enabled": True}}}}):
        monitor = one(render(helm, tmp_path, values, extra=API_VERSIONS), "PodMonitor")
        errors = [e.message for e in check.iter_errors(monitor)]
        assert errors == [], errors
    for field, bad in broken(monitor):
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in check.iter_errors(bad)]
        assert errors and field in " ".join(errors), (field, errors)


def test_api_server_with_the_crd_accepts_the_pod_monitor(
    helm: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """Plain HTTP to the API server (the Python client's models would drop the CRD's
    ``default: ""`` values), as admin."""
    import urllib3

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    definition = without_empty_defaults(crd())
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {control_plane.tokens['admin']}"
    session.verify = False  # the test API server's self-signed loopback certificate (cluster.py)
    session.trust_env = False  # (else $REQUESTS_CA_BUNDLE would override verify)
    crds = f"{control_plane.server_url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    monitors = (
        f"{control_plane.server_url}/apis/monitoring.coreos.com/v1/namespaces/{NAMESPACE}"
        "/podmonitors"
    )
    name = definition["metadata"]["name"]
    try:
        session.post(
            f"{control_plane.server_url}/api/v1/namespaces",
            json={"metadata": {"name": NAMESPACE}},
            timeout=30,
        )  # 409 when it is there
        made = session.post(crds, json=definition, timeout=30)
        assert made.status_code in (201, 409), made.text  # 409: a previous run's
        deadline = time.monotonic() + 30
        while True:
            status = session.get(f"{crds}/{name}", timeout=30).json().get("status") or {}
            conditions = status.get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                break
            assert time.monotonic() < deadline, f"the PodMonitor CRD is not Established: {status}"
            time.sleep(0.2)
        monitor = one(render(helm, tmp_path, VALUES, extra=API_VERSIONS), "PodMonitor")

        def create(body: dict[str, Any]) -> requests.Response:
            return session.post(
                monitors, params={"fieldValidation": "Strict"}, json=body, timeout=30
            )

        reply = create(monitor)
        assert reply.status_code == 201, reply.text
        session.delete(f"{monitors}/{monitor['metadata']['name']}", timeout=30)
        assert reply.json()["spec"]["podMetricsEndpoints"] == monitor["spec"]["podMetricsEndpoints"]
        misspelt, unreadable = broken(monitor)
        # an unknown field: refused where the server has strict field validation (1.25+),
        # pruned where it has not (this 1.20): either way the schema does not know it, which
        # is why the equality above shows that every field the chart writes is known
        reply = create(misspelt[1])
        if reply.status_code == 201:
            session.delete(f"{monitors}/{monitor['metadata']['name']}", timeout=30)
            assert misspelt[0] not in reply.json()["spec"]["podMetricsEndpoints"][0], reply.text
        else:
            assert reply.status_code in (400, 422) and misspelt[0] in reply.text, reply.text
        reply = create(unreadable[1])  # the schema's pattern
        assert reply.status_code == 422 and unreadable[0] in reply.text, reply.text
    finally:
        session.delete(f"{crds}/{name}", timeout=30)
        session.close()
