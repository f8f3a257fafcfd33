#!/bin/sh
# Install step of the node image (deploy/images/node/Dockerfile): jupyter_gpushare from the
# builder stage's wheel into the image's Python, then a check that what the DaemonSet runs is
# there: `jupyter gpushare daemon` (agent and device plugin), the reconciler, the interposer
# installer and the libraries it copies onto the node.
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
bin=$(dirname "$("$python" -c 'import sys; print(sys.executable)')")
"$bin/jupyter-gpushare" daemon --help >/dev/null  # what `jupyter gpushare daemon` runs
"$bin/jupyter-gpushare" controller --help >/dev/null  # the chart's controller Deployment
"$python" -m jupyter_gpushare.k8s.reconcile --help >/dev/null
"$python" - <<'PY'
import grpc  # noqa: F401  (the device plugin's gRPC)
import jupyter_gpushare.daemon.install_lib  # noqa: F401
import jupyter_gpushare.k8s.device_plugin.plugin  # noqa: F401
from jupyter_gpushare.paths import lib_dir

for name in ("libgpushare.so", "sim/libcuda.so.1", "sim/libnvidia-ml.so.1"):
    assert (lib_dir() / name).is_file(), f"{lib_dir() / name} missing"
print("node image: jupyter_gpushare", __import__("jupyter_gpushare").__version__, "in", lib_dir())
PY
