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
