#!/bin/sh
# Install step of the kernel image layer (deploy/images/kernel/Dockerfile): jupyter_gpushare
# from the builder stage's wheel into the Jupyter image's Python, run as the image's own user
# (docker-stacks images own their conda environment as uid 1000), then a check that a kernel pod
# runs: ipykernel, the %gpushare magics and the panel import, and the kernelspecs are found.
#
#   install.sh WHEEL_DIR
# $PYTHON: the interpreter to install into (default python3); $GPUSHARE_PIP_ARGS: extra
# `pip install` arguments (tests/test_images.py: --force-reinstall --no-deps, as its Python
# already has the dependencies and an editable jupyter_gpushare of the same version).
set -eu
wheels=$1
python=${PYTHON:-python3}
# shellcheck disable=SC2086  # GPUSHARE_PIP_ARGS is a list of arguments
"$python" -m pip install --no-cache-dir --disable-pip-version-check ${GPUSHARE_PIP_ARGS:-} \
    "$wheels"/jupyter_gpushare-*.whl
"$python" - <<'PY'
import ipykernel  # noqa: F401  (kernel pods run python -m ipykernel_launcher)
import jupyter_gpushare
import jupyter_gpushare.notebook.magics  # noqa: F401
import jupyter_gpushare.notebook.panel  # noqa: F401
from jupyter_client.kernelspec import KernelSpecManager

import sys
from pathlib import Path

specs = KernelSpecManager().find_kernel_specs()
assert "gpushare-python" in specs, sorted(specs)
# installed with this Python (its share/jupyter/kernels), not found elsewhere on the machine
assert Path(specs["gpushare-python"]).resolve().is_relative_to(Path(sys.prefix).resolve()), specs
print("kernel image: jupyter_gpushare", jupyter_gpushare.__version__, "kernelspecs ok")
PY
