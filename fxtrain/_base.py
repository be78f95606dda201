"""The Optax protocol in PyTorch: ``GradientTransformation``, the ``@transform`` decorator and ``chain``.

One code path per transform. A factory returns ``GradientTransformation(init_fn, update_fn)`` exactly as
in Optax (a 2-field NamedTuple: ``init_fn, update_fn = tx`` works), with one convention: ``update_fn`` is
a *kernel* written with :mod:`fxtrain.tree`'s op layer (``tree.lerp_``, ``tree.scale_``...), which
returns its results and rebuilds its trees with :func:`fxtrain.tree.put`. The same kernel runs two ways:

* **donated** (:func:`update_`, used by ``train_step(donate=True)``): the ops write into ``updates`` and
  ``state`` with ``torch._foreach_*_`` kernels; nothing parameter-sized is allocated.
* **pure** (``tx.update``): when a ``torch.func`` transform is active or autograd is recording, the ops
  run out of place, one torch op per leaf, so ``vmap``, ``grad``, ``jacrev``, ``jvp`` and
  ``create_graph`` see every operation (hyperparameter tensors included). Otherwise (under
  ``torch.no_grad``) the kernel runs in place on copies: the donated kernel's exact numbers.

The ``@transform`` decorator turns a factory into a public transform with that pure ``update``, a
readable ``repr`` and its declared :class:`Traits`. Transforms written by hand in Optax style (pure update,
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
import math
import struct
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

from fxtrain import tree
from fxtrain._deferred import DTensor

Params = Updates = State = Any
LossFn = Callable[..., Any]


FUSED_KERNELS = ("adam", "adamw", "sgd")  # names with a torch kernel of their own
FUSED_PREFIXES = ("clip_by_global_norm",)  # names that only scale the gradients: the kernels' grad_scale


class FusedSpec(NamedTuple):
    """Which fused torch kernel computes a transform, with the numbers it needs (all Python numbers).

    ``name`` is a kernel (``"adam"``, ``"adamw"``, ``"sgd"``) or a prefix (``"clip_by_global_norm"``:
    no kernel of its own, see :func:`merge_traits`). A combined spec also carries the clip's ``max_norm``,
    its ``groups`` (process groups the norm is summed over: pipeline stages) and ``states_of``, which
    splits the combinator's state into (clip state, optimizer state).

    A transform that keeps its hyperparameters in its state (``inject_hyperparams``) sets ``from_state``:
    ``from_state(state, params)`` gives ``(spec, inner_state, record)`` for the kernel, or ``None`` where
    the state holds values the kernel cannot take (the caller then runs the foreach kernels). ``spec`` is
    the inner optimizer's, declared for the state's current numbers; ``record()``, called only when the
    kernel runs, does the transform's own bookkeeping in place (its count, the values used) and returns
    the hyperparameters the kernel reads as tensors (``learning_rate``: torch's ``tensor_lr`` overloads).

    A wrapper whose update does its own work around its child's (``amp_cast``'s unscaling and overflow skip,
    ``accumulate``'s window, a chain of one) sets ``around`` and ``inner`` (the child's spec; ``name`` and
    ``hyperparams`` are the kernel's, for reading): see :func:`fused_around`.
    """

    name: str
    hyperparams: dict
    max_norm: float | None = None
    states_of: Callable[[Any], Sequence[Any]] | None = None
    groups: tuple = ()
    from_state: Callable[[Any, Any], tuple[FusedSpec, Any, Callable[[], dict]] | None] | None = None
    inner: FusedSpec | None = None
    around: Callable[..., Callable[[], None] | None] | None = None


def fused_around(inner: GradientTransformation, around: Callable[..., Callable[[], None] | None]) -> FusedSpec | None:
    """The :class:`FusedSpec` of a wrapper of ``inner`` that runs ``inner``'s fused kernel inside its own update,
    or ``None`` when ``inner`` declares no kernel (pass it to :func:`with_traits` as ``fused=``).

    ``around(grads, state, params, bind_inner)`` is called when a step asks for the kernel (metadata checks
    only, nothing written) and returns a thunk that does the wrapper's whole update *and* the apply in place,
    or ``None`` where it does not apply this call (the step then runs the wrapper's foreach update). It gets
    the child's kernel through ``bind_inner(grads, inner_state, params, pre=None)``, which gives a thunk or
    ``None`` (:func:`fxtrain.transforms._fused.bind`'s rules). ``pre(local_grads, placed_grads)``, when given, runs
    inside the child's thunk once the gradients are placed like their params (data parallel's reduced) and
    before the clip's norm: it may rewrite the local pieces in place and returns ``found_inf`` for the
    kernel (a 0-dim float32 tensor, exactly 1.0 to skip the update) or ``None``.

    >>> import torch, fxtrain as fx
    >>> spec = fused_around(fx.adam(0.1), lambda g, s, p, bind_inner: bind_inner(g, s, p))
    >>> spec.name, spec.inner.name, fused_around(fx.scale(2.0), lambda *a: None)
    ('adam', 'adam', None)
    """
    spec = traits(inner).fused
    if spec is None:
        return None
    return FusedSpec(spec.name, spec.hyperparams, inner=spec, around=around)


class Traits(NamedTuple):
    """Facts about a transform that the step and the combinators need, declared once (see :func:`transform`).

    Read them with :func:`traits`; combinators merge their children's in :func:`merge_traits`. The repr
    shows the traits that are set (``Traits()``: none).

    >>> import fxtrain as fx
    >>> fx.Traits(elementwise=True, extra_args=True)
    Traits(elementwise=True, extra_args=True)
    """

    elementwise: bool = False  #: acts on each element independently (what ``sharded_apply`` requires)
    partial_grads: bool = False  #: takes data-parallel ``Partial`` gradients unreduced (``accumulate``)
    host: bool = False  #: decides on the host between calls (``accumulate``): compiled steps keep it eager
    fused: FusedSpec | None = None  #: a :class:`FusedSpec`: a torch kernel computes update + apply
    wrap_loss: Callable[[LossFn, State], LossFn] | None = None  #: acts on the forward pass (``amp_cast``)
    extra_args: bool = False  #: its update reads keyword arguments such as ``value=`` (Optax's ``...ExtraArgs``)
    #: names its state reports that stay constant (``inject_hyperparams``' unscheduled ``b1``, ``eps``...):
    #: the state keeps them, :func:`fxtrain.train_step` leaves them out of its metrics
    constant_reports: frozenset = frozenset()

    def __repr__(self) -> str:
        # Only what differs from the defaults: a stack's traits read at a glance.
        ds = self._field_defaults
        fused = lambda v: repr(v.name) if isinstance(v, FusedSpec) else repr(v)  # noqa: E731
        shown = [f"{k}={fused(v) if k == 'fused' else describe(v)}" for k, v in zip(self._fields, self)
                 if v is not ds[k] and v != ds[k]]
        return f"Traits({', '.join(shown)})"


class GradientTransformation(NamedTuple):
    """An Optax gradient transformation: ``init(params) -> state``, ``update(updates, state, params) ->
    (updates, state)``. Exactly two fields, so ``init_fn, update_fn = tx`` works as in Optax.

    fxtrain's one extension, ``wrap_loss(loss_fn, state) -> loss_fn`` (lets a transform act on the forward
    pass; ``None`` means identity), rides along in the transform's :class:`Traits` (see
    :func:`with_traits`), read as ``tx.wrap_loss``.

    >>> import fxtrain as fx
    >>> tx = fx.GradientTransformation(lambda p: fx.EmptyState(), lambda u, s, p=None: (u, s))
    >>> init_fn, update_fn = tx
    >>> tx.wrap_loss is None, fx.traits(tx).elementwise
    (True, False)
    """

    init: Callable[[Params], State]
    update: Callable[..., tuple[Updates, State]]

    @property
    def wrap_loss(self) -> Callable[[LossFn, State], LossFn] | None:
        """The transform's forward-pass wrapper, or ``None`` (see :mod:`fxtrain.step`)."""
        return traits(self).wrap_loss

    def __repr__(self) -> str:
        return self.update.label if isinstance(self.update, _Update) else _maker(self.update)


