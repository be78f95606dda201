"""Root-mean-square rescalings: ``scale_by_rms`` (RMSProp), ``scale_by_stddev`` (centered RMSProp),
``scale_by_rss`` (Adagrad). Optax's math and state classes."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Updates, check_nonnegative, transform
from fxtrain.transforms import _moments
from fxtrain.transforms._moments import Scalar, conj, counter, ema_, ema_sq_, full_like, is_number


class ScaleByRmsState(NamedTuple):
    """State of :func:`scale_by_rms` without bias correction.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_rms().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByRmsState), state._fields
        (True, ('nu',))
    """

    nu: Updates


class ScaleByRmsWithCountState(NamedTuple):
    """State of :func:`scale_by_rms` with ``bias_correction=True``.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_rms(bias_correction=True).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByRmsWithCountState), state._fields
        (True, ('count', 'nu'))
    """

    count: torch.Tensor  # 0-dim int32
    nu: Updates


class ScaleByRStdDevState(NamedTuple):
    """State of :func:`scale_by_stddev` without bias correction.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_stddev().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByRStdDevState), state._fields
        (True, ('mu', 'nu'))
    """

    mu: Updates
    nu: Updates


class ScaleByRStdDevWithCountState(NamedTuple):
    """State of :func:`scale_by_stddev` with ``bias_correction=True``.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_stddev(bias_correction=True).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByRStdDevWithCountState), state._fields
        (True, ('count', 'mu', 'nu'))
    """

    count: torch.Tensor  # 0-dim int32
    mu: Updates
    nu: Updates


class ScaleByRssState(NamedTuple):
    """State of :func:`scale_by_rss`: the sum of squared gradients so far.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_rss().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByRssState), state._fields
        (True, ('sum_of_squares',))
    """

    sum_of_squares: Updates


def _divide_by_root_(g, v, eps, eps_in_sqrt, *, scratch=False):
    """``g / sqrt(v + eps)`` or ``g / (sqrt(v) + eps)``; ``scratch``: ``v`` is a temporary to overwrite."""
    fresh = tree.is_functional() or not scratch  # v is the state itself: never write into it
    with tree.functional(fresh):
        d = tree.add_(v, eps) if eps_in_sqrt else tree.sqrt_(v)
    d = tree.sqrt_(d) if eps_in_sqrt else tree.add_(d, eps)
    return tree.div_(g, d)


def _debiased(v, decay, count):
    """New tensors ``v / (1 - decay ** count)``."""
    with tree.functional():
        return tree.div_(v, _moments.bias_correction(decay, count, v))


@transform(elementwise=True)
def scale_by_rms(decay: Scalar = 0.9, eps: Scalar = 1e-8, initial_scale: Scalar = 0.0,
                 eps_in_sqrt: bool = True, bias_correction: bool = False) -> GradientTransformation:
    r"""Divides updates by the root of a moving average of squared gradients (RMSProp; Optax's).

    .. math::
        \nu_t = \rho\, \nu_{t-1} + (1 - \rho)\, g_t^2, \qquad
        u_t = \frac{g_t}{\sqrt{\hat\nu_t + \epsilon}} \;\text{ or }\; \frac{g_t}{\sqrt{\hat\nu_t} + \epsilon},

    with :math:`\hat\nu_t = \nu_t / (1 - \rho^t)` when ``bias_correction`` else :math:`\nu_t`.

    Args:
      decay: :math:`\rho`, decay of the moving average of squared gradients.
      eps: added to the denominator, inside the square root if ``eps_in_sqrt`` (Optax's default) else
        outside (as torch.optim.RMSprop).
      initial_scale: initial value of :math:`\nu` (TF1's RMSProp uses 1.0).
      eps_in_sqrt: where ``eps`` goes, see above.
      bias_correction: divide :math:`\nu_t` by :math:`1 - \rho^t` (then the state also counts steps).

    Returns:
      A transform with state :class:`ScaleByRmsState`, or :class:`ScaleByRmsWithCountState` when
      ``bias_correction``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_rms(decay=0.75, eps=0.0)
        >>> g = {"w": torch.tensor([2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist(), state.nu["w"].tolist()   # 2 / sqrt(0.25 * 4)
        ([2.0], [1.0])

    References:
      Hinton, `Lecture 6.5 - rmsprop <https://www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf>`_, 2012.
    """
    check_nonnegative("scale_by_rms", decay=decay, eps=eps, initial_scale=initial_scale)
    debias = bias_correction

    def init_fn(params):
        nu = full_like(params, initial_scale)
        return ScaleByRmsWithCountState(counter(params), nu) if debias else ScaleByRmsState(nu)

    def update_fn(updates, state, params=None):
        del params
        g, nu = tree.align(updates, state.nu)
        count = tree.inc_(state.count) if debias else None
        if g:
            nu, v = ema_sq_(nu, g, decay)
            if debias:
                g = _divide_by_root_(g, _debiased(v, decay, count), eps, eps_in_sqrt, scratch=True)
            else:
                g = _divide_by_root_(g, v, eps, eps_in_sqrt)
        nu = tree.put(state.nu, updates, nu)
        new = ScaleByRmsWithCountState(count, nu) if debias else ScaleByRmsState(nu)
        return tree.put(updates, updates, g), new

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=True)
def scale_by_stddev(decay: Scalar = 0.9, eps: Scalar = 1e-8, initial_scale: Scalar = 0.0,
                    eps_in_sqrt: bool = True, bias_correction: bool = False) -> GradientTransformation:
    r"""Divides updates by a moving estimate of the gradients' standard deviation (centered RMSProp).

    .. math::
        \mu_t = \rho\, \mu_{t-1} + (1 - \rho)\, g_t, \qquad
        \nu_t = \rho\, \nu_{t-1} + (1 - \rho)\, g_t^2, \qquad
        u_t = \frac{g_t}{\sqrt{\hat\nu_t - \hat\mu_t^2 + \epsilon}}
        \;\text{ or }\; \frac{g_t}{\sqrt{\hat\nu_t - \hat\mu_t^2} + \epsilon},

    the hats dividing by :math:`1 - \rho^t` when ``bias_correction``.

    Args:
      decay: :math:`\rho`, decay of both moving averages.
      eps: added to the denominator, inside the square root if ``eps_in_sqrt`` else outside.
      initial_scale: initial value of :math:`\nu`.
      eps_in_sqrt: where ``eps`` goes, see above.
      bias_correction: divide both averages by :math:`1 - \rho^t` (then the state also counts steps).

    Returns:
      A transform with state :class:`ScaleByRStdDevState`, or :class:`ScaleByRStdDevWithCountState`
      when ``bias_correction``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_stddev(decay=0.5, eps=0.0)
        >>> g = {"w": torch.tensor([2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist()   # 2 / sqrt(0.5 * 4 - (0.5 * 2) ** 2)
        [2.0]

    References:
      Graves, `Generating Sequences With Recurrent Neural Networks <https://arxiv.org/abs/1308.0850>`_, 2013.
    """
    check_nonnegative("scale_by_stddev", decay=decay, eps=eps, initial_scale=initial_scale)
    debias = bias_correction

    def init_fn(params):
        mu, nu = tree.zeros_like(params), full_like(params, initial_scale)
        if debias:
            return ScaleByRStdDevWithCountState(counter(params), mu, nu)
        return ScaleByRStdDevState(mu, nu)

    def update_fn(updates, state, params=None):
        del params
        g, mu, nu = tree.align(updates, state.mu, state.nu)
        count = tree.inc_(state.count) if debias else None
        if g:
            (mu, m), (nu, v) = ema_(mu, g, decay), ema_sq_(nu, g, decay)
            if debias:
                m, d = _debiased(m, decay, count), _debiased(v, decay, count)
                d = tree.addcmul_(d, m, conj(m), -1)
            else:
                with tree.functional():
                    d = tree.addcmul_(v, m, conj(m), -1)
            g = _divide_by_root_(g, d, eps, eps_in_sqrt, scratch=True)
        mu, nu = tree.put(state.mu, updates, mu), tree.put(state.nu, updates, nu)
        new = ScaleByRStdDevWithCountState(count, mu, nu) if debias else ScaleByRStdDevState(mu, nu)
        return tree.put(updates, updates, g), new

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=True)
def scale_by_rss(initial_accumulator_value: Scalar = 0.1, eps: Scalar = 1e-7) -> GradientTransformation:
    r"""Divides updates by the root of the sum of all squared gradients so far (Adagrad; Optax's).

    .. math::
        s_t = s_{t-1} + g_t^2, \qquad u_t = \frac{g_t}{\sqrt{s_t + \epsilon}} \;(0 \text{ where } s_t = 0).

    Args:
      initial_accumulator_value: initial value of :math:`s`.
      eps: added inside the square root.

    Returns:
      A transform with state :class:`ScaleByRssState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_rss(initial_accumulator_value=0.0, eps=0.0)
        >>> g = {"w": torch.tensor([3.0, 0.0])}
        >>> state = tx.init(g)
        >>> u, state = tx.update(g, state)
        >>> u["w"].tolist(), state.sum_of_squares["w"].tolist()
        ([1.0, 0.0], [9.0, 0.0])

    References:
      Duchi et al., `Adaptive Subgradient Methods for Online Learning and Stochastic Optimization
      <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011.
    """
    check_nonnegative("scale_by_rss", initial_accumulator_value=initial_accumulator_value, eps=eps)

    def init_fn(params):
        return ScaleByRssState(sum_of_squares=full_like(params, initial_accumulator_value))

    def update_fn(updates, state, params=None):
        del params
        g, s = tree.align(updates, state.sum_of_squares)
        if g:
            s = tree.addcmul_(s, g, conj(g))
            with tree.functional():
                d = tree.add_(s, eps)
            d = tree.sqrt_(d)
            if not (is_number(eps) and eps > 0):
                # Optax gives 0 where s + eps = 0 (then g = 0 too): 0 / tiny instead of 0 / 0. Any
                # nonzero root is far above the smallest normal number, so no other value changes.
                d = tree.clamp_(d, torch.finfo(d[0].dtype).tiny)
            g = tree.div_(g, d)
        return tree.put(updates, updates, g), ScaleByRssState(tree.put(state.sum_of_squares, updates, s))

    return GradientTransformation(init_fn, update_fn)
