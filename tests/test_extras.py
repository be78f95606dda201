"""fxtrain.extras: every optional launcher, sweeper, logger and data format, selected without its package, stops before the
run with the one line that installs it (one kind of message, where Hydra said "Could not find" for
submitit_local and the vmap submitit launcher gave a traceback)."""

import sys

import pytest

from fxtrain import extras
from tests._runner import isolate, run_main  # noqa: F401 - isolate: autouse (cwd, Hydra's state, logging)

SUBMITIT = ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher", "submitit")
OPTUNA = ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper", "optuna")
CASES = [  # what the user writes, then (the module that is missing, the package named, the extra)
    (("-m", "hydra/launcher=submitit_local", "seed=0,1"), SUBMITIT),
    (("-m", "hydra/launcher=submitit_slurm", "seed=0,1"), SUBMITIT),
    (("-m", "hydra/launcher=vmap_submitit_local", "seed=0,1"), ("submitit", "submitit", "submitit")),
    (("-m", "hydra/launcher=vmap_submitit_slurm", "seed=0,1"), ("submitit", "submitit", "submitit")),
    (("-m", "hydra/sweeper=optuna"), OPTUNA),
    (("hparams_search=digits_optuna",), OPTUNA),
    (("logger=[jsonl,tensorboard]",), ("tensorboard", "tensorboard", "tensorboard")),
    (("logger=[jsonl,wandb]",), ("wandb", "wandb", "wandb")),
    (("logger=[jsonl,mlflow]",), ("mlflow", "mlflow", "mlflow")),
    (("data=hf",), ("datasets", "datasets", "hf")),
    (("data=webdataset",), ("webdataset", "webdataset", "webdataset")),
    (("data=grain",), ("grain", "grain", "grain")),
    (("amp=float8",), ("torchao", "torchao", "float8")),
]


@pytest.mark.parametrize("argv, need", CASES, ids=[c[0][-1] if c[0][0] != "-m" else c[0][1] for c in CASES])
def test_a_missing_extra_stops_the_launch_with_the_line_that_installs_it(argv, need, monkeypatch, tmp_path, capsys):
    module, package, extra = need
    monkeypatch.setitem(sys.modules, module, None)  # what `import module` meets when it is not installed
    arg = next(a for a in argv if a.startswith(("hydra/", "hparams", "logger", "data", "amp")))
    code = run_main(*argv, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep")
    assert code == f"Error: {arg} needs {package}: pip install 'fxtrain[{extra}]'"
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()  # stopped before anything ran


def test_installed_choices_pass():
    for (group, option), (module, _, _) in extras.OPTIONAL.items():
        assert extras.installed(module), module  # the dev extras install every one (make test)
        extras.check_choice(group, option or "any", f"{group}={option}")
