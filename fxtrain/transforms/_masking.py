"""Applying transforms to part of the params: ``masked`` and ``partition`` (Optax's semantics and states).

A mask is a tree of bools with the structure of the params or a prefix of it (a bool then covers a whole
subtree), or a function of the params returning one. Masked-out subtrees are replaced by
:class:`MaskedNode` (a node with no leaves) before the inner transform sees them, so the inner state
holds nothing for them, exactly as in Optax.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, NamedTuple

import optree

from fxtrain import tree
from fxtrain._base import GradientTransformation, _combined, kernel, transform

Mask = Any  # a tree of bools (prefix of the params) or a callable returning one
_KW = tree._kw()  # fxtrain's optree conventions: None is a leaf, fxtrain's node namespace


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transform's state, over the masked-in params only."""

    inner_state: Any


class MaskedNode(NamedTuple):
    """Stands for a masked-out subtree: a node with no children, so tree maps skip it (Optax's)."""


class PartitionState(NamedTuple):
    """State of :func:`partition`: the :class:`MaskedState` of each label's transform."""

    inner_states: Mapping[Hashable, Any]


def _prefix_mismatch(prefix: Any, full: Any, path: tuple = ()) -> str | None:
    """The dotted path where ``prefix`` stops being a prefix of ``full``'s structure, or ``None``."""
    if optree.treespec_is_leaf(optree.tree_structure(prefix, **_KW)):
        return None
    if optree.treespec_is_leaf(optree.tree_structure(full, **_KW)) or type(prefix) is not type(full):
        return tree._path_str(path)
    p, f = optree.tree_flatten_one_level(prefix, **_KW), optree.tree_flatten_one_level(full, **_KW)
    if tuple(p.entries) != tuple(f.entries):
        missing = [e for e in list(p.entries) + list(f.entries) if e not in p.entries or e not in f.entries]
        return tree._path_str(path + (missing[0],)) if missing else tree._path_str(path)
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


def _unmask(mask: Any, new: Any, old: Any) -> Any:
    return optree.tree_map(lambda m, n, o: n if m else o, mask, new, old, **_KW)


def _check_no_wrap_loss(inner: GradientTransformation) -> None:
    # A transform that acts on the forward pass (amp_cast's loss scaling) cannot see only some params.
    if inner.wrap_loss is not None:
        raise ValueError(f"cannot mask {inner!r}: it acts on the forward pass (wrap_loss); apply it to "
                         "all params, outside the mask")


@transform(elementwise=None)
def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Applies ``inner`` to the params where ``mask`` is True; the other updates pass through (Optax's).

    The inner state covers only the masked-in params. Donated, ``inner`` runs in place on the masked-in
    gradient buffers, so masking costs no copies; the pure update rebuilds the trees (it composes with
    ``torch.func.vmap`` and ``grad`` as ``inner`` does).

    Args:
      inner: the transform to apply.
      mask: a tree of bools with the structure of the params, or a prefix of it (a bool covers a
        subtree), or a function of the params that returns one (called on the updates when ``update``
        gets no params, as Optax always does).

    Returns:
      A transform with state :class:`MaskedState`.

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

    def resolve(t):
        return mask(t) if callable(mask) else mask

    def init_fn(params):
        return MaskedState(inner_state=inner.init(mask_tree(params, resolve(params))))

    def update_fn(updates, state, params=None):
        m = resolve(updates if params is None else params)  # params: a frozen (None) gradient keeps its mask
        masked_params = None if params is None else mask_tree(params, m)
        new, inner_state = kernel(inner)(mask_tree(updates, m), state.inner_state, masked_params)
        return _unmask(m, new, updates), MaskedState(inner_state)

    return _combined(init_fn, update_fn, (inner,))


@transform(elementwise=None)
def partition(transforms: Mapping[Hashable, GradientTransformation], param_labels: Any
              ) -> GradientTransformation:
    """Applies a different transform to each group of params, groups given by labels (Optax's).

    Each transform runs as ``masked(tx, labels == label)``: it sees, and keeps state for, its group only.

    Args:
      transforms: a mapping from label to transform.
      param_labels: a tree of labels with the structure of the params (or a prefix of it), or a function
        of the params returning one (called on the updates when ``update`` gets no params, as Optax
        always does). Every label must be a key of ``transforms``.

    Returns:
      A transform with state :class:`PartitionState`.

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
        return param_labels(t) if callable(param_labels) else param_labels

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

    def update_fn(updates, state, params=None):
        if set(state.inner_states) != set(txs):
            raise ValueError(f"partition: the state holds labels {sorted(map(str, state.inner_states))}, "
                             f"the transforms are for {sorted(map(str, txs))}")
        labels = resolve(updates if params is None else params)
        new_states = {}
        for k, t in txs.items():
            updates, new_states[k] = kernel(masked(t, group_mask(labels, k)))(
                updates, state.inner_states[k], params)
        return updates, PartitionState(new_states)

    return _combined(init_fn, update_fn, tuple(txs.values()))
