"""Transforms applied conditionally, decided on device: ``apply_if_finite``, ``conditionally_transform`` and
``conditionally_mask`` (Optax's semantics and states).

Optax decides with ``lax.cond`` and runs one branch. Here the decision is a 0-dim tensor that is never
read on the host (no device sync): the inner transform runs on every call and ``torch.where`` keeps its
results or the old ones (:func:`select`), so the inner state and the updates come out exactly as with
``lax.cond``. In place, the wrapper keeps a copy of what a rejected call must restore.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple, Sequence

import torch

from fxtrain import distributed, tree
from fxtrain._base import forwarded, GradientTransformation, combine, call_, report, traits, transform, with_traits
from fxtrain._deferred import DTensor
from fxtrain.transforms._moments import counter, param_device, safe_increment_

__all__ = ["ApplyIfFiniteState", "apply_if_finite", "ConditionallyTransformState", "conditionally_transform",
           "ConditionallyMaskState", "conditionally_mask"]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite` (Optax's ``ApplyIfFiniteState``).

    Attributes:
      notfinite_count: consecutive updates with an Inf or NaN so far (0-dim int32); reset by a finite one.
      last_finite: whether the last update was finite (0-dim bool).
      total_notfinite: updates with an Inf or NaN since init (0-dim int32); never reset.
      inner_state: the state of the wrapped transform.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.apply_if_finite(fx.sgd(0.1), 3).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ApplyIfFiniteState), state._fields
        (True, ('notfinite_count', 'last_finite', 'total_notfinite', 'inner_state'))
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any

    def report(self) -> dict[str, torch.Tensor]:
        """``total_notfinite``: updates not finite so far (the inner state's reports are found by the walk)."""
        return {"total_notfinite": self.total_notfinite}


@transform(elementwise=False)
def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int, *,
                    groups: Sequence[Any] = ()) -> GradientTransformation:
    r"""Skips updates holding an Inf or NaN, unless too many came in a row (Optax's ``apply_if_finite``).

    With :math:`n` the number of consecutive non-finite updates including this one, the inner transform's
    result is used when the updates are all finite or :math:`n >` ``max_consecutive_errors``; otherwise the
    updates are zeros (``-0.0``: params stay bit-identical) and the inner state is left exactly as it was,
    but for the ``grad_norm`` it reports: the norm this update had (inf or NaN). The decision is a 0-dim tensor
    (``tree.all_finite``): the inner kernel always runs and its results are selected with ``torch.where``,
    so there is no host sync. ``tx.update`` stays pure; the in-place kernel copies the inner state once to
    be able to restore it. Out of place (under ``vmap``, ``grad``, autograd) a rejected update reaches the
    inner transform as zeros, so gradients through a skipped step are zero, not NaN (as Optax's
    ``lax.cond``).

    An inner stack that skips non-finite updates by itself (``amp_cast`` with a loss scale: it reports
    ``skipped``) gets them as they are and keeps what it did on a skip (its loss scale backs off, it
    reports ``skipped=1``); this transform still counts the update and returns zeros.

    Args:
      inner: the transform to protect.
      max_consecutive_errors: how many non-finite updates in a row to skip before accepting one, >= 0.
      groups: process groups (or 1-D meshes) whose ranks hold disjoint parameters, such as pipeline
        stages: the decision is taken over all of them (one ``all_reduce`` of one flag per group), so every
        stage skips together, as one process holding all the params would.

    Returns:
      A transform with an :class:`ApplyIfFiniteState`; it passes extra arguments (``value=``...) to
      ``inner`` when ``inner`` reads them.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.apply_if_finite(fx.scale(-0.1), max_consecutive_errors=2)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> u, state = tx.update({"w": torch.tensor([1.0, float("nan")])}, state)
        >>> u["w"].tolist(), bool(state.last_finite), int(state.total_notfinite)
        ([0.0, 0.0], False, 1)
    """
    if not isinstance(max_consecutive_errors, numbers.Integral) or isinstance(max_consecutive_errors, bool):
        raise TypeError(f"apply_if_finite: max_consecutive_errors must be an int, got {max_consecutive_errors!r}")
    if max_consecutive_errors < 0:
        raise ValueError(f"apply_if_finite: max_consecutive_errors={max_consecutive_errors} must be >= 0")
    def init_fn(params):
        return ApplyIfFiniteState(
            notfinite_count=counter(params),
            last_finite=torch.ones((), dtype=torch.bool, device=param_device(params)),
            total_notfinite=counter(params),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        raw = tree.leaves(updates)
        finite = _all_finite(raw).to(state.last_finite.device)
        if groups:  # every stage takes the same branch (fxtrain.distributed.global_count: a flag, no host sync)
            finite = distributed.global_count((~finite).to(torch.float32), [], groups=groups) == 0
        notfinite = tree.scale_([safe_increment_(state.notfinite_count)], ~finite)[0]  # reset by a finite update
        accept = finite | (notfinite > max_consecutive_errors)
        fed_zeros = False
        if tree.is_functional():  # nothing is written: no copy to keep
            before = state.inner_state
            # Rejected inner results are discarded, but autograd still sends them a zero cotangent, and
            # 0 * NaN = NaN in their backward (a hyperparameter's gradient): the inner transform sees zeros
            # instead (Optax does not run it at all: lax.cond). An inner stack that skips by itself (it
            # reports `skipped`: amp_cast) must see the overflow to back off, and zeroes in the same way.
            if "skipped" not in report(state.inner_state):
                updates, fed_zeros = tree.put(updates, updates, tree.zero_where_(~accept, raw)), True
        else:  # the inner kernel writes into its state: keep a copy to restore
            before = tree.clone(state.inner_state)
        updates, inner_state = call_(inner, updates, state.inner_state, params, extra_args)
        reports = report(inner_state)
        # What an inner stack did on its own skip (loss scale backoff, skipped=1) is kept, not restored.
        accept_state = accept | (reports["skipped"] > 0) if "skipped" in reports else accept
        seen = seen_grad_norm(reports, ~accept, raw, fed_zeros=fed_zeros)
        inner_state = select(accept_state, inner_state, before, seen=seen)
        updates = tree.put(updates, updates, skip_where_(~accept, tree.leaves(updates)))
        total = tree.inc_(state.total_notfinite, ~finite & (state.total_notfinite < torch.iinfo(torch.int32).max))
        last_finite = tree.copy_([state.last_finite], [finite])[0]
        return updates, ApplyIfFiniteState(notfinite, last_finite, total, inner_state)

    def wrap_loss(loss_fn, state):  # the inner transform's forward-pass wrapper sees its own state
        return inner.wrap_loss(loss_fn, state.inner_state)

    return with_traits(GradientTransformation(init_fn, update_fn),
                       wrap_loss=None if inner.wrap_loss is None else wrap_loss, **forwarded(inner))


def _all_finite(xs: list) -> torch.Tensor:
    """:func:`fxtrain.tree.all_finite`, also for DTensor leaves: each leaf's flag is reduced over its mesh (one
    collective per DTensor leaf; the reduced flags of sharded leaves cannot be stacked with replicated ones
    by ``tree.all_finite``), the same answer on every rank."""
    if any(isinstance(x, DTensor) for x in xs):
        flags = [x.isfinite().all() for x in xs]
        return torch.stack([tree.full(f) for f in flags]).all()
    return tree.all_finite(xs)


class ConditionallyTransformState(NamedTuple):
    """State of :func:`conditionally_transform` (Optax's, same fields in the same order).

    Attributes:
      inner_state: the state of the wrapped transform, changed only by calls where it runs.
      step: calls so far (0-dim int32), what ``should_transform_fn`` is given.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.conditionally_transform(fx.sgd(0.1), lambda step: step > 0).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ConditionallyTransformState), state._fields
        (True, ('inner_state', 'step'))
    """

    inner_state: Any
    step: torch.Tensor


class ConditionallyMaskState(NamedTuple):
    """State of :func:`conditionally_mask` (Optax's, same fields in the same order).

    Attributes:
      step: calls so far (0-dim int32), what ``should_transform_fn`` is given.
      inner_state: the state of the wrapped transform, changed only by calls where it runs.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.conditionally_mask(fx.sgd(0.1), lambda step: step > 0).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ConditionallyMaskState), state._fields
        (True, ('step', 'inner_state'))
    """

    step: torch.Tensor
    inner_state: Any


def _run_if(inner: GradientTransformation, should_transform_fn: Callable, forward_extra_args: bool, updates: Any,
            inner_state: Any, step: torch.Tensor, params: Any, extra_args: dict, *, rejected: str
            ) -> tuple[Any, Any]:
    """``inner``'s update where ``should_transform_fn(step)`` holds; else the updates as they came
    (``rejected="pass"``) or zeros (``rejected="zero"``), and ``inner_state`` kept. See the module docstring."""
    run = should_transform_fn(step, **(extra_args if forward_extra_args else {}))
    if isinstance(run, (bool, numbers.Integral)):  # decided on the host already (no tensor involved)
        if run:
            return call_(inner, updates, inner_state, params, extra_args)
        return (updates if rejected == "pass" else tree.map(torch.zeros_like, updates)), inner_state
    run = torch.as_tensor(run).to(torch.bool)
    if run.ndim:
        raise ValueError(f"should_transform_fn must return a bool or a 0-dim tensor, got shape {tuple(run.shape)}")
    functional = tree.is_functional()
    before = inner_state if functional else tree.clone(inner_state)  # in place the inner kernel writes into it
    kept = updates if functional or rejected == "zero" else tree.clone(updates)
    new, new_state = call_(inner, updates, inner_state, params, extra_args)
    us, olds = tree.align(new, kept, what="updates")
    reject = ~run.to(us[0].device) if us else ~run
    # Selected into the new updates' buffers (in place, tree.put keeps them where they are).
    picked = tree.where_(reject, olds, us) if rejected == "pass" else tree.zero_where_(reject, us)
    return tree.put(new, new, picked), select(run, new_state, before)


@transform(elementwise=None)
def conditionally_transform(inner: GradientTransformation, should_transform_fn: Callable,
                            forward_extra_args: bool = False) -> GradientTransformation:
    r"""Runs ``inner`` only at the steps where ``should_transform_fn(step)`` is true; at the others the updates
    pass through unchanged and the inner state is kept (Optax's ``conditionally_transform``).

    With :math:`t` the number of earlier calls::

        should_transform_fn(t):      updates, inner_state = inner.update(updates, inner_state, params)
        otherwise:                   updates, inner_state unchanged

    The condition may be a Python bool or a 0-dim tensor; a tensor is never read on the host: ``inner``
    runs and ``torch.where`` keeps its results or the old ones (see the module docstring).

    Args:
      inner: the transform to run conditionally.
      should_transform_fn: ``should_transform_fn(step) -> bool`` with ``step`` a 0-dim int32 tensor (the
        calls before this one); with ``forward_extra_args`` it also gets the extra arguments
        (``should_transform_fn(step, value=loss)``).
      forward_extra_args: pass the extra arguments of ``update`` to ``should_transform_fn``.

    Returns:
      A transform with a :class:`ConditionallyTransformState`; extra arguments reach ``inner`` if it reads
      them.

    Example:
        >>> import torch, fxtrain as fx
        >>> from fxtrain.transforms._conditionality import conditionally_transform
        >>> tx = conditionally_transform(fx.scale(2.0), lambda step: step < 2)
        >>> state = tx.init(torch.zeros(()))
        >>> out = []
        >>> for _ in range(4):
        ...     u, state = tx.update(torch.ones(()), state)
        ...     out.append(u.item())
        >>> out
        [2.0, 2.0, 1.0, 1.0]

    References:
      Optax, `conditionally_transform <https://optax.readthedocs.io/en/latest/api/transformations.html>`_.
    """
    if not callable(should_transform_fn):
        raise ValueError(f"conditionally_transform: should_transform_fn must be a callable of the step, got "
                         f"{should_transform_fn!r}")

    def init_fn(params):
        return ConditionallyTransformState(inner_state=inner.init(params), step=counter(params))

    def update_fn(updates, state, params=None, **extra_args):
        updates, inner_state = _run_if(inner, should_transform_fn, forward_extra_args, updates, state.inner_state,
                                       state.step, params, extra_args, rejected="pass")
        return updates, ConditionallyTransformState(inner_state, safe_increment_(state.step))

    return _conditional(init_fn, update_fn, inner, forward_extra_args)


@transform(elementwise=None)
def conditionally_mask(inner: GradientTransformation, should_transform_fn: Callable,
                       forward_extra_args: bool = False) -> GradientTransformation:
    r"""Runs ``inner`` only at the steps where ``should_transform_fn(step)`` is true; at the others the updates
    are zeros and the inner state is kept (Optax's ``conditionally_mask``).

    With :math:`t` the number of earlier calls::

        should_transform_fn(t):      updates, inner_state = inner.update(updates, inner_state, params)
        otherwise:                   updates = 0, inner_state unchanged

    Decided as in :func:`conditionally_transform` (a tensor condition is never read on the host).

    Args:
      inner: the transform to run conditionally.
      should_transform_fn: ``should_transform_fn(step) -> bool`` with ``step`` a 0-dim int32 tensor; with
        ``forward_extra_args`` it also gets the extra arguments (``should_transform_fn(step, loss=...)``).
      forward_extra_args: pass the extra arguments of ``update`` to ``should_transform_fn``.

    Returns:
      A transform with a :class:`ConditionallyMaskState`; extra arguments reach ``inner`` if it reads them.

    Example:
        >>> import torch, fxtrain as fx
        >>> from fxtrain.transforms._conditionality import conditionally_mask
        >>> tx = conditionally_mask(fx.scale(2.0), lambda step, loss: loss > 0.1, forward_extra_args=True)
        >>> state = tx.init(torch.zeros(()))
        >>> u, state = tx.update(torch.ones(()), state, loss=torch.tensor(0.2))
        >>> v, state = tx.update(torch.ones(()), state, loss=torch.tensor(0.0))
        >>> u.item(), v.item(), int(state.step)
        (2.0, 0.0, 2)

    References:
      Optax, `conditionally_mask <https://optax.readthedocs.io/en/latest/api/transformations.html>`_.
    """
    if not callable(should_transform_fn):
        raise ValueError(f"conditionally_mask: should_transform_fn must be a callable of the step, got "
                         f"{should_transform_fn!r}")

    def init_fn(params):
        return ConditionallyMaskState(step=counter(params), inner_state=inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        updates, inner_state = _run_if(inner, should_transform_fn, forward_extra_args, updates, state.inner_state,
                                       state.step, params, extra_args, rejected="zero")
        return updates, ConditionallyMaskState(safe_increment_(state.step), inner_state)

    return _conditional(init_fn, update_fn, inner, forward_extra_args)


def _conditional(init_fn: Callable, update_fn: Callable, inner: GradientTransformation,
                 forward_extra_args: bool) -> GradientTransformation:
    """A conditional wrapper's transform: ``inner``'s traits (merged), reading extra arguments itself when its
    condition does; ``Partial`` gradients are reduced before it (a pass-through must return real updates)."""
    tx = combine(init_fn, update_fn, (inner,))
    return with_traits(tx, partial_grads=False, extra_args=traits(tx).extra_args or forward_extra_args)


def select(pred: torch.Tensor, new: Any, old: Any, what: str = "inner state",
           seen: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
    """``new`` where the 0-dim boolean ``pred`` is true, else ``old``: a state kept or restored on device.

    Leafwise ``torch.where`` (:func:`fxtrain.tree.where_`), no host sync. In place the selection is
    written into ``old``'s tensors (the copy a kernel took before running its inner transform); out of
    place it makes new tensors. Leaves that are not tensors (a Python number in a hand-written state) are
    host values that cannot wait for a device decision: they come from ``new``.

    ``seen``: ``(leaf, value)`` from :func:`seen_grad_norm`: that leaf of ``new`` (the reported
    ``grad_norm``) takes ``value`` whatever ``pred``: a restored state still says which norm was seen.

    >>> import torch
    >>> select(torch.tensor(False), {"a": torch.ones(1), "n": 2}, {"a": torch.zeros(1), "n": 1})
    {'a': tensor([0.]), 'n': 2}
    """
    flat_new, spec = tree.flatten(new)
    flat_old, spec_old = tree.flatten(old)
    if tree.structures_differ(flat_new, spec, flat_old, spec_old):
        raise ValueError(f"the {what} changed structure at '{tree.first_mismatch(new, old)}'")
    at = [i for i, x in enumerate(flat_new) if isinstance(x, torch.Tensor)]
    out = list(flat_new)
    for i, x in zip(at, tree.where_(pred, [flat_new[i] for i in at], [flat_old[i] for i in at])):
        out[i] = x
    if seen is not None:
        leaf, value = seen
        i = next(i for i, x in enumerate(flat_new) if x is leaf)
        out[i] = tree.copy_([out[i]], [value])[0]
    return tree.unflatten(spec, out)


# --- what a skipped step writes and reports -------------------------------------------------------------
#
# Shared by apply_if_finite and amp_cast (fxtrain/amp.py), the two transforms that skip an update.

def skip_where_(pred: torch.Tensor, xs: Sequence[torch.Tensor]) -> list:
    """``xs[i]`` with every element set to ``-0.0`` where the 0-dim boolean ``pred`` is true: a skipped update.

    ``-0.0``, not ``0.0``: it is the identity of floating-point addition (``p + -0.0`` is ``p`` bit for
    bit, ``-0.0`` included, where ``-0.0 + 0.0`` is ``+0.0``), so a skipped step leaves every param
    bit-identical. On local pieces, so ``Partial`` placements are kept.

    >>> skip_where_(torch.tensor(True), [torch.ones(2)])[0].tolist()
    [-0.0, -0.0]
    """
    if tree.is_functional():
        return [tree.rewrap(tree.local(x).masked_fill(pred, -0.0), x) for x in xs]
    for x in xs:
        tree.local(x).masked_fill_(pred, -0.0)
    return list(xs)


def seen_grad_norm(reports: dict, rejected: torch.Tensor, raw: Sequence[torch.Tensor], *,
                   fed_zeros: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``grad_norm`` leaf the inner stack reports and the norm this update had, even if it is rejected.

    ``reports``: :func:`fxtrain._base.report` of the inner stack's new state, before a wrapper restores it
    (a restored state would report the previous step's norm, or the initial 0.0, on a skipped step). Where
    the inner transform ran on the gradients themselves its ``grad_norm`` is the one seen (global, the same
    on every rank). Where it was ``fed_zeros`` instead (out of place, on a rejected update), the norm is
    taken from the gradients ``raw`` (local pieces: a rank whose own pieces are finite says inf). ``None``
    when the inner stack reports no ``grad_norm``: no norm is computed for it.
    """
    leaf = reports.get("grad_norm")
    if leaf is None:
        return None
    value = leaf.detach()
    if fed_zeros:
        local = distributed.local_leaves([x.detach() for x in raw])
        norm = tree.sum_sq(local, value.dtype).sqrt().to(value.device)
        value = torch.where(rejected, torch.where(norm.isfinite(), torch.inf, norm).to(value.dtype), value)
    return leaf, value