class EmptyState(NamedTuple):
    """The state of stateless transforms (Optax's ``EmptyState``).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale(2.0).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.EmptyState), state._fields
        (True, ())
    """


class _Update:
    """The pure ``update`` of an fxtrain transform: its kernel run out of place, or in place on copies."""

    __slots__ = ("kernel", "_label", "traits")

    def __init__(self, kernel: Callable, label: str | Callable[[], str], traits: Traits):
        self.kernel, self._label, self.traits = kernel, label, traits

    @property
    def label(self) -> str:
        # Formatted on first read: inject_hyperparams rebuilds transforms with tensor hyperparameters
        # every update, and formatting their reprs there would cost a host sync each.
        if callable(self._label):
            self._label = self._label()
        return self._label

    def __call__(self, updates: Updates, state: State, params: Params = None, **extra_args: Any
                 ) -> tuple[Updates, State]:
        # Out of place whenever something may differentiate or batch through the update: a torch.func
        # transform, or autograd recording (a hyperparameter tensor in a closure can require grad
        # without any input showing it). Under no_grad: the donated kernel on copies, the same bits.
        composable = torch.is_grad_enabled() or tree.transformed()
        try:
            if composable:
                with tree.functional():
                    return self._run(updates, state, params, extra_args)
            with tree.functional(False):  # not donated: the copies are ours, the results the caller's
                return self._run(tree.clone(updates), tree.clone(state), params, extra_args)
        except ValueError as e:  # name the transform the user built, not only the inner one
            if str(e).startswith(self.label.split("(")[0] + "("):  # named already (e.g. by an inner call)
                raise
            if type(e) is not ValueError:  # a subclass (a user's, DonatedGradError...) keeps its type and message
                e.add_note(f"in the update of {self.label}")
                raise
            raise ValueError(f"{self.label}: {e}") from None

    def _run(self, updates: Updates, state: State, params: Params, extra_args: dict) -> tuple[Updates, State]:
        if extra_args and self.traits.extra_args:
            return self.kernel(updates, state, params, **extra_args)
        return self.kernel(updates, state, params)  # extra arguments it does not read are dropped, as in Optax

    def __repr__(self) -> str:
        return f"<update of {self.label}>"


