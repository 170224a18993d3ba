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


class ListedModules:
    """A model's modules, listed once and again only after a module is registered into one of
    them (`adaptmem.registrations`): a step's guard reads each module's parameters and
    buffers in place, as `model.parameters()` / `buffers()` give them (in order, each once),
    without walking the model, which took 0.2 ms a step on 24 small blocks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self._dicts: dict[str, list[dict]] = {}  # per kind, the modules' dicts that hold any
        self._generation = -1

    def tensors(self, kind: str, *, once: bool = True) -> list[torch.Tensor]:
        """The model's parameters ("_parameters") or buffers ("_buffers"), each once, in order:
        read from the modules' own dicts at each call (a parameter swapped into one in place
        is read as it stands), skipping the modules that had none when listed (registering
        one into them lists them again). `once=False`: a tensor in two places (tied weights)
        comes twice, for a reader to whom that makes no difference, without the check."""
        model = self._model()
        if model is None:
            return []
        if self._generation != registrations():
            modules, self._generation = listed(model)
            self._dicts = {k: [d for d in (getattr(m, k) for m in modules) if d] for k in ("_parameters", "_buffers")}
        out = [t for held in self._dicts[kind] for t in held.values() if t is not None]
        if once and len(set(map(id, out))) < len(out):  # one tensor in two places (tied weights): the first only
            seen: set[int] = set()
            out = [t for t in out if not (id(t) in seen or seen.add(id(t)))]
        return out


#: Each block's `ListedModules`: its buffers are read at every recompute (and the last block's
#: parameters at every step's start), and walking its modules anew cost more than copying them.
_LISTS: weakref.WeakKeyDictionary[torch.nn.Module, ListedModules] = weakref.WeakKeyDictionary()


def buffers_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """`module.buffers()`, each once, in order, read as they stand (`ListedModules`)."""
    return _listed(module).tensors("_buffers")


def parameters_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """`module.parameters()`, each once, in order, read as they stand (`ListedModules`)."""
    return _listed(module).tensors("_parameters")


def _listed(module: torch.nn.Module) -> ListedModules:
    known = _LISTS.get(module)
    if known is None:
        known = _LISTS[module] = ListedModules(module)
    return known
