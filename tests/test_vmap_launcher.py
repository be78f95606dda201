"""hydra/launcher=vmap (hydra_plugins/fxtrain_vmap_launcher, fxtrain/sweep.py): a sweep trained as one vmapped
process gives every job the numbers, files and summaries of the basic launcher's sweep; jobs that cannot be
batched are grouped apart or run one by one, with a note.

Tolerance of the comparisons with the basic launcher: relative 2e-5, absolute 1e-6 on every logged float
(loss, accuracy, grad_norm, learning_rate, test metrics) after 30 AdamW steps. A batched matmul sums in another
order than the unbatched one, so values agree to float32 rounding per step, and 30 steps of AdamW (which
divides by sqrt(nu)) grow those last-bit differences to a few 1e-6 relative; a real difference (another
learning rate, another batch, a skipped step) moves these numbers by far more than 2e-5.
"""

import csv
import json
import math
import os
import pathlib

import pytest
import torch
from torch._dynamo.utils import counters

import fxtrain as fx
import fxtrain.models
from fxtrain import sweep
from fxtrain import train as runner
from fxtrain.models import MLP
from fxtrain.report import read_jsonl
from tests._runner import cfg_of, isolate, load_checkpoint, run_main  # noqa: F401 - isolate: autouse

RTOL, ATOL = 2e-5, 1e-6
FAST = ["experiment=smoke", "trainer.device=cpu", "trainer.cpu_threads=1", "trainer.progress=false"]
SWEEP = [*FAST, "trainer.max_steps=30", "trainer.log_every=5", "trainer.eval_every=15", "trainer.checkpoint_every=15"]


def sweep_of(launcher, *overrides):
    """Runs ``-m SWEEP overrides`` with ``hydra/launcher=launcher`` into ./<launcher>; returns the sweep directory."""
    assert run_main("-m", f"hydra/launcher={launcher}", *SWEEP, *overrides, f"hydra.sweep.dir={launcher}") == 0
    return pathlib.Path(launcher)


def records(job):
    return [{k: v for k, v in r.items() if k != "time_s"} for r in read_jsonl(job / "metrics.jsonl")]


def assert_close_records(a, b, where):
    assert [sorted(r) for r in a] == [sorted(r) for r in b], where                 # same steps, same keys
    for ra, rb in zip(a, b):
        for k in ra:
            assert math.isclose(ra[k], rb[k], rel_tol=RTOL, abs_tol=ATOL), f"{where} step {ra['step']} {k}: {ra[k]} vs {rb[k]}"


def assert_same_sweep(basic, vmapped, jobs, checkpoints=("step_0000015", "step_0000030"), tested="best"):
    """Every job's metrics.jsonl, summary.json, config, checkpoints (``checkpoints[job]`` or the same for all, besides
    best) and summary.csv row equal within RTOL/ATOL; each job tested on its ``tested`` checkpoint."""
    for job in map(str, range(jobs)):
        assert_close_records(records(basic / job), records(vmapped / job), f"job {job} metrics.jsonl")
        sa, sb = (json.loads((d / job / "summary.json").read_text()) for d in (basic, vmapped))
        assert sa["status"] == sb["status"] == "completed" and sa["step"] == sb["step"]
        assert sorted(sa["metrics"]) == sorted(sb["metrics"])
        for k in sa["metrics"]:
            assert math.isclose(sa["metrics"][k], sb["metrics"][k], rel_tol=RTOL, abs_tol=ATOL), f"job {job} {k}"
        assert (basic / job / "config.yaml").read_text() == (vmapped / job / "config.yaml").read_text()
        assert (basic / job / ".hydra" / "overrides.yaml").read_text() == (vmapped / job / ".hydra" / "overrides.yaml").read_text()
        assert sa["best_step"] == sb["best_step"], f"job {job} best_step"      # test_* on the same best checkpoint
        assert [s["test_ckpt"].split(" (")[0] for s in (sa, sb)] == [tested, tested], f"job {job} test_ckpt"
        assert any(k.startswith("test_") for k in sb["metrics"]), f"job {job}: no test_* in summary.json"
        listed = [sorted(p.name for p in (d / job / "checkpoints").iterdir()) for d in (basic, vmapped)]
        own = checkpoints[int(job)] if isinstance(checkpoints, dict) else checkpoints
        assert listed[0] == listed[1] == ["best", *own], f"job {job} checkpoints"
        stacks = [[ln.split("] ", 1)[-1] for ln in (d / job / "train.log").read_text().splitlines() if "] stack  " in ln]
                  for d in (basic, vmapped)]
        assert stacks[0] == stacks[1] and len(stacks[0]) == 1, f"job {job}: {stacks}"
    rows = [list(csv.DictReader((d / "summary.csv").read_text().splitlines())) for d in (basic, vmapped)]
    assert [r["job"] for r in rows[1]] == [str(j) for j in range(jobs)]
    floats = ("loss", "accuracy", "val_loss", "val_accuracy", "test_loss", "test_accuracy")  # within the tolerance
    assert [{k: v for k, v in r.items() if k not in ("time_s", *floats)} for r in rows[0]] == \
        [{k: v for k, v in r.items() if k not in ("time_s", *floats)} for r in rows[1]]
    for ra, rb in zip(*rows):
        assert sorted(ra) == sorted(rb) and any(k in ra for k in floats)
        for k in (k for k in floats if k in ra):
            assert math.isclose(float(ra[k]), float(rb[k]), rel_tol=RTOL, abs_tol=ATOL), f"summary.csv job {ra['job']} {k}"


