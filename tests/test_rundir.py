"""A run directory belongs to one run (fxtrain/rundir.py, issue 15 findings 1, 2, 3 and 7): another config is
refused and the run there untouched, resume=PATH into an older step rewinds the directory, keep_last never
deletes the newest checkpoint, a second live process is refused naming the first, a cut-off summary.json is
reported by name and resume=auto goes on from the newest checkpoint."""

import csv
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
import torch

import fxtrain as fx
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
    """The step_<N> checkpoints; checkpoints/best (never pruned) is asserted on by name where it matters."""
    return sorted(p.name for p in (pathlib.Path(run_dir) / "checkpoints").iterdir() if p.name != "best")


def best_step(run_dir):
    """The step checkpoints/best holds (its manifest's meta), or None when there is none."""
    path = pathlib.Path(run_dir) / "checkpoints" / "best"
    return fx.checkpoint.verify(path)["meta"]["best"]["step"] if path.is_dir() else None


def test_another_config_is_refused_and_the_run_there_is_untouched(tmp_path):
    run = tmp_path / "run"
    value = runner.train(cfg_of(*RUN), run)
    before = files(run)
    assert checkpoints(run) == ["step_0000015", "step_0000020"] and best_step(run) is not None

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
    full, full_best = records(run), best_step(run)
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
    assert best_step(run) is None or best_step(run) <= 10                # a best from after step 10 is dropped

    monkeypatch.undo()
    assert runner.train(cfg_of(*RUN, "trainer.keep_last=0", "resume=auto"), run) == whole
    assert records(run) == full
    assert best_step(run) == full_best


def test_keep_last_negative_is_refused_and_never_deletes_the_newest(tmp_path):
    with pytest.raises(build.ConfigError, match=r"trainer\.keep_last=-1: .*0 to keep every checkpoint"):
        runner.train(cfg_of(*RUN, "trainer.keep_last=-1"), tmp_path / "a")
    assert not (tmp_path / "a").exists()                                  # refused before anything was written
    runner.train(cfg_of(*RUN, "trainer.keep_last=1"), tmp_path / "b")
    assert checkpoints(tmp_path / "b") == ["step_0000020"]
    assert best_step(tmp_path / "b") is not None                          # best is not a step_<N>: keep_last spares it


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


# --- issue 25 part 5: run directories never lie or block -----------------------------------------------

SHORT = [*RUN, "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.keep_last=0", "trainer.eval_every=2"]


def every_file(run_dir):
    """Every file under ``run_dir`` (the lock and Hydra's files included), as bytes."""
    return {p: p.read_bytes() for p in pathlib.Path(run_dir).rglob("*") if p.is_file()}


def redigest(path, edit):
    """Edits the manifest of the checkpoint ``path`` and recomputes its checksum, as fx.save computes it."""
    from fxtrain import checkpoint

    f = path / checkpoint.MANIFEST
    m = edit(json.loads(f.read_text()))
    m["digest"] = checkpoint._digest(m)
    f.write_text(json.dumps(m, indent=1))


def test_a_refused_relaunch_leaves_the_run_directory_byte_identical(tmp_path, capsys):
    """Hydra wrote .hydra/ before fxtrain refused, so the report showed the refused launch's lr: now .hydra/ is
    written once the launch is accepted, and a refused one changes no byte (the lock's holder record included)."""
    from tests._runner import run_main

    assert run_main(*SHORT, "hydra.run.dir=run") == 0
    run = tmp_path / "run"
    assert "- trainer.max_steps=4" in (run / ".hydra" / "overrides.yaml").read_text()
    assert (run / ".hydra" / "config.yaml").exists() and (run / ".hydra" / "hydra.yaml").exists()
    before = every_file(run)
    for refused in (["optim.chain.adamw.learning_rate=0.05"], [], ["resume=auto", "trainer.log_every=0"]):
        code = run_main(*SHORT, "hydra.run.dir=run", *refused)
        assert isinstance(code, str) and code.startswith("Error: "), (refused, code)
        assert every_file(run) == before, refused
    # the report still reads the run's own overrides
    from fxtrain import report

    [row] = report.collect(run)
    assert row["status"] == "completed" and "optim.chain.adamw.learning_rate" not in row


