"""Test utilities shared by fxtrain's tests and by users testing their own transforms.

:func:`check_transform` runs a transform through every way fxtrain runs it (pure, donated, ``no_grad``,
``vmap``, ``grad``) and checks the traits it declares; :func:`assert_trees_close` compares trees by path;
:class:`TensorMemory` counts the bytes of tensors a block allocates (a deterministic peak-memory probe).

Example:
    >>> import torch
    >>> from fxtrain.testing import assert_trees_close
    >>> assert_trees_close({"a": torch.ones(2)}, {"a": torch.ones(2) + 1e-9})
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import numpy as np
import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxtrain import tree
from fxtrain._base import GradientTransformation, apply_updates, traits, update_

MODES = ("pure", "no_grad", "donated", "vmap", "grad", "elementwise")


def check_transform(tx: GradientTransformation, params: Any, *, steps: int = 3, modes: Sequence[str] = MODES,
                    extra_args: dict | None = None, state: bool = True, rtol: float = 1e-5, atol: float = 1e-6,
                    seed: int = 0) -> None:
    """Runs ``tx`` for ``steps`` updates on random gradients shaped like ``params`` in every way fxtrain runs
    it, and checks that they agree; raises one AssertionError naming the mode, the step and the leaf path.

    The reference is ``tx.update`` where autograd records (out of place, what ``vmap`` and ``grad`` see).
    Each mode in ``modes`` is compared with it:

    * ``pure``: ``tx.update`` leaves its inputs (updates, state, params) unchanged, bit for bit;
    * ``no_grad``: ``tx.update`` under ``torch.no_grad`` (the in-place kernel on copies) gives the same
      updates and states (``rtol``/``atol``: in place and out of place may round differently) and leaves
      its inputs unchanged;
    * ``donated``: :func:`fxtrain.update_` (a donated step's update: in place on the buffers it is given)
      gives what ``no_grad`` gives. A wrapper that reads, after :func:`fxtrain.call_`, what it donated to a
      child fails here; :func:`fxtrain.call` never does;
    * ``vmap``: ``torch.func.vmap`` of ``init`` and ``update`` over an ensemble of two (the second member
      with its own params and gradients) equals the reference run per member;
    * ``grad``: in float64, ``torch.func.grad`` of ``sum_t <w_t, u_t>`` (the updates of every step, params
      moving by them) with respect to the gradients fed in is finite and matches central differences
      along a random direction (relative 1e-3, at a step of 1e-3 or 1e-4). A transform that is not differentiable must raise, never
      return a detached or zero gradient: leave ``grad`` out of ``modes`` for one that raises by design;
    * ``elementwise``, checked only where ``tx`` declares it (``@fx.transform(elementwise=True)``, what
      ``fx.sharded_apply`` relies on): each leaf split in two pieces (as a 2-way shard holds it) and run
      as separate leaves gives the pieces of the whole leaf's updates.

    Args:
      tx: the transform.
      params: a tree of floating-point tensors (``None`` leaves allowed) shaped like the params ``tx``
        will see; it is not modified.
      steps: updates per run (a transform that acts every k-th call needs ``steps >= k``).
      modes: the modes to run (default: all of :data:`MODES`).
      extra_args: keyword arguments every update gets (``value=`` for transforms that read it).
      state: compare the states too, not only the updates (``False`` for a state that holds values without
        meaning at some steps, e.g. ``accumulate``'s sum right after an emission; the later updates still
        show any difference that matters).
      rtol: the relative tolerance of every comparison but ``pure``'s (exact) and ``grad``'s.
      atol: the absolute tolerance of the same comparisons.
      seed: the seed of the random gradients.

    Raises:
      AssertionError: one line: the transform, the mode, the step and the first leaf path that disagrees.

    Example: a wrapper written with :func:`fxtrain.call` passes; the same wrapper written with the donating
    :func:`fxtrain.call_` reads the buffer its child overwrote, and is caught:

        >>> import torch, fxtrain as fx
        >>> from fxtrain.testing import check_transform
        >>> @fx.transform(elementwise=None)
        ... def mix(tx, alpha, run=fx.extend.call):   # (1 - alpha) * tx's update + alpha * the gradient
        ...     def update_fn(updates, state, params=None, **extra_args):
        ...         new, state = run(tx, updates, state, params, extra_args)
        ...         return fx.tree.map(lambda n, g: (1 - alpha) * n + alpha * g, new, updates), state
        ...     return fx.extend.combine(tx.init, update_fn, (tx,), lambda s: (s,))
        >>> params = {"w": torch.ones(3), "b": torch.zeros(2)}
        >>> check_transform(mix(fx.adam(0.1), 0.5), params)
        >>> check_transform(mix(fx.adam(0.1), 0.5, run=fx.extend.call_), params)
        Traceback (most recent call last):
        ...
        AssertionError: check_transform(mix(alpha=0.5, run=call_, adam(0.1))): mode 'no_grad', step 0: updates differ from pure's at 'b' ...
    """
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"check_transform: unknown modes {sorted(unknown)}; the modes are {list(MODES)}")
    extra = dict(extra_args or {})
    fail = _Failure(repr(tx))
    gs = _gradients(params, steps, seed)

    with torch.enable_grad():  # the reference: out of place, as vmap and grad see it
        ref = _run(tx, params, gs, extra, fail, "pure", check_pure="pure" in modes)
    if "no_grad" in modes or "donated" in modes:
        with torch.no_grad():
            no_grad = _run(tx, params, gs, extra, fail, "no_grad", check_pure=True)
        if "no_grad" in modes:
            _compare(no_grad, ref, fail, "no_grad", "pure", rtol, atol, state)
        if "donated" in modes:
            donated = _run(tx, params, gs, extra, fail, "donated", donate=True)
            _compare(donated, no_grad, fail, "donated", "no_grad", rtol, atol, state)
    if "vmap" in modes:
        _check_vmap(tx, params, gs, extra, ref, fail, rtol, atol, seed, state)
    if "grad" in modes:
        _check_grad(tx, params, gs, extra, fail, seed)
    if "elementwise" in modes and traits(tx).elementwise:
        _check_elementwise(tx, params, gs, extra, ref, fail, rtol, atol)


class _Failure:
    """Raises check_transform's one-line AssertionError."""

    def __init__(self, label: str):
        self.label = label

    def __call__(self, mode: str, what: str) -> None:
        raise AssertionError(f"check_transform({self.label}): mode '{mode}', {what}")


def _gradients(params: Any, steps: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)

    def draw(p):
        if not (isinstance(p, torch.Tensor) and (p.is_floating_point() or p.is_complex())):
            return p
        return torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype).to(p.device)

    return [tree.map(draw, params) for _ in range(steps)]


