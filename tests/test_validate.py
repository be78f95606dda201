"""fxtrain/validate.py: every setting checked before a run writes anything, errors as one line, short-run defaults."""

import csv
import errno
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fxtrain as fx
from fxtrain import build, strategies, train as runner, validate
from fxtrain.report import read_jsonl
from tests._runner import cfg_of, isolate, run_main  # noqa: F401 - isolate: autouse

FAST = ["experiment=smoke", "trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=null"]
# Without experiment=smoke, whose optim.chain.adamw settings stay when the chain is replaced.
CHAIN = ["data=synthetic", "schedule=cosine", "trainer.max_steps=2", *FAST[1:]]
ROOT = pathlib.Path(runner.__file__).resolve().parent.parent


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m fxtrain.train *args`` in the test's directory (isolate: tmp_path)."""
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "fxtrain.train", *args], capture_output=True, text=True,
                          env={**environ, **(env or {})}, timeout=240)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The error a failed launch printed, checked to be one line and nothing else."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr
    return lines[0]


def refused(*overrides: str, base: list[str] = FAST) -> str:
    """The message train() refuses a short run with, before it writes anything in its directory."""
    with pytest.raises(build.ConfigError) as e:
        runner.train(cfg_of(*base, *overrides), "run")
    assert not pathlib.Path("run").exists(), "validation must come before anything is written"
    return str(e.value)


# --- one line on the command line --------------------------------------------------------------------

def test_cli_max_steps_abc_is_one_line_naming_key_and_value():
    line = one_line(cli(*FAST, "trainer.max_steps=abc"))
    assert line == ("Error: trainer.max_steps=abc: expected a positive whole number (optimizer steps, counted in "
                    "batches; at most 2**31-1); e.g. trainer.max_steps=1000")


def test_cli_empty_chain_is_one_line():
    line = one_line(cli(*FAST, "optim/transform@optim.chain=[]"))
    assert line.startswith("Error: optim.chain=[]: no transform") and "optim/transform@optim.chain=[" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_device_cuda_without_cuda_is_one_line():
    line = one_line(cli("experiment=smoke", "trainer.device=cuda"))
    assert line.startswith("Error: trainer.device=cuda: CUDA is not available here") and "trainer.device=cpu" in line
    assert not list(pathlib.Path().rglob("metrics.jsonl"))


