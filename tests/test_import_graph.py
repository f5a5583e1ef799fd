"""No import circles in shinken_sync or webapp.

A small AST walk: every module-level import (including those under ``if
TYPE_CHECKING:`` and ``try:``, which a type checker or another interpreter
follows too; not imports inside functions, which run on use) becomes an edge,
as does the implicit import of each parent package. A cycle is a module that
can reach itself.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("shinken_sync", "webapp")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body)
            todo.extend(node.orelse)
            todo.extend(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor if is_package else anchor[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from pkg import mod`` imports the submodule when there is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                parts = target.split(".")
                # Importing a.b.c runs a and a.b first; a module's own packages are already running.
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in modules and dep != name and not name.startswith(dep + "."):
                        graph[name].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_there_are_no_import_cycles():
    graph = import_graph()
    assert "shinken_sync.client" in graph and "webapp.router" in graph  # the walk found the code
    assert find_cycles(graph) == []


def test_the_checker_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


# --- Layers -------------------------------------------------------------------------------
# docs/architecture.md (Layers) draws these. A module may import its own layer and the layers
# listed for it, never one above. Unlike the cycle walk, every import counts here, including
# those inside functions: an import on use is still a dependency the layer must not have.
# process lifetime, CLI helpers, a child's ready line, the viewer's frame batch (stdlib only)
SHARED = {"shinken_sync", "shinken_sync.lifetime", "shinken_sync.cliargs", "shinken_sync.childproc",
          "shinken_sync.fleet_wire"}
CONTRACT = {"shinken_sync.protocol", "shinken_sync.verbs"}  # the wire and the verb table
LAYER_IMPORTS = {
    "shared": {"shared"},
    "contract": {"shared", "contract"},
    "daemon": {"shared", "contract", "daemon"},
    "sdk": {"shared", "contract", "sdk"},
    "server": {"shared", "server"},
    "app": {"shared", "contract", "daemon", "sdk", "server", "app"},
}


def layer_of(module: str) -> str:
    if module in SHARED:
        return "shared"
    if module in CONTRACT:
        return "contract"
    if module.startswith("webapp"):
        return "server"
    if module == "shinken_sync.cli" or module == "shinken_sync.demo" or module.startswith("shinken_sync.demo."):
        return "app"
    if module.startswith("shinken_sync.daemon"):
        return "daemon"
    return "sdk"


def all_imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Every module of ours that ``name`` imports anywhere in its file (the nearest module of each target)."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for i in range(len(parts), 0, -1):  # the innermost module of ours the target names
                if ".".join(parts[:i]) in modules:
                    found.add(".".join(parts[:i]))
                    break
    found.discard(name)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} ({layer_of(module)}) imports {dep} ({layer_of(dep)})"
                  for module, deps in graph.items() for dep in deps
                  if layer_of(dep) not in LAYER_IMPORTS[layer_of(module)])


def full_import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: all_imports(name, path, modules) for name, path in modules.items()}


def test_no_layer_imports_a_layer_above_it():
    graph = full_import_graph()
    # the walk sees imports inside functions (the demo starts the session server on use)
    assert "webapp.serve" in graph["shinken_sync.demo"]
    assert {layer_of(m) for m in graph} == set(LAYER_IMPORTS)  # every layer has modules
    assert upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"shinken_sync.client": {"webapp.core"}, "shinken_sync.daemon.server": {"shinken_sync.client"},
             "webapp.core": {"shinken_sync.lifetime", "shinken_sync.protocol"},
             "shinken_sync.demo": {"webapp.serve", "shinken_sync.client"}}
    assert upward_imports(graph) == [
        "shinken_sync.client (sdk) imports webapp.core (server)",
        "shinken_sync.daemon.server (daemon) imports shinken_sync.client (sdk)",
        "webapp.core (server) imports shinken_sync.protocol (contract)",
    ]


def test_the_sdk_and_the_daemon_need_only_their_own_requirements():
    """What ``pip install shinken`` (no extra) brings is all the SDK and shinkend import at load time."""
    import sys

    sdk_requires = {"websockets", "PIL", "requests"}  # setup.py SDK; other extras are imported on use, or guarded
    # The modules that are an extra's whole point, and the extra's import (setup.py: [xvfb], [ray]).
    extra_modules = {"shinken_sync.daemon.display.xvfb": "mss", "shinken_sync.providers.ray_cluster": "ray"}
    modules = _modules()
    missing = set()
    for name, path in modules.items():
        if layer_of(name) in ("server", "app"):
            continue
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue
            roots = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for root in (r.split(".")[0] for r in roots):
                if root in sys.stdlib_module_names or root in PACKAGES or root in sdk_requires:
                    continue
                if extra_modules.get(name) != root:
                    missing.add(f"{name}: {root}")
    assert sorted(missing) == []
