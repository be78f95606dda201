"""torch's fused kernel under the recommended stack's wrappers on every layout of ``conf/parallel`` (small worlds).

Generated: every ``conf/parallel`` preset whose smallest world (the degrees it sets all above 1) has at most 4
ranks, a world per size (tests/_worlds.py), and in each the runner's stacks of :data:`STACKS` (``conf/amp`` x
``conf/accumulate`` x chain: tiny_lm's recommended bf16 + k4 + clip + AdamW, float16 loss scaling, a chain of one
optimizer). Each is built and stepped as ``python -m fxtrain.train`` builds and steps it
(:func:`fxtrain.train.build_run`, each rank its batch: ``Built.batch``), once as built and once with the
stack's fused mark taken off (its foreach kernels), counting torch's ``_fused_*`` calls: one per emitted update
(``STEPS / accumulate.every``) on every rank. The params (gathered) agree within tests/test_fused.py's tolerance
through a model (``rtol=1e-4, atol=1e-6``; float32 master params) and the loss-scale decisions are identical.

``3d`` (pp x dp_shard x tp: 8 ranks) is left to tests/test_matrix.py's product (``make matrix``); the fused path
there is the same code as pp_fsdp's and fsdp_tp's.
"""

from __future__ import annotations

import functools
import re
import sys

import pytest

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from omegaconf import OmegaConf

import fxtrain as fx
from fxtrain import build, distributed
from fxtrain import train as runner
from fxtrain.errors import ConfigError
from tests import _worlds

CONF = runner.CONF_DIR
CASES, case = _worlds.registry(worlds=(2, 4))
TIMEOUT_S = 300
STEPS = 4  # one window of accumulate=k4: 3 micro-steps without the kernel, then 1 with it
KERNELS = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_")
# schedule=constant: the learning rate is above 0 from the first update (warmup starts it at 0)
BASE = ["model=transformer", "data=stdlib_text", "task=lm", "data.max_bytes=20000", "data.eval_windows=16",
        "data.batch_size=8", "data.context=16", "model.d_model=16", "model.n_heads=2", "model.n_layers=2",
        "schedule=constant", "trainer.progress=false", "trainer.cpu_threads=1", f"trainer.max_steps={STEPS}"]
# name -> overrides: the recommended stack (experiment=tiny_lm's amp, accumulate and chain), float16 with dynamic
# loss scaling (found_inf), and a chain of one optimizer (optim.chain=[adam], mnist_port's)
STACKS = {
    "bf16-k4-clip-adamw": ("amp=bf16", "accumulate=k4", "optim/transform@optim.chain=[clip_by_global_norm,adamw]"),
    "fp16-k4-clip-adamw": ("amp=fp16", "accumulate=k4", "optim/transform@optim.chain=[clip_by_global_norm,adamw]"),
    "off-off-adam": ("amp=off", "accumulate=off", "optim/transform@optim.chain=[adam]"),
}


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("_"))


def smallest_world(name: str) -> tuple[int, tuple[str, ...]]:
    """The preset's smallest world in which every degree it sets is above 1, and its overrides (``model=moe``
    where it enables ep), as tests/test_matrix.py's ``layout``."""
    preset = OmegaConf.load(CONF / "parallel" / f"{name}.yaml")
    own = [d for d in preset if d in distributed.DIMS]
    shared = OmegaConf.load(CONF / "parallel" / "_degrees.yaml")
    degrees = {d: preset.get(d, shared.get(d)) for d in distributed.DIMS}
    for world in (1, 2, 4, 8, 16):
        try:
            dims = distributed.ParallelDims.of(world=world, **degrees)
        except ValueError:
            continue
        if all(dims.enabled(d) for d in own):
            return world, (f"parallel={name}", *(["model=moe"] if dims.enabled("ep") else []))
    raise AssertionError(name)


def compose(*overrides: str):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("train", overrides=list(overrides))


class KernelCalls:
    """Counts torch's fused optimizer kernel calls while active (the kernels themselves, spied on)."""

    def __enter__(self):
        self.calls, self.real = [], {n: getattr(torch, n) for n in KERNELS}
        for name, real in self.real.items():
            setattr(torch, name, functools.partial(self._spy, name, real))
        return self.calls

    def _spy(self, name, real, *args, **kwargs):
        self.calls.append(name)
        return real(*args, **kwargs)

    def __exit__(self, *exc):
        for name, real in self.real.items():
            setattr(torch, name, real)


def run(cfg, world: int, fused: bool):
    """STEPS steps of the runner's built step on this rank's slices; the params gathered, the metrics, the calls."""
    dims = build.parallel_dims(cfg, world).build("cpu")
    stack = build.stack
    if not fused:
        build.stack = lambda *a, **k: fx.with_traits(stack(*a, **k), fused=None)
    try:
        built = runner.build_run(cfg, torch.device("cpu"), dims)
    finally:
        build.stack = stack
    params, state, buffers = built.params, built.opt_state, built.buffers
    history = []
    with KernelCalls() as calls:
        for i in range(STEPS):
            params, state, buffers, metrics = built.step(params, state, buffers, built.batch(i, dims))
            history.append({k: v.detach().clone() for k, v in metrics.items()})
    full = {k: (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone()
            for k, x in zip(fx.tree.paths(params), fx.tree.leaves(params))}
    return full, history, list(calls)


def check_layout(name: str, world: int, overrides: tuple[str, ...]) -> None:
    for stack, extra in STACKS.items():
        cfg = compose(*BASE, *overrides, *extra)
        every = cfg.accumulate.every
        where = f"parallel={name} {stack} rank {dist.get_rank()}"
        try:
            p_fused, h_fused, calls = run(cfg, world, fused=True)
        except ConfigError as e:  # a layout that refuses the stack (pipelines: fp16's loss scale) refuses it unfused
            with pytest.raises(ConfigError, match=re.escape(str(e))):
                run(cfg, world, fused=False)
            print(f"kernel calls {where}: refused by the layout, with or without the kernel: {e}", flush=True)
            continue
        p_ref, h_ref, ref_calls = run(cfg, world, fused=False)
        print(f"kernel calls {where}: {len(calls)} in {STEPS} steps (every={every})", flush=True)
        assert ref_calls == [], where
        assert len(calls) == STEPS // every, f"{where}: {calls}"
        for a, b in zip(h_fused, h_ref):
            for k in ("skipped", "loss_scale", "emitted"):
                if k in a:
                    assert torch.equal(a[k], b[k]), (where, k, h_fused, h_ref)
        fx.testing.assert_trees_close(p_fused, p_ref, rtol=1e-4, atol=1e-6)


def _register(name: str) -> None:
    world, overrides = smallest_world(name)
    if 1 < world <= 4:
        fn = lambda w: check_layout(name, w, overrides)  # noqa: E731
        fn.__name__ = f"case_{name}"
        case(world)(fn)


for _name in presets("parallel"):
    _register(_name)

test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)

if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
