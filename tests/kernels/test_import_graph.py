"""``aiomm.kernels`` imports flow one way: no cycle among its modules.

Read from the files' syntax trees, so every import counts: module level, inside functions (a lazy
import that closes a loop is still a loop) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from python_source import parse_file

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
PACKAGE = "aiomm.kernels"


def module_names(folder: Path, package: str) -> dict[str, Path]:
    """Every module of the package in ``folder`` (one level: kernels/ has no subpackages)."""
    names = {package: folder / "__init__.py"}
    for path in sorted(folder.glob("*.py")):
        if path.name != "__init__.py":
            names[f"{package}.{path.stem}"] = path
    return names


def imports_of(name: str, path: Path, modules: set[str], package: str) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its file."""
    here = package if name == package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            # `from pkg import sub` imports the submodule; `from pkg import name` the package
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    names = module_names(folder, package)
    return {n: imports_of(n, p, set(names), package) for n, p in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module, as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_through(graph, group) for group in groups]


def _path_through(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A concrete loop ``a -> b -> ... -> a`` inside one strongly connected group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    return group  # pragma: no cover - a strongly connected group always loops back


def test_kernels_have_no_import_cycle() -> None:
    graph = import_graph(KERNELS, PACKAGE)
    assert f"{PACKAGE}.norm" in graph and f"{PACKAGE}._triton_norm" in graph
    found = cycles(graph)
    assert not found, "import cycles in aiomm.kernels: " + "; ".join(" -> ".join(c) for c in found)


def test_launchers_and_modules_share_checks_from_below() -> None:
    """The module, both launchers and the table lookups import the shared checks, and no
    launcher imports the module it serves."""
    graph = import_graph(KERNELS, PACKAGE)
    k = PACKAGE
    assert f"{k}._norm_checks" in graph[f"{k}.norm"] & graph[f"{k}._triton_norm"]
    assert f"{k}._norm_checks" in graph[f"{k}.table_norm"]
    assert f"{k}._resample_plan" in graph[f"{k}.resample"] & graph[f"{k}._triton_resample"]
    for launcher, module in (("_triton_norm", "norm"), ("table_norm", "norm"),
                             ("_triton_resample", "resample")):  # fmt: skip
        assert f"{k}.{module}" not in graph[f"{k}.{launcher}"], launcher


@pytest.mark.parametrize(
    ("files", "loop"),
    [
        (  # the knot this test guards against: a function-level import closes the loop
            {
                "mod.py": "from ._launch import go\n",
                "_launch.py": "def go():\n    from .mod import check\n    return check\n",
            },
            ["pkg._launch", "pkg.mod", "pkg._launch"],
        ),
        (
            {
                "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from .b import B\n",
                "b.py": "import pkg.c\n",
                "c.py": "from pkg import a\n",
            },
            ["pkg.a", "pkg.b", "pkg.c", "pkg.a"],
        ),
        ({"a.py": "from . import b\n", "b.py": "from .c import x\n", "c.py": ""}, None),
    ],
    ids=["function-level", "three-modules", "no-cycle"],
)
def test_the_check_finds_cycles(
    tmp_path: Path, files: dict[str, str], loop: list[str] | None
) -> None:
    (tmp_path / "__init__.py").write_text("from .a import x\n" if "a.py" in files else "")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    found = cycles(import_graph(tmp_path, "pkg"))
    assert found == ([] if loop is None else [loop])
