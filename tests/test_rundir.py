"""A run directory belongs to one run (fxtrain/rundir.py, issue 15 findings 1, 2, 3 and 7): another config is
refused and the run there untouched, resume=PATH into an older step rewinds the directory, keep_last never
deletes the newest checkpoint, a second live process is refused naming the first, a cut-off summary.json is
reported by name and resume=auto goes on from the newest checkpoint."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from fxtrain import build, loggers, rundir, train as runner
from fxtrain.report import read_jsonl
from tests._runner import cfg_of, isolate  # noqa: F401 - isolate: autouse

RUN = ["experiment=smoke", "trainer.max_steps=20", "trainer.log_every=1", "trainer.eval_every=5",
       "trainer.checkpoint_every=5", "trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=1"]


def records(run_dir):
    """metrics.jsonl without the wall-clock column."""
    return [{k: v for k, v in r.items() if k != "time_s"} for r in read_jsonl(pathlib.Path(run_dir) / "metrics.jsonl")]


def files(run_dir):
    """Every file a run wrote (not the lock, which records the last holder), as bytes."""
    return {p: p.read_bytes() for p in pathlib.Path(run_dir).rglob("*") if p.is_file() and p.name != rundir.LOCK}


def checkpoints(run_dir):
    return sorted(p.name for p in (pathlib.Path(run_dir) / "checkpoints").iterdir())


def test_another_config_is_refused_and_the_run_there_is_untouched(tmp_path):
    run = tmp_path / "run"
    value = runner.train(cfg_of(*RUN), run)
    before = files(run)
    assert checkpoints(run) == ["step_0000015", "step_0000020"]

    other = [*RUN, "optim.chain.adamw.learning_rate=3e-2"]
    for resume in ("resume=null", "resume=auto"):
        with pytest.raises(rundir.RunDirError, match=r"holds another run's config \(optim\.chain\.adamw\."
                           r"learning_rate=0\.01 there, 0\.03 here\).*resume=auto.*another hydra\.run\.dir"):
            runner.train(cfg_of(*other, resume), run)
    # The same config again without resume would log every step twice: refused too, saying how to continue.
    with pytest.raises(rundir.RunDirError, match=r"holds this run already, completed at step 20.*pass resume=auto"):
        runner.train(cfg_of(*RUN), run)
    assert files(run) == before                                           # checkpoints, metrics, summary as they were
    assert runner.train(cfg_of(*RUN, "resume=auto"), run) == value        # and it is still that run's directory


def test_resume_from_an_older_step_of_the_same_directory_rewinds_it(tmp_path, monkeypatch):
    run = tmp_path / "run"
    whole = runner.train(cfg_of(*RUN, "trainer.keep_last=0"), run)
    full = records(run)
    assert checkpoints(run) == ["step_0000005", "step_0000010", "step_0000015", "step_0000020"]

    log = loggers.JsonlLogger.log

    def failing_log(self, step, metrics):  # the resumed run dies after logging step 13
        log(self, step, metrics)
        if step == 13:
            raise KeyboardInterrupt

    monkeypatch.setattr(loggers.JsonlLogger, "log", failing_log)
    with pytest.raises(KeyboardInterrupt):
        runner.train(cfg_of(*RUN, "trainer.keep_last=0", f"resume={run / 'checkpoints' / 'step_0000010'}"), run)
    assert not (run / "summary.json").exists()                           # no stale "completed" summary
    assert [r["step"] for r in records(run)] == list(range(1, 14))       # each step once
    assert checkpoints(run) == ["step_0000005", "step_0000010"]          # one timeline: 15 and 20 were after 10

    monkeypatch.undo()
    assert runner.train(cfg_of(*RUN, "trainer.keep_last=0", "resume=auto"), run) == whole
    assert records(run) == full


def test_keep_last_negative_is_refused_and_never_deletes_the_newest(tmp_path):
    with pytest.raises(build.ConfigError, match=r"trainer\.keep_last=-1: .*0 to keep every checkpoint"):
        runner.train(cfg_of(*RUN, "trainer.keep_last=-1"), tmp_path / "a")
    assert not (tmp_path / "a").exists()                                  # refused before anything was written
    runner.train(cfg_of(*RUN, "trainer.keep_last=1"), tmp_path / "b")
    assert checkpoints(tmp_path / "b") == ["step_0000020"]


# Runs fxtrain.train.main and stops after logging step 3 (touches ./ready) until ./go exists.
HOLDS_AT_3 = """
import pathlib, sys, time
from fxtrain import loggers, train
log = loggers.JsonlLogger.log
def holding_log(self, step, metrics):
    log(self, step, metrics)
    if step == 3:
        pathlib.Path("ready").touch()
        while not pathlib.Path("go").exists():
            time.sleep(0.05)
loggers.JsonlLogger.log = holding_log
train.main(sys.argv[1:])
"""


def test_a_second_process_on_a_live_run_directory_is_refused_naming_the_first(tmp_path):
    args = [*RUN, "hydra.run.dir=run", "resume=auto"]
    proc = subprocess.Popen([sys.executable, "-c", HOLDS_AT_3, *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the first process never reached step 3"
            time.sleep(0.05)
        holder = f"in use by process {proc.pid} on {socket.gethostname()}"
        for resume in ("resume=auto", "resume=null"):
            with pytest.raises(rundir.RunDirError, match=holder):
                runner.train(cfg_of(*RUN, resume), tmp_path / "run")
        assert [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3]   # the live run's log, untouched
    finally:
        (tmp_path / "go").touch()
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert [r["step"] for r in records(tmp_path / "run")] == list(range(1, 21))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


def test_a_cut_off_summary_is_named_and_resume_auto_goes_on_from_the_newest_checkpoint(tmp_path, caplog):
    run = tmp_path / "run"
    cfg = cfg_of(*RUN, "resume=auto")
    value = runner.train(cfg, run)
    full = records(run)
    text = (run / "summary.json").read_text()
    (run / "summary.json").write_text(text[:len(text) // 2])            # killed mid-write (before writes were atomic)

    with pytest.raises(rundir.RunDirError, match=r"summary\.json is not valid JSON \(.*line \d+ column \d+.*\): "
                                                 r"cut off"):
        rundir.read_summary(run)
    with caplog.at_level("WARNING", logger="fxtrain"):
        assert runner.train(cfg, run) == value                           # evaluated again at step 20
    assert "summary.json is not valid JSON" in caplog.text
    assert json.loads((run / "summary.json").read_text())["value"] == value
    assert records(run) == full


def test_summary_is_written_atomically(tmp_path, monkeypatch):
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((pathlib.Path(src), pathlib.Path(dst))),
                                                         real(src, dst))[1])
    runner.train(cfg_of(*RUN, "trainer.max_steps=2"), tmp_path)
    assert (tmp_path / ".summary.json.tmp", tmp_path / "summary.json") in replaced
    assert not list(tmp_path.glob(".*.tmp"))
