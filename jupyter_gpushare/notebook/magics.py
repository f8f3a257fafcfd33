"""``%gpushare`` line magics (DEVELOPING.md, box 9), loaded in gpushare kernels by
``--ext=jupyter_gpushare`` (``GpuShare.extra_kernel_args``) or ``%load_ext jupyter_gpushare``.

``%gpushare status`` · ``%gpushare gpus`` · ``%gpushare release`` ·
``%gpushare request [--gpu-request R] [--gpu-limit L] [--gpu-memory M] [--gpu-type T]``

Each calls the function of the same name in :mod:`.actions`. Bad arguments print the usage and
change nothing; a refusal prints its reason. ``request`` changes only what it names: a request
above the current limit needs ``--gpu-limit`` too, and an "auto" memory cap (request × the GPU's
memory) follows a new request (:func:`.actions.request`).

Loading the extension is on every gpushare kernel's start path (issue 12, kernel cold start), so
it imports only IPython's magic machinery, which a kernel has loaded already: the argument parser
is built on the first ``%gpushare`` (:func:`_parser`), and :mod:`.actions`,
:mod:`jupyter_gpushare.share` and the node agent's client are imported when a magic runs or a
cell fails, not at load (``tests/test_imports.py`` checks this).
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

from IPython.core.magic import Magics, line_magic, magics_class

from .reclaim_notice import install_notice

if TYPE_CHECKING:
    from IPython.core.magic_arguments import MagicArgumentParser

ACTIONS = ("status", "gpus", "release", "request")

#: what ``%gpushare`` alone prints, and what follows an error
USAGE = """\
%gpushare ACTION [options]
  status    this kernel's GPU share: request, limit, achieved share, memory
  gpus      every GPU with its free capacity
  release   give the GPU back (the kernel keeps running, without a GPU)
  request   change the share live: --gpu-request R  --gpu-limit L  --gpu-memory M
            (R and L are fractions of the GPU: 0.25 is 25 %; M e.g. 10GiB); after a
            release it reserves a new share for the restart (--gpu-type T too)"""


#: the widest line ``%gpushare status`` prints: longer lines wrap between words (an output area
#: wraps a long line anywhere, even inside a word or a UUID)
WIDTH = 72


def _wrap(lines: list[str]) -> str:
    """``lines`` wrapped to :data:`WIDTH` between words, each continuation indented under the
    line's text (never inside a word, a UUID or an allocation id)."""
    import re
    import textwrap

    out: list[str] = []
    for line in lines:
        if len(line) <= WIDTH:
            out.append(line)
            continue
        # under the value of a "  label        value" row, else two columns in
        column = re.match(r"( *)\S+(?: \S+)*?( {2,})", line)
        hang = (
            column.end()
            if column and column.end() <= WIDTH // 2
            else len(line) - len(line.lstrip(" ")) + 2
        )
        out.extend(
            textwrap.wrap(
                line,
                WIDTH,
                initial_indent="",
                subsequent_indent=" " * hang,
                break_long_words=False,
                break_on_hyphens=False,
            )
            or [line]
        )
    return "\n".join(out)


def _status_text(status: dict[str, Any]) -> str:
    from ..share import format_bytes, format_share
    from . import actions

    state = status["state"]
    sim = " [simulated GPU]" if status.get("simulated") else ""
    if state != "active":
        lines = [f"GPU share: {state}{sim}"]
        if state == "released":
            lines.append(f"  released: {actions.describe(status['released'])}")
        if status.get("reserved"):
            lines.append(f"  reserved for the restart: {actions.describe(status['reserved'])}")
        lines.append(f"  {status.get('message')}")
        return _wrap(lines)
    a, g = status["allocation"], status.get("gpu") or {}
    nvml = g.get("nvml") or {}
    window = (status.get("daemon") or {}).get("window_ms", 0) / 1000
    waits, shares = int(a.get("lease_waits") or 0), int(g.get("kernels") or 0)
    lines = [
        f"GPU share: active{sim}  {status['allocation_id']}",
        f"  GPU          {g.get('type', 'GPU')} {g.get('uuid', '')}",
        f"  request      {format_share(a['request'])}   limit {format_share(a['limit'])}",
        f"  achieved     {format_share(float(a.get('achieved_share') or 0))} over the last "
        f"{window:g} s",
        f"  memory       {format_bytes(int(a.get('memory_used') or 0))} used of "
        f"{format_bytes(int(a.get('memory_cap') or 0))}",
        f"  waited       {float(a.get('lease_wait_seconds') or 0):.3f} s for its turn on the "
        f"GPU ({waits} time{'' if waits == 1 else 's'}), from {actions.wait_cause(a, shares)}",
        f"  GPU now      {nvml.get('utilization_gpu', '–')} % busy, "
        f"{shares} share{'' if shares == 1 else 's'} on it",
    ]
    return _wrap(lines)


def _gpus_text(rows: list[dict[str, Any]]) -> str:
    from ..share import format_bytes, format_share

    if not rows:
        return "No GPUs in the ledger."
    lines = [f"{'node':<16} {'type':<6} {'uuid':<42} {'free':>6} {'free memory':>12}  shares"]
    for r in rows:
        sim = " (simulated)" if r.get("simulated") else ""
        lines.append(
            f"{r['node']:<16} {r['type']:<6} {r['uuid']:<42} {format_share(r['free_request']):>6} "
            f"{format_bytes(int(r['free_memory'])):>12}  "
            f"{r.get('shares', len(r.get('allocations') or []))}{sim}"
        )
    return "\n".join(lines)


