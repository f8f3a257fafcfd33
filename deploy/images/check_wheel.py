"""Checks a built jupyter_gpushare wheel before it goes into an image (build-wheel.sh), and
tags it for any Python 3 on glibc >= 2.28.

The wheel must carry the interposer and the simulator's libraries, and the interposer must ask
the dynamic linker for no glibc symbol version above 2.28 (read from its ELF dynamic symbols
with objdump, as tests/enforcement/test_glibc_baseline.py does for the development build), and
link the pre-2.34 homes of dlopen and pthread (libdl, libpthread).

Its C libraries are not Python extensions (the interposer is preloaded, the simulator loaded
with ctypes), so the wheel the build tags for the builder's interpreter (``cp311-cp311-linux_…``)
is retagged ``py3-none-manylinux_2_28_<arch>``: it installs into kernel images on any Python 3
(Jupyter images ship 3.12 and 3.13).

    python check_wheel.py [--retag TAG] WHEEL   # prints the (retagged) wheel's path
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

BASELINE = (2, 28)
REQUIRED = [
    "jupyter_gpushare/_lib/libgpushare.so",
    "jupyter_gpushare/_lib/sim/libcuda.so.1",
    "jupyter_gpushare/_lib/sim/libnvidia-ml.so.1",
]


def glibc_versions(library: Path) -> dict[tuple[int, ...], list[str]]:
    dynamic = subprocess.run(
        ["objdump", "-T", str(library)], check=True, capture_output=True, text=True
    ).stdout
    needed: dict[tuple[int, ...], list[str]] = {}
    for line in dynamic.splitlines():
        found = re.search(r"\(?GLIBC_(\d+(?:\.\d+)+)\)?\s+(\S+)$", line)
        if found and "*UND*" in line:
            version = tuple(int(p) for p in found.group(1).split("."))
            needed.setdefault(version, []).append(found.group(2))
    return needed


def check(wheel: Path) -> list[str]:
    """What is wrong with ``wheel`` (empty: nothing)."""
    problems = []
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as tmp:
        names = set(archive.namelist())
        missing = [name for name in REQUIRED if name not in names]
        if missing:
            return [f"{wheel.name}: missing {', '.join(missing)}"]
        library = Path(archive.extract(REQUIRED[0], tmp))
        needed = glibc_versions(library)
        if not needed:
            problems.append(f"{REQUIRED[0]}: no versioned glibc import (objdump output changed?)")
        too_new = {v: names for v, names in needed.items() if v[:2] > BASELINE}
        if too_new:
            problems.append(f"{REQUIRED[0]}: symbols newer than glibc 2.28: {too_new}")
        private = subprocess.run(
            ["objdump", "-p", str(library)], check=True, capture_output=True, text=True
        ).stdout
        linked = set(re.findall(r"NEEDED\s+(\S+)", private))
        if not {"libdl.so.2", "libpthread.so.0"} <= linked:
            problems.append(f"{REQUIRED[0]}: not linked to libdl/libpthread: {sorted(linked)}")
    return problems


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()},{len(data)}"


def retag(wheel: Path, tag: str) -> Path:
    """``wheel`` with the one tag ``tag`` (``python-abi-platform``): the file renamed, the
    dist-info's ``WHEEL`` rewritten and its line in ``RECORD`` updated. Returns the new path
    (the old file is removed)."""
    name, version = wheel.name.split("-")[:2]
    target = wheel.with_name(f"{name}-{version}-{tag}.whl")
    dist_info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel) as src:
        items = [(info, src.read(info.filename)) for info in src.infolist()]
    wheel_file = f"{dist_info}/WHEEL"
    files = {info.filename: data for info, data in items}
    lines = [ln for ln in files[wheel_file].decode().splitlines() if not ln.startswith("Tag:")]
    new_wheel = ("\n".join([*lines, f"Tag: {tag}"]) + "\n").encode()
    record = []
    for line in files[f"{dist_info}/RECORD"].decode().splitlines():
        if line.startswith(f"{wheel_file},"):
            line = f"{wheel_file},{_record_hash(new_wheel)}"
        record.append(line)
    new_record = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for info, data in items:
            if info.filename == wheel_file:
                data = new_wheel
            elif info.filename == f"{dist_info}/RECORD":
                data = new_record
            dst.writestr(info, data)
    if target != wheel:
        wheel.unlink()
    return target


def main(argv: list[str]) -> int:
    tag = None
    if len(argv) == 3 and argv[0] == "--retag":
        tag, argv = argv[1], argv[2:]
    if len(argv) != 1:
        print("usage: check_wheel.py [--retag TAG] WHEEL", file=sys.stderr)
        return 2
    wheel = Path(argv[0])
    problems = check(wheel)
    for problem in problems:
        print(f"check_wheel: {problem}", file=sys.stderr)
    if problems:
        return 1
    if tag is not None:
        wheel = retag(wheel, tag)
    print(f"check_wheel: interposer needs glibc <= 2.28, libraries in: {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
