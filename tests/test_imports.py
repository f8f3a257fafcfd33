"""No import-time cycles: every module of the package imports alone, first, in a fresh interpreter.

A cycle at import time means some module reads from another that is still running its top-level
code (half-initialized): it works or fails depending on which module a program happens to import
first, and it hides the boxes' direction (DEVELOPING.md "Layout"). The check runs one
interpreter that loads the third-party libraries once (those that importing every module of ours
loads, found in a throwaway child) and then forks a child per module of ``jupyter_gpushare``, two
at a time; each child imports its module as the very first of the package, with
``builtins.__import__`` wrapped to report every import statement that reads a module of ours
while that module is still initializing (``from a import b`` where ``a`` is half-run, or
``import a`` of a half-run ``a``; importing a submodule from its own package's ``__init__`` is
not a cycle). Lazy imports inside functions are not import time and not reported by that
check; a second one reads the source and fails on a cycle that an import inside a function only
hides (``HIDDEN_ALLOWED`` names the known ones and why). Keep lazy imports for start-up time
only, pointing one way, with a comment saying so.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "jupyter_gpushare"
#: loaded in the parent before forking (with every other third-party module ours load), so each
#: child only pays for our own modules
THIRD_PARTY = (
    "traitlets",
    "tornado.web",
    "jupyter_client",
    "jupyter_client.provisioning",
    "jupyter_server.base.handlers",
    "jupyter_server.serverapp",
    "aiohttp",
    "yaml",
)


def package_modules() -> list[str]:
    """Every module of the package, from the file tree (importing nothing)."""
    base = ROOT / PACKAGE
    found = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        elif parts[-1] == "__main__":
            continue  # importing it runs the program; what it imports is checked on its own
        found.append(".".join(parts))
    return found


#: cycles that only an import inside a function keeps from biting at import time, allowed for now
#: (importer, imported): why
HIDDEN_ALLOWED: dict[tuple[str, str], str] = {}


def import_edges() -> dict[str, list[tuple[str, bool]]]:
    """Per module, the modules of ours it imports anywhere (at the top, or inside a function:
    ``True`` for those), from the source (``if TYPE_CHECKING:`` blocks left out)."""
    modules = {}
    for name in package_modules():
        path = ROOT / Path(*name.split("."))
        is_package = path.is_dir()
        modules[name] = (
            path / "__init__.py" if is_package else path.with_suffix(".py"),
            is_package,
        )
    edges: dict[str, list[tuple[str, bool]]] = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text())
        skipped = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        lazy = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for inner in ast.walk(node)
        }
        found = edges.setdefault(name, [])
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                if target in modules and target != name and not name.startswith(target + "."):
                    found.append((target, id(node) in lazy))
    return edges


def cycles_of(edges: dict[str, list[tuple[str, bool]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted({t for t, _ in ts}) for m, ts in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# -- the child side (this file run as a script) ---------------------------------------------------


def _initializing(module: object) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _watch_imports(events: list[dict[str, str]]) -> None:
    import builtins
    import importlib.util

    original = builtins.__import__

    def resolve(name: str, globals_: dict | None, level: int) -> str | None:
        if not level:
            return name
        if not globals_:
            return None
        package = globals_.get("__package__")
        if not package:
            importer = str(globals_.get("__name__", ""))
            package = importer if "__path__" in globals_ else importer.rpartition(".")[0]
        return importlib.util.resolve_name("." * level + name, package)

    def watched(name, globals=None, locals=None, fromlist=(), level=0):
        result = original(name, globals, locals, fromlist, level)
        importer = str((globals or {}).get("__name__", ""))
        if not importer.startswith(PACKAGE):
            return result
        target = resolve(name, globals, level)
        if target is None or not target.startswith(PACKAGE):
            return result
        read: list[str] = []
        if fromlist:
            for item in fromlist:
                sub = f"{target}.{item}"
                read.append(sub if sub in sys.modules else target)
        elif not importer.startswith(target + "."):  # `import a.b` inside a/…: binds only
            read.append(target)
        for module_name in read:
            module = sys.modules.get(module_name)
            if module_name != importer and module is not None and _initializing(module):
                events.append({"importer": importer, "reads": module_name, "statement": name})
        return result

    builtins.__import__ = watched


def _third_party_of(modules: list[str]) -> list[str]:
    """The modules outside the package that importing all of ``modules`` loads, found
    in a throwaway child (so the parent, which forks the checks, never imports ours)."""
    import importlib

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        before = set(sys.modules)
        for module in modules:
            try:
                importlib.import_module(module)
            except BaseException:  # each module's own child reports its error
                pass
        loaded = [m for m in sys.modules if m not in before]  # in the order they were loaded
        with os.fdopen(write_fd, "w") as out:
            json.dump([m for m in loaded if m.split(".")[0] != PACKAGE], out)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    return json.loads(data) if data else []


def _check_alone(module: str) -> tuple[int, int]:
    """Fork a child that imports ``module`` first of the package; its pid and result pipe."""
    import importlib

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: this module first, nothing of ours loaded yet
        os.close(read_fd)
        events: list[dict[str, str]] = []
        error = None
        try:
            assert not any(m == PACKAGE or m.startswith(PACKAGE + ".") for m in sys.modules)
            _watch_imports(events)
            importlib.import_module(module)
        except BaseException as exc:  # reported to the parent
            error = f"{type(exc).__name__}: {exc}"
        with os.fdopen(write_fd, "w") as out:
            json.dump({"module": module, "cycles": events, "error": error}, out)
        os._exit(0)
    os.close(write_fd)
    return pid, read_fd


def _child_main(modules: list[str]) -> None:
    import importlib

    # every third-party library our modules load, imported once here before forking: each child
    # then pays only for our own modules (none of ours is loaded by them: each child asserts it)
    for name in (*THIRD_PARTY, *_third_party_of(modules)):
        try:
            importlib.import_module(name)
        except Exception:  # one that loads only as part of another's import
            pass
    # two children at a time (the checks are independent; each imports in its own process)
    results: dict[str, dict] = {}
    running: list[tuple[str, int, int]] = []
    pending = list(modules)
    while pending or running:
        while pending and len(running) < 2:
            module = pending.pop(0)
            running.append((module, *_check_alone(module)))
        module, pid, read_fd = running.pop(0)
        with os.fdopen(read_fd) as inp:
            data = inp.read()
        os.waitpid(pid, 0)
        results[module] = json.loads(data) if data else {"module": module, "error": "no answer"}
    json.dump([results[m] for m in modules], sys.stdout)


# -- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def import_results() -> list[dict]:
    modules = package_modules()
    proc = subprocess.run(
        [sys.executable, __file__, *modules],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_every_module_is_found() -> None:
    modules = package_modules()
    assert PACKAGE in modules
    assert f"{PACKAGE}.share" in modules and f"{PACKAGE}.k8s.usage" in modules


def test_each_module_imports_alone(import_results: list[dict]) -> None:
    failed = {r["module"]: r["error"] for r in import_results if r["error"]}
    assert not failed, "modules that do not import alone, first:\n" + "\n".join(
        f"  {m}: {e}" for m, e in failed.items()
    )


def test_no_import_time_cycles(import_results: list[dict]) -> None:
    cycles = sorted(
        {(e["importer"], e["reads"]) for r in import_results for e in r["cycles"]},
    )
    assert not cycles, "import-time cycles (importer reads a half-initialized module):\n" + (
        "\n".join(f"  {importer} -> {reads}" for importer, reads in cycles)
    )


def test_no_cycles_hidden_in_functions() -> None:
    """An import inside a function that closes a cycle only hides it (the boxes still point
    both ways); deliberate lazy imports for start-up time point one way and close none."""
    edges = import_edges()
    assert any(lazy for ts in edges.values() for _, lazy in ts)  # the scan sees lazy imports
    problems = []
    for component in cycles_of(edges):
        members = set(component)
        arrows = sorted(
            {(m, t) for m in component for t, _ in edges[m] if t in members} - set(HIDDEN_ALLOWED)
        )
        if len(
            cycles_of({m: [(t, False) for t, _ in edges[m] if (m, t) in arrows] for m in component})
        ):
            problems.append(
                " <-> ".join(component) + ": " + ", ".join(f"{a} -> {b}" for a, b in arrows)
            )
    assert not problems, "import cycles (counting imports inside functions):\n" + "\n".join(
        problems
    )


def test_cycle_finder() -> None:
    edges = {"a": [("b", False)], "b": [("c", True)], "c": [("a", False)], "d": [("a", False)]}
    assert cycles_of(edges) == [["a", "b", "c"]]
    assert cycles_of({"a": [("b", False)], "b": []}) == []


def test_the_detector_sees_a_cycle(tmp_path: Path) -> None:
    """The watch itself: a two-module cycle planted in a scratch package is reported."""
    pkg = tmp_path / PACKAGE / "cyc"
    pkg.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\nA = 1\n")
    (pkg / "b.py").write_text("from . import a\nB = 2\n")
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        f"sys.path.insert(1, {str(ROOT / 'tests')!r})\n"
        "import test_imports as t\n"
        "events = []\n"
        "t._watch_imports(events)\n"
        f"import {PACKAGE}.cyc.a\n"
        "print(json.dumps(events))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    events = json.loads(proc.stdout)
    assert {"importer": f"{PACKAGE}.cyc.b", "reads": f"{PACKAGE}.cyc.a", "statement": ""} in events


#: what loading the %gpushare extension must not import: it runs on every gpushare kernel's
#: start (issue 12, kernel cold start); these load when a magic runs or a cell fails
KERNEL_START_LAZY = (
    f"{PACKAGE}.share",
    f"{PACKAGE}.errors",
    f"{PACKAGE}.notebook.actions",
    f"{PACKAGE}.notebook.panel",
    f"{PACKAGE}.daemon.client",
    f"{PACKAGE}.daemon.wire",
    f"{PACKAGE}.ledger",
    f"{PACKAGE}.config",
    "sqlite3",
    "kubernetes",
    "kubernetes_asyncio",
    "ipywidgets",
)


def test_the_kernel_extension_loads_without_its_lazy_modules() -> None:
    """``--ext=jupyter_gpushare`` in a real IPython shell (as a gpushare kernel has it) imports
    none of KERNEL_START_LAZY and builds no argument parser; the magic then works and loads
    them on first use."""
    code = (
        "import json, os, sys\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "shell = InteractiveShell.instance()\n"
        "before = set(sys.modules)\n"
        f"import {PACKAGE}\n"
        f"{PACKAGE}.load_ipython_extension(shell)\n"
        "loaded = sorted(set(sys.modules) - before)\n"
        f"from {PACKAGE}.notebook import magics\n"
        "built = magics._parser.cache_info().currsize\n"
        "shell.run_line_magic('gpushare', 'request --gpu-request 2')\n"
        "print(json.dumps({'loaded': loaded, 'built': built,\n"
        "    'after': sorted(set(sys.modules) - before)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env.update(GPUSHARE_ALLOCATION_ID="a-0123456789abcdef", GPUSHARE_SOCKET="/nonexistent/s")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert f"{PACKAGE}.notebook.magics" in result["loaded"]  # the extension did load
    eager = [
        m
        for m in result["loaded"]
        for lazy in KERNEL_START_LAZY
        if m.split(".")[: len(lazy.split("."))] == lazy.split(".")
    ]
    assert not eager, f"loading the %gpushare extension imported {eager}"
    assert result["built"] == 0, "the %gpushare argument parser was built at load"
    # the first use loads what it needs and refuses the bad value by its flag's name
    assert f"{PACKAGE}.share" in result["after"]
    assert "--gpu-request 2 is not allowed" in proc.stderr, proc.stderr[-2000:]


if __name__ == "__main__":
    _child_main(sys.argv[1:])
