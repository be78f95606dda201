"""Tests for fxtrain/transforms/_clipping.py: clip, clip_by_global_norm (single process; see test_norms.py)."""

import math

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp


def _norm64(t):
    return math.sqrt(sum(float(x.double().square().sum()) for x in fx.tree.leaves(t)))


# --- Optax parity ------------------------------------------------------------------------------

@pytest.mark.optax
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 100.0])
def test_clip_by_global_norm_matches_optax(max_norm):
    optax = pytest.importorskip("optax")
    g = nested_params(1)
    tx, otx = fx.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    state, ostate = tx.init(g), otx.init(to_jnp(g))
    for step in range(3):
        g = fx.tree.map(lambda x: x * (step + 1), nested_params(step))
        u, state = tx.update(g, state)
        ou, ostate = otx.update(to_jnp(g), ostate)
        assert_trees_close(u, from_jnp(ou))
        assert_trees_close(state.grad_norm, float(optax.tree.norm(to_jnp(g))))


@pytest.mark.optax
def test_global_norm_matches_optax():
    optax = pytest.importorskip("optax")
    g = nested_params(3)
    assert_trees_close(fx.global_norm(g), float(optax.tree.norm(to_jnp(g))))


@pytest.mark.optax
@pytest.mark.parametrize("max_delta", [0.0, 0.3, 10.0])
def test_clip_matches_optax(max_delta):
    optax = pytest.importorskip("optax")
    g = nested_params(2)
    tx, otx = fx.clip(max_delta), optax.clip(max_delta)
    u, _ = tx.update(g, tx.init(g))
    ou, _ = otx.update(to_jnp(g), otx.init(to_jnp(g)))
    assert_trees_close(u, from_jnp(ou))


@pytest.mark.optax
def test_chain_with_clipping_matches_optax_over_steps():
    optax = pytest.importorskip("optax")
    tx = fx.chain(fx.clip(0.8), fx.clip_by_global_norm(1.0), fx.scale(-0.1))
    otx = optax.chain(optax.clip(0.8), optax.clip_by_global_norm(1.0), optax.scale(-0.1))
    state, ostate = tx.init(nested_params()), otx.init(to_jnp(nested_params()))
    for step in range(5):
        g = nested_params(10 + step)
        u, state = tx.update(g, state)
        ou, ostate = otx.update(to_jnp(g), ostate)
        assert_trees_close(u, from_jnp(ou))


# --- invariants ----------------------------------------------------------------------------------

def test_clipped_norm_equals_bound_over_many_steps():
    tx = fx.clip_by_global_norm(0.5)
    state = tx.init(None)
    for step in range(20):
        g = fx.tree.map(lambda x: x * (1 + step), nested_params(step))
        u, state = tx.update(g, state)
        assert math.isclose(_norm64(u), 0.5, rel_tol=1e-5)
        assert math.isclose(float(state.grad_norm), _norm64(g), rel_tol=1e-5)


def test_below_bound_passes_unchanged_bitwise():
    g = nested_params()
    u, _ = fx.clip_by_global_norm(1e3).update(g, fx.clip_by_global_norm(1e3).init(g))
    for a, b in zip(fx.tree.leaves(u), fx.tree.leaves(g)):
        assert torch.equal(a, b)


def test_update_is_pure_and_keeps_structure_and_dtypes():
    g = {"a": torch.ones(3, dtype=torch.bfloat16), "b": None, "c": [torch.full((2,), 4.0, dtype=torch.float64)]}
    before = fx.tree.clone(g)
    tx = fx.clip_by_global_norm(1.0)
    u, s = tx.update(g, tx.init(g))
    assert_trees_close(g, before)
    assert u["b"] is None and u["a"].dtype == torch.bfloat16 and u["c"][0].dtype == torch.float64
    assert s.grad_norm.dtype == torch.float64 and s.grad_norm.shape == ()
    assert math.isclose(float(s.grad_norm), math.sqrt(3 + 32), rel_tol=1e-6)


