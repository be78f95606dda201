"""L-BFGS: ``scale_by_lbfgs`` and the optimizer ``lbfgs`` (Optax's math, state and defaults)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Updates, chain, check_needs_params, identity, transform
from fxtrain._deferred import DTensor, Shard
from fxtrain.distributed._collectives import contiguous_stride
from fxtrain.transforms._linesearch import scale_by_zoom_linesearch, vdot
from fxtrain.transforms._moments import Scalar, counter, param_device, safe_increment_
from fxtrain.transforms._scaling import scale, scale_by_learning_rate

__all__ = ["ScaleByLBFGSState", "lbfgs", "scale_by_lbfgs"]


class ScaleByLBFGSState(NamedTuple):
    """State of :func:`scale_by_lbfgs` (Optax's field names and leaf order).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_lbfgs().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByLBFGSState), state._fields
        (True, ('count', 'params', 'updates', 'diff_params_memory', 'diff_updates_memory', 'weights_memory'))
    """

    count: torch.Tensor  # 0-dim int32: iterations
    params: Updates  # the params of the last update
    updates: Updates  # the updates (gradients) of the last update
    diff_params_memory: Updates  # leaves (memory_size, *shape): past params differences, a circular buffer
    diff_updates_memory: Updates  # leaves (memory_size, *shape): past updates differences
    weights_memory: torch.Tensor  # (memory_size,) float32: 1 / <diff_updates, diff_params>


@transform(elementwise=False)
def scale_by_lbfgs(memory_size: int = 10, scale_init_precond: bool = True) -> GradientTransformation:
    r"""Multiplies updates by L-BFGS's approximation of the inverse Hessian (Optax's ``scale_by_lbfgs``).

    Returns :math:`P_k u_k` with

    .. math::
        P_{k, j+1} = V_j^\top P_{k, j} V_j + \rho_j\, \delta w_j \delta w_j^\top, \quad
        V_j = I - \rho_j\, \delta u_j \delta w_j^\top, \quad \rho_j = 1 / \langle \delta u_j, \delta w_j\rangle,

    over the last ``memory_size`` differences :math:`\delta w_j = w_{j+1} - w_j` of params and
    :math:`\delta u_j = u_{j+1} - u_j` of updates, starting from :math:`P_{k, k-m} = \gamma_k I`,
    :math:`\gamma_k = \langle \delta w_{k-1}, \delta u_{k-1}\rangle / \|\delta u_{k-1}\|^2` if
    ``scale_init_precond`` (1 otherwise; at the first step :math:`\min(1, 1/\|u_0\|)`), computed by the
    two-loop recursion. The memory is updated with the new params before the product, so a line search
    chained after it changes the memory only through the params it accepts; a converged step (a zero
    gradient and no step) keeps the memory's pairs, so derivatives through it stay finite and right (see
    :func:`lbfgs` for where this and the first step's scale differ from Optax). Inner products are global
    over leaves (a DTensor leaf counts all its shards); complex leaves use :math:`\mathrm{Re}\langle\cdot,
    \cdot\rangle`.

    Args:
      memory_size: how many past differences to keep (:math:`m`): an int, or a 0-dim integer tensor (as
        ``inject_hyperparams`` gives it; read at ``init``, where it sizes the memory).
      scale_init_precond: scale the initial inverse Hessian by :math:`\gamma_k`.

    Returns:
      A transform with state :class:`ScaleByLBFGSState` (``memory_size`` copies of params in each memory).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_lbfgs()
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> u, state = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(params), params)
        >>> u["w"].tolist()   # first step: the gradient over its norm
        [0.6..., 0.8...]

    References:
      Nocedal and Wright, `Numerical Optimization
      <https://www.math.uci.edu/~qnie/Publications/NumericalOptimization.pdf>`_, 1999 (Algorithms 7.4, 7.5).

      Liu and Nocedal, `On the limited memory BFGS method for large scale optimization
      <https://users.iems.northwestern.edu/~nocedal/PDFfiles/limited-memory.pdf>`_, 1989.
    """
    _check_memory_size(memory_size)

    def init_fn(params):
        memory = int(memory_size)  # a shape: read on the host once, here (update reads it off the state)
        if memory < 1:
            raise ValueError(f"scale_by_lbfgs: memory_size={memory} must be an int >= 1")
        return ScaleByLBFGSState(
            count=counter(params), params=tree.zeros_like(params), updates=tree.zeros_like(params),
            diff_params_memory=tree.map(lambda x: _stacked_zeros(x, memory), params),
            diff_updates_memory=tree.map(lambda x: _stacked_zeros(x, memory), params),
            weights_memory=torch.zeros(memory, dtype=_weights_dtype(params), device=param_device(params)))

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_lbfgs", params)
        u, p, old_p, old_u, dw_mem, du_mem = tree.align(updates, params, state.params, state.updates,
                                                        state.diff_params_memory, state.diff_updates_memory)
        memory = state.weights_memory.shape[0]  # memory_size, as a shape (no host sync on a tensor)
        first = state.count == 0
        idx = (state.count % memory).long()
        prev = ((state.count - 1) % memory).long()  # the slot of the newest difference
        # 1. The newest differences (zero at the first step, when there is no previous point).
        with tree.functional():
            dw = tree.zero_where_(first, tree.add_(list(p), old_p, -1.0))
            du = tree.zero_where_(first, tree.add_(list(u), old_u, -1.0))
        curvature, u_sq = vdot(du, dw), vdot(u, u)
        # rho = 1 / <du, dw>, 0 for a pair without curvature (the first step; a converged problem: 0 / 0). The
        # division sees 1 there (the double where): else its gradient, inf, times where's 0 is NaN.
        paired = ~first & (curvature != 0.0)
        weight = torch.where(paired, 1.0 / torch.where(paired, curvature, 1.0), 0.0)
        # Converged (a zero gradient and no step since the last one): the memory keeps its pairs, the newest
        # staying newest. Optax writes the empty pair over the oldest; the values are the same (the direction
        # is P 0 = 0 either way) but not their derivatives: d x_{k+1} = (I - eta P H) d x_k there, which
        # contracts with the learned P ~ H^-1 and grows without bound once empty pairs have replaced it
        # (a 3-d quadratic with eigenvalues to 50, converged at update 8: the derivative after 60 updates is
        # 1e-62 and growing 49x an update, against 1e-322 with the pairs kept; finite differences give 0).
        keep = ~first & ~paired & (u_sq == 0.0)
        newest = ((state.count - 2) % memory).long()  # the slot of the newest stored difference
        dw_mem, dw = _push(dw_mem, dw, prev, newest, keep)
        du_mem, du = _push(du_mem, du, prev, newest, keep)
        old = state.weights_memory
        weights = old.index_put((prev.reshape(1),), weight.to(old.dtype).reshape(1))
        at_prev, at_newest = _read_row(old, prev), _read_row(old, newest)  # not old[prev]: .item(), a host sync
        weights = weights.index_put((newest.reshape(1),), torch.where(keep, at_prev, at_newest).reshape(1))
        weights = weights.index_put((prev.reshape(1),), torch.where(keep, at_newest, weight.to(old.dtype)).reshape(1))
        # 2. The scale of the initial inverse Hessian, from the newest pair.
        gamma = torch.ones((), dtype=weights.dtype, device=weights.device)
        if scale_init_precond:
            curvature, du_sq = vdot(du, dw), vdot(du, du)
            gamma = torch.where(du_sq > 0.0, curvature / torch.where(du_sq > 0.0, du_sq, 1.0), 1.0)
            # The first step: 1 / ||u|| capped at 1, differentiated (Optax stops its gradient; see lbfgs).
            capped = torch.clamp_max(torch.where(u_sq > 0.0, u_sq, 1.0).rsqrt(), 1.0)
            gamma = torch.where(first, capped, gamma)
        # 3. The two-loop recursion, newest to oldest then back.
        direction = _two_loop(u, dw_mem, du_mem, weights, gamma, idx, memory)
        old_p, old_u = tree.copy_(old_p, p), tree.copy_(old_u, u)
        u = tree.copy_(u, direction)
        return tree.put(updates, updates, u), ScaleByLBFGSState(
            count=safe_increment_(state.count), params=tree.put(state.params, updates, old_p),
            updates=tree.put(state.updates, updates, old_u),
            diff_params_memory=tree.put(state.diff_params_memory, updates, dw_mem),
            diff_updates_memory=tree.put(state.diff_updates_memory, updates, du_mem), weights_memory=weights)

    return GradientTransformation(init_fn, update_fn)


def _check_memory_size(memory_size) -> None:
    """An int >= 1, or a 0-dim integer tensor (``inject_hyperparams`` makes one of an int, as Optax makes an
    array: its value is read at ``init``, the only place that needs it)."""
    if isinstance(memory_size, torch.Tensor):
        if memory_size.ndim == 0 and not (memory_size.is_floating_point() or memory_size.is_complex()
                                          or memory_size.dtype == torch.bool):
            return
    elif isinstance(memory_size, int) and not isinstance(memory_size, bool) and memory_size >= 1:
        return
    raise ValueError(f"scale_by_lbfgs: memory_size={memory_size!r} must be an int >= 1")


def _weights_dtype(params) -> torch.dtype:
    """float32, or float64 for float64 params (JAX's default float, as Optax's ``jnp.zeros`` gives it)."""
    leaves = tree.leaves(params)
    real = leaves[0].real.dtype if leaves else torch.float32
    return torch.promote_types(real, torch.float32)


def _two_loop(u, dw_mem, du_mem, rho, gamma, idx, m) -> list[torch.Tensor]:
    """:math:`P_k u` by Nocedal and Wright's Algorithm 7.4 over the circular memory starting at slot ``idx``
    (oldest) and ending at ``idx - 1`` (newest); new tensors, in the dtypes of ``u``."""
    order = [(idx + j) % m for j in range(m)]  # 0-dim tensors: no host sync on the slot
    alphas = [None] * m
    with tree.functional():
        q = list(u)
        for j in reversed(range(m)):
            dw = [_read_row(x, order[j]) for x in dw_mem]
            alphas[j] = _read_row(rho, order[j]) * vdot(dw, q)
            q = tree.add_(q, [_read_row(x, order[j]) for x in du_mem], -alphas[j])
        q = tree.scale_(q, gamma)
        for j in range(m):
            du = [_read_row(x, order[j]) for x in du_mem]
            beta = _read_row(rho, order[j]) * vdot(du, q)
            q = tree.add_(q, [_read_row(x, order[j]) for x in dw_mem], alphas[j] - beta)
    return q


def _push(mem: list, new: list, prev: torch.Tensor, newest: torch.Tensor, keep: torch.Tensor) -> tuple[list, list]:
    """Writes ``new`` into row ``prev`` of each memory leaf (the oldest row becomes the newest), or, where ``keep``,
    swaps rows ``prev`` and ``newest`` instead (the pairs stay, the newest one newest); the memories and the rows
    now at ``prev``. ``keep`` is a 0-dim bool tensor: both run, selected on device (no host sync)."""
    out, rows = [], []
    for m, x in zip(mem, new):
        oldest, last = _read_row(m, prev), _read_row(m, newest)
        m = _write_row(m, prev, x)
        written = _read_row(m, prev)  # x in the memory's dtype and placements
        with tree.functional():  # new rows; the memory is written as the caller writes (in place when donated)
            moved, row = tree.where_(keep, [oldest, last], [last, written])
        m = _write_row(m, newest, moved)
        out.append(_write_row(m, prev, row))
        rows.append(row)
    return out, rows


def _stacked_zeros(x: torch.Tensor, m: int) -> torch.Tensor:
    """Zeros of shape ``(m, *x.shape)`` in ``x``'s dtype; a DTensor leaf sharded on dim d gives one sharded on d + 1."""
    if not isinstance(x, DTensor):
        return torch.zeros((m, *x.shape), dtype=x.dtype, device=x.device)
    placements = [Shard(p.dim + 1) if isinstance(p, Shard) else p for p in x.placements]
    piece = torch.zeros((m, *tree.local(x).shape), dtype=x.dtype, device=tree.local(x).device)
    return DTensor.from_local(piece, x.device_mesh, placements, run_check=False, shape=(m, *x.shape),
                              stride=contiguous_stride((m, *x.shape)))


