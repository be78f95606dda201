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

import contextlib
import threading
from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

from fxtrain._deferred import DTensor

__all__ = [
    "flatten", "unflatten", "leaves", "paths", "structure", "map", "align", "put", "first_mismatch",
    "zeros_like", "clone", "cast", "sum_sq", "norm", "vdot", "full", "local", "all_finite", "where",
    "borrowed", "first_borrowed",
    # the op layer: in place by default, out of place inside functional()
    "functional", "is_functional", "donated", "is_donated", "transformed", "scale_", "mul_", "div_", "add_", "lerp_", "addcmul_",
    "addcdiv_", "sqrt_", "reciprocal_", "sign_", "tanh_", "abs_", "neg_", "clamp_", "maximum_", "copy_",
    "inc_", "where_", "zero_where_",
    # values by name (Optax's tree_get / tree_set)
    "get", "set", "get_all_with_path", "NamedTupleKey", "keystr",
]

Tree = Any
_NS = "fxtrain"  # optree namespace; register custom nodes with optree.register_pytree_node(..., namespace="fxtrain")


def optree_options(none_is_leaf: bool = True) -> dict:
    """fxtrain's optree keyword arguments (``None`` a leaf unless told, fxtrain's node namespace), for calling
    ``optree`` directly on the trees this module handles: ``optree.tree_map(f, t, **tree.optree_options())``."""
    return {"none_is_leaf": none_is_leaf, "namespace": _NS}


def flatten(tree: Tree) -> tuple[list, optree.PyTreeSpec]:
    """Flattens ``tree`` into (leaves, spec); ``None`` leaves are kept so structures stay aligned."""
    return optree.tree_flatten(tree, **optree_options())


def unflatten(spec: optree.PyTreeSpec, leaves: Sequence) -> Tree:
    """Inverse of :func:`flatten`."""
    return optree.tree_unflatten(spec, leaves)


def structure(tree: Tree) -> optree.PyTreeSpec:
    """The treespec of ``tree`` (``None`` counted as a leaf)."""
    return optree.tree_structure(tree, **optree_options())


def leaves(tree: Tree) -> list:
    """The non-``None`` leaves of ``tree`` in flatten order."""
    return optree.tree_leaves(tree, **optree_options(False))


def path_str(path: tuple) -> str:
    """A leaf's optree path as :func:`paths` writes it: ``"layer.0.w"``, ``"<root>"`` for the root."""
    return ".".join(str(p) for p in path) or "<root>"


def paths(tree: Tree) -> list[str]:
    """Dotted paths of every leaf (``None`` included), in flatten order."""
    return [path_str(p) for p in optree.tree_paths(tree, **optree_options())]


def first_mismatch(a: Tree, b: Tree) -> str | None:
    """The dotted path where the structures of ``a`` and ``b`` first differ, or ``None`` if they match.

    Names the first leaf one tree has and the other lacks (or the node whose container type differs).
    Leaf values are not compared; ``None`` matches any leaf.

    >>> first_mismatch({"a": 1, "b": [1, 2]}, {"a": 1, "b": [1]})
    'b.1'
    """
    if structure(a) == structure(b):
        return None
    a_paths = [tuple(p) for p in optree.tree_paths(a, **optree_options())]
    b_paths = [tuple(p) for p in optree.tree_paths(b, **optree_options())]
    a_set, b_set = frozenset(a_paths), frozenset(b_paths)  # (`set` below is tree.set, Optax's tree_set)
    for p in a_paths + b_paths:  # a leaf that one tree has and the other lacks
        if p not in a_set or p not in b_set:
            return path_str(_deepest_shared_prefix(p, a_set if p in b_set else b_set))
    # Same leaf paths, different containers (a list where a tuple was expected, say): name the node.
    for p in a_paths:
        for k in range(len(p)):
            if type(_get(a, p[:k])) is not type(_get(b, p[:k])):
                return path_str(p[:k])
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
    return optree.tree_map(lambda x, *r: None if x is None else fn(x, *r), tree, *rest, **optree_options())


def _check_like(tree: Tree, others: Sequence[Tree], what: str = "tree") -> None:
    spec = structure(tree)
    for i, other in enumerate(others):
        if structure(other) != spec:
            raise ValueError(
                f"{what} #{i + 1} does not match the structure of the first tree: they differ at "
                f"'{first_mismatch(tree, other)}'"
            )


