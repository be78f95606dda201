"""A run directory belongs to one run: who owns it, one live process at a time, its files rewound on resume.

The training script's directory (``hydra.run.dir``, or a sweep job's) is managed the way orbax's
``CheckpointManager`` manages its directory: what is in it was written by one run, and nothing another
launch does can mix into it or delete from it.

Map: :func:`claim` / :class:`Claim` (ownership by config hash, :data:`UNHASHED`; the lock; :func:`check_layout`),
:func:`accepted` / :func:`withdraw` / :class:`HydraFiles` / :func:`write_refused` (nothing written before a launch is
accepted), :func:`rewind` and :func:`prune` (one timeline; ``keep_last``), :func:`write_json` / :func:`read_summary`.
The rules, and why: docs/reliability.md ("How a run directory is kept").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
from typing import Any, Iterator

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fxtrain.errors import ConfigError
from fxtrain import build, checkpoint, distributed, report

__all__ = ["RunDirError", "UNHASHED", "config_hash", "claim", "Claim", "accepted", "withdraw", "rewind", "prune", "write_json", "read_summary",
           "check_layout", "describe_layout", "differing", "write_refused", "HydraFiles"]

OWNER = "run.json"  # {"config_sha256": ..., "config": {...}}: the run this directory belongs to
LOCK = "run.lock"   # flock'ed by the live process; holds its pid and host
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
# Keys (or whole nodes) that do not change what a run computes, only how it is launched or recorded: a relaunch
# may change them.
UNHASHED = ("resume", "resume_force", "resume_relayout", "trainer.progress", "trainer.cpu_threads", "trainer.keep_last", "trainer.eval_batch_size",
            "trainer.export", "trainer.orbax_naming", "logger",
            # how a map-style source's items are loaded, not which: the batches of a step are the same
            "data.num_workers", "data.prefetch_factor", "data.pin_memory", "data.persistent_workers")
_STEP = re.compile(r"^step_(\d+)$")


class RunDirError(ConfigError):
    """A launch refused by its run directory: another run's directory, the same run without ``resume``, or a
    directory another live process holds. Nothing was written."""


def config_hash(cfg: DictConfig | dict) -> tuple[str, dict[str, Any]]:
    """``(sha256 hex, flat config)`` of the resolved ``cfg`` without the :data:`UNHASHED` keys."""
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if prefix in UNHASHED:  # a key, or a whole node (logger: which loggers record the run)
            return
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = node

    walk(container, "")
    text = json.dumps(flat, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest(), json.loads(text)


@contextlib.contextmanager
def claim(out: str | os.PathLike | None, cfg: DictConfig, *, defer: bool = False) -> Iterator[Claim]:
    """Holds the run directory ``out`` for the run ``cfg`` describes (see the module doc), until the block ends.

    ``None`` (a run that writes nothing) claims nothing. Under torchrun rank 0 claims and every rank gets
    its verdict. With ``defer`` the directory is only checked here (its lock taken if it has one) and written
    nothing: ``run.json``, Hydra's files and the lock's holder record are written by :meth:`Claim.accept`, which
    the runner calls once everything that can refuse the launch (the resume's checkpoint, the data, the model,
    the layout) has been built, so that a refused launch leaves no file, in a fresh directory too.

    Raises:
      RunDirError: the directory holds another run, this run without ``resume``, or another live process.
      fxtrain.errors.ConfigError: ``trainer.keep_last`` is negative.
    """
    if out is not None:
        _LAUNCHED[_key(out)] = False  # this launch's verdict (accepted) replaces an earlier one's
    keep_last = cfg.trainer.get("keep_last", 0)
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 0:
        raise ConfigError(f"trainer.keep_last={keep_last!r}: expected the number of checkpoints to keep, "
                                "a positive integer, or 0 to keep every checkpoint")
    held = Claim(None if out is None else pathlib.Path(out), cfg)
    try:
        held.check() if defer else held.accept()
        yield held
    finally:
        held.release()


class Claim:
    """A run directory :func:`claim` holds: checked (:meth:`check`, nothing written), then :meth:`accept`-ed."""

    def __init__(self, out: pathlib.Path | None, cfg: DictConfig):
        self.out, self.cfg, self.fd = out, cfg, None
        self.accepted = out is None

    def check(self) -> None:
        """Refuses the launch as :meth:`accept` would, writing nothing: the lock is taken only where the
        directory has its file already (a run that made it, alive or not); a fresh directory gets it at accept."""
        def verdict() -> None:
            if not self.out.is_dir():
                return
            if (self.out / LOCK).exists():
                self.fd = _lock(self.out, create=False)
            _check_owner(self.out, self.cfg, _identity(self.cfg, distributed.rank_and_world()[1]), write=False)
        self._on_rank0(verdict)

    def accept(self) -> None:
        """Takes the directory for this run: its lock (and holder record), ``run.json``, Hydra's files.

        Raises:
          RunDirError: what :meth:`check` refuses, seen again under the lock (a process that came meanwhile).
        """
        if self.accepted:
            return

        def take() -> None:
            if self.fd is None:
                self.fd = _lock(self.out)
            _check_owner(self.out, self.cfg, _identity(self.cfg, distributed.rank_and_world()[1]))
            _hold(self.fd)
            _write_hydra_files(self.out, self.cfg)
        self._on_rank0(take)
        self.accepted = _LAUNCHED[_key(self.out)] = True
        if distributed.rank_and_world()[0] == 0:
            _ACCEPTED.add(_key(self.out))

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def _on_rank0(self, fn: Any) -> None:
        """Runs ``fn`` on rank 0; its refusal (a RunDirError) is raised on every rank."""
        if self.out is None:
            return
        rank, world = distributed.rank_and_world()
        why = None
        if rank == 0:
            try:
                fn()
            except RunDirError as e:
                why = str(e)
                self.release()
        if world > 1:  # rank 0's verdict, on every rank (none starts a run that rank 0 refused)
            import torch.distributed as dist

            box = [why]
            dist.broadcast_object_list(box, src=0)
            why = box[0]
        if why is not None:
            raise RunDirError(why)


_ACCEPTED: set[str] = set()  # run directories this process claimed (rank 0): Hydra's files may be written there
_MADE: set[str] = set()  # run directories that did not exist when Hydra's run started (HydraFiles.on_run_start)
_LAUNCHED: dict[str, bool] = {}  # run directory -> whether this process's latest launch into it was accepted


def _key(out: str | os.PathLike) -> str:
    return str(pathlib.Path(out).resolve())


def accepted(out: str | os.PathLike) -> bool:
    """Whether this process's latest launch into ``out`` was accepted (:meth:`Claim.accept`): only then may a
    failure be recorded there (before, the directory is not the launch's: another run's, or nothing)."""
    return _LAUNCHED.get(_key(out), False)


def withdraw(out: str | os.PathLike) -> None:
    """After a launch refused before :meth:`Claim.accept`: removes ``out`` when this launch made it (Hydra does,
    before the task runs) and it is empty, so a refused launch into a fresh directory leaves none. Never
    removes a file, nor a directory that existed before the launch."""
    out = pathlib.Path(out)
    if _key(out) in _MADE and not accepted(out):
        try:
            out.rmdir()  # only an empty one
        except OSError:
            pass


def _hydra_node() -> DictConfig | None:
    """Hydra's config of the job this process runs (``{"hydra": ...}``), or ``None`` outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.instance().cfg if HydraConfig.initialized() else None


