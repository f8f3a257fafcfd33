#!/usr/bin/env bash
# The parts of a real Kubernetes node for tests/k8s/real_node.py (the `real_node` tests):
#
#   - kubelet and kube-proxy, built (once) from the same Debian `kubernetes` 1.20.2 source tree
#     that k8s.sh unpacks and builds the control plane from, cached beside it in
#     /var/cache/gpushare-k8s/bin (GPUSHARE_K8S_CACHE) with a stamp of their own;
#   - Debian's containerd (1.6, CRI v1alpha2 for kubelet 1.20), runc and the CNI plugins
#     (bridge, portmap, host-local, loopback), iptables and conntrack for kube-proxy;
#   - the pause image the sandboxes run (pause.c from that tree, static, in a one-layer OCI
#     archive: localhost/pause:3.4.1) and a small Debian image with python3 for plain test pods
#     (mmdebstrap minbase, localhost/gpushare-test-python:dev), both as OCI archives in
#     /var/cache/gpushare-k8s/images, imported by the fixture into its own containerd.
#
# Nothing here starts a daemon: the fixture writes the containerd/kubelet/CNI configuration into
# its own directories and starts (and stops) everything itself. Idempotent; run as root after
# k8s.sh (it needs the unpacked source).
set -euo pipefail

CACHE="${GPUSHARE_K8S_CACHE:-/var/cache/gpushare-k8s}"
BIN="$CACHE/bin"
IMAGES="$CACHE/images"
STAMP="$BIN/.node-built-with-reflect2-1.0.2"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

need=()
for cmd in containerd runc iptables conntrack mmdebstrap; do
  command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/portmap ] || need+=(containernetworking-plugins)
command -v ctr >/dev/null 2>&1 || need+=(containerd)
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # the command names above are their packages' names too
  apt-get install -y -q --no-install-recommends containerd runc containernetworking-plugins \
    iptables conntrack mmdebstrap gcc libc6-dev
fi

if [ -x "$BIN/kubelet" ] && [ -x "$BIN/kube-proxy" ] && [ -f "$STAMP" ]; then
  echo "kubelet: kubelet and kube-proxy cached in $BIN"
else
  SRC=$(ls -d "$CACHE"/src/kubernetes-*/ 2>/dev/null | head -n1 || true)
  [ -n "$SRC" ] || { echo "kubelet: no Kubernetes source in $CACHE/src (run k8s.sh first)" >&2; exit 1; }
  cd "$SRC"
  grep -q "go1.18" vendor/github.com/modern-go/reflect2/*.go || {
    echo "kubelet: $SRC lacks k8s.sh's reflect2 fix (run k8s.sh first)" >&2; exit 1; }
  echo "kubelet: building kubelet and kube-proxy in $PWD (a few minutes on 2 cores)"
  unset GOFLAGS
  export GOCACHE="$CACHE/gocache" GOPATH="$CACHE/gopath"
  nice -n 5 make WHAT='cmd/kubelet cmd/kube-proxy' KUBE_BUILD_PLATFORMS=linux/amd64 GOLDFLAGS='-s -w'
  for b in kubelet kube-proxy; do
    f=$(find _output -type f -name "$b" -perm -u+x | head -n1)
    [ -n "$f" ] || { echo "kubelet: $b not built" >&2; exit 1; }
    install -m 0755 "$f" "$BIN/$b"
  done
  touch "$STAMP"
  echo "kubelet: kubelet and kube-proxy installed in $BIN"
fi

mkdir -p "$IMAGES"
if [ ! -s "$IMAGES/pause.tar" ]; then
  SRC=$(ls -d "$CACHE"/src/kubernetes-*/ | head -n1)
  WORK=$(mktemp -d)
  mkdir -p "$WORK/root"
  gcc -Os -static -o "$WORK/root/pause" "$SRC/build/pause/linux/pause.c"
  strip "$WORK/root/pause"
  tar --numeric-owner --owner=0 --group=0 -C "$WORK/root" -cf "$WORK/layer.tar" pause
  python3 "$HERE/oci_archive.py" "$WORK/layer.tar" "$IMAGES/pause.tar" localhost/pause:3.4.1 \
    --entrypoint /pause --user 65535:65535
  rm -rf "$WORK"
  echo "kubelet: pause image in $IMAGES/pause.tar"
fi
if [ ! -s "$IMAGES/python.tar" ]; then
  WORK=$(mktemp -d)
  nice -n 5 mmdebstrap --quiet --variant=minbase --include=python3 \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' bookworm "$WORK/rootfs.tar"
  python3 "$HERE/oci_archive.py" "$WORK/rootfs.tar" "$IMAGES/python.tar" \
    localhost/gpushare-test-python:dev --cmd python3
  rm -rf "$WORK"
  echo "kubelet: python test image in $IMAGES/python.tar"
fi
ls -l "$IMAGES"