def structures_differ(flat: list, spec: optree.PyTreeSpec, other_flat: list, other_spec: optree.PyTreeSpec) -> bool:
    """Whether two flattened trees differ in structure (a host check; no tensor is read).

    Under ``torch.compile`` the structures are constants of the trace and are compared by their leaf counts:
    torch 2.11's dynamo cannot trace a PyTreeSpec's ``__eq__`` (its polyfill compares function objects; seen on
    an H200 by ``make gpu-check``), so a compiled step catches a changed structure only where the leaf count
    changed. Eager calls compare the specs whole.

    >>> a, b = flatten({"a": 1}), flatten({"b": 1})
    >>> structures_differ(*a, *b), structures_differ(*a, *a)
    (True, False)
    """
    if torch.compiler.is_compiling():
        return len(flat) != len(other_flat)
    return spec != other_spec


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
        if structures_differ(flat, spec, other_flat, other_spec):
            hint = " (was the state initialised from different params?)" if what == "state" else ""
            raise ValueError(f"updates do not match the {what}: the trees differ at "
                             f"'{first_mismatch(tree, other)}'{hint}")
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


# --- batched math over flat leaf lists: the op layer ----------------------------------------------
#
# Every transform writes its math once, with the functions below. Each takes flat lists of leaves (and
# Python numbers or 0-dim tensors as scalars) and *returns* the result list; kernels always rebind
# (``mu = tree.lerp_(mu, g, 0.1)``) and rebuild their trees with :func:`put`. Two ways to run them:
#
# * in place (the default, and what a donated step uses): one ``torch._foreach_*_`` call that writes
#   into the first list and returns it. Nothing parameter-sized is allocated.
# * out of place (inside :func:`functional`, which a pure ``tx.update`` enters when a ``torch.func``
#   transform is active or autograd is recording): one ordinary torch op per leaf, never writing an
#   input. ``torch._foreach_*`` ops have no vmap batching rules and their ``Scalar`` overloads read a
#   tensor argument with ``.item()`` (a detached, host-synced number), so this path is what makes
#   ``vmap``, ``grad``, ``jvp`` and ``create_graph`` see every operation, hyperparameters included.
#
# On CPU torch runs foreach ops as the same per-tensor kernels, so both ways give the same bits.

_STATE = threading.local()


def is_functional() -> bool:
    """Whether the op layer currently runs out of place (inside :func:`functional`)."""
    return getattr(_STATE, "functional", False)


@contextlib.contextmanager
def functional(on: bool = True):
    """Runs the op layer out of place (``on=True``) or in place (``on=False``) inside the block.

    >>> xs = [torch.ones(2)]
    >>> with functional():
    ...     ys = scale_(xs, 2.0)
    >>> xs[0].tolist(), ys[0].tolist()
    ([1.0, 1.0], [2.0, 2.0])
    """
    before = is_functional()
    _STATE.functional = on
    try:
        yield
    finally:
        _STATE.functional = before


def is_donated() -> bool:
    """Whether the running update owns its buffers (:func:`fxtrain.update_`, a donated step).

    A kernel may then return ``None`` for updates it leaves untouched (``accumulate`` between emissions:
    the step skips the add); a pure update returns zeros there, as Optax does.
    """
    return getattr(_STATE, "donated", False)


@contextlib.contextmanager
def donated():
    """Marks the block as a donated update (see :func:`is_donated`); the op layer runs in place inside."""
    before = is_donated(), is_functional()
    _STATE.donated, _STATE.functional = True, False
    try:
        yield
    finally:
        _STATE.donated, _STATE.functional = before


def transformed() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp, jacrev...) is active around this call."""
    return torch._C._functorch.peek_interpreter_stack() is not None


class DonatedGradError(ValueError):
    """A hyperparameter tensor that requires grad met a donated (in-place, ``no_grad``) update."""


def _in_place(*scalars: Any) -> bool:
    """Whether ops run in place now; refuses, in a donated update, a scalar tensor that requires grad
    (its gradient would be dropped in silence: a donated update runs under ``no_grad``)."""
    if is_functional():
        return False
    if is_donated():
        for s in scalars:
            if isinstance(s, torch.Tensor) and s.requires_grad:
                raise DonatedGradError(
                    "a hyperparameter tensor requires grad, but this update is donated (in place, under "
                    "no_grad) and would drop its gradient; use tx.update or train_step(donate=False)")
    return True


def _scalars(s: Any, n: int) -> Any:
    """A 0-dim tensor scalar as a list of ``n`` tensors: the foreach ``Tensor``-list overloads broadcast
    it, where the ``Scalar`` overloads would call ``.item()``."""
    return [s] * n if isinstance(s, torch.Tensor) and s.ndim == 0 else s


def _kept(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``r`` in ``x``'s dtype, as an in-place op on ``x`` leaves it (computed promoted, stored in x's dtype).

    A 0-dim float32 hyperparameter against a 0-dim bfloat16 leaf promotes; Optax casts such scalars to
    the leaf's dtype, and so does the in-place kernel.
    """
    return r if r.dtype == x.dtype else r.to(x.dtype)


