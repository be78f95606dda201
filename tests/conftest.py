"""Strict test settings: warnings are errors (pyproject), deterministic torch, small thread count."""

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    # Tests that need the `jax` extra skip cleanly when it is absent (the core must work without it).
    try:
        import optax  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="needs the `jax` extra (pip install fxtrain[jax])")
        for item in items:
            if "optax" in item.keywords or "jax" in item.keywords:
                item.add_marker(skip)
