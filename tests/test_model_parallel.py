"""Tests for the parallel layouts of fxtrain/models.py's TransformerLM: ``tp_plan`` and ``pipeline_stage``.

The built-in LM in float64 (LayerNorm params moved off (1, 0) so their gradients matter) is parallelized
with its own plan by ``fx.parallel.tensor_parallel`` on 2 ranks (tp, with and without sequence
parallelism) and 4 (dp x tp, 2 x 2), and split by its own ``pipeline_stage`` into torch's
``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` under ``fx.parallel.pipeline_step`` on 2 ranks
and 4 (uneven: 5 blocks); each trains 3 clipped AdamW steps and must equal a single-process fxtrain run of
the same model on the full batch, computed in the same test (1e-12: float64, reduction orders differ).
The tied head is the delicate part: one DTensor under TP, one owner (the first stage) under PP.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests import _worlds

CASES, case = _worlds.registry(worlds=(2, 4))
TIMEOUT_S = 240
V, T, B = 32, 8, 4  # vocabulary, tokens, global batch
MAX_NORM, LR = 0.1, 1e-2  # the gradients' norm is ~1: every step clips
TOL = 1e-12


def model(n_layers: int = 2, n_heads: int = 4, d_model: int = 16):
    from fxtrain.models import TransformerLM

    torch.manual_seed(0)
    m = TransformerLM(vocab_size=V, context=T, d_model=d_model, n_layers=n_layers, n_heads=n_heads).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".ln" in name or name.startswith("ln_f"):
                p.add_(0.1 * torch.randn_like(p))
    return m


def batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(n)]


def cross_entropy(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def stack(groups=()):
    import fxtrain as fx

    # A tensor learning rate keeps every side on the foreach AdamW (tests/test_pipeline.py says why).
    return fx.chain(fx.clip_by_global_norm(MAX_NORM, groups=groups),
                    fx.sharded_apply(fx.adamw(torch.tensor(LR, dtype=torch.float64))))


def train(apply, params, buffers, tx, data):
    import fxtrain as fx

    def loss_fn(params, batch):
        tokens, targets = batch
        return cross_entropy(apply(params, buffers, tokens, train=True)[0], targets)

    step, state, metrics = fx.train_step(loss_fn, tx), tx.init(params), []
    for batch in data:
        params, state, m = step(params, state, batch)
        metrics.append(m)
    return params, metrics


_REFERENCE: dict = {}


def reference(n_layers: int = 2) -> tuple[dict, list]:
    """A single-process fxtrain run of the same model on the full batches: (params, metrics per step)."""
    import fxtrain as fx

    if n_layers not in _REFERENCE:
        _REFERENCE[n_layers] = train(*fx.functional(model(n_layers)), stack(), batches())
    return _REFERENCE[n_layers]


def assert_matches_reference(params: dict, metrics: list, ref_params: dict, ref_metrics: list, dp=None) -> None:
    """``params`` (this rank's, by the model's names) and every step's loss and clip norm equal the reference's.

    ``dp``: the data-parallel mesh whose ranks each report the loss of their own slice (their mean is the
    reference's, equal slices of a mean loss).
    """
    from torch.distributed.tensor import DTensor

    assert params and set(params) <= set(ref_params)
    for k, p in params.items():
        got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        assert got.dtype == torch.float64
        err = float((got - ref_params[k]).abs().max())
        assert err <= TOL * max(1.0, float(ref_params[k].abs().max())), (k, err)
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        loss = m["loss"].detach().double().clone()
        if dp is not None:
            dist.all_reduce(loss, group=dp.get_group())
            loss /= dp.size()
        assert math.isclose(float(loss), float(r["loss"]), rel_tol=TOL), (i, float(loss), float(r["loss"]))
        assert math.isclose(float(m["grad_norm"]), float(r["grad_norm"]), rel_tol=TOL), (i, float(m["grad_norm"]))
    assert float(ref_metrics[0]["grad_norm"]) > MAX_NORM  # the clip acted


_MESHES: dict = {}


def mesh(shape: tuple, names: tuple):
    from torch.distributed.device_mesh import init_device_mesh

    if names not in _MESHES:
        _MESHES[names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[names]


# --- tensor parallel --------------------------------------------------------------------------------

def tensor_parallel_run(m, plan, on, data):
    import fxtrain as fx

    apply, params, buffers = fx.parallel.tensor_parallel(m, plan, on)
    if on.ndim == 2:  # this rank's dp slice of every batch
        n, r = on.size(0), on.get_local_rank(0)
        data = [tuple(x.tensor_split(n)[r] for x in batch) for batch in data]
    return train(apply, params, buffers, stack(), data)


@case(2)
def case_tp_plans_match_one_process(world):
    from torch.distributed.tensor import DTensor, Shard

    ref = reference()
    for sequence_parallel in (True, False):
        m = model()
        params, metrics = tensor_parallel_run(m, m.tp_plan(sequence_parallel=sequence_parallel),
                                              mesh((world,), ("tp",)), batches())
        assert_matches_reference(params, metrics, *ref)
        # the tie survived: one Shard(0) DTensor (vocabulary rows) serves the embedding and the head
        assert m.head.weight is m.tok.weight and "head.weight" not in params
        assert params["tok.weight"].placements == (Shard(0),)
        assert params["blocks.0.attn.q.weight"].to_local().shape == (8, 16)  # 2 of the 4 heads here
        assert isinstance(params["ln_f.weight"], DTensor) == sequence_parallel


@case(4)
def case_dp_x_tp_plan_matches_one_process(world):
    from torch.distributed.tensor import Replicate

    m = model()
    on = mesh((2, 2), ("dp", "tp"))
    params, metrics = tensor_parallel_run(m, m.tp_plan(), on, batches())
    assert_matches_reference(params, metrics, *reference(), dp=on["dp"])
    assert all(p.device_mesh == on and p.placements[0] == Replicate() for p in params.values())


@case(2)
def case_tp_refuses_heads_that_do_not_divide(world):
    import fxtrain as fx
    from fxtrain.models import TransformerLM

    m = model(n_heads=3, d_model=12)
    with pytest.raises(ValueError, match=r"^TransformerLM.tp_plan: model.n_heads=3 is not divisible by the tp "
                                         r"size 2; pick n_heads a multiple of parallel.tp$"):
        fx.parallel.tensor_parallel(m, m.tp_plan(), mesh((world,), ("tp",)))
    with pytest.raises(ValueError, match=r"model.experts=4 \(MoE blocks\) has no tensor-parallel plan; .*parallel=ep"):
        TransformerLM(vocab_size=V, context=T, d_model=16, n_layers=1, n_heads=4, experts=4).tp_plan()


# --- pipeline parallel ------------------------------------------------------------------------------

def pipeline_run(schedule_cls, n_layers: int, world: int, n_micro: int = 2):
    import fxtrain as fx
    from torch.distributed.pipelining import PipelineStage

    pp = mesh((world,), ("pp",))
    rank = dist.get_rank()
    stage_module = model(n_layers).pipeline_stage(rank, world)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"), group=pp.get_group())
    schedule = schedule_cls(stage, n_micro, loss_fn=cross_entropy)
    tx = stack(groups=(pp,))
    params = dict(stage_module.named_parameters())
    step, state, metrics = fx.parallel.pipeline_step(schedule, tx, pp_group=pp), tx.init(params), []
    for batch in batches():
        params, state, m = step(params, state, batch)
        metrics.append(m)
    return stage_module, params, metrics


@case(2)
def case_pipeline_stages_match_one_process(world):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        stage_module, params, metrics = pipeline_run(schedule_cls, 2, world)
        assert_matches_reference(params, metrics, *reference(2))
        # the first stage owns tok.weight (embedding and head); the last holds no copy of it
        assert ("tok.weight" in params) == (dist.get_rank() == 0) and "head.weight" not in params


@case(4)
def case_uneven_pipeline_passes_the_tied_weight_through(world):
    from torch.distributed.pipelining import ScheduleGPipe

    stage_module, params, metrics = pipeline_run(ScheduleGPipe, 5, world)
    assert_matches_reference(params, metrics, *reference(5))
    assert list(stage_module.blocks._modules) == [["0", "1"], ["2"], ["3"], ["4"]][dist.get_rank()]
    names = [None] * world
    dist.all_gather_object(names, sorted(params))
    assert sorted(n for ns in names for n in ns) == sorted(reference(5)[0])  # the stages hold every param once


# --- single process ---------------------------------------------------------------------------------

def test_stages_hold_the_models_params_once_and_compose_to_it():
    import fxtrain as fx

    m = model(n_layers=3)
    stages = [m.pipeline_stage(i, 3) for i in range(3)]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(fx.functional(m)[1])
    x = batches(1)[0][0]
    out = stages[0](x)
    for s in stages[1:]:
        out = s(*out) if isinstance(out, tuple) else s(out)
    assert torch.equal(out, m(x))


def test_pipeline_stage_refuses_more_stages_than_blocks():
    with pytest.raises(ValueError, match=r"^TransformerLM.pipeline_stage: parallel.pp=3 stages need at least one "
                                         r"block each, but model.n_layers=2; lower parallel.pp or raise "
                                         r"model.n_layers$"):
        model(n_layers=2).pipeline_stage(0, 3)
    with pytest.raises(ValueError, match=r"stage=2 is not in 0..1"):
        model(n_layers=2).pipeline_stage(2, 2)


# --- the pytest side: one spawned world per world size runs every case (tests/_worlds.py) ----------------

test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
