"""fxtrain/contrib/_complex_valued.py: ``split_real_and_imaginary`` against Optax on complex64 and against the real
pair."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, to_jnp
from tests._parity import grads, state_leaves_close

C = fx.contrib


def _complex_params(seed):
    g = torch.Generator().manual_seed(seed)
    return {"z": torch.complex(torch.randn(3, 2, generator=g), torch.randn(3, 2, generator=g)),
            "w": torch.randn(4, generator=g)}


@pytest.mark.optax
@pytest.mark.parametrize("inner", ["adam", "param_block_norm"])
def test_split_real_and_imaginary_matches_optax_on_complex64(inner):
    optax = pytest.importorskip("optax")
    build = {"adam": lambda lib: lib.chain(lib.scale_by_adam(b1=0.8), lib.scale(-0.05)),
             "param_block_norm": lambda lib: lib.chain(lib.scale_by_param_block_norm(), lib.scale(-0.05))}[inner]
    tx, otx = C.split_real_and_imaginary(build(fx)), optax.contrib.split_real_and_imaginary(build(optax))
    params = _complex_params(0)
    jparams = to_jnp(params)
    state, ostate = tx.init(params), otx.init(jparams)
    for k in range(20):
        g = fx.tree.map(lambda p, n: 0.5 * p + n, params, _complex_params(100 + k))
        u, state = fx.update_(tx, fx.tree.clone(g), state, params) if k % 2 else tx.update(g, state, params)
        ou, ostate = otx.update(to_jnp(g), ostate, jparams)
        assert u["z"].dtype == torch.complex64 and u["w"].dtype == torch.float32
        assert_trees_close(u, from_jnp(ou), rtol=1e-5, atol=1e-6)
        params, jparams = fx.apply_updates(params, u), optax.apply_updates(jparams, ou)
    state_leaves_close(state, ostate)


@pytest.mark.parametrize("inner", ["scale_by_adam", "scale_by_param_block_norm"])
def test_split_complex_equals_the_real_pair(inner):  # Optax's test_split_real_and_imaginary
    x = torch.tensor([[0.1, 0.2, 0.3], [-0.1, -0.2, -0.3]])
    y = torch.tensor([[0.5, -0.5, 0.0], [0.1, 0.3, -0.2]])
    z = torch.complex(x, y)
    real_tx, complex_tx = getattr(fx, inner)(), C.split_real_and_imaginary(getattr(fx, inner)())
    real_state, complex_state = real_tx.init((x, y)), complex_tx.init(z)

    def step(loss_fn, tx, params, state):
        grads, loss = torch.func.grad_and_value(loss_fn)(params)  # torch's complex gradient needs no conjugation
        updates, state = tx.update(grads, state, params)
        return loss, grads, fx.apply_updates(params, updates), state

    complex_loss = lambda z: (z.conj() * z).real.sum()  # noqa: E731
    for _ in range(3):
        loss, (gx, gy), (x, y), real_state = step(lambda p: complex_loss(torch.complex(*p)), real_tx, (x, y),
                                                  real_state)
        loss_c, gz, z, complex_state = step(complex_loss, complex_tx, z, complex_state)
        torch.testing.assert_close(loss, loss_c, rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.complex(gx, gy), gz, rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.complex(x, y), z, rtol=1e-6, atol=0)
