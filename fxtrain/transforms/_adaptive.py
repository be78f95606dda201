"""Adam's relatives: AdaBelief, AdaDelta, AdaMax, Adan, AMSGrad, RAdam, Yogi, NovoGrad, optimistic
gradients, and their optimizers (Optax's names, arguments, defaults, states and chains).

The transforms share Adam's shape: moving moments of the gradient, bias corrections, then a quotient.
The quotient is built in the gradient buffers (the gradient is no longer needed by then), so a
donated step allocates little beyond what each method's extra terms need. Complex parameters follow
Optax: second moments use :math:`|g|^2`, so they hold real values in a complex dtype; comparisons
(maximum, sign) look at their real parts.
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import (GradientTransformation, Updates, chain, check_learning_rate, check_needs_params,
                           check_nonnegative, transform)
from fxtrain.transforms._adam import ScaleByAdamState, scale_by_adam
from fxtrain.transforms._masking import Mask
from fxtrain.transforms._normalizing import block_norms
from fxtrain.transforms._moments import (
    LearningRate,
    Scalar,
    as_dtype,
    bias_correction,
    counter,
    ema_,
    ema_sq_,
    full_like,
    is_zero,
    mixed_dtypes,
    param_device,
    safe_increment_,
    weak,
)
from fxtrain.transforms._scaling import scale_by_learning_rate
from fxtrain.transforms._weight_decay import add_decayed_weights

__all__ = [
    "ScaleByAdaDeltaState",
    "ScaleByAdanState",
    "ScaleByAmsgradState",
    "ScaleByBeliefState",
    "ScaleByNovogradState",
    "ScaleByOptimisticGradientState",
    "adabelief",
    "adadelta",
    "adamax",
    "adamaxw",
    "adan",
    "amsgrad",
    "novograd",
    "optimistic_adam",
    "optimistic_adam_v2",
    "optimistic_gradient_descent",
    "radam",
    "scale_by_adadelta",
    "scale_by_adamax",
    "scale_by_adan",
    "scale_by_amsgrad",
    "scale_by_belief",
    "scale_by_novograd",
    "scale_by_optimistic_gradient",
    "scale_by_radam",
    "scale_by_yogi",
    "yogi",
]


# --- shared kernel pieces ---------------------------------------------------------------------------

def _complex(xs: list[torch.Tensor]) -> bool:
    return any(x.is_complex() for x in xs)


def _real(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The real parts of complex leaves (views: writing into them writes the leaf), real leaves as they are."""
    return [x.real if x.is_complex() else x for x in xs] if _complex(xs) else xs


def _on_real_parts(op: Callable, xs: list[torch.Tensor], *rest: list[torch.Tensor]) -> list[torch.Tensor]:
    """``op`` (an op-layer function) on the real parts of ``xs``, results in ``xs``'s dtypes.

    For moments that hold real values in a complex dtype (as JAX's do): torch has no complex ``maximum``
    or ``sign``. In place the op writes the real parts (the imaginary parts stay 0).
    """
    if not _complex(xs):
        return op(xs, *rest)
    out = op(_real(xs), *(_real(r) for r in rest))
    return [o.to(x.dtype) for o, x in zip(out, xs)] if tree.is_functional() else xs


