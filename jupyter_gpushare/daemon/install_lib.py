"""Copy the built libraries (``libgpushare.so``, ``sim/``) into a host directory that kernel pods
mount and preload: ``python -m jupyter_gpushare.daemon.install_lib /host-lib`` (the DaemonSet's
init container).

Each file is written under a temporary name and renamed over the old one, so a kernel that has
the previous ``libgpushare.so`` mapped keeps its (unlinked) copy intact instead of reading a file
rewritten under it.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from ..paths import lib_dir


def install(target: Path, source: Path | None = None) -> list[Path]:
    """Copy ``source`` (default: this package's ``_lib``) into ``target``; returns the files."""
    source = source or lib_dir()
    if not (source / "libgpushare.so").exists():
        raise FileNotFoundError(f"{source / 'libgpushare.so'} is not built")
    written = []
    shipped = [source / "libgpushare.so", *sorted((source / "sim").glob("*"))]
    for path in shipped:  # not the sanitizer test builds under _lib/test
        if not path.is_file():
            continue
        dest = target / path.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.copy2(path, tmp)
        os.replace(tmp, dest)
        written.append(dest)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="host directory (a hostPath volume)")
    args = parser.parse_args()
    for path in install(args.target):
        print(path, flush=True)


if __name__ == "__main__":
    main()
