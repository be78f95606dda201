"""Tests for fxtrain/checkpoint.py: bit-exact resume in a fresh process (mid accumulation window, just after
an amp overflow skip, with a schedule and injected hyperparameters), DTensor save/resume on 2 gloo ranks and
load on 1 (and a save rank 0 refuses raises on every rank), SIGKILL during save, and clear errors for
truncated, corrupted and foreign checkpoints. Manifest checksums, leaf-path collisions and the cleanup of
leftovers are in tests/test_checkpoint_integrity.py.

Processes are the cost (a torch import each), so one fresh process resumes every single-process scenario,
one 2-rank world runs every DTensor case, and the two SIGKILL victims run side by side.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

import fxtrain as fx
from fxtrain.checkpoint import latest

CheckpointError = fx.CheckpointError  # the class fx.load raises (pytest may import fxtrain/checkpoint.py twice for doctests)
from fxtrain.testing import assert_trees_close
from tests import _worlds

HERE = pathlib.Path(__file__)
ENV = _worlds.script_env()  # this file runs as a script too (resume, victim, the 2-rank world)
TIMEOUT_S = 120

# --- single-process scenarios: the same code builds the run here and in the fresh process -----------

OVERFLOW_CALLS = {4, 5}  # 0-based step indices whose batch overflows float16: the window of calls 3-5 is skipped


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + k)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
    return (x * 1e6 if k in OVERFLOW_CALLS else x), y


def loss_fn(params, b):
    x, y = b
    keep = (torch.rand(x.shape) > 0.25).to(x.dtype)  # dropout: the resumed run must restore the RNG
    return ((x * keep) @ params["w"] + params["b"] - y).float().square().mean()


def stack(name: str) -> fx.GradientTransformation:
    if name == "accumulate_amp":
        inner = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-2, weight_decay=0.1))
        amp = fx.amp_cast(inner, "p=f32,c=f16,o=f32", loss_scale=fx.DynamicLossScale(init_scale=2.0 ** 10,
                                                                                      growth_interval=2))
        return fx.accumulate(amp, every=3)
    if name == "schedule_inject":
        lr = fx.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=3, decay_steps=10)
        return fx.chain(fx.clip_by_global_norm(0.5),
                        fx.inject_hyperparams(fx.sgd)(learning_rate=lr, momentum=0.9))
    raise KeyError(name)


# (stack, steps in all, step after which the checkpoint is written)
SCENARIOS = {
    "after_overflow_skip": ("accumulate_amp", 10, 6),   # call 6 emitted the skipped window
    "mid_window": ("accumulate_amp", 10, 8),            # 2 of 3 calls of a window accumulated
    "schedule_inject": ("schedule_inject", 10, 4),
}


def initial(name: str) -> fx.TrainState:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 3, generator=g) * 0.1, "b": torch.zeros(3)}
    tx = stack(SCENARIOS[name][0])
    return fx.TrainState(step=0, params=params, opt_state=tx.init(params), rng=fx.rng_state(),
                         buffers={"seen": torch.zeros((), dtype=torch.int64)})


def run(name: str, state: fx.TrainState, until: int) -> fx.TrainState:
    step = fx.train_step(loss_fn, stack(SCENARIOS[name][0]))
    params, opt_state, buffers = state.params, state.opt_state, state.buffers
    for k in range(state.step, until):
        params, opt_state, _ = step(params, opt_state, batch(k))
        buffers = {"seen": buffers["seen"] + 1}
    return fx.TrainState(until, params, opt_state, fx.rng_state(), buffers)


def resume_all(root: pathlib.Path) -> None:
    """In a fresh process: load each scenario's checkpoint, continue to the end, save the result."""
    for name, (_, total, _) in SCENARIOS.items():
        like = initial(name)
        state = fx.load(root / name / "ckpt", like=like)
        fx.set_rng_state(state.rng)
        fx.save(root / name / "final", run(name, state, total))


