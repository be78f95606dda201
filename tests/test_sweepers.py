"""Sweeps on Hydra's own engines: the Optuna sweeper (``hparams_search=digits_optuna``), the submitit launcher
(``hydra/launcher=submitit_local``), and the vmap launcher composed with submitit
(``hydra/launcher=vmap_submitit_local``/``_slurm``: each vmapped group one submitit job).

The optuna sweep runs as a user runs it: ``python -m fxtrain.train`` in a subprocess from a directory outside
the checkout. The submitit launches run in this process; submitit's local executor starts each job as a
process of its own, so the jobs' model classes must be importable there (``tests`` on ``PYTHONPATH``).
"""

import csv
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fxtrain import train as runner
from fxtrain.report import read_jsonl
from hydra_plugins.fxtrain_vmap_launcher import vmap_launcher
from tests._runner import isolate, run_main  # noqa: F401 - isolate: autouse

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = ["experiment=smoke", "trainer.device=cpu", "trainer.cpu_threads=1", "trainer.progress=false"]
LOCAL = ["hydra.launcher.timeout_min=5", "hydra.launcher.cpus_per_task=1", "hydra.launcher.gpus_per_node=0"]


def summary_rows(sweep):
    return list(csv.DictReader((pathlib.Path(sweep) / "summary.csv").read_text().splitlines()))


def summaries(sweep):
    return {d.name: json.loads((d / "summary.json").read_text())
            for d in sorted(pathlib.Path(sweep).iterdir()) if d.is_dir() and d.name.isdigit()}


