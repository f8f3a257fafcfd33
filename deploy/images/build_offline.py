"""Builds the node and kernel images from deploy/images/ without a container engine or an image
registry: a Debian root filesystem (mmdebstrap, from Debian's archive), the dependencies as
wheels from PyPI, and the Dockerfile's own steps, written as OCI image archives that
``ctr images import`` (containerd), ``podman load`` or ``skopeo`` take.

One recipe: the Dockerfile's builder stage (its RUN: build-wheel.sh) runs here on this machine
(Debian 12 in CI, not manylinux_2_28: check_wheel.py still refuses an interposer asking for a
glibc symbol newer than 2.28) with the build context the Dockerfile's .dockerignore leaves, and
its final stage's instructions (RUN with its bind mounts, LABEL, ENV, USER, WORKDIR, CMD) run on
the base below, in a chroot.
Only the base differs from a Docker build's ``BASE`` (python:3.11-slim-bookworm, a docker-stacks
image): Debian 12 with its Python 3.11 in a virtual environment on ``PATH`` (/opt/venv), and for
the kernel image the user jovyan (uid 1000, gid 100, home /home/jovyan, owning /opt/venv) and
JupyterHub (``jupyterhub-singleuser``), as docker-stacks images have them.

Layers (gzip), each cached under the cache directory by what goes into it:

1. debian: ``mmdebstrap --variant=minbase`` with python3, python3-venv, ca-certificates
   (shared by both images);
2. env: the image's base step (the virtual environment, the user) and the wheel's requirements
   installed from wheels downloaded here for the image's Python (``pip download``; the chroot
   has no network);
3. the Dockerfile's final stage with this checkout's wheel: rebuilt every time.

The chroot steps run in an overlay (lower: the cached layers, upper: the new layer) inside a
mount namespace of their own, so no mount outlives them.

    build_offline.py [--cache DIR] [--image node|kernel ...] OUTDIR

writes OUTDIR/node.tar and OUTDIR/kernel.tar (refs localhost/jupyter-gpushare-node:dev and
localhost/jupyter-gpushare-kernel:dev). Needs root (mounts, chroot), mmdebstrap, gzip and a
C compiler (the wheel's libraries). Standard library only: it runs before the package is
installed.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import IO, Any

IMAGES = Path(__file__).resolve().parent
ROOT = IMAGES.parents[1]
DEFAULT_CACHE = Path(os.environ.get("GPUSHARE_IMAGES_CACHE", "/var/cache/gpushare-images"))

#: bump to rebuild every cached layer (a change of how layers are made)
RECIPE_VERSION = "1"
SUITE = "bookworm"
PACKAGES = ["python3", "python3-venv", "ca-certificates"]
#: documentation and translations stay out of the image (copyright files stay)
DPKG_OPTIONS = [
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/info/*",
]
VENV = "/opt/venv"
PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REF = "localhost/jupyter-gpushare-{image}:dev"


@dataclass
class Base:
    """What stands in for the Dockerfile's ``BASE``: a step run as root in the chroot over the
    Debian layer, the image config it leaves, and requirements installed beside the wheel's."""

    setup: str
    config: dict[str, Any]
    owner: str  # who installs the Python packages (the image's user)
    extra_requirements: list[str] = field(default_factory=list)


BASES = {
    # python:3.11-slim-bookworm: Python on PATH as `python`, root
    "node": Base(
        setup=f"python3 -m venv {VENV}\n",
        config={"Env": [f"PATH={PATH}", "LANG=C.UTF-8"], "WorkingDir": "/"},
        owner="0:0",
    ),
    # a docker-stacks image: jovyan (uid 1000, group users) owns the Python environment and
    # runs everything; JupyterHub for the single-user server; jupyterlab is the wheel's own
    # requirement
    "kernel": Base(
        setup=(
            "useradd --uid 1000 --gid 100 --create-home --home-dir /home/jovyan"
            " --shell /bin/bash jovyan\n"
            f"mkdir -p {VENV} && chown 1000:100 {VENV}\n"
            f"setpriv --reuid 1000 --regid 100 --init-groups python3 -m venv {VENV}\n"
        ),
        config={
            "User": "1000",
            "Env": [f"PATH={PATH}", "LANG=C.UTF-8", "HOME=/home/jovyan", "SHELL=/bin/bash"],
            "WorkingDir": "/home/jovyan",
            "Cmd": ["jupyter", "lab", "--ip=0.0.0.0", "--no-browser"],
        },
        owner="1000:100",
        extra_requirements=["jupyterhub>=4"],
    ),
}


