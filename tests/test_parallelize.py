"""Tests for fxtrain/parallel/_parallelize.py and fxtrain/distributed/_mesh.py that need no process group: the
degrees a layout resolves to, the questions the mesh object answers, the presets of conf/parallel, and the
refusals a model or a composition gets before any mesh is used (the multi-process runs are in
tests/test_train_parallel.py)."""

from __future__ import annotations

import pytest
import torch

import fxtrain as fx
from fxtrain import build, distributed, parallel, validate
from fxtrain import train as runner
from fxtrain.distributed import ParallelDims
from fxtrain.models import MLP, TransformerLM
from tests._runner import cfg_of


def dims(world: int = 2, **degrees: int) -> ParallelDims:
    return ParallelDims.of(world=world, **degrees)  # not built: the refusals come before the mesh


def test_degrees_resolve_the_rest_of_the_world_and_answer_questions():
    d = dims(8, pp=2, dp_shard=-1, tp=2)
    assert d.degrees == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "ep": 1, "cp": 1, "tp": 2}
    assert d.mesh_dims == ("pp", "dp_shard", "tp") and d.data_world == 2 and d.params_sharded
    assert [d.enabled(x) for x in ("pp", "dp_replicate", "tp")] == [True, False, True]
    hsdp = dims(4, dp_replicate=2, dp_shard=-1)
    assert hsdp.mesh_dims == ("dp_replicate", "dp_shard") and hsdp.data_world == 4
    ep = dims(4, ep=2, dp_shard=2)
    assert ep.mesh_dims == ("dp_shard", "ep") and ep.data_world == 4 and ep.describe() == "parallel dp_shard=2 x ep=2"
    one = dims(1)
    assert one.mesh_dims == () and one.data_world == 1 and one.describe() == "parallel=none"
    batch = (torch.arange(8), torch.arange(8))
    assert one.local_batch(batch) is batch and one.data_rank == 0


@pytest.mark.parametrize("degrees,message", [
    ({"dp_shard": 3, "tp": 2}, r"^dp_shard=3 x tp=2 = 6 ranks, but the world has 4: make the product 4"),
    ({"dp_shard": -1, "tp": 3}, r"^tp=3 = 3 ranks does not divide the world of 4"),
    ({"dp_shard": -1, "tp": -1}, r"^dp_shard=-1 and tp=-1: only one degree can take the rest"),
    ({"tp": 0}, r"^tp=0: expected a positive whole number of ranks, or -1"),
    ({"sp": 2}, r"^sp: not a parallel degree; the degrees are pp, dp_replicate, dp_shard, ep, cp, tp"),
])
def test_bad_degrees_are_named(degrees, message):
    with pytest.raises(ValueError, match=message):
        dims(4, **degrees)


def test_the_mesh_is_asked_for_after_build():
    with pytest.raises(ValueError, match=r"submesh\('dp_shard',\): the mesh is not built"):
        dims(2, dp_shard=2).submesh("dp_shard")


@pytest.mark.parametrize("preset,world,degrees", [
    ("none", 1, {}), ("dp", 2, {"dp_replicate": 2}), ("fsdp", 2, {"dp_shard": 2}),
    ("hsdp", 4, {"dp_replicate": 2, "dp_shard": 2}), ("tp", 2, {"tp": 2}), ("fsdp_tp", 4, {"dp_shard": 2, "tp": 2}),
    ("pp", 2, {"pp": 2}), ("pp_fsdp", 4, {"pp": 2, "dp_shard": 2}), ("pp_tp", 4, {"pp": 2, "tp": 2}),
    ("3d", 8, {"pp": 2, "dp_shard": 2, "tp": 2}), ("ep", 2, {"ep": 2}), ("ep_fsdp", 4, {"ep": 2, "dp_shard": 2}),
    ("ep_tp", 4, {"ep": 2, "tp": 2}), ("pp_ep", 4, {"pp": 2, "ep": 2}),
])
def test_presets_are_degrees(preset, world, degrees):
    got = build.parallel_dims(cfg_of("experiment=smoke", f"parallel={preset}"), world)
    assert {d: s for d, s in got.degrees.items() if s > 1} == degrees


