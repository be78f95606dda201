"""Offline datasets and seeded batch iterators: reproducible, addressable by step, no downloads."""

import itertools

import pytest
import torch

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from fxtrain.data import Dataset, ShuffledBatches, WindowBatches, digits, from_source, stdlib_text, synthetic


def test_each_epoch_is_a_permutation_and_steps_are_addressable():
    b = ShuffledBatches(torch.arange(10), torch.arange(10) * 2, batch_size=3, seed=1)
    assert len(b) == 3                                      # the partial batch is dropped
    epoch0 = torch.cat([b[k][0] for k in range(3)])
    epoch1 = torch.cat([b[k][0] for k in range(3, 6)])
    assert len(set(epoch0.tolist())) == 9 and len(set(epoch1.tolist())) == 9
    assert not torch.equal(epoch0, epoch1)                  # reshuffled
    assert torch.equal(b[4][1], b[4][0] * 2)                # rows stay paired
    # Iterating is indexing 0, 1, 2...; a fresh object (a resumed run) sees the same batches.
    again = ShuffledBatches(torch.arange(10), torch.arange(10) * 2, batch_size=3, seed=1)
    for k, (x, _) in enumerate(itertools.islice(iter(b), 7)):
        assert torch.equal(x, again[k][0])
    other = ShuffledBatches(torch.arange(10), torch.arange(10), batch_size=3, seed=2)
    assert not torch.equal(torch.cat([other[k][0] for k in range(3)]), epoch0)


def test_batch_size_is_checked():
    with pytest.raises(ValueError, match="batch_size=11"):
        ShuffledBatches(torch.arange(10), torch.arange(10), batch_size=11, seed=0)


def test_windows_are_next_token_pairs_and_seeded():
    tokens = torch.arange(1000) % 251
    b = WindowBatches(tokens, batch_size=4, context=16, seed=3)
    x, y = b[5]
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(b[5][0], WindowBatches(tokens, 4, 16, seed=3)[5][0])
    assert not torch.equal(b[5][0], b[6][0])


def test_digits_reads_scikit_learns_file_as_load_digits_does_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from fxtrain.data import _digits_arrays
    pixels, labels = _digits_arrays()
    want_pixels, want_labels = load_digits(return_X_y=True)
    assert np.array_equal(pixels, want_pixels) and np.array_equal(labels, want_labels)
    assert pixels.dtype == want_pixels.dtype and labels.dtype == want_labels.dtype
    code = "import sys; from fxtrain.data import digits; digits(); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_digits():
    data = digits(batch_size=32, test_fraction=0.25, seed=0)
    x, y = data.train[0]
    assert x.shape == (32, 1, 8, 8) and y.dtype == torch.long
    assert len(data.train.x) + len(data.val[0]) + len(data.test[0]) == 1797 and len(data.test[0]) == 449
    assert len(data.val[0]) == 270  # val_fraction=0.15 of the rows, taken from the training ones
    assert torch.equal(digits(val_fraction=0.0).test[0], data.test[0])  # a validation split keeps the test set
    assert 0 <= float(data.train.x.min()) and float(data.train.x.max()) <= 1
    assert set(data.test[1].tolist()) == set(range(10))
    # The split has its own seed: another run seed keeps the same test set, and reorders the batches.
    other = digits(batch_size=32, seed=5)
    assert torch.equal(other.test[0], data.test[0])
    assert not torch.equal(other.train[0][0], x)
    assert repr(data) == "digits: 1,078 train examples, 449 test, batch 32, 270 validation"


def test_dataset_facts_are_checked():
    with pytest.raises(ValueError, match=r"digits: num_classes=5 does not match the data \(num_classes is 10\)"):
        digits(num_classes=5)
    with pytest.raises(ValueError, match="vocab_size"):
        stdlib_text(vocab_size=100, max_bytes=10_000)


def test_stdlib_text_is_bytes_of_python_sources():
    data = stdlib_text(batch_size=2, context=32, max_bytes=50_000, eval_windows=8, seed=0)
    x, y = data.train[0]
    assert x.shape == (2, 32) and int(x.max()) < 256
    tx, ty = data.test
    assert tx.shape == (8, 32) and torch.equal(tx[:, 1:], ty[:, :-1])
    assert repr(data) == "stdlib_text: 42,500 train tokens, 8 test windows of 32, batch 2, 8 validation"
    text = bytes(data.train.tokens[:2000].tolist()).decode("utf-8", "replace")
    assert "def " in text or "import " in text
    assert torch.equal(stdlib_text(batch_size=2, context=32, max_bytes=50_000, seed=0).train[3][0], data.train[3][0])


