"""Tests for fxtrain/transforms/_fused.py: the fused-kernel choice gives the foreach path's numbers."""

import re

import pytest
import torch
import torch.nn.functional as F

import fxtrain as fx
from fxtrain._base import report
from fxtrain.testing import assert_trees_close
from fxtrain.transforms import _fused

# Each optimizer next to the same chain built by hand: no fused mark, so the step takes the foreach kernels.
PAIRS = {
    "adamw": (lambda: fx.adamw(1e-2, weight_decay=0.1),
              lambda: fx.chain(fx.scale_by_adam(), fx.add_decayed_weights(0.1), fx.scale_by_learning_rate(1e-2))),
    "adam": (lambda: fx.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6),
             lambda: fx.chain(fx.scale_by_adam(0.8, 0.99, 1e-6), fx.scale_by_learning_rate(1e-2))),
    "sgd": (lambda: fx.sgd(0.1), lambda: fx.chain(fx.identity(), fx.scale_by_learning_rate(0.1))),
    "sgd-momentum": (lambda: fx.sgd(0.1, momentum=0.9),
                     lambda: fx.chain(fx.trace(0.9), fx.scale_by_learning_rate(0.1))),
    "sgd-nesterov": (lambda: fx.sgd(0.1, momentum=0.9, nesterov=True),
                     lambda: fx.chain(fx.trace(0.9, nesterov=True), fx.scale_by_learning_rate(0.1))),
    # The default stack: the clip rides in the kernel's grad_scale. The hand-built twin nests the same
    # chain, so both states are (ClipByGlobalNormState, (ScaleByAdamState, EmptyState, EmptyState)).
    # The gradients here have norms of about 0.3-10: max_norm=1.0 clips most steps, 1e3 none.
    "clip-adamw": (lambda: fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-2, weight_decay=0.1)),
                   lambda: fx.chain(fx.clip_by_global_norm(1.0), fx.chain(
                       fx.scale_by_adam(), fx.add_decayed_weights(0.1), fx.scale_by_learning_rate(1e-2)))),
    "clip-adamw-unclipped": (lambda: fx.chain(fx.clip_by_global_norm(1e3), fx.adamw(1e-2)),
                             lambda: fx.chain(fx.clip_by_global_norm(1e3), fx.chain(
                                 fx.scale_by_adam(), fx.add_decayed_weights(1e-4), fx.scale_by_learning_rate(1e-2)))),
    "clip-adam": (lambda: fx.chain(fx.clip_by_global_norm(0.5), fx.adam(1e-2)),
                  lambda: fx.chain(fx.clip_by_global_norm(0.5), fx.chain(fx.scale_by_adam(),
                                                                         fx.scale_by_learning_rate(1e-2)))),
    "clip-sgd-momentum": (lambda: fx.named_chain(("clip", fx.clip_by_global_norm(1.0)),
                                                 ("sgd", fx.sgd(0.1, momentum=0.9))),
                          lambda: fx.named_chain(("clip", fx.clip_by_global_norm(1.0)), ("sgd", fx.chain(
                              fx.trace(0.9), fx.scale_by_learning_rate(0.1))))),
    # A chain of one optimizer (the runner's optim.chain=[adam], mnist_port's): the optimizer's kernel.
    "chain-of-adamw": (lambda: fx.chain(fx.adamw(1e-2, weight_decay=0.1)),
                       lambda: fx.chain(fx.chain(fx.scale_by_adam(), fx.add_decayed_weights(0.1),
                                                 fx.scale_by_learning_rate(1e-2)))),
    "clip-sgd": (lambda: fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1)),
                 lambda: fx.chain(fx.clip_by_global_norm(1.0),
                                  fx.chain(fx.identity(), fx.scale_by_learning_rate(0.1)))),
}