def test_learning_rates_and_seeds_match_the_basic_launcher(capsys):
    grid = ["optim.chain.adamw.learning_rate=3e-3,1e-2,3e-2", "seed=0,1"]
    basic = sweep_of("basic", *grid)
    vmapped = sweep_of("vmap", *grid)
    out = capsys.readouterr().out
    assert "vmap   jobs 0,1,2,3,4,5 as one process: 6 jobs, batched over optim.chain.adamw.learning_rate, seed" in out
    assert_same_sweep(basic, vmapped, 6)
    # A job's checkpoint is its own run's TrainState: the same params as the basic launcher's job.
    cfg = cfg_of(*SWEEP, "optim.chain.adamw.learning_rate=1e-2", "seed=1")
    a, b = (load_checkpoint(d / "3" / "checkpoints" / "step_0000030", cfg) for d in (basic, vmapped))
    for x, y in zip(fx.tree.leaves(a.params), fx.tree.leaves(b.params)):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=1e-5)
    assert torch.equal(a.rng["cpu"], b.rng["cpu"])


def test_clip_and_schedule_values_are_batched_too(capsys):
    grid = ["optim.chain.clip_by_global_norm.max_norm=0.1,1.0", "schedule.alpha=0.0,0.5"]
    basic = sweep_of("basic", *grid)
    vmapped = sweep_of("vmap", *grid)
    assert ("batched over optim.chain.clip_by_global_norm.max_norm, schedule.alpha; one batch for all"
            in capsys.readouterr().out)
    assert_same_sweep(basic, vmapped, 4)


def test_a_nan_job_fails_alone_and_the_group_goes_on(capsys):
    # 1e30: a learning rate the settings accept (inf is refused before training, as each job's own run refuses it)
    code = run_main("-m", "hydra/launcher=vmap", *FAST, "schedule=constant", "optim.chain.adamw.learning_rate=1e30,0.01",
                    "trainer.max_steps=4", "trainer.log_every=1", "hydra.sweep.dir=sweep")
    assert code == 1
    rows = list(csv.DictReader(pathlib.Path("sweep/summary.csv").read_text().splitlines()))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "completed")]
    assert rows[0]["error"].startswith("FloatingPointError: loss is nan at step 2")
    assert [r["step"] for r in read_jsonl("sweep/0/metrics.jsonl")] == [1]
    captured = capsys.readouterr()
    assert "vmap   jobs 0,1 as one process" in captured.out
    assert "[fxtrain] job 0 failed (" in captured.err


