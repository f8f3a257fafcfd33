"""The node agent as the owner of its node's ledger (system mode, issue 12).

On a shared machine the agent (``jupyter gpushare daemon --system``, root) is the only process
that opens the SQLite ledger (``/var/lib/gpushare/ledger.sqlite``, 0600 in a 0700 directory).
Users' servers, ``jupyter gpushare run``, provisioners and kernels reach it through
:class:`~jupyter_gpushare.ledger.agent.AgentLedger`, which speaks these ops on the agent's socket:

``ledger.snapshot`` → ``{"ok", "allocations": [Allocation…], "versions": {node: v}}``. A caller
    who is not an admin sees its own allocations whole and everyone else's only as capacity
    (:func:`redact`: id, node, GPUs, share, memory, state; no user, kernel id, pid or extra).
``ledger.cas`` ``{"node", "version", "allocations": [...], "bound": {...}|null}`` (a record
    kept as it is may be sent as ``{"id", "keep": true}``) →
    ``{"ok": true, "swapped": bool, "added": [the new records as stamped]}`` or a refusal.
    With ``"snapshot": true`` a swap that took effect also says the node's new ``"version"``
    (it holds what was proposed, new records as in ``added``), and a lost one carries the
    ledger as the caller may see it (``allocations``, ``versions``), so that the caller's next
    change needs no ``ledger.snapshot``.
    Authorized by diffing the node's current allocations against the proposed ones
    (:func:`authorize`): a non-admin may add, change or remove only allocations whose owner
    uid (``extra["uid"]``) is its own; added records are stamped with the caller's uid and
    user name and with the bound that applies (the smallest of the caller's ``bound``, the
    agent's ``--max-share`` and its groups' bounds); the uid, user and bound of a record can
    then not be changed by its holder, and every change is checked against the recorded
    bound. A non-admin's new record names its holder (``pid`` or ``server_pid``, a process of
    the caller's, its start time stamped by the agent from /proc, or refused when the caller
    sent another: :func:`_identify_holders`), so the agent's reconciliation releases it when
    that process is gone, and never mistakes a later process with its PID for it; it
    goes only to GPUs the deployment admits (not cordoned, not an excluded type). The result
    is checked for capacity (no GPU's requests over 1, no GPU's memory caps over its memory,
    no GPU with more than ``MAX_SHARES_PER_GPU`` shares, its lease board's slots) and a
    non-admin for its number of shares (``--max-shares-per-user``, default 16).
``ledger.gpus`` → ``{"ok", "gpus": [Gpu…]}``; ``ledger.put_gpus`` (admins only: the agent
    publishes its node's inventory itself).

Identity comes from the socket's peer credentials (``SO_PEERCRED``, :class:`Client.uid`), read at
the edge (:func:`caller`); everything behind takes a checked :class:`Caller`.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import bound as bounds
from ..inventory import Gpu, TypeAliases
from ..ledger import Allocation, LedgerUnavailable, Snapshot
from ..placement import Policy
from ..placement.engine import SETTLED
from ..placement.state import MAX_SHARES_PER_GPU
from ..share import ShareError, ShareSpec
from . import wire
from .ratelog import RateLimitedLogs

if TYPE_CHECKING:
    from .server import Client, Daemon

log = logging.getLogger("jupyter_gpushare.daemon")

#: ``Allocation.extra`` key: the uid that owns an allocation made through the agent
UID_KEY = "uid"
#: ``Allocation.extra`` key on a record shown to a caller who does not own it
REDACTED_KEY = "redacted"
#: how long a uid's groups are cached (s)
GROUPS_TTL_S = 10.0
#: the most shares one user holds on this node at once (``--max-shares-per-user``): 64 tiny
#: shares would fill a GPU's lease board, whatever compute is left free on it
MAX_SHARES_PER_USER = 16


@dataclass
class Access:
    """Who may do what on this agent (set from the command line by :mod:`.cli`)."""

    system: bool = False
    #: members of these gids are admins (root and the agent's own uid always are; the
    #: connection's ``Peer.admin`` decides where the agent has one)
    admin_gids: frozenset[int] = frozenset()
    #: when set, only members of this gid (and admins) may use the GPUs
    user_gid: int | None = None
    #: the agent's bound for every allocation (``--max-share``)
    max_share: ShareSpec | None = None
    #: per-group bounds (``--group-max-share GROUP=…``): gid -> bound
    group_bounds: Mapping[int, ShareSpec] = field(default_factory=dict)
    #: how many shares one user may hold on this node (``--max-shares-per-user``; 0: no bound)
    max_shares_per_user: int = MAX_SHARES_PER_USER
    #: the deployment's placement policy (``reserve``) and type aliases
    policy: Policy = field(default_factory=Policy)
    aliases: TypeAliases = field(default_factory=TypeAliases)
    _groups: dict[int, tuple[float, frozenset[int]]] = field(default_factory=dict)
    #: refusals, logged at most once a minute per uid and kind, with a count
    refusals: RateLimitedLogs = field(
        default_factory=lambda: RateLimitedLogs(log, "refused ledger.cas")
    )

    def groups_of(self, uid: int) -> frozenset[int]:
        cached = self._groups.get(uid)
        if cached is not None and time.monotonic() - cached[0] < GROUPS_TTL_S:
            return cached[1]
        try:
            entry = pwd.getpwuid(uid)
            gids = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
        except KeyError:  # a uid with no passwd entry: no groups
            gids = frozenset()
        self._groups[uid] = (time.monotonic(), gids)
        return gids


_ACCESS: weakref.WeakKeyDictionary[Any, Access] = weakref.WeakKeyDictionary()


def configure(daemon: Daemon, access: Access) -> None:
    _ACCESS[daemon] = access


def access_of(daemon: Daemon) -> Access:
    found = _ACCESS.get(daemon)
    if found is None:
        found = _ACCESS[daemon] = Access()
    return found


@dataclass(frozen=True)
class Caller:
    """A checked identity: the peer's uid, its user name, and whether it is an admin."""

    uid: int
    name: str
    admin: bool
    groups: frozenset[int]
    #: the most shares this caller may hold on the node (None: no bound; admins have none)
    max_shares: int | None = None


