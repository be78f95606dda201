"""Checkpoints: ``fx.save(path, tree)`` / ``fx.load(path, like=tree)``, atomic, DTensor-aware, bit-exact.

A checkpoint is a directory: the tensors through ``torch.distributed.checkpoint`` (each rank its shards; loading
onto another mesh or world size reshards) and ``fxtrain.json``, a checksummed manifest of every leaf and file, so
``load`` checks structure, shapes and dtypes against ``like`` and every byte against the manifest before it reads a
tensor, and opens nothing outside the checkpoint. ``save`` writes into ``.<name>.saving`` and renames it into
place; the next save cleans what a dead one left. The file layout, the atomic protocol, leftovers and what a
bit-exact resume saves: docs/reliability.md ("How a checkpoint is written").

Map: :func:`save`, :func:`load`, :func:`verify`, :class:`TrainState`, :func:`rng_state` / :func:`set_rng_state`,
:class:`CheckpointError`; :func:`latest` / :func:`candidates` (a run's checkpoints, newest first);
:func:`open_file`, :func:`read_dcp_metadata` (reading that runs no code and follows no link).

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

import contextlib
import errno
import functools
import hashlib
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import socket
import stat
import time
import warnings
import zlib
from typing import Any, Callable, Iterator, NamedTuple

import optree
import torch
import torch.distributed as dist

from fxtrain import distributed, tree
from fxtrain._deferred import DTensor, deferred_module

dcp = deferred_module("torch.distributed.checkpoint")

__all__ = ["TrainState", "save", "load", "rng_state", "set_rng_state", "latest", "CheckpointError", "read_dcp_metadata",
           "verify", "candidates", "first_failure", "open_file"]

MANIFEST = "fxtrain.json"
_FORMAT = "fxtrain-checkpoint"
_VERSION = 2  # 2: the manifest carries its own checksum ("digest"); 1 had none
_VALUE_TYPES = (bool, int, float, str)  # non-tensor leaves kept in the manifest (JSON), by type
_OWNER = "fxtrain.owner.json"  # written first into .<name>.saving: who saves, so cleanup spares a live save
_STALE_S = 24 * 3600  # a .saving of another host, untouched this long, is abandoned (no save is that quiet)
_REDO = "restore it from a copy, or load another checkpoint (an earlier step)"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (incomplete, truncated, corrupted, edited, of another tree) or a
    tree that cannot be saved as one (two leaves with one path, a live save to the same path).

    Example:
        >>> import tempfile, fxtrain as fx
        >>> try:
        ...     fx.load(tempfile.mkdtemp(), like={})
        ... except fx.CheckpointError as e:
        ...     print(str(e).split(' has ')[1])
        no fxtrain.json: not a checkpoint directory
    """


class TrainState(NamedTuple):
    """Everything a training loop needs to continue exactly where it stopped (a pytree).

    Attributes:
      step: steps taken (a Python int); with ``fxtrain.data`` it is also the data position: the next
        batch is ``data.train[step]``.
      params: the parameter tree (tensors or DTensors).
      opt_state: ``tx.init(params)`` as updated since: every transform's state.
      rng: RNG states (:func:`rng_state`), or ``None``.
      buffers: module buffers (BatchNorm statistics) from :func:`fxtrain.functional`, or ``None``.

    Example:
        >>> import torch, fxtrain as fx
        >>> params = {"w": torch.zeros(2)}
        >>> state = fx.TrainState(step=0, params=params, opt_state=fx.sgd(0.1).init(params), rng=fx.rng_state())
        >>> state.step, state.params is params
        (0, True)
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
    """Restores what :func:`rng_state` returned.

    Example:
        >>> import torch, fxtrain as fx
        >>> saved = fx.rng_state()
        >>> first = torch.rand(2)
        >>> fx.set_rng_state(saved)
        >>> torch.equal(torch.rand(2), first)
        True
    """
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


# --- save -----------------------------------------------------------------------------------------

def save(path: str | os.PathLike, state: Any, *, meta: dict[str, Any] | None = None) -> pathlib.Path:
    """Writes the pytree ``state`` to the directory ``path``, atomically; returns ``path``.

    Leaves may be tensors, DTensors (each rank writes its shards), ``None`` and Python
    ``bool``/``int``/``float``/``str``. Under a process group every rank must call it with the same
    ``path`` (a filesystem all ranks share) and the same tree structure. An existing checkpoint at
    ``path`` is replaced only once the new one is complete. Leftovers of dead saves beside ``path`` are
    cleaned first (see the module doc).

    Args:
      path: the checkpoint directory (created; its parent too).
      state: the tree, e.g. a :class:`TrainState`.
      meta: JSON data kept in the manifest as ``meta`` (checksummed with it; :func:`verify` returns it): the
        runner records the run's config hash, world size and layout there.

    Returns:
      ``path`` as a ``pathlib.Path``.

    Raises:
      TypeError: a leaf of another type, naming its path.
      CheckpointError: two leaves with the same path (naming both), or a live process saving to ``path``.

    >>> import tempfile; d = pathlib.Path(tempfile.mkdtemp())
    >>> save(d / "ck", {"w": torch.ones(2), "step": 3}).name
    'ck'
    >>> save(d / "bad", {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}})
    Traceback (most recent call last):
    ...
    fxtrain.checkpoint.CheckpointError: fx.save: the leaves state['a']['b'] and state['a.b'] have the same path 'a.b' ...
    """
    path = pathlib.Path(path)
    flat, _ = tree.flatten(state)
    paths = _paths(state, "fx.save", "state")
    leaves, tensors = [], {}
    for p, x in zip(paths, flat):
        entry = _describe(p, x)
        leaves.append(entry)
        if entry["kind"] == "tensor":
            tensors[p] = x.detach()
    tensors = _reduced(tensors)
    rank, world = distributed.rank_and_world()
    merged = _every_rank(state, leaves) if _distributed() else leaves
    partitioned, leaves = merged is not leaves, merged
    tmp, _ = _siblings(path)
    _on_rank0(rank, path, "start saving", lambda: _start(path))
    try:
        with warnings.catch_warnings():  # single process is what we mean: DCP warns about it on every call
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not _distributed())
        # DCP's coordinator writes .metadata only after every rank reported its writes done: rank 0 sees all files.
        _on_rank0(rank, path, "commit", lambda: _commit(path, leaves, world, meta, partitioned))
    except BaseException:
        # DCP raises on every rank once every rank is done writing, _on_rank0 too: nobody writes into tmp any more.
        if rank == 0:
            _undo(path)
        raise
    return path


class _Ref:
    """A leaf of a rank's tree in :func:`_every_rank`: which rank's entry, and which of its leaves."""

    def __init__(self, rank: int, index: int):
        self.rank, self.index = rank, index


def _every_rank(state: Any, leaves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's leaves: every rank's, when ranks hold different trees (pipeline stages: each stage's own
    params and state under their own paths), merged into one tree in its flatten order (the whole model's, for
    stages of one model), a path held by several ranks listed once (rank 0's entry); ``leaves`` when every rank
    holds the same tree (one small all-gather of the leaf lists)."""
    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [e["path"] for e in leaves])
    if all(g == gathered[0] for g in gathered):
        return leaves
    spec = tree.structure(state)
    refs = tree.unflatten(spec, [_Ref(dist.get_rank(), i) for i in range(spec.num_leaves)])
    every: list = [None] * world
    dist.all_gather_object(every, (refs, leaves))
    merged = every[0][0]
    for other, _ in every[1:]:
        merged = _merge(merged, other)
    flat = optree.tree_leaves(merged, none_is_leaf=True, namespace="fxtrain")
    return [every[r.rank][1][r.index] for r in flat]