def test_resume_auto_continues_each_job_of_a_killed_group():
    grid = ["optim.chain.adamw.learning_rate=1e-2,3e-2", "hydra.sweep.dir=sweep", "resume=auto", "trainer.keep_last=0",
            "logger=[jsonl,csv]"]
    assert run_main("-m", "hydra/launcher=vmap", *SWEEP, *grid) == 0
    whole = {j: records(pathlib.Path("sweep", j)) for j in "01"}
    for j in "01":  # as if killed after the checkpoint of step 15: later lines, checkpoints and summary gone
        job = pathlib.Path("sweep", j)
        (job / "summary.json").unlink()
        for p in (job / "checkpoints" / "step_0000030").iterdir():
            p.unlink()
        (job / "checkpoints" / "step_0000030").rmdir()
        lines = (job / "metrics.jsonl").read_text().splitlines()
        (job / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n")               # steps 5..20
    assert run_main("-m", "hydra/launcher=vmap", *SWEEP, *grid) == 0
    for j in "01":
        assert_close_records(whole[j], records(pathlib.Path("sweep", j)), f"job {j}")
        assert "checkpoints/step_0000015 (step 15)" in pathlib.Path("sweep", j, "train.log").read_text()
        # The other loggers restart at the resumed step too (metrics.csv: rows after step 15 cut, then rewritten).
        rows = list(csv.DictReader(pathlib.Path("sweep", j, "metrics.csv").read_text().splitlines()))
        assert [int(r["step"]) for r in rows] == [r["step"] for r in whole[j]]


def same_stops(basic, vmapped):
    """Both jobs' metrics, steps, early stops and checkpoints equal between the launchers; the vmapped summaries."""
    summaries = []
    for job in "01":
        assert_close_records(records(basic / job), records(vmapped / job), f"job {job} metrics.jsonl")
        sa, sb = (json.loads((d / job / "summary.json").read_text()) for d in (basic, vmapped))
        stop_a, stop_b = sa.get("stopped_early", {}), sb.get("stopped_early", {})
        assert sa["step"] == sb["step"] and sorted(stop_a) == sorted(stop_b)
        assert all(math.isclose(stop_a[k], stop_b[k], rel_tol=RTOL) if k == "best" else stop_a[k] == stop_b[k]
                   for k in stop_a)
        assert sorted(p.name for p in (basic / job / "checkpoints").iterdir()) == \
            sorted(p.name for p in (vmapped / job / "checkpoints").iterdir())
        summaries.append(sb)
    return summaries


def test_eval_hooks_and_early_stopping_run_per_job_as_the_basic_launcher_runs_them(capsys):
    # One loop for a run and a group (fxtrain.train.loop): each job evaluates its hooks and stops early alone.
    grid = ["optim.chain.adamw.learning_rate=3e-2,1e-3", "+trainer.eval_hooks.cal._target_=tests.test_tasks.calibration",
            "trainer.early_stopping.metric=loss", "trainer.early_stopping.patience=2",
            "trainer.early_stopping.min_delta=0.05"]
    basic, vmapped = sweep_of("basic", *grid), sweep_of("vmap", *grid)
    assert "vmap   jobs 0,1 as one process: 2 jobs" in capsys.readouterr().out
    summaries = same_stops(basic, vmapped)
    # lr 3e-2 reaches its plateau (no 0.05 better than step 10's loss for 2 lines): it stops alone; 1e-3 goes on.
    assert summaries[0]["stopped_early"]["step"] == 20 and summaries[0]["step"] == 20
    assert "stopped_early" not in summaries[1] and summaries[1]["step"] == 30
    assert "confidence" in records(vmapped / "1")[-1]                               # the hook's metric, per job


def test_jobs_that_differ_in_early_stopping_share_a_group_and_stop_each_on_its_own(capsys):
    # Patience 2 stops at its plateau (step 20); patience 30 trains on to 30, in the same process.
    grid = ["optim.chain.adamw.learning_rate=3e-2", "trainer.early_stopping.metric=loss",
            "trainer.early_stopping.min_delta=0.05", "trainer.early_stopping.patience=2,30",
            "trainer.checkpoint.best_by=val_loss"]
    basic, vmapped = sweep_of("basic", *grid), sweep_of("vmap", *grid)
    out = capsys.readouterr().out
    assert "vmap   jobs 0,1 as one process: 2 jobs, batched over trainer.early_stopping.patience" in out
    assert [s["step"] for s in same_stops(basic, vmapped)] == [20, 30]


# --- the compiled group step (hydra.launcher.compile=true) -------------------------------------------

# Two groups of the same config and shapes (max_group_size=2), each batched over the learning rate; log_every=7
# makes chunks of 7, 7, 1, 6, 7 and 2 steps between the events of 30 steps.
COMPILED = ["seed=0,1", "optim.chain.adamw.learning_rate=1e-2,3e-2", "hydra.launcher.max_group_size=2",
            "trainer.log_every=7"]


@pytest.mark.multiprocess  # inductor compiles two graphs: about a minute on two cores
def test_the_compiled_group_step_matches_eager_and_compiles_once(capsys):
    eager = sweep_of("vmap", *COMPILED)
    torch._dynamo.reset()
    counters.clear()
    sweep.Compiled.graphs.clear()
    assert run_main("-m", "hydra/launcher=vmap", *SWEEP, *COMPILED, "hydra.launcher.compile=true",
                    "hydra.sweep.dir=compiled") == 0
    out = capsys.readouterr()
    assert "vmap   jobs 0,1 as one process" in out.out and "vmap   jobs 2,3 as one process" in out.out
    assert "runs eagerly" not in out.out + out.err
    # One graph for the step (every chunk length, both groups) and one per evaluation chunk shape; each compiled
    # once: nothing compiles again for the second group, whose learning rates and seed differ.
    keys = list(sweep.Compiled.graphs)
    assert [k[0][0] for k in keys].count("train") == 1 and len(keys) == counters["stats"]["unique_graphs"] <= 3
    assert_same_sweep(eager, pathlib.Path("compiled"), 4)


def test_a_failed_compilation_runs_the_group_eagerly_with_one_line(monkeypatch, capsys, tmp_path):
    def refuse(*args):
        raise RuntimeError("no compiler here\nsecond line")

    monkeypatch.setattr(sweep, "_trace", refuse)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))  # restored after: the launcher sets it
    grid = ["optim.chain.adamw.learning_rate=1e-2,3e-2", "trainer.max_steps=10", "trainer.eval_every=5"]
    eager = sweep_of("vmap", *grid)
    assert run_main("-m", "hydra/launcher=vmap", *SWEEP, *grid, "hydra.launcher.compile=true",
                    "hydra.sweep.dir=fallback", "hydra.launcher.cache_dir=compiled_code") == 0
    out = capsys.readouterr()
    # The compiled code's directory (torch's caches across processes) is the one the config names.
    cache = pathlib.Path("compiled_code").resolve()
    assert f"[vmap] compiled code cached in {cache}" in out.out + out.err and cache.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    lines = [ln for ln in (out.out + out.err).splitlines() if "runs eagerly" in ln]
    assert [ln.split("vmap   ", 1)[1] for ln in lines] == [
        "the vmapped step runs eagerly: torch.compile failed (RuntimeError: no compiler here)",
        "the vmapped evaluation runs eagerly: torch.compile failed (RuntimeError: no compiler here)"]
    for job in "01":  # the eager vmapped update (compile's own path) against the members' fused kernels
        assert_close_records(records(eager / job), records(pathlib.Path("fallback", job)), f"job {job}")


