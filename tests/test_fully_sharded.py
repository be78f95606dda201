"""Tests for fxtrain/distributed/_fully_sharded.py: FSDP2 (``fully_shard``) modules under fxtrain's step.

Every case builds its parallel model with torch's own ``fully_shard`` (and ``parallelize_module`` for
FSDP x TP) and compares, in the same process, against a single-process float64 run of the same model
through ``fx.functional`` + ``fx.train_step`` on the whole batch (each rank's batch is a slice of it).
Collectives are counted with ``CommDebugMode`` on both sides of each comparison.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests import _worlds

CASES, case = _worlds.registry(worlds=(2,))
TIMEOUT_S = 240
TOL = dict(rtol=1e-12, atol=1e-13)  # float64: the FSDP and single-process runs differ only in summation order


# --- helpers run inside the ranks ---------------------------------------------------------------------

class Net(nn.Module):
    """Transformer-ish and tiny: an embedding, two pre-LayerNorm MLP blocks, a LayerNorm and an output Linear."""

    def __init__(self, vocab: int = 11, d: int = 8, blocks: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx.reshape(-1))  # tokens as rows: FSDP warns about a root returning a view (3-D Linear)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.ln(x))))


def models(dtype=torch.float64, mesh=None, **shard_kw):
    """(reference, fsdp): the same initial weights; the second ``fully_shard``-ed per block and at the root."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = Net().to(dtype)
    model = copy.deepcopy(ref)
    mesh = mesh or _mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **shard_kw)
    fully_shard(model, mesh=mesh, **shard_kw)
    return ref, model


_MESHES: dict = {}


def _mesh(shape=None, names=None):
    from torch.distributed.device_mesh import init_device_mesh

    shape = shape or (dist.get_world_size(),)
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def batches(n: int, rows: int, seq: int = 3, vocab: int = 11, seed: int = 1):
    """``n`` full batches ``(idx, target)`` of ``rows`` rows, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(vocab, (rows, seq), generator=g), torch.randint(vocab, (rows, seq), generator=g))
            for _ in range(n)]


def local(batch, index: int, parts: int):
    return tuple(x.chunk(parts)[index] for x in batch)


def xent(logits, target):
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits (FSDP's policy): f32 loss
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def reference(ref: nn.Module, tx, full_batches, has_aux=False):
    """The single-process run: fx.functional + fx.train_step on the whole batches; params and metrics per step."""
    import fxtrain as fx

    apply, params, buffers = fx.functional(ref)

    def loss_fn(p, b):
        return xent(apply(p, buffers, b[0], train=True)[0], b[1])

    step, state, metrics = fx.train_step(loss_fn, tx), tx.init(params), []
    for b in full_batches:
        params, state, m = step(params, state, b)
        metrics.append(m)
    return params, metrics


def fsdp_run(model: nn.Module, tx, local_batches):
    """fully_sharded + fully_sharded_step on each rank's slices; params, state, metrics and collectives per call."""
    import fxtrain as fx

    apply, params, buffers = fx.parallel.fully_sharded(model)

    def loss_fn(p, b):
        return xent(apply(p, buffers, b[0], train=True)[0], b[1])

    step, state, metrics, counts = fx.parallel.fully_sharded_step(loss_fn, tx, model), tx.init(params), [], []
    for b in local_batches:
        out = []
        counts.append(comm_counts(lambda: out.append(step(params, state, b))))  # noqa: B023 - called at once
        params, state, m = out[0]
        metrics.append(m)
    return params, state, metrics, counts


def assert_params_equal(sharded: dict, full: dict, **tol):
    assert sharded.keys() == full.keys()
    for k, v in sharded.items():
        torch.testing.assert_close(v.full_tensor(), full[k], **(tol or TOL), msg=lambda m: f"{k}: {m}")


_KIND = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "_allgather_base_": "all_gather",
         "all_gather_into_tensor": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_tensor": "reduce_scatter"}