def _read_row(mem: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``mem[i]`` for a 0-dim index tensor (no host sync); a DTensor memory gives a DTensor row."""
    if not isinstance(mem, DTensor):
        return mem.index_select(0, i.reshape(1)).squeeze(0)
    row = tree.local(mem).index_select(0, i.reshape(1)).squeeze(0)
    placements = [Shard(p.dim - 1) if isinstance(p, Shard) else p for p in mem.placements]
    return DTensor.from_local(row, mem.device_mesh, placements, run_check=False, shape=mem.shape[1:],
                              stride=contiguous_stride(mem.shape[1:]))


def _write_row(mem: torch.Tensor, i: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """``mem`` with ``mem[i] = row`` (in place unless :func:`fxtrain.tree.functional`); ``i`` a 0-dim tensor.

    A DTensor row is first brought to the memory's placements (gradients may come replicated for sharded
    params: slicing ops replicate them); the write is then on local pieces."""
    if isinstance(mem, DTensor):
        placements = tuple(Shard(p.dim - 1) if isinstance(p, Shard) else p for p in mem.placements)
        if not isinstance(row, DTensor):
            row = DTensor.from_local(row, mem.device_mesh, placements, run_check=False)
        elif row.placements != placements:
            row = row.redistribute(mem.device_mesh, placements)
    piece, new = tree.local(mem), tree.local(row).to(mem.dtype).unsqueeze(0)
    if not tree.is_functional():
        piece.index_copy_(0, i.reshape(1), new)
        return mem
    piece = piece.index_copy(0, i.reshape(1), new)
    if not isinstance(mem, DTensor):
        return piece
    return DTensor.from_local(piece, mem.device_mesh, mem.placements, run_check=False, shape=mem.shape,
                              stride=mem.stride())




@transform(elementwise=None)
def lbfgs(learning_rate: Scalar | Callable | None = None, memory_size: int = 10, scale_init_precond: bool = True,
          linesearch: GradientTransformation | None = scale_by_zoom_linesearch(
              max_linesearch_steps=20, initial_guess_strategy="one")) -> GradientTransformation:
    r"""L-BFGS with a line search (Optax's ``lbfgs``).

    .. math:: x_{k+1} = x_k - \eta_k P_k \nabla f(x_k)

    with :math:`P_k` from :func:`scale_by_lbfgs` and :math:`\eta_k` from the line search (by default
    ``scale_by_zoom_linesearch(max_linesearch_steps=20, initial_guess_strategy="one")``, Optax's default),
    times ``learning_rate`` if given. As Optax's, the search stops at the first accepted step size: the
    host reads one flag per trial, and most updates accept their first (about 1.0 to 1.5 evaluations of
    the objective and its gradient per update on a quadratic and on Rosenbrock's function). For
    ``torch.compile`` or ``vmap`` pass ``linesearch=scale_by_zoom_linesearch(20, initial_guess_strategy="one",
    branchless=True)``: no host sync, 20 evaluations every update, the same numbers (under ``torch.func``
    transforms the search is branchless anyway; see :mod:`fxtrain.transforms._linesearch`). Its ``update`` takes
    ``value=``, ``grad=`` and ``value_fn=`` for the line search; :func:`value_and_grad_from_state` reuses
    the value and gradient the line search computed at the new params.

    **Differentiating through K iterations** (``torch.func.grad`` or autograd of a loss of the params after K
    updates, "run 20 iterations and differentiate") gives the derivative of the function those K updates
    compute: it equals central finite differences of it, before and after the inner problem has converged.
    The values are Optax's; the derivatives differ from Optax's where Optax's are not those of its values:

    * The first step's scale :math:`\min(1, 1/\|u_0\|)` is differentiated. Optax stops its gradient
      (``jax.lax.stop_gradient``), so where :math:`\|u_0\| > 1` its meta-gradients miss the step's
      dependence on the starting point (below 1 the scale is the constant 1 and both agree). The norm's
      undefined derivative at :math:`u_0 = 0`, a reason to stop it, is met here by guarding the zero.
    * Once converged (a zero gradient, no step since the last one) the new pair is empty,
      :math:`\langle \delta u, \delta w\rangle = 0`: its :math:`\rho` is 0 through a double ``where``
      (the division never sees the 0), where Optax's ``where(s.y == 0, 0, 1 / s.y)`` gives a NaN gradient
      (0 times inf) in reverse mode.
    * A converged step keeps the memory's pairs (the newest stays newest) where Optax writes the empty
      pair over the oldest. The direction is :math:`P\cdot 0 = 0` either way, so the values agree, but the
      derivative of a converged step is :math:`I - \eta P H`: it vanishes with the learned
      :math:`P \approx H^{-1}` and grows by up to :math:`\max|1 - \eta\lambda(H)|` per step once empty pairs
      have replaced it (finite, and wrong after enough updates: 49x an update on a quadratic with
      eigenvalues to 50, whose finite differences are 0).

    A start where some direction is never explored (a coordinate already at its optimum of a separable
    problem) is a point where the unrolled function's derivative jumps: there the iterates never learn that
    direction's curvature and the derivative is :math:`\prod (1 - \eta\gamma\lambda)` along it, while any
    perturbation explores it (finite differences see that).

    The line searches' own guards (interpolations over zero-length intervals, slopes of 0 at the minimum)
    are described in :mod:`fxtrain.transforms._linesearch`. A derivative through a step whose line search
    changes branch under a small change of the starting point is that of the branch taken (finite
    differences across the switch see a jump).

    Args:
      learning_rate: a fixed scale of the direction (number, 0-dim tensor or schedule); ``None``: -1.
      memory_size: past differences kept (see :func:`scale_by_lbfgs`).
      scale_init_precond: scale the initial inverse Hessian (see :func:`scale_by_lbfgs`).
      linesearch: a line search transform, or ``None`` for none (then ``learning_rate`` is the step);
        default: the zoom line search above.

    Returns:
      ``chain(scale_by_lbfgs(memory_size, scale_init_precond), scale(-1.0) or
      scale_by_learning_rate(learning_rate), linesearch or identity())``.

    Example:
        >>> import torch, fxtrain as fx
        >>> f = lambda p: ((p["x"] - torch.tensor([1.0, 2.0])) ** 2 * torch.tensor([1.0, 10.0])).sum()
        >>> params = {"x": torch.zeros(2)}
        >>> tx = fx.lbfgs()
        >>> state = tx.init(params)
        >>> value_and_grad = fx.value_and_grad_from_state(f)
        >>> for _ in range(5):
        ...     value, grad = value_and_grad(params, state=state)
        ...     u, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=f)
        ...     params = fx.apply_updates(params, u)
        >>> [round(x, 4) for x in params["x"].tolist()]
        [1.0, 2.0]

    References:
      Liu and Nocedal, `On the limited memory BFGS method for large scale optimization
      <https://users.iems.northwestern.edu/~nocedal/PDFfiles/limited-memory.pdf>`_, 1989.
    """
    return chain(scale_by_lbfgs(memory_size=memory_size, scale_init_precond=scale_init_precond),
                 scale(-1.0) if learning_rate is None else scale_by_learning_rate(learning_rate),
                 linesearch if linesearch is not None else identity())
