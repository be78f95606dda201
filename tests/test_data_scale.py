"""Data at scale (issue 37; fxtrain/data.py): each rank reads only its share of a global batch (tp and pp peers
receive it from the first of their group: real processes in tests/_worlds.py's shared worlds), map-style sources
load through DataLoader workers, resume is O(1) without replaying (from checkpoints/best too), the global order
and a random transform inside an item depend on the seed and the place in the global order only (not on the
world size, the number of workers or a resume)."""

from __future__ import annotations

import json
import multiprocessing
import pathlib
import random
import shutil
import sys

import numpy as np
import pytest
import torch

import fxtrain as fx
from fxtrain import build, data as fxdata, sources, train as runner
from fxtrain.data import ExampleBatches, Loader, for_rank, from_source
from fxtrain.errors import ConfigError
from tests import _data_sources, _worlds
from tests._runner import cfg_of, isolate, run_main, torchrun_train  # noqa: F401 - isolate: the autouse fixture


class Counted(torch.utils.data.Dataset):
    """Item i is ``([i], i % 5)``; every read counted, also from worker processes (a forked shared counter)."""

    def __init__(self, n: int):
        self.n, self.reads = n, multiprocessing.get_context("fork").Value("q", 0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.reads.get_lock():
            self.reads.value += 1
        return torch.tensor([float(i)]), i % 5


def test_each_rank_reads_its_share_and_the_shares_are_the_global_batch():
    """Per step, the items read across the data-parallel ranks are the global batch, once each, and the shares
    in rank order are the one-process batch, for 1, 2 and 4 ranks (tensors, map-style and windows alike)."""
    source = Counted(200)
    whole = from_source(source, name="c", batch_size=8, num_workers=0)
    for world in (2, 4):
        ranks = [for_rank(whole, r, world) for r in range(world)]
        assert all(sharded for _, sharded in ranks)
        for step in (0, 1, 37):   # 37: a later epoch
            before = source.reads.value
            shares = [data.train[step] for data, _ in ranks]
            assert source.reads.value - before == 8   # the global batch, read once across the ranks
            for got, want in zip((torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares])),
                                 whole.train[step]):
                assert torch.equal(got, want)
    tensors = fxdata.synthetic(batch_size=8, num_examples=64)
    windows = fxdata.stdlib_text(batch_size=8, context=8, max_bytes=5000, eval_windows=2)
    for data in (tensors, windows):
        for world in (2, 4):
            for step in (0, 9):
                shares = [for_rank(data, r, world)[0].train[step] for r in range(world)]
                assert torch.equal(torch.cat([s[0] for s in shares]), data.train[step][0])
    with pytest.raises(ValueError, match="a batch of 8 does not split evenly over 3 data-parallel ranks"):
        for_rank(whole, 0, 3)


def test_workers_give_the_in_process_batches_in_any_order_and_read_nothing_before_a_jump():
    """num_workers=2 yields the batches the training process collates, bit for bit, at steps asked in order and
    out of order; a jump to step 100,000 of a source of 1e6 batches reads one batch's items (the loader starts
    there: O(1), no replay), with workers and without."""
    small = Counted(40)
    ref = from_source(small, name="c", batch_size=4, num_workers=0, test_fraction=0.2)
    loaded = from_source(small, name="c", batch_size=4, num_workers=2, test_fraction=0.2)
    assert repr(loaded).endswith("(Counted, map-style, 2 workers)")
    for step in (0, 1, 2, 3, 9, 4, 5):   # 9 then 4: jumps restart the workers there
        for got, want in zip(loaded.train[step], ref.train[step]):
            assert torch.equal(got, want)
    big = Counted(1_000_000)   # batch 1: 1e6 batches per epoch
    for workers in (0, 2):
        batches = ExampleBatches(big, range(1_000_000), batch_size=1, seed=0, loader=Loader(num_workers=workers))
        before = big.reads.value
        x, _ = batches[100_000]
        later = [int(batches[100_000 + k][0]) for k in range(1, 3)]
        assert big.reads.value - before <= 1 + 2 + (2 * 2 * 1 if workers else 0)   # + the workers' prefetch
        assert int(x) == int(ExampleBatches(big, range(1_000_000), batch_size=1, seed=0)[100_000][0])
        assert later == [int(ExampleBatches(big, range(1_000_000), 1, 0)[100_000 + k][0]) for k in (1, 2)]


