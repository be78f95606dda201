"""The formats researchers' data comes in, as fxtrain data sources: token files, Hugging Face datasets,
WebDataset shards and Grain pipelines (``data=tokens``, ``data=hf``, ``data=webdataset``, ``data=grain``).

Each builder returns what :func:`fxtrain.data.from_source` reads, following the source contract of
:mod:`fxtrain.data`: a :class:`fxtrain.data.Dataset` whose training stream reads only its data-parallel rank's
share of every global batch (``shard(rank, world)``), resumes from its own state (``state_dict()`` /
``load_state_dict()`` on the iterator, torchdata's ``Stateful`` protocol) and says what it is (``describe()``: the
run's data line), with held-out splits read from the files meant for them; or, for a Hugging Face dataset, the
map-style rows that the runner's loader shuffles, shards and loads in workers (with one split, the map-style
dataset itself, which the runner also splits).

Map:

* :class:`TokenWindows`: the windows of a memory-mapped token file (nanoGPT's ``.bin``), map-style;
  :func:`tokens` builds ``data=tokens`` from the train/val/test files.
* :class:`HFItems`: a ``datasets.Dataset`` with a column map, map-style; :func:`hf` builds ``data=hf``.
* :class:`ItemStream`: batches of any map-style source addressed by step (random draws, per-epoch shuffles or
  file order): the stream token files train from; its state is the step, the same on every rank, so a resume
  on another world size continues the same global batches.
* :class:`ShardStream`: WebDataset ``.tar`` shards (a directory, a brace pattern, object-storage URLs), each rank
  its own shards; its state is the shard and the offset in it. :func:`webdataset` builds ``data=webdataset``.
* :class:`GrainStream`: a Grain pipeline, its iterator's ``get_state()`` checkpointed with the run.
  :func:`grain` builds ``data=grain``.

The optional packages (``datasets``, ``webdataset``, ``grain``) are imported when a builder runs; a missing one is
one line naming the extra that installs it (:mod:`fxtrain.extras`).
"""

from __future__ import annotations

import glob
import itertools
import os
import pathlib
import tarfile
import typing
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import default_collate

from fxtrain.data import Dataset, ExampleBatches, Loader, read_items
from fxtrain.extras import require

__all__ = ["ORDERS", "GrainIterator", "GrainStream", "HFItems", "ItemStream", "MissingData", "ShardIterator",
           "ShardStream", "StepIterator", "TokenWindows", "grain", "hf", "shard_urls", "tokens", "webdataset"]

Batch = tuple[torch.Tensor, torch.Tensor]


class MissingData(FileNotFoundError, ValueError):
    """A file, directory or shard that the data config names does not exist. A ``FileNotFoundError``, and a
    ``ValueError`` so that the runner reports it in one line, as every bad value of a data config."""


Order = Literal["random", "shuffle", "sequential"]
ORDERS = typing.get_args(Order)
TokenType = Literal["uint8", "uint16", "uint32"]   # nanoGPT writes uint16; vocabularies over 65,536 need uint32


def _tensor(value: Any) -> torch.Tensor:
    """A numpy array or number as a tensor (float64 as float32: numpy's default float, not a model's)."""
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.array(value))
    return t.float() if t.dtype == torch.float64 else t


def _collate(items: Sequence[Any], what: str) -> Batch:
    """``(input, target)`` items as one batch, or a TypeError naming ``what`` gave another kind of item."""
    pairs = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"{what} gave a {type(item).__name__}; fxtrain reads (input, target) items")
        pairs.append((_tensor(item[0]), _tensor(item[1])))
    x, y = default_collate(pairs)
    return x, y


_ORDER_TEXT = {"random": "drawn per step from (seed, step)", "shuffle": "a fresh permutation per epoch from (seed, "
               "epoch)", "sequential": "in order, wrapping around"}


def _reads(world: int, local: int) -> str:
    """How the data-parallel ranks read a global batch, for a data line."""
    return f"each of {world} data-parallel ranks reads its {local} of a batch" if world > 1 else "one rank reads all"


def _share(batch_size: int, world: int, owner: str) -> int:
    if world < 1 or batch_size % world:
        raise ValueError(f"{owner}: batch_size={batch_size} does not split over {world} data-parallel ranks; use a "
                         f"multiple of {world}")
    return batch_size // world


# --- map-style sources ---------------------------------------------------------------------------------------

