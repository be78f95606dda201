"""Every conformance case on DTensor leaves: 2 gloo ranks, params and gradients ``Shard(0)`` (uneven and empty
pieces included) or ``Replicate`` (0-dim), three updates, against the same transform on the full tensors in
one process (issue 18's acceptance: "a conformance case ... DTensor leaves").

Both paths run on DTensors: the pure ``update`` (out of place under autograd, the in-place kernel on copies
under ``no_grad``) and the donated ``update_``; each is compared with the plain run at float32 rounding
(a reduction over a sharded leaf sums its pieces in another order). A case that is not compared here is
named, with its reason, in its family's ``DTENSOR`` dict (tests/cases/) or in :data:`NOT_COMPARED` below.
"""

from __future__ import annotations

import sys

import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, nested_params
from tests import _worlds, cases

CASES, case = _worlds.registry(worlds=(2,))
STEPS = 3
TOL = {"rtol": 1e-5, "atol": 1e-6}

# Transforms of the core that cannot take DTensor leaves directly, each with what to use instead.
NOT_COMPARED = {
    "accumulate": "held DTensor gradients stay Partial across calls: tested in tests/test_accumulation.py's worlds",
    "amp_cast": "its loss scaling needs the step's forward pass: tested with DTensors in tests/test_amp.py",
    "inject_hyperparams": "0-dim hyperparameter tensors meet DTensor leaves in foreach ops: wrap the optimizer in "
                          "sharded_apply (tests/test_sharding.py)",
}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))


def _sharded(t, mesh):
    """``t`` with every tensor leaf as a DTensor: ``Shard(0)`` where it has a dimension, else ``Replicate``.
    Each rank holds the whole ``t`` (the same seeds), so it takes its own piece, as ``distribute_tensor`` would
    cut it (``torch.chunk``; a rank past the last chunk holds an empty one), without a collective."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        if not x.ndim:
            return DTensor.from_local(x.clone(), mesh, [Replicate()], run_check=False)
        return DTensor.from_local(_piece(x).clone(), mesh, [Shard(0)], run_check=False, shape=x.shape,
                                  stride=x.stride())

    return fx.tree.map(one, t)


def _piece(x):
    """This rank's piece of ``x`` under ``Shard(0)`` on 2 ranks."""
    pieces = torch.chunk(x, 2)
    rank = torch.distributed.get_rank()
    return pieces[rank] if rank < len(pieces) else x[:0]


def _part(x, d):
    """The part of the plain leaf ``x`` that this rank's DTensor leaf ``d`` holds: its piece under ``Shard(0)``,
    else all of it."""
    from torch.distributed.tensor import Shard

    return _piece(x) if getattr(d, "placements", None) == (Shard(0),) else x


def _held(d, x):
    """What this rank compares of the DTensor leaf ``d`` (its local piece under ``Shard(0)`` or ``Replicate``;
    otherwise the gathered tensor); a donated kernel may return ``None`` for an update it leaves untouched
    (see test_conformance): zeros."""
    from torch.distributed.tensor import Replicate, Shard

    if d is None:
        return torch.zeros_like(x)
    if not hasattr(d, "placements"):
        return d
    return d.to_local() if d.placements in ((Shard(0),), (Replicate(),)) else d.full_tensor()


def _compared(plain, dts):
    """(this rank's part of the DTensor tree ``dts``, the same part of the plain tree): every rank checks its
    own pieces, so no gather is needed."""
    return fx.tree.map(lambda x, d: _held(d, x), plain, dts), fx.tree.map(_part, plain, dts)


def _params():
    params = nested_params(seed=0)
    params["blocks"][1] = (None, params["blocks"][1][1])  # an absent parameter, as in the conformance test
    return params


def _grads(step):
    g = nested_params(seed=100 + step)
    g["blocks"][1] = (None, g["blocks"][1][1])
    return g


def _run(tx, params, grads_of, mode):
    """``STEPS`` updates: (updates of each step, final params, final state)."""
    state, history = tx.init(params), []
    for k in range(STEPS):
        g = grads_of(k)
        if mode == "donated":
            u, state = fx.update_(tx, g, state, params)
        elif mode == "no_grad":
            with torch.no_grad():
                u, state = tx.update(g, state, params)
        else:
            u, state = tx.update(g, state, params)
        history.append(u)
        params = fx.apply_updates(params, u)
    return history, params, state


def _check(name):
    build = ALL[name]
    mesh = _mesh()
    with torch.no_grad():
        plain, p_plain, _ = _run(build(), _params(), _grads, "no_grad")
    for mode in ("no_grad", "autograd", "donated"):
        dts, p_dt, _ = _run(build(), _sharded(_params(), mesh), lambda k: _sharded(_grads(k), mesh), mode)
        for k in range(STEPS):
            try:
                assert_trees_close(*_compared(plain[k], dts[k]), **TOL)
            except AssertionError as e:
                raise AssertionError(f"{name} ({mode}), step {k}: {e}") from None
        assert_trees_close(*_compared(p_plain, p_dt), **TOL)


def _all_cases() -> dict:
    from tests.test_conformance import CASES as CONFORMANCE  # the core's cases and the catalogue's, merged

    skipped = {**NOT_COMPARED, **cases.merged("DTENSOR")}
    return {n: b for n, b in CONFORMANCE.items() if n not in skipped}


ALL = _all_cases()
for _name in ALL:
    CASES[_name] = (lambda world, n=_name: _check(n), (2,))

test_case = _worlds.tests(__file__, CASES, timeout_s=300)


def test_every_skip_names_a_case_and_gives_a_reason():
    from tests.test_conformance import CASES as CONFORMANCE

    for name, why in {**NOT_COMPARED, **cases.merged("DTENSOR")}.items():
        assert name in CONFORMANCE, f"{name} is not a conformance case"
        assert isinstance(why, str) and len(why) > 20, f"{name}: say why it is not compared on DTensor leaves"


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
