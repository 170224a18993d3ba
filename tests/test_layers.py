"""The house: the layers of docs/design.md hold, no module imports another in a cycle, the top stays small.

The contracts are those in pyproject.toml ([tool.importlinter]). They run here through
import-linter's command line, `lint-imports`, on the real package, and again on a copy of
the package with one bad import added, to show each would catch what it is for. grimp
counts every import, also one inside a function or under TYPE_CHECKING: a deferred import
is still a cycle.
"""

from __future__ import annotations

import ast
import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "adaptmem"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    """`lint-imports` on the adaptmem package found first on sys.path from `root`."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    args = [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(root / "pyproject.toml")]
    for contract in contracts:
        args += ["--contract", contract]
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("adaptmem", include_external_packages=True, cache_dir=None)


def test_every_contract_is_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(
    "importer,imported,contract",
    [
        ("adaptmem.modes", "adaptmem.control.manager", "layers"),
        ("adaptmem.strategies.offload", "adaptmem.wrapping.handles", "layers"),
        ("adaptmem.devices.select", "adaptmem.testing", "no-testing"),
        ("adaptmem.control.manager", "transformers", "no-framework"),
        ("adaptmem.strategies.payloads", "adaptmem.strategies.compress", "acyclic"),
    ],
)
def test_each_contract_catches_what_it_is_for(tmp_path, importer, imported, contract):
    shutil.copytree(PACKAGE, tmp_path / "adaptmem", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert lint_imports(tmp_path, contract).returncode == 0  # the copy as it is keeps it
    module = tmp_path.joinpath(*importer.split(".")).with_suffix(".py")
    module.write_text(module.read_text() + f"\n\ndef _bad():\n    import {imported}  # noqa\n")
    broken = lint_imports(tmp_path, contract)
    assert broken.returncode != 0, broken.stdout
    assert "1 broken" in broken.stdout, broken.stdout


def strongly_connected(graph) -> list[set[str]]:
    """Module-level import cycles (Tarjan), each as the set of modules in it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if not other.startswith("adaptmem"):
                continue
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == module:
                    break
            if len(component) > 1 or module in graph.find_modules_directly_imported_by(module):
                found.append(component)

    for module in sorted(m for m in graph.modules if m.startswith("adaptmem")):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_another_in_a_cycle(graph):
    assert strongly_connected(graph) == []


def test_the_cycle_finder_finds_a_deferred_cycle(graph):
    bad = copy.deepcopy(graph)
    bad.add_import(importer="adaptmem.devices.select", imported="adaptmem.control.manager")
    cycles = strongly_connected(bad)
    assert cycles and {"adaptmem.devices.select", "adaptmem.control.manager"} <= cycles[0]


def test_a_few_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_every_subpackage_says_what_it_is_for():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 8, f"{init.relative_to(ROOT)} needs a docstring saying what it is for"