def log(message: str) -> None:
    print(f"build-offline: {message}", file=sys.stderr, flush=True)


# -- the Dockerfile --------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str = ""
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def runs(self) -> list[str]:
        return [args for op, args in self.instructions if op == "RUN"]


@dataclass
class Dockerfile:
    args: dict[str, str]  # ARGs before the first FROM, with their defaults
    stages: list[Stage]
    comments: str


def parse(path: Path) -> Dockerfile:
    """Instructions with ``\\`` continuations joined and comments dropped."""
    lines: list[str] = []
    comments = []
    pending = ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#"):
            comments.append(raw.lstrip()[1:].strip())
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line:
            lines.append(line)
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(base=words[0], name=name))
        elif not stages and op == "ARG":
            key, _, default = rest.partition("=")
            args[key] = default
        else:
            if not stages:
                raise ValueError(f"{path}: {op} before FROM")
            stages[-1].instructions.append((op, rest))
    return Dockerfile(args, stages, "\n".join(comments))


def mounts_and_command(run: str) -> tuple[list[dict[str, str]], str]:
    """A RUN's ``--mount=`` options and its shell command."""
    mounts = []
    words = shlex.split(run)
    while words and words[0].startswith("--mount="):
        mounts.append(dict(kv.split("=", 1) for kv in words.pop(0)[8:].split(",")))
    return mounts, " ".join(shlex.quote(w) for w in words)


