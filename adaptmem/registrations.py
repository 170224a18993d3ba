"""Whether a listed model's modules may have changed: global registration hooks count the
modules, parameters and buffers registered into any module a list was made of (`listed`), so
that a list of a model's modules, made once, is made again only after a change to it. A registration elsewhere does not
count: Hugging Face models slice their `nn.ModuleList` of layers in every forward, which
registers each layer into a new list."""

from __future__ import annotations

import weakref
from typing import Any

import torch

_count = 0
_hook: Any = None
_watched: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _registered(module: torch.nn.Module, name: str, value: object) -> None:
    global _count
    if module in _watched:
        _count += 1


def registrations() -> int:
    """Modules, parameters and buffers registered into listed modules since the first call (which
    installs the hooks). A parameter or buffer set by assignment (`module.weight = ...`) is
    registered; one put into `module._parameters` directly is not (FSDP2 swaps its sharded and
    gathered parameters so), which readers of those dicts see as they read them."""
    global _hook
    if _hook is None:
        module = torch.nn.modules.module
        _hook = (
            module.register_module_module_registration_hook(_registered),
            module.register_module_parameter_registration_hook(_registered),
            module.register_module_buffer_registration_hook(_registered),
        )
    return _count


def listed(root: torch.nn.Module) -> tuple[list[torch.nn.Module], int]:
    """`root.modules()` as a list, watched from now on, and the count it is current for: while
    `registrations()` returns that count, no module was registered into any of them."""
    registrations()
    modules = list(root.modules())
    _watched.update(modules)
    return modules, _count
