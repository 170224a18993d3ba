"""`tensors_in` reads plain nests without pytree's flattening, and agrees with it on everything."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils._pytree import tree_flatten

from adaptmem.pytree import tensors_in

_Pair = namedtuple("_Pair", "left right")


def _flattened(obj):
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _cases():
    a, b, c, d = (torch.full((2,), float(i)) for i in range(4))
    return {
        "tensor": a,
        "args and kwargs": ((a, 3, None), {"mask": b, "flag": True, "name": "x"}),
        "nested": ([a, (b, {"z": c, "a": d})], {}),
        "dict order is insertion order": {"z": a, "a": b, "m": [c, d]},
        "namedtuple inside": ((a, _Pair(b, c)), {"d": d}),
        "ordered dict inside": ((a,), {"o": OrderedDict(y=b, x=c)}),
        "a parameter": ((torch.nn.Parameter(a.clone()), b), {}),
        "nothing": ((1, 2.0, "s"), {}),
        "empty": ((), {}),
        "a module is a leaf": ((torch.nn.Linear(2, 2), a), {}),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_tensors_in_gives_pytrees_tensors_in_its_order(name):
    obj = _cases()[name]
    got, want = tensors_in(obj), _flattened(obj)
    assert len(got) == len(want) and all(g is w for g, w in zip(got, want))


def test_a_plain_nest_is_read_without_flattening(monkeypatch):
    import adaptmem.pytree as pytree

    def refuse(obj):
        raise AssertionError("flattened")

    monkeypatch.setattr(pytree, "tree_flatten", refuse)
    a, b = torch.ones(1), torch.zeros(1)
    assert [t is x for t, x in zip(tensors_in(((a, None, 2), {"b": [b]})), (a, b))] == [True, True]
    with pytest.raises(AssertionError, match="flattened"):  # what pytree knows and we do not: pytree's to read
        tensors_in(((a, _Pair(a, b)), {}))
