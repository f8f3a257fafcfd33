"""Per-user bounds: the most one allocation may ever hold (beside the share spec, box 1).

A bound comes from JupyterHub (``GPUSHARE_MAX_SHARE``: what the user picked when their server
started) and from the node agent's admin (``--max-share``, ``--group-max-share``); where several
apply, the smallest of each field wins (:func:`tightest`). The bound is *recorded on the
allocation* when it is created (``extra["bound"]``, :func:`record`), so every later change of that
allocation — ``PATCH``, the kernel's ``resize``, a ``reserve`` after a release — is checked
against the recorded bound (:func:`check_within`) by whoever writes the ledger (the node agent in
system mode), and the holder cannot lift it by asking again.

Pure functions over :class:`~jupyter_gpushare.share.ShareSpec`; the one reading is
:func:`share_from_environment` (the user's server reads what JupyterHub passed it, here and not
in :mod:`jupyter_gpushare.hub`, so the server never imports the Hub's module).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .share import ShareError, ShareSpec, format_bytes

#: JupyterHub -> the user's server: the JSON share kernels get when they ask for nothing, and the
#: most a kernel of that server may ask for (set by :mod:`jupyter_gpushare.hub`'s profiles)
ENV_DEFAULT = "GPUSHARE_DEFAULT_SHARE"
ENV_MAX = "GPUSHARE_MAX_SHARE"

#: ``Allocation.extra`` key holding the recorded bound (``{gpu_request, gpu_limit, gpu_memory}``)
EXTRA_KEY = "bound"

_WHY = "(the most this share may use: its user's bound, recorded when it was created)"


def tightest(bounds: Iterable[ShareSpec | None]) -> ShareSpec | None:
    """The smallest of each field over ``bounds`` (None entries ignored; None if none)."""
    given = [b for b in bounds if b is not None]
    if not given:
        return None
    request = min(b.gpu_request for b in given)
    limit = min(b.gpu_limit for b in given)
    memories = [b.gpu_memory for b in given if b.gpu_memory is not None]
    types = {b.gpu_type.lower(): b.gpu_type for b in given if b.gpu_type is not None}
    if len(types) > 1:  # two bounds naming different types admit no GPU at all
        raise ShareError(
            "gpu_type",
            sorted(types.values()),
            "one GPU type across the bounds that apply to this user",
        )
    return ShareSpec(
        gpu_request=min(request, limit),
        gpu_limit=limit,
        gpu_memory=min(memories) if memories else None,
        gpu_type=next(iter(types.values()), None),
    )


def to_json(bound: ShareSpec) -> dict[str, Any]:
    return {
        "gpu_request": bound.gpu_request,
        "gpu_limit": bound.gpu_limit,
        "gpu_memory": bound.gpu_memory,
        "gpu_type": bound.gpu_type,
    }


def from_json(data: object, field: str = "bound") -> ShareSpec | None:
    """A bound as :func:`to_json` wrote it (None for None); a malformed one is a ShareError."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ShareError(field, data, "an object with gpu_request, gpu_limit, gpu_memory")
    known = {
        k: v
        for k, v in data.items()
        if k in ("gpu_request", "gpu_limit", "gpu_memory", "gpu_type") and v is not None
    }
    return ShareSpec.from_mapping(known)


def recorded(extra: Mapping[str, Any]) -> ShareSpec | None:
    """The bound recorded on an allocation (its ``extra``), or None."""
    return from_json(extra.get(EXTRA_KEY))


def record(extra: Mapping[str, Any], bound: ShareSpec | None) -> dict[str, Any]:
    """``extra`` with ``bound`` recorded (the key removed for None)."""
    out = {k: v for k, v in extra.items() if k != EXTRA_KEY}
    if bound is not None:
        out[EXTRA_KEY] = to_json(bound)
    return out


def check_within(spec: ShareSpec, memory: int, bound: ShareSpec | None, why: str = _WHY) -> None:
    """Raise :class:`ShareError` naming the field when the share ``spec`` (memory cap ``memory``
    bytes per GPU) is over ``bound``; ``why`` says whose bound it is."""
    if bound is None:
        return
    if spec.gpu_count > 1:
        raise ShareError("gpu_count", spec.gpu_count, f"1 {why}")
    if spec.gpu_request > bound.gpu_request + 1e-9:
        raise ShareError("gpu_request", spec.gpu_request, f"at most {bound.gpu_request:g} {why}")
    if spec.gpu_limit > bound.gpu_limit + 1e-9:
        raise ShareError("gpu_limit", spec.gpu_limit, f"at most {bound.gpu_limit:g} {why}")
    if bound.gpu_memory is not None and memory > bound.gpu_memory:
        raise ShareError(
            "gpu_memory", format_bytes(memory), f"at most {format_bytes(bound.gpu_memory)} {why}"
        )
    if (
        bound.gpu_type is not None
        and spec.gpu_type is not None
        and spec.gpu_type.lower() != bound.gpu_type.lower()
    ):
        raise ShareError("gpu_type", spec.gpu_type, f"{bound.gpu_type} {why}")


def narrowed(spec: ShareSpec, bound: ShareSpec | None, why: str = _WHY) -> ShareSpec:
    """``spec`` with what it leaves open filled from ``bound`` (type, memory cap), so placement
    picks within it; over the bound is refused as :func:`check_within` does."""
    if bound is None:
        return spec
    if bound.gpu_type is not None and spec.gpu_type is None:
        spec = spec.with_changes(gpu_type=bound.gpu_type)
    if bound.gpu_memory is not None and spec.gpu_memory is None:
        spec = spec.with_changes(gpu_memory=bound.gpu_memory)
    check_within(spec, spec.gpu_memory or 0, bound, why)
    return spec


def share_from_environment(name: str, environ: Mapping[str, str] | None = None) -> ShareSpec | None:
    """The share JupyterHub put in ``GPUSHARE_DEFAULT_SHARE`` / ``GPUSHARE_MAX_SHARE`` (None when
    unset). Read by the user's server: the default share and the bound of its kernels."""
    text = (environ if environ is not None else os.environ).get(name, "")
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise ShareError(name, text, "a JSON object with share keys (set by JupyterHub)") from None
    return ShareSpec.from_mapping({k: v for k, v in data.items() if v is not None})


def apply_user_bound(spec: ShareSpec, bound: ShareSpec | None) -> ShareSpec:
    """``spec`` within the server's upper bound (what the user picked in JupyterHub).

    Over the bound is refused with a :class:`ShareError`; a type or memory cap left open is
    filled in from the bound. The rules are :func:`narrowed`'s (a node agent holds every later
    change of the share to the same bound).
    """
    why = "(the most this server's kernels may use, picked when it was started in JupyterHub)"
    return narrowed(spec, bound, why)
