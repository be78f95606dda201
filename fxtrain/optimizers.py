"""Optimizers: chains of transforms with Optax's names, arguments, defaults and math. Nothing else here.

Each returns ``chain(...)`` exactly as Optax's alias does, so states line up with Optax's and the repr
shows the call, e.g. ``adamw(0.001, weight_decay=0.1)``. Learning rates are non-negative numbers,
0-dim tensors or schedules of the update count.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, chain, check_learning_rate, check_nonnegative, identity, transform
from fxtrain.transforms import _fused
from fxtrain.transforms._adam import scale_by_adam
from fxtrain.transforms._lion import scale_by_lion
from fxtrain.transforms._masking import Mask
from fxtrain.transforms._moments import LearningRate, Scalar, is_zero
from fxtrain.transforms._momentum import trace
from fxtrain.transforms._polyak import POLYAK_VARIANTS, scale_by_polyak
from fxtrain.transforms._rms import scale_by_rms, scale_by_rss, scale_by_stddev
from fxtrain.transforms._scaling import scale_by_learning_rate
from fxtrain.transforms._weight_decay import add_decayed_weights

# sgd, adam and adamw also declare the torch kernel that computes their whole chain in one call
# (fxtrain/transforms/_fused.py), for the arguments that kernel covers; steps that own their params use it.


def _fused_adam_covers(eps_root: Scalar, mu_dtype, nesterov: bool) -> bool:
    """Whether torch's fused Adam(W) kernel computes ``scale_by_adam`` with these arguments."""
    return is_zero(eps_root) and mu_dtype is None and not nesterov


def _descends(factory: Callable) -> Callable:
    """``factory``'s transforms refuse, at ``init``, a 0-dim tensor ``learning_rate`` below 0 (it would climb the loss).

    At ``init``, not at construction: ``inject_hyperparams`` rebuilds the optimizer with its tensors at every
    update, where reading a value would be a host sync; ``init`` runs once. Under a ``torch.func`` transform
    (a vmapped sweep's batched rates) the value is not read.
    """
    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        tx = factory(*args, **kwargs)
        learning_rate = args[0] if args else kwargs.get("learning_rate")
        if not isinstance(learning_rate, torch.Tensor):
            return tx
        init = tx.init

        def init_fn(params):
            if (not tree.transformed() and learning_rate.ndim == 0 and learning_rate.device.type != "meta"
                    and not learning_rate.is_complex() and bool(learning_rate.detach() < 0)):
                raise ValueError(f"{factory.__name__}: learning_rate={float(learning_rate):g} (a tensor) must be >= 0 "
                                 "(a negative learning rate climbs the loss)")
            return init(params)
        return tx._replace(init=init_fn)

    return build


@transform(elementwise=None)
@_descends
def sgd(learning_rate: LearningRate, momentum: Scalar | None = None, nesterov: bool = False,
        accumulator_dtype: torch.dtype | str | None = None) -> GradientTransformation:
    r"""Stochastic gradient descent, with optional (Nesterov) momentum (Optax's ``sgd``).

    .. math:: t_k = g_k + \beta t_{k-1}, \qquad \theta_{k+1} = \theta_k - \eta\, t_k
        \;\;(\text{Nesterov: } \theta_k - \eta\,(g_k + \beta t_k))

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      momentum: :math:`\beta`; ``None`` for plain SGD (no state).
      nesterov: use Nesterov momentum.
      accumulator_dtype: dtype of the momentum buffer; ``None``: the param dtype.

    Returns:
      ``chain(trace(momentum, nesterov, accumulator_dtype) or identity(), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.sgd(0.1, momentum=0.9)
        >>> tx
        sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.ones(2)}, tx.init(params), params)
        >>> fx.apply_updates(params, u)["w"].tolist()
        [0.9..., 0.9...]

    References:
      Sutskever et al., `On the importance of initialization and momentum in deep learning
      <http://proceedings.mlr.press/v28/sutskever13.pdf>`_, 2013.
    """
    check_learning_rate("sgd", learning_rate=learning_rate, momentum=momentum)
    tx = chain(
        trace(momentum, nesterov, accumulator_dtype) if momentum is not None else identity(),
        scale_by_learning_rate(learning_rate),
    )
    if accumulator_dtype is not None or is_zero(momentum):
        return tx  # torch's kernel keeps no buffer at momentum 0, where Optax's trace holds the gradient
    return _fused.declare(tx, "sgd", learning_rate=learning_rate, momentum=0.0 if momentum is None else momentum,
                          nesterov=nesterov and momentum is not None)