def kernel(tx: GradientTransformation) -> Callable:
    """The kernel of ``tx`` (its pure ``update`` for hand-written transforms); runs in the caller's op mode.

    Outside ``torch.func`` and autograd the op layer runs in place: the kernel writes into what it is given
    (``tx.update`` hands it copies; :func:`call` is how a wrapper runs a child).

    >>> import torch, fxtrain as fx
    >>> g = {"w": torch.ones(2)}
    >>> u, _ = fx.extend.kernel(fx.scale(3.0))(g, fx.EmptyState(), None)
    >>> u["w"].tolist(), g["w"].tolist()
    ([3.0, 3.0], [3.0, 3.0])
    """
    return tx.update.kernel if isinstance(tx.update, _Update) else tx.update


def call(tx: GradientTransformation, updates: Updates, state: State, params: Params = None,
         extra_args: dict | None = None) -> tuple[Updates, State]:
    """Runs ``tx`` as a child of a wrapper, in the caller's op mode: the wrapper may still read ``updates`` and
    ``state`` afterwards, in every mode.

    How wrappers run their children: ``value=``, ``grad=``, ``value_fn=`` (Optax's extra arguments) reach the
    transforms that declare ``extra_args`` (:func:`transform`) and are dropped for the others. Where the op
    layer runs in place (a donated step, :func:`update_`, ``tx.update`` under ``torch.no_grad``) the child
    gets copies of ``updates`` and ``state``, so what the wrapper passed keeps its values: the pure and the
    donated update of a wrapper written with ``call`` are the same. Out of place nothing is copied. A
    wrapper that never reads what it passed (``chain``) may hand its buffers over with :func:`call_`.

    >>> import torch, fxtrain as fx
    >>> g = {"w": torch.ones(2)}
    >>> with torch.no_grad(), fx.tree.donated():          # as in a donated step
    ...     u, _ = fx.extend.call(fx.scale(3.0), g, fx.EmptyState())
    >>> u["w"].tolist(), g["w"].tolist()
    ([3.0, 3.0], [1.0, 1.0])
    """
    if tree.is_functional():
        return call_(tx, updates, state, params, extra_args)
    given = tree.clone(updates)  # the child's kernel writes into what it is given: it gets copies
    new, state = call_(tx, given, tree.clone(state), params, extra_args)
    if tree.is_donated():
        # A donated child may return None for updates it leaves untouched (accumulate holding: the step skips
        # the add); the wrapper sees what the pure update gives there, zeros (the child may keep the buffers
        # it was given, as accumulate's sum does, so they are new ones).
        new = _none_as_zeros(new, given)
    return new, state


def _none_as_zeros(new: Updates, given: Updates) -> Updates:
    flat, spec = tree.flatten(new)
    if not any(x is None for x in flat):
        return new
    given_flat, given_spec = tree.flatten(given)
    if tree.structures_differ(flat, spec, given_flat, given_spec):
        return new
    return tree.unflatten(spec, [torch.zeros_like(g) if x is None and isinstance(g, torch.Tensor) else x
                                 for x, g in zip(flat, given_flat)])


def call_(tx: GradientTransformation, updates: Updates, state: State, params: Params = None,
          extra_args: dict | None = None) -> tuple[Updates, State]:
    """:func:`call` donating ``updates`` and ``state`` to the child: where the op layer runs in place, the
    child writes into them, and the wrapper must not read them afterwards (use what ``call_`` returns).

    The door for wrappers that only pass values on (``chain``: each child's output is the next one's input),
    which then allocate nothing; a wrapper that reads its inputs after the call uses :func:`call`.
    :func:`fxtrain.testing.check_transform` finds a wrapper that reads what it donated (its pure and donated
    updates differ).

    >>> import torch, fxtrain as fx
    >>> g = {"w": torch.ones(2)}
    >>> with torch.no_grad(), fx.tree.donated():
    ...     u, _ = fx.extend.call_(fx.scale(3.0), g, fx.EmptyState())
    >>> u["w"] is g["w"], g["w"].tolist()          # the child wrote into the buffer it was given
    (True, [3.0, 3.0])
    """
    if extra_args and traits(tx).extra_args:
        return kernel(tx)(updates, state, params, **extra_args)
    return kernel(tx)(updates, state, params)


def traits(tx: GradientTransformation) -> Traits:
    """The :class:`Traits` ``tx`` declares (none for a hand-written transform): the one way to ask for a trait.

    A transform is ``elementwise`` only where its factory declares it (``@transform(elementwise=True)``);
    combinators are when all their children are.

    >>> import fxtrain as fx
    >>> fx.traits(fx.adam(0.1))
    Traits(elementwise=True, fused='adam')
    >>> fx.traits(fx.chain(fx.clip_by_global_norm(1.0), fx.adam(0.1))).elementwise
    False
    >>> fx.traits(fx.accumulate(fx.sgd(0.1), every=2)).partial_grads
    True
    """
    return tx.update.traits if isinstance(tx.update, _Update) else _PLAIN


_PLAIN = Traits()