def _call(tx: GradientTransformation, g: Any, state: Any, params: Any, extra: dict, donate: bool):
    return update_(tx, g, state, params, **extra) if donate else tx.update(g, state, params, **extra)


def _run(tx: GradientTransformation, params: Any, gs: list, extra: dict, fail: _Failure, mode: str, *,
         check_pure: bool = False, donate: bool = False) -> list:
    """``[(updates, state)]`` per step; a donated run gets copies (its inputs are its own to overwrite)."""
    out = []
    params = tree.clone(params)
    state = tx.init(params)
    for k, g in enumerate(gs):
        g = tree.clone(g)
        before = tree.clone((g, state, params)) if check_pure else None
        zeros = tree.map(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, g) if donate else None
        try:
            u, new_state = _call(tx, g, tree.clone(state) if donate else state, params, extra, donate)
        except Exception as e:  # noqa: BLE001 - reported as this mode's failure, by name
            fail(mode, f"step {k}: raised {type(e).__name__}: {_first_line(e)}")
        if donate:  # a donated kernel may leave untouched updates as None (accumulate between emissions)
            u = optree.tree_map(lambda d, z: z if d is None else d, u, zeros, **tree.optree_options())
        if check_pure:
            for what, now, was in zip(("updates", "state", "params"), (g, state, params), before):
                path = _first_differing(now, was, 0.0, 0.0)
                if path is not None:
                    fail(mode, f"step {k}: tx.update wrote into its input {what} at '{path}' (update must be pure)")
        out.append((u, new_state))
        state = new_state
        params = apply_updates(params, u)
    return out


