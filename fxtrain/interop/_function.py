"""JAX functions inside torch losses: ``jax_function``, a ``torch.autograd.Function`` around ``jax.vjp``.

The forward pass hands the input tensors to JAX through DLPack (no copy), runs ``jax.vjp`` of the
(jitted) function and hands the outputs back the same way; the backward pass runs the saved VJP on the
output gradients. So a loss or a layer written in JAX trains with fxtrain's transforms:
:func:`fxtrain.train_step` differentiates with ``torch.autograd.grad``, which calls the backward here.

Two paths, picked per call:

* Plain tensors (``torch.autograd``, what the donated :func:`fxtrain.train_step` uses): the forward keeps
  JAX's residuals and the backward runs the saved VJP once (``once_differentiable``: no double backward).
* Under a ``torch.func`` transform (``grad``, ``vjp``, ``vmap``, ``jacrev``, the pure step
  ``train_step(donate=False)``): a stateless ``torch.autograd.Function`` whose backward is itself the same
  kind of op (the JAX VJP of the function, recomputing the forward), and whose ``vmap`` rule runs
  ``jax.vmap`` of the function on the materialized batched arrays. So ``grad``, ``vmap(grad)``,
  ``grad(grad)`` (hypergradients through updates) all compose; every op is jitted and cached per shapes.
  Forward mode (``torch.func.jvp``, ``jacfwd``) is refused in one line (use ``vjp``/``jacrev``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch
from torch._C import _functorch

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
    (activations), as a torch layer saves its own. Under ``torch.func`` (``grad``, ``vjp``, ``jacrev``,
    ``vmap``, their compositions, and so the pure step ``train_step(donate=False)`` with its vmapped
    ensembles and hypergradients) the call is stateless instead: the backward recomputes the forward
    inside JAX's VJP, and ``vmap`` runs ``jax.vmap``. Forward mode (``torch.func.jvp``) is refused.

    Args:
      fn: a function of JAX arrays returning an array or a pytree of arrays. May be used as a decorator,
        with or without arguments.
      jit: compile ``fn`` with ``jax.jit`` (its forward and backward then run as compiled XLA code).

    Returns:
      The torch-callable function.

    Raises:
      ImportError: JAX is not installed (``pip install 'fxtrain[jax]'``), when the function is called.
      NotImplementedError: under ``torch.func.jvp``/``jacfwd`` (forward mode).

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
        >>> per_example = torch.func.vmap(torch.func.grad(lambda w: loss({"w": w}, torch.full((4, 3), 0.1))))
        >>> per_example(torch.ones(5, 3, 2)).shape   # jax.vmap of JAX's VJP
        torch.Size([5, 3, 2])
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
        if any(_functorch.is_functorch_wrapped_tensor(t) for t in tensors):
            op = _Op(compiled, (fn, jit), (spec, kinds, values), (), _name(fn))
            outs = _JaxOp.apply(op, *tensors)
            return require("jax").tree.unflatten(op.out_spec(), list(outs))
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


class _Op:
    """A flat JAX function of tensors for the ``torch.func`` path: the base function, or its VJP/vmap.

    ``chain`` names the derivation from the wrapped function: ``("vjp", in_float, n_in)`` takes the
    inputs then the float outputs' cotangents and returns the float inputs' gradients; ``("vmap",
    in_axes)`` maps over the given axes (outputs batched on axis 0). The jitted JAX function of each
    (chain, static) is cached on the wrapped function, so a training loop compiles once.
    """

    def __init__(self, cache: dict, base: tuple, static: tuple, chain: tuple, name: str):
        self.cache, self.base, self.static, self.chain, self.name = cache, base, static, chain, name

    def derive(self, *link) -> _Op:
        return _Op(self.cache, self.base, self.static, self.chain + (link,), self.name)

    def function(self) -> Callable:
        """The flat JAX function ``f(static, arrays) -> tuple of arrays`` of this chain (jitted, cached)."""
        key = ("op", self.chain)
        if key not in self.cache:
            jax = require(what="fxtrain.interop.jax_function")
            fn, jit = self.base
            f = _flat_base(fn, self.cache)
            for link in self.chain:
                f = _vjp_of(jax, f, *link[1:]) if link[0] == "vjp" else _vmap_of(jax, f, link[1])
            self.cache[key] = jax.jit(f, static_argnums=0) if jit else f
        return self.cache[key]

    def out_spec(self) -> Any:
        """The wrapped function's output tree, recorded when the op was traced (run it first)."""
        return self.cache[("tree", self.static)]

    def run(self, tensors) -> tuple[torch.Tensor, ...]:
        arrays = [tensor_to_jax(t.contiguous(), where=f"an argument of {self.name}") for t in tensors]
        return tuple(array_to_torch(o) for o in self.function()(self.static, arrays))


