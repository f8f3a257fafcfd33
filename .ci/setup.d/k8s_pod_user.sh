#!/usr/bin/env bash
# Kernel pods run as the image's user (runAsUser 1000, runAsGroup 100, fsGroup 100). The node
# agent test double (tests/k8s/node_agent.py) has no container images: a pod's "image" is this
# machine's Python and this checkout, so that user must be able to reach them. Where they live
# under a directory closed to others (pyenv in /root, mode 0700), let others traverse it (o+x:
# no listing, no writing). Idempotent; run as root from the repository root.
set -euo pipefail

python=$(python3 -c 'import os, sys; print(os.path.realpath(sys.executable))')
for start in "$(dirname "$python")" "$(pwd -P)"; do
    dir=$start
    while [ "$dir" != "/" ]; do
        if [ "$(( 8#$(stat -c %a "$dir") & 1 ))" = 0 ]; then
            chmod o+x "$dir"
        fi
        dir=$(dirname "$dir")
    done
done
