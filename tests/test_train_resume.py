"""The Hydra runner's checkpoints and resume (fxtrain/train.py): a run killed by SIGKILL mid-run and relaunched
with resume=auto ends where the uninterrupted run ends, metrics.jsonl included; resume=PATH; resume=auto on a
finished run changes nothing; keep_last."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

import fxtrain as fx
from fxtrain import build, loggers, train as runner
from fxtrain.report import read_jsonl
from tests._runner import cfg_of, isolate, load_checkpoint  # noqa: F401 - isolate: autouse

RUN = ["experiment=smoke", "trainer.max_steps=20", "trainer.log_every=1", "trainer.eval_every=5",
       "trainer.checkpoint_every=5", "trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=1"]

# Dies by SIGKILL right after metrics.jsonl got its line for step 13: the checkpoint of step 10 is the last one,
# and 3 logged steps lie beyond it.
KILLED_AT_13 = """
import os, signal, sys
from fxtrain import loggers, train
log = loggers.JsonlLogger.log
def killing_log(self, step, metrics):
    log(self, step, metrics)
    if step == 13:
        os.kill(os.getpid(), signal.SIGKILL)
loggers.JsonlLogger.log = killing_log
train.main(sys.argv[1:])
"""


def records(run_dir):
    """metrics.jsonl without the wall-clock column."""
    return [{k: v for k, v in r.items() if k != "time_s"} for r in read_jsonl(pathlib.Path(run_dir) / "metrics.jsonl")]


def final_state(run_dir, cfg):
    return load_checkpoint(fx.checkpoint.latest(pathlib.Path(run_dir) / "checkpoints"), cfg)


def step_checkpoints(run_dir):
    """The step_<N> checkpoints of a run; ``checkpoints/best`` (never pruned) is asserted on by name where it matters."""
    return sorted(p.name for p in (pathlib.Path(run_dir) / "checkpoints").iterdir() if p.name != "best")


def best_record(run_dir):
    """checkpoints/best's recorded step, metric and value (its manifest's meta)."""
    return fx.checkpoint.verify(pathlib.Path(run_dir) / "checkpoints" / "best")["meta"]["best"]


def assert_same_final_state(a, b):
    for path, x, y in zip(fx.tree.paths(a), fx.tree.flatten(a)[0], fx.tree.flatten(b)[0]):
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f"at '{path}'"


def test_killed_run_resumed_with_auto_ends_like_the_uninterrupted_run(tmp_path):
    cfg = cfg_of(*RUN)
    value = runner.train(cfg, tmp_path / "whole")

    args = [*RUN, "hydra.run.dir=run", "resume=auto"]
    proc = subprocess.run([sys.executable, "-c", KILLED_AT_13, *args], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    run = tmp_path / "run"
    assert [r["step"] for r in records(run)] == list(range(1, 14))
    assert step_checkpoints(run) == ["step_0000005", "step_0000010"]
    assert best_record(run)["step"] <= 10                                 # the best so far, from before the kill
    assert not (run / "summary.json").exists()

    runner.main(args)                                                     # relaunched, in this process

    assert records(run) == records(tmp_path / "whole")                   # steps 1..20 once each, same values
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["value"] == value
    assert_same_final_state(final_state(run, cfg), final_state(tmp_path / "whole", cfg))
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["best_step"] == whole["best_step"] and summary["test_ckpt"] == whole["test_ckpt"]
    assert {k: v for k, v in summary["metrics"].items() if k.startswith(("val_", "test_"))} == \
           {k: v for k, v in whole["metrics"].items() if k.startswith(("val_", "test_"))}  # tested on the same best
    assert best_record(run) == best_record(tmp_path / "whole")
    assert_same_final_state(load_checkpoint(run / "checkpoints" / "best", cfg),
                            load_checkpoint(tmp_path / "whole" / "checkpoints" / "best", cfg))
    assert step_checkpoints(run) == ["step_0000015", "step_0000020"]     # keep_last=2; best is never pruned
    assert f"start  from {run / 'checkpoints' / 'step_0000010'} (step 10)" in (run / "train.log").read_text()


class Killed(BaseException):
    """Ends a run in this process as a kill does: no handler of the runner catches it, nothing runs after it."""


def test_a_kill_between_an_improvement_and_the_next_checkpoint_loses_it_on_disk_and_the_resume_finds_it_again(
        tmp_path, monkeypatch):
    """checkpoints/best is written with the next regular checkpoint, not at the improvement (issue 36, item 5;
    fxtrain/selection.py says what a kill loses): killed after step 7's line, the run's best of steps 5-7 is not on
    disk, which holds the best of steps 1-4 (written with step 4's checkpoint); the resume from step 4 redoes 5-7,
    finds the same improvements and ends with the uninterrupted run's checkpoints/best. (The SIGKILL itself, and
    what it leaves, is test_killed_run_resumed_with_auto_ends_like_the_uninterrupted_run's.)"""
    args = [*RUN, "trainer.max_steps=12", "trainer.eval_every=1", "trainer.checkpoint_every=4",
            "trainer.checkpoint.best_by=val_loss"]
    cfg = cfg_of(*args)
    runner.train(cfg, tmp_path / "whole")
    lines = records(tmp_path / "whole")
    best_up_to = {n: min((r for r in lines if r["step"] <= n), key=lambda r: (r["val_loss"], r["step"])) for n in (4, 7)}
    assert best_up_to[7]["step"] > 4                                      # a premise: an improvement after step 4

    log = loggers.JsonlLogger.log

    def killed_after_7(self, step, metrics):
        log(self, step, metrics)
        if step == 7:
            raise Killed

    monkeypatch.setattr(loggers.JsonlLogger, "log", killed_after_7)
    run = tmp_path / "run"
    with pytest.raises(Killed):
        runner.train(cfg_of(*args), run)
    monkeypatch.setattr(loggers.JsonlLogger, "log", log)
    assert [r["step"] for r in records(run)] == list(range(1, 8)) and step_checkpoints(run) == ["step_0000004"]
    on_disk = best_record(run)                                            # what the kill lost: steps 5-7's best
    assert (on_disk["step"], on_disk["value"]) == (best_up_to[4]["step"], best_up_to[4]["val_loss"])

    runner.train(cfg_of(*args, "resume=auto"), run)                       # from step 4

    assert best_record(run) == best_record(tmp_path / "whole")
    assert_same_final_state(load_checkpoint(run / "checkpoints" / "best", cfg),
                            load_checkpoint(tmp_path / "whole" / "checkpoints" / "best", cfg))
    summary, whole = (json.loads((d / "summary.json").read_text()) for d in (run, tmp_path / "whole"))
    assert summary["best_step"] == whole["best_step"] and summary["metrics"] == whole["metrics"]


def test_resume_auto_on_a_finished_run_changes_nothing(tmp_path):
    cfg = cfg_of(*RUN, "trainer.max_steps=6", "resume=auto")
    value = runner.train(cfg, tmp_path)
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert runner.train(cfg, tmp_path) == value
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files


def test_resume_from_a_path_continues_in_a_new_run_directory(tmp_path):
    cfg = cfg_of(*RUN, "trainer.max_steps=8", "trainer.checkpoint_every=4", "trainer.keep_last=0")
    value = runner.train(cfg, tmp_path / "a")
    assert step_checkpoints(tmp_path / "a") == ["step_0000004", "step_0000008"]
    assert (tmp_path / "a" / "checkpoints" / "best").is_dir()
    resumed = cfg_of(*RUN, "trainer.max_steps=8", "trainer.checkpoint_every=4", f"resume={tmp_path / 'a' / 'checkpoints' / 'step_0000004'}")
    assert runner.train(resumed, tmp_path / "b") == value
    assert records(tmp_path / "b") == records(tmp_path / "a")[4:]         # steps 5..8
    assert_same_final_state(final_state(tmp_path / "b", cfg), final_state(tmp_path / "a", cfg))
    with pytest.raises(build.ConfigError, match=r"resume=.*nowhere: no checkpoint there"):
        runner.train(cfg_of(*RUN, f"resume={tmp_path / 'nowhere'}"), tmp_path / "c")


# --- issue 25 parts 4 and 5: resume loads no code, falls back past a damaged checkpoint, a full disk is one
# line, the final summary carries every metric after any kill ------------------------------------------------

SHORT = [*RUN, "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.keep_last=0", "trainer.eval_every=2"]


def killed_after(run, step):
    """``run`` as a kill right after its step-``step`` checkpoint leaves it: no summary, no later checkpoint."""
    (run / "summary.json").unlink()
    for p in (run / "checkpoints").iterdir():
        if (best_record(run)["step"] if p.name == "best" else int(p.name.split("_")[1])) > step:
            for f in p.iterdir():
                f.unlink()
            p.rmdir()


def test_resume_refuses_a_crafted_checkpoint_and_runs_nothing(tmp_path):
    """A crafted .metadata ran its payload through resume=auto and resume=PATH, and the run finished normally."""
    from tests._runner import run_main
    from tests.test_checkpoint_safety import craft

    run = tmp_path / "run"
    runner.train(cfg_of(*SHORT), run)
    killed_after(run, 2)
    ckpt = run / "checkpoints" / "step_0000002"
    marker = tmp_path / "marker"
    craft(ckpt, marker)
    for resume, where in (("resume=auto", "run"), (f"resume={ckpt}", "run"), (f"resume={ckpt}", "other")):
        code = run_main(*SHORT, f"hydra.run.dir={where}", resume)
        assert code == f"Error: {resume}: checkpoint {ckpt}: .metadata is refused: it names builtins.exec, which " \
                       "DCP's metadata never holds (a crafted file would run it: refused, nothing was run)", code
        assert not marker.exists()
    assert not (run / "summary.json").exists() and not (tmp_path / "other" / "summary.json").exists()


def test_resume_auto_falls_back_past_a_damaged_newest_checkpoint(tmp_path, caplog):
    whole = runner.train(cfg_of(*SHORT), tmp_path / "whole")
    run = tmp_path / "run"
    runner.train(cfg_of(*SHORT), run)
    killed_after(run, 4)
    newest = run / "checkpoints" / "step_0000004"
    [data] = newest.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))                                          # a bit flipped on disk
    with caplog.at_level("INFO", logger="fxtrain"):
        assert runner.train(cfg_of(*SHORT, "resume=auto"), run) == whole
    assert f"resume=auto: checkpoint {newest} is corrupted: {data.name} does not match its checksum; going on " \
           "from the previous checkpoint, step_0000002" in caplog.text
    assert f"start  from {run / 'checkpoints' / 'step_0000002'} (step 2)" in caplog.text
    assert records(run) == records(tmp_path / "whole")
    fx.checkpoint.verify(newest)                                          # written again
    # none that verifies: refused, never a silent start at step 0
    killed_after(run, 4)
    for p in (run / "checkpoints").iterdir():
        (p / ".metadata").write_bytes(b"damaged")
    with pytest.raises(Exception, match=r"resume=auto: checkpoint .*step_0000004 is truncated.*\(and every older "
                                        r"checkpoint in .* too\)"):
        runner.train(cfg_of(*SHORT, "resume=auto"), run)


