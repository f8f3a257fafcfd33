"""Directives that write the reference pages from the code and the measured figures.

Each one reads the source of truth at build time, so a page cannot drift from it:

- ``gpushare-config``: every traitlets ``Configurable`` of the package with an option
  (``config=True``), documented by autodoc-traits (``autoconfigurable``);
- ``gpushare-cli``: the ``--help`` of ``jupyter gpushare`` and of every subcommand;
- ``gpushare-kernelspec-keys``: the provisioner's keys (``CONFIG_KEYS``) and the shipped
  kernelspecs;
- ``gpushare-metrics``: the node agent's Prometheus series (``daemon/metrics.py``);
- ``gpushare-enforcement-matrix`` and ``gpushare-benchmark``: tables built from the newest
  run in ``benchmarks/results/``.

A directive that cannot find what it documents fails the build (an ``ExtensionError``), and
one whose description table misses a key of the code warns (CI builds with ``-W``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
log = logging.getLogger(__name__)

#: modules never imported to look for configurables (entry scripts, generated gRPC code)
SKIP_MODULES = re.compile(r"(__main__|_pb2(_grpc)?)$")


class _Generated(SphinxDirective):
    """A directive whose body is reStructuredText built by :meth:`rst`."""

    has_content = False

    def rst(self) -> list[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        lines = self.rst()
        node = nodes.section() if self.titles else nodes.container()
        node.document = self.state.document
        content = StringList(lines, source=f"<{self.name}>")
        if self.titles:
            nested_parse_with_titles(self.state, content, node)
        else:
            self.state.nested_parse(content, self.content_offset, node)
        return list(node.children)

    titles = False


def _table(header: list[str], rows: list[list[str]], widths: str | None = None) -> list[str]:
    """A ``list-table`` (cells are inline reStructuredText, one line each)."""
    out = [".. list-table::", "   :header-rows: 1", "   :class: gs-figures"]
    if widths:
        out.append(f"   :widths: {widths}")
    out.append("")
    for row in [header, *rows]:
        for i, cell in enumerate(row):
            text = " ".join(str(cell).split()) or " "
            out.append(f"   {'*' if i == 0 else ' '} - {text}")
    out.append("")
    return out


def _literal(text: str) -> str:
    """Inline literal, safe for any text."""
    return ":literal:`" + text.replace("\\", "\\\\").replace("`", "\\`") + "`"


# -- configuration (traitlets) ---------------------------------------------------------------


def _package_modules() -> Iterator[str]:
    import jupyter_gpushare

    yield "jupyter_gpushare"
    for info in pkgutil.walk_packages(jupyter_gpushare.__path__, "jupyter_gpushare."):
        if not SKIP_MODULES.search(info.name):
            yield info.name


def configurables() -> list[type]:
    """Every ``Configurable`` defined in the package that declares at least one option."""
    from traitlets.config import Configurable

    found: dict[str, type] = {}
    for name in _package_modules():
        module = importlib.import_module(name)
        for _attr, obj in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(obj, Configurable)
                and obj.__module__ == module.__name__
                and obj.class_own_traits(config=True)
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    if not found:
        raise ExtensionError("gpushare-config: no configurable class found in jupyter_gpushare")
    return [found[k] for k in sorted(found, key=lambda k: (k.rsplit(".", 1)[1], k))]


class ConfigDirective(_Generated):
    titles = True

    def rst(self) -> list[str]:
        out: list[str] = []
        for cls in configurables():
            path = f"{cls.__module__}.{cls.__qualname__}"
            out += [cls.__name__, "-" * len(cls.__name__), ""]
            out += [
                f"Set in a config file as ``c.{cls.__name__}.<option> = …``; defined in "
                f"``{cls.__module__}``.",
                "",
            ]
            out += [f".. autoconfigurable:: {path}", "   :no-index:", ""]
        return out


# -- CLI ----------------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> Iterator[tuple[str, Any]]:
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, f"{prefix} {name}")


def _traitlets_help(argv: list[str]) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise ExtensionError(
            f"gpushare-cli: `jupyter gpushare {' '.join(argv)}` failed:\n{done.stdout}{done.stderr}"
        )
    return done.stdout


class CliDirective(_Generated):
    titles = True

    def rst(self) -> list[str]:
        from jupyter_gpushare.cli import build_parser

        os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width
        out: list[str] = []
        for command, parser in _subcommands(build_parser(), "jupyter gpushare"):
            if parser.add_help:
                text = parser.format_help()
            else:  # a traitlets application (the controller): its own --help
                text = _traitlets_help([*command.split()[2:], "--help"])
            out += [f"``{command}``", "-" * (len(command) + 4), ""]
            out += ["::", ""] + ["   " + line for line in text.rstrip().splitlines()] + [""]
        return out


# -- kernelspec keys ----------------------------------------------------------------------------

#: what each provisioner key means; every key of ``provisioner.CONFIG_KEYS`` needs a row
KERNELSPEC_KEYS = {
    "gpu_request": (
        "guaranteed fraction of one GPU's time",
        "(0, 1] in steps of 0.01, at most ``gpu_limit``",
    ),
    "gpu_limit": ("the most the kernel may use while others are idle", "(0, 1] in steps of 0.01"),
    "gpu_memory": (
        "memory cap per GPU; default ``auto`` = ``gpu_request`` × the GPU's memory",
        "bytes, or ``10GiB``, ``512Mi``, ``2G``; 1 MiB to the GPU's memory",
    ),
    "gpu_type": ("GPU type alias (``A100``, ``H100``, ``T4``, …)", "a type in the inventory"),
    "gpu_count": ("whole GPUs (request = limit = 1 each)", "1 to 16"),
    "gpu_labels": (
        "placement labels: ``affinity`` (same label, same GPU), ``anti_affinity`` (same label, "
        "different GPUs), ``exclusive`` (a GPU holds only shares of that label)",
        "an object with those keys and a label each, or ``affinity=a,exclusive=b``",
    ),
    "backend": (
        "where the kernel runs",
        "``local``, ``kubernetes``, or a backend installed in "
        "the entry point group ``jupyter_gpushare.backends``",
    ),
}


class KernelspecKeysDirective(_Generated):
    def rst(self) -> list[str]:
        from jupyter_gpushare.provisioner import CONFIG_KEYS

        missing = [k for k in CONFIG_KEYS if k not in KERNELSPEC_KEYS]
        extra = [k for k in KERNELSPEC_KEYS if k not in CONFIG_KEYS]
        if missing or extra:
            log.warning(
                "gpushare-kernelspec-keys: describe %s; drop %s (docs/_ext/gpushare_docs.py)",
                missing,
                extra,
                location=self.get_location(),
            )
        rows = [[f"``{k}``", *KERNELSPEC_KEYS.get(k, ("", ""))] for k in CONFIG_KEYS]
        out = _table(["key", "meaning", "allowed"], rows, "20 45 35")
        specs = []
        for path in sorted((REPO / "kernelspecs").glob("*/kernel.json")):
            spec = json.loads(path.read_text())
            config = spec["metadata"]["kernel_provisioner"].get("config", {})
            specs.append(
                [f"``{path.parent.name}``", spec["display_name"], _literal(json.dumps(config))]
            )
        if not specs:
            raise ExtensionError("gpushare-kernelspec-keys: no kernelspec under kernelspecs/")
        out += ["The kernelspecs the package installs:", ""]
        out += _table(["name", "display name", "``kernel_provisioner.config``"], specs)
        return out


# -- metrics ------------------------------------------------------------------------------------


class MetricsDirective(_Generated):
    """Every ``*_METRICS`` list of ``daemon/metrics.py`` (``(kind, name, help, …)``, labels from
    the matching ``*_LABELS`` list, else ``Hostname``) and every ``*_HISTOGRAMS`` list
    (``(name, help, …)``), checked against ``metric_names()``."""

    def rst(self) -> list[str]:
        from jupyter_gpushare.daemon import metrics

        rows, names = [], set()
        for attr in sorted(vars(metrics)):
            family = getattr(metrics, attr)
            group, _, kind_of_list = attr.rpartition("_")
            if not group or kind_of_list not in ("METRICS", "HISTOGRAMS"):
                continue
            labels = getattr(metrics, f"{group}_LABELS", ["Hostname"])
            shown = ", ".join(f"``{label}``" for label in labels)
            for entry in family:
                if kind_of_list == "METRICS":
                    kind, name, help_text = entry[:3]
                    exported = [f"{name}_total" if kind == "counter" else name]
                else:
                    kind, (name, help_text) = "histogram", entry[:2]
                    exported = [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
                names.update(exported)
                series = exported[0] if len(exported) == 1 else f"{name}_{{bucket,sum,count}}"
                rows.append([f"``{series}``", kind, help_text, group.lower(), shown])
        if names != set(metrics.metric_names()):
            log.warning(
                "gpushare-metrics: the table's names differ from metric_names(): %s",
                sorted(names ^ set(metrics.metric_names())),
                location=self.get_location(),
            )
        return _table(["series", "type", "what", "of", "labels"], rows, "28 8 32 10 22")


# -- measured figures ---------------------------------------------------------------------------


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _newest(path: Path, key: str | None = None) -> dict[str, Any]:
    """The newest run's JSON line in a results file: results files put the newest run first."""
    runs = [r for r in _json_lines(path) if key is None or key in r]
    if not runs:
        raise ExtensionError(f"no JSON result line{' with ' + key if key else ''} in {path}")
    return runs[0]


