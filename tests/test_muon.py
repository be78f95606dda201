"""Muon (fxtrain/contrib/_muon.py): Optax parity, Optax's own muon tests (ported), DTensor on 2 gloo ranks.

The DTensor cases run in one spawned 2-rank world (tests/_worlds.py) and compare the sharded update with
the same optimizer on full tensors in the same process.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import fxtrain as fx
from fxtrain.contrib._muon import MuonDimensionNumbers, _as_matrices, orthogonalize_via_newton_schulz
from fxtrain.testing import assert_trees_close, nested_params
from tests import _worlds
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure


Dims = MuonDimensionNumbers
PRECONDITIONINGS = ("frobenius", "aol", "schatten")

# nested_params: dense.w (4, 3) and blocks.0 (2, 2, 2) can be Muon's; the vectors and the scalar go to AdamW.
VARIANTS = {
    "default": {},
    "plain_adaptive_decay": {"nesterov": False, "beta": 0.9, "adaptive": True, "consistent_rms": 0.2,
                             "weight_decay": 0.1, "adam_weight_decay": 0.01, "adam_learning_rate": 0.05,
                             "adam_b1": 0.8, "adam_b2": 0.99, "adam_eps_root": 1e-8, "eps": 1e-6},
    "spectral": {"preconditioning": "spectral", "ns_steps": 3, "ns_coeffs": (2.0, -1.5, 0.5)},
    "aol_dion": {"ns_coeffs": "dion", "preconditioning": "aol"},
    "schatten_rows": {"preconditioning": "schatten", "ns_coeffs": ((3.0, -3.2, 1.2), (2.0, -1.5, 0.5)),
                      "ns_steps": 3},
}


def _jit(otx):
    """Optax's transform with a jitted update: Optax's Newton-Schulz runs op by op ~10x slower."""
    import jax
    import optax

    return optax.GradientTransformation(otx.init, jax.jit(otx.update))


@pytest.mark.optax
@pytest.mark.parametrize("kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_muon_matches_optax(kwargs):
    optax = pytest.importorskip("optax")
    assert_parity(fx.contrib.muon(0.02, **kwargs), _jit(optax.contrib.muon(0.02, **kwargs)))


@pytest.mark.optax
def test_muon_with_dimension_numbers_schedule_and_mask_matches_optax():
    """A tree of dimension numbers (matrices transposed or with a batch axis; None: AdamW), a schedule."""
    optax = pytest.importorskip("optax")
    def tree(D):
        return {"dense": {"w": D(1, 0), "b": None}, "blocks": [D((1,), (0, 2)), (None, None)], "scalar": None}

    OD = optax.contrib.MuonDimensionNumbers
    assert_parity(fx.contrib.muon(fx.cosine_decay_schedule(0.05, 20), weight_decay=0.1,
                                  muon_weight_dimension_numbers=tree(Dims)),
                  _jit(optax.contrib.muon(optax.cosine_decay_schedule(0.05, 20), weight_decay=0.1,
                                          muon_weight_dimension_numbers=tree(OD))))


@pytest.mark.optax
def test_scale_by_muon_with_a_bfloat16_momentum_matches_optax():
    optax = pytest.importorskip("optax")
    mask = {"dense": {"w": True, "b": False}, "blocks": [False, (False, False)], "scalar": False}
    assert_parity(
        fx.chain(fx.masked(fx.contrib.scale_by_muon(mu_dtype=torch.bfloat16), mask), fx.scale(-0.01)),
        optax.chain(optax.masked(optax.contrib.scale_by_muon(mu_dtype="bfloat16", weight_dimension_numbers=(
            # Optax's scale_by_muon needs a tree of dimension numbers (None only works inside muon)
            lambda u: fx.tree.map(lambda x: optax.contrib.MuonDimensionNumbers(), u))), mask), optax.scale(-0.01)),
        # Jitted, the bfloat16 ulp XLA's fusion saves grows through Newton-Schulz to 40% by step 16. Op by op
        # costs ~0.5 s a step (its fori_loop compiles per call): 20 steps agree too (checked), 2 run here.
        steps=2, check_state=False)


@pytest.mark.optax
def test_tensor_learning_rates_match_optax_inject_hyperparams():
    optax = pytest.importorskip("optax")
    tx = fx.contrib.muon(torch.tensor(0.02), beta=torch.tensor(0.9), weight_decay=torch.tensor(0.1))
    otx = _jit(optax.inject_hyperparams(optax.contrib.muon, static_args=("ns_steps",))(0.02, beta=0.9, weight_decay=0.1))
    assert_parity(tx, otx, check_state=False)


@pytest.mark.optax
def test_complex_matrix_matches_optax():
    """Optax tests muon on complex64 matrices (conjugated gradients): 5 adaptive steps side by side."""
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp
    import numpy as np

    target = torch.tensor([[1.0 + 2.0j, 0.0], [-1.0 + 1.0j, 1.0 - 3.0j]], dtype=torch.complex64)
    tx, otx = fx.contrib.muon(1e-2, adaptive=True), optax.contrib.muon(1e-2, adaptive=True)
    oupdate = jax.jit(otx.update)
    p, op = {"w": torch.zeros(2, 2, dtype=torch.complex64)}, {"w": jnp.zeros((2, 2), jnp.complex64)}
    state, ostate = tx.init(p), otx.init(op)
    for _ in range(5):
        u, state = tx.update({"w": 2 * (p["w"] - target)}, state, p)
        p = fx.apply_updates(p, u)
        ou, ostate = oupdate({"w": 2 * (op["w"] - jnp.asarray(target.numpy()))}, ostate, op)
        op = optax.apply_updates(op, ou)
    np.testing.assert_allclose(p["w"].numpy(), np.asarray(op["w"]), rtol=1e-5, atol=1e-6)


# --- Optax's muon tests (optax/contrib/_muon_test.py), ported ---------------------------------------

def _updates(params, preconditioning="frobenius", **kwargs):
    """One step of muon(1e-3) on loss = sum(params ** 2) / 2 (gradient = params)."""
    tx = fx.contrib.muon(learning_rate=1e-3, preconditioning=preconditioning, **kwargs)
    return tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("shape,dims,flat", [
    ((2, 3), Dims(0, 1), (1, 2, 3)),
    ((2, 3, 4), Dims(0, 2), (3, 2, 4)),
    ((2, 3, 4), Dims(-3, -1), (3, 2, 4)),
    ((2, 3, 4, 5), Dims(2, 3), (6, 4, 5)),
    ((2, 3, 4, 5), Dims(2, (0, 3)), (3, 4, 10)),
], ids=["2d", "3d_batch", "3d_negative", "4d_batches", "4d_outputs"])
def test_reshape_inverse(shape, dims, flat):
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    m, restore = _as_matrices(x, dims)
    assert tuple(m.shape) == flat
    assert torch.equal(restore(m), x)


@pytest.mark.parametrize("preconditioning", PRECONDITIONINGS)
def test_callable_weight_dimension_numbers(preconditioning):
    params = {"w1": torch.ones(10, 10), "w2": torch.ones(2, 10)}
    for fn in (lambda p: fx.tree.map(lambda x: Dims(0, 1) if x.ndim == 2 else None, p),
               lambda p: {"w1": Dims(), "w2": None}):
        u, state = _updates(params, preconditioning, muon_weight_dimension_numbers=fn)
        assert all(torch.isfinite(x).all() for x in fx.tree.leaves(u))


@pytest.mark.parametrize("preconditioning", PRECONDITIONINGS)
def test_trivial_dimension_numbers_match_the_default(preconditioning):
    w = torch.randn(10, 12, generator=torch.Generator().manual_seed(0))
    ref, _ = _updates({"w": w}, preconditioning)
    same, _ = _updates({"w": w}, preconditioning, muon_weight_dimension_numbers={"w": Dims(0, 1)})
    assert_trees_close(same, ref, rtol=1e-8, atol=1e-8)
    # (10, 12) -> (4, 1, 10, 3) and (5, 12, 1, 2): the same matrix with its axes moved and split
    for reshape, dims, tol in ((lambda x: x.reshape(10, 3, 1, 4).permute(3, 2, 0, 1), Dims((2,), (0, 3)), 1e-6),
                               (lambda x: x.reshape(2, 1, 5, 12).permute(2, 3, 1, 0), Dims((0, 3), (1,)), 1e-5)):
        moved, _ = _updates({"w": reshape(w)}, preconditioning, muon_weight_dimension_numbers={"w": dims})
        assert_trees_close(moved, {"w": reshape(ref["w"])}, rtol=tol, atol=tol)


def _muon_mu(state):
    return state.inner_states["muon"].inner_state[0].mu


@pytest.mark.parametrize("preconditioning", PRECONDITIONINGS)
def test_dimension_numbers_choose_muon_leaves(preconditioning):
    masked = fx.MaskedNode
    d = Dims((1,), (2,))
    _, s = _updates({"w1": torch.ones(1, 2, 3), "w2": torch.ones(2, 3, 4)}, preconditioning,
                    muon_weight_dimension_numbers={"w1": d, "w2": d})
    assert not isinstance(_muon_mu(s)["w1"], masked) and not isinstance(_muon_mu(s)["w2"], masked)
    _, s = _updates({"w1": torch.ones(1, 2, 3), "w2": torch.ones(3, 4)}, preconditioning)  # default: 2-D only
    assert isinstance(_muon_mu(s)["w1"], masked) and not isinstance(_muon_mu(s)["w2"], masked)
    _, s = _updates({"w1": torch.ones(1, 2, 3), "w2": torch.ones(2, 3, 4)}, preconditioning,
                    muon_weight_dimension_numbers={"w1": None, "w2": d})
    assert isinstance(_muon_mu(s)["w1"], masked)
    pair = {"a": torch.ones(2, 3), "b": torch.ones(2, 3)}
    _, s = _updates({"w1": dict(pair), "w2": dict(pair)}, preconditioning,
                    muon_weight_dimension_numbers={"w1": None, "w2": {"a": Dims(), "b": None}})  # a None prefix
    mu = _muon_mu(s)
    assert [isinstance(mu[k][j], masked) for k in ("w1", "w2") for j in ("a", "b")] == [True, True, False, True]
    _, s = _updates({"w1": dict(pair), "w2": dict(pair)}, preconditioning,
                    muon_weight_dimension_numbers={"w1": Dims(), "w2": None})
    mu = _muon_mu(s)
    assert [isinstance(mu[k][j], masked) for k in ("w1", "w2") for j in ("a", "b")] == [False, False, True, True]


def test_newton_schulz_orthogonalizes():
    g = torch.Generator().manual_seed(0)
    real = torch.randn(4, 3, generator=g)
    o = orthogonalize_via_newton_schulz(real, torch.tensor([2.0, -1.5, 0.5]), ns_steps=20, eps=1e-12,
                                        dimension_numbers=Dims(0, 1))
    torch.testing.assert_close(o.T @ o, torch.eye(3), atol=1e-5, rtol=1e-5)
    cplx = torch.randn(4, 3, dtype=torch.complex64, generator=g)
    o = orthogonalize_via_newton_schulz(cplx, torch.tensor([2.0, -1.5, 0.5]), ns_steps=10)
    assert o.shape == cplx.shape
    torch.testing.assert_close(o.mH @ o, torch.eye(3, dtype=torch.complex64), atol=1e-5, rtol=1e-5)


def test_complex_matrix_converges():
    """Optax's complex target (1000 steps, adaptive or not; here adaptive, which is there in 400)."""
    target = torch.tensor([[1.0 + 2.0j, 0.0], [-1.0 + 1.0j, 1.0 - 3.0j]], dtype=torch.complex64)
    tx = fx.contrib.muon(1e-2, adaptive=True)
    p = {"w": torch.zeros(2, 2, dtype=torch.complex64)}
    state = tx.init(p)
    for _ in range(400):
        u, state = fx.update_(tx, {"w": 2 * (p["w"] - target)}, state, p)
        p = fx.apply_updates_(p, u)
    torch.testing.assert_close(p["w"], target, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("preconditioning", ["frobenius", "aol"])
@pytest.mark.parametrize("shape", [(16, 16), (16, 8), (8, 16)], ids=["square", "tall", "wide"])
def test_updates_are_near_orthogonal(preconditioning, shape):
    params = {"w": torch.randn(shape, generator=torch.Generator().manual_seed(42))}
    tx = fx.contrib.muon(learning_rate=1.0, preconditioning=preconditioning)
    u, _ = tx.update(params, tx.init(params), params)
    assert u["w"].shape == shape
    if shape[0] == shape[1]:
        s = torch.linalg.svdvals(u["w"])
        assert s.max() < 2.0 and s.min() > 0.1


def test_aol_differs_from_frobenius():
    params = {"w": torch.eye(8) * 2.0}

    def run(preconditioning, **kwargs):
        tx = fx.contrib.muon(0.1, preconditioning=preconditioning, **kwargs)
        u, _ = tx.update(params, tx.init(params), params)
        assert torch.isfinite(u["w"]).all()
        return u["w"]

    assert not torch.allclose(run("frobenius"), run("aol", ns_coeffs="dion"))


@pytest.mark.parametrize("preconditioning", PRECONDITIONINGS)
def test_orthogonality(preconditioning):
    params = {"w": torch.eye(8) * 2.0}
    tx = fx.contrib.muon(0.1, preconditioning=preconditioning)
    u, _ = tx.update(params, tx.init(params), params)
    gram = u["w"].T @ u["w"]
    assert torch.linalg.matrix_norm(gram / gram.max() - torch.eye(8)) < 1e-3


# --- fxtrain's own checks ----------------------------------------------------------------------------

def _every_leaf(params):
    """Dimension numbers for every leaf of nested_params, vectors and scalars included (fxtrain only)."""
    return fx.tree.map(lambda x: {0: Dims((), ()), 1: Dims((), 0), 2: Dims(), 3: Dims(1, 2)}[x.ndim], params)


def test_pure_dtypes_and_none_leaves():
    for tx in (fx.contrib.scale_by_muon(weight_dimension_numbers=_every_leaf),
               fx.contrib.muon(0.02, weight_decay=0.1)):
        assert_pure(tx)
        assert_none_passthrough(tx)
        assert_dtypes(tx, state_dtypes={"ns_coeffs": torch.float32})  # Optax keeps the coefficients in float32
    assert_dtypes(fx.contrib.muon(0.02, mu_dtype=torch.float32),
                  state_dtypes={"mu": torch.float32, "ns_coeffs": torch.float32})


def test_a_vector_with_dimension_numbers_is_a_one_row_matrix():
    v = torch.tensor([3.0, -4.0])
    o = orthogonalize_via_newton_schulz(v, torch.tensor([2.0, -1.5, 0.5]), ns_steps=20,
                                        dimension_numbers=Dims((), 0))
    torch.testing.assert_close(o, v / 5.0)  # the unit vector: the polar factor of a 1 x n matrix


def test_refuses_non_matrices_without_dimension_numbers():
    tx = fx.contrib.scale_by_muon()
    g = {"layer": {"bias": torch.ones(3)}}
    with pytest.raises(ValueError, match=r"^scale_by_muon\(\): the update at 'layer.bias' has shape \(3,\), not a matrix"):
        tx.update(g, tx.init(g))


def test_refused_by_sharded_apply_by_name():
    for tx, name in ((fx.contrib.muon(0.02), "muon"), (fx.contrib.scale_by_muon(), "scale_by_muon")):
        with pytest.raises(ValueError, match=name):
            fx.sharded_apply(tx)


@pytest.mark.parametrize("kwargs,msg", [
    ({"beta": -0.5}, r"^muon: beta=-0.5 must be >= 0"),
    ({"adam_b2": -0.5}, r"^muon: adam_b2=-0.5 must be >= 0"),
    ({"ns_coeffs": "fast"}, r"^muon: ns_coeffs='fast' must be one of"),
    ({"ns_coeffs": (1.0, 2.0)}, r"^muon: ns_coeffs must have shape \(3,\) or \(n, 3\)"),
    ({"ns_coeffs": "dion", "ns_steps": 3}, r"^muon: ns_coeffs has 5 rows, more than ns_steps=3"),
    ({"preconditioning": "svd"}, r"^muon: preconditioning='svd' must be one of"),
])
def test_bad_arguments_name_them(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        fx.contrib.muon(0.02, **kwargs).init({"w": torch.ones(2, 2)})


def test_repr():
    assert repr(fx.contrib.muon(0.02, weight_decay=0.1)) == "muon(0.02, weight_decay=0.1)"


# --- DTensor leaves on 2 gloo ranks: equal to the one-process update ---------------------------------

CASES, case = _worlds.registry(worlds=(2,))


def _tp_params(world):
    """A tensor-parallel-like tree: matrices sharded on rows or columns (uneven too), a vector, a 3-D leaf."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    plain = nested_params(seed=3)
    plain["dense"]["w"] = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    plain["blocks"][0] = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(5))
    plain["wide"] = torch.randn(3, 7, generator=torch.Generator().manual_seed(6))
    places = {"dense": {"w": Shard(0), "b": Replicate()}, "blocks": [Shard(2), (Replicate(), Replicate())],
              "scalar": Replicate(), "wide": Shard(1)}
    sharded = fx.tree.map(lambda x, p: distribute_tensor(x.clone(), mesh, [p]), plain, places)
    return plain, sharded


def _run(tx, params, steps=2, donate=False):
    state = tx.init(params)
    for k in range(steps):
        g = fx.tree.map(lambda p: 0.5 * p + 0.1 * (k + 1), params)
        u, state = fx.update_(tx, g, state, params) if donate else tx.update(g, state, params)
        params = fx.apply_updates(params, u)
    return u, params, state


@case()
def case_muon_on_dtensor_equals_one_process(world):
    plain, sharded = _tp_params(world)
    dims = lambda p: fx.tree.map(lambda x: {2: Dims(), 3: Dims(0, 2)}.get(x.ndim), p)  # noqa: E731
    # the pure update (out of place under autograd) for one, the donated kernel for the other
    for make, donate in ((lambda: fx.contrib.muon(0.02, weight_decay=0.1, consistent_rms=0.2), False),
                         (lambda: fx.contrib.muon(0.02, adaptive=True, preconditioning="aol",
                                                  muon_weight_dimension_numbers=dims), True)):
        ref_u, ref_p, ref_s = _run(make(), plain)
        u, p, s = _run(make(), fx.tree.clone(sharded), donate=donate)
        assert_trees_close(u, ref_u, rtol=1e-5, atol=1e-6)
        assert_trees_close(p, ref_p, rtol=1e-5, atol=1e-6)
        assert_trees_close(s, ref_s, rtol=1e-5, atol=1e-6)
        for x, y in zip(fx.tree.leaves(p), fx.tree.leaves(sharded)):  # updates kept each param's placements
            assert x.placements == y.placements


# scale_by_muon on every leaf (vectors and a scalar as 1 x n matrices) runs on DTensor leaves in
# tests/test_conformance_dtensor.py (its conformance case).


test_case = _worlds.tests(__file__, CASES, timeout_s=240)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])


# --- vmap over inject_hyperparams(muon)'s state (issue 25) ---------------------------------------
# inject_hyperparams keeps the integer ns_steps in the state (as Optax does); vmap(init) batches it, and the
# Newton-Schulz loop read it with .item(), which vmap refuses.

def _muon_members():
    return [{"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(i)),
             "b": torch.randn(2, generator=torch.Generator().manual_seed(10 + i))} for i in range(3)]


def _muon_vmapped(tx, members, ns_steps=None):
    stack = lambda ts: fx.tree.map(lambda *xs: torch.stack(xs), *ts)  # noqa: E731
    params = stack(members)
    state = torch.func.vmap(tx.init)(params)
    if ns_steps is not None:
        state.hyperparams["ns_steps"] = torch.tensor(ns_steps, dtype=torch.int32)
    out = []
    for k in range(3):
        g = fx.tree.map(lambda p: p * (k + 1) - 0.5, params)
        u, state = torch.func.vmap(tx.update)(g, state, params)
        params = fx.apply_updates(params, u)
        out.append(u)
    return out


def _muon_member(build, p, ns_steps):
    tx = build(ns_steps)
    state, out = tx.init(p), []
    for k in range(3):
        u, state = tx.update(fx.tree.map(lambda x: x * (k + 1) - 0.5, p), state, p)
        p = fx.apply_updates(p, u)
        out.append(u)
    return out


def test_vmap_over_injected_muon_state_equals_a_loop():
    build = lambda n: fx.inject_hyperparams(fx.contrib.muon)(learning_rate=0.02, ns_steps=n)  # noqa: E731
    members = _muon_members()
    for counts in (None, [5, 2, 3]):  # the state's ns_steps as init made it, then one count per member
        batched = _muon_vmapped(build(5), members, counts)
        for i, p in enumerate(members):
            alone = _muon_member(build, p, 5 if counts is None else counts[i])
            for k in range(3):
                assert_trees_close(fx.tree.map(lambda x: x[i], batched[k]), alone[k], rtol=1e-5, atol=1e-6)


@pytest.mark.optax
def test_vmap_over_injected_muon_state_matches_optax():
    optax = pytest.importorskip("optax")
    import jax

    from fxtrain.testing import from_jnp, to_jnp

    members = _muon_members()
    ours = _muon_vmapped(fx.inject_hyperparams(fx.contrib.muon)(learning_rate=0.02), members)
    otx = optax.inject_hyperparams(optax.contrib.muon)(learning_rate=0.02)
    params = to_jnp(fx.tree.map(lambda *xs: torch.stack(xs), *members))
    state, update = jax.vmap(otx.init)(params), jax.jit(jax.vmap(otx.update))
    for k in range(3):
        u, state = update(jax.tree.map(lambda p: p * (k + 1) - 0.5, params), state, params)
        params = optax.apply_updates(params, u)
        assert_trees_close(ours[k], from_jnp(u), rtol=1e-4, atol=1e-6)
