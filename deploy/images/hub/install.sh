#!/bin/sh
# Install step of the hub image (deploy/images/hub/Dockerfile): jupyter_gpushare with its `hub`
# extra (JupyterHub, KubeSpawner) from the builder stage's wheel into z2jh's hub image, then a
# check that deploy/z2jh/values.yaml's hub.extraConfig can run: GpuProfiles, the Kubernetes
# ledger it reads the inventory from, and KubeSpawner.
#
#   install.sh WHEEL_DIR
# $PYTHON: the interpreter to install into (default python3); $GPUSHARE_PIP_ARGS: extra
# `pip install` arguments (tests/test_images.py: --force-reinstall --no-deps, as its Python
# already has the dependencies and an editable jupyter_gpushare of the same version).
set -eu
wheels=$1
python=${PYTHON:-python3}
wheel=$(ls "$wheels"/jupyter_gpushare-*.whl)
# shellcheck disable=SC2086  # GPUSHARE_PIP_ARGS is a list of arguments
"$python" -m pip install --no-cache-dir --disable-pip-version-check ${GPUSHARE_PIP_ARGS:-} \
    "jupyter_gpushare[hub] @ file://$wheel"
"$python" - <<'PY'
import kubespawner  # noqa: F401  (z2jh's spawner)
import jupyter_gpushare
from jupyter_gpushare.hub import GpuProfiles, ledger_inventory  # noqa: F401
from jupyter_gpushare.k8s.ledger import KubernetesLedger  # noqa: F401

print("hub image: jupyter_gpushare", jupyter_gpushare.__version__, "in", jupyter_gpushare.__file__)
PY
