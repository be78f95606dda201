"""fxtrain/distributed/_overlap.py: the data-parallel all-reduce launched from hooks while the backward runs.

Every case counts the all-reduces of each step (launched inside the backward, i.e. while autograd's engine runs,
and after it) and compares the params after a few steps with one process training on the whole batch.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn

import fxtrain as fx
from tests import _worlds

CASES, case = _worlds.registry(worlds=(2,))  # one 4-rank case: dp x tp
TIMEOUT_S = 240
STEPS = 4
TOL = 2e-6  # float32, two reduction orders (gloo's ring against one process's batch sum)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def batches(n: int, rows: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(n)]


def loss_of(apply) -> callable:
    return lambda p, b: ((apply(p, {}, b[0], train=True)[0] - b[1]) ** 2).mean()


def stack(every: int = 1):
    tx = fx.chain(fx.clip_by_global_norm(0.5), fx.adamw(1e-2))
    return tx if every == 1 else fx.accumulate(tx, every=every)


@contextlib.contextmanager
def counting(names=("all_reduce",)):
    """The collectives ``names`` of ``torch.distributed`` on gradients, counted: ``calls`` gets ``(inside the
    backward, async_op)`` per launch (FSDP2 reduce-scatters with ``reduce_scatter_single``)."""
    calls, real = [], {n: getattr(dist, n) for n in names}

    def counted(name):
        def collective(*args, **kwargs):
            x = kwargs.get("input", args[1] if name == "reduce_scatter_single" else args[0])
            if x.numel() > 3:  # a gradient bucket (the global norm's all-reduces carry 3 numbers)
                calls.append((torch._C._current_graph_task_id() != -1, bool(kwargs.get("async_op"))))
            return real[name](*args, **kwargs)
        return collective

    for n in names:
        setattr(dist, n, counted(n))
    try:
        yield calls
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)


def one_process(every: int, steps: int, world: int) -> dict:
    apply, params, _ = fx.functional(model())
    tx = stack(every)
    step, state = fx.train_step(loss_of(apply), tx), tx.init(params)
    for b in batches(steps, 4 * world):
        params, state, _ = step(params, state, b)
    return params


def data_parallel(world: int, every: int, steps: int) -> tuple[dict, list]:
    """Params after ``steps`` data-parallel steps (this rank's rows of each batch) and each step's counts."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh, rank = init_device_mesh("cpu", (world,)), dist.get_rank()
    apply, params, _ = fx.parallel.data_parallel(model(), mesh)
    tx = stack(every)
    step, state = fx.train_step(loss_of(apply), tx), tx.init(params)
    counts = []
    with fx.distributed.reduction_buckets(0.002):  # ~2 KB: a bucket per layer or two, several per backward
        for x, y in batches(steps, 4 * world):
            with counting() as calls:
                params, state, _ = step(params, state, (x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]))
            counts.append(calls)
    return {k: v.full_tensor() for k, v in params.items()}, counts


def assert_close(params: dict, ref: dict, tol: float = TOL) -> None:
    errs = {k: float((params[k] - ref[k]).abs().max()) for k in ref}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"{worst} is {errs[worst]:.2g} from one process (> {tol})"


@case()
def case_dp_reduction_launches_during_the_backward(world):
    params, counts = data_parallel(world, every=1, steps=STEPS)
    # The first step plans the buckets (the order gradients come in) and reduces in them after the backward.
    assert counts[0] == [(False, True)] * 3, counts[0]
    for calls in counts[1:]:
        inside = [c for c in calls if c[0]]
        # 4 Linear layers, 1.5 KB of gradients each (about 2 KB per bucket): 3 buckets, all launched from the hooks
        # (the last one by the first layer's gradient, the last computed), asynchronously, nothing after.
        assert inside == [(True, True)] * 3 and len(calls) == 3, calls
    assert_close(params, one_process(1, STEPS, world))


