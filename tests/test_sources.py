"""The data formats of fxtrain/sources.py: memory-mapped token files, Hugging Face datasets, WebDataset shards and
Grain pipelines. Each: items read as the reference reads them (numpy's own view of the file, the dataset's own
rows, the shard's own samples), each rank's share of a global batch, resume from the stream's state without
reading what it skips, bad input in one line, and a run of the runner that trains and resumes
(tests/_formats.py generates every fixture; tests enumerate its FORMATS)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from fxtrain import build, data as fxdata, sources, train as runner
from fxtrain.errors import ConfigError
from fxtrain.report import read_jsonl
from tests import _formats
from tests._runner import cfg_of, isolate, run_main, torchrun_train  # noqa: F401 - isolate: autouse


class Counted:
    """A map-style source that counts the items read from it."""

    def __init__(self, source):
        self.source, self.reads = source, 0

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        self.reads += 1
        return self.source[i]


def take(it, n):
    return [next(it) for _ in range(n)]


def cat(batches):
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


# --- data=tokens ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_token_windows_are_the_files_tokens_read_by_numpy(tmp_path, dtype):
    tokens = (np.arange(5000) * 7919 % 70000).astype(dtype)   # uint32: values above 65,535 survive
    tokens.tofile(tmp_path / "train.bin")
    windows = sources.TokenWindows(tmp_path / "train.bin", context=32, dtype=np.dtype(dtype).name, stride=5)
    assert len(windows) == (5000 - 33) // 5 + 1
    for i in (0, 17, len(windows) - 1, -1):
        x, y = windows[i]
        start = (i % len(windows)) * 5
        assert x.dtype == torch.int64 and x.tolist() == tokens[start:start + 32].tolist()
        assert y.tolist() == tokens[start + 1:start + 33].tolist()
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_token_windows_bad_input_is_one_line_naming_the_file(tmp_path):
    np.arange(101, dtype=np.uint16).tofile(tmp_path / "odd.bin")          # 202 bytes: not uint32
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "short.bin")
    cases = [(tmp_path / "missing.bin", {}, "does not exist"),
             (tmp_path / "odd.bin", {"dtype": "uint32"}, "holds 202 bytes, not a whole number of uint32 tokens"),
             (tmp_path / "short.bin", {}, "holds 10 tokens, not more than context=16"),
             (tmp_path / "odd.bin", {"dtype": "float32"}, "dtype=float32 is not an integer type")]
    for path, kwargs, message in cases:
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            sources.TokenWindows(path, context=16, **kwargs)
        assert message in str(e.value) and "\n" not in str(e.value)
        assert "dtype" in str(e.value) or str(path) in str(e.value)


def test_tokens_random_windows_are_seeded_and_sequential_ones_are_the_file_in_order(tmp_path):
    d = _formats.token_files(tmp_path)
    data = sources.tokens(d, context=16, batch_size=4, seed=3, eval_windows=8)
    again = sources.tokens(d, context=16, batch_size=4, seed=3, eval_windows=8)
    first = take(iter(data.train), 5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, take(iter(again.train), 5)))   # a pure function of seed
    assert not torch.equal(first[0][0], first[1][0])
    other = take(iter(sources.tokens(d, context=16, batch_size=4, seed=4, eval_windows=8).train), 1)
    assert not torch.equal(first[0][0], other[0][0])
    file = np.fromfile(d / "train.bin", dtype=np.uint16)
    seq = take(iter(sources.tokens(d, context=16, batch_size=4, order="sequential", eval_windows=8).train), 3)
    x, y = cat(seq)
    assert x.flatten().tolist() == file[:12 * 16].tolist() and y[:, -1].tolist() == file[16:12 * 16 + 1:16].tolist()
    # val.bin is the test split when there is no test file; its windows sit side by side, spread over the file
    val = np.fromfile(d / "val.bin", dtype=np.uint16)
    starts = np.unique(np.linspace(0, (4096 - 17) // 16, 8).astype(int)) * 16
    assert data.val is None and data.test[0].tolist() == [val[s:s + 16].tolist() for s in starts]
    assert data.test[1].tolist() == [val[s + 1:s + 17].tolist() for s in starts]


def test_tokens_with_val_and_test_files_and_the_facts(tmp_path):
    d = _formats.token_files(tmp_path, splits=("train", "val", "test"))
    data = sources.tokens(d, test_file="test.bin", context=16, batch_size=4, eval_windows=4, vocab_size=64)
    test = np.fromfile(d / "test.bin", dtype=np.uint16)
    assert data.val is not None and data.test[0][0].tolist() == test[:16].tolist()
    with pytest.raises(ValueError, match=r"^tokens: vocab_size=10 is too small: the tokens go up to 6\d; set "):
        sources.tokens(d, context=16, batch_size=4, vocab_size=10)
    with pytest.raises(ValueError, match="tokens: val_file=null and test_file=null"):
        sources.tokens(d, val_file=None, context=16, batch_size=4)
    with pytest.raises(ValueError, match="order='shuffled'; expected one of random, shuffle, sequential"):
        sources.tokens(d, order="shuffled", context=16, batch_size=4)


@pytest.mark.parametrize("order", sources.ORDERS)
def test_each_rank_reads_only_its_share_and_the_shares_are_the_global_batch(order):
    items = [(np.float32(i), i) for i in range(50)]
    whole = sources.ItemStream(Counted(items), batch_size=8, seed=1, order=order)
    ranks = [sources.ItemStream(Counted(items), 8, 1, order).shard(r, 4) for r in range(4)]
    global_batches = take(iter(whole), 9)
    shares = [take(iter(r), 9) for r in ranks]
    for k in range(9):
        assert torch.equal(cat([s[k] for s in shares])[0], global_batches[k][0])   # rank order, any world size
    assert [r.source.reads for r in ranks] == [9 * 2] * 4                          # 2 items per rank per step
    with pytest.raises(ValueError, match=r"batch_size=8 does not split over 3 data-parallel ranks"):
        whole.shard(0, 3)


def test_a_stream_resumes_at_a_far_step_without_reading_what_it_skips():
    source = Counted([(np.float32(i), i) for i in range(10_000)])
    stream = sources.ItemStream(source, batch_size=4, seed=0, order="shuffle")
    it = iter(stream)
    it.load_state_dict({"step": 100_000})                 # epoch 40: the permutation of (seed, 40), nothing else
    batch = next(it)
    assert source.reads == 4 and it.state_dict() == {"step": 100_001}
    perm = np.random.default_rng([0, 40]).permutation(10_000)
    assert batch[1].tolist() == perm[0:4].tolist()        # step 100,000 = epoch 40, batch 0


# --- data=hf ----------------------------------------------------------------------------------------------------

def test_hf_items_follow_the_column_map(tmp_path):
    import datasets
    table = datasets.Dataset.from_dict({"ids": [[1, 2, 3, 4], [5, 6, 7, 8]], "a": [0.5, 1.5], "b": [2, 3],
                                        "label": [1, 0]})
    x, y = sources.HFItems(table, input="ids", target=None)[1]          # next token of a token column
    assert x.tolist() == [5, 6, 7] and y.tolist() == [6, 7, 8] and x.dtype == torch.int64
    x, y = sources.HFItems(table, input=["a", "b"], target="label")[0]  # numeric columns stacked, float32
    assert x.tolist() == [0.5, 2.0] and x.dtype == torch.float32 and int(y) == 1
    pairs = sources.HFItems(table, input="ids", target="label").__getitems__([1, 0])   # one Arrow read
    assert [p[0].tolist() for p in pairs] == [[5, 6, 7, 8], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"^hf: target column 'labels' is not in the dataset; its columns are "
                                         r"ids, a, b, label$"):
        sources.HFItems(table, input="ids", target="labels")
    ragged = datasets.Dataset.from_dict({"ids": [[1, 2], [3, 4, 5]]})
    with pytest.raises(ValueError, match="rows of column 'ids' have different lengths \\(2..3\\); chunk them"):
        sources.HFItems(ragged, input="ids", target=None).__getitems__([0, 1])


@pytest.mark.parametrize("kind", ["parquet", "json", "csv", "save_to_disk"])
def test_hf_reads_each_local_format_as_the_dataset_holds_it(tmp_path, kind):
    import datasets
    table = datasets.Dataset.from_dict(_formats.rows(40))
    if kind == "csv":
        table = datasets.Dataset.from_dict({"f0": [r[0] for r in table["features"]], "f1": [r[1] for r in
                                                                                             table["features"]],
                                            "label": table["label"]})
    where = {"from_disk": str(tmp_path / "disk")} if kind == "save_to_disk" else {
        "data_files": str(tmp_path / f"rows.{'jsonl' if kind == 'json' else kind}"), "cache_dir": str(tmp_path / "c")}
    if kind == "save_to_disk":
        table.save_to_disk(where["from_disk"])
    else:
        getattr(table, f"to_{kind}")(where["data_files"])
    columns = ["f0", "f1"] if kind == "csv" else "features"
    items = sources.hf(**where, input=columns, target="label")
    assert len(items) == 40
    for i in (0, 39):
        want = [table[i][c] for c in columns] if kind == "csv" else table[i]["features"]
        assert items[i][0].tolist() == pytest.approx(want) and int(items[i][1]) == table[i]["label"]


def test_hf_held_out_splits_come_from_their_files_and_train_through_the_loader(tmp_path):
    """With a test split the training rows go through the map-style loader (DataLoader workers, resumed at its
    step), in the order the stream gave them before (a fresh permutation per epoch from (seed, epoch))."""
    train = _formats.parquet_file(tmp_path, n=64, name="train.parquet", seed=0)
    test = _formats.parquet_file(tmp_path, n=16, name="test.parquet", seed=1)
    files = {"train": str(train), "test": str(test)}
    data = sources.hf(data_files=files, input="features", target="label", test_split="test", batch_size=8,
                      eval_examples=10, cache_dir=str(tmp_path / "c"), num_workers=2)
    want = _formats.rows(16, seed=1)
    rows = np.unique(np.linspace(0, 15, 10).astype(int))
    assert data.test[1].tolist() == [want["label"][i] for i in rows] and data.val is None
    assert repr(data) == "hf: 64 train examples, 10 test, batch 8 (HFItems, map-style, 2 workers)"
    streamed = iter(sources.ItemStream(data.train.dataset, batch_size=8, seed=0, order="shuffle"))
    for k in range(10):   # past an epoch of 8 batches
        x, y = data.train[k]
        sx, sy = next(streamed)
        assert x.shape == (8, _formats.FEATURES) and torch.equal(x, sx) and torch.equal(y, sy), k
    with pytest.raises(ValueError, match=r"^hf: split 'validation' is not in the data; its splits are train, test$"):
        sources.hf(data_files={"train": str(train), "test": str(test)}, input="features", test_split="test",
                   val_split="validation", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="hf: give from_disk .* or data_files .*, not neither"):
        sources.hf(input="features")
    (tmp_path / "rows.dat").write_text("1,2")
    with pytest.raises(ValueError, match=r"cannot tell the format of .*rows.dat from its suffix; set builder"):
        sources.hf(data_files=str(tmp_path / "rows.dat"), input="features")
    for missing in (str(tmp_path / "nope.parquet"), {"train": str(train), "test": str(tmp_path / "no-*.parquet")}):
        with pytest.raises(sources.MissingData, match=r"^hf: .*nope.parquet|^hf: .*no-\*.parquet") as e:
            sources.hf(data_files=missing, input="features", cache_dir=str(tmp_path / "c"))
        assert "\n" not in str(e.value) and isinstance(e.value, ValueError)   # one line, as the runner reports it


# --- data=webdataset --------------------------------------------------------------------------------------------

def all_samples(folder):
    """Every sample of the shards under ``folder``, by key, read with Python's tarfile (not fxtrain's reader)."""
    import io
    import tarfile
    out = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, _, field = m.name.partition(".")
                data = tar.extractfile(m).read()
                out.setdefault(key, {})[field] = np.load(io.BytesIO(data)) if field == "x.npy" else int(data)
    return out


def test_shards_are_split_between_ranks_and_every_sample_is_read_once_an_epoch(tmp_path):
    d = _formats.shards(tmp_path, count=4, per_shard=12)
    truth = all_samples(d)
    urls = sources.shard_urls(d)
    assert urls == sorted(str(p) for p in d.glob("*.tar"))
    epoch = {}
    for rank in range(2):
        stream = sources.ShardStream(urls, batch_size=8, seed=5).shard(rank, 2)
        assert len(set(stream.shards(0))) == 2
        x, y = cat(take(iter(stream), 6))                   # 24 samples: this rank's 2 shards, once each
        for xi, yi in zip(x, y):
            key = next(k for k, s in truth.items() if np.array_equal(s["x.npy"], xi.numpy()))
            assert truth[key]["cls"] == int(yi) and key not in epoch
            epoch[key] = rank
    assert set(epoch) == set(truth)                         # the two ranks' shards are disjoint and cover all
    with pytest.raises(ValueError, match="4 shards cannot feed 8 data-parallel ranks"):
        sources.ShardStream(urls, batch_size=8).shard(0, 8)


def test_a_shard_stream_resumes_at_its_shard_and_offset(tmp_path):
    urls = sources.shard_urls(_formats.shards(tmp_path, count=3, per_shard=5))
    stream = sources.ShardStream(urls, batch_size=4, seed=2)
    it = iter(stream)
    take(it, 6)                                            # 24 samples: epoch 1 (15 per epoch), its second shard
    state = it.state_dict()
    assert state == {"epoch": 1, "shard": 1, "offset": 4, "rank": 0, "world": 1}
    json.dumps(state)                                      # plain data for the checkpoint manifest
    rest = take(it, 4)
    resumed = iter(sources.ShardStream(urls, batch_size=4, seed=2))
    resumed.load_state_dict(state)
    for a, b in zip(rest, take(resumed, 4)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match=r"rank 0 of 1's shards, and this is rank 1 of 2; resume on 1 data-parallel"):
        iter(stream.shard(1, 2)).load_state_dict(state)


def test_a_shard_resume_skips_whole_shards_unopened(tmp_path, monkeypatch):
    urls = sources.shard_urls(_formats.shards(tmp_path, count=3, per_shard=5))
    opened = []
    samples = sources._samples
    monkeypatch.setattr(sources, "_samples", lambda url, skip=0: opened.append((url, skip)) or samples(url, skip))
    it = iter(sources.ShardStream(urls, batch_size=2, seed=0))
    it.load_state_dict({"epoch": 7, "shard": 2, "offset": 3, "rank": 0, "world": 1})
    next(it)
    order = np.random.default_rng([0, 7]).permutation(3)
    assert opened == [(urls[order[2]], 3)]


def test_shard_fields_and_missing_shards_are_one_line(tmp_path):
    urls = sources.shard_urls(_formats.shards(tmp_path, count=1))
    with pytest.raises(ValueError, match=r"sample 000000 has no field 'image.jpg' \(its fields: cls, x.npy\); set "):
        next(iter(sources.ShardStream(urls, batch_size=2, input="image.jpg")))
    with pytest.raises(FileNotFoundError, match=r"shard .*/nope-1.tar does not exist \(2 of 2 missing\)"):
        sources.shard_urls(str(tmp_path / "nope-{1..2}.tar"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .tar shards in"):
        sources.shard_urls(tmp_path / "empty")
    assert sources.shard_urls("gs://b/x-{0..1}.tar") == ["gs://b/x-0.tar", "gs://b/x-1.tar"]   # not opened here


def test_shards_stream_from_urls_as_from_files(tmp_path):
    """Object storage in real life: a URL opened by webdataset (here a pipe: command, as `pipe:aws s3 cp ... -`)."""
    d = _formats.shards(tmp_path, count=2, per_shard=3)
    local = take(iter(sources.ShardStream(sources.shard_urls(d), batch_size=2, seed=1)), 4)
    piped = take(iter(sources.ShardStream(sources.shard_urls(f"pipe:cat {d}/shard-{{000..001}}.tar"), 2, 1)), 4)
    for a, b in zip(local, piped):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --- data=grain -------------------------------------------------------------------------------------------------

def grain_items(n=40):
    import grain
    return grain.MapDataset.source(np.arange(n)).map(lambda i: (np.float32(i), i % 3))


def test_grain_shares_are_the_global_batch_on_any_world_size():
    one = take(iter(sources.GrainStream(grain_items(), batch_size=8, seed=1)), 12)     # 2.4 epochs
    for world in (2, 4):
        shares = [take(iter(sources.GrainStream(grain_items(), 8, 1).shard(r, world)), 12) for r in range(world)]
        for k in range(12):
            assert torch.equal(cat([s[k] for s in shares])[0], one[k][0])
    epoch = torch.cat([x for x, _ in one[:5]])
    assert sorted(epoch.tolist()) == list(range(40))            # an epoch: every item once, shuffled by Grain
    assert epoch.tolist() != list(range(40))


def test_grain_resumes_from_its_iterators_state_on_any_world_size():
    it = iter(sources.GrainStream(grain_items(), batch_size=8, seed=1))
    take(it, 7)
    state = it.state_dict()
    json.dumps(state)
    rest = take(it, 3)
    for world in (1, 2):      # the state is the step, the same on every rank: a resume on another world size
        shares = []
        for r in range(world):
            resumed = iter(sources.GrainStream(grain_items(), 8, 1).shard(r, world))
            resumed.load_state_dict(state)
            shares.append(take(resumed, 3))
        for k in range(3):
            assert torch.equal(cat([s[k] for s in shares])[0], rest[k][0])


def test_grain_iter_datasets_and_random_access_sources(tmp_path):
    import grain
    stream = sources.GrainStream(grain_items(12).to_iter_dataset(), batch_size=4)
    it = iter(stream)
    assert next(it)[0].tolist() == [0, 1, 2, 3]                 # an IterDataset: its order, batched here
    state = it.state_dict()
    resumed = iter(sources.GrainStream(grain_items(12).to_iter_dataset(), batch_size=4))
    resumed.load_state_dict(state)
    assert next(resumed)[0].tolist() == next(it)[0].tolist() == [4, 5, 6, 7]
    half = iter(sources.GrainStream(grain_items(12).to_iter_dataset(), batch_size=4).shard(1, 2))
    assert next(half)[0].tolist() == [2, 3]                     # read whole, rank 1 keeps its share
    # not split by rank, but split correctly: Grain's order is deterministic, so the 2 ranks' shares of each step
    # are the one-process global batch (the runner's data line says every rank reads the whole batch)
    whole = take(iter(sources.GrainStream(grain_items(12).to_iter_dataset(), batch_size=4)), 3)   # the whole pass
    halves = [take(iter(sources.GrainStream(grain_items(12).to_iter_dataset(), 4).shard(r, 2)), 3) for r in (0, 1)]
    for k in range(3):
        assert torch.equal(cat([h[k] for h in halves])[0], whole[k][0]), k
    d = _formats.token_files(tmp_path)
    windows = sources.TokenWindows(d / "train.bin", context=8)
    x, y = next(iter(sources.GrainStream(windows, batch_size=4)))   # any len() + [i] source
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    # a grain.DataLoader that batches: its iterator's state (JSON bytes) resumes it; every rank reads it whole
    loader = lambda: grain.DataLoader(  # noqa: E731
        data_source=windows, operations=[grain.transforms.Batch(4, drop_remainder=True)], worker_count=0,
        sampler=grain.samplers.IndexSampler(num_records=len(windows), shuffle=True, seed=0, num_epochs=None,
                                            shard_options=grain.sharding.NoSharding()))
    it = iter(sources.GrainStream(loader(), batch_size=4))
    next(it)
    state = it.state_dict()
    resumed = iter(sources.GrainStream(loader(), batch_size=4))
    resumed.load_state_dict(state)
    after = next(it)
    assert isinstance(state["grain"], bytes) and torch.equal(next(resumed)[0], after[0])
    share = iter(sources.GrainStream(loader(), batch_size=4).shard(1, 2))
    share.load_state_dict(state)
    assert torch.equal(next(share)[0], after[0][2:])
    with pytest.raises(TypeError, match="the pipeline is a int; give a grain.MapDataset, IterDataset, DataLoader"):
        sources.GrainStream(3, batch_size=4)
    assert isinstance(stream.pipeline, grain.IterDataset)


# --- the data line: true for every option of conf/data and every kind of source it builds ---------------------

OPTIONS = sorted(p.stem for p in (runner.CONF_DIR / "data").glob("*.yaml") if not p.stem.startswith("_"))


def _truths(train) -> list[str]:
    """What the data line must say of ``train`` (a training source as the runner holds it), read off the object."""
    if isinstance(train, fxdata.ExampleBatches):
        return ["map-style", f"{train.loader.workers()} workers" if train.loader.workers() else "training process"]
    if not isinstance(train, fxdata.StreamBatches):
        return ["train", f"batch {train.batch_size}"]   # tensors, windows: rows addressed by step, in memory
    src = train.source
    if isinstance(src, sources.ItemStream):
        told = [f"order {src.order}", "in the training process"]
    elif isinstance(src, sources.ShardStream):
        told = ["WebDataset shards", "order drawn per epoch"]
    elif isinstance(src, sources.GrainStream):
        told = ["not split by rank (no random access"] if src.whole() else ["shuffled by Grain", "read threads"]
    else:
        raise AssertionError(f"{type(src).__name__}: a stream kind this test does not know; say what its line states")
    split = f"each of {src.world} data-parallel ranks" if src.world > 1 else ""
    return [*told, split, "resumed"]


@pytest.mark.parametrize("option", OPTIONS)
def test_the_data_line_is_true_for_every_data_option_and_source_kind(option, tmp_path):
    """Generated over conf/data's options (and each kind of source an option builds, tests/_formats.variants): the
    data line a run prints, in one process and on rank 1 of 2, states the global batch of the config, the source's
    order, how the ranks split it and how it is read and resumed, as the built object has them; never "order as
    given" for a source whose order fxtrain draws (data=tokens' random windows said "ItemStream (iterable, order
    as given)", and a rank's share as the batch)."""
    base = _formats.FORMATS[option](tmp_path) if option in _formats.FORMATS else [f"data={option}"]
    for kind, extra in _formats.variants(option, tmp_path).items():
        cfg = cfg_of(*base, *extra)
        data = build.dataset(cfg.data, option)
        for world in (1, 2):
            shown, _ = fxdata.for_rank(data, 1, world) if world > 1 else (data, False)
            line = repr(shown)
            assert "order as given" not in line and f"batch {cfg.data.batch_size}" in line, (kind, line)
            for truth in _truths(shown.train):
                assert truth in line, (kind, world, truth, line)


