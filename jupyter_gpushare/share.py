"""Share spec: what a kernel asks for (DEVELOPING.md, box 1).

One immutable model, :class:`ShareSpec`, with one parser per entry point (kernelspec config, REST
JSON, command-line flags) and one validator. Every refusal is a :class:`ShareError` that names the
field, the value given and what is allowed; nothing is reserved before a spec validates.

Units: compute as a fraction of one GPU (``0 < gpu_request <= gpu_limit <= 1``) in steps of
:data:`COMPUTE_UNIT` (0.01 of a GPU: ``0.25`` and ``0.3`` are shares, ``0.333`` and ``1e-320`` are
refused with the unit named) or, with ``gpu_count > 1``, whole GPUs; memory in bytes, human
suffixes accepted (``10GiB``, ``512Mi``, ``2G``), at least :data:`MEMORY_UNIT` (1 MiB) and at most
:data:`MAX_MEMORY`. Numbers are ASCII: other scripts' digits (``"٠٫٥"``), ``NaN``/``Infinity``,
booleans and numbers too long to mean anything are refused by name, never an exception.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any

from .errors import GpushareError

#: The public field names (kernelspec ``metadata.kernel_provisioner.config`` keys and REST JSON).
SHARE_FIELDS = (
    "gpu_request",
    "gpu_limit",
    "gpu_memory",
    "gpu_type",
    "gpu_count",
    "gpu_labels",
)
LABEL_KINDS = ("affinity", "anti_affinity", "exclusive")
MAX_GPU_COUNT = 16
#: the smallest compute share, and the step of every compute share: 0.01 of one GPU
COMPUTE_UNIT = 0.01
#: the smallest memory cap (a smaller one cannot hold a CUDA context anyway)
MEMORY_UNIT = 2**20
#: the largest memory cap anyone may write down (1 PiB; real GPUs are far below it)
MAX_MEMORY = 2**50
#: how much of a refused value an error message repeats
SHOWN_CHARS = 80

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "ki": 2**10,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mi": 2**20,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gi": 2**30,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "ti": 2**40,
    "tib": 2**40,
}


# ASCII only: ``\d`` and ``float()`` also take other scripts' digits
@functools.cache
def _memory_re() -> re.Pattern[str]:
    """Compiled on first use: ~1.5 ms, which every kernel start paid on import (issue 12)."""
    return re.compile(r"^[ \t]*([0-9]{1,1000}(?:\.[0-9]{1,1000})?)[ \t]*([a-zA-Z]{0,3})[ \t]*\Z")


_NUMBER_RE = re.compile(
    r"^[ \t]*\+?([0-9]{0,30}(?:\.[0-9]{0,30})?(?:[eE][+-]?[0-9]{1,4})?)[ \t]*\Z"
)
_LABEL_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?\Z")


class ShareError(GpushareError, ValueError):
    """A share that cannot be accepted; the message names field, value and what is allowed."""

    code = "invalid_share"
    status = 400
    field: str
    allowed: str

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = shown_value(value)
        self.allowed = allowed
        super().__init__(f"{field}={self.value!r} is not allowed: {allowed}")

    def for_flags(self) -> str:
        """The message as a command line says it (``jupyter gpushare run``, ``%gpushare``):
        ``--gpu-request 2 is not allowed: …`` for the flag the user typed, not ``gpu_request=``."""
        value = self.value if isinstance(self.value, str) else repr(self.value)
        return flag_names(f"{self.field} {value} is not allowed: {self.allowed}")

    def json_value(self) -> Any:
        return _jsonable(self.value)


def shown_value(value: object) -> object:
    """``value`` as an error repeats it: a string or repr cut to :data:`SHOWN_CHARS`, a number
    of more digits than that described (``str()`` of a 5,000-digit int raises in Python 3.11)."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        if value.bit_length() > 3 * SHOWN_CHARS:
            return f"<a number of about {int(value.bit_length() * 0.30103) + 1} digits>"
        return value
    text = value if isinstance(value, str) else _short_repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def key_name(key: object) -> str:
    """A key someone sent, as an error names it: cut to :data:`SHOWN_CHARS`; ``""`` for an
    empty one."""
    text = str(key)
    if len(text) > SHOWN_CHARS:
        return text[: SHOWN_CHARS - 1] + "…"
    return text or '""'


