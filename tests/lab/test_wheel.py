"""The wheel ships the prebuilt JupyterLab extension and installs without Node.

From a fresh copy of the committed tree, with no `node` on the PATH: build the wheel, install it
into a fresh virtual environment, and `jupyter labextension list` there shows the extension
enabled and OK (JupyterLab's own compatibility check of its shared packages).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support import REPO

import jupyter_gpushare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NODE_TOOLS = {"node", "nodejs", "npm", "npx", "corepack", "yarn", "jlpm"}


def path_without_node(tmp_path: Path) -> str:
    """A PATH with the system tools (make, cc, ...) and Python, but no Node."""
    tools = tmp_path / "bin-without-node"
    tools.mkdir()
    for entry in Path("/usr/bin").iterdir():
        if entry.name not in NODE_TOOLS:
            (tools / entry.name).symlink_to(entry)
    path = os.pathsep.join([str(Path(sys.executable).parent), str(tools)])
    assert shutil.which("node", path=path) is None
    return path


def fresh_checkout(dest: Path) -> Path:
    """The committed files of this repository (what `git clone` gives)."""
    files = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def test_wheel_installs_labextension_without_node(tmp_path: Path) -> None:
    path = path_without_node(tmp_path)
    env = {**os.environ, "PATH": path}
    checkout = fresh_checkout(tmp_path / "checkout")
    assert (checkout / "jupyter_gpushare" / "labextension" / "package.json").is_file()
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(checkout),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            "-q",
        ],
        env=env,
        check=True,
        timeout=500,
    )
    (wheel,) = wheels.glob("jupyter_gpushare-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = (
        f"jupyter_gpushare-{jupyter_gpushare.__version__}.data/data/share/jupyter/"
        "labextensions/jupyter-gpushare/"
    )
    assert shipped + "package.json" in names and shipped + "install.json" in names
    assert any(n.startswith(shipped + "static/remoteEntry.") for n in names)

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, env=env
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--force-reinstall",
            "-q",
            str(wheel),
        ],
        check=True,
        env=env,
    )
    home = tmp_path / "home"
    listing = subprocess.run(
        # `jupyter labextension list`, run by the venv's Python (not a `jupyter-labextension`
        # script found elsewhere on the PATH)
        [str(python), "-m", "jupyterlab.labextensions", "list"],
        env={
            **env,
            "PATH": f"{venv / 'bin'}{os.pathsep}{path}",
            "JUPYTER_DATA_DIR": str(home / "data"),
            "JUPYTER_CONFIG_DIR": str(home / "config"),
            "JUPYTER_PATH": "",
            "JUPYTER_CONFIG_PATH": "",
        },
        capture_output=True,
        text=True,
        check=True,
    )
    text = re.sub(r"\x1b\[[0-9;]*m", "", listing.stdout + listing.stderr)
    assert f"{venv}/share/jupyter/labextensions" in text, text
    enabled = r"jupyter-gpushare v0\.1\.0 enabled\s+OK \(python, jupyter_gpushare\)"
    assert re.search(enabled, text), text