def _merge(a: Any, b: Any) -> Any:
    """The union of two trees of :class:`_Ref` (dicts by key, sequences and NamedTuples position by position);
    where both hold a leaf, ``a``'s."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = list(a) + [k for k in b if k not in a]
        return type(a)((k, _merge(a[k], b[k]) if k in a and k in b else (a[k] if k in a else b[k])) for k in keys)
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        items = [_merge(x, y) for x, y in zip(a, b)]
        return type(a)(*items) if hasattr(a, "_fields") else type(a)(items)
    return a


def _start(path: pathlib.Path) -> None:
    """Cleans what dead saves left beside ``path``, then makes ``.<name>.saving`` with its owner record."""
    tmp, _ = _siblings(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _clean(path.parent, path)
    tmp.mkdir()
    try:
        _write_synced(tmp / _OWNER, json.dumps(_me()) + "\n")
    except BaseException:
        _remove(tmp)
        raise


def _commit(path: pathlib.Path, leaves: list[dict[str, Any]], world: int, meta: dict[str, Any] | None = None,
            partitioned: bool = False) -> None:
    """Lists and checksums what DCP wrote into ``.<name>.saving``, writes the manifest, renames it to ``path``."""
    tmp, old = _siblings(path)
    files = {f.name: _fsync_and_crc(f) for f in sorted(tmp.iterdir())}
    manifest = {"format": _FORMAT, "version": _VERSION, "world_size": world, "leaves": leaves, "files": files}
    if partitioned:  # ranks saved different trees (pipeline stages): each loads its own part (see load)
        manifest["partitioned"] = True
    if meta is not None:
        manifest["meta"] = meta
    manifest["digest"] = _digest(manifest)
    _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    _fsync_dir(tmp)
    if path.exists():
        os.rename(path, old)
        _fsync_dir(path.parent)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    _remove(old)


def _describe(path: str, x: Any) -> dict[str, Any]:
    if x is None:
        return {"path": path, "kind": "none"}
    if isinstance(x, torch.Tensor):
        entry = {"path": path, "kind": "tensor", "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
        if isinstance(x, DTensor):
            entry["placements"] = [str(p) for p in x.placements]
            entry["layout"] = _layout(x)
        return entry
    if isinstance(x, _VALUE_TYPES):
        return {"path": path, "kind": type(x).__name__, "value": x}
    raise TypeError(f"fx.save: the leaf at '{path}' is a {type(x).__name__}; checkpoints hold tensors, DTensors, "
                    "None and Python bool/int/float/str (make it a tensor, or keep it out of the tree)")


def _paths(t: Any, who: str, name: str) -> list[str]:
    """Dotted leaf paths with NamedTuple fields by name (``opt_state.inner_state.mu.w``), for the manifest.

    A path names one leaf in the manifest and in DCP's files, so two leaves with one path (``{"a.b": x,
    "a": {"b": y}}``, keys ``1`` and ``"1"``) raise, naming both as ``name[...]`` expressions; ``who``
    starts the message.
    """
    out, first = [], {}
    for accessor in optree.tree_accessors(t, none_is_leaf=True, namespace="fxtrain"):
        keys = [getattr(e, "field", None) if isinstance(e, optree.NamedTupleEntry) else e.entry for e in accessor]
        p = ".".join(str(k) for k in keys) or "<root>"
        if p in first:
            raise CheckpointError(f"{who}: the leaves {first[p].codify(name)} and {accessor.codify(name)} have "
                                  f"the same path '{p}' (a checkpoint names a leaf by its keys joined with '.', "
                                  "so they would load as one); rename one of the keys")
        first[p] = accessor
        out.append(p)
    return out


def _digest(manifest: dict[str, Any]) -> str:
    """``sha256:<hex>`` of the manifest's JSON with keys sorted, no spaces, and ``digest`` itself left out."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _siblings(path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    return path.parent / f".{path.name}.saving", path.parent / f".{path.name}.old"


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