# The runner's default stack (fxtrain/build.py from conf/: clip, then inject_hyperparams(adamw) with the
# schedule group's warmup_cosine times the peak): the learning rate is a 0-dim tensor in the state that
# changes every step here (3 warmup steps, cosine to 0 over 20), the kernel takes it as a tensor.
def default_stack(max_norm=1.0, **kwargs):
    lr = fx.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=3, decay_steps=20)
    return fx.chain(fx.clip_by_global_norm(max_norm),
                    fx.inject_hyperparams(fx.adamw)(learning_rate=lr, weight_decay=0.1, **kwargs))


def unfused(make):
    """The same stack with its fused mark taken off: the step runs its foreach kernels."""
    return lambda: fx.with_traits(make(), fused=None)


INJECTED = {
    "default-stack": default_stack,
    "inject-adamw-schedule": lambda: fx.inject_hyperparams(fx.adamw)(
        learning_rate=fx.cosine_decay_schedule(1e-2, 10), weight_decay=0.1),
    "inject-adam-constant": lambda: fx.inject_hyperparams(fx.adam)(learning_rate=1e-2, b1=0.8),
    "inject-sgd-momentum": lambda: fx.inject_hyperparams(fx.sgd)(learning_rate=fx.linear_schedule(0.1, 0.01, 10),
                                                                momentum=0.9),
    "clip-inject-sgd": lambda: fx.chain(fx.clip_by_global_norm(1.0), fx.inject_hyperparams(fx.sgd)(learning_rate=0.1)),
}
PAIRS.update({name: (make, unfused(make)) for name, make in INJECTED.items()})


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"l1": {"w": torch.randn(8, 5, generator=g) / 3, "b": torch.zeros(8)}, "l2": [torch.randn(3, 8, generator=g) / 3, torch.zeros(3)]}


def _loss(params, batch):
    x, y = batch
    h = torch.tanh(F.linear(x, params["l1"]["w"], params["l1"]["b"]))
    return F.cross_entropy(F.linear(h, *params["l2"]), y)


def _run(tx, params, steps=10, donate=True, record=True):
    """``steps`` training steps; ``record=False`` calls them under ``no_grad`` (a pure step then runs the
    donated kernels on copies, see fxtrain/step.py; where autograd records, it runs out of place)."""
    state = tx.init(params)
    step = fx.train_step(_loss, tx, donate=donate)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = (torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g))
        with torch.set_grad_enabled(record):
            params, state, _ = step(params, state, batch)
    return params, state


def _run_updates(tx, params, fused, steps=10):
    """``steps`` updates on fixed random gradients: the fused kernel, or update_ + apply_updates_."""
    state = tx.init(params)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        grads = fx.tree.map(lambda p: torch.randn(p.shape, generator=g) * torch.rand((), generator=g), params)
        if fused:
            assert _fused.step_(tx, grads, state, params)
        else:
            updates, state = fx.update_(tx, grads, state, params)
            fx.apply_updates_(params, updates)
    return params, state


@pytest.mark.parametrize("name", list(PAIRS))
def test_fused_kernel_equals_foreach_kernels_over_steps(name):
    fused, foreach = PAIRS[name][0](), PAIRS[name][1]()
    assert _fused.spec(fused) is not None and _fused.spec(foreach) is None
    p_fused, s_fused = _run_updates(fused, _params(), fused=True)
    p_ref, s_ref = _run_updates(foreach, _params(), fused=False)
    # Same state structure, same moments to float32 rounding (1 ulp of the momentum's largest past value,
    # ~5e-7 here, survives when later gradients cancel it).
    assert_trees_close(s_fused, s_ref, rtol=1e-6, atol=1e-6)
    # The summed updates agree to 1e-6 relative, except for Adam's bias corrections: fxtrain (as Optax)
    # computes 1 - b2**t in float32, torch's kernel in float64; at t=1, b2=0.999 float32's is off by
    # 1.3e-5 relative (cancellation), which moves each update by half that: 10 steps of lr=1e-2 differ by
    # at most 10 * 1e-2 * 1e-5 = 1e-6.
    assert_trees_close(p_fused, p_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(PAIRS))
