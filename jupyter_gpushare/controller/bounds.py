"""Per-user bounds and quotas applied by the controller.

A *bound* is the most one share of a user may hold; a *quota* the most compute (in GPUs, the sum
of their shares' requests) all of a user's shares may hold together.

Configured on the controller (``c.GpushareController.user_bounds`` / ``group_bounds`` /
``default_bound``, share objects like ``{"gpu_request": 0.25, "gpu_limit": 0.5}``); a user's
bound is the tightest of their own entry and those of their JupyterHub groups
(:func:`jupyter_gpushare.bound.tightest`), else the default. The bound is recorded on the
allocation when it is placed (:func:`jupyter_gpushare.bound.record`), and every resize is checked
against the recorded bound, so a later change of config or groups does not lift it for a running
share. Quotas (``user_quotas`` / ``group_quotas`` / ``default_quota``) are checked on every
placement and every resize against what the user holds then. Admins have neither unless
configured. Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..bound import tightest
from ..share import SHARE_FIELDS, ShareError, ShareSpec
from .auth import HubUser


def parse_bounds(mapping: Mapping[str, Any], setting: str) -> dict[str, ShareSpec]:
    """``{name: share object}`` from config; a bad entry names the setting and the key."""
    out = {}
    for name, value in mapping.items():
        if not isinstance(value, Mapping):
            raise ShareError(
                f"{setting}[{name!r}]",
                value,
                "a share object like {'gpu_request': 0.25, 'gpu_limit': 0.5}",
            )
        given = {k: v for k, v in value.items() if v is not None}
        unknown = sorted(set(given) - set(SHARE_FIELDS))
        if unknown:
            raise ShareError(
                f"{setting}[{name!r}].{unknown[0]}",
                given[unknown[0]],
                "one of " + ", ".join(SHARE_FIELDS),
            )
        out[str(name)] = ShareSpec.from_mapping(given)
    return out


class Bounds:
    def __init__(
        self,
        users: Mapping[str, ShareSpec],
        groups: Mapping[str, ShareSpec],
        default: ShareSpec | None,
    ) -> None:
        self.users = dict(users)
        self.groups = dict(groups)
        self.default = default

    def of(self, user: HubUser) -> ShareSpec | None:
        """The bound of ``user``: their entry and their groups' entries, tightest wins; with
        none of those, the default (admins: none)."""
        found = [self.users.get(user.name), *(self.groups.get(g) for g in user.groups)]
        if any(b is not None for b in found):
            return tightest(found)
        return None if user.admin else self.default


class Quotas:
    def __init__(
        self, users: Mapping[str, float], groups: Mapping[str, float], default: float | None
    ) -> None:
        for setting, mapping in (("user_quotas", users), ("group_quotas", groups)):
            for name, value in mapping.items():
                if (
                    not isinstance(value, (int, float))
                    or isinstance(value, bool)
                    or not 0 < value <= 100_000
                ):
                    raise ShareError(
                        f"{setting}[{name!r}]", value, "GPUs of compute, a number > 0 (0.5, 2, ...)"
                    )
        self.users = {str(k): float(v) for k, v in users.items()}
        self.groups = {str(k): float(v) for k, v in groups.items()}
        self.default = default

    def of(self, user: HubUser) -> float | None:
        """The most compute all of ``user``'s shares may request together, or None."""
        found = [
            q
            for q in (self.users.get(user.name), *(self.groups.get(g) for g in user.groups))
            if q is not None
        ]
        if found:
            return min(found)
        return None if user.admin else self.default


__all__ = ["Bounds", "Quotas", "parse_bounds"]
