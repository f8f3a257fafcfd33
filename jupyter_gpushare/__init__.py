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


def panel(interval: float = 1.0) -> Any:
    """A live ipywidgets panel of this kernel's GPU share, with a Release button."""
    from .notebook.panel import panel as make

    return make(interval)


def status() -> dict[str, Any]:
    """This kernel's share and its GPU now (see :func:`.notebook.actions.status`)."""
    from .notebook.actions import status as get

    return get()


def gpus() -> list[dict[str, Any]]:
    """Every GPU in the ledger with its free capacity."""
    from .notebook.actions import gpus as get

    return get()


def release() -> dict[str, Any]:
    """Give this kernel's GPU share back; the kernel keeps running without a GPU."""
    from .notebook.actions import release as do

    return do()


def request(
    gpu_request: float | str | None = None,
    gpu_limit: float | str | None = None,
    gpu_memory: int | str | None = None,
    gpu_type: str | None = None,
) -> dict[str, Any]:
    """Change this kernel's share live, or reserve a new one after a release."""
    from .notebook.actions import request as do

    return do(gpu_request, gpu_limit, gpu_memory, gpu_type)
