"""How many modules have been registered anywhere in this process: a global registration hook
counts them, so that a list of a model's modules, made once, is made again only after a change."""

from __future__ import annotations

from typing import Any

import torch

_count = 0
_hook: Any = None


def _registered(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    global _count
    _count += 1


def registrations() -> int:
    """Modules registered since the first call (which installs the counting hook)."""
    global _hook
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_module_registration_hook(_registered)
    return _count
