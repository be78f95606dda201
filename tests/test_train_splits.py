"""Three splits in the runner (issue 27): validation chooses, the test split is evaluated once at the end on the
checkpoint trainer.test_ckpt names; checkpoints/best survives keep_last and a restart."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from fxtrain import data as fxdata
import fxtrain as fx
from fxtrain import report, rundir, selection, train as runner
from fxtrain.errors import ConfigError
from tests._runner import cfg_of, isolate, load_checkpoint  # noqa: F401 - isolate: autouse fixture

FAST = ["trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=null"]
SMALL = ["data=synthetic", "data.num_examples=256", "data.batch_size=32", "model.hidden=[16]", *FAST]


def disagreeing(batch_size: int = 32, seed: int = 0) -> fxdata.Dataset:
    """Synthetic clusters whose validation labels are the test labels shifted by one class: a model that learned
    the task scores high on the test split and near zero on validation."""
    made = fxdata.synthetic(batch_size=batch_size, num_examples=256, noise=0.5, seed=seed)
    x, y = made.test
    return fxdata.Dataset("disagreeing", made.train, (x, y), (x, (y + 1) % 10))


def test_validation_every_eval_test_once_on_the_best_checkpoint(tmp_path):
    cfg = cfg_of(*SMALL, "data.val_fraction=0.2", "trainer.max_steps=8", "trainer.log_every=2",
                 "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.keep_last=1")
    value = runner.train(cfg, tmp_path)
    lines = report.read_jsonl(tmp_path / "metrics.jsonl")
    assert all({"val_loss", "val_accuracy"} <= set(r) for r in lines)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # the test split only at the end: the loggers get it at the last step (its line), after training
    assert [[k for k in r if k.startswith("test_")] for r in lines] == [[]] * 3 + [["test_loss", "test_accuracy"]]
    assert lines[-1]["test_accuracy"] == summary["metrics"]["test_accuracy"]
    best = max(lines, key=lambda r: (r["val_accuracy"], -r["step"]))  # ties keep the earlier step
    assert summary["best_step"] == best["step"] and value == summary["value"] == best["val_accuracy"]
    assert summary["metrics"]["val_accuracy"] == best["val_accuracy"]
    assert {"test_loss", "test_accuracy"} <= set(summary["metrics"])
    assert summary["test_ckpt"].startswith("best")
    assert summary["tested"] == {"step": best["step"], "checkpoint": "best", "why": "trainer.test_ckpt=best: "
                                 f"val_accuracy {best['val_accuracy']:.4g} at step {best['step']}"}
    # keep_last=1 keeps the last step and, beside it, the best one
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best", "step_0000008"]
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "best", cfg)
    assert ckpt.step == best["step"]
    # the test metrics are those of checkpoints/best on the test split (evaluated here again)
    run = runner.start_run(cfg, runner.plan_run(cfg, None))
    built = runner.build_run(cfg, run.device, run.dims)
    tested = built.evaluate(ckpt.params, ckpt.buffers, built.data.test, cfg.trainer.eval_batch_size)
    assert tested["test_accuracy"] == pytest.approx(summary["metrics"]["test_accuracy"], abs=1e-6)
    assert built.data.test[0].shape[0] == 64 and built.data.val[0].shape[0] == 51  # 256 x 0.25, 256 x 0.2


def test_a_sweep_picks_by_validation_where_test_disagrees(tmp_path):
    data = ["data._target_=tests.test_train_splits.disagreeing", "~data.num_examples", "~data.noise",
            "~data.test_fraction", "~data.split_seed", "~data.val_fraction", "~data.input_shape",
            "~data.num_classes", "model.input_shape=[1,8,8]", "model.num_classes=10"]
    for job, steps in ((0, 1), (1, 40)):  # barely trained / trained: by test 1 wins, by validation 0
        cfg = cfg_of("data=synthetic", *data, "model.hidden=[16]", *FAST, f"trainer.max_steps={steps}",
                     "optim.chain.adamw.learning_rate=0.01", "schedule=constant")
        runner.train(cfg, tmp_path / str(job))
    rows = report.collect(tmp_path)
    assert report.best(rows, "test_accuracy")["job"] == "1"
    assert report.best(rows, "val_accuracy")["job"] == "0"
    assert {r["job"]: r["val_accuracy"] for r in rows}["1"] < 0.1 < {r["job"]: r["test_accuracy"] for r in rows}["1"]
    metric = json.loads((tmp_path / "0" / "summary.json").read_text())["optimized_metric"]
    assert metric == "val_accuracy" and report.best(rows, metric)["job"] == "0"


def test_best_checkpoint_survives_a_restart(tmp_path):
    args = [*SMALL, "data.val_fraction=0.2", "trainer.max_steps=8", "trainer.log_every=2", "trainer.eval_every=2",
            "trainer.checkpoint_every=6", "trainer.checkpoint.best_by=grad_norm", "trainer.keep_last=0"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    runner.train(cfg_of(*args), whole)
    done = json.loads((whole / "summary.json").read_text())
    assert done["best_step"] <= 6  # the best is in the part the restarted run does not redo (asserted: a premise)
    runner.train(cfg_of(*args), cut)
    # a kill after step 6's checkpoint: what a restart finds (the best of step <= 6 in checkpoints/best)
    shutil.rmtree(cut / "checkpoints" / "step_0000008")
    (cut / "summary.json").unlink()
    resumed = runner.train(cfg_of(*args, "resume=auto"), cut)
    again = json.loads((cut / "summary.json").read_text())
    assert again["best_step"] == done["best_step"] and resumed == done["value"]
    assert again["metrics"] == done["metrics"]


def test_a_best_after_the_resumed_step_is_dropped(tmp_path):
    args = [*SMALL, "trainer.max_steps=6", "trainer.eval_every=2", "trainer.checkpoint_every=2",
            "trainer.checkpoint.best_by=val_loss", "trainer.keep_last=0"]
    runner.train(cfg_of(*args), tmp_path)
    best = json.loads((tmp_path / "summary.json").read_text())["best_step"]
    assert best > 2
    for step in (4, 6):
        shutil.rmtree(tmp_path / "checkpoints" / f"step_{step:07d}")
    (tmp_path / "summary.json").unlink()
    runner.train(cfg_of(*args, "resume=auto"), tmp_path)  # from step 2: the best of steps 4 or 6 is redone
    assert json.loads((tmp_path / "summary.json").read_text())["best_step"] == best


def test_test_ckpt_last_and_no_validation_split(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fxtrain")
    cfg = cfg_of(*SMALL, "trainer.max_steps=4", "trainer.test_ckpt=last")
    runner.train(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test_ckpt"] == "last (step 4)"
    assert summary["tested"] == {"step": 4, "checkpoint": "last", "why": "trainer.test_ckpt=last"}
    # synthetic has no validation split: validation reads the test split, and the data line says so once
    said = [r.getMessage() for r in caplog.records]
    assert sum(runner.NO_VALIDATION in line for line in said) == 1
    assert summary["metrics"]["val_accuracy"] == summary["metrics"]["test_accuracy"]


@pytest.mark.parametrize("override, message", [
    ("trainer.test_ckpt=first", "trainer.test_ckpt=first: expected one of best, last"),
    ("trainer.checkpoint.best_by=test_accuracy", "trainer.checkpoint.best_by=test_accuracy: the test split is"),
    ("trainer.early_stopping.metric=test_loss", "trainer.early_stopping.metric=test_loss: the test split is"),
    ("data.val_fraction=0.8", "data.val_fraction=0.8: expected a number from 0"),
])
def test_settings_that_would_choose_on_the_test_split_are_refused(override, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
        runner.check(cfg_of(override))


def test_resume_keeps_rundir_rewind_off_best(tmp_path):
    (tmp_path / "checkpoints" / "best").mkdir(parents=True)
    rundir.rewind(tmp_path, 0)  # rewind removes later step_<N> checkpoints, never the best one
    assert (tmp_path / "checkpoints" / "best").is_dir()


def test_epochs_equal_steps_times_batches_per_epoch(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fxtrain")
    cfg = cfg_of(*SMALL, "trainer.max_epochs=2", "trainer.max_steps=null")
    runner.train(cfg, tmp_path)
    per_epoch = 192 // 32  # 256 examples less the 64 of the test split, in batches of 32
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == cfg.trainer.max_steps == 2 * per_epoch
    assert "decay_steps: 12" in (tmp_path / "config.yaml").read_text()  # the schedule follows the resulting steps
    assert f"steps  12 = 2 epochs of {per_epoch} batches" in [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("overrides, message", [
    (["trainer.max_epochs=2"], "trainer.max_epochs=2 and trainer.max_steps=1000: set one of them"),
    (["trainer.max_steps=null"], "trainer.max_steps=null and trainer.max_epochs=null: set one of them"),
])
def test_exactly_one_of_max_steps_and_max_epochs(overrides, message):
    with pytest.raises(ConfigError, match="^" + message):
        runner.check(cfg_of(*SMALL, *overrides))


def test_a_best_by_metric_the_run_does_not_log_is_refused_in_one_line(tmp_path):
    # Without the check a name no step logs left checkpoints/best empty and the last step was tested in silence.
    cfg = cfg_of(*SMALL, "data.val_fraction=0.2", "trainer.max_steps=4", "trainer.checkpoint.best_by=val_acc")
    with pytest.raises(ConfigError, match=r"^trainer\.checkpoint\.best_by=val_acc is not a metric of this run; "
                                          r"it has: .*val_accuracy"):
        runner.train(cfg, tmp_path / "run")


# --- a split that gets no rows (issue 35 item 5) ----------------------------------------------------------------
# data=synthetic data.num_examples=40 data.test_fraction=0.01 held out 0.4 rows, rounded to none: a RuntimeError
# traceback at the first evaluation, after the run directory was written. A val_fraction that rounds to none became
# "validation reads the test split" in silence (the meaning of val_fraction=0, which asks for it).

def presets() -> list[str]:
    return sorted(p.stem for p in (runner.CONF_DIR / "data").glob("*.yaml"))


def rounds_to_none(preset: str) -> list[str]:
    """Each split fraction ``preset`` has, at a value that holds out less than one row (byte) of any shipped data."""
    keys = [k for k in ("test_fraction", "val_fraction") if k in cfg_of(f"data={preset}").data]
    return [f"data.{k}=1e-09" for k in keys]


@pytest.mark.parametrize("preset, override", [(p, o) for p in presets() for o in rounds_to_none(p)])
def test_a_split_fraction_that_rounds_to_no_rows_is_refused_in_one_line(preset, override, tmp_path):
    from fxtrain import build
    from tests import _formats

    files = _formats.FORMATS[preset](tmp_path) if preset in _formats.FORMATS else []  # a format's generated fixture
    cfg = cfg_of(f"data={preset}", *files, override)
    key = override.split("=")[0].removeprefix("data.")
    with pytest.raises(ConfigError) as info:
        build.dataset(cfg.data)
    msg = str(info.value)
    assert f"{key}=1e-09 of " in msg and "rounds to none" in msg and f"raise {key} to at least " in msg, msg
    assert "\n" not in msg
    if key == "val_fraction":  # what asks for validation on the test split, named
        assert "or set val_fraction=0 to validate on the test split on purpose" in msg


def test_the_empty_test_split_of_the_issue_is_refused_before_anything_is_written(tmp_path):
    from tests._runner import run_main

    code = run_main(*SMALL, "data.num_examples=40", "data.test_fraction=0.01", "hydra.run.dir=run")
    assert code == ("Error: data (fxtrain.data.synthetic): synthetic: test_fraction=0.01 of 40 examples holds out "
                    "0.4, which rounds to none: the test split would be empty; raise test_fraction to at least 0.025 "
                    "(1 of 40), or give more examples"), code
    assert not (tmp_path / "run").exists()


def test_val_fraction_zero_still_asks_for_validation_on_the_test_split():
    data = fxdata.synthetic(batch_size=8, num_examples=40, val_fraction=0.0)
    assert data.val is None and data.validation is data.test
    with pytest.raises(ValueError, match=r"val_fraction=0.01 of 40 examples holds out 0.4, which rounds to none"):
        fxdata.synthetic(batch_size=8, num_examples=40, val_fraction=0.01)


# --- issue 36 item 5: checkpoints/best written with the next checkpoint, not at each improvement ---------------

EVERY_EVAL = [*SMALL, "data.val_fraction=0.2", "trainer.max_steps=8", "trainer.log_every=1", "trainer.eval_every=1",
              "trainer.checkpoint_every=4", "trainer.checkpoint.best_by=val_loss", "trainer.keep_last=0"]


def _saves(monkeypatch):
    """The checkpoints the run writes, in order: ``(name, step of the state written)``."""
    saved, save = [], rundir.save

    def spy(target, state, meta, kept):
        saved.append((target.name, state.step))
        return save(target, state, meta, kept)

    monkeypatch.setattr(rundir, "save", spy)
    return saved


def test_the_best_is_written_with_the_next_checkpoint_as_a_save_at_each_improvement_wrote_it(tmp_path, monkeypatch):
    # Before issue 36 every improvement saved checkpoints/best at once (fsync'ed, ~17 ms: 14% of a small CNN's
    # loop). The reference here is that behaviour: Best.keep followed by the write at the same step.
    keep = selection.Best.keep

    def keep_and_write(self, *args, **kwargs):
        keep(self, *args, **kwargs)
        self.write()

    saved = _saves(monkeypatch)
    monkeypatch.setattr(selection.Best, "keep", keep_and_write)
    runner.train(cfg_of(*EVERY_EVAL), tmp_path / "at_once")
    at_once = [step for name, step in saved if name == "best"]
    improvements = [r["step"] for r in report.read_jsonl(tmp_path / "at_once" / "metrics.jsonl")
                    if r["val_loss"] < min([float("inf")] + [q["val_loss"] for q in report.read_jsonl(
                        tmp_path / "at_once" / "metrics.jsonl") if q["step"] < r["step"]])]
    assert at_once == improvements and len(improvements) >= 4  # a premise: the val loss improves often
    monkeypatch.setattr(selection.Best, "keep", keep)
    saved.clear()

    runner.train(cfg_of(*EVERY_EVAL), tmp_path / "deferred")
    # At most one best write per regular checkpoint, just before it, holding the newest improvement by then.
    last_by = {c: max(s for s in improvements if s <= c) for c in (4, 8)}
    assert saved == [("best", last_by[4]), ("step_0000004", 4), ("best", last_by[8]), ("step_0000008", 8)]
    one, other = tmp_path / "at_once" / "checkpoints" / "best", tmp_path / "deferred" / "checkpoints" / "best"
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in other.iterdir())
    for f in one.glob("*.distcp"):  # the same bytes of state: params, optimizer state, RNG, buffers
        assert f.read_bytes() == (other / f.name).read_bytes(), f.name
    # The same manifest (leaves, step, the best's record), but for the files that name the process that saved
    # (fxtrain.owner.json) and the directory it saved into (DCP's .metadata), and so the digest.
    manifests = [fx.checkpoint.verify(d) for d in (one, other)]
    for m in manifests:
        del m["digest"], m["files"]["fxtrain.owner.json"], m["files"][".metadata"]
    assert manifests[0] == manifests[1] and manifests[0]["meta"]["best"]["step"] == last_by[8]
    cfg = cfg_of(*EVERY_EVAL)
    a, b = load_checkpoint(one, cfg), load_checkpoint(other, cfg)
    assert fx.tree.structure(a) == fx.tree.structure(b)
    for x, y in zip(fx.tree.flatten(a)[0], fx.tree.flatten(b)[0]):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    summary = json.loads((tmp_path / "deferred" / "summary.json").read_text())
    assert summary == {**json.loads((tmp_path / "at_once" / "summary.json").read_text()), "time_s": summary["time_s"]}


def test_a_run_that_fails_on_a_non_finite_loss_writes_the_best_it_kept(tmp_path, monkeypatch):
    # checkpoint_every=0: no checkpoint before the end, so without this write the failed run's best would be lost.
    saved, calls, logged = _saves(monkeypatch), [], runner.RunSteps.logged

    def nan_at_6(self, metrics, j):  # log_every=1: the 6th log line is step 6's
        calls.append(j)
        floats = logged(self, metrics, j)
        return {**floats, "loss": float("nan")} if len(calls) == 6 else floats

    monkeypatch.setattr(runner.RunSteps, "logged", nan_at_6)
    with pytest.raises(FloatingPointError, match="loss is nan at step 6"):
        runner.train(cfg_of(*EVERY_EVAL, "trainer.checkpoint_every=0"), tmp_path)
    [(name, step)] = saved
    assert name == "best" and step <= 5
    assert fx.checkpoint.verify(tmp_path / "checkpoints" / "best")["meta"]["best"]["step"] == step
