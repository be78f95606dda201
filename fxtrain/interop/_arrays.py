"""Trees of arrays across frameworks: ``to_jax`` and ``from_jax``, through DLPack.

:func:`to_jax` hands over the buffer, not a copy (measured on CPU with jax 0.10 and torch 2.13, bfloat16 and
strided views included): the ``jax.Array`` reads the tensor's memory, so a tensor written in place after
:func:`to_jax` changes the JAX array. :func:`from_jax` copies by default: JAX arrays are immutable by
contract, and a tensor that shares one would be written in place by a donated :func:`fxtrain.train_step`,
changing the array behind JAX's back (a JAX run continued from the arrays would silently start from the
torch run's params). ``from_jax(tree, copy=False)`` shares the buffers instead (zero-copy: the tensors read
the arrays' memory); a donated step then refuses them on its first call (:func:`fxtrain.tree.borrowed`),
and ``donate=False`` or a ``clone`` is the user's explicit choice. Every fxtrain function that turns JAX or
numpy arrays into tensors (``from_linen``, ``from_nnx``, ``load_orbax``, ``state_from_optax``...) does the same,
with the same ``copy`` argument: :func:`to_torch`.

DLPack copies instead (still correct) when the buffer cannot be shared, e.g. a view whose start is not
aligned as XLA requires. Dtypes are kept exactly (bfloat16, float16, every integer width, bool, complex);
64-bit types need JAX's 64-bit mode (``jax.config.update("jax_enable_x64", True)``), and converting one
without it is an error rather than a silent narrowing to 32 bits.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fxtrain import tree
from fxtrain._deferred import DTensor
from fxtrain.interop._jax import is_jax_array, require

__all__ = ["to_jax", "from_jax", "tensor_to_jax", "array_to_torch", "to_torch", "owned"]

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


def from_jax(tree: Any, *, copy: bool = True) -> Any:
    """A tree of ``jax.Array`` as a tree of torch tensors (copies; ``copy=False``: sharing their memory).

    The inverse of :func:`to_jax`. The tree is walked with JAX's own tree utilities, so JAX-registered
    containers (Optax states, Flax's ``FrozenDict``...) are understood; ``None`` and leaves that are not
    JAX arrays pass through. Each tensor lives on the device that holds the array (CPU arrays give CPU
    tensors).

    Args:
      tree: a pytree whose leaves may be ``jax.Array``, ``None`` or anything else.
      copy: copy each array into memory torch owns (the default), so nothing fxtrain does in place (a donated
        step) can change the arrays. ``False`` shares the buffers through DLPack (no copy): writing into a
        tensor then changes its array, and a donated step refuses such params on its first call.

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
        >>> t["w"].data_ptr() == a.unsafe_buffer_pointer()   # a copy
        False
        >>> from_jax(a, copy=False).data_ptr() == a.unsafe_buffer_pointer()   # zero-copy
        True
    """
    jax = require(what="fxtrain.interop.from_jax")
    return jax.tree_util.tree_map(lambda x: array_to_torch(x, copy=copy) if is_jax_array(x) else x, tree)


def tensor_to_jax(x: torch.Tensor, *, where: str = "tensor") -> Any:
    """One tensor (not a DTensor) as a ``jax.Array`` through DLPack; ``where`` names it in errors."""
    jax = require(what="fxtrain.interop.to_jax")
    if x.dtype in _WIDE and not jax.config.jax_enable_x64:
        raise TypeError(
            f"to_jax: '{where}' is {x.dtype}, but JAX's 64-bit mode is off and would narrow it to 32 bits; "
            "enable it with jax.config.update('jax_enable_x64', True), or cast the tensor first"
        )
    return jax.dlpack.from_dlpack(x.detach())


def array_to_torch(x: Any, *, copy: bool = False) -> torch.Tensor:
    """One ``jax.Array`` as a torch tensor through DLPack (sharing its buffer; ``copy=True``: torch's own copy)."""
    if len(x.devices()) > 1:
        raise ValueError(f"from_jax: an array sharded over {len(x.devices())} devices has no single buffer "
                         "to share; gather it first (jax.device_get) or convert its addressable shards")
    t = torch.from_dlpack(x)
    return t.clone() if copy and tree.borrowed(t) else t


def to_torch(x: Any, *, copy: bool) -> torch.Tensor:
    """A JAX array, numpy array or tensor as a tensor: with ``copy``, in memory torch owns (a copy only where
    it would otherwise share another library's: :func:`fxtrain.tree.borrowed`); without, sharing where
    DLPack or numpy allow. The one boundary every interop reader goes through.

    >>> import numpy as np
    >>> a = np.ones(2, dtype=np.float32)
    >>> to_torch(a, copy=True).data_ptr() == a.ctypes.data, to_torch(a, copy=False).data_ptr() == a.ctypes.data
    (False, True)
    """
    t = array_to_torch(x) if is_jax_array(x) else torch.as_tensor(x)
    return owned(t) if copy else t


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where its memory belongs to another library (:func:`fxtrain.tree.borrowed`)."""
    return t.clone() if tree.borrowed(t) else t


def dotted(path: tuple) -> str:
    """An optree path as the dotted string errors name (``"1.inner_state.mu.w"``), as ``fxtrain.tree.paths``."""
    return ".".join(str(p) for p in path) or "<root>"