def caller(daemon: Daemon, client: Client) -> Caller:
    """The checked identity of ``client``: its peer credentials as the connection read them
    (``Client.peer``: uid, and admin = uid 0, the agent's uid or the admin group, never a
    process in a kernel pod)."""
    access = access_of(daemon)
    groups = access.groups_of(client.uid)
    peer = getattr(client, "peer", None)
    if peer is not None:
        admin = bool(peer.admin)
    else:
        admin = client.uid in (0, os.geteuid()) or bool(groups & access.admin_gids)
    try:
        name = pwd.getpwuid(client.uid).pw_name
    except KeyError:
        name = str(client.uid)
    most = access.max_shares_per_user if access.system and not admin else 0
    return Caller(client.uid, name, admin, groups, most or None)


def may_use(daemon: Daemon, who: Caller) -> dict[str, Any] | None:
    """None when ``who`` may use this agent's GPUs, else the refusal."""
    access = access_of(daemon)
    if who.admin:
        return None
    if not access.system:
        return wire.refusal(
            wire.E_NOT_PERMITTED,
            f"this is user {os.geteuid()}'s own gpushare "
            f"agent; uid {who.uid} may not use its ledger",
        )
    if access.user_gid is not None and access.user_gid not in who.groups:
        return wire.refusal(
            wire.E_NOT_PERMITTED,
            f"user {who.name} is not in group "
            f"{_group_name(access.user_gid)}, which may use this machine's GPUs",
        )
    return None


def bound_for(daemon: Daemon, who: Caller, asked: ShareSpec | None) -> ShareSpec | None:
    """The bound to record on an allocation ``who`` creates: the smallest of what its server
    asked (JupyterHub's ``GPUSHARE_MAX_SHARE``), the agent's and its groups' bounds."""
    access = access_of(daemon)
    group = [b for gid, b in access.group_bounds.items() if gid in who.groups]
    return bounds.tightest([asked, access.max_share, *group])


def owner_uid(allocation: Allocation) -> int | None:
    uid = allocation.extra.get(UID_KEY)
    return uid if isinstance(uid, int) and not isinstance(uid, bool) else None


def redact(allocation: Allocation) -> Allocation:
    """What a caller who does not own ``allocation`` sees: its capacity only."""
    extra: dict[str, Any] = {REDACTED_KEY: True}
    if allocation.extra.get(SETTLED):  # placement orders affinity groups by it
        extra[SETTLED] = True
    return Allocation(
        id=allocation.id,
        node=allocation.node,
        gpus=allocation.gpus,
        spec=allocation.spec,
        memory=allocation.memory,
        owner="other",
        backend=allocation.backend,
        state=allocation.state,
        created=allocation.created,
        extra=extra,
    )