def test_disk_full_during_a_save_is_one_line_and_a_failed_summary(tmp_path, monkeypatch, capsys):
    """DCP's CheckpointException is not an Exception: a full disk gave an 82-line traceback and no summary."""
    import errno
    import torch.distributed.checkpoint as dcp
    from tests._runner import run_main

    write = dcp.FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        if "step_0000004" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full_disk)
    code = run_main(*SHORT, "hydra.run.dir=run")
    err = capsys.readouterr().err
    assert code == ("Error: no space left on the device: the run stopped, its complete checkpoints are intact; free "
                    "some space and relaunch with resume=auto, or write elsewhere (hydra.run.dir=...)"), code
    assert "Traceback" not in err
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"].startswith(f"CheckpointError: could not write the checkpoint {run / 'checkpoints'}"
                                       "/step_0000004: OSError: [Errno 28] No space left on device; the last "
                                       "checkpoint is step 2")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", "step_0000002"]  # no .saving left over
    fx.checkpoint.verify(run / "checkpoints" / "step_0000002")
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write)
    assert run_main(*SHORT, "hydra.run.dir=run", "resume=auto") == 0     # space freed: it goes on from step 2
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_a_kill_after_the_final_checkpoint_keeps_every_metric_in_the_summary(tmp_path):
    run = tmp_path / "run"
    runner.train(cfg_of(*SHORT), run)
    whole = json.loads((run / "summary.json").read_text())
    assert {"loss", "accuracy", "grad_norm", "learning_rate", "test_loss", "test_accuracy"} <= set(whole["metrics"])
    killed_after(run, 4)
    runner.train(cfg_of(*SHORT, "resume=auto"), run)                    # evaluates step 4 again
    resumed = json.loads((run / "summary.json").read_text())
    assert set(resumed["metrics"]) == set(whole["metrics"])
    for k in ("loss", "accuracy", "grad_norm", "learning_rate"):         # the train metrics of step 4's log line
        assert resumed["metrics"][k] == whole["metrics"][k], k
    assert resumed["best_step"] == whole["best_step"]                    # checkpoints/best survived the kill
    for k in [k for k in whole["metrics"] if k.startswith(("val_", "test_"))]:  # the same best params tested again
        assert resumed["metrics"][k] == pytest.approx(whole["metrics"][k], rel=1e-6), k


