"""The rooms of the package (docs/architecture.md) as a contract on the import graph, read from the source:
every import of a tracelm module, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tracelm"

# room -> the rooms it may import ("" is the package's own __init__)
ALLOWED = {
    "state": {"state"},
    "kernels": {"kernels"},
    "stages": {"stages", "state", "kernels"},
    "io": {"io", "state", "kernels", "version"},
    # the faces reach the engine through the front door (and the tools and audit above it) only
    "server": {"server", "session", "state", "version", "audit"},  # audit: the trace viewer verifies with it
    "cli": {"cli", "session", "tools", "audit", "server", "state", "version"},
}
NEVER = {  # room -> rooms it must not import (the engine never imports the tools above it)
    "pipeline": {"server", "cli", "tools", "audit", "session"},
    "session": {"server", "cli", "tools", "audit"},
    "tools": {"cli"},
    "audit": {"cli", "server", "tools"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def imports(path: Path, modules: set[str]) -> set[str]:
    """The tracelm modules `path` imports (a `from X import name` counts X, and X.name when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in modules}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: imports(p, set(paths)) - {m} for m, p in paths.items()}


def test_rooms_import_only_what_they_may() -> None:
    bad = []
    for a, targets in graph().items():
        for b in targets:
            ra, rb = room(a), room(b)
            if ra in ALLOWED and rb not in ALLOWED[ra]:
                bad.append(f"{a} -> {b}")
            if rb in NEVER.get(ra, ()) or (rb == "cli" and ra != "cli"):
                bad.append(f"{a} -> {b}")
    assert not bad, bad


def test_no_import_circle() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(n):], n]))
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])


FUNCTION_LINES_MAX = 90  # the longest function before the front door (issue 14) was cli.build_parser, 132 lines


def test_no_function_is_long() -> None:
    """Short functions with the math in view: none in the package is longer than FUNCTION_LINES_MAX lines."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES_MAX:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
