"""Helpers for the tests that drive the Hydra runner (test_train*.py, test_experiments.py, and the user's own
project of test_own_project.py and test_readme.py).

``from tests._runner import isolate`` in a test module turns on the autouse fixture there (pytest finds
fixtures by module attribute); the rest are plain functions.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import fxtrain as fx
from fxtrain import build, train as runner

CONF = runner.CONF_DIR


def cfg_of(*overrides: str):
    """``conf/train.yaml`` composed with ``overrides``, as ``python -m fxtrain.train`` would."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def run_main(*argv: str):
    """fxtrain.train.main in this process; returns the exit code (0 when it returns normally)."""
    try:
        runner.main(list(argv))
    except SystemExit as e:
        return e.code
    return 0


def torchrun_train(cwd, *args: str, timeout: float = 240, nproc: int = 2) -> tuple[str, pathlib.Path]:
    """``torchrun --nproc_per_node=<nproc> -m fxtrain.train *args`` in ``cwd``; returns (stdout, the run directory)."""
    pathlib.Path(cwd).mkdir(parents=True, exist_ok=True)
    # the repository importable from cwd (a data._target_ of tests/, as the suite's own process has it)
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "-m", "fxtrain.train", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [p.parent for p in (pathlib.Path(cwd) / "outputs").rglob("summary.json")]
    return proc.stdout, run


def load_checkpoint(path, cfg) -> fx.TrainState:
    """The runner's checkpoint at ``path`` as an fx.TrainState (like: the model and stack ``cfg`` builds)."""
    _, params, buffers = fx.functional(build.model(cfg))
    like = fx.TrainState(0, params, build.stack(cfg).init(params), fx.rng_state(), buffers)
    return fx.load(path, like=like)


@pytest.fixture(autouse=True)
def isolate(monkeypatch, tmp_path):
    """Runs write under tmp_path; Hydra's global state, logging handlers and torch threads are restored."""
    monkeypatch.chdir(tmp_path)
    root, threads = logging.getLogger(), torch.get_num_threads()
    handlers, level = list(root.handlers), root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            h.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    torch.set_num_threads(threads)
    GlobalHydra.instance().clear()


# --- a researcher's own project, outside the checkout (test_own_project.py, test_readme.py) ---------------

OWN_LIB = '''
"""A researcher's own code: a model, a regression dataset, a loss, metrics and an evaluation hook; nothing
from fxtrain."""
import torch
from torch import nn
from torch.nn import functional as F


class WideDeep(nn.Module):
    """A linear (wide) part plus an MLP (deep) part, summed: one output per example."""

    def __init__(self, in_features, hidden=32):
        super().__init__()
        self.wide = nn.Linear(in_features, 1)
        self.deep = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.wide(x) + self.deep(x)


def make_data(n=400, features=6, noise=0.1, seed=0):
    """(x, y): y = a smooth function of x plus noise, float targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x[:, 0] - 0.5 * x[:, 1] ** 2 + torch.sin(x[:, 2]) + noise * torch.randn(n, generator=g)
    return x, y


def huber(outputs, targets):
    return F.huber_loss(outputs.reshape(targets.shape), targets)


def within(outputs, targets):
    return {"within_half": ((outputs.reshape(targets.shape) - targets).abs() < 0.5).float().mean()}


def calibration(ctx):
    x, _ = ctx.data.test
    return {"confidence": float(ctx.forward(x).softmax(-1).amax(-1).mean())}
'''


def write_project(root: pathlib.Path, configs: dict[str, str]) -> pathlib.Path:
    """The user's project in ``root``: ``mylib/__init__.py`` holds :data:`OWN_LIB`, and each of ``configs``
    (a path under ``conf/``, e.g. ``model/mine.yaml`` -> its YAML, dedented) is written; returns ``root``."""
    (root / "mylib").mkdir(parents=True, exist_ok=True)
    (root / "mylib" / "__init__.py").write_text(OWN_LIB)
    for name, text in configs.items():
        path = root / "conf" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root
