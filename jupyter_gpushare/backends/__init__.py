"""Backends, found by entry point: where kernels run and where their shares are recorded.

Like ``jupyter_client.kernel_provisioners``: a package registers a :class:`~.base.Backend`
subclass in the entry point group ``jupyter_gpushare.backends`` under its name, e.g. in
``pyproject.toml``::

    [project.entry-points."jupyter_gpushare.backends"]
    local = "jupyter_gpushare.backends.local:LocalBackend"
    kubernetes = "jupyter_gpushare.backends.kubernetes:KubernetesBackend"

and ``c.GpuShare.backend = "<name>"`` (or a kernelspec's ``backend`` key) selects it. Nothing
else in the package names a backend: callers ask the configured one
(``GpuShare.get_backend()``). The implementations are loaded on first use only.
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points

from ..share import ShareError
from .base import Backend, KernelBackend

GROUP = "jupyter_gpushare.backends"
DEFAULT = "local"


@functools.cache  # read once per process: scanning every distribution costs milliseconds
def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def names() -> list[str]:
    """The names of the installed backends."""
    return sorted(_entry_points())


def allowed() -> str:
    return "one of the installed backends: " + ", ".join(repr(n) for n in names())


def check_name(name: object, field: str = "backend") -> str:
    """``name`` if a backend is registered under it; else a :class:`ShareError` naming
    ``field``, the value and the installed backends."""
    if not isinstance(name, str) or name not in _entry_points():
        raise ShareError(field, name, allowed())
    return name


def backend_class(name: str) -> type[Backend]:
    """The backend registered as ``name`` (loaded now)."""
    found = _entry_points().get(check_name(name))
    assert found is not None
    cls = found.load()
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"entry point {GROUP}:{name} is {cls!r}, not a Backend subclass")
    return cls


__all__ = [
    "DEFAULT",
    "GROUP",
    "Backend",
    "KernelBackend",
    "allowed",
    "backend_class",
    "check_name",
    "names",
]
