"""Line searches: ``scale_by_backtracking_linesearch``, ``scale_by_zoom_linesearch`` and
``value_and_grad_from_state`` (Optax's ``linesearch.py``: arguments, defaults, states and math).

A line search scales the update direction :math:`u` by a step size :math:`\\eta` chosen by evaluating the
objective along :math:`x + \\eta u`. Its ``update`` reads Optax's extra arguments::

    u, state = tx.update(direction, state, params, value=f(params), grad=grad_f(params), value_fn=f)

``value_fn(params, **kw)`` returns a 0-dim tensor; extra keyword arguments named in its signature are
passed on to it (others raise ``TypeError``, as in Optax). Gradients along the line come from
``torch.func.grad_and_value(value_fn)``, so ``value_fn`` must be a pure function of ``params`` (use
``torch.func.functional_call`` for a module).

**Host decisions.** Optax runs each search in a ``jax.lax.while_loop`` that stops at the first accepted step
size. The zoom search does the same by default: after each trial the host reads whether the search is
over (one read per trial; most updates accept their first trial, so about one per update: Optax's lbfgs
averages 1.0 to 1.5 value and gradient evaluations per update on a quadratic and on Rosenbrock's
function, and so does this one). With ``branchless=True``, and always under ``torch.func`` transforms
(``vmap`` cannot stop one member early), it runs its maximal number of trials every update and every
decision is a ``torch.where`` on device: trials after the search has finished are evaluated and
discarded, the same numbers for ``max_linesearch_steps`` evaluations per update, with no host sync (what
``torch.compile`` and ``vmap`` need). The backtracking search is always branchless:
``max_backtracking_steps + 1`` evaluations of ``value_fn`` per update. Pick small maximal numbers of steps
for them.

**Gradients through a search** (meta-learning through L-BFGS) are those of the branch taken: the accepted
step size is a constant of the trial that was accepted, or the cubic or quadratic interpolation that
produced it, differentiated through the values and slopes it interpolated. The interpolations are guarded
(their inputs replaced where they are not defined), so the branches not taken, and the trials discarded
by a branchless search, give zero gradient, not NaN (0 times a NaN derivative is NaN). At a converged point
(direction and slope 0, an interval of length 0) both searches accept their first trial, whose derivative is
that of a constant step: through K L-BFGS updates they equal finite differences past convergence
(:func:`fxtrain.lbfgs` says where its derivatives differ from Optax's).

**Complex parameters.** torch's gradient of a real function of complex parameters is the conjugate of
JAX's (torch's is the direction of steepest ascent). Slopes here are :math:`\\mathrm{Re}\\langle g, u\\rangle`
with torch's gradient, the directional derivative, which is what Optax's formulas compute from JAX's.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, Params, Updates, check_nonnegative, transform
from fxtrain._deferred import DTensor
from fxtrain.transforms._moments import Scalar, param_device

__all__ = [
    "BacktrackingLinesearchInfo",
    "ScaleByBacktrackingLinesearchState",
    "ScaleByZoomLinesearchState",
    "ZoomLinesearchInfo",
    "scale_by_backtracking_linesearch",
    "scale_by_zoom_linesearch",
    "value_and_grad_from_state",
]


# --- global reductions and evaluations along the line --------------------------------------------------

vdot = tree.vdot  # the line searches' and L-BFGS' inner products (re-exported for _lbfgs, _polyak)


def _real(dtype: torch.dtype) -> torch.dtype:
    return torch.empty((), dtype=dtype).real.dtype if dtype.is_complex else dtype


def plain_scalar(x: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A value (number, tensor, 0-dim DTensor) as a plain 0-dim tensor of ``dtype``."""
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return torch.as_tensor(x, device=device).real.to(dtype) if torch.is_tensor(x) else torch.tensor(
        x, dtype=dtype, device=device)


def _split_kwargs(name: str, value_fn: Callable, extra_args: dict) -> dict:
    """The extra arguments ``value_fn`` takes by name; any other is an error (Optax's rule)."""
    if not extra_args:
        return {}
    names = set(inspect.signature(value_fn).parameters)
    unused = sorted(k for k in extra_args if k not in names)
    if unused:
        raise TypeError(f"{name}.update got keyword arguments {unused} that value_fn does not take; pass only "
                        "value, grad, value_fn and the arguments of value_fn")
    return dict(extra_args)


