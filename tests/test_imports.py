"""The package imports cleanly: no ``__path__`` trick, no import cycle.

The import graph is read from the source with :mod:`ast`: every ``import`` and ``from ...
import`` statement, at module level or inside a function, between the modules of
``mpidl/``, ``kernels/`` (installed as ``mpidl.kernels``) and ``data_tools/`` (installed as
``mpidl.data_tools``). An edge goes to the module named, or to the package when the name is
an attribute of its ``__init__``; importing ``a.b.c`` is not counted as importing the
packages ``a`` and ``a.b`` (Python initialises those first, but a package's ``__init__``
importing its own submodules is not a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: source folder -> dotted package it is installed as (pyproject.toml's package-dir)
PACKAGES = {"mpidl": "mpidl", "kernels": "mpidl.kernels", "data_tools": "mpidl.data_tools"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three source folders."""
    modules = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([dotted, *parts])] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the project it imports (anywhere in its body)."""
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                for alias in node.names:
                    full = f"{origin}.{alias.name}"
                    targets.append(full if full in modules else origin)
            for target in targets:
                # `import mpidl.kernels.cpu` names a module; a deeper dotted name may be an
                # attribute path: fall back to the longest prefix that is a module.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    white, grey, black = 0, 1, 2
    colour = {n: white for n in graph}
    stack: list[str] = []

    def visit(node):
        colour[node] = grey
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == grey:
                return stack[stack.index(nxt):] + [nxt]
            if colour[nxt] == white:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = black
        return None

    for node in sorted(graph):
        if colour[node] == white:
            found = visit(node)
            if found:
                return found
    return None


def test_graph_covers_the_three_folders():
    graph = import_graph()
    assert "mpidl.kernels.recurrent_reference" in graph
    assert "mpidl.data_tools.synthetic" in graph
    assert "mpidl.distributed.data_parallel" in graph
    # The parser sees function-level imports too (a lazy import is still an edge).
    assert "mpidl.engine.backend" in graph["mpidl.kernels.recurrent_reference"]


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_package_init_does_not_touch_path():
    tree = ast.parse((ROOT / "mpidl" / "__init__.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "__path__" not in names | attributes