def with_traits(tx: GradientTransformation, **changes: Any) -> GradientTransformation:
    """``tx`` with some :class:`Traits` replaced (e.g. ``wrap_loss=...``); its kernel and repr are kept.

    >>> import fxtrain as fx
    >>> tx = fx.with_traits(fx.scale(2.0), wrap_loss=lambda fn, state: fn)
    >>> tx, tx.wrap_loss is not None
    (scale(2.0), True)
    """
    label = tx.update._label if isinstance(tx.update, _Update) else functools.partial(_maker, tx.update)
    return GradientTransformation(tx.init, _Update(kernel(tx), label, traits(tx)._replace(**changes)))


def forwarded(*inner: GradientTransformation) -> dict[str, Any]:
    """The traits a wrapper passes on from the transforms it runs, for :func:`with_traits`: whether any reads
    extra arguments (``value=``...), and which of their reported hyperparameters are constants.

    >>> import fxtrain as fx
    >>> sorted(fx.extend.forwarded(fx.inject_hyperparams(fx.adam)(learning_rate=0.1))["constant_reports"])
    ['b1', 'b2', 'eps', 'eps_root']
    """
    ts = [traits(tx) for tx in inner]
    return {"extra_args": any(t.extra_args for t in ts),
            "constant_reports": frozenset().union(*(t.constant_reports for t in ts))}


def named(tx: GradientTransformation, name: str | Callable[[], str]) -> GradientTransformation:
    """``tx`` printed as ``name``: in its repr, a chain's, the runner's ``stack`` line and error messages.

    The label is the one ``@transform`` gives library transforms (``scale(2.0)``); kernel, state and
    traits are ``tx``'s. A hand-written transform prints without it as the function that made its
    ``update`` (``scale_by_foo`` for ``scale_by_foo.<locals>.update_fn``). ``name`` may be a function of
    no arguments returning the label: it is called on the first read (a label that formats tensor
    hyperparameters would cost a host sync each time the transform is built). Format argument values
    with :func:`describe`.

    >>> import torch, fxtrain as fx
    >>> def scale_by_two():
    ...     def update_fn(updates, state, params=None):
    ...         return fx.tree.map(lambda g: 2 * g, updates), state
    ...     return fx.GradientTransformation(lambda params: fx.EmptyState(), update_fn)
    >>> fx.chain(fx.clip(1.0), scale_by_two(), fx.named(scale_by_two(), "double(mine)"))
    chain(clip(1.0), scale_by_two, double(mine))
    """
    if not callable(name) and (not isinstance(name, str) or not name):
        raise TypeError(f"named: name must be a non-empty string (or a function returning one), got {name!r}")
    return GradientTransformation(tx.init, _Update(kernel(tx), name, traits(tx)))


def merge_traits(children: Sequence[GradientTransformation], states_of: Callable | None = None, *,
                 fused: bool = False) -> Traits:
    """The traits of a combinator that runs ``children`` (``chain``, ``masked``, a wrapper of yours...).

    Elementwise if all children are; reads extra arguments if any child does; its constant reports are
    all its children's; takes ``Partial`` gradients and decides on the host as its first child does (the first
    child is the one that sees the gradients). ``wrap_loss`` composes the children's (the first one outermost)
    when ``states_of(state)`` gives their states in order; combinators that cannot pass a state per child
    (``states_of=None``) refuse children with one.

    A fused kernel (:class:`FusedSpec`) computes the children's math, not the combinator's, so it carries
    over only with ``fused=True``, which ``chain`` and ``named_chain`` pass: their update is provably their
    children's in sequence (:func:`_fused_in_sequence` is the one place where specs combine). A wrapper
    with an update of its own (:func:`combine`) never inherits one: the fused kernel would replace its update.
    """
    ts = [traits(c) for c in children]
    wraps = [t.wrap_loss for t in ts]
    wrap = None
    if any(w is not None for w in wraps):
        if states_of is None:
            raise ValueError(f"cannot combine {next(c for c, w in zip(children, wraps) if w)!r} here: it acts on "
                             "the forward pass (wrap_loss); apply it outside")
        wrap = _composed_wrap_loss(tuple(children), states_of)
    first = ts[0] if ts else _PLAIN
    return Traits(elementwise=all(t.elementwise for t in ts), partial_grads=first.partial_grads, host=first.host,
                  fused=_fused_in_sequence([t.fused for t in ts], states_of) if fused else None, wrap_loss=wrap,
                  **forwarded(*children))


def _fused_in_sequence(specs: Sequence[FusedSpec | None], states_of: Callable | None) -> FusedSpec | None:
    """The :class:`FusedSpec` of children run in sequence on the same updates, or ``None``.

    Covered: a chain of one child with a kernel (its kernel, on its state), and
    ``[clip_by_global_norm(max_norm), optimizer]`` with both declared, which becomes the optimizer's
    kernel with the clip in its ``grad_scale`` (:mod:`fxtrain.transforms._fused` runs it). ``states_of`` (the
    combinator's state -> its children's states, in order) is needed to find both states; combinators
    without one get ``None``.
    """
    if states_of is None:
        return None
    if len(specs) == 1 and specs[0] is not None and specs[0].name in FUSED_KERNELS:
        # A chain of one (the runner's ``optim.chain=[adam]``): the child's kernel on the child's state.
        return FusedSpec(specs[0].name, specs[0].hyperparams, inner=specs[0],
                         around=lambda g, s, p, bind_inner: bind_inner(g, states_of(s)[0], p))
    if len(specs) != 2:
        return None
    clip, opt = specs
    if (clip is None or opt is None or clip.name not in FUSED_PREFIXES or opt.name not in FUSED_KERNELS
            or opt.max_norm is not None or opt.around is not None):  # a wrapper after the clip: its own update
        return None
    return opt._replace(max_norm=clip.hyperparams["max_norm"], states_of=states_of, groups=clip.groups)


