"""Test utilities shared by fxtrain's tests and by users testing their own transforms.

Example:
    >>> import torch
    >>> from fxtrain.testing import assert_trees_close
    >>> assert_trees_close({"a": torch.ones(2)}, {"a": torch.ones(2) + 1e-9})
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fxtrain import tree


def assert_trees_close(actual: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-6,
                       equal_nan: bool = False) -> None:
    """Asserts two trees have the same structure and leafwise-close values; names the first bad path.

    Leaves may be torch tensors (DTensors are compared by their full value), numpy or jax arrays, or
    Python numbers. ``None`` must match ``None``.
    """
    mismatch = tree.first_mismatch(actual, expected)
    if mismatch is not None:
        raise AssertionError(f"tree structures differ at '{mismatch}'")
    a_leaves, _ = tree.flatten(actual)
    e_leaves, _ = tree.flatten(expected)
    for path, a, e in zip(tree.paths(actual), a_leaves, e_leaves):
        if a is None or e is None:
            if a is not e:
                raise AssertionError(f"at '{path}': {a!r} vs {e!r}")
            continue
        a_np, e_np = to_numpy(a), to_numpy(e)
        if a_np.shape != e_np.shape:
            raise AssertionError(f"at '{path}': shape {a_np.shape} vs {e_np.shape}")
        np.testing.assert_allclose(a_np, e_np, rtol=rtol, atol=atol, equal_nan=equal_nan,
                                   err_msg=f"at '{path}'")


def to_numpy(x: Any) -> np.ndarray:
    """A float64 (or integer/bool) numpy copy of a tensor, DTensor, jax array or number."""
    if isinstance(x, torch.Tensor):
        if hasattr(x, "full_tensor"):
            x = x.full_tensor()
        x = x.detach().cpu()
        return (x.double() if x.is_floating_point() else x).numpy()
    arr = np.asarray(x)
    return arr.astype(np.float64) if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16" else arr


def to_jnp(t: Any) -> Any:
    """A tree of torch tensors as jax arrays (copies, same dtype; bfloat16 kept). Needs the ``jax`` extra."""
    import jax.numpy as jnp

    def conv(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.dtype == torch.bfloat16:
            return jnp.asarray(x.float().numpy()).astype(jnp.bfloat16)
        return jnp.asarray(x.detach().numpy())

    return tree.map(conv, t)


def from_jnp(t: Any) -> Any:
    """A tree of jax arrays as torch tensors (copies, same dtype; bfloat16 kept)."""
    import jax.numpy as jnp

    def conv(x):
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            return x
        if x.dtype == jnp.bfloat16:
            return torch.from_numpy(np.array(x.astype(jnp.float32))).to(torch.bfloat16)
        return torch.from_numpy(np.array(x))

    return tree.map(conv, t)


def nested_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """A small nested pytree with mixed shapes (dict, list, tuple, scalar leaf) for parity tests."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g).to(dtype)

    return {"dense": {"w": r(4, 3), "b": r(3)}, "blocks": [r(2, 2, 2), (r(5), r(1))], "scalar": r()}