def _write_hydra_files(out: pathlib.Path, cfg: DictConfig, hydra_cfg: DictConfig | None = None) -> None:
    """Writes Hydra's ``.hydra/{config,hydra,overrides}.yaml`` into ``out``, as Hydra's ``run_job`` would, when
    ``out`` is the output directory of the Hydra job (``hydra_cfg``, by default the one running).

    ``conf/train.yaml`` sets ``hydra.output_subdir: null``, so Hydra itself writes nothing before the task
    runs: these files are written only once a launch is accepted (:func:`claim`), and a refused launch
    leaves the directory it was refused by as it was (another run's ``.hydra/`` is never rewritten).
    """
    hydra_cfg = _hydra_node() if hydra_cfg is None else hydra_cfg
    if hydra_cfg is None or "hydra" not in hydra_cfg:
        return
    node = hydra_cfg.hydra
    try:
        if pathlib.Path(str(node.runtime.output_dir)).resolve() != out.resolve():
            return
    except (OmegaConfBaseException, OSError):
        return
    if node.get("output_subdir") not in (None, ".hydra"):
        return  # a user who asked for Hydra's files elsewhere has them there, from Hydra
    target = out / ".hydra"
    target.mkdir(parents=True, exist_ok=True)
    shown = OmegaConf.create({"hydra": OmegaConf.to_container(node)})  # the files say where they are
    shown.hydra.output_subdir = ".hydra"
    task = OmegaConf.create(OmegaConf.to_container(cfg))
    if "hydra" in task:
        del task["hydra"]
    for name, node_cfg in (("config.yaml", task), ("hydra.yaml", shown), ("overrides.yaml", node.overrides.task)):
        (target / name).write_text(OmegaConf.to_yaml(node_cfg), encoding="utf-8")


