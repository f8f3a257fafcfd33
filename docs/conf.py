"""Sphinx configuration of the jupyter_gpushare documentation.

Build: ``python3 -m sphinx -W -b html docs docs/_build/html`` (CI does, warnings as errors).
The reference pages are generated from the code and benchmarks/results/ at build time by the
directives in ``_ext/gpushare_docs.py``; nothing in them is copied by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

import jupyter_gpushare  # noqa: E402  (the installed package: `pip install -e .[docs]`)

project = "jupyter_gpushare"
author = "jupyter_gpushare contributors"
copyright = "jupyter_gpushare contributors"
release = jupyter_gpushare.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "autodoc_traits",
    "sphinxcontrib.openapi",
    "gpushare_docs",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_generated", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# the README and the deploy guides are written for GitHub: their links to files outside the
# documentation are paths, not documents
myst_linkify_fuzzy_links = False

autodoc_member_order = "bysource"
autodoc_typehints = "none"

html_theme = "pydata_sphinx_theme"
html_title = f"jupyter_gpushare {release}"
html_static_path = ["_static"]
html_css_files = ["css/gpushare.css"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 7,
    "footer_start": ["copyright"],
    "footer_end": [],
    "secondary_sidebar_items": ["page-toc"],
}
html_sidebars = {"index": [], "changelog": []}
html_show_sourcelink = False
