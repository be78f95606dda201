"""Muon: momentum orthogonalised by a Newton-Schulz iteration, AdamW for the rest (Optax's ``contrib.muon``).

The orthogonalisation acts on whole matrices, so Muon is not elementwise (``sharded_apply`` refuses it).
A DTensor leaf (a tensor-parallel matrix) is gathered, orthogonalised whole, and its update handed back
with the leaf's own placements: every rank computes the one-process update and keeps its piece.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, NamedTuple, Sequence

import optree
import torch

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, Updates, chain, check_learning_rate, check_nonnegative, transform
from fxtrain._deferred import DTensor, Replicate
from fxtrain.optimizers import adamw
from fxtrain.transforms._masking import Mask, partition
from fxtrain.transforms._moments import (Scalar, as_dtype, bias_correction, counter, ema_, mixed_dtypes,
                                         param_device, safe_increment_)
from fxtrain.transforms._scaling import scale_by_learning_rate
from fxtrain.transforms._weight_decay import add_decayed_weights

__all__ = ["MuonDimensionNumbers", "MuonState", "scale_by_muon", "muon"]

_DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic: steepest slope at 0, S' ~ U(0.5, 1.5)
_NS_COEFFS_PRESETS = {
    "standard": _DEFAULT_NS_COEFFS,
    "dion": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
             (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),  # one row per step (Ahn et al.)
}
_PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
_FLOOR = 1e-8  # Optax's floor of the AOL and Schatten-4 rescalings (not the user's eps)


class MuonDimensionNumbers(NamedTuple):
    """Which axes of a weight form the matrix Muon orthogonalises (Optax's).

    For ``y = x @ W`` the reduction axis is 0 and the output axis 1 (the default). Several axes are
    flattened together; every other axis is a batch axis (each slice orthogonalised on its own).
    fxtrain also accepts leaves of rank < 2 given explicit numbers with no reduction axis
    (``MuonDimensionNumbers((), 0)``: a vector as a 1 x n matrix), which Optax refuses.
    """

    reduction_axis: Sequence[int] | int = 0
    output_axis: Sequence[int] | int = 1


DimNums = MuonDimensionNumbers | None
WeightDimNumOrFn = DimNums | Any | Callable[[Any], Any]  # one for all, a tree (prefix) of them, or a function


class MuonState(NamedTuple):
    """State of :func:`scale_by_muon` (Optax's field names and order)."""

    count: torch.Tensor  # 0-dim int32: updates so far
    mu: Updates  # momentum, in mu_dtype (default: the param dtype)
    ns_coeffs: torch.Tensor  # float32, (3,) or (steps, 3): the Newton-Schulz coefficients


# --- reshaping weights into batches of matrices ------------------------------------------------------

def _axes(ndim: int, dims: MuonDimensionNumbers, shape: tuple) -> tuple[tuple, tuple, tuple]:
    """(batch, reduction, output) axes of a weight of rank ``ndim``, non-negative, checked disjoint."""
    def as_tuple(a):
        return (a,) if isinstance(a, int) else tuple(a)

    reduction, output = as_tuple(dims.reduction_axis), as_tuple(dims.output_axis)
    if any(not -ndim <= a < ndim for a in reduction + output):
        raise ValueError(f"{dims} names an axis that a weight of shape {shape} does not have")
    reduction, output = tuple(a % ndim for a in reduction), tuple(a % ndim for a in output)
    if set(reduction) & set(output):
        raise ValueError(f"{dims}: reduction and output axes must be disjoint, got {reduction} and {output} "
                         f"for a weight of shape {shape}")
    batch = tuple(sorted(set(range(ndim)) - set(reduction) - set(output)))
    return batch, reduction, output


def _as_matrices(x: torch.Tensor, dims: MuonDimensionNumbers) -> tuple[torch.Tensor, Callable]:
    """``x`` as a (batch, reduction, output) stack of matrices, and the function that undoes it."""
    shape = tuple(x.shape)
    batch, reduction, output = _axes(x.ndim, dims, shape)
    order = batch + reduction + output
    sizes = [math.prod(shape[a] for a in axes) for axes in (batch, reduction, output)]
    permuted = tuple(shape[a] for a in order)
    inverse = tuple(sorted(range(x.ndim), key=lambda i: order[i]))
    return x.permute(order).reshape(sizes), lambda m: m.reshape(permuted).permute(inverse)


def _fans(shape: tuple, dims: DimNums) -> tuple[int, int]:
    _, reduction, output = _axes(len(shape), dims or MuonDimensionNumbers(), shape)
    return math.prod(shape[a] for a in reduction), math.prod(shape[a] for a in output)


# --- the Newton-Schulz iteration ---------------------------------------------------------------------

def _newton_schulz(x: torch.Tensor, steps: list, preconditioning: str, eps: Scalar) -> torch.Tensor:
    """The quintic iteration ``x <- a x + (b A + c A^2) x`` with ``A = x x^H`` on a stack of wide matrices."""
    if preconditioning == "frobenius":
        x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    elif preconditioning == "spectral":
        x = x / (torch.linalg.matrix_norm(x, ord=2, keepdim=True) + eps)
    for i, (a, b, c, on) in enumerate(steps):
        before = x
        if i == 0 and preconditioning == "aol":  # rows rescaled by their Gram row sums (Boissin et al.)
            gram = x @ x.mH
            s = gram.abs().sum(-1).clamp_min(_FLOOR).rsqrt().unsqueeze(-1)
            x, gram = x * s, gram * s * s.mT
        elif i == 0 and preconditioning == "schatten":  # scaled by the Schatten-4 norm (as Optax: x x^T)
            gram = x @ x.mT
            s = torch.linalg.matrix_norm(gram, keepdim=True).clamp_min(_FLOOR).rsqrt()
            x, gram = x * s, gram * s * s
        else:
            gram = x @ x.mH
        x = a * x + (b * gram + c * gram @ gram) @ x
        if on is not None:  # a step past this member's ns_steps (a batched count): keep the iterate
            x = torch.where(on, x, before)
    return x


def _coefficient_rows(ns_coeffs: torch.Tensor, ns_steps: int | torch.Tensor, dtype: torch.dtype) -> list:
    """One (a, b, c, on) per step, in ``dtype``: a (3,) vector repeated ``ns_steps`` times, or the rows of a
    matrix; ``on`` is ``None``, or for a batched ``ns_steps`` whether the step is within this member's count."""
    coeffs = ns_coeffs.to(dtype)
    if coeffs.ndim != 1:
        return [(r[0], r[1], r[2], None) for r in coeffs.unbind()]
    bound, batched = _loop_count(ns_steps)
    return [(coeffs[0], coeffs[1], coeffs[2], None if batched is None else i < batched) for i in range(bound)]


def _loop_count(n: int | torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """``(steps to run, per-member count or None)`` for ``ns_steps``, a Python int or an integer tensor
    (``inject_hyperparams(muon)`` keeps it in the state, as Optax does).

    A loop in Python runs a host-known number of times: an integer tensor is read (its largest value over
    a ``torch.func.vmap`` batch, the wrappers taken off), and where the members' counts differ, the steps
    past a member's count leave its iterate unchanged (what ``jax.lax.fori_loop`` does under ``jax.vmap``).
    """
    if not isinstance(n, torch.Tensor):
        return int(n), None
    physical = n
    while torch._C._functorch.is_functorch_wrapped_tensor(physical):
        physical = torch._C._functorch.get_unwrapped(physical)
    bound = int(physical.max())
    return bound, (n if physical.numel() > 1 else None)


def orthogonalize_via_newton_schulz(x: torch.Tensor, ns_coeffs: torch.Tensor | Sequence, ns_steps: int = 5,
                                    preconditioning: str = "frobenius", eps: Scalar = 1e-8,
                                    dimension_numbers: MuonDimensionNumbers | None = None) -> torch.Tensor:
    r"""Approximately :math:`U V^H` of :math:`x = U S V^H` by a Newton-Schulz iteration (Optax's).

    The matrix is first normalised (``preconditioning``), transposed to be wide, then iterated
    :math:`x \leftarrow a x + (b A + c A^2) x`, :math:`A = x x^H`. With Muon's coefficients the singular
    values land in about [0.5, 1.5] rather than at 1, which does not hurt training (Jordan).

    Args:
      x: a matrix, or a weight with ``dimension_numbers`` (batch axes orthogonalised slice by slice).
      ns_coeffs: (3,) coefficients used ``ns_steps`` times, or (n, 3): one row per step.
      ns_steps: number of steps for (3,) coefficients.
      preconditioning: ``"frobenius"``, ``"spectral"`` (divide by that norm + ``eps``), ``"aol"`` or
        ``"schatten"`` (a rescaled first step).
      eps: added to the norm of the first two.
      dimension_numbers: which axes form the matrix (:class:`MuonDimensionNumbers`).

    Returns:
      A tensor shaped like ``x``, in its dtype (bfloat16 and float16 iterate in float32, Optax in their
      own dtype, where one rounding of the input moves the result by ~5%).

    Example:
        >>> import torch
        >>> from fxtrain.contrib._muon import orthogonalize_via_newton_schulz
        >>> x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
        >>> o = orthogonalize_via_newton_schulz(x, torch.tensor([2.0, -1.5, 0.5]), ns_steps=20)
        >>> torch.allclose(o.T @ o, torch.eye(3), atol=1e-4)
        True
    """
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"preconditioning={preconditioning!r} must be one of {_PRECONDITIONINGS}")
    if x.ndim != 2 and dimension_numbers is None:
        raise ValueError(f"Newton-Schulz needs a matrix or dimension_numbers; got shape {tuple(x.shape)}")
    ns_coeffs = torch.as_tensor(ns_coeffs, dtype=torch.float32, device=x.device)
    if ns_coeffs.ndim > 2 or ns_coeffs.shape[-1] != 3:
        raise ValueError(f"ns_coeffs must have shape (3,) or (n, 3), got {tuple(ns_coeffs.shape)}")
    return _orthogonalized(x, dimension_numbers or MuonDimensionNumbers(), ns_coeffs, ns_steps, preconditioning, eps)


def _orthogonalized(x: torch.Tensor, dims: MuonDimensionNumbers, coeffs: torch.Tensor, ns_steps: int,
                    preconditioning: str, eps: Scalar) -> torch.Tensor:
    # bfloat16 and float16 iterate in float32: in bfloat16 the iteration's own rounding is ~5% of the update
    # (one ulp of input moves it that much), where Optax iterates in the leaf's dtype.
    wide = torch.promote_types(x.dtype, torch.float32)
    m, restore = _as_matrices(x.to(wide), dims)
    tall = m.shape[-2] > m.shape[-1]  # f(X^T) = f(X)^T: iterate on the wide side, A is the smaller Gram
    o = _newton_schulz(m.mT if tall else m, _coefficient_rows(coeffs, ns_steps, wide), preconditioning, eps)
    return restore(o.mT if tall else o).to(x.dtype)


def _whole(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` of the full value of ``x``; a DTensor comes back with its own mesh and placements.

    A tensor-parallel matrix is gathered (one all-gather) and every rank runs the same iteration on it:
    redundant work, but the update is the one-process update exactly, and the Replicate -> Shard step back
    to the leaf's placements is a local slice (no collective).
    """
    if not isinstance(x, DTensor):
        return fn(x)
    full = fn(x.full_tensor())
    mesh = x.device_mesh
    return DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(mesh, x.placements)


# --- resolving dimension numbers per leaf ------------------------------------------------------------

def _is_dims(x: Any) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def _broadcast(dims: Any, t: Any) -> Any:
    """``dims`` (a :class:`MuonDimensionNumbers`, ``None``, or a tree of them, a prefix of ``t``) given to
    every leaf of ``t``; masked-out subtrees (:class:`MaskedNode`) stay masked."""
    def fill(d, sub):
        return optree.tree_map(lambda _: d, sub, **tree.optree_options())

    try:
        return optree.tree_map(fill, dims, t, is_leaf=_is_dims, **tree.optree_options())
    except ValueError as e:
        raise ValueError(f"weight dimension numbers do not match the params' structure ({e})") from None


def _resolve(weight_dimension_numbers: WeightDimNumOrFn, t: Any) -> Any:
    dims = weight_dimension_numbers(t) if callable(weight_dimension_numbers) else weight_dimension_numbers
    return _broadcast(dims, t)


def _per_leaf(weight_dimension_numbers: WeightDimNumOrFn, updates: Any) -> list[DimNums]:
    """The dimension numbers of each gradient leaf (in :func:`fxtrain.tree.align`'s order)."""
    flat, spec = tree.flatten(updates)
    dims = spec.flatten_up_to(_resolve(weight_dimension_numbers, updates))  # stops at the updates' leaves
    return [d for d, x in zip(dims, flat) if x is not None]


def _check_matrices(updates: Any, dims: list[DimNums]) -> None:
    """Refuses, naming its path, a leaf that is no matrix and has no dimension numbers (as Optax does)."""
    present = [(p, x) for p, x in zip(tree.paths(updates), tree.flatten(updates)[0]) if x is not None]
    for (path, x), d in zip(present, dims):
        if d is None and x.ndim != 2:
            raise ValueError(f"the update at '{path}' has shape {tuple(x.shape)}, not a matrix; give it "
                             "MuonDimensionNumbers (weight_dimension_numbers=) or leave it to muon's AdamW")


def _ns_coefficients(name: str, ns_coeffs: Any, ns_steps: int) -> tuple:
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in _NS_COEFFS_PRESETS:
            raise ValueError(f"{name}: ns_coeffs={ns_coeffs!r} must be one of {sorted(_NS_COEFFS_PRESETS)} or "
                             "coefficients of shape (3,) or (n, 3)")
        ns_coeffs = _NS_COEFFS_PRESETS[ns_coeffs]
    shape = tuple(torch.as_tensor(ns_coeffs, dtype=torch.float32).shape)
    if len(shape) not in (1, 2) or shape[-1] != 3:
        raise ValueError(f"{name}: ns_coeffs must have shape (3,) or (n, 3), got {shape}")
    if len(shape) == 2 and shape[0] > ns_steps:
        raise ValueError(f"{name}: ns_coeffs has {shape[0]} rows, more than ns_steps={ns_steps} (Optax refuses "
                         "this too); pass ns_steps >= the number of rows")
    return ns_coeffs


# --- transforms --------------------------------------------------------------------------------------

@transform(elementwise=False)
def scale_by_muon(ns_coeffs: Sequence | str = _DEFAULT_NS_COEFFS, ns_steps: int = 5, beta: Scalar = 0.95,
                  eps: Scalar = 1e-8, mu_dtype: torch.dtype | str | None = None, *, nesterov: bool = True,
                  adaptive: bool = False,
                  preconditioning: Literal["frobenius", "spectral", "aol", "schatten"] = "frobenius",
                  weight_dimension_numbers: WeightDimNumOrFn = None) -> GradientTransformation:
    r"""Rescales updates to the orthogonalised momentum (Muon's direction; Optax's ``scale_by_muon``).

    .. math::
        m_t = \beta m_{t-1} + (1 - \beta) g_t, \qquad
        \hat m_t = \frac{\beta\, m_t}{1 - \beta^{t+1}} + \frac{(1 - \beta)\, g_t}{1 - \beta^t}
        \;\;(\text{else } m_t / (1 - \beta^t)), \qquad u_t = \mathrm{NS}(\hat m_t) \approx U V^H

    where :math:`\hat m_t = U S V^H` and NS is the Newton-Schulz iteration of
    :func:`orthogonalize_via_newton_schulz`. ``adaptive`` scales :math:`u_t` by
    :math:`\langle \hat m_t, u_t \rangle` (the dual norm, Bernstein et al.). Every leaf must be a matrix
    or have :class:`MuonDimensionNumbers`; :func:`muon` sends the others to AdamW.

    DTensor leaves (tensor-parallel matrices) are orthogonalised whole: gathered, iterated on every rank,
    and returned with the leaf's placements, so the update equals the one-process update. Low-precision
    momenta iterate in float32 (see :func:`orthogonalize_via_newton_schulz`).

    Args:
      ns_coeffs: the quintic's (a, b, c), or one row per step ((n, 3), with n <= ``ns_steps``), or a
        preset name (``"standard"``, ``"dion"``).
      ns_steps: number of Newton-Schulz steps for (3,) coefficients.
      beta: decay of the momentum.
      eps: added to the norm that normalises the momentum before the iteration.
      mu_dtype: dtype of the momentum (a ``torch.dtype`` or its name); ``None``: the param dtype.
      nesterov: use Nesterov momentum.
      adaptive: scale by the dual norm of the momentum.
      preconditioning: ``"frobenius"`` (default), ``"spectral"``, ``"aol"`` or ``"schatten"`` (see
        :func:`muon`).
      weight_dimension_numbers: :class:`MuonDimensionNumbers` for every leaf, a tree of them (``None``:
        a matrix), or a function of the updates returning one.

    Returns:
      A transform with state :class:`MuonState`. Updates keep the gradients' dtype.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_muon(ns_steps=10)
        >>> g = {"w": torch.tensor([[3.0, 0.0], [0.0, 0.5]])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> torch.linalg.svdvals(u["w"]).gt(0.5).all().item()   # both directions, about equally long
        True

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline <https://github.com/KellerJordan/modded-nanogpt>`_, 2024.
      Bernstein and Newhouse, `Old Optimizer, New Norm: An Anthology <https://arxiv.org/abs/2409.20325>`_, 2024.
    """
    check_nonnegative("scale_by_muon", beta=beta, eps=eps)
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"scale_by_muon: preconditioning={preconditioning!r} must be one of {_PRECONDITIONINGS}")
    ns_coeffs = _ns_coefficients("scale_by_muon", ns_coeffs, ns_steps)
    mu_dtype = as_dtype(mu_dtype, "scale_by_muon: mu_dtype")

    def init_fn(params):
        return MuonState(count=counter(params), mu=tree.zeros_like(params, dtype=mu_dtype),
                         ns_coeffs=torch.as_tensor(ns_coeffs, dtype=torch.float32, device=param_device(params)).clone())

    def debiased_(g, m, count):
        """The bias-corrected (Nesterov) momentum, in g's buffer (when dtypes agree)."""
        if not nesterov:
            return tree.div_(tree.copy_(g, m), bias_correction(beta, count))
        g = tree.scale_(tree.div_(g, bias_correction(beta, count)), 1 - beta)
        with tree.functional():
            ahead = tree.scale_(tree.div_(m, bias_correction(beta, count + 1)), beta)
        return tree.add_(ahead, g) if mixed_dtypes(ahead, g) else tree.add_(g, ahead)

    def direction(h, dims, coeffs):
        o = _orthogonalized(h, dims or MuonDimensionNumbers(), coeffs, ns_steps, preconditioning, eps)
        return (h.conj() * o).sum() * o if adaptive else o

    def update_fn(updates, state, params=None):
        del params
        dims = _per_leaf(weight_dimension_numbers, updates)
        _check_matrices(updates, dims)  # errors raised in update are prefixed with the transform's repr
        g, mu = tree.align(updates, state.mu)
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        mu, m = ema_(mu, g, beta)
        if mixed_dtypes(m, g):  # the momentum's precision (Optax: the promoted dtype) through the iteration
            with tree.functional():
                h = debiased_(g, m, count)
        else:
            h = g = debiased_(g, m, count)
        out = [_whole(x, lambda full, d=d: direction(full, d, state.ns_coeffs)) for x, d in zip(h, dims)]
        g = tree.copy_(g, out)
        return tree.put(updates, updates, g), MuonState(count, tree.put(state.mu, updates, mu), state.ns_coeffs)

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=False)  # needs each weight's global shape: the local piece's would be wrong
def scale_by_shape(weight_dimension_numbers: WeightDimNumOrFn = None, consistent_rms: Scalar | None = None
                   ) -> GradientTransformation:
    r"""Scales each update by a factor of its weight's shape (Optax's ``contrib._muon.scale_by_shape``).

    :math:`\sqrt{\max(1, \text{fan\_out} / \text{fan\_in})}` (Jordan's width transfer), or with
    ``consistent_rms``: :math:`\sqrt{\max(\text{fan\_in}, \text{fan\_out})} \cdot \text{consistent\_rms}`
    (an RMS independent of the shape, Liu et al.). Fans come from the dimension numbers (default: a matrix).
    Not exported (as in Optax): :func:`muon` chains it after :func:`scale_by_muon`.

    Args:
      weight_dimension_numbers: as for :func:`scale_by_muon`.
      consistent_rms: the target RMS factor; ``None``: width transfer.

    Returns:
      A stateless transform (``EmptyState``).

    Example:
        >>> import torch
        >>> from fxtrain.contrib._muon import scale_by_shape
        >>> tx = scale_by_shape()
        >>> tx.update({"w": torch.ones(2, 8)}, tx.init(None))[0]["w"][0, 0].item()   # sqrt(8 / 2)
        2.0
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        dims = _per_leaf(weight_dimension_numbers, updates)
        g = tree.align(updates)[0]
        fans = [_fans(tuple(x.shape), d) for x, d in zip(g, dims)]
        if consistent_rms is None:
            factors = [math.sqrt(max(1.0, fan_out / fan_in)) for fan_in, fan_out in fans]
        else:
            factors = [math.sqrt(max(fan_in, fan_out)) * consistent_rms for fan_in, fan_out in fans]
        return tree.put(updates, updates, tree.scale_(g, factors)), state

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def muon(learning_rate: Scalar | Callable, ns_coeffs: Sequence | str = _DEFAULT_NS_COEFFS, ns_steps: int = 5,
         beta: Scalar = 0.95, eps: Scalar = 1e-8, weight_decay: Scalar = 0.0, weight_decay_mask: Mask | None = None,
         mu_dtype: torch.dtype | str | None = None, *, nesterov: bool = True, adaptive: bool = False,
         preconditioning: Literal["frobenius", "spectral", "aol", "schatten"] = "frobenius",
         adam_b1: Scalar = 0.9, adam_b2: Scalar = 0.999, adam_eps_root: Scalar = 0.0,
         adam_weight_decay: Scalar = 0.0, adam_learning_rate: Scalar | Callable | None = None,
         muon_weight_dimension_numbers: WeightDimNumOrFn = None, consistent_rms: Scalar | None = None
         ) -> GradientTransformation:
    r"""Muon: Momentum Orthogonalized by Newton-Schulz for matrices, AdamW for the rest (Optax's ``contrib.muon``).

    Matrices (by default every 2-D leaf; or the leaves ``muon_weight_dimension_numbers`` gives numbers
    for) get

    .. math:: \theta_{t+1} = \theta_t - \eta \left(s\, u_t + \lambda \theta_t\right)

    with :math:`u_t` from :func:`scale_by_muon` and :math:`s` the shape factor
    :math:`\sqrt{\max(1, \text{fan\_out}/\text{fan\_in})}` (or :math:`\sqrt{\max(\text{fan\_in},
    \text{fan\_out})}\cdot` ``consistent_rms``). Every other leaf gets :func:`fxtrain.adamw` with the
    ``adam_*`` arguments (``eps``, ``mu_dtype`` and ``nesterov`` shared).

    Preconditionings before the iteration: ``"frobenius"`` (safe, standard), ``"spectral"`` (exact
    spectral norm: costlier, better orthogonality), ``"aol"`` (row rescaling from the Gram matrix,
    often one step fewer; Boissin et al.), ``"schatten"`` (Schatten-4 rescaling; Grishina et al.).

    Not elementwise: ``sharded_apply`` refuses it. On DTensor leaves it computes the one-process update
    (see :func:`scale_by_muon`).

    Args:
      learning_rate: :math:`\eta` for the matrices, a number, a 0-dim tensor or a schedule.
      ns_coeffs: Newton-Schulz coefficients, (3,) or (n, 3), or a preset: ``"standard"``, ``"dion"``.
      ns_steps: number of Newton-Schulz steps (for (3,) coefficients).
      beta: decay of the momentum.
      eps: added to the normalising norm, and AdamW's eps.
      weight_decay: :math:`\lambda` for the matrices (multiplied by the learning rate).
      weight_decay_mask: where to decay among the matrices (see :func:`fxtrain.adamw`).
      mu_dtype: dtype of the momenta; ``None``: the param dtype.
      nesterov: Nesterov momentum (both parts).
      adaptive: scale by the dual norm of the momentum.
      preconditioning: see above.
      adam_b1: AdamW's first-moment decay.
      adam_b2: AdamW's second-moment decay.
      adam_eps_root: AdamW's eps inside the square root.
      adam_weight_decay: AdamW's decay.
      adam_learning_rate: AdamW's learning rate; ``None``: ``learning_rate``.
      muon_weight_dimension_numbers: a tree (or prefix) of :class:`MuonDimensionNumbers`, ``None`` for
        the leaves AdamW takes, or a function of the params returning one; ``None``: every 2-D leaf.
      consistent_rms: switch the shape factor to consistent RMS (0.2 matches AdamW's RMS).

    Returns:
      ``partition({"muon": chain(scale_by_muon(...), scale_by_shape(...), add_decayed_weights(weight_decay,
      weight_decay_mask), scale_by_learning_rate(learning_rate)), "adam": adamw(...)}, labels)``.

    Example:
        >>> import torch, fxtrain as fx
        >>> params = {"w": torch.ones(4, 2), "b": torch.ones(2)}
        >>> tx = fx.contrib.muon(0.02)
        >>> state = tx.init(params)
        >>> u, state = tx.update(params, state, params)
        >>> sorted(state.inner_states)   # the matrix goes to Muon, the vector to AdamW
        ['adam', 'muon']
        >>> [round(x, 4) for x in u["b"].tolist()]
        [-0.02, -0.02]

    References:
      Jordan, `modded-nanogpt: Speedrunning the NanoGPT baseline <https://github.com/KellerJordan/modded-nanogpt>`_, 2024.
      Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025.
      Boissin et al., `Turbo-Muon <https://arxiv.org/abs/2512.04632>`_, 2025.
      Grishina et al., `Accelerating Newton-Schulz Iteration for Orthogonalization via Chebyshev-type
      Polynomials <https://arxiv.org/abs/2506.10935>`_, 2025.
      Ahn et al., `Dion: Distributed Orthonormalized Updates <https://arxiv.org/abs/2504.05295>`_, 2025.
    """
    check_learning_rate("muon", learning_rate=learning_rate, beta=beta, eps=eps, weight_decay=weight_decay, adam_b1=adam_b1,
           adam_b2=adam_b2, adam_eps_root=adam_eps_root, adam_weight_decay=adam_weight_decay,
           adam_learning_rate=adam_learning_rate)
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"muon: preconditioning={preconditioning!r} must be one of {_PRECONDITIONINGS}")
    ns_coeffs = _ns_coefficients("muon", ns_coeffs, ns_steps)
    if muon_weight_dimension_numbers is None:
        def labels(params):
            return tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)  # a None param keeps None
        dims: WeightDimNumOrFn = MuonDimensionNumbers()
    else:
        def labels(params):
            return optree.tree_map(lambda d: "adam" if d is None else "muon",
                                   _resolve(muon_weight_dimension_numbers, params), is_leaf=_is_dims,
                                   **tree.optree_options())
        dims = muon_weight_dimension_numbers

    return partition({
        "muon": chain(
            scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov, adaptive=adaptive,
                          preconditioning=preconditioning, weight_dimension_numbers=dims),
            scale_by_shape(dims, consistent_rms),
            add_decayed_weights(weight_decay, weight_decay_mask),
            scale_by_learning_rate(learning_rate),
        ),
        "adam": adamw(learning_rate if adam_learning_rate is None else adam_learning_rate, adam_b1, adam_b2, eps,
                      adam_eps_root, mu_dtype, weight_decay=adam_weight_decay, nesterov=nesterov),
    }, labels)