@case()
def case_accumulate_reduces_once_per_window_after_the_backward(world):
    # accumulate takes Partial gradients unreduced: held micro-steps launch nothing, the emitting one reduces the
    # window's sum once (the functional no_sync), after its backward.
    params, counts = data_parallel(world, every=2, steps=STEPS)
    assert counts == [[], [(False, False)]] * (STEPS // 2), counts
    assert_close(params, one_process(2, STEPS, world))


@case()
def case_unused_param_reduces_zeros_on_every_rank(world):
    # A layer that one step does not use: its hook does not fire, its bucket still launches (zeros), and the
    # collectives of every rank stay in step.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    apply, params, _ = fx.parallel.data_parallel(model(), mesh)
    tx = fx.sgd(0.1)
    x, y = batches(1, 4)[0]
    with fx.distributed.reduction_buckets(0.002):
        params, state, _ = fx.train_step(loss_of(apply), tx)(params, tx.init(params), (x, y))  # plans the buckets
    # The same params through a loss that does not use the last layer's weight: its gradient is the step's zeros.
    unused = fx.train_step(lambda p, b: ((apply({**p, "6.weight": p["6.weight"].detach()}, {}, b[0], train=True)[0]
                                          - b[1]) ** 2).mean(), tx)
    before = params["6.weight"].full_tensor().clone()
    with fx.distributed.reduction_buckets(0.002):
        for _ in range(2):
            params, state, _ = unused(params, state, (x, y))
    torch.testing.assert_close(params["6.weight"].full_tensor(), before, rtol=0, atol=0)


@case()
def case_amp_fp16_unscales_after_the_reduction_and_skips_on_every_rank(world):
    # amp_cast with a dynamic loss scale, no accumulate: the scaled gradients are reduced from the hooks, amp_cast
    # unscales the reduced ones and decides overflow across ranks; an inf in one rank's rows skips the step on both.
    from torch.distributed.device_mesh import init_device_mesh

    mesh, rank = init_device_mesh("cpu", (world,)), dist.get_rank()
    tx = fx.amp_cast(fx.sgd(0.1), "p=f32,c=f16,o=f32", fx.DynamicLossScale(init_scale=2.0**10))
    data = batches(STEPS, 4 * world)
    bad = (data[2][0].clone(), data[2][1])
    bad[0][4 * world - 1, 0] = float("inf")  # the last rank's rows only
    data[2] = bad

    def train(apply, params, rows):
        step, state, out = fx.train_step(loss_of(apply), tx), tx.init(params), []
        for x, y in data:
            params, state, m = step(params, state, (x[rows], y[rows]))
            out.append((float(m["skipped"]), float(m["loss_scale"])))
        return params, out

    apply, params, _ = fx.parallel.data_parallel(model(), mesh)
    with fx.distributed.reduction_buckets(0.002), counting() as calls:
        params, metrics = train(apply, params, slice(4 * rank, 4 * rank + 4))
    assert sum(inside for inside, _ in calls) >= 3 * (STEPS - 1), calls  # 3 buckets per step after the first
    assert [s for s, _ in metrics] == [0, 0, 1, 0] and metrics[2][1] == 2.0**9, metrics
    ref_apply, ref, _ = fx.functional(model())
    ref, ref_metrics = train(ref_apply, ref, slice(None))
    assert ref_metrics == metrics, (ref_metrics, metrics)
    assert_close({k: v.full_tensor() for k, v in params.items()}, ref, tol=1e-3)  # fp16 compute of other rows


@case(4)
def case_a_resumed_run_reduces_bit_for_bit_as_the_uninterrupted_one(world):
    # A restarted process plans its buckets again on its first step; that step reduces in the plan's buckets too, so
    # every element is summed at the same buffer position (4 ranks: gloo's ring sums in an order that depends on it).
    from torch.distributed.device_mesh import init_device_mesh

    from fxtrain.distributed import _overlap

    mesh, rank = init_device_mesh("cpu", (world,)), dist.get_rank()
    data = [(x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]) for x, y in batches(STEPS, 4 * world)]
    runs = []
    for restart in (None, 2):
        _overlap._PLANS.clear()
        apply, params, _ = fx.parallel.data_parallel(model(), mesh)
        tx = stack()
        step, state = fx.train_step(loss_of(apply), tx), tx.init(params)
        with fx.distributed.reduction_buckets(0.002):
            for k, b in enumerate(data):
                if k == restart:
                    _overlap._PLANS.clear()  # what a new process starts with
                params, state, _ = step(params, state, b)
        runs.append({k: v.to_local() for k, v in params.items()})
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def lm():
    from fxtrain.models import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(vocab_size=16, context=8, d_model=8, n_layers=2, n_heads=2)


