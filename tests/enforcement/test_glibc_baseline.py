"""The interposer loads into old kernel images: it needs no glibc symbol version above 2.28.

Kernel images are whatever Jupyter image an admin runs (Ubuntu 20.04: glibc 2.31; UBI 8: 2.28),
while the library is built on a current toolchain. ``csrc/include/glibc_baseline.h`` binds the
symbols glibc 2.34 re-versioned to their old versions; this reads what the built library asks
the dynamic linker for, as ``objdump -T`` shows it.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from jupyter_gpushare.paths import lib_dir

BASELINE = (2, 28)


def _objdump(*flags: str) -> str:
    if shutil.which("objdump") is None:
        pytest.fail("objdump (binutils) is needed to read the interposer's symbol versions")
    library = lib_dir() / "libgpushare.so"
    return subprocess.run(
        ["objdump", *flags, str(library)], check=True, capture_output=True, text=True
    ).stdout


def test_no_glibc_symbol_version_above_the_baseline() -> None:
    needed: dict[tuple[int, ...], list[str]] = {}
    for line in _objdump("-T").splitlines():
        found = re.search(r"\(?GLIBC_(\d+(?:\.\d+)+)\)?\s+(\S+)$", line)
        if found and "*UND*" in line:
            version = tuple(int(p) for p in found.group(1).split("."))
            needed.setdefault(version, []).append(found.group(2))
    assert needed, "no versioned glibc import found: objdump output changed?"
    too_new = {v: names for v, names in needed.items() if v[:2] > BASELINE}
    assert not too_new, f"symbols newer than glibc {BASELINE}: {too_new}"


def test_old_homes_of_dl_and_pthread_symbols_are_linked() -> None:
    """Before glibc 2.34, dlopen and pthread_create live in libdl and libpthread."""
    needed = re.findall(r"NEEDED\s+(\S+)", _objdump("-p"))
    assert {"libdl.so.2", "libpthread.so.0"} <= set(needed), needed
