#!/usr/bin/env bash
# Headless Chromium and the Node test driver for the JupyterLab browser tests (tests/lab).
#
# Debian's chromium + chromium-driver (browser downloads do not work in CI), fonts so that
# screenshots show text, and `playwright-core` (driver only, no bundled browser) from npm into
# tests/lab/node_modules.  The lab extension itself ships prebuilt in the repository, so Node is
# only needed here for the test driver.  Idempotent; run as root from the repository root.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

export DEBIAN_FRONTEND=noninteractive
# Only what is missing: a machine may already have Node from elsewhere (NodeSource's nodejs
# ships npm and conflicts with Debian's npm package).
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium chromium-driver fonts-dejavu-core \
  fonts-liberation)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
if ((${#need[@]})); then
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${need[@]}"
fi

# playwright-core drives Chromium; @kubernetes-models/prometheus-operator validates the chart's
# PodMonitor (tests/k8s/test_podmonitor_schema.py).
if [ ! -d "$HERE/tests/lab/node_modules/playwright-core" ] ||
  [ ! -d "$HERE/tests/lab/node_modules/@kubernetes-models/prometheus-operator" ]; then
  (cd "$HERE/tests/lab" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund)
fi
echo "browser: $(chromium --version 2>/dev/null || echo 'chromium missing'), node $(node --version)"
