"""Tests for fxtrain/distributed/_pipeline.py: ``pipeline_step`` on torch.distributed.pipelining schedules.

The model (embedding, four residual MLP blocks with LayerNorms, a head; float64) is split into stages by
the user (``nn.Sequential`` slices), wrapped in torch's own ``PipelineStage`` and schedules, and every
case compares against a single-process fxtrain ``train_step`` on the full model in the same process.
"""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests import _worlds

CASES, case = _worlds.registry(worlds=(2, 4))
TIMEOUT_S = 240

V, D, T, B = 11, 8, 4, 8  # vocabulary, width, tokens, batch
N_MICRO = 4
MAX_NORM = 0.05  # below the gradients' norm (~1): every step clips
LR = 1e-2
SPLITS = {2: [(0, 3), (3, 6)], 4: [(0, 2), (2, 3), (3, 4), (4, 6)]}  # module slices per stage


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(self.norm(h))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, h):
        return self.out(self.norm(h))


def full_model() -> nn.Sequential:
    """The same float64 model on every rank (and for the single-process reference)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, D), Block(), Block(), Block(), Block(), Head()).double()
    with torch.no_grad():  # non-trivial LayerNorm params, so their gradients are not symmetric
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(n)]


_GROUPS: dict = {}


def pp_mesh(size: int, dp: int = 1):
    """A (dp, pp) mesh, built once per shape (each one creates process groups on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (dp, size)
    if key not in _GROUPS:
        _GROUPS[key] = init_device_mesh("cpu", (dp, size), mesh_dim_names=("dp", "pp"))
    return _GROUPS[key]


def build(schedule_cls, stages: int, *, rank: int | None = None, group=None, n_micro: int = N_MICRO, wrap=None):
    """This rank's stage module (a slice of the full model), its PipelineStage and a schedule."""
    from torch.distributed.pipelining import PipelineStage

    rank = dist.get_rank(group) if rank is None else rank
    lo, hi = SPLITS[stages][rank]
    module = copy.deepcopy(full_model()[lo:hi])  # keeps the full model's names ("3.fc1.weight")
    stage = PipelineStage(wrap(module) if wrap else module, rank, stages, torch.device("cpu"), group=group)
    return module, schedule_cls(stage, n_micro, loss_fn=loss_fn)


def reference(tx, data, steps: int = 3):
    """Single-process fxtrain train_step on the full model: params, metrics per step and first gradients."""
    import fxtrain as fx

    apply, params, buffers = fx.functional(full_model())

    def loss(p, batch):
        x, y = batch
        return loss_fn(apply(p, buffers, x, train=True)[0], y)

    grads0 = torch.func.grad(loss)(params, data[0])
    step, state, metrics = fx.train_step(loss, tx), tx.init(params), []
    for batch in data[:steps]:
        params, state, m = step(params, state, batch)
        metrics.append(m)
    return params, metrics, grads0


def stack(groups=()):
    import fxtrain as fx

    # A tensor learning rate keeps both sides on the foreach kernels (the fused AdamW's float64 bias
    # correction differs from fxtrain's float32 one by ~1e-6; case_fused_clip_over_the_pp_group runs it).
    return fx.chain(fx.clip_by_global_norm(MAX_NORM, groups=groups), fx.adamw(torch.tensor(LR, dtype=torch.float64)))


def assert_close(a, b, what: str, tol: float = 1e-12) -> None:
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def run_pipeline(schedule, module, tx, pp, data, params=None, steps: int = 3):
    import fxtrain as fx

    params = dict(module.named_parameters()) if params is None else params
    step, state, metrics = fx.parallel.pipeline_step(schedule, tx, pp_group=pp), tx.init(params), []
    for batch in data[:steps]:
        params, state, m = step(params, state, batch)
        metrics.append(m)
    return params, metrics


def check_against_reference(params, metrics, ref_params, ref_metrics, ref_grads0, pp_group, *, clip: bool = True):
    assert set(params) and set(params) <= set(ref_params)
    for name, p in params.items():
        assert_close(p.detach(), ref_params[name], f"param {name}")
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        assert_close(m["loss"], r["loss"], f"loss at step {i}")
        if clip:
            assert_close(m["grad_norm"], r["grad_norm"], f"grad_norm at step {i}")
    if clip:  # the clip's norm is the full model's: an independent float64 norm of the full gradient
        full = math.sqrt(sum(float(g.square().sum()) for g in ref_grads0.values()))
        assert math.isclose(float(metrics[0]["grad_norm"]), full, rel_tol=1e-12), (float(metrics[0]["grad_norm"]), full)
        assert full > MAX_NORM  # the clip acted
    # Every rank reports the same loss and norm (rank 0, the first stage, logs them).
    vec = torch.stack([m["loss"].double() for m in metrics]
                      + ([m["grad_norm"].double() for m in metrics] if clip else []))
    out = [torch.empty_like(vec) for _ in range(dist.get_world_size(pp_group))]
    dist.all_gather(out, vec, group=pp_group)
    assert all(torch.equal(o, vec) for o in out)


# --- cases ------------------------------------------------------------------------------------------

@case()
def case_gpipe_and_1f1b_match_single_process(world):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    pp, data = pp_mesh(world), batches()
    ref_params, ref_metrics, grads0 = reference(stack(), data)
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        module, schedule = build(schedule_cls, world)
        params, metrics = run_pipeline(schedule, module, stack(groups=(pp["pp"],)), pp["pp"], data)
        check_against_reference(params, metrics, ref_params, ref_metrics, grads0, pp["pp"].get_group())
        assert all(p is q for p, q in zip(params.values(), module.parameters()))  # in place, donated


@case(2)
def case_fused_adamw_and_functional_params(world):
    import fxtrain as fx
    from torch.distributed.pipelining import ScheduleGPipe

    # No global transform: the fused AdamW kernel runs on the stage params, as in the reference; params
    # given as fx.functional's detached trees (they alias the stage module's parameters).
    pp, data = pp_mesh(world), batches()
    ref_params, ref_metrics, grads0 = reference(fx.adamw(LR), data)
    module, schedule = build(ScheduleGPipe, world)
    _, params, _ = fx.functional(module)
    params, metrics = run_pipeline(schedule, module, fx.adamw(LR), pp["pp"], data, params=params)
    check_against_reference(params, metrics, ref_params, ref_metrics, grads0, pp["pp"].get_group(), clip=False)
    for name, p in module.named_parameters():  # the module trained
        assert_close(p.detach(), ref_params[name], f"module param {name}")


@case(2)
def case_fused_clip_over_the_pp_group(world):
    import fxtrain as fx
    from torch.distributed.pipelining import ScheduleGPipe
    from fxtrain.transforms import _fused

    # Plain-number hyperparameters: clip + AdamW is one fused kernel call with the clip in its grad_scale,
    # the norm summed over the pp group; the single-process reference takes the same kernel.
    pp, data = pp_mesh(world), batches()
    tx = fx.chain(fx.clip_by_global_norm(MAX_NORM, groups=(pp["pp"],)), fx.adamw(LR))
    assert _fused.spec(tx).groups == (pp["pp"],)
    ref_params, ref_metrics, grads0 = reference(fx.chain(fx.clip_by_global_norm(MAX_NORM), fx.adamw(LR)), data)
    module, schedule = build(ScheduleGPipe, world)
    params, metrics = run_pipeline(schedule, module, tx, pp["pp"], data)
    check_against_reference(params, metrics, ref_params, ref_metrics, grads0, pp["pp"].get_group())


@case(2)
def case_torch_per_stage_clip_sees_one_stage(world):
    from torch.distributed.pipelining import ScheduleGPipe

    # torch's imperative loop: schedule.step, then clip_grad_norm_ on the stage's parameters. Its norm is
    # this stage's alone; fxtrain's clip (groups=(pp,)) reports the full model's.
    pp, data = pp_mesh(world), batches()
    _, ref_metrics, grads0 = reference(stack(), data, steps=1)
    module, schedule = build(ScheduleGPipe, world)
    x, y = data[0]
    schedule.step(x if dist.get_rank() == 0 else None, target=y)
    torch_norm = float(torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM))
    names = [n for n, _ in module.named_parameters()]
    stage_norm = math.sqrt(sum(float(grads0[n].square().sum()) for n in names))
    full = math.sqrt(sum(float(g.square().sum()) for g in grads0.values()))
    assert math.isclose(torch_norm, stage_norm, rel_tol=1e-12), (torch_norm, stage_norm)
    assert torch_norm < 0.9 * full, (torch_norm, full)  # per-stage: not the full model's norm
    norms = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(norms, torch.tensor(torch_norm, dtype=torch.float64))
    assert math.isclose(math.sqrt(sum(float(n) ** 2 for n in norms)), full, rel_tol=1e-12)
    assert math.isclose(float(ref_metrics[0]["grad_norm"]), full, rel_tol=1e-12)


