"""Offline datasets and seeded, reproducible batch iterators.

Nothing here downloads. The default classification experiment uses scikit-learn's 8x8 handwritten
digits (1,797 images shipped inside scikit-learn: ``pip install fxtrain[data]``); the language model
reads Python's own standard-library sources as a byte-level corpus; tests use synthetic data.

Batches are addressed by step: ``data.train[k]`` is the k-th batch of the run, a pure function of the
seed and ``k`` (epoch ``k // steps_per_epoch`` is a fresh permutation drawn from ``(seed, epoch)``). A
resumed run asks for step k and gets exactly the batch the uninterrupted run saw; iterating is the
same as indexing 0, 1, 2, ...

Your own data: a data config's ``_target_`` may return tensors ``(x, y)``, a map-style
``torch.utils.data.Dataset`` or an iterable of batches; :func:`from_source` turns any of them into a
:class:`Dataset` (split, batches addressed by step, a description that needs no knowledge of the class).

**At scale** (the contract a data source keeps; CONTRACT.md). Batch ``k`` is always the *global* batch of step
``k``, a function of the seed and ``k`` only, never of the world size or the number of workers, so a run
resumed on another layout (``resume_relayout=true``) continues the same sequence. The runner hands each
data-parallel rank (``ParallelDims.data_rank`` of ``data_world``) its share through :func:`for_rank`:

* tensors, a map-style dataset and token windows: rank ``r`` of ``n`` reads only rows ``r*B/n .. (r+1)*B/n`` of
  every global batch of ``B`` (the rows ``ParallelDims.local_batch`` keeps), so the items read per step across
  the data-parallel ranks are the global batch. Ranks that use the same share (tp and pp peers of a data rank)
  do not read it again: the first of each group reads it and broadcasts it to the others (``Built.batch`` in
  :mod:`fxtrain.train`, :func:`fxtrain.distributed.broadcast_batch`).
* a map-style dataset (``len()`` and ``[i]``) is loaded by ``torch.utils.data.DataLoader`` workers (``num_workers``,
  ``prefetch_factor``, ``pin_memory`` on CUDA, ``persistent_workers``: :class:`Loader`) that read the steps in
  order from the one asked for; its position is the step, so a resume restarts the workers at the checkpoint's
  step and reads nothing before it (O(1)). Every item is read with torch's, numpy's and Python's global RNGs
  seeded from ``(seed, its place in the global order)`` (:func:`read_items`), in workers and in the training
  process alike, so a random transform inside an item (a random crop) does not change with the number of
  workers, the world size or a resume.
* an iterable is read in its own order. An iterable that is a returned :class:`Dataset`'s ``train`` may define
  ``shard(rank, world) -> iterable``: the runner calls it once on every rank (``(0, 1)`` in one process) and
  reads what it returns, each batch this rank's share (``batch_size // world`` examples; the global batch is the
  ranks' shares in rank order). Without it every rank reads the whole batch and keeps its slice. A stream
  resumes through its own state: the iterator's ``state_dict()``/``load_state_dict()`` (torchdata's
  ``Stateful``), else the source's (torchdata's ``StatefulDataLoader``), recorded in the checkpoint after its
  step (:func:`stream_state`); a list or tuple of batches resumes by index; any other stream's resume is
  refused in one line (:func:`resume_refusal`), never replayed.

Every builder takes the shapes its model reads (``input_shape``, ``num_classes``, ``vocab_size``,
``context``) so that model configs can interpolate them (``${data.num_classes}``); for a real dataset
they are facts, checked against the data.

Example:
    >>> from fxtrain.data import synthetic
    >>> data = synthetic(batch_size=4, num_examples=32, seed=0)
    >>> x, y = data.train[0]
    >>> x.shape, y.shape, data.test[0].shape, data.val is None   # synthetic: no validation split unless asked
    (torch.Size([4, 1, 8, 8]), torch.Size([4]), torch.Size([8, 1, 8, 8]), True)
    >>> bool((data.train[5][0] == synthetic(batch_size=4, num_examples=32, seed=0).train[5][0]).all())
    True
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import functools
import json
import os
import base64
import gzip
import importlib.util
import itertools
import pathlib
import random
import sysconfig
import weakref
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate
from torch.utils.data import Dataset as TorchDataset

__all__ = ["Dataset", "ExampleBatches", "Loader", "ShuffledBatches", "StreamBatches", "WindowBatches", "digits",
           "for_rank", "from_source", "item_seed", "read_items", "stdlib_text", "synthetic"]

Batch = tuple[torch.Tensor, torch.Tensor]
_END = object()   # an iterator's end, for next(it, _END)


class _Batches:
    """Batches addressed by step: ``batches[k]`` is the k-th; iterating yields batches 0, 1, 2... without end."""

    def __getitem__(self, step: int) -> Batch:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Batch]:
        return map(self.__getitem__, itertools.count())

    def describe(self, test: Batch) -> str:
        """What a run prints after the dataset's name: both splits' sizes and the batch."""
        raise NotImplementedError

    def to(self, device: torch.device | str) -> "_Batches":
        """These batches on ``device``, each moved as it is produced (sources holding tensors move them once)."""
        return _OnDevice(self, device)


def _to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``x`` on ``device``. From the host to a CUDA device the copy goes through pinned memory and does not
    wait: the training loop never stalls on a batch or an index made on the host (a copy from pageable
    memory makes the host wait for the GPU). The copy is queued on the current stream, before the step's
    kernels that read it, and torch keeps the pinned buffer until it is done."""
    if torch.device(device).type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def _moved(batches: Any, device: torch.device | str) -> "_Batches":
    """``batches`` on ``device``: a source of this module moves itself (tensors it holds, once); any other object
    with ``batches[k]`` moves each batch as it is produced."""
    return batches.to(device) if isinstance(batches, _Batches) else _OnDevice(batches, device)


class _OnDevice(_Batches):
    """``batches`` (any object with ``batches[k]``) with each batch moved to ``device`` as it is produced."""

    def __init__(self, batches: Any, device: torch.device | str):
        self.batches, self.device = batches, device

    def __getitem__(self, step: int) -> Batch:
        x, y = self.batches[step]
        return _to_device(x, self.device), _to_device(y, self.device)

    def to(self, device: torch.device | str) -> "_OnDevice":
        return _OnDevice(self.batches, device)

    def describe(self, test: Batch) -> str:
        return _describe(self.batches, test)


class _Epochs(_Batches):
    """Steps over ``n`` rows: epoch ``k // len(self)`` is a fresh permutation drawn from ``(seed, epoch)``."""

    rank, world = 0, 1   # this rank's share of every global batch (shard)

    def __init__(self, n: int, batch_size: int, seed: int, device: torch.device | str):
        if not 0 < batch_size <= n:
            raise ValueError(f"batch_size={batch_size} must be between 1 and the {n} training examples")
        self.batch_size, self.seed = batch_size, seed
        self._n, self._device = n, device
        self._perm: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        """Batches per epoch (the last partial batch is dropped)."""
        return self._n // self.batch_size

    def _rows(self, step: int) -> torch.Tensor:
        """This rank's rows of the global batch ``step`` (all of them for one rank): contiguous, as
        ``ParallelDims.local_batch`` slices a global batch."""
        epoch, i = divmod(step, len(self))
        if self._perm is None or self._perm[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self._n)
            self._perm = (epoch, _to_device(torch.from_numpy(perm), self._device))
        share = self.batch_size // self.world
        first = i * self.batch_size + self.rank * share
        return self._perm[1][first:first + share]

    def shard(self, rank: int, world: int) -> "_Epochs":
        """These batches as data-parallel rank ``rank`` of ``world`` reads them: its contiguous share of every
        global batch (``batch_size // world`` rows), and only those rows are read."""
        _check_share(self.batch_size, rank, world)
        out = copy.copy(self)
        out.rank, out.world, out._perm = rank, world, None
        return out


