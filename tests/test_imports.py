"""The package imports cleanly: no ``__path__`` trick, no import cycle; and the house rules
of the layers hold (layers never import MPI, the distributed package never imports a layer,
the distributed core never names what is built around it).

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


def import_graph(external: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of the project it imports (anywhere in its body). ``external``,
    when given, is filled with module -> the top-level names of the other packages it imports
    (``mpi4py``, ``numpy``, ...)."""
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
            if external is not None and not (isinstance(node, ast.ImportFrom) and node.level):
                external.setdefault(name, set()).update(
                    t.partition(".")[0] for t in targets if t.partition(".")[0] not in PACKAGES.values())
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


# ------------------------------------------------------------------ the house rules
def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (lazy imports included)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def in_package(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_only_the_distributed_package_imports_mpi():
    """Every MPI call lives in ``mpidl/distributed/``: no other module imports ``mpi4py``."""
    external: dict[str, set[str]] = {}
    import_graph(external)
    assert "mpi4py" in external["mpidl.distributed.topology"]  # the check sees them
    outside = sorted(m for m, names in external.items()
                     if "mpi4py" in names and not in_package(m, "mpidl.distributed"))
    assert outside == [], f"import mpi4py outside mpidl.distributed: {outside}"


def test_layers_never_import_mpi():
    """The layers, the models, the optimizers and the kernels (``mpidl.engine``,
    ``mpidl.kernels``) import nothing of ``mpidl.distributed``, even through another module."""
    graph = import_graph()
    bad = {m: sorted(d for d in reachable(graph, m) if in_package(d, "mpidl.distributed"))
           for m in graph if in_package(m, "mpidl.engine", "mpidl.kernels")}
    assert "mpidl.engine.nn.conv" in bad
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_distributed_package_never_imports_a_layer():
    """``mpidl.distributed`` knows no layer, model, optimizer, data set or training loop
    (``mpidl.engine.backend`` and the kernels, array code, it may use); even through another
    module."""
    layers = ("mpidl.engine.nn", "mpidl.engine.models", "mpidl.engine.optim", "mpidl.app", "mpidl.data")
    graph = import_graph()
    bad = {m: sorted(d for d in reachable(graph, m) if in_package(d, *layers))
           for m in graph if in_package(m, "mpidl.distributed")}
    assert "mpidl.distributed.extras.overlap" in bad
    assert {m: d for m, d in bad.items() if d} == {}


#: the distributed core: DataParallel, the exchange interface and the three strategies
CORE = ["mpidl.distributed." + name for name in ("data_parallel", "exchange", "flat", "hierarchical", "node")]
#: what is built around the core, which the core never names
AROUND_THE_CORE = ("mpidl.distributed.extras", "mpidl.distributed.emulation", "mpidl.distributed.elastic",
                   "mpidl.distributed.build")


def test_the_distributed_core_imports_nothing_built_around_it():
    """``mpidl/distributed/{data_parallel,exchange,flat,hierarchical,node}.py`` import nothing
    from ``extras/``, ``emulation/``, ``elastic/`` or ``build.py``, directly, lazily or through
    another module (they are composed around the core by ``build.py``, never named by it)."""
    graph = import_graph()
    assert all(m in graph for m in CORE)
    bad = {m: sorted(d for d in reachable(graph, m) if in_package(d, *AROUND_THE_CORE)) for m in CORE}
    assert {m: d for m, d in bad.items() if d} == {}
    # the check sees such an edge
    assert reachable({"a": {"b"}, "b": {"mpidl.distributed.extras.shm"}, "mpidl.distributed.extras.shm": set()},
                     "a") == {"b", "mpidl.distributed.extras.shm"}