def visible(allocation: Allocation, who: Caller) -> Allocation:
    return allocation if who.admin or owner_uid(allocation) == who.uid else redact(allocation)


# -- ops -----------------------------------------------------------------------------------------


async def handle(daemon: Daemon, client: Client, message: dict[str, Any]) -> dict[str, Any]:
    op = message.get("op")
    who = caller(daemon, client)
    refusal = may_use(daemon, who)
    if refusal is not None:
        return refusal
    try:
        if op == "ledger.snapshot":
            snap = await daemon.ledger.snapshot()
            return {"ok": True, "allocations": _shown(snap, who), "versions": dict(snap.versions)}
        if op == "ledger.gpus":
            return {"ok": True, "gpus": [g.to_json() for g in await daemon.ledger.gpus()]}
        if op == "ledger.put_gpus":
            return await _put_gpus(daemon, who, message)
        if op == "ledger.cas":
            return await _cas(daemon, who, message)
    except ShareError as exc:
        return {"ok": False, **exc.to_json()}
    except LedgerUnavailable as exc:  # the agent's own file: a full disk, a broken database
        return {"ok": False, **exc.to_json()}
    return wire.refusal(wire.E_BAD_REQUEST, f"unknown op {op!r}")


#: records as shown, encoded, per record object and viewer kind: the agent's cached ledger hands
#: out the same objects until they change, so a snapshot reply is mostly spliced from here
#: (``wire.Encoded``) instead of encoding every record for every request
_SHOWN: dict[tuple[int, bool], tuple[Allocation, bytes]] = {}
_SHOWN_MAX = 8192


def _shown(snap: Snapshot, who: Caller) -> wire.Encoded:
    """``snap``'s records as ``who`` may see them, each encoded as JSON."""
    out = []
    for a in snap.allocations:
        whole = who.admin or owner_uid(a) == who.uid
        key = (id(a), whole)
        hit = _SHOWN.get(key)
        if hit is None or hit[0] is not a:
            if len(_SHOWN) >= _SHOWN_MAX:
                _SHOWN.clear()
            shown = (a if whole else redact(a)).to_json()
            hit = _SHOWN[key] = (a, json.dumps(shown, separators=(",", ":")).encode())
        out.append(hit[1])
    return wire.Encoded(out)


async def _put_gpus(daemon: Daemon, who: Caller, message: dict[str, Any]) -> dict[str, Any]:
    if access_of(daemon).system and not who.admin:
        return wire.refusal(
            wire.E_NOT_PERMITTED,
            "the system agent publishes this machine's GPUs itself; only an admin may replace them",
        )
    node = message.get("node")
    raw = message.get("gpus")
    if not isinstance(node, str) or not isinstance(raw, list):
        return wire.refusal(
            wire.E_BAD_REQUEST, "ledger.put_gpus needs node (a string) and gpus (a list)"
        )
    try:
        gpus = [Gpu.from_json(g) for g in raw]
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        return wire.refusal(wire.E_BAD_REQUEST, f"gpus: not a list of GPUs ({exc})")
    await daemon.ledger.put_gpus(node, gpus)
    return {"ok": True}


def _parse_allocations(raw: object, current: Sequence[Allocation]) -> list[Allocation]:
    """The proposed records; ``{"id": …, "keep": true}`` stands for the stored record (a caller
    sends other users' records, which it saw redacted, in this short form)."""
    if not isinstance(raw, list):
        raise ShareError("allocations", raw, "a list of allocations")
    stored = {a.id: a for a in current}
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ShareError(f"allocations[{i}]", item, "an allocation object")
        if item.get("keep") is True:
            kept = stored.get(item.get("id"))  # type: ignore[arg-type]
            if kept is None:
                raise ShareError(
                    f"allocations[{i}].id",
                    item.get("id"),
                    "the id of an allocation on this node (to keep it)",
                )
            out.append(kept)
            continue
        try:
            out.append(Allocation.from_json(item))
        except ShareError as exc:
            raise ShareError(f"allocations[{i}].{exc.field}", exc.value, exc.allowed) from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ShareError(
                f"allocations[{i}]",
                item.get("id"),
                f"an allocation with every field ({type(exc).__name__}: {exc})",
            ) from None
    ids = [a.id for a in out]
    if len(set(ids)) != len(ids):
        raise ShareError(
            "allocations", sorted({i for i in ids if ids.count(i) > 1}), "each allocation id once"
        )
    return out