def _num(s: Any, x: torch.Tensor) -> Any:
    """A Python number against a 0-dim ``x`` as a 0-dim tensor of ``x``'s compute dtype.

    Under ``torch.func.jvp``, a 0-dim tensor times a Python float gets a float64 tangent
    (pytorch/functorch#1073), which later ops refuse. A tensor scalar in the same (opmath) dtype gives
    the same value and a tangent of the right dtype.
    """
    if x.ndim or isinstance(s, torch.Tensor):
        return s
    return torch.tensor(s, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)


def _additive_pieces(xs: list) -> list | None:
    """The tensors to add one 0-dim tensor to without reading it on the host: ``xs`` themselves when plain, their
    local pieces when every DTensor among them is Shard or Replicate (a number added to each piece is the number
    added to the whole; DTensor's own dispatch of the Tensor overload refuses a scalar on another mesh); ``None``
    when a piece is ``Partial`` (the number belongs to one piece of the sum: DTensor's Scalar overload places it,
    reading it on the host)."""
    if not any(isinstance(x, DTensor) for x in xs):
        return xs
    if any(p.is_partial() for x in xs if isinstance(x, DTensor) for p in x.placements):
        return None
    return [local(x) for x in xs]


def _linear_pieces(xs: list, s: Any) -> tuple[list, Any]:
    """``(xs, s)`` to run an in-place product on: for DTensor ``xs`` and one scalar or one 0-dim scalar per leaf
    (a per-leaf norm), their local pieces and the scalars' full values (linear: right for every placement,
    ``Partial`` included); ``(xs, s)`` themselves otherwise. DTensor dispatch of a foreach op with a 0-dim
    tensor scalar replicates the scalar onto one mesh and refuses leaves on several (FSDP2 x TP: norms on the
    dp mesh, matrices on dp x tp), and refuses plain per-leaf scalars; on the pieces it is one plain kernel."""
    if not isinstance(xs[0], DTensor) and not any(isinstance(x, DTensor) for x in xs):
        return xs, s
    if not isinstance(s, list):
        return [local(x) for x in xs], s
    if all(isinstance(y, torch.Tensor) and y.ndim == 0 for y in s) and any(x.ndim for x in xs):
        return [local(x) for x in xs], [full(y) for y in s]
    return xs, s