@pytest.mark.parametrize("key,value,message", [
    ("num_workers", -1, "data.num_workers=-1: expected a whole number of worker processes >= 0"),
    ("prefetch_factor", 0, "data.prefetch_factor=0: expected a whole number of batches >= 1"),
    ("pin_memory", "yes", "data.pin_memory=yes: expected true, false or null"),
    ("persistent_workers", 2, "data.persistent_workers=2: expected true or false"),
])
def test_bad_loader_settings_are_one_line_before_anything_is_written(tmp_path, key, value, message):
    code = run_main("data=synthetic", f"+data.{key}={value}", f"hydra.run.dir={tmp_path / 'run'}")
    assert message in str(code) and "\n" not in str(code) and not (tmp_path / "run").exists()


def _records(run: pathlib.Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time_s"}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


MAP = ["data=synthetic", "data._target_=tests._data_sources.gaussians", "data.batch_size=8", "data.num_examples=96",
       "trainer.max_steps=8", "trainer.log_every=1", "trainer.eval_every=8", "trainer.keep_last=0", "model.hidden=[8]"]


def test_resume_with_workers_is_bit_exact_and_reads_nothing_before_its_step(tmp_path):
    """A run killed after step 4's checkpoint and resumed (resume=auto, 2 workers) logs what the uninterrupted
    run logged, bit for bit, across an epoch boundary (9 batches an epoch); the resume reads no item of steps
    1-4, and the training process waited for some share of its steps (the run's data line)."""
    args = [*MAP, "+data.num_workers=2", "+data.prefetch_factor=1", "trainer.max_steps=12", "trainer.checkpoint_every=4"]
    assert run_main(*args, f"hydra.run.dir={tmp_path / 'whole'}") == 0
    killed = tmp_path / "killed"
    assert run_main(*args, f"hydra.run.dir={killed}", "resume=auto") == 0
    for later in ("step_0000008", "step_0000012"):
        shutil.rmtree(killed / "checkpoints" / later)
    (killed / "summary.json").unlink()
    reads = tmp_path / "reads"
    assert run_main(*args, f"hydra.run.dir={killed}", "resume=auto", f"+data.reads={reads}") == 0
    assert _records(killed) == _records(tmp_path / "whole")
    read = [int(i) for i in (reads / "rank0.txt").read_text().split()]
    data = from_source(_data_sources.gaussians(num_examples=96), name="g", batch_size=8, test_fraction=0.25,
                       num_workers=0)
    train = set(data.train.indices.tolist())
    trained = [i for i in read if i in train]   # the held-out rows are read once, at the start
    # the num_classes check's first batch, steps 5-12, and at most the 2 batches the 2 workers load ahead
    # (prefetch_factor=1); a replay of steps 1-4 would read 8 + 12 x 8 = 104
    assert 8 + 8 * 8 <= len(trained) <= 8 + 8 * 8 + 2 * 8, len(trained)


STREAM = ["data=synthetic", "data._target_=tests._data_sources.counter", "trainer.max_steps=6", "trainer.log_every=1",
          "trainer.eval_every=6", "trainer.keep_last=0", "trainer.checkpoint_every=3", "model.hidden=[8]",
          "data.batch_size=8"]


def test_a_stream_resumes_through_its_own_state_and_one_without_is_refused(tmp_path):
    """A stream whose iterator has state_dict/load_state_dict resumes from the checkpoint's position (bit for bit,
    none of its batches made again); one without is refused at resume in one line, before anything is written."""
    assert run_main(*STREAM, f"hydra.run.dir={tmp_path / 'whole'}") == 0
    killed = tmp_path / "killed"
    assert run_main(*STREAM, f"hydra.run.dir={killed}", "resume=auto") == 0
    manifest = json.loads((killed / "checkpoints" / "step_0000003" / "fxtrain.json").read_text())
    assert manifest["meta"]["data"]["states"][0]["source"] == {"at": 3}   # steps 1-3 read batches 0-2
    shutil.rmtree(killed / "checkpoints" / "step_0000006")
    (killed / "summary.json").unlink()
    _data_sources.Counter.made = 0
    assert run_main(*STREAM, f"hydra.run.dir={killed}", "resume=auto") == 0
    assert _records(killed) == _records(tmp_path / "whole")
    assert _data_sources.Counter.made == 1 + 3   # the check's first batch of a fresh source, then steps 4-6
    plain = tmp_path / "plain"
    args = [*STREAM, "+data.stateful=false", f"hydra.run.dir={plain}", "resume=auto"]
    assert run_main(*args) == 0
    shutil.rmtree(plain / "checkpoints" / "step_0000006")
    (plain / "summary.json").unlink()
    written = sorted(p.name for p in plain.rglob("*"))
    code = str(run_main(*args))
    assert "has no state_dict()/load_state_dict() to continue from at step 3" in code and "\n" not in code
    assert sorted(p.name for p in plain.rglob("*")) == written


def test_a_resume_from_the_best_checkpoint_continues_the_stream_from_its_step(tmp_path):
    """checkpoints/best records every rank's stream position at its step, as step_<N> does: resume=<run>/checkpoints/
    best continues the stream from there and logs the uninterrupted run's records after best's step, bit for bit
    (before, best held no position and the resume was refused)."""
    args = [*STREAM, "trainer.eval_every=2", "trainer.checkpoint_every=2"]
    assert run_main(*args, f"hydra.run.dir={tmp_path / 'whole'}") == 0
    best = tmp_path / "whole" / "checkpoints" / "best"
    meta = json.loads((best / "fxtrain.json").read_text())["meta"]
    step = meta["best"]["step"]
    assert step < 6 and meta["data"]["states"][0]["source"] == {"at": step}, meta
    assert run_main(*args, f"hydra.run.dir={tmp_path / 'resumed'}", f"resume={best}") == 0

    def trained(run):  # the test split's metrics are of each run's own best checkpoint
        return [{k: v for k, v in r.items() if not k.startswith("test_")} for r in _records(run)]
    assert trained(tmp_path / "resumed") == [r for r in trained(tmp_path / "whole") if r["step"] > step]


def _reads_per_rank(reads: pathlib.Path, world: int) -> list[int]:
    return [len((reads / f"rank{r}.txt").read_text().split()) for r in range(world)]


@pytest.mark.slow  # fast cover: test_each_rank_reads_its_share_and_the_shares_are_the_global_batch (one process)
def test_real_ranks_read_the_global_batch_once_per_step(tmp_path):
    """2 gloo ranks under torchrun, parallel=dp: each rank reads half of every global batch (4 of 8 items per
    step); together the ranks read each step's global batch once (the old path read it on every rank: 2x)."""
    reads = tmp_path / "reads"
    torchrun_train(tmp_path, *MAP, "parallel=dp", "+data.num_workers=0", f"+data.reads={reads}",
                   "trainer.checkpoint_every=0", "data.test_fraction=0.25")
    data = from_source(_data_sources.gaussians(num_examples=96), name="g", batch_size=8, test_fraction=0.25)
    train = {i for k in range(9) for i in data.train.items(k)}
    per_rank = [[int(i) for i in (reads / f"rank{r}.txt").read_text().split() if int(i) in train] for r in (0, 1)]
    assert all(r[:8] == data.train.items(0) for r in per_rank)   # at the start, the num_classes check's batch 0
    per_rank = [r[8:] for r in per_rank]
    assert [len(r) for r in per_rank] == [8 * 4, 8 * 4]   # 8 steps, 4 items a step on each rank
    assert sorted(per_rank[0] + per_rank[1]) == sorted(i for k in range(8) for i in data.train.items(k))


@pytest.mark.slow  # fast cover: the one-process shares test (the order depends on the seed and the step only)
def test_relayout_from_4_ranks_to_2_and_to_1_continues_the_same_global_batches(tmp_path):
    """4 dp ranks (no workers) checkpoint at step 4; resume_relayout=true on 2 ranks (2 workers each) and in one
    process (2 workers) logs what the uninterrupted 4-rank run logs after step 4, within the float32 tolerance the
    layouts agree to (another reduction order), and trains on the same batches (another batch: a loss far off)."""
    args = [*MAP, "trainer.checkpoint_every=4"]
    _, whole = torchrun_train(tmp_path / "whole", *args, "parallel=dp", "+data.num_workers=0", nproc=4)
    ckpt = whole / "checkpoints" / "step_0000004"
    ref = [r for r in _records(whole) if r["step"] > 4]
    for nproc, layout in ((2, "parallel=dp"), (1, "parallel=none")):
        over = [*args, layout, "+data.num_workers=2", f"resume={ckpt}", "resume_relayout=true"]
        if nproc == 1:
            assert run_main(*over, f"hydra.run.dir={tmp_path / 'one'}") == 0
            run = tmp_path / "one"
        else:
            _, run = torchrun_train(tmp_path / f"on{nproc}", *over, nproc=nproc)
        got = [r for r in _records(run) if r["step"] > 4]
        assert [r["step"] for r in got] == [r["step"] for r in ref]
        for g, r in zip(got, ref):
            assert abs(g["loss"] - r["loss"]) <= 1e-5 * abs(r["loss"]), (nproc, g, r)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11 on torch 2.13
@pytest.mark.parametrize("workers", [0, 2])
def test_torchdatas_stateful_dataloader_resumes_from_its_state_in_the_checkpoint_json(workers):
    """A torchdata StatefulDataLoader (shuffled, seeded, with and without workers) as a Dataset's train: the state
    recorded after 5 batches (JSON, as the checkpoint's manifest holds it) put into a fresh loader continues with
    batches 5, 6, 7 of the uninterrupted stream, and the fresh loader reads only those."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def stream(source):
        loader = StatefulDataLoader(source, batch_size=4, shuffle=True, num_workers=workers,
                                    generator=torch.Generator().manual_seed(3))
        return from_source(fxdata.Dataset("sdl", loader, (torch.zeros(4, 1), torch.zeros(4, dtype=torch.long))),
                           name="sdl")

    first = stream(Counted(40))
    whole = [first.train[k][0] for k in range(5)]
    state = json.loads(json.dumps(fxdata.stream_state(first)))   # as the checkpoint's manifest holds it
    whole += [first.train[k][0] for k in range(5, 8)]
    source = Counted(40)
    resumed = stream(source)
    before = source.reads.value   # the check's first batch
    fxdata.load_stream_state(resumed, state)
    for k in (5, 6, 7):
        assert torch.equal(resumed.train[k][0], whole[k])
    if workers == 0:   # (workers read in their own processes, ahead)
        assert source.reads.value - before == 3 * 4   # batches 5-7 only: nothing replayed


class Rows:
    """A stream of global batches of 8 rows drawn from ``(seed, step)``, that splits itself: ``shard(rank, world)``
    yields each step's rows ``rank*8/world ..`` only (the contract of CONTRACT.md); ``made`` counts rows made."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world, self.made = rank, world, 0

    def shard(self, rank: int, world: int) -> "Rows":
        return Rows(rank, world)

    def __iter__(self):
        step = 0
        while True:
            rows = torch.Generator().manual_seed(step)
            x = torch.randn((8, 2), generator=rows)
            share = 8 // self.world
            self.made += share
            yield x[self.rank * share:(self.rank + 1) * share], torch.zeros(share, dtype=torch.long)
            step += 1


def test_a_stream_that_splits_itself_gives_each_rank_its_share():
    """A returned Dataset's iterable with shard(rank, world): each rank reads its share only (rows made per step
    across the ranks: the global batch), the shares in rank order are the one-process batch; a bare iterable's
    shard is not used (its held-out batches must be every rank's), so every rank reads and slices the whole."""
    whole = from_source(fxdata.Dataset("rows", Rows(), (torch.zeros(2, 2), torch.zeros(2, dtype=torch.long))),
                        name="rows")
    ranks = [for_rank(whole, r, 2) for r in range(2)]
    assert all(sharded for _, sharded in ranks)
    for step in range(4):
        shares = [data.train[step][0] for data, _ in ranks]
        assert torch.equal(torch.cat(shares), whole.train[step][0])
    assert [data.train.source.made for data, _ in ranks] == [4 * 4, 4 * 4]   # 4 steps x 4 rows, each rank
    bare = from_source(Rows(), name="rows", test_batches=1)
    assert for_rank(bare, 0, 2) == (bare, False)


# --- per-item RNG: a random transform inside an item ---------------------------------------------------------

class Crops(torch.utils.data.Dataset):
    """Item ``i`` is ``[i, a torch draw, a numpy draw, a Python draw]``: a random transform's three sources."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.tensor([float(i), float(torch.rand(())), np.random.rand(), random.random()]), i % 3


def test_a_random_transform_in_an_item_is_a_function_of_the_seed_and_its_place_in_the_global_order():
    """The draws inside items (torch's, numpy's and Python's global RNGs) give the same global batch of a step with 0
    or 2 workers, on 1 or 2 ranks (the shares concatenated), read in order or after a jump (a resume); an item at
    another place (its next epoch) draws anew; the training process's own RNG does not move. The same for a
    stream of items (ItemStream: data=tokens' random windows)."""
    ref = ExampleBatches(Crops(), range(32), batch_size=4, seed=3)
    torch_state = torch.get_rng_state()
    want = [ref[k][0] for k in range(10)]   # 10 steps: 8 an epoch
    assert torch.equal(torch.get_rng_state(), torch_state)
    loaded = ExampleBatches(Crops(), range(32), batch_size=4, seed=3, loader=Loader(num_workers=2))
    for k in (9, 2, 3):   # a jump (a resume at step 9), then back
        assert torch.equal(loaded[k][0], want[k]), k
    halves = [ExampleBatches(Crops(), range(32), batch_size=4, seed=3).shard(r, 2) for r in (0, 1)]
    for k in (5, 1):
        assert torch.equal(torch.cat([h[k][0] for h in halves]), want[k]), k
    first = {int(x[0]): x[1:] for k in range(8) for x in want[k]}   # epoch 0: each item once
    again = {int(x[0]): x[1:] for x in want[8]}                      # epoch 1's first batch
    assert all(not torch.equal(again[i], first[i]) for i in again)
    stream = sources.ItemStream(Crops(), batch_size=4, seed=3, order="random")
    whole = [stream.batch(k)[0] for k in range(3)]
    for k in (2, 0):
        assert torch.equal(torch.cat([stream.shard(r, 2).batch(k)[0] for r in (0, 1)]), whole[k]), k


# --- tp, pp and ep peers: the batch read once per step across the ranks, the params one process's -------------

CASES, case = _worlds.registry(worlds=(2, 4))
STEPS = 3
# the tiny LM on map-style random crops of a token sequence (tests/_data_sources.windows), read in this process
PEERS = ["model=transformer", "data=stdlib_text", "task=lm", "data._target_=tests._data_sources.windows",
         "+data.num_workers=0", "data.batch_size=8", "data.context=16", "data.eval_windows=8", "model.d_model=16",
         "model.n_heads=2", "model.n_layers=2", "schedule=constant", "trainer.cpu_threads=1", "amp=off",
         "accumulate=off", "optim/transform@optim.chain=[sgd]",
         f"trainer.max_steps={STEPS}"]
LAYOUTS = {"tp": (2, ["parallel=tp"]), "pp": (2, ["parallel=pp", "parallel.microbatches=2"]),
           "ep": (2, ["parallel=ep", "model=moe"]), "pp_tp": (4, ["parallel=pp_tp", "parallel.microbatches=2"]),
           "fsdp_tp": (4, ["parallel=fsdp_tp"])}


def _trained(cfg, dims=None) -> tuple[dict, list[int]]:
    """STEPS steps of the runner's build and step on ``dims`` (one process: ``None``): the params (full tensors, by
    path) and the items this process read for each step's batch."""
    import torch.distributed.tensor as dt

    built = runner.build_run(cfg, torch.device("cpu"), dims)
    params, state, buffers, reads = built.params, built.opt_state, built.buffers, []
    for i in range(STEPS):
        before = _data_sources.Windows.reads
        batch = built.batch(i, dims) if dims is not None else built.data.train[i]
        reads.append(_data_sources.Windows.reads - before)
        params, state, buffers, _ = built.step(params, state, buffers, batch)
    full = {p: (x.full_tensor() if isinstance(x, dt.DTensor) else x).detach()
            for p, x in zip(fx.tree.paths(params), fx.tree.leaves(params))}
    return full, reads


def _peers_case(name: str):
    world, overrides = LAYOUTS[name]

    def run(w):
        import torch.distributed as dist

        cfg = cfg_of(*PEERS, *overrides)
        dims = build.parallel_dims(cfg, w).build("cpu")
        params, reads = _trained(cfg, dims)
        every: list = [None] * w
        dist.all_gather_object(every, reads)
        print(f"reads per step per rank, parallel={name}: {every}", flush=True)
        assert [sum(r[i] for r in every) for i in range(STEPS)] == [8] * STEPS, every   # the global batch, once
        assert reads == [8 // dims.data_world if dims.reads_data else 0] * STEPS, every
        one, _ = _trained(cfg)   # one process's, computed on this rank
        assert params and set(params) <= set(one)
        fx.testing.assert_trees_close(params, {p: one[p] for p in params}, rtol=1e-4, atol=1e-6)

    run.__name__ = f"case_peers_read_once_{name}"
    case(world)(run)


for _name in LAYOUTS:
    _peers_case(_name)


def _fixture(write, folder: pathlib.Path) -> list[str]:
    """``write(folder)``'s files written once, by rank 0, and its overrides on every rank."""
    import torch.distributed as dist

    out = [write(folder) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(out, src=0)
    return out[0]


@case(2)
def case_a_stream_on_tp_checkpoints_the_readers_position_and_resumes(world):
    """data=tokens (a stream) under parallel=tp: the checkpoint holds the position of the rank that reads
    (the other receives and records none); a resume on tp, and a relayout to 2 data-parallel ranks (both read),
    continue the stream as the uninterrupted run does."""
    import torch.distributed as dist

    from tests import _formats

    root = _worlds.OUT_DIR / "stream_tp"
    args = [*_fixture(_formats.tokens, root / "fixture"), "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=4", "trainer.keep_last=0",
            "trainer.checkpoint_every=2", "trainer.progress=false", "trainer.cpu_threads=1", "schedule=constant",
            "optim/transform@optim.chain=[sgd]", "amp=off", "accumulate=off"]

    def train(out, *extra):
        runner.train(cfg_of(*args, *extra), out)
        dist.barrier()
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k != "time_s" and not k.startswith("test_")} for x in lines]

    whole = train(root / "whole", "parallel=tp")
    ckpt = root / "whole" / "checkpoints" / "step_0000002"
    states = json.loads((ckpt / "fxtrain.json").read_text())["meta"]["data"]["states"]
    assert states[1] is None and states[0]["source"] == {"step": 2}, states
    assert train(root / "tp", "parallel=tp", f"resume={ckpt}") == whole[2:]
    dp = train(root / "dp", "parallel=dp", f"resume={ckpt}", "resume_relayout=true")
    assert [r["step"] for r in dp] == [3, 4]
    for a, b in zip(dp, whole[2:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)

@case(2)
def case_a_grain_iter_dataset_on_two_ranks_splits_correctly_or_is_refused(world):
    """A Grain IterDataset is not split by rank (each rank reads the whole batch and keeps its share): on 2
    data-parallel ranks its shares are the one-process global batches; one whose order differs between the
    processes is refused at build, in one line, on every rank."""
    import torch.distributed as dist

    from tests import _formats

    base = [*_fixture(_formats.grain, _worlds.OUT_DIR / "grain_iter"), "parallel=dp"]
    cfg = cfg_of(*base, "data.train._target_=tests._formats.grain_iter")
    dims = build.parallel_dims(cfg, world).build("cpu")
    built = runner.build_run(cfg, torch.device("cpu"), dims)
    one = build.dataset(cfg.data, "grain")   # one process's global batches
    for k in range(3):
        share = built.batch(k, dims)[0]
        shares: list = [None] * world
        dist.all_gather_object(shares, share)
        assert torch.equal(torch.cat(shares), one.train[k][0]), k
    with pytest.raises(ConfigError) as e:
        runner.build_run(cfg_of(*base, "data.train._target_=tests._formats.grain_iter_by_process"),
                         torch.device("cpu"), dims)
    assert "the ranks read different first batches" in str(e.value) and "\n" not in str(e.value)


test_case = _worlds.tests(__file__, CASES, timeout_s=240)

if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
