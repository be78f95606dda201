"""Gradient accumulation: ``accumulate`` (Optax's ``MultiSteps``, the functional ``no_sync``), ``split_backward``
and ``microbatch`` (Optax's ``microbatching.microbatch``).

``accumulate(tx, every=k)`` sums the gradients of k calls and runs ``tx`` once on their mean: k micro-
batches of size b give the update of one batch of k*b, with the activation memory of b. ``split_backward``
does the same inside one call, for a caller who holds the whole batch. ``microbatch`` is Optax's function
transform: any function evaluated piece by piece along a batch axis, its outputs summed, averaged or
concatenated.

Map: :func:`accumulate` and its state (:class:`AccumulateState`, :class:`Accumulator`), :func:`split_backward`,
:func:`microbatch` (:class:`AccumulationType`), :func:`skip_not_finite` / :func:`skip_large_updates` (Optax's
``MultiSteps`` predicates), :func:`counters` / :func:`window_position` (where a window stands). Why the emit decision is taken on the host, what a held call returns, how buffers change
hands and how data-parallel ``Partial`` gradients are reduced once per window: docs/stack.md ("How ``accumulate``
works").
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import numbers
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

from fxtrain import distributed, tree
from fxtrain._base import (forwarded, fused_around, GradientTransformation, describe, call_, kernel,
                           transform, with_traits)
from fxtrain.transforms._hyperparams import safe_increment_
from fxtrain.transforms._moments import as_dtype, param_device

__all__ = ["AccumulateState", "accumulate", "counters", "split_backward", "microbatch", "Accumulator", "AccumulationType",
           "skip_not_finite", "skip_large_updates"]

_NS = "fxtrain"
_SCHEDULE_ON_DEVICE = (
    "accumulate: every={} is a schedule (a callable of the emitted count), evaluated on the host, but the "
    "counters mini_step and emitted are batched or traced here (e.g. torch.func.vmap over the state of "
    "vmap(tx.init)), where the emit decision is taken on device: pass an integer every, or keep the counters "
    "unbatched (in_dims=None for mini_step and emitted, and out_dims=None)")


class AccumulateState(NamedTuple):
    """State of :func:`accumulate` (Optax's ``MultiStepsState``, with ``gradient_step`` named ``emitted``).

    Attributes:
      mini_step: calls accumulated in the current window (0-dim int32, on the CPU); 0 after an emission.
      emitted: updates emitted so far (0-dim int32, on the CPU); ``every`` is a schedule of it.
      acc: the running sum of this window's gradients, in the gradient dtype or ``accumulator_dtype``;
        ``Partial`` DTensors stay ``Partial``. Meaningless while ``mini_step`` is 0.
      inner_state: the state of the wrapped transform, changed only by emitting calls.
      skip_state: what ``should_skip_update_fn`` returned last (Optax's ``skip_state``); ``()`` without one.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.accumulate(fx.sgd(0.1), every=2).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.AccumulateState), state._fields
        (True, ('mini_step', 'emitted', 'acc', 'inner_state', 'skip_state'))
    """

    mini_step: torch.Tensor
    emitted: torch.Tensor
    acc: Any
    inner_state: Any
    skip_state: Any = ()

    def report(self) -> dict[str, torch.Tensor]:
        """``emitted`` (the inner state's reports are found by the step's walk)."""
        return {"emitted": self.emitted}


@transform(elementwise=False)
def accumulate(tx: GradientTransformation, every: int | Callable, *, mean: bool = True,
               accumulator_dtype: torch.dtype | str | None = None,
               should_skip_update_fn: Callable | None = None) -> GradientTransformation:
    r"""Accumulates gradients over ``every`` calls and runs ``tx`` once on them (Optax's ``MultiSteps``).

    With :math:`g_1 \dots g_k` the gradients of one window of :math:`k` = ``every(emitted)`` calls::

        calls 1 .. k-1:  updates = 0 (None from the donated kernel: params untouched), acc += g_i
        call k:          updates, inner_state = tx.update(G, inner_state, params)
                         G = (g_1 + ... + g_k) / k   (mean=True)   or   g_1 + ... + g_k   (mean=False)

    ``tx`` runs once per emitted update, never on the other calls, and its state changes only then; its
    ``wrap_loss`` sees that state, so ``amp_cast`` inside keeps one loss scale for a whole window (an
    overflow in any micro-batch makes the sum non-finite: the window is skipped and the scale backs off
    once). A non-emitting call costs one pass over the gradients (none on the window's first call) and
    no communication. How and why: see the module docstring.

    Under ``torch.func.vmap`` with batched counters (an ensemble whose state comes from
    ``vmap(tx.init)``: each member at its own window position) the decision is taken on device instead,
    as Optax does under ``jax.vmap``: ``tx`` then runs on every call, and ``torch.where`` keeps its results
    only where a member emits. Same numbers; an integer ``every`` only.

    **Optax's** ``MultiSteps(opt, every_k_schedule, use_grad_mean, should_skip_update_fn,
    accumulator_dtype)`` **is** ``accumulate(opt, every, mean=..., should_skip_update_fn=...,
    accumulator_dtype=...)``: the same updates (zeros between emissions) and the same state fields under
    fxtrain's names (``gradient_step`` is ``emitted``, ``acc_grads`` is ``acc``: a running sum where Optax
    keeps a running mean, ``inner_opt_state`` is ``inner_state``). ``MultiSteps.has_updated(state)`` is
    ``state.mini_step == 0 and state.emitted > 0``. Optax's default ``accumulator_dtype`` is float32;
    here ``None`` keeps the gradient dtype.

    With ``should_skip_update_fn`` (Optax's: :func:`skip_not_finite`, :func:`skip_large_updates`, or your
    own ``f(updates, gradient_step, params) -> (skip, skip_state)``), a call whose gradients it rejects is
    as if it never happened: zero updates, counters, accumulator and inner state unchanged, only
    ``skip_state`` written. ``skip`` is a 0-dim bool tensor decided on device, so that decision is taken
    as under ``vmap`` above (the counters live on the params' device, ``tx`` runs on every call and
    ``torch.where`` selects): no host sync, an integer ``every`` only.

    Args:
      tx: the transform to run on the accumulated gradients, e.g. ``chain(clip_by_global_norm(1.0),
        adamw(1e-3))``: clipping acts on the accumulated gradient, as on one big batch.
      every: calls per update, an int >= 1, or a schedule: a callable of the number of updates emitted so
        far (a Python int) returning the window length (varying the effective batch size, as Optax).
      mean: divide the sum by the number of calls accumulated (the mean of the gradients of equal-size
        micro-batches is the gradient of their union). ``False`` passes the sum.
      accumulator_dtype: dtype of the accumulator (a ``torch.dtype`` or its name); ``None``: the gradient
        dtype. The updates handed to ``tx`` have the gradient dtype.
      should_skip_update_fn: ``f(updates, gradient_step, params) -> (skip, skip_state)``: a 0-dim bool
        tensor, true to ignore this call's gradients, and a tree kept in the state as ``skip_state``.

    Returns:
      A transform with an :class:`AccumulateState`; ``emitted`` shows in :func:`fxtrain.train_step`'s
      metrics. Extra arguments (``value=``...) reach ``tx`` when ``tx`` reads them.

    Raises:
      ValueError: ``every`` is not an int >= 1 or a callable (or the schedule returns a value < 1); or, at
        an update, ``every`` is a schedule and the counters are batched or traced (or a
        ``should_skip_update_fn`` is given); or ``should_skip_update_fn`` does not return a 0-dim bool.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.accumulate(fx.sgd(1.0), every=2)
        >>> tx
        accumulate(every=2, sgd(1.0))
        >>> params = {"w": torch.zeros(2)}
        >>> state = tx.init(params)
        >>> u, state = tx.update({"w": torch.tensor([1.0, 2.0])}, state, params)
        >>> u["w"].tolist(), int(state.mini_step)   # held: a zero update this call
        ([0.0, 0.0], 1)
        >>> u, state = tx.update({"w": torch.tensor([3.0, 4.0])}, state, params)
        >>> u["w"].tolist(), int(state.emitted)    # -learning_rate * mean of the two gradients
        ([-2.0, -3.0], 1)

    References:
      Optax, `MultiSteps <https://optax.readthedocs.io/en/latest/api/optimizer_wrappers.html>`_;
      PyTorch DDP's `no_sync <https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html>`_.
    """
    window = _window_length(every)
    dtype = as_dtype(accumulator_dtype, "accumulate: accumulator_dtype")
    if should_skip_update_fn is not None:
        if not callable(should_skip_update_fn):
            raise ValueError(f"accumulate: should_skip_update_fn must be a callable (updates, gradient_step, "
                             f"params) -> (skip, skip_state), got {should_skip_update_fn!r}")
        if not isinstance(every, numbers.Integral):
            raise ValueError(f"accumulate: every={describe(every)} is a schedule, evaluated on the host, but with a "
                             "should_skip_update_fn the window is decided on device: pass an integer every")

    def inner_kernel(extra_args):
        return lambda u, s, p: call_(tx, u, s, p, extra_args)

    def init_fn(params):
        held = every != 1  # every=1 never holds a gradient: no accumulator memory
        # With a skip test the counters follow its device-side answer: they live with the params.
        where = "cpu" if should_skip_update_fn is None else param_device(params)
        emitted = torch.zeros((), dtype=torch.int32, device=where)
        skip_state = ()
        if should_skip_update_fn is not None:  # its state's structure, as Optax: asked about zero updates
            _, skip_state = _skip_test(should_skip_update_fn, tree.zeros_like(params), emitted, params)
        return AccumulateState(
            mini_step=torch.zeros((), dtype=torch.int32, device=where),
            emitted=emitted,
            acc=tree.zeros_like(params, dtype=dtype) if held else _none_like(params),
            inner_state=tx.init(params),
            skip_state=skip_state,
        )

    def update_fn(updates, state, params=None, **extra_args):
        if should_skip_update_fn is not None:  # decided on device, like batched counters below
            skip, skip_state = _skip_test(should_skip_update_fn, updates, state.emitted, params)
            with tree.functional():
                return _update_on_device(inner_kernel(extra_args), int(every), mean, updates, state, params,
                                         skip=skip, skip_state=skip_state)
        # Host reads of CPU counters (no device sync): the decision that lets held calls skip the inner tx.
        try:
            m, n = counters(state)
        except (RuntimeError, ValueError):  # batched (vmap over tx.init's state) or traced: decided on device
            if state.mini_step.ndim or state.emitted.ndim:  # a stacked state outside vmap, say
                raise ValueError(f"accumulate: the counters mini_step and emitted must be 0-dim (per model), got "
                                 f"shapes {tuple(state.mini_step.shape)} and {tuple(state.emitted.shape)}") from None
            if not isinstance(every, numbers.Integral):
                raise ValueError(_SCHEDULE_ON_DEVICE.format(describe(every))) from None
            with tree.functional():
                return _update_on_device(inner_kernel(extra_args), int(every), mean, updates, state, params)
        k = window(n)
        if m + 1 < k:  # hold
            if m == 0:
                acc = _refill(state.acc, updates, dtype)  # the gradient buffers become the accumulator
            else:
                xs, ys = tree.align(updates, state.acc)
                acc = tree.put(state.acc, updates,
                               tree.add_(distributed.local_leaves(ys), distributed.local_leaves(xs)))
            state = AccumulateState(tree.inc_(state.mini_step), state.emitted, acc, state.inner_state, state.skip_state)
            # Zeros when pure (Optax; what vmap and grad see); None when donated: the step skips the add.
            return (_none_like(updates) if tree.is_donated() else tree.map(torch.zeros_like, updates)), state

        acc = state.acc
        if m > 0:  # a window of m + 1 calls; with m == 0 (every=1) the gradients pass straight through
            updates, acc = _window_sum(acc, updates, m + 1 if mean else 1, same_dtype=dtype is None)
        # Data parallel: Partial sums become Replicate here, once per emitted update (one packed all-reduce).
        updates = distributed.reduce_partials(updates)
        updates, inner_state = call_(tx, updates, state.inner_state, params, extra_args)
        mini_step = torch.zeros_like(state.mini_step) if tree.is_functional() else state.mini_step.zero_()
        return updates, AccumulateState(mini_step, safe_increment_(state.emitted), acc, inner_state, state.skip_state)

    def wrap_loss(loss_fn, state):  # the inner transform's forward-pass wrapper sees its own state
        return tx.wrap_loss(loss_fn, state.inner_state)

    def fused(grads, state, params, bind_inner):
        """The inner stack's fused kernel (:mod:`fxtrain.transforms._fused`) on the emitting call, on the window's
        sum (reduced once, as on the foreach path); held calls take the foreach path (no kernel to run)."""
        try:
            m, n = counters(state)
        except (RuntimeError, ValueError, AttributeError):
            return None
        if m + 1 < window(n):
            return None
        # The tree the window's sum will be in (below): the kernel must take it. Placements change (Partial
        # to Replicate), which it takes either way.
        summed = grads
        if m > 0 and dtype is None:
            summed = state.acc if not _has_none(grads) else tree.map(lambda g, a: a, grads, state.acc)
        if bind_inner(summed, state.inner_state, params) is None:
            return None

        def run():
            if counters(state) != (m, n):  # a plan bound once and called again
                raise RuntimeError(f"{describe(tx)}: accumulate's fused update was bound at mini_step={m} and "
                                   "called at another: bind it again each call")
            updates = grads
            if m > 0:
                # The sum in the accumulator (or rounded into the gradients), which stays the accumulator: its
                # values are not read again before the next window's first call replaces it.
                updates, _ = _window_sum(state.acc, grads, m + 1 if mean else 1, same_dtype=dtype is None)
            updates = distributed.reduce_partials(updates)
            bind_inner(updates, state.inner_state, params)()  # checked above on the same tree
            state.mini_step.zero_()
            safe_increment_(state.emitted)

        return run

    _WINDOWS[update_fn] = window  # for window_position: a gradient engine that must know before the backward
    # partial_grads: train_step leaves Partial gradients unreduced for this kernel (see fxtrain/step.py), unless
    # a skip test must see the reduced gradients.
    return with_traits(GradientTransformation(init_fn, update_fn), partial_grads=should_skip_update_fn is None,
                       host=True,
                       wrap_loss=None if tx.wrap_loss is None else wrap_loss,
                       fused=None if should_skip_update_fn is not None else fused_around(tx, fused), **forwarded(tx))


_WINDOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # accumulate's kernel -> its window length


def counters(state: AccumulateState) -> tuple[int, int]:
    """``(mini_step, emitted)`` of an :func:`accumulate` state as Python ints: reads of CPU tensors, never a device
    sync (they live on the CPU whatever the params' device). Raises ``RuntimeError``/``ValueError`` where they have
    no host value (batched by ``vmap`` or traced).

    >>> import torch, fxtrain as fx
    >>> counters(fx.accumulate(fx.sgd(1.0), every=2).init({"w": torch.zeros(1)}))
    (0, 0)
    """
    return int(state.mini_step), int(state.emitted)


def window_position(tx: GradientTransformation, state: Any) -> tuple[int, int] | None:
    """``(calls held so far, window length)`` of ``tx`` if it is an :func:`accumulate`, read from its host counters.

    The next call of ``tx`` emits when ``held + 1 >= length``. For gradient engines that must decide
    before the backward pass whether gradients are reduced this call (FSDP2's ``set_requires_gradient_sync``).
    ``None`` when ``tx`` is not an ``accumulate`` or its counters are batched or traced (no host value).

    >>> import torch, fxtrain as fx
    >>> tx = fx.accumulate(fx.sgd(1.0), every=3)
    >>> window_position(tx, tx.init({"w": torch.zeros(1)})), window_position(fx.sgd(1.0), None)
    ((0, 3), None)
    """
    window = _WINDOWS.get(kernel(tx))
    if window is None or not isinstance(state, AccumulateState):
        return None
    try:
        m, n = counters(state)
    except (RuntimeError, ValueError):
        return None
    return m, window(n)


def _skip_test(fn: Callable, updates: Any, gradient_step: torch.Tensor, params: Any) -> tuple[torch.Tensor, Any]:
    """``fn(updates, gradient_step, params)``, checked: a 0-dim bool tensor and the skip state."""
    skip, skip_state = fn(updates, gradient_step, params)
    skip = torch.as_tensor(skip)
    if skip.dtype != torch.bool or skip.ndim:
        raise ValueError(f"accumulate: should_skip_update_fn must return a 0-dim bool tensor first, got dtype "
                         f"{skip.dtype} and shape {tuple(skip.shape)}")
    return skip, skip_state


def skip_not_finite(updates: Any, gradient_step: torch.Tensor, params: Any) -> tuple[torch.Tensor, dict]:
    """Whether ``updates`` hold an Inf or a NaN: a ``should_skip_update_fn`` for :func:`accumulate` (Optax's).

    Args:
      updates: the gradients of this call.
      gradient_step: the updates emitted so far (unused).
      params: the params (unused).

    Returns:
      ``(should_skip, {"should_skip": should_skip, "num_not_finite": n})``: a 0-dim bool tensor and the
      number of non-finite elements (0-dim int32), computed on device.

    Example:
        >>> import torch
        >>> from fxtrain.transforms._accumulation import skip_not_finite
        >>> skip, info = skip_not_finite([torch.tensor(float("inf")), torch.zeros(())], torch.tensor(0), None)
        >>> bool(skip), int(info["num_not_finite"])
        (True, 1)
    """
    del gradient_step, params
    xs = tree.leaves(updates)
    counts = [(~torch.isfinite(x)).sum(dtype=torch.int32) for x in xs]  # one reduction per leaf: no foreach op
    num = torch.stack(counts).sum(dtype=torch.int32) if counts else torch.zeros((), dtype=torch.int32)
    should_skip = num > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": num}


def skip_large_updates(updates: Any, gradient_step: torch.Tensor, params: Any, max_squared_norm: Any
                       ) -> tuple[torch.Tensor, dict]:
    """Whether the squared global norm of ``updates`` reaches ``max_squared_norm`` (or is NaN): a
    ``should_skip_update_fn`` for :func:`accumulate` once ``max_squared_norm`` is bound (Optax's).

    Args:
      updates: the gradients of this call.
      gradient_step: the updates emitted so far (unused).
      params: the params (unused).
      max_squared_norm: the largest squared norm accepted (a number or a 0-dim tensor).

    Returns:
      ``(should_skip, {"should_skip": should_skip, "norm_squared": s})``, 0-dim tensors, on device.

    Example:
        >>> import functools, torch, fxtrain as fx
        >>> from fxtrain.transforms._accumulation import skip_large_updates
        >>> skip, info = skip_large_updates([torch.tensor(11.0), torch.zeros(())], torch.tensor(0), None, 100.0)
        >>> bool(skip), float(info["norm_squared"])
        (True, 121.0)
        >>> tx = fx.accumulate(fx.sgd(1.0), every=2,
        ...                    should_skip_update_fn=functools.partial(skip_large_updates, max_squared_norm=42.0))
    """
    del gradient_step, params
    xs = tree.leaves(updates)
    norm_sq = tree.sum_sq(xs, xs[0].dtype if xs and xs[0].is_floating_point() else torch.float32)
    should_skip = ~(norm_sq < max_squared_norm)  # NaN is not < anything: skipped
    return should_skip, {"should_skip": should_skip, "norm_squared": norm_sq}


def _window_length(every: Any) -> Callable[[int], int]:
    """``every`` as a function of the emitted count, checked; errors name ``every`` and the value."""
    if isinstance(every, numbers.Integral) and not isinstance(every, bool):
        if every < 1:
            raise ValueError(f"accumulate: every={every!r} must be >= 1")
        k = int(every)
        return lambda emitted: k
    if not callable(every) or isinstance(every, type):
        raise ValueError(f"accumulate: every must be an int >= 1 or a schedule (a callable of the number "
                         f"of emitted updates), got {every!r}")

    def window(emitted: int) -> int:
        value = every(emitted)
        try:
            k = round(float(value))  # schedules return float tensors: 2.0 (or 1.9999999) means 2
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"accumulate: every({emitted}) returned {value!r}, not a number") from None
        if k < 1:
            raise ValueError(f"accumulate: every({emitted}) = {value!r}; the window length must be >= 1")
        return k

    window(0)  # fail at construction, not at the first update
    return window


def _update_on_device(inner_kernel: Callable, k: int, mean: bool, updates: Any, state: AccumulateState,
                      params: Any, skip: torch.Tensor | None = None, skip_state: Any = ()
                      ) -> tuple[Any, AccumulateState]:
    """One call whose counters cannot be read on the host (batched or traced), as Optax's ``MultiSteps``
    under ``jax.vmap``: both branches out of place, selected leaf by leaf on ``mini_step + 1 >= k``.

    Runs inside :func:`fxtrain.tree.functional`. The window sum is ``acc + g`` (``g`` alone when
    ``mini_step`` is 0, whatever ``acc`` holds then, as on the host path), rounded and divided as there.
    ``skip`` (a 0-dim bool, from ``should_skip_update_fn``): where true, zero updates and the state as it
    was, but for ``skip_state``.
    """
    m, n = state.mini_step, state.emitted
    if skip is None:
        skip_state = state.skip_state
    else:
        skip = skip.to(m.device)
    if k == 1 and skip is None:  # every call emits: nothing to select, no accumulator
        updates, inner_state = inner_kernel(distributed.reduce_partials(updates), state.inner_state, params)
        return updates, AccumulateState(torch.zeros_like(m), safe_increment_(n), state.acc, inner_state, skip_state)
    go = m + 1 >= k
    keep = m + 1 if skip is None else torch.where(skip, m, m + 1)  # mini_step after a held call
    if skip is not None:
        go = go & ~skip
    emit, held = _placed(go), _placed(m > 0)  # bools with the counters (batched like them), per leaf device
    if k == 1:  # no accumulator: the gradients themselves
        new_updates, inner_state = inner_kernel(distributed.reduce_partials(updates), state.inner_state, params)
        new_updates = tree.map(lambda u: torch.where(emit(u), u, u.new_zeros(())), new_updates)
        return new_updates, AccumulateState(
            mini_step=torch.zeros_like(m), emitted=torch.where(go, safe_increment_(n), n), acc=state.acc,
            inner_state=_select(emit, inner_state, state.inner_state), skip_state=skip_state)
    xs, ys = tree.align(updates, state.acc)
    g_local, acc_local = distributed.local_leaves(xs), distributed.local_leaves(ys)
    total = [torch.where(held(g), a + g, g).to(a.dtype) for g, a in zip(g_local, acc_local)]
    window = total
    if mean:  # times 1 / (mini_step + 1), in float32 or wider, as the host path's scale by a Python float
        inv = _placed(1.0 / (m + 1).double())
        window = [(t.to(_opmath(t)) * inv(t).to(_opmath(t))).to(t.dtype) for t in total]
    grads = tree.put(updates, updates, [w.to(g.dtype) for w, g in zip(window, g_local)])
    new_updates, inner_state = inner_kernel(distributed.reduce_partials(grads), state.inner_state, params)
    new_updates = tree.map(lambda u: torch.where(emit(u), u, u.new_zeros(())), new_updates)  # held: zeros
    acc_new = [torch.where(emit(t), t.new_zeros(()), t) for t in total]
    if skip is not None:  # a skipped call leaves the accumulator as it was
        acc_new = [torch.where(_placed(skip)(a), a, t) for a, t in zip(acc_local, acc_new)]
    acc = tree.put(state.acc, updates, acc_new)
    return new_updates, AccumulateState(
        mini_step=torch.where(emit(m), torch.zeros_like(m), keep),
        emitted=torch.where(emit(n), safe_increment_(n), n),
        acc=acc,
        inner_state=_select(emit, inner_state, state.inner_state),
        skip_state=skip_state,
    )


def _placed(pred: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> pred`` on ``x``'s device (copied once per device): the counters live on the CPU, and under
    ``vmap`` a batched CPU tensor is no 0-dim scalar that torch would let meet a CUDA tensor."""
    on: dict = {}

    def at(x: torch.Tensor) -> torch.Tensor:
        if x.device not in on:  # non_blocking: a copy from pageable memory is staged at once, no stream sync
            on[x.device] = pred.to(x.device, non_blocking=True)
        return on[x.device]

    return at


def _opmath(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _select(emit: Callable, new: Any, old: Any) -> Any:
    """Leafwise ``torch.where(emit, new, old)`` in ``old``'s dtypes (Optax's inner-state select)."""
    def pick(a: Any, b: Any) -> Any:
        if a is b:
            return a
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return torch.where(emit(a), a, b).to(b.dtype)
        if type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b:
            return a
        raise ValueError(f"accumulate: the inner state holds {a!r} where it held {b!r}, not tensors: with "
                         "batched or traced counters the inner state is selected on device, leaf by leaf")

    return optree.tree_map(pick, new, old, none_is_leaf=True, namespace=_NS)


def _refill(acc: Any, grads: Any, dtype: torch.dtype | None) -> Any:
    """``acc`` with each leaf replaced by the gradient at its position (cast to ``dtype`` if given)."""
    if dtype is None and not _has_none(grads):  # the usual case: the gradient tree itself, no per-leaf work
        return grads
    return optree.tree_map(lambda a, g: a if g is None else (g if dtype is None else g.to(dtype)),
                           acc, grads, none_is_leaf=True, namespace=_NS)


def _has_none(t: Any) -> bool:
    """Whether ``t`` has ``None`` leaves (counted by optree, without a Python loop over leaves)."""
    return tree.structure(t).num_leaves != optree.tree_structure(t, none_is_leaf=False, namespace=_NS).num_leaves


def _window_sum(acc: Any, grads: Any, divisor: int, same_dtype: bool) -> tuple[Any, Any]:
    """``(acc + grads) / divisor`` as updates in the gradient dtype, and the tree to keep as accumulator."""
    xs, ys = tree.align(grads, acc)
    g_local, acc_local = distributed.local_leaves(xs), distributed.local_leaves(ys)
    total = tree.add_(acc_local, g_local)  # in the accumulator dtype; Partial + Partial stays Partial
    if divisor != 1:
        total = tree.scale_(total, 1.0 / divisor)
    if tree.is_functional():  # new tensors: the sum, rounded once into the gradient dtype; acc is spent
        return tree.put(grads, grads, tree.copy_(g_local, total)), acc
    if same_dtype:  # the sum is the update; the spent gradient buffers are the next accumulator
        if not _has_none(grads):
            return acc, grads
        return tree.map(lambda g, a: a, grads, acc), _refill(acc, grads, None)
    tree.copy_(g_local, acc_local)  # rounded once into the gradient dtype
    return grads, acc


def _none_like(t: Any) -> Any:
    spec = tree.structure(t)
    return tree.unflatten(spec, [None] * spec.num_leaves)


# --- split_backward -------------------------------------------------------------------------------------

def split_backward(loss_fn: Callable, n: int) -> Callable:
    r"""Splits each batch into ``n`` micro-batches inside one call: the gradient of the whole batch, the
    activation memory of one micro-batch.

    Not Optax's ``microbatch`` (that one is :func:`microbatch`: a function transform that evaluates any
    function piece by piece and accumulates its outputs, which under ``torch.func.grad`` keeps every piece's
    graph); this one runs each piece's backward inside the call, for :func:`fxtrain.train_step`.

    The returned ``loss_fn(params, batch)`` splits every tensor leaf of ``batch`` into ``n`` pieces along
    dim 0 (``torch.tensor_split``; other leaves go to every piece), runs forward *and backward* on each
    piece in turn, and returns :math:`\sum_i w_i \ell_i` with :math:`w_i = b_i / B` (micro-batch size over
    batch size), attached to ``params`` so that its gradient is :math:`\sum_i w_i \nabla \ell_i`: for a
    loss that is a mean over examples, the loss and gradient of the whole batch. Only one micro-batch's
    activations are alive at a time; the gradient sum costs one param-sized buffer.

    With ``(loss, aux)`` outputs, floating-point tensors in ``aux`` are combined like the loss (weighted
    mean), integer tensors are summed (counts), other leaves come from the last micro-batch.

    Use it as the ``loss_fn`` of :func:`fxtrain.train_step`. With ``amp_cast`` and float16, prefer
    ``accumulate`` over ``n`` step calls: each micro-batch's backward here runs before the loss scale is
    applied (the scale multiplies the summed gradient afterwards), so tiny float16 gradients of a
    micro-batch can underflow; bfloat16 and float32 are unaffected. Called without gradients (evaluation),
    it just computes the weighted mean of the micro-batch losses. Under a ``torch.func`` transform
    (``grad``, ``vmap``) it returns that weighted mean with its graph: the same gradient, differentiated
    by the transform, without the memory saving. Higher-order gradients (``create_graph=True``) through
    the split backward raise: differentiate ``loss_fn`` itself there.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``, a mean over the batch's examples.
      n: the number of micro-batches, an int >= 1 (at most the batch size).

    Returns:
      A loss function of the same form.

    Example:
        >>> import torch, fxtrain as fx
        >>> def loss_fn(params, batch):
        ...     x, y = batch
        ...     return ((x @ params["w"] - y) ** 2).mean()
        >>> x, y = torch.randn(8, 3), torch.randn(8)
        >>> w = torch.randn(3, requires_grad=True)
        >>> (g_full,) = torch.autograd.grad(loss_fn({"w": w}, (x, y)), [w])
        >>> (g_four,) = torch.autograd.grad(fx.split_backward(loss_fn, 4)({"w": w}, (x, y)), [w])
        >>> torch.allclose(g_full, g_four, atol=1e-6)
        True
    """
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
        raise ValueError(f"split_backward: n={n!r} must be an int >= 1")
    n = int(n)

    def fn(params, batch):
        chunks, weights = _split(batch, n)
        # Under a torch.func transform no backward may run inside the loss: the weighted sum, for the caller
        # to differentiate (the same gradient, every micro-batch's activations alive).
        composable = tree.transformed()
        xs = [] if composable else [x for x in tree.leaves(params) if isinstance(x, torch.Tensor) and x.requires_grad]
        differentiate = bool(xs) and torch.is_grad_enabled()
        total, grads, auxes, has_aux = None, None, [], False
        for chunk, w in zip(chunks, weights):
            out = loss_fn(params, chunk)
            has_aux = isinstance(out, tuple)
            loss, aux = out if has_aux and len(out) == 2 else (out, None)
            if not isinstance(loss, torch.Tensor):
                return out  # train_step names the bad output
            if differentiate:
                if not loss.requires_grad:
                    raise ValueError("split_backward: the loss does not depend on params (no gradient flows)")
                gs = torch.autograd.grad(loss, xs, materialize_grads=True)
                if grads is None:
                    grads = list(torch._foreach_mul(gs, w))  # fresh buffers: autograd's may be shared
                else:
                    torch._foreach_add_(distributed.local_leaves(grads), distributed.local_leaves(list(gs)),
                                        alpha=w)
            loss = (loss if composable else loss.detach()) * w
            total = loss if total is None else total + loss
            auxes.append(aux)
        if differentiate:
            total = _WithGradients.apply(total, grads, *xs)
        return (total, _combine(auxes, weights)) if has_aux else total

    fn.__qualname__ = f"split_backward({getattr(loss_fn, '__qualname__', repr(loss_fn))}, {n})"
    return fn


class _WithGradients(torch.autograd.Function):
    """``loss`` (a value) attached to ``xs`` with precomputed gradients: backward returns ``gout * grads``."""

    @staticmethod
    def forward(ctx, loss, grads, *xs):
        del xs
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx, gout):
        if torch.is_grad_enabled():  # create_graph=True: the precomputed gradients have no graph of their own
            raise RuntimeError("split_backward: higher-order gradients (create_graph=True) are not supported: its "
                               "gradients are computed micro-batch by micro-batch without a graph; differentiate "
                               "the loss function itself, or call it under torch.func.grad")
        grads, ctx.grads = ctx.grads, None
        # gout is 1 under train_step, the loss scale under amp_cast: scale the buffers we own, in place.
        torch._foreach_mul_(distributed.local_leaves(grads), distributed.local_leaves([gout])[0])
        return (None, None, *grads)


def _split(batch: Any, n: int) -> tuple[list, list[float]]:
    """``n`` micro-batches of ``batch`` along dim 0, and their sizes as fractions of the batch."""
    flat, spec = tree.flatten(batch)
    sizes = {p: x.shape[0] for p, x in zip(tree.paths(batch), flat) if isinstance(x, torch.Tensor) and x.ndim}
    if not sizes:
        raise ValueError("split_backward: the batch holds no tensor with a batch dimension to split")
    size = next(iter(sizes.values()))
    if any(s != size for s in sizes.values()):
        raise ValueError(f"split_backward: batch leaves differ in size along dim 0: {sizes}")
    if size < n:
        raise ValueError(f"split_backward: a batch of {size} cannot be split into n={n} micro-batches")
    pieces = [torch.tensor_split(x, n) if isinstance(x, torch.Tensor) and x.ndim else [x] * n for x in flat]
    chunks = [tree.unflatten(spec, [p[i] for p in pieces]) for i in range(n)]
    first = next(i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.ndim)
    return chunks, [pieces[first][i].shape[0] / size for i in range(n)]


def _combine(auxes: list, weights: list[float]) -> Any:
    """The micro-batches' aux outputs as one: floats averaged by weight, integers summed, others the last."""
    def combine(*xs):
        last = xs[-1]
        if not isinstance(last, torch.Tensor):
            return last
        if last.is_floating_point() or last.is_complex():
            return sum(w * x.detach() for w, x in zip(weights, xs))
        if last.dtype != torch.bool:
            return sum(x.detach() for x in xs)
        return last.detach()

    return optree.tree_map(combine, *auxes, none_is_leaf=False, namespace=_NS)


# --- microbatch (Optax's optax.microbatching.microbatch) ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Accumulator:
    """How :func:`microbatch` combines one output leaf over the micro-batches (Optax's ``Accumulator``)::

        carry = init(x_0)
        for i in range(n):
            carry = update(carry, x_i, i)
        return finalize(carry)

    ``init`` gets the first micro-batch's output (a tensor; Optax passes its shape and dtype: use only
    those), ``aggregate`` reduces a stacked output along dim 0 (kept for Optax's protocol).

    Example:
        >>> import torch, fxtrain as fx
        >>> largest = fx.Accumulator(init=lambda x: x, update=lambda c, x, i: torch.maximum(c, x),
        ...                          finalize=lambda c: c, aggregate=lambda xs: xs.max(0).values)
        >>> fx.microbatch(lambda x: x.max(), argnums=0, microbatch_size=2,
        ...               accumulator=largest)(torch.tensor([1, 5, 3, 4]))
        tensor(5)
    """

    init: Callable
    update: Callable
    finalize: Callable
    aggregate: Callable


class AccumulationType(enum.Enum):
    """The built-in accumulators of :func:`microbatch` (Optax's ``AccumulationType``).

    Example:
        >>> import torch, fxtrain as fx
        >>> fun = lambda x: (x + 1, (3 * x).sum())
        >>> fx.microbatch(fun, argnums=0, microbatch_size=2,
        ...               accumulator=(fx.AccumulationType.CONCAT, fx.AccumulationType.SUM))(torch.tensor([1, 2, 3, 4]))
        (tensor([2, 3, 4, 5]), tensor(30))
    """

    MEAN = enum.auto()  #: the mean of the micro-batches' outputs (floating outputs)
    SUM = enum.auto()  #: their sum
    RUNNING_MEAN = enum.auto()  #: their mean over the micro-batches run (``num_real_microbatches``)
    CONCAT = enum.auto()  #: concatenated along dim 0, in the batch's order


def microbatch(fun: Callable, argnums: int | Sequence[int], microbatch_size: int | None,
               accumulator: Any = AccumulationType.SUM, *, argnames: str | Sequence[str] = (),
               in_axes: int | Sequence[int] = 0, num_real_microbatches: int | torch.Tensor | None = None) -> Callable:
    r"""Evaluates ``fun`` on micro-batches of its batch arguments and accumulates the results (Optax's
    ``optax.microbatching.microbatch``: same arguments, same numbers).

    The arguments ``argnums`` (positions) and ``argnames`` (keywords) are pytrees whose leaves share a batch
    axis (``in_axes``, one per argument or one for all) of size :math:`B`, a multiple of ``microbatch_size``
    :math:`m`. Micro-batch :math:`i` of the :math:`n = B/m` takes the rows :math:`i, i+n, i+2n, \dots`
    (Optax's column-major reshape, which keeps a sharded batch axis sharded); ``fun`` runs on each in turn
    and each output leaf is combined by ``accumulator``: an :class:`AccumulationType`, an
    :class:`Accumulator`, or a pytree prefix of ``fun``'s output holding them (``(CONCAT, SUM)`` for a
    ``(values, total)`` output). ``CONCAT`` gives the rows back in the batch's order. With
    ``num_real_microbatches`` only the first that many run (``MEAN`` still divides by :math:`n`).

    ``argnums`` and ``argnames`` name ``fun``'s parameters, whatever way a call passes them (as Optax: the
    call is bound to ``inspect.signature(fun)``, so ``argnames="c"`` finds ``c`` given positionally and
    ``argnums=0`` finds ``a`` given as ``a=``); a batch argument the call leaves at its default is not split.
    A batch of size 0 runs no micro-batch, as Optax: ``SUM`` gives zeros shaped like one micro-batch's
    output (found by running ``fun`` once on zeros), ``MEAN`` NaN (0/0), ``CONCAT`` an empty batch.

    Only one micro-batch's intermediates are alive at a time when ``fun`` returns values without a graph
    (``torch.func.grad(loss)`` as ``fun``: summed gradients, the memory of one micro-batch). The loop is
    Python (Optax's is ``lax.fori_loop``); everything is out of place, so ``torch.func`` transforms
    compose with it. To split the batch of a :func:`fxtrain.train_step` loss instead, use
    :func:`split_backward`.

    Args:
      fun: any function.
      argnums: the positions of the arguments with a batch axis.
      microbatch_size: rows per micro-batch; ``None`` returns ``fun`` itself (as Optax).
      accumulator: how outputs combine (above); ``SUM`` by default, as Optax.
      argnames: the keyword arguments with a batch axis.
      in_axes: the batch axis of each argument of ``argnums + argnames``, or one int for all.
      num_real_microbatches: run only the first this many micro-batches.

    Returns:
      A function with ``fun``'s arguments.

    Example:
        >>> import torch, fxtrain as fx
        >>> fun = lambda x: (x + 1, (3 * x).sum())
        >>> chunked = fx.microbatch(fun, argnums=0, microbatch_size=2,
        ...                         accumulator=(fx.AccumulationType.CONCAT, fx.AccumulationType.SUM))
        >>> chunked(torch.tensor([1, 2, 3, 4]))
        (tensor([2, 3, 4, 5]), tensor(30))

        The gradient of a mean loss, micro-batch by micro-batch:

        >>> def loss(w, x, y):
        ...     return ((x @ w - y) ** 2).mean()
        >>> w, x, y = torch.randn(3), torch.randn(8, 3), torch.randn(8)
        >>> g = fx.microbatch(torch.func.grad(loss), argnums=(1, 2), microbatch_size=2,
        ...                   accumulator=fx.AccumulationType.MEAN)(w, x, y)
        >>> torch.allclose(g, torch.func.grad(loss)(w, x, y), atol=1e-6)
        True
    """
    if microbatch_size is None:
        return fun
    if not isinstance(microbatch_size, numbers.Integral) or isinstance(microbatch_size, bool) or microbatch_size < 1:
        raise ValueError(f"microbatch: microbatch_size={microbatch_size!r} must be an int >= 1 (or None)")
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    argnames = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    axes = (in_axes,) * (len(argnums) + len(argnames)) if isinstance(in_axes, int) else tuple(in_axes)
    if len(axes) != len(argnums) + len(argnames):
        raise ValueError(f"microbatch: in_axes={in_axes!r} needs one axis per argument of argnums {argnums} "
                         f"and argnames {argnames}")
    m = int(microbatch_size)
    sig = _signature(fun)
    batched = _batch_slots(sig, argnums, argnames)  # [(args or kwargs, position or name)], in_axes order

    def microbatched(*args, **kwargs):
        args, kwargs, passed = _normalized(sig, args, kwargs)
        given = (args, kwargs)
        for (where, key), wrote in zip(batched, argnums + argnames):
            if (key >= len(args)) if where == 0 else (key not in kwargs):
                raise ValueError(f"microbatch: the batch argument {wrote!r} (argnums {argnums}, argnames {argnames}) "
                                 "is not in this call")
        # A batch argument left at its default (not passed) is not split: it has no batch axis of the call's.
        slots = [(slot, ax) for slot, ax in zip(batched, axes) if passed is None or _name_of(sig, *slot) in passed]
        sizes = [x.shape[ax] for (where, key), ax in slots for x in tree.leaves(given[where][key])]
        if len(set(sizes)) > 1:
            raise ValueError(f"microbatch: the batch arguments must have equal-size batch axes, found {sizes}")
        if not sizes:
            raise ValueError(f"microbatch: argnums {argnums} and argnames {argnames} hold no tensor to split")
        if sizes[0] % m:
            raise ValueError(f"microbatch: batch_size={sizes[0]} must be divisible by microbatch_size={m}")
        n = sizes[0] // m

        def piece(i, cut):
            new = (list(args), dict(kwargs))
            for (where, key), ax in slots:
                new[where][key] = optree.tree_map(lambda x: cut(x, ax % x.ndim, i), given[where][key], namespace=_NS)
            return fun(*new[0], **new[1])

        # rows i, i+n, i+2n...: Optax's reshape to (n, m) in column-major order, then take(i)
        rows = lambda x, ax, i: x.unflatten(ax, (m, n)).select(ax + 1, i)  # noqa: E731
        acc = _composed(accumulator, n)
        if n == 0:  # an empty batch (Optax): no micro-batch runs; the output's shape from one of zeros
            zeros = lambda x, ax, i: x.new_zeros((*x.shape[:ax], m, *x.shape[ax + 1:]))  # noqa: E731
            return acc.finalize(acc.init(piece(0, zeros)))
        runs = n if num_real_microbatches is None else int(num_real_microbatches)
        first = piece(0, rows)
        carry = acc.init(first)
        for i in range(runs):
            carry = acc.update(carry, first if i == 0 else piece(i, rows), i)
        return acc.finalize(carry)

    return microbatched


def _signature(fun: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):  # some builtins have none: the call's own positions and names are used
        return None


def _batch_slots(sig: inspect.Signature | None, argnums: tuple, argnames: tuple) -> list[tuple[int, Any]]:
    """Where each batch argument sits in a call normalized by :func:`_normalized` (Optax's rule): a name of a
    parameter that can be positional is its position, any other name a keyword."""
    params = list(sig.parameters.values()) if sig is not None else []
    positional = {p.name: i for i, p in enumerate(params)
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return [(0, i) for i in argnums] + [(0, positional[k]) if k in positional else (1, k) for k in argnames]


def _normalized(sig: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[list, dict, set | None]:
    """The call bound to ``fun``'s signature: positional parameters positional (defaults filled in up to the
    last one), the rest keywords, and the names the caller passed (``None`` without a signature)."""
    if sig is None:
        return list(args), dict(kwargs), None
    bound = sig.bind(*args, **kwargs)
    passed = set(bound.arguments)
    for p in sig.parameters.values():
        if p.kind == inspect.Parameter.VAR_KEYWORD:  # names given through **kwargs
            passed |= set(bound.arguments.get(p.name, {}))
    bound.apply_defaults()
    return list(bound.args), dict(bound.kwargs), passed


def _name_of(sig: inspect.Signature | None, where: int, key: Any) -> str:
    """The parameter name of a normalized slot (``*args``' name for positions past the named ones)."""
    if where == 1:
        return key
    positional = [p.name for p in sig.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    rest = [p.name for p in sig.parameters.values() if p.kind == inspect.Parameter.VAR_POSITIONAL]
    return positional[key] if key < len(positional) else (rest or [str(key)])[0]


def _composed(accumulator: Any, n: int) -> Accumulator:
    """``accumulator`` (a pytree prefix of the output holding accumulators) as one accumulator of the output."""
    is_acc = lambda x: isinstance(x, (Accumulator, AccumulationType))  # noqa: E731
    accs, spec = optree.tree_flatten(accumulator, is_leaf=is_acc, namespace=_NS)
    if not all(is_acc(a) for a in accs):
        raise ValueError(f"microbatch: accumulator={accumulator!r} must hold Accumulator or AccumulationType values")
    accs = [_builtin(a, n) if isinstance(a, AccumulationType) else a for a in accs]

    def each(method: str, trees: tuple, *extra: Any) -> Any:
        # the output cut at the prefix: one subtree per accumulator, which runs on every leaf of it
        parts = [spec.flatten_up_to(t) for t in trees]
        return optree.tree_unflatten(spec, [
            optree.tree_map(lambda *xs, a=a: getattr(a, method)(*xs, *extra), *subtrees, namespace=_NS)
            for a, *subtrees in zip(accs, *parts)])

    return Accumulator(lambda value: each("init", (value,)), lambda carry, value, i: each("update", (carry, value), i),
                       lambda carry: each("finalize", (carry,)), lambda values: each("aggregate", (values,)))


def _builtin(kind: AccumulationType, n: int) -> Accumulator:
    """Optax's SUM, MEAN, RUNNING_MEAN and CONCAT on one tensor."""
    if kind is AccumulationType.SUM:
        return Accumulator(torch.zeros_like, lambda c, v, i: c + v, lambda c: c, lambda v: v.sum(0))
    if kind is AccumulationType.MEAN:
        return Accumulator(_floating(torch.zeros_like), lambda c, v, i: c + v, lambda c: c / n, lambda v: v.mean(0))
    if kind is AccumulationType.RUNNING_MEAN:
        return Accumulator(_floating(torch.zeros_like), lambda c, v, i: c * (i / (i + 1)) + v * (1 - i / (i + 1)),
                           lambda c: c, lambda v: v.mean(0))
    # CONCAT: carry[i] is micro-batch i's output (rows i, i+n...): back in the batch's order by a transpose
    return Accumulator(lambda v: v.new_zeros((n, *v.shape)),
                       lambda c, v, i: c.index_put((torch.tensor(i, device=c.device),), v),
                       lambda c: c.transpose(0, 1).reshape(-1, *c.shape[2:]), lambda v: v)


def _floating(init: Callable) -> Callable:
    def checked(value):
        if not (value.is_floating_point() or value.is_complex()):
            raise ValueError("microbatch: MEAN and RUNNING_MEAN accumulators require floating-point values, got "
                             f"{value.dtype}")
        return init(value)

    return checked