def test_train_step_takes_the_fused_kernel(name, monkeypatch):
    calls = []
    real = _fused.step_
    monkeypatch.setattr(_fused, "step_", lambda *a: calls.append(real(*a)) or calls[-1])
    p_fused, s_fused = _run(PAIRS[name][0](), _params())
    assert calls == [True] * 10
    # Through a model, rounding differences feed back into the gradients; one step apart they are ~1e-7.
    p_ref, s_ref = _run(PAIRS[name][1](), _params())
    assert_trees_close(p_fused, p_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "clip-adamw", "clip-sgd-momentum"])
def test_pure_fused_step_leaves_inputs_and_matches_donated(name):
    make = PAIRS[name][0]
    params = _params()
    before = fx.tree.clone(params)
    p_don, s_don = _run(make(), _params(), steps=3)
    # Under no_grad the pure step runs the same fused kernel on copies: bit-exact.
    p_pure, s_pure = _run(make(), params, steps=3, donate=False, record=False)
    assert_trees_close(params, before, rtol=0, atol=0)
    assert_trees_close((p_pure, s_pure), (p_don, s_don), rtol=0, atol=0)
    # Where autograd records, it runs the transforms out of place: the foreach math, so the fused kernel's
    # tolerance: float64 bias corrections move each Adam update (at most lr=1e-2 per element) by up to
    # ~1e-5 relative, so 3 steps apart by 3e-7 absolute at most, plus what that feeds back through the loss.
    p_rec, s_rec = _run(make(), params, steps=3, donate=False)
    assert_trees_close(params, before, rtol=0, atol=0)
    assert_trees_close((p_rec, s_rec), (p_don, s_don), rtol=2e-5, atol=5e-7)


def _clipped_adamw(learning_rate):
    return fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(learning_rate))


@pytest.mark.parametrize("make", [
    lambda: fx.adamw(1e-2, mask={"l1": True, "l2": False}),
    lambda: fx.adamw(fx.linear_schedule(1e-2, 0.0, 10)),
    lambda: fx.adam(1e-2, mu_dtype=torch.bfloat16),
    lambda: fx.adam(1e-2, nesterov=True),
    lambda: fx.adam(1e-2, eps_root=1e-8),
    lambda: fx.adam(torch.tensor(1e-2)),
    lambda: fx.sgd(0.1, momentum=0.9, accumulator_dtype=torch.float64),
    lambda: fx.sgd(0.1, momentum=0.0),  # Optax's trace holds the gradient; torch's kernel keeps no buffer
    # inject_hyperparams: a hyperparameter the kernel takes as a host number given as a schedule or a tensor
    # (its value is on the device), one the kernel does not cover, an optimizer without a kernel.
    lambda: fx.inject_hyperparams(fx.adamw)(learning_rate=1e-2, b1=fx.linear_schedule(0.9, 0.8, 10)),
    lambda: fx.inject_hyperparams(fx.adamw)(learning_rate=1e-2, weight_decay=torch.tensor(0.1)),
    lambda: fx.inject_hyperparams(fx.adamw)(learning_rate=1e-2, eps_root=1e-8),
    lambda: fx.inject_hyperparams(fx.adam)(learning_rate=1e-2, nesterov=True),
    lambda: fx.inject_hyperparams(fx.lion)(learning_rate=1e-2),
    lambda: fx.inject_hyperparams(_clipped_adamw)(learning_rate=1e-2),  # a combined kernel inside: not covered
    lambda: fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(fx.linear_schedule(1e-2, 0.0, 10))),
    lambda: fx.chain(fx.clip_by_global_norm(torch.tensor(1.0)), fx.adamw(1e-2)),
    lambda: fx.chain(fx.adamw(1e-2), fx.clip_by_global_norm(1.0)),  # clips the update, not the gradient
    lambda: fx.chain(fx.clip_by_global_norm(1.0), fx.clip_by_global_norm(2.0), fx.adamw(1e-2)),
    lambda: fx.chain(fx.clip_by_global_norm(1.0), fx.chain(fx.clip_by_global_norm(2.0), fx.adamw(1e-2))),
    lambda: fx.chain(fx.clip(1.0), fx.adamw(1e-2)),
    lambda: fx.masked(fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-2)), {"l1": True, "l2": False}),
    lambda: fx.clip_by_global_norm(1.0),  # a prefix: no kernel of its own
])
def test_arguments_the_kernels_do_not_cover_take_the_foreach_path(make):
    params = _params()
    tx = make()
    assert not _fused.applies(tx, params, tx.init(params), params)


