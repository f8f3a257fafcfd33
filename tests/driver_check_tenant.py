"""A tenant for the driver check's attack tests (tests/test_driver_check_attacks.py), run as a
real user with only the standard library: it drives the simulated CUDA driver through ctypes
(``dlsym``, so a preloaded interposer sees every call) and attacks its own share's lease memory,
which its process maps (found in ``/proc/self/maps``).

    driver_check_tenant.py MODE ARGS...

- ``alloc BYTES [ZERO_ACCOUNT]``: allocate BYTES in 256 MiB pieces; with ZERO_ACCOUNT=1 write
  0 to its account's ``mem_used`` before each piece (the cap's own counter); prints
  ``{"allocated": n, "error": code}`` when it stops, then sleeps.
- ``spin SECONDS KERNEL_US [FORGE_LEASE]``: launch busy_us kernels back to back (one stream,
  synchronised every 4); prints ``{"t", "done_us"}`` about every 50 ms; with FORGE_LEASE=1 a
  thread keeps writing a lease one second ahead into its own slot of the board.
- ``garbage SECONDS``: after one allocation (which connects it), write random values over the
  whole board (header and slots) as fast as it can; prints ``{"writes": n}``.

It waits for a line on stdin before it starts (the test records its pid meanwhile).
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import struct
import sys
import threading
import time

SLOTS, HEADER, SLOT = 64, 256, 256


def check(code: int, what: str) -> None:
    if code != 0:
        print(json.dumps({"error": code, "call": what}), flush=True)
        time.sleep(3600)


def cuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    check(lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return lib


def mapping(suffix: str) -> tuple[int, int] | None:
    """(address, length) of this process's mapping of a file whose name ends with suffix."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(suffix):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                return lo, hi - lo
    return None


def my_slot() -> int:
    policy = mapping(".policy")
    assert policy is not None, "no policy mapping: not connected"
    mine = os.environ["GPUSHARE_ALLOCATION_ID"].encode()[:31]
    for i in range(SLOTS):
        at = policy[0] + HEADER + i * SLOT + 112
        if ctypes.string_at(at, 32).rstrip(b"\0") == mine:
            return i
    raise AssertionError("no slot of ours in the policy")


def alloc(total: int, zero: bool) -> None:
    lib = cuda()
    piece, done, error = 256 * 2**20, 0, 0
    ptr = ctypes.c_uint64()
    while done < total:
        if zero:
            account = mapping(".account")
            if account is not None:
                ctypes.c_uint64.from_address(account[0] + 40).value = 0  # mem_used
        error = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(min(piece, total - done)))
        if error:
            break
        done += min(piece, total - done)
    print(json.dumps({"allocated": done, "error": error}), flush=True)
    time.sleep(3600)


def spin(seconds: float, kernel_us: int, forge: bool) -> None:
    lib = cuda()
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check(lib.cuModuleLoadData(ctypes.byref(mod), b"driver_check_tenant"), "cuModuleLoadData")
    check(lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"busy_us"), "cuModuleGetFunction")
    arg = ctypes.c_uint64(kernel_us)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    launch = lib.cuLaunchKernel
    sync = lib.cuCtxSynchronize
    check(launch(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None), "cuLaunchKernel")
    check(sync(), "cuCtxSynchronize")
    if forge:
        slot = my_slot()
        board = mapping(".board")
        assert board is not None
        until = ctypes.c_uint64.from_address(board[0] + HEADER + slot * SLOT)

        def forger() -> None:
            while True:
                until.value = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + 1_000_000_000
                time.sleep(0.0005)

        threading.Thread(target=forger, daemon=True).start()
    start = time.monotonic()
    done, last = 0, 0.0
    while time.monotonic() - start < seconds:
        for _ in range(4):
            check(launch(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None), "cuLaunchKernel")
        check(sync(), "cuCtxSynchronize")
        done += 4 * kernel_us
        now = time.monotonic()
        if now - last >= 0.05:
            last = now
            t = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            print(json.dumps({"t": t, "done_us": done}), flush=True)
    t = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    print(json.dumps({"t": t, "done_us": done, "end": True}), flush=True)


def garbage(seconds: float) -> None:
    lib = cuda()
    ptr = ctypes.c_uint64()
    check(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(2**20)), "cuMemAlloc_v2")
    board = mapping(".board")
    assert board is not None
    base, size = board
    rand = random.Random(23)
    words = size // 8
    special = [0, 1, SLOTS, SLOTS + 1, 2**32 - 1, 2**63, 2**64 - 1]
    view = (ctypes.c_char * size).from_address(base)
    writes, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(1000):
            value = rand.choice(special) if rand.random() < 0.5 else rand.getrandbits(64)
            struct.pack_into("<Q", view, 8 * rand.randrange(words), value)
            writes += 1
    print(json.dumps({"writes": writes}), flush=True)


def main() -> None:
    sys.stdin.readline()
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "alloc":
        alloc(int(args[0]), len(args) > 1 and args[1] == "1")
    elif mode == "spin":
        spin(float(args[0]), int(args[1]), len(args) > 2 and args[2] == "1")
    elif mode == "garbage":
        garbage(float(args[0]))


if __name__ == "__main__":
    main()
