"""deploy/: the manifests the tests apply, and the Helm chart that ships the same rules.

Where it runs: no cluster: the manifests as files.
"""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CHART = DEPLOY / "helm" / "jupyter-gpushare"


def test_chart_ships_the_tested_crd() -> None:
    assert (CHART / "crds" / "gpuledgers.yaml").read_text() == (
        DEPLOY / "crds" / "gpuledgers.yaml"
    ).read_text()


def test_rbac_is_least_privilege() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()) if d]
    for doc in docs:
        for rule in doc.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert "escalate" not in rule["verbs"] and "bind" not in rule["verbs"]
        ref = doc.get("roleRef", {})
        assert ref.get("name") not in ("cluster-admin", "admin", "edit")
    server_rules = next(
        d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "jupyter-gpushare"
    )["rules"]
    secrets = next(r for r in server_rules if r["resources"] == ["secrets"])
    # The server writes connection Secrets but can never read any Secret back.
    assert not {"get", "list", "watch"} & set(secrets["verbs"])
    chart_rbac = (CHART / "templates" / "rbac.yaml").read_text()
    assert "name: cluster-admin" not in chart_rbac and '"*"' not in chart_rbac