class HydraFiles(Callback):
    """Hydra callback (``conf/train.yaml``): writes ``.hydra/`` of a job whose directory this process claimed,
    when the job ends. :func:`claim` writes them itself when the job runs in the claiming process's Hydra
    job; this covers jobs claimed outside ``run_job`` (``hydra/launcher=vmap`` trains a group first). And it
    notes whether a single run's directory exists before Hydra makes it, so that a refused launch removes the
    empty directory it made (:func:`withdraw`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            out = pathlib.Path(str(config.hydra.run.dir))
        except (OmegaConfBaseException, OSError):
            return
        if not out.exists():
            _MADE.add(str(out.resolve()))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        try:
            out = pathlib.Path(str(config.hydra.runtime.output_dir)).resolve()
        except (OmegaConfBaseException, OSError):
            return
        if str(out) in _ACCEPTED and job_return.cfg is not None:
            _write_hydra_files(out, job_return.cfg, OmegaConf.create({"hydra": config.hydra}))


def write_refused(out: str | os.PathLike, cfg: DictConfig, error: BaseException, status: str = "refused") -> bool:
    """Records a launch refused for a setting (``status: refused`` and its one-line error in ``summary.json``,
    and Hydra's files) in ``out`` when ``out`` holds no run: a sweep job's fresh directory, so that
    ``summary.csv`` says why the job did not run (``status``: ``failed`` for an error that is not a setting's,
    raised before the launch was accepted). Never writes where a run is. Returns whether it wrote."""
    out = pathlib.Path(out)
    if (out / OWNER).exists() or _progress(out) is not None:
        return False
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / SUMMARY, {"status": status, "error": f"{type(error).__name__}: {error}",
                               "optimized_metric": cfg.get("optimized_metric")})
    _write_hydra_files(out, cfg)
    return True


def _lock(out: pathlib.Path, create: bool = True) -> int:
    """The flock'ed descriptor of ``out/run.lock`` (made with ``out`` when ``create``), or a RunDirError naming
    the live process that holds it."""
    if create:
        out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.read(fd, 4096) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        who = f"process {holder.get('pid', '?')} on {holder.get('host', '?')}"
        raise RunDirError(f"run directory {out} is in use by {who} ({out / LOCK} is locked): one process per run "
                          "directory; wait for it to end, or pass another hydra.run.dir") from None
    return fd


def _hold(fd: int) -> None:
    """Records this process in the lock file, once the launch is accepted (a refused one changes nothing)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n").encode(), 0)


def _check_owner(out: pathlib.Path, cfg: DictConfig, identity: dict[str, Any], write: bool = True) -> None:
    """Refuses ``cfg`` in ``out`` (see the module doc), or (``write``) records ``cfg`` and ``identity`` as the
    owner of ``out``."""
    digest, flat = config_hash(cfg)
    progress = _progress(out)
    try:
        owner = json.loads((out / OWNER).read_text())
    except (OSError, ValueError):
        owner = None
    owner = owner if isinstance(owner, dict) else {}
    if progress is not None and _failed_early(out):
        progress = None  # a launch that failed before its first checkpoint: nothing to continue, rerun it here
    if progress is not None:
        there = owner.get("config")
        resume = cfg.get("resume") not in (None, "")
        if isinstance(there, dict):
            # Keys on one side only (one that a newer fxtrain added, at its default) do not make another run.
            diff = differing(there, flat, cfg)
            if diff:
                shown = ", ".join(f"{k}={there[k]} there, {flat[k]} here" for k in diff[:3])
                raise RunDirError(f"run directory {out} holds another run's config ({shown}"
                                  f"{', ...' if len(diff) > 3 else ''}), {progress}: to continue that run, relaunch "
                                  "it with its own config and resume=auto; for this one, pass another hydra.run.dir")
            if not resume:
                then = "return its result" if progress.startswith("completed") else "continue it"
                raise RunDirError(f"run directory {out} holds this run already, {progress}: pass resume=auto to "
                                  f"{then}, or another hydra.run.dir to start a new run (resume=null never mixes two "
                                  "runs in one directory)")
            if checkpoint.latest(out / "checkpoints") is not None:
                check_layout(f"run directory {out}", _identity_of(owner), identity, cfg)
            if owner.get("config_sha256") == digest and _identity_of(owner) == identity:
                return
        elif not resume:
            raise RunDirError(f"run directory {out} holds a run without {OWNER} (from before run directories were "
                              f"recorded), {progress}: pass resume=auto to continue it with this config, or another "
                              "hydra.run.dir to start a new run")
    if write:
        write_json(out / OWNER, {"config_sha256": digest, "config": flat, **identity})


def differing(there: dict[str, Any], here: dict[str, Any], cfg: DictConfig) -> list[str]:
    """The keys of two flat configs (:func:`config_hash`) whose values differ, sorted. Keys on one side only
    (one that a newer fxtrain added, at its default) do not count; nor do the ``parallel.*`` keys when
    ``cfg.resume_relayout`` is true: they are the layout, which :func:`check_layout` compares.

    >>> differing({"a": 1, "parallel.dp_shard": -1}, {"a": 2, "parallel.dp_shard": 1, "b": 0},
    ...           OmegaConf.create({"resume_relayout": True}))
    ['a']
    """
    relayout = cfg.get("resume_relayout", False) is True
    return [k for k in sorted(set(there) & set(here))
            if there[k] != here[k] and not (relayout and k.startswith("parallel."))]


def _failed_early(out: pathlib.Path) -> bool:
    """Whether ``out`` holds a launch that failed (or was refused) before writing any checkpoint."""
    try:
        summary = read_summary(out)
    except RunDirError:
        return False
    return (summary is not None and summary.get("status") in ("failed", "refused")
            and not _steps(out / "checkpoints"))


def _identity(cfg: DictConfig, world: int) -> dict[str, Any]:
    """The run's world size and parallel layout (``parallel dp_shard=2``): part of what it computes."""
    try:
        layout = build.parallel_dims(cfg, world).describe()
    except ConfigError:
        layout = None  # refused later, by the runner's own check, naming the key
    return {"world_size": world, "layout": layout}


def _identity_of(record: dict[str, Any]) -> dict[str, Any] | None:
    """The ``{"world_size", "layout"}`` a run.json or checkpoint record holds, or ``None`` (older records)."""
    if not isinstance(record, dict) or "world_size" not in record:
        return None
    return {"world_size": record.get("world_size"), "layout": record.get("layout")}


def describe_layout(identity: dict[str, Any]) -> str:
    """``2 ranks, parallel dp_shard=2`` (or ``1 process``) for messages and the run's start line.

    >>> describe_layout({"world_size": 4, "layout": "parallel dp_shard=4"})
    '4 ranks, parallel dp_shard=4'
    """
    n = identity.get("world_size")
    head = "1 process" if n == 1 else f"{n} ranks"
    return head + (f", {identity['layout']}" if identity.get("layout") else "")


def check_layout(what: str, then: dict[str, Any] | None, now: dict[str, Any], cfg: DictConfig) -> str | None:
    """Refuses to continue ``what`` (a run directory, a checkpoint) trained on ``then`` (world size and layout)
    on another one ``now``, unless ``cfg.resume_relayout`` is true; returns the note the run's start line
    gives then (``relayout from 2 ranks, parallel dp_replicate=2``), or ``None`` when nothing changed.

    A checkpoint that records only its world size (``fx.save`` without ``meta``) is compared by world size.

    Raises:
      RunDirError: another world size or layout, without ``resume_relayout=true``.
      fxtrain.errors.ConfigError: ``resume_relayout`` is not a boolean.
    """
    if then is None:
        return None
    same = then["world_size"] == now["world_size"] and (then.get("layout") is None or then["layout"] == now["layout"])
    if same:
        return None
    relayout = cfg.get("resume_relayout", False)
    if not isinstance(relayout, bool):
        raise ConfigError(f"resume_relayout={relayout!r}: expected true (continue a run on another world size "
                                "or layout, resharding its checkpoint) or false")
    if not relayout:
        raise RunDirError(f"{what} was trained on {describe_layout(then)}; this launch is {describe_layout(now)}: "
                          "another world size or layout changes what the run computes (batches per rank, reduction "
                          f"order), so it is not resumed silently. Launch it on {describe_layout(then)}, or pass "
                          "resume_relayout=true to continue it on this layout (its checkpoint is resharded)")
    return f"relayout from {describe_layout(then)} to {describe_layout(now)}"


def _progress(out: pathlib.Path) -> str | None:
    """What ``out`` holds of a run (``"completed at step 60"``, ``"at step 20 (checkpoint)"``...), or ``None``."""
    try:
        summary = read_summary(out)
    except RunDirError:
        summary = {"status": "unreadable"}
    if summary is not None:
        return f"{summary.get('status', 'unknown')} at step {summary.get('step', '?')} ({SUMMARY})"
    latest = checkpoint.latest(out / "checkpoints")
    if latest is not None:
        return f"checkpoint at step {int(latest.name.split('_')[1])}"
    steps = [r.get("step") for r in report.read_jsonl(out / METRICS)]
    if steps:
        return f"logged up to step {steps[-1]} ({METRICS})"
    return None


def rewind(out: pathlib.Path | None, step: int) -> None:
    """Makes ``out`` the directory of a run at ``step``: removes ``summary.json`` and checkpoints after
    ``step``, cuts ``metrics.jsonl`` back to ``step`` (a half-written last line dropped), atomically."""
    if out is None:
        return
    (out / SUMMARY).unlink(missing_ok=True)
    for path, n in _steps(out / "checkpoints"):
        if n > step:
            shutil.rmtree(path, ignore_errors=True)
    metrics = out / METRICS
    if metrics.exists():
        kept = [r for r in report.read_jsonl(metrics) if r.get("step", 0) <= step]
        tmp = metrics.with_name(f".{METRICS}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, metrics)


def save(target: pathlib.Path, state: Any, meta: dict[str, Any] | None, kept: str) -> pathlib.Path:
    """Writes ``state`` to the run's checkpoint ``target`` (:func:`fxtrain.save`: atomic, ``meta`` into its
    manifest); ``kept`` says what is intact when it fails. Every rank calls it.

    Raises:
      fxtrain.CheckpointError: the save failed (a full disk: its ``OSError`` is the cause, so the runner reports it
        as one line). DCP reports a failed write as a ``BaseException``, which would pass by every handler meant
        for errors: it is turned into this one.

    Example:
        >>> import tempfile, torch, fxtrain as fx
        >>> out = pathlib.Path(tempfile.mkdtemp())
        >>> save(out / "best", fx.TrainState(0, {"w": torch.ones(2)}, None, None), None, "nothing").name
        'best'
    """
    import fxtrain as fx
    try:
        return fx.save(target, state, meta=meta)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is not an Exception
        cause = checkpoint.first_failure(e)
        raise checkpoint.CheckpointError(f"could not write the checkpoint {target}: {type(cause).__name__}: "
                                         f"{(str(cause).splitlines() or [''])[0]}; {kept}") from cause


def prune(directory: pathlib.Path, keep_last: int, current: int) -> None:
    """Deletes the checkpoints of ``directory`` older than step ``current`` (just written) beyond the newest
    ``keep_last`` (``0``: none); never ``current`` itself, never a later one.

    >>> import tempfile; d = pathlib.Path(tempfile.mkdtemp())
    >>> for n in (5, 10, 15): (d / f"step_{n:07d}").mkdir()
    >>> prune(d, keep_last=2, current=15); sorted(p.name for p in d.iterdir())
    ['step_0000010', 'step_0000015']
    >>> prune(d, keep_last=1, current=10); sorted(p.name for p in d.iterdir())  # 15 is not this run's to delete
    ['step_0000010', 'step_0000015']
    """
    if keep_last <= 0:
        return
    older = sorted((n, path) for path, n in _steps(directory) if n < current)
    for _, path in older[:max(len(older) - (keep_last - 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)


def _steps(directory: pathlib.Path) -> list[tuple[pathlib.Path, int]]:
    if not directory.is_dir():
        return []
    return [(p, int(m.group(1))) for p in directory.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]


def write_json(path: pathlib.Path, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path`` atomically: a temporary file beside it, fsynced, then ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_summary(out: str | os.PathLike) -> dict[str, Any] | None:
    """The ``summary.json`` of the run directory ``out``, or ``None`` when there is none.

    Raises:
      RunDirError: it does not parse as a JSON object (named, with where it stops).
    """
    path = pathlib.Path(out) / SUMMARY
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        summary = json.loads(text)
    except ValueError as e:
        raise RunDirError(f"{path} is not valid JSON ({str(e).splitlines()[0]}): cut off by a kill while it was "
                          "written, or edited") from None
    if not isinstance(summary, dict):
        raise RunDirError(f"{path} is not a JSON object")
    return summary
