"""Checks a built jupyter_gpushare wheel before it goes into an image (build-wheel.sh).

The wheel must carry the interposer and the simulator's libraries, and the interposer must ask
the dynamic linker for no glibc symbol version above 2.28 (read from its ELF dynamic symbols
with objdump, as tests/enforcement/test_glibc_baseline.py does for the development build), and
link the pre-2.34 homes of dlopen and pthread (libdl, libpthread).

    python check_wheel.py WHEEL
"""

from __future__ import annotations

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


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_wheel.py WHEEL", file=sys.stderr)
        return 2
    problems = check(Path(argv[0]))
    for problem in problems:
        print(f"check_wheel: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_wheel: {Path(argv[0]).name}: interposer needs glibc <= 2.28, libraries in")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
