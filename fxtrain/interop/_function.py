"""JAX functions inside torch losses: ``jax_function``, a ``torch.autograd.Function`` around ``jax.vjp``.

The forward pass hands the input tensors to JAX through DLPack (no copy), runs ``jax.vjp`` of the
(jitted) function and hands the outputs back the same way; the backward pass runs the saved VJP on the
output gradients. So a loss or a layer written in JAX trains with fxtrain's transforms:
:func:`fxtrain.train_step` differentiates with ``torch.autograd.grad``, which calls the backward here.

The backward is ``once_differentiable`` (no double backward through JAX). ``torch.autograd`` is the
supported path (what ``train_step`` uses); ``torch.func.grad`` runs the forward but hands the backward
functorch-wrapped gradients that DLPack cannot export (torch 2.13), so it is not supported.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch

from fxtrain.interop._arrays import array_to_torch, tensor_to_jax
from fxtrain.interop._jax import require

__all__ = ["jax_function"]

_KW = {"none_is_leaf": False, "namespace": "fxtrain"}


def jax_function(fn: Callable | None = None, *, jit: bool = True) -> Callable:
    """Wraps a JAX function so torch can call and differentiate it.

    ``jax_function(fn)(*args, **kwargs)`` takes the same arguments as ``fn`` with torch tensors in place
    of JAX arrays (any pytree of them: a params dict works) and returns ``fn``'s outputs as torch tensors
    in the same tree. Gradients flow to every floating-point tensor that requires them, computed by
    ``jax.vjp``. Integer and bool tensors (labels, token ids) are passed to JAX but not differentiated;
    integer outputs are returned as non-differentiable tensors. Leaves that are not tensors are static
    (``jax.jit`` recompiles for each new value): they must be hashable.

    Inputs and outputs cross through DLPack without copies (on CPU; see :func:`fxtrain.interop.to_jax`
    for dtypes: 64-bit tensors need JAX's 64-bit mode). The backward pass saves JAX's residuals
    (activations), as a torch layer saves its own.

    Args:
      fn: a function of JAX arrays returning an array or a pytree of arrays. May be used as a decorator,
        with or without arguments.
      jit: compile ``fn`` with ``jax.jit`` (its forward and backward then run as compiled XLA code).

    Returns:
      The torch-callable function.

    Raises:
      ImportError: JAX is not installed (``pip install 'fxtrain[jax]'``), when the function is called.

    Example:
        >>> import pytest; jnp = pytest.importorskip("jax.numpy")
        >>> import torch
        >>> from fxtrain.interop import jax_function
        >>> @jax_function
        ... def loss(params, x):
        ...     return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)
        >>> params = {"w": torch.ones(3, 2, requires_grad=True)}
        >>> out = loss(params, torch.full((4, 3), 0.1))
        >>> out.backward()
        >>> out.shape, params["w"].grad.shape
        (torch.Size([]), torch.Size([3, 2]))
    """
    if fn is None:
        return functools.partial(jax_function, jit=jit)
    compiled: dict = {}

    def core():
        if "fn" not in compiled:
            jax = require(what="fxtrain.interop.jax_function")

            def call(static, arrays):
                spec, kinds, values = static
                args, kwargs = optree.tree_unflatten(spec, _merge(kinds, arrays, values))
                return fn(*args, **kwargs)

            compiled["fn"] = jax.jit(call, static_argnums=0) if jit else call
        return compiled["fn"]

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        leaves, spec = optree.tree_flatten((args, kwargs), **_KW)
        kinds = tuple(_kind(x) for x in leaves)
        values = tuple(None if k else x for k, x in zip(kinds, leaves))
        try:
            hash(values)
        except TypeError:
            raise TypeError(f"jax_function({_name(fn)}): arguments that are not tensors are static and must "
                            "be hashable; pass arrays as torch tensors") from None
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        call = _Call(core(), (spec, kinds, values), name=_name(fn))
        call.grad_mask = [k == "diff" and t.requires_grad for k, t in zip(filter(None, kinds), tensors)]
        if not (torch.is_grad_enabled() and any(call.grad_mask)):
            return call.run(tensors)
        outs = _JaxFunction.apply(call, *tensors)
        return require("jax").tree.unflatten(call.out_def, list(outs))

    return wrapped


class _Call:
    """One call of a wrapped function: what the forward saves for the backward (the VJP, output kinds)."""

    def __init__(self, fn: Callable, static: tuple, name: str):
        self.fn, self.static, self.name = fn, static, name
        self.grad_mask: list[bool] = []
        self.vjp = self.out_def = self.out_float = self.out_avals = None
        self.diff_idx: list[int] = []

    def run(self, tensors: list[torch.Tensor]) -> Any:
        """Forward only (no gradient needed): outputs as a tree of tensors."""
        jax = require(what="fxtrain.interop.jax_function")
        out = self.fn(self.static, _to_jax(tensors))
        return jax.tree.map(array_to_torch, out)

    def forward(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        jax = require(what="fxtrain.interop.jax_function")
        arrays = _to_jax(tensors)
        diff_idx = [i for i, g in enumerate(self.grad_mask) if g]

        def of_diff(*diff):
            full = list(arrays)
            for i, d in zip(diff_idx, diff):
                full[i] = d
            return self.fn(self.static, full)

        out, self.vjp = jax.vjp(of_diff, *(arrays[i] for i in diff_idx))
        out_leaves, self.out_def = jax.tree.flatten(out)
        self.out_float = [jax.numpy.issubdtype(o.dtype, jax.numpy.inexact) for o in out_leaves]
        self.out_avals = [(o.shape, o.dtype) for o in out_leaves]
        self.diff_idx = diff_idx
        return tuple(array_to_torch(o) for o in out_leaves)

    def backward(self, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        jax = require(what="fxtrain.interop.jax_function")
        np = require("numpy")
        cts = []
        for g, is_float, (shape, dtype) in zip(grads, self.out_float, self.out_avals):
            if is_float:
                cts.append(tensor_to_jax(g.contiguous(), where=f"the gradient of an output of {self.name}"))
            else:
                cts.append(np.zeros(shape, dtype=jax.dtypes.float0))
        diff_grads = self.vjp(jax.tree.unflatten(self.out_def, cts))
        self.vjp = None  # free JAX's residuals now (once_differentiable)
        out: list[torch.Tensor | None] = [None] * len(self.grad_mask)
        for i, g in zip(self.diff_idx, diff_grads):
            out[i] = array_to_torch(g)
        return out


class _JaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return call.forward(tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call = inputs[0]
        ctx.call = call
        ctx.mark_non_differentiable(*(o for o, f in zip(output, call.out_float) if not f))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.call.backward(grads))


def _kind(x: Any) -> str | None:
    """``"diff"`` for floating tensors, ``"data"`` for other tensors, ``None`` for static leaves."""
    if isinstance(x, torch.Tensor):
        return "diff" if (x.is_floating_point() or x.is_complex()) else "data"
    return None


def _merge(kinds: tuple, arrays: list, values: tuple) -> list:
    it = iter(arrays)
    return [next(it) if k else v for k, v in zip(kinds, values)]


def _to_jax(tensors) -> list:
    return [tensor_to_jax(t, where="an argument") for t in tensors]


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
