"""Memory-light second moments: ``scale_by_factored_rms`` and ``adafactor``, ``scale_by_sm3`` and ``sm3``
(Optax's math and state).

Both keep, for a matrix, statistics per row and per column instead of per element, so both reduce
across elements (``elementwise=False``: ``sharded_apply`` refuses them). The reductions are per leaf:
torch has no foreach mean or amax, so factored leaves run a short chain of torch ops each; leaves kept
whole (vectors, small matrices) go through the op layer's foreach kernels.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Updates, chain, check_needs_params, check_nonnegative, transform

from fxtrain.transforms._masking import Mask
from fxtrain.transforms._moments import LearningRate, Scalar, as_dtype, counter, safe_increment_
from fxtrain.transforms._normalizing import clip_by_block_rms, scale_by_param_block_rms
from fxtrain.transforms._scaling import scale, scale_by_learning_rate
from fxtrain.transforms._simple import ema
from fxtrain.transforms._weight_decay import add_decayed_weights

__all__ = ["FactoredState", "ScaleBySM3State", "adafactor", "scale_by_factored_rms", "scale_by_sm3", "sm3"]

def _abs_sq(x: torch.Tensor) -> torch.Tensor:
    return (x * x.conj()).real if x.is_complex() else x * x


def _pick(xs: list, index: list[int]) -> list:
    return [xs[i] for i in index]


def _place(xs: list, index: list[int], new: list) -> None:
    """Writes ``new`` at positions ``index`` of the list ``xs`` (the inverse of :func:`_pick`)."""
    for i, x in zip(index, new):
        xs[i] = x


# --- Adafactor's factored second moments ----------------------------------------------------------

class FactoredState(NamedTuple):
    """State of :func:`scale_by_factored_rms` (Optax's fields). A factored leaf keeps ``v_row`` and ``v_col``
    (its shape without the largest, resp. second-largest, dim) and a 1-element placeholder ``v``; any
    other leaf keeps ``v`` (its shape) and 1-element placeholders ``v_row``, ``v_col``.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_factored_rms().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.FactoredState), state._fields
        (True, ('count', 'v_row', 'v_col', 'v'))
    """

    count: torch.Tensor  # 0-dim int32
    v_row: Updates
    v_col: Updates
    v: Updates


def _decay_rate_pow(step: torch.Tensor, exponent: Scalar = 0.8) -> torch.Tensor:
    """Adafactor's second-moment decay ``1 - (step + 1) ** -exponent`` (float32, on device)."""
    t = (step + 1).to(torch.float32)
    return 1.0 - t ** -exponent


def _factored_dims(shape: torch.Size, factored: bool, min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """``(second largest dim, largest dim)`` of a shape that is factored, ``None`` otherwise (Optax's rule;
    ties keep the dims' order)."""
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda i: shape[i])
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return order[-2], order[-1]