def test_bf16_norm_accumulates_in_float32():
    # 4096 ones: a bf16 running sum would stall at 256; the norm must be exactly 64.
    g = {"w": torch.ones(4096, dtype=torch.bfloat16)}
    n = fx.global_norm(g)
    assert n.dtype == torch.float32 and float(n) == 64.0


def test_donated_kernel_writes_in_place():
    g = {"w": torch.full((4,), 2.0)}
    buf = g["w"]
    u, _ = fx.update_(fx.clip_by_global_norm(1.0), g, fx.clip_by_global_norm(1.0).init(g))
    assert u["w"] is buf and math.isclose(float(buf.norm()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_norm_like_optax(bad):
    g = {"a": torch.tensor([1.0, bad]), "b": torch.tensor([2.0])}
    u, s = fx.clip_by_global_norm(1.0).update(g, fx.clip_by_global_norm(1.0).init(g))
    if math.isnan(bad):
        assert math.isnan(float(s.grad_norm)) and torch.isnan(u["b"]).all()
    else:  # Optax: t / inf * max_norm -> 0 for finite t, nan for inf t
        assert math.isinf(float(s.grad_norm)) and float(u["b"]) == 0.0 and torch.isnan(u["a"][1])


def test_clip_nan_stays_nan():
    u, _ = fx.clip(1.0).update({"w": torch.tensor([float("nan"), -5.0])}, fx.EmptyState())
    assert math.isnan(float(u["w"][0])) and float(u["w"][1]) == -1.0


def test_empty_tree_and_zero_norm():
    assert float(fx.global_norm({})) == 0.0
    u, s = fx.clip_by_global_norm(1.0).update({"w": torch.zeros(2)}, fx.clip_by_global_norm(1.0).init(None))
    assert float(s.grad_norm) == 0.0 and u["w"].tolist() == [0.0, 0.0]


# --- protocol ------------------------------------------------------------------------------------

def test_repr_state_and_flags():
    assert repr(fx.clip_by_global_norm(1.0)) == "clip_by_global_norm(1.0)"
    assert repr(fx.clip(0.5)) == "clip(0.5)"
    assert not fx.is_elementwise(fx.clip_by_global_norm(1.0))
    assert fx.is_elementwise(fx.clip(0.5))
    s = fx.clip_by_global_norm(1.0).init(nested_params())
    assert isinstance(s, fx.ClipByGlobalNormState)
    from fxtrain._base import report
    assert set(report((fx.EmptyState(), s))) == {"grad_norm"}


def test_state_structure_stable():
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.scale(-1.0))
    s0 = tx.init(nested_params())
    _, s1 = tx.update(nested_params(1), s0)
    assert fx.tree.structure(s0) == fx.tree.structure(s1)


@pytest.mark.parametrize("factory,arg", [(fx.clip_by_global_norm, "max_norm"), (fx.clip, "max_delta")])
def test_negative_bound_is_an_error_naming_the_argument(factory, arg):
    with pytest.raises(ValueError, match=arg):
        factory(-1.0)


@pytest.mark.parametrize("n", [3, 100_000], ids=["packed", "foreach"])
def test_global_norm_of_complex_leaves_counts_the_imaginary_parts(n):
    """|z|^2 for complex leaves (Optax's abs_sq) on both of the norm engine's paths: the packed copy used to
    cast complex to real, dropping the imaginary parts (and warning)."""
    g = torch.Generator().manual_seed(0)
    t = {"z": torch.randn(n, dtype=torch.complex64, generator=g), "r": torch.randn(4, generator=g)}
    expected = (t["z"].abs().double().square().sum() + t["r"].double().square().sum()).sqrt()
    torch.testing.assert_close(fx.global_norm(t).double(), expected, rtol=1e-5, atol=0)
    tx = fx.clip_by_global_norm(1.0)
    u, _ = tx.update(t, tx.init(t))
    torch.testing.assert_close(fx.global_norm(u).double(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-5, atol=0)
