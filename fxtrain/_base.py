"""The Optax protocol in PyTorch: ``GradientTransformation``, the ``@transform`` decorator and ``chain``.

One code path per transform. A factory returns ``GradientTransformation(init_fn, update_fn)`` exactly as
in Optax, with one convention: ``update_fn`` is a *kernel* that owns ``updates`` and ``state`` and may
update them in place with ``torch._foreach_*_`` ops (it never mutates ``params``). The ``@transform``
decorator then turns it into a public transform whose ``update`` is pure (it copies ``updates`` and
``state`` on entry, then runs the kernel), and whose ``repr`` shows the factory call. A donated
:func:`fxtrain.train_step` calls the kernel directly (:func:`update_`), so a step writes into the buffers it
was given and allocates nothing parameter-sized. Transforms written by hand in Optax style (pure update,
no decorator) compose with everything: a pure function is a valid kernel.

Example:
    >>> import torch, fxtrain as fx
    >>> tx = fx.chain(fx.scale(2.0), fx.scale(-0.5))
    >>> tx
    chain(scale(2.0), scale(-0.5))
    >>> g = {"w": torch.ones(2)}
    >>> u, _ = tx.update(g, tx.init(g))
    >>> u["w"].tolist(), g["w"].tolist()   # update is pure: g is untouched
    ([-1.0, -1.0], [1.0, 1.0])
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

import optree
import torch
from torch.distributed.tensor import DTensor

from fxtrain import tree

Params = Updates = State = Any
LossFn = Callable[..., Any]


class GradientTransformation(NamedTuple):
    """An Optax gradient transformation: ``init(params) -> state``, ``update(updates, state, params) ->
    (updates, state)``, plus fxtrain's one extension ``wrap_loss(loss_fn, state) -> loss_fn`` that lets a
    transform act on the forward pass (``None`` means identity).

    >>> import fxtrain as fx
    >>> tx = fx.GradientTransformation(lambda p: fx.EmptyState(), lambda u, s, p=None: (u, s))
    >>> tx.wrap_loss is None
    True
    """

    init: Callable[[Params], State]
    update: Callable[..., tuple[Updates, State]]
    wrap_loss: Callable[[LossFn, State], LossFn] | None = None

    def __repr__(self) -> str:
        label = getattr(self.update, "label", None)
        if label is not None:
            return label
        return f"GradientTransformation(init={_name(self.init)}, update={_name(self.update)})"


class EmptyState(NamedTuple):
    """The state of stateless transforms (Optax's ``EmptyState``)."""


class _Update:
    """The pure ``update`` of an fxtrain transform: copies its inputs, then runs the in-place kernel."""

    __slots__ = ("kernel", "_label", "elementwise")

    def __init__(self, kernel: Callable, label: str | Callable[[], str], elementwise: bool):
        self.kernel, self._label, self.elementwise = kernel, label, elementwise

    @property
    def label(self) -> str:
        # Formatted on first read: inject_hyperparams rebuilds transforms with tensor hyperparameters
        # every update, and formatting their reprs there would cost a host sync each.
        if callable(self._label):
            self._label = self._label()
        return self._label

    def __call__(self, updates: Updates, state: State, params: Params = None) -> tuple[Updates, State]:
        try:
            return self.kernel(tree.clone(updates), tree.clone(state), params)
        except ValueError as e:  # name the transform the user built, not only the inner one
            raise ValueError(f"{self.label}: {e}") from None

    def __repr__(self) -> str:
        return f"<update of {self.label}>"


def kernel(tx: GradientTransformation) -> Callable:
    """The in-place kernel of ``tx`` (its pure ``update`` for hand-written transforms)."""
    return getattr(tx.update, "kernel", tx.update)


def update_(tx: GradientTransformation, updates: Updates, state: State, params: Params = None):
    """Runs ``tx`` donating ``updates`` and ``state``: their buffers may be overwritten and must not be reused.

    The in-place twin of ``tx.update`` (like ``jax.jit(..., donate_argnums=(0, 1))``). Same numbers.

    >>> import torch, fxtrain as fx
    >>> g = {"w": torch.ones(2)}
    >>> u, _ = fx.update_(fx.scale(3.0), g, fx.EmptyState())
    >>> u["w"] is g["w"], g["w"].tolist()   # the gradient buffer now holds the update
    (True, [3.0, 3.0])
    """
    return kernel(tx)(updates, state, params)


def is_elementwise(tx: GradientTransformation) -> bool:
    """Whether ``tx`` acts on each element independently (no reduction across elements or leaves)."""
    return bool(getattr(tx.update, "elementwise", False))


def _name(obj: Any) -> str:
    if isinstance(obj, GradientTransformation):
        return repr(obj)
    if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
        return obj.__name__
    return repr(obj)


def _label(name: str, sig: inspect.Signature, args: tuple, kwargs: dict) -> str:
    """``name(required, key=value for non-defaults, child transforms last)``."""
    bound = sig.bind(*args, **kwargs)
    params = sig.parameters
    required = [n for n, p in params.items() if p.default is p.empty and p.kind != p.VAR_POSITIONAL]
    head, children = [], []
    for n, v in bound.arguments.items():
        p = params[n]
        if p.kind == p.VAR_POSITIONAL:
            children += [f"{x[0]}={_name(x[1])}" if _is_named_pair(x) else _name(x) for x in v]
        elif p.kind == p.VAR_KEYWORD:
            head += [f"{k}={_name(x)}" for k, x in v.items()]
        elif isinstance(v, GradientTransformation):
            children.append(_name(v))
        elif p.default is not p.empty and _same(v, p.default):
            continue
        elif len(required) == 1 and n == required[0]:
            head.insert(0, _name(v))
        else:
            head.append(f"{n}={_name(v)}")
    return f"{name}({', '.join(head + children)})"


def _is_named_pair(x: Any) -> bool:
    return type(x) is tuple and len(x) == 2 and isinstance(x[0], str)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, (int, float, str, bool, type(None))) and isinstance(b, (int, float, str, bool)):
        return type(a) is type(b) and a == b
    return False


