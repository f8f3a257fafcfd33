"""The chart's optional PodMonitor (``daemon.metrics.podMonitor.enabled``) against the npm package
``@kubernetes-models/prometheus-operator`` (pinned in ``tests/lab/package.json``, installed by
``.ci/setup.d/browser.sh``): its validators, generated from the Prometheus Operator's Go API
types, check types, required fields, patterns (the durations) and enums; they accept unknown
fields, so ``podmonitor_validate.mjs`` also walks the object against the package's TypeScript
declarations and refuses a field no declaration lists. Not checked: keys inside maps (labels,
params) and anything only the operator's CRD or the API server adds (CEL rules, defaults); no
CRD manifest ships in the package, so no API server takes part. Each check is shown to refuse a
broken PodMonitor (a misspelt field, an interval Prometheus cannot read).

Where it runs: no cluster: the Prometheus Operator's validators.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_helm import IN_CI, one, render
from test_helm import helm as helm

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "podmonitor_validate.mjs"
MODULES = HERE.parent / "lab" / "node_modules"
PACKAGE = MODULES / "@kubernetes-models" / "prometheus-operator"
API_VERSIONS = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor"]
VALUES = {
    "daemon": {
        "metrics": {
            "podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}}
        }
    }
}


@pytest.fixture(scope="module")
def node() -> str:
    binary = shutil.which("node")
    reason = None
    if binary is None:
        reason = "no node on PATH (.ci/setup.d/browser.sh installs it)"
    elif not (PACKAGE / "package.json").is_file():
        reason = f"{PACKAGE} missing (run .ci/setup.d/browser.sh, or npm ci in tests/lab)"
    if reason is not None:
        if IN_CI:
            pytest.fail(f"{reason} (CI)")
        pytest.skip(reason)
    assert binary is not None
    return binary


def validate(node: str, monitor: dict[str, Any]) -> tuple[int, list[str]]:
    """The script's exit status (0 accepted, 1 refused) and its error lines."""
    done = subprocess.run(
        [node, str(SCRIPT), str(MODULES)],
        input=json.dumps(monitor),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, done.stdout.splitlines()


def broken(monitor: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """PodMonitors the package must refuse: a misspelt field (in an endpoint, and at the top of
    the spec) and an interval Prometheus cannot read."""
    misspelt = copy.deepcopy(monitor)
    misspelt["spec"]["podMetricsEndpoints"][0]["honourLabels"] = True
    misspelt_spec = copy.deepcopy(monitor)
    misspelt_spec["spec"]["namespaceSelectors"] = {"any": True}
    unreadable = copy.deepcopy(monitor)
    unreadable["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    return [
        ("/spec/podMetricsEndpoints/0/honourLabels", misspelt),
        ("/spec/namespaceSelectors", misspelt_spec),
        ("/spec/podMetricsEndpoints/0/interval", unreadable),
    ]


def test_rendered_pod_monitor_matches_the_operators_types(
    helm: str, node: str, tmp_path: Path
) -> None:
    for values in (VALUES, {"daemon": {"metrics": {"podMonitor": {"enabled": True}}}}):
        monitor = one(render(helm, tmp_path, values, extra=API_VERSIONS), "PodMonitor")
        assert validate(node, monitor) == (0, [])
    for field, bad in broken(monitor):
        status, errors = validate(node, bad)
        assert status == 1 and any(e.startswith(f"{field}:") for e in errors), (field, errors)
