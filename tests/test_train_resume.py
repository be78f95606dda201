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
from fxtrain import build, train as runner
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
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000005", "step_0000010"]
    assert not (run / "summary.json").exists()

    runner.main(args)                                                     # relaunched, in this process

    assert records(run) == records(tmp_path / "whole")                   # steps 1..20 once each, same values
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["value"] == value
    assert_same_final_state(final_state(run, cfg), final_state(tmp_path / "whole", cfg))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000015", "step_0000020"]  # keep_last=2
    assert f"start  from {run / 'checkpoints' / 'step_0000010'} (step 10)" in (run / "train.log").read_text()


def test_resume_auto_on_a_finished_run_changes_nothing(tmp_path):
    cfg = cfg_of(*RUN, "trainer.max_steps=6", "resume=auto")
    value = runner.train(cfg, tmp_path)
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert runner.train(cfg, tmp_path) == value
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files


def test_resume_from_a_path_continues_in_a_new_run_directory(tmp_path):
    cfg = cfg_of(*RUN, "trainer.max_steps=8", "trainer.checkpoint_every=4", "trainer.keep_last=0")
    value = runner.train(cfg, tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_0000004", "step_0000008"]
    resumed = cfg_of(*RUN, "trainer.max_steps=8", "trainer.checkpoint_every=4", f"resume={tmp_path / 'a' / 'checkpoints' / 'step_0000004'}")
    assert runner.train(resumed, tmp_path / "b") == value
    assert records(tmp_path / "b") == records(tmp_path / "a")[4:]         # steps 5..8
    assert_same_final_state(final_state(tmp_path / "b", cfg), final_state(tmp_path / "a", cfg))
    with pytest.raises(build.ConfigError, match=r"resume=.*nowhere: no checkpoint there"):
        runner.train(cfg_of(*RUN, f"resume={tmp_path / 'nowhere'}"), tmp_path / "c")