def comm_counts(fn) -> dict:
    """Collectives ``fn`` runs, by kind: CommDebugMode names a c10d call (fxtrain's norm engine, FSDP's hooks)
    and a functional collective (DTensor's, in clip_grad_norm_) differently; one all-reduce is one all-reduce."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn()
    out: dict = {}
    for k, v in comm.get_comm_counts().items():
        name = str(k).split(".")[-1]
        if v:
            out[_KIND.get(name, name)] = out.get(_KIND.get(name, name), 0) + v
    return out


def torch_loop(model: nn.Module, local_batches, *, clip: float | None, lr=1e-2, wd=0.1, every: int = 1):
    """FSDP2 + torch.optim.AdamW(foreach) + clip_grad_norm_ (torchtitan's loop); collectives per call."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, foreach=True)
    counts = []
    for i, b in enumerate(local_batches):
        last = (i + 1) % every == 0

        def call():
            model.set_requires_gradient_sync(last)
            (xent(model(b[0]), b[1]) / every).backward()
            if last:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
        counts.append(comm_counts(call))
    return counts


# --- cases: numbers against a single process --------------------------------------------------------

def _stack(clip=0.05):
    import fxtrain as fx

    return fx.chain(fx.clip_by_global_norm(clip), fx.sharded_apply(fx.adamw(1e-2, weight_decay=0.1)))


@case()
def case_clip_sharded_adamw_matches_single_process(world):
    from torch.distributed.tensor import DTensor, Shard

    rank = dist.get_rank()
    ref, model = models()
    full = batches(3, rows=4 * world)
    ref_params, ref_metrics = reference(ref, _stack(), full)
    params, state, metrics, _ = fsdp_run(model, _stack(), [local(b, rank, world) for b in full])
    assert_params_equal(params, ref_params)
    for m, r in zip(metrics, ref_metrics):  # the norm across shards is the full model's, and clipping acted
        torch.testing.assert_close(m["grad_norm"], r["grad_norm"], **TOL)
        assert float(r["grad_norm"]) > 0.05
    # The tree is the module's own parameters: same storage, updated in place.
    for (name, p), x in zip(model.named_parameters(), params.values()):
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.grad is None, name
        assert p._local_tensor.untyped_storage().data_ptr() == x._local_tensor.untyped_storage().data_ptr(), name
    # sharded_apply's state is born sharded like the params (Adam's moments: this rank's rows only).
    leaves = [x for x in _state_leaves(state) if isinstance(x, DTensor) and x.ndim]
    assert leaves and all(x.placements == (Shard(0),) for x in leaves)
    assert sum(x._local_tensor.numel() for x in leaves) == 2 * sum(p._local_tensor.numel() for p in params.values())


def _state_leaves(state):
    import fxtrain as fx

    return [x for x in fx.tree.leaves(state) if isinstance(x, torch.Tensor)]


@case()
def case_plain_adamw_matches_single_process(world):
    import fxtrain as fx

    rank = dist.get_rank()
    ref, model = models()
    full = batches(3, rows=2 * world, seed=2)
    # Through DTensor dispatch, no sharded_apply. A schedule keeps the reference off torch's fused kernel
    # (plain tensors would take it), so both runs take the foreach kernels (bias corrections in float32,
    # as Optax; the fused kernel's are float64: up to 7e-6 apart, see fxtrain/transforms/_fused.py).
    tx = lambda: fx.adamw(fx.constant_schedule(3e-2), weight_decay=0.1)  # noqa: E731
    ref_params, _ = reference(ref, tx(), full)
    apply, params, buffers = fx.parallel.fully_sharded(model)

    def loss_fn(p, b):  # with an aux output
        logits = apply(p, buffers, b[0], train=True)[0]
        return xent(logits, b[1]), {"rows": logits.shape[0]}

    step, state = fx.parallel.fully_sharded_step(loss_fn, tx(), model, has_aux=True), tx().init(params)
    for b in full:
        params, state, m = step(params, state, local(b, rank, world))
        assert m["aux"] == {"rows": b[0].numel() // world}
    assert_params_equal(params, ref_params)


@case()
def case_accumulate_syncs_once_per_window(world):
    """accumulate(every=3) outermost: held calls make no reduce-scatter, the emitting one reduces the window's sum."""
    import fxtrain as fx

    rank = dist.get_rank()
    ref, model = models()
    _, torch_model = models()
    micro = batches(6, rows=2 * world, seed=3)  # two windows of three micro-batches
    tx = lambda: fx.accumulate(_stack(), every=3)  # noqa: E731
    ref_params, ref_metrics = reference(ref, tx(), micro)
    params, _, metrics, counts = fsdp_run(model, tx(), [local(b, rank, world) for b in micro])
    assert [int(m["emitted"]) for m in metrics] == [int(m["emitted"]) for m in ref_metrics] == [0, 0, 1, 1, 1, 2]
    assert_params_equal(params, ref_params)
    assert counts[0] == counts[1] == {"all_gather": 5}, counts  # held: FSDP's all-gathers only, nothing reduced
    torch_counts = torch_loop(torch_model, [local(b, rank, world) for b in micro], clip=0.05, every=3)
    assert counts == torch_counts, (counts, torch_counts)


@case()
def case_amp_cast_loss_scaling_and_overflow_skip(world):
    """amp_cast's loss scaling on FSDP's gradients: unscaled, checked across ranks, a window skipped on inf."""
    import fxtrain as fx

    rank = dist.get_rank()
    ref, model = models()
    tx = lambda: fx.amp_cast(_stack(), "p=f64,c=f64,o=f64",  # noqa: E731 - FSDP casts params, amp_cast scales
                             loss_scale=fx.DynamicLossScale(init_scale=2.0 ** 10, growth_interval=2))
    full = [(*b, torch.tensor(1.0, dtype=torch.float64)) for b in batches(4, rows=2 * world, seed=5)]
    full[2] = (*full[2][:2], torch.tensor(float("inf"), dtype=torch.float64))  # the whole batch overflows

    def scaled(apply, buffers):
        return lambda p, b: xent(apply(p, buffers, b[0], train=True)[0], b[1]) * b[2]

    apply_r, params_r, buffers_r = fx.functional(ref)
    step_r, state_r, ref_metrics = fx.train_step(scaled(apply_r, buffers_r), tx()), None, []
    state_r = tx().init(params_r)
    for b in full:
        params_r, state_r, m = step_r(params_r, state_r, b)
        ref_metrics.append(m)
    apply, params, buffers = fx.parallel.fully_sharded(model)
    step = fx.parallel.fully_sharded_step(scaled(apply, buffers), tx(), model)
    state = tx().init(params)
    for i, b in enumerate(full):
        # inf on rank 0's slice only: FSDP's reduce-scatter carries it to every rank's shard
        factor = b[2] if rank == 0 else torch.tensor(1.0, dtype=torch.float64)
        params, state, m = step(params, state, (*local(b[:2], rank, world), factor))
        assert int(m["skipped"]) == int(ref_metrics[i]["skipped"]) == (i == 2), (i, m)
        assert float(m["loss_scale"]) == float(ref_metrics[i]["loss_scale"])
    assert [float(m["loss_scale"]) for m in ref_metrics] == [2.0 ** 10, 2.0 ** 11, 2.0 ** 10, 2.0 ** 10]
    assert_params_equal(params, params_r)


@case()
def case_mixed_precision_policy_casts_params_amp_cast_scales(world):
    """FSDP's MixedPrecisionPolicy (bf16 compute, f32 reduce) under amp_cast's loss scale, against FSDP2 +
    torch.optim.AdamW with the same policy: the same gradients, float32 master params."""
    import fxtrain as fx
    from torch.distributed.fsdp import MixedPrecisionPolicy

    rank = dist.get_rank()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _, model = models(torch.float32, mp_policy=policy)
    _, torch_model = models(torch.float32, mp_policy=policy)
    bs = [local(b, rank, world) for b in batches(3, rows=2 * world, seed=6)]
    tx = fx.amp_cast(_stack(clip=1e3), "p=f32,c=f32,o=f32", loss_scale=2.0 ** 8)
    apply, params, buffers = fx.parallel.fully_sharded(model)
    step = fx.parallel.fully_sharded_step(lambda p, b: xent(apply(p, buffers, b[0], train=True)[0], b[1]),
                                             tx, model)
    state = tx.init(params)
    for b in bs:
        params, state, m = step(params, state, b)
    assert float(m["loss_scale"]) == 2.0 ** 8 and all(p.dtype == torch.float32 for p in params.values())
    torch_loop(torch_model, bs, clip=1e3)
    for (name, p), q in zip(torch_model.named_parameters(), params.values()):  # the bias corrections differ
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), rtol=2e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    moved = max(float((q.full_tensor() - p.full_tensor()).abs().max()) for q, p in
                zip(params.values(), models(torch.float32, mp_policy=policy)[1].parameters()))
    assert moved > 1e-3  # it trained


@case(4)
def case_fsdp_x_tp_strided_shards_match_single_process(world):
    """parallelize_module on the tp dim of a 2x2 mesh, then fully_shard on dp: _StridedShard params."""
    import fxtrain as fx
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = _mesh((2, 2), ("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    plan = {f"blocks.{i}.{name}": style for i in range(2)
            for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}
    full = batches(4, rows=4, seed=7)
    # Plain adamw too: its leaves span two meshes (norms on dp, matrices on dp x tp), where DTensor's
    # foreach dispatch of a tensor scalar refuses mixed meshes (the op layer scales local pieces).
    plain = lambda: fx.chain(fx.clip_by_global_norm(0.05), fx.adamw(fx.constant_schedule(1e-2), weight_decay=0.1))  # noqa: E731
    for tx in (_stack, lambda: fx.accumulate(_stack(), every=2), plain):
        torch.manual_seed(0)
        ref = Net().double()
        model = parallelize_module(copy.deepcopy(ref), mesh["tp"], plan)
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        up = dict(model.named_parameters())["blocks.0.up.weight"]
        assert isinstance(up, DTensor) and isinstance(up.placements[0], _StridedShard), up.placements
        ref_params, ref_metrics = reference(ref, tx(), full)
        params, _, metrics, _ = fsdp_run(model, tx(), [local(b, dp, 2) for b in full])
        assert_params_equal(params, ref_params)
        for m, r in zip(metrics, ref_metrics):
            if "grad_norm" in r:
                torch.testing.assert_close(m["grad_norm"], r["grad_norm"], **TOL)


# --- cases: collectives, and the bad inputs ----------------------------------------------------------

@case()
def case_collectives_per_step_equal_fsdp2_torch_optim(world):
    import fxtrain as fx

    rank = dist.get_rank()
    _, model = models()
    _, torch_model = models()
    bs = [local(b, rank, world) for b in batches(2, rows=2 * world, seed=4)]
    # clip inactive: torch divides by norm + 1e-6, Optax by norm; both sides all-reduce the norm anyway
    params, _, _, counts = fsdp_run(model, _stack(clip=1e3), bs)
    torch_counts = torch_loop(torch_model, bs, clip=1e3)
    per_step = {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 1}  # 3 FSDP modules; 2 re-gathered in backward
    assert counts == torch_counts == [per_step] * 2, (counts, torch_counts)
    # and the params agree with torch's own loop: the same AdamW but for the bias corrections, float32 in
    # fxtrain (Optax's), float64 in torch (~7e-6 of lr per step in the first steps; fxtrain/transforms/_fused.py)
    for (name, p), q in zip(torch_model.named_parameters(), params.values()):
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), rtol=2e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")  # noqa: B023


@case()
def case_bad_inputs_named(world):
    import fxtrain as fx
    from torch.distributed.fsdp import fully_shard

    _, model = models()
    with pytest.raises(TypeError, match=r"Net.*fully_shard.*fx\.parallel\.fully_sharded"):
        fx.functional(model)
    with pytest.raises(TypeError, match=r"fully_sharded\(Linear\): nothing in it is fully_shard-ed"):
        fx.parallel.fully_sharded(nn.Linear(2, 2))
    partly = Net().double()
    fully_shard(partly.blocks[0], mesh=_mesh())
    with pytest.raises(ValueError, match=r"'tok\.weight' is not managed by fully_shard"):
        fx.parallel.fully_sharded(partly)

    apply, params, buffers = fx.parallel.fully_sharded(model)
    b = local(batches(1, rows=2 * world)[0], dist.get_rank(), world)
    loss_fn = lambda p, b: xent(apply(p, buffers, b[0], train=True)[0], b[1])  # noqa: E731
    tx = _stack()
    # plain train_step differentiates its own views of params, which FSDP's hooks never see
    with pytest.raises(ValueError, match=r"fully_sharded\(Net\) apply_fn: params\['[\w.]+'\] requires grad.*"
                                         r"fully_sharded_step"):
        fx.train_step(loss_fn, tx)(params, tx.init(params), b)
    # params that are not the module's own
    step = fx.parallel.fully_sharded_step(loss_fn, tx, model)
    copies = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(ValueError, match=r"params\['blocks\.0\.down\.bias'\] is not Net's parameter 'blocks\.0\.down"):
        step(copies, tx.init(copies), b)
    with pytest.raises(ValueError, match=r"params differ from Net's parameters at 'out\.bias'"):
        fewer = {k: v for k, v in params.items() if k != "out.bias"}
        step(fewer, tx.init(fewer), b)
    # a loss that does not run this module's apply_fn
    with pytest.raises(ValueError, match=r"no gradient reaches any parameter of Net"):
        fx.parallel.fully_sharded_step(lambda p, b: (b[0] * 1.0).sum().requires_grad_(), tx, model)(
            params, tx.init(params), b)
    # amp_cast's own param cast is FSDP's MixedPrecisionPolicy's job
    amp = fx.amp_cast(tx, "p=f64,c=f32,o=f64")
    with pytest.raises(ValueError, match=r"is torch\.float32 but Net's parameter is torch\.float64.*MixedPrecision"):
        fx.parallel.fully_sharded_step(loss_fn, amp, model)(params, amp.init(params), b)
    # nothing was written by the refused steps: one good step still matches a fresh run
    assert all(p.grad is None for p in model.parameters())


# --- the pytest side: one spawned world per world size runs every case (tests/_worlds.py) ----------------

test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
