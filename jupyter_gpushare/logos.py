"""The gpushare kernelspecs' logos (``kernelspecs/*/logo-svg.svg``, ``logo-32x32.png``,
``logo-64x64.png``): a GPU chip whose face is a dial showing the kernelspec's share of the GPU —
the request filled, the rest of the limit lighter. Drawn here from shapes (no artwork copied,
no imaging library: the PNGs are rasterized with 4x4 supersampling and written with zlib).

``python -m jupyter_gpushare.logos`` writes them into ``kernelspecs/``; tests/test_cli.py checks
that the committed files are what this module draws.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

#: colours (RGB): the chip, its pins, the dial's empty part, the request, the rest of the limit
CHIP = (38, 50, 56)
PIN = (120, 144, 156)
DIAL = (236, 239, 241)
REQUEST = (255, 143, 0)
LIMIT = (255, 204, 128)

Shape = Callable[[float, float], bool]  # (x, y) in a 64-unit square -> inside?


def _rounded_rect(x0: float, y0: float, x1: float, y1: float, r: float) -> Shape:
    def inside(x: float, y: float) -> bool:
        if not (x0 <= x <= x1 and y0 <= y <= y1):
            return False
        cx = min(max(x, x0 + r), x1 - r)
        cy = min(max(y, y0 + r), y1 - r)
        return (x - cx) ** 2 + (y - cy) ** 2 <= r * r

    return inside


def _wedge(cx: float, cy: float, r: float, start: float, end: float) -> Shape:
    """The part of a disc from ``start`` to ``end`` (fractions of a turn, clockwise from 12)."""

    def inside(x: float, y: float) -> bool:
        dx, dy = x - cx, y - cy
        if dx * dx + dy * dy > r * r:
            return False
        turn = (math.atan2(dx, -dy) / (2 * math.pi)) % 1.0
        return start <= turn < end or (end >= 1.0 and turn < end - 1.0)

    return inside


#: the pins: four on each side of the chip, (x, y, width, height)
PINS = [(p, 2, 4, 8) for p in (14, 24, 36, 46)] + [(p, 54, 4, 8) for p in (14, 24, 36, 46)]
PINS += [(2, p, 8, 4) for p in (14, 24, 36, 46)] + [(54, p, 8, 4) for p in (14, 24, 36, 46)]


def layers(request: float, limit: float) -> list[tuple[tuple[int, int, int], Shape]]:
    """The logo as (colour, shape) layers, bottom first, in a 64-unit square."""
    shapes: list[tuple[tuple[int, int, int], Shape]] = [
        (PIN, _rounded_rect(x, y, x + w, y + h, 1)) for x, y, w, h in PINS
    ]
    shapes.append((CHIP, _rounded_rect(8, 8, 56, 56, 7)))
    shapes.append((DIAL, _wedge(32, 32, 18, 0.0, 1.0)))
    if limit > request:
        shapes.append((LIMIT, _wedge(32, 32, 18, 0.0, limit)))
    shapes.append((REQUEST, _wedge(32, 32, 18, 0.0, request)))
    return shapes


def svg(request: float, limit: float) -> str:
    """The logo as SVG (the same shapes, as vector paths)."""

    def colour(rgb: tuple[int, int, int]) -> str:
        return "#{:02x}{:02x}{:02x}".format(*rgb)

    def arc(end: float) -> str:
        if end >= 1.0:
            return '<circle cx="32" cy="32" r="18" fill="{c}"/>'
        a = 2 * math.pi * end
        x, y = 32 + 18 * math.sin(a), 32 - 18 * math.cos(a)
        large = 1 if end > 0.5 else 0
        return f'<path d="M32 32 L32 14 A18 18 0 {large} 1 {x:.3f} {y:.3f} Z" fill="{{c}}"/>'

    parts = [
        f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="1" fill="{colour(PIN)}"/>'
        for x, y, w, h in PINS
    ]
    parts.append(f'<rect x="8" y="8" width="48" height="48" rx="7" fill="{colour(CHIP)}"/>')
    parts.append(f'<circle cx="32" cy="32" r="18" fill="{colour(DIAL)}"/>')
    if limit > request:
        parts.append(arc(limit).format(c=colour(LIMIT)))
    parts.append(arc(request).format(c=colour(REQUEST)))
    title = f"GPU share {request:.0%}" + (f"–{limit:.0%}" if limit > request else "")
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64" viewBox="0 0 64 64">'
        f"<title>{title}</title>{''.join(parts)}</svg>\n"
    )


def png(request: float, limit: float, size: int) -> bytes:
    """The logo as an RGBA PNG of ``size`` x ``size`` pixels (4x4 samples per pixel)."""
    shapes = layers(request, limit)
    n = 4
    scale = 64 / size
    rows = []
    for py in range(size):
        row = bytearray([0])  # filter: none
        for px in range(size):
            acc = [0.0, 0.0, 0.0]
            covered = 0
            for sy in range(n):
                for sx in range(n):
                    x, y = (px + (sx + 0.5) / n) * scale, (py + (sy + 0.5) / n) * scale
                    for rgb, inside in reversed(shapes):  # topmost first
                        if inside(x, y):
                            acc = [a + c for a, c in zip(acc, rgb, strict=True)]
                            covered += 1
                            break
            if covered:
                row += bytes(round(a / covered) for a in acc)
                row.append(round(255 * covered / (n * n)))
            else:
                row += b"\0\0\0\0"
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0)  # 8-bit RGBA
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows), 9))
        + chunk(b"IEND", b"")
    )


def share_of(kernelspec: Path) -> tuple[float, float]:
    """Request and limit a kernelspec asks for (``metadata.kernel_provisioner.config``)."""
    config = json.loads((kernelspec / "kernel.json").read_text())["metadata"]
    config = config["kernel_provisioner"]["config"]
    request = float(config.get("gpu_request", 0.25))
    return request, float(config.get("gpu_limit", max(request, 0.5)))


def files(kernelspec: Path) -> dict[str, bytes]:
    """The logo files a kernelspec directory should hold."""
    request, limit = share_of(kernelspec)
    return {
        "logo-svg.svg": svg(request, limit).encode(),
        "logo-32x32.png": png(request, limit, 32),
        "logo-64x64.png": png(request, limit, 64),
    }


def main(argv: list[str] | None = None) -> int:
    """Write the logos of every kernelspec under ``kernelspecs/`` (or the folders given)."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(__file__).resolve().parent.parent / "kernelspecs"
    folders = [Path(a) for a in args] or sorted(p for p in root.iterdir() if p.is_dir())
    for folder in folders:
        for name, data in files(folder).items():
            (folder / name).write_bytes(data)
            print(f"wrote {folder / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
