"""train_step(donate=False) under torch.func (fxtrain/step.py): ensembles with vmap, gradients through steps.

References: N separate steps (vmap), a hand-written Adam in plain torch and Optax under ``jax.grad``
(gradients through steps), closed forms (hypergradients of SGD). The docs' "Composing with
torch.func" examples (docs/functional-step.md) run here as written (tests named ``test_readme_*``).
"""

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain.testing import assert_trees_close

N = 4  # models in an ensemble


def _loss(params, batch):
    x, y = batch
    return ((torch.tanh(x @ params["w"]) @ params["v"] + params["b"] - y) ** 2).mean()


def _params(n=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = () if n is None else (n,)
    return {"w": torch.randn(*lead, 3, 5, generator=g) / 2, "v": torch.randn(*lead, 5, generator=g) / 2,
            "b": torch.zeros(lead)}


def _batches(steps, lead=(), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*lead, 16, 3, generator=g), torch.randn(*lead, 16, generator=g)) for _ in range(steps)]


def _model(tree, i):
    return fx.tree.map(lambda x: x[i], tree)


def _stacked(trees):
    return fx.tree.map(lambda *xs: torch.stack(xs), *trees)


# --- vmap: an ensemble in one call ------------------------------------------------------------------

@pytest.mark.parametrize("batch_dim", [None, 0], ids=["shared-batch", "batch-per-model"])
def test_vmapped_step_equals_separate_steps(batch_dim):
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-2))
    step = fx.train_step(_loss, tx, donate=False)
    vstep = torch.func.vmap(step, in_dims=(0, 0, batch_dim))
    params = _params(N)
    states = torch.func.vmap(tx.init)(params)
    batches = _batches(5, lead=() if batch_dim is None else (N,))
    singles = [(_model(params, i), tx.init(_model(params, i))) for i in range(N)]
    # The single steps run the fused kernel on copies (nothing differentiates them), the vmapped one out of
    # place: float32 rounding apart (the conformance tests' rtol between the two paths).
    for batch in batches:
        params, states, metrics = vstep(params, states, batch)
        for i, (p, s) in enumerate(singles):
            p, s, m = step(p, s, batch if batch_dim is None else _model(batch, i))
            singles[i] = (p, s)
            assert_trees_close(_model(metrics, i), m, rtol=1e-5, atol=1e-6)
    assert_trees_close(params, _stacked([p for p, _ in singles]), rtol=1e-5, atol=1e-6)
    assert_trees_close(states, _stacked([s for _, s in singles]), rtol=1e-5, atol=1e-6)
    assert set(metrics) == {"loss", "grad_norm"} and metrics["loss"].shape == (N,)


def test_vmapped_learning_rates_through_inject_hyperparams():
    """N hyperparameter settings in one call: the learning rate is batched in the state."""
    lrs = torch.tensor([0.01, 0.03, 0.1, 0.3])
    make = fx.inject_hyperparams(fx.sgd)
    params = _params()  # one initialisation, shared: in_dims=None for params on the first step
    states = torch.func.vmap(lambda lr: make(learning_rate=lr, momentum=0.9).init(params))(lrs)
    tx = make(learning_rate=0.1, momentum=0.9)  # the structure; the values come from the state
    vstep = torch.func.vmap(fx.train_step(_loss, tx, donate=False), in_dims=(0, 0, None))
    vparams = _stacked([params] * N)
    refs = []
    for lr in lrs.tolist():
        ref_tx = fx.sgd(lr, momentum=0.9)
        refs.append((fx.train_step(_loss, ref_tx, donate=False), params, ref_tx.init(params)))
    for batch in _batches(5):
        vparams, states, metrics = vstep(vparams, states, batch)
        for i, (ref_step, p, s) in enumerate(refs):
            p, s, m = ref_step(p, s, batch)
            refs[i] = (ref_step, p, s)
            assert metrics["loss"][i].item() == pytest.approx(m["loss"].item(), rel=1e-6)
    assert_trees_close(vparams, _stacked([p for _, p, _ in refs]), rtol=1e-6, atol=1e-6)
    assert_trees_close(metrics["learning_rate"], lrs, rtol=0, atol=0)