def transform(factory: Callable | None = None, *, elementwise: bool | None = True):
    """Decorator for transform factories: pure ``update`` around the in-place kernel, and a readable repr.

    Args:
      factory: returns ``GradientTransformation(init_fn, update_fn)`` where ``update_fn`` may mutate
        ``updates`` and ``state`` (never ``params``).
      elementwise: whether the transform treats every element independently (what
        ``sharded_apply`` requires). ``None`` inherits the flag of the transform the factory returns
        (for optimizers, which are chains).

    Example:
        >>> import torch, fxtrain as fx
        >>> @fx.transform
        ... def add_one():
        ...     def init_fn(params):
        ...         del params
        ...         return fx.EmptyState()
        ...     def update_fn(updates, state, params=None):
        ...         torch._foreach_add_(fx.tree.leaves(updates), 1.0)
        ...         return updates, state
        ...     return fx.GradientTransformation(init_fn, update_fn)
        >>> add_one()
        add_one()
    """
    def decorate(factory: Callable) -> Callable:
        sig = inspect.signature(factory)

        @functools.wraps(factory)
        def build(*args, **kwargs) -> GradientTransformation:
            tx = factory(*args, **kwargs)
            label = functools.partial(_label, factory.__name__, sig, args, kwargs)
            flag = is_elementwise(tx) if elementwise is None else elementwise
            return GradientTransformation(tx.init, _Update(kernel(tx), label, flag), tx.wrap_loss)

        build.is_transform_factory = True  # lets the conformance test find every public factory
        return build

    return decorate(factory) if factory is not None else decorate


# --- validation -------------------------------------------------------------------------------------

def check_nonnegative(transform_name: str, **values: Any) -> None:
    """Raises ``ValueError`` naming the argument when a float hyperparameter is negative."""
    for name, v in values.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            raise ValueError(f"{transform_name}: {name}={v!r} must be >= 0")


# --- combinators ----------------------------------------------------------------------------------

def wrap_loss(tx: GradientTransformation, loss_fn: LossFn, state: State) -> LossFn:
    """``tx.wrap_loss(loss_fn, state)``, or ``loss_fn`` itself when ``tx`` does not touch the forward pass."""
    return loss_fn if tx.wrap_loss is None else tx.wrap_loss(loss_fn, state)