def update_(tx: GradientTransformation, updates: Updates, state: State, params: Params = None, **extra_args: Any):
    """Runs ``tx`` donating ``updates`` and ``state``: their buffers may be overwritten and must not be reused.

    The in-place twin of ``tx.update`` (like ``jax.jit(..., donate_argnums=(0, 1))``). Same numbers. Not
    differentiable and not batchable (it runs under ``no_grad``; under a ``torch.func`` transform it
    raises): use ``tx.update`` for that.

    >>> import torch, fxtrain as fx
    >>> g = {"w": torch.ones(2)}
    >>> u, _ = fx.update_(fx.scale(3.0), g, fx.EmptyState())
    >>> u["w"] is g["w"], g["w"].tolist()   # the gradient buffer now holds the update
    (True, [3.0, 3.0])
    """
    if tree.transformed():
        raise ValueError(f"update_ donates its buffers and cannot run under a torch.func transform; use "
                         f"{tx!r}.update (pure, composable) there")
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                       for x in tree.leaves((updates, state, params))):
        raise ValueError(f"update_ donates its buffers and is not differentiable, but an input requires grad; "
                         f"use {tx!r}.update (pure, composable) to differentiate through the update")
    with torch.no_grad(), tree.donated():
        try:
            return call_(tx, updates, state, params, extra_args)
        except tree.DonatedGradError as e:
            raise ValueError(f"{tx!r}: {e}") from None


def is_elementwise(tx: GradientTransformation) -> bool:
    """Whether ``tx`` acts on each element independently (no reduction across elements or leaves).

    Example:
        >>> import fxtrain as fx
        >>> fx.is_elementwise(fx.adam(0.1)), fx.is_elementwise(fx.clip_by_global_norm(1.0))
        (True, False)
    """
    return traits(tx).elementwise


def describe(obj: Any) -> str:
    """How ``obj`` reads inside a transform's label: a transform by its repr, a function by its name, anything
    else by its repr (what :func:`transform` writes for each argument; use it in labels of your own).

    A float reads as the shortest decimal that gives it back in float32, the precision the hyperparameters
    train at: a value a sweeper drew (``0.0003079180048983016``) reads ``0.000307918``, and ``0.001`` stays ``0.001``.

    >>> import fxtrain as fx
    >>> fx.describe(fx.scale(2.0)), fx.describe(fx.cosine_decay_schedule), fx.describe(0.1)
    ('scale(2.0)', 'cosine_decay_schedule', '0.1')
    >>> fx.describe(0.0003079180048983016), fx.describe(1e-08), fx.describe(3.0)
    ('0.000307918', '1e-08', '3.0')
    """
    if isinstance(obj, GradientTransformation):
        return repr(obj)
    if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
        return obj.__name__
    if type(obj) is float and math.isfinite(obj):
        single = struct.unpack("f", struct.pack("f", obj))[0] if abs(obj) < 3.4e38 else obj
        for digits in range(1, 17):  # the shortest of %.1g ... %.16g that is the same float32
            short = float(f"{obj:.{digits}g}")
            if abs(short) < 3.4e38 and struct.unpack("f", struct.pack("f", short))[0] == single:
                return repr(short)
    return repr(obj)


def _maker(update: Callable) -> str:
    """A hand-written transform's name: what defined its ``update`` (``scale_by_foo`` for
    ``scale_by_foo.<locals>.update_fn``, ``MyOpt`` for a method ``MyOpt.update``), else the function's name."""
    qualname = getattr(update, "__qualname__", None) or type(update).__name__
    outer = qualname.rsplit(".", 1)[0]  # drops the function's own name
    return outer.removesuffix(".<locals>").rsplit(".", 1)[-1] if outer != qualname else qualname


def _label(name: str, sig: inspect.Signature, args: tuple, kwargs: dict) -> str:
    """``name(required, key=value for non-defaults, child transforms last)``."""
    bound = sig.bind(*args, **kwargs)
    params = sig.parameters
    required = [n for n, p in params.items() if p.default is p.empty and p.kind != p.VAR_POSITIONAL]
    head, children = [], []
    for n, v in bound.arguments.items():
        p = params[n]
        if p.kind == p.VAR_POSITIONAL:
            children += [f"{x[0]}={describe(x[1])}" if _is_named_pair(x) else describe(x) for x in v]
        elif p.kind == p.VAR_KEYWORD:
            head += [f"{k}={describe(x)}" for k, x in v.items()]
        elif isinstance(v, GradientTransformation):
            children.append(describe(v))
        elif p.default is not p.empty and _same(v, p.default):
            continue
        elif len(required) == 1 and n == required[0]:
            head.insert(0, describe(v))
        else:
            head.append(f"{n}={describe(v)}")
    return f"{name}({', '.join(head + children)})"