def test_vmapped_step_with_has_aux():
    def loss_fn(params, batch):
        return _loss(params, batch), {"w_norm": params["w"].norm()}  # vmap returns tensors only

    tx = fx.adam(1e-2)
    params = _params(N)
    states = torch.func.vmap(tx.init)(params)
    _, _, metrics = torch.func.vmap(fx.train_step(loss_fn, tx, has_aux=True, donate=False),
                                    in_dims=(0, 0, None))(params, states, _batches(1)[0])
    assert metrics["aux"]["w_norm"].shape == (N,) and not metrics["aux"]["w_norm"].requires_grad


# --- gradients through steps ---------------------------------------------------------------------

def _adam_reference(params, batches, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    """Adam written out in plain torch, differentiable (create_graph): the loss after the steps.

    Bias corrections ``1 - b ** t`` as Optax and fxtrain compute them: a Python float to the power of an
    integer tensor, a float32 result. Rounded otherwise (float64, or ``float32(b) ** t``) they differ by
    ~1e-5 relative for b2=0.999 (cancellation), which the gradient through three steps shows.
    """
    names = sorted(params)
    ps = [params[k] for k in names]
    mu = [torch.zeros_like(p) for p in ps]
    nu = [torch.zeros_like(p) for p in ps]
    for t, batch in enumerate(batches[:-1], start=1):
        gs = torch.autograd.grad(_loss(dict(zip(names, ps)), batch), ps, create_graph=True)
        mu = [b1 * m + (1 - b1) * g for m, g in zip(mu, gs)]
        nu = [b2 * v + (1 - b2) * g * g for v, g in zip(nu, gs)]
        bc1, bc2 = (1 - b ** torch.tensor(t) for b in (b1, b2))
        ps = [p - lr * (m / bc1) / ((v / bc2).sqrt() + eps) for p, m, v in zip(ps, mu, nu)]
    return _loss(dict(zip(names, ps)), batches[-1])


def _meta_loss(tx, batches):
    """The loss on the last batch after one pure step per other batch: a function of the initial params."""
    step = fx.train_step(_loss, tx, donate=False)

    def fn(params):
        state = tx.init(params)
        for batch in batches[:-1]:
            params, state, metrics = step(params, state, batch)
            assert not metrics["loss"].requires_grad  # the reported loss is detached, the params are not
        return _loss(params, batches[-1])

    return fn


def test_grad_through_three_adam_steps_equals_hand_written_torch():
    batches = _batches(4)
    fn = _meta_loss(fx.adam(0.1), batches)
    params = _params()
    expected = torch.func.grad(lambda p: _adam_reference(p, batches))(params)
    assert_trees_close(torch.func.grad(fn)(params), expected, rtol=1e-5, atol=1e-6)
    # Plain autograd through the same steps gives the same gradient.
    leaves = fx.tree.map(lambda p: p.clone().requires_grad_(), params)
    fn(leaves).backward()
    assert_trees_close(fx.tree.map(lambda p: p.grad, leaves), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.optax
def test_grad_through_three_adam_steps_equals_optax_under_jax_grad():
    jax = pytest.importorskip("jax")
    jnp, optax = jax.numpy, pytest.importorskip("optax")
    batches = _batches(4)
    params = _params()

    def jloss(p, batch):
        x, y = batch
        return ((jnp.tanh(x @ p["w"]) @ p["v"] + p["b"] - y) ** 2).mean()

    jbatches = [tuple(jnp.asarray(t.numpy()) for t in b) for b in batches]

    def jmeta(p):
        opt = optax.adam(0.1)
        state = opt.init(p)
        for batch in jbatches[:-1]:
            g = jax.grad(jloss)(p, batch)
            u, state = opt.update(g, state, p)
            p = optax.apply_updates(p, u)
        return jloss(p, jbatches[-1])

    expected = jax.grad(jmeta)({k: jnp.asarray(v.numpy()) for k, v in params.items()})
    actual = torch.func.grad(_meta_loss(fx.adam(0.1), batches))(params)
    assert_trees_close(actual, {k: np.asarray(v) for k, v in expected.items()}, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["torch.func.grad", "autograd"])
def test_hypergradient_of_sgd_learning_rate_closed_form(how):
    """The issue's example: loss after one sgd(lr, momentum=0.9) step of sum(w^2) from w=ones(3)."""
    w = torch.ones(3)

    def loss_after(lr):
        tx = fx.sgd(lr, momentum=0.9)
        params, _, _ = fx.train_step(lambda p, b: (p ** 2).sum(), tx, donate=False)(w, tx.init(w), None)
        return (params ** 2).sum()

    lr = torch.tensor(0.1)
    if how == "torch.func.grad":
        g = torch.func.grad(loss_after)(lr)
    else:
        lr.requires_grad_()
        loss_after(lr).backward()
        g = lr.grad
    assert g.item() == pytest.approx(-12 * (1 - 2 * 0.1), rel=1e-6)  # d/dlr 3 (1 - 2 lr)^2 = -9.6


def test_hypergradient_through_inject_hyperparams_state():
    """Meta-learning a learning rate kept in the state: grad w.r.t. state.hyperparams over 3 steps."""
    batches = _batches(4)
    tx = fx.inject_hyperparams(fx.sgd)(learning_rate=0.1)
    step = fx.train_step(_loss, tx, donate=False)

    def loss_after(lr):
        params = _params()
        state = tx.init(params)
        state = state._replace(hyperparams={**state.hyperparams, "learning_rate": lr})
        for batch in batches[:-1]:
            params, state, _ = step(params, state, batch)
        return _loss(params, batches[-1])

    eps = 1e-3
    g = torch.func.grad(loss_after)(torch.tensor(0.1, dtype=torch.float64).float())
    with torch.no_grad():
        fd = (loss_after(torch.tensor(0.1 + eps)) - loss_after(torch.tensor(0.1 - eps))) / (2 * eps)
    assert g.item() == pytest.approx(fd.item(), rel=1e-2)
    assert g.item() != 0.0


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func.jvp's import
def test_jvp_and_jacrev_of_a_step_agree():
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1, momentum=0.9))
    step = fx.train_step(_loss, tx, donate=False)
    batch = _batches(1)[0]
    params = _params()

    def new_w(w):
        p = {**params, "w": w}
        out, _, _ = step(p, tx.init(p), batch)
        return out["w"]

    tangent = torch.randn_like(params["w"])
    _, jvp = torch.func.jvp(new_w, (params["w"],), (tangent,))
    jac = torch.func.jacrev(new_w)(params["w"])
    assert_trees_close(jvp, torch.einsum("ijkl,kl->ij", jac, tangent), rtol=1e-5, atol=1e-6)