def test_a_clip_over_process_groups_keeps_the_fused_kernel():
    # Pipeline stages: the norm is summed over the clip's groups (tests/test_pipeline.py runs it on 2 ranks);
    # the kernel itself is the same, so the spec carries the groups to the norm.
    group = object()
    tx = fx.chain(fx.clip_by_global_norm(1.0, groups=[group]), fx.adamw(1e-2))
    params = _params()
    assert _fused.spec(tx).groups == (group,) and _fused.spec(tx).max_norm == 1.0
    assert _fused.applies(tx, params, tx.init(params), params)


def test_leaves_the_kernels_do_not_allow_fall_back_with_the_same_numbers():
    # A transposed (non-contiguous) param: the check declines, the foreach kernels run, nothing was touched.
    params = _params()
    params["l1"]["w"] = params["l1"]["w"].t().contiguous().t()
    tx = PAIRS["adamw"][0]()
    state = tx.init(params)
    assert not _fused.applies(tx, params, state, params)
    assert not _fused.step_(tx, params, state, params) and int(state[0].count) == 0
    p_fallback, _ = _run(tx, params)
    p_ref, _ = _run(PAIRS["adamw"][1](), _params())
    # The foreach kernels on a transposed layout against the same kernels on a contiguous one: different
    # loops (vectorised differently per CPU), so agreement is a float32 rounding claim, not bit-exactness
    # (7e-9 apart on an AMD EPYC). 1e-6 relative is a few float32 ulps over these steps.
    assert_trees_close(p_fallback, p_ref, rtol=1e-6, atol=1e-7)


def test_frozen_none_leaves_keep_their_state():
    params = _params()
    params["l2"][1] = None
    p_fused, s_fused = _run(PAIRS["adamw"][0](), params, steps=1)
    p_ref, s_ref = _run(PAIRS["adamw"][1](), {**_params(), "l2": [_params()["l2"][0], None]}, steps=1)
    assert p_fused["l2"][1] is None
    assert_trees_close((p_fused, s_fused), (p_ref, s_ref), rtol=1e-6, atol=1e-7)


