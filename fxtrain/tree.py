"""Pytree utilities on optree, and batched math over flat leaf lists.

One namespace for everything fxtrain does to trees. Conventions:

* ``None`` is an absent leaf (a frozen or missing parameter). It passes through every function here:
  a ``None`` in the first tree is never handed to ``fn`` and stays ``None`` in the result.
* Math runs on flat lists of leaves with ``torch._foreach_*`` (one dispatch for many tensors, no Python
  loop over leaves). A trailing ``_`` means in place.
* Paths are dotted strings (``"layers.0.weight"``) so errors can name the leaf the user wrote.

Example:
    >>> import torch
    >>> from fxtrain import tree
    >>> t = {"w": torch.ones(2, 2), "b": None, "h": [torch.zeros(3)]}
    >>> tree.paths(t)
    ['b', 'h.0', 'w']
    >>> float(tree.norm(t))
    2.0
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "flatten", "unflatten", "leaves", "paths", "structure", "map", "align", "first_mismatch",
    "zeros_like", "clone", "cast", "sum_sq", "norm", "add_", "scale_", "where", "where_", "zero_where_",
    "local", "all_finite",
]

Tree = Any
_NS = "fxtrain"  # optree namespace; register custom nodes with optree.register_pytree_node(..., namespace="fxtrain")


def _kw(none_is_leaf: bool = True) -> dict:
    return {"none_is_leaf": none_is_leaf, "namespace": _NS}


def flatten(tree: Tree) -> tuple[list, optree.PyTreeSpec]:
    """Flattens ``tree`` into (leaves, spec); ``None`` leaves are kept so structures stay aligned."""
    return optree.tree_flatten(tree, **_kw())


def unflatten(spec: optree.PyTreeSpec, leaves: Sequence) -> Tree:
    """Inverse of :func:`flatten`."""
    return optree.tree_unflatten(spec, leaves)


def structure(tree: Tree) -> optree.PyTreeSpec:
    """The treespec of ``tree`` (``None`` counted as a leaf)."""
    return optree.tree_structure(tree, **_kw())


def leaves(tree: Tree) -> list:
    """The non-``None`` leaves of ``tree`` in flatten order."""
    return optree.tree_leaves(tree, **_kw(False))


def _path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def paths(tree: Tree) -> list[str]:
    """Dotted paths of every leaf (``None`` included), in flatten order."""
    return [_path_str(p) for p in optree.tree_paths(tree, **_kw())]


def first_mismatch(a: Tree, b: Tree) -> str | None:
    """The dotted path where the structures of ``a`` and ``b`` first differ, or ``None`` if they match.

    Names the first leaf one tree has and the other lacks (or the node whose container type differs).
    Leaf values are not compared; ``None`` matches any leaf.

    >>> first_mismatch({"a": 1, "b": [1, 2]}, {"a": 1, "b": [1]})
    'b.1'
    """
    if structure(a) == structure(b):
        return None
    a_paths = [tuple(p) for p in optree.tree_paths(a, **_kw())]
    b_paths = [tuple(p) for p in optree.tree_paths(b, **_kw())]
    a_set, b_set = set(a_paths), set(b_paths)
    for p in a_paths + b_paths:  # a leaf that one tree has and the other lacks
        if p not in a_set or p not in b_set:
            return _path_str(_deepest_shared_prefix(p, a_set if p in b_set else b_set))
    # Same leaf paths, different containers (a list where a tuple was expected, say): name the node.
    for p in a_paths:
        for k in range(len(p)):
            if type(_get(a, p[:k])) is not type(_get(b, p[:k])):
                return _path_str(p[:k])
    return "<root>"


def _deepest_shared_prefix(path: tuple, other_paths: set) -> tuple:
    # The path itself if the other tree has a leaf there, else the path of the missing entry.
    prefixes = {q[:k] for q in other_paths for k in range(len(q) + 1)}
    k = len(path)
    while k > 0 and path[:k - 1] not in prefixes:
        k -= 1
    return path[:k]


def _get(t: Tree, path: tuple) -> Any:
    for key in path:
        t = getattr(t, key) if hasattr(t, "_fields") and isinstance(key, str) else t[key]
    return t


def map(fn: Callable, tree: Tree, *rest: Tree) -> Tree:  # noqa: A001 - mirrors optree.tree_map
    """Maps ``fn`` over the leaves of ``tree`` and the matching leaves of ``rest``; ``None`` in ``tree`` stays ``None``.

    >>> map(lambda x, y: x + y, {"a": 1, "b": None}, {"a": 2, "b": 5})
    {'a': 3, 'b': None}
    """
    _check_like(tree, rest)
    return optree.tree_map(lambda x, *r: None if x is None else fn(x, *r), tree, *rest, **_kw())


def _check_like(tree: Tree, others: Sequence[Tree], what: str = "tree") -> None:
    spec = structure(tree)
    for i, other in enumerate(others):
        if structure(other) != spec:
            raise ValueError(
                f"{what} #{i + 1} does not match the structure of the first tree: they differ at "
                f"'{first_mismatch(tree, other)}'"
            )


def align(tree: Tree, *others: Tree, what: str = "state") -> tuple[list, ...]:
    """Flat leaf lists of ``tree`` and ``others``, restricted to positions where ``tree`` has a leaf.

    This is how transforms line gradients up with their state: a ``None`` gradient (frozen parameter)
    drops that position from every list, so the state there is left untouched.

    >>> g, mu = align({"a": torch.ones(1), "b": None}, {"a": torch.zeros(1), "b": torch.zeros(2)})
    >>> len(g), len(mu)
    (1, 1)
    """
    flat, spec = flatten(tree)
    rest = []
    for other in others:
        other_flat, other_spec = flatten(other)
        if other_spec != spec:
            raise ValueError(
                f"updates do not match the {what}: the trees differ at '{first_mismatch(tree, other)}' "
                "(was the state initialised from different params?)"
            )
        rest.append(other_flat)
    if any(x is None for x in flat):  # not `None in flat`: that calls Tensor.__eq__ per leaf
        keep = [i for i, x in enumerate(flat) if x is not None]
        flat = [flat[i] for i in keep]
        rest = [[r[i] for i in keep] for r in rest]
    return (flat, *rest)


# --- construction ---------------------------------------------------------------------------------

def zeros_like(tree: Tree, dtype: torch.dtype | None = None) -> Tree:
    """Zeros shaped like each leaf (DTensor leaves give DTensors), optionally in ``dtype``."""
    return map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def clone(tree: Tree) -> Tree:
    """A copy of every tensor leaf (non-tensor leaves are shared).

    DTensor leaves are copied piece by piece with the same mesh, placements, shape and stride:
    ``DTensor.clone`` would redistribute a ``Partial`` leaf (a collective per leaf).
    """
    return map(_clone, tree)


def _clone(x: Any) -> Any:
    if isinstance(x, DTensor):
        return DTensor.from_local(local(x).clone(), x.device_mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())
    return x.clone() if isinstance(x, torch.Tensor) else x


def cast(tree: Tree, dtype: torch.dtype | None) -> Tree:
    """Casts floating-point leaves to ``dtype`` (no copy when already there); other leaves pass through."""
    if dtype is None:
        return tree
    return map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


# --- batched math over flat leaf lists --------------------------------------------------------------

def sum_sq(xs: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum of squares of all elements of ``xs`` as a 0-dim tensor, accumulated in ``dtype`` or wider."""
    xs = list(xs)
    if not xs:
        return torch.zeros((), dtype=dtype)
    acc = torch.promote_types(dtype, xs[0].dtype) if xs[0].is_floating_point() else dtype
    norms = torch._foreach_norm(xs, 2, dtype=acc)
    return torch.stack(norms).square().sum()