def _flat_base(fn: Callable, cache: dict) -> Callable:
    def f(static, arrays):
        spec, kinds, values = static
        args, kwargs = optree.tree_unflatten(spec, _merge(kinds, arrays, values))
        leaves, cache[("tree", static)] = require("jax").tree.flatten(fn(*args, **kwargs))
        return tuple(leaves)
    return f


def _vjp_of(jax: Any, f: Callable, in_float: tuple, n_in: int) -> Callable:
    np = require("numpy")

    def g(static, arrays):
        xs, cts = list(arrays[:n_in]), iter(arrays[n_in:])
        diff = [i for i in range(n_in) if in_float[i]]

        def of_diff(*d):
            full = list(xs)
            for i, v in zip(diff, d):
                full[i] = v
            return f(static, full)

        out, pull = jax.vjp(of_diff, *(xs[i] for i in diff))
        full_cts = tuple(next(cts) if jax.numpy.issubdtype(o.dtype, jax.numpy.inexact)
                         else np.zeros(o.shape, dtype=jax.dtypes.float0) for o in out)
        return tuple(pull(full_cts))
    return g


def _vmap_of(jax: Any, f: Callable, in_axes: tuple) -> Callable:
    def g(static, arrays):
        return jax.vmap(lambda *a: f(static, list(a)), in_axes=in_axes, out_axes=0)(*arrays)
    return g


class _JaxOp(torch.autograd.Function):
    """``_Op`` as a functorch-composable Function: backward is the VJP op, ``vmap`` is ``jax.vmap``."""

    @staticmethod
    def forward(op: _Op, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return op.run(tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, tensors = inputs[0], inputs[1:]
        ctx.op = op
        ctx.save_for_backward(*tensors)
        ctx.out_float = [o.is_floating_point() or o.is_complex() for o in output]
        ctx.mark_non_differentiable(*(o for o, f in zip(output, ctx.out_float) if not f))

    @staticmethod
    def backward(ctx, *grads):
        xs = ctx.saved_tensors
        in_float = tuple(x.is_floating_point() or x.is_complex() for x in xs)
        if not any(in_float):
            return (None,) * (1 + len(xs))
        cts = [g for g, f in zip(grads, ctx.out_float) if f]
        vjp = ctx.op.derive("vjp", in_float, len(xs))
        diff_grads = iter(_JaxOp.apply(vjp, *xs, *cts))
        return (None, *(next(diff_grads) if f else None for f in in_float))

    @staticmethod
    def vmap(info, in_dims, op: _Op, *tensors):
        axes = tuple(in_dims[1:])  # the tensors may still be wrapped by outer transforms: apply, not run
        if all(d is None for d in axes):
            outs = _JaxOp.apply(op, *tensors)
            return outs, (None,) * len(outs)
        outs = _JaxOp.apply(op.derive("vmap", axes), *tensors)
        return outs, (0,) * len(outs)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(f"jax_function({ctx.op.name}): forward mode (torch.func.jvp, jacfwd) is not "
                                  "supported; use torch.func.vjp, grad or jacrev")


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