def _compare(actual: list, expected: list, fail: _Failure, mode: str, against: str, rtol: float, atol: float,
             state: bool = True, member: str = "") -> None:
    for k, ((u, s), (eu, es)) in enumerate(zip(actual, expected)):
        for what, a, e in (("updates", u, eu), ("state", s, es))[:2 if state else 1]:
            mismatch = tree.first_mismatch(a, e)
            if mismatch is not None:
                fail(mode, f"step {k}{member}: the {what} tree differs from {against}'s at '{mismatch}'")
            path = _first_differing(a, e, rtol, atol)
            if path is not None:
                fail(mode, f"step {k}{member}: {what} differ from {against}'s at '{path}' "
                           f"({_describe_diff(_leaf(a, path), _leaf(e, path))})")


def _first_differing(a: Any, b: Any, rtol: float, atol: float) -> str | None:
    """The first path where ``a`` and ``b`` are not close (NaNs equal), or ``None``."""
    fa, _ = tree.flatten(a)
    fb, _ = tree.flatten(b)
    for i, (x, y) in enumerate(zip(fa, fb)):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if (x is None) != (y is None):
                return tree.paths(a)[i]
            continue
        x, y = to_numpy(x), to_numpy(y)
        if x.shape != y.shape or not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            return tree.paths(a)[i]
    return None


def _leaf(t: Any, path: str) -> Any:
    return tree.flatten(t)[0][tree.paths(t).index(path)]


def _describe_diff(a: Any, e: Any) -> str:
    a, e = to_numpy(a), to_numpy(e)
    if a.shape != e.shape:
        return f"shape {a.shape} vs {e.shape}"
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - e.astype(np.float64))
    i = int(np.nanargmax(d)) if d.size and not np.isnan(d).all() else 0
    return f"{a.reshape(-1)[i]:.6g} vs {e.reshape(-1)[i]:.6g}, max abs difference {np.nanmax(d) if d.size else 0:.3g}"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _stack(trees: list) -> Any:
    return tree.map(lambda *xs: torch.stack(xs) if isinstance(xs[0], torch.Tensor) else xs[0], *trees)


def _check_vmap(tx: GradientTransformation, params: Any, gs: list, extra: dict, ref: list, fail: _Failure,
                rtol: float, atol: float, seed: int, compare_state: bool) -> None:
    other = tree.map(lambda p: p * 0.5 + 0.25 if isinstance(p, torch.Tensor) and p.is_floating_point() else p, params)
    other_gs = _gradients(params, len(gs), seed + 1)
    with torch.enable_grad():
        ref2 = _run(tx, other, other_gs, extra, fail, "vmap")
    update = lambda g, s, p: tx.update(g, s, p, **extra)  # noqa: E731
    try:
        ps = _stack([tree.clone(params), other])
        state = torch.func.vmap(tx.init)(ps)
        out = []
        for g, g2 in zip(gs, other_gs):
            u, state = torch.func.vmap(update)(_stack([g, g2]), state, ps)
            out.append((u, state))
            ps = apply_updates(ps, u)
    except Exception as e:  # noqa: BLE001
        fail("vmap", f"raised {type(e).__name__}: {_first_line(e)} (leave 'vmap' out of modes if tx cannot be batched)")
    for i, expected in enumerate((ref, ref2)):
        member = [tree.map(lambda x: x[i] if isinstance(x, torch.Tensor) else x, run) for run in out]
        _compare(member, expected, fail, "vmap", "a loop over the members", rtol, atol, compare_state,
                 member=f", member {i}")