# --- leftovers of interrupted saves -------------------------------------------------------------------

_LEFTOVER = re.compile(r"^\.(.+)\.(saving|old)$")


def _clean(parent: pathlib.Path, path: pathlib.Path) -> None:
    """Before saving ``path``: removes the ``.saving`` of dead saves in ``parent`` (and ``path``'s own, unless
    a live process is saving there: that raises), then puts back or removes the ``.old`` of interrupted
    commits. A ``.saving`` without an owner record or an ``.old`` without a manifest is not fxtrain's and
    stays, unless it is ``path``'s own. A sibling that cannot be removed (another user's) stays too."""
    found = [(d, *m.groups()) for d in sorted(parent.iterdir())
             if (m := _LEFTOVER.match(d.name)) and (d.is_dir() or d.is_symlink())]
    # .saving first: an .old is put back only while no save of its name is under way
    for d, name, kind in sorted(found, key=lambda f: f[2] == "old"):
        own = parent / name == path
        try:
            if d.is_symlink():  # not fxtrain's (a save makes directories): never followed; path's own is unlinked
                if own:
                    d.unlink()
            elif kind == "saving":
                _clean_saving(d, path if own else None)
            else:
                _clean_old(d, parent / name, own)
        except OSError:
            if own:
                raise


def _clean_saving(d: pathlib.Path, own: pathlib.Path | None) -> None:
    owner = _owner(d)
    if own is not None:
        if owner is not None and owner.get("pid") != os.getpid() and _alive(owner):
            raise CheckpointError(f"fx.save: another process (pid {owner.get('pid')} on {owner.get('host')}) is "
                                  f"saving to {own} right now, into {d}; wait for it to finish or stop it, then "
                                  "save again")
        _remove(d)
    elif owner is not None and _abandoned(d, owner):
        _remove(d)


def _clean_old(d: pathlib.Path, target: pathlib.Path, own: bool) -> None:
    if not (own or (d / MANIFEST).exists()):
        return
    if (target / MANIFEST).exists() or (own and target.exists()):
        _remove(d)  # the new one was committed; only the cleanup was missed
    elif not target.exists() and not _siblings(target)[0].exists():  # and no save of it is under way
        try:
            os.rename(d, target)  # the commit was interrupted between its renames: the previous one is back
        except OSError:  # a save of `target` committed meanwhile; the next save removes d
            return
        _fsync_dir(target.parent)


def _undo(path: pathlib.Path) -> None:
    """After a save of ``path`` raised: removes its ``.saving`` and puts the previous checkpoint back if it
    was aside. Never raises (the save's own error is the one to see)."""
    tmp, old = _siblings(path)
    try:
        if old.exists() and not path.exists():
            os.rename(old, path)
        _remove(tmp)
    except OSError:
        pass


