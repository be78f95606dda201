"""Optimizers (fxtrain/optimizers.py): Optax's signatures, states and numbers; errors; dtypes."""

import inspect

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from tests._parity import TREE_MASK, assert_dtypes, assert_none_passthrough, assert_parity, assert_pure, ndim_mask

NAMES = ["sgd", "adam", "adamw", "lion", "rmsprop", "adagrad"]


def _sched(count):
    return 0.1 * 0.9 ** count


CASES = {
    "sgd": ("sgd", (0.1,), {}),
    "sgd_momentum": ("sgd", (0.1,), {"momentum": 0.9}),
    "sgd_nesterov": ("sgd", (0.1,), {"momentum": 0.9, "nesterov": True}),
    "sgd_schedule": ("sgd", (_sched,), {"momentum": 0.5}),
    "adam": ("adam", (0.05,), {}),
    "adam_nesterov": ("adam", (0.05,), {"nesterov": True, "b1": 0.8}),
    "adam_eps_root": ("adam", (0.05,), {"eps_root": 1e-5}),
    "adam_schedule": ("adam", (_sched,), {}),
    "adamw": ("adamw", (0.05,), {"weight_decay": 0.1}),
    "adamw_tree_mask": ("adamw", (0.05,), {"weight_decay": 0.1, "mask": TREE_MASK}),
    "adamw_callable_mask": ("adamw", (0.05,), {"weight_decay": 0.1, "mask": ndim_mask}),
    "adamw_nesterov_schedules": ("adamw", (_sched,), {"weight_decay": _sched, "nesterov": True}),
    "lion": ("lion", (0.01,), {}),
    "lion_mask": ("lion", (0.01,), {"weight_decay": 0.1, "mask": ndim_mask, "b2": 0.9}),
    "rmsprop": ("rmsprop", (0.01,), {}),
    "rmsprop_torch_like": ("rmsprop", (0.01,), {"decay": 0.99, "eps_in_sqrt": False}),
    "rmsprop_centered": ("rmsprop", (0.01,), {"centered": True}),
    "rmsprop_momentum": ("rmsprop", (0.01,), {"momentum": 0.9}),
    "rmsprop_centered_nesterov": ("rmsprop", (0.01,), {"centered": True, "momentum": 0.9, "nesterov": True}),
    "rmsprop_all": ("rmsprop", (_sched,), {"initial_scale": 1.0, "bias_correction": True, "centered": True,
                                           "eps_in_sqrt": False, "momentum": 0.5}),
    "adagrad": ("adagrad", (0.1,), {}),
    "adagrad_zero_start": ("adagrad", (0.1,), {"initial_accumulator_value": 0.0, "eps": 1e-10}),
}


@pytest.mark.optax
@pytest.mark.parametrize("name,args,kwargs", CASES.values(), ids=CASES.keys())
def test_matches_optax(name, args, kwargs):
    optax = pytest.importorskip("optax")
    assert_parity(getattr(fx, name)(*args, **kwargs), getattr(optax, name)(*args, **kwargs))


@pytest.mark.optax
def test_chains_match_optax():
    optax = pytest.importorskip("optax")
    tx = fx.chain(fx.add_decayed_weights(1e-2, ndim_mask), fx.sgd(_sched, momentum=0.9, nesterov=True))
    otx = optax.chain(optax.add_decayed_weights(1e-2, ndim_mask), optax.sgd(_sched, momentum=0.9, nesterov=True))
    assert_parity(tx, otx)


@pytest.mark.optax
@pytest.mark.parametrize("name", NAMES + ["scale", "scale_by_learning_rate", "scale_by_schedule", "scale_by_adam",
                                          "scale_by_rms", "scale_by_stddev", "scale_by_rss", "scale_by_lion",
                                          "trace", "add_decayed_weights"])
def test_signature_is_optax(name):
    optax = pytest.importorskip("optax")
    ours, theirs = inspect.signature(getattr(fx, name)), inspect.signature(getattr(optax, name))
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


@pytest.mark.optax
def test_masking_signatures_are_optax_without_extra_args():
    """fxtrain has no extra update arguments, so Optax's ``mask_compatible_extra_args`` is left out."""
    optax = pytest.importorskip("optax")
    for name in ("masked", "partition"):
        theirs = [p for p in inspect.signature(getattr(optax, name)).parameters if p != "mask_compatible_extra_args"]
        assert list(inspect.signature(getattr(fx, name)).parameters) == theirs