def test_vmapped_evaluation_equals_each_jobs_own():
    # One vmapped call evaluates every member (GroupSteps.evaluate_all); each job's own evaluate_run agrees.
    cfgs = [cfg_of(*SWEEP, f"optim.chain.adamw.learning_rate={lr}", f"seed={s}") for lr, s in ((1e-2, 0), (3e-2, 1))]
    built = [runner.build_run(c, torch.device("cpu")) for c in cfgs]
    states = [fx.TrainState(0, b.params, b.opt_state, fx.rng_state(), b.buffers) for b in built]
    hp = sweep.hyperparams({"optim.chain.adamw.learning_rate": [1e-2, 3e-2]})
    group = sweep.GroupSteps(cfgs[0], built, states, hp, shared_data=False)
    group.advance(0, 7)
    vmapped = [group.evaluate(7, j, []) for j in range(2)]
    own = [runner.evaluate_run(b, sweep.pick(group.params, j), sweep.pick(group.buffers, j), 7, [], 512)
           for j, b in enumerate(built)]
    assert sorted(vmapped[0]) == sorted(own[0]) == ["val_accuracy", "val_loss"]
    for a, b in zip(vmapped, own):
        for k in a:
            assert math.isclose(a[k], b[k], rel_tol=RTOL, abs_tol=ATOL), k
    assert vmapped[0] != vmapped[1]  # each member its own params (and seed)


# --- the update half: each member's fused kernel on its slices (sweep.MemberKernels) ----------------------