def _me() -> dict[str, Any]:
    """The owner record of a save: enough for another process to tell whether this one still runs."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _proc(pid)[1],
            "boot": _read("/proc/sys/kernel/random/boot_id"), "pid_namespace": _pid_namespace(), "time": time.time()}


def _owner(d: pathlib.Path) -> dict[str, Any] | None:
    try:
        with open_file(d / _OWNER, d) as fh:
            owner = json.loads(fh.read(1 << 16).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):  # CheckpointError is a ValueError: a link, a FIFO
        return None
    return owner if isinstance(owner, dict) else None


def _alive(owner: dict[str, Any]) -> bool | None:
    """Whether the process that wrote ``owner`` runs: ``True``, ``False``, or ``None`` when this process cannot
    tell: another host, another boot of this one (a host name alone does not tell machines apart), or
    another pid namespace. A pid reused since counts as dead where ``/proc`` gives start times; where it
    does not, as alive (a leftover kept is the safe mistake)."""
    me = _me()
    if any(owner.get(k) != me[k] for k in ("host", "boot", "pid_namespace")):
        return None
    pid = owner.get("pid")
    if type(pid) is not int or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    state, started = _proc(pid)
    if state == "Z":  # killed, not yet reaped by its parent
        return False
    return started is None or owner.get("started") is None or started == owner["started"]


def _abandoned(d: pathlib.Path, owner: dict[str, Any]) -> bool:
    alive = _alive(owner)
    if alive is not None:
        return not alive
    try:  # cannot tell from here: abandoned if nothing in it changed for _STALE_S
        newest = max([d.stat().st_mtime] + [f.stat().st_mtime for f in d.iterdir()])
    except OSError:
        return False
    return time.time() - newest > _STALE_S


def _proc(pid: int) -> tuple[str | None, int | None]:
    """(state, start time in clock ticks since boot) of ``pid`` from ``/proc/<pid>/stat``; ``None`` each
    where there is no ``/proc``."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None, None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name, in parentheses, may hold spaces
    return fields[0], int(fields[19])


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _read(f: str) -> str | None:
    try:
        with open(f, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _remove(d: pathlib.Path) -> None:
    """Removes a ``.saving`` or ``.old`` directory, its owner record and manifest last: a crash halfway leaves
    it still recognisable as fxtrain's, for the next save to finish. What is gone already (another
    process's cleanup got there first) is skipped. A symbolic link is removed itself, never followed."""
    if d.is_symlink():
        d.unlink(missing_ok=True)
        return
    try:
        files = sorted(d.iterdir(), key=lambda f: f.name in (_OWNER, MANIFEST))
    except FileNotFoundError:
        return
    for f in files:
        try:
            shutil.rmtree(f) if f.is_dir() and not f.is_symlink() else f.unlink()
        except FileNotFoundError:
            pass
    try:
        d.rmdir()
    except FileNotFoundError:
        pass


# --- load -----------------------------------------------------------------------------------------

def load(path: str | os.PathLike, *, like: Any, verify: bool = True, saved_placements: bool = False,
         part: bool = False) -> Any:
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
      saved_placements: DTensor leaves keep the placements they were saved with where ``like``'s mesh has the
        shape of the one they were saved on (a resume on the same layout: an accumulated gradient's placements
        may differ from its param's); ``False``: ``like``'s, each leaf's value placed so (``Partial`` terms
        summed, unless ``like``'s leaf is ``Partial`` the same way: then its terms, exactly).
        A checkpoint whose ranks saved different trees (pipeline stages) loads into a ``like`` that is one
        rank's part, or the whole tree.
      part: ``like`` may be a part of the saved tree (a pipeline stage's params and state, from the checkpoint
        of a whole model): only its leaves are read. ``False``: the trees must match.

    Returns:
      The loaded tree, with ``like``'s containers.

    Raises:
      FileNotFoundError: nothing at ``path``.
      CheckpointError: an incomplete, truncated or corrupted checkpoint, naming the file; a manifest that
        was edited or is malformed (its checksum is verified even with ``verify=False``); one whose
        structure, shapes or dtypes differ from ``like``, naming the first path that differs; or a
        ``like`` with two leaves of the same path.

    >>> import json, tempfile; d = pathlib.Path(tempfile.mkdtemp())
    >>> path = save(d / "ck", {"w": torch.ones(2), "step": 25})
    >>> back = load(path, like={"w": torch.zeros(2), "step": 0})
    >>> back["step"], back["w"].tolist()
    (25, [1.0, 1.0])
    >>> edited = (path / MANIFEST).read_text().replace('"value": 25', '"value": 65')
    >>> _ = (path / MANIFEST).write_text(edited)
    >>> load(path, like={"w": torch.zeros(2), "step": 0})
    Traceback (most recent call last):
    ...
    fxtrain.checkpoint.CheckpointError: checkpoint .../ck: fxtrain.json does not match its checksum ...
    """
    path = _readable(pathlib.Path(path))
    flat, spec = tree.flatten(like)
    like_paths = _paths(like, f"checkpoint {path} cannot be loaded into `like`", "like")
    manifest = _manifest(path)
    _check_files(path, manifest, verify)
    saved = manifest["leaves"]
    if manifest.get("partitioned") is True or part:  # pipeline stages: `like` is one stage's part (or the whole)
        mine = set(like_paths)
        saved = [e for e in saved if e["path"] in mine] if mine <= {e["path"] for e in saved} else saved
    _check_like(path, saved, like_paths, flat)
    _check_dcp(path, manifest)
    likes = {e["path"]: x for e, x in zip(saved, flat) if e["kind"] == "tensor"}
    entries = {e["path"]: e for e in saved}
    tensors = {k: _empty_like(x, entries[k], saved_placements) for k, x in likes.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=_safe_reader()(path), no_dist=not _distributed())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP wraps per-rank failures in a BaseException; say which checkpoint
        cause = first_failure(e)
        raise CheckpointError(f"checkpoint {path} could not be read: {type(cause).__name__}: "
                              f"{(str(cause).splitlines() or [''])[0]}") from cause
    tensors = {k: _loaded(v, likes[k], entries[k]) for k, v in tensors.items()}
    out = [tensors[e["path"]] if e["kind"] == "tensor" else e.get("value") for e in saved]
    return tree.unflatten(spec, out)


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Checks the checkpoint at ``path`` as :func:`load` does before reading a tensor (the manifest and its
    checksum, every file's size and CRC32, DCP's ``.metadata`` read without running code) and returns its
    manifest: ``world_size``, ``meta`` (what ``save(meta=...)`` recorded, ``{}`` without), ``leaves``...

    Raises:
      FileNotFoundError: nothing at ``path``.
      CheckpointError: what :func:`load` would refuse, naming the file.

    >>> import tempfile; d = pathlib.Path(tempfile.mkdtemp())
    >>> m = verify(save(d / "ck", {"w": torch.ones(2)}, meta={"layout": "parallel=none"}))
    >>> m["world_size"], m["meta"]
    (1, {'layout': 'parallel=none'})
    """
    path = _readable(pathlib.Path(path))
    manifest = _manifest(path)
    _check_files(path, manifest, True)
    _check_dcp(path, manifest)
    return {**manifest, "meta": manifest.get("meta", {})}


def _readable(path: pathlib.Path) -> pathlib.Path:
    """``path``, or its ``.old`` sibling when a save was killed between its renames; a link is refused."""
    _, old = _siblings(path)
    for d in (path, old):
        if d.is_symlink():  # a step_N linked into another run would continue that run's state under this name
            raise CheckpointError(f"checkpoint {d} is a symbolic link (to {os.readlink(d)}): a checkpoint is read "
                                  "from its own directory, never through a link (another run's checkpoint?); pass "
                                  "the directory it links to, if that is the one you mean")
    if path.is_dir():
        return path
    if (old / MANIFEST).exists():  # a save was killed between its two renames: the previous one is here
        return old
    raise FileNotFoundError(f"no checkpoint at {path}")


def _manifest(path: pathlib.Path) -> dict[str, Any]:
    """The manifest, once its checksum and its shape are verified: every key ``load`` reads is there, with
    the type it expects; anything else is one :class:`CheckpointError` naming what is wrong."""
    f = path / MANIFEST
    if not f.exists():
        what = "an incomplete save or a DCP checkpoint not written by fx.save" if (path / ".metadata").exists() \
            else "not a checkpoint directory"
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: {what}")
    with open_file(f, path) as fh:
        text = fh.read()
    try:
        manifest = json.loads(text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupted ({e}); {_REDO}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a JSON object; {_REDO}")
    if manifest.get("format") != _FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not an fxtrain checkpoint manifest "
                              f"(format {manifest.get('format')!r}); pass a directory written by fx.save")
    if manifest.get("version") != _VERSION:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is version {manifest.get('version')!r}, this fxtrain "
                              f"reads version {_VERSION} (version 1 manifests had no checksum); load it with the "
                              "fxtrain that wrote it and save it again, or load another checkpoint")
    if not isinstance(manifest.get("digest"), str):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} has no checksum ('digest'), so it was edited or not "
                              f"written by fx.save; {_REDO}")
    if manifest["digest"] != _digest(manifest):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not match its checksum (edited or damaged since "
                              f"it was saved); {_REDO}")
    _check_manifest(path, manifest)
    return manifest


