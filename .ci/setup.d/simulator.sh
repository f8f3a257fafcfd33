#!/usr/bin/env bash
# The GPU simulator and its tests need a C compiler, make and the sanitizer runtimes (libasan,
# libubsan, libtsan come with gcc on Debian). Idempotent: installs only what is missing.
set -euo pipefail
need=()
command -v make >/dev/null 2>&1 || need+=(make)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
if command -v cc >/dev/null 2>&1; then
  probe=$(mktemp -d)
  echo 'int main(void){return 0;}' > "$probe/p.c"
  cc -fsanitize=address,undefined "$probe/p.c" -o "$probe/a" 2>/dev/null || need+=(gcc libc6-dev)
  cc -fsanitize=thread "$probe/p.c" -o "$probe/t" 2>/dev/null || need+=(gcc libc6-dev)
  rm -rf "$probe"
fi
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${need[@]}"
fi
