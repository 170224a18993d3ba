"""The docs cannot drift: every Python block in README.md and docs/ parses and runs as written (on a
small Hugging Face Llama, with a user's loader, optimizer, Lightning module and Trainer arguments
around it), the README's own loop trains, and every link between the pages lands on a file and a
heading that exist."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import hf_arguments, hf_batch, lightning_trainer, llama, tiny, tiny_batch

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


BLOCKS = [(page, line, code) for page in PAGES for line, code in python_blocks(page)]


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 8, seq: int = 16, vocab: int = 256) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def _user_scope(tmp_path: Path) -> dict:
    """What a block takes as given: the user's model (a Hugging Face Llama: `model.layers.N`,
    `lm_head`), a batch, a loader, an optimizer, a Lightning module and loaders, Trainer arguments
    and a dataset, and an open manager for the blocks that use one made before them."""
    import lightning.pytorch as pl
    from transformers import Trainer

    model = llama(layers=4, hidden=64, vocab=256)
    loader = [hf_batch(batch=2, seq=16, vocab=256) for _ in range(2)]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama(layers=2, hidden=64, vocab=256)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def validation_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    batches = torch.utils.data.DataLoader(loader, batch_size=None)
    return {
        "adaptmem": adaptmem,
        "torch": torch,
        "model": model,
        "batch": loader[0],
        "loader": loader,
        "opt": torch.optim.SGD(model.parameters(), lr=0.01),
        "module": Module(),
        "train_loader": batches,
        "val_loader": batches,
        # the user's Trainer, quiet and short: two steps
        "lightning": types.SimpleNamespace(
            Trainer=lambda **kw: lightning_trainer(max_steps=2, limit_val_batches=1, **kw)
        ),
        "Trainer": Trainer,
        "args": hf_arguments(tmp_path / "hf", max_steps=2),
        "data": _Tokens(),
    }


@pytest.mark.parametrize("page, line, code", BLOCKS, ids=[f"{p.name}:{n}" for p, n, _ in BLOCKS])
def test_every_python_block_runs(page, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the blocks write their logs and states where they run
    scope = _user_scope(tmp_path)
    if re.search(r"\bmem\.", code) and not re.search(r"\bmem = |as mem\b", code):  # a manager made before it
        scope["mem"] = adaptmem.manage(scope["model"])
    sharding = "fully_shard(" in code  # FSDP2 wants a process group: one of one rank, as torchrun would start
    if sharding:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        exec(compile(code, f"{page.name}:{line}", "exec"), scope)
    finally:
        if sharding:
            dist.destroy_process_group()
        mem = scope.get("mem")
        if isinstance(mem, adaptmem.MemoryManager):
            mem.close()
    assert adaptmem.get_handles(scope["model"]) == [] or "instrument(" in code  # the model given back
    for log in re.findall(r'log="([^"]+)"', code):  # a block that logs ran its steps
        records = adaptmem.read_log(tmp_path / log)
        assert any(r["type"] == "step" for r in records), (log, [r["type"] for r in records])