def group_of(values, *overrides, key="optim.chain.adamw.learning_rate", **kwargs):
    """A GroupSteps of the smoke experiment at these values of ``key`` (one batch for all), and each job's own run."""
    cfgs = [cfg_of(*SWEEP, *overrides, f"{key}={v}") for v in values]
    data = runner.build_run(cfgs[0], torch.device("cpu")).data
    built = [runner.build_run(c, torch.device("cpu"), data=data) for c in cfgs]
    states = [fx.TrainState(0, b.params, b.opt_state, fx.rng_state(), b.buffers) for b in built]
    hp = sweep.hyperparams({key: values})
    return sweep.GroupSteps(cfgs[0], built, states, hp, shared_data=True, **kwargs), built


@pytest.mark.parametrize("key, values", [("learning_rate", [1e-2, 3e-2, 1e-1]), ("b1", [0.8, 0.9, 0.95]),
                                         ("weight_decay", [0.0, 0.1, 0.5])])
def test_each_member_updates_with_its_own_fused_kernel_as_its_own_run_does(monkeypatch, key, values):
    # The kernel takes the learning rate as a tensor and b1, weight_decay as host numbers: each member's own.
    calls = []
    fused_adamw = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(k) or fused_adamw(*a, **k))
    key = f"optim.chain.adamw.{key}"
    group, built = group_of(values, key=key)
    vmapped, _ = group_of(values, key=key, kernels=False)  # the update under vmap, out of place
    assert group.kernels is not None and vmapped.kernels is None
    metrics, reference = group.advance(0, 12), vmapped.advance(0, 12)
    assert len(calls) == 12 * 3  # one kernel call per member and step
    assert all(isinstance(k["lr"], torch.Tensor) and k["lr"].ndim == 0 for k in calls)
    if key.endswith(("b1", "weight_decay")):  # each member's own host number, in member order, at every step
        arg = "beta1" if key.endswith("b1") else "weight_decay"
        assert all([k[arg] for k in calls[i:i + 3]] == pytest.approx(values) for i in range(0, 36, 3))
    assert sorted(metrics) == sorted(reference) == ["accuracy", "grad_norm", "learning_rate", "loss"]
    for k in metrics:
        assert metrics[k].shape == (3,)
        torch.testing.assert_close(metrics[k], reference[k], rtol=RTOL, atol=ATOL, msg=k)
    # Params and state elementwise: the kernel's bias corrections are float64, the vmapped update's float32, up to
    # 7e-6 of an update apart (tests/test_fused.py): 12 updates of at most lr = 0.1 stay within 1e-5.
    assert_trees_close_rows((group.params, group.opt_state), (vmapped.params, vmapped.opt_state))
    # Each job's own donated step (the basic launcher's, the same fused kernel) on the same 12 batches.
    for j, b in enumerate(built):
        params, state, _, own = own_steps(b, 12)
        assert_trees_close_rows(sweep.pick(group.params, j), params)
        assert_trees_close_rows(sweep.pick(group.opt_state, j), state)
        assert math.isclose(metrics["learning_rate"][j], own["learning_rate"], rel_tol=1e-6)
        assert math.isclose(metrics["grad_norm"][j], own["grad_norm"], rel_tol=RTOL)
    assert int(sweep.pick(group.opt_state, 1)[1].count) == 12  # the kernels counted in the batched state


def test_batchnorm_statistics_ride_through_the_members_kernels_as_through_their_own_steps():
    # A model with buffers (BatchNorm's running statistics): the vmapped gradients return each member's new
    # statistics, the kernels update the params; both equal each job's own donated steps.
    group, built = group_of([1e-2, 3e-2], "model=resnet", "~model.hidden", "data=digits", "model.width=4",
                            "model.blocks=[1]", "data.batch_size=16")
    assert group.kernels is not None and "stages.0.bn1.running_mean" in fx.tree.paths(group.buffers)
    group.advance(0, 3)
    for j, b in enumerate(built):
        params, _, buffers, _ = own_steps(b, 3)
        assert_trees_close_rows(sweep.pick(group.params, j), params)
        assert_trees_close_rows(sweep.pick(group.buffers, j), buffers)


