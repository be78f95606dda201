"""snapshot, monitor, measure_with_ema (fxtrain/transforms/_monitoring.py): Optax's cases and parity."""

import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from tests._parity import assert_parity
from tests.cases.wrappers import doubled, reads_value


def _grad_f(x):
    return 2 * x  # the gradient of sum(x ** 2)


def test_optax_snapshot():
    before_clip = fx.chain(fx.sgd(0.1, momentum=0.9), fx.snapshot("norm_before_clip", fx.tree.norm))
    tx = fx.chain(before_clip, fx.clip_by_global_norm(0.05))
    params = torch.tensor([1.0, 2.0, 3.0])
    aux, state = before_clip.init(params), tx.init(params)
    for _ in range(2):
        g = _grad_f(params)
        u_before, aux = before_clip.update(g, aux)
        u, state = tx.update(g, state)
        params = fx.apply_updates(params, u)
        assert fx.tree.get(state, "norm_before_clip").item() == pytest.approx(fx.tree.norm(u_before).item(), rel=1e-6)


def test_optax_monitor():
    before_clip = fx.chain(fx.sgd(0.1, momentum=0.9), fx.monitor({
        "norm_before_clip": fx.tree.norm,
        "norm_before_clip_ema": fx.measure_with_ema(fx.tree.norm, 0.9, True)}))
    tx = fx.chain(before_clip, fx.clip_by_global_norm(0.05))
    params = torch.tensor([1.0, 2.0, 3.0])
    aux, state = before_clip.init(params), tx.init(params)
    ema = 0.0
    for step in range(1, 4):
        g = _grad_f(params)
        u_before, aux = before_clip.update(g, aux)
        u, state = tx.update(g, state)
        params = fx.apply_updates(params, u)
        norm = fx.tree.norm(u_before).item()
        assert fx.tree.get(state, "norm_before_clip").item() == pytest.approx(norm, rel=1e-6)
        ema = 0.9 * ema + 0.1 * norm
        assert fx.tree.get(state, "norm_before_clip_ema").item() == pytest.approx(ema / (1 - 0.9 ** step), rel=1e-5)


def test_optax_docstring_numbers():
    # Optax's examples: norms 7.48e-01 then 1.41e+00 (snapshot); 1.27e+00 and an is_clipped_ema of 5.26e-01
    # at the second step (monitor).
    tx = fx.chain(fx.sgd(0.1, momentum=0.9), fx.snapshot("norm_before_clip", fx.tree.norm),
                  fx.clip_by_global_norm(0.05))
    params = torch.tensor([1.0, 2.0, 3.0])
    state, norms = tx.init(params), []
    for _ in range(2):
        u, state = tx.update(_grad_f(params), state)
        params = fx.apply_updates(params, u)
        norms.append(round(fx.tree.get(state, "norm_before_clip").item(), 2))
    assert norms == [0.75, 1.41]
    tx = fx.chain(fx.sgd(0.1, momentum=0.9), fx.monitor({
        "norm_before_clip": fx.tree.norm,
        "is_clipped_ema": fx.measure_with_ema(lambda x: (fx.tree.norm(x) > 1.0).float(), decay=0.9)}),
        fx.clip_by_global_norm(1.0))
    params = torch.tensor([1.0, 2.0, 3.0])
    state = tx.init(params)
    for _ in range(2):
        u, state = tx.update(_grad_f(params), state)
        params = fx.apply_updates(params, u)
    assert round(fx.tree.get(state, "norm_before_clip").item(), 2) == 1.27
    assert round(fx.tree.get(state, "is_clipped_ema").item(), 3) == 0.526


@pytest.mark.optax
def test_snapshot_and_monitor_match_optax():
    optax = pytest.importorskip("optax")
    assert_parity(fx.chain(fx.adam(0.1), fx.snapshot("doubled", doubled), fx.scale(0.5)),
                  optax.chain(optax.adam(0.1), optax.snapshot("doubled", doubled), optax.scale(0.5)))
    measures = {"trace": fx.trace(0.9), "doubled": doubled, "ema": fx.measure_with_ema(doubled, 0.8, debias=False)}
    omeasures = {"trace": optax.trace(0.9), "doubled": doubled,
                 "ema": optax.measure_with_ema(doubled, 0.8, debias=False)}
    assert_parity(fx.chain(fx.monitor(measures), fx.sgd(0.1, momentum=0.9)),
                  optax.chain(optax.monitor(omeasures), optax.sgd(0.1, momentum=0.9)))


def test_monitor_passes_updates_unchanged_and_keeps_one_structure():
    tx = fx.monitor({"scaled": fx.scale(3.0), "doubled": doubled})
    params = {"w": torch.ones(2), "b": torch.ones(1)}
    state = tx.init(params)
    spec = fx.tree.structure(state)
    g = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    for donate in (False, True):
        u, new = fx.update_(tx, fx.tree.clone(g), state, params) if donate else tx.update(g, state, params)
        assert_trees_close(u, g, rtol=0, atol=0)  # a transform measure never writes into the updates
        assert_trees_close(new.measurements["scaled"], fx.tree.map(lambda x: 3 * x, g), rtol=0, atol=0)
        assert fx.tree.structure(new) == spec
    with pytest.raises(ValueError, match="monitor: measures\\['x'\\] must be a transform or a callable"):
        fx.monitor({"x": 3})
    with pytest.raises(ValueError, match="snapshot: measure must be a callable"):
        fx.snapshot("x", 3)


def test_extra_args_reach_monitoring_transforms():
    tx = fx.monitor({"v": reads_value()})
    assert fx.traits(tx).extra_args
    state = tx.init(torch.zeros(2))
    u, state = tx.update(torch.ones(2), state, value=torch.tensor(2.0))
    assert u.tolist() == [1.0, 1.0] and state.measurements["v"].tolist() == [3.0, 3.0]
    assert not fx.traits(fx.monitor({"t": fx.trace(0.5)})).extra_args