def _header(path: Path) -> str:
    """The file's first line: the command and when and where it ran."""
    first = path.read_text().splitlines()[0]
    return first.lstrip("# ").strip()


def _us(kernel_us: int) -> str:
    return f"{kernel_us / 1000:g} ms"


def _shares(values: list[float] | None) -> str:
    if not values:
        return "–"
    if len(values) > 3 and len(set(values)) > 1:
        return f"{min(values):.3f}..{max(values):.3f}"
    if len(values) > 3:
        return f"{len(values)} × {values[0]:.3f}"
    return " / ".join(f"{v:.3f}" for v in values)


class EnforcementMatrixDirective(_Generated):
    """The newest full run of ``benchmarks/enforcement.py --only matrix``; the columns a run did
    not record (older runs have no fair parts) are left out."""

    def rst(self) -> list[str]:
        path = RESULTS / "enforcement-simulator.txt"
        run = _newest(path, "matrix")
        matrix = run["matrix"]
        cells = matrix.get("cells", [])
        if not cells:
            raise ExtensionError(f"gpushare-enforcement-matrix: no cells in {path}")
        summary = [
            f"From ``benchmarks/results/{path.name}``, run of {run.get('date', '?')} on "
            f"{run.get('device', '?')} ({run.get('cpus', '?')} CPUs, load "
            f"{run.get('load1', '?')} at start); quantum {run.get('quantum_ms', '?')} ms, window "
            f"{run.get('window_ms', '?')} ms, each cell {run.get('seconds', '?')} s."
        ]
        for key, words, target in (
            ("worst_error", "Worst error against the promise", "0.03"),
            (
                "min_busy_saturating",
                "lowest busy share of the saturating cells, against the "
                "same processes without gpushare",
                "0.97",
            ),
            ("worst_ratio_to_fair", "lowest share of their fair parts", None),
        ):
            if isinstance(matrix.get(key), (int, float)):
                tail = f" (target {target})" if target else ""
                summary.append(f"{words}: **{matrix[key]:.3f}**{tail}.")
        out = [" ".join(summary), ""]
        fair = any(c.get("ratio_to_fair") is not None for c in cells)
        header = (
            ["case", "kernel", "launches", "promised", "achieved", "error", "busy", "vs. alone"]
            + (["of fair"] if fair else [])
            + ["1 s over"]
        )
        rows = []
        for c in cells:
            over = c.get("peak_1s_over_limit")
            row = [
                c.get("case", "?"),
                _us(c.get("kernel_us", 0)),
                c.get("pattern", "?"),
                _shares(c.get("promised")),
                _shares(c.get("achieved")),
                _num(c.get("worst_error")),
                _num(c.get("busy")),
                _num(c.get("ratio_to_plain")),
            ]
            if fair:
                row.append(_num(c.get("ratio_to_fair")))
            row.append("–" if over is None else f"{over:+.3f}")
            rows.append(row)
        out += _table(header, rows)
        mixed = [
            [
                _us(m.get("kernel_us", 0)),
                _shares(m.get("achieved")),
                _num(m.get("busy")),
                _ms(m.get("interactive_wait_p50_us")),
                _ms(m.get("interactive_wait_p99_us")),
            ]
            for m in matrix.get("mixed", [])
        ]
        if mixed:
            out += ["A saturating tenant beside an interactive one (short bursts):", ""]
            out += _table(
                [
                    "kernel",
                    "achieved (saturating / interactive)",
                    "busy",
                    "interactive wait p50",
                    "p99",
                ],
                mixed,
            )
        return out


