"""Build hook: compiles the C parts (GPU simulator, CUDA interposer) with the plain C compiler.

`make -C jupyter_gpushare/csrc` writes the shared libraries into `jupyter_gpushare/_lib/`, which
the wheel ships as artifacts. No CUDA toolkit is needed: the sources declare the few driver types
they use.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        csrc = Path(self.root) / "jupyter_gpushare" / "csrc"
        if (csrc / "Makefile").exists():
            make = shutil.which("make")
            if make is None:
                raise RuntimeError("building jupyter_gpushare needs `make` and a C compiler (cc)")
            subprocess.run([make, "-C", str(csrc)], check=True)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