def test_cli_hydra_full_error_shows_the_traceback():
    proc = cli(*FAST, "trainer.log_every=0", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "fxtrain.build.ConfigError: trainer.log_every=0: expected" in proc.stderr


def test_cli_ten_steps_with_the_defaults_works():
    proc = cli("trainer.max_steps=10", "trainer.progress=false", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr
    assert "warmup_steps=0, decay_steps=10" in proc.stdout  # 5% of the run
    records = read_jsonl("run/metrics.jsonl")
    assert [r["step"] for r in records if "test_accuracy" in r] == list(range(1, 11))


def test_unexpected_exception_keeps_its_traceback(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not a setting")

    monkeypatch.setattr(strategies, "evaluate", broken)  # the runner's evaluation
    assert run_main(*FAST, "trainer.max_steps=2", "hydra.run.dir=run") == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug, not a setting" in err


def test_full_disk_is_one_line(monkeypatch):
    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(fx, "save", full)
    code = run_main(*FAST, "trainer.max_steps=2", "hydra.run.dir=run")
    assert isinstance(code, str) and "\n" not in code, code
    assert code.startswith("Error: no space left on the device writing ") and "resume=auto" in code


def test_multirun_bad_job_is_compact_and_the_others_finish(capsys):
    code = run_main("-m", *FAST, "trainer.max_steps=0,2", "hydra.sweep.dir=sweep")
    assert code == 1
    err = capsys.readouterr().err
    assert "trainer.max_steps=0: expected a positive whole number" in err and "Traceback" not in err
    rows = list(csv.DictReader(pathlib.Path("sweep/summary.csv").read_text().splitlines()))
    assert [r["status"] for r in rows][1] == "completed"


# --- every trainer / data / seed setting -------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("trainer.max_steps=0", "trainer.max_steps=0: expected a positive whole number (optimizer steps"),
    ("trainer.log_every=0", "trainer.log_every=0: expected a positive whole number (steps between metrics.jsonl"),
    ("trainer.eval_every=0", "trainer.eval_every=0: expected a positive whole number (steps between evaluations"),
    ("trainer.eval_batch_size=0", "trainer.eval_batch_size=0: expected a positive whole number (examples per"),
    ("trainer.checkpoint_every=abc", "trainer.checkpoint_every=abc: expected a whole number >= 0"),
    ("trainer.keep_last=-1", "trainer.keep_last=-1: expected a whole number >= 0"),
    ("trainer.cpu_threads=0", "trainer.cpu_threads=0: expected a positive whole number or null"),
    ("trainer.progress=maybe", "trainer.progress=maybe: expected true or false"),
    ("trainer.device=gpu", "trainer.device=gpu: not a device torch knows"),
    ("seed=abc", "seed=abc: expected a whole number (params init and batch order"),
    ("data.batch_size=abc", "data.batch_size=abc: expected a positive whole number (examples per step"),
    ("data.test_fraction=1.5", "data.test_fraction=1.5: expected a number between 0 and 1"),
], ids=lambda x: x.split("=")[0] if "=" in x and ":" not in x else None)
def test_a_bad_setting_is_refused_by_key_and_value(override, message):
    assert refused(override).startswith(message)


# --- the optimizer: the library's sign checks, a chain that descends ------------------------------------

def test_negative_learning_rate_is_refused_like_the_library():
    with pytest.raises(ValueError, match=r"adamw: learning_rate=-1 must be >= 0"):
        fx.adamw(-1)
    assert refused("optim.chain.adamw.learning_rate=-1") == (
        "optim.chain.adamw.learning_rate=-1: adamw: learning_rate=-1 must be >= 0; "
        "change optim.chain.adamw.learning_rate")


def test_negative_momentum_is_refused_like_the_library():
    with pytest.raises(ValueError, match="sgd: momentum=-0.9 must be >= 0"):
        fx.sgd(0.1, momentum=-0.9)
    assert refused("optim/transform@optim.chain=[sgd]", "optim.chain.sgd.momentum=-0.9", base=CHAIN).startswith(
        "optim.chain.sgd.momentum=-0.9: sgd: momentum=-0.9 must be >= 0")


def test_null_learning_rate_is_refused():
    # fx.adam(None) leaves the updates unscaled: the runner never builds one.
    assert refused("optim.chain.adamw.learning_rate=null").startswith(
        "optim.chain.adamw.learning_rate=null: expected a number >= 0")


def test_negative_schedule_value_is_refused():
    assert refused("schedule=constant", "schedule.value=-1").startswith(
        "schedule.value=-1: the schedule multiplies the optimizer's learning_rate")


@pytest.mark.parametrize("chain", ["clip_by_global_norm", "add_decayed_weights"])
def test_a_chain_without_descent_is_refused(chain):
    assert refused(f"optim/transform@optim.chain=[{chain}]", base=CHAIN).startswith(
        f"optim.chain=[{chain}]: no entry takes a learning_rate, so nothing steps against the gradient")


def test_a_chain_without_descent_runs_with_the_opt_in(tmp_path):
    cfg = cfg_of(*CHAIN, "optim/transform@optim.chain=[clip_by_global_norm]", "trainer.allow_no_descent=true")
    validate.check(cfg)
    assert 0 <= runner.train(cfg) <= 1


def test_empty_chain_is_refused_in_process():
    assert refused("optim/transform@optim.chain=[]", base=CHAIN).startswith("optim.chain=[]: no transform")


def test_settings_left_for_a_transform_not_in_the_chain_are_named():
    assert refused("optim/transform@optim.chain=[sgd]") == (
        "optim.chain.adamw={'learning_rate':0.01}: adamw is not in the chain (optim/transform@optim.chain=[sgd]); "
        "add it there, or remove the setting with '~optim.chain.adamw'")


# --- defaults that work for short runs -----------------------------------------------------------------

def test_ten_steps_warm_up_in_proportion():
    cfg = cfg_of("trainer.max_steps=10")
    validate.check(cfg)
    assert cfg.schedule.warmup_steps == 0 and cfg_of().schedule.warmup_steps == 50  # 5% of the run
    build.stack(cfg)  # was: decay_steps=10 must be greater than warmup_steps=50


def test_an_explicit_warmup_longer_than_the_run_names_both_keys():
    assert refused("schedule=warmup_cosine", "schedule.warmup_steps=100", "trainer.max_steps=10").startswith(
        "schedule.warmup_steps=100: warmup must end before the run does (trainer.max_steps=10)")


@pytest.mark.parametrize("max_steps", [3, 10, 300, 1000, 1001])
def test_evaluation_cadence_gives_several_points(max_steps):
    trainer = cfg_of(f"trainer.max_steps={max_steps}").trainer
    points = len({*range(trainer.eval_every, max_steps + 1, trainer.eval_every), max_steps})
    assert min(max_steps, 10) <= points <= 11  # was 2 points at 300 steps (eval_every=250)
    if max_steps == 1000:  # the default run logs and warms up as before
        assert (trainer.log_every, trainer.eval_every) == (25, 100)


def test_resolved_config_records_the_numbers():
    cfg = cfg_of(*FAST, "trainer.max_steps=300", "trainer.eval_every=null")
    with pytest.raises(build.ConfigError, match=r"^trainer.eval_every=null: expected a positive whole number"):
        validate.check(cfg)
    text = runner._resolved_yaml(cfg_of("trainer.max_steps=300"))
    assert "eval_every: 30\n" in text and "warmup_steps: 15\n" in text and "log_every: 8\n" in text