def test_synthetic_is_learnable_and_seeded():
    data = synthetic(batch_size=8, num_examples=100, input_shape=(4,), num_classes=3, noise=0.1)
    x, y = data.test
    # Nearest class mean separates low-noise clusters.
    means = torch.stack([data.train.x[data.train.y == c].mean(0) for c in range(3)])
    pred = torch.cdist(x, means).argmin(1)
    assert (pred == y).float().mean() > 0.95
    again = synthetic(batch_size=8, num_examples=100, input_shape=(4,), num_classes=3, noise=0.1)
    assert torch.equal(again.test[0], x) and torch.equal(again.train[3][0], data.train[3][0])
    assert data.to("cpu").train[2][0].shape == (8, 4)


# --- from_source: whatever a data _target_ returns --------------------------------------------------------

def rows_seen(data, steps):
    """The row ids (column 0 of the inputs) of training steps 0..steps-1."""
    return torch.cat([data.train[k][0][:, 0] for k in range(steps)]).long().tolist()


def test_tensors_are_split_by_split_seed_and_shuffled_by_seed():
    x = np.arange(100, dtype=np.float64)[:, None].repeat(3, 1)      # row i holds i: the row's id
    y = np.arange(100) % 4
    data = from_source((x, y), name="mine", batch_size=10, test_fraction=0.2, split_seed=1, seed=2)
    assert repr(data) == "mine: 80 train examples, 20 test, batch 10"
    assert data.train[0][0].dtype == torch.float32 and data.train[0][1].dtype == torch.int64   # numpy float64: float32
    test = data.test[0][:, 0].long().tolist()
    epoch = rows_seen(data, 8)
    assert sorted(epoch + test) == list(range(100))                  # disjoint, and together every row
    assert torch.equal(data.train[3][1], data.train[3][0][:, 0].long() % 4)   # rows stay paired
    assert rows_seen(data, 16)[80:] != epoch                         # reshuffled each epoch
    same_split = from_source((x, y), name="mine", batch_size=10, split_seed=1, seed=3)
    assert same_split.test[0][:, 0].long().tolist() == test and rows_seen(same_split, 8) != epoch
    assert from_source((x, y), name="mine", batch_size=10, split_seed=2, seed=2).test[0][:, 0].long().tolist() != test
    # Random access is the resumed run's: a fresh build asked for step 13 gives the batch of step 13.
    again = from_source((x, y), name="mine", batch_size=10, split_seed=1, seed=2)
    assert torch.equal(again.train[13][0], data.train[13][0])
    moved = data.to("cpu")
    assert repr(moved) == repr(data) and torch.equal(moved.train[5][0], data.train[5][0])


class Squares(torch.utils.data.Dataset):
    """A map-style dataset: item i is (a numpy row holding i, i's class), read one at a time."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return np.full(2, float(i)), i % 3


def test_map_style_dataset_is_split_and_collated_per_step():
    data = from_source(Squares(), name="sq", batch_size=8, test_fraction=0.2, split_seed=0, seed=1, num_workers=2)
    assert repr(data) == "sq: 40 train examples, 10 test, batch 8 (Squares, map-style, 2 workers)"
    x, y = data.train[0]
    assert x.shape == (8, 2) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(y, x[:, 0].long() % 3)
    test = data.test[0][:, 0].long().tolist()
    assert len(test) == 10 and sorted(rows_seen(data, 5) + test) == list(range(50))
    assert from_source(Squares(), name="sq", batch_size=8, split_seed=0, seed=9).test[0][:, 0].long().tolist() == test
    fresh = from_source(Squares(), name="sq", batch_size=8, split_seed=0, seed=1, num_workers=0)
    assert all(torch.equal(fresh.train[k][0], data.train[k][0]) for k in (12, 3, 7))   # any order: by step
    # A TensorDataset is one too; the split and the order match the tensors form's.
    xs, ys = torch.randn(30, 4), torch.randint(5, (30,))
    tensors = from_source((xs, ys), name="t", batch_size=6)
    mapped = from_source(TensorDataset(xs, ys), name="t", batch_size=6).to("cpu")
    assert torch.equal(mapped.test[0], tensors.test[0]) and torch.equal(mapped.train[9][0], tensors.train[9][0])


class MyBatches:
    """The issue's custom batch source: a class with __iter__ yielding (x, y) batches, regression targets."""

    def __init__(self, n=6, batch=4):
        self.n, self.batch, self.passes, self.pulled = n, batch, 0, 0

    def __iter__(self):
        self.passes += 1
        for i in range(self.n):
            self.pulled += 1
            x = torch.full((self.batch, 3), float(i))
            yield x, x.sum(1, keepdim=True)                 # float targets with a trailing dim