async def _cas(daemon: Daemon, who: Caller, message: dict[str, Any]) -> dict[str, Any]:
    node = message.get("node")
    version = message.get("version")
    if not isinstance(node, str) or not isinstance(version, int) or isinstance(version, bool):
        return wire.refusal(
            wire.E_BAD_REQUEST, "ledger.cas needs node (a string) and version (an integer)"
        )
    asked = bounds.from_json(message.get("bound"), "bound")
    snap = await daemon.ledger.snapshot()
    if snap.versions.get(node, 0) != version:
        return await _with_snapshot(daemon, who, message, {"ok": True, "swapped": False})
    current = snap.on_node(node)
    proposed = _parse_allocations(message.get("allocations"), current)
    inventory = [g for g in await daemon.ledger.gpus() if g.node == node]
    try:
        access = access_of(daemon)
        result = authorize(
            current,
            proposed,
            who,
            node,
            inventory,
            bound_for(daemon, who, asked),
            access.system,
            access.policy,
        )
    except NotPermitted as exc:
        access_of(daemon).refusals.failed(
            (who.uid, "ledger.cas"), f"from uid {who.uid} ({who.name})", exc
        )
        return wire.refusal(wire.E_NOT_PERMITTED, str(exc))
    except OverCapacity as exc:
        return {"ok": False, "error": "over_capacity", "message": str(exc)}
    swapped = await daemon.ledger.compare_and_swap(node, version, result)
    if not swapped:
        return await _with_snapshot(daemon, who, message, {"ok": True, "swapped": False})
    if node == daemon.settings.node:
        await daemon.refresh()  # in force before the caller hears "swapped"
    before = {a.id for a in current}
    reply = {
        "ok": True,
        "swapped": True,
        "added": [a.to_json() for a in result if a.id not in before],
    }
    if message.get("snapshot") is True:
        # the node holds what the caller proposed, new records as in "added": its view of the
        # node without sending the node back, when the ledger (in memory: no read) shows the
        # swap's own version, one past the one it replaced, and so nothing after it
        after = (await daemon.ledger.snapshot()).versions.get(node)
        if after == version + 1:
            reply["version"] = after
    return reply


async def _with_snapshot(
    daemon: Daemon, who: Caller, message: dict[str, Any], reply: dict[str, Any]
) -> dict[str, Any]:
    """A lost swap's ``reply`` with the ledger as ``who`` may see it now, when the request
    asked for it (``"snapshot": true``): the caller's next try then needs no
    ``ledger.snapshot``."""
    if message.get("snapshot") is True:
        snap = await daemon.ledger.snapshot()
        reply["allocations"] = _shown(snap, who)
        reply["versions"] = dict(snap.versions)
    return reply


class NotPermitted(Exception):
    """The caller may not make this change (another user's share, a protected field)."""


class OverCapacity(Exception):
    """The proposed allocations would put a GPU over its compute or memory."""


#: fields of a record its holder may not change (the agent stamps them)
PROTECTED = (UID_KEY, bounds.EXTRA_KEY)