class _Line:
    """The objective restricted to the line ``params + s * direction``: values, gradients and slopes there."""

    def __init__(self, value_fn: Callable, fn_kwargs: dict, params: Params, direction: Updates, acc: torch.dtype):
        self.fn, self.kwargs, self.acc = value_fn, fn_kwargs, acc
        flat, self.spec = tree.flatten(params)
        dirs = tree.flatten(direction)[0]
        if len(dirs) != len(flat):
            raise ValueError(f"the update direction does not match params: they differ at "
                             f"'{tree.first_mismatch(params, direction)}'")
        self.keep = [i for i, x in enumerate(flat) if x is not None]
        self.flat = flat
        self.p = [flat[i] for i in self.keep]
        self.u = [dirs[i] for i in self.keep]  # None where the update is frozen: that leaf stays put

    def point(self, s: torch.Tensor) -> list[torch.Tensor]:
        """The non-``None`` leaves of ``params + s * direction`` (new tensors; params are never written)."""
        return [p if u is None else (p + (s * u).to(p.dtype)) for p, u in zip(self.p, self.u)]

    def tree(self, leaves: list[torch.Tensor]) -> Params:
        out = list(self.flat)
        for i, x in zip(self.keep, leaves):
            out[i] = x
        return tree.unflatten(self.spec, out)

    def value(self, s: torch.Tensor) -> torch.Tensor:
        return self._scalar(self.fn(self.tree(self.point(s)), **self.kwargs))

    def value_and_grad(self, s: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.value_and_grad_at(self.point(s))

    def value_and_grad_at(self, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grads, value = torch.func.grad_and_value(lambda xs: self.fn(self.tree(xs), **self.kwargs))(leaves)
        return self._scalar(value), list(grads)

    def slope(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The derivative of the objective along the direction, from its gradient ``grads``."""
        pairs = [(g, u) for g, u in zip(grads, self.u) if u is not None]
        return vdot([g for g, _ in pairs], [u for _, u in pairs]).to(self.acc)

    def _scalar(self, v: Any) -> torch.Tensor:
        return plain_scalar(v, self.acc, self.p[0].device if self.p else torch.device("cpu"))


def _cast_like(new: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [n.to(x.dtype) for n, x in zip(new, like)]


def _where(pred: torch.Tensor, a: list, b: list) -> list:
    """New tensors ``torch.where(pred, a_i, b_i)``, item by item (0-dim scalars and leaves; DTensor leaves are
    selected on their local pieces, keeping their placements). Never writes into ``a`` or ``b``."""
    with tree.functional():
        return [tree.where_(pred, [x], [y])[0] if isinstance(x, DTensor) else torch.where(pred, x, y)
                for x, y in zip(a, b)]


# --- backtracking --------------------------------------------------------------------------------------

class BacktrackingLinesearchInfo(NamedTuple):
    """How the last backtracking search went (Optax's fields).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_backtracking_linesearch(max_backtracking_steps=15).init({"w": torch.zeros(2)})
        >>> isinstance(state.info, fx.BacktrackingLinesearchInfo), state.info._fields
        (True, ('num_linesearch_steps', 'decrease_error'))
    """

    num_linesearch_steps: torch.Tensor  # 0-dim int32: trials evaluated
    decrease_error: torch.Tensor  # 0-dim float32: > 0 if the sufficient decrease criterion failed


class ScaleByBacktrackingLinesearchState(NamedTuple):
    """State of :func:`scale_by_backtracking_linesearch` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_backtracking_linesearch(max_backtracking_steps=15).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByBacktrackingLinesearchState), state._fields
        (True, ('learning_rate', 'value', 'grad', 'info'))
    """

    learning_rate: torch.Tensor  # 0-dim, the params' real dtype: the accepted step size
    value: torch.Tensor  # 0-dim: the objective at the accepted point (inf before the first update)
    grad: Updates | EmptyState  # its gradient there, if store_grad (else EmptyState(): no leaf, so vmap and
    # checkpoints see none, where Optax's None is an empty subtree to JAX but not a tensor to torch.func.vmap)
    info: BacktrackingLinesearchInfo


@transform(elementwise=False, extra_args=True)
def scale_by_backtracking_linesearch(max_backtracking_steps: int, slope_rtol: Scalar = 1e-4,
                                     decrease_factor: Scalar = 0.8, increase_factor: Scalar = 1.5,
                                     max_learning_rate: Scalar = 1.0, atol: Scalar = 0.0, rtol: Scalar = 0.0,
                                     store_grad: bool = False, verbose: bool = False) -> GradientTransformation:
    r"""Scales the update direction by a step size that decreases the objective enough (backtracking; Optax's).

    Starting from :math:`\eta = \min(\text{increase\_factor}\cdot\eta_{t-1}, \text{max\_learning\_rate})`,
    multiplies :math:`\eta` by ``decrease_factor`` until the sufficient decrease (Armijo) criterion holds:

    .. math::
        f(x + \eta u) \le (1 + \text{rtol}) f(x) + \eta\, c\, \mathrm{Re}\langle \nabla f(x), u\rangle
        + \text{atol}, \qquad c = \text{slope\_rtol},

    for at most ``max_backtracking_steps`` reductions; returns :math:`\eta u`. If even the last trial
    gives inf or NaN the step is 0. All trials run every update (see the module docstring: no host sync).

    Args:
      max_backtracking_steps: the most step size reductions (a Python int).
      slope_rtol: :math:`c`, the fraction of the linear decrease required.
      decrease_factor: multiplies the step size after a failed trial.
      increase_factor: multiplies the previous step size to give the first trial.
      max_learning_rate: the largest step size tried.
      atol: absolute tolerance of the criterion.
      rtol: relative tolerance of the criterion.
      store_grad: also compute and keep the gradient at the accepted point (``state.grad``), so the next
        iteration can reuse it through :func:`value_and_grad_from_state` (one gradient evaluation more).
      verbose: print a diagnostic when the search fails (reads the outcome on the host: a sync).

    Returns:
      A transform with state :class:`ScaleByBacktrackingLinesearchState` whose ``update`` requires
      ``value=`` (:math:`f(x)`), ``grad=`` (:math:`\nabla f(x)`, a tree like params) and ``value_fn=``
      (:math:`f`); keyword arguments of ``value_fn`` may follow.

    Example:
        >>> import torch, fxtrain as fx
        >>> f = lambda p: ((p["x"] - 1.0) ** 2).sum()
        >>> params = {"x": torch.zeros(2)}
        >>> tx = fx.chain(fx.sgd(1.0), fx.scale_by_backtracking_linesearch(max_backtracking_steps=15))
        >>> state = tx.init(params)
        >>> grads = {"x": 2 * (params["x"] - 1.0)}
        >>> u, state = tx.update(grads, state, params, value=f(params), grad=grads, value_fn=f)
        >>> round(state[-1].learning_rate.item(), 4), fx.apply_updates(params, u)["x"].tolist()
        (0.8, [1.6..., 1.6...])

    References:
      Nocedal and Wright, `Numerical Optimization
      <https://www.math.uci.edu/~qnie/Publications/NumericalOptimization.pdf>`_, 1999 (Algorithm 3.1).
    """
    check_nonnegative("scale_by_backtracking_linesearch", max_backtracking_steps=max_backtracking_steps,
                      slope_rtol=slope_rtol, decrease_factor=decrease_factor, increase_factor=increase_factor,
                      max_learning_rate=max_learning_rate, atol=atol, rtol=rtol)
    name = "scale_by_backtracking_linesearch"

    def init_fn(params):
        dtype, device = _value_dtype(params), param_device(params)
        return ScaleByBacktrackingLinesearchState(
            learning_rate=torch.ones((), dtype=dtype, device=device),
            value=torch.full((), torch.inf, dtype=dtype, device=device),
            grad=tree.zeros_like(params) if store_grad else EmptyState(),
            info=BacktrackingLinesearchInfo(torch.zeros((), dtype=torch.int32, device=device),
                                            torch.full((), torch.inf, device=device)))

    def update_fn(updates, state, params=None, *, value=None, grad=None, value_fn=None, **extra_args):
        _require(name, params=params, value=value, grad=grad, value_fn=value_fn)
        line = _Line(value_fn, _split_kwargs(name, value_fn, extra_args), params, updates,
                     torch.promote_types(state.learning_rate.dtype, torch.float32))
        slope = line.slope(tree.align(params, grad)[1])
        value = line._scalar(value)
        lr = torch.minimum(increase_factor * state.learning_rate.to(line.acc),
                           line._scalar(max_learning_rate))
        new_value, error = value, torch.full_like(value, torch.inf)
        steps = torch.zeros_like(state.info.num_linesearch_steps)
        for k in range(int(max_backtracking_steps) + 1):  # every trial runs; finished searches keep their result
            active = ~(error <= atol)
            trial = lr * decrease_factor if k > 0 else lr
            trial_value = line.value(trial)
            trial_error = trial_value - (1.0 + rtol) * value - trial * slope_rtol * slope
            trial_error = torch.where(torch.isnan(trial_error), torch.inf, trial_error).clamp_min(0.0)
            lr, new_value, error = _where(active, [trial, trial_value, trial_error], [lr, new_value, error])
            steps = steps + active.to(steps.dtype)
        if verbose:
            _report_backtracking(error, atol, value, slope, lr)
        new_grad = state.grad
        if store_grad:
            g_state = tree.align(params, state.grad)[1]
            g_state = tree.copy_(g_state, line.value_and_grad(lr)[1])
            new_grad = tree.put(state.grad, params, g_state)
        lr = torch.where(torch.isinf(error), torch.zeros_like(lr), lr)
        u = tree.align(updates)[0]
        u = tree.scale_(u, lr)
        info = BacktrackingLinesearchInfo(steps, error.to(state.info.decrease_error.dtype))
        dtype = state.learning_rate.dtype
        return tree.put(updates, updates, u), ScaleByBacktrackingLinesearchState(
            lr.to(dtype), new_value.to(dtype), new_grad, info)

    return GradientTransformation(init_fn, update_fn)


def _value_dtype(params: Params) -> torch.dtype:
    leaves = tree.leaves(params)
    return _real(leaves[0].dtype) if leaves else torch.float32


def _require(name: str, **args: Any) -> None:
    missing = [k for k, v in args.items() if v is None]
    if missing:
        raise TypeError(f"{name}.update needs {', '.join(missing)}: tx.update(direction, state, params, "
                         "value=f(params), grad=grad_f(params), value_fn=f)")


def _report_backtracking(error, atol, value, slope, lr) -> None:
    if bool(error > atol):  # opt-in host sync (verbose=True)
        print(f"INFO: scale_by_backtracking_linesearch: no step size ensured sufficient decrease; value "
              f"{value.item():.6g}, slope {slope.item():.6g}, step size {lr.item():.6g}, decrease error "
              f"{error.item():.6g}" + ("; using a step size of 0 to avoid inf or NaN" if bool(error.isinf()) else ""))


# --- zoom ----------------------------------------------------------------------------------------------

# What verbose=True prints when the search fails (Optax's messages).
FLAG_INTERVAL_NOT_FOUND = ("No interval satisfying curvature condition. Consider increasing maximal possible "
                           "stepsize of the linesearch.")
FLAG_INTERVAL_TOO_SMALL = "Length of searched interval has been reduced below threshold."
FLAG_CURVATURE_COND_NOT_SATISFIED = "Returning stepsize with sufficient decrease but curvature condition not satisfied."
FLAG_NO_STEPSIZE_FOUND = "Linesearch failed, no stepsize satisfying sufficient decrease found."
FLAG_NOT_A_DESCENT_DIRECTION = "The linesearch failed because the provided direction is not a descent direction. "

class ZoomLinesearchInfo(NamedTuple):
    """How the last zoom search went (Optax's fields).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_zoom_linesearch(max_linesearch_steps=15).init({"w": torch.zeros(2)})
        >>> isinstance(state.info, fx.ZoomLinesearchInfo), state.info._fields
        (True, ('num_linesearch_steps', 'decrease_error', 'curvature_error'))
    """

    num_linesearch_steps: torch.Tensor  # 0-dim int32: trials evaluated
    decrease_error: torch.Tensor  # 0-dim float32: > 0 if the sufficient decrease criterion failed
    curvature_error: torch.Tensor  # 0-dim float32: > 0 if the curvature criterion failed


class ScaleByZoomLinesearchState(NamedTuple):
    """State of :func:`scale_by_zoom_linesearch` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_zoom_linesearch(max_linesearch_steps=15).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByZoomLinesearchState), state._fields
        (True, ('learning_rate', 'value', 'grad', 'info'))
    """

    learning_rate: torch.Tensor  # 0-dim, the params' real dtype: the accepted step size
    value: torch.Tensor  # 0-dim: the objective at the accepted point (inf before the first update)
    grad: Updates  # its gradient there (torch's convention: the conjugate of JAX's for complex params)
    info: ZoomLinesearchInfo


class _Search(NamedTuple):
    """The zoom search's running state: 0-dim tensors, and gradient leaf lists (Optax's ZoomLinesearchState
    less its fixed entries)."""

    count: torch.Tensor
    stepsize: torch.Tensor
    value: torch.Tensor
    slope: torch.Tensor
    decrease_error: torch.Tensor
    curvature_error: torch.Tensor
    interval_found: torch.Tensor
    done: torch.Tensor
    failed: torch.Tensor
    low: torch.Tensor
    value_low: torch.Tensor
    slope_low: torch.Tensor
    high: torch.Tensor
    value_high: torch.Tensor
    slope_high: torch.Tensor
    cubic_ref: torch.Tensor
    value_cubic_ref: torch.Tensor
    safe_stepsize: torch.Tensor
    safe_value: torch.Tensor
    grad: list
    safe_grad: list


@transform(elementwise=False, extra_args=True)
def scale_by_zoom_linesearch(max_linesearch_steps: int, max_learning_rate: Scalar | None = None, tol: Scalar = 0.0,
                             increase_factor: Scalar = 2.0, slope_rtol: Scalar = 1e-4, curv_rtol: Scalar = 0.9,
                             approx_dec_rtol: Scalar | None = 1e-6, stepsize_precision: Scalar = 1e-5,
                             initial_guess_strategy: str = "keep", verbose: bool = False, *,
                             branchless: bool = False) -> GradientTransformation:
    r"""Scales the update direction by a step size satisfying the strong Wolfe conditions (zoom; Optax's).

    Looks for :math:`\eta` with sufficient decrease and small curvature,

    .. math::
        f(x + \eta u) \le f(x) + c_1 \eta\, \partial_u f(x), \qquad
        |\partial_u f(x + \eta u)| \le c_2 |\partial_u f(x)|,

    (:math:`c_1` = ``slope_rtol``, :math:`c_2` = ``curv_rtol``; with ``approx_dec_rtol`` the approximate
    decrease criterion of Hager and Zhang is accepted near a minimum): first increasing :math:`\eta` by
    ``increase_factor`` until an interval holding such a step is found, then zooming into it by cubic,
    quadratic or bisection interpolation (Nocedal and Wright's Algorithms 3.5 and 3.6). If no step
    satisfies both, returns the best one with sufficient decrease seen, if any. Returns :math:`\eta u`;
    ``state.value`` and ``state.grad`` hold the objective and its gradient at the new point.

    As Optax, the search stops at the first accepted trial: the host reads one flag after each trial (a
    sync per trial, usually one per update). ``branchless=True`` runs all ``max_linesearch_steps`` trials
    every update with no host sync, the same numbers: for ``torch.compile`` and ``vmap`` (under
    ``torch.func`` transforms the search is branchless whatever this says). See the module docstring.

    Args:
      max_linesearch_steps: the most trials (value and gradient evaluations; a Python int).
      max_learning_rate: the largest step size tried (``None``: no bound).
      tol: tolerance on the criteria.
      increase_factor: multiplies the step size while searching for an interval.
      slope_rtol: :math:`c_1`, the fraction of the linear decrease required.
      curv_rtol: :math:`c_2`, the largest ratio of slopes allowed.
      approx_dec_rtol: relative tolerance of the approximate decrease criterion (``None``: off).
      stepsize_precision: the search stops when the interval is shorter than this (with a step of
        sufficient decrease in hand).
      initial_guess_strategy: ``"keep"`` (the first trial is the previous step size) or ``"one"``.
      verbose: print a diagnostic when the search fails (reads the outcome on the host: a sync).
      branchless: run every trial, deciding on device (no host sync; ``max_linesearch_steps`` evaluations
        of the value and gradient per update); ``False``: stop at the first accepted one, as Optax.

    Returns:
      A transform with state :class:`ScaleByZoomLinesearchState` whose ``update`` requires ``value=``,
      ``grad=`` (a tree like params) and ``value_fn=``; keyword arguments of ``value_fn`` may follow.

    Example:
        >>> import torch, fxtrain as fx
        >>> f = lambda p: (p["x"] ** 2).sum()
        >>> params = {"x": torch.tensor([1.0, -2.0])}
        >>> tx = fx.chain(fx.sgd(1.0), fx.scale_by_zoom_linesearch(max_linesearch_steps=10))
        >>> state = tx.init(params)
        >>> grads = {"x": 2 * params["x"]}
        >>> u, state = tx.update(grads, state, params, value=f(params), grad=grads, value_fn=f)
        >>> fx.apply_updates(params, u)["x"].tolist(), state[-1].value.item()   # the exact minimum
        ([0.0, 0.0], 0.0)

    References:
      Nocedal and Wright, `Numerical Optimization
      <https://www.math.uci.edu/~qnie/Publications/NumericalOptimization.pdf>`_, 1999 (Algorithms 3.5, 3.6).

      Hager and Zhang, `Algorithm 851: CG_DESCENT <https://doi.org/10.1145/1132973.1132979>`_, 2006.
    """
    name = "scale_by_zoom_linesearch"
    check_nonnegative(name, max_linesearch_steps=max_linesearch_steps, tol=tol, increase_factor=increase_factor,
                      slope_rtol=slope_rtol, curv_rtol=curv_rtol, stepsize_precision=stepsize_precision)
    if initial_guess_strategy not in ("keep", "one"):
        raise ValueError(f"{name}: initial_guess_strategy={initial_guess_strategy!r} must be 'keep' or 'one'")
    rules = _ZoomRules(int(max_linesearch_steps), max_learning_rate, tol, increase_factor, slope_rtol, curv_rtol,
                       approx_dec_rtol, stepsize_precision, verbose, bool(branchless))

    def init_fn(params):
        dtype, device = _value_dtype(params), param_device(params)
        return ScaleByZoomLinesearchState(
            learning_rate=torch.ones((), dtype=dtype, device=device),
            value=torch.full((), torch.inf, dtype=dtype, device=device),
            grad=tree.zeros_like(params),
            info=ZoomLinesearchInfo(torch.zeros((), dtype=torch.int32, device=device),
                                    torch.full((), torch.inf, device=device), torch.full((), torch.inf, device=device)))

    def update_fn(updates, state, params=None, *, value=None, grad=None, value_fn=None, **extra_args):
        _require(name, params=params, value=value, grad=grad, value_fn=value_fn)
        line = _Line(value_fn, _split_kwargs(name, value_fn, extra_args), params, updates,
                     torch.promote_types(state.learning_rate.dtype, torch.float32))
        guess = state.learning_rate.to(line.acc) if initial_guess_strategy == "keep" else line._scalar(1.0)
        s = rules.search(line, line._scalar(value), tree.align(params, grad)[1], guess)
        u = tree.scale_(tree.align(updates)[0], s.stepsize)
        g_state = tree.copy_(tree.align(params, state.grad)[1], s.grad)
        dtype, info_dtype = state.learning_rate.dtype, state.info.decrease_error.dtype
        info = ZoomLinesearchInfo(s.count.to(state.info.num_linesearch_steps.dtype), s.decrease_error.to(info_dtype),
                                  s.curvature_error.to(info_dtype))
        return tree.put(updates, updates, u), ScaleByZoomLinesearchState(
            s.stepsize.to(dtype), s.value.to(dtype), tree.put(state.grad, params, g_state), info)

    return GradientTransformation(init_fn, update_fn)


class _ZoomRules(NamedTuple):
    """The zoom search's hyperparameters and its steps (Optax's ``zoom_linesearch``)."""

    max_steps: int
    max_stepsize: Scalar | None
    tol: Scalar
    increase_factor: Scalar
    slope_rtol: Scalar
    curv_rtol: Scalar
    approx_dec_rtol: Scalar | None
    interval_threshold: Scalar
    verbose: bool
    branchless: bool

    def search(self, line: _Line, value: torch.Tensor, grad: list, guess: torch.Tensor) -> _Search:
        """Runs the trials until the search is done or failed (read on the host after each), or every trial
        (masked once done or failed) when branchless or under a torch.func transform; the final search state."""
        slope = line.slope(grad)
        zero, false = torch.zeros_like(value), torch.zeros((), dtype=torch.bool, device=value.device)
        inf = torch.full_like(value, torch.inf)
        s = _Search(count=torch.zeros((), dtype=torch.int32, device=value.device), stepsize=zero, value=value,
                    slope=slope, decrease_error=inf, curvature_error=inf, interval_found=false, done=false,
                    failed=false, low=zero, value_low=value, slope_low=slope, high=zero, value_high=value,
                    slope_high=slope, cubic_ref=zero, value_cubic_ref=value, safe_stepsize=zero, safe_value=value,
                    grad=list(grad), safe_grad=list(grad))
        stop_early = not (self.branchless or tree.transformed())  # vmap cannot stop one member early
        for _ in range(max(self.max_steps, 1)):  # Optax's while loop runs at least once
            s = self.step(line, s, value, slope, guess)
            if stop_early and bool(s.done | s.failed):  # the host decision: one read per trial
                break
        if self.verbose:
            self.report(s, value, slope)
        return s

    def report(self, s: _Search, value_init: torch.Tensor, slope_init: torch.Tensor) -> None:
        """Optax's diagnostics, printed when the search did not satisfy both criteria (reads the outcome on the
        host: a sync, opt in with ``verbose=True``)."""
        say = []
        if bool(s.done & ~s.interval_found & (torch.maximum(s.decrease_error, s.curvature_error) > self.tol)):
            say += [FLAG_INTERVAL_NOT_FOUND, FLAG_CURVATURE_COND_NOT_SATISFIED]
        if bool(s.failed):
            if bool((s.low - s.high).abs() <= self.interval_threshold):
                say.append(f"{FLAG_INTERVAL_TOO_SMALL} Interval length: {float((s.low - s.high).abs()):.6g}.")
            if bool(s.safe_stepsize > 0):
                say.append(f"{FLAG_CURVATURE_COND_NOT_SATISFIED} Stepsize ensuring sufficient decrease: "
                           f"{float(s.safe_stepsize):.6g}.")
            else:
                say.append(FLAG_NO_STEPSIZE_FOUND)
                say.append(f"{FLAG_NOT_A_DESCENT_DIRECTION}The slope (={float(slope_init):.6g}) at stepsize=0 "
                           "should be negative" if bool(slope_init >= 0) else
                           "Consider augmenting the maximal number of linesearch iterations.")
                if bool(torch.isinf(s.decrease_error)):
                    say.append("Cannot even make a step without getting Inf or Nan. The linesearch won't make a "
                               "step and the optimizer is stuck.")
        if say:
            print(f"INFO: scale_by_zoom_linesearch:\nValue at current params: {float(value_init):.6g}\n"
                  f"Slope along update direction: {float(slope_init):.6g}\nStepsize reached: "
                  f"{float(s.stepsize):.6g}\nDecrease Error: {float(s.decrease_error):.6g}\nCurvature Error: "
                  f"{float(s.curvature_error):.6g}\n" + "\n".join(say))

    def step(self, line: _Line, s: _Search, value_init, slope_init, guess) -> _Search:
        active = ~(s.done | s.failed)
        # The trial step size: growing while no interval is known, interpolated inside it afterwards.
        grown = torch.where(s.count == 0, guess, self.increase_factor * s.stepsize)
        reached = torch.zeros_like(s.done)
        if self.max_stepsize is not None:
            reached = grown >= self.max_stepsize
            grown = torch.clamp_max(grown, self.max_stepsize)
        middle, too_small = self._interpolate(s)
        trial = torch.where(s.interval_found, middle, grown)
        value, grad = line.value_and_grad(trial)
        slope = line.slope(grad)
        dec, curv = self._decrease_error(trial, value, slope, value_init, slope_init), self._curvature_error(
            slope, slope_init)
        good = torch.maximum(dec, curv) <= self.tol
        new = self._after_growing(s, trial, value, slope, dec, good, reached)
        zoomed = self._after_zooming(s, trial, value, slope, dec, good, too_small)
        new = _Search(*_where(s.interval_found, list(zoomed[:-2]), list(new[:-2])), grad=grad, safe_grad=None)
        # The best step size with sufficient decrease so far, kept in case curvature cannot be satisfied.
        take_safe = torch.where(s.interval_found, (dec <= self.tol) & (value < s.safe_value), dec <= self.tol)
        safe_stepsize, safe_value = _where(take_safe, [trial, value], [s.safe_stepsize, s.safe_value])
        # Optax's search fails at the last trial; its zoom also once the interval is too short (with a
        # step of sufficient decrease in hand).
        failed = ((s.count + 1 >= self.max_steps) | (s.interval_found & too_small & (safe_stepsize > 0.0))) & ~new.done
        # Optax's _try_safe_step: on failure, fall back to the safe step (or stay put outside the domain).
        fallback = failed & ((safe_stepsize > 0.0) | torch.isinf(dec))
        stepsize, value = _where(fallback, [safe_stepsize, safe_value], [new.stepsize, new.value])
        new = new._replace(failed=failed, stepsize=stepsize, value=value, safe_stepsize=safe_stepsize,
                           safe_value=safe_value, decrease_error=dec, curvature_error=curv,
                           count=s.count + 1)
        # Leaves: the gradient at the returned point, and the safe one; untouched once the search is over.
        safe_grad = _where(active & take_safe, grad, s.safe_grad)
        grad = _where(active, _where(fallback, safe_grad, grad), s.grad)
        scalars = _where(active, list(new[:-2]), list(s[:-2]))
        return _Search(*scalars, grad=grad, safe_grad=safe_grad)

    def _decrease_error(self, stepsize, value, slope, value_init, slope_init) -> torch.Tensor:
        # Armijo (Nocedal and Wright's (3.7a)), or the approximate decrease of Hager and Zhang ((23)) once
        # the value is within approx_dec_rtol of the initial one: the smaller error of the two.
        error = value - value_init - self.slope_rtol * stepsize * slope_init
        if self.approx_dec_rtol is not None:
            approx = torch.maximum(slope - (2 * self.slope_rtol - 1.0) * slope_init,
                                   value - value_init - self.approx_dec_rtol * value_init.abs())
            error = torch.minimum(approx, error)
        error = error.clamp_min(0.0)
        return torch.where(torch.isnan(error), torch.inf, error)

    def _curvature_error(self, slope, slope_init) -> torch.Tensor:
        error = (slope.abs() - self.curv_rtol * slope_init.abs()).clamp_min(0.0)
        return torch.where(torch.isnan(error), torch.inf, error)

    def _interpolate(self, s: _Search) -> tuple[torch.Tensor, torch.Tensor]:
        """The next trial inside [low, high]: the cubic's minimizer, else the quadratic's, else the midpoint."""
        delta = (s.high - s.low).abs()
        left, right = torch.minimum(s.high, s.low), torch.maximum(s.high, s.low)
        cubic, has_cubic = _cubicmin(s.low, s.value_low, s.slope_low, s.high, s.value_high, s.cubic_ref,
                                     s.value_cubic_ref)
        use_cubic = has_cubic & (cubic > left + 0.2 * delta) & (cubic < right - 0.2 * delta)
        quad, has_quad = _quadmin(s.low, s.value_low, s.slope_low, s.high, s.value_high)
        use_quad = ~use_cubic & has_quad & (quad > left + 0.1 * delta) & (quad < right - 0.1 * delta)
        middle = torch.where(use_cubic, cubic, torch.where(use_quad, quad, (s.low + s.high) / 2.0))
        return middle, delta <= self.interval_threshold

    def _after_growing(self, s, trial, value, slope, dec, good, reached) -> _Search:
        """Optax's ``_search_interval`` after its trial: the interval (low, high), if found."""
        to_high = (dec > 0.0) | ((value >= s.value) & (s.count > 0))
        to_low = (slope >= 0.0) & ~to_high
        low, value_low, slope_low, high, value_high, slope_high = _where(
            to_low, [trial, value, slope, s.stepsize, s.value, s.slope],
            [s.stepsize, s.value, s.slope, trial, value, slope])
        found = to_high | to_low | good
        done = good | (reached & ~found)
        return s._replace(stepsize=trial, value=value, slope=slope, interval_found=found, done=done, low=low,
                          value_low=value_low, slope_low=slope_low, high=high, value_high=value_high,
                          slope_high=slope_high, cubic_ref=low, value_cubic_ref=value_low)

    def _after_zooming(self, s, trial, value, slope, dec, good, too_small) -> _Search:
        """Optax's ``_zoom_into_interval`` after its trial: the interval shrunk around a valid step size."""
        to_high = (dec > 0.0) | (value >= s.value_low)
        high_to_low = (slope * (s.high - s.low) >= 0.0) & ~to_high
        high, value_high, slope_high = _where(to_high, [trial, value, slope], [s.high, s.value_high, s.slope_high])
        high, value_high, slope_high = _where(high_to_low, [s.low, s.value_low, s.slope_low],
                                              [high, value_high, slope_high])
        low, value_low, slope_low = _where(~to_high, [trial, value, slope], [s.low, s.value_low, s.slope_low])
        cubic_ref, value_cubic_ref = _where(to_high | high_to_low, [s.high, s.value_high], [s.low, s.value_low])
        return s._replace(stepsize=trial, value=value, slope=slope, done=good, low=low,
                          value_low=value_low, slope_low=slope_low, high=high, value_high=value_high,
                          slope_high=slope_high, cubic_ref=cubic_ref, value_cubic_ref=value_cubic_ref)


def _cubicmin(a, fa, fpa, b, fb, c, fc) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimizer of the cubic through (a, fa) with slope fpa at a, (b, fb) and (c, fc), and whether it
    exists (NaN where not: Optax's value there is NaN or infinite, never chosen).

    Guarded for gradients: where it does not exist, the inputs of each undefined operation (a division by
    0, the root of a negative number, an infinite value) are swapped for harmless ones before it runs,
    so the unused result has finite derivatives and ``torch.where`` gives its inputs zero gradient.
    """
    ok = _all_finite(a, fa, fpa, b, fb, c, fc) & (b != a) & (c != a) & (b != c)
    a, fa, fpa, b, fb, c, fc = _guard(ok, (a, fa, fpa, b, fb, c, fc), (0.0, 0.0, -1.0, 1.0, 0.0, 2.0, 0.0))
    db, dc = b - a, c - a
    denom = (db * dc) ** 2 * (db - dc)
    rb, rc = fb - fa - fpa * db, fc - fa - fpa * dc
    big_a = (dc ** 2 * rb - db ** 2 * rc) / denom
    big_b = (-(dc ** 3) * rb + db ** 3 * rc) / denom
    radicand = big_b * big_b - 3.0 * big_a * fpa
    ok = ok & (radicand >= 0.0) & (big_a != 0.0) & torch.isfinite(radicand)
    radicand, big_a = _guard(ok, (radicand, big_a), (1.0, 1.0))
    xmin = a + (-big_b + torch.sqrt(radicand)) / (3.0 * big_a)
    return torch.where(ok, xmin, torch.nan), ok


def _quadmin(a, fa, fpa, b, fb) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimizer of the quadratic through (a, fa) with slope fpa at a, and (b, fb), and whether it exists
    (guarded as :func:`_cubicmin`)."""
    ok = _all_finite(a, fa, fpa, b, fb) & (b != a)
    a, fa, fpa, b, fb = _guard(ok, (a, fa, fpa, b, fb), (0.0, 0.0, -1.0, 1.0, 0.0))
    db = b - a
    curvature = (fb - fa - fpa * db) / db ** 2
    ok = ok & (curvature != 0.0) & torch.isfinite(curvature)
    curvature = torch.where(ok, curvature, 1.0)
    return torch.where(ok, a - fpa / (2.0 * curvature), torch.nan), ok


def _all_finite(*xs: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.isfinite(x) for x in xs]).all()


def _guard(ok: torch.Tensor, xs: tuple, safe: tuple) -> list[torch.Tensor]:
    """``xs`` where ``ok``, else the ``safe`` values (the double ``where`` that keeps gradients finite)."""
    return [torch.where(ok, x, v) for x, v in zip(xs, safe)]


# --- reusing the line search's value and gradient ------------------------------------------------------

def value_and_grad_from_state(value_fn: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, Updates]]:
    r"""``value_and_grad`` of ``value_fn`` that reuses what a line search computed (Optax's).

    A zoom line search (or a backtracking one with ``store_grad=True``) ends having evaluated the
    objective and its gradient at the new params; they sit in its state as ``value`` and ``grad``. The
    returned ``fn(params, *args, state=opt_state, **kwargs)`` returns them when the stored value is finite
    (every update but the first), else computes ``value_fn(params, *args, **kwargs)`` and its gradient.

    Outside ``torch.func`` transforms the choice reads the stored value on the host (one sync per call,
    in the training loop, not in an update); under ``vmap`` both are computed and selected on device.

    Args:
      value_fn: the objective, a function of params (a tree of tensors) returning a 0-dim tensor.

    Returns:
      ``fn(params, *args, state, **kwargs) -> (value, grad)``, ``grad`` a tree like params.

    Example:
        >>> import torch, fxtrain as fx
        >>> f = lambda p: (p["x"] ** 2).sum()
        >>> params = {"x": torch.tensor([1.0, -2.0])}
        >>> tx = fx.lbfgs()
        >>> state = tx.init(params)
        >>> value_and_grad = fx.value_and_grad_from_state(f)
        >>> for _ in range(2):
        ...     value, grad = value_and_grad(params, state=state)
        ...     u, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=f)
        ...     params = fx.apply_updates(params, u)
        >>> params["x"].tolist()
        [0.0, 0.0]
    """
    def fn(params, *args, state, **kwargs):
        value, grad = _field(state, "value"), _field(state, "grad")
        if value is None or grad is None or isinstance(grad, EmptyState):
            raise ValueError("value_and_grad_from_state: the optimizer state holds no value or grad; use a "
                             "zoom line search, or a backtracking one with store_grad=True")
        f = lambda p: value_fn(p, *args, **kwargs)  # noqa: E731
        stored = torch.isfinite(value)
        if not tree.transformed() and bool(stored):  # the host picks the branch (outside update)
            return value, grad
        new_grad, new_value = _grad_and_value(f, params)
        if tree.transformed():
            return torch.where(stored, value, new_value.to(value.dtype)), tree.where(stored, grad, new_grad)
        return new_value, new_grad

    return fn


def _grad_and_value(f: Callable, params: Params) -> tuple[Params, torch.Tensor]:
    flat, spec = tree.flatten(params)
    keep = [i for i, x in enumerate(flat) if x is not None]

    def on_leaves(xs):
        full = list(flat)
        for i, x in zip(keep, xs):
            full[i] = x
        return f(tree.unflatten(spec, full))

    grads, value = torch.func.grad_and_value(on_leaves)([flat[i] for i in keep])
    out = [None] * len(flat)
    for i, g in zip(keep, grads):
        out[i] = g
    return tree.unflatten(spec, out), value


def _field(state: Any, name: str) -> Any:
    """The one entry called ``name`` in the NamedTuples of ``state`` (Optax's ``tree.get``), else ``None``."""
    found = []

    def walk(x):
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            for k, v in zip(x._fields, x):
                if k == name:
                    found.append(v)
                else:
                    walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(state)
    if len(found) > 1:
        raise KeyError(f"value_and_grad_from_state: the state holds {len(found)} entries named {name!r}")
    return found[0] if found else None