def _is_named_pair(x: Any) -> bool:
    return type(x) is tuple and len(x) == 2 and isinstance(x[0], str)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, (int, float, str, bool, type(None))) and isinstance(b, (int, float, str, bool)):
        return type(a) is type(b) and a == b
    return False


_FACTORIES: dict[str, Callable] = {}


def public_factory(fn: Callable) -> Callable:
    """Registers ``fn`` as a public transform factory (the conformance test runs every one); returns it.

    :func:`transform` registers the factories it decorates; factories written without it call this.
    """
    _FACTORIES[fn.__name__] = fn
    return fn


def factories() -> dict[str, Callable]:
    """Every registered public transform factory by name (see :func:`public_factory`)."""
    return dict(_FACTORIES)


def transform(factory: Callable | None = None, *, elementwise: bool | None = False,
              partial_grads: bool | None = None, host: bool | None = None, extra_args: bool | None = None):
    """Decorator for transform factories: pure ``update`` around the kernel, declared traits, a readable repr.

    Args:
      factory: returns ``GradientTransformation(init_fn, update_fn)`` where ``update_fn`` is written with
        :mod:`fxtrain.tree`'s op layer: it may write into ``updates`` and ``state`` through it (never
        ``params``) and returns its results (see the module docstring).
      elementwise: each output element depends only on the same element of the inputs (updates,
        params) and of the state: no norms, means or shapes across elements, no position in the leaf.
        What ``sharded_apply`` requires, so it runs the transform on each rank's local shard. Opt-in:
        ``False`` unless declared. ``None`` inherits the trait of the transform the factory returns
        (for optimizers, which are chains).
      partial_grads: takes data-parallel ``Partial`` gradients unreduced; ``None`` inherits.
      host: decides on the host between calls; ``None`` inherits.
      extra_args: the kernel reads keyword arguments (``update_fn(updates, state, params=None, *, value,
        **extra_args)``: Optax's ``GradientTransformationExtraArgs``); ``None`` inherits (combinators
        that run their children with :func:`call` read them when a child does).

    Other traits (``wrap_loss``, ``fused``) come from the transform the factory returns
    (:func:`with_traits`).

    Example:
        >>> import torch, fxtrain as fx
        >>> @fx.transform(elementwise=True)     # each element on its own: sharded_apply may run it
        ... def add_one():
        ...     def init_fn(params):
        ...         del params
        ...         return fx.EmptyState()
        ...     def update_fn(updates, state, params=None):
        ...         new = fx.tree.add_(fx.tree.leaves(updates), 1.0)   # in place when donated
        ...         return fx.tree.put(updates, updates, new), state
        ...     return fx.GradientTransformation(init_fn, update_fn)
        >>> add_one()
        add_one()
    """
    def decorate(factory: Callable) -> Callable:
        sig = inspect.signature(factory)

        declared = {k: v for k, v in (("elementwise", elementwise), ("partial_grads", partial_grads),
                                      ("host", host), ("extra_args", extra_args)) if v is not None}

        @functools.wraps(factory)
        def build(*args, **kwargs) -> GradientTransformation:
            tx = factory(*args, **kwargs)
            label = functools.partial(_label, factory.__name__, sig, args, kwargs)
            update = _Update(kernel(tx), label, traits(tx)._replace(**declared))
            return GradientTransformation(_checked_init(tx.init, update), update)

        return public_factory(build)

    return decorate(factory) if factory is not None else decorate


def _checked_init(init: Callable[[Params], State], update: _Update) -> Callable[[Params], State]:
    """``init`` refusing, by name, what is not a tree of tensors but looks like params: a module, a generator."""
    @functools.wraps(init)
    def init_fn(params: Params) -> State:
        if isinstance(params, torch.nn.Module) or isinstance(params, Iterator):
            what = (f"an nn.Module ({type(params).__name__})" if isinstance(params, torch.nn.Module) else
                    f"a {type(params).__name__} (module.parameters()?), which can be read only once")
            raise TypeError(f"{update.label}.init got {what}; transforms take a tree of tensors (dict, list, "
                            "tuple...): `apply, params, buffers = fx.functional(module)` gives the params tree of "
                            "a module and a pure function of it, then `tx.init(params)`")
        return init(params)

    return init_fn


# --- validation: the checks transforms share, one message each ---------------------------------------

def check_nonnegative(transform_name: str, **values: Any) -> None:
    """Checks numeric hyperparameters: Python numbers must be >= 0; tensors must be 0-dim and floating.

    A tensor's value is never read (no host sync, and under ``vmap`` it has none): only its shape and dtype.
    To batch a hyperparameter, build the transform *inside* the vmapped function (where each setting is
    a 0-dim tensor) or use ``inject_hyperparams``, whose state holds it.

    >>> import torch, fxtrain as fx
    >>> fx.sgd(torch.tensor([0.1, 0.2]))
    Traceback (most recent call last):
    ...
    ValueError: sgd: learning_rate must be a number or a 0-dim floating-point tensor, got a tensor of shape (2,) ...
    """
    for name, v in values.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            raise ValueError(f"{transform_name}: {name}={v!r} must be >= 0")
        if isinstance(v, torch.Tensor) and (v.ndim != 0 or not (v.is_floating_point() or v.is_complex())):
            got = f"shape {tuple(v.shape)}" if v.ndim else f"dtype {v.dtype}"
            raise ValueError(f"{transform_name}: {name} must be a number or a 0-dim floating-point tensor, got a "
                             f"tensor of {got} (to batch hyperparameters, build the transform inside "
                             "torch.func.vmap or use inject_hyperparams)")