@transform(elementwise=None)
@_descends
def adam(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
         eps_root: Scalar = 0.0, mu_dtype: torch.dtype | str | None = None, *, nesterov: bool = False
         ) -> GradientTransformation:
    r"""Adam (Optax's ``adam``; NAdam with ``nesterov=True``).

    .. math:: \theta_{t+1} = \theta_t - \eta\, \frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}

    with :math:`\hat m_t, \hat v_t` the bias-corrected moments of :func:`fxtrain.scale_by_adam`.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the param dtype.
      nesterov: use Nesterov momentum (NAdam).

    Returns:
      ``chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
      scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adam(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> u["w"].tolist()
        [-0.1..., 0.1...]

    References:
      Kingma and Ba, `Adam: A Method for Stochastic Optimization <https://arxiv.org/abs/1412.6980>`_, 2014.
    """
    check_learning_rate("adam", learning_rate=learning_rate)
    tx = chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )
    if not _fused_adam_covers(eps_root, mu_dtype, nesterov):
        return tx
    return _fused.declare(tx, "adam", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)


@transform(elementwise=None)
@_descends
def adamw(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
          eps_root: Scalar = 0.0, mu_dtype: torch.dtype | str | None = None,
          weight_decay: Scalar | Callable = 1e-4, mask: Mask | None = None, *, nesterov: bool = False
          ) -> GradientTransformation:
    r"""Adam with decoupled weight decay (Optax's ``adamw``).

    .. math:: \theta_{t+1} = \theta_t - \eta \left(\frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}
        + \lambda \theta_t\right)

    The decay is multiplied by the learning rate, as in torch.optim.AdamW (not by the schedule
    multiplier only, as in Loshchilov and Hutter).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the param dtype.
      weight_decay: :math:`\lambda`, a number, a 0-dim tensor or a schedule.
      mask: where to decay: a tree of bools (the params' structure or a prefix) or a function of the
        params returning one; ``None``: everywhere. Adam itself applies to all params.
      nesterov: use Nesterov momentum (NAdamW).

    Returns:
      ``chain(scale_by_adam(...), add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adamw(1e-3, weight_decay=0.1, mask=lambda p: {"w": True, "b": False})
        >>> tx
        adamw(0.001, weight_decay=0.1, mask=<lambda>)
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> u, state = tx.update(params, tx.init(params), params)
        >>> u["w"].tolist(), u["b"].tolist()
        ([-0.0011..., -0.0011...], [-0.001...])

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_, 2019.
    """
    check_learning_rate("adamw", learning_rate=learning_rate)
    tx = chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
    if mask is not None or not _fused_adam_covers(eps_root, mu_dtype, nesterov):
        return tx
    return _fused.declare(tx, "adamw", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                          weight_decay=weight_decay)


