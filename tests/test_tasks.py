"""fxtrain.tasks: the built-in tasks against torch's own losses, user tasks, evaluation, early stopping, and the
runner driving them (task=regression, eval hooks, early stopping recorded and resumed)."""

import json

import pytest
import torch
import torch.nn.functional as F

from fxtrain import build, tasks
from fxtrain import train as runner
from fxtrain.report import read_jsonl
from tests._runner import cfg_of

FAST = ["trainer.progress=false", "trainer.cpu_threads=1"]


def test_classification_and_lm_are_torch_cross_entropy_and_accuracy():
    torch.manual_seed(0)
    logits, y = torch.randn(6, 4), torch.randint(4, (6,))
    loss, metrics = tasks.classification().compute(logits, y)
    torch.testing.assert_close(loss, F.cross_entropy(logits, y), rtol=0, atol=0)
    assert float(metrics["accuracy"]) == float((logits.argmax(-1) == y).float().mean())
    seq, tokens = torch.randn(2, 5, 7), torch.randint(7, (2, 5))
    loss, metrics = tasks.lm().compute(seq, tokens)
    torch.testing.assert_close(loss, F.cross_entropy(seq.reshape(10, 7), tokens.reshape(10)), rtol=0, atol=0)
    assert tasks.lm().optimized_metric == "val_loss" and tasks.classification().optimized_metric == "val_accuracy"


def test_regression_is_mse_with_mae_and_takes_one_output_per_target():
    out, y = torch.tensor([[0.5], [2.0], [-1.0]]), torch.tensor([1.0, 1.0, 1.0])
    loss, metrics = tasks.regression().compute(out, y)
    torch.testing.assert_close(loss, F.mse_loss(out.squeeze(1), y))
    torch.testing.assert_close(metrics["mae"], (out.squeeze(1) - y).abs().mean())
    with pytest.raises(build.ConfigError, match=r"^task=regression: outputs \(3, 2\) and targets \(3,\) hold "
                       r"different numbers of values.*num_classes: 1"):
        tasks.regression().compute(torch.zeros(3, 2), y)


def test_float_targets_under_cross_entropy_point_at_regression():
    with pytest.raises(build.ConfigError, match=r"cross-entropy needs integer class targets, got torch.float32; for "
                       r"real-valued targets use task=regression"):
        tasks.classification().compute(torch.zeros(3, 2), torch.zeros(3))


def huber(outputs, targets):
    return F.huber_loss(outputs.reshape(targets.shape), targets)


def per_example(outputs, targets):
    return (outputs.reshape(targets.shape) - targets) ** 2  # not reduced: a (B,) loss


def abs_error(outputs, targets):
    return {"mae": (outputs.reshape(targets.shape) - targets).abs().mean()}


def test_a_user_task_from_dotted_paths():
    task = build.task(_cfg({"_target_": "fxtrain.tasks.Task", "loss": f"{__name__}.huber",
                            "metrics": f"{__name__}.abs_error", "optimized_metric": "test_mae"}))
    assert task.name == "huber" and task.loss is huber and task.optimized_metric == "test_mae"
    loss, metrics = task.compute(torch.tensor([[0.0], [3.0]]), torch.tensor([0.0, 0.0]))
    assert float(loss) == pytest.approx((0 + 2.5) / 2) and float(metrics["mae"]) == 1.5
    with pytest.raises(build.ConfigError, match=r"^task \(builtins.dict\): returned dict, expected a fxtrain.tasks.Task"):
        build.task(_cfg({"_target_": "builtins.dict"}))
    with pytest.raises(build.ConfigError, match=r"task.loss=mylib_missing.huber: cannot import it"):
        build.task(_cfg({"_target_": "fxtrain.tasks.Task", "loss": "mylib_missing.huber"}))


def _cfg(task_node):
    from omegaconf import OmegaConf

    return OmegaConf.create({"task": task_node})


def test_a_loss_that_is_not_a_scalar_names_the_task_and_the_shape():
    task = tasks.Task(per_example, name="mine")
    with pytest.raises(build.ConfigError, match=r"^task=mine: its loss returned \(4,\) for outputs \(4, 1\) and "
                       r"targets \(4,\); a loss must be a 0-dim tensor, the mean over the batch"):
        task.compute(torch.zeros(4, 1), torch.ones(4))


