"""No transform and no runner step reads a tensor's value on the host (DESIGN: no host syncs inside transforms).

On a GPU such a read (``.item()``, ``bool(t)``, a 0-dim tensor passed where torch takes a Python number) makes
the host wait for the device every step; tests/test_cuda.py catches it with torch's sync debug mode, on a GPU
only. Every such read goes through ``aten._local_scalar_dense``, which a dispatch mode sees on any device: these
tests count it on the CPU, so a new sync fails here on every machine. (Found this way after a GPU run:
``torch._foreach_add_(xs, t)`` with a 0-dim tensor ``t`` takes the ``Scalar`` overload and calls ``t.item()``;
``inject_hyperparams(adamw)``'s ``eps_root`` hit it once per step.)

Generated from the registries: every conformance case (one per public transform), every registered optimizer
factory (a ``learning_rate`` parameter) under ``inject_hyperparams`` (every numeric default becomes a 0-dim
tensor), and every experiment's runner step. A transform that declares the ``host`` trait is exempt.
"""

from __future__ import annotations

import inspect
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxtrain as fx
from fxtrain import train as runner
from fxtrain.testing import nested_params
from tests._runner import CONF, cfg_of
from tests.test_conformance import CASES

READ = torch.ops.aten._local_scalar_dense.default

# Reads that are not device syncs on any device, by the function that makes them (fxtrain's innermost frame).
ON_THE_HOST = {
    "counters@transforms/_accumulation.py": "accumulate (host=True) reads its mini_step/emitted counters, which "
                                            "live on the CPU on every device",
    "_rounded@transforms/_moments.py": "rounds a Python number through a CPU tensor made on the host (cached)",
    "search@transforms/_linesearch.py": "the zoom linesearch stops early on the host, one read a trial, "
                                     "documented (branchless=True decides on the device)",
}


class HostReads(TorchDispatchMode):
    """Counts the ops that copy a tensor's value to a Python number."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where: list[str] = []  # fxtrain's innermost frame of each read, for the failure message

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is READ:
            ours = [f for f in traceback.extract_stack() if "/fxtrain/" in f.filename]
            where = f"{ours[-1].name}@{ours[-1].filename.split('/fxtrain/')[-1]}" if ours else "?"
            if where not in ON_THE_HOST:
                self.count += 1
                self.where.append(f"{where}:{ours[-1].lineno}" if ours else where)
        return func(*args, **(kwargs or {}))


def test_the_counter_sees_a_host_read():  # the mode sees what it must, and nothing in a plain foreach op
    xs, t = [torch.ones(3), torch.ones(5)], torch.tensor(0.5)
    with HostReads() as seen:
        torch._foreach_mul_(xs, t)
    assert seen.count == 0
    with HostReads() as seen:
        torch._foreach_add_(xs, t)  # the Scalar overload: t.item()
    assert seen.count == 1


def _updates_read_nothing(tx, steps=3):
    """Host reads during ``steps`` updates, pure then donated (the first steps included: a sync at step 0 is one
    every run pays, and most transforms take the same path every step)."""
    params = nested_params(seed=0)
    pure_state, donated_state = tx.init(params), tx.init(params)
    extra = {"value": torch.tensor(0.5)} if fx.traits(tx).extra_args else {}  # the loss, as train_step passes it
    with HostReads() as seen:
        for step in range(steps):
            grads = nested_params(seed=1 + step)
            with torch.no_grad():
                _, pure_state = tx.update(grads, pure_state, params, **extra)
            _, donated_state = fx.update_(tx, fx.tree.clone(grads), donated_state, params, **extra)
    return seen


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_transform_reads_a_value_on_the_host(name):
    tx = CASES[name]()
    if fx.traits(tx).host:
        pytest.skip(f"{name} declares host=True (it reads values on the host by design)")
    seen = _updates_read_nothing(tx)
    assert seen.count == 0, f"{name}: {seen.count} host reads in 3 updates, at {sorted(set(seen.where))}"


def _optimizer_factories() -> dict:
    """Registered factories with a ``learning_rate`` parameter and no other required one."""
    out = {}
    for name, f in sorted(fx._base.factories().items()):
        params = inspect.signature(f).parameters
        required = [p for p, v in params.items() if v.default is inspect.Parameter.empty
                    and v.kind in (v.POSITIONAL_ONLY, v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
        if "learning_rate" in params and set(required) <= {"learning_rate"}:
            out[name] = f
    return out


OPTIMIZER_FACTORIES = _optimizer_factories()


def test_the_optimizer_registry_is_read():
    assert {"adam", "adamw", "sgd", "lion"} <= set(OPTIMIZER_FACTORIES), sorted(OPTIMIZER_FACTORIES)


# Injected integers that size or count (a shape threshold, a loop's length) can only be read on the host: as
# 0-dim tensors on the params' device each update reads them back. Strict: fixing one fails its entry here.
COUNTING_INTS = {
    "adafactor": "min_dim_size_to_factor, compared with each leaf's shape",
    "muon": "ns_steps, the Newton-Schulz loop's length",
}


def _injected_cases():
    for name in sorted(OPTIMIZER_FACTORIES):
        marks = [pytest.mark.xfail(strict=True, reason=COUNTING_INTS[name])] if name in COUNTING_INTS else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # optimistic_adam, as Optax deprecates it
@pytest.mark.parametrize("name", list(_injected_cases()))
def test_no_injected_optimizer_reads_a_hyperparameter_on_the_host(name):
    # Every numeric default (eps_root, b1, weight_decay...) becomes a 0-dim tensor in the state.
    tx = fx.inject_hyperparams(OPTIMIZER_FACTORIES[name])(learning_rate=fx.cosine_decay_schedule(1e-2, 10))
    if fx.traits(tx).host:
        pytest.skip(f"{name} declares host=True")
    if "value_fn" in inspect.signature(OPTIMIZER_FACTORIES[name]).parameters or name == "lbfgs":
        pytest.skip(f"{name} updates with value_fn= (a linesearch): its conformance case runs it above")
    seen = _updates_read_nothing(tx)
    assert seen.count == 0, f"inject_hyperparams({name}): {seen.count} host reads, at {sorted(set(seen.where))}"


EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_a_runner_step_reads_nothing_on_the_host(experiment):
    # The runner's batch and step as fxtrain/train.py runs them, after two accumulation windows of warm-up.
    built = runner.build_run(cfg_of(f"experiment={experiment}", "trainer.max_steps=800"), torch.device("cpu"))
    params, state, buffers = built.params, built.opt_state, built.buffers
    for i in range(8):
        params, state, buffers, _ = built.step(params, state, buffers, built.data.train[i])
    with HostReads() as seen:
        for i in range(8, 12):
            params, state, buffers, _ = built.step(params, state, buffers, built.data.train[i])
    assert seen.count == 0, f"experiment={experiment}: {seen.count} host reads in 4 steps, at {sorted(set(seen.where))}"