@case(4)
def case_two_stages_by_two_fully_sharded(world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import ScheduleGPipe
    from torch.distributed.tensor import DTensor

    # dp x pp as torchtitan builds it: each pipeline replica is given half of the batch, the stage modules
    # are fully_shard-ed over dp (the schedule reduce-scatters their gradients after the last
    # micro-batch), and the clip sums over dp (DTensor shards) and over the pp group (groups=).
    mesh, data = pp_mesh(2, dp=2), batches()
    ref_params, ref_metrics, grads0 = reference(stack(), data)
    dp_rank, pp_rank = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    module, schedule = build(ScheduleGPipe, 2, rank=pp_rank, group=mesh["pp"].get_group(), n_micro=2,
                             wrap=lambda m: fully_shard(m, mesh=mesh["dp"]))
    half = [(x[dp_rank * B // 2:(dp_rank + 1) * B // 2], y[dp_rank * B // 2:(dp_rank + 1) * B // 2]) for x, y in data]
    params, metrics = run_pipeline(schedule, module, stack(groups=(mesh["pp"],)), mesh["pp"], half)
    assert all(isinstance(p, DTensor) for p in params.values())
    for name, p in params.items():
        assert_close(p.detach().full_tensor(), ref_params[name], f"param {name}")
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        assert_close(m["grad_norm"], r["grad_norm"], f"grad_norm at step {i}")


@case(2)
def case_interleaved_two_stages_per_rank(world):
    import fxtrain as fx
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    pp, data = pp_mesh(world), batches()
    ref_params, ref_metrics, grads0 = reference(stack(), data)
    rank, n = dist.get_rank(), 2 * world
    modules = {i: copy.deepcopy(full_model()[lo:hi]) for i, (lo, hi) in enumerate(SPLITS[4]) if i % world == rank}
    stages = [PipelineStage(m, i, n, torch.device("cpu"), group=pp["pp"].get_group()) for i, m in modules.items()]
    schedule = ScheduleInterleaved1F1B(stages, N_MICRO, loss_fn=loss_fn)
    params = {f"stage{i}": dict(m.named_parameters()) for i, m in modules.items()}
    params, metrics = run_pipeline(schedule, None, stack(groups=(pp["pp"],)), pp["pp"], data, params=params)
    flat = {k: v for stage in params.values() for k, v in stage.items()}
    check_against_reference(flat, metrics, ref_params, ref_metrics, grads0, pp["pp"].get_group())
    del fx


@case(2)
def case_refuses_params_that_are_not_the_stages(world):
    from torch.distributed.pipelining import ScheduleGPipe

    pp, rank = pp_mesh(world)["pp"], dist.get_rank()
    x, y = batches(1)[0]
    module, schedule = build(ScheduleGPipe, world)
    names = [n for n, _ in module.named_parameters()]
    own = dict(module.named_parameters())
    cases = {
        # Copies: the schedule computes gradients into the module, never into these (the first leaf in
        # flatten order, dict keys sorted, is named).
        "copied": ({k: v.detach().clone() for k, v in own.items()} if rank == 1 else own,
                   f"params['{min(names)}'] is not a parameter of the schedule's stage module"),
        # One left out: its gradient would be computed and never applied.
        "missing": ({k: v for k, v in own.items() if k != names[-1]} if rank == 1 else own,
                    f"the parameter stage 1 '{names[-1]}' of the schedule's stage module is not in params"),
    }
    for what, (params, message) in cases.items():
        tx = stack(groups=(pp,))
        import fxtrain as fx

        step = fx.parallel.pipeline_step(schedule, tx, pp_group=pp)
        before = {k: v.detach().clone() for k, v in own.items()}
        with pytest.raises(ValueError) as e:
            step(params, tx.init(params), (x, y))
        expected = message if rank == 1 else "another stage of the pp group (ranks [0, 1]) refused its params"
        assert expected in str(e.value), (what, str(e.value))
        assert all(torch.equal(v, before[k]) for k, v in own.items()), what  # nothing written


@case(2)
def case_refuses_a_stack_that_sees_one_stage(world):
    import fxtrain as fx
    from torch.distributed.pipelining import ScheduleGPipe

    pp = pp_mesh(world)["pp"]
    module, schedule = build(ScheduleGPipe, world)
    params = dict(module.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    for tx in (stack(), fx.accumulate(stack(), every=2)):  # clip without groups, also inside accumulate
        step, state = fx.parallel.pipeline_step(schedule, tx, pp_group=pp), tx.init(params)
        with pytest.raises(ValueError) as e:
            step(params, state, batches(1)[0])
        msg = str(e.value)
        assert "reports 'grad_norm' differently on the stages of the pp group (rank 0: inf, rank 1: 0)" in msg, msg
        assert "clip_by_global_norm(max_norm, groups=(pp_group,))" in msg, msg
        assert all(torch.equal(v, before[k]) for k, v in params.items())
    # With the group, the same stack (inside accumulate too) passes the probe and trains.
    tx = fx.accumulate(stack(groups=(pp,)), every=2)
    step, state = fx.parallel.pipeline_step(schedule, tx, pp_group=pp), tx.init(params)
    for batch in batches(2):
        params, state, m = step(params, state, batch)
    assert int(m["emitted"]) == 1 and not all(torch.equal(v, before[k]) for k, v in params.items())


@case(2)
def case_apply_if_finite_decides_over_its_groups(world):
    """apply_if_finite's skip decision over the pp group (groups=): without it each stage decides alone (the probe,
    inf on stage 0 only, sees total_notfinite 1 and 0: refused); with it both skip together, then train."""
    import fxtrain as fx
    from torch.distributed.pipelining import ScheduleGPipe

    pp = pp_mesh(world)["pp"]
    module, schedule = build(ScheduleGPipe, world)
    params = dict(module.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    tx = fx.apply_if_finite(stack(groups=(pp,)), max_consecutive_errors=1)
    with pytest.raises(ValueError, match=r"reports 'total_notfinite' differently on the stages of the pp group"):
        fx.parallel.pipeline_step(schedule, tx, pp_group=pp)(params, tx.init(params), batches(1)[0])
    assert all(torch.equal(v, before[k]) for k, v in params.items())
    tx = fx.apply_if_finite(stack(groups=(pp,)), max_consecutive_errors=1, groups=(pp,))
    step, state = fx.parallel.pipeline_step(schedule, tx, pp_group=pp), tx.init(params)
    params, state, m = step(params, state, batches(1)[0])
    assert int(state.total_notfinite) == 0 and not all(torch.equal(v, before[k]) for k, v in params.items())


@case(2)
def case_amp_cast_bf16_computes_like_one_process(world):
    """amp_cast(bf16) on the pipeline: the stage modules compute with amp_cast's bf16 casts of their params, as
    one process's train_step does with the whole model (issue 25: pp refused the bf16 preset), and the stack sees
    the mean of the micro-batches' gradients, as without amp (issue 35: torch's scale_grads divided the casts'
    missing .grad, so gpipe and 1f1b clipped and applied N_MICRO x the gradient)."""
    import fxtrain as fx
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    pp, data = pp_mesh(world), batches()
    amp = lambda tx: fx.amp_cast(tx, "p=f64,c=bf16,o=f64", loss_scale="none")  # noqa: E731
    wide = lambda logits, y: loss_fn(logits.double(), y)  # noqa: E731 - the loss of bf16 logits, in float64

    def one_process(tx):
        apply, params, buffers = fx.functional(full_model())
        step, state, metrics = fx.train_step(lambda p, b: wide(apply(p, buffers, b[0], train=True)[0], b[1]), tx), \
            tx.init(params), []
        for batch in data:
            params, state, m = step(params, state, batch)
            metrics.append(m)
        return params, metrics

    ref_params, ref_metrics = one_process(amp(stack()))
    _, off_metrics = one_process(stack())
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        module, schedule = build(lambda stage, n, loss_fn: schedule_cls(stage, n, loss_fn=wide), world)
        params, metrics = run_pipeline(schedule, module, amp(stack(groups=(pp["pp"],))), pp["pp"], data)
        for i, (m, r, off) in enumerate(zip(metrics, ref_metrics, off_metrics)):
            # bf16 forward passes as one process's: the same loss from the same params (step 0), then apart by
            # the micro-batches' bf16 gradients; far from float64's. The norm of the gradient the stack sees:
            # bf16 rounding of the micro-batches' backward (measured 2e-3 at most), not a factor.
            what = f"{schedule_cls.__name__} at step {i}"
            assert_close(m["loss"], r["loss"], f"loss, {what}", tol=1e-6 if i == 0 else 1e-3)
            assert_close(m["grad_norm"], r["grad_norm"], f"grad_norm, {what}", tol=1e-2)
            assert abs(float(m["loss"]) - float(off["loss"])) > 1e-4, (float(m["loss"]), float(off["loss"]))
        for name, p in params.items():
            assert p.dtype == torch.float64  # master weights keep their dtype
            assert_close(p.detach(), ref_params[name], f"param {name}", tol=1e-2)  # Adam: sign-like steps


@case(2)
def case_refuses_amp_casts_on_fully_sharded_stages(world):
    """FSDP's all-gather replaces what amp_cast's casts put in a stage module, so their gradients never reach the
    params (issue 35: pp_fsdp under bf16 trained on zeros): refused when the step is built; FSDP's own
    MixedPrecisionPolicy casts instead (the runner's pp_fsdp, tests/test_train_parallel.py)."""
    import fxtrain as fx
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import ScheduleGPipe

    mesh = pp_mesh(world)
    _, schedule = build(ScheduleGPipe, world, wrap=lambda m: fully_shard(m, mesh=mesh["dp"]))
    with pytest.raises(ValueError, match=r"casts the params in its forward \(amp_cast's compute dtype\), but stage "
                                         rf"{dist.get_rank()}'s module is fully_shard-ed, whose all-gather replaces "
                                         r"the casts: cast with fully_shard\(\.\.\., mp_policy=MixedPrecisionPolicy"):
        fx.parallel.pipeline_step(schedule, fx.amp_cast(stack(groups=(mesh["pp"],)), "p=f64,c=bf16,o=f64"),
                                  pp_group=mesh["pp"])
    # a policy that casts nothing (FSDP casts) is taken
    fx.parallel.pipeline_step(schedule, fx.amp_cast(stack(groups=(mesh["pp"],)), "p=f64,c=f64,o=f64"),
                              pp_group=mesh["pp"])


@case(2)
def case_refuses_wrong_group_amp_and_forward_only(world):
    import fxtrain as fx
    from torch.distributed.pipelining import ScheduleGPipe

    pp, rank = pp_mesh(world)["pp"], dist.get_rank()
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    _, schedule = build(ScheduleGPipe, world)
    with pytest.raises(ValueError, match=rf"pp_group \(a process group\) has ranks \[{rank}\], but stage {rank} "
                                         r"sends over ranks \[0, 1\]: pass the group \(or mesh\)"):
        fx.parallel.pipeline_step(schedule, stack(groups=(solo,)), pp_group=solo)
    with pytest.raises(ValueError, match=r"^pipeline_step: amp_cast scales the loss \(fp16\), which the schedule's "
                                         r"own loss_fn cannot take; use bf16 \(amp=bf16: no loss scale\)$"):
        fx.parallel.pipeline_step(schedule, fx.amp_cast(stack(groups=(pp,)), "p=f64,c=f16,o=f64"), pp_group=pp)
    _, forward_only = build(lambda stage, n, loss_fn: ScheduleGPipe(stage, n), world)
    with pytest.raises(ValueError, match=r"ScheduleGPipe has no loss_fn, so it runs no backward"):
        fx.parallel.pipeline_step(forward_only, stack(groups=(pp,)), pp_group=pp)


test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
