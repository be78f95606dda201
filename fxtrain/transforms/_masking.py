"""Applying transforms to part of the params: ``masked``, ``partition`` (alias ``multi_transform``),
``freeze`` and ``selective_transform`` (Optax's semantics and states).

A mask is a tree of bools with the structure of the params or a prefix of it (a bool then covers a whole
subtree), or a function of the params returning one. Masked-out subtrees are replaced by
:class:`MaskedNode` (a node with no leaves) before the inner transform sees them, so the inner state
holds nothing for them, exactly as in Optax. A mask that is a tree whose node happens to be callable (an
Equinox-style module holding bools) is a tree, not a function (Optax's issue #913): only a callable
*leaf* is called.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, NamedTuple

import optree

from fxtrain import tree
from fxtrain._base import GradientTransformation, combine, call_, transform
from fxtrain.transforms._simple import set_to_zero

__all__ = ["MaskedNode", "MaskedState", "PartitionState", "masked", "partition", "multi_transform", "freeze",
           "selective_transform"]

Mask = Any  # a tree of bools (prefix of the params) or a callable returning one
_KW = tree.optree_options()  # fxtrain's optree conventions: None is a leaf, fxtrain's node namespace


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transform's state, over the masked-in params only.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.masked(fx.sgd(0.1), {"w": True}).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.MaskedState), state._fields
        (True, ('inner_state',))
    """

    inner_state: Any


class MaskedNode(NamedTuple):
    """Stands for a masked-out subtree: a node with no children, so tree maps skip it (Optax's).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.masked(fx.trace(0.9), {"w": True, "b": False})
        >>> tx.init({"w": torch.zeros(2), "b": torch.zeros(1)}).inner_state.trace["b"]
        MaskedNode()
    """


class PartitionState(NamedTuple):
    """State of :func:`partition`: the :class:`MaskedState` of each label's transform.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.partition({"a": fx.sgd(0.1)}, {"w": "a"}).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.PartitionState), state._fields
        (True, ('inner_states',))
    """

    inner_states: Mapping[Hashable, Any]


def _prefix_mismatch(prefix: Any, full: Any, path: tuple = ()) -> str | None:
    """The dotted path where ``prefix`` stops being a prefix of ``full``'s structure, or ``None``."""
    if optree.treespec_is_leaf(optree.tree_structure(prefix, **_KW)):
        return None
    if optree.treespec_is_leaf(optree.tree_structure(full, **_KW)) or type(prefix) is not type(full):
        return tree.path_str(path)
    p, f = optree.tree_flatten_one_level(prefix, **_KW), optree.tree_flatten_one_level(full, **_KW)
    if tuple(p.entries) != tuple(f.entries):
        missing = [e for e in list(p.entries) + list(f.entries) if e not in p.entries or e not in f.entries]
        return tree.path_str(path + (missing[0],)) if missing else tree.path_str(path)
    for entry, cp, cf in zip(p.entries, p.children, f.children):
        bad = _prefix_mismatch(cp, cf, path + (entry,))
        if bad is not None:
            return bad
    return None


def _check_prefix(prefix: Any, full: Any, what: str) -> None:
    bad = _prefix_mismatch(prefix, full)
    if bad is not None:
        raise ValueError(f"{what} does not match the params: the trees differ at '{bad}'")


def mask_tree(t: Any, mask: Mask) -> Any:
    """``t`` with the subtrees where ``mask`` is False replaced by :class:`MaskedNode`."""
    try:
        return optree.tree_map(lambda m, sub: sub if m else MaskedNode(), mask, t, **_KW)
    except ValueError:
        _check_prefix(mask, t, "the mask")
        raise


def is_mask_fn(mask: Any) -> bool:
    """Whether ``mask`` is a function of the params (a callable leaf), not a tree that happens to be callable.

    >>> class Module(NamedTuple):   # a pytree node with a __call__, as an Equinox module
    ...     w: Any
    ...     def __call__(self, x):
    ...         return self.w * x
    >>> is_mask_fn(lambda p: p), is_mask_fn(Module(False)), is_mask_fn({"w": True})
    (True, False, False)
    """
    return callable(mask) and optree.treespec_is_leaf(optree.tree_structure(mask, **_KW))


def _resolve(mask: Any, t: Any) -> Any:
    return mask(t) if is_mask_fn(mask) else mask