def _short_repr(value: object) -> str:
    """``repr`` of a JSON value without walking deep or huge structures."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(repr(k)[:SHOWN_CHARS] for k in list(value)[:8]) + ": …}"
    if isinstance(value, list | tuple):
        return f"[… {len(value)} item(s)]"
    try:
        return repr(value)[: SHOWN_CHARS + 1]
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return repr(value)


def flag_names(text: str) -> str:
    """``text`` with the share's field names written as their command-line flags
    (``gpu_limit`` -> ``--gpu-limit``)."""
    return _FIELD_RE.sub(lambda m: "--" + m.group(0).replace("_", "-"), text)


# a name followed by "= in Python" is a hint for Python callers, left as it is
_FIELD_RE = re.compile(
    r"(?<![\w-])gpu_(?:request|limit|memory|type|count|labels)\b(?!= in Python)=?"
)


def format_share(fraction: float | None) -> str:
    """A share of one GPU as every user-facing text writes it (panel, magics, CLI, the lab
    extension's status bar): percent of the GPU, a space, ``%``: ``0.49`` -> ``'49 %'``.
    Shares come in steps of 0.01, so whole percents; a measured share above 0 but under
    0.5 % is ``'<1 %'``; ``None`` (not known) is ``'–'``."""
    if fraction is None:
        return "–"
    percent = 100 * float(fraction)
    if 0 < percent < 0.5:
        return "<1 %"
    return f"{percent:.0f} %"


def format_share_range(request: float, limit: float) -> str:
    """Request and limit of a share: ``'25–50 %'``, or ``'50 %'`` when they are equal."""
    low, high = format_share(request), format_share(limit)
    return low if low == high else f"{low[:-2]}–{high}"


def format_bytes(n: int) -> str:
    """``10737418240`` -> ``'10GiB'``; exact binary units where they divide, else one decimal."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n // size}{unit}" if n % size == 0 else f"{n / size:.1f}{unit}"
    return f"{n}B"


def parse_memory(value: object, field: str = "gpu_memory") -> int:
    """Parse a memory size: an int of bytes or a string such as ``10GiB``, ``512Mi``, ``2G``,
    from :data:`MEMORY_UNIT` (1 MiB) to :data:`MAX_MEMORY` (1 PiB); fractions of a byte are
    dropped (``1.5KiB`` of a ``1000.7MiB`` cap does not matter)."""
    sizes = f"from 1MiB to {format_bytes(MAX_MEMORY)}"
    if isinstance(value, bool):
        raise ShareError(
            field, value, f"a size in bytes or with a unit, e.g. 10GiB, 512Mi, 2G, {sizes}"
        )
    if isinstance(value, int):
        number = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ShareError(
                field, value, f"a whole number of bytes, or a size such as 10GiB, {sizes}"
            )
        number = Fraction(value)
    elif isinstance(value, str):
        match = _memory_re().match(value)
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS:
            raise ShareError(
                field,
                value,
                "a size in bytes or with a unit (B, KiB, MiB, GiB, TiB, K, M, G, "
                f"T) in ASCII digits, {sizes}",
            )
        number = Fraction(match.group(1)) * _UNITS[unit]  # exact: no float overflow or rounding
    else:
        raise ShareError(
            field, value, f"a size in bytes or with a unit, e.g. 10GiB, 512Mi, 2G, {sizes}"
        )
    if number < MEMORY_UNIT:
        raise ShareError(field, value, f"at least 1MiB (the smallest memory cap); {sizes}")
    if number > MAX_MEMORY:
        raise ShareError(field, value, f"at most {format_bytes(MAX_MEMORY)}; {sizes}")
    return int(number)


# -- shares and sizes written as one line of text (the Hub form's custom values) --------------
#
# The patterns are the same grammar for a browser (JavaScript ``RegExp`` syntax, checked before
# the form is sent); the server parses the text again with the functions here and ShareSpec.

#: a GPU type name as written by people (``A100``, ``H100``, ``RTX 4090``)
TYPE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 _.-]{0,63}$"
#: a share as text: ``REQUEST`` or ``REQUEST-LIMIT``, ASCII digits in steps of 0.01
SHARE_PATTERN = r"^\s*([0-9]*\.)?[0-9]{1,2}\s*(-\s*([0-9]*\.)?[0-9]{1,2}\s*)?$"