def _check_grad(tx: GradientTransformation, params: Any, gs: list, extra: dict, fail: _Failure, seed: int) -> None:
    f64 = lambda t: tree.map(  # noqa: E731
        lambda x: x.to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, t)
    params, gs = f64(params), [f64(g) for g in gs]
    g = torch.Generator().manual_seed(seed + 2)
    rand = lambda t: tree.map(  # noqa: E731
        lambda x: torch.randn(x.shape, generator=g, dtype=x.dtype) if isinstance(x, torch.Tensor) else x, t)
    weights, direction = [rand(x) for x in gs], [rand(x) for x in gs]

    def objective(gs):
        p, state, total = params, tx.init(params), torch.zeros((), dtype=torch.float64)
        for x, w in zip(gs, weights):
            u, state = tx.update(x, state, p, **extra)
            total = total + sum((a * b).sum() for a, b in zip(tree.leaves(u), tree.leaves(w))
                                if isinstance(a, torch.Tensor))
            p = apply_updates(p, u)
        return total

    try:
        grads = torch.func.grad(objective)(gs)
    except Exception as e:  # noqa: BLE001
        fail("grad", f"raised {type(e).__name__}: {_first_line(e)} (leave 'grad' out of modes if tx refuses it)")
    flat = [x for x in tree.leaves(grads) if isinstance(x, torch.Tensor)]
    if not all(bool(x.isfinite().all()) for x in flat):
        fail("grad", "the gradient with respect to the input updates is not finite")
    ad = sum((a * b).sum() for a, b in zip(flat, [x for x in tree.leaves(direction) if isinstance(x, torch.Tensor)]))
    ad = float(ad.detach())
    fds = []
    for h in (1e-3, 1e-4):  # O(h^2) truncation against rounding (float32 inside a kernel costs 1e-7 |f| / h)
        shifted = [[tree.map(lambda x, d: x + s * h * d if isinstance(x, torch.Tensor) else x, x, v)
                    for x, v in zip(gs, direction)] for s in (1, -1)]
        with torch.enable_grad():  # out of place, as the gradient saw it
            fds.append(float((objective(shifted[0]) - objective(shifted[1])).detach()) / (2 * h))
        if abs(ad - fds[-1]) <= 1e-3 * abs(fds[-1]) + 1e-6:
            return
    fail("grad", f"the directional derivative {ad:.8g} (torch.func.grad) differs from central differences "
                 f"{fds[0]:.8g} (h=1e-3), {fds[1]:.8g} (h=1e-4): the update is differentiated wrongly, or detached")


def _half(t: Any, i: int) -> Any:
    """Half ``i`` (0 or 1) of each tensor leaf along dim 0, as a 2-way ``Shard(0)`` holds it; leaves with fewer
    than 2 rows whole (replicated). The tree's structure, ranks and dtypes are kept (masks still apply)."""
    def half(x):
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] < 2:
            return x
        n = x.shape[0] // 2
        return (x[:n] if i == 0 else x[n:]).clone()

    return tree.map(half, t)


def _joined(a: Any, b: Any, like: Any) -> Any:
    """The inverse of :func:`_half`: the halves ``a`` and ``b`` of each leaf joined, shaped like ``like``."""
    def join(x, y, w):
        if not isinstance(w, torch.Tensor) or w.ndim == 0 or w.shape[0] < 2 or x is None:
            return x
        return torch.cat([x, y])

    return tree.map(join, a, b, like)


def _check_elementwise(tx: GradientTransformation, params: Any, gs: list, extra: dict, ref: list,
                       fail: _Failure, rtol: float, atol: float) -> None:
    with torch.enable_grad():
        halves = [_run(tx, _half(params, i), [_half(g, i) for g in gs], extra, fail, "elementwise") for i in (0, 1)]
    for k, ((u0, _), (u1, _), (eu, _)) in enumerate(zip(*halves, ref)):
        joined = _joined(u0, u1, eu)
        path = _first_differing(joined, eu, rtol, atol)
        if path is not None:
            fail("elementwise", f"step {k}: tx declares elementwise=True, but updating '{path}' in two halves (a "
                                f"2-way Shard(0)) differs from updating it whole "
                                f"({_describe_diff(_leaf(joined, path), _leaf(eu, path))})")