def test_resume_path_refuses_another_runs_checkpoint_unless_forced(tmp_path):
    """resume=<another run's checkpoint> into a completed run deleted its later checkpoints and metrics and went
    on with the other run's state: refused, naming the keys that differ, unless resume_force=true."""
    a, b = tmp_path / "a", tmp_path / "b"
    runner.train(cfg_of(*SHORT), a)
    runner.train(cfg_of(*SHORT, "optim.chain.adamw.learning_rate=0.03"), b)
    before = files(a)
    other = f"resume={b / 'checkpoints' / 'step_0000002'}"
    with pytest.raises(rundir.RunDirError, match=r"resume=.*step_0000002: the checkpoint is of another config "
                                                 r"\(optim\.chain\.adamw\.learning_rate=0\.03 there, 0\.01 here\).*"
                                                 r"resume_force=true"):
        runner.train(cfg_of(*SHORT, other), a)
    assert files(a) == before                                             # a's checkpoints and metrics kept
    # its own older checkpoint is this run's: resume=PATH into an older step still rewinds
    runner.train(cfg_of(*SHORT, f"resume={a / 'checkpoints' / 'step_0000002'}"), a)
    forced = runner.train(cfg_of(*SHORT, other, "resume_force=true"), tmp_path / "c")
    assert [r["step"] for r in records(tmp_path / "c")] == [3, 4]
    assert forced == forced  # finished, from b's state under this config
    with pytest.raises(build.ConfigError, match=r"resume_force='?yes'?: expected true"):
        runner.train(cfg_of(*SHORT, other, "resume_force=yes"), tmp_path / "d")


def test_another_world_size_or_layout_is_refused_unless_relayout(tmp_path, caplog):
    """fsdp 2 -> 4 ranks, dp 2 ranks -> 1 process resumed without a word: the world size and layout are in
    run.json and in every checkpoint's manifest, and a change is refused unless resume_relayout=true; the
    start line then says so. (The 2-rank run is stood for by its records: a checkpoint's manifest and run.json
    rewritten as a torchrun dp=2 run writes them.)"""
    run = tmp_path / "run"
    cfg = [*SHORT, "parallel=dp"]
    runner.train(cfg_of(*cfg), run)
    owner = json.loads((run / "run.json").read_text())
    assert (owner["world_size"], owner["layout"]) == (1, "parallel=none")
    (run / "summary.json").unlink()                                       # killed after its step-4 checkpoint
    two = {"world_size": 2, "layout": "parallel dp_replicate=2"}
    for step in ("step_0000002", "step_0000004"):
        path = run / "checkpoints" / step
        assert fx.checkpoint.verify(path)["meta"]["layout"] == "parallel=none"
        redigest(path, lambda m: {**m, "world_size": 2, "meta": {**m["meta"], **two}})
    rundir.write_json(run / "run.json", {**owner, **two})
    before = files(run)
    for resume in ("resume=auto", f"resume={run / 'checkpoints' / 'step_0000002'}"):
        with pytest.raises(rundir.RunDirError, match=r"was trained on 2 ranks, parallel dp_replicate=2; this launch is "
                                                     r"1 process, parallel=none.*resume_relayout=true"):
            runner.train(cfg_of(*cfg, resume), run)
    assert files(run) == before
    # into another directory: the checkpoint's own manifest says it (no run.json there to tell)
    with pytest.raises(rundir.RunDirError, match=r"the checkpoint .*step_0000002 was trained on 2 ranks"):
        runner.train(cfg_of(*cfg, f"resume={run / 'checkpoints' / 'step_0000002'}"), tmp_path / "elsewhere")
    # parallel=none is the same run on another layout: its parallel.* keys are the layout, not another config,
    # and the refusal names the key that continues it (issue 35: it named resume_force, which led to a second
    # refusal naming resume_relayout)
    with pytest.raises(rundir.RunDirError, match=r"^resume=.*step_0000002: the checkpoint was trained on another "
                                                 r"parallel layout \(parallel\.dp_replicate=-1 there, 1 here\), "
                                                 r"[^\n]*pass resume_relayout=true to continue it on this one") as e:
        runner.train(cfg_of(*SHORT, f"resume={run / 'checkpoints' / 'step_0000002'}"), tmp_path / "none")
    assert "resume_force" not in str(e.value)
    runner.train(cfg_of(*SHORT, f"resume={run / 'checkpoints' / 'step_0000002'}", "resume_relayout=true"),
                 tmp_path / "none")
    with caplog.at_level("INFO", logger="fxtrain"):
        runner.train(cfg_of(*cfg, "resume=auto", "resume_relayout=true"), run)
    assert ("(step 4), relayout from 2 ranks, parallel dp_replicate=2 to 1 process, parallel=none" in caplog.text)
    owner = json.loads((run / "run.json").read_text())
    assert (owner["world_size"], owner["layout"]) == (1, "parallel=none")