# --- optuna ---------------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_digits_optuna_search_runs_and_reports_its_best_trial(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # fxtrain as installed, not from the checkout
    proc = subprocess.run(
        [sys.executable, "-m", "fxtrain.train", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=3",
         "data=synthetic", "trainer.max_steps=10", "trainer.progress=false", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr and "setup plugin alembic" not in proc.stdout, proc.stderr[-3000:]
    done = summaries(tmp_path / "sweep")
    assert sorted(done) == ["0", "1", "2"] and all(s["status"] == "completed" for s in done.values())
    result = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    best = max(s["value"] for s in done.values())
    assert result["best_value"] == pytest.approx(best, rel=1e-12)
    # The best params are the overrides of a job that reached the best value (ties: any of them).
    rows = {r["job"]: r for r in summary_rows(tmp_path / "sweep")}
    assert any(all(float(rows[j][k]) == pytest.approx(v) for k, v in result["best_params"].items())
               for j, s in done.items() if s["value"] == best)
    assert sorted(result["best_params"]) == sorted(yaml.safe_load(
        (runner.CONF_DIR / "hparams_search" / "digits_optuna.yaml").read_text())["hydra"]["sweeper"]["params"])
    # Optuna draws floats such as 0.0007247031607588866. fxtrain's lines (the stack line, the sweep's table and best
    # line) printed all 17 digits, or a %g that is not the value: now the shortest decimal that is the same float32
    # (0.000724703), the precision the run trains at. Hydra's own lines ("[HYDRA] #0 : ...") are Hydra's.
    ours = "\n".join(line for line in proc.stdout.splitlines() if not line.lstrip("\x1b").startswith("["))
    for value in {float(row[k]) for row in rows.values() for k in result["best_params"] if k.startswith("optim.")}:
        short = next(s for s in (f"{value:.{d}g}" for d in range(1, 17))
                     if np.float32(float(s)) == np.float32(value))
        if len(repr(float(short))) < len(repr(value)):  # a long draw
            assert repr(value) not in ours and repr(float(short)) in ours, (value, ours[-3000:])


# --- Hydra's submitit launcher --------------------------------------------------------------------

@pytest.mark.multiprocess
def test_submitit_local_launches_a_multirun():
    code = run_main("-m", "seed=0,1", "hydra/launcher=submitit_local", *FAST, "trainer.max_steps=10", *LOCAL,
                    "hydra.sweep.dir=sweep")
    assert code == 0
    assert {j: s["status"] for j, s in summaries("sweep").items()} == {"0": "completed", "1": "completed"}
    rows = summary_rows("sweep")  # written by SweepSummary in each submitit job, then once more at the end here
    assert [(r["job"], r["status"], r["seed"]) for r in rows] == [("0", "completed", "0"), ("1", "completed", "1")]
    assert all(float(r["test_accuracy"]) == summaries("sweep")[r["job"]]["value"] for r in rows)
    assert len(list(pathlib.Path("sweep/.submitit").glob("*/*_result.pkl"))) == 2  # two submitit jobs


# --- the vmap launcher with a submitit executor ---------------------------------------------------

def records(job):
    return [{k: v for k, v in r.items() if k != "time_s"} for r in read_jsonl(pathlib.Path(job) / "metrics.jsonl")]


@pytest.mark.multiprocess
@pytest.mark.slow  # fast suite: submitit_local's multirun (below) and the vmap launcher (test_vmap_launcher.py)
def test_vmap_submitit_local_runs_each_group_as_one_submitit_job(monkeypatch, capsys):
    # Jobs 0-3 (lr x seed) are one vmapped group; jobs 4-7 use a model with dropout, which vmap refuses: that group
    # runs job by job inside its own submitit job. The first group must give what hydra/launcher=vmap gives.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the submitit jobs import tests.test_vmap_launcher.DropoutMLP
    grid = ["optim.chain.adamw.learning_rate=3e-3,1e-2", "seed=0,1"]
    models = "model._target_=fxtrain.models.MLP,tests.test_vmap_launcher.DropoutMLP"
    code = run_main("-m", "hydra/launcher=vmap_submitit_local", models, *grid, *FAST, "trainer.max_steps=10",
                    "hydra.launcher.executor.timeout_min=5", "hydra.sweep.dir=submitit")
    assert code == 0
    out = capsys.readouterr().out
    assert "[vmap] jobs 0,1,2,3: submitit job " in out and "[vmap] jobs 4,5,6,7: submitit job " in out
    assert len(list(pathlib.Path("submitit/.submitit").glob("*/*_result.pkl"))) == 2  # two submitit jobs
    rows = summary_rows("submitit")
    assert [(r["job"], r["status"]) for r in rows] == [(str(j), "completed") for j in range(8)]
    # How each job ran, from what its run recorded (train.log's run line; not the submitit job's console, whose
    # logging setup is the machine's): jobs 0-3 in one vmapped process, jobs 4-7 each in a run of its own.
    for j in range(8):
        assert pathlib.Path("submitit", str(j), ".hydra", "overrides.yaml").exists()
        log = pathlib.Path("submitit", str(j), "train.log").read_text()
        others = ",".join(str(o) for o in range(4) if o != j)
        assert (f"  [vmap: one process with jobs {others}]" in log) == (j < 4), (j, log.splitlines()[0])
        assert "done   10 steps" in log

    assert run_main("-m", "hydra/launcher=vmap", *grid, *FAST, "trainer.max_steps=10", "hydra.sweep.dir=vmap") == 0
    for j in map(str, range(4)):
        a, b = records(pathlib.Path("vmap", j)), records(pathlib.Path("submitit", j))
        assert [sorted(r) for r in a] == [sorted(r) for r in b]
        for ra, rb in zip(a, b):
            assert all(math.isclose(ra[k], rb[k], rel_tol=1e-5, abs_tol=1e-7) for k in ra), (j, ra, rb)
        va, vb = (summaries(d)[j]["value"] for d in ("vmap", "submitit"))
        assert math.isclose(va, vb, rel_tol=1e-5), (j, va, vb)


def launcher_config(name, *overrides):
    """``hydra.launcher`` of ``hydra/launcher=name``, resolved as Hydra resolves it when it instantiates the launcher."""
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra/launcher={name}", *overrides], return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def test_vmap_submitit_slurm_config_is_submitits_own_parameters(monkeypatch):
    # No cluster here: SlurmExecutor refuses to start without srun, so that check is the only thing faked; the
    # sbatch file is submitit's own, written from every key of conf/hydra/launcher/vmap_submitit_slurm.yaml.
    from submitit.slurm.slurm import SlurmExecutor

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    conf = launcher_config("vmap_submitit_slurm", "hydra.launcher.executor.slurm_partition=gpu",
                           "hydra.launcher.executor.gpus_per_node=1", "hydra.launcher.executor.slurm_max_num_timeout=2",
                           "hydra.sweep.dir=sweep")
    launcher = vmap_launcher.VmapLauncher(**{k: v for k, v in conf.items() if k != "_target_"})
    executor = vmap_launcher._executor(launcher.executor)
    assert executor.cluster == "slurm" and executor._executor.max_num_timeout == 2
    sbatch = executor._executor._make_submission_file_text("python -m x", "uid")
    for line in ["#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=1", "#SBATCH --time=60",
                 "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={pathlib.Path.cwd()}/sweep/.submitit/%j/%j_0_log.out"]:
        assert line in sbatch, sbatch


def test_bad_executor_settings_name_the_key():
    local = launcher_config("vmap_submitit_local", "hydra.sweep.dir=sweep")
    executor = local["executor"]
    with pytest.raises(ValueError, match=r"^hydra.launcher.executor.cluster='slrum': expected local, slurm or debug"):
        vmap_launcher.VmapLauncher(executor={**executor, "cluster": "slrum"})
    with pytest.raises(ValueError, match=r"^hydra.launcher.executor.tasks_per_node=2: a vmapped group trains in one process"):
        vmap_launcher.VmapLauncher(executor={**executor, "tasks_per_node": 2})
    with pytest.raises(ValueError, match=r"hydra.launcher.executor \(local\): .*'slurm_partiton'"):
        vmap_launcher._executor({**executor, "slurm_partiton": "gpu"})
    assert vmap_launcher.VmapLauncher(**{k: v for k, v in launcher_config("vmap").items() if k != "_target_"}
                                      ).executor is None