def test_grad_of_vmapped_ensemble_loss():
    """vmap inside grad: the mean loss of an ensemble after one step, differentiated w.r.t. all params."""
    tx = fx.adam(1e-2)
    step = fx.train_step(_loss, tx, donate=False)
    batch, after = _batches(2)

    def ensemble_loss(params):
        states = torch.func.vmap(tx.init)(params)
        params, _, _ = torch.func.vmap(step, in_dims=(0, 0, None))(params, states, batch)
        return torch.func.vmap(_loss, in_dims=(0, None))(params, after).sum()

    params = _params(N)
    g = torch.func.grad(ensemble_loss)(params)
    for i in range(N):
        def single(p):
            p, _, _ = step(p, tx.init(p), batch)
            return _loss(p, after)
        assert_trees_close(_model(g, i), torch.func.grad(single)(_model(params, i)), rtol=1e-5, atol=1e-6)


def test_autograd_through_pure_steps_on_dtensor_params(one_rank_mesh):
    """DTensor params take torch.autograd.grad with create_graph: the gradient through two steps equals
    the plain-tensor one (torch.func.grad does not run on DTensors)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # Not clip_by_global_norm: its norm over DTensors runs collectives outside autograd and says so.
    tx = fx.chain(fx.add_decayed_weights(1e-2), fx.sgd(0.1, momentum=0.9))
    batches = _batches(3)
    placements = {"w": Shard(1), "v": Shard(0), "b": Replicate()}

    def meta(params, loss):
        step = fx.train_step(loss, tx, donate=False)
        state = tx.init(params)
        for batch in batches[:-1]:
            params, state, _ = step(params, state, batch)
        return loss(params, batches[-1]), params

    def dloss(params, batch):
        x, y = (distribute_tensor(t, one_rank_mesh, [Replicate()]) for t in batch)
        return ((torch.tanh(x @ params["w"]) @ params["v"] + params["b"] - y) ** 2).mean().full_tensor()

    plain = fx.tree.map(lambda p: p.clone().requires_grad_(), _params())
    loss, _ = meta(plain, _loss)
    loss.backward()
    dparams = fx.tree.map(lambda p, pl: distribute_tensor(p.clone(), one_rank_mesh, [pl]).requires_grad_(),
                          _params(), placements)
    dloss_value, trained = meta(dparams, dloss)
    dloss_value.backward()
    assert fx.tree.map(lambda p: p.placements, trained) == fx.tree.map(lambda pl: (pl,), placements)
    assert dloss_value.item() == pytest.approx(loss.item(), rel=1e-6)
    for k in plain:
        assert_trees_close(dparams[k].grad, plain[k].grad, rtol=1e-5, atol=1e-6)


# --- what cannot compose raises -------------------------------------------------------------------

@pytest.mark.parametrize("options, name", [({}, "donate=True"), ({"compile": True}, "compile=True")])
def test_donated_or_compiled_step_under_vmap_is_refused(options, name):
    tx = fx.adam(1e-2)
    params = _params(N)
    step = fx.train_step(_loss, tx, **options)
    with pytest.raises(ValueError, match=rf"train_step\({name}\) updates its params and state in place.*"
                                         r"donate=False.*adam\(0.01\)"):
        torch.func.vmap(step, in_dims=(0, 0, None))(params, torch.func.vmap(tx.init)(params), _batches(1)[0])


def test_donated_step_under_grad_is_refused():
    tx = fx.sgd(0.1)
    step = fx.train_step(_loss, tx)
    batch = _batches(1)[0]
    with pytest.raises(ValueError, match=r"train_step\(donate=True\).*donate=False"):
        torch.func.grad(lambda p: _loss(step(p, tx.init(p), batch)[0], batch))(_params())


def test_donated_step_refuses_params_autograd_is_tracking():
    """Writing in place into a tensor with history would silently detach the gradient: an error instead."""
    tx = fx.sgd(0.1)
    w0 = _params()["w"].requires_grad_()
    params = {**_params(), "w": w0 * 1.0}
    with pytest.raises(ValueError, match=r"autograd is tracking.*donate=False"):
        fx.train_step(_loss, tx)(params, tx.init(params), _batches(1)[0])


def test_pure_step_under_no_grad_gives_no_graph_but_the_same_numbers():
    tx = fx.adam(1e-2)
    params = fx.tree.map(lambda p: p.requires_grad_(), _params())
    step = fx.train_step(_loss, tx, donate=False)
    batch = _batches(1)[0]
    recorded, _, _ = step(params, tx.init(params), batch)
    assert all(p.requires_grad for p in fx.tree.leaves(recorded))
    with torch.no_grad():
        plain, _, _ = step(params, tx.init(params), batch)
    assert not any(p.requires_grad for p in fx.tree.leaves(plain))
    assert_trees_close(plain, recorded, rtol=1e-5, atol=1e-6)


# --- docs/functional-step.md's "Composing with torch.func" examples, as written (each prints what it shows) -

def test_readme_ensemble(capsys):
    def loss_fn(params, batch):
        x, y = batch
        return ((torch.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2).mean()

    x, y = torch.randn(256, 8), torch.randn(256, 1)
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-2))
    step = torch.func.vmap(fx.train_step(loss_fn, tx, donate=False), in_dims=(0, 0, None))

    n = 8  # eight models, one call per step
    params = {"w1": torch.randn(n, 8, 32) / 8 ** 0.5, "w2": torch.randn(n, 32, 1) / 32 ** 0.5}
    opt_state = torch.func.vmap(tx.init)(params)
    for i in range(50):
        params, opt_state, metrics = step(params, opt_state, (x, y))
    print(metrics["loss"].shape, metrics["grad_norm"].shape)  # torch.Size([8]) torch.Size([8]): one per model

    assert metrics["loss"].shape == (8,) and params["w1"].shape == (8, 8, 32)
    assert len(set(metrics["loss"].tolist())) == 8  # eight different models
    assert capsys.readouterr().out


def test_readme_learning_rates(capsys):
    def loss_fn(params, batch):
        x, y = batch
        return ((x @ params["w"] - y) ** 2).mean()

    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(256, 1)
    lrs = torch.tensor([1e-3, 1e-2, 3e-2, 1e-1])
    make = fx.inject_hyperparams(fx.sgd)
    params = {"w": torch.zeros(len(lrs), 8, 1)}
    opt_state = torch.func.vmap(lambda p, lr: make(learning_rate=lr, momentum=0.9).init(p))(params, lrs)
    tx = make(learning_rate=0.0, momentum=0.9)  # the structure; the values come from the state
    step = torch.func.vmap(fx.train_step(loss_fn, tx, donate=False), in_dims=(0, 0, None))
    for i in range(50):
        params, opt_state, metrics = step(params, opt_state, (x, y))
    print(metrics["learning_rate"], metrics["loss"])  # the loss after 50 steps, per learning rate

    assert_trees_close(metrics["learning_rate"], lrs, rtol=0, atol=0)
    assert metrics["loss"][0] > 10 * metrics["loss"][2]  # lr=1e-3 has not converged in 50 steps
    assert capsys.readouterr().out


def test_readme_hypergradient(capsys):
    def loss_fn(params, batch):
        x, y = batch
        return ((x @ params["w"] - y) ** 2).mean()

    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(8, 1, generator=g)
    x_train, x_val = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    train, val = (x_train, x_train @ w_true), (x_val, x_val @ w_true)

    def val_loss_after_steps(lr, params):
        tx = fx.sgd(lr, momentum=0.9)               # lr is a tensor: the update is differentiable in it
        step = fx.train_step(loss_fn, tx, donate=False)
        opt_state = tx.init(params)
        for _ in range(5):
            params, opt_state, _ = step(params, opt_state, train)
        return loss_fn(params, val)

    params = {"w": torch.zeros(8, 1)}
    lr = torch.tensor(0.01)
    print(float(val_loss_after_steps(lr, params)))  # 7.91
    for _ in range(10):  # hypergradient descent on the learning rate
        d_lr = torch.func.grad(val_loss_after_steps)(lr, params)
        lr = lr - 1e-4 * d_lr
    print(float(lr), float(val_loss_after_steps(lr, params)))  # 0.052 0.418: a larger lr, a lower loss

    # MAML-style: the gradient with respect to the initial params, through the same five steps.
    d_params = torch.func.grad(val_loss_after_steps, argnums=1)(lr, params)
    print(d_params["w"].shape)

    assert float(lr) == pytest.approx(0.052, abs=2e-3)
    assert float(val_loss_after_steps(lr, params)) < 0.1 * float(val_loss_after_steps(torch.tensor(0.01), params))
    assert torch.isfinite(d_params["w"]).all() and d_params["w"].abs().sum() > 0
    assert capsys.readouterr().out


def test_readme_per_example_clipping(capsys):
    def loss_fn(params, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(x @ params["w"] + params["b"], y)

    x, y = torch.randn(32, 10), torch.randint(0, 3, (32,))
    params = {"w": torch.zeros(10, 3), "b": torch.zeros(3)}
    grads_fn = fx.per_example_grads(loss_fn)
    tx = fx.chain(fx.per_example_global_norm_clip(1.0), fx.scale(1 / len(x)), fx.sgd(0.5))
    opt_state = tx.init(params)

    for i in range(20):
        grads = grads_fn(params, (x, y))                 # {"w": [32, 10, 3], "b": [32, 3]}
        updates, opt_state = tx.update(grads, opt_state, params)
        params = fx.apply_updates(params, updates)
    print(grads["w"].shape, float(loss_fn(params, (x, y))))

    assert grads["w"].shape == (32, 10, 3) and grads["b"].shape == (32, 3)
    assert float(loss_fn(params, (x, y))) < float(torch.log(torch.tensor(3.0)))  # below the loss at zero params
    assert capsys.readouterr().out
