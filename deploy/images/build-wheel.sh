#!/bin/sh
# Builder stage of both images: the jupyter_gpushare wheel, with its C libraries (the interposer
# libgpushare.so and the simulator's libcuda/libnvidia-ml) compiled by the wheel's build hook
# (make -C jupyter_gpushare/csrc). Run in quay.io/pypa/manylinux_2_28 (glibc 2.28, AlmaLinux 8),
# so the interposer preloads into any kernel image with glibc >= 2.28 (Ubuntu 20.04, UBI 8 and
# newer); the check below refuses a library that asks for a newer glibc symbol version.
#
#   build-wheel.sh SOURCE_DIR OUT_DIR
# $PYTHON: the interpreter (default python3); $GPUSHARE_WHEEL_ARGS: extra `pip wheel` arguments
# (tests/test_images.py passes --no-build-isolation to build offline).
set -eu
src=$1
out=$2
python=${PYTHON:-python3}
mkdir -p "$out"
# shellcheck disable=SC2086  # GPUSHARE_WHEEL_ARGS is a list of arguments
"$python" -m pip wheel --no-deps --disable-pip-version-check ${GPUSHARE_WHEEL_ARGS:-} \
    --wheel-dir "$out" "$src"
wheel=$(ls "$out"/jupyter_gpushare-*.whl)
# checked, then tagged for any Python 3 on glibc >= 2.28 (the C libraries are no extensions)
"$python" "$(dirname "$0")/check_wheel.py" --retag "py3-none-manylinux_2_28_$(uname -m)" "$wheel"