def _masked_extra_args(extra_args: dict, like: Any, mask: Any) -> dict:
    """``extra_args`` with the values shaped like the updates masked as they are (``mask_compatible_extra_args``)."""
    spec = tree.structure(like)
    return {k: mask_tree(v, mask) if tree.structure(v) == spec else v for k, v in extra_args.items()}


def _unmask(mask: Any, new: Any, old: Any) -> Any:
    return optree.tree_map(lambda m, n, o: n if m else o, mask, new, old, **_KW)


def _check_no_wrap_loss(inner: GradientTransformation) -> None:
    # A transform that acts on the forward pass (amp_cast's loss scaling) cannot see only some params.
    if inner.wrap_loss is not None:
        raise ValueError(f"cannot mask {inner!r}: it acts on the forward pass (wrap_loss); apply it to "
                         "all params, outside the mask")


@transform(elementwise=None)
def masked(inner: GradientTransformation, mask: Mask, *, mask_compatible_extra_args: bool = False
           ) -> GradientTransformation:
    """Applies ``inner`` to the params where ``mask`` is True; the other updates pass through (Optax's).

    The inner state covers only the masked-in params. Donated, ``inner`` runs in place on the masked-in
    gradient buffers, so masking costs no copies; the pure update rebuilds the trees (it composes with
    ``torch.func.vmap`` and ``grad`` as ``inner`` does).

    Args:
      inner: the transform to apply.
      mask: a tree of bools with the structure of the params, or a prefix of it (a bool covers a
        subtree), or a function of the params that returns one (called on the updates when ``update``
        gets no params, as Optax always does). A tree whose node is callable is used as a tree.
      mask_compatible_extra_args: extra arguments (``value=``...) shaped like the updates are masked
        the same way before ``inner`` sees them; others are passed as they are.

    Returns:
      A transform with state :class:`MaskedState`; it passes extra arguments to ``inner`` when ``inner``
      reads them.

    Raises:
      ValueError: the mask's structure is not a prefix of the params' (naming the path), or ``inner``
        acts on the forward pass (``wrap_loss``).

    Example:
        >>> import torch, fxtrain as fx
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> tx = fx.masked(fx.scale(10.0), lambda p: {"w": True, "b": False})
        >>> u, _ = tx.update(params, tx.init(params))
        >>> u["w"].tolist(), u["b"].tolist()
        ([10.0, 10.0], [1.0])
    """
    _check_no_wrap_loss(inner)

    def init_fn(params):
        return MaskedState(inner_state=inner.init(mask_tree(params, _resolve(mask, params))))

    def update_fn(updates, state, params=None, **extra_args):
        m = _resolve(mask, updates if params is None else params)  # params: a frozen (None) gradient keeps its mask
        masked_params = None if params is None else mask_tree(params, m)
        if mask_compatible_extra_args:
            extra_args = _masked_extra_args(extra_args, updates, m)
        new, inner_state = call_(inner, mask_tree(updates, m), state.inner_state, masked_params, extra_args)
        return _unmask(m, new, updates), MaskedState(inner_state)

    return combine(init_fn, update_fn, (inner,))


@transform(elementwise=None)
def partition(transforms: Mapping[Hashable, GradientTransformation], param_labels: Any, *,
              mask_compatible_extra_args: bool = False) -> GradientTransformation:
    """Applies a different transform to each group of params, groups given by labels (Optax's).

    Each transform runs as ``masked(tx, labels == label)``: it sees, and keeps state for, its group only.

    Args:
      transforms: a mapping from label to transform.
      param_labels: a tree of labels with the structure of the params (or a prefix of it), or a function
        of the params returning one (called on the updates when ``update`` gets no params, as Optax
        always does). Every label must be a key of ``transforms``.
      mask_compatible_extra_args: extra arguments shaped like the updates are masked per group (see
        :func:`masked`).

    Returns:
      A transform with state :class:`PartitionState`; extra arguments reach the transforms that read them.

    Example:
        >>> import torch, fxtrain as fx
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> tx = fx.partition({"fast": fx.sgd(1.0), "frozen": fx.scale(0.0)}, {"w": "fast", "b": "frozen"})
        >>> u, state = tx.update(params, tx.init(params), params)
        >>> u["w"].tolist(), u["b"].tolist(), sorted(state.inner_states)
        ([-1.0, -1.0], [0.0], ['fast', 'frozen'])
    """
    txs = dict(transforms)
    for t in txs.values():
        _check_no_wrap_loss(t)

    def resolve(t):
        return _resolve(param_labels, t)

    def group_mask(labels, group):
        return optree.tree_map(lambda label: label == group, labels, **_KW)

    def init_fn(params):
        labels = resolve(params)
        _check_prefix(labels, params, "partition: param_labels")
        unknown = set(tree.leaves(labels)) - set(txs)
        if unknown:
            raise ValueError(f"partition: labels {sorted(map(str, unknown))} have no transform; the "
                             f"transforms are for {sorted(map(str, txs))}")
        return PartitionState({k: masked(t, group_mask(labels, k)).init(params) for k, t in txs.items()})

    def update_fn(updates, state, params=None, **extra_args):
        if set(state.inner_states) != set(txs):
            raise ValueError(f"partition: the state holds labels {sorted(map(str, state.inner_states))}, "
                             f"the transforms are for {sorted(map(str, txs))}")
        labels = resolve(updates if params is None else params)
        new_states = {}
        for k, t in txs.items():
            group = masked(t, group_mask(labels, k), mask_compatible_extra_args=mask_compatible_extra_args)
            updates, new_states[k] = call_(group, updates, state.inner_states[k], params, extra_args)
        return updates, PartitionState(new_states)

    return combine(init_fn, update_fn, tuple(txs.values()))