@transform(elementwise=False)
def scale_by_factored_rms(factored: bool = True, decay_rate: Scalar = 0.8, step_offset: int | torch.Tensor = 0,
                          min_dim_size_to_factor: int = 128, epsilon: Scalar = 1e-30,
                          decay_rate_fn: Callable[[torch.Tensor, Scalar], torch.Tensor] = _decay_rate_pow
                          ) -> GradientTransformation:
    r"""Divides updates by a factored estimate of the root mean square of the gradients (Adafactor's).

    With :math:`\beta_t` = ``decay_rate_fn(count - step_offset, decay_rate)`` (default
    :math:`1 - (t + 1)^{-0.8}`) and :math:`s = |g|^2 + \epsilon`: a leaf whose two largest dims are at
    least ``min_dim_size_to_factor`` keeps averages over its largest dim :math:`R` and over its second
    largest :math:`C`,

    .. math::
        r_t = \beta_t r_{t-1} + (1 - \beta_t)\, \operatorname{mean}_C s, \qquad
        c_t = \beta_t c_{t-1} + (1 - \beta_t)\, \operatorname{mean}_R s, \qquad
        u = g \Big/ \sqrt{\frac{r_t\, c_t}{\operatorname{mean}(r_t)}};

    any other leaf keeps :math:`v_t = \beta_t v_{t-1} + (1 - \beta_t) s` and gets :math:`u = g / \sqrt{v_t}`.

    Args:
      factored: factor matrices at all (``False``: every leaf keeps a full second moment).
      decay_rate: the exponent handed to ``decay_rate_fn``.
      step_offset: subtracted from the count (to restart the decay schedule when fine-tuning).
      min_dim_size_to_factor: factor a leaf only if its two largest dims are at least this size.
      epsilon: added to the squared gradients.
      decay_rate_fn: ``(step, decay_rate) -> decay`` on device (``step`` a 0-dim int tensor).

    Returns:
      A transform with state :class:`FactoredState`; it needs the params (their shapes and dtypes).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_factored_rms(min_dim_size_to_factor=2)
        >>> params = {"w": torch.ones(2, 3)}
        >>> state = tx.init(params)
        >>> [tuple(x.shape) for x in (state.v_row["w"], state.v_col["w"], state.v["w"])]
        [(2,), (3,), (1,)]
        >>> u, state = tx.update({"w": torch.full((2, 3), 2.0)}, state, params)
        >>> u["w"][0].tolist()   # g / rms(g) at the first step
        [1.0, 1.0, 1.0]

    References:
      Shazeer and Stern, `Adafactor: Adaptive Learning Rates with Sublinear Memory Cost
      <https://arxiv.org/abs/1804.04235>`_, 2018.
    """
    check_nonnegative("scale_by_factored_rms", decay_rate=decay_rate, epsilon=epsilon)

    def dims(x):
        return _factored_dims(x.shape, factored, min_dim_size_to_factor)

    def placeholder(x):
        return x.new_zeros((1,))

    def init_fn(params):
        def v_row(x):
            d = dims(x)
            return placeholder(x) if d is None else x.new_zeros(x.shape[:d[1]] + x.shape[d[1] + 1:])

        def v_col(x):
            d = dims(x)
            return placeholder(x) if d is None else x.new_zeros(x.shape[:d[0]] + x.shape[d[0] + 1:])

        def v(x):
            return torch.zeros_like(x) if dims(x) is None else placeholder(x)

        return FactoredState(counter(params), tree.map(v_row, params), tree.map(v_col, params), tree.map(v, params))

    def factored_update(g, row, col, p, decay):
        """One factored leaf: (update, v_row, v_col), new tensors."""
        d1, d0 = dims(p)
        sq = _abs_sq(g) + epsilon
        row = (decay * row + (1 - decay) * sq.mean(dim=d0)).to(p.dtype)
        col = (decay * col + (1 - decay) * sq.mean(dim=d1)).to(p.dtype)
        row_mean = row.mean(dim=d1 - 1 if d1 > d0 else d1, keepdim=True)
        u = g * (row / row_mean).rsqrt().unsqueeze(d0) * col.rsqrt().unsqueeze(d1)
        return u.to(g.dtype), row, col

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_factored_rms", params)
        g, row, col, v, p = tree.align(updates, state.v_row, state.v_col, state.v, params, what="state")
        decay = decay_rate_fn(state.count - step_offset, decay_rate)
        count = safe_increment_(state.count)
        whole = [i for i, x in enumerate(p) if dims(x) is None]
        parts = [i for i, x in enumerate(p) if dims(x) is not None]
        g, row, col, v = list(g), list(row), list(col), list(v)
        if whole:  # v <- decay * v + (1 - decay) * (|g|^2 + eps); g <- g / sqrt(v), with foreach kernels
            gw, vw = _pick(g, whole), _pick(v, whole)
            with tree.functional():
                sq = tree.add_([_abs_sq(x) for x in gw], epsilon)
            vw = tree.add_(tree.scale_(vw, decay), sq, 1 - decay)
            with tree.functional():
                root = tree.sqrt_(vw)
            _place(g, whole, tree.div_(gw, root))
            _place(v, whole, vw)
        if parts:  # per-leaf reductions (torch has no foreach mean)
            new = [factored_update(g[i], row[i], col[i], p[i], decay) for i in parts]
            _place(g, parts, tree.copy_(_pick(g, parts), [u for u, _, _ in new]))
            _place(row, parts, tree.copy_(_pick(row, parts), [r for _, r, _ in new]))
            _place(col, parts, tree.copy_(_pick(col, parts), [c for _, _, c in new]))
        return tree.put(updates, updates, g), FactoredState(
            count, tree.put(state.v_row, updates, row), tree.put(state.v_col, updates, col),
            tree.put(state.v, updates, v))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def adafactor(learning_rate: LearningRate | None = None, min_dim_size_to_factor: int = 128,
              decay_rate: Scalar = 0.8, decay_offset: int | torch.Tensor = 0,
              multiply_by_parameter_scale: bool = True, clipping_threshold: Scalar | None = 1.0,
              momentum: Scalar | None = None, dtype_momentum: torch.dtype | str = torch.float32,
              weight_decay_rate: Scalar | Callable | None = None, eps: Scalar = 1e-30, factored: bool = True,
              weight_decay_mask: Mask | None = None) -> GradientTransformation:
    r"""Adafactor: factored second moments, update clipping, steps relative to the params' scale (Optax's).

    .. math::
        u_t = \operatorname{clip}_{rms \le d}\!\left(\frac{g_t}{\sqrt{\hat v_t}}\right), \qquad
        \theta_{t+1} = \theta_t - \eta_t \max(\operatorname{rms}(\theta_t), 10^{-3})\, u_t

    with :math:`\hat v_t` from :func:`scale_by_factored_rms` and :math:`d` = ``clipping_threshold``;
    optionally a moving average of the updates (``momentum``) and weight decay.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule; ``None``: 1 (a descent: the
        update is already relative to the params' scale).
      min_dim_size_to_factor: factor a leaf only if its two largest dims are at least this size.
      decay_rate: the second moments' decay exponent (see :func:`scale_by_factored_rms`).
      decay_offset: subtracted from the step count in the decay schedule (fine-tuning).
      multiply_by_parameter_scale: scale each leaf's step by the root mean square of its param.
      clipping_threshold: clip each leaf's update to this root mean square (``None``: no clipping).
      momentum: decay of a moving average of the updates (``None``: none, no memory).
      dtype_momentum: dtype of that moving average.
      weight_decay_rate: add ``weight_decay_rate * params`` (``None``: no decay); a number or a schedule.
      eps: added to the squared gradients.
      factored: factor the second moments at all.
      weight_decay_mask: where to decay (see :func:`fxtrain.masked`).

    Returns:
      ``chain(scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps),
      clip_by_block_rms(clipping_threshold), scale_by_learning_rate(learning_rate, flip_sign=False),
      scale_by_param_block_rms(), ema(momentum, debias=False, accumulator_dtype=dtype_momentum),
      add_decayed_weights(weight_decay_rate, weight_decay_mask), scale(-1))``, each optional step only when
      enabled.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adafactor(learning_rate=0.01)
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> u, _ = tx.update({"w": torch.tensor([3.0, 3.0])}, tx.init(params), params)
        >>> u["w"].tolist()   # -0.01 * rms(w) * g / |g|
        [-0.0158..., -0.0158...]

    References:
      Shazeer and Stern, `Adafactor: Adaptive Learning Rates with Sublinear Memory Cost
      <https://arxiv.org/abs/1804.04235>`_, 2018.
    """
    check_nonnegative("adafactor", learning_rate=learning_rate, decay_rate=decay_rate, momentum=momentum,
                      eps=eps, clipping_threshold=clipping_threshold)
    txs = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        txs.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        txs.append(scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        txs.append(scale_by_param_block_rms())
    if momentum is not None:
        txs.append(ema(momentum, debias=False, accumulator_dtype=as_dtype(dtype_momentum, "adafactor: dtype_momentum")))
    if weight_decay_rate is not None:
        txs.append(add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    txs.append(scale(-1))
    return chain(*txs)


# --- SM3 --------------------------------------------------------------------------------------------

class ScaleBySM3State(NamedTuple):
    """State of :func:`scale_by_sm3` (Optax's fields).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_sm3().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleBySM3State), state._fields
        (True, ('mu', 'nu'))
    """

    mu: Any  # per leaf, a list of one vector per dim: the accumulator's max over the other dims
    nu: Updates  # the momentum of the preconditioned updates (the updates themselves)


def _expanded(v: torch.Tensor, axis: int, ndim: int) -> torch.Tensor:
    """The vector ``v`` of dim ``axis`` shaped to broadcast against an ``ndim`` tensor."""
    return v.view([1] * axis + [-1] + [1] * (ndim - axis - 1))


@transform(elementwise=False)
def scale_by_sm3(b1: Scalar = 0.9, b2: Scalar = 1.0, eps: Scalar = 1e-8) -> GradientTransformation:
    r"""SM3's preconditioner: second moments kept as one vector per dim, with momentum (Optax's).

    For a leaf with dims :math:`1..k` and per-dim vectors :math:`\mu^{(i)}`, elementwise:

    .. math::
        a_t = (1 - b_2)\, g_t^2 + b_2 \min_i \mu^{(i)}_{t-1} \quad (b_2 = 1:\; g_t^2 + \min_i \mu^{(i)}_{t-1}),
        \qquad \nu_t = b_1 \nu_{t-1} + (1 - b_1) \frac{g_t}{\sqrt{a_t + \epsilon}}
        \;(0 \text{ where } a_t = 0),

    then :math:`\mu^{(i)}_t` is the max of :math:`a_t` over every dim but :math:`i`; the update is
    :math:`\nu_t`. A vector keeps :math:`a_t` itself. A 0-dim leaf has no accumulator in Optax's state
    (Optax fails on one): here it uses :math:`a_t = (1 - b_2) g_t^2` (or :math:`g_t^2`).

    Args:
      b1: decay of the momentum.
      b2: decay of the accumulator (1: a running sum, as in the paper).
      eps: added to the accumulator inside the root.

    Returns:
      A transform with state :class:`ScaleBySM3State`. Complex params are refused (as Optax does).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_sm3(b1=0.0)
        >>> params = {"w": torch.zeros(2, 2)}
        >>> u, state = tx.update({"w": torch.tensor([[3.0, 0.0], [0.0, 4.0]])}, tx.init(params))
        >>> u["w"].tolist(), state.mu["w"][0].tolist()
        ([[1.0, 0.0], [0.0, 1.0]], [9.0, 16.0])

    References:
      Anil et al., `Memory-Efficient Adaptive Optimization <https://arxiv.org/abs/1901.11150>`_, 2019.
    """
    check_nonnegative("scale_by_sm3", b1=b1, b2=b2, eps=eps)
    if isinstance(b2, torch.Tensor):  # Optax's (1 - b2 if b2 != 1 else 1), decided on device
        c0 = torch.where(b2 != 1, 1 - b2, torch.ones_like(b2))
    else:
        c0 = 1 - b2 if b2 != 1 else 1.0

    def init_fn(params):
        for x in tree.leaves(params):
            if isinstance(x, torch.Tensor) and x.is_complex():
                raise ValueError("scale_by_sm3 does not support complex params (as in Optax)")
        mu = tree.map(lambda x: [x.new_zeros(n) for n in x.shape], params)
        return ScaleBySM3State(mu=mu, nu=tree.zeros_like(params))

    def accumulate(g, vs):
        """One leaf: the new accumulator ``a_t`` (a new tensor)."""
        a = c0 * g * g
        if vs:
            a = a + b2 * functools.reduce(torch.minimum, [_expanded(v, i, g.ndim) for i, v in enumerate(vs)])
        return a.to(g.dtype)

    def update_fn(updates, state, params=None):
        del params
        g, nu = tree.align(updates, state.nu)
        mu_lists = [m for m, x in zip(_flat_lists(state.mu, updates), tree.flatten(updates)[0]) if x is not None]
        acc = [accumulate(x, vs) for x, vs in zip(g, mu_lists)]
        inv = [torch.where(a > 0, torch.rsqrt(a + eps), 0.0).to(a.dtype) for a in acc]
        with tree.functional():
            up = tree.scale_(g, inv)
        nu = tree.add_(tree.scale_(nu, b1), up, 1 - b1)
        g = tree.copy_(g, nu)
        new_mu = [[a] if a.ndim == 1 else
                  [a.amax(dim=[j for j in range(a.ndim) if j != i]) for i in range(a.ndim)] for a in acc]
        if tree.is_functional():
            mu = _put_lists(state.mu, updates, new_mu)
        else:  # written into the state's vectors, one foreach copy
            tree.copy_([x for xs in mu_lists for x in xs], [x for xs in new_mu for x in xs])
            mu = state.mu
        return tree.put(updates, updates, g), ScaleBySM3State(mu, tree.put(state.nu, updates, nu))

    return GradientTransformation(init_fn, update_fn)


def _flat_lists(mu: Any, updates: Updates) -> list:
    """SM3's ``mu`` cut at the leaves of ``updates``: one list of per-dim vectors per leaf, in leaf order."""
    return tree.structure(updates).flatten_up_to(mu)


def _put_lists(mu: Any, updates: Updates, new: list) -> Any:
    """``mu`` with the lists at ``updates``' non-``None`` positions replaced by ``new``."""
    it = iter(new)
    flat = [m if x is None else next(it) for m, x in zip(_flat_lists(mu, updates), tree.flatten(updates)[0])]
    return tree.structure(updates).unflatten(flat)


@transform(elementwise=None)
def sm3(learning_rate: Scalar, momentum: Scalar = 0.9) -> GradientTransformation:
    r"""SM3: adaptive steps with second moments kept as one vector per dim (Optax's ``sm3``).

    .. math:: \theta_{t+1} = \theta_t - \eta\, \nu_t, \qquad \nu_t \text{ from } :func:`scale_by_sm3`

    Args:
      learning_rate: :math:`\eta`, a number or a 0-dim tensor (no schedule, as in Optax).
      momentum: decay of the momentum (``b1`` of :func:`scale_by_sm3`).

    Returns:
      ``chain(scale_by_sm3(momentum), scale(-learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.sm3(0.1, momentum=0.0)
        >>> params = {"w": torch.ones(2, 2)}
        >>> u, _ = tx.update({"w": torch.tensor([[3.0, 0.0], [0.0, 4.0]])}, tx.init(params), params)
        >>> u["w"].tolist()
        [[-0.1..., 0.0], [0.0, -0.1...]]

    References:
      Anil et al., `Memory-Efficient Adaptive Optimization <https://arxiv.org/abs/1901.11150>`_, 2019.
    """
    if learning_rate is None or callable(learning_rate):
        raise ValueError(f"sm3: learning_rate={learning_rate!r} must be a number or a 0-dim tensor (as in Optax, "
                         "no schedule)")
    check_nonnegative("sm3", learning_rate=learning_rate, momentum=momentum)
    return chain(scale_by_sm3(momentum), scale(-learning_rate))