def test_iterable_holds_out_its_first_batches_and_cycles():
    source = MyBatches()
    data = from_source(source, name="mine", batch_size=4, test_batches=2)
    assert repr(data) == "mine: batches from MyBatches (iterable, order as given), 2 test batches (8 examples), batch 4"
    assert data.test[0][:, 0].tolist() == [0] * 4 + [1] * 4 and data.test[1].shape == (8, 1)
    ids = [int(data.train[k][0][0, 0]) for k in range(10)]
    assert ids == [2, 3, 4, 5, 2, 3, 4, 5, 2, 3]                  # in order; each new pass skips the test batches
    assert (source.passes, source.pulled) == (3, 2 * 6 + 4)       # sequential: one batch pulled per step
    # A resumed run (a fresh source) asked for step 7 skips to it; going back starts a new pass.
    fresh = from_source(MyBatches(), name="mine", batch_size=4, test_batches=2)
    assert torch.equal(fresh.train[7][0], data.train[7][0]) and torch.equal(fresh.train[1][0], data.train[1][0])
    assert torch.equal(list(itertools.islice(iter(fresh.to("cpu").train), 6))[5][0], data.train[5][0])


def test_iterable_default_test_batches_and_loaders():
    batches = [(torch.randn(5, 2), torch.randint(3, (5,))) for _ in range(10)]
    assert len(from_source(batches, name="b", batch_size=5, test_fraction=0.3).test[0]) == 15   # 3 of 10 batches

    class Stream(IterableDataset):                              # no len(): one test batch
        def __iter__(self):
            return iter(batches)

    data = from_source(Stream(), name="s")
    assert torch.equal(data.test[0], batches[0][0]) and torch.equal(data.train[9][0], batches[1][0])
    assert repr(data).endswith("1 test batch (5 examples), batch 5")
    loader = DataLoader(TensorDataset(torch.arange(20.)[:, None], torch.arange(20)), batch_size=4)
    data = from_source(loader, name="l", batch_size=4, test_batches=1)
    assert data.test[0][:, 0].tolist() == [0, 1, 2, 3] and data.train[4][1].tolist() == [4, 5, 6, 7]


def test_one_shot_iterator_goes_forward_only():
    def gen(n):
        for i in range(n):
            yield np.full((2, 1), float(i)), np.array([i, i])

    data = from_source(gen(5), name="g", batch_size=2)
    assert repr(data) == ("g: batches from generator (one-shot iterator, order as given), 1 test batch (2 examples), "
                          "batch 2")
    assert [int(data.train[k][1][0]) for k in range(3)] == [1, 2, 3]
    assert int(from_source(gen(5), name="g", batch_size=2).train[2][1][0]) == 3   # a resume re-runs the generator
    with pytest.raises(ValueError, match=r"g: step 0 comes before .* one-shot iterator cannot go back; return a "
                                         r"re-iterable \(a list, a Dataset or a class with __iter__\)"):
        data.train[0]
    data.train[3]
    with pytest.raises(ValueError, match="ended after 4 training batches .* return a re-iterable"):
        data.train[4]


class ByStep:
    """A train object of the user's own: ``batches[k]`` is step k's batch."""

    def __getitem__(self, k):
        return torch.full((2, 3), float(k)), torch.full((2,), k)


def test_a_dataset_is_returned_as_is_and_described_generically():
    test = (torch.zeros(3, 3), torch.zeros(3, dtype=torch.long))
    data = Dataset("mine", ByStep(), test)                          # a train object fxtrain does not know
    assert from_source(data, name="ignored", batch_size=2, input_shape=[3], num_classes=1) is data
    assert repr(data) == "mine: batches from ByStep, 3 test examples"
    moved = data.to("cpu")                                          # moved batch by batch
    assert torch.equal(moved.train[4][0], data.train[4][0]) and repr(moved) == repr(data)
    # The case: a Dataset whose train only iterates is read in order (its test is its own).
    mine = from_source(Dataset("mine", MyBatches(), test), name="mine", batch_size=4).to("cpu")
    assert [int(mine.train[k][0][0, 0]) for k in (0, 1, 6)] == [0, 1, 0] and mine.test is not None
    assert repr(mine) == "mine: batches from MyBatches (iterable, order as given), 3 test, batch 4"
    with pytest.raises(ValueError, match=r"mine: batch_size=4 does not match the data \(its training batches hold 2\)"):
        from_source(data, name="mine", batch_size=4)
    with pytest.raises(ValueError, match=r"mine: num_classes=2 is too few"):
        from_source(Dataset("mine", ByStep(), (torch.zeros(3, 3), torch.tensor([0, 1, 2]))), name="mine",
                    num_classes=2)


