"""A researcher's own project: their module, config groups and task, run with fxtrain's runner from their
directory through Hydra's search path (``--config-dir``, ``hydra.searchpath``), never from the checkout."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import yaml
from omegaconf import OmegaConf

from fxtrain import build
from fxtrain.report import read_jsonl
from tests._runner import isolate, run_main  # noqa: F401 - isolate: autouse (Hydra's state, logging, cwd)
from tests._runner import write_project

CONFIGS = {
    "model/mine.yaml": """
        _target_: mylib.WideDeep
        in_features: ${data.input_shape[0]}
        hidden: 32
    """,
    "data/mine.yaml": """
        _target_: mylib.make_data
        n: 400
        noise: 0.1
        batch_size: 32          # the runner's keys: it splits, shuffles and batches the (x, y) make_data returns
        test_fraction: 0.25
        split_seed: 0
        seed: ${seed}
        input_shape: [6]        # facts the model configs read (and the runner checks)
        num_classes: 1          # one output per example for model=mlp
    """,
    "task/huber.yaml": """
        _target_: fxtrain.tasks.Task
        loss: mylib.huber
        metrics: mylib.within
        optimized_metric: test_within_half
    """,
}


@pytest.fixture
def project(tmp_path) -> pathlib.Path:
    """A throwaway project outside the checkout: ``mylib/`` and ``conf/{model,data,task}/*.yaml``."""
    return write_project(tmp_path / "myproj", CONFIGS)


def _run(project: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HYDRA"))}
    env["PYTHONPATH"] = str(project)  # mylib, as an installed package of the user's would be
    return subprocess.run([sys.executable, "-m", "fxtrain.train", *args, "trainer.progress=false"], cwd=project,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.multiprocess
def test_own_model_data_and_task_train_through_config_dir_with_three_loggers(project):
    run = _run(project, "--config-dir", "conf", "model=mine", "data=mine", "task=regression",
               "logger=[jsonl,tensorboard,csv]", "trainer.max_steps=60", "trainer.log_every=2",
               "optim.chain.adamw.learning_rate=1e-2", "hydra.run.dir=run")
    assert run.returncode == 0, run.stderr[-3000:]
    out = project / "run"
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 30 and sum(losses[-5:]) < 0.3 * sum(losses[:5])  # a falling loss
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["optimized_metric"] == "val_loss"
    assert {"val_loss", "test_loss", "test_mae", "mae"} <= set(summary["metrics"])
    assert "data   mine: 300 train examples, 100 test, batch 32" in run.stdout
    assert "model  WideDeep" in run.stdout and "task   regression" in run.stdout
    # Every logger wrote what its own library reads back.
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses, rel=1e-6)
    events = EventAccumulator(str(next(out.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses, rel=1e-6)


@pytest.mark.multiprocess
def test_a_sweep_over_own_and_builtin_options_through_hydra_searchpath(project):
    # hydra.searchpath instead of --config-dir, the user's task, and a sweep over their model and fxtrain's mlp,
    # with fxtrain's vmap launcher (found by Hydra's plugin scan from outside the checkout): each model's two
    # seeds train as one vmapped process.
    run = _run(project, "-m", f"hydra.searchpath=[file://{project / 'conf'}]", "hydra/launcher=vmap",
               "model=mine,mlp", "seed=0,1", "data=mine", "task=huber", "trainer.max_steps=20", "hydra.sweep.dir=sweep")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "vmap   jobs 0,1 as one process" in run.stdout and "vmap   jobs 2,3 as one process" in run.stdout
    for job in ("0", "1", "2", "3"):
        summary = json.loads((project / "sweep" / job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["optimized_metric"] == "test_within_half"
        assert 0 <= summary["value"] <= 1 and "test_within_half" in summary["metrics"]
    import csv

    rows = list(csv.DictReader((project / "sweep" / "summary.csv").read_text().splitlines()))
    assert [(r["model"], r["seed"], r["status"]) for r in rows] == [
        ("mine", "0", "completed"), ("mine", "1", "completed"), ("mlp", "0", "completed"), ("mlp", "1", "completed")]


# The user's options named like fxtrain's: a narrower mlp, and an Optuna search of their own.
SHADOWING = {
    "model/mlp.yaml": """
        _target_: fxtrain.models.MLP
        input_shape: ${data.input_shape}
        hidden: [7]              # fxtrain's conf/model/mlp.yaml has [256, 256]
        num_classes: ${data.num_classes}
    """,
    "hparams_search/digits_optuna.yaml": """
        # @package _global_
        defaults:
          - override /hydra/sweeper: optuna
        optimized_metric: test_loss
        hydra:
          mode: MULTIRUN
          sweeper:
            study_name: mine
            direction: minimize
            n_trials: 2
            params:
              seed: choice(0, 1)
    """,
}


@pytest.fixture
def shadowing(project) -> pathlib.Path:
    """The throwaway project, plus ``conf/model/mlp.yaml`` and ``conf/hparams_search/digits_optuna.yaml`` of its own."""
    for name, text in SHADOWING.items():
        path = project / "conf" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return project


@pytest.mark.parametrize("where", ["--config-dir", "hydra.searchpath"])
def test_own_option_named_like_fxtrains_is_the_one_that_runs(shadowing, where, monkeypatch, capsys):
    # Hydra takes an option from the first search-path entry that has it; fxtrain's conf/ used to come first (the
    # app's primary config directory), so the user's mlp.yaml was silently replaced by fxtrain's.
    from fxtrain.models import MLP, count_params

    monkeypatch.chdir(shadowing)
    conf = shadowing / "conf"
    search = ["--config-dir", str(conf)] if where == "--config-dir" else [f"hydra.searchpath=[file://{conf}]"]
    # model: mlp is train.yaml's default: no model= on the command line
    assert run_main(*search, "data=synthetic", "trainer.max_steps=2", "trainer.progress=false",
                    "trainer.device=cpu", "hydra.run.dir=run") == 0
    built = count_params(dict(MLP([1, 8, 8], hidden=[7], num_classes=10).named_parameters()))
    assert f"model  MLP: {built:,} params on cpu" in (shadowing / "run" / "train.log").read_text()
    assert OmegaConf.load(shadowing / "run" / "config.yaml").model.hidden == [7]
    # Their hparams_search file, composed as the sweep would run it (--cfg: nothing runs).
    capsys.readouterr()
    assert run_main(*search, "hparams_search=digits_optuna", "--cfg", "hydra") == 0
    sweeper = yaml.safe_load(capsys.readouterr().out)["hydra"]["sweeper"]
    assert (sweeper["study_name"], sweeper["n_trials"], sweeper["params"]) == ("mine", 2, {"seed": "choice(0, 1)"})


def test_unknown_options_list_every_search_path_entry(project):
    conf = f"file://{project / 'conf'}"
    with pytest.raises(build.ConfigError) as e:
        build.check_overrides(["--config-dir", str(project / "conf"), "-m", "model=mine,widedeep"])
    # In search-path order: the user's entries first (their options shadow fxtrain's of the same name).
    assert str(e.value) == (f"model=mine,widedeep: no option 'widedeep' in model; available: mine ({conf}); convnet, mlp, "
                            f"moe, resnet, transformer (pkg://fxtrain.conf)")
    with pytest.raises(build.ConfigError, match=r"^task=hubr: no option 'hubr' in task \(did you mean huber\?\); "
                       r"available: huber \(file://.*\); classification, lm, regression \(pkg://fxtrain.conf\)$"):
        build.check_overrides([f"hydra.searchpath=[{conf}]", "task=hubr"])
    build.check_overrides([f"hydra.searchpath=[{conf}]", "model=mine", "data=mine", "task=huber"])  # all there
    with pytest.raises(build.ConfigError, match=r"^--config-dir nowhere: no such directory"):
        build.check_overrides(["--config-dir", "nowhere", "model=mine"])


def test_bad_input_of_own_configs_is_one_line(project):
    run = _run(project, "--config-dir", "conf", "model=mine", "data=mine", "task=classification",
               "trainer.max_steps=3", "hydra.run.dir=run")
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
        "Error: task=classification/lm: cross-entropy needs integer class targets, got torch.float32; for "
        "real-valued targets use task=regression")
    run = _run(project, "--config-dir", "conf", "model=mine", "data=mine", "task=regression",
               "+data.batch_sise=3", "hydra.run.dir=run2")
    assert run.returncode == 1 and "Error: data: batch_sise is not an argument of mylib.make_data nor a runner key " \
        "(did you mean batch_size?)" in run.stderr