def assert_trees_equal(a, b) -> None:
    assert fx.tree.first_mismatch(a, b) is None
    for path, x, y in zip(fx.tree.paths(a), fx.tree.flatten(a)[0], fx.tree.flatten(b)[0]):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f"at '{path}': {x} vs {y}"
        else:
            assert x == y, f"at '{path}': {x!r} vs {y!r}"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{scenario: (uninterrupted final state, the state saved mid-run, the state resumed in a fresh process)}."""
    root = tmp_path_factory.mktemp("resume")
    out = {}
    for name, (_, total, save_at) in SCENARIOS.items():
        torch.manual_seed(0)
        reference = run(name, initial(name), total)
        torch.manual_seed(0)
        saved = run(name, initial(name), save_at)
        fx.save(root / name / "ckpt", saved)
        out[name] = [reference, saved]
    proc = subprocess.run([sys.executable, str(HERE), "resume", str(root)], env=ENV, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in SCENARIOS:
        out[name].append(fx.load(root / name / "final", like=initial(name)))
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_in_a_fresh_process_is_bit_exact(resumed, name):
    reference, saved, final = resumed[name]
    assert_trees_equal(final.params, reference.params)
    assert_trees_equal(final.opt_state, reference.opt_state)
    assert_trees_equal(final.buffers, reference.buffers)
    assert_trees_equal(final.rng, reference.rng)
    assert final.step == reference.step == SCENARIOS[name][1]
    assert not torch.equal(saved.params["w"], reference.params["w"])  # the resumed part did train


def test_checkpoints_were_taken_where_the_scenarios_say(resumed):
    _, skip, _ = resumed["after_overflow_skip"]
    amp_state = skip.opt_state.inner_state
    assert int(skip.opt_state.mini_step) == 0 and int(amp_state.skipped) == 1     # just after the skip
    assert float(amp_state.loss_scale.scale) == 2.0 ** 9                          # backed off once
    _, mid, _ = resumed["mid_window"]
    assert int(mid.opt_state.mini_step) == 2                                     # mid-window: acc is live
    assert not torch.equal(mid.opt_state.acc["w"], torch.zeros(8, 3))
    _, sched, _ = resumed["schedule_inject"]
    hp = sched.opt_state[1]
    assert int(hp.count) == 4 and float(hp.hyperparams["learning_rate"]) > 0  # the schedule has moved


# --- round trip, layout, errors -------------------------------------------------------------------

def small_state(seed: int = 0, width: int = 3) -> fx.TrainState:
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, width, generator=g), "b": torch.randn(width, generator=g).bfloat16()}
    tx = fx.adam(1e-3)
    return fx.TrainState(step=3, params=params, opt_state=tx.init(params), rng={"cpu": g.get_state()})


def test_round_trip_keeps_dtypes_values_and_python_leaves(tmp_path):
    state = small_state()._replace(buffers={"note": "hi", "lr": 0.5, "flag": True, "none": None})
    path = fx.save(tmp_path / "ck", state)
    assert {p.name for p in path.iterdir()} >= {"fxtrain.json", ".metadata"}
    back = fx.load(path, like=small_state(seed=1)._replace(buffers={"note": "", "lr": 0.0, "flag": False, "none": None}))
    assert_trees_equal(back, state)
    assert isinstance(back, fx.TrainState) and back.buffers["flag"] is True
    assert not (tmp_path / ".ck.saving").exists() and not (tmp_path / ".ck.old").exists()


def test_save_over_an_existing_checkpoint_replaces_it(tmp_path):
    fx.save(tmp_path / "ck", small_state(0))
    fx.save(tmp_path / "ck", small_state(1))
    assert_trees_equal(fx.load(tmp_path / "ck", like=small_state(2)), small_state(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_another_models_checkpoint_names_the_path(tmp_path):
    fx.save(tmp_path / "ck", small_state())
    with pytest.raises(CheckpointError, match=r"ck does not match `like` at 'params.b': shape \(3,\) in the "
                                              r"checkpoint, \(5,\) in like"):
        fx.load(tmp_path / "ck", like=small_state(width=5))
    other = small_state()._replace(params={"w": torch.zeros(4, 3), "b": torch.zeros(3).bfloat16(),
                                           "extra": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"at 'params.extra': the checkpoint has no leaf there"):
        fx.load(tmp_path / "ck", like=other._replace(opt_state=fx.adam(1e-3).init(other.params)))
    sgd = small_state()._replace(opt_state=fx.sgd(0.1).init(small_state().params))
    with pytest.raises(CheckpointError, match=r"at 'opt_state.0.count'"):
        fx.load(tmp_path / "ck", like=sgd)
    wrong_dtype = small_state()._replace(params={"w": torch.zeros(4, 3), "b": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"at 'params.b': dtype bfloat16 in the checkpoint, float32 in like"):
        fx.load(tmp_path / "ck", like=wrong_dtype)
    with pytest.raises(CheckpointError, match=r"at 'step': a Python int in the checkpoint, a tensor in like"):
        fx.load(tmp_path / "ck", like=small_state()._replace(step=torch.tensor(3)))


def test_truncated_corrupted_incomplete_and_missing_checkpoints_say_so(tmp_path):
    path = fx.save(tmp_path / "ck", small_state())
    [data] = path.glob("*.distcp")
    blob = data.read_bytes()
    data.write_bytes(blob[:-10])
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is truncated or corrupted: {data.name} has "):
        fx.load(path, like=small_state())
    data.write_bytes(blob[:100] + bytes([blob[100] ^ 0xFF]) + blob[101:])
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is corrupted: {data.name} does not match its checksum"):
        fx.load(path, like=small_state())
    data.write_bytes(blob)
    fx.load(path, like=small_state())
    (path / "fxtrain.json").write_text('{"format": "fxtrain-checkpoint", "vers')
    with pytest.raises(CheckpointError, match=rf"checkpoint {path}: fxtrain.json is corrupted"):
        fx.load(path, like=small_state())
    (path / "fxtrain.json").unlink()
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} has no fxtrain.json: an incomplete save"):
        fx.load(path, like=small_state())
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint at {tmp_path / 'nope'}"):
        fx.load(tmp_path / "nope", like=small_state())


def test_unsupported_leaf_names_its_path(tmp_path):
    with pytest.raises(TypeError, match=r"the leaf at 'buffers.fn' is a function"):
        fx.save(tmp_path / "ck", small_state()._replace(buffers={"fn": lambda: 0}))
    assert not (tmp_path / "ck").exists()


def test_latest_picks_the_highest_complete_step(tmp_path):
    assert latest(tmp_path) is None
    for n in (2, 10):
        fx.save(tmp_path / f"step_{n:07d}", small_state())
    (tmp_path / ".step_0000012.saving").mkdir()  # a save that was killed
    assert latest(tmp_path).name == "step_0000010"


# --- SIGKILL during save ----------------------------------------------------------------------------

def victim(path: pathlib.Path, where: str) -> None:
    """Saves small_state(0) to ``path``, then dies by SIGKILL while saving small_state(1) over it."""
    fx.save(path, small_state(0))
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):  # the first fsync is DCP's, of the first data file it wrote
        os.kill(os.getpid(), signal.SIGKILL)

    def rename(src, dst):  # the old checkpoint is aside; the new one is about to move in
        if pathlib.Path(dst) == path:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst)

    if where == "write":
        os.fsync = fsync
    else:
        os.rename = rename
    fx.save(path, small_state(1))
    raise SystemExit("not killed")


def test_partial_terms_load_on_one_process_reduced_by_each_dims_own_op():
    # FSDP x TP's held sum of a norm weight: Partial avg over dp_shard, Partial sum over tp (sequence
    # parallel: each tp rank's tokens). Loaded on one process its terms are its value: the mean over dp of
    # the sum over tp; the mean over every term (the bug) gave half of it.
    terms = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3)  # [dp, tp, *shape]
    entry = {"layout": {"mesh": [2, 2], "placements": [["P", "avg"], ["P", "sum"]]}}
    got = fx.checkpoint._loaded(terms, torch.zeros(3), entry)
    assert torch.equal(got, (terms[0, 0] + terms[0, 1] + terms[1, 0] + terms[1, 1]) / 2)
    entry = {"layout": {"mesh": [2, 2], "placements": [["P", "sum"], ["P", "avg"]]}}
    assert torch.equal(fx.checkpoint._loaded(terms, torch.zeros(3), entry), terms.sum(0).mean(0))


def test_sigkill_during_save_leaves_the_last_good_checkpoint(tmp_path):
    procs = {w: subprocess.Popen([sys.executable, str(HERE), "victim", str(tmp_path / w / "ck"), w], env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for w in ("write", "commit")}
    for w, p in procs.items():
        out, _ = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == -signal.SIGKILL, out.decode()
    assert (tmp_path / "write" / ".ck.saving").exists()          # the half-written one is left aside
    assert not (tmp_path / "commit" / "ck").exists()            # killed between the renames
    for w in procs:
        assert_trees_equal(fx.load(tmp_path / w / "ck", like=small_state(2)), small_state(0))
        fx.save(tmp_path / w / "ck", small_state(1))               # the next save recovers and cleans up
        assert_trees_equal(fx.load(tmp_path / w / "ck", like=small_state(2)), small_state(1))
        assert sorted(p.name for p in (tmp_path / w).iterdir()) == ["ck"]


# --- DTensor: a world of 2 gloo ranks ---------------------------------------------------------------

CASES, case = _worlds.registry(worlds=(2,))  # run by tests/_worlds.py; files go to _worlds.OUT_DIR


@functools.cache  # one mesh for both cases (each init_device_mesh makes process groups)
def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _params_on(mesh, placement, seed=0):
    from torch.distributed.tensor import Replicate, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    return {"w": distribute_tensor(torch.randn(8, 4, generator=g), mesh, [placement]),
            "b": distribute_tensor(torch.randn(4, generator=g), mesh, [Replicate()])}


def _dtensor_stack() -> fx.GradientTransformation:
    return fx.chain(fx.clip_by_global_norm(1.0), fx.adam(1e-2))


@case()
def case_resume_on_two_ranks_is_bit_exact(world):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh, root, tx = _mesh(world), _worlds.OUT_DIR, _dtensor_stack()

    def dloss(params, k):
        g = torch.Generator().manual_seed(k)
        x = distribute_tensor(torch.randn(6, 8, generator=g), mesh, [Replicate()])
        y = distribute_tensor(torch.randn(6, 4, generator=g), mesh, [Replicate()])
        return (x @ params["w"] + params["b"] - y).square().mean()

    step = fx.train_step(dloss, tx, donate=False)

    def train(params, opt_state, start, stop):
        for k in range(start, stop):
            params, opt_state, _ = step(params, opt_state, k)
        return params, opt_state

    def local(t):
        return fx.tree.map(lambda x: x.to_local() if isinstance(x, DTensor) else x, t)

    p0 = _params_on(mesh, Shard(0))
    ref = train(p0, tx.init(p0), 0, 6)
    p, s = train(p0, tx.init(p0), 0, 3)
    fx.save(root / "mid", fx.TrainState(3, p, s))
    fresh = _params_on(mesh, Shard(0), seed=1)
    state = fx.load(root / "mid", like=fx.TrainState(0, fresh, tx.init(fresh)))
    got = train(state.params, state.opt_state, 3, 6)
    assert_trees_equal(local(got), local(ref))
    assert state.params["w"].placements == (Shard(0),)
    fx.save(root / "final", fx.TrainState(6, *got))
    full = fx.tree.map(lambda x: x.full_tensor() if hasattr(x, "full_tensor") else x, got)  # collectives: all ranks
    if torch.distributed.get_rank() == 0:
        torch.save({"params": full[0], "opt_state": full[1]}, root / "full.pt")


@case()
def case_load_onto_other_placements_reshards(world):
    from torch.distributed.tensor import Shard

    mesh, root = _mesh(world), _worlds.OUT_DIR
    p = _params_on(mesh, Shard(0))
    fx.save(root / "reshard", p)
    back = fx.load(root / "reshard", like=_params_on(mesh, Shard(1), seed=3))
    assert back["w"].placements == (Shard(1),)
    assert torch.equal(back["w"].full_tensor(), p["w"].full_tensor())


@case()
def case_a_save_rank0_refuses_raises_on_every_rank(world):
    root, rank = _worlds.OUT_DIR, torch.distributed.get_rank()
    owner = [fx.checkpoint._me()]  # the owner record of rank 1: a live process on this host
    torch.distributed.broadcast_object_list(owner, src=1)
    if rank == 0:  # as if rank 1 were saving to root / "busy" on its own
        (root / ".busy.saving").mkdir()
        (root / ".busy.saving" / "fxtrain.owner.json").write_text(json.dumps(owner[0]))
    expected = r"another process \(pid \d+" if rank == 0 else r"rank 0 could not start saving .*another process"
    with pytest.raises(CheckpointError, match=expected):  # on rank 1 too, instead of waiting at a barrier
        fx.save(root / "busy", {"x": torch.ones(2)})


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("world2")
    return root, _worlds.results(__file__, 2, root, TIMEOUT_S)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_dtensor_case(world2, name):
    _worlds.check(world2[1], 2, name)


@pytest.mark.multiprocess
def test_two_rank_dtensor_checkpoint_loads_on_one_rank(world2):
    root, results = world2
    assert all(r.get("resume_on_two_ranks_is_bit_exact") == "ok" for r in results)
    full = torch.load(root / "full.pt", weights_only=False)
    params = {"w": torch.zeros(8, 4), "b": torch.zeros(4)}
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.adam(1e-2))
    state = fx.load(root / "final", like=fx.TrainState(0, params, tx.init(params)))
    assert state.step == 6
    assert_trees_equal(state.params, full["params"])
    assert_trees_equal(state.opt_state, full["opt_state"])
    assert_trees_close(state.params, full["params"], rtol=0, atol=0)


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        resume_all(pathlib.Path(sys.argv[2]))
    elif sys.argv[1] == "victim":
        victim(pathlib.Path(sys.argv[2]), sys.argv[3])
    else:
        _worlds.worker(CASES, *sys.argv[1:])