def test_disk_full_during_the_best_save_is_one_line_and_keeps_the_previous_best(tmp_path, monkeypatch, capsys):
    """checkpoints/best's save went past the runner's handler: a raw DCP traceback and no summary.json."""
    import errno
    import torch.distributed.checkpoint as dcp
    from tests._runner import run_main

    whole = runner.train(cfg_of(*SHORT), tmp_path / "whole")
    write, saves = dcp.FileSystemWriter.write_data, []

    def full_disk(self, plan, planner):
        if ".best" in str(self.path):
            saves.append(self.path)
            if len(saves) == 2:                                           # the best of step 4 (step 2's was saved)
                raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full_disk)
    code = run_main(*SHORT, "hydra.run.dir=run")
    assert code.startswith("Error: no space left on the device: the run stopped"), code
    assert "Traceback" not in capsys.readouterr().err
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"] == (f"CheckpointError: could not write the checkpoint {run / 'checkpoints' / 'best'}: "
                                "OSError: [Errno 28] No space left on device; the previous best checkpoint is intact")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", "step_0000002"]
    assert best_record(run)["step"] == 2
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write)
    assert run_main(*SHORT, "hydra.run.dir=run", "resume=auto") == 0
    assert runner.train(cfg_of(*SHORT, "resume=auto"), run) == whole     # finished: the same value as uninterrupted
    assert best_record(run) == best_record(tmp_path / "whole")


def test_a_damaged_best_checkpoint_is_dropped_with_a_warning_and_the_run_goes_on(tmp_path, caplog):
    run = tmp_path / "run"
    runner.train(cfg_of(*SHORT), run)
    killed_after(run, 4)
    best = run / "checkpoints" / "best"
    (best / ".metadata").write_bytes(b"damaged")
    with caplog.at_level("INFO", logger="fxtrain"):
        runner.train(cfg_of(*SHORT, "resume=auto"), run)
    assert f"checkpoint {best} is damaged (" in caplog.text and "chosen from step 4 on" in caplog.text
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    # The last step was tested where the best was asked for: summary.json and the closing line say so, and why
    # (they said best_step: null and nothing else).
    why = ("trainer.test_ckpt=best, but checkpoints/best was damaged and dropped at the resume from step 4, and no "
           "step logged val_accuracy since: the last step was tested")
    assert summary["best_step"] is None and summary["tested"] == {"step": 4, "checkpoint": "last", "why": why}
    [done] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done   ")]
    assert done.endswith(f" | tested last (step 4: {why})"), done
    from fxtrain import report

    assert report.collect(run)[0]["tested"] == "last (step 4)"
