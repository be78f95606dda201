"""Sharpness-Aware Minimization: ``sam`` alternates adversarial steps and outer steps (Optax's contrib).

SAM (Foret et al., 2021) takes the gradient at a nearby worst-case point: an adversarial optimizer (often
``chain(normalize(), sgd(rho))`` read as an *ascent*) moves the params for ``sync_period - 1`` steps,
then the outer optimizer's step, computed with the gradient found there, is applied to the params saved
before the adversarial steps.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import (forwarded, EmptyState, GradientTransformation, Params, apply_updates, call_, is_elementwise,
                           transform, with_traits)
from fxtrain import distributed
from fxtrain.distributed import match_placements
from fxtrain.transforms._moments import param_device

__all__ = ["normalize", "NormalizeState", "SAMState", "sam"]

NormalizeState = EmptyState


@transform(elementwise=False)
def normalize() -> GradientTransformation:
    r"""Divides the updates by their global L2 norm (Optax's ``contrib.normalize``, SAM's helper).

    .. math:: u = \frac{g}{\lVert g \rVert_2}

    with the norm over all leaves (accumulated in float32 or wider; DTensor leaves over their meshes, see
    :func:`fxtrain.distributed.global_norm`). A zero gradient gives NaN, as in Optax.

    Returns:
      A stateless transform (state :class:`NormalizeState`, the empty state); not elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.normalize()
        >>> tx.update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, tx.init(None))[0]
        {'a': tensor([0.6000]), 'b': tensor([0.8000])}

    References:
      Foret et al., `Sharpness-Aware Minimization for Efficiently Improving Generalization
      <https://arxiv.org/abs/2010.01412>`_, 2021.
    """
    def init_fn(params):
        del params
        return NormalizeState()

    def update_fn(updates, state, params=None):
        del params
        g = tree.leaves(updates)
        if not g:
            return updates, state
        return tree.put(updates, updates, tree.div_(g, distributed.global_norm(g))), state

    return GradientTransformation(init_fn, update_fn)


class SAMState(NamedTuple):
    """State of :func:`sam` (Optax's field names and order)."""

    steps_since_sync: torch.Tensor  # 0-dim int32: adversarial steps since the last outer step
    opt_state: Any  # the outer optimizer's
    adv_state: Any  # the adversarial optimizer's
    cache: Params | None  # the params of the last outer step (transparent mode); None in opaque mode


def _select(pred: torch.Tensor, new: Any, out: Any) -> Any:
    """``torch.where(pred, new, out)`` leaf by leaf for two trees of one structure, written into ``out``."""
    return tree.put(out, out, tree.where_(pred, tree.leaves(new), tree.leaves(out)))


@transform(elementwise=None, extra_args=True)
def sam(optimizer: GradientTransformation, adv_optimizer: GradientTransformation, sync_period: int = 2,
        reset_state: bool = True, opaque_mode: bool = False, batch_axis_name: str | None = None
        ) -> GradientTransformation:
    r"""Sharpness-Aware Minimization: adversarial steps, then an outer step from the saved params (Optax's).

    Every ``sync_period`` updates form one SAM step. With :math:`\theta` the params of the last outer step:

    .. math::
        \tilde\theta_0 = \theta, \qquad
        \tilde\theta_{i+1} = \tilde\theta_i - \mathrm{adv}(\nabla f(\tilde\theta_i)) \quad (i < k - 1),
        \qquad \theta \leftarrow \theta + \mathrm{opt}(\nabla f(\tilde\theta_{k-1}))

    with :math:`k` = ``sync_period``; the adversarial updates are negated, so ``adv_optimizer = chain(
    normalize(), sgd(rho))`` ascends by :math:`\rho` along the normalized gradient (the paper's SAM with
    ``sync_period=2``).

    Transparent mode (the default): each call to ``update`` is one of those steps. Adversarial calls return
    the adversarial update; the last call of a period returns the update that takes the params back to
    :math:`\theta` plus the outer update. Both optimizers run on every call and the right results are
    selected on device (``torch.where``, no host sync), so it composes with ``torch.func``.

    Opaque mode: each call runs the ``sync_period - 1`` adversarial steps internally, calling
    ``update(..., grad_fn=grad_fn)``'s ``grad_fn(params, i)`` (the gradient of the loss at the adversarial
    params, ``i`` the adversarial step), and returns the outer update: callers only see outer steps
    (needed when a call has side effects, e.g. BatchNorm statistics). Gradients that ``grad_fn`` returns as
    data-parallel ``Partial`` DTensors are reduced to their params' placements
    (:func:`fxtrain.distributed.match_placements`, what ``jax.lax.pmean`` over ``batch_axis_name`` does in Optax).

    Args:
      optimizer: the outer optimizer.
      adv_optimizer: the adversarial optimizer (its update is negated: an ascent).
      sync_period: updates per SAM step (at least 1): ``sync_period - 1`` adversarial ones, then the outer one.
      reset_state: reinitialize the adversarial optimizer's state after each outer step.
      opaque_mode: run the adversarial steps inside ``update`` with ``grad_fn`` (see above).
      batch_axis_name: JAX's ``pmean`` axis in Optax; must be ``None`` here: data-parallel gradients are
        reduced through their DTensor placements instead.

    Returns:
      A transform with state :class:`SAMState` that reads the extra argument ``grad_fn`` in opaque mode.
      Transparent mode is elementwise if both optimizers are; opaque mode is not (``grad_fn`` runs the model).

    Raises:
      ValueError: ``sync_period < 1``, a ``batch_axis_name``, or (at update) opaque mode without ``grad_fn``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.sam(fx.sgd(0.1), fx.chain(fx.contrib.normalize(), fx.sgd(0.05)))
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> state = tx.init(params)
        >>> for _ in range(2):   # f(w) = |w|^2 / 2: the gradient is w
        ...     u, state = tx.update(params, state, params)
        ...     params = fx.apply_updates(params, u)
        ...     print([round(x, 2) for x in params["w"].tolist()])
        [3.03, 4.04]
        [2.7, 3.6]

    References:
      Foret et al., `Sharpness-Aware Minimization for Efficiently Improving Generalization
      <https://arxiv.org/abs/2010.01412>`_, 2021.
    """
    # An int, or the 0-dim int tensor inject_hyperparams gives (the transparent mode counts on the device).
    injected = isinstance(sync_period, torch.Tensor) and sync_period.ndim == 0 and not (
        sync_period.is_floating_point() or sync_period.is_complex() or sync_period.dtype == torch.bool)
    if not injected and (not isinstance(sync_period, int) or isinstance(sync_period, bool) or sync_period < 1):
        raise ValueError(f"sam: sync_period={sync_period!r} must be an int >= 1")
    if batch_axis_name is not None:
        raise ValueError(f"sam: batch_axis_name={batch_axis_name!r} is JAX's pmean axis; fxtrain reduces "
                         "data-parallel gradients through their placements (grad_fn's Partial DTensors are "
                         "brought to their params' placements): pass batch_axis_name=None")

    def init_fn(params):
        return SAMState(steps_since_sync=torch.zeros((), dtype=torch.int32, device=param_device(params)),
                        opt_state=optimizer.init(params), adv_state=adv_optimizer.init(params),
                        cache=None if opaque_mode else tree.clone(params))

    def transparent_update_fn(updates, state, params=None, *, grad_fn=None, **extra_args):
        del grad_fn, extra_args
        first, last = state.steps_since_sync == 0, state.steps_since_sync == sync_period - 1
        with tree.functional():  # both optimizers run; their inputs stay intact for the selection below
            adv_updates, adv_state = call_(adv_optimizer, updates, state.adv_state, params)
            opt_updates, opt_state = call_(optimizer, updates, state.opt_state, state.cache)
            g, c, p, adv_u, opt_u = tree.align(updates, state.cache, params, adv_updates, opt_updates)
            opt_u = tree.add_(tree.add_(opt_u, c), p, -1.0)  # back to the cache, then the outer step
        g = tree.copy_(g, tree.neg_(adv_u))  # adversarial updates ascend
        g = tree.where_(last, opt_u, g)
        cache = tree.where_(first, p, c)
        if reset_state:
            adv_state = _select(last, adv_optimizer.init(params), _assign(state.adv_state, adv_state))
        else:
            adv_state = _select(~last, adv_state, state.adv_state)
        return tree.put(updates, updates, g), SAMState(
            steps_since_sync=(state.steps_since_sync + 1) % sync_period, opt_state=_select(last, opt_state, state.opt_state),
            adv_state=adv_state, cache=tree.put(state.cache, updates, cache))

    def opaque_update_fn(updates, state, params=None, *, grad_fn: Callable | None = None, **extra_args):
        del extra_args
        if grad_fn is None:
            raise ValueError("sam: opaque_mode=True needs the gradient function: "
                             "tx.update(grads, state, params, grad_fn=lambda params, i: grads_at(params))")
        adv_params, adv_state = params, state.adv_state
        for i in range(int(sync_period) - 1):  # a host read of an injected sync_period: opaque mode loops here
            updates, adv_state = call_(adv_optimizer, updates, adv_state, adv_params)
            updates = tree.put(updates, updates, tree.neg_(tree.leaves(updates)))  # adversarial updates ascend
            adv_params = apply_updates(adv_params, updates)
            updates = match_placements(grad_fn(adv_params, i), adv_params)
        if reset_state:
            adv_state = adv_optimizer.init(params)
        updates, opt_state = call_(optimizer, updates, state.opt_state, params)
        return updates, SAMState(steps_since_sync=torch.zeros_like(state.steps_since_sync), opt_state=opt_state,
                                 adv_state=adv_state, cache=None)

    if opaque_mode:
        return with_traits(GradientTransformation(init_fn, opaque_update_fn), elementwise=False, **forwarded(optimizer))
    return with_traits(GradientTransformation(init_fn, transparent_update_fn),
                       elementwise=is_elementwise(optimizer) and is_elementwise(adv_optimizer), **forwarded(optimizer))


def _assign(out: Any, new: Any) -> Any:
    """``new``'s leaves written into ``out``'s (in place when donated), returned as a tree like ``out``."""
    return tree.put(out, out, tree.copy_(tree.leaves(out), tree.leaves(new)))
