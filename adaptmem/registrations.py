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


#: Per module (a block, a model): its modules' dicts, each with the names of its public attributes
#: that held a tensor or None when first read (a layer's last state, a cache of its own)
_ATTRIBUTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def keep_attributes(module: torch.nn.Module) -> list[tuple[dict, str, Any]]:
    """(a module's dict, a name, its value) for the attributes of `module` and its modules that a
    forward may set to a tensor of its own: a recurrent layer's last state (RecurrentGemma's
    `recurrent_states`), kept on the module for the next call. A recompute would set them again, to
    tensors of a graph no backward runs (they held 48 MiB of a RecurrentGemma's 2 x 768 tokens
    until the next forward), and a forward that ran out of memory leaves them holding its graph:
    both put them back (`put_back_attributes`), by reference (a tensor changed in place is a
    buffer's business)."""
    known = _ATTRIBUTES.get(module)
    if known is None or known[0] != registrations():  # read again once a module is registered into one
        modules, count = listed(module)
        known = _ATTRIBUTES[module] = (count, [(m.__dict__, names) for m in modules if (names := _state_names(m))])
    return [(held, name, held.get(name)) for held, names in known[1] for name in names]


def _state_names(module: torch.nn.Module) -> list[str]:
    return [
        k for k, v in module.__dict__.items() if not k.startswith("_") and (v is None or isinstance(v, torch.Tensor))
    ]


def put_back_attributes(state: list[tuple[dict, str, Any]]) -> None:
    """Set back the attributes `keep_attributes` read, where they were replaced since."""
    for held, name, value in state:
        if held.get(name) is not value:
            held[name] = value