class ShuffledBatches(_Epochs):
    """Batches of ``(x, y)`` rows in a fresh seeded permutation each epoch (the last partial batch dropped).

    ``batches[k]`` is the k-th batch (random access, for resuming); iterating yields batches 0, 1, 2...
    without end.

    >>> import torch
    >>> b = ShuffledBatches(torch.arange(6), torch.arange(6), batch_size=2, seed=0)
    >>> len(b), sorted(torch.cat([b[k][0] for k in range(3)]).tolist())   # one epoch sees every row once
    (3, [0, 1, 2, 3, 4, 5])
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
        super().__init__(len(x), batch_size, seed, x.device)
        self.x, self.y = x, y

    def __getitem__(self, step: int) -> Batch:
        idx = self._rows(step)
        return self.x[idx], self.y[idx]

    def to(self, device: torch.device | str) -> "ShuffledBatches":
        return ShuffledBatches(self.x.to(device), self.y.to(device), self.batch_size, self.seed).shard(self.rank,
                                                                                                    self.world)

    def describe(self, test: Batch) -> str:
        return f"{len(self.x):,} train examples, {len(test[0]):,} test, batch {self.batch_size}"


@dataclasses.dataclass(frozen=True)
class Loader:
    """How a map-style source's items are loaded (the data config's ``num_workers``, ``prefetch_factor``,
    ``pin_memory``, ``persistent_workers``): by ``torch.utils.data.DataLoader`` worker processes, in step order.

    ``num_workers``: worker processes (0: items read in the training process; ``None``: :meth:`workers` picks
    one per core this rank has, at most 4). ``prefetch_factor``: batches each worker loads ahead.
    ``pin_memory``: batches in pinned memory for a CUDA device (``None``: on a CUDA device; never on a CPU one).
    ``persistent_workers``: the workers outlive a jump to another step (a resume, a debug limit's epochs).

    >>> Loader(num_workers=0).workers(), Loader(num_workers=3).workers()
    (0, 3)
    >>> Loader(num_workers=-1)
    Traceback (most recent call last):
    ...
    ValueError: num_workers=-1: expected a whole number of worker processes >= 0 (0: items read in the training process) or null (auto: one per core, at most 4)
    """

    num_workers: int | None = None
    prefetch_factor: int = 2
    pin_memory: bool | None = None
    persistent_workers: bool = True

    def __post_init__(self) -> None:
        check_loader(self.num_workers, self.prefetch_factor, self.pin_memory, self.persistent_workers)

    def workers(self) -> int:
        """The worker processes: ``num_workers``, or for ``None`` the cores this process may use, shared by the
        ranks on this machine (``LOCAL_WORLD_SIZE``), at most 4 (enough to hide a read's latency)."""
        if self.num_workers is not None:
            return self.num_workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(4, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_loader(num_workers: Any = None, prefetch_factor: Any = 2, pin_memory: Any = None,
                 persistent_workers: Any = True, prefix: str = "") -> None:
    """Raises ``ValueError`` (one line naming the setting, ``prefix`` before its name) for a :class:`Loader`
    setting of the wrong kind.

    >>> check_loader(prefetch_factor=0, prefix="data.")
    Traceback (most recent call last):
    ...
    ValueError: data.prefetch_factor=0: expected a whole number of batches >= 1 that each worker loads ahead (2)
    """
    if num_workers is not None and not _whole(num_workers, 0):
        raise ValueError(f"{prefix}num_workers={num_workers}: expected a whole number of worker processes >= 0 (0: "
                         "items read in the training process) or null (auto: one per core, at most 4)")
    if not _whole(prefetch_factor, 1):
        raise ValueError(f"{prefix}prefetch_factor={prefetch_factor}: expected a whole number of batches >= 1 that "
                         "each worker loads ahead (2)")
    for name, value, what in (("pin_memory", pin_memory, "true, false or null (auto: on a CUDA device)"),
                              ("persistent_workers", persistent_workers, "true or false")):
        if not (isinstance(value, bool) or (value is None and name == "pin_memory")):
            raise ValueError(f"{prefix}{name}={value}: expected {what}")


LOADER_KEYS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")


class ExampleBatches(_Epochs):
    """Batches of a map-style dataset's items ``dataset[i]``, ``i`` among ``indices``, in a fresh seeded
    permutation each epoch (as :class:`ShuffledBatches`), collated by ``torch.utils.data.default_collate``.

    Items are ``(input, target)`` pairs of tensors, numpy arrays or numbers (arrays and numbers become
    tensors, float64 as float32). ``loader`` says how they are read: in the training process
    (``num_workers=0``, the default here), or by ``torch.utils.data.DataLoader`` workers that load the steps
    ahead, in order, from the step asked for (a jump to another step, a resume, restarts them there: no step
    before it is read). :meth:`shard` reads only a data-parallel rank's share of each batch. Each item is read
    with the global RNGs seeded from ``(seed, its place in the global order)`` (:func:`read_items`): a random
    transform inside it draws the same numbers whatever the workers, the world size or a resume.

    >>> import torch
    >>> squares = [(torch.tensor([float(i)]), i * i) for i in range(10)]    # any len() + [i] object
    >>> b = ExampleBatches(squares, indices=range(8), batch_size=4, seed=0)
    >>> x, y = b[1]
    >>> x.shape, y.dtype, bool((y == x[:, 0].long() ** 2).all())
    (torch.Size([4, 1]), torch.int64, True)
    >>> bool((b.shard(1, 2)[1][1] == y[2:]).all())   # rank 1 of 2 reads the second half of the global batch
    True
    """

    def __init__(self, dataset: Any, indices: Sequence[int], batch_size: int, seed: int,
                 loader: Loader = Loader(num_workers=0)):
        self.dataset, self.indices = dataset, torch.as_tensor(np.asarray(indices, dtype=np.int64))
        super().__init__(len(self.indices), batch_size, seed, "cpu")
        self.loader, self.pin = loader, False
        self._reset()

    def _reset(self) -> None:
        self._loading: tuple[Any, "_FromStep"] | None = None   # the DataLoader and its batch sampler, once started
        self._it: Iterator[Batch] | None = None
        self._next, self._last = 0, None

    def items(self, step: int) -> list[int]:
        """The dataset indices this rank reads for step ``step``."""
        return self.indices[self._rows(step)].tolist()

    def positions(self, step: int) -> range:
        """The places in the global sample order of the items this rank reads for step ``step`` (global batch ``k``
        holds ``k * batch_size ..``): what their per-item seeds are drawn from (:func:`read_items`)."""
        share = self.batch_size // self.world
        first = step * self.batch_size + self.rank * share
        return range(first, first + share)

    def read(self, step: int) -> Batch:
        """This rank's batch of step ``step``, read and collated in this process (no worker started)."""
        return _collate(self.dataset, self.items(step), self.seed, self.positions(step))

    def __getitem__(self, step: int) -> Batch:
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        if self.loader.workers() == 0:
            batch = self.read(step)
        else:
            if self._it is None or step != self._next:
                self._it = self._start(step)
            batch = next(self._it)
        self._next, self._last = step + 1, (step, batch)
        return batch

    def _start(self, step: int) -> Iterator[Batch]:
        """The workers' batches from step ``step`` on (O(1): the sampler starts there)."""
        if self._loading is None:
            from torch.utils.data import DataLoader

            sampler = _FromStep(self)
            workers = self.loader.workers()
            loader = DataLoader(_SeededItems(self.dataset, self.seed), batch_sampler=sampler, num_workers=workers,
                                collate_fn=functools.partial(_collate_items, type(self.dataset).__name__),
                                prefetch_factor=self.loader.prefetch_factor, pin_memory=self.pin,
                                persistent_workers=self.loader.persistent_workers,
                                # the workers' seeds from the data's seed, not from torch's global RNG (which
                                # DataLoader would draw from: the training's dropout would depend on num_workers)
                                generator=torch.Generator().manual_seed(self.seed))
            self._loading = (loader, sampler)
        loader, sampler = self._loading
        sampler.start = step
        return iter(loader)

    def shard(self, rank: int, world: int) -> "ExampleBatches":
        out = super().shard(rank, world)
        out._reset()
        return out

    def to(self, device: torch.device | str) -> "_Batches":
        """Batches moved to ``device`` as they come; to a CUDA device the workers pin them (``pin_memory``)."""
        out = copy.copy(self)
        out._reset()
        out.pin = (torch.device(device).type == "cuda" and self.loader.pin_memory is not False
                   and out.loader.workers() > 0 and torch.cuda.is_available())  # else _to_device pins, as it moves
        return _OnDevice(out, device)

    def describe(self, test: Batch) -> str:
        workers = self.loader.workers()
        return (f"{len(self.indices):,} train examples, {len(test[0]):,} test, batch {self.batch_size} "
                f"({type(self.dataset).__name__}, map-style, "
                + (f"{workers} worker{'s' if workers > 1 else ''})" if workers else "read in the training process)"))


class _FromStep:
    """An :class:`ExampleBatches`' batch sampler: the ``(index, position)`` of the items each step from ``start`` on
    reads, without end (:class:`_SeededItems` reads them).

    It holds its batches weakly: they hold the DataLoader (and its iterator) that holds this sampler, and through
    that cycle only the garbage collector would free the loader, in an order that may close the workers' queues
    before the loader's shutdown sends them its stop (each worker then sat out DataLoader's 5 s join: 10 s at the
    end of every run and test that read batches through 2 workers)."""

    def __init__(self, batches: ExampleBatches):
        self.batches, self.start = weakref.ref(batches), 0

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        batches, step = self.batches, self.start
        while True:
            yield list(zip(batches().items(step), batches().positions(step)))
            step += 1


class _SeededItems:
    """``dataset`` as a ``DataLoader``'s workers read it: the keys are ``(index, position)`` pairs, each item read by
    :func:`read_items` (seeded from ``(seed, position)``)."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        return read_items(self.dataset, [i for i, _ in keys], [p for _, p in keys], self.seed)


def _collate_items(name: str, items: list) -> Batch:
    """A worker's batch of items ``(input, target)``, collated as :func:`_collate` does."""
    x, y = default_collate([_pair(item, f"an item of {name}") for item in items])
    return x, y


def _check_share(batch_size: int, rank: int, world: int) -> None:
    if not (_whole(world, 1) and _whole(rank, 0) and rank < world):
        raise ValueError(f"shard(rank={rank}, world={world}): expected 0 <= rank < world")
    if batch_size % world:
        raise ValueError(f"a batch of {batch_size} does not split evenly over {world} data-parallel ranks")


class StreamBatches(_Batches):
    """The training batches an iterable yields, in its order: each pass (``iter(source)``) skips its first
    ``held_out`` batches (the test split, :attr:`test`, concatenated; ``None`` for 0) and yields the rest;
    passes repeat.

    ``batches[k]`` is the k-th training batch. Going forward costs one ``next`` per step (the position is
    kept); going back starts a new pass and skips to step ``k``; a list or tuple is read by index. A resumed
    run does not skip forward: it restores the position its checkpoint recorded (:meth:`state_dict`, with the
    source's own ``state_dict()``), or the runner refuses the resume (:func:`resume_refusal`).
    A one-shot iterator (a generator: ``iter(source) is source``) only goes forward: a second pass or an
    earlier step raises. Every training batch must hold ``batch_size`` examples (``None``: the first one's).
    The held-out batches are each pass's first ones: an iterable that reshuffles every pass would train on
    its test batches (return a map-style dataset, which fxtrain splits once and shuffles itself).

    >>> import torch
    >>> batches = [(torch.full((2, 3), float(i)), torch.tensor([i, i])) for i in range(4)]
    >>> stream = StreamBatches(batches, held_out=1)
    >>> [int(stream[k][1][0]) for k in range(6)]    # batch 0 is the test split; 1, 2, 3, then a new pass
    [1, 2, 3, 1, 2, 3]
    >>> stream.test[0].shape, stream.batch_size
    (torch.Size([2, 3]), 2)
    """

    world = 1   # the data-parallel ranks whose shares of a global batch these batches are (shard)

    def __init__(self, source: Iterable, held_out: int, batch_size: int | None = None, owner: str = "data"):
        it = iter(source)
        self.source, self.held_out, self.owner, self.batch_size = source, held_out, owner, batch_size
        self.one_shot = it is source
        self._kind = f"{type(source).__name__} ({'one-shot iterator' if self.one_shot else 'iterable'}, order as given)"
        test = [_pair(b, f"{owner}: test batch {j} from {self._kind}")
                for j, b in enumerate(itertools.islice(it, held_out))]
        if len(test) < held_out:
            raise ValueError(f"{owner}: {self._kind} yielded {len(test)} batches, fewer than the test_batches="
                             f"{held_out} held out for testing, and none for training")
        self.test: Batch | None = (torch.cat([x for x, _ in test]), torch.cat([y for _, y in test])) if test else None
        self._it, self._in_pass, self._next = it, 0, 0   # the current pass, its training batches so far, the next step
        self._last: tuple[int, Batch] | None = None
        first, _ = self[0]   # fails now without training batches, or on a bad first one
        self.batch_size = len(first) if batch_size is None else batch_size

    def __getitem__(self, step: int) -> Batch:
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        if self._indexed():   # a list or tuple of batches: by index, O(1) at any step
            raw, self._next = self.source[self.held_out + step % (len(self.source) - self.held_out)], step + 1
        else:
            if step < self._next:
                if self.one_shot:
                    raise ValueError(f"{self.owner}: step {step} comes before the position of {self._kind} (step "
                                     f"{self._next - 1}) and a one-shot iterator cannot go back; return a re-iterable "
                                     "(a list, a Dataset or a class with __iter__)")
                self._it, self._in_pass, self._next = self._new_pass(), 0, 0
            while self._next <= step:
                raw = self._pull()
                self._next += 1
        x, y = _pair(raw, f"{self.owner}: training batch {step} from {self._kind}")
        if self.batch_size is not None and len(x) != self.batch_size:
            raise ValueError(f"{self.owner}: training batch {step} from {self._kind} has {len(x)} examples, not "
                             f"batch_size={self.batch_size}; every training batch needs batch_size examples "
                             "(a DataLoader: drop_last=True)")
        self._last = (step, (x, y))
        return x, y

    def _indexed(self) -> bool:
        return isinstance(self.source, (list, tuple)) and len(self.source) > self.held_out

    def _pull(self) -> Any:
        """The next raw training batch, starting a new pass when this one ends."""
        raw = next(self._it, _END)
        if raw is not _END:
            self._in_pass += 1
            return raw
        if self.one_shot:
            raise ValueError(f"{self.owner}: {self._kind} ended after {self._next} training batches and a one-shot "
                             "iterator cannot start another pass; return a re-iterable (a list, a Dataset or a class "
                             "with __iter__) or train fewer steps")
        if self._in_pass == 0:
            raise ValueError(f"{self.owner}: a pass of {self._kind} yields no training batches after the "
                             f"test_batches={self.held_out} held out")
        self._it, self._in_pass = self._new_pass(), 0
        return self._pull()

    def _new_pass(self) -> Iterator:
        it = iter(self.source)
        for _ in itertools.islice(it, self.held_out):   # this pass's test batches
            pass
        return it

    # --- resume through the source's own state; a data-parallel rank's share -------------------------------

    def stateful(self) -> Any:
        """What holds this stream's position: the current iterator when it has ``state_dict()`` and
        ``load_state_dict()`` (torchdata's ``Stateful``), else the source when it has them (torchdata's
        ``StatefulDataLoader``), else ``None``. A list or tuple of batches needs none: it is read by index."""
        for holder in (self._it, self.source):
            if callable(getattr(holder, "state_dict", None)) and callable(getattr(holder, "load_state_dict", None)):
                return holder
        return None

    def resumable(self) -> bool:
        """Whether a resume can continue this stream without replaying it: a list or tuple, or :meth:`stateful`."""
        return self._indexed() or self.stateful() is not None

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch taken: the step, the pass's batches so far and the source's state
        (``None`` for a list or tuple). Taken right after a checkpoint's step, before the next batch."""
        holder = self.stateful()
        return {"next": self._next, "in_pass": self._in_pass,
                "source": None if holder is None else holder.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from ``state`` (:meth:`state_dict`'s): the next batch is that of step ``state["next"]``,
        read by index (a list or tuple) or by the source restored from its own state; nothing is replayed."""
        if state["source"] is not None:
            holder = self.stateful()
            if holder is self.source:   # a loader: its next iter() continues from the state
                self.source.load_state_dict(state["source"])
                self._it = iter(self.source)
            else:   # the iterator's: a fresh one, moved to the state
                self._it = iter(self.source)
                self._it.load_state_dict(state["source"])
        self._next, self._in_pass, self._last = state["next"], state["in_pass"], None

    def shard(self, rank: int, world: int) -> "StreamBatches | None":
        """Data-parallel rank ``rank`` of ``world``'s share of each batch, read by the source's own
        ``shard(rank, world)`` (see the module doc), or ``None``: the source cannot split itself (no ``shard``, or
        its test batches are its own first ones, which every rank must hold alike)."""
        if self.held_out or not callable(getattr(self.source, "shard", None)):
            return None
        _check_share(self.batch_size, rank, world)
        out = StreamBatches(self.source.shard(rank, world), 0, self.batch_size // world, self.owner)
        out.world = world
        return out

    def describe(self, test: Batch) -> str:
        """The run's data line: the source's own ``describe()`` where it has one (its order, how the ranks split it,
        how it is read and resumed: fxtrain.sources' streams), else what fxtrain knows of an iterable: its order is
        the one it yields."""
        held = (f"{self.held_out} test batch{'es' if self.held_out > 1 else ''} ({len(test[0]):,} examples)"
                if self.held_out else f"{len(test[0]):,} test")   # a Dataset's own test split
        own = getattr(self.source, "describe", None)
        try:
            own = own() if callable(own) else None
        except TypeError:   # a describe() of another protocol (it takes arguments)
            own = None
        what = own if isinstance(own, str) else f"batches from {self._kind}"
        per_rank = f" ({self.batch_size} per rank)" if self.world > 1 else ""
        return f"{what}, {held}, batch {self.batch_size * self.world}{per_rank}"


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

    rank, world = 0, 1   # this rank's share of every global batch (shard)

    def __getitem__(self, step: int) -> Batch:
        starts = np.random.default_rng([self.seed, step]).integers(0, len(self.tokens) - self.context, self.batch_size)
        share = self.batch_size // self.world
        starts = starts[self.rank * share:(self.rank + 1) * share]   # the global batch's offsets, this rank's share
        rows = self.tokens[_to_device(torch.from_numpy(starts), self.tokens.device)[:, None] + self._window]
        return rows[:, :-1], rows[:, 1:]

    def shard(self, rank: int, world: int) -> "WindowBatches":
        """As :meth:`ShuffledBatches.shard`: rank ``rank`` of ``world`` cuts only its share of the windows."""
        _check_share(self.batch_size, rank, world)
        out = copy.copy(self)
        out.rank, out.world = rank, world
        return out

    def to(self, device: torch.device | str) -> "WindowBatches":
        return WindowBatches(self.tokens.to(device), self.batch_size, self.context, self.seed).shard(self.rank,
                                                                                                  self.world)

    def describe(self, test: Batch) -> str:
        return (f"{len(self.tokens):,} train tokens, {len(test[0]):,} test windows of {self.context}, "
                f"batch {self.batch_size}")


@dataclasses.dataclass
class Dataset:
    """What an experiment trains and evaluates on: three splits.

    Attributes:
      name: for logs.
      train: ``train[k]`` is the k-th training batch ``(inputs, targets)``: one of this module's batch
        sources, or any object with ``train[k]`` (then described by its class name, moved batch by batch).
      test: the whole held-out test split ``(inputs, targets)``, evaluated once, at the end of a run.
      val: the whole validation split ``(inputs, targets)``, which training-time evaluation, early stopping
        and every choice the runner makes read; ``None`` when the source has none (the runner then
        validates on ``test``, and says so: :attr:`validation`).
    """

    name: str
    train: Any
    test: Batch
    val: Batch | None = None

    @property
    def validation(self) -> Batch:
        """The split training-time evaluation reads: :attr:`val`, or :attr:`test` when there is none."""
        return self.test if self.val is None else self.val

    def to(self, device: torch.device | str) -> "Dataset":
        train = _moved(self.train, device)
        val = None if self.val is None else (self.val[0].to(device), self.val[1].to(device))
        return Dataset(self.name, train, (self.test[0].to(device), self.test[1].to(device)), val)

    def __repr__(self) -> str:
        val = f", {len(self.val[0]):,} validation" if self.val is not None else ""
        return f"{self.name}: {_describe(self.train, self.test)}{val}"


def batches_per_epoch(data: Dataset) -> int | None:
    """Training batches in one pass over the training split (the last partial batch dropped), or ``None`` when
    the source does not say (an iterable of batches without a ``len()``, your own ``train[k]``).

    >>> batches_per_epoch(synthetic(batch_size=32, num_examples=256))   # 192 training examples
    6
    """
    train = data.train
    if isinstance(train, _OnDevice):
        train = train.batches
    if isinstance(train, (_Epochs, _FirstOfEpoch, _Repeated)):
        return len(train)
    return None


# --- each rank's share, and a stream's position in a checkpoint ---------------------------------------------

def for_rank(data: Dataset, rank: int, world: int) -> tuple[Dataset, bool]:
    """``(data, sharded)``: ``data`` whose training batches are data-parallel rank ``rank`` of ``world``'s share
    of each global batch, only that share read (``sharded=True``), or ``data`` as it is when its source cannot
    split itself (``False``: every rank reads the whole batch and keeps its slice, ``ParallelDims.local_batch``).

    Tensors, map-style datasets and token windows split by rows (rank ``r`` reads rows ``r*B/n .. (r+1)*B/n`` of
    the global batch, the rows ``local_batch`` keeps: the same values); an iterable that is a returned
    :class:`Dataset`'s ``train`` with a ``shard(rank, world)`` method splits itself; debug runs' repeated
    batches (``overfit``) are held in memory already and not split.

    >>> data = synthetic(batch_size=8, num_examples=64)
    >>> half, sharded = for_rank(data, 1, 2)
    >>> sharded, bool((half.train[3][0] == data.train[3][0][4:]).all())
    (True, True)
    """
    train = _sharded(data.train, rank, world)
    return (data, False) if train is None else (dataclasses.replace(data, train=train), True)


def _sharded(train: Any, rank: int, world: int) -> Any:
    if isinstance(train, _OnDevice):
        inner = _sharded(train.batches, rank, world)
        return None if inner is None else _OnDevice(inner, train.device)
    if isinstance(train, _FirstOfEpoch):
        inner = _sharded(train.batches, rank, world)
        return None if inner is None else _FirstOfEpoch(inner, train.n, train.per_epoch)
    if isinstance(train, (_Epochs, WindowBatches, StreamBatches)):
        return train.shard(rank, world)
    return None


def _stream(train: Any) -> StreamBatches | None:
    """The :class:`StreamBatches` under ``train``'s wrappers, or ``None`` (batches addressed by step)."""
    while isinstance(train, (_OnDevice, _FirstOfEpoch)):
        train = train.batches
    return train if isinstance(train, StreamBatches) else None


def whole_batch_fingerprint(data: Dataset, sharded: bool) -> float | None:
    """The sum of the first global batch's values where every data-parallel rank reads all of it and keeps its
    share: a stream that does not split itself by rank (``sharded=False``, :func:`for_rank`), or one that reads
    whole inside (a Grain ``IterDataset``: its ``whole_fingerprint``); ``None`` where each rank reads only its share.
    The runner compares the ranks' (:func:`fxtrain.train.build_run`): ranks that read different global batches
    would each keep a share of another batch, and train on a batch no process saw.

    >>> batches = [(torch.ones(2, 1), torch.zeros(2)) for _ in range(3)]
    >>> whole_batch_fingerprint(from_source(batches, name="b", test_batches=1), sharded=False)
    2.0
    """
    stream = _stream(data.train)
    if stream is None:
        return None
    if not sharded:
        x, y = stream[0]   # read at start-up already (kept for step 0)
        return float(x.double().sum() + y.double().sum())
    return getattr(stream.source, "whole_fingerprint", None)


def stream_state(data: Dataset) -> dict[str, Any] | None:
    """The position of ``data``'s training stream as plain JSON (what a checkpoint records), or ``None`` when its
    batches are addressed by step (tensors, map-style, windows: the step is the position) or it has no state.

    >>> class Counting:   # an iterable with torchdata's Stateful protocol
    ...     def __init__(self): self.at = 0
    ...     def __iter__(self): return self
    ...     def __next__(self):
    ...         self.at += 1
    ...         return torch.full((2, 1), float(self.at)), torch.zeros(2)
    ...     def state_dict(self): return {"at": self.at}
    ...     def load_state_dict(self, state): self.at = state["at"]
    >>> data = Dataset("counting", Counting(), (torch.zeros(2, 1), torch.zeros(2)))
    >>> data = from_source(data, name="counting")
    >>> [float(data.train[k][0][0]) for k in range(3)], stream_state(data)["source"]
    ([1.0, 2.0, 3.0], {'at': 3})
    """
    stream = _stream(data.train)
    if stream is None or not stream.resumable():
        return None
    return _jsonable(stream.state_dict())


def load_stream_state(data: Dataset, state: dict[str, Any]) -> None:
    """Puts ``data``'s training stream at ``state`` (:func:`stream_state`'s): its next batch is the one after the
    checkpoint's step, and nothing before it is read."""
    stream = _stream(data.train)
    stream.load_state_dict(_from_jsonable(state))


def resume_refusal(data: Dataset, step: int) -> str | None:
    """Why ``data``'s training batches cannot resume at ``step`` without replaying them (one line), or ``None``."""
    stream = _stream(data.train)
    if step == 0 or stream is None or stream.resumable():
        return None
    return (f"{data.name}'s training batches come from {stream._kind}, which has no state_dict()/load_state_dict() "
            f"to continue from at step {step:,}, and fxtrain does not replay {step:,} batches of a stream: give the "
            "source (or its iterator) those two methods (torchdata's StatefulDataLoader has them), return a "
            "map-style dataset (len() and [i]) or a list of batches, or start afresh (resume=null)")


def _jsonable(value: Any) -> Any:
    """``value`` (dicts, lists, tuples, numbers, strings, bytes, tensors, numpy arrays) as JSON data, tagged so
    that :func:`_from_jsonable` gives it back exactly (a checkpoint's manifest holds only JSON: nothing pickled).

    >>> state = {"seen": 3, 0: (b"ab", torch.tensor([1, 2])), "g": np.arange(2, dtype=np.uint8)}
    >>> back = _from_jsonable(json.loads(json.dumps(_jsonable(state))))
    >>> back["seen"], back[0][0], back[0][1].tolist(), back["g"].dtype
    (3, b'ab', [1, 2], dtype('uint8'))
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _jsonable(v) for k, v in value.items()}
        return {"__dict__": [[_jsonable(k), _jsonable(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_jsonable(v) for v in value]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": _jsonable(value.detach().cpu().numpy())}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": base64.b64encode(np.ascontiguousarray(value).tobytes()).decode(),
                "dtype": value.dtype.str, "shape": list(value.shape)}
    raise TypeError(f"a stream's state_dict() holds a {type(value).__name__}; a checkpoint records dicts, lists, "
                    "tuples, numbers, strings, bytes, tensors and numpy arrays")


def _from_jsonable(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_jsonable(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__dict__" in value:
        return {_from_jsonable(k): _from_jsonable(v) for k, v in value["__dict__"]}
    if "__tuple__" in value:
        return tuple(_from_jsonable(v) for v in value["__tuple__"])
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if "__tensor__" in value:
        return torch.from_numpy(_from_jsonable(value["__tensor__"]).copy())
    if "__ndarray__" in value:
        raw = base64.b64decode(value["__ndarray__"])
        return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    return {k: _from_jsonable(v) for k, v in value.items()}


# --- debug runs (the runner's debug.limit_* and debug.overfit_batches) ---------------------------------------

def check_limit(name: str, value: Any) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``value`` is a limit :func:`limited` takes: ``None`` (all), a
    fraction in (0, 1] (a float: ``0.1``, ``1.0``) or a count of batches >= 1 (a whole number: ``5``).

    >>> check_limit("limit_val", 0.5); check_limit("limit_val", 3); check_limit("limit_val", None)
    >>> check_limit("limit_val", 1.5)
    Traceback (most recent call last):
    ...
    ValueError: limit_val=1.5: expected a fraction in (0, 1] (0.1: a tenth) or a whole number of batches >= 1 (5), or null (all)
    """
    fraction = isinstance(value, float) and 0 < value <= 1
    count = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 2**31 - 1
    if value is not None and not (fraction or count):
        raise ValueError(f"{name}={value}: expected a fraction in (0, 1] (0.1: a tenth) or a whole number of "
                         "batches >= 1 (5), or null (all)")


def _limit(name: str, value: int | float | None, total: int) -> int:
    """How many of ``total`` batches (or rows) the limit ``value`` keeps: all, a fraction (at least one), a count."""
    check_limit(name, value)
    if value is None:
        return total
    return max(1, int(value * total)) if isinstance(value, float) else min(value, total)


class _FirstOfEpoch(_Batches):
    """The first ``n`` batches of each epoch of ``batches`` (whose epochs are ``per_epoch`` batches): an epoch
    of ``n`` batches, each a fresh draw as ``batches``' own epochs are (Lightning's ``limit_train_batches``)."""

    def __init__(self, batches: Any, n: int, per_epoch: int):
        self.batches, self.n, self.per_epoch = batches, n, per_epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, step: int) -> Batch:
        epoch, i = divmod(step, self.n)
        return self.batches[epoch * self.per_epoch + i]

    def to(self, device: torch.device | str) -> "_FirstOfEpoch":
        moved = _moved(self.batches, device)
        return _FirstOfEpoch(moved, self.n, self.per_epoch)

    def describe(self, test: Batch) -> str:
        return f"{_describe(self.batches, test)}; debug: {self.n} of {self.per_epoch} batches per epoch"


class _Repeated(_Batches):
    """The first ``n`` batches of ``batches``, again and again: ``repeated[k]`` is ``batches[k % n]``."""

    def __init__(self, batches: Any, n: int):
        self.batches, self.n = batches, n
        self._held = [batches[i] for i in range(n)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, step: int) -> Batch:
        return self._held[step % self.n]

    def to(self, device: torch.device | str) -> "_Repeated":
        moved = _moved(self.batches, device)
        return _Repeated(moved, self.n)

    def describe(self, test: Batch) -> str:
        return f"debug: the same {self.n} training batch{'es' if self.n > 1 else ''} every step, of {_describe(self.batches, test)}"


def limited(data: Dataset, *, limit_train: int | float | None = None, limit_val: int | float | None = None,
            limit_test: int | float | None = None, eval_batch_size: int = 512) -> Dataset:
    """``data`` with fewer batches in each split (a debug run): a fraction (a float in (0, 1]) or a count (a whole
    number >= 1) of the training batches of each epoch (the first of each, so an epoch is shorter), and of the
    validation and test splits, counted in batches of ``eval_batch_size`` (their first rows); ``None``: all.

    Raises:
      ValueError: a limit out of range, or ``limit_train`` on data that does not say how many batches an epoch
        holds; the message starts with the argument's name.

    >>> data = synthetic(batch_size=32, num_examples=256, val_fraction=0.25)
    >>> small = limited(data, limit_train=0.5, limit_val=1, limit_test=0.5, eval_batch_size=16)
    >>> batches_per_epoch(data), batches_per_epoch(small), len(small.val[0]), len(small.test[0])
    (4, 2, 16, 32)
    >>> bool((small.train[2][0] == data.train[4][0]).all())   # the second epoch starts where data's does
    True
    """
    train = data.train
    if limit_train is not None:
        per_epoch = batches_per_epoch(data)
        if per_epoch is None:
            check_limit("limit_train", limit_train)
            raise ValueError(f"limit_train={limit_train}: the training batches of {data.name} do not say how many an "
                             "epoch holds (an iterable without len()); leave it null")
        train = _FirstOfEpoch(train, _limit("limit_train", limit_train, per_epoch), per_epoch)

    def rows(name: str, value: int | float | None, split: Batch | None) -> Batch | None:
        check_limit(name, value)
        if split is None or value is None:
            return split
        total = len(split[0])
        keep = max(1, int(value * total)) if isinstance(value, float) else min(value * eval_batch_size, total)
        return split[0][:keep], split[1][:keep]

    return Dataset(data.name, train, rows("limit_test", limit_test, data.test), rows("limit_val", limit_val, data.val))


def overfit(data: Dataset, batches: int) -> Dataset:
    """``data`` for a debug run that overfits: its first ``batches`` training batches, reused every step
    (``train[k]`` is ``train[k % batches]``), and the same rows as the validation and test splits, so the
    evaluation shows what training reaches on them (a loss near zero, when model and step are right).

    >>> data = overfit(synthetic(batch_size=8, num_examples=64), 2)
    >>> bool((data.train[0][0] == data.train[2][0]).all()), len(data.val[0]), len(data.test[0]), batches_per_epoch(data)
    (True, 16, 16, 2)
    """
    if not (isinstance(batches, int) and not isinstance(batches, bool) and batches >= 1):
        raise ValueError(f"overfit_batches={batches}: expected a whole number of batches >= 1")
    train = _Repeated(data.train, batches)
    held = train._held
    rows = (torch.cat([x for x, _ in held]), torch.cat([y for _, y in held]))
    return Dataset(data.name, train, rows, rows)


def _describe(train: Any, test: Batch) -> str:
    if isinstance(train, _Batches):
        return train.describe(test)
    return f"batches from {type(train).__name__}, {len(test[0]):,} test examples"


def _tensor(value: Any) -> Any:
    """A numpy array or number as a tensor, float64 as float32 (numpy's and Python's float, not torch's
    default); anything else (a tensor, a nested structure for ``default_collate``) as given."""
    if isinstance(value, (np.ndarray, np.generic, int, float)):
        t = torch.tensor(np.asarray(value))   # a copy: torch warns on sharing read-only numpy memory
        return t.float() if t.dtype == torch.float64 else t
    return value


def _pair(item: Any, what: str) -> Batch:
    """``item`` as ``(inputs, targets)``, or a TypeError naming ``what`` it is."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        size = f" of {len(item)}" if isinstance(item, (tuple, list)) else ""
        raise TypeError(f"{what} is a {type(item).__name__}{size}; fxtrain reads (inputs, targets) pairs")
    return _tensor(item[0]), _tensor(item[1])


def _collate(dataset: Any, rows: Sequence[int], seed: int, positions: Sequence[int] | None = None) -> Batch:
    """The items ``dataset[i]`` of ``rows`` as one batch ``(inputs, targets)`` (torch's ``default_collate``), read by
    :func:`read_items` at ``positions`` (``None``: held-out items, at ``-1 - i``)."""
    rows = [int(i) for i in rows]
    positions = [-1 - i for i in rows] if positions is None else positions
    items = read_items(dataset, rows, positions, seed)
    x, y = default_collate([_pair(item, f"{type(dataset).__name__}[{i}]") for i, item in zip(rows, items)])
    return x, y


# --- per-item RNG: a random transform inside an item is a function of (seed, its place in the global order) ----

_MASK = (1 << 64) - 1


def item_seed(seed: int, position: int) -> int:
    """The seed of the item at ``position`` in the global sample order (global batch ``k`` holds positions
    ``k * batch_size`` to ``(k + 1) * batch_size - 1``; a held-out item ``i`` is at ``-1 - i``): splitmix64 of both,
    so that neighbouring items get unrelated streams; 63 bits.

    >>> item_seed(0, 5) == item_seed(0, 5), item_seed(0, 5) == item_seed(1, 5), item_seed(0, 5) < 2**63
    (True, False, True)
    """
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def _seed_all(s: int) -> None:
    torch.default_generator.manual_seed(s)
    np.random.seed(s & 0xFFFFFFFF)
    random.seed(s)


def read_items(dataset: Any, rows: Sequence[int], positions: Sequence[int], seed: int) -> list:
    """The items ``dataset[i]`` of ``rows``, each read with torch's (CPU), numpy's global and Python's ``random``
    generators seeded from ``(seed, position)`` (:func:`item_seed`): a random transform inside an item (a random
    crop, a random window) draws the same numbers whatever the number of workers, the world size or a resume.
    The generators are given back as they were (the training's own draws, dropout, do not move).

    A dataset that reads several items in one call (``__getitems__``, as torch's ``DataLoader`` asks: an Arrow
    slice, a memory map) is read so, seeded once from its first item's position: a random transform belongs in
    ``__getitem__``.

    >>> import torch
    >>> class Crops:
    ...     def __getitem__(self, i): return torch.randint(100, (1,)), i
    >>> a = read_items(Crops(), [7, 3], positions=[16, 17], seed=0)
    >>> b = read_items(Crops(), [3], positions=[17], seed=0)   # item 3 alone (another rank, worker or resume)
    >>> bool(a[1][0] == b[0][0])
    True
    """
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        getitems = getattr(dataset, "__getitems__", None)
        if getitems is not None:
            _seed_all(item_seed(seed, int(positions[0])))
            return list(getitems([int(i) for i in rows]))
        out = []
        for i, p in zip(rows, positions):
            _seed_all(item_seed(seed, int(p)))
            out.append(dataset[int(i)])
        return out
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


def _split(n: int, test_fraction: float, split_seed: int, owner: str,
           val_fraction: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(train, val, test)`` row indices of ``n`` rows: ``test_fraction`` and ``val_fraction`` of them held out.

    The test rows are the first of one permutation drawn from ``split_seed`` and the validation rows the
    next ones, so adding a validation split keeps the test set (it is carved out of the training rows).
    A fraction that rounds to no rows is refused (:func:`check_held_out`).

    >>> [len(part) for part in _split(100, 0.25, 0, "mine", val_fraction=0.1)]
    [65, 10, 25]
    >>> bool((_split(100, 0.25, 0, "mine")[2] == _split(100, 0.25, 0, "mine", val_fraction=0.1)[2]).all())
    True
    >>> _split(40, 0.01, 0, "synthetic")
    Traceback (most recent call last):
    ...
    ValueError: synthetic: test_fraction=0.01 of 40 examples holds out 0.4, which rounds to none: the test split would be empty; raise test_fraction to at least 0.025 (1 of 40), or give more examples
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"{owner}: test_fraction={test_fraction} must be between 0 and 1")
    if not 0 <= val_fraction < 1 - test_fraction:
        raise ValueError(f"{owner}: val_fraction={val_fraction} must be at least 0 and below 1 - test_fraction "
                         f"({1 - test_fraction:g}): the rest trains")
    # The split has its own seed: sweeping the run's seed changes init and batch order, not the held-out sets.
    perm = np.random.default_rng(split_seed).permutation(n)
    n_test, n_val = int(round(n * test_fraction)), int(round(n * val_fraction))
    check_held_out(owner, n, "examples", test_fraction, n_test, val_fraction, n_val)
    return perm[n_test + n_val:], perm[n_test:n_test + n_val], perm[:n_test]


def check_held_out(owner: str, n: int, unit: str, test_fraction: float, n_test: int, val_fraction: float,
                   n_val: int, least: int = 1) -> None:
    """Refuses a split that holds out nothing: a ``test_fraction`` whose share of ``n`` ``unit`` (rows, bytes)
    rounds to fewer than ``least``, and a ``val_fraction`` above 0 that does (validation would silently read
    the test split; ``val_fraction=0`` asks for that on purpose, and the run says so). Each is one line naming
    the setting, its share and the smallest one that holds ``least``.

    >>> check_held_out("mine", 512, "examples", 0.25, 128, 0.0001, 0)
    Traceback (most recent call last):
    ...
    ValueError: mine: val_fraction=0.0001 of 512 examples holds out 0.0512, which rounds to none: the validation split would be empty, and validation would read the test split; raise val_fraction to at least 0.002 (1 of 512), or set val_fraction=0 to validate on the test split on purpose
    """
    for name, fraction, held, empty in (
            ("test_fraction", test_fraction, n_test, "the test split would be empty"),
            ("val_fraction", val_fraction, n_val, "the validation split would be empty, and validation would read the "
                                                  "test split")):
        if held >= least or (name == "val_fraction" and fraction == 0):
            continue
        smallest = least / n if n else 1.0
        fix = ("set val_fraction=0 to validate on the test split on purpose" if name == "val_fraction"
               else f"give more {unit}")
        got = f"{n * fraction:.3g}, which rounds to none" if held == 0 else f"{held}, fewer than {least}"
        raise ValueError(f"{owner}: {name}={fraction:g} of {n} {unit} holds out {got}: {empty}; raise {name} to at "
                         f"least {smallest:.2g} ({least} of {n}), or {fix}")


def _rows(x: torch.Tensor, y: torch.Tensor, rows: np.ndarray) -> Batch | None:
    """The rows ``rows`` of ``(x, y)``, or ``None`` for no rows (no validation split)."""
    return (x[rows], y[rows]) if len(rows) else None


def _check(owner: str, name: str, given, actual) -> None:
    if given is not None and list(np.atleast_1d(given)) != list(np.atleast_1d(actual)):
        raise ValueError(f"{owner}: {name}={given} does not match the data ({name} is {actual}); "
                         f"leave it at {actual}")


def digits(batch_size: int = 64, test_fraction: float = 0.25, split_seed: int = 0, seed: int = 0,
           input_shape: Sequence[int] = (1, 8, 8), num_classes: int = 10, val_fraction: float = 0.15) -> Dataset:
    """scikit-learn's 8x8 handwritten digits: 1,797 images in [0, 1], shape ``(1, 8, 8)``, 10 classes.

    Args:
      batch_size: examples per training batch.
      test_fraction: share held out for the test split, split with ``split_seed`` (not ``seed``).
      split_seed: seed of the train/validation/test split.
      val_fraction: share held out for the validation split (taken from the training rows: the test split
        does not change with it); 0 for none.
      seed: seed of the batch order.
      input_shape, num_classes: facts of the dataset (checked), for model configs to interpolate.
    """
    _check("digits", "input_shape", input_shape, [1, 8, 8])
    _check("digits", "num_classes", num_classes, 10)
    pixels, labels = _digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32).div_(16.0).view(-1, 1, 8, 8)
    y = torch.tensor(labels, dtype=torch.long)
    tr, va, te = _split(len(x), test_fraction, split_seed, "digits", val_fraction)
    return Dataset("digits", ShuffledBatches(x[tr], y[tr], batch_size, seed), (x[te], y[te]), _rows(x, y, va))


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``load_digits(return_X_y=True)``: the ``digits.csv.gz`` scikit-learn ships, read as it reads it
    (``np.loadtxt``, the last column the label) without importing scikit-learn, whose import (``sklearn.utils``
    pulls in scipy.stats) took 1.5-2.5 s of every digits run's start-up before its first line."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("data=digits needs scikit-learn: pip install 'fxtrain[data]'")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():  # a scikit-learn that keeps it elsewhere: ask it
        from sklearn.datasets import load_digits
        return load_digits(return_X_y=True)
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def synthetic(batch_size: int = 32, num_examples: int = 512, input_shape: Sequence[int] = (1, 8, 8),
              num_classes: int = 10, noise: float = 1.0, test_fraction: float = 0.25, split_seed: int = 0,
              seed: int = 0, val_fraction: float = 0.0) -> Dataset:
    """Gaussian clusters: one random prototype per class plus ``noise``-scaled Gaussian noise. For tests.

    Args:
      batch_size: examples per training batch.
      num_examples: train + test examples.
      input_shape: shape of one input.
      num_classes: number of classes (and prototypes).
      noise: standard deviation of the noise around each prototype (1.0: overlapping but learnable).
      test_fraction, split_seed, seed, val_fraction: as in :func:`digits` (no validation split by default).
    """
    g = torch.Generator().manual_seed(split_seed)
    protos = torch.randn((num_classes, *input_shape), generator=g)
    y = torch.randint(num_classes, (num_examples,), generator=g)
    x = protos[y] + noise * torch.randn((num_examples, *input_shape), generator=g)
    tr, va, te = _split(num_examples, test_fraction, split_seed, "synthetic", val_fraction)
    return Dataset("synthetic", ShuffledBatches(x[tr], y[tr], batch_size, seed), (x[te], y[te]), _rows(x, y, va))


def stdlib_text(batch_size: int = 32, context: int = 128, max_bytes: int = 2_000_000, test_fraction: float = 0.1,
                eval_windows: int = 64, seed: int = 0, vocab_size: int = 256, val_fraction: float = 0.05) -> Dataset:
    """Byte-level text of Python's standard library (the top-level ``*.py`` files, sorted by name).

    The first ``max_bytes`` bytes of the files in name order (about 4.7 MB exist on CPython 3.11), the last
    ``test_fraction`` of them held out; the test split is ``eval_windows`` non-overlapping windows from
    the start of the held-out text. Tokens are bytes (``vocab_size=256``), so no tokenizer is needed.

    Args:
      batch_size: windows per training batch.
      context: tokens per window (the model predicts each next byte).
      max_bytes: corpus size.
      test_fraction: share of the corpus held out (its end).
      eval_windows: test windows, and validation windows (capped by the held-out text).
      val_fraction: share of the corpus held out for validation (just before the test text); 0 for none.
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
    n_test, n_val = int(len(tokens) * test_fraction), int(len(tokens) * val_fraction)
    # each held-out split is cut into windows of context + 1 bytes: fewer is a split with no window
    check_held_out("stdlib_text", len(tokens), "bytes", test_fraction, n_test, val_fraction, n_val, least=context + 1)
    train, val, held = tokens[:-n_test - n_val], tokens[-n_test - n_val:-n_test], tokens[-n_test:]
    test = _windows(held, eval_windows, context)
    return Dataset("stdlib_text", WindowBatches(train, batch_size, context, seed), test,
                   _windows(val, eval_windows, context) if n_val else None)


def _windows(held: torch.Tensor, count: int, context: int) -> Batch:
    """Up to ``count`` non-overlapping windows ``(inputs, next tokens)`` from the start of ``held``."""
    n_windows = min(count, (len(held) - 1) // context)
    if n_windows < 1:
        raise ValueError(f"stdlib_text: the held-out text ({len(held)} bytes) is shorter than context={context}")
    rows = held[: n_windows * context + 1]
    return rows[:-1].view(n_windows, context), rows[1:].view(n_windows, context)


def from_source(source: Any, *, name: str, batch_size: int | None = None, test_fraction: float = 0.2,
                split_seed: int = 0, seed: int = 0, test_batches: int | None = None,
                input_shape: Sequence[int] | None = None, num_classes: int | None = None,
                val_fraction: float = 0.0, num_workers: int | None = None, prefetch_factor: int = 2,
                pin_memory: bool | None = None, persistent_workers: bool = True) -> Dataset:
    """A :class:`Dataset` from whatever a data config's ``_target_`` returned, whatever its class.

    ``source`` may be:

    * a :class:`Dataset`: returned as is, with its own validation split if it has one (the facts below
      checked); if its ``train`` only iterates, its batches are read in order as an iterable's (below), none
      held out;
    * tensors ``(x, y)``, a tuple or list of two tensors or numpy arrays: rows split with ``split_seed``, the
      training rows reshuffled each epoch with ``seed`` (:class:`ShuffledBatches`);
    * a map-style dataset of ``(input, target)`` items (a ``torch.utils.data.Dataset``, or any object with
      ``len()`` and ``[i]`` and no ``__iter__``): indices split with ``split_seed``, batches of indices
      reshuffled each epoch with ``seed`` and collated (:class:`ExampleBatches`), by ``DataLoader`` worker
      processes (``num_workers``, :class:`Loader`); the test split collated once, in this process;
    * an iterable of ``(inputs, targets)`` batches (an ``IterableDataset``, a ``DataLoader``, a list of batches,
      a class with ``__iter__``, a generator): the first ``test_batches`` batches of each pass are the test
      split, the rest the training batches in the iterable's own order, fxtrain does not shuffle them; a new
      pass when one ends (:class:`StreamBatches`, which says what a resume and the split need of it).

    Numpy arrays and numbers become tensors (float64 as float32). Targets may be float (regression) or
    integer (classes) of any trailing shape, inputs of any shape. Batches are global: under data parallelism
    the runner has each rank read only its share of every batch (:func:`for_rank`), so ``batch_size`` is the
    global batch.

    Args:
      source: the data, in one of the forms above.
      name: the dataset's name, for logs and messages (a returned :class:`Dataset` keeps its own).
      batch_size: examples per training batch; for a Dataset or an iterable, checked against their batches
        (``None``: theirs).
      test_fraction: share of the examples held out (tensors, map-style), or of the batches of an iterable
        with a ``len()`` when ``test_batches`` is None.
      split_seed: seed of the train/validation/test split, not ``seed``: sweeping the seed keeps the held-out sets.
      seed: seed of the batch order (tensors, map-style).
      test_batches: batches of an iterable held out; ``None``: about ``test_fraction`` of them (at least 1)
        when it has a ``len()``, else 1.
      input_shape: a fact from the config: the shape of one input (checked against the test split).
      num_classes: a fact from the config: integer targets must lie in ``0..num_classes-1`` (a split or a
        batch may miss classes). Checked on all of tensors ``(x, y)``, else on the test split and the first
        training batch (reading a whole dataset only to check would cost an epoch); float targets unchecked.
      val_fraction: share of the examples held out for validation (tensors, map-style; taken from the
        training rows, so the test split does not change with it); 0: no validation split (an iterable has
        none: return a :class:`Dataset` with ``val`` for one).
      num_workers, prefetch_factor, pin_memory, persistent_workers: how a map-style dataset's items are loaded
        (:class:`Loader`; ``num_workers=None``: one worker per core, at most 4; 0: in this process).

    Examples:
        >>> import torch
        >>> x, y = torch.randn(500, 4), torch.randint(3, (500,))
        >>> data = from_source((x, y), name="mine", batch_size=32, num_classes=3)
        >>> data, data.train[7][0].shape
        (mine: 400 train examples, 100 test, batch 32, torch.Size([32, 4]))
        >>> from torch.utils.data import TensorDataset
        >>> from_source(TensorDataset(x, y), name="mine", batch_size=32, val_fraction=0.1, num_workers=2)
        mine: 350 train examples, 100 test, batch 32 (TensorDataset, map-style, 2 workers), 50 validation
        >>> batches = [(x[i:i + 50], y[i:i + 50]) for i in range(0, 500, 50)]
        >>> from_source(batches, name="mine", batch_size=50, test_batches=2)
        mine: batches from list (iterable, order as given), 2 test batches (100 examples), batch 50
        >>> from_source((x, y), name="mine", batch_size=32, num_classes=2)
        Traceback (most recent call last):
        ...
        ValueError: mine: num_classes=2 is too few: the targets go up to 2, so num_classes is at least 3
    """
    targets = None   # all the targets, where they are at hand
    loader = Loader(num_workers, prefetch_factor, pin_memory, persistent_workers)
    if isinstance(source, Dataset):
        data = source
        if not hasattr(data.train, "__getitem__"):   # only iterates: its batches in order, its test its own
            if not _is_iterable(data.train):
                raise TypeError(f"{name}: Dataset.train is a {type(data.train).__name__}; it needs train[k] (step k's "
                                "batch) or __iter__ (batches in order)")
            data = Dataset(data.name, StreamBatches(data.train, 0, batch_size, name), data.test, data.val)
        if batch_size is not None and len(data.train[0][0]) != batch_size:
            raise ValueError(f"{name}: batch_size={batch_size} does not match the data (its training batches hold "
                             f"{len(data.train[0][0])}); leave it at {len(data.train[0][0])}")
    elif isinstance(source, (tuple, list)) and len(source) == 2 and all(isinstance(v, (torch.Tensor, np.ndarray))
                                                                        for v in source):
        x, y = map(_tensor, source)
        if len(x) != len(y):
            raise ValueError(f"{name}: x has {len(x)} rows and y {len(y)}; tensors (x, y) pair row i of x with "
                             "row i of y")
        train, val, test = _split_rows(name, len(x), test_fraction, split_seed, batch_size, val_fraction)
        data = Dataset(name, ShuffledBatches(x[train], y[train], batch_size, seed), (x[test], y[test]),
                       _rows(x, y, val))
        targets = [y]
    elif _is_map_style(source):
        train, val, test = _split_rows(name, len(source), test_fraction, split_seed, batch_size, val_fraction)
        batches = ExampleBatches(source, train, batch_size, seed, loader)
        data = Dataset(name, batches, _collate(source, test.tolist(), split_seed),
                       _collate(source, val.tolist(), split_seed) if len(val) else None)
        if num_classes is not None:   # the first batch read here, no worker started for a check
            targets = [data.test[1], batches.read(0)[1]]
    elif _is_iterable(source):
        if test_batches is not None and test_batches < 1:
            raise ValueError(f"{name}: test_batches={test_batches} must be at least 1 (the test split)")
        stream = StreamBatches(source, _test_batches(source, test_batches, test_fraction), batch_size, name)
        data = Dataset(name, stream, stream.test)
    else:
        raise TypeError(f"{name}: the data is a {type(source).__name__}; fxtrain reads tensors (x, y), a map-style "
                        "torch.utils.data.Dataset of (input, target) items, or an iterable of (inputs, targets) "
                        "batches (or an fxtrain.data.Dataset)")
    _check(name, "input_shape", input_shape, list(data.test[0].shape[1:]))
    if num_classes is not None:
        _check_classes(name, num_classes, targets or [data.test[1], data.train[0][1]])
    return data


def _is_map_style(source: Any) -> bool:
    """``len()`` and ``[i]``, and not iterated: a torch map-style Dataset, or a plain class without ``__iter__``."""
    if isinstance(source, IterableDataset) or not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        return False
    return isinstance(source, TorchDataset) or not hasattr(source, "__iter__")


def _is_iterable(source: Any) -> bool:
    """Iterated for batches: ``__iter__``, or only ``[k]`` (Python iterates that too); not text or a mapping."""
    if isinstance(source, (str, bytes, collections.abc.Mapping)):
        return False
    return isinstance(source, collections.abc.Iterable) or hasattr(source, "__getitem__")


def _split_rows(owner: str, n: int, test_fraction: float, split_seed: int, batch_size: int | None,
                val_fraction: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_split`, checked: some rows held out, a batch's worth left for training."""
    train, val, test = _split(n, test_fraction, split_seed, owner, val_fraction)
    if not len(test):
        raise ValueError(f"{owner}: test_fraction={test_fraction} of {n} examples holds none out; raise test_fraction")
    if batch_size is None or not 0 < batch_size <= len(train):
        raise ValueError(f"{owner}: batch_size={batch_size} must be between 1 and the {len(train)} training examples "
                         f"({n} examples, {len(test)} held out by test_fraction={test_fraction}"
                         + (f", {len(val)} by val_fraction={val_fraction})" if len(val) else ")"))
    return train, val, test


def _test_batches(source: Any, test_batches: int | None, test_fraction: float) -> int:
    """``test_batches``, or about ``test_fraction`` of an iterable's batches when it has a ``len()``, else 1."""
    if test_batches is not None:
        return test_batches
    try:
        n = len(source)
    except TypeError:   # no len(): a generator, an IterableDataset
        return 1
    return max(1, int(round(n * test_fraction)))


def _check_classes(owner: str, num_classes: int, targets: Sequence[torch.Tensor]) -> None:
    """Integer targets in ``0..num_classes-1`` (float targets are regression: nothing to check)."""
    ys = [y for y in targets if y.numel() and not (y.is_floating_point() or y.is_complex())]
    if not ys:
        return
    low, top = min(int(y.min()) for y in ys), max(int(y.max()) for y in ys)
    if low < 0:
        raise ValueError(f"{owner}: the targets go down to {low}; class targets are 0..num_classes-1 "
                         f"(num_classes={num_classes})")
    if top >= num_classes:
        raise ValueError(f"{owner}: num_classes={num_classes} is too few: the targets go up to {top}, so num_classes "
                         f"is at least {top + 1}")
