"""Tests for fxtrain/distributed/_collectives.py: match_placements and reduce_partials on gloo worlds of 2 and 4.

Every case builds the gradient from a full tensor known on every rank, moves it, and compares the moved
DTensor's local piece with the piece DTensor itself would give the param's placements (``distribute_tensor``
of the expected full value). Collectives are counted by wrapping torch.distributed's functions, so the
bucketing claims (one all-reduce per process group, one reduce-scatter per group, slices free) are checked.
"""

from __future__ import annotations

import collections
import contextlib
import sys

import pytest
import torch
import torch.distributed as dist

from tests import _worlds

CASES, case = _worlds.registry(worlds=(2, 4))
TIMEOUT_S = 240

_MESHES: dict = {}


def meshes(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    if not _MESHES:
        _MESHES["dp"] = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        _MESHES["2d"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        _MESHES["one"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rest", "one"))["one"]
    return _MESHES


def randn(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """The same tensor on every rank, in multiples of 2**-8: sums over ranks are exact in any order."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return ((x * 256).round() / 256).to(dtype)


def partial(full: torch.Tensor, mesh, placements: tuple, dim: int, op: str = "sum"):
    """A DTensor whose placement on mesh dim ``dim`` is Partial(op), summing (or averaging) to ``full``.

    Rank 0 along ``dim`` holds ``full + (n - 1) * d`` and the others ``-d`` (``d`` a fixed tensor): uneven
    pieces, so a wrong reduction cannot pass by accident, whose sum is exact in float32 in any order.
    Other dims take ``placements``."""
    from torch.distributed.tensor import DTensor, Partial

    n, r = mesh.size(dim), mesh.get_local_rank(dim)
    # bf16 has 8 bits of mantissa: there rank 0 holds the whole value (sums of zeros are exact).
    d = randn(99, *full.shape, dtype=full.dtype) * (full.dtype in (torch.float32, torch.float64))
    total = full * n if op == "avg" else full
    value = total + (n - 1) * d if r == 0 else -d
    others = list(placements)
    others[dim] = _replicate()
    places = list(placements)
    places[dim] = Partial(op)
    return DTensor.from_local(piece(value, mesh, others), mesh, places, run_check=False, shape=full.shape,
                              stride=full.stride())


def piece(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's piece of ``full`` under ``placements``, computed locally (no collective: ranks that fail
    an assertion at different leaves must not leave a collective half-called)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, list(placements))
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[index].clone()


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()


@contextlib.contextmanager
def counting():
    """Counts calls of torch.distributed's collectives made inside the block."""
    counts: collections.Counter = collections.Counter()
    names = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast")
    saved = {n: getattr(dist, n) for n in names}

    def wrap(name):
        def f(*a, **k):
            counts[name] += 1
            return saved[name](*a, **k)
        return f

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        yield counts
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def expect(moved, full, mesh, placements):
    """``moved`` holds exactly the piece of ``full`` that ``placements`` give this rank."""
    assert tuple(moved.placements) == tuple(placements), (moved.placements, placements)
    torch.testing.assert_close(moved.to_local(), piece(full.to(moved.dtype), mesh, placements), rtol=0, atol=0)


# --- cases ----------------------------------------------------------------------------------------------

@case()
def case_replicate_to_shard_is_a_local_slice(world):
    from torch.distributed.tensor import Shard, distribute_tensor

    from fxtrain.distributed import match_placements

    m = meshes(world)["dp"]
    # Uneven rows (5 over 4 ranks: 2, 2, 1, 0), a shard along dim 1, and a 0-row leaf.
    shapes = {"a": (5, 3), "b": (3, 2 * world + 1), "c": (1, 2)}
    dims = {"a": 0, "b": 1, "c": 0}
    fulls = {k: randn(i, *s) for i, (k, s) in enumerate(shapes.items())}
    params = {k: distribute_tensor(torch.zeros(s), m, [Shard(dims[k])]) for k, s in shapes.items()}
    grads = {k: distribute_tensor(fulls[k], m, [_replicate()]) for k in shapes}
    with counting() as n:
        out = match_placements(grads, params)
    assert sum(n.values()) == 0, n
    for k in shapes:
        expect(out[k], fulls[k], m, (Shard(dims[k]),))


@case()
def case_partial_to_replicate_one_all_reduce_per_group(world):
    from torch.distributed.tensor import Shard, distribute_tensor

    from fxtrain.distributed import match_placements, reduce_partials

    ms = meshes(world)
    dp, m2 = ms["dp"], ms["2d"]
    # Partial over the world's dp group on a 1-D mesh, and Partial over the 2-D mesh's dp dim with
    # Shard and Replicate on tp (the dp x tp bridge's gradients): 1-D leaves share one buffer, and the 2-D
    # mesh's dp dim is one group whatever the tp placement.
    fulls = {"emb": randn(1, 6, 4), "norm": randn(2, 4), "mlp": randn(3, 4, 8), "bias": randn(4, 8),
             "half": randn(5, 3, dtype=torch.bfloat16)}
    grads = {
        "emb": partial(fulls["emb"], dp, (None,), 0, "avg"),
        "norm": partial(fulls["norm"], dp, (None,), 0),
        "mlp": partial(fulls["mlp"], m2, (None, Shard(1)), 0, "avg"),
        "bias": partial(fulls["bias"], m2, (None, _replicate()), 0, "avg"),
        "half": partial(fulls["half"], dp, (None,), 0),
    }
    params = {
        "emb": distribute_tensor(torch.zeros(6, 4), dp, [_replicate()]),
        "norm": distribute_tensor(torch.zeros(4), dp, [_replicate()]),
        "mlp": distribute_tensor(torch.zeros(4, 8), m2, [_replicate(), Shard(1)]),
        "bias": distribute_tensor(torch.zeros(8), m2, [_replicate(), _replicate()]),
        "half": distribute_tensor(torch.zeros(3, dtype=torch.bfloat16), dp, [_replicate()]),
    }
    with counting() as n:
        out = match_placements(grads, params)
    # One buffer per (group, op, divisor) over mesh dim 0: dp sum (norm, half: bf16 rides in float32),
    # dp avg (emb), and the 2-D mesh's dp dim avg (mlp, bias: one buffer for both tp placements). At world
    # 2 the 2-D mesh's dp dim has size 1: its leaves are relabelled, nothing moves.
    assert n["all_reduce"] == (3 if world == 4 else 2), n
    for k, p in params.items():
        expect(out[k], fulls[k], p.device_mesh, p.placements)
    with counting() as n:
        reduced = reduce_partials(grads)
    assert n["all_reduce"] == (3 if world == 4 else 2), n
    for k in ("emb", "mlp"):
        torch.testing.assert_close(reduced[k].to_local(), out[k].to_local(), rtol=0, atol=0)


@case()
def case_partial_to_shard_is_one_reduce_scatter(world):
    from torch.distributed.tensor import Shard, distribute_tensor

    from fxtrain.distributed import match_placements

    m = meshes(world)["dp"]
    shapes = {"a": (2 * world + 1, 3), "b": (3, 5), "c": (world, 2)}
    dims = {"a": 0, "b": 1, "c": 0}
    fulls = {k: randn(10 + i, *s) for i, (k, s) in enumerate(shapes.items())}
    grads = {k: partial(fulls[k], m, (None,), 0, "avg") for k in shapes}
    params = {k: distribute_tensor(torch.zeros(s), m, [Shard(dims[k])]) for k, s in shapes.items()}
    with counting() as n:
        out = match_placements(grads, params)
    assert n == {"reduce_scatter_tensor": 1}, n
    for k in shapes:
        expect(out[k], fulls[k], m, (Shard(dims[k]),))


@case()
def case_other_moves_go_through_torch_and_size_one_dims_relabel(world):
    from torch.distributed.tensor import Shard, distribute_tensor

    from fxtrain.distributed import match_placements

    ms = meshes(world)
    full = randn(20, 2 * world, 3)
    p = {"w": distribute_tensor(torch.zeros(2 * world, 3), ms["dp"], [_replicate()])}
    out = match_placements({"w": distribute_tensor(full, ms["dp"], [Shard(0)])}, p)  # a gather
    expect(out["w"], full, ms["dp"], (_replicate(),))
    # On a mesh dim of size 1 every placement holds the whole tensor: relabelled, nothing moves.
    one = ms["one"]
    q = {"w": distribute_tensor(torch.zeros(4, 3), one, [_replicate()])}
    with counting() as n:
        out = match_placements({"w": distribute_tensor(randn(21, 4, 3), one, [Shard(0)])}, q)
    assert sum(n.values()) == 0 and out["w"].placements == (_replicate(),)
    torch.testing.assert_close(out["w"].to_local(), randn(21, 4, 3), rtol=0, atol=0)


@case()
def case_bad_input_names_the_leaf_and_the_meshes(world):
    from torch.distributed.tensor import distribute_tensor

    from fxtrain.distributed import match_placements

    ms = meshes(world)
    g = {"blocks": [{"w": distribute_tensor(randn(30, 4, 2), ms["dp"], [_replicate()])}]}
    with pytest.raises(ValueError, match=r"'blocks.0.w' is a DTensor .* its param is a plain tensor"):
        match_placements(g, {"blocks": [{"w": torch.zeros(4, 2)}]})
    other = {"blocks": [{"w": distribute_tensor(torch.zeros(4, 2), ms["2d"], [_replicate(), _replicate()])}]}
    with pytest.raises(ValueError, match=r"'blocks.0.w' lives on DeviceMesh.*but its param on DeviceMesh"):
        match_placements(g, other)
    # Collectives are outside autograd: refused, not a detached gradient.
    gp = {"w": partial(randn(31, 4), ms["dp"], (None,), 0).requires_grad_()}
    with pytest.raises(ValueError, match="cannot differentiate through its collectives"):
        match_placements(gp, {"w": distribute_tensor(torch.zeros(4), ms["dp"], [_replicate()])})


test_case = _worlds.tests(__file__, CASES, timeout_s=TIMEOUT_S)


def test_plain_trees_pass_through_untouched():
    from fxtrain.distributed import match_placements

    g = {"w": torch.ones(2), "frozen": None}
    out = match_placements(g, {"w": torch.zeros(2), "frozen": None})
    assert out["w"] is g["w"] and out["frozen"] is None


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