@functools.cache
def _parser() -> MagicArgumentParser:
    """The ``%gpushare`` argument parser, built on first use (not when the extension loads)."""
    from IPython.core.magic_arguments import argument, magic_arguments

    @magic_arguments()
    @argument("action", help="status | gpus | release | request")
    @argument(
        "--gpu-request",
        default=None,
        help="guaranteed fraction of the GPU, (0, 1] in steps of 0.01; above the "
        "current limit only with --gpu-limit",
    )
    @argument("--gpu-limit", default=None, help="the most the kernel may use, (0, 1]")
    @argument("--gpu-memory", default=None, help="memory cap, e.g. 10GiB (at least 1MiB)")
    @argument("--gpu-type", default=None, help="GPU type (new shares only), e.g. A100")
    def gpushare(line: str) -> None:
        """Your GPU share (see %gpushare alone)."""

    return gpushare.parser


@magics_class
class GpushareMagics(Magics):
    @line_magic
    def gpushare(self, line: str) -> None:
        """Your GPU share: ``status``, ``gpus`` (with free capacity), ``release`` (give the GPU
        back; the kernel keeps running without one), ``request`` (change the share live, or
        reserve a new one after a release)."""
        if not line.strip():
            print(USAGE)
            return
        # imported here, not at load: the extension loads on every kernel start (module doc)
        from IPython.core.error import UsageError

        from ..share import ShareError, ShareSpec, flag_names
        from . import actions

        def refuse(problem: str) -> None:
            print(f"%gpushare: error: {flag_names(problem)}\n\n{USAGE}", file=sys.stderr)

        try:
            args = _parser().parse_argstring(line)
        except UsageError as exc:
            refuse(str(exc))
            return
        if args.action not in ACTIONS:
            refuse(f"unknown action {args.action!r} (choose from {', '.join(ACTIONS)})")
            return
        share = {
            "gpu_request": args.gpu_request,
            "gpu_limit": args.gpu_limit,
            "gpu_memory": args.gpu_memory,
            "gpu_type": args.gpu_type,
        }
        given = {k: v for k, v in share.items() if v is not None}
        if given and args.action != "request":
            refuse("--gpu-* options go with 'request' only")
            return
        if args.action == "request":
            try:  # refuse bad values here, before anything is asked of the daemon
                ShareSpec.from_mapping(given, defaults=ShareSpec(gpu_request=0.01, gpu_limit=1.0))
            except ShareError as exc:
                refuse(exc.for_flags())
                return
        try:
            print(self._run(args.action, given))
        except actions.GpushareError as exc:  # the daemon's words, in the magic's flags
            print(f"%gpushare {args.action}: {flag_names(str(exc))}", file=sys.stderr)

    # what ``%gpushare?`` shows: the description, then the usage (indented like the docstring)
    gpushare.__doc__ = f"{gpushare.__doc__}\n\n" + "\n".join(
        " " * 8 + line for line in USAGE.splitlines()
    )

    @staticmethod
    def _run(action: str, share: dict[str, Any]) -> str:
        from . import actions

        if action == "status":
            return _status_text(actions.status())
        if action == "gpus":
            return _gpus_text(actions.gpus())
        if action == "release":
            return str(actions.release()["message"])
        return str(actions.request(**share)["message"])


class RefusalNotes:
    """Explains refused GPU calls in the output of the cell they met (``post_run_cell``).

    After a release every GPU call of the kernel fails with ``CUDA_ERROR_NOT_PERMITTED`` (800);
    the interposer prints the reason once per process, on the process's stderr, which a refusal
    in a background thread sends to the server's terminal, and later cells showed a bare
    ``800``. So after each cell in which the interposer counted a refused call (from any thread,
    also between cells: then the next cell says it) the cell's output gets the reason and what to
    do. A cell that failed on a GPU error after a release gets it too (frameworks only say
    "operation not permitted"), also where no interposer counts."""

    def __init__(self) -> None:
        self.seen: int | None = None  # the interposer's count when the last cell ended

    def post_run_cell(self, result: Any) -> None:
        from . import actions

        count = actions.refused_calls()
        if count is not None:
            new = count - (self.seen or 0)
            self.seen = count
            if new > 0:
                print(f"gpushare: {self.reason(new)}", file=sys.stderr)
                return
        error = getattr(result, "error_in_exec", None)
        if error is None:
            return  # the common case, without asking the daemon
        if actions.allocation_id() is not None or not actions.released():
            return
        text = f"{type(error).__name__} {error}".lower()
        if any(word in text for word in GPU_ERROR_WORDS):
            print(f"gpushare: {actions.RELEASED_MESSAGE}", file=sys.stderr)

    @staticmethod
    def reason(new: int) -> str:
        from . import actions

        calls = "a GPU call was" if new == 1 else f"{new} GPU calls were"
        head = f"{calls} refused (CUDA_ERROR_NOT_PERMITTED, error 800). "
        if actions.released() is None:
            try:
                state = actions.status()  # learns of a release from outside (REST, an admin)
            except Exception as exc:  # the reason is a nicety; the cell's own output stays
                return head + f"The GPU share's state is unknown: {exc}"
            if state.get("state") != "released":
                return head + str(state.get("message") or "This kernel holds no GPU share.")
        return head + actions.RELEASED_MESSAGE


GPU_ERROR_WORDS = (
    "cuda",
    "gpu",
    "not permitted",
    "not_permitted",
    "cublas",
    "cudnn",
    "nvml",
    "device",
)


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(GpushareMagics)
    if not any(
        isinstance(getattr(cb, "__self__", None), RefusalNotes)
        for cb in ipython.events.callbacks["post_run_cell"]
    ):
        ipython.events.register("post_run_cell", RefusalNotes().post_run_cell)
    install_notice(ipython)  # idle-reclaim warning and release, printed before the next cell
