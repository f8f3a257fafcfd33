"""jupyter_gpushare: fractional GPU shares for Jupyter kernels.

See README.md for the user's view and DEVELOPING.md for the boxes and their contracts.
"""

from __future__ import annotations

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "jupyter_gpushare.serverext"}]
