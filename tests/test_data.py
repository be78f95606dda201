"""Offline datasets and seeded batch iterators: reproducible, addressable by step, no downloads."""

import itertools

import pytest
import torch

from fxtrain.data import ShuffledBatches, WindowBatches, digits, stdlib_text, synthetic


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


def test_digits():
    data = digits(batch_size=32, test_fraction=0.25, seed=0)
    x, y = data.train[0]
    assert x.shape == (32, 1, 8, 8) and y.dtype == torch.long
    assert len(data.train.x) + len(data.test[0]) == 1797 and len(data.test[0]) == 449
    assert 0 <= float(data.train.x.min()) and float(data.train.x.max()) <= 1
    assert set(data.test[1].tolist()) == set(range(10))
    # The split has its own seed: another run seed keeps the same test set, and reorders the batches.
    other = digits(batch_size=32, seed=5)
    assert torch.equal(other.test[0], data.test[0])
    assert not torch.equal(other.train[0][0], x)
    assert repr(data) == "digits: 1,348 train examples, 449 test, batch 32"


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
    assert repr(data) == "stdlib_text: 45,000 train tokens, 8 test windows of 32, batch 2"
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