def norm(tree: Tree) -> torch.Tensor:
    """Global L2 norm of a tree of local (non-distributed) tensors, float32 or wider."""
    return sum_sq(leaves(tree)).sqrt()


def add_(xs: list[torch.Tensor], ys: list[torch.Tensor], alpha: float = 1.0) -> list[torch.Tensor]:
    """``xs += alpha * ys`` in place."""
    if xs:
        torch._foreach_add_(xs, ys, alpha=alpha)
    return xs


def scale_(xs: list[torch.Tensor], s: float | torch.Tensor) -> list[torch.Tensor]:
    """``xs *= s`` in place; ``s`` may be a Python number or a 0-dim tensor (no host sync)."""
    if xs:
        torch._foreach_mul_(xs, s)
    return xs


def where(pred: torch.Tensor, a: Tree, b: Tree) -> Tree:
    """Leafwise ``torch.where(pred, a, b)`` for a 0-dim boolean ``pred`` (selected on device, no host sync)."""
    return map(lambda x, y: torch.where(pred, x, y), a, b)


def local(x: Any) -> Any:
    """The local piece of a DTensor (a view: writing into it writes into the DTensor); anything else as is.

    ``_local_tensor`` is what ``DTensor.to_local()`` returns under ``no_grad``, read directly so a gradient
    tree of ``requires_grad`` DTensors still gives views to write into, with no autograd node per leaf.

    >>> local(torch.ones(1)).tolist(), local(None)
    ([1.0], None)
    """
    return x._local_tensor if isinstance(x, DTensor) else x


def where_(pred: torch.Tensor, new: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
    """``out[i] = torch.where(pred, new[i], out[i])`` in place, for a 0-dim boolean ``pred`` (no host sync).

    How a transform keeps or restores state without branching on the host: run the kernel, then select
    into a kept copy. On local pieces, so DTensor placements (``Partial`` too) are kept. One kernel per
    leaf: torch has no foreach ``where``, and arithmetic tricks (``mul``, ``lerp``) turn inf into NaN.
    """
    for n, o in zip(new, out):
        o = local(o)
        torch.where(pred, local(n), o, out=o)


def zero_where_(pred: torch.Tensor, xs: Sequence[torch.Tensor]) -> None:
    """``xs[i][...] = 0`` where the 0-dim boolean ``pred`` is true, in place (NaN and inf included)."""
    for x in xs:
        local(x).masked_fill_(pred, 0)


def all_finite(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-dim bool tensor: every element of every tensor in ``xs`` is finite."""
    xs = list(xs)
    if not xs:
        return torch.ones((), dtype=torch.bool)
    # The inf-norm of finite values is finite (a sum of squares could overflow); NaN propagates through amax.
    return torch.stack(torch._foreach_norm(xs, float("inf"))).isfinite().all()