def authorize(
    current: Sequence[Allocation],
    proposed: Sequence[Allocation],
    who: Caller,
    node: str,
    inventory: Sequence[Gpu],
    bound: ShareSpec | None,
    system: bool,
    policy: Policy | None = None,
) -> list[Allocation]:
    """The allocations to write for ``who``'s proposal on ``node``, or NotPermitted /
    OverCapacity / ShareError. A non-admin's new or moved share must be on GPUs the
    deployment's ``policy`` admits (healthy, not cordoned, not an excluded type). Pure."""
    old = {a.id: a for a in current}
    new = {a.id: a for a in proposed}
    for a in proposed:
        if a.node != node:
            raise NotPermitted(f"allocation {a.id} names node {a.node!r}, not {node!r}")
    result: list[Allocation] = []
    touched: set[str] = set()
    for a in current:  # kept, changed or removed
        mine = who.admin or owner_uid(a) == who.uid
        if a.id not in new:
            if not mine:
                raise NotPermitted(
                    f"allocation {a.id} belongs to another user; only they or "
                    "an admin may release it"
                )
            continue
        sent = new[a.id]
        if sent is a:  # sent back as ``{"id", "keep": true}``: the stored record itself
            result.append(a)
            continue
        if not mine:
            if redact(sent) != redact(a):
                raise NotPermitted(
                    f"allocation {a.id} belongs to another user; only they or "
                    "an admin may change it"
                )
            result.append(a)  # the stored record, not what came back redacted
            continue
        if sent == a:
            result.append(a)
            continue
        if not who.admin:
            sent = _check_fields(sent, who, inventory, a)
            for key in PROTECTED:
                if sent.extra.get(key) != a.extra.get(key):
                    raise NotPermitted(
                        f"allocation {a.id}: extra.{key} is set by the agent and "
                        "cannot be changed by its holder"
                    )
            if sent.user != a.user:
                raise NotPermitted(f"allocation {a.id}: user is set by the agent")
        if sent.spec != a.spec or sent.memory != a.memory or sent.gpus != a.gpus:
            bounds.check_within(sent.spec, sent.memory, bounds.recorded(a.extra))
            touched.update(sent.gpus)
            if not who.admin and sent.gpus != a.gpus:
                _check_admitted(sent, inventory, policy or Policy())
        result.append(sent)
    for a in proposed:  # added
        if a.id in old:
            continue
        if not who.admin:
            a = _check_fields(a, who, inventory)
            _check_admitted(a, inventory, policy or Policy())
            if a.pid is None and a.server_pid is None:  # else nothing ever releases it
                raise NotPermitted(
                    f"allocation {a.id}: a share needs its holder (pid or "
                    "server_pid: a process of yours; the agent releases the "
                    "share when it exits)"
                )
        if REDACTED_KEY in a.extra:
            raise NotPermitted(f"allocation {a.id}: a redacted record cannot be added")
        stamped = a
        if system and not (who.admin and owner_uid(a) is not None):
            stamped = replace(a, user=who.name, extra={**a.extra, UID_KEY: who.uid})
        applies = bounds.tightest([bound, bounds.recorded(a.extra) if who.admin else None])
        if not who.admin or applies is not None:
            bounds.check_within(stamped.spec, stamped.memory, applies)
            stamped = replace(stamped, extra=bounds.record(stamped.extra, applies))
        result.append(stamped)
        touched.update(a.gpus)
    _check_capacity(result, inventory, touched)
    _check_share_count(current, result, who)
    return result


def _check_share_count(
    current: Sequence[Allocation], result: Sequence[Allocation], who: Caller
) -> None:
    """A caller with a bound on its number of shares (``Caller.max_shares``) may not go over
    it (fewer than before, while over it, is fine)."""
    if who.max_shares is None:
        return
    before = sum(1 for a in current if owner_uid(a) == who.uid)
    after = sum(1 for a in result if owner_uid(a) == who.uid)
    if after > who.max_shares and after > before:
        raise NotPermitted(
            f"user {who.name} would hold {after} GPU shares on this machine; one user holds "
            f"at most {who.max_shares} (the agent's --max-shares-per-user)"
        )


def _check_fields(
    a: Allocation, who: Caller, inventory: Sequence[Gpu], before: Allocation | None = None
) -> Allocation:
    """What a non-admin may put in a record of its own (``before``: the record it changes);
    returns the record with its holders' start times as the agent read them."""
    # the share itself passes the one validator (a record read from JSON skipped it): no
    # negative, NaN or oversized request or memory that would fool the capacity sums
    ShareSpec.from_mapping({k: v for k, v in a.spec.to_json().items() if v is not None})
    known = {g.uuid for g in inventory}
    unknown = [u for u in a.gpus if u not in known]
    if unknown or not a.gpus or len(set(a.gpus)) != len(a.gpus):
        raise NotPermitted(
            f"allocation {a.id}: gpus {list(a.gpus)} are not distinct GPUs of this node"
        )
    if a.spec.gpu_count != len(a.gpus) or a.memory < 0 or a.spec.gpu_memory != a.memory:
        raise NotPermitted(f"allocation {a.id}: gpu_count, gpus and gpu_memory disagree")
    if a.backend != "local":
        raise NotPermitted(
            f"allocation {a.id}: backend {a.backend!r} (this agent records local shares)"
        )
    return _identify_holders(a, who, before)


