"""The package's import graph: no module of `kvtier_rs` imports, even indirectly, a module that
imports it back (type-only and function-level imports counted: a circle there is still one
design knot), and every module imports on its own, in a fresh process where no other kvtier
module was imported first (an import that works only after another module's is a hidden
dependency on import order)."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "python" / "kvtier_rs"
# Third-party modules the package needs, imported once before the per-module children fork, so
# that each child pays only for kvtier's own modules.
THIRD_PARTY = ("numpy", "torch", "prometheus_client", "vllm")


def package_modules() -> dict[str, Path]:
    """Dotted name -> file, for every Python module of the package (packages by __init__.py)."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts[-1] != "__main__":
            out[".".join(parts)] = path
    return out


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `path` imports anywhere in its text. `from pkg import sub` names the
    submodule `sub`, not `pkg`, when `sub` is a module: that is what the import system loads."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            names = {f"{node.module}.{a.name}" for a in node.names}
            found |= names & modules.keys()
            if names - modules.keys():
                found.add(node.module)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    modules = package_modules()
    assert "kvtier_rs.planner.plan" in modules  # the walk found the package
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    assert cycles(graph) == []


# Run in a child interpreter: import the third-party modules, then fork one child per kvtier
# module, which imports just that module. Prints {module: error or null} as JSON.
_IMPORT_EACH = """
import importlib, json, os, sys, traceback
third_party, modules = json.loads(sys.argv[1])
for name in third_party:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.split(".")[0] == "kvtier_rs"], "a dependency imported kvtier"
results = {}
for name in modules:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            msg = b""
        except BaseException:
            msg = traceback.format_exc(limit=3).encode()
        os.write(w, msg[-4000:])
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        err = f.read().decode()
    os.waitpid(pid, 0)
    results[name] = err or None
print(json.dumps(results))
"""


def test_every_module_imports_on_its_own():
    modules = sorted(package_modules())
    have_vllm = importlib.util.find_spec("vllm") is not None
    if not have_vllm:
        # `make check` runs without vLLM; `make test` (CI) has it and imports every module.
        modules = [m for m in modules if not m.startswith("kvtier_rs.integrations.vllm")]
    third_party = [m for m in THIRD_PARTY if importlib.util.find_spec(m) is not None]
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps([third_party, modules])],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    failed = {m: err for m, err in json.loads(out.stdout.splitlines()[-1]).items() if err}
    assert not failed, "\n".join(f"{m}:\n{err}" for m, err in failed.items())
    if not have_vllm:
        pytest.skip("SKIPPED LOUDLY: vLLM is not installed, its adapter's modules were not imported")


def test_nothing_but_its_command_imports_the_rollout():
    """`kvtier rollout` sits on top: it reads the planner and the vLLM config checks, and no
    module of kvtier's own (tiers, orchestrator, adapters, planner) depends on it."""
    modules = package_modules()
    assert "kvtier_rs.rollout.run" in modules
    users = {
        name
        for name, path in modules.items()
        if not name.startswith("kvtier_rs.rollout")
        and any(m.startswith("kvtier_rs.rollout") for m in imports_of(path, modules))
    }
    assert users == {"kvtier_rs.cli.rollout"}
