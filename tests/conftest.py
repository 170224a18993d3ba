import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, for bitwise CUDA tests

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(False)
    yield


@pytest.fixture
def every_layer_held(monkeypatch):
    """SELECTIVE holds every weight layer's output, however narrow (the tests' models are small)."""
    from adaptmem.strategies import selective

    monkeypatch.setattr(selective, "MIN_FLOPS_PER_ELEMENT", 0)