def _check_manifest(path: pathlib.Path, manifest: dict[str, Any]) -> None:
    """Checks the shape of a manifest whose checksum matched (so written by a tool, or an fxtrain with a bug)."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed: {what}; {_REDO}")

    world, leaves, files = manifest.get("world_size"), manifest.get("leaves"), manifest.get("files")
    if type(world) is not int or world < 1:
        raise bad(f"'world_size' is {world!r}, not a positive int")
    if not isinstance(leaves, list):
        raise bad("'leaves' is not a list")
    if not isinstance(files, dict):
        raise bad("'files' is not a map of file name to [size, crc32]")
    if not isinstance(manifest.get("meta", {}), dict):
        raise bad("'meta' is not a JSON object")
    for name, entry in files.items():
        if name in ("", ".", "..", MANIFEST) or "/" in name or "\\" in name:
            raise bad(f"'files' lists {name!r}, which is not a data file of this directory")
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int and v >= 0 for v in entry)):
            raise bad(f"the entry of {name} in 'files' is {entry!r}, not [size, crc32]")
    seen = set()
    for i, e in enumerate(leaves):
        if not isinstance(e, dict) or not isinstance(e.get("path"), str):
            raise bad(f"leaf {i} of 'leaves' has no path")
        leaf, kind = f"the leaf '{e['path']}'", e.get("kind")
        if e["path"] in seen:
            raise bad(f"{leaf} is listed twice (two leaves would load as one)")
        seen.add(e["path"])
        if kind == "tensor":
            shape, dtype = e.get("shape"), e.get("dtype")
            if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
                raise bad(f"{leaf} has shape {shape!r}, not a list of sizes")
            if not (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)):
                raise bad(f"{leaf} has dtype {dtype!r}, not a torch dtype")
        elif kind in _KINDS:
            if "value" not in e:
                raise bad(f"{leaf} has no value")
            if type(e["value"]) is not _KINDS[kind]:
                raise bad(f"{leaf} has value {e['value']!r}, not a Python {kind}")
        elif kind != "none":
            raise bad(f"{leaf} has kind {kind!r}, not one of tensor, none, " + ", ".join(_KINDS))


_KINDS = {t.__name__: t for t in _VALUE_TYPES}  # a Python leaf's "kind" in the manifest -> its type


def _check_files(path: pathlib.Path, manifest: dict[str, Any], verify: bool) -> None:
    """Every file DCP wrote is listed (``.metadata`` always is), and each listed file has its size and CRC."""
    files = manifest["files"]
    for f in sorted(path.iterdir()):
        if (f.name == ".metadata" or f.suffix == ".distcp") and f.name not in files:
            raise CheckpointError(f"checkpoint {path}: {f.name} is not listed in {MANIFEST} (the manifest was "
                                  f"edited, or files of another save were copied in); {_REDO}")
    for name in sorted({".metadata", *files}):
        if name not in files:  # .metadata, not listed: the loop above found none
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        size, crc = files[name]
        with open_file(path / name, path) as fh:  # a regular file of this directory, or refused: never waits
            actual = os.fstat(fh.fileno()).st_size
            if actual != size:
                raise CheckpointError(f"checkpoint {path} is truncated or corrupted: {name} has {actual} bytes, "
                                      f"{size} were written")
            if verify and _crc_of(fh, size) != crc:
                raise CheckpointError(f"checkpoint {path} is corrupted: {name} does not match its checksum")


def _check_dcp(path: pathlib.Path, manifest: dict[str, Any]) -> None:
    """The manifest's tensor leaves are exactly the tensors DCP's ``.metadata`` holds, in files it lists."""
    metadata = _safe_reader()(path).read_metadata()
    stored = set(metadata.state_dict_metadata)
    listed = [e["path"] for e in manifest["leaves"] if e["kind"] == "tensor"]
    for p in listed:
        if p not in stored:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists the tensor '{p}', which DCP's .metadata "
                                  f"does not hold; {_REDO}")
    for p in sorted(stored - set(listed)):
        raise CheckpointError(f"checkpoint {path}: DCP's .metadata holds the tensor '{p}', which {MANIFEST} does "
                              f"not list; {_REDO}")
    for name in sorted({info.relative_path for info in metadata.storage_data.values()} - set(manifest["files"])):
        raise CheckpointError(f"checkpoint {path}: DCP's .metadata refers to {name}, which {MANIFEST} does not "
                              f"list; {_REDO}")


def first_failure(error: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException`` (a ``BaseException`` holding each failed rank's error):
    the lowest failed rank's; any other error is itself.

    >>> from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
    >>> first_failure(CheckpointException("save", {1: _wrap_exception(OSError(28, "No space left on device"))}))
    OSError(28, 'No space left on device')
    """
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        found = failures[min(failures)]
        if isinstance(found, tuple) and found and isinstance(found[0], BaseException):
            return found[0]
    return error