def test_degrees_without_a_preset_and_old_keys():
    got = build.parallel_dims(cfg_of("experiment=smoke", "parallel.tp=2", "parallel.dp_shard=-1"), 8)
    assert got.describe() == "parallel dp_shard=4 x tp=2"
    with pytest.raises(build.ConfigError, match=r"^parallel.dp=2: expected null \(the key before degrees: use "
                                                r"parallel.dp_replicate .* or parallel.dp_shard"):
        validate.check(cfg_of("experiment=smoke", "parallel.dp=2"))


@pytest.mark.parametrize("degrees,message", [
    ({"tp": 2}, r"parallel tp=2: MLP has no tensor-parallel plan \(tp_plan\); use model=transformer or model=moe"),
    ({"dp_shard": 1, "tp": 2}, r"parallel tp=2: MLP has no tensor-parallel plan"),
    ({"pp": 2}, r"parallel pp=2: MLP has no pipeline split \(pipeline_stage\); use model=transformer"),
])
def test_a_model_without_a_degree_is_named(degrees, message):
    with pytest.raises(ValueError, match=message):
        parallel.parallelize(MLP((4,), (8,), 2), fx.sgd(0.1), dims(2, **degrees))


@pytest.mark.parametrize("degrees,message", [
    ({"pp": 2, "dp_replicate": 2}, r"^parallel pp=2 x dp_replicate=2: pipeline replicas are FSDP-sharded stages; "
                                   r"use parallel.dp_shard"),
])
def test_compositions_the_runner_does_not_build_are_named(degrees, message):
    with pytest.raises(ValueError, match=message):
        parallel.parallelize(TransformerLM(d_model=8, n_heads=2, experts=2 if "ep" in degrees else 0),
                             fx.sgd(0.1), dims(4, **degrees))


def test_pipeline_schedule_and_split_are_checked():
    with pytest.raises(ValueError, match=r"parallel.schedule=zb: expected one of gpipe, 1f1b"):
        parallel.parallelize(TransformerLM(d_model=8, n_heads=2), fx.sgd(0.1), dims(2, pp=2),
                             pipeline={"schedule": "zb"})
    with pytest.raises(ValueError, match=r"parallel.pp=3 stages need at least one block each, but model.n_layers=2"):
        TransformerLM(d_model=8, n_heads=2, n_layers=2).pipeline_stage(0, 3)


def test_one_process_is_fx_functional_and_train_step():
    torch.manual_seed(0)
    model = MLP((4,), (8,), 2)
    placed = parallel.parallelize(model, fx.sgd(0.1), ParallelDims.of(world=1))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 0, 1])
    params, _, _, metrics = placed.step(placed.params, fx.sgd(0.1).init(placed.params), placed.buffers, (x, y))
    assert set(metrics) >= {"loss", "accuracy"} and float(metrics["loss"]) > 0
    assert set(placed.evaluate(params, placed.buffers, (x, y), 4)) == {"test_loss", "test_accuracy"}


@pytest.mark.parametrize("preset", sorted(p.stem for p in (runner.CONF_DIR / "parallel").glob("*.yaml")
                                           if not p.stem.startswith("_")))
def test_a_preset_on_one_process_says_that_nothing_is_split(preset):
    """Issue 35: parallel=tp on one process trained unsharded without a line. The presets' -1 degrees take the
    rest of the world by design (one command on 1 or N processes), so the run line says it instead of refusing."""
    cfg = cfg_of("experiment=smoke", f"parallel={preset}")
    if any(cfg.parallel.get(d) not in (1, -1, None) for d in distributed.DIMS):
        with pytest.raises(build.ConfigError, match=r"needs several processes: launch with torchrun"):
            build.parallel_dims(cfg, 1)  # a fixed size (hsdp's dp_replicate=2) is refused on one process
        return
    note = build.single_process_note(cfg, build.parallel_dims(cfg, 1))
    free = [d for d in ("pp", "dp_replicate", "dp_shard", "ep", "tp") if cfg.parallel.get(d) == -1]
    assert (note is None) == (not free)
    if free:
        assert note.startswith(f"1 process: parallel.{free[0]}=-1 takes the rest of a world of 1, so nothing is split")
    if preset in ("dp", "fsdp", "tp"):  # on 2 ranks the layout is there: nothing to say
        assert build.single_process_note(cfg, build.parallel_dims(cfg, 2)) is None
