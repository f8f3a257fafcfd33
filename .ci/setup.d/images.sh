#!/usr/bin/env bash
# The node and kernel images, built from this checkout's recipes (deploy/images/) without a
# container engine or registry: OCI archives in /var/cache/gpushare-images/out/ (node.tar,
# kernel.tar, images.json with their sizes) for `ctr -n k8s.io images import`. The Debian layer
# and each image's dependency layer are cached by what goes into them, so a rerun only builds the
# wheel and the layer holding it. Idempotent; run as root (apt, overlay mounts, chroot).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
need=()
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
command -v objdump >/dev/null 2>&1 || need+=(binutils)
command -v make >/dev/null 2>&1 || need+=(make)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
command -v gzip >/dev/null 2>&1 || need+=(gzip)
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${need[@]}"
fi
nice -n 10 deploy/images/build-offline.sh "${GPUSHARE_IMAGES_DIR:-/var/cache/gpushare-images/out}"