def check_needs_params(name: str, params: Params) -> None:
    """The check of a transform whose ``update`` reads the params: ``params=None`` is refused, one message.

    ``name`` is what the message calls the transform (its factory's name, or the option that needs the
    params: ``"weight_decay=0.1"``); the transform's label is prefixed when it runs under ``tx.update``.

    >>> import fxtrain as fx
    >>> fx.extend.check_needs_params("scale_by_foo", {"w": 1.0})
    >>> fx.extend.check_needs_params("scale_by_foo", None)
    Traceback (most recent call last):
    ...
    ValueError: scale_by_foo needs the params: call update(updates, state, params)
    """
    if params is None:
        raise ValueError(f"{name} needs the params: call update(updates, state, params)")


def check_learning_rate(name: str, **values: Any) -> None:
    """An optimizer's argument checks, for the library's aliases and users' own: a learning rate is required
    (``None`` would leave the raw direction, an ascent with step size 1), then :func:`check_nonnegative` of
    every value; a schedule is probed at step 0 (a negative value there would climb the loss). A 0-dim
    tensor's sign is checked at ``init`` by the optimizers (reading it here would be a host sync).

    Example:
        >>> import fxtrain as fx
        >>> fx.extend.check_learning_rate("my_sgd", learning_rate=0.1, momentum=0.9)
        >>> fx.extend.check_learning_rate("my_sgd", learning_rate=None)
        Traceback (most recent call last):
        ...
        ValueError: my_sgd: learning_rate=None would apply the raw update direction (an ascent with step size 1); pass a number, a 0-dim tensor or a schedule
    """
    learning_rate = values.get("learning_rate", 0)
    if learning_rate is None:
        raise ValueError(f"{name}: learning_rate=None would apply the raw update direction (an ascent with step "
                         "size 1); pass a number, a 0-dim tensor or a schedule")
    check_nonnegative(name, **values)
    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        try:
            first = learning_rate(torch.zeros((), dtype=torch.int32))
            first = float(first.detach()) if isinstance(first, torch.Tensor) and first.ndim == 0 else first
        except Exception:  # noqa: BLE001 - a schedule that cannot be probed here reports at its first update
            return
        if isinstance(first, (int, float)) and first < 0:
            raise ValueError(f"{name}: learning_rate is a schedule whose value at step 0 is {first:g}; it must be "
                             ">= 0 (a negative learning rate climbs the loss)")


# --- combinators ----------------------------------------------------------------------------------

def wrap_loss(tx: GradientTransformation, loss_fn: LossFn, state: State) -> LossFn:
    """``tx.wrap_loss(loss_fn, state)``, or ``loss_fn`` itself when ``tx`` does not touch the forward pass."""
    return loss_fn if tx.wrap_loss is None else tx.wrap_loss(loss_fn, state)