def test_facts_and_bad_input_are_named():
    x, y = torch.randn(40, 3), torch.arange(40) % 4
    with pytest.raises(ValueError, match=r"mine: input_shape=\[1, 8, 8\] does not match the data "
                                         r"\(input_shape is \[3\]\)"):
        from_source((x, y), name="mine", batch_size=4, input_shape=[1, 8, 8])
    from_source((x, y), name="mine", batch_size=4, input_shape=[3], num_classes=10)   # at most: classes may be missing
    rare = y.clone()
    rare[torch.nonzero(rare == 3)[1:]] = 0                          # class 3 in one row only: all the data is checked
    with pytest.raises(ValueError, match="mine: num_classes=3 is too few: the targets go up to 3, so num_classes is "
                                         "at least 4"):
        from_source((x, rare), name="mine", batch_size=4, num_classes=3)
    with pytest.raises(ValueError, match="targets go down to -1"):
        from_source((x, y - 1), name="mine", batch_size=4, num_classes=4)
    from_source((x, x[:, :2]), name="reg", batch_size=4, num_classes=1)   # float targets: regression, unchecked
    with pytest.raises(ValueError, match=r"s: num_classes=2 is too few"):
        from_source([(x[:4], y[:4])] * 3, name="s", batch_size=4, num_classes=2)
    with pytest.raises(ValueError, match=r"mine: batch_size=64 must be between 1 and the 32 training examples \(40 "
                                         r"examples, 8 held out by test_fraction=0.2\)"):
        from_source((x, y), name="mine", batch_size=64)
    with pytest.raises(ValueError, match=r"x has 40 rows and y 39"):
        from_source((x, y[:-1]), name="mine", batch_size=4)
    with pytest.raises(TypeError, match=r"mine: the data is a int; fxtrain reads tensors \(x, y\), a map-style"):
        from_source(3, name="mine", batch_size=4)
    with pytest.raises(TypeError, match=r"mine: the data is a dict"):
        from_source({"x": x, "y": y}, name="mine", batch_size=4)
    with pytest.raises(TypeError, match=r"mine: test batch 0 from list \(iterable, order as given\) is a tuple of 3; "
                                        r"fxtrain reads \(inputs, targets\) pairs"):
        from_source([(x, y, y)] * 3, name="mine", batch_size=4)
    with pytest.raises(ValueError, match=r"training batch 1 from list .* has 2 examples, not batch_size=4.*"
                                         r"drop_last=True"):
        from_source([(x[:4], y[:4])] * 2 + [(x[:2], y[:2])], name="mine", batch_size=4).train[1]
    with pytest.raises(ValueError, match=r"list \(iterable, order as given\) yielded 2 batches, fewer than the "
                                         r"test_batches=3 held out for testing, and none for training"):
        from_source([(x, y)] * 2, name="mine", batch_size=40, test_batches=3)
    with pytest.raises(ValueError, match=r"a pass of list .* yields no training batches after the "
                                         r"test_batches=2 held out"):
        from_source([(x, y)] * 2, name="mine", batch_size=40, test_batches=2)


def rows_any(**kwargs):
    """A data target that takes any keyword (and so is handed the runner's keys too)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(kwargs.get("n", 40), 3, generator=g), torch.randn(kwargs.get("n", 40), generator=g)


def test_build_dataset_hands_the_runner_its_keys_whatever_the_target_takes():
    from fxtrain import build

    for target in ("tests.test_data.rows_any", "sklearn.datasets.make_regression"):
        extra = {"n": 40} if target.endswith("rows_any") else {"n_samples": 40, "n_features": 3}
        data = build.dataset({"_target_": target, **extra, "batch_size": 8, "test_fraction": 0.25,
                              "input_shape": [3]}, "mine")
        assert repr(data) == "mine: 30 train examples, 10 test, batch 8"
    with pytest.raises(build.ConfigError, match=r"input_shape"):
        build.dataset({"_target_": "tests.test_data.rows_any", "batch_size": 8, "input_shape": [4]}, "mine")


def test_a_loaders_workers_stop_as_soon_as_its_batches_are_dropped():
    """Dropping the batches of a map-style source ends their DataLoader at once (refcount), its workers stopped
    by its shutdown: through a reference cycle (its sampler held the batches) only the garbage collector freed
    it, after closing the queues the stop goes through, and each worker sat out DataLoader's 5 s join."""
    import gc
    import weakref

    data = from_source(TensorDataset(torch.randn(40, 3), torch.arange(40)), name="mine", batch_size=8, num_workers=2)
    batches = data.train
    batches[3]
    workers = list(batches._it._workers)  # the DataLoader iterator's worker processes
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    gone = weakref.ref(batches)
    gc.disable()
    try:
        del data, batches
        assert gone() is None, "the batches outlived their last reference (a cycle left for the garbage collector)"
        assert not any(w.is_alive() for w in workers)
    finally:
        gc.enable()