def dockerignore(image: str) -> list[str]:
    text = (IMAGES / image / "Dockerfile.dockerignore").read_text()
    return [p.strip() for p in text.splitlines() if p.strip() and not p.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """``path`` (relative, /-separated) matches a .dockerignore pattern (the subset used here:
    names, paths and a leading ``**/``)."""
    for pattern in patterns:
        if pattern.startswith("**/"):
            if fnmatch(path, pattern[3:]) or fnmatch(path, pattern):
                return True
        elif fnmatch(path, pattern):
            return True
    return False


def in_context(path: str, patterns: list[str]) -> bool:
    """``path`` is in the build context: neither it nor a directory above it is ignored."""
    parts = path.split("/")
    return not any(ignored("/".join(parts[: i + 1]), patterns) for i in range(len(parts)))


def copy_context(image: str, dest: Path) -> None:
    """The Docker build context of ``image``: the repository root less its .dockerignore."""
    patterns = dockerignore(image)
    for top, dirs, files in os.walk(ROOT):
        rel_top = os.path.relpath(top, ROOT)
        rel = "" if rel_top == "." else rel_top + "/"
        dirs[:] = [d for d in dirs if not ignored(rel + d, patterns)]
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            if not ignored(rel + name, patterns):
                shutil.copy2(os.path.join(top, name), dest / rel / name, follow_symlinks=False)
        for name in dirs:
            if os.path.islink(os.path.join(top, name)):
                shutil.copy2(os.path.join(top, name), dest / rel / name, follow_symlinks=False)


# -- layers ----------------------------------------------------------------------------------


class _Hashing:
    """A write-only file object: hashes and counts what goes through to ``out``."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        self.out.write(data)
        return len(data)

    def flush(self) -> None:
        self.out.flush()


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def write_layer(
    tree: Path, out: Path, *, upper: bool, skip: Callable[[str], bool]
) -> dict[str, Any]:
    """``tree`` as a gzipped layer tar at ``out``. ``upper``: an overlay upper directory, its
    whiteouts (0/0 character devices) and opaque directories written as OCI whiteouts.
    Returns the layer's digest, diff_id and sizes."""
    with open(out, "wb") as sink:
        gz = subprocess.Popen(["gzip", "-n", "-6"], stdin=subprocess.PIPE, stdout=sink)
        assert gz.stdin is not None
        hashing = _Hashing(gz.stdin)
        with tarfile.open(fileobj=hashing, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            for top, dirs, files in os.walk(tree):
                dirs.sort()
                rel_top = os.path.relpath(top, tree)
                rel = "" if rel_top == "." else rel_top + "/"
                if rel and upper and _opaque(top):
                    info = tarfile.TarInfo(rel + ".wh..wh..opq")
                    tar.addfile(info)
                keep_dirs = []
                for name in sorted(files) + dirs:
                    path = os.path.join(top, name)
                    arcname = rel + name
                    if skip(arcname):
                        continue
                    st = os.lstat(path)
                    if stat.S_ISDIR(st.st_mode) and name in dirs:
                        keep_dirs.append(name)
                    if upper and _is_whiteout(st):
                        parent, _, base = arcname.rpartition("/")
                        tar.addfile(
                            tarfile.TarInfo((parent + "/" if parent else "") + ".wh." + base)
                        )
                        continue
                    info = tar.gettarinfo(path, arcname)
                    info.mtime = int(st.st_mtime)
                    info.uname = info.gname = ""
                    if info.isreg():
                        with open(path, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
                dirs[:] = [d for d in dirs if d in keep_dirs]
        gz.stdin.close()
        if gz.wait() != 0:
            raise RuntimeError(f"gzip failed for {out}")
    digest = hashlib.sha256()
    with open(out, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {
        "digest": "sha256:" + digest.hexdigest(),
        "diff_id": "sha256:" + hashing.sha.hexdigest(),
        "size": out.stat().st_size,
        "unpacked": hashing.size,
    }


def skip_dev(arcname: str) -> bool:
    """The runtime mounts /dev; device nodes and bind targets stay out of the layers."""
    return arcname.startswith("dev/")


def in_chroot(
    lowers: list[Path],
    upper: Path,
    command: str,
    *,
    user: str = "0:0",
    env: dict[str, str],
    binds: dict[str, Path] | None = None,
) -> None:
    """Runs ``command`` (sh -c) as ``user`` (uid:gid) in the overlay of ``lowers`` (top first)
    with ``upper`` taking the changes. /tmp is a tmpfs (nothing written there stays), ``binds``
    (target in the chroot -> host path) are mounted read-only under it, /proc and /dev come from
    the host. Everything is mounted in a new mount namespace, gone when the command ends."""
    upper.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=upper.parent, prefix=".work-") as scratch:
        work = Path(scratch) / "work"
        merged = Path(scratch) / "merged"
        work.mkdir()
        merged.mkdir()
        lowerdir = ":".join(str(p) for p in lowers)
        script = [
            "set -e",
            f"mount -t overlay overlay -o lowerdir={lowerdir},upperdir={upper},workdir={work},"
            f"redirect_dir=off,index=off,metacopy=off {merged}",
            f"mount -t proc proc {merged}/proc",
            f"mount --bind /dev {merged}/dev",
            f"mount -t tmpfs -o mode=1777 tmpfs {merged}/tmp",
        ]
        for target, source in (binds or {}).items():
            if not target.startswith("/tmp/"):
                raise ValueError(f"bind target {target}: only under /tmp (not kept in the layer)")
            inside = shlex.quote(f"{merged}{target}")
            if source.is_dir():
                script.append(f"mkdir -p {inside}")
            else:
                script.append(f'mkdir -p "$(dirname {inside})" && touch {inside}')
            script.append(f"mount --bind {shlex.quote(str(source))} {inside}")
            script.append(f"mount -o remount,bind,ro {inside}")
        uid, gid = user.split(":")
        env_words = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        script.append(
            f"exec chroot --userspec={uid}:{gid} {merged} /usr/bin/env -i {env_words}"
            f" /bin/sh -c {shlex.quote(command)}"
        )
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script)]
        )
        if result.returncode != 0:
            raise RuntimeError(f"step failed ({result.returncode}): {command}")
        # the overlay's work directory, left root-only by the kernel
        shutil.rmtree(work, ignore_errors=True)


# -- cache -----------------------------------------------------------------------------------


