"""Checkpoints: ``fx.save(path, tree)`` / ``fx.load(path, like=tree)``, atomic, DTensor-aware, bit-exact.

A checkpoint is a directory. Its tensors are written by ``torch.distributed.checkpoint`` (DCP): every
rank writes the shards it holds of each DTensor leaf (plain tensors are taken as identical on every rank
and written once), and loading into DTensors on another mesh or world size reshards. Without a process
group the same call saves and loads in one process. Beside DCP's files, ``fxtrain.json`` (the manifest)
records every leaf's path, kind, global shape and dtype, the non-tensor leaves (Python numbers, strings)
and the size and CRC32 of every file, so that:

* ``load`` checks structure, shapes and dtypes against ``like`` and names the first path that differs
  (another model's checkpoint, an optimizer state from another stack) before reading any tensor;
* a truncated or corrupted file is reported with its name and the checkpoint's path, never loaded.

**Atomic.** ``save`` writes into ``.<name>.saving`` beside the target, fsyncs every file and the
directory, writes the manifest last, then renames it to ``<name>`` (an existing checkpoint there is first
renamed to ``.<name>.old`` and removed after). A crash at any point leaves the previous checkpoint
loadable: before the first rename it is untouched; between the two renames ``load`` finds it as
``.<name>.old`` (and the next ``save`` puts it back first).

**What to save for a bit-exact resume.** Everything the next step reads: :class:`TrainState` holds the
step count (which is also the data position: ``fxtrain.data`` batches are a pure function of seed and
index, so batch ``step`` is the next one), params, buffers, the whole transform state (counters, loss
scale and its trackers, accumulation window, injected hyperparameters; all NamedTuples/dicts/tuples of
tensors) and the RNG states (:func:`rng_state`). Bytes are copied as they are: a resumed run computes
what the uninterrupted one would have.

Talking to ``torch.distributed`` belongs in ``fxtrain/distributed.py`` (rank and world size come from
there), with one exception: this module calls ``torch.distributed.checkpoint``, and the barriers its save
protocol needs (nobody goes on before the rename) are part of that protocol, so they live here too.

Example:
    >>> import tempfile, torch, fxtrain as fx
    >>> params = {"w": torch.randn(3), "b": torch.zeros(())}
    >>> tx = fx.adam(1e-3)
    >>> state = fx.TrainState(step=7, params=params, opt_state=tx.init(params), rng=fx.rng_state())
    >>> path = fx.save(tempfile.mkdtemp() + "/ckpt", state)
    >>> back = fx.load(path, like=state)
    >>> back.step, torch.equal(back.params["w"], params["w"])
    (7, True)
    >>> fx.load(path, like=state._replace(params={"w": torch.zeros(4), "b": torch.zeros(())}))
    Traceback (most recent call last):
    ...
    fxtrain.checkpoint.CheckpointError: checkpoint .../ckpt does not match `like` at 'params.w': shape (3,) in the checkpoint, (4,) in like
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import warnings
import zlib
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from fxtrain import distributed, tree

__all__ = ["TrainState", "save", "load", "rng_state", "set_rng_state", "latest", "CheckpointError"]

MANIFEST = "fxtrain.json"
_FORMAT = "fxtrain-checkpoint"
_VERSION = 1
_VALUE_TYPES = (bool, int, float, str)  # non-tensor leaves kept in the manifest (JSON), by type


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: incomplete, truncated, corrupted, or of another tree."""


class TrainState(NamedTuple):
    """Everything a training loop needs to continue exactly where it stopped (a pytree).

    Attributes:
      step: steps taken (a Python int); with ``fxtrain.data`` it is also the data position: the next
        batch is ``data.train[step]``.
      params: the parameter tree (tensors or DTensors).
      opt_state: ``tx.init(params)`` as updated since: every transform's state.
      rng: RNG states (:func:`rng_state`), or ``None``.
      buffers: module buffers (BatchNorm statistics) from :func:`fxtrain.functional`, or ``None``.
    """

    step: int
    params: Any
    opt_state: Any
    rng: Any = None
    buffers: Any = None


