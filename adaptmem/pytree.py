"""The tensors inside a nested structure (tuples, lists, dicts, and what PyTorch's pytree knows).

The one helper every layer uses to find tensors in a block's arguments or outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in `obj`, in pytree order (depth first, positional before keyword)."""
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]
