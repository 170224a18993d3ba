"""The tensors inside a nested structure (tuples, lists, dicts, and what PyTorch's pytree knows).

The one helper every layer uses to find tensors in a block's arguments or outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_PLAIN = (torch.Tensor, int, float, bool, str, type(None))


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in `obj`, in pytree order (depth first, positional before keyword). A tensor,
    or a tuple or list of plain leaves (what blocks mostly return), is read without flattening:
    every block boundary asks."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if type(obj) in (tuple, list) and all(isinstance(x, _PLAIN) for x in obj):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]
