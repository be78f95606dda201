"""``split_real_and_imaginary``: complex params as pairs of real ones (Optax's ``contrib._complex_valued``)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from fxtrain._base import GradientTransformation, call_, is_elementwise, transform, with_traits


__all__ = ["SplitRealAndImaginaryArrays", "SplitRealAndImaginaryState", "split_real_and_imaginary"]

class SplitRealAndImaginaryArrays(NamedTuple):
    """A complex tensor as the pair of real tensors the inner transform of :func:`split_real_and_imaginary` sees."""

    real: torch.Tensor
    imaginary: torch.Tensor


class SplitRealAndImaginaryState(NamedTuple):
    """State of :func:`split_real_and_imaginary`: the inner transform's, built on the split params."""

    inner_state: Any


def _split(x: Any) -> Any:
    # Views: a donated inner update writing into them writes into the complex buffer.
    return SplitRealAndImaginaryArrays(x.real, x.imag) if isinstance(x, torch.Tensor) and x.is_complex() else x


def _merge(x: Any) -> Any:
    return torch.complex(x.real, x.imaginary) if isinstance(x, SplitRealAndImaginaryArrays) else x


def _map_split(fn: Callable, t: Any) -> Any:
    return optree.tree_map(fn, t, is_leaf=lambda x: isinstance(x, SplitRealAndImaginaryArrays), none_is_leaf=True,
                           namespace="fxtrain")


@transform(elementwise=None)
def split_real_and_imaginary(inner: GradientTransformation) -> GradientTransformation:
    r"""Runs ``inner`` on complex params as on pairs of real ones (Optax's ``contrib.split_real_and_imaginary``).

    Each complex leaf :math:`z = x + iy` of the updates and params becomes a
    :class:`SplitRealAndImaginaryArrays` ``(x, y)`` for ``inner``; its two real updates are merged back into
    one complex update. Real leaves pass unchanged. An optimizer then treats :math:`x` and :math:`y` as
    independent real params (Adam's second moment per part, not :math:`|g|^2`).

    PyTorch's gradient of a real loss with respect to a complex tensor is already the conjugate of JAX's
    (``z.grad`` points along the steepest ascent), so unlike with ``jax.grad`` no conjugation is needed
    before the update.

    Args:
      inner: the transform to run on the real pairs.

    Returns:
      A transform with state :class:`SplitRealAndImaginaryState`; elementwise if ``inner`` is.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.split_real_and_imaginary(fx.scale_by_adam())
        >>> z = torch.tensor([3.0 - 4.0j, 0.5 + 0.0j])
        >>> u, state = tx.update(z, tx.init(z), z)
        >>> [[round(v, 4) for v in pair] for pair in torch.view_as_real(u).tolist()]   # Adam's first step: signs
        [[1.0, -1.0], [1.0, 0.0]]

    References:
      Optax issue `#196 <https://github.com/google-deepmind/optax/issues/196>`_ (complex gradient conventions).
    """
    def init_fn(params):
        return SplitRealAndImaginaryState(inner.init(_map_split(_split, params)))

    def update_fn(updates, state, params=None):
        split_updates, split_params = _map_split(_split, updates), _map_split(_split, params)
        split_updates, inner_state = call_(inner, split_updates, state.inner_state, split_params)
        return _map_split(_merge, split_updates), SplitRealAndImaginaryState(inner_state)

    return with_traits(GradientTransformation(init_fn, update_fn), elementwise=is_elementwise(inner))
