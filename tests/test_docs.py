"""The docs cannot drift: every Python block in README.md and docs/ parses, the README's own loop
runs as written, and every link between the pages lands on a file and a heading that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from helpers import tiny, tiny_batch

import adaptmem

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def python_blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in BLOCK.finditer(text)]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    found, fence = set(), False
    for line in page.read_text().splitlines():
        fence ^= line.startswith("```")
        if not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_parses(page):
    for line, code in python_blocks(page):
        try:
            ast.parse(code)
        except SyntaxError as err:
            pytest.fail(f"{page.name}:{line + (err.lineno or 0)}: {err.msg}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_lands_on_a_page_and_a_heading(page):
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        landing = (page.parent / path).resolve() if path else page
        assert landing.exists(), f"{page.name}: {target} (no such file)"
        if anchor and landing.suffix == ".md":
            assert anchor in anchors(landing), f"{page.name}: {target} (no such heading)"


def test_the_readmes_own_loop_runs_as_written():
    """The first block under "Three ways in", with `model`, `loader` and `opt` of a user's."""
    text = (ROOT / "README.md").read_text()
    code = BLOCK.search(text, text.index("## Three ways in")).group(1)
    assert "mem.run_step(" in code
    model = tiny(n_layers=2)
    loader = [tiny_batch(model, batch=2, seq=16) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    scope = {"model": model, "loader": loader, "opt": opt}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["mem"].summary()["steps"] == len(loader)  # each batch a managed step
    assert adaptmem.get_handles(model) == []  # and the model given back as it was
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained
