"""Tests for fxtrain/distributed/_expert_parallel.py: MoE experts sharded over an ``ep`` mesh dim, dense params
on the dp mesh, gloo worlds of 2 and 4 CPU ranks.

Every case builds the same float64 TransformerLM with MoE blocks on every rank and compares against a
single-process computation on the whole batch in the same rank: the global norm of the gradients, and
the params after 3 steps of ``chain(clip_by_global_norm, sharded_apply(adamw))`` (fxtrain, one process).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.distributed as dist

from tests import _worlds

CASES, case = _worlds.registry(worlds=(2, 4))
TIMEOUT_S = 240
PER_RANK = 2  # sequences per rank
CLIP = 0.05  # below the gradient norm (0.9-1.2 here): clipping scales every step, so a wrong norm moves params


# --- helpers run inside the ranks ---------------------------------------------------------------------

_MESHES: dict = {}


def mesh(world: int, shape: tuple, names: tuple):
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def layouts(world: int) -> list:
    """(shape, names) of the meshes each case runs on: ep over all ranks, and dp x ep."""
    return [((world,), ("ep",)), ((world // 2, 2), ("dp", "ep"))]


def model(experts: int = 4):
    from fxtrain.models import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(vocab_size=11, context=4, d_model=8, n_layers=2, n_heads=2, experts=experts).double()


def batch(world: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (inputs, targets): PER_RANK sequences per rank, the same on every rank."""
    x = torch.randint(0, 11, (PER_RANK * world, 5), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1], x[:, 1:]


def mine(b: tuple) -> tuple:
    r = dist.get_rank()
    return tuple(t[r * PER_RANK:(r + 1) * PER_RANK] for t in b)


def loss_of(apply, buffers):
    import torch.nn.functional as F

    def loss_fn(params, b):
        logits, _ = apply(params, buffers, b[0], train=True)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1))

    return loss_fn


def full(x):
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def reference_grads(world: int) -> dict:
    """float64 gradients of the whole batch's mean loss, one process."""
    import fxtrain as fx

    apply, params, buffers = fx.functional(model())
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    g = torch.autograd.grad(loss_of(apply, buffers)(params, batch(world)), list(params.values()))
    return dict(zip(params, g))


def ep_grads(m) -> tuple[dict, dict]:
    """(params, gradients) of this rank's share through expert_parallel on mesh ``m``: DTensors."""
    import fxtrain as fx

    apply, params, buffers = fx.parallel.expert_parallel(model(), m)
    xs = {k: v.detach().requires_grad_() for k, v in params.items()}
    g = torch.autograd.grad(loss_of(apply, buffers)(xs, mine(batch(dist.get_world_size()))), list(xs.values()))
    return params, dict(zip(params, g))


def norm(ts) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in ts))


def sq(ts) -> float:
    return sum(float(t.double().square().sum()) for t in ts)


def tx():
    import fxtrain as fx

    # A tensor learning rate keeps every run on the foreach kernels, so donated, pure and one process agree to
    # 1e-12 (the fused kernel's float64 bias corrections differ from the foreach path's by ~1e-7 relative;
    # tests/test_sharding.py runs the fused kernel on this layout).
    return fx.chain(fx.clip_by_global_norm(CLIP), fx.sharded_apply(fx.adamw(torch.tensor(1e-2, dtype=torch.float64))))


def one_process_run(world: int) -> dict:
    """The params after 3 steps of :func:`tx` on the whole batches, one process."""
    import fxtrain as fx

    apply, ref, buffers = fx.functional(model())
    step, t = fx.train_step(loss_of(apply, buffers), tx()), tx()
    state = t.init(ref)
    for i in range(3):
        ref, state, _ = step(ref, state, batch(world, seed=i))
    return ref


# --- cases ------------------------------------------------------------------------------------------

@case()
def case_layout_and_gradients_match_one_process(world):
    from torch.distributed.tensor import Partial, Replicate, Shard

    ref = reference_grads(world)
    for shape, names in layouts(world):
        m = mesh(world, shape, names)
        params, grads = ep_grads(m)
        experts = {k for k in params if k.rsplit(".", 1)[-1] in ("w_in", "b_in", "w_out", "b_out")}
        assert len(experts) == 8 and len(params) > len(experts)
        ep = names.index("ep")
        for k, p in params.items():
            if k in experts:
                assert p.device_mesh is m and p.placements[ep] == Shard(0), (k, p.placements)
                assert p.to_local().shape[0] == 4 // shape[ep]  # this rank's experts only
                assert grads[k].placements == tuple(Shard(0) if d == ep else Partial("avg") for d in range(m.ndim))
            else:
                assert p.device_mesh.ndim == 1 and p.device_mesh.size() == world and p.placements == (Replicate(),)
                assert grads[k].placements == (Partial("avg"),), (k, grads[k].placements)
            assert (p.device_mesh is m) == (k in experts or m.ndim == 1)  # 2-D: dense on the flattened mesh
            torch.testing.assert_close(full(grads[k]), ref[k], rtol=1e-12, atol=1e-14, msg=k)


@case()
def case_global_norm_over_dense_and_expert_meshes_where_clip_grad_norm_fails(world):
    import fxtrain as fx
    from fxtrain.distributed import reduce_partials

    ref = reference_grads(world)
    true = norm(ref.values())
    experts = [k for k in ref if k.rsplit(".", 1)[-1] in ("w_in", "b_in", "w_out", "b_out")]
    dense_sq, expert_sq = sq(ref[k] for k in ref if k not in experts), sq(ref[k] for k in experts)
    for shape, names in layouts(world):
        m = mesh(world, shape, names)
        params, grads = ep_grads(m)
        n = fx.global_norm(grads)  # Partial gradients: reduced inside the norm engine
        assert math.isclose(float(n), true, rel_tol=1e-12), (float(n), true)
        reduced = reduce_partials(grads)  # the gradients torch's optimizer would see as .grad
        assert math.isclose(float(fx.global_norm(reduced)), true, rel_tol=1e-12)

        # torch's clip_grad_norm_ on the same .grad: dense params on the dp mesh, experts on (dp, ep).
        ps = {k: torch.nn.Parameter(v) for k, v in params.items()}
        for k, p in ps.items():
            p.grad = reduced[k]
        if m.ndim == 1:  # one mesh object for both: DTensor's own norm is right
            got = float(torch.nn.utils.clip_grad_norm_(list(ps.values()), max_norm=1e9))
            assert math.isclose(got, true, rel_tol=1e-12), (got, true)
        else:
            with pytest.raises(RuntimeError, match="must have the same mesh"):  # aten.stack of the norms
                torch.nn.utils.clip_grad_norm_(list(ps.values()), max_norm=1e9)

        # As users write it with local gradients (Megatron-style: DTensors dropped after the reduction).
        local = {k: v.to_local() for k, v in reduced.items()}
        mine_sq = sq(local[k] for k in experts)  # this rank's experts only
        got = float(_clip_norm(local))
        assert math.isclose(got, math.sqrt(dense_sq + mine_sq), rel_tol=1e-12)  # misses the other experts
        assert got < 0.99 * true, (got, true)
        # ... and the usual fix, sum of squares all-reduced over the world group: dense params are counted
        # once per rank, experts once per dp replica (Megatron's 2026 bug: the reduction over the wrong group).
        s = torch.tensor(got**2, dtype=torch.float64)
        dist.all_reduce(s)
        dp = world // shape[names.index("ep")]
        assert math.isclose(math.sqrt(float(s)), math.sqrt(world * dense_sq + dp * expert_sq), rel_tol=1e-12)
        assert math.sqrt(float(s)) > 1.2 * true, (math.sqrt(float(s)), true)


def _clip_norm(local: dict) -> torch.Tensor:
    """torch's clip_grad_norm_ over plain local gradients (what it reports)."""
    ps = [torch.nn.Parameter(torch.zeros_like(v)) for v in local.values()]
    for p, v in zip(ps, local.values()):
        p.grad = v.clone()
    return torch.nn.utils.clip_grad_norm_(ps, max_norm=1e9)


