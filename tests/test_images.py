"""The image recipes in deploy/images/ (issue 15), run without docker: each Dockerfile is parsed,
its builder stage's RUN step (build-wheel.sh: the wheel with its C libraries, and the glibc 2.28
check of the interposer) and its final stage's RUN step (the image's install.sh, given the
builder's wheel through the same bind mounts as in the Dockerfile) are run here, the install
into a fresh virtual environment. A broken recipe, a missing file or an interposer that needs a
newer glibc fails here. The structure is checked too: the kernel layer goes on ``ARG BASE`` and
keeps the base image's user; the node image's tag is the chart's image.

The images deploy/images/build-offline.sh built (.ci/setup.d/images.sh, into
/var/cache/gpushare-images/out/) are checked too, without a container runtime: each archive's
blobs against their digests, the layers unpacked in order (whiteouts applied; their diff_ids
checked) on tmpfs, and the package's commands run in a chroot as the image's user with its
environment (the kernel image as uid 1000, with the simulator and the interposer). The overlay
whiteouts the builder turns into OCI whiteouts are checked on a real overlay mount."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "deploy" / "images"
CHART = ROOT / "deploy" / "helm" / "jupyter-gpushare"
sys.path.insert(0, str(IMAGES))

from build_offline import (  # noqa: E402
    _check_owned,
    _create,
    dockerignore,
    in_context,
    mounts_and_command,
    parse,
    skip_dev,
    write_layer,
)
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
    left_out = [
        ".git/config",
        "labextension/node_modules/x/package.json",
        "jupyter_gpushare/_lib/libgpushare.so",
        "tests/test_images.py",
        ".mypy_cache/3.11/x.json",
    ]
    for image in ("node", "kernel", "hub"):
        patterns = dockerignore(image)
        for path in needed:
            assert (ROOT / path).exists(), path
            assert in_context(path, patterns), (image, path)
        for path in left_out:
            assert not in_context(path, patterns), (image, path)


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


# -- the images deploy/images/build-offline.sh built (.ci/setup.d/images.sh) ------------------

#: where .ci/setup.d/images.sh writes node.tar and kernel.tar
BUILT = Path(os.environ.get("GPUSHARE_IMAGES_DIR", "/var/cache/gpushare-images/out"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclass
class Built:
    name: str
    annotations: dict[str, str]
    manifest: dict[str, Any]
    config: dict[str, Any]
    root: Path  # the layers applied in order

    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.config["config"].get("Env", []))

    def user(self) -> tuple[int, int]:
        """The config's User as uid, gid (looked up in the image's /etc/passwd)."""
        user = self.config["config"].get("User") or "0"
        for line in (self.root / "etc" / "passwd").read_text().splitlines():
            name, _, uid, gid = line.split(":")[:4]
            if user in (name, uid):
                return int(uid), int(gid)
        raise AssertionError(f"{self.name}: user {user} not in /etc/passwd")

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        """``command`` (sh -c) in the image as a runtime starts it: its user, environment and
        working directory, /proc and /dev mounted (in a mount namespace of its own)."""
        uid, gid = self.user()
        env = " ".join(shlex.quote(f"{k}={v}") for k, v in self.env().items())
        workdir = self.config["config"].get("WorkingDir") or "/"
        script = (
            f"mount -t proc proc {self.root}/proc && mount --bind /dev {self.root}/dev && "
            f"exec chroot --userspec={uid}:{gid} {self.root} /usr/bin/env -i {env} "
            f"sh -c {shlex.quote(f'cd {workdir} && {command}')}"
        )
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _apply_layer(blob: Path, root: Path) -> str:
    """Applies a gzipped layer to ``root`` as containerd does (its whiteouts remove what the
    layers below have); returns the digest of the uncompressed tar (the config's diff_id). One
    pass: the tar goes through here (hashed) to ``tar -xv``, which names what it wrote."""
    gunzip = subprocess.Popen(["gzip", "-dc", str(blob)], stdout=subprocess.PIPE)
    untar = subprocess.Popen(
        ["tar", "-xv", "-C", str(root), "--numeric-owner", "-p"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert gunzip.stdout is not None and untar.stdin is not None and untar.stdout is not None
    names: list[str] = []
    reader = threading.Thread(target=lambda: names.extend(untar.stdout.read().decode().split("\n")))  # type: ignore[union-attr]
    reader.start()
    digest = hashlib.sha256()
    for chunk in iter(lambda: gunzip.stdout.read(1 << 20), b""):  # type: ignore[union-attr]
        digest.update(chunk)
        untar.stdin.write(chunk)
    untar.stdin.close()
    reader.join()
    assert gunzip.wait() == 0 and untar.wait() == 0, blob
    present = {n.rstrip("/") for n in names if n}
    for name in present:
        parent, _, base = name.rpartition("/")
        assert base != ".wh..wh..opq", f"{blob.name}: opaque directory {parent} (not applied here)"
        if base.startswith(".wh."):
            (root / name).unlink()
            hidden = f"{parent}/{base[4:]}".lstrip("/")
            if hidden in present:  # a whiteout hides the layers below only
                continue
            target = root / hidden
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    return "sha256:" + digest.hexdigest()


def _built(name: str) -> Iterator[Built]:
    """An image archive of .ci/setup.d/images.sh, every blob checked against its digest and
    unpacked into a scratch root filesystem."""
    archive = BUILT / f"{name}.tar"
    why = None
    if not archive.exists():
        why = f"{archive} missing: build it with .ci/setup.d/images.sh"
    elif os.geteuid() != 0:
        why = "running an image's commands (mount, chroot) needs root"
    if why:
        if IN_CI:
            pytest.fail(why)
        pytest.skip(why)
    # on tmpfs where there is one: writing ~700 MB of small files to disk costs more
    shm = Path("/dev/shm")
    fast = shm.is_dir() and shutil.disk_usage(shm).free > 4 << 30
    scratch = Path(tempfile.mkdtemp(prefix=f"gpushare-image-{name}-", dir=shm if fast else None))
    try:
        layout = scratch / "layout"
        layout.mkdir()
        subprocess.run(["tar", "-xf", str(archive), "-C", str(layout)], check=True)
        assert json.loads((layout / "oci-layout").read_text())["imageLayoutVersion"] == "1.0.0"
        blobs = layout / "blobs" / "sha256"
        for blob in blobs.iterdir():
            assert _sha256(blob) == f"sha256:{blob.name}", blob
        [entry] = json.loads((layout / "index.json").read_text())["manifests"]
        assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
        manifest = json.loads((blobs / entry["digest"][7:]).read_text())
        config = json.loads((blobs / manifest["config"]["digest"][7:]).read_text())
        root = scratch / "rootfs"
        root.mkdir()
        diff_ids = []
        for layer in manifest["layers"]:
            assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
            diff_ids.append(_apply_layer(blobs / layer["digest"][7:], root))
            (blobs / layer["digest"][7:]).unlink()  # disk: one copy at a time
        assert diff_ids == config["rootfs"]["diff_ids"]
        yield Built(name, entry["annotations"], manifest, config, root)
    finally:
        shutil.rmtree(scratch)


@pytest.fixture(scope="module")
def node_image() -> Iterator[Built]:
    yield from _built("node")


@pytest.fixture(scope="module")
def kernel_image() -> Iterator[Built]:
    yield from _built("kernel")


@pytest.fixture(params=["node", "kernel"])
def built(request: pytest.FixtureRequest) -> Built:
    image: Built = request.getfixturevalue(f"{request.param}_image")
    return image


def test_archive_carries_the_ref_containerd_imports(built: Built) -> None:
    ref = f"localhost/jupyter-gpushare-{built.name}:dev"
    # ctr images import names the image by this annotation (the OCI ref.name is for other
    # tools: ctr drops a full reference there unless --base-name is given)
    assert built.annotations["io.containerd.image.name"] == ref
    assert built.annotations["org.opencontainers.image.ref.name"] == ref
    assert (built.config["architecture"], built.config["os"]) == ("amd64", "linux")
    # the Debian layer, the image's dependencies, the layer with this checkout's wheel
    assert len(built.manifest["layers"]) == 3
    assert built.env()["PATH"].startswith("/opt/venv/bin:")


def test_image_has_this_checkouts_package_and_its_libraries(built: Built) -> None:
    result = built.run(
        "python -c 'import jupyter_gpushare, sys; print(jupyter_gpushare.__version__, "
        "jupyter_gpushare.__file__, sys.version_info[:2])' && jupyter gpushare --help"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"{version()} /opt/venv/lib/python3.11/site-packages/"), first
    assert "usage: jupyter gpushare" in result.stdout
    lib = built.root / "opt/venv/lib/python3.11/site-packages/jupyter_gpushare/_lib"
    for name in ("libgpushare.so", "sim/libcuda.so.1", "sim/libnvidia-ml.so.1"):
        assert (lib / name).is_file(), name


def test_node_image_runs_what_the_chart_runs(node_image: Built) -> None:
    built = node_image
    assert built.user() == (0, 0)  # the daemon: hostPID, the kubelet's plugin directory
    assert built.config["config"]["Cmd"] == ["jupyter", "gpushare", "daemon", "--help"]
    result = built.run(
        "jupyter gpushare daemon --help >/dev/null && jupyter gpushare controller --help "
        ">/dev/null && python -m jupyter_gpushare.k8s.reconcile --help >/dev/null && "
        "python -c 'import grpc, jupyter_gpushare.daemon.install_lib, "
        "jupyter_gpushare.k8s.device_plugin.plugin' && echo ok"
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


KERNEL_CHECK = """
import ctypes, json, os, subprocess, sys
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.paths import lib_dir
from jupyter_gpushare.simulator import simulator_env
import jupyter_gpushare.notebook.magics
os.makedirs("/tmp/sim", mode=0o700, exist_ok=True)
env = {**os.environ, **simulator_env(simulated_gpus("2xA100", node="n"), "/tmp/sim/sim.state")}
env["LD_PRELOAD"] = str(lib_dir() / "libgpushare.so")
probe = (
    "import ctypes, json, pynvml; pynvml.nvmlInit(); n = ctypes.c_int();"
    "cuda = ctypes.CDLL('libcuda.so.1'); assert cuda.cuInit(0) == 0;"
    "assert cuda.cuDeviceGetCount(ctypes.byref(n)) == 0;"
    "maps = open('/proc/self/maps').read();"
    "print(json.dumps({'nvml': pynvml.nvmlDeviceGetCount(), 'cuda': n.value,"
    " 'name': pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)),"
    " 'interposer': 'libgpushare.so' in maps, 'simulator': '/sim/libcuda.so.1' in maps}))"
)
out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
assert out.returncode == 0 and not out.stderr, out.stderr
print(json.dumps({
    "uid": os.getuid(), "home": os.environ["HOME"], "cwd": os.getcwd(),
    "probe": json.loads(out.stdout),
    "specs": sorted(KernelSpecManager().find_kernel_specs()),
}))
"""


def test_kernel_image_runs_kernels_as_uid_1000_with_the_simulator(kernel_image: Built) -> None:
    """As the image's user (jovyan, uid 1000): the simulated driver and NVML load with the
    interposer preloaded (what a kernel pod's environment sets up), the gpushare kernelspecs
    are found, the single-user server is there (the image is z2jh's singleuser.image too)."""
    built = kernel_image
    assert built.config["config"]["User"] == "1000"
    assert built.user() == (1000, 100)
    home = built.root / "home" / "jovyan"
    assert (home.stat().st_uid, (built.root / "opt/venv").stat().st_uid) == (1000, 1000)
    result = built.run(
        f"python -c {shlex.quote(KERNEL_CHECK)} && jupyterhub-singleuser --version && "
        "python -m ipykernel_launcher --help >/dev/null && echo ok"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    report = json.loads(lines[0])
    assert report["uid"] == 1000 and report["home"] == report["cwd"] == "/home/jovyan"
    assert report["probe"] == {
        "nvml": 2,
        "cuda": 2,
        "name": "NVIDIA A100-SXM4-80GB",
        "interposer": True,
        "simulator": True,
    }
    assert {"gpushare-python", "gpushare-python-half", "python3"} <= set(report["specs"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", lines[1]), lines[1]  # jupyterhub's version
    assert lines[-1] == "ok"


def test_overlay_whiteouts_become_oci_whiteouts(tmp_path: Path) -> None:
    """The builder's layers come from overlay upper directories, where a deleted file is a 0/0
    character device and a replaced directory is marked opaque: the layer must say both the OCI
    way (.wh.<name>, .wh..wh..opq), or an image would bring back what a step removed."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("overlay mounts need root")
        pytest.skip("overlay mounts need root")
    lower = tmp_path / "lower"
    (lower / "d").mkdir(parents=True)
    (lower / "gone").write_text("x")
    (lower / "d" / "old").write_text("x")
    (lower / "kept").write_text("x")
    upper = tmp_path / "upper"
    in_chroot_free = (
        "set -e; mount -t overlay overlay -o lowerdir={l},upperdir={u},workdir={w},"
        "redirect_dir=off,index=off,metacopy=off {m}; rm {m}/gone; rm -r {m}/d; mkdir {m}/d; "
        "echo y > {m}/d/new; echo z > {m}/added"
    )
    for d in ("upper", "work", "merged"):
        (tmp_path / d).mkdir()
    script = in_chroot_free.format(l=lower, u=upper, w=tmp_path / "work", m=tmp_path / "merged")
    subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script], check=True
    )
    info = write_layer(upper, tmp_path / "layer.tar.gz", upper=True, skip=skip_dev)
    with tarfile.open(tmp_path / "layer.tar.gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {".wh.gone", "d", "d/.wh..wh..opq", "d/new", "added"}, members
    assert not any(m.ischr() for m in members.values())
    assert info["digest"] == _sha256(tmp_path / "layer.tar.gz")


def test_outputs_replace_a_planted_link_and_the_cache_must_be_private(tmp_path: Path) -> None:
    """The build runs as root into a directory the caller names: a link planted at the name of
    a file it writes is replaced, not followed (the link's target is left as it was), and a
    cache directory others may write to is refused."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = tmp_path / "node.tar.partial"
    planted.symlink_to(victim)
    with _create(planted) as f:
        f.write(b"archive")
    assert victim.read_text() == "keep"
    assert not planted.is_symlink() and planted.read_bytes() == b"archive"
    shared = tmp_path / "cache"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(SystemExit, match="writable by nobody else"):
        _check_owned(shared)
    shared.chmod(0o755)
    _check_owned(shared)
