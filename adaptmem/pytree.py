"""The tensors inside a nested structure (tuples, lists, dicts, and what PyTorch's pytree knows).

The one helper every layer uses to find tensors in a block's arguments or outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_PLAIN = (torch.Tensor, int, float, bool, str, type(None))
_NODES = (tuple, list, dict)  # exactly these types (a namedtuple or OrderedDict is pytree's to read)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in `obj`, in pytree order (depth first, positional before keyword, a dict's
    values in insertion order). Nests of plain tuples, lists and dicts whose leaves are tensors
    or plain values (what blocks mostly take and return) are read without pytree's flattening:
    every block boundary asks, and `tree_flatten` builds a spec nobody reads."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if type(obj) in _NODES:
        out: list[torch.Tensor] = []
        if _plain_nest(obj, out):
            return out
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _plain_nest(node: tuple | list | dict, out: list[torch.Tensor]) -> bool:
    """Append the tensors of a nest of plain tuples, lists and dicts to `out`; False (with `out`
    partly filled) where it holds anything else."""
    for x in node.values() if type(node) is dict else node:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif type(x) in _NODES:
            if not _plain_nest(x, out):
                return False
        elif not isinstance(x, _PLAIN):
            return False
    return True
