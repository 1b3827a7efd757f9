"""Nothing in the product exists for tests, and nothing changes the process behind its back.

* Importing any module of mpidl (``mpidl``, ``mpidl.kernels``, ``mpidl.data_tools``, walked
  with :mod:`pkgutil`) leaves ``os.environ``, the BLAS libraries' thread counts and Numba's
  unchanged, and applies no thread policy: only an explicit
  :func:`mpidl.engine.threads.apply` does (tests/test_threads.py checks that constructors and
  kernels do not either).
* The product reads its ``MPIDL_*`` variables in :mod:`mpidl.settings` and nowhere else (once,
  when it is imported): no ``os.environ`` / ``getenv`` access to such a name anywhere else in
  ``mpidl/``, ``kernels/`` or ``data_tools/`` (read from the source with :mod:`ast`).
* So a test never sets one of those variables in its own process, where it would change
  nothing: it uses the explicit API (``kernels.use``, ``Conv2d(algorithm=...)``) or replaces
  ``mpidl.settings.SETTINGS`` (the ``mpidl_settings`` fixture, tests/conftest.py). A child
  process (``python -m mpidl.train`` under mpiexec) may be given one in its environment, as a
  user gives it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it is installed as (pyproject.toml's package-dir)
PACKAGES = {"mpidl": "mpidl", "kernels": "mpidl.kernels", "data_tools": "mpidl.data_tools"}
#: the one module that reads mpidl's environment variables
SETTINGS_FILE = "mpidl/settings.py"
#: Modules that are programs, run on import by design, so not imported here: ``python -m``
#: entry files, and the example training script (its whole body is the training loop).
PROGRAM_MODULES = ("mpidl.data_tools.__main__", "mpidl.examples.custom_loop")

_IMPORT_ALL = r"""
import importlib, json, os, pkgutil, sys, traceback
import numpy, scipy.linalg.cython_blas  # every BLAS library, loaded before the first look
import numba
from threadpoolctl import threadpool_info

def blas():
    return {p["filepath"]: p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}

skip = set(sys.argv[1].split(","))
environ, counts, numba_threads = dict(os.environ), blas(), numba.get_num_threads()
imported, failed = [], {}

def walk_error(name):
    failed[name] = traceback.format_exc(limit=-3)

for root in ("mpidl", "mpidl.kernels", "mpidl.data_tools"):
    try:
        package = importlib.import_module(root)
    except Exception:
        failed[root] = traceback.format_exc(limit=-3)
        continue
    imported.append(root)
    for info in pkgutil.walk_packages(package.__path__, root + ".", onerror=walk_error):
        if info.name in skip:
            continue
        try:
            importlib.import_module(info.name)
            imported.append(info.name)
        except Exception:
            failed[info.name] = traceback.format_exc(limit=-3)

from mpidl.engine import threads
after = dict(os.environ)
print(json.dumps({
    "imported": imported, "failed": failed,
    "added": {k: after[k] for k in after.keys() - environ.keys()},
    "removed": sorted(environ.keys() - after.keys()),
    "changed": {k: [environ[k], after[k]] for k in environ.keys() & after.keys() if environ[k] != after[k]},
    "blas_before": counts, "blas_after": {k: v for k, v in blas().items() if k in counts},
    "numba_before": numba_threads, "numba_after": numba.get_num_threads(),
    "policy_applied": threads.describe()["threads"],
}))
"""


@pytest.fixture(scope="module")
def import_everything() -> dict:
    """Every module of the product imported in one fresh interpreter, and what changed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "OPENBLAS_", "MKL_", "NUMBA_NUM_THREADS",
                                                                       "OMPI_MCA_osc"))}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL, ",".join(PROGRAM_MODULES)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_every_module_leaves_the_environment_alone(import_everything):
    result = import_everything
    assert len(result["imported"]) > 50, result["imported"]  # the walk found the package
    assert {"mpidl.distributed", "mpidl.engine.params", "mpidl.kernels.cpu", "mpidl.data_tools.hsi"} <= set(
        result["imported"]), result["imported"]
    changes = {key: result[key] for key in ("added", "removed", "changed") if result[key]}
    assert not changes, f"importing mpidl's modules changed os.environ: {changes}"


