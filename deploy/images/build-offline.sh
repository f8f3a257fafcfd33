#!/bin/sh
# Builds the node and kernel images from this checkout without a container engine or registry:
# OUTDIR/node.tar and OUTDIR/kernel.tar, OCI archives of localhost/jupyter-gpushare-node:dev and
# localhost/jupyter-gpushare-kernel:dev for `ctr -n k8s.io images import` (see build_offline.py).
# Run as root; cached layers live in $GPUSHARE_IMAGES_CACHE (default /var/cache/gpushare-images).
#
#   deploy/images/build-offline.sh OUTDIR [--image node|kernel ...]
set -eu
here=$(dirname "$0")
exec "${PYTHON:-python3}" "$here/build_offline.py" "$@"
