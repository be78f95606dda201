"""Tests for fxtrain/step.py: train_step's numbers, donation, DTensor params, metrics and errors."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import fxtrain as fx
from fxtrain.testing import assert_trees_close


STACKS = {
    "scale": lambda: fx.scale(-0.1),
    "clip+scale": lambda: fx.chain(fx.clip_by_global_norm(0.5), fx.scale(-0.1)),
    "sgd": lambda: fx.sgd(0.1),
    "sgd-momentum": lambda: fx.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: fx.adam(1e-2),
    "adamw": lambda: fx.adamw(1e-2, weight_decay=0.1),
    "clip+adamw": lambda: fx.chain(fx.clip_by_global_norm(0.5), fx.adamw(1e-2)),
}


def _mlp_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(s, generator=g) / s[-1] ** 0.5).to(dtype)  # noqa: E731
    return {"l1": {"w": r(8, 5), "b": r(8)}, "l2": [r(3, 8), r(3)]}


def _mlp_loss(params, batch):
    x, y = batch
    h = torch.tanh(F.linear(x, params["l1"]["w"], params["l1"]["b"]))
    return F.cross_entropy(F.linear(h, *params["l2"]), y)


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _run(stack, donate, steps=5, params=None, loss=_mlp_loss, grad_enabled=True):
    tx = stack()
    params = _mlp_params() if params is None else params
    state = tx.init(params)
    step = fx.train_step(loss, tx, donate=donate)
    history = []
    with torch.set_grad_enabled(grad_enabled):
        for batch in _batches(steps):
            params, state, metrics = step(params, state, batch)
            history.append(metrics)
    return params, state, history


# --- numbers ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(STACKS))
def test_donated_equals_pure_under_no_grad_bit_for_bit(name):
    """Under no_grad the pure step runs the donated kernels on copies: the same kernels, the same bits."""
    p_donated, s_donated, m_donated = _run(STACKS[name], donate=True)
    p_pure, s_pure, m_pure = _run(STACKS[name], donate=False, grad_enabled=False)
    assert_trees_close(p_donated, p_pure, rtol=0, atol=0)
    assert_trees_close(s_donated, s_pure, rtol=0, atol=0)
    assert_trees_close(m_donated, m_pure, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(STACKS))
def test_donated_equals_composable_pure_step_to_rounding(name):
    """Where autograd records (params that require grad) the pure step runs out of place (per-tensor ops,
    differentiable): other kernels.

    Bound: float32 rounding of foreach vs per-tensor kernels, plus the fused Adam kernels' float64 bias
    correction (up to ~7e-6 relative per update, fxtrain/transforms/_fused.py), over 5 steps.
    """
    p_donated, s_donated, m_donated = _run(STACKS[name], donate=True)
    recorded = fx.tree.map(lambda p: p.requires_grad_(), _mlp_params())
    p_pure, s_pure, m_pure = _run(STACKS[name], donate=False, params=recorded)
    assert all(p.grad_fn is not None for p in fx.tree.leaves(p_pure))  # differentiable: the out-of-place path
    assert_trees_close(p_donated, p_pure, rtol=1e-5, atol=1e-6)
    assert_trees_close(s_donated, s_pure, rtol=1e-5, atol=1e-6)
    assert_trees_close(m_donated, m_pure, rtol=1e-5, atol=1e-6)


# The stacks users run: the runner's default and the README's recommended one (amp_cast, accumulate around it).
RUN_STACKS = {
    "default": lambda: fx.chain(fx.clip_by_global_norm(0.5), fx.inject_hyperparams(fx.adamw)(
        learning_rate=fx.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.1)),
    "recommended": lambda: fx.accumulate(fx.amp_cast(fx.chain(fx.clip_by_global_norm(0.5), fx.adamw(1e-2)), "bf16"),
                                         every=2),
    **STACKS,
}


@pytest.mark.parametrize("name", list(RUN_STACKS))
def test_pure_step_in_a_training_loop_equals_donated_bit_for_bit(name):
    """Autograd on (as in any training loop) but nothing that requires grad: nothing can differentiate the
    update, so the pure step runs the donated kernels (fused where the stack has one) on copies: the same bits,
    and its inputs untouched."""
    p_donated, s_donated, m_donated = _run(RUN_STACKS[name], donate=True, steps=6)
    tx = RUN_STACKS[name]()
    params = _mlp_params()
    state = tx.init(params)
    step = fx.train_step(_mlp_loss, tx, donate=False)
    for batch in _batches(6):
        before = fx.tree.clone((params, state))
        new_params, state_new, metrics = step(params, state, batch)
        assert_trees_close((params, state), before, rtol=0, atol=0)  # pure: the inputs keep their values
        params, state = new_params, state_new
    assert not any(p.requires_grad for p in fx.tree.leaves((params, state)))
    assert_trees_close(p_donated, params, rtol=0, atol=0)
    assert_trees_close(s_donated, state, rtol=0, atol=0)
    assert_trees_close(m_donated[-1], metrics, rtol=0, atol=0)


def _wide_loss(params, batch):
    """A loss whose activations are a few floats: what a step allocates is its gradients and new trees."""
    return (params["w"] @ batch).square().sum() + params["b"].square().sum()


@pytest.mark.parametrize("name, trees", [("clip+adamw", 4), ("default", 4), ("recommended", 5), ("sgd", 2)])
def test_pure_step_allocates_only_its_gradients_and_new_trees(name, trees):
    """Counted by fxtrain.testing.TensorMemory (tensor bytes, deterministic): one pure step's peak growth is the
    gradients plus the new params and state (AdamW: 4P; accumulate's sum: 5P; SGD: 2P), with 0.05P for the
    scalars and the activations. The out-of-place update measured 6P, 7P and 3P: a temporary per op."""
    tx = RUN_STACKS[name]()
    params = {"w": torch.randn(128, 128), "b": torch.randn(128)}
    P = sum(p.numel() * p.element_size() for p in fx.tree.leaves(params))
    state = tx.init(params)
    step = fx.train_step(_wide_loss, tx, donate=False)
    batch = torch.randn(128)
    for _ in range(3):  # a steady step: state grown, the last of them an emitting one under accumulate(every=2)
        params, state, _ = step(params, state, batch)
    with fx.testing.TensorMemory() as mem:
        new_params, new_state, _ = step(params, state, batch)
    assert mem.peak <= (trees + 0.05) * P, f"{mem.peak / P:.2f}P"
    assert mem.peak >= trees * P  # the probe saw the new trees: the bound is not vacuous


def test_pure_step_differentiates_through_a_hyperparameter_it_closes_over():
    """A learning rate that requires grad, closed over by the stack (not an input of the step): the step sees it
    when built and keeps the update out of place, so backward reaches it; a module-level tensor a schedule
    reads too. d/dlr of |w - lr g|^2 with g = 2w: -2 <g, w - lr g>."""
    w = torch.tensor([1.0, -2.0])
    lr = torch.tensor(0.1, requires_grad=True)
    schedules = {"tensor": lr, "schedule": fx.constant_schedule(lr), "global": _reads_global_lr}
    for name, learning_rate in schedules.items():
        tx = fx.sgd(learning_rate)
        new_w, _, _ = fx.train_step(lambda p, b: p.square().sum(), tx, donate=False)(w, tx.init(w), None)
        (got,) = torch.autograd.grad(new_w.square().sum(), _GLOBAL_LR if name == "global" else lr)
        g = 2 * w
        assert float(got) == pytest.approx(float(-2 * (g * (w - 0.1 * g)).sum()), rel=1e-6), name


_GLOBAL_LR = torch.tensor(0.1, requires_grad=True)


def _reads_global_lr(count):
    del count
    return _GLOBAL_LR


def test_matches_hand_written_autograd_reference():
    """clip_by_global_norm + SGD against torch.autograd and a manual update, in float64."""
    lr, max_norm = 0.3, 0.5
    params = _mlp_params(dtype=torch.float64)
    ref = [p.clone().requires_grad_() for p in fx.tree.leaves(params)]
    step = fx.train_step(_mlp_loss, fx.chain(fx.clip_by_global_norm(max_norm), fx.scale(-lr)))
    state = fx.chain(fx.clip_by_global_norm(max_norm), fx.scale(-lr)).init(params)
    for x, y in _batches(6):
        params, state, metrics = step(params, state, (x.double(), y))
        ref_tree = fx.tree.unflatten(fx.tree.structure(params), ref)
        loss = _mlp_loss(ref_tree, (x.double(), y))
        grads = torch.autograd.grad(loss, ref)
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        coef = 1.0 if norm < max_norm else max_norm / norm
        with torch.no_grad():
            for p, g in zip(ref, grads):
                p -= lr * coef * g
        assert_trees_close(metrics, {"loss": loss, "grad_norm": norm}, rtol=1e-12)
    assert_trees_close(fx.tree.leaves(params), ref, rtol=1e-12, atol=1e-14)


def test_matches_torch_optim_adamw_with_clipping():
    lr, wd = 1e-2, 0.05
    tx = fx.chain(fx.clip_by_global_norm(0.5), fx.adamw(lr, weight_decay=wd))
    params = _mlp_params()
    ref = [torch.nn.Parameter(p.clone()) for p in fx.tree.leaves(params)]
    opt = torch.optim.AdamW(ref, lr=lr, weight_decay=wd, foreach=True)
    step, state = fx.train_step(_mlp_loss, tx), tx.init(params)
    for batch in _batches(10):
        params, state, _ = step(params, state, batch)
        opt.zero_grad()
        _mlp_loss(fx.tree.unflatten(fx.tree.structure(params), ref), batch).backward()
        torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=True)
        opt.step()
    assert_trees_close(fx.tree.leaves(params), ref, rtol=1e-5, atol=1e-6)


def test_unused_param_gets_zero_gradient():
    params = {"used": torch.ones(2), "unused": torch.ones(3)}
    step = fx.train_step(lambda p, b: (p["used"] * b).sum(), fx.scale(-1.0))
    params, _, _ = step(params, fx.scale(-1.0).init(params), torch.full((2,), 2.0))
    assert params["used"].tolist() == [-1.0, -1.0] and params["unused"].tolist() == [1.0, 1.0, 1.0]


def test_wrap_loss_scales_objective_but_reports_loss():
    """An amp_cast-like wrapper: casts params, scales the objective; gradients come back in f32."""
    seen = {}

    def wrap_loss(fn, state):
        def wrapped(params, batch):
            objective, (loss, aux) = fn(fx.tree.cast(params, torch.float64), batch)
            seen["dtype"] = objective.dtype
            return objective * 1024.0, (loss.float(), aux)
        return wrapped

    unscale = fx.with_traits(fx.GradientTransformation(lambda p: fx.EmptyState(), fx.scale(1 / 1024.0).update), wrap_loss=wrap_loss)
    tx = fx.chain(unscale, fx.scale(-0.1))
    params = {"w": torch.tensor([1.0, 2.0])}
    step = fx.train_step(lambda p, b: (p["w"] ** 2).sum(), tx)
    params, _, metrics = step(params, tx.init(params), None)
    assert seen["dtype"] == torch.float64
    assert metrics["loss"].dtype == torch.float32 and metrics["loss"].item() == 5.0
    assert params["w"].dtype == torch.float32 and params["w"].tolist() == pytest.approx([0.8, 1.6])


# --- donation ---------------------------------------------------------------------------------------

def _ptrs(t):
    return [x.data_ptr() for x in fx.tree.leaves(t) if x.numel() > 1]


@pytest.mark.parametrize("name", ["clip+scale", "adamw", "sgd-momentum"])
def test_donated_step_reuses_param_and_state_buffers(name):
    tx = STACKS[name]()
    params = _mlp_params()
    state = tx.init(params)
    ptrs = (_ptrs(params), _ptrs(state))
    step = fx.train_step(_mlp_loss, tx)
    for batch in _batches(3):
        new_params, state, _ = step(params, state, batch)
        assert fx.tree.leaves(new_params)[0] is fx.tree.leaves(params)[0]  # returned trees alias the inputs
        params = new_params
        assert (_ptrs(params), _ptrs(state)) == ptrs


@pytest.mark.parametrize("name", ["clip+scale", "adamw"])
def test_pure_step_leaves_inputs_unchanged(name):
    tx = STACKS[name]()
    params = _mlp_params()
    state = tx.init(params)
    params, state, _ = fx.train_step(_mlp_loss, tx)(params, state, _batches(1)[0])  # a non-trivial state
    before = fx.tree.clone((params, state))
    new_params, new_state, _ = fx.train_step(_mlp_loss, tx, donate=False)(params, state, _batches(1)[0])
    assert_trees_close((params, state), before, rtol=0, atol=0)
    assert not set(_ptrs(new_params)) & set(_ptrs(params))


def test_metrics_do_not_alias_donated_state():
    """Metrics from step k keep their values after step k+1 overwrites the state in place."""
    count = torch.zeros(())

    class Counting(tuple):
        def report(self):
            return {"count": count}

    def update(u, s, p=None):
        count.add_(1)  # an in-place state write, like a donated step counter
        return u, s

    tx = fx.GradientTransformation(lambda p: Counting(), update)
    step = fx.train_step(lambda p, b: p.sum(), tx)
    params, state, m1 = step(torch.ones(2), tx.init(None), None)
    _, _, m2 = step(params, state, None)
    assert (m1["count"].item(), m2["count"].item()) == (1.0, 2.0)


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_failed_step_loses_nothing(donate, where):
    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom in backward")

    def loss_fn(params, batch):
        loss = _mlp_loss(params, batch)
        if where == "forward":
            raise RuntimeError("boom in forward")
        return FailingBackward.apply(loss)

    tx = STACKS["clip+scale"]()
    params = _mlp_params()
    state = tx.init(params)
    params, state, _ = fx.train_step(_mlp_loss, tx)(params, state, _batches(1)[0])
    before = fx.tree.clone((params, state))
    with pytest.raises(RuntimeError, match=f"boom in {where}"):
        fx.train_step(loss_fn, tx, donate=donate)(params, state, _batches(1)[0])
    assert_trees_close((params, state), before, rtol=0, atol=0)
    params, state, _ = fx.train_step(_mlp_loss, tx)(params, state, _batches(1)[0])  # and training goes on


# --- trees, aux, metrics --------------------------------------------------------------------------

def test_has_aux_returns_detached_aux():
    def loss_fn(params, batch):
        loss = _mlp_loss(params, batch)
        return loss, {"logits_norm": params["l1"]["w"].norm(), "tag": "x"}

    tx = fx.scale(-0.1)
    params = _mlp_params()
    _, _, metrics = fx.train_step(loss_fn, tx, has_aux=True)(params, tx.init(params), _batches(1)[0])
    assert set(metrics) == {"loss", "aux"}
    assert metrics["aux"]["tag"] == "x" and not metrics["aux"]["logits_norm"].requires_grad
    assert metrics["aux"]["logits_norm"].item() == pytest.approx(_mlp_params()["l1"]["w"].norm().item())


def test_none_leaves_pass_through():
    params = {"w": torch.ones(2), "frozen": None, "stack": [None, torch.ones(1)]}
    seen = []

    def loss_fn(p, batch):
        seen.append((p["frozen"], p["stack"][0]))
        return p["w"].sum() + 2 * p["stack"][1].sum()

    tx = fx.chain(fx.clip_by_global_norm(100.0), fx.scale(-1.0))
    for donate in (True, False):
        out, _, _ = fx.train_step(loss_fn, tx, donate=donate)(fx.tree.clone(params), tx.init(params), None)
        assert out["frozen"] is None and out["stack"][0] is None
        assert out["w"].tolist() == [0.0, 0.0] and out["stack"][1].tolist() == [-1.0]
    assert seen == [(None, None)] * 2


def test_metrics_keys_and_shapes():
    params = _mlp_params()
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.scale(-0.1))
    _, _, metrics = fx.train_step(_mlp_loss, tx)(params, tx.init(params), _batches(1)[0])
    assert set(metrics) == {"loss", "grad_norm"}
    assert all(m.ndim == 0 and not m.requires_grad for m in metrics.values())


def test_learning_rate_is_reported_when_injected():
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.inject_hyperparams(fx.adamw)(learning_rate=3e-3))
    params = _mlp_params()
    _, _, metrics = fx.train_step(_mlp_loss, tx)(params, tx.init(params), _batches(1)[0])
    assert {"loss", "grad_norm", "learning_rate"} <= set(metrics)
    assert metrics["learning_rate"].item() == pytest.approx(3e-3)


def test_parameters_requiring_grad_build_no_graph():
    """nn.Parameter leaves (requires_grad=True) train without autograd history, under no_grad too."""
    params = fx.tree.map(torch.nn.Parameter, _mlp_params())
    tx = fx.scale(-0.1)
    for donate in (True, False):
        with torch.no_grad():
            out, _, metrics = fx.train_step(_mlp_loss, tx, donate=donate)(params, tx.init(params), _batches(1)[0])
        assert all(p.grad_fn is None for p in fx.tree.leaves(out)) and metrics["loss"].grad_fn is None
        assert all(p.grad is None for p in fx.tree.leaves(params))


# --- errors -----------------------------------------------------------------------------------------

def _step_with(loss_fn, has_aux=False, params=None):
    params = {"w": torch.ones(3)} if params is None else params
    return fx.train_step(loss_fn, fx.scale(-1.0), has_aux=has_aux)(params, fx.EmptyState(), None)


def vector_loss(p, b):
    return p["w"] * 2


@pytest.mark.parametrize(
    "loss_fn, has_aux, error, match",
    [
        (vector_loss, False, ValueError, r"loss_fn vector_loss must be a scalar \(0-dim\), got shape \(3,\)"),
        (lambda p, b: (p["w"].sum(), 1), False, TypeError, "returned a tuple of 2; pass has_aux=True"),
        (lambda p, b: p["w"].sum(), True, TypeError, r"must return \(loss, aux\) when has_aux=True, got a torch"),
        (lambda p, b: 1.0, False, TypeError, "must be a 0-dim tensor, got float"),
        (lambda p, b: p["w"].sum().long(), False, TypeError, "must be floating-point, got torch.int64"),
        (lambda p, b: torch.tensor(1.0), False, ValueError, "does not depend on params"),
    ],
    ids=["non-scalar", "tuple-without-aux", "aux-without-tuple", "python-float", "integer", "constant"],
)
def test_bad_loss_fn_is_named(loss_fn, has_aux, error, match):
    with pytest.raises(error, match=match):
        _step_with(loss_fn, has_aux)


def test_bad_wrap_loss_is_named():
    tx = fx.with_traits(fx.scale(1.0), wrap_loss=lambda fn, s: lambda p, b: fn(p, b)[0])
    match = r"the wrap_loss of scale\(1.0\) must return a loss function giving \(objective, \(loss, aux\)\)"
    with pytest.raises(TypeError, match=match):
        fx.train_step(lambda p, b: p.sum(), tx)(torch.ones(2), tx.init(None), None)


def test_non_float_param_leaf_is_named():
    with pytest.raises(TypeError, match="'step' is a torch.int64 tensor"):
        _step_with(lambda p, b: p["w"].sum(), params={"w": torch.ones(2), "step": torch.zeros((), dtype=torch.int64)})


# --- DTensor parameters -----------------------------------------------------------------------------

# Plain adam/adamw on DTensor leaves is sharded_apply's job (DESIGN 3.3); here: clip and elementwise SGD.
# donate=False covers the pure fx.apply_updates, which must keep each param's placements.
@pytest.mark.parametrize("name, donate", [("clip+scale", True), ("sgd-momentum", True), ("sgd-momentum", False)])
def test_dtensor_params_train_like_plain_ones(one_rank_mesh, name, donate):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    plain = _mlp_params()
    placements = {"l1": {"w": Shard(0), "b": Replicate()}, "l2": [Shard(1), Replicate()]}
    dparams = fx.tree.map(lambda p, pl: distribute_tensor(p.clone(), one_rank_mesh, [pl]), plain, placements)

    def dloss(params, batch):
        x, y = batch
        x = distribute_tensor(x, one_rank_mesh, [Replicate()])
        h = torch.tanh(F.linear(x, params["l1"]["w"], params["l1"]["b"]))
        return F.cross_entropy(F.linear(h, *params["l2"]).full_tensor(), y)

    p_plain, _, m_plain = _run(STACKS[name], donate=True, steps=3, params=plain)
    ptrs = [p.to_local().data_ptr() for p in fx.tree.leaves(dparams)]
    p_dt, s_dt, m_dt = _run(STACKS[name], donate=donate, steps=3, params=dparams, loss=dloss)
    assert ([p.to_local().data_ptr() for p in fx.tree.leaves(p_dt)] == ptrs) == donate
    assert all(isinstance(p, DTensor) for p in fx.tree.leaves(p_dt))
    assert_trees_close(p_dt, p_plain, rtol=1e-6, atol=1e-7)
    assert_trees_close(m_dt, m_plain, rtol=1e-6)
    assert fx.tree.map(lambda p: p.placements, p_dt) == fx.tree.map(lambda pl: (pl,), placements)


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda p, b: (p["a"] + p["b"]).sum(),  # autograd hands back one gradient tensor for both leaves
        lambda p, b: p["a"].sum() + 3 * p["b"].sum(),  # stride-0 expanded gradients
        lambda p, b: torch.cat([p["a"], p["b"]]).square().sum(),  # two views of one gradient buffer
    ],
    ids=["shared", "expanded", "views"],
)
def test_donated_step_copies_gradients_autograd_shares(loss_fn):
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.5, momentum=0.9))
    outs = []
    for donate in (True, False):
        params = {"a": torch.ones(3), "b": torch.full((3,), 2.0)}
        state = tx.init(params)
        step = fx.train_step(loss_fn, tx, donate=donate)
        with torch.no_grad():  # the pure step then runs the same kernels on copies: same bits
            for _ in range(3):
                params, state, _ = step(params, state, None)
        outs.append((params, state))
    assert_trees_close(outs[0], outs[1], rtol=0, atol=0)


def test_apply_updates_on_a_tree_mixing_plain_tensors_and_dtensors(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    params = {"d": distribute_tensor(torch.ones(4), one_rank_mesh, [Shard(0)]), "p": torch.ones(2)}
    updates = {"d": distribute_tensor(torch.full((4,), 0.5), one_rank_mesh, [Shard(0)]), "p": torch.full((2,), 0.5)}
    pure = fx.apply_updates(params, updates)
    assert pure["d"].placements == (Shard(0),) and pure["d"].full_tensor().tolist() == [1.5] * 4
    assert params["p"].tolist() == [1.0, 1.0]  # pure left the input alone
    fx.apply_updates_(params, updates)
    assert params["p"].tolist() == [1.5, 1.5] and params["d"].full_tensor().tolist() == [1.5] * 4


# --- issue 15, finding 12: a step that trains nothing raises ------------------------------------------

@pytest.mark.parametrize("donate", [True, False], ids=["donated", "pure"])
def test_no_param_receives_a_gradient(donate):
    # The classic slip: loss_fn calls the module (its own nn.Parameters) instead of computing with `params`.
    # The loss does require grad, so torch.autograd.grad(materialize_grads=True) would fill zeros.
    model = torch.nn.Linear(3, 1)
    params = {"weight": torch.zeros(1, 3), "bias": torch.zeros(1)}
    tx = fx.sgd(0.1)
    step = fx.train_step(lambda p, x: model(x).sum(), tx, donate=donate)
    with pytest.raises(ValueError, match=r"no gradient reaches any leaf of params.*fx.functional"):
        step(params, tx.init(params), torch.ones(2, 3))


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "pure"])
def test_params_without_a_tensor_leaf(donate):
    step = fx.train_step(lambda p, x: x.sum(), fx.identity(), donate=donate)
    with pytest.raises(ValueError, match="params hold no tensor to differentiate"):
        step({"w": None}, fx.EmptyState(), torch.ones(2, requires_grad=True))


@pytest.mark.parametrize("given", ["module", "parameters()", "named_parameters()"])
def test_init_on_a_module_points_to_functional(given):
    model = torch.nn.Linear(3, 1)
    arg = {"module": model, "parameters()": model.parameters(),
           "named_parameters()": model.named_parameters()}[given]
    for tx in (fx.adamw(1e-3), fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1)),
               fx.amp_cast(fx.sgd(0.1)), fx.apply_if_finite(fx.sgd(0.1), 2)):
        with pytest.raises(TypeError, match=r"fx.functional\(module\)"):
            tx.init(arg)
    assert fx.sgd(0.1).init(list(model.parameters())) is not None  # a list of tensors is a tree


def test_errors_give_their_reason_not_a_design_section():
    with pytest.raises(ValueError) as e:
        fx.train_step(lambda p, b: p.sum(), fx.sgd(0.1), donate=False, compile=True)
    assert "DESIGN" not in str(e.value) and "allocates every buffer afresh" in str(e.value)


# --- the metrics of a skipped step say what happened (issue 15, finding 10) ---------------------------------
# Issue 15, finding 10: the metrics of a skipped step say what happened.
#
# On a step skipped for a non-finite gradient (``amp_cast`` overflow, ``apply_if_finite``) ``grad_norm`` is the
# norm that was seen (inf or NaN, not the previous step's value nor the initial 0.0) and ``skipped`` is 1 (where
# the stack reports it: ``amp_cast``; ``apply_if_finite`` keeps Optax's state and reports ``total_notfinite``);
# ``apply_if_finite(amp_cast(...))`` backs the loss scale off; a skipped step leaves params bit-identical
# (``-0.0`` included). Every case runs the donated step, the pure step under ``no_grad`` (the donated kernels
# on copies) and the pure step with autograd recording (the out-of-place kernels).

INF, NAN = float("inf"), float("nan")
MODES = ["donated", "pure", "pure-no-grad"]


def _linear_loss(params, x):
    return (params["w"] * x).sum()  # gradient: x (times the loss scale under amp_cast)


def _clipped_sgd():
    return fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1))


def _amp_of(inner):
    return fx.amp_cast(inner, "p=f32,c=f16,o=f32", loss_scale=fx.DynamicLossScale(init_scale=4.0))


SKIP_STACKS = {
    "amp_cast": lambda: _amp_of(_clipped_sgd()),
    "apply_if_finite": lambda: fx.apply_if_finite(_clipped_sgd(), max_consecutive_errors=3),
    "apply_if_finite(amp_cast)": lambda: fx.apply_if_finite(_amp_of(_clipped_sgd()), max_consecutive_errors=3),
    "amp_cast(apply_if_finite)": lambda: _amp_of(fx.apply_if_finite(_clipped_sgd(), max_consecutive_errors=3)),
}


def _run_skips(tx, xs, mode):
    params = {"w": torch.tensor([-0.0, 1.0, -2.0])}
    state = tx.init(params)
    step = fx.train_step(_linear_loss, tx, donate=mode == "donated")
    history = []
    for x in xs:
        before = params["w"].clone()
        with torch.no_grad() if mode == "pure-no-grad" else contextlib.nullcontext():
            params, state, m = step(params, state, torch.full((3,), x))
        history.append((before, params["w"].clone(), m))
    return history, state


def _same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SKIP_STACKS))
def test_skipped_step_reports_the_norm_it_saw_and_skipped(name, mode):
    history, _ = _run_skips(SKIP_STACKS[name](), [INF, 1.0, INF, NAN, 1.0], mode)
    norms = [float(m["grad_norm"]) for _, _, m in history]
    # First step skipped: not the initial 0.0. Later ones: not the previous step's sqrt(3).
    assert norms[0] == INF and norms[2] == INF and math.isnan(norms[3]), norms
    assert norms[1] == pytest.approx(math.sqrt(3)) and norms[4] == pytest.approx(math.sqrt(3)), norms
    if name == "apply_if_finite":
        assert [int(m["total_notfinite"]) for _, _, m in history] == [1, 1, 2, 3, 3]
    else:
        assert [int(m["skipped"]) for _, _, m in history] == [1, 0, 1, 1, 0]
    for (before, after, _), skipped in zip(history, [1, 0, 1, 1, 0]):
        assert _same_bits(before, after) == bool(skipped)


@pytest.mark.parametrize("mode", MODES)
def test_apply_if_finite_around_amp_cast_backs_the_scale_off(mode):
    history, state = _run_skips(SKIP_STACKS["apply_if_finite(amp_cast)"](), [1.0, INF, 1.0, NAN, NAN], mode)
    assert [float(m["loss_scale"]) for _, _, m in history] == [4.0, 2.0, 2.0, 1.0, 0.5]
    assert [int(m["skipped"]) for _, _, m in history] == [0, 1, 0, 1, 1]
    assert int(state.total_notfinite) == 3 and int(state.notfinite_count) == 2
    assert int(state.inner_state.skipped) == 1 and float(state.inner_state.loss_scale.scale) == 0.5
    for before, after, m in history:  # skipped steps change nothing
        assert _same_bits(before, after) == bool(m["skipped"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SKIP_STACKS))
def test_negative_zero_survives_a_skipped_step(name, mode):
    history, _ = _run_skips(SKIP_STACKS[name](), [INF, NAN], mode)
    for before, after, m in history:
        assert int(m.get("skipped", 1)) == 1
        assert _same_bits(after, before), (before, after)
        assert torch.signbit(after[0])  # -0.0, not +0.0


def test_accepted_non_finite_update_after_too_many_errors_is_not_skipped():
    tx = fx.apply_if_finite(_clipped_sgd(), max_consecutive_errors=1)
    history, _ = _run_skips(tx, [INF, INF], "donated")
    assert [float(m["grad_norm"]) for _, _, m in history] == [INF, INF]
    assert _same_bits(history[0][0], history[0][1]) and not history[1][1].isfinite().any()  # 2nd applied (Optax)


@pytest.mark.parametrize("mode", MODES)
def test_inner_without_grad_norm_reports_none(mode):
    # Nothing in the stack computes a norm: no grad_norm metric appears (no extra pass over the gradients).
    for tx in (fx.amp_cast(fx.sgd(0.1), "p=f32,c=f16,o=f32"), fx.apply_if_finite(fx.sgd(0.1), 2)):
        history, _ = _run_skips(tx, [INF, 1.0], mode)
        assert "grad_norm" not in history[0][2] and _same_bits(history[0][0], history[0][1])
