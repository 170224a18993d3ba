"""Whether a listed model's modules may have changed: a global registration hook counts the
modules registered into any module a list was made of (`listed`), so that a list of a model's
modules, made once, is made again only after a change to it. A registration elsewhere does not
count: Hugging Face models slice their `nn.ModuleList` of layers in every forward, which
registers each layer into a new list."""

from __future__ import annotations

import weakref
from typing import Any

import torch

_count = 0
_hook: Any = None
_watched: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _registered(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    global _count
    if module in _watched:
        _count += 1


def registrations() -> int:
    """Modules registered into listed modules since the first call (which installs the hook)."""
    global _hook
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_module_registration_hook(_registered)
    return _count


def listed(root: torch.nn.Module) -> tuple[list[torch.nn.Module], int]:
    """`root.modules()` as a list, watched from now on, and the count it is current for: while
    `registrations()` returns that count, no module was registered into any of them."""
    registrations()
    modules = list(root.modules())
    _watched.update(modules)
    return modules, _count