@transform(elementwise=None, partial_grads=None)
def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in sequence; the state is a tuple of their states (Optax's ``chain``).

    >>> import fxtrain as fx
    >>> fx.chain(fx.clip(1.0), fx.scale(-0.1))
    chain(clip(1.0), scale(-0.1))
    """
    txs = tuple(transforms)

    def init_fn(params):
        return tuple(t.init(params) for t in txs)

    def update_fn(updates, state, params=None, **extra_args):
        if len(state) != len(txs):
            raise ValueError(f"chain of {len(txs)} transforms got a state of {len(state)} entries")
        new_state = []
        for t, s in zip(txs, state):
            updates, s = call_(t, updates, s, params, extra_args)
            new_state.append(s)
        return updates, tuple(new_state)

    return _in_sequence(init_fn, update_fn, txs, lambda s: s)


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

    def update_fn(updates, state, params=None, **extra_args):
        if list(state) != names:
            raise ValueError(f"named_chain expects state entries {names}, got {list(state)}")
        new_state = {}
        for n, t in transforms:
            updates, new_state[n] = call_(t, updates, state[n], params, extra_args)
        return updates, new_state

    return _in_sequence(init_fn, update_fn, txs, lambda s: [s[n] for n in names])


def combine(init_fn: Callable, update_fn: Callable, children: Sequence[GradientTransformation],
            states_of: Callable | None = None) -> GradientTransformation:
    """A wrapper transform that runs ``children``: it carries their merged traits (:func:`merge_traits`).

    How the library's own wrappers (``chain``, ``masked``, ``apply_if_finite``, ``lookahead``...) are
    built, and how you build yours: ``update_fn(updates, state, params=None, **extra_args)`` runs each
    child with :func:`call` (which passes ``value=`` and other extra arguments on to the children that
    read them, and leaves what it passed readable afterwards, donated or not); the result reads extra
    arguments if a child does, is elementwise only if every child is, and keeps the children's constant
    reports. ``states_of(state)`` gives the children's states in order; with it a child's ``wrap_loss``
    (``amp_cast``) carries over, without it such a child is refused. A child's fused kernel never carries
    over: it would compute the child's update instead of ``update_fn``. Decorate the factory with
    :func:`transform` for its repr, and declare its own elementwise-ness there: ``@transform(elementwise=None)``
    keeps the children's. :func:`fxtrain.testing.check_transform` checks the result (pure, donated,
    ``no_grad``, ``vmap``, ``grad``, its elementwise claim). See docs/transforms.md.

    Example: ``every_other(tx)`` applies ``tx`` on odd steps and passes updates through on even ones.

        >>> import torch, fxtrain as fx
        >>> from typing import Any, NamedTuple
        >>> class EveryOtherState(NamedTuple):
        ...     count: torch.Tensor
        ...     inner: Any
        >>> @fx.transform(elementwise=None)    # elementwise when tx is
        ... def every_other(tx: fx.GradientTransformation) -> fx.GradientTransformation:
        ...     def init_fn(params):
        ...         return EveryOtherState(torch.zeros((), dtype=torch.int32), tx.init(params))
        ...     def update_fn(updates, state, params=None, **extra_args):
        ...         new, inner = fx.extend.call(tx, updates, state.inner, params, extra_args)
        ...         odd = state.count % 2 == 0      # the 1st, 3rd... update; no host sync
        ...         new = fx.tree.map(lambda n, u: torch.where(odd, n, u), new, updates)
        ...         return new, EveryOtherState(state.count + 1, inner)
        ...     return fx.extend.combine(init_fn, update_fn, (tx,), lambda s: (s.inner,))
        >>> tx = every_other(fx.scale(-0.1))
        >>> tx, fx.traits(tx)
        (every_other(scale(-0.1)), Traits(elementwise=True))
        >>> g = {"w": torch.ones(2)}
        >>> state = tx.init(g)
        >>> for _ in range(3):
        ...     u, state = tx.update(g, state)
        ...     print(u["w"].tolist())
        [-0.1, -0.1]
        [1.0, 1.0]
        [-0.1, -0.1]

    Donated (a step's :func:`update_`, or ``tx.update`` under ``torch.no_grad``), the same numbers: ``call``
    left ``updates`` as they came for the ``where``:

        >>> u, _ = fx.update_(tx, {"w": torch.ones(2)}, tx.init(g))
        >>> u["w"].tolist()
        [-0.1, -0.1]
        >>> fx.testing.check_transform(tx, g)
    """
    return GradientTransformation(init_fn, _Update(update_fn, "", merge_traits(children, states_of)))


def _in_sequence(init_fn: Callable, update_fn: Callable, children: Sequence[GradientTransformation],
                 states_of: Callable) -> GradientTransformation:
    """:func:`combine` for ``chain`` and ``named_chain``, whose ``update_fn`` runs exactly ``children`` in
    sequence: the one case where a fused kernel of the children is the combinator's (``clip`` then ``adamw``)."""
    return GradientTransformation(init_fn, _Update(update_fn, "", merge_traits(children, states_of, fused=True)))


def _composed_wrap_loss(txs: tuple, states_of: Callable) -> Callable:
    def wrap(loss_fn, state):
        # The first transform's wrapper is outermost: it sees the params the step was called with.
        for t, s in reversed(list(zip(txs, states_of(state)))):
            loss_fn = wrap_loss(t, loss_fn, s)
        return loss_fn

    return wrap


@transform(elementwise=True)
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

    Pure. Where a ``torch.func`` transform is active or autograd is recording, ``(p + u).to(p.dtype)`` leaf
    by leaf (Optax's expression: differentiable, batchable); under ``no_grad``, :func:`apply_updates_` on
    copies of the params (the donated step's kernel; DTensor params keep their placements).

    >>> import torch, fxtrain as fx
    >>> fx.apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})["w"].tolist()
    [0.5, 0.5]
    """
    if params is None:  # an empty tree (Optax: jax.tree.map over None gives None)
        return None
    _check_matches(updates, params)
    if torch.is_grad_enabled() or tree.transformed():
        return tree.map(lambda p, u: p if u is None else _placed_like((p + u).to(p.dtype), p), params, updates)
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
        if any(issubclass(k, DTensor) for k in kinds) and len(kinds) > 1:
            # DTensor refuses foreach lists that mix it with plain tensors: one call per kind. The DTensor
            # call goes through DTensor dispatch, which redistributes an update placed unlike its param.
            for want in (False, True):
                pick = [i for i, p in enumerate(ps) if isinstance(p, DTensor) is want]
                torch._foreach_add_([ps[i] for i in pick], [us[i] for i in pick])
        elif ps:
            torch._foreach_add_(ps, us)
    return params


def _placed_like(x: Any, p: Any) -> Any:
    """``x`` with ``p``'s placements when both are DTensors (an update placed unlike its param, e.g. a
    ``Shard(0)`` update of a ``Replicate`` param, must not change the param's layout)."""
    if isinstance(p, DTensor) and isinstance(x, DTensor) and x.placements != p.placements:
        return x.redistribute(p.device_mesh, p.placements)
    return x


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
