"""Trees of arrays across frameworks: ``to_jax`` and ``from_jax``, zero-copy through DLPack.

Both directions hand over the buffer, not a copy (measured on CPU with jax 0.10 and torch 2.13, bfloat16
and strided views included): a ``jax.Array`` made by :func:`to_jax` reads the tensor's memory and a tensor
made by :func:`from_jax` reads the array's. Two consequences, the same as for a donated buffer:

* JAX arrays are immutable by contract. Writing in place into a tensor that came from :func:`from_jax`
  (a donated :func:`fxtrain.train_step` does) changes the JAX array it aliases; hand the JAX tree over
  and stop using it, or ``.clone()`` first.
* Likewise a tensor written in place after :func:`to_jax` changes the JAX array.

DLPack copies instead (still correct) when the buffer cannot be shared, e.g. a view whose start is not
aligned as XLA requires. Dtypes are kept exactly (bfloat16, float16, every integer width, bool, complex);
64-bit types need JAX's 64-bit mode (``jax.config.update("jax_enable_x64", True)``), and converting one
without it is an error rather than a silent narrowing to 32 bits.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fxtrain._deferred import DTensor
from fxtrain.interop._jax import is_jax_array, require

__all__ = ["to_jax", "from_jax", "tensor_to_jax", "array_to_torch"]

_KW = {"none_is_leaf": True, "namespace": "fxtrain"}
_WIDE = (torch.float64, torch.int64, torch.uint64, torch.complex128)


def to_jax(tree: Any, *, local: bool = False) -> Any:
    """A tree of torch tensors as a tree of ``jax.Array`` sharing their memory (DLPack, no copy).

    Tensor leaves become JAX arrays with the same shape and dtype (bfloat16 and integers included);
    ``None`` and non-tensor leaves pass through unchanged; the containers are kept. Tensors that require
    gradients are detached first (JAX has no use for torch's autograd graph).

    A DTensor leaf becomes its full (global) value: ``full_tensor()`` all-gathers it over its mesh,
    a collective that every rank of the mesh must join, and the result is a new buffer (a copy of the
    whole parameter on every rank). With ``local=True`` it becomes its local shard instead, with no
    communication and no copy.

    Args:
      tree: a pytree (dict/list/tuple/NamedTuple) whose leaves may be tensors, DTensors, ``None`` or
        anything else.
      local: take each DTensor's local piece instead of its full value.

    Returns:
      The same tree with ``jax.Array`` leaves where ``tree`` had tensors.

    Raises:
      ImportError: JAX is not installed (``pip install 'fxtrain[jax]'``).
      TypeError: a 64-bit tensor while JAX's 64-bit mode is off; the error names the leaf.

    Example:
        >>> import pytest; jax = pytest.importorskip("jax")
        >>> import torch
        >>> from fxtrain.interop import to_jax
        >>> t = torch.arange(3, dtype=torch.bfloat16)
        >>> out = to_jax({"w": t, "frozen": None, "name": "mlp"})
        >>> out["w"].dtype, out["frozen"], out["name"]
        (dtype(bfloat16), None, 'mlp')
        >>> out["w"].unsafe_buffer_pointer() == t.data_ptr()   # zero-copy
        True
    """
    require(what="fxtrain.interop.to_jax")

    def conv(path, x):
        if not isinstance(x, torch.Tensor):
            return x
        if isinstance(x, DTensor):
            x = x.to_local() if local else x.full_tensor()
        return tensor_to_jax(x, where=dotted(path))

    return optree.tree_map_with_path(conv, tree, **_KW)


def from_jax(tree: Any) -> Any:
    """A tree of ``jax.Array`` as a tree of torch tensors sharing their memory (DLPack, no copy).

    The inverse of :func:`to_jax`. The tree is walked with JAX's own tree utilities, so JAX-registered
    containers (Optax states, Flax's ``FrozenDict``...) are understood; ``None`` and leaves that are not
    JAX arrays pass through. Each tensor lives on the device that holds the array (CPU arrays give CPU
    tensors). Writing into the tensors in place changes the arrays (see the module docstring).

    Args:
      tree: a pytree whose leaves may be ``jax.Array``, ``None`` or anything else.

    Returns:
      The same tree with ``torch.Tensor`` leaves where ``tree`` had JAX arrays.

    Raises:
      ImportError: JAX is not installed (``pip install 'fxtrain[jax]'``).
      ValueError: an array sharded over several devices (gather it first, e.g. ``jax.device_get``).

    Example:
        >>> import pytest; jnp = pytest.importorskip("jax.numpy")
        >>> from fxtrain.interop import from_jax
        >>> a = jnp.ones((2, 3), dtype=jnp.bfloat16)
        >>> t = from_jax({"w": a, "step": 3})
        >>> t["w"].dtype, t["w"].shape, t["step"]
        (torch.bfloat16, torch.Size([2, 3]), 3)
        >>> t["w"].data_ptr() == a.unsafe_buffer_pointer()   # zero-copy
        True
    """
    jax = require(what="fxtrain.interop.from_jax")
    return jax.tree_util.tree_map(lambda x: array_to_torch(x) if is_jax_array(x) else x, tree)


def tensor_to_jax(x: torch.Tensor, *, where: str = "tensor") -> Any:
    """One tensor (not a DTensor) as a ``jax.Array`` through DLPack; ``where`` names it in errors."""
    jax = require(what="fxtrain.interop.to_jax")
    if x.dtype in _WIDE and not jax.config.jax_enable_x64:
        raise TypeError(
            f"to_jax: '{where}' is {x.dtype}, but JAX's 64-bit mode is off and would narrow it to 32 bits; "
            "enable it with jax.config.update('jax_enable_x64', True), or cast the tensor first"
        )
    return jax.dlpack.from_dlpack(x.detach())


def array_to_torch(x: Any) -> torch.Tensor:
    """One ``jax.Array`` as a torch tensor through DLPack."""
    if len(x.devices()) > 1:
        raise ValueError(f"from_jax: an array sharded over {len(x.devices())} devices has no single buffer "
                         "to share; gather it first (jax.device_get) or convert its addressable shards")
    return torch.from_dlpack(x)


def dotted(path: tuple) -> str:
    """An optree path as the dotted string errors name (``"1.inner_state.mu.w"``), as ``fxtrain.tree.paths``."""
    return ".".join(str(p) for p in path) or "<root>"
