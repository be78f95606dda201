"""Tests for fxtrain/parallel/_parallelize.py that need no process group: the refusals a model gets before any mesh is
used (the multi-process runs are in tests/test_train_parallel.py)."""

from __future__ import annotations

import pytest
import torch

import fxtrain as fx
from fxtrain import parallel as strategies
from fxtrain.distributed import ParallelDims
from fxtrain.models import MLP, TransformerLM


def dims(strategy: str, **sizes: int) -> ParallelDims:
    return ParallelDims.of(strategy, world=2, **sizes)  # not built: the refusals come before the mesh


@pytest.mark.parametrize("strategy,sizes,message", [
    ("tp", {"tp": 2}, r"parallel=tp: MLP has no tensor-parallel plan \(tp_plan\); use model=transformer or model=moe"),
    ("fsdp_tp", {"dp": 1, "tp": 2}, r"parallel=fsdp_tp: MLP has no tensor-parallel plan"),
    ("pp", {"pp": 2}, r"parallel=pp: MLP has no pipeline split \(pipeline_stage\); use model=transformer"),
])
def test_a_model_without_the_strategy_is_named(strategy, sizes, message):
    with pytest.raises(ValueError, match=message):
        strategies.parallelize(MLP((4,), (8,), 2), fx.sgd(0.1), dims(strategy, **sizes))


def test_pipeline_schedule_and_split_are_checked():
    with pytest.raises(ValueError, match=r"parallel.schedule=zb: expected one of gpipe, 1f1b"):
        strategies.parallelize(TransformerLM(d_model=8, n_heads=2), fx.sgd(0.1), dims("pp", pp=2),
                               pipeline={"schedule": "zb"})
    with pytest.raises(ValueError, match=r"parallel.pp=3 stages need at least one block each, but model.n_layers=2"):
        TransformerLM(d_model=8, n_heads=2, n_layers=2).pipeline_stage(0, 3)


def test_one_process_is_fx_functional_and_train_step():
    torch.manual_seed(0)
    model = MLP((4,), (8,), 2)
    placed = strategies.parallelize(model, fx.sgd(0.1), ParallelDims.of("none", world=1))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 0, 1])
    params, _, _, metrics = placed.step(placed.params, fx.sgd(0.1).init(placed.params), placed.buffers, (x, y))
    assert set(metrics) >= {"loss", "accuracy"} and float(metrics["loss"]) > 0
    assert set(placed.evaluate(params, placed.buffers, (x, y), 4)) == {"test_loss", "test_accuracy"}