def key_of(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cached(
    cache: Path, kind: str, key: str, build: Callable[[Path], dict[str, Any]]
) -> tuple[Path, dict[str, Any]]:
    """The directory ``cache/kind-key`` with its ``layer.json``, built by ``build(dir)`` unless
    it is there; other ``kind-*`` entries are removed (an older recipe's)."""
    where = cache / f"{kind}-{key}"
    meta = where / "layer.json"
    if meta.exists():
        log(f"{kind}: cached ({where})")
        return where, json.loads(meta.read_text())
    for old in cache.glob(f"{kind}-*"):
        log(f"{kind}: removing {old}")
        shutil.rmtree(old)
    partial = cache / f".{kind}-{key}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    started = time.monotonic()
    info = build(partial)
    info["seconds"] = round(time.monotonic() - started, 1)
    (partial / "layer.json").write_text(json.dumps(info, indent=1))
    partial.rename(where)
    log(f"{kind}: built in {info['seconds']} s ({info['size']} bytes gzipped)")
    return where, info


def debian_layer(cache: Path) -> tuple[Path, dict[str, Any]]:
    def build(where: Path) -> dict[str, Any]:
        rootfs = where / "rootfs"
        command = [
            "mmdebstrap",
            "--variant=minbase",
            "--include=" + ",".join(PACKAGES),
            *[f"--dpkgopt={opt}" for opt in DPKG_OPTIONS],
            # the runtime mounts its own; an empty file to mount over
            '--customize-hook=rm -f "$1/etc/resolv.conf" && touch "$1/etc/resolv.conf"',
            SUITE,
            str(rootfs),
        ]
        log("debian: " + " ".join(shlex.quote(c) for c in command))
        subprocess.run(["nice", "-n", "10", *command], check=True)
        info = write_layer(rootfs, where / "layer.tar.gz", upper=False, skip=skip_dev)
        info["created_by"] = f"mmdebstrap --variant=minbase --include={','.join(PACKAGES)} {SUITE}"
        return info

    return cached(cache, "debian", key_of(RECIPE_VERSION, SUITE, PACKAGES, DPKG_OPTIONS), build)


def requirements_of(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist without the extras' ones."""
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            requirement = line.split(":", 1)[1].strip()
            if "extra ==" not in requirement:
                out.append(requirement)
    return out


#: the env layer's install, in the chroot as the image's user: the requirements' wheels only
ENV_INSTALL = (
    f"{VENV}/bin/python -m pip install --no-cache-dir --disable-pip-version-check"
    " --no-index --find-links /tmp/wheels -r /tmp/requirements.txt"
)


def env_layer(
    cache: Path, image: str, debian: tuple[Path, dict[str, Any]], requirements: list[str]
) -> tuple[Path, dict[str, Any]]:
    base = BASES[image]
    wanted = sorted(requirements + base.extra_requirements)

    def build(where: Path) -> dict[str, Any]:
        upper = where / "upper"
        with tempfile.TemporaryDirectory(prefix="gpushare-wheelhouse-") as tmp:
            house = Path(tmp) / "wheels"
            reqs = Path(tmp) / "requirements.txt"
            reqs.write_text("\n".join(wanted) + "\n")
            # resolved here for the image's Python (Debian's 3.11.2, not this interpreter)
            version = subprocess.run(
                [
                    "chroot",
                    str(debian[0] / "rootfs"),
                    "/usr/bin/python3",
                    "-c",
                    "import platform; print(platform.python_version())",
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            log(f"{image} env: downloading {len(wanted)} requirements' wheels for Python {version}")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--disable-pip-version-check",
                    "-q",
                    "--only-binary=:all:",
                    f"--python-version={version}",
                    "--dest",
                    str(house),
                    "-r",
                    str(reqs),
                ],
                check=True,
            )
            env = {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8"}
            in_chroot([debian[0] / "rootfs"], upper, base.setup, env=env)
            home = "/home/jovyan" if base.owner.startswith("1000") else "/root"
            in_chroot(
                [debian[0] / "rootfs"],
                upper,
                ENV_INSTALL,
                user=base.owner,
                env={**env, "HOME": home},
                binds={"/tmp/wheels": house, "/tmp/requirements.txt": reqs},
            )
        info = write_layer(upper, where / "layer.tar.gz", upper=True, skip=skip_dev)
        info["created_by"] = f"{image} base: venv {VENV}, " + " ".join(wanted)
        return info

    key = key_of(RECIPE_VERSION, debian[1]["diff_id"], base.setup, base.owner, ENV_INSTALL, wanted)
    return cached(cache, f"{image}-env", key, build)


def build_wheel(image: str, out: Path) -> Path:
    """The Dockerfile's builder stage on this machine: its RUN with /src the build context
    (this checkout less .dockerignore) and /wheels ``out``."""
    recipe = parse(IMAGES / image / "Dockerfile")
    builder = recipe.stages[0]
    [run] = builder.runs()
    with tempfile.TemporaryDirectory(prefix="gpushare-context-") as tmp:
        src = Path(tmp) / "src"
        copy_context(image, src)
        command = run.replace("/src", str(src)).replace("/wheels", str(out))
        env = {**os.environ, "PYTHON": sys.executable}
        log(f"wheel: {command} (builder: this machine, {os_release()})")
        subprocess.run(
            ["sh", "-c", f"cd {shlex.quote(str(src))} && nice -n 10 {command}"], env=env, check=True
        )
    [wheel] = out.glob("jupyter_gpushare-*.whl")
    return wheel


def os_release() -> str:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return "unknown OS"
    found = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', text, re.M)
    return found.group(1) if found else "unknown OS"


def final_stage(
    image: str,
    lowers: list[Path],
    upper: Path,
    wheels: Path,
    config: dict[str, Any],
) -> tuple[dict[str, Any], list[str]]:
    """The Dockerfile's final stage on the base: its instructions applied to ``config`` and
    its RUN steps run in the chroot. Returns the config and the history's lines."""
    recipe = parse(IMAGES / image / "Dockerfile")
    final = recipe.stages[-1]
    config = json.loads(json.dumps(config))
    history = []
    passwd: dict[str, list[str]] = {}
    for path in lowers:
        if (path / "etc" / "passwd").exists():
            for line in (path / "etc" / "passwd").read_text().splitlines():
                entry = line.split(":")
                passwd.setdefault(entry[0], entry)
                passwd.setdefault(entry[2], entry)
    for op, args in final.instructions:
        history.append(f"{op} {args}")
        if op == "RUN":
            mounts, command = mounts_and_command(args)
            binds = {}
            for mount in mounts:
                if mount.get("type") != "bind":
                    raise ValueError(f"{image}: mount {mount}: only bind mounts are built here")
                source = wheels if mount.get("from") == "wheel" else ROOT / mount["source"]
                binds[mount["target"]] = source
            user = config.get("User") or "0"
            fields = passwd.get(user.split(":")[0])
            uid = fields[2] if fields else user
            gid = fields[3] if fields else "0"
            env = dict(e.split("=", 1) for e in config.get("Env", []))
            env.setdefault("HOME", fields[5] if fields else "/")
            # offline: every requirement is in the base already
            env["PIP_NO_INDEX"] = "1"
            env["GPUSHARE_PIP_ARGS"] = "--quiet"
            # the layer gets the package's bytecode (pip compiles it), not that of pip itself
            env["PYTHONDONTWRITEBYTECODE"] = "1"
            log(f"{image}: RUN {command} (as {uid}:{gid})")
            in_chroot(lowers, upper, command, user=f"{uid}:{gid}", env=env, binds=binds)
        elif op == "USER":
            config["User"] = args
        elif op == "WORKDIR":
            config["WorkingDir"] = args
        elif op in ("CMD", "ENTRYPOINT"):
            key = "Cmd" if op == "CMD" else "Entrypoint"
            config[key] = json.loads(args) if args.startswith("[") else ["/bin/sh", "-c", args]
            if op == "ENTRYPOINT":
                config.pop("Cmd", None)
        elif op == "LABEL":
            words = shlex.split(args)
            config.setdefault("Labels", {}).update(dict(w.split("=", 1) for w in words))
        elif op == "ENV":
            words = shlex.split(args)
            env = dict(e.split("=", 1) for e in config.get("Env", []))
            env.update(dict(w.split("=", 1) for w in words))
            config["Env"] = [f"{k}={v}" for k, v in env.items()]
        else:
            raise ValueError(f"{image}: {op} in the final stage is not built offline")
    return config, history


# -- the OCI archive -------------------------------------------------------------------------


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _create(path: Path) -> IO[bytes]:
    """``path`` opened for writing as a new file: a stale one is removed first, and a link
    someone put there is replaced, never followed (the output directory is the caller's)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "wb")


def _check_owned(directory: Path) -> None:
    """The cache is run as root from: it must be root's and writable by nobody else."""
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SystemExit(
            f"build-offline: {directory} must be a directory owned by uid {os.geteuid()} and "
            f"writable by nobody else (it is uid {st.st_uid}, mode {oct(st.st_mode & 0o7777)})"
        )


def write_archive(
    out: Path,
    ref: str,
    layers: list[tuple[Path, dict[str, Any]]],
    config: dict[str, Any],
    history: list[str],
) -> dict[str, Any]:
    """An OCI image layout as a tar: oci-layout, index.json (the manifest named ``ref`` for
    containerd's import and for OCI tools) and the blobs."""
    image_config = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [info["diff_id"] for _, info in layers]},
        "history": [{"created_by": line} for line in history],
    }
    config_bytes = json.dumps(image_config, indent=1).encode()
    config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": info["digest"],
                "size": info["size"],
            }
            for _, info in layers
        ],
    }
    manifest_bytes = json.dumps(manifest, indent=1).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": ref,
                    "org.opencontainers.image.ref.name": ref,
                },
            }
        ],
    }
    partial = out.with_name(out.name + ".partial")
    with (
        _create(partial) as sink,
        tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        _add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _add_bytes(tar, "index.json", json.dumps(index, indent=1).encode())
        _add_bytes(tar, f"blobs/sha256/{manifest_digest[7:]}", manifest_bytes)
        _add_bytes(tar, f"blobs/sha256/{config_digest[7:]}", config_bytes)
        for path, info in layers:
            tar.add(path, f"blobs/sha256/{info['digest'][7:]}")
    partial.rename(out)
    return {
        "ref": ref,
        "archive_bytes": out.stat().st_size,
        "unpacked_bytes": sum(info["unpacked"] for _, info in layers),
        "layers": [
            {
                "created_by": info.get("created_by", ""),
                "gzip": info["size"],
                "unpacked": info["unpacked"],
            }
            for _, info in layers
        ],
    }


# -- main ------------------------------------------------------------------------------------


def build(outdir: Path, cache: Path, images: list[str]) -> list[dict[str, Any]]:
    outdir.mkdir(parents=True, exist_ok=True)
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    _check_owned(cache)
    reports = []
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = time.monotonic()
        for stale in cache.glob("gpushare-images-*"):  # a build killed before its cleanup
            shutil.rmtree(stale)
        with tempfile.TemporaryDirectory(prefix="gpushare-images-", dir=cache) as tmp:
            wheels = Path(tmp) / "wheels"
            wheels.mkdir()
            wheel = build_wheel(images[0], wheels)
            log(f"wheel: {wheel.name} in {time.monotonic() - started:.1f} s")
            requirements = requirements_of(wheel)
            debian = debian_layer(cache)
            for image in images:
                t0 = time.monotonic()
                env_dir, env_info = env_layer(cache, image, debian, requirements)
                env_info["created_by"] = env_info.get("created_by", "")
                top = Path(tmp) / f"{image}-top"
                lowers = [env_dir / "upper", debian[0] / "rootfs"]
                config, history = final_stage(
                    image, lowers, top / "upper", wheels, BASES[image].config
                )
                top_info = write_layer(
                    top / "upper", top / "layer.tar.gz", upper=True, skip=skip_dev
                )
                top_info["created_by"] = f"deploy/images/{image}/Dockerfile: {wheel.name}"
                report = write_archive(
                    outdir / f"{image}.tar",
                    REF.format(image=image),
                    [
                        (debian[0] / "layer.tar.gz", debian[1]),
                        (env_dir / "layer.tar.gz", env_info),
                        (top / "layer.tar.gz", top_info),
                    ],
                    config,
                    [debian[1]["created_by"], env_info["created_by"], *history],
                )
                report["seconds"] = round(time.monotonic() - t0, 1)
                log(
                    f"{image}: {outdir / f'{image}.tar'} {report['ref']}: "
                    f"{report['archive_bytes'] / 1e6:.1f} MB archive, "
                    f"{report['unpacked_bytes'] / 1e6:.1f} MB unpacked"
                )
                reports.append(report)
        log(f"done in {time.monotonic() - started:.1f} s")
    summary = outdir / "images.json.partial"
    with _create(summary) as f:
        f.write((json.dumps(reports, indent=1) + "\n").encode())
    summary.rename(outdir / "images.json")
    return reports


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--image", action="append", choices=sorted(BASES))
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("build-offline: needs root (overlay mounts, chroot)", file=sys.stderr)
        return 2
    for tool in ("mmdebstrap", "gzip", "unshare", "chroot", "make", "cc", "objdump"):
        if shutil.which(tool) is None:
            print(f"build-offline: {tool} is missing", file=sys.stderr)
            return 2
    build(args.outdir.resolve(), args.cache.resolve(), args.image or ["node", "kernel"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