def full(x: Any) -> Any:
    """The value of a DTensor as a plain tensor, identical on every rank (a reduction of a sharded leaf, e.g.
    its norm or sum, is reduced over the mesh: one collective); anything else as it is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def vdot(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
    r""":math:`\mathrm{Re} \sum_i \langle x_i, y_i \rangle` over all leaves (Optax's ``tree.vdot``), a plain 0-dim
    tensor, float32 or wider.

    One product and sum per leaf (no foreach op reduces a product; and an elementwise product batches
    exactly under vmap, where ``torch.vdot`` becomes a matrix product that rounds differently). A DTensor
    leaf's sum covers all its shards (one all-reduce per sharded leaf).

    >>> float(vdot([torch.tensor([1.0, 2.0]), torch.tensor([3j])], [torch.tensor([3.0, 4.0]), torch.tensor([2j])]))
    17.0
    """
    xs, ys = list(xs), list(ys)
    if not xs:
        return torch.zeros(())
    real = xs[0].real.dtype if xs[0].is_complex() else xs[0].dtype
    acc = torch.promote_types(real, torch.float32)
    total = None
    for x, y in zip(xs, ys):
        d = (x.conj() * y).real if x.is_complex() or y.is_complex() else x.to(acc) * y.to(acc)
        d = full(d.sum(dtype=acc))
        total = d if total is None else total + d
    return total


def scale_(xs: list[torch.Tensor], s: Any) -> list[torch.Tensor]:
    """``xs * s``; ``s`` a number, a 0-dim tensor (no host sync) or a list of tensors."""
    if not xs:
        return xs
    _in_place(s)
    if is_functional():
        return [_kept(x * y, x) for x, y in zip(xs, s)] if isinstance(s, list) else [_kept(x * _num(s, x), x) for x in xs]
    torch._foreach_mul_(*_linear_pieces(xs, s))
    return xs


mul_ = scale_


def div_(xs: list[torch.Tensor], s: Any) -> list[torch.Tensor]:
    """``xs / s``; ``s`` a number, a 0-dim tensor or a list of tensors."""
    if not xs:
        return xs
    _in_place(s)
    if is_functional():
        return [_kept(x / y, x) for x, y in zip(xs, s)] if isinstance(s, list) else [_kept(x / _num(s, x), x) for x in xs]
    torch._foreach_div_(*_linear_pieces(xs, s))
    return xs


def add_(xs: list[torch.Tensor], ys: Any, alpha: Any = 1.0) -> list[torch.Tensor]:
    """``xs + alpha * ys``; ``ys`` a list of tensors, or a number / 0-dim tensor added to every element."""
    if not xs:
        return xs
    _in_place(ys, alpha)
    if not isinstance(ys, list):
        if is_functional():
            return [_kept(x + _num(ys, x), x) for x in xs]
        # alpha= selects the Tensor overload for a 0-dim tensor: without it Python's argument parser takes
        # the Scalar one (declared first, one argument fewer) and reads the tensor with .item(), a host sync
        # (tests/test_no_host_sync.py).
        pieces = _additive_pieces(xs) if isinstance(ys, torch.Tensor) else None
        if pieces is not None:
            torch._foreach_add_(pieces, full(ys), alpha=1)
        else:
            torch._foreach_add_(xs, ys)
        return xs
    if isinstance(alpha, torch.Tensor):  # alpha= takes a number only: fold a tensor into ys
        ys, alpha = scale_(list(ys), alpha) if is_functional() else torch._foreach_mul(ys, alpha), 1.0
    if is_functional():
        return [_kept(torch.add(x, y, alpha=alpha), x) for x, y in zip(xs, ys)]
    torch._foreach_add_(xs, ys, alpha=alpha)
    return xs


def lerp_(xs: list[torch.Tensor], ys: list[torch.Tensor], w: Any) -> list[torch.Tensor]:
    """``xs + w * (ys - xs)`` (``torch.lerp``); ``w`` a number or a 0-dim tensor."""
    if not xs:
        return xs
    _in_place(w)
    if is_functional():
        return [_kept(_lerp(x, y, w), x) for x, y in zip(xs, ys)]
    torch._foreach_lerp_(xs, ys, _scalars(w, len(xs)))
    return xs


def _lerp(x: torch.Tensor, y: torch.Tensor, w: Any) -> torch.Tensor:
    if x.ndim == 0 and transformed():
        # torch.lerp refuses the float64 tangent forward mode gives 0-dim tensors (see _num): the formula.
        return x + _num(w, x) * (y - x)
    return torch.lerp(x, y, w.to(x.dtype) if isinstance(w, torch.Tensor) else w)


def _addc(name: str, folds: int) -> Callable:
    """``xs + value * ys op zs`` (op: mul or div); a tensor ``value`` multiplies operand ``folds`` (1: ``ys``,
    2: ``zs``) first, since the ops' ``value=`` takes numbers only."""
    inplace, leafwise = getattr(torch, f"_foreach_{name}_"), getattr(torch, name)

    def op(xs: list[torch.Tensor], ys: list[torch.Tensor], zs: list[torch.Tensor], value: Any = 1.0
           ) -> list[torch.Tensor]:
        if not xs:
            return xs
        _in_place(value)
        if isinstance(value, torch.Tensor):
            operands = [ys, zs]
            f = operands[folds - 1]
            operands[folds - 1] = [t * value for t in f] if is_functional() else torch._foreach_mul(f, value)
            (ys, zs), value = operands, 1.0
        if is_functional():
            return [_kept(leafwise(x, y, z, value=value), x) for x, y, z in zip(xs, ys, zs)]
        inplace(xs, ys, zs, value=value)
        return xs

    op.__name__ = op.__qualname__ = f"{name}_"
    op.__doc__ = f"``torch.{name}(xs, ys, zs, value=value)`` leaf by leaf; ``value`` a number or a 0-dim tensor."
    return op


addcmul_, addcdiv_ = _addc("addcmul", folds=2), _addc("addcdiv", folds=1)


def sum_sq(xs: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum of squared magnitudes of all elements of ``xs`` as a 0-dim tensor, accumulated in ``dtype`` or wider.

    In place: one ``torch._foreach_norm``. Inside :func:`functional`: ``sum(|x|^2)`` leaf by leaf, as Optax
    writes it, so its gradient is ``2x`` everywhere (a norm's is undefined at 0) and vmap batches it.
    """
    xs = list(xs)
    if not xs:
        return torch.zeros((), dtype=dtype)
    real = xs[0].real.dtype if xs[0].is_complex() else xs[0].dtype
    acc = torch.promote_types(dtype, real) if real.is_floating_point else dtype
    if is_functional():
        return sum(_abs_sq(x).to(acc).sum() for x in xs)
    xs = [torch.view_as_real(x) if x.is_complex() else x for x in xs]  # |z|^2 = re^2 + im^2
    norms = torch._foreach_norm(xs, 2, dtype=acc)
    return torch.stack(norms).square().sum()


def _abs_sq(x: torch.Tensor) -> torch.Tensor:
    return (x * x.conj()).real if x.is_complex() else x * x


def norm(tree: Tree) -> torch.Tensor:
    """Global L2 norm of a tree of local (non-distributed) tensors, float32 or wider."""
    return sum_sq(leaves(tree)).sqrt()


def _unary(name: str) -> Callable:
    inplace, leafwise = getattr(torch, f"_foreach_{name}_"), getattr(torch, name)

    def op(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not xs:
            return xs
        if is_functional():
            return [leafwise(x) for x in xs]
        inplace(xs)
        return xs

    op.__name__ = op.__qualname__ = f"{name}_"
    op.__doc__ = f"``torch.{name}`` of every tensor of ``xs``."
    return op


sqrt_, reciprocal_, sign_, tanh_, abs_, neg_ = map(_unary, ("sqrt", "reciprocal", "sign", "tanh", "abs", "neg"))


def clamp_(xs: list[torch.Tensor], lo: Any = None, hi: Any = None) -> list[torch.Tensor]:
    """``min(max(xs, lo), hi)`` elementwise (NaN stays NaN); bounds are numbers, 0-dim tensors or ``None``."""
    if not xs:
        return xs
    _in_place(lo, hi)
    if is_functional():
        if lo is not None:
            xs = [_kept(torch.clamp_min(x, lo), x) for x in xs]
        return xs if hi is None else [_kept(torch.clamp_max(x, hi), x) for x in xs]
    if lo is not None:
        torch._foreach_clamp_min_(xs, _scalars(lo, len(xs)))
    if hi is not None:
        torch._foreach_clamp_max_(xs, _scalars(hi, len(xs)))
    return xs


def maximum_(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[torch.Tensor]:
    """Elementwise ``max(xs, ys)`` (NaN propagates)."""
    if not xs:
        return xs
    if is_functional():
        return [_kept(torch.maximum(x, y), x) for x, y in zip(xs, ys)]
    torch._foreach_maximum_(xs, ys)
    return xs


def copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> list[torch.Tensor]:
    """``src`` cast to ``dst``'s dtypes; in place, written into ``dst``.

    DTensor has no sharding rule for ``_foreach_copy_`` (torch 2.13), so DTensor leaves are copied one
    by one there, each source first brought to its destination's placements; plain tensors take the single
    foreach call.
    """
    if not dst:
        return dst
    if is_functional():
        return [s.to(d.dtype) for d, s in zip(dst, src)]
    if not any(isinstance(x, DTensor) for x in dst):
        torch._foreach_copy_(dst, src)
    else:
        for d, x in zip(dst, src):
            # A source in another layout (a gradient computed Replicate or Partial for a Shard(0) state) is
            # brought to the destination's first: DTensor refuses in-place copies that change placements.
            if isinstance(d, DTensor) and isinstance(x, DTensor) and x.placements != d.placements:
                x = x.redistribute(d.device_mesh, d.placements)
            d.copy_(x)
    return dst


def inc_(count: torch.Tensor, by: Any = 1) -> torch.Tensor:
    """``count + by`` for a 0-dim counter (in place outside :func:`functional`)."""
    return count + by if is_functional() else count.add_(by)


def put(like: Tree, mask: Tree, new: Sequence) -> Tree:
    """``like`` with its leaves at the non-``None`` positions of ``mask`` replaced by ``new``, in order.

    The inverse of :func:`align` for kernels: ``g, mu = align(updates, state.mu)`` then, after the math,
    ``put(state.mu, updates, mu)``. In place the leaves were written already and ``like`` itself comes
    back (no cost). A DTensor leaf whose new value is a plain tensor (math on its local piece) is
    wrapped back with the same mesh, placements, shape and stride.

    >>> with functional():
    ...     put({"a": torch.zeros(1), "b": torch.zeros(1)}, {"a": None, "b": 1}, [torch.ones(1)])
    {'a': tensor([0.]), 'b': tensor([1.])}
    """
    if not is_functional():
        return like
    flat, spec = flatten(like)
    keep = flatten(mask)[0] if mask is not like else flat
    it = iter(new)
    out = [x if m is None else rewrap(next(it), x) for x, m in zip(flat, keep)]
    return unflatten(spec, out)


def rewrap(new: Any, old: Any) -> Any:
    """``new``, computed from ``old``'s local piece (:func:`local`), as a DTensor placed like ``old`` when
    ``old`` is one (its global shape and stride kept); ``new`` itself otherwise."""
    if isinstance(old, DTensor) and not isinstance(new, DTensor):
        return DTensor.from_local(new, old.device_mesh, old.placements, run_check=False, shape=old.shape,
                                  stride=old.stride())
    return new


def where(pred: torch.Tensor, a: Tree, b: Tree) -> Tree:
    """Leafwise ``torch.where(pred, a, b)`` for a 0-dim boolean ``pred`` (selected on device, no host sync)."""
    return map(lambda x, y: torch.where(pred, x, y), a, b)


def local(x: Any) -> Any:
    """The local piece of a DTensor (a view: writing into it writes into the DTensor); anything else as is.

    ``_local_tensor`` is what ``DTensor.to_local()`` returns under ``no_grad``, read directly so a gradient
    tree of ``requires_grad`` DTensors still gives views to write into, with no autograd node per leaf.
    Inside :func:`functional` it is ``to_local()`` itself, so autograd sees the step.

    >>> local(torch.ones(1)).tolist(), local(None)
    ([1.0], None)
    """
    if not isinstance(x, DTensor):
        return x
    return x.to_local() if is_functional() else x._local_tensor


def borrowed(x: Any) -> bool:
    """Whether tensor ``x`` (a DTensor: its local piece) lives in memory that torch did not allocate for itself.

    True for tensors made from numpy arrays (``torch.from_numpy``, ``torch.as_tensor`` without a copy),
    from DLPack capsules (JAX and Flax arrays, ``fxtrain.interop.from_jax(copy=False)``, CuPy),
    ``torch.frombuffer``, and records read by ``torch.load``/safetensors (file mappings included): writing
    into those in place changes an array another library owns, or a file. How it is told: torch marks a
    storage *resizable* exactly when its own allocator made it and nothing outside torch points into it
    (``torch.empty``, every op's output, ``clone``, parameters, ``fx.load``); a storage that wraps memory
    handed to it (``at::from_blob``: numpy, DLPack, buffers, mappings, ``torch.load``'s records) is not, on
    every device, and neither is one that torch has exported to numpy (``t.numpy()``, ``np.asarray(t)``:
    the array points into it, so torch may never reallocate it; measured on torch 2.13, the mark stays
    after the array is gone). That last case is conservative: a numpy view kept by the caller would see
    a donated step's writes, a temporary one would not, and both are refused; ``fx.tree.clone`` gives a
    tensor of torch's own either way. Measured on CPU, torch 2.13: from_numpy, as_tensor, frombuffer,
    DLPack from JAX, torch.load and safetensors are borrowed; ones, clone, views, parameters,
    share_memory_, fx.load, to_jax/to_dlpack exports are not. A metadata read, no sync. Empty tensors are
    never borrowed (nothing to write).

    >>> import numpy as np
    >>> borrowed(torch.from_numpy(np.ones(2))), borrowed(torch.ones(2)), borrowed(torch.from_numpy(np.ones(2)).clone())
    (True, False, False)
    """
    if not isinstance(x, torch.Tensor) or x.is_meta or x.layout != torch.strided:
        return False
    storage = local(x).untyped_storage()
    return storage.nbytes() > 0 and not storage.resizable()


def first_borrowed(tree: Tree) -> str | None:
    """The path of the first tensor leaf of ``tree`` that is :func:`borrowed`, or ``None``.

    >>> import numpy as np
    >>> first_borrowed({"a": torch.ones(1), "b": [torch.as_tensor(np.ones(1))]})
    'b.0'
    """
    flat, _ = flatten(tree)
    for i, x in enumerate(flat):
        if borrowed(x):
            return paths(tree)[i]
    return None


def where_(pred: torch.Tensor, new: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> list:
    """``torch.where(pred, new[i], out[i])`` for a 0-dim boolean ``pred`` (no host sync), written into ``out``.

    How a transform keeps or restores state without branching on the host: run the kernel, then select
    into a kept copy. On local pieces, so DTensor placements (``Partial`` too) are kept. One kernel per
    leaf: torch has no foreach ``where``, and arithmetic tricks (``mul``, ``lerp``) turn inf into NaN.
    Returns the selected leaves (``out`` itself in place; new tensors inside :func:`functional`).
    """
    if is_functional():
        return [rewrap(torch.where(pred, local(n), local(o)), o) for n, o in zip(new, out)]
    for n, o in zip(new, out):
        o = local(o)
        torch.where(pred, local(n), o, out=o)
    return list(out)


def zero_where_(pred: torch.Tensor, xs: Sequence[torch.Tensor]) -> list:
    """``xs[i]`` with every element set to 0 where the 0-dim boolean ``pred`` is true (NaN and inf included)."""
    if is_functional():
        return [rewrap(local(x).masked_fill(pred, 0), x) for x in xs]
    for x in xs:
        local(x).masked_fill_(pred, 0)
    return list(xs)


def all_finite(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-dim bool tensor: every element of every tensor in ``xs`` is finite."""
    xs = list(xs)
    if not xs:
        return torch.ones((), dtype=torch.bool)
    if is_functional() or any(isinstance(x, DTensor) for x in xs):
        # DTensors too: a rank's piece can be empty (an uneven Shard), where the inf-norm below raises on that
        # rank alone and leaves the others waiting in a collective.
        return torch.stack([x.isfinite().all() for x in xs]).all()
    # The inf-norm of finite values is finite (a sum of squares could overflow); NaN propagates through amax.
    # It has no identity on an empty tensor (torch raises): those are finite anyway.
    xs = [x for x in xs if x.numel()]
    return torch.stack(torch._foreach_norm(xs, float("inf"))).isfinite().all() if xs else torch.ones((), dtype=torch.bool)


# --- values by name: get / set (Optax's tree_get / tree_set) ----------------------------------------
#
# Optimizer states are nests of NamedTuples, dicts and tuples (chain, accumulate, amp_cast...); these
# find a value by its name (a NamedTuple field, a dict key, or a NamedTuple's type name) wherever it
# sits, so `set(state, learning_rate=lr)` reaches `state.inner_state.inner_state[3].hyperparams`.
# Written out here rather than with optree's paths: a path entry must tell a NamedTuple field (and the
# NamedTuple's type, which filters use) from a dict key.


class NamedTupleKey(NamedTuple):
    """A path entry of :func:`get_all_with_path`: field ``name`` of a NamedTuple of type ``tuple_name``.

    Filters tell apart same-named fields of different states with it (Optax's ``NamedTupleKey``):
    ``lambda path, value: path[-1] == NamedTupleKey("ScaleByAdamState", "count")``. Other entries are
    the dict key or the sequence index itself.
    """

    tuple_name: str
    name: str

    def __str__(self) -> str:
        return f"{self.tuple_name}.{self.name}"


KeyPath = tuple  # of NamedTupleKey, dict keys and sequence indices, root first
Filter = Callable[[KeyPath, Any], bool]


def keystr(path: KeyPath) -> str:
    """``path`` as the Python accessor it stands for, e.g. ``[1].inner_state.hyperparams['learning_rate']``.

    >>> keystr((1, NamedTupleKey("InjectHyperparamsState", "hyperparams"), "learning_rate"))
    "[1].hyperparams['learning_rate']"
    """
    return "".join(f".{e.name}" if isinstance(e, NamedTupleKey) else f"[{e!r}]" for e in path) or "<root>"


def _is_named_tuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _children(node: Any) -> tuple[list, list, Callable[[list], Any]] | None:
    """``(entries, children, rebuild)`` of a container (``rebuild(new_children)`` gives a node of the same
    type), or ``None`` for a leaf. Any node the fxtrain optree namespace knows is entered."""
    if node is None or isinstance(node, torch.Tensor):
        return None
    try:
        children, meta, entries, unflatten_one = optree.tree_flatten_one_level(node, **optree_options())
    except ValueError:  # a leaf type
        return None
    if _is_named_tuple(node):
        entries = [NamedTupleKey(type(node).__name__, f) for f in node._fields]
    return list(entries), list(children), lambda new: unflatten_one(meta, new)


def _name_of(node: Any, entry: Any) -> Any:
    """The name a child of ``node`` answers to: its field for a NamedTuple, its key for a dict; none else."""
    if isinstance(entry, NamedTupleKey):
        return entry.name
    return entry if isinstance(node, dict) else _NO_NAME


_NO_NAME = object()


def _found(tree: Tree, key: Any, path: KeyPath = ()):
    """(path, value) of every value named ``key``, depth first: a node's own matches before its subtrees'."""
    if _is_named_tuple(tree) and type(tree).__name__ == key:
        yield path, tree
    kids = _children(tree)
    if kids is None:
        return
    entries, children, _ = kids
    for e, c in zip(entries, children):
        if _name_of(tree, e) == key:
            yield (*path, e), c
    for e, c in zip(entries, children):
        yield from _found(c, key, (*path, e))


def get_all_with_path(tree: Tree, key: Any, filtering: Filter | None = None) -> list[tuple[KeyPath, Any]]:
    """Every value of ``tree`` named ``key``, with its path (Optax's ``tree_utils.tree_get_all_with_path``).

    A value is named by a NamedTuple field, a dict key (``InjectHyperparamsState.hyperparams`` holds the
    hyperparameters of :func:`fxtrain.inject_hyperparams`), or, for a whole NamedTuple, its type name
    (``"ScaleByAdamState"``). Paths are tuples of :class:`NamedTupleKey` (for NamedTuple fields), dict
    keys and sequence indices; :func:`keystr` prints them. Values inside a found value are found too.

    Args:
      tree: the tree to search, typically an optimizer state.
      key: the name to look for.
      filtering: optional ``filtering(path, value) -> bool`` keeping only some of the values found.

    Returns:
      ``[(path, value), ...]``, depth first (a node's own fields before those of its subtrees).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.chain(fx.inject_hyperparams(fx.sgd)(learning_rate=0.1), fx.adam(1e-3))
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> [fx.tree.keystr(path) for path, _ in fx.tree.get_all_with_path(state, "count")]
        ['[0].count', '[1][0].count']
        >>> adam_only = lambda path, value: path[-1].tuple_name == "ScaleByAdamState"
        >>> [fx.tree.keystr(path) for path, _ in fx.tree.get_all_with_path(state, "count", adam_only)]
        ['[1][0].count']
    """
    found = list(_found(tree, key))
    return found if filtering is None else [(p, v) for p, v in found if filtering(p, v)]


def get(tree: Tree, key: Any, default: Any = None, filtering: Filter | None = None) -> Any:
    """The one value of ``tree`` named ``key``, or ``default`` if there is none (Optax's ``tree_get``).

    Names are NamedTuple fields, dict keys and NamedTuple type names, found at any depth (see
    :func:`get_all_with_path`).

    Args:
      tree: the tree to search, typically an optimizer state.
      key: the name to look for.
      default: what to return when no value is named ``key``.
      filtering: optional ``filtering(path, value) -> bool`` keeping only some of the values found.

    Returns:
      The value.

    Raises:
      KeyError: several values are named ``key`` (after ``filtering``); the message gives their paths.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.accumulate(fx.inject_hyperparams(fx.adamw)(learning_rate=1e-3), every=4)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> float(fx.tree.get(state, "learning_rate"))
        0.001
        >>> fx.tree.get(state, "ScaleByAdamState").count
        tensor(0, dtype=torch.int32)
        >>> fx.tree.get(state, "momentum", default="none")
        'none'
    """
    found = get_all_with_path(tree, key, filtering)
    if len(found) > 1:
        where = ", ".join(keystr(p) for p, _ in found)
        raise KeyError(f"fxtrain.tree.get: {len(found)} values are named {key!r}, at {where}; pass "
                       "filtering=lambda path, value: ... to pick one (path entries: NamedTupleKey(tuple_name, "
                       "name), dict keys, indices)")
    return found[0][1] if found else default


def set(tree: Tree, filtering: Filter | None = None, /, **kwargs: Any) -> Tree:  # noqa: A001 - Optax's tree_set
    """A copy of ``tree`` with the values named by ``kwargs`` replaced (Optax's ``tree_set``).

    Every value named by a key of ``kwargs`` (a NamedTuple field, a dict key or a NamedTuple type name,
    at any depth, as :func:`get_all_with_path` finds them) that passes ``filtering`` is replaced by the
    given value, used as it is. The containers on the way are rebuilt; other leaves are shared, not
    copied. With :func:`fxtrain.inject_hyperparams` anywhere in a stack, this changes a hyperparameter
    from the next update on: give a 0-dim tensor of the hyperparameter's dtype (see its docstring).

    Args:
      tree: the tree, typically an optimizer state.
      filtering: optional ``filtering(path, value) -> bool``: only values passing it are replaced.
      **kwargs: name = new value.

    Returns:
      The new tree, of the same structure where the replaced values have the structure of the old ones.

    Raises:
      KeyError: no value (passing ``filtering``) is named by one of the keys; the message names it.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.amp_cast(fx.accumulate(fx.inject_hyperparams(fx.adamw)(learning_rate=1e-3), every=2))
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> state = fx.tree.set(state, learning_rate=torch.tensor(1e-4))
        >>> float(state.inner_state.inner_state.hyperparams["learning_rate"])
        0.0001...
    """
    for key in kwargs:
        if not get_all_with_path(tree, key, filtering):
            raise KeyError(_missing(tree, key, filtering))
    return _replaced(tree, (), filtering, kwargs)


def _replaced(node: Any, path: KeyPath, filtering: Filter | None, new: dict) -> Any:
    if _is_named_tuple(node) and type(node).__name__ in new and (filtering is None or filtering(path, node)):
        return new[type(node).__name__]
    kids = _children(node)
    if kids is None:
        return node
    entries, children, rebuild = kids
    out = []
    for e, c in zip(entries, children):
        name, p = _name_of(node, e), (*path, e)
        hit = name is not _NO_NAME and name in new and (filtering is None or filtering(p, c))
        out.append(new[name] if hit else _replaced(c, p, filtering, new))
    return rebuild(out)


def _missing(tree: Tree, key: Any, filtering: Filter | None) -> str:
    """Why ``set`` found nothing for ``key``, with the closest names the tree has."""
    import difflib  # only on this error path

    names: dict = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_named_tuple(node):
            names[type(node).__name__] = None
        kids = _children(node)
        if kids is not None:
            names.update((_name_of(node, e), None) for e in kids[0])
            stack.extend(kids[1])
    names.pop(_NO_NAME, None)
    if filtering is not None and key in names:
        return f"fxtrain.tree.set: no value named {key!r} passes the filtering given"
    close = difflib.get_close_matches(str(key), [str(n) for n in names], n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"fxtrain.tree.set: no value is named {key!r} in the tree{hint}"
