"""fxtrain optimizers against torch.optim, where the math coincides (20 steps, float32, rtol 1e-5).

Settings chosen so the two agree, and the differences that remain by design:

* SGD: torch's ``weight_decay`` adds ``wd * p`` to the gradient before momentum, which is
  ``chain(add_decayed_weights(wd), sgd(...))``; ``dampening`` must be 0 (Optax's ``trace`` has none).
* Adam / AdamW: same formula (Algorithm 1 of Kingma and Ba, eps outside the root). torch.optim computes
  the bias corrections ``1 - beta ** t`` in float64 on the host; fxtrain, like Optax, in float32 on
  device (no host sync), which moves the first steps by a few 1e-6 relative when ``b2 = 0.999``.
  AdamW's decay is multiplied by the learning rate in both (``p *= 1 - lr * wd``).
* RMSprop: torch puts eps outside the root and starts the average at 0: ``eps_in_sqrt=False``,
  ``initial_scale=0``. Centered and momentum coincide too (torch's momentum buffer accumulates
  ``g / avg``, Optax's ``trace`` accumulates ``-lr * g / avg``: the same steps for a constant lr).
* Adagrad: torch adds eps outside the root (``sqrt(s) + eps``), Optax inside (``sqrt(s + eps)``): they
  coincide for ``eps=0`` with a positive ``initial_accumulator_value``; torch's ``lr_decay`` must be 0.
* Not compared: Optax's ``bias_correction`` and ``initial_scale`` for RMSprop, ``eps_root``, ``mu_dtype``
  and Nesterov Adam (torch.optim.NAdam uses a momentum-decay schedule that Optax's NAdam does not).
"""

import pytest
import torch

import fxtrain as fx
from fxtrain import tree
from fxtrain.testing import assert_trees_close, nested_params
from tests._parity import STEPS, grads, run_fx


def run_torch(make_opt):
    params = nested_params()
    leaves, spec = tree.flatten(params)
    ps = [p.clone().requires_grad_() for p in leaves]
    opt = make_opt(ps)
    history = []
    for k in range(STEPS):
        current = tree.unflatten(spec, [p.detach() for p in ps])
        for p, g in zip(ps, tree.flatten(grads(current, k))[0]):
            p.grad = g
        opt.step()
        history.append(tree.unflatten(spec, [p.detach().clone() for p in ps]))
    return history


def run_fxtrain(tx):
    params, history = nested_params(), []
    state = tx.init(params)
    for k in range(STEPS):
        u, state = tx.update(grads(params, k), state, params)
        params = fx.apply_updates(params, u)
        history.append(params)
    return history


CASES = {
    "sgd": (fx.sgd(0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd_momentum": (fx.sgd(0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "sgd_nesterov": (fx.sgd(0.1, momentum=0.9, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    "sgd_weight_decay": (fx.chain(fx.add_decayed_weights(0.01), fx.sgd(0.1, momentum=0.9, nesterov=True)),
                         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam": (fx.adam(0.01), lambda ps: torch.optim.Adam(ps, lr=0.01)),
    "adam_betas": (fx.adam(0.01, b1=0.8, b2=0.95, eps=1e-6),
                   lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-6)),
    "adamw": (fx.adamw(0.01, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
    "adamw_foreach": (fx.adamw(0.01, weight_decay=0.1),
                      lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True)),
    "rmsprop": (fx.rmsprop(0.01, decay=0.99, eps=1e-8, eps_in_sqrt=False),
                lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.99, eps=1e-8)),
    "rmsprop_centered": (fx.rmsprop(0.01, decay=0.9, eps=1e-6, eps_in_sqrt=False, centered=True),
                         lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-6, centered=True)),
    "rmsprop_momentum": (fx.rmsprop(0.01, decay=0.9, eps_in_sqrt=False, momentum=0.9),
                         lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, momentum=0.9)),
    "rmsprop_centered_momentum": (fx.rmsprop(0.01, decay=0.9, eps_in_sqrt=False, centered=True, momentum=0.5),
                                  lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, centered=True, momentum=0.5)),
    "adagrad": (fx.adagrad(0.1, initial_accumulator_value=0.1, eps=0.0),
                lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1, eps=0.0)),
}


@pytest.mark.parametrize("tx,make_opt", CASES.values(), ids=CASES.keys())
def test_matches_torch_optim(tx, make_opt):
    for k, (ours, theirs) in enumerate(zip(run_fxtrain(tx), run_torch(make_opt))):
        try:
            assert_trees_close(ours, theirs, rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"params differ from torch.optim's after step {k}: {e}") from None


def test_donated_adamw_matches_torch_optim():
    """The in-place kernel, as a donated train step runs it."""
    tx = fx.adamw(0.01, weight_decay=0.1)
    _, params, _ = run_fx(tx, nested_params(), donate=True)
    assert_trees_close(params, run_torch(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1))[-1],
                       rtol=1e-5, atol=1e-6)