def test_importing_every_module_leaves_the_thread_counts_alone(import_everything):
    result = import_everything
    assert result["blas_before"], "no BLAS library seen"
    assert result["blas_after"] == result["blas_before"]
    assert result["numba_after"] == result["numba_before"]
    assert result["policy_applied"] is None  # threads.apply() was not called by any import


def test_every_module_imports(import_everything):
    """Else the checks above did not see it (a module that fails half-way may still have
    changed the process)."""
    assert not import_everything["failed"], "\n".join(f"{name}:\n{error}" for name, error
                                                      in import_everything["failed"].items())


# --------------------------------------------------------------------------------------------
# MPIDL_* variables are read in mpidl/settings.py only
# --------------------------------------------------------------------------------------------


def _product_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three source folders."""
    modules = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([dotted, *parts])] = path
    return modules


def _constants(tree: ast.Module) -> dict[str, str]:
    """The module-level ``NAME = "..."`` string constants of a module."""
    found = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            found.update({t.id: value.value for t in targets if isinstance(t, ast.Name)})
    return found


class _EnvironmentReads(ast.NodeVisitor):
    """Every access to the process environment (``os.environ`` / ``environ`` subscripts,
    ``.get``, ``.pop``, ``.setdefault``, ``in``; ``os.getenv``, ``putenv``, ``unsetenv``) whose
    variable name is, or starts as, a string: ``(line, name)`` in ``self.found``."""

    def __init__(self, names: dict[str, str], modules: dict[str, dict[str, str]]):
        self.names = names  # local name -> string it stands for (this module's and imported constants)
        self.modules = modules  # local name of an imported product module -> its constants
        self.found: list[tuple[int, str]] = []

    def text(self, node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in self.modules:
            return self.modules[node.value.id].get(node.attr)
        if isinstance(node, ast.JoinedStr) and node.values:  # f"MPIDL_{...}": its constant head
            return self.text(node.values[0])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "MPIDL_" + x
            return self.text(node.left)
        return None

    @staticmethod
    def is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")
                or isinstance(node, ast.Name) and node.id in ("environ", "environb"))

    def note(self, node, key) -> None:
        name = self.text(key)
        if name is not None:
            self.found.append((node.lineno, name))

    def visit_Subscript(self, node):
        if self.is_environ(node.value):
            self.note(node, node.slice)
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if node.args and isinstance(func, ast.Attribute):
            if self.is_environ(func.value) and func.attr in ("get", "pop", "setdefault", "__getitem__"):
                self.note(node, node.args[0])
            if func.attr in ("getenv", "getenvb", "putenv", "unsetenv"):
                self.note(node, node.args[0])
        elif node.args and isinstance(func, ast.Name) and func.id in ("getenv", "getenvb", "putenv", "unsetenv"):
            self.note(node, node.args[0])
        self.generic_visit(node)

    def visit_Compare(self, node):
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.In, ast.NotIn)) and self.is_environ(right):
                self.note(node, node.left)
        self.generic_visit(node)


def _product_constants() -> dict[str, dict[str, str]]:
    """Module -> its module-level string constants, for every module of the product."""
    return {name: _constants(ast.parse(path.read_text(), filename=str(path))) for name, path in _product_files().items()}


def _names_in(tree: ast.Module, constants: dict[str, dict[str, str]]) -> tuple[dict[str, str], dict[str, dict]]:
    """The string constants a module can name: its own and those it imports from the product
    (``from mpidl.faults import ENV``); and its aliases of product modules (``from mpidl import
    faults``, ``import mpidl.faults as f``) with their constants."""
    names, modules = _constants(tree), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in constants:
                    modules[alias.asname or alias.name] = constants[full]
                elif alias.name in constants.get(node.module, {}):
                    names[alias.asname or alias.name] = constants[node.module][alias.name]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in constants:
                    modules[alias.asname] = constants[alias.name]
    return names, modules


def environment_reads(prefix: str = "MPIDL_") -> list[str]:
    """``path:line: NAME`` for every access to an environment variable named ``prefix...`` in
    the product outside mpidl/settings.py."""
    files = _product_files()
    constants = _product_constants()
    offenders = []
    for module, file in files.items():
        path = file.relative_to(ROOT).as_posix()
        if path == SETTINGS_FILE:
            continue
        tree = ast.parse(file.read_text(), filename=str(file))
        visitor = _EnvironmentReads(*_names_in(tree, constants))
        visitor.visit(tree)
        offenders += [f"{path}:{line}: {name}" for line, name in visitor.found if name.startswith(prefix)]
    return sorted(offenders)


def test_the_scan_sees_each_way_of_reading_a_variable(tmp_path, monkeypatch):
    """The scan itself: literal, module constant, imported constant, f-string, ``in``,
    ``getenv``, a write; and a mention in a docstring or an unrelated dict is not a read."""
    source = '''
"""MPIDL_KERNELS=reference in a docstring is no read."""
import os
from os import environ, getenv
from mpidl.faults import ENV as FAULT
from mpidl import faults
OWN = "MPIDL_OWN"
a = os.environ.get("MPIDL_A")
b = os.environ["MPIDL_B"]
c = environ.get(OWN, "")
d = getenv(FAULT)
e = os.environ.get(faults.ENV)
f = "MPIDL_F" in os.environ
g = os.environ.get(f"MPIDL_{a}")
os.environ.setdefault("MPIDL_H", "1")
unrelated = {"MPIDL_I": 1}.get("MPIDL_I")
ok = os.environ.get("OMP_NUM_THREADS")
'''
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "probe.py").write_text(source)
    (tmp_path / "mpidl").mkdir()
    (tmp_path / "mpidl" / "faults.py").write_text('ENV = "MPIDL_INJECT_FAULT"\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", {"mpidl": "mpidl", "kernels": "mpidl.kernels"})
    lines = {int(entry.split(":")[1]): entry.rsplit(": ", 1)[1] for entry in environment_reads()}
    assert lines == {8: "MPIDL_A", 9: "MPIDL_B", 10: "MPIDL_OWN", 11: "MPIDL_INJECT_FAULT", 12: "MPIDL_INJECT_FAULT",
                     13: "MPIDL_F", 14: "MPIDL_", 15: "MPIDL_H"}, lines


def test_mpidl_variables_are_read_in_settings_only():
    """``MPIDL_*`` is read once, by mpidl/settings.py (``settings.SETTINGS``); anywhere else a
    read would be a second way in, one that a test can only reach through the environment."""
    offenders = environment_reads()
    assert not offenders, "read MPIDL_* outside mpidl/settings.py (go through mpidl.settings.SETTINGS):\n" + \
        "\n".join(offenders)


# --------------------------------------------------------------------------------------------
# the tests set none of those variables in their own process
# --------------------------------------------------------------------------------------------


#: the comment that marks a late write as the check of the rule itself (the value must change nothing)
READ_ONCE_CHECK = "# too late:"


def _in_process_settings(path: Path, variables: tuple[str, ...], constants: dict[str, dict[str, str]]) -> list[str]:
    """``monkeypatch.setenv`` / ``delenv`` and ``os.environ`` writes of ``variables`` in ``path``
    (through a literal, or a constant of its own or imported from the product): in a test
    process they change nothing the product reads."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    names, _ = _names_in(tree, constants)
    lines = source.splitlines()
    found = []

    def text(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return names.get(node.id) if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = ast.unparse(node.func.value)
            if node.func.attr in ("setenv", "delenv") and "monkeypatch" in owner:
                key = node.args[0]
            elif node.func.attr in ("setdefault", "pop", "update") and owner in ("os.environ", "environ"):
                key = node.args[0]
        elif isinstance(node, (ast.Assign, ast.Delete)):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) in ("os.environ", "environ"):
                    key = target.slice
        if key is not None and text(key) in variables and READ_ONCE_CHECK not in lines[node.lineno - 1]:
            found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: {text(key)}")
    return found


def test_no_test_or_benchmark_sets_a_setting_in_its_own_process():
    from mpidl.settings import ENVIRONMENT

    constants = _product_constants()
    offenders = []
    for folder in ("tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            offenders += _in_process_settings(path, ENVIRONMENT, constants)
    assert not offenders, ("mpidl reads these once, at import (mpidl.settings): use the explicit API or the "
                           "mpidl_settings fixture (tests/conftest.py):\n" + "\n".join(offenders))
