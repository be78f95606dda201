"""Every optimizer inside the recommended stack (issue 18's acceptance: "``fx.amp_cast``/``fx.accumulate``/
``sharded_apply`` compose with the new optimizers (a test per optimizer inside the recommended stack)").

For each optimizer of the catalogue (tests/cases/*.py ``OPTIMIZERS``) and of the core:

* ``accumulate(opt, every=2)`` emits ``opt``'s update of the mean of two micro-batch gradients, and zeros
  between emissions (Optax's MultiSteps);
* ``amp_cast(opt, "p=f32,c=f32,o=f32", loss_scale=2**10)`` fed the gradients of the scaled loss gives ``opt``'s
  update of the true gradients, bit for bit (a power-of-two scale is exact);
* ``sharded_apply(opt)`` equals ``opt`` on plain leaves when ``opt`` is elementwise, and otherwise is refused with
  a message naming it;
* the whole stack, ``accumulate(amp_cast(chain(clip_by_global_norm(1.0), opt')), every=2)`` with ``opt'`` the
  optimizer in ``sharded_apply`` where it is elementwise, trained by ``fx.train_step`` (donated) for 3 emitted
  steps, equals ``chain(clip_by_global_norm(1.0), opt)`` on the mean gradient of each window.
"""

from __future__ import annotations

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from tests import cases

CORE = {
    "sgd": lambda: fx.sgd(0.1, momentum=0.9),
    "adam": lambda: fx.adam(1e-2),
    "adamw": lambda: fx.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: fx.lion(1e-3),
    "rmsprop": lambda: fx.rmsprop(1e-2),
    "adagrad": lambda: fx.adagrad(1e-2),
}
OPTIMIZERS = {**CORE, **cases.merged("OPTIMIZERS")}
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _extra(tx) -> dict:
    """``value=`` for optimizers that read it (polyak_sgd...), as train_step passes the loss."""
    return {"value": torch.tensor(0.5)} if fx.traits(tx).extra_args else {}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_accumulate_emits_the_update_of_the_mean_gradient(name):
    opt = OPTIMIZERS[name]()
    tx = fx.accumulate(OPTIMIZERS[name](), every=2)
    params = _params()
    s, ref_s = tx.init(params), opt.init(params)
    for window in range(2):
        g1, g2 = _params(10 + 2 * window), _params(11 + 2 * window)
        held, s = tx.update(g1, s, params, **_extra(tx))
        assert len(fx.tree.leaves(held)) == len(fx.tree.leaves(params))  # zeros, not None (Optax's MultiSteps)
        for u in fx.tree.leaves(held):
            assert u.dtype == torch.float32 and not u.any()
        u, s = tx.update(g2, s, params, **_extra(tx))
        mean = fx.tree.map(lambda a, b: (a + b) / 2, g1, g2)
        ref, ref_s = opt.update(mean, ref_s, params, **_extra(opt))
        assert_trees_close(u, ref, **TOL)
        params = fx.apply_updates(params, ref)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_amp_cast_unscales_to_the_optimizer_on_true_gradients(name):
    opt = OPTIMIZERS[name]()
    tx = fx.amp_cast(OPTIMIZERS[name](), policy="p=f32,c=f32,o=f32", loss_scale=fx.StaticLossScale(2.0 ** 10))
    params = _params()
    s, ref_s = tx.init(params), opt.init(params)
    for step in range(3):
        g = _params(20 + step)
        u, s = tx.update(fx.tree.map(lambda x: x * 2.0 ** 10, g), s, params, **_extra(tx))
        ref, ref_s = opt.update(g, ref_s, params, **_extra(opt))
        assert_trees_close(u, ref, rtol=0, atol=0)
        params = fx.apply_updates(params, ref)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_apply_runs_elementwise_optimizers_and_refuses_the_others(name):
    opt = OPTIMIZERS[name]()
    if not fx.is_elementwise(opt):
        with pytest.raises(ValueError, match=rf"sharded_apply: .*{name}\(.* is not elementwise"):
            fx.sharded_apply(opt)
        return
    tx = fx.sharded_apply(OPTIMIZERS[name]())
    params = _params()
    s, ref_s = tx.init(params), opt.init(params)
    for step in range(3):
        g = _params(30 + step)
        u, s = tx.update(g, s, params, **_extra(tx))
        ref, ref_s = opt.update(g, ref_s, params, **_extra(opt))
        assert_trees_close(u, ref, rtol=0, atol=0)
        params = fx.apply_updates(params, ref)


def _loss(params, batch):
    x, y = batch
    return ((x @ params["w"] + params["b"] - y) ** 2).mean()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_recommended_stack_trains_like_the_optimizer_on_window_means(name):
    inner = OPTIMIZERS[name]()
    inner = fx.sharded_apply(inner) if fx.is_elementwise(inner) else inner
    tx = fx.accumulate(fx.amp_cast(fx.chain(fx.clip_by_global_norm(1.0), inner), policy="p=f32,c=f32,o=f32",
                                   loss_scale=fx.StaticLossScale(2.0 ** 4)), every=2)
    ref_tx = fx.chain(fx.clip_by_global_norm(1.0), OPTIMIZERS[name]())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(6)]
    step = fx.train_step(_loss, tx)
    params, ref = _params(), _params()
    state, ref_state = tx.init(params), ref_tx.init(ref)
    for k in range(0, len(batches), 2):
        losses = []
        for b in batches[k:k + 2]:
            params, state, metrics = step(params, state, b)
            losses.append(metrics["loss"])
        grads = [torch.func.grad(_loss)(ref, b) for b in batches[k:k + 2]]
        mean = fx.tree.map(lambda a, c: (a + c) / 2, *grads)
        extra = {"value": losses[-1]} if fx.traits(ref_tx).extra_args else {}
        u, ref_state = ref_tx.update(mean, ref_state, ref, **extra)
        ref = fx.apply_updates(ref, u)
        assert_trees_close(params, ref, **TOL)
