"""One version source: ``jupyter_gpushare.__version__`` (pyproject reads it through hatch).

Everything else that states the version - the installed metadata, the JupyterLab extension's
package.json (source and the prebuilt copy), the Helm chart's appVersion and the images the
manifests name - must agree with it, so a release bumps one line and this test names the rest.
"""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path

import yaml
from support import REPO

import jupyter_gpushare

VERSION = jupyter_gpushare.__version__


def test_pyproject_takes_the_version_from_the_package() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]$', text, re.M)
    assert not re.search(r"^version = ", text, re.M), "pyproject must not state a version"
    assert version("jupyter_gpushare") == VERSION


def test_the_lab_extension_and_chart_state_the_same_version() -> None:
    for package in (
        REPO / "labextension" / "package.json",
        REPO / "jupyter_gpushare" / "labextension" / "package.json",
    ):
        assert json.loads(package.read_text())["version"] == VERSION, package
    chart = yaml.safe_load((REPO / "deploy/helm/jupyter-gpushare/Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION


def test_manifests_name_images_of_this_version() -> None:
    images = []
    for manifest in Path(REPO / "deploy").rglob("*.yaml"):
        images += re.findall(r"image: ghcr\.io/jupyter-gpushare/[\w-]+:(\S+)", manifest.read_text())
    assert images, "no gpushare image named under deploy/"
    assert set(images) == {VERSION}, images