@transform(elementwise=None)
@_descends
def lion(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.99,
         mu_dtype: torch.dtype | str | None = None, weight_decay: Scalar | Callable = 1e-3,
         mask: Mask | None = None) -> GradientTransformation:
    r"""Lion: the sign of an interpolated momentum, with decoupled weight decay (Optax's ``lion``).

    .. math:: \theta_{t+1} = \theta_t - \eta \left(\operatorname{sign}((1 - \beta_1) g_t + \beta_1 m_{t-1})
        + \lambda \theta_t\right), \qquad m_t = \beta_2 m_{t-1} + (1 - \beta_2) g_t

    Args:
      learning_rate: :math:`\eta` (typically 3-10x smaller than AdamW's), a number, a 0-dim tensor or
        a schedule.
      b1: weight of the momentum in the interpolation.
      b2: decay of the momentum.
      mu_dtype: dtype of the momentum; ``None``: the param dtype.
      weight_decay: :math:`\lambda`, a number, a 0-dim tensor or a schedule.
      mask: where to decay (see :func:`adamw`).

    Returns:
      ``chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.lion(0.1, weight_decay=0.0)
        >>> params = {"w": torch.ones(2)}
        >>> u, _ = tx.update({"w": torch.tensor([0.3, -5.0])}, tx.init(params), params)
        >>> u["w"].tolist()
        [-0.1..., 0.1...]

    References:
      Chen et al., `Symbolic Discovery of Optimization Algorithms <https://arxiv.org/abs/2302.06675>`_, 2023.
    """
    check_learning_rate("lion", learning_rate=learning_rate)
    return chain(
        scale_by_lion(b1, b2, mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


@transform(elementwise=None)
@_descends
def rmsprop(learning_rate: LearningRate, decay: Scalar = 0.9, eps: Scalar = 1e-8,
            initial_scale: Scalar = 0.0, eps_in_sqrt: bool = True, centered: bool = False,
            momentum: Scalar | None = None, nesterov: bool = False, bias_correction: bool = False
            ) -> GradientTransformation:
    r"""RMSProp, optionally centered and with momentum (Optax's ``rmsprop``).

    .. math:: \theta_{t+1} = \theta_t - \eta\, \frac{g_t}{\sqrt{\hat\nu_t + \epsilon}}

    (centered: :math:`\hat\nu_t - \hat\mu_t^2` under the root; ``eps_in_sqrt=False``: :math:`\epsilon`
    outside it, as torch.optim.RMSprop), followed by :func:`fxtrain.trace` when ``momentum`` is set.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      decay: decay of the moving averages.
      eps: added to the denominator (see ``eps_in_sqrt``).
      initial_scale: initial value of the second moment.
      eps_in_sqrt: add ``eps`` inside the square root (Optax's default) or outside.
      centered: divide by the estimated standard deviation instead of the root mean square.
      momentum: momentum applied after the learning rate; ``None``: none.
      nesterov: use Nesterov momentum.
      bias_correction: bias-correct the moving averages.

    Returns:
      ``chain(scale_by_rms(...) or scale_by_stddev(...), scale_by_learning_rate(learning_rate),
      trace(momentum, nesterov) or identity())``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.rmsprop(0.1, decay=0.75, eps=0.0)
        >>> params = {"w": torch.ones(1)}
        >>> u, _ = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> u["w"].tolist()
        [-0.2...]

    References:
      Hinton, `Lecture 6.5 - rmsprop <https://www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf>`_, 2012.
      Graves, `Generating Sequences With Recurrent Neural Networks <https://arxiv.org/abs/1308.0850>`_, 2013.
    """
    check_learning_rate("rmsprop", learning_rate=learning_rate, momentum=momentum)
    rescale = scale_by_stddev if centered else scale_by_rms
    return chain(
        rescale(decay=decay, eps=eps, initial_scale=initial_scale, eps_in_sqrt=eps_in_sqrt,
                bias_correction=bias_correction),
        scale_by_learning_rate(learning_rate),
        trace(decay=momentum, nesterov=nesterov) if momentum is not None else identity(),
    )


@transform(elementwise=None)
@_descends
def adagrad(learning_rate: LearningRate, initial_accumulator_value: Scalar = 0.1, eps: Scalar = 1e-7
            ) -> GradientTransformation:
    r"""Adagrad: steps divided by the root of the sum of all squared gradients (Optax's ``adagrad``).

    .. math:: s_t = s_{t-1} + g_t^2, \qquad \theta_{t+1} = \theta_t - \eta\, \frac{g_t}{\sqrt{s_t + \epsilon}}

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      initial_accumulator_value: initial value of :math:`s`.
      eps: added inside the square root (torch.optim.Adagrad adds it outside).

    Returns:
      ``chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adagrad(1.0, initial_accumulator_value=0.0, eps=0.0)
        >>> params = {"w": torch.ones(1)}
        >>> u, _ = tx.update({"w": torch.tensor([4.0])}, tx.init(params), params)
        >>> u["w"].tolist()
        [-1.0]

    References:
      Duchi et al., `Adaptive Subgradient Methods for Online Learning and Stochastic Optimization
      <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011.
    """
    check_learning_rate("adagrad", learning_rate=learning_rate)
    return chain(
        scale_by_rss(initial_accumulator_value=initial_accumulator_value, eps=eps),
        scale_by_learning_rate(learning_rate),
    )


@transform(elementwise=None)
def nadam(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
          eps_root: Scalar = 0.0, mu_dtype: torch.dtype | str | None = None, *, nesterov: bool = True
          ) -> GradientTransformation:
    r"""NAdam: Adam with Nesterov momentum (Optax's ``nadam``, that is ``adam(..., nesterov=True)``).

    .. math:: \theta_{t+1} = \theta_t - \eta\, \frac{\beta_1 m_t / (1 - \beta_1^{t+1}) + (1 - \beta_1) g_t /
        (1 - \beta_1^t)}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the param dtype.
      nesterov: use Nesterov momentum (``False``: plain Adam).

    Returns:
      :func:`fxtrain.adam`'s chain with ``nesterov=nesterov``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.nadam(0.1)
        >>> tx
        nadam(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]   # Adam's first step times 1 + b1 / (1 + b1)
        [-0.1474, 0.1474]

    References:
      Dozat, `Incorporating Nesterov Momentum into Adam <https://openreview.net/pdf?id=OM0jvwB8jIp57ZJjtNEZ>`_, 2016.
    """
    check_learning_rate("nadam", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)


@transform(elementwise=None)
def nadamw(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
           eps_root: Scalar = 0.0, mu_dtype: torch.dtype | str | None = None,
           weight_decay: Scalar | Callable = 1e-4, mask: Mask | None = None, *, nesterov: bool = True
           ) -> GradientTransformation:
    r"""NAdamW: NAdam with decoupled weight decay (Optax's ``nadamw``, that is ``adamw(..., nesterov=True)``).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      mu_dtype: dtype of the first moment; ``None``: the param dtype.
      weight_decay: :math:`\lambda`, a number, a 0-dim tensor or a schedule.
      mask: where to decay (see :func:`fxtrain.adamw`).
      nesterov: use Nesterov momentum (``False``: plain AdamW).

    Returns:
      :func:`fxtrain.adamw`'s chain with ``nesterov=nesterov``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.nadamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(2)}
        >>> u, state = tx.update({"w": torch.tensor([3.0, -3.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]   # -0.1 * (1.474 sign(g) + 0.5 * params)
        [-0.1974, 0.0974]

    References:
      Dozat, `Incorporating Nesterov Momentum into Adam <https://openreview.net/pdf?id=OM0jvwB8jIp57ZJjtNEZ>`_, 2016.
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_, 2019.
    """
    check_learning_rate("nadamw", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
           weight_decay=weight_decay)
    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=nesterov)


@transform(elementwise=None)
def polyak_sgd(max_learning_rate: Scalar = 1.0, scaling: LearningRate = 1.0, f_min: Scalar = 0.0,
               eps: Scalar = 0.0, variant: Literal["sps", "sps+"] = "sps") -> GradientTransformation:
    r"""SGD with Polyak's step size (Optax's ``polyak_sgd``).

    .. math::
        x_{t+1} = x_t - s_t \min\left\{\frac{f(x_t) - f^\star}{\|\nabla f(x_t)\|^2 + \epsilon},
        \gamma_{\max}\right\} \nabla f(x_t)

    Args:
      max_learning_rate: :math:`\gamma_{\max}`, the largest step size.
      scaling: :math:`s_t`, a number, a 0-dim tensor or a schedule.
      f_min: :math:`f^\star`, a lower bound on the objective (0 for models that interpolate the data).
      eps: :math:`\epsilon`, added to the denominator.
      variant: ``"sps"``, or ``"sps+"`` (the gap's positive part).

    Returns:
      ``chain(sgd(learning_rate=scaling), scale_by_polyak(...))``; its ``update`` requires ``value=``.

    Example:
        >>> import torch, fxtrain as fx
        >>> f = lambda p: (p["x"] ** 2).sum()
        >>> params = {"x": torch.tensor([1.0, 2.0, 3.0])}
        >>> tx = fx.polyak_sgd()
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     value, grads = f(params), {"x": 2 * params["x"]}
        ...     u, state = tx.update(grads, state, params, value=value)
        ...     params = fx.apply_updates(params, u)
        >>> round(f(params).item(), 4)   # each step halves x: 14 / 4**3
        0.2188

    References:
      Loizou et al., `Stochastic Polyak step-size for SGD: An adaptive learning rate for fast convergence
      <https://arxiv.org/abs/2002.10542>`_, 2021.

      Berrada et al., `Training neural networks for and by interpolation
      <https://arxiv.org/abs/1906.05661>`_, 2020.
    """
    check_nonnegative("polyak_sgd", max_learning_rate=max_learning_rate, eps=eps)
    if variant not in POLYAK_VARIANTS:
        raise ValueError(f"polyak_sgd: variant={variant!r} must be one of {POLYAK_VARIANTS}")
    return chain(sgd(learning_rate=scaling),
                 scale_by_polyak(f_min=f_min, max_learning_rate=max_learning_rate, eps=eps, variant=variant))