# accumulate holds 3 of 4 micro-batches (it declares no fused kernel: one every step would be a silently wrong
# update); amp wraps the forward (wrap_loss). Tolerances: accumulate elementwise as the kernel tests above; under
# bf16, batched and unbatched matmuls round differently (about 1e-3 relative a step, fxtrain/sweep.py "Numbers"),
# and Adam's first step (about lr * sign(g)) turns that into 2 lr on an element whose gradient is near 0 (measured:
# one element of the 10x32 head). So after one step: every element within 1e-5, except at most 1% of a leaf's,
# which may differ by a sign flip (2 lr) and no more. The other job's learning rate moves every element.
AWAY = {"accumulate": (("accumulate=k4", "trainer.max_steps=32"), 8, False),
        "amp": (("amp=bf16",), 1, True)}


@pytest.mark.parametrize("name", list(AWAY))
def test_stacks_that_are_more_than_one_kernel_call_take_the_vmapped_update_as_their_own_runs(name):
    overrides, steps, flips = AWAY[name]
    lrs = [1e-2, 3e-2]
    group, built = group_of(lrs, *overrides)
    assert group.kernels is None
    group.advance(0, steps)
    for j, b in enumerate(built):
        params, _, _, _ = own_steps(b, steps)
        if not flips:
            assert_trees_close_rows(sweep.pick(group.params, j), params)
            continue
        for x, y in zip(fx.tree.leaves(sweep.pick(group.params, j)), fx.tree.leaves(params)):
            diff = (x - y).abs()
            assert float((diff > 1e-5).float().mean()) <= 0.01 and float(diff.max()) <= 2 * lrs[j] * 1.01
    if name == "accumulate":  # 8 micro-batches, 2 updates, in every member's state
        assert sweep.pick(group.opt_state, 1).inner_state[1].count.tolist() == 2


def own_steps(b, n):
    """Job ``b``'s own donated step (the basic launcher's run) on its first ``n`` batches: params, state, buffers and
    the last metrics."""
    params, state, buffers = b.params, b.opt_state, b.buffers
    for i in range(n):
        params, state, buffers, metrics = b.step(params, state, buffers, b.data.train[i])
    return params, state, buffers, metrics


def assert_trees_close_rows(a, b):
    for x, y in zip(fx.tree.leaves(a), fx.tree.leaves(b)):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("chain", ["[clip_by_global_norm,lion]", "[clip_by_global_norm,adam]"])
def test_a_stack_without_a_fused_kernel_takes_the_vmapped_update_and_one_with_a_kernel_its_own(chain):
    lrs = [1e-2, 3e-2]
    key = f"optim.chain.{chain.strip('[]').split(',')[-1]}.learning_rate"
    cfgs = [cfg_of(*FAST, "trainer.max_steps=30", f"optim/transform@optim.chain={chain}", "~optim.chain.adamw",
                   f"{key}={lr}") for lr in lrs]  # ~: the smoke experiment sets adamw's learning rate
    built = [runner.build_run(c, torch.device("cpu")) for c in cfgs]
    states = [fx.TrainState(0, b.params, b.opt_state, fx.rng_state(), b.buffers) for b in built]
    group = sweep.GroupSteps(cfgs[0], built, states, sweep.hyperparams({key: lrs}), shared_data=True)
    # lion declares no torch kernel; adam does (a chain of one optimizer does not: _base._fused_in_sequence)
    assert (group.kernels is None) == ("lion" in chain)
    before = sweep.pick(group.params, 0)
    metrics = group.advance(0, 3)
    assert torch.isfinite(metrics["loss"]).all() and metrics["loss"].shape == (2,)
    assert not torch.equal(fx.tree.leaves(before)[0], fx.tree.leaves(sweep.pick(group.params, 0))[0])


# --- grouping (plan-level checks of each reason's note: tests/test_sweep.py) --------------------------