def lm_batches(world: int, steps: int) -> list:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randint(0, 16, (2 * world, 9), generator=g) for _ in range(steps)]
    return [(x[:, :-1], x[:, 1:]) for x in xs]


def lm_loss(apply, buffers):
    return lambda p, b: torch.nn.functional.cross_entropy(apply(p, buffers, b[0], train=True)[0].reshape(-1, 16),
                                                          b[1].reshape(-1))


def lm_one_process(world: int, every: int, steps: int) -> dict:
    apply, params, buffers = fx.functional(lm())
    tx = stack(every)
    step, state = fx.train_step(lm_loss(apply, buffers), tx), tx.init(params)
    for b in lm_batches(world, steps):
        params, state, _ = step(params, state, b)
    return params


def assert_lm_close(params: dict, ref: dict) -> None:
    # Attention key biases left out: their gradient is zero in exact arithmetic, Adam normalises rounding noise.
    assert_close({k: v for k, v in params.items() if not k.endswith("attn.k.bias")},
                 {k: v for k, v in ref.items() if not k.endswith("attn.k.bias")}, tol=2e-5)


@case(4)
def case_dp_x_tp_reduces_the_dp_gradients_during_the_backward(world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = lm()
    apply, params, buffers = fx.parallel.tensor_parallel(model, model.tp_plan(), mesh)
    tx = stack()
    step, state = fx.train_step(lm_loss(apply, buffers), tx), tx.init(params)
    counts, dp = [], mesh["dp"].get_local_rank()
    with fx.distributed.reduction_buckets(0.001):
        for x, y in lm_batches(world, STEPS):
            n = len(x) // 2  # this dp rank's half of the batch
            rows = slice(n * dp, n * (dp + 1))
            with counting() as calls:
                params, state, _ = step(params, state, (x[rows], y[rows]))
            counts.append(calls)
    for calls in counts[1:]:
        # the dp gradients in several buckets from the hooks (the SequenceParallel norms' too, which stay Partial
        # over tp); after the backward only the norms' tp all-reduce
        inside = [c for c in calls if c[0]]
        assert len(inside) >= 2 and all(c[1] for c in inside) and len(calls) == len(inside) + 1, calls
    assert_lm_close({k: v.full_tensor() for k, v in params.items()}, lm_one_process(world, 1, STEPS))


@case()
def case_hsdp_accumulate_reduces_once_per_window_inside_the_backward(world):
    # HSDP is FSDP2's engine (fully_shard on a (dp_replicate, dp_shard) mesh; here 2 x 1): torch reduces inside the
    # backward, and fx.parallel.fully_sharded_step turns the reduction off on held micro-steps (no_sync).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = lm()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    apply, params, buffers = fx.parallel.fully_sharded(model)
    tx = stack(every=2)
    step, state, counts = fx.parallel.fully_sharded_step(lm_loss(apply, buffers), tx, model), tx.init(params), []
    rank = dist.get_rank()
    for x, y in lm_batches(world, STEPS):
        with counting(("all_reduce", "reduce_scatter_single")) as calls:
            params, state, _ = step(params, state, (x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        counts.append(calls)
    for held, emitting in zip(counts[::2], counts[1::2]):
        assert held == [], held
        assert emitting and all(inside for inside, _ in emitting), emitting
    assert_lm_close({k: v.full_tensor() for k, v in params.items()}, lm_one_process(world, 2, STEPS))


test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
