"""The committed, prebuilt lab extension matches its sources (no Node needed to check).

`npm run build:prod` in labextension/ writes jupyter_gpushare/labextension/source.sha256 (see
labextension/scripts/source-hash.js); editing labextension/src, style or package.json without
rebuilding makes this test fail.
"""

from __future__ import annotations

import hashlib

from support import REPO

SOURCE = REPO / "labextension"


def test_prebuilt_extension_matches_sources() -> None:
    files = ["package.json"] + [
        p.relative_to(SOURCE).as_posix()
        for folder in ("src", "style")
        for p in (SOURCE / folder).rglob("*")
        if p.is_file()
    ]
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0")
        digest.update((SOURCE / rel).read_bytes())
        digest.update(b"\0")
    recorded = (REPO / "jupyter_gpushare" / "labextension" / "source.sha256").read_text().strip()
    assert digest.hexdigest() == recorded, (
        "labextension/ changed since the committed build: run `npm ci && npm run build:prod` in "
        "labextension/ and commit jupyter_gpushare/labextension/"
    )
