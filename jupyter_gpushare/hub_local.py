"""The JupyterHub GPU form for one machine: LocalProcessSpawner, SystemdSpawner, TLJH.

These spawners have no ``profile_list``; the same choices as :class:`.hub.GpuProfiles` (GPU
type with its free capacity now, share, memory cap, custom values, CPU-only profiles) are
offered through JupyterHub's generic ``options_form``, and the pick reaches the user's server in
its environment (``GPUSHARE_DEFAULT_SHARE``, ``GPUSHARE_MAX_SHARE``). In
``jupyterhub_config.py`` (TLJH: ``/opt/tljh/config/jupyterhub_config.d/gpushare.py``)::

    from jupyter_gpushare.hub_local import LocalGpuForm
    gpu = LocalGpuForm(config=c)
    c.Spawner.options_form = gpu.options_form            # per request (inventory_ttl cache)
    c.Spawner.options_from_form = gpu.options_from_form  # refuses bad values on the form
    c.Spawner.environment.update(gpu.environment())      # the pick, checked again at start

The inventory is the machine's system agent (``jupyter gpushare daemon --system``: its GPUs and
the shares held now, read through :class:`~jupyter_gpushare.ledger.agent.AgentLedger`), unless
``c.GpuProfiles.inventory`` names another. The bound in the environment is the user's own to
edit; the agent's ``--max-share``/``--group-max-share`` are the bounds that hold regardless.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from typing import Any

from .hub import (
    ENV_DEFAULT,
    ENV_DISABLED,
    ENV_MAX,
    OPT_MEMORY,
    OPT_SHARE,
    OPT_TYPE,
    GpuOptionError,
    GpuProfiles,
    TypeOffer,
    ledger_inventory,
    share_environment,
    share_from_options,
)

#: form fields this form reads (anything else in a POST is ignored)
FIELDS = (
    "profile",
    OPT_TYPE,
    OPT_SHARE,
    OPT_MEMORY,
    f"{OPT_TYPE}--unlisted-choice",
    f"{OPT_SHARE}--unlisted-choice",
    f"{OPT_MEMORY}--unlisted-choice",
)


async def agent_inventory(spawner: Any) -> list[TypeOffer]:
    """This machine's GPUs and what is free on them, from its node agent."""
    import asyncio

    from .ledger.agent import AgentLedger
    from .paths import find_agent

    found = await asyncio.to_thread(find_agent)
    return await ledger_inventory(AgentLedger(found.socket))(spawner)


class LocalGpuForm(GpuProfiles):
    """:class:`GpuProfiles` for spawners with a generic ``options_form``."""

    async def offers(self, spawner: Any) -> list[TypeOffer]:
        if self.inventory is None:
            self.inventory = agent_inventory
        return await super().offers(spawner)

    async def options_form(self, spawner: Any) -> str:
        """``Spawner.options_form`` callable: the profiles as radio buttons, the GPU choices
        with the free capacity of each type now."""
        try:
            offers = await self.offers(spawner)
            problem = ""
        except Exception as exc:  # the CPU-only profiles must stay usable
            self.log.warning("gpushare: GPU inventory unavailable: %s", exc)
            offers, problem = [], f"GPU inventory unavailable ({exc})."
        gpu = self._gpu_profile(offers, problem)
        options = gpu["profile_options"]
        parts = [self._radio(gpu, checked=True)]
        for name in (OPT_TYPE, OPT_SHARE, OPT_MEMORY):
            parts.append(_select(name, options[name]))
        parts.extend(self._radio(p, checked=False) for p in self.cpu_profiles)
        return "\n".join(parts)

    def options_from_form(
        self, formdata: Mapping[str, list[str]], spawner: Any = None
    ) -> dict[str, Any]:
        """``Spawner.options_from_form``: the fields of this form; a bad GPU value is refused
        with its reason (JupyterHub shows it on the form)."""
        options = {k: str(v[0]) for k, v in formdata.items() if k in FIELDS and v}
        slugs = [self._slug(self.gpu_profile)] + [self._slug(p) for p in self.cpu_profiles]
        profile = options.setdefault("profile", slugs[0])
        if profile not in slugs:
            raise GpuOptionError(f"profile={profile!r} is not allowed: one of {', '.join(slugs)}")
        if profile == slugs[0]:
            share_from_options(options, None, self.max_request, self._max_memory())
        return options

    def environment(self) -> dict[str, Callable[[Any], str]]:
        """``Spawner.environment`` entries (callables, run when the server starts): the picked
        share as default and bound, checked again then (options may come from JupyterHub's
        REST API, not the form); a CPU-only profile clears them. ``CUDA_VISIBLE_DEVICES`` is
        empty in the server either way: only gpushare kernels and ``jupyter gpushare run``,
        which get their GPU from their share, see one."""

        def pick(spawner: Any) -> dict[str, str]:
            options = dict(spawner.user_options or {})
            if options.get("profile", self._slug(self.gpu_profile)) != self._slug(self.gpu_profile):
                return {ENV_DEFAULT: "", ENV_MAX: "", ENV_DISABLED: "1", "CUDA_VISIBLE_DEVICES": ""}
            spec = share_from_options(options, None, self.max_request, self._max_memory())
            env = {k: v or "" for k, v in share_environment(spec).items()}
            return {**env, ENV_DISABLED: ""}

        def variable(name: str) -> Callable[[Any], str]:
            def value(spawner: Any) -> str:
                return pick(spawner).get(name, "")

            return value

        names = (ENV_DEFAULT, ENV_MAX, ENV_DISABLED, "CUDA_VISIBLE_DEVICES")
        return {name: variable(name) for name in names}

    # -- rendering ------------------------------------------------------------------------------

    @staticmethod
    def _slug(profile: Mapping[str, Any]) -> str:
        return str(profile.get("slug") or "gpu")

    def _radio(self, profile: Mapping[str, Any], checked: bool) -> str:
        slug = html.escape(self._slug(profile), quote=True)
        label = html.escape(str(profile.get("display_name", slug)))
        about = html.escape(str(profile.get("description", "")))
        mark = " checked" if checked else ""
        return (
            f'<div class="radio"><label><input type="radio" name="profile" '
            f'value="{slug}"{mark}> <strong>{label}</strong> {about}</label></div>'
        )


def _select(name: str, option: Mapping[str, Any]) -> str:
    """One GPU option as a ``<select>``, with a text field for a custom value where allowed."""
    label = html.escape(str(option.get("display_name", name)))
    rows = []
    for value, choice in option["choices"].items():
        selected = " selected" if choice.get("default") else ""
        rows.append(
            f'<option value="{html.escape(str(value), quote=True)}"{selected}>'
            f"{html.escape(str(choice.get('display_name', value)))}</option>"
        )
    out = (
        f'<div class="form-group"><label for="{name}">{label}</label>'
        f'<select class="form-control" name="{name}" id="{name}">{"".join(rows)}</select>'
    )
    custom = option.get("unlisted_choice") or {}
    if custom.get("enabled"):
        pattern = html.escape(str(custom.get("validation_regex", "")), quote=True)
        hint = html.escape(str(custom.get("validation_message", "")), quote=True)
        out += (
            f'<input class="form-control" type="text" name="{name}--unlisted-choice" '
            f'placeholder="{html.escape(str(custom.get("display_name", "")), quote=True)}" '
            f'pattern="{pattern}" title="{hint}">'
        )
    return out + "</div>"


__all__ = ["LocalGpuForm", "agent_inventory"]