# --- each format through the runner: trains, and a resume ends like the uninterrupted run ---------------------

RUN = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=2", "trainer.checkpoint_every=2",
       "trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=1", "schedule.warmup_steps=1"]


def records(run):
    """metrics.jsonl without the wall clock and the test split's metrics (evaluated on the run's own best
    checkpoint: a resume=PATH run in a new directory chooses among its own steps)."""
    return [{k: v for k, v in r.items() if k != "time_s" and not k.startswith("test_")}
            for r in read_jsonl(run / "metrics.jsonl")]


@pytest.mark.parametrize("option", sorted(_formats.FORMATS))
def test_each_format_trains_with_the_runner_and_resumes_like_the_uninterrupted_run(option, tmp_path):
    overrides = [*_formats.FORMATS[option](tmp_path / "fixture"), *RUN]
    value = runner.train(cfg_of(*overrides), tmp_path / "whole")
    whole = records(tmp_path / "whole")
    assert [r["step"] for r in whole if "loss" in r] == [1, 2, 3, 4] and np.isfinite(value)
    ckpt = tmp_path / "whole" / "checkpoints" / "step_0000002"
    runner.train(cfg_of(*overrides, f"resume={ckpt}"), tmp_path / "resumed")
    assert records(tmp_path / "resumed") == [r for r in whole if r["step"] > 2]   # the same batches, bit for bit


