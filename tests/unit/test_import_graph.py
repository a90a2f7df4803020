"""The import graph: arrows point from the services to ``tandem`` only, never back, never sideways
between services; no package (a service, or a package of ``tandem``) reaches itself through
another, lazy imports inside functions included; no module reaches itself through the imports
that run when it is imported. Imports under ``TYPE_CHECKING`` never run and do not count.

(A lazy import inside one package that picks an implementation, as ``tandem.engine.attention``
does for flashinfer, is not counted as a module cycle.)"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("router", "prefill_svc", "decode_svc", "gpu_agent")
PACKAGES = ("tandem", *SERVICES)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "/v1/" in path.as_posix():  # generated stubs import only each other and protobuf
                continue
            out[_module_name(path)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, lazy: bool) -> Iterator[str]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (name for child in node.orelse for name in _imports(child, module, is_package, lazy))
            continue
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        else:
            yield from _imports(node, module, is_package, lazy)


def _graph(lazy: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = set()
        for imported in _imports(tree, name, path.name == "__init__.py", lazy):
            # `from pkg import mod` names a module; `from mod import func` the module itself.
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _top(module: str) -> str:
    return module.split(".")[0]


def test_arrows_point_from_services_to_tandem_only() -> None:
    wrong = sorted((src, dst) for src, dsts in _graph().items() for dst in dsts
                   if _top(dst) != "tandem" and _top(dst) != _top(src))
    assert not wrong, wrong


def _package(module: str) -> str:
    """``tandem.engine`` for ``tandem.engine.llm``; a top-level module of ``tandem`` is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "tandem" else parts[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_package_reaches_itself_through_another() -> None:
    packages: dict[str, set[str]] = {}
    for src, dsts in _graph(lazy=True).items():
        packages.setdefault(_package(src), set()).update(_package(d) for d in dsts if _package(d) != _package(src))
    cycles = _cycles(packages)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_itself_when_imported() -> None:
    cycles = _cycles(_graph(lazy=False))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert not _cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()})


def test_the_graph_sees_the_imports() -> None:
    graph = _graph()
    assert "router.core" in graph["router.server"] and "tandem.protocol" in graph["router.core"]
    assert "router.core" in graph["router.http"] and "router.server" not in graph["router.http"]
