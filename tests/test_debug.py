"""Debug runs (conf/debug/, issue 27 item 5) and the heartbeat: debug=fast, overfit, limit and profile in the runner
and under the vmap launcher; fxtrain.data.limited and overfit; trainer.heartbeat_s."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from fxtrain import data as fxdata
from fxtrain import report, train as runner
from tests._runner import cfg_of, isolate, run_main  # noqa: F401 - isolate: autouse fixture

FAST = ["trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=null"]
SMALL = ["data=synthetic", "data.num_examples=256", "data.batch_size=32", "model.hidden=[16]", *FAST]


def lines(caplog, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


# --- debug=fast --------------------------------------------------------------------------------------

def test_fast_trains_a_few_steps_keeps_no_checkpoint_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fxtrain")
    cfg = cfg_of("debug=fast", "data.val_fraction=0.25", *SMALL, "data.num_examples=512")
    value = runner.train(cfg, tmp_path)
    assert lines(caplog, "debug  ") == ["debug  debug=fast: no checkpoints (nothing for resume=auto), limit_val=2, "
                                        "limit_test=2"]
    # 2 batches of trainer.eval_batch_size=32 rows of validation and test (of 128 each)
    assert lines(caplog, "data   ") == ["data   synthetic: 256 train examples, 64 test, batch 32, 64 validation"]
    records = report.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and all("val_loss" in r for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 3 and value == summary["value"]
    assert {"test_loss", "test_accuracy"} <= set(summary["metrics"])
    assert not (tmp_path / "checkpoints").exists()  # no step_N, no best: nothing a relaunch would resume
    relaunch = cfg_of("debug=fast", "data.val_fraction=0.25", *SMALL, "data.num_examples=512", "resume=auto")
    assert runner.resume_plan(relaunch, tmp_path / "checkpoints") == ("completed", None)  # done: left alone
    (tmp_path / "summary.json").unlink()  # as if killed before its end: nothing to resume, step 0 again
    assert runner.resume_plan(relaunch, tmp_path / "checkpoints") == (None, None)


def test_fast_under_the_vmap_launcher_gives_each_job_its_own_run(tmp_path):
    sweep = ["-m", "debug=fast", *SMALL, "optim.chain.adamw.learning_rate=1e-3,3e-2"]
    assert run_main(*sweep, "hydra/launcher=vmap", "hydra.sweep.dir=vmapped") == 0
    assert run_main(*sweep, "hydra.sweep.dir=basic") == 0
    for job in "01":
        vmapped, basic = (json.loads(pathlib.Path(d, job, "summary.json").read_text()) for d in ("vmapped", "basic"))
        assert vmapped["status"] == "completed" and vmapped["step"] == 3
        for k, v in basic["metrics"].items():
            assert vmapped["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-5), (job, k)
        assert not pathlib.Path("vmapped", job, "checkpoints").exists()
        assert "debug  debug=fast" in pathlib.Path("vmapped", job, "train.log").read_text()


# --- debug=overfit -----------------------------------------------------------------------------------

def test_overfit_drives_the_default_digits_mlp_loss_near_zero(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fxtrain")
    # the default model (the digits MLP) and data; 60 of debug=overfit's 100 steps (one CPU thread, the default)
    cfg = cfg_of("debug=overfit", "trainer.max_steps=60", "trainer.progress=false", "trainer.device=cpu")
    runner.train(cfg, tmp_path)
    records = report.read_jsonl(tmp_path / "metrics.jsonl")
    first, last = records[0], records[-1]
    assert first["loss"] > 1.5                       # chance level on 10 classes is ln 10 = 2.3
    assert last["step"] == 60 and last["loss"] < 0.01 and last["val_loss"] < 0.01 and last["accuracy"] == 1.0
    # validation and test read the same 64 rows: the batch that trained
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metrics"]["test_loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    assert "debug: the same 1 training batch every step" in lines(caplog, "data   ")[0]


def test_overfit_data_reuses_its_first_batches():
    data = fxdata.synthetic(batch_size=8, num_examples=64, val_fraction=0.25)
    held = fxdata.overfit(data, 3)
    for k in range(12):
        x, y = held.train[k]
        assert torch.equal(x, data.train[k % 3][0]) and torch.equal(y, data.train[k % 3][1])
    rows = torch.cat([data.train[k][0] for k in range(3)])
    assert torch.equal(held.val[0], rows) and torch.equal(held.test[0], rows)
    assert fxdata.batches_per_epoch(held) == 3


# --- debug=limit -------------------------------------------------------------------------------------

def test_limited_keeps_the_first_batches_of_each_epoch_and_rows_of_each_split():
    data = fxdata.synthetic(batch_size=8, num_examples=200, val_fraction=0.2)  # 110 train rows: 13 batches an epoch
    assert fxdata.batches_per_epoch(data) == 13 and len(data.val[0]) == 40 and len(data.test[0]) == 50
    small = fxdata.limited(data, limit_train=0.25, limit_val=2, limit_test=0.5, eval_batch_size=16)
    assert fxdata.batches_per_epoch(small) == 3                  # int(0.25 x 13)
    for k in range(9):                                           # epochs 0, 1, 2: their first 3 batches
        assert torch.equal(small.train[k][0], data.train[(k // 3) * 13 + k % 3][0])
    assert torch.equal(small.val[0], data.val[0][:32]) and torch.equal(small.test[0], data.test[0][:25])
    assert fxdata.batches_per_epoch(fxdata.limited(data, limit_train=100)) == 13   # a count beyond the epoch: all
    assert len(fxdata.limited(data, limit_test=1.0).test[0]) == 50 and fxdata.limited(data).val[0] is data.val[0]
    with pytest.raises(ValueError, match=r"^limit_train=0: expected a fraction in \(0, 1\]"):
        fxdata.limited(data, limit_train=0)


def test_limit_shortens_epochs_and_the_run_follows(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fxtrain")
    cfg = cfg_of("debug=limit", "debug.limit_train=0.5", *SMALL, "trainer.max_epochs=2", "trainer.max_steps=null")
    runner.train(cfg, tmp_path)
    assert lines(caplog, "steps  ") == ["steps  6 = 2 epochs of 3 batches"]   # 192 rows: 6 batches, half of them
    assert "; debug: 3 of 6 batches per epoch" in lines(caplog, "data   ")[0]
    assert "16 test" in lines(caplog, "data   ")[0]                            # a quarter of the 64 test rows
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 6
    assert (tmp_path / "checkpoints" / "best").is_dir()                        # debug=limit keeps checkpoints


# --- debug=profile -----------------------------------------------------------------------------------

def test_profile_writes_a_chrome_trace_and_says_the_top_ops(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fxtrain")
    runner.train(cfg_of("debug=profile", *SMALL), tmp_path)
    (said,) = lines(caplog, "profile ")
    assert said.startswith(f"profile steps 4..8: {tmp_path / 'profile_trace.json'}; top ops by self_cpu_time_total:")
    assert "aten::" in said and "Self CPU time total" in said
    trace = json.loads((tmp_path / "profile_trace.json").read_text())
    assert any(e.get("name", "").startswith("aten::addmm") for e in trace["traceEvents"])  # the model's linear layers
    assert not (tmp_path / "checkpoints").exists()


def test_profile_under_the_vmap_launcher_gives_every_job_the_group_trace(tmp_path):
    assert run_main("-m", "hydra/launcher=vmap", "debug=profile", *SMALL, "optim.chain.adamw.learning_rate=1e-2,3e-2",
                    "hydra.sweep.dir=sweep") == 0
    for job in "01":
        assert json.loads(pathlib.Path("sweep", job, "summary.json").read_text())["status"] == "completed"
        assert "traceEvents" in json.loads(pathlib.Path("sweep", job, "profile_trace.json").read_text())
    assert "profile steps 4..8: " in pathlib.Path("sweep", "0", "train.log").read_text()


# --- the heartbeat -----------------------------------------------------------------------------------

def test_heartbeat_lines_while_training_without_a_bar(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fxtrain")
    runner.train(cfg_of(*SMALL, "trainer.max_steps=12", "trainer.log_every=4", "trainer.heartbeat_s=1e-6"), tmp_path)
    beats = lines(caplog, "beat   ")
    assert [int(b.split()[2].split("/")[0]) for b in beats] == list(range(1, 13))   # due after every step here
    assert all(b.split()[2].endswith("/12") and " s | " in b and " steps/s | loss " in b for b in beats)
    assert beats[0].endswith("loss - (none logged yet)")
    logged = {r["step"]: r["loss"] for r in report.read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r}
    assert sorted(logged) == [4, 8, 12]
    assert beats[5].endswith(f"loss {logged[4]:.4g}") and beats[-1].endswith(f"loss {logged[12]:.4g}")


def test_no_heartbeat_when_off(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fxtrain")
    runner.train(cfg_of(*SMALL, "trainer.max_steps=6", "trainer.heartbeat_s=0"), tmp_path)
    assert lines(caplog, "beat   ") == [] and lines(caplog, "done   ")


# --- every shipped experiment under every debug option (issue 35): generated from conf/ -------------------------

EXPERIMENTS = sorted(p.stem for p in (runner.CONF_DIR / "experiment").glob("*.yaml"))
DEBUG_OPTIONS = sorted(p.stem for p in (runner.CONF_DIR / "debug").glob("*.yaml") if not p.stem.startswith("_"))


@pytest.mark.parametrize("option", DEBUG_OPTIONS)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_is_accepted_under_every_debug_option(experiment, option):
    """Before: experiment=tiny_lm/resnet_accumulate debug=fast was refused (accumulate.every=4 does not divide
    max_steps=3), stdlib_lm (warmup_steps=30 >= 3); debug=profile likewise. A debug option that shortens says
    what on its debug line."""
    cfg = cfg_of(f"experiment={experiment}", f"debug={option}")
    runner.check(cfg)
    shortened = dict(cfg.debug.get("shortened") or {})
    assert set(shortened) <= {"accumulate.every", "schedule.warmup_steps"}
    if shortened:
        assert cfg.debug.shorten and "shortened to fit trainer.max_steps=" in runner.debug_lines(cfg)[0]
        if "accumulate.every" in shortened:
            assert cfg.trainer.max_steps % cfg.accumulate.every == 0 < cfg.accumulate.every < shortened["accumulate.every"]
        if "schedule.warmup_steps" in shortened:
            assert cfg.schedule.warmup_steps < cfg.trainer.max_steps <= shortened["schedule.warmup_steps"]


def test_a_run_without_debug_is_refused_rather_than_shortened():
    with pytest.raises(runner.ConfigError, match=r"^accumulate.every=4: trainer.max_steps=3 is not a multiple"):
        runner.check(cfg_of("experiment=tiny_lm", "trainer.max_steps=3"))
    with pytest.raises(runner.ConfigError, match=r"^accumulate.every=4: trainer.max_steps=3 is not a multiple"):
        runner.check(cfg_of("experiment=tiny_lm", "debug=fast", "debug.shorten=false"))


def test_fast_runs_a_shortened_experiment_and_says_so(tmp_path, caplog):
    """tiny_lm (bf16, accumulate=k4, warmup 80) in debug=fast's 3 steps: one update of 3 micro-batches."""
    caplog.set_level(logging.INFO, logger="fxtrain")
    runner.train(cfg_of("experiment=tiny_lm", "debug=fast", *FAST, "data.max_bytes=20000"), tmp_path)
    assert lines(caplog, "debug  ") == [
        "debug  debug=fast: no checkpoints (nothing for resume=auto), limit_val=2, limit_test=2, shortened to fit "
        "trainer.max_steps=3: accumulate.every 4 -> 3, schedule.warmup_steps 80 -> 1"]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


@pytest.mark.multiprocess
def test_fast_runs_every_shipped_experiment(tmp_path):
    """`-m 'experiment=glob(*)' debug=fast`, as the issue ran it (measured: 11 jobs, 12.5 s of CPU)."""
    assert run_main("-m", "experiment=glob(*)", "debug=fast", f"hydra.sweep.dir={tmp_path}") == 0
    text = (tmp_path / "summary.csv").read_text()
    assert text.count("completed") == len(EXPERIMENTS) and "failed" not in text, text


@pytest.mark.multiprocess
def test_profile_leaves_out_kineto_s_own_lines(tmp_path):
    # torch.profiler's engine wrote "USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start" (and
    # profiler_stop) to stderr. A fresh process, as a user runs it: kineto reads its log level once per process.
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-m", "fxtrain.train", "debug=profile", *SMALL, "hydra.run.dir=run"],
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile steps 4..8: " in proc.stdout
    for shown in (proc.stdout, proc.stderr, (tmp_path / "run" / "train.log").read_text()):
        assert "profiler_start" not in shown and "SyncActivityProfilerHandler" not in shown, shown[-3000:]
