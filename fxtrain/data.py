"""Offline datasets and seeded, reproducible batch iterators.

Nothing here downloads. The default classification experiment uses scikit-learn's 8x8 handwritten
digits (1,797 images shipped inside scikit-learn: ``pip install fxtrain[data]``); the language model
reads Python's own standard-library sources as a byte-level corpus; tests use synthetic data.

Batches are addressed by step: ``data.train[k]`` is the k-th batch of the run, a pure function of the
seed and ``k`` (epoch ``k // steps_per_epoch`` is a fresh permutation drawn from ``(seed, epoch)``). A
resumed run asks for step k and gets exactly the batch the uninterrupted run saw; iterating is the
same as indexing 0, 1, 2, ...

Every builder takes the shapes its model reads (``input_shape``, ``num_classes``, ``vocab_size``,
``context``) so that model configs can interpolate them (``${data.num_classes}``); for a real dataset
they are facts, checked against the data.

Example:
    >>> from fxtrain.data import synthetic
    >>> data = synthetic(batch_size=4, num_examples=32, seed=0)
    >>> x, y = data.train[0]
    >>> x.shape, y.shape, data.test[0].shape
    (torch.Size([4, 1, 8, 8]), torch.Size([4]), torch.Size([8, 1, 8, 8]))
    >>> bool((data.train[5][0] == synthetic(batch_size=4, num_examples=32, seed=0).train[5][0]).all())
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import sysconfig
from typing import Iterator, Sequence

import numpy as np
import torch

__all__ = ["Dataset", "ShuffledBatches", "WindowBatches", "digits", "stdlib_text", "synthetic"]

Batch = tuple[torch.Tensor, torch.Tensor]


class _Batches:
    """Batches addressed by step: ``batches[k]`` is the k-th; iterating yields batches 0, 1, 2... without end."""

    def __getitem__(self, step: int) -> Batch:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Batch]:
        return map(self.__getitem__, itertools.count())


class ShuffledBatches(_Batches):
    """Batches of ``(x, y)`` rows in a fresh seeded permutation each epoch (the last partial batch dropped).

    ``batches[k]`` is the k-th batch (random access, for resuming); iterating yields batches 0, 1, 2...
    without end.

    >>> import torch
    >>> b = ShuffledBatches(torch.arange(6), torch.arange(6), batch_size=2, seed=0)
    >>> len(b), sorted(torch.cat([b[k][0] for k in range(3)]).tolist())   # one epoch sees every row once
    (3, [0, 1, 2, 3, 4, 5])
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
        if not 0 < batch_size <= len(x):
            raise ValueError(f"batch_size={batch_size} must be between 1 and the {len(x)} training examples")
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self._perm: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.x) // self.batch_size

    def __getitem__(self, step: int) -> Batch:
        epoch, i = divmod(step, len(self))
        if self._perm is None or self._perm[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.x))
            self._perm = (epoch, torch.as_tensor(perm, device=self.x.device))
        idx = self._perm[1][i * self.batch_size:(i + 1) * self.batch_size]
        return self.x[idx], self.y[idx]

    def to(self, device: torch.device | str) -> "ShuffledBatches":
        return ShuffledBatches(self.x.to(device), self.y.to(device), self.batch_size, self.seed)