def assert_trees_close(actual: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-6,
                       equal_nan: bool = False) -> None:
    """Asserts two trees have the same structure and leafwise-close values; names the first bad path.

    Leaves may be torch tensors (DTensors are compared by their full value), numpy or jax arrays, or
    Python numbers. ``None`` must match ``None``.
    """
    mismatch = tree.first_mismatch(actual, expected)
    if mismatch is not None:
        raise AssertionError(f"tree structures differ at '{mismatch}'")
    a_leaves, _ = tree.flatten(actual)
    e_leaves, _ = tree.flatten(expected)
    for path, a, e in zip(tree.paths(actual), a_leaves, e_leaves):
        if a is None or e is None:
            if a is not e:
                raise AssertionError(f"at '{path}': {a!r} vs {e!r}")
            continue
        a_np, e_np = to_numpy(a), to_numpy(e)
        if a_np.shape != e_np.shape:
            raise AssertionError(f"at '{path}': shape {a_np.shape} vs {e_np.shape}")
        np.testing.assert_allclose(a_np, e_np, rtol=rtol, atol=atol, equal_nan=equal_nan,
                                   err_msg=f"at '{path}'")


def to_numpy(x: Any) -> np.ndarray:
    """A float64 (or integer/bool) numpy copy of a tensor, DTensor, jax array or number."""
    if isinstance(x, torch.Tensor):
        if hasattr(x, "full_tensor"):
            x = x.full_tensor()
        # A copy: torch marks a storage exported through .numpy() as not resizable for good, which a donated
        # step's first call takes for memory another library owns (fxtrain.tree.borrowed).
        x = x.detach().cpu()
        return (x.to(torch.float64, copy=True) if x.is_floating_point() else x.clone()).numpy()
    arr = np.asarray(x)
    return arr.astype(np.float64) if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16" else arr


def to_jnp(t: Any) -> Any:
    """A tree of torch tensors as jax arrays (copies, same dtype; bfloat16 kept). Needs the ``jax`` extra."""
    import jax.numpy as jnp

    def conv(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.dtype == torch.bfloat16:
            return jnp.asarray(x.float().numpy()).astype(jnp.bfloat16)
        return jnp.asarray(x.detach().cpu().clone().numpy())  # a copy, see to_numpy

    return tree.map(conv, t)


def from_jnp(t: Any) -> Any:
    """A tree of jax arrays as torch tensors (copies, same dtype; bfloat16 kept)."""
    import jax.numpy as jnp

    def conv(x):
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            return x
        if x.dtype == jnp.bfloat16:
            return torch.from_numpy(np.array(x.astype(jnp.float32))).to(torch.bfloat16)
        return torch.from_numpy(np.array(x))

    return tree.map(conv, t)


def nested_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """A small nested pytree with mixed shapes (dict, list, tuple, scalar leaf) for parity tests."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g).to(dtype)

    return {"dense": {"w": r(4, 3), "b": r(3)}, "blocks": [r(2, 2, 2), (r(5), r(1))], "scalar": r()}


class TensorMemory(TorchDispatchMode):
    """Counts the bytes of the tensor storages that torch ops create inside the block: ``live`` (still
    referenced), ``peak`` (the most live at once) and ``total`` (all ever created), deterministically.

    A dispatch mode sees every op's outputs; an output whose storage is none of the op's inputs' and was not
    seen before is new (views and in-place results are not), and counts until that storage is freed. What
    kernels allocate for themselves without a torch op (scratch space inside a fused kernel, the caching
    allocator's rounding) is not seen: it measures the tensors a computation keeps alive, the same on every
    machine and every run, where RSS and wall clock are not. Storages that existed before the block
    (params, state) count as ``0``: ``peak`` is the growth above them.

    Example:
        >>> import torch
        >>> from fxtrain.testing import TensorMemory
        >>> x = torch.ones(1000)
        >>> with TensorMemory() as mem:
        ...     y = x * 2            # 4000 bytes, kept
        ...     z = (y + 1).sum()    # y + 1: 4000 bytes, freed after the sum (4 bytes) is made
        ...     _ = x.mul_(2)        # in place: nothing new
        >>> mem.peak, mem.live, mem.total
        (8004, 4004, 8004)
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.total = 0
        self._seen: set[int] = set()  # ids of the storages counted and still alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(x.untyped_storage()) for x in optree.tree_leaves((args, kwargs))
                  if type(x) is torch.Tensor and x.device.type != "meta"}
        for x in optree.tree_leaves(out):
            if type(x) is not torch.Tensor or x.device.type == "meta" or x.is_sparse:
                continue
            storage = x.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._seen:
                continue
            size = storage.nbytes()
            self._seen.add(key)
            self.live += size
            self.total += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size