def _num(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "–"


def _ms(us: Any) -> str:
    return f"{us / 1000:.2f} ms" if isinstance(us, (int, float)) else "–"


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, bool) or value is None:
        yield prefix, json.dumps(value)
    elif isinstance(value, (int, float)):
        yield prefix, f"{value:g}" if isinstance(value, float) else str(value)
    elif isinstance(value, str) and len(value) <= 80:
        yield prefix, value
    elif (
        isinstance(value, list)
        and len(value) <= 4
        and all(isinstance(v, (int, float, str)) for v in value)
    ):
        yield prefix, ", ".join(str(v) for v in value)


class BenchmarkDirective(_Generated):
    """``.. gpushare-benchmark:: <file in benchmarks/results>``: its first line (command, date,
    machine), its summary lines (not JSON, not comments) and the newest run's figures."""

    required_arguments = 1
    option_spec = {"keys": lambda text: [k.strip() for k in text.split(",") if k.strip()]}

    def rst(self) -> list[str]:
        path = RESULTS / self.arguments[0]
        if not path.is_file():
            raise ExtensionError(f"gpushare-benchmark: no {path}")
        run = _newest(path)
        figures = dict(_flatten(run))
        keys = self.options.get("keys")
        if keys:
            missing = [k for k in keys if k not in figures]
            if missing:
                log.warning(
                    "gpushare-benchmark: %s has no %s",
                    path.name,
                    missing,
                    location=self.get_location(),
                )
            figures = {k: figures[k] for k in keys if k in figures}
        out = [f"``benchmarks/results/{path.name}``: {_literal(_header(path))}", ""]
        out += _table(["figure", "value"], [[f"``{k}``", v] for k, v in figures.items()], "50 50")
        return out


