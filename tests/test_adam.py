"""scale_by_adam (fxtrain/transforms/_adam.py): Optax parity, in-place kernel, dtypes, errors."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import nested_params
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, grads

VARIANTS = {
    "default": {},
    "nesterov": {"nesterov": True},
    "eps_root": {"eps_root": 1e-4, "eps": 1e-6},
    "b2_small": {"b1": 0.5, "b2": 0.9},
    "b1_zero": {"b1": 0.0},
    "b1_zero_nesterov": {"b1": 0.0, "nesterov": True},
    "eps_root_nesterov": {"eps_root": 1e-3, "nesterov": True},
}


@pytest.mark.optax
@pytest.mark.parametrize("kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_matches_optax(kwargs):
    optax = pytest.importorskip("optax")
    assert_parity(fx.chain(fx.scale_by_adam(**kwargs), fx.scale(-0.05)),
                  optax.chain(optax.scale_by_adam(**kwargs), optax.scale(-0.05)))


@pytest.mark.optax
@pytest.mark.parametrize("nesterov", [False, True])
def test_mu_dtype_matches_optax(nesterov):
    """The update uses the new first moment at full precision; the state keeps it in bfloat16 (Optax)."""
    optax = pytest.importorskip("optax")
    assert_parity(fx.chain(fx.scale_by_adam(mu_dtype=torch.bfloat16, nesterov=nesterov), fx.scale(-0.05)),
                  optax.chain(optax.scale_by_adam(mu_dtype="bfloat16", nesterov=nesterov), optax.scale(-0.05)))


@pytest.mark.optax
@pytest.mark.parametrize("nesterov", [False, True])
def test_tensor_hyperparameters_match_optax_inject_hyperparams(nesterov):
    """0-dim tensors (what inject_hyperparams passes) give Optax's results with float32 array
    hyperparameters; no host sync is needed."""
    optax = pytest.importorskip("optax")
    hp = {"b1": 0.8, "b2": 0.99, "eps": 1e-6, "eps_root": 1e-8}
    tx = fx.chain(fx.scale_by_adam(**{k: torch.tensor(v) for k, v in hp.items()}, nesterov=nesterov),
                  fx.scale(-0.05))
    otx = optax.chain(optax.inject_hyperparams(optax.scale_by_adam, static_args="nesterov")(**hp, nesterov=nesterov),
                      optax.scale(-0.05))
    assert_parity(tx, otx, check_state=False)


def test_first_step_is_the_sign():
    # Up to 1 - 0.999 ** 1 rounded in float32, as in Optax (torch.optim uses float64 on the host).
    g = {"w": torch.tensor([3.0, -0.5, 0.0])}
    u, state = fx.scale_by_adam(eps=0.0).update(g, fx.scale_by_adam().init(g))
    torch.testing.assert_close(u["w"][:2], torch.tensor([1.0, -1.0]), rtol=1e-5, atol=0)
    assert u["w"][2].isnan()  # 0 / 0, as Optax with eps=0
    assert int(state.count) == 1 and state.count.dtype == torch.int32


def test_donated_kernel_writes_into_the_gradient_buffers():
    """The donated (in-place) kernel returns the gradient tensors themselves: nothing parameter-sized
    is allocated for the output."""
    tx = fx.adamw(1e-3, weight_decay=0.1)
    params = nested_params()
    g = grads(params, 0)
    u, _ = fx.update_(tx, g, tx.init(params), params)
    assert all(a is b for a, b in zip(fx.tree.leaves(u), fx.tree.leaves(g)))


def test_pure_and_none_leaves():
    for kwargs in VARIANTS.values():
        assert_pure(fx.scale_by_adam(**kwargs))
        assert_none_passthrough(fx.scale_by_adam(**kwargs))


@pytest.mark.parametrize("nesterov", [False, True])
def test_bfloat16_keeps_dtypes(nesterov):
    assert_dtypes(fx.scale_by_adam(nesterov=nesterov))
    assert_dtypes(fx.scale_by_adam(mu_dtype=torch.float32, nesterov=nesterov), state_dtypes={"mu": torch.float32})
    assert_dtypes(fx.scale_by_adam(mu_dtype="float32"), state_dtypes={"mu": torch.float32})


@pytest.mark.parametrize("arg", ["b1", "b2", "eps", "eps_root"])
def test_negative_hyperparameter_names_it(arg):
    with pytest.raises(ValueError, match=rf"scale_by_adam: {arg}=-0.1 must be >= 0"):
        fx.scale_by_adam(**{arg: -0.1})


def test_bad_mu_dtype():
    with pytest.raises(TypeError, match="mu_dtype"):
        fx.scale_by_adam(mu_dtype="float33")


def test_updates_not_matching_state_names_the_path():
    tx = fx.scale_by_adam()
    params = nested_params()
    state = tx.init(params)
    g = grads(params, 0)
    g["blocks"][1] = (g["blocks"][1][0],)
    with pytest.raises(ValueError, match=r"scale_by_adam\(\): updates do not match the state: .* at 'blocks\.1"):
        tx.update(g, state)


def test_repr():
    assert repr(fx.scale_by_adam(b2=0.95, nesterov=True)) == "scale_by_adam(b2=0.95, nesterov=True)"