def test_matches_torch_optim_fused_adamw():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    params = {"w": model.weight.detach().clone(), "b": model.bias.detach().clone()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    tx = fx.adamw(1e-2, weight_decay=0.1)
    state = tx.init(params)
    step = fx.train_step(lambda p, b: F.mse_loss(F.linear(b[0], p["w"], p["b"]), b[1]), tx)
    for i in range(5):
        batch = (torch.randn(4, 5), torch.randn(4, 3))
        opt.zero_grad()
        F.mse_loss(model(batch[0]), batch[1]).backward()
        opt.step()
        params, state, _ = step(params, state, batch)
    assert_trees_close(params, {"w": model.weight.detach(), "b": model.bias.detach()}, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping every step, and never
def test_clip_then_adamw_matches_torch_optim_fused_adamw_with_clip_grad_norm(max_norm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    params = {"l1": {"w": model[0].weight.detach().clone(), "b": model[0].bias.detach().clone()},
              "l2": [model[2].weight.detach().clone(), model[2].bias.detach().clone()]}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    tx = fx.chain(fx.clip_by_global_norm(max_norm), fx.adamw(1e-2, weight_decay=0.1))
    state = tx.init(params)
    step = fx.train_step(_loss, tx)
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        params, state, metrics = step(params, state, (x, y))
        torch.testing.assert_close(metrics["grad_norm"], norm, rtol=1e-5, atol=0)
    # clip_grad_norm_ scales by max_norm / (norm + 1e-6), Optax by max_norm / norm: the gradients differ by
    # 1e-6 / norm relative (~1e-5 here), which Adam's normalisation cancels but for eps; with the float32
    # vs float64 bias corrections (module docstring), 10 steps of lr=1e-2 agree to 2e-6.
    expected = {"l1": {"w": model[0].weight.detach(), "b": model[0].bias.detach()},
                "l2": [model[2].weight.detach(), model[2].bias.detach()]}
    assert_trees_close(params, expected, rtol=2e-6, atol=2e-6)


def test_clip_state_reports_the_norm_as_the_foreach_path_does():
    fused, foreach = PAIRS["clip-adamw"][0](), PAIRS["clip-adamw"][1]()
    g = {"l1": {"w": torch.full((8, 5), 0.5), "b": torch.ones(8)}, "l2": [torch.zeros(3, 8), torch.full((3,), 2.0)]}
    params = _params()
    s_fused, s_ref = fused.init(params), foreach.init(params)
    assert _fused.step_(fused, fx.tree.clone(g), s_fused, fx.tree.clone(params))
    _, s_ref = fx.update_(foreach, fx.tree.clone(g), s_ref, params)
    # The same global_norm on the same gradients: bit-exact.
    assert float(s_fused[0].grad_norm) == float(s_ref[0].grad_norm) == float(fx.global_norm(g))
    assert report(s_fused)["grad_norm"] is s_fused[0].grad_norm


def test_clip_declines_gradients_that_share_a_buffer():
    # autograd gives (a + b).sum() one gradient tensor for both leaves; the kernel writes the clipped
    # gradients back, so it would divide that buffer twice. The foreach path (which copies) runs instead.
    tx = PAIRS["clip-adamw"][0]()
    params = {"a": torch.ones(3), "b": torch.ones(3)}
    shared = torch.full((3,), 2.0)
    state = tx.init(params)
    assert not _fused.applies(tx, {"a": shared, "b": shared}, state, params)
    assert _fused.applies(tx, {"a": shared, "b": shared.clone()}, state, params)
    step = fx.train_step(lambda p, b: (p["a"] + p["b"]).sum(), tx)
    p_step, _, metrics = step(fx.tree.clone(params), tx.init(params), None)
    p_ref, _, _ = fx.train_step(lambda p, b: (p["a"] + p["b"]).sum(), PAIRS["clip-adamw"][1]())(
        fx.tree.clone(params), PAIRS["clip-adamw"][1]().init(params), None)
    assert_trees_close(p_step, p_ref, rtol=1e-6, atol=1e-7)
    assert float(metrics["grad_norm"]) == pytest.approx(6 ** 0.5)


def test_clip_takes_disjoint_slices_of_one_buffer_and_declines_overlapping_ones():
    # FSDP2's reduce-scatter leaves a module's gradients as disjoint slices of one buffer: each is written once.
    tx = PAIRS["clip-adamw"][0]()
    params = {"a": torch.ones(3), "b": torch.ones(3)}
    buf = torch.arange(6.0)
    state = tx.init(params)
    assert _fused.applies(tx, {"a": buf[:3], "b": buf[3:]}, state, params)
    assert not _fused.applies(tx, {"a": buf[:3], "b": buf[2:5]}, state, params)  # element 2 in both
    assert _fused.step_(tx, {"a": buf[:3], "b": buf[3:]}, state, params)
    assert float(state[0].grad_norm) == pytest.approx(float(torch.arange(6.0).norm()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_clip_non_finite_gradients_poison_the_step_as_on_the_foreach_path(bad):
    # Optax's rule: no skipping (that is apply_if_finite's or amp_cast's job); the params become non-finite.
    fused, foreach = PAIRS["clip-adamw"][0](), PAIRS["clip-adamw"][1]()
    grads = fx.tree.map(torch.ones_like, _params())
    grads["l2"][1][0] = bad
    p_fused, s_fused = _params(), fused.init(_params())
    assert _fused.step_(fused, fx.tree.clone(grads), s_fused, p_fused)
    p_ref, s_ref = _params(), foreach.init(_params())
    updates, s_ref = fx.update_(foreach, fx.tree.clone(grads), s_ref, p_ref)
    fx.apply_updates_(p_ref, updates)
    fused_leaves, ref_leaves = fx.tree.leaves(p_fused), fx.tree.leaves(p_ref)
    assert all(torch.equal(a.isfinite(), b.isfinite()) for a, b in zip(fused_leaves, ref_leaves))
    assert not all(bool(x.isfinite().all()) for x in fused_leaves)
    assert torch.equal(s_fused[0].grad_norm.isnan(), s_ref[0].grad_norm.isnan())


# --- inject_hyperparams: the runner's default stack (fxtrain/transforms/_hyperparams.py declares the kernel) ----

def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _train(tx, params, state, batches, donate=True):
    """Steps over ``batches``; returns the params, state, every step's learning rate and what each fused attempt
    returned (True: the kernel ran)."""
    calls, lrs = [], []
    step = fx.train_step(_loss, tx, donate=donate)
    real = _fused.step_
    _fused.step_ = lambda *a: calls.append(real(*a)) or calls[-1]
    try:
        for b in batches:
            params, state, metrics = step(params, state, b)
            lrs.append(metrics["learning_rate"])
    finally:
        _fused.step_ = real
    return params, state, torch.stack(lrs), calls


def test_default_stack_fused_step_equals_its_pure_unfused_step():
    tx, steps = default_stack(), 20
    p_fused, s_fused, lr_fused, calls = _train(tx, _params(), tx.init(_params()), _batches(steps))
    assert calls == [True] * steps  # the kernel ran on every step
    # The pure step where autograd records (params that require grad): tx.update out of place, the foreach math.
    recorded = fx.tree.map(lambda p: p.requires_grad_(), _params())
    p_pure, s_pure, lr_pure, calls = _train(tx, recorded, tx.init(_params()), _batches(steps), donate=False)
    assert calls == []
    # Where nothing records, the pure step runs the kernel on copies: the donated step's bits.
    p_copy, s_copy, lr_copy, calls = _train(tx, _params(), tx.init(_params()), _batches(steps), donate=False)
    assert calls == [True] * steps
    assert all(map(torch.equal, fx.tree.leaves((p_copy, s_copy)), fx.tree.leaves((p_fused, s_fused))))
    # The schedule is read at the same counts by the same function: the same learning rates, bit for bit, and
    # they change every step (warmup from 0, then cosine decay).
    assert torch.equal(lr_fused, lr_pure) and bool((lr_fused[1:] != lr_fused[:-1]).all())
    assert fx.tree.structure(s_fused) == fx.tree.structure(s_pure)
    # As test_train_step_takes_the_fused_kernel: float64 bias corrections in the kernel (~1e-5 relative on
    # early updates of at most lr=1e-2), fed back through the loss over 20 steps.
    assert_trees_close(p_fused, p_pure, rtol=1e-4, atol=1e-6)
    assert_trees_close(s_fused, s_pure, rtol=1e-4, atol=1e-6)


def test_default_stack_fused_matches_optax():
    pytest.importorskip("optax")
    import optax

    from tests import _parity

    tx = default_stack(max_norm=2.0)
    otx = optax.chain(optax.clip_by_global_norm(2.0), optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=3, decay_steps=20), weight_decay=0.1))
    params = fx.testing.nested_params()
    state = tx.init(params)
    for k in range(_parity.STEPS):
        assert _fused.step_(tx, _parity.grads(params, k), state, params)
    _, p_optax, s_optax = _parity.run_optax(otx, fx.testing.nested_params())
    # Optax computes Adam's bias corrections in float32, the kernel in float64: ~7e-6 relative on an
    # early update, at most lr=1e-2 each.
    assert_trees_close(params, p_optax, rtol=1e-5, atol=2e-7)
    # Adam's moments, and the learning rate the last update used (Optax's clip state is empty, ours the norm).
    _parity.state_leaves_close(state[1].inner_state, s_optax[1].inner_state, rtol=1e-5, atol=1e-6)
    _parity.state_leaves_close(state[1].hyperparams["learning_rate"], s_optax[1].hyperparams["learning_rate"])


def test_default_stack_resumes_bit_exactly_with_the_fused_kernel(tmp_path):
    tx, batches = default_stack(), _batches(12)
    p_all, s_all, _, calls = _train(tx, _params(), tx.init(_params()), batches)
    assert calls == [True] * 12
    p_half, s_half, _, _ = _train(tx, _params(), tx.init(_params()), batches[:5])
    fx.save(tmp_path / "ckpt", fx.TrainState(5, p_half, s_half, None))
    like = fx.TrainState(0, _params(), tx.init(_params()), None)
    back = fx.load(tmp_path / "ckpt", like=like)  # new tensors: the host reads the state's constants once
    p_res, s_res, _, calls = _train(tx, back.params, back.opt_state, batches[5:])
    assert calls == [True] * 7
    assert_trees_close((p_res, s_res), (p_all, s_all), rtol=0, atol=0)


def test_default_stack_state_layout_is_the_unfused_one_so_old_checkpoints_load(tmp_path):
    # A checkpoint written by a run of the foreach kernels continues with the fused kernel.
    tx, old = default_stack(), unfused(default_stack)()
    p_old, s_old, _, calls = _train(old, _params(), old.init(_params()), _batches(4))
    assert calls == []
    fx.save(tmp_path / "old", fx.TrainState(4, p_old, s_old, None))
    back = fx.load(tmp_path / "old", like=fx.TrainState(0, _params(), tx.init(_params()), None))
    assert_trees_close(back.opt_state, s_old, rtol=0, atol=0)
    _, s_new, _, calls = _train(tx, back.params, back.opt_state, _batches(2, seed=5))
    assert calls == [True, True] and int(s_new[1].count) == 6


def test_values_written_into_the_state_are_the_kernels_from_the_next_step():
    # What inject_hyperparams promises: a value written into state.hyperparams is used from the next update on.
    # In place (fill_: the tensor's version counter moves) or as a new tensor, the kernel reads the new value.
    def run(make):
        tx, params = make(), _params()
        state = tx.init(params)
        params, state, _, calls = _train(tx, params, state, _batches(3))
        state[1].hyperparams["weight_decay"].fill_(0.5)
        state[1].hyperparams["b2"] = torch.tensor(0.99)
        params, state, _, more = _train(tx, params, state, _batches(3, seed=2))
        return params, state, calls + more

    p_fused, s_fused, calls = run(default_stack)
    assert calls == [True] * 6
    p_ref, s_ref, calls = run(unfused(default_stack))
    assert calls == []
    assert_trees_close((p_fused, s_fused), (p_ref, s_ref), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("key, value", [
    ("eps_root", torch.tensor(1e-8)),  # the kernel has no eps_root: adamw declares no kernel for it
    ("weight_decay", torch.full((8,), 0.1)),  # not 0-dim: the foreach path names it
    ("weight_decay", torch.tensor(0.1, requires_grad=True)),  # differentiated: the donated step refuses it
    ("b1", "0.9"),  # not a number
])
def test_state_values_the_kernel_cannot_take_fall_back_to_the_foreach_path(key, value):
    tx, params = default_stack(), _params()
    state = tx.init(params)
    assert _fused.applies(tx, params, state, params)
    state[1].hyperparams[key] = value
    assert not _fused.applies(tx, params, state, params)
    step = fx.train_step(_loss, tx)
    ref = fx.train_step(_loss, unfused(default_stack)())
    try:
        expected = ref(fx.tree.clone(params), fx.tree.clone(state), _batches(1)[0])
    except (TypeError, ValueError) as e:  # never silently different: the same refusal, with the same words
        with pytest.raises(type(e), match=re.escape(str(e))):
            step(params, state, _batches(1)[0])
        return
    got = step(params, state, _batches(1)[0])
    assert_trees_close(got[:2], expected[:2], rtol=0, atol=0)