def rng_state() -> dict[str, Any]:
    """The torch CPU RNG state and, when CUDA is available, every CUDA device's: ``{"cpu": t, "cuda": [...]}``.

    >>> s = rng_state(); a = torch.rand(2); set_rng_state(s); torch.equal(a, torch.rand(2))
    True
    """
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores what :func:`rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


# --- save -----------------------------------------------------------------------------------------

def save(path: str | os.PathLike, state: Any) -> pathlib.Path:
    """Writes the pytree ``state`` to the directory ``path``, atomically; returns ``path``.

    Leaves may be tensors, DTensors (each rank writes its shards), ``None`` and Python
    ``bool``/``int``/``float``/``str``. Under a process group every rank must call it with the same
    ``path`` (a filesystem all ranks share) and the same tree structure. An existing checkpoint at
    ``path`` is replaced only once the new one is complete.

    Args:
      path: the checkpoint directory (created; its parent too).
      state: the tree, e.g. a :class:`TrainState`.

    Returns:
      ``path`` as a ``pathlib.Path``.

    Raises:
      TypeError: a leaf of another type, naming its path.
    """
    path = pathlib.Path(path)
    flat, _ = tree.flatten(state)
    paths = _paths(state)
    leaves, tensors = [], {}
    for p, x in zip(paths, flat):
        entry = _describe(p, x)
        leaves.append(entry)
        if entry["kind"] == "tensor":
            tensors[p] = x.detach()
    rank, world = distributed.rank_and_world()
    rank0 = rank == 0
    tmp, old = _siblings(path)
    if rank0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _recover(path)
        if tmp.exists():  # a save that was killed: its files are garbage
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():  # single process is what we mean: DCP warns about it on every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not _distributed())
    # DCP's coordinator writes .metadata only after every rank reported its writes done: rank 0 sees all files.
    if rank0:
        files = {f.name: _fsync_and_crc(f) for f in sorted(tmp.iterdir())}
        manifest = {"format": _FORMAT, "version": _VERSION, "world_size": world, "leaves": leaves,
                    "files": files}
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        _fsync_dir(tmp)
        if path.exists():
            os.rename(path, old)
            _fsync_dir(path.parent)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return path


def _describe(path: str, x: Any) -> dict[str, Any]:
    if x is None:
        return {"path": path, "kind": "none"}
    if isinstance(x, torch.Tensor):
        entry = {"path": path, "kind": "tensor", "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
        if isinstance(x, DTensor):
            entry["placements"] = [str(p) for p in x.placements]
        return entry
    if isinstance(x, _VALUE_TYPES):
        return {"path": path, "kind": type(x).__name__, "value": x}
    raise TypeError(f"fx.save: the leaf at '{path}' is a {type(x).__name__}; checkpoints hold tensors, DTensors, "
                    "None and Python bool/int/float/str (make it a tensor, or keep it out of the tree)")


def _paths(t: Any) -> list[str]:
    """Dotted leaf paths with NamedTuple fields by name (``opt_state.inner_state.mu.w``), for the manifest."""
    out = []
    for accessor in optree.tree_accessors(t, none_is_leaf=True, namespace="fxtrain"):
        keys = [getattr(e, "field", None) if isinstance(e, optree.NamedTupleEntry) else e.entry for e in accessor]
        out.append(".".join(str(k) for k in keys) or "<root>")
    return out


def _siblings(path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    return path.parent / f".{path.name}.saving", path.parent / f".{path.name}.old"


def _recover(path: pathlib.Path) -> None:
    """Finishes or undoes a commit that a crash interrupted between its two renames."""
    _, old = _siblings(path)
    if old.exists():
        if path.exists():  # the new one was committed; only the cleanup was missed
            shutil.rmtree(old)
        else:
            os.rename(old, path)
            _fsync_dir(path.parent)


def _fsync_and_crc(f: pathlib.Path) -> list[int]:
    crc = _crc(f, fsync=True)
    return [f.stat().st_size, crc]


def _write_synced(f: pathlib.Path, text: str) -> None:
    with open(f, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(d: pathlib.Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- load -----------------------------------------------------------------------------------------

def load(path: str | os.PathLike, *, like: Any, verify: bool = True) -> Any:
    """Reads the checkpoint at ``path`` into a new tree shaped like ``like``.

    ``like`` gives the structure, and for each tensor leaf the shape, dtype, device and (for DTensors)
    the mesh and placements to load into: a checkpoint saved from shards on one mesh loads onto another
    mesh, another world size, or into plain tensors (the full value). Non-tensor leaves come from the
    checkpoint. ``like`` itself is not modified. Under a process group every rank calls it.

    Args:
      path: a directory written by :func:`save`.
      like: a tree of the same structure (``tx.init(params)`` of a freshly built model, say).
      verify: check every file's size and CRC32 against the manifest first (reads the whole checkpoint
        once more; ``False`` only checks sizes).

    Returns:
      The loaded tree, with ``like``'s containers.

    Raises:
      FileNotFoundError: nothing at ``path``.
      CheckpointError: an incomplete, truncated or corrupted checkpoint, naming the file; or one whose
        structure, shapes or dtypes differ from ``like``, naming the first path that differs.
    """
    path = pathlib.Path(path)
    path = _readable(path)
    manifest = _manifest(path)
    _check_files(path, manifest, verify)
    flat, spec = tree.flatten(like)
    saved = manifest["leaves"]
    _check_like(path, saved, _paths(like), flat)
    tensors = {e["path"]: _empty_like(x) for e, x in zip(saved, flat) if e["kind"] == "tensor"}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(path), no_dist=not _distributed())
    except Exception as e:  # noqa: BLE001 - DCP wraps per-rank failures; say which checkpoint it was
        raise CheckpointError(f"checkpoint {path} could not be read: {str(e).splitlines()[0]}") from e
    out = [tensors[e["path"]] if e["kind"] == "tensor" else e.get("value") for e in saved]
    return tree.unflatten(spec, out)


def _readable(path: pathlib.Path) -> pathlib.Path:
    if path.is_dir():
        return path
    _, old = _siblings(path)
    if (old / MANIFEST).exists():  # a save was killed between its two renames: the previous one is here
        return old
    raise FileNotFoundError(f"no checkpoint at {path}")


def _manifest(path: pathlib.Path) -> dict[str, Any]:
    f = path / MANIFEST
    if not f.exists():
        what = "an incomplete save or a DCP checkpoint not written by fx.save" if (path / ".metadata").exists() \
            else "not a checkpoint directory"
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: {what}")
    try:
        manifest = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupted ({e})") from None
    if manifest.get("format") != _FORMAT or manifest.get("version") != _VERSION:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not an fxtrain checkpoint manifest of version "
                              f"{_VERSION}")
    return manifest


def _check_files(path: pathlib.Path, manifest: dict[str, Any], verify: bool) -> None:
    for name, (size, crc) in manifest["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        actual = f.stat().st_size
        if actual != size:
            raise CheckpointError(f"checkpoint {path} is truncated or corrupted: {name} has {actual} bytes, "
                                  f"{size} were written")
        if verify and _crc(f) != crc:
            raise CheckpointError(f"checkpoint {path} is corrupted: {name} does not match its checksum")


def _crc(f: pathlib.Path, fsync: bool = False) -> int:
    """CRC32 of ``f``'s bytes, read in 4 MiB chunks; with ``fsync`` the file is also flushed to disk."""
    crc = 0
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
        if fsync:
            os.fsync(fh.fileno())
    return crc


def _check_like(path: pathlib.Path, saved: list[dict], like_paths: list[str], like_flat: list) -> None:
    saved_paths = [e["path"] for e in saved]
    if saved_paths != like_paths:
        saved_set, like_set = set(saved_paths), set(like_paths)
        for s, l in zip(saved_paths + [None] * len(like_paths), like_paths + [None] * len(saved_paths)):
            if s == l:
                continue
            if l is not None and l not in saved_set:
                raise CheckpointError(f"checkpoint {path} does not match `like` at '{l}': the checkpoint has no "
                                      "leaf there (another model or optimizer stack?)")
            raise CheckpointError(f"checkpoint {path} does not match `like` at '{s}': `like` has no leaf there, "
                                  "the checkpoint does (another model or optimizer stack?)")
    for e, x in zip(saved, like_flat):
        got = _describe(e["path"], x)
        where = f"checkpoint {path} does not match `like` at '{e['path']}'"
        if got["kind"] != e["kind"]:
            raise CheckpointError(f"{where}: {_kind(e)} in the checkpoint, {_kind(got)} in like")
        if e["kind"] == "tensor":
            if got["shape"] != e["shape"]:
                raise CheckpointError(f"{where}: shape {tuple(e['shape'])} in the checkpoint, "
                                      f"{tuple(got['shape'])} in like")
            if got["dtype"] != e["dtype"]:
                raise CheckpointError(f"{where}: dtype {e['dtype']} in the checkpoint, {got['dtype']} in like")


def _kind(e: dict) -> str:
    return {"tensor": "a tensor", "none": "None"}.get(e["kind"], f"a Python {e['kind']}")


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    # DCP loads in place; empty_like of a DTensor is a DTensor on the same mesh with the same placements.
    return torch.empty_like(x.detach(), memory_format=torch.contiguous_format)


# --- a directory of step checkpoints (the training script's layout) ---------------------------------

_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete checkpoint ``directory/step_<N>`` (highest ``N``), or ``None``.

    Partial saves (hidden ``.step_<N>.saving``) are never returned; a step whose commit was interrupted
    between its renames is found as ``.step_<N>.old`` by :func:`load` itself, so its name is returned.

    >>> import tempfile; d = pathlib.Path(tempfile.mkdtemp())
    >>> for n in (5, 10): _ = save(d / f"step_{n:07d}", {"x": torch.ones(1)})
    >>> latest(d).name
    'step_0000010'
    """
    d = pathlib.Path(directory)
    if not d.is_dir():
        return None
    found = []
    for f in d.iterdir():
        name = f.name[1:-4] if f.name.startswith(".") and f.name.endswith(".old") else f.name
        m = _STEP_DIR.match(name)
        if m and (f / MANIFEST).exists():
            found.append((int(m.group(1)), d / name))
    return max(found)[1] if found else None


# --- the save protocol's coordination ---------------------------------------------------------------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()