def test_structures_and_max_steps_match_the_basic_launcher(capsys):
    # Two structures of the chain (the same transforms in another order: a group each) x two lengths: each group
    # batches both lengths, the job of 20 steps stopping alone at its own step (its last log line, checkpoint,
    # summary and test there, on its own state). Jobs: (20, a), (20, b), (30, a), (30, b).
    grid = ["trainer.max_steps=20,30", "optim/transform@optim.chain=[clip_by_global_norm,adamw],[adamw,clip_by_global_norm]",
            "schedule=constant", "trainer.test_ckpt=last"]
    basic = sweep_of("basic", *grid)
    vmapped = sweep_of("vmap", *grid)
    out = capsys.readouterr().out
    assert "vmap   jobs 0,2 as one process: 2 jobs, batched over trainer.max_steps" in out
    assert "vmap   jobs 1,3 as one process: 2 jobs, batched over trainer.max_steps" in out
    assert "[vmap] group 2: apart by optim/transform@optim.chain: [adamw,clip_by_global_norm] here, " \
           "[clip_by_global_norm,adamw] in group 1: the chain's structure" in out
    steps = {20: ["step_0000015", "step_0000020"], 30: ["step_0000015", "step_0000030"]}
    assert_same_sweep(basic, vmapped, 4, checkpoints={j: steps[20 if j < 2 else 30] for j in range(4)}, tested="last")
    assert [r["step"] for r in records(vmapped / "1")] == [5, 10, 15, 20]
    for job in range(4):  # the note each job records in its train.log
        log = (vmapped / str(job) / "train.log").read_text()
        assert (f"group  job {job} in group {job % 2 + 1}: jobs {job % 2},{job % 2 + 2} as one vmapped process, "
                f"batched over trainer.max_steps=20,30") in log
        assert "group  apart by optim/transform@optim.chain: " in log
    cfg = cfg_of(*SWEEP, "optim/transform@optim.chain=[adamw,clip_by_global_norm]", "trainer.max_steps=20",
                 "schedule=constant")
    a, b = (load_checkpoint(d / "1" / "checkpoints" / "step_0000020", cfg) for d in (basic, vmapped))
    for x, y in zip(fx.tree.leaves(a.params), fx.tree.leaves(b.params)):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=1e-5)


class DropoutMLP(torch.nn.Module):
    """The smoke MLP with dropout: random draws in training, which vmap refuses rather than share them."""

    def __init__(self, input_shape, hidden, num_classes, activation):
        super().__init__()
        self.net = torch.nn.Sequential(MLP(input_shape, hidden, num_classes, activation), torch.nn.Dropout(0.1))

    def forward(self, x):
        return self.net(x)


def test_a_group_vmap_cannot_run_falls_back_to_one_by_one(monkeypatch, capsys):
    monkeypatch.setattr(fxtrain.models, "DropoutMLP", DropoutMLP, raising=False)
    code = run_main("-m", "hydra/launcher=vmap", *FAST, "model._target_=fxtrain.models.DropoutMLP",
                    "optim.chain.adamw.learning_rate=1e-2,3e-2", "trainer.max_steps=3", "hydra.sweep.dir=sweep")
    assert code == 0
    out = capsys.readouterr().out
    assert "[vmap] jobs 0,1 run one by one: the vmapped step raised RuntimeError: " in out
    for job in "01":  # and each job's train.log says so, before its run's own lines
        log = pathlib.Path("sweep", job, "train.log").read_text().splitlines()
        assert f"] group  job {job} in group 1: jobs 0,1 one by one: the vmapped step raised RuntimeError: " in log[0]
        assert "] run    " in log[1]
    assert [r["status"] for r in csv.DictReader(pathlib.Path("sweep/summary.csv").read_text().splitlines())] == \
        ["completed", "completed"]


def test_each_jobs_config_is_composed_once_for_validation_and_launch(monkeypatch):
    # Hydra's basic sweeper composes every job to validate the batch, then a launcher composes it again; the vmap
    # launcher takes the validated config instead (vmap_launcher._ComposedOnce). Same configs: the files say so.
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    composed = []
    load = ConfigLoaderImpl.load_sweep_config
    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config",
                        lambda self, master_config, sweep_overrides: composed.append(list(sweep_overrides))
                        or load(self, master_config, sweep_overrides))
    grid = ["optim.chain.adamw.learning_rate=1e-2,3e-2", "trainer.max_steps=3"]
    basic = sweep_of("basic", *grid)
    assert len(composed) == 4  # 2 jobs: validated, then launched
    composed.clear()
    vmapped = sweep_of("vmap", *grid)
    assert len(composed) == 2 and composed[0] != composed[1]
    for job in "01":
        for name in ("config.yaml", "overrides.yaml"):
            assert (vmapped / job / ".hydra" / name).read_text() == (basic / job / ".hydra" / name).read_text()
        assert f"num: {job}\n" in (vmapped / job / ".hydra" / "hydra.yaml").read_text()
