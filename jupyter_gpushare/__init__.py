"""jupyter_gpushare: fractional GPU shares for Jupyter kernels.

See README.md for the user's view and DEVELOPING.md for the boxes and their contracts.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "jupyter_gpushare.serverext"}]


# -- inside a kernel (box 9): imported lazily, so the server never loads ipywidgets or IPython --


def load_ipython_extension(ipython: Any) -> None:
    """``--ext=jupyter_gpushare`` (gpushare kernels) or ``%load_ext jupyter_gpushare``: the
    ``%gpushare`` magics."""
    from .notebook.magics import load_ipython_extension as load

    load(ipython)


#: the plain-Python API of a gpushare kernel: name -> module that defines it
_KERNEL_API = {
    "panel": "jupyter_gpushare.notebook.panel",
    "status": "jupyter_gpushare.notebook.actions",
    "gpus": "jupyter_gpushare.notebook.actions",
    "release": "jupyter_gpushare.notebook.actions",
    "request": "jupyter_gpushare.notebook.actions",
}
__all__ = ["__version__", "load_ipython_extension", *_KERNEL_API]


def __getattr__(name: str) -> Any:
    """``jupyter_gpushare.panel()``, ``.status()``, ``.gpus()``, ``.release()``, ``.request()``:
    the functions of :mod:`.notebook.panel` and :mod:`.notebook.actions`, loaded on first use."""
    if name in _KERNEL_API:
        import importlib

        return getattr(importlib.import_module(_KERNEL_API[name]), name)
    raise AttributeError(f"module 'jupyter_gpushare' has no attribute {name!r}")
