#!/usr/bin/env bash
# Build (once) and cache the Kubernetes control-plane binaries used by tests/k8s.
#
# No package registry ships kube-apiserver & co, so we build them offline from Debian's
# `kubernetes` source package (1.20.2) with Debian's Go, and use Debian's etcd.  The binaries
# are cached outside the checkout (GPUSHARE_K8S_CACHE, default /var/cache/gpushare-k8s) so that
# later runs only check that they exist.  Idempotent; run as root (apt).
set -euo pipefail

CACHE="${GPUSHARE_K8S_CACHE:-/var/cache/gpushare-k8s}"
BIN="$CACHE/bin"
WANT=(kube-apiserver kube-scheduler kube-controller-manager)

# Stamp of a build with the reflect2 fix below (older caches are rebuilt).
STAMP="$BIN/.built-with-reflect2-1.0.2"

have_all() {
  for b in "${WANT[@]}"; do [ -x "$BIN/$b" ] || return 1; done
  [ -f "$STAMP" ] || return 1
  command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || return 1
}

if have_all; then
  echo "k8s: control-plane binaries cached in $BIN"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
SRC_LIST=/etc/apt/sources.list.d/gpushare-deb-src.sources
rm -f /etc/apt/sources.list.d/gpushare-deb-src.list
if ! apt-get source --print-uris kubernetes >/dev/null 2>&1 && [ ! -f "$SRC_LIST" ]; then
  # deb822 form, with the same Signed-By as Debian's own entry (apt refuses mixed values).
  cat > "$SRC_LIST" <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
apt-get update -q
apt-get install -y -q --no-install-recommends golang-go rsync etcd-server make dpkg-dev \
  ca-certificates gcc libc6-dev golang-github-modern-go-reflect2-dev

mkdir -p "$CACHE/src" "$BIN"
cd "$CACHE/src"
if ! ls kubernetes_*.dsc >/dev/null 2>&1; then
  apt-get source --download-only kubernetes
fi
DSC=$(ls kubernetes_*.dsc | head -n1)
DIR=$(ls -d kubernetes-*/ 2>/dev/null | head -n1 || true)
if [ -z "$DIR" ]; then
  dpkg-source --no-check -x "$DSC"
  DIR=$(ls -d kubernetes-*/ | head -n1)
fi
cd "$DIR"
# Kubernetes 1.20 vendors modern-go/reflect2 1.0.1, whose map iteration crashes binaries built
# with Go >= 1.18 ("fatal error: fault" in mapiterinit, e.g. on the first custom resource a
# kube-apiserver decodes). reflect2 1.0.2 (same API) fixes it; Debian packages it.
R2=vendor/github.com/modern-go/reflect2
if ! grep -q "go1.18" "$R2"/*.go 2>/dev/null; then
  rm -rf "$R2" && mkdir -p "$R2"
  cp -a /usr/share/gocode/src/github.com/modern-go/reflect2/*.go \
     /usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$R2"/
  rm -f "$R2"/*_test.go
fi
echo "k8s: building ${WANT[*]} in $PWD (several minutes on 2 cores)"
unset GOFLAGS  # hack/lib/golang.sh folds GOFLAGS into -tags
export GOCACHE="$CACHE/gocache" GOPATH="$CACHE/gopath"
# `make` runs the code generators first; a plain `go build` would fail.
nice -n 5 make WHAT='cmd/kube-apiserver cmd/kube-scheduler cmd/kube-controller-manager' \
  KUBE_BUILD_PLATFORMS=linux/amd64 GOLDFLAGS='-s -w'
for b in "${WANT[@]}"; do
  f=$(find _output -type f -name "$b" -perm -u+x | head -n1)
  [ -n "$f" ] || { echo "k8s: $b not built" >&2; exit 1; }
  install -m 0755 "$f" "$BIN/$b"
done
touch "$STAMP"
have_all
echo "k8s: binaries installed in $BIN"