class OtherBenchmarksDirective(_Generated):
    """Every file of ``benchmarks/results/`` that no ``gpushare-benchmark`` or the matrix of this
    page shows, each with its newest run: a new results file is on the page without a docs
    change."""

    def rst(self) -> list[str]:
        source = Path(self.env.doc2path(self.env.docname)).read_text()
        shown = set(re.findall(r"gpushare-benchmark::\s*(\S+)", source))
        if "gpushare-enforcement-matrix" in source:
            shown.add("enforcement-simulator.txt")
        rest = sorted(p.name for p in RESULTS.glob("*.txt") if p.name not in shown)
        if not rest:
            return ["None: every file of ``benchmarks/results/`` is shown above.", ""]
        out: list[str] = []
        for name in rest:
            out += [f".. rubric:: {name}", "", f".. gpushare-benchmark:: {name}", ""]
        return out


# -- guides kept next to what they install ------------------------------------------------------

#: docs/_generated/<name>.md <- (file in the repository, heading where the part starts (kept) or
#: None for the start after the file's title, heading where it ends (not kept) or None): the
#: deploy guides live next to the manifests they describe and are read here as they are
_K8S = "deploy/README.md"
INCLUDES = {
    "deploy-kubernetes": (_K8S, None, "## Upgrades: a DaemonSet rollout"),
    "deploy-kubernetes-network": (_K8S, "## Network", "## Metrics"),
    "deploy-kubernetes-controller": (_K8S, "## Controller mode", None),
    "deploy-upgrades": (_K8S, "## Upgrades: a DaemonSet rollout", "## Images"),
    "deploy-images": (_K8S, "## Images", "## Network"),
    "deploy-metrics": (_K8S, "## Metrics", "## Controller mode"),
    "deploy-chart": ("deploy/helm/jupyter-gpushare/README.md", None, None),
    "deploy-z2jh": ("deploy/z2jh/README.md", None, None),
    "deploy-systemd": ("deploy/systemd/README.md", None, None),
    "labextension": ("labextension/README.md", None, None),
}
GENERATED = Path(__file__).resolve().parents[1] / "_generated"
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\((?!https?:|#|mailto:)([^)\s]+)\)")


def _repo_links(text: str, source: Path) -> str:
    """A link to a file of the repository becomes its path: the docs are read apart from it."""

    def path_of(match: re.Match[str]) -> str:
        label, target = match.group(1), match.group(2)
        resolved = (source.parent / target.split("#")[0]).resolve()
        try:
            shown = str(resolved.relative_to(REPO)) + ("/" if resolved.is_dir() else "")
        except ValueError:
            shown = target
        if label.strip("`") == target or label.strip("`") == shown:
            return f"`{shown}`"
        return f"{label} (`{shown}`)"

    return _LINK.sub(path_of, text)


def _promote_headings(text: str) -> str:
    """``##`` -> ``#`` outside code fences: the page includes the part with ``:heading-offset: 1``,
    so the part's sections sit under the page's title."""
    out, fence = [], ""
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            marker = stripped[:3]
            fence = "" if fence == marker else (fence or marker)
        elif not fence and line.startswith("##"):
            line = line[1:]
        out.append(line)
    return "\n".join(out) + "\n"


def write_includes(app: Sphinx) -> None:
    GENERATED.mkdir(exist_ok=True)
    for name, (relpath, start, end) in INCLUDES.items():
        source = REPO / relpath
        if not source.is_file():
            raise ExtensionError(f"gpushare docs: {relpath} is gone; update INCLUDES")
        lines = source.read_text().splitlines()
        if lines and lines[0].startswith("# "):
            lines = lines[1:]  # the including page has its own title
        text = "\n".join(lines)
        if start:
            if start not in text:
                raise ExtensionError(f"gpushare docs: no {start!r} in {relpath}; update INCLUDES")
            text = start + text.split(start, 1)[1]
        if end:
            if end not in text:
                raise ExtensionError(f"gpushare docs: no {end!r} in {relpath}; update INCLUDES")
            text = text.split(end, 1)[0]
        text = _promote_headings(_repo_links(text, source))
        target = GENERATED / f"{name}.md"
        if not target.exists() or target.read_text() != text:
            target.write_text(text)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", write_includes)
    app.add_directive("gpushare-config", ConfigDirective)
    app.add_directive("gpushare-cli", CliDirective)
    app.add_directive("gpushare-kernelspec-keys", KernelspecKeysDirective)
    app.add_directive("gpushare-metrics", MetricsDirective)
    app.add_directive("gpushare-enforcement-matrix", EnforcementMatrixDirective)
    app.add_directive("gpushare-benchmark", BenchmarkDirective)
    app.add_directive("gpushare-other-benchmarks", OtherBenchmarksDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


__all__ = ["configurables", "setup"]