class TokenWindows(TorchDataset):
    """The windows of a token file, as nanoGPT's ``prepare.py`` writes it: the raw tokens, ``uint16`` (vocabularies
    up to 65,536, GPT-2's) or ``uint32``, no header. Item ``i`` is ``(x, y)``: the ``context`` tokens starting at
    ``i * stride`` and the next token of each (int64).

    The file is memory-mapped (``np.memmap``) when first read, in the process that reads it (a DataLoader worker
    opens its own), so a 10 GB file costs no memory and a window costs one read.

    Args:
      path: the ``.bin`` file.
      context: tokens per window.
      dtype: ``uint16`` or ``uint32`` (``uint8``: bytes; in code, any numpy integer type).
      stride: tokens between window starts: 1 (every offset: the random windows nanoGPT draws) or ``context``
        (windows side by side, each token once).

    Raises:
      FileNotFoundError, ValueError: one line naming the file and what to change: a missing file, a size that is
        not a multiple of the dtype's, a file not longer than ``context``.

    >>> import os, tempfile, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "train.bin")
    >>> np.arange(101, dtype=np.uint16).tofile(path)
    >>> windows = TokenWindows(path, context=8)
    >>> x, y = windows[3]
    >>> len(windows), x.tolist(), y[-1].item()
    (93, [3, 4, 5, 6, 7, 8, 9, 10], 11)
    >>> TokenWindows(path, context=8, dtype="uint32")
    Traceback (most recent call last):
    ...
    ValueError: tokens: ... holds 202 bytes, not a whole number of uint32 tokens (4 bytes each); is it uint16? set dtype
    """

    def __init__(self, path: str, context: int, dtype: TokenType = "uint16", stride: int = 1):
        self.path, self.context, self.stride = str(path), int(context), int(stride)
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"tokens: dtype={dtype!r} is not a numpy type; use uint16 or uint32") from None
        if self.dtype.kind not in "ui":
            raise ValueError(f"tokens: dtype={dtype} is not an integer type; use uint16 or uint32")
        if not os.path.isfile(self.path):
            raise MissingData(f"tokens: {self.path} does not exist; point the data config at a .bin token file "
                                    "(nanoGPT's prepare.py writes train.bin and val.bin)")
        size = os.path.getsize(self.path)
        if size % self.dtype.itemsize:
            other = "uint16" if self.dtype.itemsize == 4 else "uint32"
            raise ValueError(f"tokens: {self.path} holds {size} bytes, not a whole number of {self.dtype} tokens "
                             f"({self.dtype.itemsize} bytes each); is it {other}? set dtype")
        self.num_tokens = size // self.dtype.itemsize
        if self.num_tokens <= self.context:
            raise ValueError(f"tokens: {self.path} holds {self.num_tokens} tokens, not more than "
                             f"context={self.context}; "
                             "lower context or give a longer file")
        if self.stride < 1:
            raise ValueError(f"tokens: stride={stride} must be at least 1")
        self._tokens: np.memmap | None = None
        self._window = np.arange(self.context + 1)

    def __len__(self) -> int:
        return (self.num_tokens - self.context - 1) // self.stride + 1

    def __getitem__(self, i: int) -> Batch:
        return self.__getitems__([i])[0]

    def __getitems__(self, rows: Sequence[int]) -> list[Batch]:
        """The windows ``rows`` in one read of the memory map (what torch's DataLoader asks of a batch)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        starts = np.asarray(rows, dtype=np.int64)
        if len(starts) and (starts.min() < -len(self) or starts.max() >= len(self)):
            raise IndexError(f"tokens: window index out of range for {len(self)} windows of {self.path}")
        starts = (starts % len(self)) * self.stride
        win = torch.from_numpy(self._tokens[starts[:, None] + self._window].astype(np.int64))
        return [(w[:-1], w[1:]) for w in win]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}   # a worker maps the file itself

    def __repr__(self) -> str:
        return f"TokenWindows({self.path!r}, context={self.context}, dtype={self.dtype}, stride={self.stride})"


class HFItems(TorchDataset):
    """A Hugging Face ``datasets.Dataset`` as ``(input, target)`` items, by a column map.

    ``input`` names one column (token ids, an image array, a feature vector) or several numeric columns, stacked
    into one float vector; ``target`` names the target column, or ``None`` for next-token prediction on the
    input column (``x = ids[:-1]``, ``y = ids[1:]``: rows of equal length, as ``group_texts`` chunks them).
    Reads several rows at once where torch's DataLoader asks (``__getitems__``: one Arrow slice, not one per row).

    >>> import datasets
    >>> table = datasets.Dataset.from_dict({"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0], "label": [0, 1, 0]})
    >>> x, y = HFItems(table, input=["a", "b"], target="label")[1]
    >>> x.tolist(), int(y)
    ([2.0, 5.0], 1)
    >>> HFItems(table, input="ids", target="label")
    Traceback (most recent call last):
    ...
    ValueError: hf: input column 'ids' is not in the dataset; its columns are a, b, label
    """

    def __init__(self, table: Any, input: str | Sequence[str], target: str | None = None):
        self.inputs = [input] if isinstance(input, str) else list(input)
        self.target = target
        columns = list(table.column_names)
        for kind, name in [*(("input", c) for c in self.inputs), ("target", target)]:
            if name is not None and name not in columns:
                raise ValueError(f"hf: {kind} column {name!r} is not in the dataset; its columns are "
                                 f"{', '.join(columns)}")
        if target is None and len(self.inputs) != 1:
            raise ValueError(f"hf: target=null (next-token prediction) reads one input column, not {self.inputs}")
        self.table = table.with_format("numpy", columns=[*self.inputs, *([target] if target else [])])

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> Batch:
        return self.__getitems__([i])[0]

    def __getitems__(self, rows: Sequence[int]) -> list[Batch]:
        cols = self.table[list(rows)]
        if self.target is None:
            ids = _stack(cols[self.inputs[0]], self.inputs[0])
            return list(zip(_tensor(ids[:, :-1]), _tensor(ids[:, 1:])))
        if len(self.inputs) == 1:
            x = _tensor(_stack(cols[self.inputs[0]], self.inputs[0]))
        else:
            x = torch.stack([_tensor(np.asarray(cols[c], dtype=np.float32)) for c in self.inputs], dim=-1)
        return list(zip(x, _tensor(_stack(cols[self.target], self.target))))

    def __repr__(self) -> str:
        return f"HFItems({len(self)} rows, input={self.inputs}, target={self.target})"


def _stack(column: Any, name: str) -> np.ndarray:
    """A column's rows as one array (rows of a list column must have one length)."""
    if isinstance(column, np.ndarray) and column.dtype != object:
        return column
    try:
        return np.stack([np.asarray(v) for v in column])
    except ValueError:
        lengths = sorted({len(v) for v in column})
        raise ValueError(f"hf: the rows of column {name!r} have different lengths ({lengths[0]}..{lengths[-1]}); "
                         "chunk them to one length first (group_texts), or pick another column") from None


# --- streams addressed by step (the state is the step) ---------------------------------------------------------

class ItemStream:
    """Training batches of a map-style ``source`` (``len()`` and ``[i]``), batch ``k`` a pure function of
    ``(seed, k)``: each data-parallel rank reads only its share of it (:meth:`shard`), and the state is the step,
    the same on every rank, so a resume (on any world size) reads nothing it skips.

    ``order``: ``random`` draws ``batch_size`` items with replacement per step (nanoGPT's random windows: no
    permutation of a 10-billion-window file is ever held), ``shuffle`` a fresh seeded permutation each epoch
    (the last partial batch dropped), ``sequential`` the items in order, wrapping around.

    >>> stream = ItemStream(list(zip(range(10), range(10))), batch_size=4, seed=0, order="sequential")
    >>> it = iter(stream)
    >>> [next(it)[0].tolist() for _ in range(3)]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    >>> state = it.state_dict(); state
    {'step': 3}
    >>> rank1 = iter(stream.shard(1, 2)); rank1.load_state_dict(state); next(rank1)[0].tolist()   # rank 1's half
    [4, 5]
    """

    def __init__(self, source: Any, batch_size: int, seed: int = 0, order: str = "shuffle", name: str = "data",
                 rank: int = 0, world: int = 1):
        if order not in ORDERS:
            raise ValueError(f"{name}: order={order!r}; expected one of {', '.join(ORDERS)}")
        n = len(source)
        if not 0 < batch_size <= n:
            raise ValueError(f"{name}: batch_size={batch_size} must be between 1 and the {n} training items")
        self.source, self.batch_size, self.seed, self.order, self.name = source, batch_size, seed, order, name
        self.rank, self.world, self.local = rank, world, _share(batch_size, world, name)
        self._perm: tuple[int, np.ndarray] | None = None

    def rows(self, step: int) -> np.ndarray:
        """The items of global batch ``step``, all ranks' shares in rank order."""
        n, b = len(self.source), self.batch_size
        if self.order == "random":
            return np.random.default_rng([self.seed, step]).integers(0, n, b)
        if self.order == "sequential":
            return (step * b + np.arange(b)) % n
        epoch, i = divmod(step, n // b)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n))
        return self._perm[1][i * b:(i + 1) * b]

    def batch(self, step: int) -> Batch:
        """This rank's share of global batch ``step``: its ``batch_size // world`` items, read and collated."""
        first = self.rank * self.local
        rows = self.rows(step)[first:first + self.local]
        # each item seeded from its place in the global order (a random transform in it: the same on any layout)
        positions = range(step * self.batch_size + first, step * self.batch_size + first + self.local)
        items = read_items(self.source, rows, positions, self.seed)
        return _collate(items, f"{self.name}: {type(self.source).__name__}")

    def shard(self, rank: int, world: int) -> "ItemStream":
        """This stream for data-parallel ``rank`` of ``world``: each batch is its ``batch_size // world`` items."""
        return ItemStream(self.source, self.batch_size, self.seed, self.order, self.name, rank, world)

    def __iter__(self) -> "StepIterator":
        return StepIterator(self.batch)

    def describe(self) -> str:
        """The run's data line for this stream: its items, their order, each rank's share, how it is read and
        resumed.

        >>> ItemStream(list(zip(range(10), range(10))), batch_size=4, order="random").shard(1, 2).describe()
        'list: 10 items, order random (drawn per step from (seed, step)), each of 2 data-parallel ranks reads its 2
        of a batch, in the training process; resumed at its step'
        """
        return (f"{type(self.source).__name__}: {len(self.source):,} items, order {self.order} "
                f"({_ORDER_TEXT[self.order]}), {_reads(self.world, self.local)}, in the training process; resumed at "
                "its step")

    def __repr__(self) -> str:
        return f"ItemStream({self.describe()}, batch {self.batch_size})"


class StepIterator:
    """``batch(0)``, ``batch(1)``, ... with its position as state: ``state_dict()`` is ``{"step": k}``, the next
    batch's step; ``load_state_dict`` moves there without reading anything in between."""

    def __init__(self, batch, step: int = 0):
        self._batch, self.step = batch, step

    def __iter__(self) -> "StepIterator":
        return self

    def __next__(self) -> Batch:
        out = self._batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def _held_out(source: Any, count: int, what: str) -> Batch:
    """Up to ``count`` items of a map-style ``source``, evenly spaced over it, as one batch (an evaluation split)."""
    n = len(source)
    rows = np.unique(np.linspace(0, n - 1, min(count, n)).astype(np.int64))
    return _collate(read_items(source, rows, [-1 - int(i) for i in rows], 0), what)


def _check_vocab(name: str, vocab_size: int | None, *splits: Batch) -> None:
    if vocab_size is None:
        return
    top = max(int(s[0].max()) for s in splits if s is not None)
    if top >= vocab_size:
        raise ValueError(f"{name}: vocab_size={vocab_size} is too small: the tokens go up to {top}; set vocab_size "
                         f"to at least {top + 1}")


def _check_context(name: str, context: int | None, test: Batch) -> None:
    if context is not None and test[0].shape[-1] != context:
        raise ValueError(f"{name}: context={context} does not match the data (its windows hold "
                         f"{test[0].shape[-1]} tokens); leave it at {test[0].shape[-1]}")


def _local(path: str | os.PathLike | None, root: str | os.PathLike | None) -> str | None:
    if path is None:
        return None
    return str(pathlib.Path(root or ".", path)) if root is not None else str(path)


def tokens(dir: str | None = None, train_file: str = "train.bin", val_file: str | None = "val.bin",
           test_file: str | None = None, context: int = 128, dtype: TokenType = "uint16", order: Order = "random",
           batch_size: int = 32, seed: int = 0, eval_windows: int = 64, vocab_size: int | None = None) -> Dataset:
    """Memory-mapped token files (nanoGPT's ``train.bin`` / ``val.bin``): ``data=tokens``.

    Training windows of ``context + 1`` tokens come from ``train_file`` in ``order`` (:class:`ItemStream`: ``random``
    offsets drawn per step from ``(seed, step)``, or ``sequential``, side by side in file order); the validation
    and test splits are ``eval_windows`` non-overlapping windows spread evenly over ``val_file`` and ``test_file``.
    Without a test file (nanoGPT writes none) the validation file is the test split and the run validates on it
    (and says so).

    Args:
      dir: the directory of the files (``None``: paths as given).
      train_file, val_file, test_file: file names in ``dir`` (``val_file``, ``test_file``: ``None`` for none).
      context: tokens per window.
      dtype: ``uint16`` (nanoGPT, vocabularies up to 65,536) or ``uint32``.
      order: ``random`` or ``sequential`` (``shuffle``: a permutation of every window each epoch, 8 bytes a
        window held in memory: for small files only).
      batch_size: windows per global batch.
      seed: seed of the random windows.
      eval_windows: windows per held-out split.
      vocab_size: a fact for the model config (checked against the held-out tokens).

    >>> import os, tempfile, numpy as np
    >>> d = tempfile.mkdtemp()
    >>> for split in ("train", "val"): np.arange(1000, dtype=np.uint16).tofile(os.path.join(d, split + ".bin"))
    >>> data = tokens(d, context=16, batch_size=4, eval_windows=8)
    >>> x, y = next(iter(data.train))
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all()), data.test[0].shape, data.val is None
    (torch.Size([4, 16]), True, torch.Size([8, 16]), True)
    """
    held = {split: TokenWindows(_local(f, dir), context, dtype, stride=context)
            for split, f in (("val", val_file), ("test", test_file)) if f is not None}
    if not held:
        raise ValueError("tokens: val_file=null and test_file=null: give at least one held-out file "
                         "(val_file=val.bin)")
    windows = TokenWindows(_local(train_file, dir), context, dtype, stride=context if order == "sequential" else 1)
    stream = ItemStream(windows, batch_size, seed, order, "tokens")
    splits = {k: _held_out(w, eval_windows, f"tokens: {w.path}") for k, w in held.items()}
    test_split, val_split = (splits["test"], splits.get("val")) if "test" in splits else (splits["val"], None)
    _check_vocab("tokens", vocab_size, test_split, val_split)
    _check_context("tokens", context, test_split)
    return Dataset("tokens", stream, test_split, val_split)


# --- Hugging Face datasets ---------------------------------------------------------------------------------------

Builder = Literal["parquet", "json", "csv", "arrow", "text"]
_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow",
             ".txt": "text"}


def hf(from_disk: str | None = None, data_files: Any = None, builder: Builder | None = None,
       input: str | list[str] = "input_ids", target: str | None = "label", split: str = "train",
       test_split: str | None = None, val_split: str | None = None, batch_size: int = 32, seed: int = 0,
       eval_examples: int = 1024, vocab_size: int | None = None, context: int | None = None,
       cache_dir: str | None = None, num_workers: int | None = None, prefetch_factor: int = 2,
       pin_memory: bool | None = None, persistent_workers: bool = True) -> Any:
    """A Hugging Face ``datasets`` dataset from local files: ``data=hf``.

    ``from_disk`` a directory written by ``save_to_disk`` (``load_from_disk``), or ``data_files`` (a file, a glob, a
    list, or ``{split: files}``) read by ``load_dataset(builder, data_files=...)``, ``builder`` (``parquet``,
    ``json``, ``csv``, ``arrow``) found from the files' suffix when not given. Items come from the column map
    ``input`` / ``target`` (:class:`HFItems`).

    With one split, the map-style :class:`HFItems` of ``split`` is returned: the runner splits it (``test_fraction``,
    ``val_fraction``), shuffles it per epoch, gives each rank its share and loads it in workers. With
    ``test_split`` (and ``val_split``), those splits are the held-out ones (``eval_examples`` rows spread evenly
    over each) and ``split`` trains through the same loader (:class:`fxtrain.data.ExampleBatches`: a fresh seeded
    permutation each epoch, each rank its share, ``DataLoader`` workers, resumed at its step).

    Args:
      from_disk, data_files, builder: where the data is (one of ``from_disk`` and ``data_files``).
      input, target: the column map (``target=None``: next-token prediction on the ``input`` column).
      split, test_split, val_split: the splits' names.
      batch_size, seed: the global batch and the order's seed (held-out splits given).
      eval_examples: rows per held-out split.
      vocab_size, context: facts for a language model's config (checked on the held-out splits when given).
      cache_dir: where ``load_dataset`` writes its Arrow cache (``None``: Hugging Face's, ``~/.cache/huggingface``).
      num_workers, prefetch_factor, pin_memory, persistent_workers: how the training rows are loaded with held-out
        splits given (:class:`fxtrain.data.Loader`; the runner's keys: with one split the runner loads it alike).

    >>> import os, tempfile, datasets
    >>> d = tempfile.mkdtemp()
    >>> rows = [{"x": [float(i), 1.0], "y": i % 2} for i in range(20)]
    >>> _ = datasets.Dataset.from_list(rows).to_json(os.path.join(d, "rows.jsonl"))
    >>> items = hf(data_files=os.path.join(d, "rows.jsonl"), input="x", target="y", cache_dir=d)
    >>> len(items), items[3][0].tolist()
    (20, [3.0, 1.0])
    """
    datasets = require("datasets", "data=hf", "datasets", "hf")
    if (from_disk is None) == (data_files is None):
        raise ValueError("hf: give from_disk (a save_to_disk directory) or data_files (files to load_dataset), not "
                         f"{'both' if from_disk is not None else 'neither'}")
    if from_disk is not None:
        if not pathlib.Path(from_disk).exists():
            raise MissingData(f"hf: from_disk={from_disk} does not exist; give a directory written by "
                                    "save_to_disk")
        loaded = datasets.load_from_disk(str(from_disk))
    else:
        _check_files(data_files)
        try:
            loaded = datasets.load_dataset(builder or _builder(data_files), data_files=_files(data_files),
                                           cache_dir=None if cache_dir is None else str(cache_dir))
        except FileNotFoundError as e:   # datasets' own words name the file or pattern
            raise MissingData(f"hf: {e}; data_files names the files load_dataset reads (a path, a glob, a list, "
                              "or {split: files})") from None
    splits = loaded if isinstance(loaded, datasets.DatasetDict) else {split: loaded}
    for name in (split, test_split, val_split):
        if name is not None and name not in splits:
            raise ValueError(f"hf: split {name!r} is not in the data; its splits are {', '.join(splits)}")
    items = HFItems(splits[split], input, target)
    if test_split is None:
        return items
    held = {k: _held_out(HFItems(splits[s], input, target), eval_examples, f"hf: split {s}")
            for k, s in (("test", test_split), ("val", val_split)) if s is not None}
    _check_vocab("hf", vocab_size, held["test"], held.get("val"))
    _check_context("hf", context, held["test"])
    loader = Loader(num_workers, prefetch_factor, pin_memory, persistent_workers)
    train = ExampleBatches(items, range(len(items)), batch_size, seed, loader)
    return Dataset("hf", train, held["test"], held.get("val"))


def _files(data_files: Any) -> Any:
    """``data_files`` with OmegaConf containers as plain ones (``load_dataset`` checks for ``dict``/``list``)."""
    if isinstance(data_files, dict):
        return {k: _files(v) for k, v in data_files.items()}
    if isinstance(data_files, (list, tuple)):
        return [str(f) for f in data_files]
    return str(data_files)


def _check_files(data_files: Any) -> None:
    """Each local file or glob of ``data_files`` names something (``load_dataset`` says less, or the wrong thing:
    a split whose glob matches nothing "corresponds to no data")."""
    if isinstance(data_files, dict):
        for split, files in data_files.items():
            _check_files(files)
        return
    for f in [data_files] if isinstance(data_files, (str, os.PathLike)) else data_files:
        f = str(f)
        if "://" not in f and not glob.glob(f):
            raise MissingData(f"hf: data_files: {f} {'matches no file' if glob.has_magic(f) else 'does not exist'}; "
                              "give files that load_dataset reads (a path, a glob, a list, or {split: files})")


def _builder(data_files: Any) -> str:
    """The ``load_dataset`` builder for ``data_files`` by their suffix, or one line asking for ``builder``."""
    first = data_files
    while isinstance(first, (dict, list, tuple)):
        first = next(iter(first.values() if isinstance(first, dict) else first), "")
    suffix = pathlib.Path(str(first).removesuffix(".gz")).suffix
    if suffix not in _BUILDERS:
        raise ValueError(f"hf: cannot tell the format of {first} from its suffix; set builder (parquet, json, csv, "
                         "arrow, text)")
    return _BUILDERS[suffix]


# --- WebDataset shards -------------------------------------------------------------------------------------------

def shard_urls(spec: str | os.PathLike | Sequence[str], owner: str = "webdataset") -> list[str]:
    """The shard URLs of ``spec``: a local directory (its ``*.tar``, sorted), a brace pattern
    (``gs://bucket/train-{000000..000099}.tar``, ``pipe:aws s3 cp s3://bucket/train-{000000..000099}.tar -``),
    or a list of them; URLs open as webdataset opens them (``https``, ``gs``, ``pipe:`` commands).

    >>> shard_urls("gs://bucket/train-{000..002}.tar")
    ['gs://bucket/train-000.tar', 'gs://bucket/train-001.tar', 'gs://bucket/train-002.tar']
    """
    if isinstance(spec, (list, tuple)):
        return [u for s in spec for u in shard_urls(s, owner)]
    spec = str(spec)
    if os.path.isdir(spec):
        urls = sorted(str(p) for p in pathlib.Path(spec).glob("*.tar"))
        if not urls:
            raise MissingData(f"{owner}: no .tar shards in {spec}")
        return urls
    braceexpand = require("braceexpand", f"data={owner}", "webdataset", "webdataset")
    urls = list(braceexpand.braceexpand(spec))
    local = [u for u in urls if "://" not in u and not u.startswith("pipe:")]
    missing = [u for u in local if not os.path.isfile(u)]
    if missing:
        raise MissingData(f"{owner}: shard {missing[0]} does not exist ({len(missing)} of {len(urls)} missing); "
                                "give a directory of .tar shards, a brace pattern or URLs")
    return urls


def _samples(url: str, skip: int = 0) -> Iterator[dict]:
    """The samples of one tar shard (its files grouped by key: the name up to the first dot of its base name), the
    first ``skip`` passed over unread; fields decoded by webdataset's decoders (``.npy``, ``.cls``, ``.json``...)."""
    wds = require("webdataset", "data=webdataset", "webdataset", "webdataset")
    decode = wds.autodecode.Decoder([])
    with wds.gopen(url, "rb") as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
        key, sample, index = None, {}, -1
        for member in tar:
            if not member.isfile():
                continue
            folder, base = os.path.split(member.name)
            prefix, _, field = base.partition(".")
            if os.path.join(folder, prefix) != key:
                if sample:
                    yield decode(sample)
                key, index = os.path.join(folder, prefix), index + 1
                sample = {"__key__": key} if index >= skip else {}
            if index >= skip:
                sample[field] = tar.extractfile(member).read()
        if sample:
            yield decode(sample)


class ShardStream:
    """Batches of WebDataset ``.tar`` shards: each epoch the shards in a fresh order drawn from ``(seed, epoch)``,
    data-parallel rank ``r`` of ``n`` reading shards ``r, r + n, ...`` of it (:meth:`shard`), the samples of a
    shard in order. A sample's ``input`` and ``target`` fields (``x.npy``, ``cls``: the part of the file name after
    the key) are the pair.

    The state is ``(epoch, shard, offset)``: a resume opens the shard and passes over ``offset`` samples without
    decoding them, never earlier shards. A resume on another world size is refused (each rank's shards change).

    >>> import os, tempfile, numpy as np, webdataset as wds
    >>> d = tempfile.mkdtemp()
    >>> for s in range(2):
    ...     with wds.TarWriter(os.path.join(d, f"train-{s}.tar")) as w:
    ...         for i in range(4):
    ...             _ = w.write({"__key__": f"{s}{i}", "x.npy": np.full(2, 4 * s + i, np.float32), "cls": i})
    >>> it = iter(ShardStream(shard_urls(d), batch_size=3, seed=0))
    >>> [next(it)[0][:, 0].tolist() for _ in range(2)]
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    >>> state = it.state_dict(); again = iter(ShardStream(shard_urls(d), batch_size=3, seed=0))
    >>> again.load_state_dict(state); next(again)[0][:, 0].tolist() == next(it)[0][:, 0].tolist()
    True
    """

    def __init__(self, urls: Sequence[str], batch_size: int, seed: int = 0, input: str = "x.npy",
                 target: str = "cls", name: str = "webdataset", rank: int = 0, world: int = 1):
        if len(urls) < world:
            raise ValueError(f"{name}: {len(urls)} shards cannot feed {world} data-parallel ranks (each reads its own "
                             f"shards); write at least {world} shards")
        self.urls, self.batch_size, self.seed, self.input, self.target = list(urls), batch_size, seed, input, target
        self.name, self.rank, self.world, self.local = name, rank, world, _share(batch_size, world, name)

    def shard(self, rank: int, world: int) -> "ShardStream":
        """This stream for data-parallel ``rank`` of ``world``: its own shards, ``batch_size // world`` per batch."""
        return ShardStream(self.urls, self.batch_size, self.seed, self.input, self.target, self.name, rank, world)

    def shards(self, epoch: int) -> list[str]:
        """This rank's shards in ``epoch``, in the order it reads them."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.urls))
        return [self.urls[i] for i in order[self.rank::self.world]]

    def pair(self, sample: dict) -> tuple[Any, Any]:
        missing = [f for f in (self.input, self.target) if f not in sample]
        if missing:
            fields = ", ".join(k for k in sample if not k.startswith("__"))
            raise ValueError(f"{self.name}: sample {sample['__key__']} has no field {missing[0]!r} (its fields: "
                             f"{fields}); set input and target to fields of the shards")
        return sample[self.input], sample[self.target]

    def __iter__(self) -> "ShardIterator":
        return ShardIterator(self)

    def describe(self) -> str:
        """The run's data line for this stream: the shards, their order, each rank's share, how it resumes."""
        split = (f"each of {self.world} data-parallel ranks streams its own shards ({self.local} samples of a "
                 "batch)" if self.world > 1 else "one rank streams them all")
        return (f"{len(self.urls)} WebDataset shards in an order drawn per epoch from (seed, epoch), samples in shard "
                f"order, {split}, in the training process; resumed at its shard and offset (on as many ranks)")

    def __repr__(self) -> str:
        return f"ShardStream({self.describe()}, batch {self.batch_size})"


class ShardIterator:
    """A :class:`ShardStream`'s batches, its position ``{"epoch", "shard", "offset"}`` as state."""

    def __init__(self, stream: ShardStream):
        self.stream, self.epoch, self.shard, self.offset = stream, 0, 0, 0
        self._samples: Iterator[dict] | None = None

    def __iter__(self) -> "ShardIterator":
        return self

    def _next_sample(self) -> dict:
        ended = 0   # shards ended in a row without a sample: more than there are is an empty stream, not a hang
        while True:
            shards = self.stream.shards(self.epoch)
            if self._samples is None:
                self._samples = _samples(shards[self.shard], skip=self.offset)
            sample = next(self._samples, None)
            if sample is not None:
                self.offset += 1
                return sample
            ended += 1
            if ended > len(self.stream.urls) + 1:
                raise ValueError(f"{self.stream.name}: the shards of rank {self.stream.rank} hold no samples")
            self._samples, self.offset, self.shard = None, 0, self.shard + 1
            if self.shard == len(shards):
                self.epoch, self.shard = self.epoch + 1, 0

    def __next__(self) -> Batch:
        s = self.stream
        return _collate([s.pair(self._next_sample()) for _ in range(s.local)], f"{s.name}: a shard sample")

    def state_dict(self) -> dict:
        s = self.stream
        return {"epoch": self.epoch, "shard": self.shard, "offset": self.offset, "rank": s.rank, "world": s.world}

    def load_state_dict(self, state: dict) -> None:
        s = self.stream
        if (state["rank"], state["world"]) != (s.rank, s.world):
            raise ValueError(f"{s.name}: the checkpoint's stream position is rank {state['rank']} of "
                             f"{state['world']}'s shards, and this is rank {s.rank} of {s.world}; resume on "
                             f"{state['world']} data-parallel ranks")
        self.epoch, self.shard, self.offset = int(state["epoch"]), int(state["shard"]), int(state["offset"])
        self._samples = None


def _held_out_samples(urls: Sequence[str], stream: ShardStream, count: int) -> Batch:
    """The first ``count`` samples of ``urls``, in order, as one batch (a held-out split)."""
    pairs = [stream.pair(s) for s in itertools.islice((s for u in urls for s in _samples(u)), count)]
    if not pairs:
        raise ValueError(f"{stream.name}: the held-out shards hold no samples")
    return _collate(pairs, f"{stream.name}: a held-out sample")


def webdataset(train_shards: str | list[str], test_shards: str | list[str], val_shards: str | list[str] | None = None,
               input: str = "x.npy", target: str = "cls", batch_size: int = 32, seed: int = 0,
               eval_examples: int = 1024) -> Dataset:
    """WebDataset ``.tar`` shards: ``data=webdataset``. Training batches stream from ``train_shards``
    (:class:`ShardStream`: each rank its own shards, resumable at a shard and offset); the held-out splits are
    the first ``eval_examples`` samples of ``test_shards`` (and ``val_shards``).

    Args:
      train_shards, test_shards, val_shards: a local directory, a brace pattern, object-storage URLs
        (``https://``, ``gs://``, ``pipe:aws s3 cp s3://... -``, as webdataset opens them), or a list.
      input, target: the fields of a sample that are the pair (the file name after the sample's key).
      batch_size: samples per global batch.
      seed: seed of each epoch's shard order.
      eval_examples: samples per held-out split.

    >>> import os, tempfile, numpy as np, webdataset as wds
    >>> d = tempfile.mkdtemp()
    >>> for split in ("train", "test"):
    ...     os.makedirs(os.path.join(d, split))
    ...     with wds.TarWriter(os.path.join(d, split, "000.tar")) as w:
    ...         for i in range(8): _ = w.write({"__key__": str(i), "x.npy": np.ones(3, np.float32), "cls": i % 2})
    >>> data = webdataset(os.path.join(d, "train"), os.path.join(d, "test"), batch_size=4)   # train, test shards
    >>> next(iter(data.train))[0].shape, data.test[1].tolist()
    (torch.Size([4, 3]), [0, 1, 0, 1, 0, 1, 0, 1])
    """
    require("webdataset", "data=webdataset", "webdataset", "webdataset")
    stream = ShardStream(shard_urls(train_shards), batch_size, seed, input, target)
    held = {k: _held_out_samples(shard_urls(v), stream, eval_examples)
            for k, v in (("test", test_shards), ("val", val_shards)) if v is not None}
    return Dataset("webdataset", stream, held["test"], held.get("val"))


# --- Grain ---------------------------------------------------------------------------------------------------------

class GrainStream:
    """A Grain pipeline's batches, its iterator's state (``get_state()``) checkpointed with the run.

    ``read_threads``: Grain's threads reading ahead (``ReadOptions.num_threads``; 0 reads in the training thread).

    ``pipeline``: a ``grain.MapDataset`` of ``(input, target)`` items, or any random-access source Grain reads
    (``len()`` and ``[i]``: :class:`TokenWindows`, an ArrayRecord source), shuffled per epoch by Grain from
    ``seed`` and cut into global batches; each data-parallel rank reads only its share of every global batch (the
    global order does not depend on the world size, so the state, the step, is the same on every rank). Or a
    ``grain.IterDataset`` of items (batched here) or a ``grain.DataLoader`` that batches: read whole on every
    rank, each keeping its share.

    >>> import grain, numpy as np
    >>> items = grain.MapDataset.source(np.arange(12)).map(lambda i: (np.float32(i), i % 3))
    >>> it = iter(GrainStream(items, batch_size=4, seed=0))
    >>> first = next(it)[0]; state = it.state_dict(); second = next(it)[0]
    >>> again = iter(GrainStream(items, batch_size=4, seed=0)); again.load_state_dict(state)
    >>> bool((next(again)[0] == second).all()), first.tolist()   # shuffled by Grain
    (True, [...])
    """

    def __init__(self, pipeline: Any, batch_size: int, seed: int = 0, read_threads: int = 2, name: str = "grain",
                 rank: int = 0, world: int = 1):
        self.grain = require("grain", "data=grain", "grain", "grain")
        g = self.grain
        if not isinstance(pipeline, (g.MapDataset, g.IterDataset, g.DataLoader)):
            if not (hasattr(pipeline, "__len__") and hasattr(pipeline, "__getitem__")):
                raise TypeError(f"{name}: the pipeline is a {type(pipeline).__name__}; give a grain.MapDataset, "
                                "IterDataset, DataLoader, or a source with len() and [i]")
            pipeline = g.MapDataset.source(pipeline)
        self.pipeline, self.batch_size, self.seed, self.name = pipeline, batch_size, seed, name
        self.read_threads = read_threads
        self.rank, self.world, self.local = rank, world, _share(batch_size, world, name)
        # read whole on every rank (whole()): the sum of the first global batch, which the runner compares across
        # the ranks (fxtrain.data.whole_batch_fingerprint): a pipeline whose order differs between processes is refused
        self.whole_fingerprint: float | None = None

    def shard(self, rank: int, world: int) -> "GrainStream":
        """This stream for data-parallel ``rank`` of ``world``: each batch is its ``batch_size // world`` items."""
        return GrainStream(self.pipeline, self.batch_size, self.seed, self.read_threads, self.name, rank, world)

    def dataset(self) -> Any:
        """What this rank iterates: a grain ``IterDataset`` of batches (or the DataLoader as given)."""
        g, p = self.grain, self.pipeline
        if isinstance(p, g.MapDataset):
            # the global order (items shuffled per epoch) cut into shares of `local` items: step k's global batch
            # is shares k*world .. k*world + world-1, so rank r reads share k*world + r
            # Grain's reading threads prefetch (its state counts what was taken, not what was read ahead); its
            # default of 16 threads took 0.25-0.9 s to start on 2 cores
            options = g.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=max(2, 8 * self.read_threads))
            return p.seed(self.seed).shuffle().repeat().batch(self.local, drop_remainder=True)[
                self.rank::self.world].to_iter_dataset(options)
        if isinstance(p, g.IterDataset):
            return p.batch(self.batch_size, drop_remainder=True)
        return p

    def whole(self) -> bool:
        """Whether every rank reads the whole global batch (an IterDataset or a DataLoader: not split by rank)."""
        return not isinstance(self.pipeline, self.grain.MapDataset)

    def __iter__(self) -> "GrainIterator":
        return GrainIterator(self)

    def describe(self) -> str:
        """The run's data line for this stream: the pipeline, its order, how the ranks read it, how it resumes. A
        ``MapDataset`` is split by rank; an ``IterDataset`` or a ``DataLoader`` is not (no random access): each rank
        reads the whole global batch, in Grain's deterministic order, and keeps its share."""
        kind = type(self.pipeline).__name__
        if self.whole():
            how = (f"in its own order, not split by rank (no random access): each of {self.world} data-parallel "
                   f"ranks reads the whole batch of {self.batch_size} and keeps its {self.local}" if self.world > 1
                   else "in its own order, not split by rank (no random access: on several data-parallel ranks each "
                        "reads the whole batch and keeps its share)")
        else:
            how = (f"{len(self.pipeline):,} items shuffled by Grain per epoch from the seed, "
                   f"{_reads(self.world, self.local)}, {self.read_threads} Grain read threads")
        return f"Grain {kind} {how}; resumed from Grain's iterator state"

    def __repr__(self) -> str:
        return f"GrainStream({self.describe()}, batch {self.batch_size})"


class GrainIterator:
    """A :class:`GrainStream`'s batches as tensor pairs; its state is Grain's iterator state."""

    def __init__(self, stream: GrainStream):
        self.stream, self._it = stream, iter(stream.dataset())

    def __iter__(self) -> "GrainIterator":
        return self

    def __next__(self) -> Batch:
        s = self.stream
        batch = next(self._it)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(f"{s.name}: the pipeline gave a {type(batch).__name__}; fxtrain reads (input, target) "
                            "items")
        x, y = _tensor(batch[0]), _tensor(batch[1])
        if s.whole() and s.world > 1:
            if s.whole_fingerprint is None:
                s.whole_fingerprint = float(x.double().sum() + y.double().sum())
            x, y = x[s.rank * s.local:(s.rank + 1) * s.local], y[s.rank * s.local:(s.rank + 1) * s.local]
        return x, y

    def state_dict(self) -> dict:
        return {"grain": self._it.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._it.set_state(state["grain"])


def _grain_held_out(pipeline: Any, count: int, g: Any, name: str) -> Batch:
    """The first ``count`` items of a Grain dataset or random-access source, as one batch."""
    if isinstance(pipeline, g.IterDataset):
        items = list(itertools.islice(iter(pipeline), count))
    else:
        items = [pipeline[i] for i in range(min(count, len(pipeline)))]
    return _collate(items, f"{name}: a held-out item")


def grain(train: Any, test: Any, val: Any = None, batch_size: int = 32, seed: int = 0, eval_examples: int = 1024,
          read_threads: int = 2, vocab_size: int | None = None, context: int | None = None) -> Dataset:
    """A Grain pipeline as the source: ``data=grain``. Training batches from ``train`` (:class:`GrainStream`);
    the held-out splits are the first ``eval_examples`` items of ``test`` (and ``val``), Grain datasets or
    random-access sources. In a config each is a ``_target_`` node (your function returning the pipeline).

    Args:
      train: a ``grain.MapDataset`` / ``IterDataset`` of ``(input, target)`` items, a ``grain.DataLoader`` that
        batches, or a random-access source (``len()`` and ``[i]``).
      test, val: held-out items (``val``: ``None`` for none).
      batch_size: items per global batch.
      seed: seed of Grain's shuffle.
      eval_examples: items per held-out split.
      read_threads: Grain's threads reading ahead of the step (a ``MapDataset`` or random-access ``train``).
      vocab_size, context: facts for a language model's config (checked on the held-out splits when given).

    >>> import os, tempfile, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "tokens.bin")
    >>> np.arange(500, dtype=np.uint16).tofile(path)
    >>> data = grain(TokenWindows(path, context=8), TokenWindows(path, context=8, stride=8), batch_size=4)
    >>> next(iter(data.train))[0].shape, data.test[0].shape
    (torch.Size([4, 8]), torch.Size([62, 8]))
    """
    stream = GrainStream(train, batch_size, seed, read_threads)
    held = {k: _grain_held_out(v, eval_examples, stream.grain, "grain") for k, v in (("test", test), ("val", val))
            if v is not None}
    _check_vocab("grain", vocab_size, held["test"], held.get("val"))
    _check_context("grain", context, held["test"])
    return Dataset("grain", stream, held["test"], held.get("val"))
