"""Start-up: what ``import fxtrain`` and ``import fxtrain.train`` leave out of ``sys.modules``, and the stand-ins of
``fxtrain._deferred`` that let them (timings live in experiments/bench/startup.py, not in asserts)."""

import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Heavy modules (import time on a quiet machine, on top of torch) that a program pays for only when it uses them.
HEAVY = {
    "torch.distributed.tensor": "0.5 s; a DTensor exists only after it, so fxtrain._deferred answers isinstance",
    "torch.distributed.fsdp": "imports torch.distributed.tensor",
    "torch.distributed.checkpoint": "imports torch.distributed.tensor; fx.save/fx.load import it",
    "jax": "interop only", "flax": "interop only", "optax": "interop only", "orbax": "interop only",
    "matplotlib": "studies only", "sklearn": "data sets only", "transformers": "interop only",
    "tensorboard": "logger=tensorboard", "wandb": "logger=wandb", "mlflow": "logger=mlflow",
}
# What the runner needs on top: Hydra and OmegaConf (and fxtrain.errors' ConfigError is a Hydra exception).
RUNNER = {"hydra", "omegaconf"}


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("statement", ["import fxtrain", "import fxtrain.train"])
def test_import_leaves_the_heavy_modules_out(statement):
    loaded = _loaded_after(statement)
    assert "fxtrain" in loaded and "optree" in loaded  # the import ran
    assert sorted(m for m in HEAVY if m in loaded) == []
    if statement == "import fxtrain.train":
        assert RUNNER <= loaded


def test_a_heavy_import_is_caught():
    # the check above can fail: a module that pulls one in is seen
    assert "torch.distributed.tensor" in _loaded_after("import fxtrain, torch.distributed.checkpoint")


def test_stand_ins_answer_like_the_real_classes():
    from fxtrain._deferred import DTensor, FSDPModule, Partial, Replicate, Shard, deferred_module

    import torch.distributed.tensor as tdt
    from torch.distributed.fsdp import FSDPModule as RealFSDPModule

    assert not isinstance(torch.zeros(2), DTensor) and not isinstance(1.0, (DTensor, Shard))
    assert isinstance(Shard(1), tdt.Shard) and Shard(1) == tdt.Shard(1) and isinstance(tdt.Shard(0), Shard)
    assert isinstance(Replicate(), Replicate) and not isinstance(Replicate(), Shard)
    assert isinstance(Partial(), tdt.Partial) and isinstance(tdt.Partial("sum"), Partial)
    assert DTensor.from_local is tdt.DTensor.from_local and issubclass(tdt.DTensor, DTensor)
    assert not issubclass(torch.Tensor, DTensor) and issubclass(RealFSDPModule, FSDPModule)
    assert not isinstance(torch.nn.Linear(1, 1), FSDPModule)
    assert deferred_module("torch.distributed.checkpoint").FileSystemReader is sys.modules[
        "torch.distributed.checkpoint"].FileSystemReader


def test_a_dtensor_is_one(one_rank_mesh):
    from fxtrain._deferred import DTensor, Replicate

    x = DTensor.from_local(torch.ones(2), one_rank_mesh, [Replicate()])
    assert isinstance(x, DTensor) and not isinstance(x.to_local(), DTensor)
