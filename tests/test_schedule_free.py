"""schedule_free and its aliases (fxtrain/contrib/_schedule_free.py): Optax parity, Optax's own cases, dtypes."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close, from_jnp, nested_params, to_jnp
from tests._parity import assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, run_fx, run_optax

SF = fx.contrib


def _pair(o, name, **kwargs):
    return getattr(SF, name)(**kwargs), getattr(o.contrib, name)(**kwargs)


ALIASES = {
    "sgd_default": ("schedule_free_sgd", {"learning_rate": 0.05}),
    "sgd_warmup_wd": ("schedule_free_sgd", {"learning_rate": 0.1, "warmup_steps": 5, "b1": 0.8,
                                            "weight_decay": 0.01, "weight_lr_power": 1.0}),
    "adamw_default": ("schedule_free_adamw", {}),
    "adamw_all": ("schedule_free_adamw", {"learning_rate": 0.01, "warmup_steps": 7, "b1": 0.95, "b2": 0.99,
                                          "eps": 1e-6, "weight_decay": 0.1, "weight_lr_power": 3.0}),
}


@pytest.mark.optax
@pytest.mark.parametrize("case", ALIASES.values(), ids=ALIASES.keys())
def test_aliases_match_optax(case):
    optax = pytest.importorskip("optax")
    name, kwargs = case
    assert_parity(*_pair(optax, name, **kwargs))


@pytest.mark.optax
def test_wrapper_matches_optax_around_adam_with_a_schedule():
    optax = pytest.importorskip("optax")
    sched, osched = fx.linear_schedule(0.0, 0.02, 6), optax.linear_schedule(0.0, 0.02, 6)
    assert_parity(SF.schedule_free(fx.adam(sched, b1=0.0), sched, b1=0.7, weight_lr_power=0.5),
                  optax.contrib.schedule_free(optax.adam(osched, b1=0.0), osched, b1=0.7, weight_lr_power=0.5))


@pytest.mark.optax
def test_eval_params_match_optax():
    optax = pytest.importorskip("optax")
    params = nested_params()
    _, p, s = run_fx(SF.schedule_free_sgd(0.1), params, 5)
    _, op, os_ = run_optax(optax.contrib.schedule_free_sgd(0.1), params, 5)
    assert_trees_close(SF.schedule_free_eval_params(s, p),
                       from_jnp(optax.contrib.schedule_free_eval_params(os_, to_jnp(op))))
    assert os_.b1.ndim == s.b1.ndim == 0


def _quadratic_run(tx, steps=5, params=None):
    params = torch.tensor([1.0, 2.0]) if params is None else params
    state = tx.init(params)
    for _ in range(steps):
        u, state = tx.update(2 * params, state, params)
        params = fx.apply_updates(params, u)
    return params, state


def test_learning_rate_zero_keeps_the_eval_params():  # Optax's test_learning_rate_zero
    params, state = _quadratic_run(SF.schedule_free(fx.sgd(0.0, momentum=0.0), learning_rate=0.0))
    assert_trees_close(SF.schedule_free_eval_params(state, params), torch.tensor([1.0, 2.0]))


def test_adamw_alias_is_the_wrapper_around_adamw_without_momentum():  # Optax's test_schedule_free_adamw
    ours, _ = _quadratic_run(SF.schedule_free_adamw(learning_rate=1.0, b1=0.9, weight_decay=1e-4))
    wrapped, _ = _quadratic_run(SF.schedule_free(fx.adamw(1.0, b1=0.0, weight_decay=1e-4), learning_rate=1.0,
                                                 b1=0.9))
    assert_trees_close(ours, wrapped, rtol=1e-6, atol=1e-6)


def test_scalar_params_keep_shape_and_dtype():  # Optax's test_scalar_preservance
    tx = SF.schedule_free(fx.sgd(1.0, momentum=0.0), learning_rate=1.0)
    params = torch.ones(())
    ev = SF.schedule_free_eval_params(tx.init(params), params)
    assert ev.shape == () and ev.dtype == torch.float32


def test_donated_update_leaves_params_alone():  # Optax's test_buffer_donation: z is not the params
    tx = SF.schedule_free_sgd()
    params = torch.tensor([-1.0, 10.0, 1.0])
    state = tx.init(params)
    assert state.z.data_ptr() != params.data_ptr()
    before = params.clone()
    u, state = fx.update_(tx, params - torch.tensor([1.0, -1.0, 1.0]), state, params)
    assert torch.equal(params, before)
    assert_trees_close(fx.apply_updates(params, u), torch.tensor([1.0, -1.0, 1.0]))  # lr 1 on a parabola: one step


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32, torch.complex64, None])
@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float32, torch.complex64])
def test_explicit_state_dtype(params_dtype, state_dtype):  # Optax's test_explicit_dtype
    if params_dtype.is_complex and not (state_dtype is None or state_dtype.is_complex):
        pytest.skip("complex params with a real state are not supported (as in Optax)")
    tx = SF.schedule_free(fx.sgd(1.0), learning_rate=1.0, state_dtype=state_dtype)
    params = torch.zeros(2, dtype=params_dtype)
    state = tx.init(params)
    assert state.z.dtype == (state_dtype or params_dtype)
    if state_dtype is not None and state_dtype.is_complex and not params_dtype.is_complex:
        return  # Optax's test checks init only; an update would cast complex to real
    u, state = tx.update(torch.ones(2, dtype=params_dtype), state, params)
    assert u.dtype == params_dtype and state.z.dtype == (state_dtype or params_dtype)


def test_extra_args_reach_the_base_optimizer():
    seen = {}

    @fx.transform(elementwise=True, extra_args=True)
    def record():
        def update_fn(updates, state, params=None, *, value=None, **extra):
            seen["value"] = value
            return updates, state
        return fx.GradientTransformation(lambda p: fx.EmptyState(), update_fn)

    tx = fx.chain(SF.schedule_free(fx.chain(record(), fx.sgd(0.1)), 0.1))
    params = {"w": torch.ones(2)}
    tx.update({"w": torch.ones(2)}, tx.init(params), params, value=torch.tensor(3.0))
    assert float(seen["value"]) == 3.0


@pytest.mark.parametrize("tx", [SF.schedule_free_sgd(0.1, weight_decay=0.1), SF.schedule_free_adamw(1e-2),
                                SF.schedule_free(fx.sgd(0.1), 0.1, state_dtype=torch.float32)],
                         ids=["sgd", "adamw", "state_f32"])
def test_pure_dtypes_and_none_leaves(tx):
    assert_pure(tx)
    assert_none_passthrough(tx)
    if "state_dtype" not in repr(tx):
        assert_dtypes(tx)
    else:
        assert_dtypes(tx, state_dtypes={"z": torch.float32})


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"schedule_free: b1=0 divides by zero"):
        SF.schedule_free(fx.sgd(0.1), 0.1, b1=0.0)
    with pytest.raises(ValueError, match=r"schedule_free_sgd: learning_rate=-1.0 must be >= 0"):
        SF.schedule_free_sgd(-1.0)
    with pytest.raises(ValueError, match=r"schedule_free needs the params: call update"):
        tx = SF.schedule_free_sgd()
        tx.update(torch.ones(1), tx.init(torch.ones(1)))
    with pytest.raises(ValueError, match=r"ScheduleFreeState"):
        SF.schedule_free_eval_params(fx.EmptyState(), torch.ones(1))