def test_a_launch_that_failed_before_its_first_checkpoint_can_be_rerun_corrected(tmp_path, monkeypatch):
    """A launch that failed at step 1 blocked its directory (the corrected command was refused, advising
    resume=auto): with no checkpoint there, it is rerun into the same directory, from step 0, one timeline."""
    from tests._runner import run_main

    log = loggers.JsonlLogger.log

    def failing_log(self, step, metrics):
        log(self, step, metrics)
        raise RuntimeError("a bug at step 1")

    monkeypatch.setattr(loggers.JsonlLogger, "log", failing_log)
    assert run_main(*SHORT, "hydra.run.dir=run", "optim.chain.adamw.learning_rate=0.5") == 1
    run = tmp_path / "run"
    assert json.loads((run / "summary.json").read_text())["error"] == "RuntimeError: a bug at step 1"
    assert [r["step"] for r in records(run)] == [1] and not (run / "checkpoints").exists()
    monkeypatch.setattr(loggers.JsonlLogger, "log", log)                  # (undo() would undo isolate's chdir too)

    code = run_main(*SHORT, "hydra.run.dir=run")
    assert code == 0, code                                                # corrected: accepted, starts over
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]
    assert "- optim.chain.adamw.learning_rate=0.5" not in (run / ".hydra" / "overrides.yaml").read_text()
    assert json.loads((run / "run.json").read_text())["config"]["optim.chain.adamw.learning_rate"] == 0.01


def test_a_sweep_job_refused_for_a_setting_says_why_in_summary_csv(tmp_path):
    from tests._runner import run_main

    run_main("-m", *SHORT, "hydra.sweep.dir=sweep", "trainer.log_every=1,0")
    with open(tmp_path / "sweep" / "summary.csv", newline="") as f:
        rows = {r["job"]: r for r in csv.DictReader(f)}
    assert rows["0"]["status"] == "completed"
    assert rows["1"]["status"] == "refused"
    assert rows["1"]["error"].startswith("ConfigError: trainer.log_every=0: expected a positive whole number")
    assert rows["1"]["trainer.log_every"] == "0"                           # its overrides, from its .hydra/
    summary = json.loads((tmp_path / "sweep" / "1" / "summary.json").read_text())
    assert summary["status"] == "refused" and "trainer.log_every=0" in summary["error"]


# --- a refused launch writes nothing, in a fresh directory too (issue 35 item 5) ---------------------------------
# Refusals raised once the directory was claimed (the data, an empty split, the resume's checkpoint) left run.json,
# .hydra/, config.yaml, run.lock, a failed summary.json, and Hydra's train.log, in a directory no run ever used.

def bad_settings(tmp_path):
    """One refusal of each kind: validation, the data when built, an empty split, resume=PATH (none there, and a
    checkpoint of another tree, refused when loaded)."""
    foreign = fx.save(tmp_path / "foreign" / "step_0000002", fx.TrainState(2, {"w": torch.zeros(3)}, None))
    return [["data.test_fraction=2"], ["trainer.keep_last=-1"], ["data.batch_size=100000"],
            ["data.num_examples=40", "data.test_fraction=0.01"], [f"resume={tmp_path / 'missing'}"],
            [f"resume={foreign}"]]


def test_a_refused_launch_into_a_fresh_directory_leaves_nothing(tmp_path):
    from tests._runner import run_main

    for i, refused in enumerate(bad_settings(tmp_path)):
        code = run_main(*SHORT, f"hydra.run.dir=fresh/{i}", *refused)
        assert isinstance(code, str) and code.startswith("Error: ") and "\n" not in code, (refused, code)
        assert not (tmp_path / "fresh" / str(i)).exists(), (refused, sorted(every_file(tmp_path / "fresh" / str(i))))
    # a directory that was there before (empty) stays, empty: nothing of a refused launch is kept, nothing else goes
    (tmp_path / "mine").mkdir()
    assert run_main(*SHORT, "hydra.run.dir=mine", "data.batch_size=100000").startswith("Error: ")
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())
    # and an accepted launch into it writes as before
    assert run_main(*SHORT, "hydra.run.dir=mine") == 0
    written = {p.name for p in (tmp_path / "mine").iterdir()}
    assert {"run.json", "config.yaml", "summary.json", "train.log", ".hydra"} <= written
