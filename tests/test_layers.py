"""The house: the layers of DESIGN.md hold, no module imports another in a cycle, files stay small.

The contracts are those in pyproject.toml ([tool.importlinter]); they run here on
the real import graph, and again on that graph with one bad import added, to
show each would catch what it is for. grimp counts every import, also one
inside a function or under TYPE_CHECKING: a deferred import is still a cycle.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import grimp
import pytest
from importlinter import api
from importlinter.application import use_cases
from importlinter.domain.contract import registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "adaptmem"


@pytest.fixture(scope="module")
def config():
    options = api.read_configuration(str(ROOT / "pyproject.toml"))
    user_options = use_cases.read_user_options(str(ROOT / "pyproject.toml"))
    use_cases._register_contract_types(user_options)
    return options


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("adaptmem", include_external_packages=True, cache_dir=None)


def check(config, graph, name: str) -> bool:
    options = next(c for c in config["contracts_options"] if c["name"] == name)
    contract = registry.get_contract_class(options["type"])(
        name=name, session_options=config["session_options"], contract_options=options
    )
    return contract.check(copy.deepcopy(graph), verbose=False).kept


def test_every_contract_is_kept(config, graph):
    names = [c["name"] for c in config["contracts_options"]]
    assert len(names) == 4
    broken = [name for name in names if not check(config, graph, name)]
    assert not broken, f"broken import contracts: {broken}; run `lint-imports` for the offending imports"


@pytest.mark.parametrize("importer,imported,contract", [
    ("adaptmem.modes", "adaptmem.control.manager", "Layers: arrows point down only"),
    ("adaptmem.strategies.offload", "adaptmem.wrapping.handles", "Layers: arrows point down only"),
    ("adaptmem.devices.select", "adaptmem.testing", "Nothing imports adaptmem.testing"),
    ("adaptmem.control.manager", "transformers", "The core knows no framework"),
    ("adaptmem.strategies.payloads", "adaptmem.strategies.compress", "No import cycles between sibling modules"),
])
def test_each_contract_catches_what_it_is_for(config, graph, importer, imported, contract):
    bad = copy.deepcopy(graph)
    bad.add_import(importer=importer, imported=imported)
    assert not check(config, bad, contract)


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


def test_a_few_small_modules_at_the_top_and_none_large():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    large = {name: n for name, n in sizes.items() if n > 400}
    assert not large, large


def test_every_subpackage_says_what_it_is_for():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 8, f"{init.relative_to(ROOT)} needs a docstring saying what it is for"