@pytest.mark.multiprocess
@pytest.mark.parametrize("option", ["tokens", pytest.param("grain", marks=pytest.mark.slow)])  # the same stream kind
def test_two_data_parallel_ranks_train_a_stream_as_one_process_does(option, tmp_path):
    """The global batch of a step is the same on 2 ranks as in one process (each rank reads its share where the
    runner asks the stream to shard, the whole batch and its slice where it does not): the same losses, to float32
    summation order (1e-5 relative)."""
    overrides = [*_formats.FORMATS[option](tmp_path / "fixture"), *RUN]
    runner.train(cfg_of(*overrides), tmp_path / "one")
    _, run = torchrun_train(tmp_path / "two", *overrides, "parallel=dp")
    one, two = records(tmp_path / "one"), records(run)
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(one, two):
        assert b == pytest.approx(a, rel=1e-5), a["step"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("option", ["tokens", "grain"])
def test_a_stream_checkpointed_on_two_ranks_resumes_in_one_process_on_the_same_batches(option, tmp_path):
    """Elastic: the state of these streams is the step (the same on every rank), so resume_relayout from 2
    data-parallel ranks to one process continues the global batches of the one-process run."""
    overrides = [*_formats.FORMATS[option](tmp_path / "fixture"), *RUN]
    runner.train(cfg_of(*overrides), tmp_path / "one")
    _, two = torchrun_train(tmp_path / "two", *overrides, "parallel=dp")
    ckpt = two / "checkpoints" / "step_0000002"
    runner.train(cfg_of(*overrides, f"resume={ckpt}", "resume_relayout=true"), tmp_path / "back")
    back, one = records(tmp_path / "back"), [r for r in records(tmp_path / "one") if r["step"] > 2]
    assert [r["step"] for r in back] == [r["step"] for r in one]
    for a, b in zip(one, back):
        assert b == pytest.approx(a, rel=1e-5), a["step"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_stream_their_own_shards_and_resume_each_from_its_position(tmp_path):
    """WebDataset on 2 data-parallel ranks: each rank's position (its shard and offset) is checkpointed and
    restored on its rank, so the resumed run logs the uninterrupted 2-rank run's records."""
    overrides = [*_formats.FORMATS["webdataset"](tmp_path / "fixture"), *RUN, "parallel=dp"]
    _, whole = torchrun_train(tmp_path / "whole", *overrides)
    ckpt = whole / "checkpoints" / "step_0000002"
    _, resumed = torchrun_train(tmp_path / "resumed", *overrides, f"resume={ckpt}")
    assert records(resumed) == [r for r in records(whole) if r["step"] > 2]


@pytest.mark.parametrize("option", sorted(_formats.EXTRAS))
def test_a_missing_extra_is_one_line_naming_it(option, monkeypatch, tmp_path, capsys):
    module, package, extra = _formats.EXTRAS[option]
    overrides = _formats.FORMATS[option](tmp_path / "fixture")
    monkeypatch.setitem(sys.modules, module, None)              # what `import module` meets when it is not installed
    message = f"data={option} needs {package}: pip install 'fxtrain[{extra}]'"
    assert run_main(*overrides, *RUN, "hydra.run.dir=run") == f"Error: {message}"   # on the command line
    assert "Traceback" not in capsys.readouterr().err
    with pytest.raises(ConfigError) as e:                       # chosen inside a config file: where it is built
        runner.train(cfg_of(*overrides, *RUN), tmp_path / "built")
    assert str(e.value).endswith(message) and not (tmp_path / "built" / "metrics.jsonl").exists()