# --- DCP's .metadata, read without running code ------------------------------------------------------
# DCP writes .metadata as a pickle and reads it with pickle.load, which runs whatever callable the file names:
# a crafted checkpoint would run code at load. It is read here by an unpickler that resolves only the classes
# and values DCP's metadata of fx.save's tensors is made of (listed from the files torch writes), and refuses
# any other global, naming the file. BytesStorageMetadata is not among them: fx.save writes no pickled objects,
# and DCP reads those with an unrestricted torch.load. The tensor files are read by DCP with
# torch.load(weights_only=True). The manifest's digest detects damage, not tampering (it has no key): what keeps
# a checkpoint from running code is that nothing in it is read by a loader that can.

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by name (torch.strided)
    "torch": {"Size"},                        # and the dtypes, below
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
}


class _Refused(pickle.UnpicklingError):
    """What the metadata names is not on the allow-list (as opposed to a damaged pickle)."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`_DCP_CLASSES` and torch dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                      torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"it names {module}.{name}, which DCP's metadata never holds (a crafted file "
                                     "would run it: refused, nothing was run)")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it holds a persistent id, which DCP's metadata never does")


def read_dcp_metadata(path: str | os.PathLike) -> Any:
    """DCP's ``Metadata`` of the checkpoint directory ``path``, unpickled without running any code it names.

    Raises:
      CheckpointError: ``.metadata`` names a class or function DCP's metadata of tensors does not hold (a
        crafted file), or does not unpickle, or is not DCP's ``Metadata``; naming the file.

    >>> import tempfile; d = pathlib.Path(tempfile.mkdtemp())
    >>> sorted(read_dcp_metadata(save(d / "ck", {"w": torch.ones(2)})).state_dict_metadata)
    ['w']
    >>> _ = (d / "ck" / ".metadata").write_bytes(pickle.dumps(print))
    >>> read_dcp_metadata(d / "ck")
    Traceback (most recent call last):
    ...
    fxtrain.checkpoint.CheckpointError: checkpoint .../ck: .metadata is refused: it names builtins.print, ...
    """
    from torch.distributed.checkpoint.metadata import Metadata

    path = pathlib.Path(path)
    try:
        with open_file(path / ".metadata", path) as fh:
            data = fh.read()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: .metadata cannot be read ({e.strerror or e})") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise CheckpointError(f"checkpoint {path}: .metadata is refused: {e}") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in many ways; none of them runs code
        raise CheckpointError(f"checkpoint {path}: .metadata is damaged ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); {_REDO}") from None
    if type(metadata) is not Metadata or not isinstance(getattr(metadata, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(f"checkpoint {path}: .metadata is not DCP's metadata (a {type(metadata).__name__}); "
                              f"{_REDO}")
    return metadata


@functools.cache
def _safe_reader() -> type:
    """DCP's file reader with :func:`read_dcp_metadata` in place of its ``pickle.load`` of ``.metadata``, and every
    file opened through :func:`open_file` (classes made on first use: their bases import
    ``torch.distributed.checkpoint``, which ``import fxtrain`` defers)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _CheckedFileSystem(FileSystem):
        """DCP's file system, reading through :func:`open_file`: no link followed, no FIFO or device opened."""

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            if mode != "rb":
                raise CheckpointError(f"checkpoint {pathlib.Path(path).parent}: opened to write ({mode!r}) while "
                                      "loading")
            path = pathlib.Path(path)
            with open_file(path, path.parent) as fh:
                yield fh

    class _SafeReader(dcp.FileSystemReader):
        def __init__(self, path: str | os.PathLike) -> None:
            super().__init__(path)
            self.fs = _CheckedFileSystem()

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:  # per-rank metadata files: fx.save never writes them
                raise CheckpointError(f"checkpoint {self.path}: per-rank DCP metadata is not read by fxtrain")
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_dcp_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader


def open_file(f: str | os.PathLike, checkpoint: str | os.PathLike) -> io.BufferedReader:
    """The file ``f`` of the checkpoint directory ``checkpoint``, opened for reading once it is known to be a
    regular file there: opened with ``O_NOFOLLOW`` (a symbolic link, to another run's file or to ``/dev/zero``,
    is refused) and ``O_NONBLOCK`` (so that opening a FIFO returns at once instead of waiting for a writer),
    then checked with ``os.fstat`` on the opened descriptor (a FIFO, a device, a socket is refused). Every
    file :func:`load` and :func:`verify` read, DCP's included, is opened here.

    Raises:
      CheckpointError: ``f`` is missing, a link, or not a regular file; one line naming it and ``checkpoint``.

    >>> import tempfile; d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a").write_bytes(b"xy"); (d / "b").symlink_to("/dev/zero")
    >>> with open_file(d / "a", d) as fh: fh.read()
    b'xy'
    >>> open_file(d / "b", d)
    Traceback (most recent call last):
    ...
    fxtrain.checkpoint.CheckpointError: checkpoint ...: b is a symbolic link (to /dev/zero), not a file of the checkpoint; ...
    """
    f = pathlib.Path(f)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(f, flags)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {checkpoint} is incomplete: {f.name} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP or f.is_symlink():  # O_NOFOLLOW on a link: ELOOP (EMLINK on some BSDs)
            raise CheckpointError(f"checkpoint {checkpoint}: {f.name} is a symbolic link (to {os.readlink(f)}), not "
                                  f"a file of the checkpoint; {_REDO}") from None
        raise CheckpointError(f"checkpoint {checkpoint}: {f.name} cannot be read ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
                if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special")
        raise CheckpointError(f"checkpoint {checkpoint}: {f.name} is {kind}, not a regular file (reading it could "
                              f"wait for ever or never end); {_REDO}")
    os.set_blocking(fd, True)  # no effect on a regular file; reads stay plain
    return os.fdopen(fd, "rb")


def _crc_of(fh: io.BufferedReader, size: int) -> int:
    """CRC32 of the first ``size`` bytes of the open file ``fh`` (its size, checked), in 4 MiB chunks."""
    crc, left = 0, size
    while left > 0 and (chunk := fh.read(min(1 << 22, left))):
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc


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


def _empty_like(x: torch.Tensor, entry: dict[str, Any], saved: bool = False) -> torch.Tensor:
    """The tensor DCP loads ``entry`` into, in place: ``x``'s mesh with the placements the leaf was saved with
    (a gradient held by ``accumulate`` keeps its own, which may differ from its param's), Partial ones as their
    stacked terms (see :func:`_stacked`); a plain tensor for a plain ``x`` (a Partial leaf: all its terms)."""
    if not isinstance(x, DTensor):
        terms = _saved_terms(entry)
        return torch.empty((*terms, *x.shape), dtype=x.dtype, device=x.device) if terms else \
            torch.empty_like(x.detach(), memory_format=torch.contiguous_format)
    placements = _saved_placements(entry, x)
    if placements is not None and not saved and placements != tuple(x.placements):
        # Into another layout (a mesh of the same shape may mean other dims: tp's (2,) is not dp's): the leaf's
        # value, Partial terms reduced, placed like x. Issue 35: tp -> dp kept tp's Shard on the dp mesh.
        placements = None if _saved_terms(entry) else tuple(x.placements)
    if placements is None:  # saved on another mesh: the full value, on every rank, then placed like x
        terms = _saved_terms(entry)
        return torch.empty((*terms, *x.shape), dtype=x.dtype, device=x._local_tensor.device)
    target = DTensor.from_local(torch.empty_like(x._local_tensor), x.device_mesh, x.placements, run_check=False,
                                shape=x.shape, stride=x.stride())
    if placements != tuple(x.placements):
        target = torch.distributed.tensor.empty(x.shape, dtype=x.dtype, device_mesh=x.device_mesh,
                                                placements=_replicated(placements))
        target = DTensor.from_local(target._local_tensor, x.device_mesh, placements, run_check=False,
                                    shape=x.shape, stride=distributed.contiguous_stride(x.shape))
    return _stacked(target)


# --- DTensors: placements and Partial terms -------------------------------------------------------------
# DCP refuses Partial placements: each rank's piece is a term of a sum, not a part of a tensor. A Partial
# DTensor (accumulate's window sum under data parallelism) is saved as its terms, exactly: one new leading
# dim per Partial mesh dim, sharded over that mesh dim (Shard), so every rank writes its own term and loads
# it back bit for bit. The manifest records each DTensor's placements ("layout"), so a leaf loads with the
# placements it was saved with on the same mesh (a held gradient's, which may differ from its param's), and
# a resumed run adds into an accumulator laid out as the uninterrupted run's. Loaded into a plain tensor or
# onto another mesh, the terms are reduced (sum, or mean for avg) and the value placed like `like`.

_PLACEMENT_KINDS = {"S": "Shard", "SS": "_StridedShard", "R": "Replicate", "P": "Partial"}


def _layout(x: DTensor) -> dict[str, Any]:
    """``x``'s mesh shape and placements as JSON (``["S", dim]``, ``["SS", dim, split]``, ``["R"]``, ``["P", op]``)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    def one(p: Any) -> list:
        if isinstance(p, _StridedShard):
            return ["SS", p.dim, p.split_factor]
        if p.is_shard():
            return ["S", p.dim]
        if p.is_partial():
            return ["P", p.reduce_op]
        return ["R"]

    return {"mesh": list(x.device_mesh.shape), "placements": [one(p) for p in x.placements]}


def _saved_placements(entry: dict[str, Any], like: DTensor) -> tuple | None:
    """The placements ``entry`` was saved with, for ``like``'s mesh; ``like``'s own when the manifest has none
    (saved as a plain tensor); ``None`` when it was saved on a mesh of another shape."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    layout = entry.get("layout")
    if not isinstance(layout, dict):
        return tuple(like.placements)
    if layout.get("mesh") != list(like.device_mesh.shape):
        return None
    make = {"S": lambda d: Shard(d), "SS": lambda d, f: _StridedShard(d, split_factor=f), "R": Replicate,
            "P": lambda op: Partial(op)}
    try:
        return tuple(make[p[0]](*p[1:]) for p in layout["placements"])
    except (KeyError, TypeError, IndexError, ValueError):
        raise CheckpointError(f"checkpoint: the leaf '{entry['path']}' has layout {layout!r}, not a mesh shape and "
                              f"placements; {_REDO}") from None


def _saved_terms(entry: dict[str, Any]) -> tuple[int, ...]:
    """The sizes of the Partial mesh dims a leaf was saved with: its stacked terms (``()``: none)."""
    layout = entry.get("layout")
    if not isinstance(layout, dict):
        return ()
    return tuple(n for n, p in zip(layout.get("mesh", ()), layout.get("placements", ())) if p and p[0] == "P")


def _stacked(x: torch.Tensor) -> torch.Tensor:
    """A Partial DTensor as its terms: a new leading dim per Partial mesh dim, Shard on it; others as they are."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not (isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)):
        return x
    mesh, n = x.device_mesh, sum(p.is_partial() for p in x.placements)
    placements, k = [], 0
    for p in x.placements:
        if p.is_partial():
            placements.append(Shard(k))
            k += 1
        elif isinstance(p, _StridedShard):
            placements.append(_StridedShard(p.dim + n, split_factor=p.split_factor))
        elif p.is_shard():
            placements.append(Shard(p.dim + n))
        else:
            placements.append(p)
    sizes = tuple(mesh.size(d) for d, p in enumerate(x.placements) if p.is_partial())
    shape = (*sizes, *x.shape)
    local = x._local_tensor.reshape((1,) * n + tuple(x._local_tensor.shape))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=distributed.contiguous_stride(shape))


def _replicated(placements: tuple) -> tuple:
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _reduced(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors DCP writes: Partial DTensors as their stacked terms (no communication, exact)."""
    return {k: _stacked(x) for k, x in tensors.items()}


def _loaded(loaded: torch.Tensor, like: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
    """What DCP loaded, back in the form the tree holds: terms unstacked into Partial, or reduced."""
    terms = _saved_terms(entry)
    if isinstance(like, DTensor) and isinstance(loaded, DTensor):
        if terms:
            placements = _saved_placements(entry, like)  # the terms of this rank, on the mesh they were saved from
            local = loaded._local_tensor.reshape(loaded._local_tensor.shape[len(terms):])
            return DTensor.from_local(local, like.device_mesh, placements, run_check=False, shape=like.shape,
                                      stride=distributed.contiguous_stride(like.shape))
        return loaded
    if terms:  # every term, as a plain tensor: their value
        ops = [p[1] for p in entry["layout"]["placements"] if p[0] == "P"]
        if len(set(ops)) == 1:
            dims = tuple(range(len(terms)))
            value = loaded.mean(dim=dims) if ops[0] == "avg" else loaded.sum(dim=dims)
        else:  # each term dim by its own op: e.g. FSDP x TP's held sum of a norm weight, avg over dp, sum over tp
            value = loaded
            for d in reversed(range(len(ops))):
                value = value.mean(dim=d) if ops[d] == "avg" else value.sum(dim=d)
        loaded = value.to(like.dtype)
    if isinstance(like, DTensor):  # saved on another mesh: placed like `like` from the full value on every rank
        from torch.distributed.tensor import distribute_tensor

        placed = distribute_tensor(loaded, like.device_mesh, _replicated(like.placements), src_data_rank=None)
        return _as_partial(placed, like)
    return loaded


def _as_partial(loaded: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A Replicate value as ``like``'s Partial placements: the value on the first rank of each sum dim, zeros
    elsewhere (avg: the value everywhere)."""
    if not (isinstance(like, DTensor) and any(p.is_partial() for p in like.placements)):
        return loaded
    local = loaded._local_tensor
    mesh = like.device_mesh
    for d, p in enumerate(like.placements):
        if p.is_partial() and p.reduce_op == "sum" and mesh.get_local_rank(d) != 0:
            local = torch.zeros_like(local)
    return DTensor.from_local(local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


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
    found = candidates(directory)
    return found[0] if found else None


def candidates(directory: str | os.PathLike) -> list[pathlib.Path]:
    """Every complete checkpoint ``directory/step_<N>``, newest first (what :func:`latest` picks from), for a
    caller that goes back to an older one when the newest does not :func:`verify`.

    >>> import tempfile; d = pathlib.Path(tempfile.mkdtemp())
    >>> for n in (5, 10): _ = save(d / f"step_{n:07d}", {"x": torch.ones(1)})
    >>> [p.name for p in candidates(d)]
    ['step_0000010', 'step_0000005']
    """
    d = pathlib.Path(directory)
    if not d.is_dir():
        return []
    found = []
    for f in d.iterdir():
        name = f.name[1:-4] if f.name.startswith(".") and f.name.endswith(".old") else f.name
        m = _STEP_DIR.match(name)
        if m and (f / MANIFEST).exists():
            found.append((int(m.group(1)), d / name))
    return [p for _, p in sorted(set(found), reverse=True)]


# --- the save protocol's coordination ---------------------------------------------------------------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _on_rank0(rank: int, path: pathlib.Path, what: str, fn: Callable[[], None]) -> None:
    """Runs ``fn`` on rank 0, then every rank goes on together (a barrier), or raises if rank 0's ``fn``
    raised: rank 0 its own error, the others a :class:`CheckpointError` saying so (none waits for ever)."""
    failed = None
    if rank == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - passed on to every rank, then raised here as it is
            failed = e
    why = None if failed is None else f"{type(failed).__name__}: {failed}".splitlines()[0]
    if _distributed():
        box = [why]
        dist.broadcast_object_list(box, src=0)
        why = box[0]
    if failed is not None:
        raise failed
    if why is not None:
        raise CheckpointError(f"fx.save: rank 0 could not {what} {path}: {why}")
