"""Per-example gradients and clipping (fxtrain/per_example.py, fxtrain/transforms/_per_example.py).

References: a Python loop over examples (autograd on batches of one) and Optax's
``per_example_global_norm_clip`` itself.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fxtrain as fx
from fxtrain.testing import assert_trees_close
from fxtrain.transforms._per_example import clip_sum

B = 6


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"l1": {"w": torch.randn(8, 5, generator=g) / 3, "b": torch.zeros(8)},
            "l2": [torch.randn(3, 8, generator=g) / 3, torch.zeros(3)]}


def _loss(params, batch):
    x, y = batch
    h = torch.tanh(F.linear(x, params["l1"]["w"], params["l1"]["b"]))
    return F.cross_entropy(F.linear(h, *params["l2"]), y)


def _batch(n=B, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loop_grads(loss_fn, params, batch):
    """One autograd call per example, on a batch of one; stacked."""
    leaves, spec = fx.tree.flatten(params)
    out = []
    for i in range(batch[0].shape[0]):
        xs = [p.detach().requires_grad_() for p in leaves]
        example = tuple(t[i:i + 1] for t in batch)
        out.append(torch.autograd.grad(loss_fn(fx.tree.unflatten(spec, xs), example), xs))
    return fx.tree.unflatten(spec, [torch.stack(gs) for gs in zip(*out)])


# --- per_example_grads ----------------------------------------------------------------------------

def test_per_example_grads_equal_a_loop_over_examples():
    params, batch = _params(), _batch()
    grads = fx.per_example_grads(_loss)(params, batch)
    assert_trees_close(grads, _loop_grads(_loss, params, batch), rtol=1e-5, atol=1e-7)
    assert fx.tree.map(lambda g: g.shape[0], grads) == fx.tree.map(lambda p: B, params)
    # Their mean is the batch gradient of a mean-reduced loss.
    batch_grads = torch.func.grad(_loss)(params, batch)
    assert_trees_close(fx.tree.map(lambda g: g.mean(0), grads), batch_grads, rtol=1e-5, atol=1e-7)


def test_per_example_grads_with_aux_dict_batch_none_and_unused_leaves():
    def loss_fn(params, batch):
        loss = (params["w"] * batch["x"]).sum() * batch["scale"]
        return loss, {"loss": loss.detach()}

    params = {"w": torch.ones(2), "frozen": None, "unused": torch.ones(3)}
    batch = {"x": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), "scale": 2.0}  # a non-tensor leaf
    grads, aux = fx.per_example_grads(loss_fn, has_aux=True)(params, batch)
    assert grads["frozen"] is None
    assert grads["w"].tolist() == [[2.0, 4.0], [6.0, 8.0], [10.0, 12.0]]
    assert grads["unused"].tolist() == [[0.0] * 3] * 3
    assert aux["loss"].tolist() == [6.0, 14.0, 22.0]


def test_per_example_grads_under_vmap_of_an_ensemble():
    params = fx.tree.map(lambda *xs: torch.stack(xs), _params(0), _params(1))
    batch = _batch()
    grads = torch.func.vmap(fx.per_example_grads(_loss), in_dims=(0, None))(params, batch)
    for i in range(2):
        assert_trees_close(fx.tree.map(lambda g: g[i], grads), _loop_grads(_loss, _params(i), batch),
                           rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("batch, match", [
    ((torch.ones(3, 2), torch.ones(4)), r"differ in length along dim 0: '0' has 3, '1' has 4"),
    ((torch.ones(3, 2), torch.tensor(1.0)), r"batch leaf '1' is 0-dim"),
    ({"a": 1.0}, "no tensor leaf"),
], ids=["lengths", "scalar-leaf", "no-tensor"])
def test_per_example_grads_bad_batch_is_named(batch, match):
    with pytest.raises(ValueError, match=match):
        fx.per_example_grads(lambda p, b: p.sum())(torch.ones(2), batch)


def test_per_example_grads_non_scalar_loss_is_named():
    def vector_loss(p, b):
        return p * b.sum()

    with pytest.raises(ValueError, match="loss_fn .*vector_loss must return a 0-dim floating-point tensor"):
        fx.per_example_grads(vector_loss)(torch.ones(2), torch.ones(3, 2))


# --- per_example_global_norm_clip -----------------------------------------------------------------

def _per_example_tree(seed=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tree = {"a": torch.randn(B, 4, 3, generator=g), "b": [torch.randn(B, generator=g), torch.randn(B, 2, generator=g)]}
    tree["a"][1] = 0.0  # example 1: a zero gradient in one leaf...
    tree["b"][0][1] = 0.0
    tree["b"][1][1] = 0.0  # ...and in all: its norm is 0
    return fx.tree.map(lambda x: (x * 3).to(dtype), tree)


@pytest.mark.optax
@pytest.mark.parametrize("clip", [0.0, 0.5, 3.0, 1e9, float("inf")])
def test_per_example_global_norm_clip_matches_optax(clip):
    optax = pytest.importorskip("optax")
    jnp = pytest.importorskip("jax.numpy")
    grads = _per_example_tree()
    tx = fx.per_example_global_norm_clip(clip)
    updates, state = tx.update(grads, tx.init(None))
    leaves = fx.tree.leaves(grads)
    expected, expected_n = optax.per_example_global_norm_clip([jnp.asarray(x.numpy()) for x in leaves], clip)
    assert_trees_close(fx.tree.leaves(updates), [np.asarray(e) for e in expected], rtol=1e-6, atol=1e-6)
    assert state == fx.EmptyState()
    summed, n = clip_sum(leaves, clip)
    assert int(n) == int(expected_n)
    assert_trees_close(summed, fx.tree.leaves(updates), rtol=0, atol=0)


@pytest.mark.parametrize("clip", [0.5, 3.0])
def test_per_example_global_norm_clip_equals_a_loop_and_has_the_bound(clip):
    grads = _per_example_tree()
    updates, _ = fx.per_example_global_norm_clip(clip).update(grads, fx.EmptyState())
    total = fx.tree.map(torch.zeros_like, fx.tree.map(lambda x: x[0], grads))
    for i in range(B):
        example = fx.tree.map(lambda x: x[i].double(), grads)
        norm = fx.tree.norm(example)
        clipped = fx.tree.map(lambda x: x * min(1.0, clip / norm.item()) if norm > 0 else x, example)
        assert fx.tree.norm(clipped) <= clip * (1 + 1e-6)
        total = fx.tree.map(lambda t, c: t + c, total, clipped)
    assert_trees_close(updates, total, rtol=1e-6, atol=1e-6)


def test_per_example_global_norm_clip_donated_equals_pure_and_keeps_dtype_and_none():
    grads = {**_per_example_tree(dtype=torch.bfloat16), "frozen": None}
    tx = fx.chain(fx.per_example_global_norm_clip(1.0), fx.sgd(0.1, momentum=0.9))
    params = fx.tree.map(lambda x: x[0], grads)
    state = tx.init(params)
    with torch.no_grad():
        pure, pure_state = tx.update(grads, state, params)
    donated, donated_state = fx.update_(tx, fx.tree.clone(grads), fx.tree.clone(state), params)
    assert_trees_close((donated, donated_state), (pure, pure_state), rtol=0, atol=0)
    composable, _ = tx.update(grads, state, params)
    assert_trees_close(composable, pure, rtol=1e-2, atol=1e-2)  # bfloat16 rounding of the momentum ops
    assert pure["frozen"] is None
    assert fx.tree.map(lambda u: (u.dtype, u.shape), pure) == fx.tree.map(lambda p: (p.dtype, p.shape), params)


def test_per_example_global_norm_clip_is_differentiable_and_batchable():
    grads = _per_example_tree()

    def total(clip, g):
        updates, _ = fx.per_example_global_norm_clip(clip).update(g, fx.EmptyState())
        return sum(u.sum() for u in fx.tree.leaves(updates))

    clip = torch.tensor(0.5)
    d_clip, d_grads = torch.func.grad(total, argnums=(0, 1))(clip, grads)
    eps = 1e-3
    fd = (total(clip + eps, grads) - total(clip - eps, grads)) / (2 * eps)
    assert d_clip.item() == pytest.approx(fd.item(), rel=1e-3)
    assert all(torch.isfinite(x).all() for x in fx.tree.leaves(d_grads))  # the zero example included
    # vmap over clip values: N settings in one call.
    clips = torch.tensor([0.1, 0.5, 2.0])
    batched = torch.func.vmap(total, in_dims=(0, None))(clips, grads)
    assert_trees_close(batched, torch.stack([total(c, grads) for c in clips]), rtol=1e-6)


def test_per_example_global_norm_clip_traits_and_repr():
    tx = fx.per_example_global_norm_clip(1.0)
    assert repr(tx) == "per_example_global_norm_clip(1.0)"
    assert not fx.traits(tx).elementwise
    assert repr(fx.chain(tx, fx.scale(-0.1))) == "chain(per_example_global_norm_clip(1.0), scale(-0.1))"


@pytest.mark.parametrize("grads, match", [
    ({"a": torch.ones(3, 2), "b": torch.ones(4)}, r"'b' has 4 examples on axis 0, 'a' has 3"),
    ({"a": torch.ones(3, 2), "b": torch.tensor(1.0)}, r"'b' has no batch axis"),
], ids=["lengths", "scalar"])
def test_per_example_global_norm_clip_bad_updates_are_named(grads, match):
    tx = fx.per_example_global_norm_clip(1.0)
    with pytest.raises(ValueError, match=r"per_example_global_norm_clip.*per-example gradients.*" + match):
        tx.update(grads, tx.init(None))


def test_negative_clip_is_refused():
    with pytest.raises(ValueError, match="per_example_global_norm_clip: l2_norm_clip=-1.0 must be >= 0"):
        fx.per_example_global_norm_clip(-1.0)


# --- a DP-style step, composed by hand ------------------------------------------------------------

def test_clipped_mean_step_composed_by_hand_equals_a_loop():
    params, batch = _params(), _batch()
    clip, lr = 0.5, 0.1
    tx = fx.chain(fx.per_example_global_norm_clip(clip), fx.scale(1.0 / B), fx.sgd(lr))
    grads = fx.per_example_grads(_loss)(params, batch)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = fx.apply_updates(params, updates)

    per = _loop_grads(_loss, params, batch)
    norms = torch.stack([fx.tree.norm(fx.tree.map(lambda g: g[i], per)) for i in range(B)])
    coef = torch.clamp(clip / norms, max=1.0)
    expected = fx.tree.map(lambda p, g: p - lr * torch.tensordot(coef, g, dims=1) / B, params, per)
    assert_trees_close(new, expected, rtol=1e-5, atol=1e-7)
