"""Helpers for the browser tests: a real JupyterLab (the gpushare server extension on simulated
GPUs, this checkout's prebuilt lab extension) and the Node driver for Debian's headless Chromium.

A module of its own (not conftest.py): several conftest.py files cannot be imported by name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from support import REPO, JupyterServer  # tests/support.py

HERE = Path(__file__).resolve().parent
BUILT = REPO / "jupyter_gpushare" / "labextension"


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def driver_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if chromium_path() is None:
        return "no chromium on PATH (.ci/setup.d/browser.sh installs it)"
    if shutil.which("node") is None:
        return "no node on PATH"
    if not (HERE / "node_modules" / "playwright-core").is_dir():
        return "tests/lab/node_modules/playwright-core missing (run .ci/setup.d/browser.sh)"
    return None


class LabServer(JupyterServer):
    """JupyterServer with JupyterLab enabled and the lab extension linked into the data dir."""

    def __init__(self, env: dict[str, str], simulate: str, *extra: str) -> None:
        super().__init__(
            env,
            simulate,
            "--ServerApp.jpserver_extensions=jupyterlab=True",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            *extra,
        )
        home = Path(env["JUPYTER_DATA_DIR"]).parent
        env["JUPYTERLAB_WORKSPACES_DIR"] = str(home / "lab-workspaces")
        env["JUPYTERLAB_SETTINGS_DIR"] = str(home / "lab-settings")
        news = home / "lab-settings" / "@jupyterlab" / "apputils-extension"
        news.mkdir(parents=True, exist_ok=True)
        (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
        target = Path(env["JUPYTER_DATA_DIR"]) / "labextensions" / "jupyter-gpushare"
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copytree(BUILT, target)
            shutil.copy(REPO / "labextension" / "install.json", target / "install.json")


def run_driver(
    script: str, server: JupyterServer, artifacts: Path, timeout: float = 240, **params: Any
) -> dict[str, Any]:
    """Run a Node driver script in tests/lab; it prints one JSON object as its last line."""
    artifacts.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        LAB_URL=server.url,
        LAB_TOKEN=server.token,
        ARTIFACTS=str(artifacts),
        CHROMIUM=chromium_path() or "",
        PARAMS=json.dumps(params),
    )
    proc = subprocess.run(
        ["node", str(HERE / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE,
    )
    (artifacts / f"{script}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            f"\n--- server log ---\n{server.log()}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])