@pytest.mark.parametrize("name,args,kwargs", CASES.values(), ids=CASES.keys())
def test_pure_dtypes_and_none_leaves(name, args, kwargs):
    tx = getattr(fx, name)(*args, **kwargs)
    assert_pure(tx)
    assert_dtypes(tx)
    if not isinstance(kwargs.get("mask"), dict):
        assert_none_passthrough(tx)


def test_optimizers_accept_tensor_hyperparameters():
    """What inject_hyperparams passes: 0-dim tensors for every numeric argument."""
    t = torch.tensor
    params = {"w": torch.ones(3), "b": torch.ones(1)}
    for tx in [fx.sgd(t(0.1), t(0.9)), fx.adam(t(0.1), t(0.9), t(0.99), t(1e-8), t(0.0)),
               fx.adamw(t(0.1), weight_decay=t(0.1)), fx.lion(t(0.1), t(0.9), t(0.99), weight_decay=t(0.1)),
               fx.rmsprop(t(0.1), t(0.9), t(1e-8), t(0.1), momentum=t(0.9), centered=True),
               fx.adagrad(t(0.1), t(0.1), t(1e-7))]:
        u, _ = tx.update(params, tx.init(params), params)
        assert all(torch.isfinite(x).all() for x in fx.tree.leaves(u))


def test_repr():
    assert repr(fx.adamw(1e-3, weight_decay=0.1)) == "adamw(0.001, weight_decay=0.1)"
    assert repr(fx.sgd(0.1, momentum=0.9, nesterov=True)) == "sgd(0.1, momentum=0.9, nesterov=True)"
    assert repr(fx.rmsprop(_sched, centered=True)) == "rmsprop(_sched, centered=True)"


def test_elementwise():
    assert all(fx.is_elementwise(getattr(fx, n)(0.1)) for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_negative_learning_rate_names_the_optimizer(name):
    with pytest.raises(ValueError, match=rf"{name}: learning_rate=-0.1 must be >= 0"):
        getattr(fx, name)(-0.1)


@pytest.mark.parametrize("name,kwargs", [("sgd", {"momentum": -0.9}), ("adam", {"b1": -0.9}), ("adamw", {"eps": -1.0}),
                                         ("adamw", {"weight_decay": -0.1}), ("lion", {"b2": -0.5}),
                                         ("rmsprop", {"decay": -0.9}), ("rmsprop", {"momentum": -0.9}),
                                         ("adagrad", {"eps": -1.0})])
def test_negative_hyperparameters_raise_naming_them(name, kwargs):
    (arg, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"{arg}={value} must be >= 0"):
        getattr(fx, name)(0.1, **kwargs)


def test_dtensor_leaves_give_the_plain_numbers(tmp_path):
    """Without sharded_apply the optimizers also run on DTensor leaves (a world of one process here)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = {"w": torch.randn(4, 3), "b": torch.randn(3)}
        sharded = {"w": distribute_tensor(plain["w"], mesh, [Shard(0)]),
                   "b": distribute_tensor(plain["b"], mesh, [Replicate()])}
        for tx in [fx.sgd(0.1, 0.9, accumulator_dtype=torch.bfloat16),
                   fx.adamw(0.1, weight_decay=0.1, mask={"w": True, "b": False}),
                   fx.adam(_sched, nesterov=True, mu_dtype=torch.bfloat16), fx.lion(0.1),
                   fx.rmsprop(0.1, centered=True, momentum=0.9), fx.adagrad(0.1)]:
            results = []
            for params in (plain, sharded):
                state = tx.init(params)
                for _ in range(2):
                    u, state = fx.update_(tx, fx.tree.map(lambda x: 0.1 * x, params), state, params)
                results.append(u)
            assert type(results[1]["w"]).__name__ == "DTensor"
            assert_trees_close(results[1], results[0])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lion", "rmsprop", "adagrad"])
def test_learning_rate_none_is_refused_not_an_ascent(name):
    # Issue 15, finding 4: fx.adam(None) used to apply the raw direction (+update, step size 1).
    with pytest.raises(ValueError, match=f"{name}: learning_rate=None"):
        getattr(fx, name)(None)