def _any_case(unit: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" for c in unit)


#: a memory size as text, with any unit :func:`parse_memory` knows (in any case)
MEMORY_PATTERN = (
    r"^[ \t]*[0-9]+(\.[0-9]+)?[ \t]*("
    + "|".join(_any_case(u) for u in sorted(_UNITS, key=lambda u: (-len(u), u)) if u)
    + r")?[ \t]*$"
)


def share_text(spec: ShareSpec) -> str:
    """A share's request and limit as :func:`share_from_text` reads them: ``'0.25-0.5'``."""
    return f"{spec.gpu_request:g}-{spec.gpu_limit:g}"


def share_from_text(text: str) -> dict[str, str]:
    """``gpu_request`` / ``gpu_limit`` of a share written as ``REQUEST`` or ``REQUEST-LIMIT``
    (:data:`SHARE_PATTERN`), as :meth:`ShareSpec.from_mapping` takes them (which checks the
    values and names the field); empty text gives ``{}`` (nothing asked)."""
    request, _, limit = text.partition("-")
    if not request.strip():
        return {}
    return {"gpu_request": request.strip(), "gpu_limit": limit.strip() or request.strip()}


def _number(value: object) -> float | None:
    """An ASCII decimal number (int, float or string such as ``"0.25"``, ``"2.5e-1"``) as a
    float, or None: no booleans, other scripts' digits, ``_`` separators, NaN or infinities, and
    no int too large for a float."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return float(value) if abs(value) < 2**63 else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        match = _NUMBER_RE.match(value)
        if not match or not any(c.isdigit() for c in match.group(1).split("e")[0].split("E")[0]):
            return None
        number = float(match.group(1))
        return number if math.isfinite(number) else None
    return None


def _parse_fraction(value: object, field: str) -> float:
    """A compute share: a multiple of :data:`COMPUTE_UNIT` in (0, 1]."""
    allowed = (
        f"a number in (0, 1] in steps of {COMPUTE_UNIT:g}, the fraction of one GPU "
        f"(the smallest share is {COMPUTE_UNIT:g})"
    )
    number = _number(value)
    if number is None or number <= 0 or number > 1:
        raise ShareError(field, value, allowed)
    units = round(number / COMPUTE_UNIT)
    if units < 1 or abs(number - units * COMPUTE_UNIT) > 1e-9:
        raise ShareError(field, value, allowed)
    return round(units * COMPUTE_UNIT, 2)


def _parse_count(value: object) -> int:
    allowed = f"a whole number of GPUs from 1 to {MAX_GPU_COUNT}"
    number = _number(value)
    if number is None or number != int(number) or not 1 <= number <= MAX_GPU_COUNT:
        raise ShareError("gpu_count", value, allowed)
    return int(number)


@dataclass(frozen=True)
class GpuLabels:
    """KubeShare-style locality labels.

    ``affinity``: shares with the same label go to the same GPU. ``anti_affinity``: shares with
    the same label go to different GPUs. ``exclusive``: a GPU holding a share with this label
    holds only shares with the same exclusive label.
    """

    affinity: str | None = None
    anti_affinity: str | None = None
    exclusive: str | None = None

    @classmethod
    def parse(cls, value: object) -> GpuLabels:
        if value is None or value == "":
            return cls()
        if isinstance(value, GpuLabels):
            return value
        if isinstance(value, str):
            # "affinity=a,exclusive=team1" (command line / form)
            pairs: dict[str, object] = {}
            for part in value.split(","):
                key, sep, val = part.partition("=")
                if not sep:
                    allowed = "KIND=LABEL pairs, KIND one of " + ", ".join(LABEL_KINDS)
                    raise ShareError("gpu_labels", value, allowed)
                pairs[key.strip().replace("-", "_")] = val.strip()
            value = pairs
        if not isinstance(value, Mapping):
            raise ShareError("gpu_labels", value, "an object with keys " + ", ".join(LABEL_KINDS))
        unknown = sorted(set(value) - set(LABEL_KINDS), key=str)
        if unknown:
            raise ShareError(
                f"gpu_labels.{key_name(unknown[0])}",
                value[unknown[0]],
                "keys are " + ", ".join(LABEL_KINDS),
            )
        parsed: dict[str, str | None] = {}
        for kind in LABEL_KINDS:
            label = value.get(kind)
            if label is None or label == "":
                parsed[kind] = None
                continue
            if not isinstance(label, str) or not _LABEL_RE.match(label):
                raise ShareError(
                    f"gpu_labels.{kind}",
                    label,
                    "1-63 letters, digits, '-', '_' or '.', starting and ending alphanumeric",
                )
            parsed[kind] = label
        labels = cls(**parsed)
        if labels.affinity and labels.affinity == labels.anti_affinity:
            raise ShareError(
                "gpu_labels.anti_affinity",
                labels.anti_affinity,
                "a label other than the affinity label (a share cannot be with and apart from "
                "the same group)",
            )
        return labels

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v}

    def __bool__(self) -> bool:
        return bool(self.affinity or self.anti_affinity or self.exclusive)


@dataclass(frozen=True)
class ShareSpec:
    """What one kernel asks for.

    ``gpu_memory`` is the memory cap in bytes; ``None`` means "the request's fraction of the
    chosen GPU's memory", resolved by :meth:`resolved_memory` when the GPU is known. With
    ``gpu_count > 1`` the share is that many whole GPUs (request = limit = 1).
    """

    gpu_request: float = 0.25
    gpu_limit: float = 0.5
    gpu_memory: int | None = None
    gpu_type: str | None = None
    gpu_count: int = 1
    gpu_labels: GpuLabels = field(default_factory=GpuLabels)

    def __post_init__(self) -> None:
        if self.gpu_count > 1 and (self.gpu_request != 1.0 or self.gpu_limit != 1.0):
            raise ShareError(
                "gpu_request",
                self.gpu_request,
                f"1 with gpu_count={self.gpu_count} (several GPUs are whole GPUs)",
            )
        if self.gpu_request > self.gpu_limit:
            raise ShareError(
                "gpu_request",
                self.gpu_request,
                f"at most gpu_limit ({self.gpu_limit:g}); the request is the guaranteed part of "
                "the limit",
            )

    # -- parsing -----------------------------------------------------------------------------

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], defaults: ShareSpec | None = None, *, strict: bool = True
    ) -> ShareSpec:
        """Parse kernelspec config or REST JSON (keys as in :data:`SHARE_FIELDS`).

        Keys not given fall back to ``defaults``. With ``strict``, unknown keys are refused, so
        a misspelled ``gpu_limt`` does not pass silently.
        """
        if not isinstance(data, Mapping):
            raise ShareError("share", data, "an object with keys " + ", ".join(SHARE_FIELDS))
        if strict:
            unknown = sorted(set(data) - set(SHARE_FIELDS), key=str)
            if unknown:
                allowed = "known keys are " + ", ".join(SHARE_FIELDS)
                raise ShareError(key_name(unknown[0]), data[unknown[0]], allowed)
        base = defaults or cls()
        count = _parse_count(data["gpu_count"]) if data.get("gpu_count") is not None else None
        whole = count is not None and count > 1
        if "gpu_request" in data and data["gpu_request"] is not None:
            request = _parse_fraction(data["gpu_request"], "gpu_request")
        else:
            request = 1.0 if whole else base.gpu_request
        if "gpu_limit" in data and data["gpu_limit"] is not None:
            limit = _parse_fraction(data["gpu_limit"], "gpu_limit")
        elif whole:
            limit = 1.0
        else:
            # A request above the default limit lifts the limit with it ("request 0.75" alone).
            limit = max(base.gpu_limit, request)
        memory = base.gpu_memory
        if data.get("gpu_memory") not in (None, ""):
            memory = parse_memory(data["gpu_memory"])
        gpu_type = base.gpu_type
        if "gpu_type" in data:
            gpu_type = _parse_type(data["gpu_type"])
        labels = base.gpu_labels
        if "gpu_labels" in data:
            labels = GpuLabels.parse(data["gpu_labels"])
        return cls(
            gpu_request=request,
            gpu_limit=limit,
            gpu_memory=memory,
            gpu_type=gpu_type,
            gpu_count=count if count is not None else (1 if whole else base.gpu_count),
            gpu_labels=labels,
        )

    @classmethod
    def from_args(
        cls,
        request: str | None = None,
        limit: str | None = None,
        memory: str | None = None,
        gpu_type: str | None = None,
        count: str | None = None,
        labels: str | None = None,
        defaults: ShareSpec | None = None,
    ) -> ShareSpec:
        """Parse command-line flags (``--gpu-request 0.25 --gpu-memory 10GiB``)."""
        given = {
            "gpu_request": request,
            "gpu_limit": limit,
            "gpu_memory": memory,
            "gpu_type": gpu_type,
            "gpu_count": count,
            "gpu_labels": labels,
        }
        return cls.from_mapping({k: v for k, v in given.items() if v is not None}, defaults)

    # -- use ---------------------------------------------------------------------------------

    def resolved_memory(self, gpu_memory: int) -> int:
        """The memory cap in bytes on a GPU with ``gpu_memory`` bytes."""
        if self.gpu_memory is not None:
            return self.gpu_memory
        return int(gpu_memory * self.gpu_request)

    def with_changes(self, **changes: Any) -> ShareSpec:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "gpu_request": self.gpu_request,
            "gpu_limit": self.gpu_limit,
            "gpu_memory": self.gpu_memory,
            "gpu_type": self.gpu_type,
            "gpu_count": self.gpu_count,
        }
        if self.gpu_labels:
            data["gpu_labels"] = self.gpu_labels.to_json()
        return data

    def describe(self) -> str:
        """Human summary: ``0.25–0.5 of an A100, 10GiB``."""
        kind = self.gpu_type or "GPU"
        if self.gpu_count > 1:
            text = f"{self.gpu_count} whole {kind}s"
        elif self.gpu_request == self.gpu_limit:
            text = f"{self.gpu_request:g} of {_article(kind)} {kind}"
        else:
            text = f"{self.gpu_request:g}–{self.gpu_limit:g} of {_article(kind)} {kind}"
        if self.gpu_memory is not None:
            text += f", {format_bytes(self.gpu_memory)}"
        return text


def _article(word: str) -> str:
    return "an" if word[:1].upper() in "AEFHILMNORSX" else "a"


def _parse_type(value: object) -> str | None:
    if value is None or value == "" or value == "any":
        return None
    if not isinstance(value, str) or not re.match(TYPE_PATTERN[:-1] + r"\Z", value):
        raise ShareError("gpu_type", value, "a GPU type name such as A100, H100 or T4")
    return value
