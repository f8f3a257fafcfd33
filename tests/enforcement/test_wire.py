"""The wire format is written down once (daemon/wire.py) and mirrored in gpushare_wire.h: the
C layout must match the Python one field by field."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from jupyter_gpushare.daemon import wire

INCLUDE = Path(__file__).resolve().parents[2] / "jupyter_gpushare" / "csrc" / "include"

PROGRAM = r"""
#include <stdio.h>
#include "gpushare_wire.h"
#define P(t, f) printf("%s\"%s\":%zu", first ? "" : ",", #f, offsetof(struct t, f)), first = 0;
#define H(f) P(gpushare_wire_header, f)
#define S(f) P(gpushare_wire_slot, f)
int main(void) {
    int first = 1;
    printf("{\"version\":%u,\"oldest\":%u,\"layout\":%u,\"magic\":%u,\"slots\":%d,"
           "\"file\":%d,\"account\":%d,\"header\":{", GPUSHARE_WIRE_VERSION,
           GPUSHARE_WIRE_OLDEST_VERSION, GPUSHARE_WIRE_LAYOUT_VERSION, GPUSHARE_WIRE_MAGIC,
           GPUSHARE_WIRE_SLOTS, GPUSHARE_WIRE_FILE_SIZE, GPUSHARE_WIRE_ACCOUNT_SIZE);
    GPUSHARE_WIRE_HEADER_FIELDS(H)
    printf("},\"slot\":{");
    first = 1;
    GPUSHARE_WIRE_SLOT_FIELDS(S)
    printf("}}\n");
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("wire")
    (d / "w.c").write_text(PROGRAM)
    subprocess.run(
        [cc, "-std=gnu11", "-Wall", "-Werror", f"-I{INCLUDE}", "-o", str(d / "w"), str(d / "w.c")],
        check=True,
    )
    return json.loads(
        subprocess.run([str(d / "w")], check=True, capture_output=True, text=True).stdout
    )


def test_constants_match(c_layout):
    assert c_layout["version"] == wire.VERSION
    assert c_layout["oldest"] == wire.OLDEST_VERSION
    assert c_layout["layout"] == wire.LAYOUT_VERSION
    assert c_layout["magic"] == wire.MAGIC
    assert c_layout["slots"] == wire.SLOTS
    assert c_layout["file"] == wire.FILE_SIZE
    assert c_layout["account"] == wire.ACCOUNT_SIZE


def test_offsets_match(c_layout):
    py_header = {k: v for k, v in wire.HEADER_OFFSETS.items() if not k.startswith("_")}
    py_slot = {k: v for k, v in wire.SLOT_OFFSETS.items() if not k.startswith("_")}
    assert c_layout["header"] == py_header
    assert c_layout["slot"] == py_slot


def test_messages_round_trip():
    line = wire.encode({"op": "hello", "v": wire.VERSION, "allocation": "a-0"})
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    assert wire.decode(line) == {"op": "hello", "v": wire.VERSION, "allocation": "a-0"}
    with pytest.raises(ValueError):
        wire.decode(b"[1, 2]")
