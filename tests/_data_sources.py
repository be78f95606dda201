"""Data targets for tests/test_data_scale.py's runs (``data._target_=tests._data_sources.<name>``): the synthetic
data config's examples as a map-style dataset whose reads are counted, and streams with and without state."""

from __future__ import annotations

import os
import pathlib

import torch

from fxtrain.data import Dataset, synthetic


class Gaussians(torch.utils.data.Dataset):
    """``data=synthetic``'s examples, one item at a time; with ``reads`` a directory, every item read appends its
    index to ``reads/rank<RANK>.txt`` (from the training process or a worker: appends of a line are atomic)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, reads: str | None = None):
        self.x, self.y, self.reads = x, y, reads
        self.log = None if reads is None else pathlib.Path(reads) / f"rank{os.environ.get('RANK', '0')}.txt"

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{i}\n")
        return self.x[i], self.y[i]


def gaussians(num_examples: int = 512, input_shape=(1, 8, 8), num_classes: int = 10, noise: float = 1.0,
              split_seed: int = 0, reads: str | None = None, **_) -> Gaussians:
    """The synthetic config's tensors (its generator), as a map-style dataset."""
    g = torch.Generator().manual_seed(split_seed)
    protos = torch.randn((num_classes, *input_shape), generator=g)
    y = torch.randint(num_classes, (num_examples,), generator=g)
    x = protos[y] + noise * torch.randn((num_examples, *input_shape), generator=g)
    if reads is not None:
        pathlib.Path(reads).mkdir(parents=True, exist_ok=True)
    return Gaussians(x, y, reads)


class Counter:
    """An endless stream of batches drawn from ``(seed, position)``, with torchdata's Stateful protocol on its
    iterator when ``stateful``; ``made`` counts batches made (a replay would make more)."""

    made = 0

    def __init__(self, batch_size: int, seed: int, stateful: bool):
        self.batch_size, self.seed, self.stateful = batch_size, seed, stateful

    def __iter__(self):
        return _CounterIt(self) if self.stateful else _Plain(self)


class _Plain:
    def __init__(self, source: Counter):
        self.source, self.at = source, 0

    def __iter__(self):
        return self

    def __next__(self):
        g = torch.Generator().manual_seed(self.source.seed * 1_000_003 + self.at)
        self.at += 1
        Counter.made += 1
        x = torch.randn((self.source.batch_size, 1, 8, 8), generator=g)
        return x, (x.flatten(1).sum(1) > 0).long()


class _CounterIt(_Plain):
    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]


def counter(batch_size: int = 8, seed: int = 0, stateful: bool = True, **_) -> Dataset:
    """A :class:`Counter` stream as a returned Dataset with its own test split."""
    g = torch.Generator().manual_seed(12345)
    x = torch.randn((32, 1, 8, 8), generator=g)
    return Dataset("counter", Counter(batch_size, seed, stateful), (x, (x.flatten(1).sum(1) > 0).long()))


class Windows(torch.utils.data.Dataset):
    """Language-model windows of a fixed random token sequence, item ``i`` a random crop of slot ``i``: its offset
    in the slot drawn from torch's global RNG (as a random-crop transform draws). ``reads`` counts the items read
    in this process."""

    reads = 0

    def __init__(self, tokens: torch.Tensor, context: int, slot: int):
        self.tokens, self.context, self.slot = tokens, context, slot

    def __len__(self) -> int:
        return (len(self.tokens) - self.context - 1) // self.slot

    def __getitem__(self, i: int):
        Windows.reads += 1
        start = i * self.slot + int(torch.randint(self.slot, ()))
        w = self.tokens[start:start + self.context + 1]
        return w[:-1], w[1:]


def windows(context: int = 16, vocab_size: int = 256, num_tokens: int = 4096, slot: int = 4, **_) -> Windows:
    """``data=stdlib_text``'s shapes (``context``, ``vocab_size``) from a map-style dataset of random crops."""
    tokens = torch.randint(vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    return Windows(tokens, context, slot)
