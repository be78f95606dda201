"""Tests for fxtrain/tree.py: paths, alignment with None leaves, batched math."""

import math

import pytest
import torch

from fxtrain import tree


def test_paths_and_flatten_keep_none():
    t = {"b": None, "a": [torch.ones(1), (torch.zeros(2),)]}
    leaves, spec = tree.flatten(t)
    assert tree.paths(t) == ["a.0", "a.1.0", "b"]
    assert leaves[2] is None
    assert tree.unflatten(spec, leaves)["b"] is None
    assert len(tree.leaves(t)) == 2


def test_map_passes_none_through_and_checks_structure():
    out = tree.map(lambda x, y: x + y, {"a": torch.ones(1), "b": None}, {"a": torch.ones(1), "b": torch.ones(3)})
    assert out["b"] is None and out["a"].item() == 2.0
    with pytest.raises(ValueError, match="differ at 'a.1'"):
        tree.map(lambda x, y: x, {"a": [torch.ones(1)]}, {"a": [torch.ones(1), torch.ones(1)]})


def test_align_drops_none_positions_and_names_mismatch():
    g = {"w": torch.ones(2), "frozen": None, "b": torch.ones(1)}
    mu = {"w": torch.zeros(2), "frozen": torch.zeros(5), "b": torch.zeros(1)}
    gs, mus = tree.align(g, mu)
    assert [x.numel() for x in gs] == [1, 2] and [x.numel() for x in mus] == [1, 2]
    with pytest.raises(ValueError, match="differ at 'extra'"):
        tree.align(g, {**mu, "extra": torch.zeros(1)})


def test_first_mismatch():
    assert tree.first_mismatch({"a": 1}, {"a": 2}) is None
    assert tree.first_mismatch({"x": {"y": 1}}, {"x": {"z": 1}}) == "x.y"
    assert tree.first_mismatch([1, [2, 3]], [1, [2]]) == "1.1"
    assert tree.first_mismatch({"x": [1]}, {"x": (1,)}) == "x"


def test_sum_sq_norm_accumulate_bf16_in_float32():
    xs = [torch.full((1000,), 0.1, dtype=torch.bfloat16), torch.ones(3)]
    expected = 1000 * float(torch.tensor(0.1, dtype=torch.bfloat16)) ** 2 + 3
    assert tree.sum_sq(xs).dtype == torch.float32
    assert math.isclose(float(tree.sum_sq(xs)), expected, rel_tol=1e-6)
    assert float(tree.norm({"a": None, "b": torch.tensor([3.0, 4.0])})) == 5.0
    assert float(tree.sum_sq([])) == 0.0


def test_all_finite_does_not_overflow_and_sees_nan():
    assert bool(tree.all_finite([torch.tensor([3e38, 3e38])]))
    assert not bool(tree.all_finite([torch.ones(2), torch.tensor([float("nan")])]))
    assert not bool(tree.all_finite([torch.tensor([float("-inf")])]))


def test_where_cast_zeros_clone():
    a, b = {"x": torch.ones(2), "n": None}, {"x": torch.zeros(2), "n": None}
    assert tree.where(torch.tensor(False), a, b)["x"].sum() == 0
    c = tree.cast({"f": torch.ones(1), "i": torch.ones(1, dtype=torch.int64)}, torch.bfloat16)
    assert c["f"].dtype == torch.bfloat16 and c["i"].dtype == torch.int64
    z = tree.zeros_like(a, dtype=torch.float64)
    assert z["x"].dtype == torch.float64 and z["n"] is None
    k = tree.clone(a)
    assert k["x"] is not a["x"] and torch.equal(k["x"], a["x"])


def test_add_and_scale_in_place():
    xs, ys = [torch.ones(2)], [torch.ones(2)]
    tree.add_(xs, ys, alpha=2.0)
    tree.scale_(xs, torch.tensor(0.5))
    assert xs[0].tolist() == [1.5, 1.5]


def test_where_and_zero_where_in_place_keep_inf_out_of_nan():
    new, out = [torch.tensor([1.0, float("inf")])], [torch.tensor([5.0, 6.0])]
    tree.where_(torch.tensor(False), new, out)
    assert out[0].tolist() == [5.0, 6.0]
    tree.where_(torch.tensor(True), new, out)
    assert out[0].tolist() == [1.0, float("inf")]
    xs = [torch.tensor([float("nan"), 2.0])]
    tree.zero_where_(torch.tensor(True), xs)
    assert xs[0].tolist() == [0.0, 0.0]


# --- the op layer: one definition, in place when donated, out of place when composable ---------------

import pytest  # noqa: E402
from torch.func import grad, vmap  # noqa: E402

