"""Copy the built libraries (``libgpushare.so``, ``sim/``) into a host directory that kernel pods
mount and preload: ``python -m jupyter_gpushare.daemon.install_lib /host-lib`` (the DaemonSet's
init container).

Each file is written under a fresh temporary name (``mkstemp``: ``O_EXCL``, so nothing prepared
under that name is followed) and renamed over the old one, so a kernel that has the previous
``libgpushare.so`` mapped keeps its (unlinked) copy intact instead of reading a file rewritten
under it. The files are 0644: kernels (any user) read them, nobody but the installer writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
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
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                shutil.copyfileobj(src, out)
                os.fchmod(out.fileno(), 0o644)
            os.replace(name, dest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
            raise
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
