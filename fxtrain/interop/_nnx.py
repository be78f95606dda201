"""Flax NNX: ``from_nnx``, ``to_nnx``, ``state_from_nnx_optimizer``, ``state_to_nnx_optimizer``.

An NNX module keeps its variables as attributes, so a torch module and an ``nnx.Module`` "with the same
layers" have the same attribute names: ``self.blocks[0].attn`` in both. ``nnx.state(model)`` is then keyed
by the torch attribute path (``('blocks', 0, 'attn', 'query', 'kernel')``), with Flax's names and
layouts inside each layer, the same as linen's (see :mod:`fxtrain.interop._linen`: ``nnx.Linear`` is
``nn.Linear``, ``nnx.Conv`` ``nn.Conv1d/2d/3d``, ``nnx.LayerNorm``, ``nnx.BatchNorm`` (running statistics
as ``BatchStat`` ``mean``/``var``), ``nnx.Embed``, ``nnx.MultiHeadAttention`` ``nn.MultiheadAttention``).
A torch ``nn.Sequential`` at the root matches an ``nnx.Sequential`` (whose state is under ``layers``).

The optimizer of an ``nnx.Optimizer`` holds an Optax state whose parameter trees are keyed like the
model's ``Param`` state; the two ``state_*_nnx_optimizer`` functions rename those trees and hand the rest
to :func:`~fxtrain.interop.state_from_optax` / :func:`~fxtrain.interop.state_to_optax`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fxtrain.interop._arrays import tensor_to_jax, to_torch
from fxtrain.interop._jax import require
from fxtrain.interop._linen import from_linen, linen_names, to_linen
from fxtrain.interop._optax_state import state_from_optax, state_to_optax

__all__ = ["from_nnx", "to_nnx", "state_from_nnx_optimizer", "state_to_nnx_optimizer"]


def _nnx():
    require(what="fxtrain.interop (Flax NNX)")
    try:
        from flax import nnx
    except ImportError as e:  # pragma: no cover - flax comes with the jax extra
        raise ImportError("fxtrain.interop's NNX functions need flax: pip install 'fxtrain[jax]'") from e
    return nnx


def _is_sequential_pair(module: nn.Module, keys) -> bool:
    return isinstance(module, nn.Sequential) and set(keys) == {"layers"}


def _flat(state: Any) -> dict[tuple, tuple[str, Any]]:
    """``{path: (kind, array)}`` of an nnx module, State or nested dict; kind is ``"param"``, ``"stat"``,
    ``"other"`` (RNG state...) or ``"?"`` (a plain dict: told apart by path)."""
    nnx = _nnx()
    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    if isinstance(state, nnx.State):
        out = {}
        for path, var in nnx.to_flat_state(state):
            kind = "param" if isinstance(var, nnx.Param) else "stat" if isinstance(var, nnx.BatchStat) else "other"
            out[tuple(path)] = (kind, var.get_value() if isinstance(var, nnx.Variable) else var)
        return out

    def walk(node, prefix):
        if isinstance(node, Mapping):
            for k, v in node.items():
                yield from walk(v, prefix + (k,))
        else:
            yield prefix, ("?", node.get_value() if isinstance(node, nnx.Variable) else node)

    return dict(walk(state, ()))


def _nested(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def from_nnx(nnx_model_or_state: Any, module: nn.Module, *, buffers: bool = False,
             copy: bool = True) -> dict[str, torch.Tensor]:
    """The variables of a Flax NNX module as the params of a torch module with the same layers.

    Args:
      nnx_model_or_state: an ``nnx.Module``, its ``nnx.state(...)``, or that state as a pure dict
        (``nnx.to_pure_dict``), keyed by the torch attribute names (see the module docstring).
      module: the torch module whose params to produce (read for its layer types and names only).
      buffers: also return BatchNorm's running statistics (``BatchStat`` ``mean``/``var``) under their
        buffer names (``bn.running_mean``).
      copy: every tensor in memory torch owns (the default), so a donated step cannot write into the NNX
        model's arrays; ``False`` shares the arrays whose layout is unchanged (see :func:`from_linen`).

    Returns:
      ``{name: tensor}`` keyed like ``module.named_parameters()`` (plus the running statistics with
      ``buffers``), torch layouts: ``module.load_state_dict(out, strict=False)`` takes it.

    Raises:
      ValueError: a parameter is missing or has the wrong shape, or the NNX state holds a ``Param`` the
        torch module does not have (the path is named).

    Example:
        >>> import pytest; nnx = pytest.importorskip("flax.nnx")
        >>> import torch
        >>> from fxtrain.interop import from_jax, from_nnx
        >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        >>> net = torch.nn.Linear(3, 2)
        >>> net.load_state_dict(from_nnx(model, net))
        <All keys matched successfully>
        >>> torch.equal(net.weight, from_jax(model.kernel[...]).T)
        True
    """
    flat = _flat(nnx_model_or_state)
    if _is_sequential_pair(module, {p[0] for p in flat}):
        flat = {p[1:]: v for p, v in flat.items()}
    where = linen_names(module, naming="nnx", buffers=True)
    stat_paths = {leaf.path[1:]: name for name, leaf in where.items() if leaf.path[0] == "batch_stats"}
    params = {p: v for p, (kind, v) in flat.items() if kind == "param" or (kind == "?" and p not in stat_paths)}
    out = from_linen({"params": _nested(params)}, module, naming="nnx", copy=copy)
    if buffers:
        for path, name in stat_paths.items():
            if path not in flat:
                raise ValueError(f"from_nnx: '{name}' expects the BatchStat '{'/'.join(map(str, path))}', "
                                 "which the NNX state does not have")
            v = flat[path][1]
            out[name] = to_torch(v, copy=copy)
    return out


def to_nnx(params: dict[str, Any], module: nn.Module, nnx_model: Any, *,
           buffers: dict[str, Any] | None = None) -> Any:
    """Writes the params of a torch module into a Flax NNX module with the same layers.

    Args:
      params: ``{name: tensor}`` keyed like ``module.named_parameters()`` (``fx.functional``'s params).
      module: the torch module the params belong to (read for its layer types and names only).
      nnx_model: the ``nnx.Module`` to write into (its variables take the new values, in place).
      buffers: ``fx.functional``'s buffers; BatchNorm running statistics then fill the ``BatchStat``s.

    Returns:
      ``nnx_model``. The new values are JAX arrays sharing memory with the tensors where the layout is
      unchanged (DLPack); transposed kernels are one copy.

    Raises:
      ValueError: a key of ``params`` is not a parameter of ``module``, or the NNX model has no variable
        (or one of another shape) where a parameter goes, or a ``Param`` no parameter fills.

    Example:
        >>> import pytest; nnx = pytest.importorskip("flax.nnx")
        >>> import torch
        >>> from fxtrain.interop import from_jax, to_jax, to_nnx
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
        >>> _ = to_nnx(dict(net.named_parameters()), net, model)
        >>> x = torch.randn(5, 3)
        >>> torch.allclose(from_jax(model(to_jax(x))), net(x), atol=1e-6)
        True
    """
    nnx = _nnx()
    state = nnx.state(nnx_model)
    flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    prefix = ("layers",) if _is_sequential_pair(module, {p[0] for p in flat}) else ()
    variables = to_linen(params, module, naming="nnx", buffers=buffers, as_jax=False)
    new: dict[tuple, Any] = {}
    for collection, tree in variables.items():
        for path, t in _flat(tree).items():
            path = prefix + path
            var = flat.get(path)
            if var is None:
                raise ValueError(f"to_nnx: the NNX model has no variable at '{'/'.join(map(str, path))}' "
                                 f"(from the torch {collection}); its variables are "
                                 f"{', '.join('/'.join(map(str, p)) for p in flat)}")
            t = t[1]
            if tuple(var.shape) != tuple(t.shape):
                raise ValueError(f"to_nnx: '{'/'.join(map(str, path))}' has the shape {tuple(var.shape)} in the "
                                 f"NNX model, the torch {collection} give {tuple(t.shape)}")
            new[path] = tensor_to_jax(t.contiguous(), where="/".join(map(str, path))).astype(var.get_value().dtype)
    missing = [p for p, v in flat.items() if isinstance(v, nnx.Param) and p not in new]
    if missing:
        raise ValueError(f"to_nnx: the NNX Param '{'/'.join(map(str, missing[0]))}' gets no torch parameter "
                         f"({type(module).__name__} has no layer there)")
    for path, v in new.items():
        flat[path].set_value(v)
    nnx.update(nnx_model, state)
    return nnx_model


# --- the optimizer ------------------------------------------------------------------------------------

def _param_names(module: nn.Module) -> set[str]:
    return {n for n, leaf in linen_names(module, naming="nnx").items()}


def _fx_to_nnx_keys(fx_state: Any, module: nn.Module, prefix: tuple) -> Any:
    """fxtrain's state with each params-keyed dict as the nested NNX tree (Flax layouts)."""
    names = _param_names(module)

    def walk(node):
        if isinstance(node, Mapping) and set(node) == names:
            tree = to_linen(dict(node), module, naming="nnx", as_jax=False)["params"]
            return {prefix[0]: tree} if prefix else tree
        if isinstance(node, tuple) and hasattr(type(node), "_fields"):
            return type(node)(*(walk(x) for x in node))
        if isinstance(node, (tuple, list)):
            return type(node)(walk(x) for x in node)
        if isinstance(node, Mapping):
            return type(node)((k, walk(v)) for k, v in node.items())
        return node

    return walk(fx_state)


def _nnx_to_fx_keys(state: Any, module: nn.Module, copy: bool = True) -> Any:
    """The inverse of :func:`_fx_to_nnx_keys`: NNX trees back to ``{torch name: tensor}`` (``copy=False``: sharing
    the arrays' memory where the layouts allow, as :func:`~fxtrain.interop.from_linen`)."""
    top = {leaf.path[1] for leaf in linen_names(module, naming="nnx").values()}

    def walk(node):
        if isinstance(node, Mapping) and node:
            if set(node) == top:
                return from_linen({"params": node}, module, naming="nnx", copy=copy)
            if _is_sequential_pair(module, node):
                return from_linen({"params": node["layers"]}, module, naming="nnx", copy=copy)
        if isinstance(node, tuple) and hasattr(type(node), "_fields"):
            return type(node)(*(walk(x) for x in node))
        if isinstance(node, (tuple, list)):
            return type(node)(walk(x) for x in node)
        if isinstance(node, Mapping):
            return type(node)((k, walk(v)) for k, v in node.items())
        return node

    return walk(state)


def _pure(opt_state: Any) -> Any:
    """An ``nnx.Optimizer``'s ``opt_state`` with its ``State``s as nested dicts and Variables unwrapped."""
    nnx = _nnx()

    def walk(node):
        if isinstance(node, nnx.Variable):
            return node.get_value()
        if isinstance(node, nnx.State):
            return _nested({p: v for p, (_, v) in _flat(node).items()})
        if isinstance(node, tuple) and hasattr(type(node), "_fields"):
            return type(node)(*(walk(x) for x in node))
        if isinstance(node, (tuple, list)):
            return type(node)(walk(x) for x in node)
        if isinstance(node, Mapping):
            return type(node)((k, walk(v)) for k, v in node.items())
        return node

    return walk(opt_state)


def state_from_nnx_optimizer(optimizer: Any, module: nn.Module, fx_like: Any, *, copy: bool = True) -> Any:
    """The Optax state of an ``nnx.Optimizer`` as the state of the matching fxtrain transform.

    Args:
      optimizer: an ``nnx.Optimizer`` (its ``opt_state``), e.g. ``nnx.Optimizer(model, optax.adamw(1e-3),
        wrt=nnx.Param)`` after some steps.
      module: the torch module with the same layers as the NNX model.
      fx_like: the fxtrain counterpart's fresh state: ``fx.adamw(1e-3).init(params)``.
      copy: tensors in memory torch owns (the default); ``False`` shares the arrays' memory where it can
        (see :func:`~fxtrain.interop.state_from_optax`).

    Returns:
      A state with the classes of ``fx_like`` and the values of the optimizer's state, its param trees
      keyed like ``module.named_parameters()`` in torch layouts; ready for ``tx.update``.

    Raises:
      ValueError: the two states differ (see :func:`~fxtrain.interop.state_from_optax`).

    Example:
        >>> import pytest; nnx = pytest.importorskip("flax.nnx"); optax = pytest.importorskip("optax")
        >>> import torch, fxtrain as fx
        >>> from fxtrain.interop import state_from_nnx_optimizer
        >>> opt = nnx.Optimizer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.adam(0.1), wrt=nnx.Param)
        >>> net = torch.nn.Linear(3, 2)
        >>> state = state_from_nnx_optimizer(opt, net, fx.adam(0.1).init(dict(net.named_parameters())))
        >>> type(state[0]).__name__, sorted(state[0].mu)
        ('ScaleByAdamState', ['bias', 'weight'])
    """
    return state_from_optax(_nnx_to_fx_keys(_pure(optimizer.opt_state), module, copy), fx_like, copy=copy)


def state_to_nnx_optimizer(fx_state: Any, module: nn.Module, optimizer: Any) -> Any:
    """Writes an fxtrain optimizer state into an ``nnx.Optimizer`` (the inverse of
    :func:`state_from_nnx_optimizer`); its ``step`` takes the first ``count`` found, if any.

    Args:
      fx_state: the state of the fxtrain counterpart of the optimizer's Optax transform.
      module: the torch module with the same layers as the NNX model.
      optimizer: the ``nnx.Optimizer`` to write into (in place).

    Returns:
      ``optimizer``.

    Raises:
      ValueError: the two states differ (see :func:`~fxtrain.interop.state_to_optax`).

    Example:
        >>> import pytest; nnx = pytest.importorskip("flax.nnx"); optax = pytest.importorskip("optax")
        >>> import torch, fxtrain as fx
        >>> from fxtrain.interop import state_to_nnx_optimizer
        >>> opt = nnx.Optimizer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
        >>> net = torch.nn.Linear(3, 2)
        >>> params = dict(net.named_parameters())
        >>> tx = fx.sgd(0.1, momentum=0.9)
        >>> _, state = tx.update({k: torch.ones_like(p) for k, p in params.items()}, tx.init(params), params)
        >>> _ = state_to_nnx_optimizer(state, net, opt)
        >>> opt.opt_state[0].trace["kernel"][...].tolist()
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    nnx = _nnx()
    like = _pure(optimizer.opt_state)
    prefix = ()
    if isinstance(module, nn.Sequential):
        first = _first_params_tree(like)
        if first is not None and set(first) == {"layers"}:
            prefix = ("layers",)
    new = state_to_optax(_fx_to_nnx_keys(fx_state, module, prefix), like)
    jax = require()
    old_leaves = jax.tree.leaves(optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    new_leaves = jax.tree.leaves(new)
    if len(old_leaves) != len(new_leaves):  # pragma: no cover - state_to_optax checked the structure
        raise ValueError(f"state_to_nnx_optimizer: {len(new_leaves)} arrays for the optimizer's {len(old_leaves)}")
    for var, value in zip(old_leaves, new_leaves):
        if tuple(var.shape) != tuple(value.shape):  # pragma: no cover - the same order on both sides
            raise ValueError(f"state_to_nnx_optimizer: an array of shape {tuple(value.shape)} where the optimizer "
                             f"holds {tuple(var.shape)}")
        var.set_value(value)
    count = _first_count(new)
    if count is not None:
        optimizer.step.set_value(count.astype(optimizer.step.get_value().dtype))
    return optimizer


def _first_params_tree(state: Any) -> Mapping | None:
    if isinstance(state, Mapping):
        return state
    if isinstance(state, (tuple, list)):
        for x in state:
            found = _first_params_tree(x)
            if found is not None:
                return found
    return None


def _first_count(state: Any) -> Any:
    if isinstance(state, tuple) and hasattr(state, "_fields") and "count" in state._fields:
        return state.count
    if isinstance(state, (tuple, list)):
        for x in state:
            found = _first_count(x)
            if found is not None:
                return found
    return None