_S = torch.tensor(0.3)
# name -> (op, extra args builder); every op of the layer that takes lists
OPS = {
    "scale_": lambda xs, ys, zs: tree.scale_(xs, 0.7),
    "scale_tensor": lambda xs, ys, zs: tree.scale_(xs, _S),
    "div_": lambda xs, ys, zs: tree.div_(xs, zs),
    "div_tensor": lambda xs, ys, zs: tree.div_(xs, _S),
    "add_": lambda xs, ys, zs: tree.add_(xs, ys, 0.5),
    "add_tensor_alpha": lambda xs, ys, zs: tree.add_(xs, ys, _S),
    "add_scalar": lambda xs, ys, zs: tree.add_(xs, 0.25),
    "lerp_": lambda xs, ys, zs: tree.lerp_(xs, ys, 0.1),
    "lerp_tensor": lambda xs, ys, zs: tree.lerp_(xs, ys, _S),
    "addcmul_": lambda xs, ys, zs: tree.addcmul_(xs, ys, zs, 0.5),
    "addcmul_tensor": lambda xs, ys, zs: tree.addcmul_(xs, ys, zs, _S),
    "addcdiv_": lambda xs, ys, zs: tree.addcdiv_(xs, ys, zs, 0.5),
    "sqrt_": lambda xs, ys, zs: tree.sqrt_(tree.abs_(xs)),
    "reciprocal_": lambda xs, ys, zs: tree.reciprocal_(zs),
    "sign_tanh_neg": lambda xs, ys, zs: tree.neg_(tree.tanh_(tree.sign_(xs))),
    "clamp_": lambda xs, ys, zs: tree.clamp_(xs, -0.5, _S),
    "maximum_": lambda xs, ys, zs: tree.maximum_(xs, ys),
    "copy_": lambda xs, ys, zs: tree.copy_(xs, ys),
}


def _lists():
    g = torch.Generator().manual_seed(3)
    shapes = [(3, 2), (4,), ()]
    xs, ys = [torch.randn(s, generator=g) for s in shapes], [torch.randn(s, generator=g) for s in shapes]
    zs = [torch.rand(s, generator=g) + 0.5 for s in shapes]
    return xs, ys, zs


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_in_place_and_out_of_place_agree(name):
    xs, ys, zs = _lists()
    before = [x.clone() for x in xs]
    with tree.functional():
        out = OPS[name](xs, ys, zs)
    assert all(torch.equal(x, b) for x, b in zip(xs, before)), "out of place must not write its inputs"
    inplace = OPS[name]([x.clone() for x in xs], ys, [z.clone() for z in zs])
    for a, b in zip(out, inplace):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # foreach vs per-tensor kernels


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_batches_under_vmap_like_a_loop(name):
    xs, ys, zs = _lists()
    stack = lambda ls: [torch.stack([x, 2 * x, -x]) for x in ls]  # noqa: E731

    def f(xs, ys, zs):
        with tree.functional():
            return OPS[name](xs, ys, zs)

    batched = vmap(f)(stack(xs), stack(ys), [z.expand(3, *z.shape) for z in zs])
    for k, scale in enumerate((1, 2, -1)):
        one = f([x * scale for x in xs], [y * scale for y in ys], zs)
        for b, o in zip(batched, one):
            torch.testing.assert_close(b[k], o, rtol=1e-6, atol=1e-7)


def test_tensor_scalars_are_differentiated_not_read():
    xs, ys, zs = _lists()

    def loss(s):
        with tree.functional():
            out = tree.addcmul_(tree.lerp_(tree.scale_(xs, s), ys, s), ys, zs, s)
        return sum(o.sum() for o in out)

    s = torch.tensor(0.3)
    eps = 1e-3
    fd = (loss(s + eps) - loss(s - eps)) / (2 * eps)
    torch.testing.assert_close(grad(loss)(s), fd, rtol=1e-3, atol=1e-3)
    assert grad(loss)(s).abs() > 0


def test_put_rebuilds_trees_only_out_of_place():
    t = {"a": torch.zeros(2), "b": None, "c": torch.zeros(1)}
    mask = {"a": None, "b": None, "c": 1.0}
    assert tree.put(t, mask, [torch.ones(1)]) is t  # in place: the leaves were written already
    with tree.functional():
        out = tree.put(t, mask, [torch.ones(1)])
    assert out["a"] is t["a"] and out["b"] is None and out["c"].tolist() == [1.0]


def test_functional_mode_is_scoped():
    assert not tree.is_functional()
    with tree.functional():
        assert tree.is_functional()
        with tree.functional(False):
            assert not tree.is_functional()
        assert tree.is_functional()
    assert not tree.is_functional()


def test_sum_sq_of_complex_leaves_is_the_squared_magnitude_on_both_paths():
    xs = [torch.tensor([3 + 4j]), torch.tensor([12.0])]
    assert float(tree.sum_sq(xs)) == 169.0
    with tree.functional():
        assert float(tree.sum_sq(xs)) == 169.0