@transform(elementwise=None)
def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in sequence; the state is a tuple of their states (Optax's ``chain``).

    >>> import fxtrain as fx
    >>> fx.chain(fx.clip(1.0), fx.scale(-0.1))
    chain(clip(1.0), scale(-0.1))
    """
    txs = tuple(transforms)

    def init_fn(params):
        return tuple(t.init(params) for t in txs)

    def update_fn(updates, state, params=None):
        if len(state) != len(txs):
            raise ValueError(f"chain of {len(txs)} transforms got a state of {len(state)} entries")
        new_state = []
        for t, s in zip(txs, state):
            updates, s = kernel(t)(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return _with_flags(GradientTransformation(init_fn, update_fn, _chain_wrap_loss(txs, lambda s: s)), txs)


@transform(elementwise=None)
def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with named entries; the state is a dict keyed by name.

    >>> import fxtrain as fx
    >>> tx = fx.named_chain(("clip", fx.clip(1.0)), ("lr", fx.scale(-0.1)))
    >>> tx, list(tx.init({}))
    (named_chain(clip=clip(1.0), lr=scale(-0.1)), ['clip', 'lr'])
    """
    names = [n for n, _ in transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: duplicate names in {names}")
    txs = tuple(t for _, t in transforms)

    def init_fn(params):
        return {n: t.init(params) for n, t in transforms}

    def update_fn(updates, state, params=None):
        if list(state) != names:
            raise ValueError(f"named_chain expects state entries {names}, got {list(state)}")
        new_state = {}
        for n, t in transforms:
            updates, new_state[n] = kernel(t)(updates, state[n], params)
        return updates, new_state

    wrap = _chain_wrap_loss(txs, lambda s: [s[n] for n in names])
    return _with_flags(GradientTransformation(init_fn, update_fn, wrap), txs)


def _chain_wrap_loss(txs: tuple, states_of: Callable) -> Callable | None:
    if all(t.wrap_loss is None for t in txs):
        return None

    def wrap(loss_fn, state):
        # The first transform's wrapper is outermost: it sees the params the step was called with.
        for t, s in reversed(list(zip(txs, states_of(state)))):
            loss_fn = wrap_loss(t, loss_fn, s)
        return loss_fn

    return wrap


def _with_flags(tx: GradientTransformation, children: tuple) -> GradientTransformation:
    flag = all(is_elementwise(c) for c in children)
    return GradientTransformation(tx.init, _Update(kernel(tx), "", flag), tx.wrap_loss)


@transform
def identity() -> GradientTransformation:
    """Leaves updates unchanged (Optax's ``identity``).

    >>> import fxtrain as fx
    >>> fx.identity()
    identity()
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return updates, state

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=False)
def stateless(f: Callable[[Updates, Params], Updates]) -> GradientTransformation:
    """A transform from a pure function ``f(updates, params) -> updates`` (Optax's ``stateless``).

    >>> import torch, fxtrain as fx
    >>> def negate(updates, params):
    ...     return fx.tree.map(torch.neg, updates)
    >>> tx = fx.stateless(negate)
    >>> tx
    stateless(negate)
    >>> tx.update({"w": torch.ones(1)}, tx.init(None))[0]["w"].tolist()
    [-1.0]
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        return f(updates, params), state

    return GradientTransformation(init_fn, update_fn)


# --- applying updates ---------------------------------------------------------------------------------

def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates`` leafwise, keeping each param's dtype; ``None`` updates leave the param as is.

    Pure: copies the params, then runs :func:`apply_updates_` on the copy (one code path; the in-place add
    keeps each param's dtype and, for DTensors, its placements).

    >>> import torch, fxtrain as fx
    >>> fx.apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})["w"].tolist()
    [0.5, 0.5]
    """
    _check_matches(updates, params)
    copied = tree.map(lambda p, u: p if u is None else tree.clone(p), params, updates)
    return apply_updates_(copied, updates)


def apply_updates_(params: Params, updates: Updates) -> Params:
    """In-place :func:`apply_updates`: adds ``updates`` into the param buffers and returns ``params``.

    >>> import torch, fxtrain as fx
    >>> p = {"w": torch.ones(2)}
    >>> fx.apply_updates_(p, {"w": torch.ones(2)})["w"].tolist()
    [2.0, 2.0]
    """
    us, ps = tree.align(updates, params, what="params")  # checks the structure, naming the first bad path
    with torch.no_grad():
        kinds = set(map(type, ps))
        if DTensor in kinds and len(kinds) > 1:
            # DTensor refuses foreach lists that mix it with plain tensors: one call per kind. The DTensor
            # call goes through DTensor dispatch, which redistributes an update placed unlike its param.
            for want in (False, True):
                pick = [i for i, p in enumerate(ps) if isinstance(p, DTensor) is want]
                torch._foreach_add_([ps[i] for i in pick], [us[i] for i in pick])
        elif ps:
            torch._foreach_add_(ps, us)
    return params


def _check_matches(updates: Updates, params: Params) -> None:
    # Updates may be None where params hold a tensor (frozen); the other way round is a user error.
    mismatch = tree.first_mismatch(updates, params)
    if mismatch is not None:
        raise ValueError(f"updates do not match params: the trees differ at '{mismatch}'")


# --- metrics reported from state ------------------------------------------------------------------

_REPORTERS: dict = {}


def report(state: State) -> dict[str, torch.Tensor]:
    """Metrics a stack exposes from its state: every state node with a ``report()`` method contributes.

    Used by :func:`fxtrain.train_step` to fill ``metrics`` (``grad_norm``, ``learning_rate``,
    ``loss_scale``...). Reporting nodes are found at every depth, so a wrapper's state (``amp_cast``,
    ``accumulate``) reports only its own values and its inner stack's show up as well; an outer node wins
    when two report the same name. The paths to reporting nodes are found once per state structure.
    """
    leaves, spec = tree.flatten(state)
    # Leaf types are part of the key: a state object that optree does not know is a leaf, so two states
    # can share a treespec ("*") while only one of them reports.
    key = (spec, tuple(map(type, leaves)))
    paths = _REPORTERS.get(key)
    if paths is None:
        paths = _REPORTERS[key] = _reporting_paths(state)
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        node = state
        for acc in path:
            node = acc(node)
        for k, v in node.report().items():
            out.setdefault(k, v)
    return out


def _reporting_paths(node: Any) -> list[tuple]:
    """Accessor chains to every node under (and including) ``node`` that has ``report()``, outer first."""
    out = [()] if hasattr(node, "report") else []
    accessors, leaves, _ = optree.tree_flatten_with_accessor(
        node, is_leaf=lambda x: x is not node and hasattr(x, "report"), none_is_leaf=True, namespace="fxtrain")
    for acc, leaf in zip(accessors, leaves):
        if leaf is not node and hasattr(leaf, "report"):
            out += [(acc, *rest) for rest in _reporting_paths(leaf)]
    return out
