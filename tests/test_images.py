"""The image recipes in deploy/images/ (issue 15), run without docker: each Dockerfile is parsed,
its builder stage's RUN step (build-wheel.sh: the wheel with its C libraries, and the glibc 2.28
check of the interposer) and its final stage's RUN step (the image's install.sh, given the
builder's wheel through the same bind mounts as in the Dockerfile) are run here, the install
into a fresh virtual environment. A broken recipe, a missing file or an interposer that needs a
newer glibc fails here. The structure is checked too: the kernel layer goes on ``ARG BASE`` and
keeps the base image's user; the node image's tag is the chart's image."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "deploy" / "images"
CHART = ROOT / "deploy" / "helm" / "jupyter-gpushare"
sys.path.insert(0, str(IMAGES))

from build_offline import mounts_and_command, parse  # noqa: E402
from check_wheel import check, retag  # noqa: E402


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builder stage's step, run here: its RUN line with /src = this checkout."""
    out = tmp_path_factory.mktemp("wheels")
    builder = parse(IMAGES / "node" / "Dockerfile").stages[0]
    [run] = builder.runs()
    assert run == "deploy/images/build-wheel.sh /src /wheels", run
    if shutil.which("objdump") is None:
        pytest.fail("objdump (binutils) is needed to check the interposer's glibc versions")
    result = subprocess.run(
        ["sh", str(ROOT / "deploy/images/build-wheel.sh"), str(ROOT), str(out)],
        env={**os.environ, "PYTHON": sys.executable, "GPUSHARE_WHEEL_ARGS": "--no-build-isolation"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "interposer needs glibc <= 2.28" in result.stdout
    # one wheel for every Python 3 of the images (Jupyter images ship 3.12, 3.13)
    [wheel] = out.glob("*.whl")
    assert (
        wheel.name
        == f"jupyter_gpushare-{version()}-py3-none-manylinux_2_28_{os.uname().machine}.whl"
    )
    return out


def version() -> str:
    text = (ROOT / "jupyter_gpushare" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)  # type: ignore[union-attr]


def run_install(image: str, wheels: Path, tmp_path: Path) -> tuple[str, Path]:
    """The final stage's RUN step with its bind mounts mapped to local paths, installing into a
    fresh virtual environment (its dependencies come from this interpreter's site-packages, so
    nothing is downloaded). Returns the step's output and the environment."""
    final = parse(IMAGES / image / "Dockerfile").stages[-1]
    [run] = final.runs()
    mounts, command = mounts_and_command(run)
    local = {}
    for mount in mounts:
        assert mount["type"] == "bind", mount
        source = wheels if mount.get("from") == "wheel" else ROOT / mount["source"]
        assert source.exists(), mount
        local[mount["target"]] = str(source)
    for target, path in sorted(local.items(), key=lambda kv: -len(kv[0])):
        command = command.replace(target, path)
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JUPYTER"))}
    env |= {"PYTHON": str(venv / "bin" / "python"), "PIP_NO_INPUT": "1", "HOME": str(tmp_path)}
    # the dependencies are this interpreter's (checked below), and its editable jupyter_gpushare
    # of the same version would make pip skip the wheel
    env["GPUSHARE_PIP_ARGS"] = "--force-reinstall --no-deps"
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    result = subprocess.run(  # not in the checkout: '' on sys.path would find its package
        ["sh", "-c", command], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    unmet = subprocess.run(
        [str(venv / "bin" / "python"), "-c", UNMET_REQUIREMENTS],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert unmet == "", f"the wheel's requirements not met: {unmet}"
    return result.stdout, venv


#: prints the installed jupyter_gpushare's requirements (no extras) that nothing installed meets
UNMET_REQUIREMENTS = """
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement
for text in requires("jupyter_gpushare") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        ok = req.specifier.contains(version(req.name), prereleases=True)
    except PackageNotFoundError:
        ok = False
    if not ok:
        print(text)
"""


def test_node_image_installs_what_the_daemonset_runs(wheel_dir: Path, tmp_path: Path) -> None:
    out, venv = run_install("node", wheel_dir, tmp_path)
    assert "node image: jupyter_gpushare" in out
    # the wheel's package, not this checkout's editable install
    [line] = [ln for ln in out.splitlines() if ln.startswith("node image:")]
    assert str(venv) in line, line
    assert (venv / "bin" / "jupyter-gpushare").exists()


def test_kernel_layer_installs_magics_and_kernelspecs(wheel_dir: Path, tmp_path: Path) -> None:
    out, venv = run_install("kernel", wheel_dir, tmp_path)
    assert "kernelspecs ok" in out
    assert (venv / "share" / "jupyter" / "kernels" / "gpushare-python" / "kernel.json").exists()


def test_hub_image_installs_the_hub_extra(wheel_dir: Path, tmp_path: Path) -> None:
    out, venv = run_install("hub", wheel_dir, tmp_path)
    [line] = [ln for ln in out.splitlines() if ln.startswith("hub image:")]
    assert str(venv) in line, line


def test_hub_image_ends_as_the_hub_user() -> None:
    final = parse(IMAGES / "hub" / "Dockerfile").stages[-1]
    assert final.base == "${BASE}"
    assert [op for op, _ in final.instructions] == ["USER", "RUN", "USER"]
    assert final.instructions[-1] == ("USER", "1000")  # z2jh's hub runs as uid 1000


def test_z2jh_values_name_the_images_the_recipes_build() -> None:
    values = yaml.safe_load((ROOT / "deploy" / "z2jh" / "values.yaml").read_text())
    for image, key in (("hub", "hub"), ("kernel", "singleuser")):
        ref = values[key]["image"]
        comments = parse(IMAGES / image / "Dockerfile").comments
        assert f"-t {ref['name']}:{ref['tag']} ." in comments, (image, ref)


def test_kernel_layer_goes_on_any_jupyter_image_and_keeps_its_user() -> None:
    recipe = parse(IMAGES / "kernel" / "Dockerfile")
    assert recipe.args["BASE"].startswith("quay.io/jupyter/"), recipe.args
    assert not recipe.args["BASE"].endswith(":latest")  # a pinned tag
    final = recipe.stages[-1]
    assert final.base == "${BASE}"
    assert not [op for op, _ in final.instructions if op == "USER"]  # the base image's user
    assert [op for op, _ in final.instructions] == ["RUN"]  # nothing but the install step


def test_images_build_the_wheel_on_the_glibc_baseline() -> None:
    for image in ("node", "kernel", "hub"):
        recipe = parse(IMAGES / image / "Dockerfile")
        builder = recipe.stages[0]
        assert builder.name == "wheel" and builder.base == "${BUILDER}"
        assert recipe.args["BUILDER"] == "quay.io/pypa/manylinux_2_28_x86_64"
        for stage in recipe.stages[1:]:
            for run in stage.runs():
                mounts, _ = mounts_and_command(run)
                assert {m.get("from") for m in mounts} <= {"wheel", None}, mounts


def test_node_image_is_the_charts_image() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    comments = parse(IMAGES / "node" / "Dockerfile").comments
    tag = f"{values['image']['repository']}:{version}"
    assert f"-t {tag} ." in comments, comments
    daemonset = (ROOT / "deploy" / "daemonset.yaml").read_text()
    assert f"image: {tag}" in daemonset


def test_build_context_keeps_what_the_wheel_needs() -> None:
    needed = [
        "pyproject.toml",
        "hatch_build.py",
        "README.md",
        "jupyter_gpushare/__init__.py",
        "jupyter_gpushare/csrc/Makefile",
        "jupyter_gpushare/labextension/package.json",
        "labextension/install.json",
        "kernelspecs/gpushare-python/kernel.json",
        "jupyter-config/jupyter_server_config.d/jupyter_gpushare.json",
        "deploy/images/build-wheel.sh",
        "deploy/images/check_wheel.py",
    ]
    for image in ("node", "kernel", "hub"):
        ignore = IMAGES / image / "Dockerfile.dockerignore"
        patterns = [
            p.strip()
            for p in ignore.read_text().splitlines()
            if p.strip() and not p.startswith("#")
        ]
        for path in needed:
            assert (ROOT / path).exists(), path
            excluded = [
                p
                for p in patterns
                if fnmatch(path, p) or fnmatch(path, p + "/*") or path.startswith(p + "/")
            ]
            assert not excluded, (image, path, excluded)


def test_retag_keeps_the_record_true(wheel_dir: Path, tmp_path: Path) -> None:
    [built] = wheel_dir.glob("*.whl")
    copy = tmp_path / built.name
    shutil.copy(built, copy)
    out = retag(copy, "py3-none-any")
    assert out.name.endswith("-py3-none-any.whl") and not copy.exists()
    with zipfile.ZipFile(out) as archive:
        dist_info = next(n.split("/")[0] for n in archive.namelist() if ".dist-info/" in n)
        tags = [
            ln
            for ln in archive.read(f"{dist_info}/WHEEL").decode().splitlines()
            if ln.startswith("Tag:")
        ]
        assert tags == ["Tag: py3-none-any"]
        for line in archive.read(f"{dist_info}/RECORD").decode().splitlines():
            path, digest, _size = line.rsplit(",", 2)
            if digest:  # every file's recorded hash is its content's
                data = archive.read(path)
                want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                assert digest == f"sha256={want.decode()}", path


def test_check_wheel_refuses_a_newer_glibc_and_missing_libraries(tmp_path: Path) -> None:
    """Not a check that cannot fail: a library asking for GLIBC_2.34 (this machine's
    pthread_create, built without the baseline header) and a wheel without the simulator."""
    if shutil.which("cc") is None or shutil.which("objdump") is None:
        pytest.fail("cc and objdump are needed")
    source = tmp_path / "new.c"
    source.write_text(
        "#include <pthread.h>\n"
        "static void *run(void *a) { return a; }\n"
        "int start(void) { pthread_t t; return pthread_create(&t, 0, run, 0); }\n"
    )
    library = tmp_path / "libgpushare.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-pthread", "-o", str(library), str(source)], check=True
    )
    glibc = tuple(int(x) for x in re.findall(r"\d+", os.confstr("CS_GNU_LIBC_VERSION") or "")[:2])
    wheel = tmp_path / "jupyter_gpushare-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(library, "jupyter_gpushare/_lib/libgpushare.so")
        archive.writestr("jupyter_gpushare/_lib/sim/libcuda.so.1", b"")
        archive.writestr("jupyter_gpushare/_lib/sim/libnvidia-ml.so.1", b"")
    problems = check(wheel)
    if glibc >= (2, 34):
        assert any("newer than glibc 2.28" in p and "pthread_create" in p for p in problems)
    assert any("libdl/libpthread" in p for p in problems), problems
    partial = tmp_path / "partial.whl"
    with zipfile.ZipFile(partial, "w") as archive:
        archive.write(library, "jupyter_gpushare/_lib/libgpushare.so")
    assert check(partial) == [
        "partial.whl: missing jupyter_gpushare/_lib/sim/libcuda.so.1, "
        "jupyter_gpushare/_lib/sim/libnvidia-ml.so.1"
    ]