class WindowBatches(_Batches):
    """Language-model batches: ``batch_size`` windows of ``context + 1`` tokens at seeded random offsets.

    ``batches[k]`` gives ``(x, y)`` with ``y`` the next token of every position of ``x``.

    >>> import torch
    >>> x, y = WindowBatches(torch.arange(100), batch_size=2, context=4, seed=0)[7]
    >>> x.shape, bool((y == x + 1).all())
    (torch.Size([2, 4]), True)
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, context: int, seed: int):
        if len(tokens) <= context:
            raise ValueError(f"context={context} needs more than {len(tokens)} tokens of training text")
        self.tokens, self.batch_size, self.context, self.seed = tokens, batch_size, context, seed
        self._window = torch.arange(context + 1, device=tokens.device)

    def __getitem__(self, step: int) -> Batch:
        starts = np.random.default_rng([self.seed, step]).integers(0, len(self.tokens) - self.context, self.batch_size)
        rows = self.tokens[torch.as_tensor(starts, device=self.tokens.device)[:, None] + self._window]
        return rows[:, :-1], rows[:, 1:]

    def to(self, device: torch.device | str) -> "WindowBatches":
        return WindowBatches(self.tokens.to(device), self.batch_size, self.context, self.seed)


@dataclasses.dataclass
class Dataset:
    """What an experiment trains and evaluates on.

    Attributes:
      name: for logs.
      train: ``train[k]`` is the k-th training batch ``(inputs, targets)``.
      test: the whole held-out split ``(inputs, targets)``, evaluated in chunks.
    """

    name: str
    train: ShuffledBatches | WindowBatches
    test: Batch

    def to(self, device: torch.device | str) -> "Dataset":
        return Dataset(self.name, self.train.to(device), (self.test[0].to(device), self.test[1].to(device)))

    def __repr__(self) -> str:
        if isinstance(self.train, ShuffledBatches):
            sizes = f"{len(self.train.x):,} train examples, {len(self.test[0]):,} test"
        else:
            sizes = (f"{len(self.train.tokens):,} train tokens, {len(self.test[0]):,} test windows of "
                     f"{self.train.context}")
        return f"{self.name}: {sizes}, batch {self.train.batch_size}"


def _split(n: int, test_fraction: float, split_seed: int, owner: str) -> tuple[np.ndarray, np.ndarray]:
    if not 0 < test_fraction < 1:
        raise ValueError(f"{owner}: test_fraction={test_fraction} must be between 0 and 1")
    # The split has its own seed: sweeping the run's seed changes init and batch order, not the test set.
    perm = np.random.default_rng(split_seed).permutation(n)
    n_test = int(round(n * test_fraction))
    return perm[n_test:], perm[:n_test]


def _check(owner: str, name: str, given, actual) -> None:
    if given is not None and list(np.atleast_1d(given)) != list(np.atleast_1d(actual)):
        raise ValueError(f"{owner}: {name}={given} does not match the data ({name} is {actual}); "
                         f"leave it at {actual}")


def digits(batch_size: int = 64, test_fraction: float = 0.25, split_seed: int = 0, seed: int = 0,
           input_shape: Sequence[int] = (1, 8, 8), num_classes: int = 10) -> Dataset:
    """scikit-learn's 8x8 handwritten digits: 1,797 images in [0, 1], shape ``(1, 8, 8)``, 10 classes.

    Args:
      batch_size: examples per training batch.
      test_fraction: share held out for evaluation, split with ``split_seed`` (not ``seed``).
      split_seed: seed of the train/test split.
      seed: seed of the batch order.
      input_shape, num_classes: facts of the dataset (checked), for model configs to interpolate.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("data=digits needs scikit-learn: pip install 'fxtrain[data]'") from None
    _check("digits", "input_shape", input_shape, [1, 8, 8])
    _check("digits", "num_classes", num_classes, 10)
    raw = load_digits()
    x = torch.tensor(raw.data, dtype=torch.float32).div_(16.0).view(-1, 1, 8, 8)
    y = torch.tensor(raw.target, dtype=torch.long)
    tr, te = _split(len(x), test_fraction, split_seed, "digits")
    return Dataset("digits", ShuffledBatches(x[tr], y[tr], batch_size, seed), (x[te], y[te]))


def synthetic(batch_size: int = 32, num_examples: int = 512, input_shape: Sequence[int] = (1, 8, 8),
              num_classes: int = 10, noise: float = 1.0, test_fraction: float = 0.25, split_seed: int = 0,
              seed: int = 0) -> Dataset:
    """Gaussian clusters: one random prototype per class plus ``noise``-scaled Gaussian noise. For tests.

    Args:
      batch_size: examples per training batch.
      num_examples: train + test examples.
      input_shape: shape of one input.
      num_classes: number of classes (and prototypes).
      noise: standard deviation of the noise around each prototype (1.0: overlapping but learnable).
      test_fraction, split_seed, seed: as in :func:`digits`.
    """
    g = torch.Generator().manual_seed(split_seed)
    protos = torch.randn((num_classes, *input_shape), generator=g)
    y = torch.randint(num_classes, (num_examples,), generator=g)
    x = protos[y] + noise * torch.randn((num_examples, *input_shape), generator=g)
    tr, te = _split(num_examples, test_fraction, split_seed, "synthetic")
    return Dataset("synthetic", ShuffledBatches(x[tr], y[tr], batch_size, seed), (x[te], y[te]))


def stdlib_text(batch_size: int = 32, context: int = 128, max_bytes: int = 2_000_000, test_fraction: float = 0.1,
                eval_windows: int = 64, seed: int = 0, vocab_size: int = 256) -> Dataset:
    """Byte-level text of Python's standard library (the top-level ``*.py`` files, sorted by name).

    The first ``max_bytes`` bytes of the files in name order (about 4.7 MB exist on CPython 3.11), the last
    ``test_fraction`` of them held out; the test split is ``eval_windows`` non-overlapping windows from
    the start of the held-out text. Tokens are bytes (``vocab_size=256``), so no tokenizer is needed.

    Args:
      batch_size: windows per training batch.
      context: tokens per window (the model predicts each next byte).
      max_bytes: corpus size.
      test_fraction: share of the corpus held out (its end).
      eval_windows: test windows (capped by the held-out text).
      seed: seed of the window offsets.
      vocab_size: 256, a fact of byte-level text (checked).
    """
    _check("stdlib_text", "vocab_size", vocab_size, 256)
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        if size >= max_bytes:
            break
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
    if not chunks:
        raise FileNotFoundError(f"stdlib_text: no *.py files under {root}")
    tokens = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()
    n_test = int(len(tokens) * test_fraction)
    train, held = tokens[:-n_test], tokens[-n_test:]
    n_windows = min(eval_windows, (len(held) - 1) // context)
    if n_windows < 1:
        raise ValueError(f"stdlib_text: the held-out text ({len(held)} bytes) is shorter than context={context}")
    rows = held[: n_windows * context + 1]
    x = rows[:-1].view(n_windows, context)
    y = rows[1:].view(n_windows, context)
    return Dataset("stdlib_text", WindowBatches(train, batch_size, context, seed), (x, y))
