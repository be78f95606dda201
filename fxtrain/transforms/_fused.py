"""torch's fused optimizer kernels as a kernel choice of the donated step: ``adam``, ``adamw``, ``sgd``.

``fx.adamw(...)`` is a chain (``scale_by_adam``, ``add_decayed_weights``, ``scale_by_learning_rate``)
whose foreach kernels make several passes over memory, then ``apply_updates_`` makes one more. torch
ships the same math as one fused kernel per optimizer (``torch._fused_adamw_``, ``torch._fused_adam_``,
``torch._fused_sgd_``, on CPU and GPU in torch 2.13) that reads each element once and writes the params
and moments in place. When a training step owns the params (:func:`fxtrain.train_step`, not compiled),
it asks :func:`step_` to run the whole update-and-apply as that one kernel call.

No second copy of the math lives here: an optimizer *declares* (:func:`declare`, called by the
factories in ``fxtrain/optimizers.py``) which torch kernel computes exactly its chain, and only when
its arguments are ones that kernel covers (plain-number hyperparameters, no schedule, no ``mask``,
``mu_dtype``, ``eps_root`` or ``nesterov`` for Adam). The state is the chain's own (``ScaleByAdamState``,
``TraceState``...), so a run can switch between the fused and foreach kernels at any step, and
checkpoints do not know which one ran. The numerics agree with the foreach path to float32 rounding,
with one caveat:

* AdamW: Optax adds ``weight_decay * p`` to the Adam direction and scales the sum by ``-lr``; torch's
  ``p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`` is the same expression, rearranged.
* bias corrections: fxtrain (as Optax) computes ``1 - b ** count`` in float32 on the device, torch's
  kernel in float64 from the same count. The float32 one loses digits to cancellation early on (at
  ``count=1``, ``b2=0.999``: 1.3e-5 relative), so an Adam update differs by up to ~7e-6 relative in the
  first steps, shrinking as ``b2 ** count`` moves away from 1 (tests/test_fused.py bounds it).
* SGD momentum: Optax's ``trace`` starts from a zero buffer (``t_1 = g_1``), which is torch's update
  with ``dampening=0`` when the buffer is zero; torch's ``is_first_step`` shortcut is never needed.

Leaves must allow it too (:func:`step_` checks each call, in Python, on metadata only): plain (not
DTensor) floating-point tensors, all on one device, each param, gradient and state leaf of one dtype and
contiguous. Otherwise the step takes the foreach kernels (same numbers, up to the above).

Example:
    >>> import torch, fxtrain as fx
    >>> from fxtrain.transforms import _fused
    >>> tx = fx.adamw(0.1)
    >>> params = {"w": torch.ones(2)}
    >>> state = tx.init(params)
    >>> _fused.spec(tx).name, _fused.spec(fx.adamw(0.1, mask={"w": False})) is None
    ('adamw', True)
    >>> ref, _ = tx.update({"w": torch.tensor([1.0, -1.0])}, state, params)
    >>> _fused.step_(tx, {"w": torch.tensor([1.0, -1.0])}, state, params)
    True
    >>> torch.allclose(params["w"], 1 + ref["w"])
    True
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, kernel
from fxtrain.transforms._momentum import TraceState

__all__ = ["FusedSpec", "applies", "declare", "spec", "step_"]


class FusedSpec(NamedTuple):
    """Which fused torch kernel computes a chain, with the numbers it needs (all Python numbers)."""

    name: str  # "adam", "adamw" or "sgd"
    hyperparams: dict


def declare(tx: GradientTransformation, name: str, **hyperparams: Any) -> GradientTransformation:
    """Marks ``tx`` (a chain built by an optimizer factory) as computed exactly by torch's fused ``name``.

    The mark is set only when every hyperparameter is a plain number (the fused kernels take floats;
    tensors from ``inject_hyperparams`` and schedules stay on the foreach path; bools are flags).
    Returns ``tx``.
    """
    if all(isinstance(v, (bool, int, float)) for v in hyperparams.values()):
        kernel(tx).fused = FusedSpec(name, dict(hyperparams))  # the chain's own kernel: one per instance
    return tx


def spec(tx: GradientTransformation) -> FusedSpec | None:
    """The :class:`FusedSpec` declared for ``tx``, or ``None``."""
    return getattr(kernel(tx), "fused", None)


def step_(tx: GradientTransformation, grads: Any, state: Any, params: Any) -> bool:
    """Runs ``tx``'s update *and* ``apply_updates_`` as one fused kernel, in place on ``params`` and ``state``.

    Returns ``False`` (and touches nothing) when :func:`applies` is false; the caller then runs the
    foreach kernels. ``grads`` are read, never written.
    """
    plan = _plan(tx, grads, state, params)
    if plan is None:
        return False
    plan()
    return True


def applies(tx: GradientTransformation, grads: Any, state: Any, params: Any) -> bool:
    """Whether :func:`step_` would run a fused kernel on these trees (metadata only, no sync)."""
    return _plan(tx, grads, state, params) is not None


def _plan(tx, grads, state, params):
    """A thunk running the fused kernel on these trees, or ``None`` where none applies."""
    s = spec(tx)
    if s is None:
        return None
    hp = s.hyperparams
    if s.name in ("adam", "adamw"):
        g, p, mu, nu = tree.align(grads, params, state[0].mu, state[0].nu, what="params")
        if not _allowed(g, p, mu, nu):
            return None
        count = state[0].count
        fused = torch._fused_adamw_ if s.name == "adamw" else torch._fused_adam_

        def run():
            count.add_(1)
            if p:
                steps = [count.to(torch.float32)] * len(p)  # read, not written, by the kernel
                fused(p, g, mu, nu, [], steps, lr=hp["learning_rate"], beta1=hp["b1"], beta2=hp["b2"],
                      weight_decay=hp.get("weight_decay", 0.0), eps=hp["eps"], amsgrad=False, maximize=False)
        return run
    if s.name == "sgd":
        if isinstance(state[0], TraceState):  # momentum given (never 0: sgd declares no kernel then)
            g, p, bufs = tree.align(grads, params, state[0].trace, what="params")
            ok = _allowed(g, p, bufs)
        else:
            (g, p), bufs = tree.align(grads, params, what="params"), []
            ok = _allowed(g, p)
        if not ok:
            return None

        def run():
            if p:
                torch._fused_sgd_(p, g, bufs, weight_decay=0.0, momentum=hp["momentum"], lr=hp["learning_rate"],
                                  dampening=0.0, nesterov=hp["nesterov"], maximize=False, is_first_step=False)
        return run
    return None


def _allowed(*lists: list) -> bool:
    """Plain floating tensors on one device, leafwise one dtype, contiguous (metadata only, no sync)."""
    first = lists[0]
    if not first:
        return True
    device = first[0].device
    for row in zip(*lists):
        dtype = row[0].dtype
        for x in row:
            if (type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter)) or x.dtype != dtype \
                    or x.device != device or not x.is_floating_point() or not x.is_contiguous():
                return False
    return True
