"""The package's imports flow one way: no module imports (at any depth, in any function or
``TYPE_CHECKING`` block) a module that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from python_source import parse_file

import aiomm

ROOTS = {
    "aiomm": Path(aiomm.__file__).parent,
    "aiomm.kernels": Path(aiomm.__file__).parents[1] / "kernels",
    "aiomm.adapters": Path(aiomm.__file__).parents[1] / "adapters",
}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``aiomm.kernels`` lives in ``kernels/``)."""
    found: dict[str, Path] = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "aiomm" and parts and parts[0] in ("kernels", "adapters"):
                continue
            found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(parse_file(path)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        for target in targets:
            # the deepest package module the import names (``from x import y`` may name one)
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def package_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    graph = {name: imports_of(name, path, known) for name, path in found.items()}
    # Importing a submodule initialises its parent packages first anyway; a package's
    # re-exports of its own submodules are not cycles.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    return graph


def test_the_package_has_no_import_cycle() -> None:
    graph = package_graph()
    assert len(graph) > 40
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from .norm import x", {"aiomm.kernels.norm"}),
        ("def f():\n    from aiomm.kernels import norm", {"aiomm.kernels", "aiomm.kernels.norm"}),
        ("if TYPE_CHECKING:\n    import aiomm.kernels.norm", {"aiomm.kernels.norm"}),
    ],
)
def test_imports_are_found_at_any_depth(tmp_path: Path, source: str, expected: set[str]) -> None:
    path = tmp_path / "table_norm.py"
    path.write_text(source)
    known = {"aiomm", "aiomm.kernels", "aiomm.kernels.norm", "aiomm.kernels.table_norm"}
    assert imports_of("aiomm.kernels.table_norm", path, known) == expected


def test_the_top_level_holds_few_modules_and_the_rest_are_packages_per_concern() -> None:
    top = [p.name for p in ROOTS["aiomm"].iterdir() if p.suffix == ".py"]
    assert len(top) <= 12, sorted(top)
    packages = {p.name for p in ROOTS["aiomm"].iterdir() if (p / "__init__.py").exists()}
    assert {"engine", "media", "cache", "device", "processing", "vllm", "server", "tuning"} <= (
        packages
    )


def _imports_under(graph: dict[str, set[str]], prefix: str) -> set[str]:
    return {t for name, targets in graph.items() if name.startswith(prefix) for t in targets}


def test_the_server_and_ray_share_aiomm_vllm_and_neither_imports_the_other() -> None:
    graph = package_graph()
    server, ray = _imports_under(graph, "aiomm.server"), _imports_under(graph, "aiomm.integrations")
    vllm = _imports_under(graph, "aiomm.vllm")
    assert any(t.startswith("aiomm.vllm") for t in server)
    assert any(t.startswith("aiomm.vllm") for t in ray)
    assert not any(t.startswith("aiomm.integrations") for t in server)
    assert not any(t.startswith("aiomm.server") for t in ray | vllm)


def test_the_server_has_no_fetch_or_hash_code_of_its_own() -> None:
    """It hands URLs to the engine, whose load and hash stages fetch and identify them (vLLM's
    mm_hash as the engine's hasher)."""
    graph = package_graph()
    server = _imports_under(graph, "aiomm.server")
    assert not server & {"aiomm.media.fetch", "aiomm.media.hashing", "aiomm.vllm.mm_hash"}
    sources = [p.read_text() for p in (ROOTS["aiomm"] / "server").rglob("*.py")]
    assert not any("blake3" in s for s in sources)