def test_evaluate_is_the_split_mean_whatever_the_chunks():
    torch.manual_seed(1)
    x, y = torch.randn(11, 3), torch.randint(3, (11,))
    whole = tasks.evaluate(tasks.classification(), lambda xb: xb, (x, y), batch_size=11)
    chunked = tasks.evaluate(tasks.classification(), lambda xb: xb, (x, y), batch_size=4)
    assert whole.keys() == {"test_loss", "test_accuracy"}
    assert chunked["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-6)
    assert chunked["test_accuracy"] == pytest.approx(float((x.argmax(-1) == y).float().mean()), rel=1e-6)
    assert whole["test_loss"] == pytest.approx(float(F.cross_entropy(x, y)), rel=1e-6)


@pytest.mark.parametrize("metric, values, mode, min_delta, stops_at", [
    ("test_loss", [1.0, 0.9, 0.95, 0.91], "auto", 0.0, 3),      # auto: lower is better for a loss
    ("test_accuracy", [0.5, 0.6, 0.55, 0.58], "auto", 0.0, 3),  # higher for an accuracy
    ("test_loss", [1.0, 0.99, 0.985], "auto", 0.05, 2),         # improvements under min_delta do not count
    ("score", [1.0, 2.0, 3.0, 4.0], "min", 0.0, 2),            # mode=min for any name
    ("test_loss", [1.0, float("nan"), 0.5], "auto", 0.0, None),  # a NaN is not an improvement
])
def test_early_stopping_counts_logged_values_without_improvement(metric, values, mode, min_delta, stops_at):
    stop = tasks.EarlyStopping(metric, patience=2, mode=mode, min_delta=min_delta)
    flags = [stop.update({metric: v, "other": 0.0}, step) for step, v in enumerate(values)]
    assert (flags.index(True) if True in flags else None) == stops_at
    assert not stop.update({"other": 1.0})  # lines without the metric are not counted


def test_early_stopping_settings_are_checked():
    with pytest.raises(build.ConfigError, match=r"trainer.early_stopping.patience=0: expected a whole number >= 1"):
        build.early_stopping(cfg_of("trainer.early_stopping.metric=test_loss", "trainer.early_stopping.patience=0"))
    with pytest.raises(build.ConfigError, match=r"trainer.early_stopping: patiense is not an argument .*did you mean "
                       r"patience"):
        build.early_stopping(cfg_of("trainer.early_stopping.metric=test_loss", "+trainer.early_stopping.patiense=3"))
    assert build.early_stopping(cfg_of()) is None



def test_bad_task_hook_and_early_stopping_settings_stop_before_anything_is_written(tmp_path):
    for bad, message in [
        (["trainer.early_stopping.metric=loss", "trainer.early_stopping.mode=lowest"],
         r"trainer.early_stopping.mode=lowest: expected one of auto, min, max"),
        (["+trainer.eval_hooks.cal._target_=tests.test_tasks.calibration", "+trainer.eval_hooks.cal.binz=3"],
         r"trainer.eval_hooks.cal: binz is not an argument of tests.test_tasks.calibration \(did you mean bins\?\)"),
        (["task._target_=fxtrain.tasks.Task", "+task.loss=mylib_missing.huber"],
         r"task.loss=mylib_missing.huber: cannot import it"),
        (["+task.loss=mylib.huber"], r"task: loss is not an argument of fxtrain.tasks.classification"),
    ]:
        with pytest.raises(build.ConfigError, match=message):
            runner.train(cfg_of("experiment=smoke", *bad, *FAST), tmp_path / "run")
        assert not (tmp_path / "run").exists()


def calibration(ctx, bins=4):
    """An eval hook: the mean top-class probability on the test split, and how many bins it was asked for."""
    x, _ = ctx.data.test
    confidence = ctx.forward(x).softmax(-1).amax(-1).mean()
    return {"confidence": confidence, "bins": bins, "step_seen": ctx.step}


def test_the_runner_trains_regression_calls_hooks_and_stops_early(tmp_path):
    # Regression on the runner's own data path: synthetic clusters' class index as a real-valued target.
    cfg = cfg_of("experiment=smoke", "task=regression", "model.num_classes=1", "trainer.max_steps=30",
                 "trainer.log_every=1", "trainer.eval_every=5", "data._target_=tests.test_tasks.float_targets", *FAST)
    value = runner.train(cfg, tmp_path / "reg")
    records = read_jsonl(tmp_path / "reg" / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    assert cfg.optimized_metric == "val_loss" and value == min(r["val_loss"] for r in records if "val_loss" in r)
    assert "mae" in records[0] and "val_mae" in records[-1] and "accuracy" not in records[0]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5

    # Eval hooks add metrics; early stopping on a hook's metric stops, records it, and a resume=auto leaves it.
    cfg = cfg_of("experiment=smoke", "trainer.max_steps=40", "trainer.eval_every=2", "trainer.log_every=2",
                 f"+trainer.eval_hooks.cal._target_={__name__}.calibration", "+trainer.eval_hooks.cal.bins=7",
                 "trainer.early_stopping.metric=bins", "trainer.early_stopping.patience=3", *FAST)
    runner.train(cfg, tmp_path / "stop")
    summary = json.loads((tmp_path / "stop" / "summary.json").read_text())
    records = read_jsonl(tmp_path / "stop" / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6, 8]  # bins never improves after step 2: 3 more values
    assert all(r["bins"] == 7.0 and r["step_seen"] == r["step"] and 0 < r["confidence"] <= 1 for r in records)
    assert summary["status"] == "completed" and summary["step"] == 8
    assert summary["stopped_early"] == {"step": 8, "metric": "bins", "best": 7.0, "best_step": 2, "patience": 3}
    assert (tmp_path / "stop" / "checkpoints" / "step_0000008").is_dir()
    cfg.resume = "auto"  # a stopped run is done: resume=auto returns its value and trains nothing
    assert runner.train(cfg, tmp_path / "stop") == summary["value"]
    assert len(read_jsonl(tmp_path / "stop" / "metrics.jsonl")) == 4


def test_early_stopping_replays_the_logged_lines_on_resume(tmp_path):
    # Resumed from a checkpoint before the stop, a run reads the lines logged up to it and stops where the
    # uninterrupted run stopped, with the same record.
    args = ["experiment=smoke", "trainer.max_steps=60", "trainer.log_every=1", "trainer.eval_every=60",
            "trainer.checkpoint_every=1", "trainer.keep_last=0", "trainer.early_stopping.metric=loss",
            "trainer.early_stopping.patience=4", *FAST]
    runner.train(cfg_of(*args), tmp_path / "whole")
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    stop = whole["stopped_early"]["step"]
    assert 8 < stop < 60
    # Stopped between evaluations: the params it stops with are evaluated, logged on the stop line and summarised.
    last = read_jsonl(tmp_path / "whole" / "metrics.jsonl")[-1]
    assert last["step"] == stop and whole["value"] == last["val_accuracy"] == whole["metrics"]["val_accuracy"]
    assert whole["best_step"] == stop and "test_accuracy" in whole["metrics"]
    runner.train(cfg_of(*args, f"resume={tmp_path / 'whole' / 'checkpoints' / f'step_{stop - 1:07d}'}"),
                 tmp_path / "resumed")
    resumed = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert resumed["stopped_early"] == whole["stopped_early"]
    assert resumed["value"] == whole["value"]  # the same kernels on the same inputs: bit for bit


def float_targets(num_examples=512, input_shape=(1, 8, 8), num_classes=10, noise=1.0):
    """fxtrain's synthetic clusters with the class index / 3 as a float target: ``(x, y)`` tensors, a regression
    dataset that the runner splits and batches (batch_size, test_fraction... are the runner's keys here)."""
    from fxtrain.data import synthetic

    data = synthetic(batch_size=1, num_examples=num_examples, input_shape=input_shape, num_classes=num_classes,
                     noise=noise)
    return torch.cat([data.train.x, data.test[0]]), torch.cat([data.train.y, data.test[1]]).float() / 3


def test_early_stopping_auto_and_report_best_agree_on_direction():
    # One rule (tasks.lower_is_better) for early stopping's mode=auto and report.best: an error metric such as
    # test_mae is minimized by both (early stopping maximized it while report.best minimized it).
    from fxtrain import report
    from fxtrain.tasks import EarlyStopping

    stop = EarlyStopping("test_mae", patience=1)
    assert [stop.update({"test_mae": v}) for v in (1.0, 0.5, 0.7)] == [False, False, True] and stop.best == 0.5
    rows = [{"job": 0, "status": "completed", "test_mae": 0.5}, {"job": 1, "status": "completed", "test_mae": 0.7}]
    assert report.best(rows, "test_mae")["job"] == 0
