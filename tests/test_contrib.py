"""The smaller optimizers of fxtrain/contrib/ (DoG, DoWG, COCOB, MADGRAD, Mechanic, D-Adaptation AdamW): the checks
they share (the minimum of a parabola, pure, dtypes, ``None`` leaves, errors naming the argument, finite
gradients through updates). Their own tests: test_dog.py, test_momo.py, test_mechanic.py, test_complex_valued.py."""

import pytest
import torch

import fxtrain as fx
from tests._parity import assert_dtypes, assert_none_passthrough, assert_pure

C = fx.contrib


@pytest.mark.parametrize("build", [lambda: C.dog(init_step=("learning_rate", 0.1)), lambda: C.dowg(),
                                   lambda: C.cocob(), lambda: C.cocob(weight_decay=1e-2), lambda: C.madgrad(0.1),
                                   lambda: C.dadapt_adamw()],
                         ids=["dog", "dowg", "cocob", "cocob_decay", "madgrad", "dadapt_adamw"])
def test_reaches_the_minimum(build):  # Optax's common test, on the parabola, with fewer steps
    target = torch.tensor([1.0, -1.0, 1.0])
    params, tx = torch.tensor([-1.0, 10.0, 1.0]), build()
    state = tx.init(params)
    for _ in range(500):
        u, state = tx.update(2 * (params - target), state, params)
        params = fx.apply_updates(params, u)
    torch.testing.assert_close(params, target, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("build", [lambda: C.dog(weight_decay=1e-2), lambda: C.dowg(weight_decay=1e-2),
                                   lambda: C.cocob(weight_decay=1e-2), lambda: C.madgrad(1e-2, weight_decay=1e-2),
                                   lambda: C.mechanize(fx.adam(1.0)), lambda: C.dadapt_adamw(weight_decay=1e-2)],
                         ids=["dog", "dowg", "cocob", "madgrad", "mechanize", "dadapt_adamw"])
def test_pure_dtypes_and_none_leaves(build):
    tx = build()
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"scale_by_dog: init_step=\('lr', \.\.\.\) must start with one of"):
        C.dog(init_step=("lr", 0.1))
    with pytest.raises(ValueError, match=r"scale_by_dowg: eps=-1.0 must be >= 0"):
        C.dowg(eps=-1.0)
    with pytest.raises(ValueError, match=r"dog: learning_rate=-1.0 must be >= 0"):
        C.dog(-1.0)
    for tx, name in [(C.scale_by_dog(("distance", 1.0)), "scale_by_dog"), (C.scale_by_cocob(), "scale_by_cocob"),
                     (C.scale_by_madgrad(0.1), "scale_by_madgrad")]:
        with pytest.raises(ValueError, match=rf"{name} needs the params: call update\(updates, state, params\)"):
            tx.update(torch.ones(2), tx.init(torch.ones(2)))
    with pytest.raises(ValueError, match=r"scale_by_cocob: alpha=-1.0 must be >= 0"):
        C.cocob(alpha=-1.0)


@pytest.mark.parametrize("build", [lambda: C.dog(init_step=("distance", 0.1)), lambda: C.mechanize(fx.adam(1.0))],
                         ids=["dog", "mechanize"])
def test_gradient_through_updates_is_finite(build):
    # Optax's is NaN: a sqrt at 0 on the first update (dog: the distance |x_0 - x_0|; mechanize: sqrt(v)).
    tx = build()

    def loss(p):
        state = tx.init(p)
        for _ in range(2):
            u, state = tx.update(2 * p, state, p)
            p = fx.apply_updates(p, u)
        return (p ** 2).sum()

    assert torch.isfinite(torch.func.grad(loss)(torch.tensor([1.0, 2.0]))).all()