@case()
def case_three_steps_equal_one_process_run(world):
    import fxtrain as fx

    ref = one_process_run(world)
    for shape, names in layouts(world):
        for donate in (True, False):
            apply, params, buffers = fx.parallel.expert_parallel(model(), mesh(world, shape, names))
            step, t = fx.train_step(loss_of(apply, buffers), tx(), donate=donate), tx()
            state = t.init(params)
            for i in range(3):
                params, state, metrics = step(params, state, mine(batch(world, seed=i)))
            for k in ref:
                torch.testing.assert_close(full(params[k]), ref[k], rtol=1e-12, atol=1e-14, msg=(names, donate, k))
            moved = max(float((full(params[k]) - v).abs().max()) for k, v in fx.functional(model())[1].items())
            assert moved > 1e-3  # the params did train


@case(4)
def case_fully_sharded_experts_equal_one_process_run(world):
    """torchtitan's EP x FSDP (fully_shard_experts): experts Shard(0) over ep and fully_shard-ed over dp_shard,
    the rest fully_shard-ed over the four data ranks; three steps of fully_sharded_step equal one process's."""
    import fxtrain as fx
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    ref = one_process_run(world)
    m, lm = mesh(world, (2, 2), ("dp_shard", "ep")), model()
    dense = fx.parallel.fully_shard_experts(lm, m)
    for block in lm.blocks:
        fully_shard(block, mesh=dense)
    fully_shard(lm, mesh=dense)
    apply, params, buffers = fx.parallel.fully_sharded(lm)
    w_in, router = params["blocks.0.mlp.w_in"], params["blocks.0.mlp.router.weight"]
    # the experts: this rank's 2 of 4 over ep, FSDP's half of them over dp_shard; the router over all 4 ranks
    assert w_in.device_mesh.mesh_dim_names == ("dp_shard", "ep") and w_in.placements[1] == Shard(0)
    assert w_in.to_local().shape[0] == 1 and router.device_mesh.size() == 4 and router.placements == (Shard(0),)
    step, t = fx.parallel.fully_sharded_step(loss_of(apply, buffers), tx(), lm), tx()
    state = t.init(params)
    for i in range(3):
        params, state, _ = step(params, state, mine(batch(world, seed=i)))
    for k in ref:
        torch.testing.assert_close(full(params[k]), ref[k], rtol=1e-10, atol=1e-12, msg=k)
    moved = max(float((full(params[k]) - v).abs().max()) for k, v in fx.functional(model())[1].items())
    assert moved > 1e-3  # the params did train


@case(2)
def case_bad_input_is_named(world):
    import fxtrain as fx
    from fxtrain.models import MoE

    dp_only = mesh(world, (world,), ("dp",))
    with pytest.raises(ValueError, match=r"the mesh has dims \('dp',\), none named 'ep'; pass ep="):
        fx.parallel.expert_parallel(model(), dp_only)
    fx.parallel.expert_parallel(model(), dp_only, ep="dp")  # the fix it names
    with pytest.raises(ValueError, match="MoE layer 'blocks.0.mlp' has 3 experts, not divisible by the 'ep' "
                                         "mesh dim's size 2; use a multiple of 2 experts"):
        fx.parallel.expert_parallel(model(experts=3), mesh(world, (world,), ("ep",)))
    with pytest.raises(ValueError, match="Sequential has no fxtrain.models.MoE layer"):
        fx.parallel.expert_parallel(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh(world, (world,), ("ep",)))
    with pytest.raises(ValueError, match="fully_shard_experts: MoE layer 'blocks.0.mlp' has 3 experts, not divisible"):
        fx.parallel.fully_shard_experts(model(experts=3), mesh(world, (world,), ("ep",)))
    apply, params, buffers = fx.parallel.expert_parallel(torch.nn.Sequential(MoE(4, 8, 2)), dp_only, ep="dp")
    with pytest.raises(ValueError, match="param '0.w_in' is a plain tensor; pass the params tree that expert_parallel"):
        apply({k: full(v) for k, v in params.items()}, buffers, torch.zeros(2, 4), train=True)


# --- the pytest side: one spawned world per world size runs every case (tests/_worlds.py) ----------------

test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