def _abs_sq(g: list[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors ``|g|^2`` in ``g``'s dtypes (Optax's ``abs_sq``: exactly 0 imaginary part when complex)."""
    with tree.functional():
        if not _complex(g):
            return tree.scale_(g, g)
        return [(x * x.conj()).real.to(x.dtype) if x.is_complex() else x * x for x in g]


def _root_(d: list[torch.Tensor], eps: Scalar, eps_root: Scalar = 0.0, bc: Scalar | None = None) -> list:
    """``sqrt(d / bc + eps_root) + eps`` (``bc``: a bias correction or ``None``); ``d`` is scratch, written
    in place."""
    if bc is not None:
        d = tree.div_(d, bc)
    if not is_zero(eps_root):
        d = tree.add_(d, eps_root)
    return tree.add_(tree.sqrt_(d), eps)


def _quotient_(d: list[torch.Tensor], num: list[torch.Tensor], bc: Scalar | None = None) -> list:
    """``(num / bc) / d`` written into ``d`` (scratch).

    In place, real leaves: ``1 / (bc * d / num)``, Adam's form without a temporary (0 where ``num`` is 0,
    as the plain quotient). Out of place, or complex leaves (a complex division by 0 gives NaN, not
    infinity): the plain quotient, copied into ``d``.
    """
    if bc is not None:
        d = tree.scale_(d, bc)
    if tree.is_functional() or _complex(d):  # the plain quotient: its derivative is defined where num is 0
        with tree.functional():
            q = tree.div_(num, d)
        return tree.copy_(d, q)
    return tree.reciprocal_(tree.div_(d, num))


def _nesterov_mean(m: list, g: list, b1: Scalar, count: torch.Tensor) -> list:
    r"""NAdam's :math:`\hat m_t = \beta_1 m_t / (1 - \beta_1^{t+1}) + (1 - \beta_1) g_t / (1 - \beta_1^t)`,
    new tensors (``g`` is overwritten: callers pass scratch)."""
    with tree.functional():
        num = tree.div_(m, bias_correction(b1, count + 1, m))
    num = tree.scale_(num, b1)
    g = tree.scale_(tree.div_(g, bias_correction(b1, count, g)), 1 - b1)
    return tree.add_(num, g)


# --- transforms -------------------------------------------------------------------------------------

class ScaleByAmsgradState(NamedTuple):
    """State of :func:`scale_by_amsgrad` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_amsgrad().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByAmsgradState), state._fields
        (True, ('count', 'mu', 'nu', 'nu_max'))
    """

    count: torch.Tensor  # 0-dim int32: number of updates so far
    mu: Updates  # first moment, in mu_dtype (default: the param dtype)
    nu: Updates  # second moment
    nu_max: Updates  # running maximum of the (bias-corrected) second moment


@transform(elementwise=True)
def scale_by_amsgrad(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8, eps_root: Scalar = 0.0,
                     mu_dtype: torch.dtype | str | None = None, bias_correction_mu: bool = True,
                     bias_correction_nu: bool = True) -> GradientTransformation:
    r"""Rescales updates with AMSGrad: Adam with a non-decreasing second moment (Optax's ``scale_by_amsgrad``).

    .. math::
        m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad v_t = \beta_2 v_{t-1} + (1 - \beta_2) |g_t|^2, \\
        \hat v^{max}_t = \max(\hat v^{max}_{t-1}, v_t / (1 - \beta_2^t)), \qquad
        u_t = \frac{m_t / (1 - \beta_1^t)}{\sqrt{\hat v^{max}_t + \epsilon_{root}} + \epsilon}.

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root (for meta-gradients).
      mu_dtype: dtype of the first moment (a ``torch.dtype`` or its name); ``None``: the param dtype.
      bias_correction_mu: divide the first moment by :math:`1 - \beta_1^t` (``False``: the paper's AMSGrad).
      bias_correction_nu: divide the second moment by :math:`1 - \beta_2^t` before the maximum.

    Returns:
      A transform with state :class:`ScaleByAmsgradState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_amsgrad()
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> for g in (4.0, 1.0):
        ...     u, state = tx.update({"w": torch.tensor([g])}, state)
        >>> state.nu_max["w"].tolist()   # the larger of 16 and (0.999 * 0.001 * 16 + 0.001) / (1 - 0.999^2)
        [16.0]

    References:
      Reddi et al., `On the Convergence of Adam and Beyond <https://openreview.net/forum?id=ryQu7f-RZ>`_, 2018.
    """
    check_nonnegative("scale_by_amsgrad", b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    mu_dtype = as_dtype(mu_dtype, "scale_by_amsgrad: mu_dtype")

    def init_fn(params):
        return ScaleByAmsgradState(count=counter(params), mu=tree.zeros_like(params, dtype=mu_dtype),
                                   nu=tree.zeros_like(params), nu_max=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        g, mu, nu, nu_max = tree.align(updates, state.mu, state.nu, state.nu_max)
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        mu, m = ema_(mu, g, b1)
        nu, v = ema_sq_(nu, g, b2)
        if bias_correction_nu:
            with tree.functional():
                v = tree.div_(v, bias_correction(b2, count, g))
        nu_max = _on_real_parts(tree.maximum_, nu_max, v)
        d = _root_(tree.copy_(g, nu_max), eps, eps_root)
        g = _quotient_(d, m, bias_correction(b1, count, g) if bias_correction_mu else None)
        return tree.put(updates, updates, g), ScaleByAmsgradState(
            count, tree.put(state.mu, updates, mu), tree.put(state.nu, updates, nu),
            tree.put(state.nu_max, updates, nu_max))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=True)
def scale_by_adamax(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8) -> GradientTransformation:
    r"""Rescales updates with AdaMax: Adam with an infinity-norm second moment (Optax's ``scale_by_adamax``).

    .. math::
        m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad
        u_t = \max(|g_t| + \epsilon, \beta_2 u_{t-1}), \qquad
        \text{update}_t = \frac{m_t}{(1 - \beta_1^t)\, u_t}.

    Args:
      b1: decay of the first moment.
      b2: decay of the infinity norm.
      eps: added to :math:`|g_t|` (keeps the denominator away from 0).

    Returns:
      A transform with state :class:`fxtrain.ScaleByAdamState` (``nu`` holds :math:`u_t`).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_adamax(eps=0.0)
        >>> g = {"w": torch.tensor([2.0, -0.5])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist(), state.nu["w"].tolist()
        ([1.0, -1.0], [2.0, 0.5])

    References:
      Kingma and Ba, `Adam: A Method for Stochastic Optimization <https://arxiv.org/abs/1412.6980>`_, 2014
      (section 7.1).
    """
    check_nonnegative("scale_by_adamax", b1=b1, b2=b2, eps=eps)

    def init_fn(params):
        return ScaleByAdamState(count=counter(params), mu=tree.zeros_like(params), nu=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        g, mu, nu = tree.align(updates, state.mu, state.nu)
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        mu, m = ema_(mu, g, b1)
        with tree.functional(_complex(g) or tree.is_functional()):  # torch has no in-place complex abs
            a = tree.abs_(g)
        a = tree.add_(a, eps)
        nu = _on_real_parts(tree.maximum_, tree.scale_(nu, b2), a)
        g = tree.div_(tree.div_(tree.copy_(g, m), bias_correction(b1, count, g)), nu)
        return tree.put(updates, updates, g), ScaleByAdamState(
            count, tree.put(state.mu, updates, mu), tree.put(state.nu, updates, nu))

    return GradientTransformation(init_fn, update_fn)


class ScaleByBeliefState(NamedTuple):
    """State of :func:`scale_by_belief` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_belief().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByBeliefState), state._fields
        (True, ('count', 'mu', 'nu'))
    """

    count: torch.Tensor  # 0-dim int32
    mu: Updates  # first moment
    nu: Updates  # second moment of the prediction error g - mu, plus eps_root


@transform(elementwise=True)
def scale_by_belief(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-16, eps_root: Scalar = 1e-16, *,
                    nesterov: bool = False) -> GradientTransformation:
    r"""Rescales updates with AdaBelief: Adam whose second moment tracks the gradient's deviation from
    its mean (Optax's ``scale_by_belief``).

    .. math::
        m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad
        s_t = \beta_2 s_{t-1} + (1 - \beta_2) |g_t - m_t|^2 + \epsilon_{root}, \\
        u_t = \frac{m_t / (1 - \beta_1^t)}{\sqrt{s_t / (1 - \beta_2^t)} + \epsilon},

    with NAdam's first moment (see :func:`fxtrain.scale_by_adam`) when ``nesterov``.

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment of the prediction error.
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment at every step (must be positive to differentiate through it).
      nesterov: use Nesterov momentum.

    Returns:
      A transform with state :class:`ScaleByBeliefState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_belief()
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> for _ in range(3):   # a constant gradient: the error g - m shrinks, the steps grow
        ...     u, state = tx.update({"w": torch.tensor([1.0, -1.0])}, state)
        >>> [round(x, 2) for x in u["w"].tolist()]   # Adam's: [1.0, -1.0]
        [1.23, -1.23]

    References:
      Zhuang et al., `AdaBelief Optimizer: Adapting Stepsizes by the Belief in Observed Gradients
      <https://arxiv.org/abs/2010.07468>`_, 2020.
    """
    check_nonnegative("scale_by_belief", b1=b1, b2=b2, eps=eps, eps_root=eps_root)

    def init_fn(params):
        return ScaleByBeliefState(count=counter(params), mu=tree.zeros_like(params), nu=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        g, mu, nu = tree.align(updates, state.mu, state.nu)
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        mu, m = ema_(mu, g, b1)
        if nesterov:  # g is still needed
            with tree.functional():
                error = tree.add_(g, m, -1)
        else:
            error = g = tree.add_(g, m, -1)
        nu, _ = ema_sq_(nu, error, b2)
        nu = tree.add_(nu, eps_root)
        bc1, bc2 = bias_correction(b1, count, g), bias_correction(b2, count, g)
        if nesterov:
            num = _nesterov_mean(m, g, b1, count)
            g = _quotient_(_root_(tree.copy_(g, nu), eps, bc=bc2), num)
        else:
            g = _quotient_(_root_(tree.copy_(g, nu), eps, bc=bc2), m, bc1)
        return tree.put(updates, updates, g), ScaleByBeliefState(
            count, tree.put(state.mu, updates, mu), tree.put(state.nu, updates, nu))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=True)
def scale_by_yogi(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-3, eps_root: Scalar = 0.0,
                  initial_accumulator_value: Scalar = 1e-6) -> GradientTransformation:
    r"""Rescales updates with Yogi: Adam whose second moment moves additively (Optax's ``scale_by_yogi``).

    .. math::
        m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad
        v_t = v_{t-1} - (1 - \beta_2) \operatorname{sign}(v_{t-1} - |g_t|^2)\, |g_t|^2, \\
        u_t = \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t) + \epsilon_{root}} + \epsilon}.

    Args:
      b1: decay of the first moment.
      b2: rate of the second moment's additive steps.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root (for meta-gradients).
      initial_accumulator_value: initial value of both moments (positive).

    Returns:
      A transform with state :class:`fxtrain.ScaleByAdamState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_yogi(initial_accumulator_value=0.0)
        >>> g = {"w": torch.tensor([2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> state.nu["w"].tolist()   # 0 - 0.001 * sign(0 - 4) * 4
        [0.004...]

    References:
      Zaheer et al., `Adaptive Methods for Nonconvex Optimization
      <https://papers.nips.cc/paper/8186-adaptive-methods-for-nonconvex-optimization>`_, 2018.
    """
    check_nonnegative("scale_by_yogi", b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                      initial_accumulator_value=initial_accumulator_value)

    def init_fn(params):
        return ScaleByAdamState(count=counter(params), mu=full_like(params, initial_accumulator_value),
                                nu=full_like(params, initial_accumulator_value))

    def update_fn(updates, state, params=None):
        del params
        g, mu, nu = tree.align(updates, state.mu, state.nu)
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        mu, m = ema_(mu, g, b1)
        sq = _abs_sq(g)
        with tree.functional():
            direction = tree.add_(nu, sq, -1)
        direction = _on_real_parts(tree.sign_, direction)
        nu = tree.addcmul_(nu, direction, sq, -(1 - b2))
        d = _root_(tree.copy_(g, nu), eps, eps_root, bias_correction(b2, count, g))
        g = _quotient_(d, m, bias_correction(b1, count, g))
        return tree.put(updates, updates, g), ScaleByAdamState(
            count, tree.put(state.mu, updates, mu), tree.put(state.nu, updates, nu))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=True)
def scale_by_radam(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8, eps_root: Scalar = 0.0,
                   threshold: Scalar = 5.0, *, nesterov: bool = False) -> GradientTransformation:
    r"""Rescales updates with Rectified Adam (Optax's ``scale_by_radam``).

    While the approximated length :math:`\rho_t` of the second moment's moving average is below
    ``threshold`` the update is the bias-corrected first moment (momentum SGD); after it, Adam's update
    times the rectification :math:`r_t`:

    .. math::
        \rho_\infty = \frac{2}{1 - \beta_2} - 1, \qquad
        \rho_t = \rho_\infty - \frac{2 t \beta_2^t}{1 - \beta_2^t}, \qquad
        r_t = \sqrt{\frac{(\rho_t - 4)(\rho_t - 2)\rho_\infty}{(\rho_\infty - 4)(\rho_\infty - 2)\rho_t}}, \\
        u_t = \hat m_t \;\text{ if } \rho_t < \text{threshold, else }\;
        r_t \frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}.

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root (for meta-gradients).
      threshold: the :math:`\rho_t` from which the adaptive update is used.
      nesterov: use Nesterov momentum (NAdam's :math:`\hat m_t`).

    Returns:
      A transform with state :class:`fxtrain.ScaleByAdamState`. The choice is made on the device.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_radam()
        >>> g = {"w": torch.tensor([3.0, -0.5])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist()   # rho_1 = 1 < 5: the first moment itself
        [3.0, -0.5]

    References:
      Liu et al., `On the Variance of the Adaptive Learning Rate and Beyond <https://arxiv.org/abs/1908.03265>`_,
      2020.
    """
    check_nonnegative("scale_by_radam", b1=b1, b2=b2, eps=eps, eps_root=eps_root, threshold=threshold)
    rho_inf = 2.0 / (1.0 - b2) - 1.0

    def rectification(count):
        """(``rho_t >= threshold``, ``r_t`` there and 1 elsewhere), 0-dim tensors."""
        # In float64: rho_t is a difference of two numbers near rho_inf (2 / (1 - b2) - 1 = 1999 by
        # default), which float32 (Optax's) gets 0.7% wrong at t = 5, the rectified steps' scale 2%.
        t = count.double()
        b2t = b2 ** t
        rho = rho_inf - 2 * t * b2t / (1 - b2t)
        r = ((rho - 4.0) * (rho - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho)).sqrt()
        on = rho >= threshold
        return on, torch.where(on, r, 1.0)  # r is NaN for rho < 4: never used

    def init_fn(params):
        return ScaleByAdamState(count=counter(params), mu=tree.zeros_like(params), nu=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        g, mu, nu = tree.align(updates, state.mu, state.nu)
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        mu, m = ema_(mu, g, b1)
        nu, v = ema_sq_(nu, g, b2)
        if nesterov:
            g = tree.copy_(g, _nesterov_mean(m, g, b1, count))
        else:
            g = tree.div_(tree.copy_(g, m), bias_correction(b1, count, g))  # g <- m_hat
        on, r = rectification(count)
        with tree.functional():
            d = tree.div_(v, bias_correction(b2, count, g))
        adaptive = _quotient_(_root_(d, eps, eps_root), g, 1 / r)
        g = tree.where_(on, adaptive, g)
        return tree.put(updates, updates, g), ScaleByAdamState(
            count, tree.put(state.mu, updates, mu), tree.put(state.nu, updates, nu))

    return GradientTransformation(init_fn, update_fn)


class ScaleByAdaDeltaState(NamedTuple):
    """State of :func:`scale_by_adadelta` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_adadelta().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByAdaDeltaState), state._fields
        (True, ('e_g', 'e_x'))
    """

    e_g: Updates  # moving average of squared gradients
    e_x: Updates  # moving average of squared updates


@transform(elementwise=True)
def scale_by_adadelta(rho: Scalar = 0.9, eps: Scalar = 1e-6) -> GradientTransformation:
    r"""Rescales updates with AdaDelta (Optax's ``scale_by_adadelta``).

    .. math::
        E[g^2]_t = \rho E[g^2]_{t-1} + (1 - \rho) g_t^2, \qquad
        u_t = \frac{\sqrt{E[u^2]_{t-1} + \epsilon}}{\sqrt{E[g^2]_t + \epsilon}}\, g_t, \qquad
        E[u^2]_t = \rho E[u^2]_{t-1} + (1 - \rho) u_t^2.

    Real parameters only (as Optax).

    Args:
      rho: decay of both moving averages.
      eps: added inside both square roots.

    Returns:
      A transform with state :class:`ScaleByAdaDeltaState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_adadelta(rho=0.5, eps=1.0)
        >>> g = {"w": torch.tensor([2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist(), state.e_g["w"].tolist()   # sqrt(0 + 1) / sqrt(2 + 1) * 2
        ([1.1547...], [2.0])

    References:
      Zeiler, `ADADELTA: An Adaptive Learning Rate Method <https://arxiv.org/abs/1212.5701>`_, 2012.
    """
    check_nonnegative("scale_by_adadelta", rho=rho, eps=eps)

    def init_fn(params):
        return ScaleByAdaDeltaState(e_g=tree.zeros_like(params), e_x=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        g, e_g, e_x = tree.align(updates, state.e_g, state.e_x)
        if g:
            e_g, v = ema_sq_(e_g, g, rho)
            with tree.functional():
                ratio, d = tree.add_(e_x, eps), tree.add_(v, eps)
            ratio = tree.div_(tree.sqrt_(ratio), tree.sqrt_(d))
            g = tree.scale_(g, ratio)
            e_x, _ = ema_sq_(e_x, g, rho)
        return tree.put(updates, updates, g), ScaleByAdaDeltaState(
            tree.put(state.e_g, updates, e_g), tree.put(state.e_x, updates, e_x))

    return GradientTransformation(init_fn, update_fn)


class ScaleByAdanState(NamedTuple):
    """State of :func:`scale_by_adan` (Optax's field names and order).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_adan().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByAdanState), state._fields
        (True, ('m', 'v', 'n', 'g', 't'))
    """

    m: Updates  # moving average of gradients
    v: Updates  # moving average of gradient differences
    n: Updates  # moving average of the squared Nesterov-corrected gradient
    g: Updates  # the previous gradient
    t: torch.Tensor  # 0-dim int32: number of updates so far


@transform(elementwise=True)
def scale_by_adan(b1: Scalar = 0.98, b2: Scalar = 0.92, b3: Scalar = 0.99, eps: Scalar = 1e-8,
                  eps_root: Scalar = 0.0) -> GradientTransformation:
    r"""Rescales updates with Adan, adaptive Nesterov momentum (Optax's ``scale_by_adan``).

    With :math:`\Delta_t = g_t - g_{t-1}` (0 at the first step):

    .. math::
        m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad v_t = \beta_2 v_{t-1} + (1 - \beta_2) \Delta_t, \\
        n_t = \beta_3 n_{t-1} + (1 - \beta_3) (g_t + (1 - \beta_2) \Delta_t)^2, \qquad
        u_t = \frac{\hat m_t + (1 - \beta_2) \hat v_t}{\sqrt{\hat n_t + \epsilon_{root}} + \epsilon},

    the hats dividing by :math:`1 - \beta_i^t`. Real parameters only (as Optax).

    Args:
      b1: decay of the gradients' average.
      b2: decay of the gradient differences' average.
      b3: decay of the squared term's average.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root (for meta-gradients).

    Returns:
      A transform with state :class:`ScaleByAdanState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_adan()
        >>> g = {"w": torch.tensor([2.0, -1.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist(), int(state.t)   # the first step is sign(g) up to eps
        ([1.0, -1.0], 1)

    References:
      Xie et al., `Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep Models
      <https://arxiv.org/abs/2208.06677>`_, 2022.
    """
    check_nonnegative("scale_by_adan", b1=b1, b2=b2, b3=b3, eps=eps, eps_root=eps_root)

    def init_fn(params):
        zeros = tree.zeros_like
        return ScaleByAdanState(m=zeros(params), v=zeros(params), n=zeros(params), g=zeros(params),
                                t=counter(params))

    def update_fn(updates, state, params=None):
        del params
        g, m, v, n, prev = tree.align(updates, state.m, state.v, state.n, state.g)
        first = state.t == 0
        t = safe_increment_(state.t)
        if not g:
            return updates, state._replace(t=t)
        with tree.functional():
            diff = tree.add_(g, prev, -1)
        diff = tree.zero_where_(first, diff)
        m, m_new = ema_(m, g, b1)
        v, v_new = ema_(v, diff, b2)
        nesterov_g = tree.add_(tree.scale_(diff, 1 - b2), g)  # written into diff
        n, n_new = ema_sq_(n, nesterov_g, b3)
        prev = tree.copy_(prev, g)
        # numerator m_hat + (1 - b2) v_hat in the scratch list, denominator in the gradient buffers
        num = tree.scale_(tree.div_(tree.copy_(nesterov_g, v_new), bias_correction(b2, t, g)), 1 - b2)
        with tree.functional():
            m_hat = tree.div_(m_new, bias_correction(b1, t, g))
        num = tree.add_(num, m_hat)
        g = _quotient_(_root_(tree.copy_(g, n_new), eps, eps_root, bias_correction(b3, t, g)), num)
        put = tree.put
        return put(updates, updates, g), ScaleByAdanState(
            put(state.m, updates, m), put(state.v, updates, v), put(state.n, updates, n),
            put(state.g, updates, prev), t)

    return GradientTransformation(init_fn, update_fn)


class ScaleByNovogradState(NamedTuple):
    """State of :func:`scale_by_novograd` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_novograd().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByNovogradState), state._fields
        (True, ('count', 'mu', 'nu'))
    """

    count: torch.Tensor  # 0-dim int32
    mu: Updates  # momentum of the normalized gradients, in mu_dtype (default: the param dtype)
    nu: Updates  # per leaf: a 0-dim moving average of the squared gradient norm, in the param dtype


@transform(elementwise=False)
def scale_by_novograd(b1: Scalar = 0.9, b2: Scalar = 0.25, eps: Scalar = 1e-8, eps_root: Scalar = 0.0,
                      weight_decay: Scalar = 0.0, mu_dtype: torch.dtype | str | None = None
                      ) -> GradientTransformation:
    r"""Rescales updates with NovoGrad: momentum of gradients normalized per layer (Optax's ``scale_by_novograd``).

    Per leaf (layer) :math:`l`, with :math:`v^l_1 = \|g^l_1\|^2` and :math:`m^l_0 = 0`:

    .. math::
        v^l_t = \beta_2 v^l_{t-1} + (1 - \beta_2) \|g^l_t\|^2, \qquad
        m^l_t = \beta_1 m^l_{t-1} + \frac{g^l_t}{\sqrt{v^l_t + \epsilon_{root}} + \epsilon} + \lambda \theta^l_t,
        \qquad u^l_t = m^l_t.

    Not elementwise (a norm per leaf): ``sharded_apply`` refuses it. On DTensor leaves the norms are the
    full tensors' (one reduction per leaf), the rest runs on the local pieces.

    Args:
      b1: decay of the momentum.
      b2: decay of the squared norms' average.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root (for meta-gradients).
      weight_decay: :math:`\lambda` (then ``update`` needs ``params``).
      mu_dtype: dtype of the momentum (a ``torch.dtype`` or its name); ``None``: the param dtype.

    Returns:
      A transform with state :class:`ScaleByNovogradState`. Updates keep the gradients' dtype.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_novograd(eps=0.0)
        >>> g = {"w": torch.tensor([3.0, 4.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist(), state.nu["w"].tolist()   # g / ||g||
        ([0.6..., 0.8...], 25.0)

    References:
      Ginsburg et al., `Stochastic Gradient Methods with Layer-wise Adaptive Moments for Training of Deep
      Networks <https://arxiv.org/abs/1905.11286>`_, 2019.
    """
    check_nonnegative("scale_by_novograd", b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay)
    mu_dtype = as_dtype(mu_dtype, "scale_by_novograd: mu_dtype")
    decays = not is_zero(weight_decay)

    def init_fn(params):
        return ScaleByNovogradState(count=counter(params), mu=tree.zeros_like(params, dtype=mu_dtype),
                                    nu=tree.map(lambda p: torch.zeros((), dtype=p.dtype, device=tree.local(p).device),
                                                params))

    def update_fn(updates, state, params=None):
        if decays:
            check_needs_params(f"weight_decay={weight_decay!r}", params)
        g, mu, nu, p = tree.align(updates, state.mu, state.nu, params if decays else updates)
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        sq = [n.square().to(v.dtype) for n, v in zip(block_norms(g).unbind(), nu)]  # 0-dim: cheap per leaf
        # The math on DTensors' local pieces: nu is a plain 0-dim tensor per leaf (a DTensor's full norm)
        g, mu, p = ([tree.local(x) for x in xs] for xs in (g, mu, p))
        # b2 nu + (1 - b2) sq, not a lerp: torch.lerp rounds 0-dim tensors differently under vmap
        nu = tree.add_(tree.scale_(nu, b2), sq, 1 - b2)
        nu = tree.where_(count == 1, sq, nu)  # the first step starts the average at the first norm
        with tree.functional():
            d = tree.add_(nu, eps_root)
        g = tree.div_(g, tree.add_(tree.sqrt_(d), eps))
        if decays:
            g = tree.add_(g, p, weight_decay)
        # m_0 = 0, so b1 * m + u is u itself at the first step (Optax's separate first branch)
        if mixed_dtypes(mu, g):  # as Optax (XLA): b1 rounded to mu's dtype, b1 * m + u in g's, stored rounded
            with tree.functional():
                new = tree.add_(tree.scale_(tree.copy_(g, mu), weak(b1, mu)), g)
            mu = tree.copy_(mu, new)
        else:
            mu = tree.add_(tree.scale_(mu, b1), g)
        g = tree.copy_(g, mu)  # the update is the stored momentum
        return tree.put(updates, updates, g), ScaleByNovogradState(
            count, tree.put(state.mu, updates, mu), tree.put(state.nu, updates, nu))

    return GradientTransformation(init_fn, update_fn)


class ScaleByOptimisticGradientState(NamedTuple):
    """State of :func:`scale_by_optimistic_gradient` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_optimistic_gradient().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByOptimisticGradientState), state._fields
        (True, ('is_initial_step', 'previous_gradient'))
    """

    is_initial_step: torch.Tensor  # 0-dim bool
    previous_gradient: Updates


@transform(elementwise=True)
def scale_by_optimistic_gradient(alpha: Scalar = 1.0, beta: Scalar = 1.0) -> GradientTransformation:
    r"""Optimistic gradients: extrapolates from the previous gradient (Optax's ``scale_by_optimistic_gradient``).

    .. math:: u_t = (\alpha + \beta)\, g_t - \beta\, g_{t-1}, \qquad g_0 := g_1
        \;(\text{the first update is } \alpha g_1).

    Args:
      alpha: weight of the current gradient (the step size of generalized optimistic gradient descent).
      beta: weight of the negative momentum (the optimism).

    Returns:
      A transform with state :class:`ScaleByOptimisticGradientState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_optimistic_gradient()
        >>> state = tx.init(torch.zeros(()))
        >>> for g in (2.0, 3.0, 4.0):
        ...     u, state = tx.update(torch.tensor(g), state)
        ...     print(u.item())   # g_1, then 2 g_t - g_{t-1}
        2.0
        4.0
        5.0

    References:
      Daskalakis et al., `Training GANs with Optimism <https://arxiv.org/abs/1711.00141>`_, 2017.
      Mokhtari et al., `A Unified Analysis of Extra-gradient and Optimistic Gradient Methods for Saddle
      Point Problems <https://arxiv.org/abs/1901.08511>`_, 2019.
    """
    check_nonnegative("scale_by_optimistic_gradient", alpha=alpha, beta=beta)

    def init_fn(params):
        return ScaleByOptimisticGradientState(
            is_initial_step=torch.ones((), dtype=torch.bool, device=param_device(params)),
            previous_gradient=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        g, prev = tree.align(updates, state.previous_gradient)
        if g:
            prev = tree.where_(state.is_initial_step, g, prev)  # no previous gradient yet: g itself
            prev = tree.scale_(prev, beta)
            with tree.functional():
                u = tree.scale_(g, alpha + beta)
            u = tree.add_(u, prev, -1)
            prev = tree.copy_(prev, g)
            g = tree.copy_(g, u)
        return tree.put(updates, updates, g), ScaleByOptimisticGradientState(
            torch.zeros_like(state.is_initial_step), tree.put(state.previous_gradient, updates, prev))

    return GradientTransformation(init_fn, update_fn)


# --- optimizers -------------------------------------------------------------------------------------

@transform(elementwise=None)
def adabelief(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-16,
              eps_root: Scalar = 1e-16, weight_decay: Scalar | Callable | None = None,
              weight_decay_mask: Mask | None = None, *, nesterov: bool = False) -> GradientTransformation:
    r"""AdaBelief (Optax's ``adabelief``): Adam whose step grows where gradients match their running mean.

    .. math:: \theta_{t+1} = \theta_t - \eta\, \left(\frac{\hat m_t}{\sqrt{\hat s_t} + \epsilon}
        + \lambda \theta_t\right)

    with :math:`\hat s_t` the bias-corrected second moment of :math:`g_t - m_t` (:func:`scale_by_belief`)
    and :math:`\lambda` = ``weight_decay`` (0 by default: none), decoupled as in :func:`fxtrain.adamw`
    and multiplied by the learning rate (Optax's ``adabelief``).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the second moment of the prediction error.
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment at every step.
      weight_decay: :math:`\lambda`, a number, a 0-dim tensor or a schedule; ``None`` (Optax's default):
        no weight decay.
      weight_decay_mask: where to decay (see :func:`fxtrain.adamw`'s ``mask``).
      nesterov: use Nesterov momentum.

    Returns:
      ``chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov), add_decayed_weights(weight_decay,
      weight_decay_mask)`` (only if ``weight_decay`` is not ``None``) ``, scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adabelief(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]   # sign(g) / 0.9: the first error g - m_1 is 0.9 g
        [-0.1111, 0.1111]

    References:
      Zhuang et al., `AdaBelief Optimizer: Adapting Stepsizes by the Belief in Observed Gradients
      <https://arxiv.org/abs/2010.07468>`_, 2020.
    """
    check_learning_rate("adabelief", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
           weight_decay=weight_decay)
    decay = [] if weight_decay is None else [add_decayed_weights(weight_decay, weight_decay_mask)]
    return chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov), *decay,
                 scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def adadelta(learning_rate: LearningRate | None = None, rho: Scalar = 0.9, eps: Scalar = 1e-6,
             weight_decay: Scalar | Callable = 0.0, weight_decay_mask: Mask | None = None
             ) -> GradientTransformation:
    r"""AdaDelta with optional weight decay (Optax's ``adadelta``).

    .. math:: \theta_{t+1} = \theta_t - \eta\, \frac{\sqrt{E[u^2]_{t-1} + \epsilon}}{\sqrt{E[g^2]_t + \epsilon}}
        (g_t + \lambda \theta_t)

    (see :func:`scale_by_adadelta`). Optax's default ``learning_rate=None`` leaves the direction unscaled
    and unsigned (an ascent); fxtrain refuses it: the paper's method is ``learning_rate=1.0``.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule (required, see above).
      rho: decay of both moving averages.
      eps: added inside both square roots.
      weight_decay: :math:`\lambda`, added to the gradient before the rescaling (a number, a 0-dim
        tensor or a schedule).
      weight_decay_mask: where to decay (see :func:`fxtrain.adamw`'s ``mask``).

    Returns:
      ``chain(add_decayed_weights(weight_decay, weight_decay_mask), scale_by_adadelta(rho, eps),
      scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adadelta(10.0)
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(5):
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        >>> round(float((params ** 2).sum()), 1)   # from 14.0, as Optax's example
        12.1

    References:
      Zeiler, `ADADELTA: An Adaptive Learning Rate Method <https://arxiv.org/abs/1212.5701>`_, 2012.
    """
    check_learning_rate("adadelta", learning_rate=learning_rate, rho=rho, eps=eps, weight_decay=weight_decay)
    return chain(add_decayed_weights(weight_decay, weight_decay_mask), scale_by_adadelta(rho, eps),
                 scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def adamax(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8
           ) -> GradientTransformation:
    r"""AdaMax: Adam with an infinity norm (Optax's ``adamax``).

    .. math:: \theta_{t+1} = \theta_t - \eta\, \frac{m_t}{(1 - \beta_1^t)\, u_t}, \qquad
        u_t = \max(|g_t| + \epsilon, \beta_2 u_{t-1})

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the infinity norm.
      eps: added to :math:`|g_t|`.

    Returns:
      ``chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adamax(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]
        [-0.1, 0.1]

    References:
      Kingma and Ba, `Adam: A Method for Stochastic Optimization <https://arxiv.org/abs/1412.6980>`_, 2014.
    """
    check_learning_rate("adamax", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
    return chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def adamaxw(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
            weight_decay: Scalar | Callable = 1e-4, mask: Mask | None = None) -> GradientTransformation:
    r"""AdaMax with decoupled weight decay (Optax's ``adamaxw``).

    .. math:: \theta_{t+1} = \theta_t - \eta \left(\frac{m_t}{(1 - \beta_1^t)\, u_t} + \lambda \theta_t\right)

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the infinity norm.
      eps: added to :math:`|g_t|`.
      weight_decay: :math:`\lambda`, a number, a 0-dim tensor or a schedule.
      mask: where to decay (see :func:`fxtrain.adamw`).

    Returns:
      ``chain(scale_by_adamax(b1, b2, eps), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adamaxw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]   # -0.1 * (sign(g) + 0.5 * params)
        [-0.15, 0.05]

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_, 2019.
    """
    check_learning_rate("adamaxw", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    return chain(scale_by_adamax(b1, b2, eps), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def adan(learning_rate: LearningRate, b1: Scalar = 0.98, b2: Scalar = 0.92, b3: Scalar = 0.99,
         eps: Scalar = 1e-8, eps_root: Scalar = 1e-8, weight_decay: Scalar | Callable = 0.0,
         mask: Mask | None = None) -> GradientTransformation:
    r"""Adan, adaptive Nesterov momentum, with decoupled weight decay (Optax's ``adan``).

    .. math:: \theta_{t+1} = \theta_t - \eta \left(\frac{\hat m_t + (1 - \beta_2) \hat v_t}
        {\sqrt{\hat n_t + \epsilon_{root}} + \epsilon} + \lambda \theta_t\right)

    (see :func:`scale_by_adan`). Real parameters only.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the gradients' average.
      b2: decay of the gradient differences' average.
      b3: decay of the squared term's average.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      weight_decay: :math:`\lambda`, a number, a 0-dim tensor or a schedule.
      mask: where to decay (see :func:`fxtrain.adamw`).

    Returns:
      ``chain(scale_by_adan(b1, b2, b3, eps, eps_root), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adan(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]
        [-0.1, 0.1]

    References:
      Xie et al., `Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep Models
      <https://arxiv.org/abs/2208.06677>`_, 2022.
    """
    check_learning_rate("adan", learning_rate=learning_rate, b1=b1, b2=b2, b3=b3, eps=eps, eps_root=eps_root,
           weight_decay=weight_decay)
    return chain(scale_by_adan(b1, b2, b3, eps, eps_root), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def amsgrad(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
            eps_root: Scalar = 0.0, mu_dtype: torch.dtype | str | None = None, bias_correction_mu: bool = True,
            bias_correction_nu: bool = True) -> GradientTransformation:
    r"""AMSGrad: Adam with a non-decreasing second moment (Optax's ``amsgrad``).

    .. math:: \theta_{t+1} = \theta_t - \eta\, \frac{\hat m_t}{\sqrt{\hat v^{max}_t + \epsilon_{root}} + \epsilon}

    (see :func:`scale_by_amsgrad`).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the param dtype.
      bias_correction_mu: bias-correct the first moment (``False``: the paper's AMSGrad).
      bias_correction_nu: bias-correct the second moment before the maximum.

    Returns:
      ``chain(scale_by_amsgrad(...), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.amsgrad(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]
        [-0.1, 0.1]

    References:
      Reddi et al., `On the Convergence of Adam and Beyond <https://openreview.net/forum?id=ryQu7f-RZ>`_, 2018.
    """
    check_learning_rate("amsgrad", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return chain(scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype, bias_correction_mu, bias_correction_nu),
                 scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def radam(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
          eps_root: Scalar = 0.0, threshold: Scalar = 5.0, *, nesterov: bool = False) -> GradientTransformation:
    r"""Rectified Adam (Optax's ``radam``): momentum SGD until the second moment is reliable, then
    rectified Adam (see :func:`scale_by_radam`).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      threshold: the approximated moving-average length from which the adaptive update is used.
      nesterov: use Nesterov momentum.

    Returns:
      ``chain(scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
      scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.radam(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]   # the first steps are momentum SGD
        [-0.3, 0.3]

    References:
      Liu et al., `On the Variance of the Adaptive Learning Rate and Beyond <https://arxiv.org/abs/1908.03265>`_,
      2020.
    """
    check_learning_rate("radam", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, threshold=threshold)
    return chain(scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def yogi(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-3
         ) -> GradientTransformation:
    r"""Yogi: Adam whose second moment moves additively (Optax's ``yogi``; see :func:`scale_by_yogi`).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: rate of the second moment's additive steps.
      eps: added to the denominator outside the square root.

    Returns:
      ``chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.yogi(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]
        [-0.1, 0.1]

    References:
      Zaheer et al., `Adaptive Methods for Nonconvex Optimization
      <https://papers.nips.cc/paper/8186-adaptive-methods-for-nonconvex-optimization>`_, 2018.
    """
    check_learning_rate("yogi", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
    return chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def novograd(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.25, eps: Scalar = 1e-6,
             eps_root: Scalar = 0.0, weight_decay: Scalar = 0.0) -> GradientTransformation:
    r"""NovoGrad: momentum of gradients normalized per layer (Optax's ``novograd``; see :func:`scale_by_novograd`).

    Not elementwise (a norm per leaf).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the momentum.
      b2: decay of the squared norms' average.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      weight_decay: :math:`\lambda`, added to the normalized gradient (a number or a 0-dim tensor).

    Returns:
      ``chain(scale_by_novograd(b1, b2, eps, eps_root, weight_decay), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.novograd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -4.0])}, tx.init(params), params)
        >>> u["w"].tolist()   # -0.1 * g / ||g||
        [-0.06..., 0.08...]

    References:
      Ginsburg et al., `Stochastic Gradient Methods with Layer-wise Adaptive Moments for Training of Deep
      Networks <https://arxiv.org/abs/1905.11286>`_, 2019.
    """
    check_learning_rate("novograd", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
           weight_decay=weight_decay)
    return chain(scale_by_novograd(b1, b2, eps, eps_root, weight_decay), scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def optimistic_gradient_descent(learning_rate: LearningRate, alpha: Scalar = 1.0, beta: Scalar = 1.0
                                ) -> GradientTransformation:
    r"""Optimistic gradient descent for min-max problems (Optax's ``optimistic_gradient_descent``).

    .. math:: \theta_{t+1} = \theta_t - \eta \left((\alpha + \beta)\, g_t - \beta\, g_{t-1}\right)

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      alpha: weight of the current gradient.
      beta: weight of the negative momentum (the optimism).

    Returns:
      ``chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.optimistic_gradient_descent(0.1)
        >>> params = torch.zeros(())
        >>> state = tx.init(params)
        >>> for g in (1.0, 2.0):
        ...     u, state = tx.update(torch.tensor(g), state, params)
        >>> round(u.item(), 6)   # -0.1 * (2 * 2 - 1)
        -0.3

    References:
      Mokhtari et al., `A Unified Analysis of Extra-gradient and Optimistic Gradient Methods for Saddle
      Point Problems <https://arxiv.org/abs/1901.08511>`_, 2019.
    """
    check_learning_rate("optimistic_gradient_descent", learning_rate=learning_rate, alpha=alpha, beta=beta)
    return chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def optimistic_adam(learning_rate: Scalar, optimism: Scalar | None = None, b1: Scalar = 0.9, b2: Scalar = 0.999,
                    eps: Scalar = 1e-8, eps_root: Scalar = 0.0, mu_dtype: torch.dtype | str | None = None, *,
                    nesterov: bool = True) -> GradientTransformation:
    r"""Optimistic Adam, the first interface (deprecated as in Optax: use :func:`optimistic_adam_v2`).

    Adam's direction :math:`a_t` (NAdam by default) made optimistic:

    .. math:: \theta_{t+1} = \theta_t - \left((\eta + o)\, a_t - o\, a_{t-1}\right), \qquad o = \text{optimism}

    Warns ``DeprecationWarning`` (Optax 0.2.8's message).

    Args:
      learning_rate: :math:`\eta`, a number or a 0-dim tensor (no schedule: it weights the optimism).
      optimism: :math:`o`; ``None``: ``learning_rate``.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the param dtype.
      nesterov: use Nesterov momentum.

    Returns:
      ``chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
      scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism), scale_by_learning_rate(1.0))``.

    Example:
        >>> import torch, warnings, fxtrain as fx
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     tx = fx.optimistic_adam(0.01)
        >>> str(caught[0].message)
        '`optimistic_adam` is deprecated, please use `optimistic_adam_v2` instead.'

    References:
      Daskalakis et al., `Training GANs with Optimism <https://arxiv.org/abs/1711.00141>`_, 2017.
    """
    warnings.warn("`optimistic_adam` is deprecated, please use `optimistic_adam_v2` instead.",
                  DeprecationWarning, stacklevel=3)
    if callable(learning_rate):
        raise ValueError("optimistic_adam: learning_rate cannot be a schedule (it weights the optimism); "
                         "use optimistic_adam_v2, which takes one")
    check_learning_rate("optimistic_adam", learning_rate=learning_rate, optimism=optimism, b1=b1, b2=b2, eps=eps,
           eps_root=eps_root)
    if optimism is None:
        optimism = learning_rate
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism),
                 scale_by_learning_rate(1.0))


@transform(elementwise=None)
def optimistic_adam_v2(learning_rate: LearningRate, *, alpha: Scalar = 1.0, beta: Scalar = 1.0, b1: Scalar = 0.9,
                       b2: Scalar = 0.999, eps: Scalar = 1e-8, eps_root: Scalar = 0.0,
                       mu_dtype: torch.dtype | str | None = None, nesterov: bool = True) -> GradientTransformation:
    r"""Optimistic Adam (Optax's ``optimistic_adam_v2``): optimistic gradients of Adam's direction.

    .. math:: \theta_{t+1} = \theta_t - \eta \left((\alpha + \beta)\, a_t - \beta\, a_{t-1}\right)

    with :math:`a_t` Adam's direction (NAdam by default, :func:`fxtrain.scale_by_adam`).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      alpha: weight of the current direction.
      beta: weight of the negative momentum (the optimism).
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the param dtype.
      nesterov: use Nesterov momentum.

    Returns:
      ``chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
      scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.optimistic_adam_v2(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]   # alpha times NAdam's first step
        [-0.1474, 0.1474]

    References:
      Daskalakis et al., `Training GANs with Optimism <https://arxiv.org/abs/1711.00141>`_, 2017.
    """
    check_learning_rate("optimistic_adam_v2", learning_rate=learning_rate, alpha=alpha, beta=beta, b1=b1, b2=b2, eps=eps,
           eps_root=eps_root)
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate))