#: where a record keeps each holder's start time: ``pid_start``, ``extra["server_start"]``
SERVER_START_KEY = "server_start"


def _identify_holders(a: Allocation, who: Caller, before: Allocation | None) -> Allocation:
    """``a`` with each holder it names (``pid``, ``server_pid``) identified by the agent itself:
    a live process of ``who``'s, its start time as /proc says it stamped (``pid_start``,
    ``extra["server_start"]``) when the caller left it out, refused when the caller's value
    is another's. A holder and start time kept as they were recorded are not looked at again.
    The agent (root) later signals a dead server's kernel by these alone (reconcile.py), so a
    record must never name a process the agent has not identified."""
    from ..ledger.reconcile import START_TOLERANCE, process_identity

    extra = dict(a.extra)
    holders = (
        ("pid", a.pid, "pid_start", a.pid_start),
        ("server_pid", a.server_pid, f"extra.{SERVER_START_KEY}", extra.get(SERVER_START_KEY)),
    )
    stamped: dict[str, float | None] = {}
    for what, pid, start_field, start in holders:
        if before is not None:
            old_start = before.pid_start if what == "pid" else before.extra.get(SERVER_START_KEY)
            if getattr(before, what) == pid and old_start == start:
                continue
        if pid is None:
            if start is not None:
                raise NotPermitted(f"allocation {a.id}: {start_field} without {what}")
            continue
        found = process_identity(pid) if isinstance(pid, int) and pid > 0 else None
        if found is None or found[1] != who.uid:
            raise NotPermitted(
                f"allocation {a.id}: {what} {pid} is not a process of user {who.name}"
            )
        if start is None:
            stamped[start_field] = found[0]
        elif (
            not isinstance(start, (int, float))
            or isinstance(start, bool)
            or not abs(float(start) - found[0]) <= START_TOLERANCE
        ):
            raise NotPermitted(
                f"allocation {a.id}: {start_field} {start!r} is not the start time of "
                f"process {pid} ({found[0]:.2f}, as the agent reads it)"
            )
    if not stamped:
        return a
    if "pid_start" in stamped:
        a = replace(a, pid_start=stamped["pid_start"])
    if f"extra.{SERVER_START_KEY}" in stamped:
        a = replace(a, extra={**extra, SERVER_START_KEY: stamped[f"extra.{SERVER_START_KEY}"]})
    return a


def _check_admitted(a: Allocation, inventory: Sequence[Gpu], policy: Policy) -> None:
    """The deployment's rules for where a new share may go (placement applies them; a caller
    that wrote its own record is held to them here). Types compare by alias or product name."""
    by_uuid = {g.uuid: g for g in inventory}
    excluded = {t.lower() for t in policy.exclude_types}
    wanted = {t.lower() for t in policy.gpu_types}
    for uuid in a.gpus:
        g = by_uuid[uuid]
        names = {g.type.lower(), g.name.lower()}
        why = (
            "unhealthy"
            if not g.healthy
            else "cordoned"
            if g.cordoned or uuid in policy.cordoned_gpus or g.node in policy.cordoned_nodes
            else "of an excluded type"
            if names & excluded
            else "not of a type kernels may use"
            if wanted and not names & wanted
            else None
        )
        if why is not None:
            raise NotPermitted(
                f"allocation {a.id}: GPU {uuid} is {why}; new shares do not go there"
            )


def _check_capacity(
    result: Sequence[Allocation], inventory: Sequence[Gpu], touched: set[str]
) -> None:
    by_uuid = {g.uuid: g for g in inventory}
    for uuid in sorted(touched):
        gpu = by_uuid.get(uuid)
        on = [a for a in result if uuid in a.gpus]
        request = sum(a.request for a in on)
        if request > 1.0 + 1e-6:
            raise OverCapacity(f"GPU {uuid} would hold requests of {request:g} (at most 1)")
        if gpu is not None and sum(a.memory for a in on) > gpu.memory:
            raise OverCapacity(f"GPU {uuid} would hold memory caps over its {gpu.memory} bytes")
        if len(on) > MAX_SHARES_PER_GPU:
            raise OverCapacity(
                f"GPU {uuid} would hold {len(on)} shares; one GPU holds at most "
                f"{MAX_SHARES_PER_GPU} (its lease board's slots)"
            )


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
