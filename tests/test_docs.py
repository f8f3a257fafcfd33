"""The README, CHANGELOG and DEVELOPING keep their promises to readers.

The README stays short (at most 150 lines) and keeps the two quick-start commands CI runs;
every file it, DEVELOPING.md and the documentation's index point to exists; the changelog's
newest entry names the package's version and reads in users' words (versions, not work periods).
The documentation site itself is built by CI with warnings as errors (``.ci/run``).
"""

from __future__ import annotations

import re

from support import REPO

import jupyter_gpushare

README = (REPO / "README.md").read_text()
LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)\s]+)\)")


def test_the_readme_is_short_and_keeps_the_quick_start() -> None:
    assert len(README.splitlines()) <= 150
    assert "pip install . && jupyter gpushare lab --simulate 2xA100" in README
    assert "bash .ci/run" in README
    assert "the README's test command (`bash .ci/run`)" in (REPO / ".ci" / "run").read_text()


def test_links_to_files_of_the_repository_exist() -> None:
    for name in ("README.md", "DEVELOPING.md", "CHANGELOG.md"):
        for target in LINK.findall((REPO / name).read_text()):
            assert (REPO / target.split("#")[0]).exists(), f"{name} links to {target}"
    for path in re.findall(r"`((?:docs|deploy|tests|benchmarks)/[\w./-]+)`", README):
        assert (REPO / path).exists(), f"README.md names {path}"
    for path in re.findall(r"`(docs/[\w./-]+)`", (REPO / "DEVELOPING.md").read_text()):
        assert (REPO / path).exists(), f"DEVELOPING.md names {path}"


def test_the_changelog_names_this_version_first_and_no_work_periods() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## (\S+)", text, re.M)
    assert versions and versions[0] == jupyter_gpushare.__version__, versions
    assert not re.search(r"^#.*\bsession\b", text, re.M | re.I)
    for heading in re.findall(r"^### (.+)$", text, re.M):
        assert heading in {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