@transform(elementwise=None)
def multi_transform(transforms: Mapping[Hashable, GradientTransformation], param_labels: Any, *,
                    mask_compatible_extra_args: bool = False) -> GradientTransformation:
    """Optax's older name of :func:`partition` (same arguments, same state: :class:`PartitionState`).

    Example:
        >>> import torch, fxtrain as fx
        >>> from fxtrain.transforms._masking import multi_transform
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> tx = multi_transform({"w": fx.sgd(1.0), "b": fx.scale(0.0)}, {"w": "w", "b": "b"})
        >>> u, _ = tx.update(params, tx.init(params), params)
        >>> u["w"].tolist(), u["b"].tolist()
        ([-1.0, -1.0], [0.0])
    """
    return partition(transforms, param_labels, mask_compatible_extra_args=mask_compatible_extra_args)


@transform(elementwise=None)
def freeze(mask: Any) -> GradientTransformation:
    """Zeros the updates where ``mask`` is True: those params stay as they are (Optax's ``freeze``).

    ``masked(set_to_zero(), mask)``: its state is a :class:`MaskedState` holding nothing.

    Args:
      mask: a bool (True: freeze every param) or a tree of bools with the structure of the params (or a
        prefix of it), True where the param is frozen. Static: not a function of the params.

    Returns:
      A transform with state :class:`MaskedState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> from fxtrain.transforms._masking import freeze
        >>> params = {"a": torch.ones(1), "b": torch.ones(2)}
        >>> tx = freeze({"a": True, "b": False})
        >>> u, _ = tx.update(params, tx.init(params))
        >>> u["a"].tolist(), u["b"].tolist()
        ([0.0], [1.0, 1.0])
    """
    return masked(set_to_zero(), mask)


@transform(elementwise=None)
def selective_transform(optimizer: GradientTransformation, *, freeze_mask: Any) -> GradientTransformation:
    """Runs ``optimizer`` on the params not frozen by ``freeze_mask``; frozen ones get zero updates
    (Optax's ``selective_transform``).

    ``partition({"train": optimizer, "freeze": set_to_zero()}, labels)``: the optimizer's state covers the
    trained params only.

    Args:
      optimizer: the transform for the params where ``freeze_mask`` is False.
      freeze_mask: a bool (True: freeze everything) or a tree of bools with the structure of the params
        (or a prefix of it), True where frozen. Static.

    Returns:
      A transform with state :class:`PartitionState` (labels ``"freeze"`` and ``"train"``).

    Example:
        >>> import torch, fxtrain as fx
        >>> from fxtrain.transforms._masking import selective_transform
        >>> params = {"a": torch.ones(1), "b": torch.ones(2)}
        >>> tx = selective_transform(fx.sgd(0.5), freeze_mask={"a": True, "b": False})
        >>> u, state = tx.update(params, tx.init(params), params)
        >>> u["a"].tolist(), u["b"].tolist(), sorted(state.inner_states)
        ([0.0], [-0.5, -0.5], ['freeze', 'train'])
    """
    labels = optree.tree_map(lambda frozen: "freeze" if frozen else "train", freeze_mask, **_KW)
    return partition({"train": optimizer, "freeze": set_to_zero()}, lambda params: labels)
