"""Tests for fxtrain/distributed/_norms.py: global_norm, global_sum_sq, reduce_partials and the clipping transforms on
DTensor shards across gloo worlds of 2 and 4 CPU ranks.

Spawning is the cost (torch import per rank), so each world size is spawned once per test session and
runs every case; each case is then reported as its own test. Every case compares against a float64
reference computed from the full tensors in the same process, and checks the result is bitwise identical
on every rank.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from tests import _worlds

CASES, case = _worlds.registry(worlds=(2, 4))  # name -> (function(world), world sizes it runs at)
TIMEOUT_S = 240


# --- helpers run inside the ranks ---------------------------------------------------------------------

_MESHES: dict = {}


def meshes(world: int) -> dict:
    """The meshes every case shares (built once per world: each one creates process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _MESHES:
        _MESHES["1d"] = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
        _MESHES["2d"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        _MESHES["ep"] = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))  # another mesh object
        _MESHES["one"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rest", "one"))["one"]
    return _MESHES


def randn(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def ref_norm(*tensors: torch.Tensor) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def full(x) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def dt(x: torch.Tensor, mesh, *placements):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(x, mesh, list(placements))


def same_on_all_ranks(x: torch.Tensor, group=None) -> bool:
    """Whether ``x`` (0-dim) is bitwise identical on every rank (NaN payloads included)."""
    bits = x.detach().reshape(1).view(torch.int64 if x.dtype == torch.float64 else torch.int32).long()
    out = [torch.zeros_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, bits, group=group)
    return all(torch.equal(o, out[0]) for o in out)


def check_norm(t, expected: float, *, groups=(), rtol: float = 2e-6) -> torch.Tensor:
    import fxtrain as fx

    n = fx.global_norm(t, groups=groups)
    assert n.shape == () and not hasattr(n, "placements"), n
    assert math.isclose(float(n), expected, rel_tol=rtol), (float(n), expected)
    assert same_on_all_ranks(n), "norm differs across ranks"
    return n


def comm_counts(fn) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn()
    return {str(k): v for k, v in comm.get_comm_counts().items()}


# --- cases ------------------------------------------------------------------------------------------

@case()
def case_plain_only(world):
    import fxtrain as fx
    from fxtrain.testing import nested_params

    t = nested_params(0)
    check_norm(t, ref_norm(*fx.tree.leaves(t)))
    assert comm_counts(lambda: fx.global_norm(t)) == {}  # identical on every rank by assumption: no talk


@case()
def case_shard_1d_even_uneven_empty(world):
    from torch.distributed.tensor import Shard

    m = meshes(world)["1d"]
    xs = {
        "even": randn(1, 4 * world, 3),
        "uneven": randn(2, world + 1, 3),
        "uneven_dim1": randn(3, 2, 2 * world - 1),
        "empty_piece": randn(4, world - 1, 2),  # the last rank holds a 0-row piece
        "one_row": randn(5, 1),  # every rank but the first holds nothing
    }
    dim = {"uneven_dim1": 1}
    t = {k: dt(x, m, Shard(dim.get(k, 0))) for k, x in xs.items()}
    assert t["empty_piece"].to_local().numel() == 0 or dist.get_rank() != world - 1
    for k in xs:
        check_norm({k: t[k]}, ref_norm(xs[k]))
    check_norm(t, ref_norm(*xs.values()))


@case()
def case_replicate_counted_once_at_world_1_2_and_n(world):
    from torch.distributed.tensor import Replicate

    ms = meshes(world)
    x = randn(6, 5, 4)
    for mesh in (ms["one"], ms["2d"]["tp"], ms["1d"]):  # mesh sizes 1, 2, world
        check_norm({"w": dt(x, mesh, Replicate())}, ref_norm(x))
    check_norm([dt(x, ms["2d"], Replicate(), Replicate())], ref_norm(x))
    both = [dt(x, ms["one"], Replicate()), dt(x, ms["1d"], Replicate()), dt(x, ms["2d"], Replicate(), Replicate())]
    check_norm(both, math.sqrt(3) * ref_norm(x))


@case(4)
def case_mesh_2d_placements(world):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    m = meshes(world)["2d"]
    placements = {
        "shard_shard": (Shard(0), Shard(1)),
        "replicate_shard": (Replicate(), Shard(0)),
        "replicate_replicate": (Replicate(), Replicate()),
        "shard_replicate": (Shard(1), Replicate()),
        "shard0_shard0_uneven": (Shard(0), Shard(0)),
        "strided_shard": (_StridedShard(0, split_factor=2), Shard(0)),  # FSDP over TP layout
    }
    xs = {k: randn(10 + i, 7, 5) for i, k in enumerate(placements)}
    xs["strided_shard"] = randn(19, 8, 5)  # strided sharding needs even pieces
    t = {k: dt(xs[k], m, *p) for k, p in placements.items()}
    for k in placements:
        assert tuple(t[k].placements) == placements[k]
        check_norm({k: t[k]}, ref_norm(xs[k]))
    check_norm(t, ref_norm(*xs.values()))


def mixed_tree(world, seed: int = 20):
    """One tree over a 2-D mesh, its tp submesh, a separate 1-D expert mesh, plain tensors and None."""
    from torch.distributed.tensor import Replicate, Shard

    ms = meshes(world)
    xs = {
        "wq": randn(seed, 8, 6), "wo": randn(seed + 1, 6, 8), "mlp": randn(seed + 2, 4, 9),
        "experts": randn(seed + 3, 2 * world + 1, 3), "bias": randn(seed + 4, 5), "norm": randn(seed + 5, 6),
    }
    t = {
        "attn": {"wq": dt(xs["wq"], ms["2d"], Replicate(), Shard(0)), "wo": dt(xs["wo"], ms["2d"], Shard(0), Shard(1))},
        "mlp": dt(xs["mlp"], ms["2d"]["tp"], Shard(1)),
        "experts": dt(xs["experts"], ms["ep"], Shard(0)),
        "bias": dt(xs["bias"], ms["1d"], Replicate()),
        "norm": xs["norm"].clone(),
        "frozen": None,
    }
    return t, xs


@case()
def case_mixed_meshes_and_plain(world):
    import fxtrain as fx

    t, xs = mixed_tree(world)
    check_norm(t, ref_norm(*xs.values()))
    # One all_reduce per distinct group of ranks (world, dp, tp; the ep mesh spans the world group's ranks).
    counts = comm_counts(lambda: fx.global_norm(t))
    n_groups = 3 if world == 4 else 1  # at world 2 the dp dim has size 1 and tp spans the world
    assert counts == {"c10d.allreduce_": n_groups}, counts


@case()
def case_partial_gradients(world):
    import fxtrain as fx
    from torch.distributed.tensor import DTensor, Partial, Shard

    ms, rank = meshes(world), dist.get_rank()
    pieces = [randn(30 + r, 6, 3) for r in range(world)]  # rank r holds pieces[r]; the value is their sum
    p_sum = DTensor.from_local(pieces[rank], ms["1d"], [Partial()])
    p_avg = DTensor.from_local(pieces[rank], ms["1d"], [Partial("avg")])
    total = sum(pieces)
    check_norm({"g": p_sum}, ref_norm(total))
    check_norm({"g": p_avg}, ref_norm(total / world))
    p_bf16 = DTensor.from_local(pieces[rank].bfloat16(), ms["1d"], [Partial()])  # packed with p_sum: mixed dtypes
    check_norm([p_sum, p_bf16], ref_norm(total, sum(x.bfloat16().double() for x in pieces)))

    # Data parallel x tensor parallel: Partial over dp, Shard over tp.
    dp, tp = ms["2d"].get_coordinate()
    q = [randn(40 + i, 4, 3) for i in range(world // 2)]
    local = q[dp].chunk(2, dim=0)[tp]
    p_2d = DTensor.from_local(local, ms["2d"], [Partial(), Shard(0)], shape=(4, 3), stride=(3, 1))
    check_norm([p_2d], ref_norm(sum(q)))
    t = {"a": p_sum, "b": p_2d, "c": dt(randn(50, 5), ms["1d"], Shard(0)), "d": randn(51, 2)}
    check_norm(t, ref_norm(total, sum(q), randn(50, 5), randn(51, 2)))

    # Real data-parallel gradients: Replicate params, Shard(0) batch -> Partial(sum) out of autograd.
    from torch.distributed.tensor import Replicate

    w = randn(60, 3, 2).requires_grad_()
    x = randn(61, 4 * world, 3)
    wd = dt(w.detach(), ms["1d"], Replicate()).requires_grad_()
    (gd,) = torch.autograd.grad((dt(x, ms["1d"], Shard(0)) @ wd).square().sum(), [wd])
    (g,) = torch.autograd.grad((x @ w).square().sum(), [w])
    assert gd.placements[0].is_partial(), gd.placements
    check_norm({"w": gd}, ref_norm(g), rtol=1e-5)

    # Clipping keeps Partial (scaling is linear); clip by value must reduce first (clamp is not).
    clip = fx.clip_by_global_norm(1.0)
    u, _ = fx.update_(clip, fx.tree.clone(t), clip.init(t))  # the kernel, as a donated train_step runs it
    assert u["a"].placements == p_sum.placements and u["b"].placements == p_2d.placements
    coef = 1.0 / ref_norm(total, sum(q), randn(50, 5), randn(51, 2))
    torch.testing.assert_close(full(u["a"]), total * coef, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full(u["b"]), sum(q) * coef, rtol=1e-5, atol=1e-6)
    v, _ = fx.update_(fx.clip(0.5), fx.tree.clone(t), fx.EmptyState())
    assert [p.is_replicate() for p in v["b"].placements] == [True, False], v["b"].placements
    assert v["b"].shape == p_2d.shape and v["b"].stride() == p_2d.stride()
    torch.testing.assert_close(full(v["a"]), total.clamp(-0.5, 0.5))
    torch.testing.assert_close(full(v["b"]), sum(q).clamp(-0.5, 0.5))
    torch.testing.assert_close(full(v["c"]), randn(50, 5).clamp(-0.5, 0.5))


@case(4)
def case_pipeline_stages_through_groups(world):
    """Two stages of two ranks; each stage holds its own leaves, tp-sharded inside the stage."""
    import fxtrain as fx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    if "pp" not in _MESHES:
        _MESHES["pp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    m = _MESHES["pp"]
    stage = m.get_coordinate()[0]
    x0, b0, x1, x2 = randn(70, 6, 4), randn(71, 4), randn(72, 3, 5), randn(73, 2, 2)
    if stage == 0:
        t = {"w": dt(x0, m["tp"], Shard(0)), "b": b0}  # stage 0: a tp-sharded weight and a plain bias
    else:
        t = {"w": dt(x1, m["tp"], Shard(1)), "v": dt(x2, m["tp"], Replicate())}  # stage 1: no plain leaf
    expected = ref_norm(x0, b0, x1, x2)
    check_norm(t, expected, groups=(m["pp"],))
    check_norm(t, expected, groups=(m.get_group("pp"),))  # a ProcessGroup works as well as a 1-D mesh
    clip = fx.clip_by_global_norm(0.5, groups=(m["pp"],))
    u, s = clip.update(t, clip.init(t))
    assert same_on_all_ranks(s.grad_norm) and math.isclose(float(s.grad_norm), expected, rel_tol=2e-6)
    check_norm(u, 0.5, groups=(m["pp"],), rtol=1e-5)


@case(2)
def case_pipeline_stage_without_leaves(world):
    import fxtrain as fx

    x = randn(80, 5, 3)
    t = {"w": x} if dist.get_rank() == 0 else {}
    check_norm(t, ref_norm(x), groups=(dist.group.WORLD,))
    s = fx.distributed.global_sum_sq(t, groups=(dist.group.WORLD,))
    assert float(s.nonfinite) == 0.0 and same_on_all_ranks(s.sum_sq)


@case()
def case_nonfinite_on_one_rank_seen_everywhere(world):
    """NaN or inf on exactly one rank, for every rank position and every kind of leaf."""
    import fxtrain as fx
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    ms, rank = meshes(world), dist.get_rank()
    clip = fx.clip_by_global_norm(1.0)
    for bad in (float("nan"), float("inf")):
        for where in range(world):
            for kind in ("shard", "replicate", "replicate_2d", "partial", "plain"):
                t = {
                    "shard": dt(randn(90, 2 * world, 3), ms["1d"], Shard(0)),
                    "replicate": dt(randn(91, 3), ms["1d"], Replicate()),
                    "replicate_2d": dt(randn(92, 2, 4), ms["2d"], Replicate(), Shard(1)),
                    "partial": DTensor.from_local(randn(93 + rank, 3), ms["1d"], [Partial()]),
                    "plain": randn(94, 4),
                }
                if rank == where:
                    local = t[kind].to_local() if isinstance(t[kind], DTensor) else t[kind]
                    local.view(-1)[0] = bad
                n = fx.global_norm(t)
                ok = math.isnan(float(n)) if math.isnan(bad) else math.isinf(float(n))
                assert ok, (bad, where, kind, float(n))
                assert same_on_all_ranks(n), (bad, where, kind)
                s = fx.distributed.global_sum_sq(t)
                assert float(s.nonfinite) > 0 and same_on_all_ranks(s.sum_sq), (bad, where, kind)
                _, state = clip.update(t, clip.init(t))
                assert same_on_all_ranks(state.grad_norm) and not math.isfinite(float(state.grad_norm))


@case()
def case_clipped_norm_is_max_norm_and_coefficient_identical(world):
    import fxtrain as fx

    t, xs = mixed_tree(world, seed=100)
    t = fx.tree.map(lambda x: x * 10, t)
    clip = fx.clip_by_global_norm(1.0)
    u, s = clip.update(t, clip.init(t))
    assert same_on_all_ranks(s.grad_norm) and math.isclose(float(s.grad_norm), 10 * ref_norm(*xs.values()), rel_tol=2e-6)
    assert math.isclose(ref_norm(*(full(x) for x in fx.tree.leaves(u))), 1.0, rel_tol=1e-5)
    for a, b in zip(fx.tree.leaves(u), fx.tree.leaves(t)):  # placements, meshes, shapes, strides kept
        assert type(a) is type(b) and a.shape == b.shape and a.stride() == b.stride()
        if hasattr(a, "placements"):
            assert a.placements == b.placements and a.device_mesh is b.device_mesh
    # One coefficient everywhere: replicas of a Replicate leaf stay bitwise identical after scaling.
    for x in fx.tree.leaves(u["bias"].to_local()):
        for v in x.reshape(-1):
            assert same_on_all_ranks(v)
    # Below the bound: untouched, bitwise.
    u, _ = fx.clip_by_global_norm(1e6).update(t, clip.init(t))
    for a, b in zip(fx.distributed.local_leaves(u), fx.distributed.local_leaves(t)):
        assert torch.equal(a, b)


@case()
def case_bf16_accumulates_in_float32(world):
    import fxtrain as fx
    from torch.distributed.tensor import Replicate, Shard

    ms = meshes(world)
    t = {"a": dt(torch.ones(4096 * world, dtype=torch.bfloat16), ms["1d"], Shard(0)),
         "b": dt(torch.ones(2, 64, dtype=torch.bfloat16), ms["2d"], Replicate(), Shard(1))}
    n = check_norm(t, math.sqrt(4096 * world + 128), rtol=1e-6)  # a bf16 running sum would stall at 256
    assert n.dtype == torch.float32


@case()
def case_collectives_do_not_grow_with_leaves(world):
    import fxtrain as fx
    from torch.distributed.tensor import Replicate, Shard

    ms = meshes(world)
    for mesh, placements in ((ms["1d"], [Shard(0)]), (ms["2d"], [Replicate(), Shard(0)]), (ms["2d"], [Shard(0), Shard(1)])):
        one = [dt(randn(110, 4, 4), mesh, *placements)]
        many = [dt(randn(111 + i, 4, 4), mesh, *placements) for i in range(64)]
        c1, c64 = comm_counts(lambda: fx.global_norm(one)), comm_counts(lambda: fx.global_norm(many))
        assert c1 == c64 and sum(c1.values()) <= len(placements), (placements, c1, c64)
        check_norm(many, ref_norm(*(randn(111 + i, 4, 4) for i in range(64))))
        clip = fx.clip_by_global_norm(1.0)
        assert comm_counts(lambda: clip.update(many, clip.init(many))) == c64


@case()
def case_clip_by_value_on_shards(world):
    import fxtrain as fx
    from torch.distributed.tensor import Replicate, Shard

    ms = meshes(world)
    x, y = randn(120, 5, 6), randn(121, 7)
    t = {"x": dt(x, ms["2d"], Shard(0), Shard(1)), "y": dt(y, ms["1d"], Replicate()), "z": None}
    u, _ = fx.clip(0.3).update(t, fx.EmptyState())
    assert u["x"].placements == t["x"].placements and u["z"] is None
    torch.testing.assert_close(full(u["x"]), x.clamp(-0.3, 0.3))
    torch.testing.assert_close(full(u["y"]), y.clamp(-0.3, 0.3))
    assert comm_counts(lambda: fx.clip(0.3).update(t, fx.EmptyState())) == {}  # local and elementwise


# --- single process: the same functions without a process group ----------------------------------------

def test_global_sum_sq_single_process_counts_and_mixed_sizes():
    import fxtrain as fx
    from fxtrain import distributed

    # Small leaves take the packed path, large ones _foreach_norm; bf16 and float64 mixed in.
    t = {"small": [randn(i, 3, 5) for i in range(5)], "big": randn(9, 100, 50), "half": randn(10, 7).bfloat16(),
         "big_half": randn(11, 3000).bfloat16(), "none": None}
    s = distributed.global_sum_sq(t)
    expected = sum(float(x.double().square().sum()) for x in fx.tree.leaves(t))
    assert math.isclose(float(s.sum_sq), expected, rel_tol=1e-6) and float(s.nonfinite) == 0.0
    wide = {**t, "f64": randn(12, 4, dtype=torch.float64)}
    assert fx.global_norm(wide).dtype == torch.float64
    t["small"][2][0, 0] = float("nan")
    s = distributed.global_sum_sq(t)
    assert math.isnan(float(s.sum_sq)) and float(s.nonfinite) > 0


def test_reduce_partials_and_local_leaves_pass_plain_trees_through():
    from fxtrain import distributed

    t = {"a": torch.ones(2), "b": None}
    assert distributed.reduce_partials(t) is t
    assert distributed.local_leaves(t)[0] is t["a"]


def test_plan_is_cached_per_leaf_signature():
    from fxtrain import distributed

    t = [randn(1, 3), randn(2, 5000)]
    leaves = [x for x in t]
    assert distributed._norms._plan(leaves) is distributed._norms._plan([x.clone() for x in leaves])
    assert distributed._norms._plan(leaves) is not distributed._norms._plan([randn(1, 4), randn(2, 5000)])


# --- the pytest side: one spawned world per world size runs every case (tests/_worlds.py) ----------------

test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
