#!/usr/bin/env bash
# jupyter_server's own test suite (tests/ from its sdist) for tests/test_jupyter_server_suite.py,
# which runs their tests/services/kernels and tests/services/sessions with gpushare kernels.
#
# The sdist of the pinned version comes from PyPI (pip's ordinary client, nothing else on the
# network); its tests/ and pyproject.toml (their pytest settings) are extracted into
#   $GPUSHARE_JSTESTS_DIR/jupyter_server-<version>/   (default /var/cache/gpushare-jstests)
# Keep JUPYTER_SERVER_VERSION equal to the jupyter_server that `pip install -e .[test]` installs
# (`pip show jupyter_server`); the test fails under CI, naming both, when they differ.
# Idempotent: does nothing when that version is extracted already.
set -euo pipefail
JUPYTER_SERVER_VERSION="${JUPYTER_SERVER_VERSION:-2.21.1}"
CACHE="${GPUSHARE_JSTESTS_DIR:-/var/cache/gpushare-jstests}"
DEST="$CACHE/jupyter_server-$JUPYTER_SERVER_VERSION"

if [ -f "$DEST/.complete" ]; then
  echo "jupyter_server tests: $DEST (cached)"
  exit 0
fi
mkdir -p "$CACHE"
chmod 0755 "$CACHE"
work="$(mktemp -d "$CACHE/.download.XXXXXX")"
trap 'rm -rf "$work"' EXIT
sdist="$CACHE/jupyter_server-$JUPYTER_SERVER_VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: --dest "$work" \
    "jupyter_server==$JUPYTER_SERVER_VERSION"
  mv "$work/jupyter_server-$JUPYTER_SERVER_VERSION.tar.gz" "$sdist"
fi
tar -xzf "$sdist" -C "$work" --no-same-owner \
  "jupyter_server-$JUPYTER_SERVER_VERSION/tests" \
  "jupyter_server-$JUPYTER_SERVER_VERSION/pyproject.toml"
touch "$work/jupyter_server-$JUPYTER_SERVER_VERSION/.complete"
rm -rf "$DEST"
mv "$work/jupyter_server-$JUPYTER_SERVER_VERSION" "$DEST"
chmod -R go-w "$DEST"
echo "jupyter_server tests: $DEST"
