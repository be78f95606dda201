"""Checkpoints load no code (fxtrain/checkpoint.py, issue 25 part 4): DCP's ``.metadata`` is a pickle, and
``fx.load`` read it with ``pickle.load``; the manifest's digest is an unkeyed sha256 anyone can recompute. A
crafted ``.metadata`` (a valid DCP metadata carrying a payload that runs code when unpickled), with the
manifest's sizes, CRCs and digest recomputed to match, is refused as one CheckpointError naming the file, and
the payload never runs: through ``fx.load`` here, through the runner's resume in tests/test_train_resume.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import pickle
import re
import shutil
import signal
import subprocess
import sys
import zlib

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import fxtrain as fx
from fxtrain import checkpoint, rundir, train as runner


class Payload:
    """Unpickled, it writes ``marker`` (a real attack would run anything)."""

    def __init__(self, marker: pathlib.Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def craft(path: pathlib.Path, marker: pathlib.Path) -> None:
    """Replaces the checkpoint ``path``'s ``.metadata`` by its own metadata carrying :class:`Payload` (so that
    plain ``pickle.load`` runs it and still returns a valid ``Metadata``), and rewrites the manifest's entry
    of the file and its digest as anyone can."""
    f = path / ".metadata"
    metadata = pickle.loads(f.read_bytes())
    assert type(metadata) is Metadata
    metadata.planner_data = Payload(marker)
    data = pickle.dumps(metadata)
    f.write_bytes(data)
    m = json.loads((path / checkpoint.MANIFEST).read_text())
    m["files"][".metadata"] = [len(data), zlib.crc32(data)]
    body = {k: v for k, v in m.items() if k != "digest"}
    m["digest"] = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                                             .encode()).hexdigest()
    (path / checkpoint.MANIFEST).write_text(json.dumps(m, indent=1))


def small_state() -> fx.TrainState:
    params = {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    return fx.TrainState(step=5, params=params, opt_state=fx.adam(1e-3).init(params), rng=fx.rng_state())


def test_a_crafted_metadata_is_refused_naming_the_file_and_runs_nothing(tmp_path):
    state = small_state()
    path = fx.save(tmp_path / "ck", state)
    marker = tmp_path / "marker"
    craft(path, marker)
    with pytest.raises(fx.CheckpointError) as info:
        fx.load(path, like=state)
    msg = str(info.value)
    assert msg.startswith(f"checkpoint {path}: .metadata is refused: it names builtins.exec") and "\n" not in msg
    assert not marker.exists()                                            # the payload did not run
    with pytest.raises(fx.CheckpointError, match=r"\.metadata is refused"):
        fx.load(path, like=state, verify=False)
    assert not marker.exists()


def test_the_real_metadata_of_every_leaf_kind_loads(tmp_path):
    """The allow-list holds what torch writes: every dtype, 0-dim, empty, bool and int tensors, the RNG state."""
    tree = {"f64": torch.randn(2, dtype=torch.float64), "bf16": torch.ones(3, dtype=torch.bfloat16),
            "empty": torch.zeros(0, 4), "scalar": torch.tensor(1.5), "flag": torch.tensor([True, False]),
            "i8": torch.arange(4, dtype=torch.int8), "c64": torch.ones(2, dtype=torch.complex64),
            "rng": fx.rng_state(), "n": 3, "none": None}
    back = fx.load(fx.save(tmp_path / "ck", tree), like=tree)
    for k in ("f64", "bf16", "empty", "scalar", "flag", "i8", "c64"):
        assert torch.equal(back[k], tree[k]) and back[k].dtype == tree[k].dtype


@pytest.mark.parametrize("data, what", [
    (b"\x80\x04garbage", "is damaged"),
    (pickle.dumps({"state_dict_metadata": {}}), "is not DCP's metadata"),
    (pickle.dumps(pathlib.Path("/etc")), "is not DCP's metadata"),
])
def test_a_damaged_or_foreign_metadata_is_one_line(tmp_path, data, what):
    path = fx.save(tmp_path / "ck", {"w": torch.ones(2)})
    (path / ".metadata").write_bytes(data)
    with pytest.raises(fx.CheckpointError, match=f"checkpoint {path}: .metadata {what}"):
        checkpoint.read_dcp_metadata(path)


def test_no_plain_pickle_load_or_unsafe_torch_load_in_fxtrain():
    """Nothing in fxtrain reads a checkpoint's bytes with a loader that runs code."""
    root = pathlib.Path(fx.__file__).parent
    for f in root.rglob("*.py"):
        text = f.read_text()
        assert "pickle.load(" not in text and "pickle.loads(" not in text, f
        assert "weights_only=False" not in text, f
        for line in text.splitlines():
            if "torch.load(" in line and not line.lstrip().startswith(("#", ">>>")):
                assert "weights_only=True" in line, f"{f}: {line.strip()}"


# --- files that are not the checkpoint's own (issue 35 item 5) ------------------------------------------------------
# A manifest listing a 0-byte file that is a FIFO or a link to /dev/zero hung fx.load, resume=PATH and resume=auto for
# ever (stat says 0 bytes, then the CRC read never ends); a data file or a whole step_N linked into another run was
# followed and loaded. Every (file kind x entry point) cell runs under a deadline, so a regression fails, never hangs.

RUN = ["experiment=smoke", "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.keep_last=0",
       "trainer.eval_every=2", "trainer.log_every=1", "trainer.progress=false", "trainer.device=cpu",
       "trainer.cpu_threads=1"]


@contextlib.contextmanager
def deadline(seconds: int = 20):
    """Raises TimeoutError in the block after ``seconds`` (SIGALRM interrupts a blocking open or read)."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s: a checkpoint read waits for ever")

    before = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def relist(path: pathlib.Path, name: str, size: int, crc: int) -> None:
    """Rewrites the manifest's entry of ``name`` and its digest, as anyone can (the digest has no key)."""
    m = json.loads((path / checkpoint.MANIFEST).read_text())
    m["files"][name] = [size, crc]
    body = {k: v for k, v in m.items() if k != "digest"}
    m["digest"] = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                                             .encode()).hexdigest()
    (path / checkpoint.MANIFEST).write_text(json.dumps(m, indent=1))


def data_file(ckpt: pathlib.Path) -> pathlib.Path:
    [f] = ckpt.glob("*.distcp")
    return f


def fifo(ckpt, elsewhere):
    f = data_file(ckpt)
    f.unlink()
    os.mkfifo(f)
    relist(ckpt, f.name, 0, 0)
    return ckpt, f"checkpoint {ckpt}: {f.name} is a FIFO, not a regular file"


def dev_zero(ckpt, elsewhere):
    f = data_file(ckpt)
    f.unlink()
    f.symlink_to("/dev/zero")
    relist(ckpt, f.name, 0, 0)
    return ckpt, f"checkpoint {ckpt}: {f.name} is a symbolic link (to /dev/zero), not a file of the checkpoint"


def linked_file(ckpt, elsewhere):
    """The same bytes (sizes and CRCs match the manifest), read through a link into another run."""
    f = data_file(ckpt)
    f.unlink()
    f.symlink_to(elsewhere / f.name)
    return ckpt, f"checkpoint {ckpt}: {f.name} is a symbolic link (to {elsewhere / f.name}), not a file of"


def linked_step(ckpt, elsewhere):
    shutil.rmtree(ckpt)
    ckpt.symlink_to(elsewhere)
    return ckpt, f"checkpoint {ckpt} is a symbolic link (to {elsewhere}): a checkpoint is read from its own directory"


def wrong_size(ckpt, elsewhere):
    f = data_file(ckpt)
    relist(ckpt, f.name, f.stat().st_size + 8, zlib.crc32(f.read_bytes()))
    return ckpt, f"checkpoint {ckpt} is truncated or corrupted: {f.name} has {f.stat().st_size} bytes, " \
                 f"{f.stat().st_size + 8} were written"


ATTACKS = [fifo, dev_zero, linked_file, linked_step, wrong_size]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with checkpoints at steps 2 and 4 (trained once for the module)."""
    from tests._runner import cfg_of

    run = tmp_path_factory.mktemp("trained") / "run"
    runner.train(cfg_of(*RUN), run)
    return run


def attacked(trained, tmp_path, attack):
    """A copy of ``trained`` whose newest checkpoint ``attack`` edited, and what the refusal says."""
    run, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(trained, run, symlinks=True)
    shutil.copytree(trained, other, symlinks=True)
    (run / "run.lock").unlink(missing_ok=True)
    newest = run / "checkpoints" / "step_0000004"
    return run, *attack(newest, other / "checkpoints" / "step_0000004")


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_fx_load_refuses_a_file_that_is_not_the_checkpoints_own_in_one_line(trained, tmp_path, attack):
    from tests._runner import cfg_of, load_checkpoint

    _, ckpt, expected = attacked(trained, tmp_path, attack)
    for verify in (True, False):
        with deadline(), pytest.raises(fx.CheckpointError) as info:
            checkpoint.load(ckpt, like=load_checkpoint(trained / "checkpoints" / "step_0000004", cfg_of(*RUN)),
                            verify=verify)
        assert str(info.value).startswith(expected) and "\n" not in str(info.value), str(info.value)
    with deadline(), pytest.raises(fx.CheckpointError, match=re.escape(expected)):
        checkpoint.verify(ckpt)


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_resume_path_refuses_it_in_one_line(trained, tmp_path, attack):
    from tests._runner import cfg_of

    _, ckpt, expected = attacked(trained, tmp_path, attack)
    with deadline(), pytest.raises(rundir.RunDirError) as info:
        runner.train(cfg_of(*RUN, f"resume={ckpt}"), tmp_path / "new")
    assert str(info.value).startswith(f"resume={ckpt}: {expected}") and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_resume_auto_skips_it_with_a_line_and_goes_on_from_the_previous_checkpoint(trained, tmp_path, attack,
                                                                                   caplog):
    from tests._runner import cfg_of

    run, ckpt, expected = attacked(trained, tmp_path, attack)
    (run / "summary.json").unlink()                                       # killed after its last checkpoint
    with deadline(), caplog.at_level("WARNING", logger="fxtrain"):
        source, _ = runner.resume_plan(cfg_of(*RUN, "resume=auto"), run / "checkpoints")
    assert source == run / "checkpoints" / "step_0000002"
    assert f"resume=auto: {expected}" in caplog.text and "going on from the previous checkpoint, step_0000002" \
        in caplog.text
    # none other: refused in one line, never a silent start at step 0 (and never a read that waits)
    shutil.rmtree(run / "checkpoints" / "step_0000002")
    with deadline(), pytest.raises(rundir.RunDirError, match=re.escape(f"resume=auto: {expected}")):
        runner.resume_plan(cfg_of(*RUN, "resume=auto"), run / "checkpoints")


def test_a_save_never_follows_a_linked_leftover_into_another_directory(tmp_path):
    """A .saving of a dead process is removed by the next save; as a link it took the files of where it pointed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("kept")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {**checkpoint._me(), "pid": int(dead.stdout)}              # a save whose process is gone
    (elsewhere / checkpoint._OWNER).write_text(json.dumps(record))
    (tmp_path / "d").mkdir()
    for name in (".ck.saving", ".other.saving", ".ck.old", ".other.old"):
        (tmp_path / "d" / name).symlink_to(elsewhere)
    fx.save(tmp_path / "d" / "ck", {"w": torch.ones(2)})
    assert (elsewhere / "precious").read_text() == "kept" and (elsewhere / checkpoint._OWNER).exists()
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [".other.old", ".other.saving", "ck"]


def test_resume_path_does_not_wait_on_a_fifo_for_the_checkpoints_run_json(trained, tmp_path):
    """resume=PATH reads the checkpoint's run's run.json (its config, when the manifest has none); a FIFO there
    hung it like a checkpoint file. Now it is not read: the resume goes on on what the manifest records."""
    from tests._runner import cfg_of

    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    (run / "run.json").unlink()
    os.mkfifo(run / "run.json")
    ckpt = run / "checkpoints" / "step_0000004"
    with deadline(), pytest.raises(rundir.RunDirError, match=r"the checkpoint is of another config"):
        runner.train(cfg_of(*RUN, "seed=1", f"resume={ckpt}"), tmp_path / "new")  # the manifest's config differs
    with deadline():
        runner._check_same_config(cfg_of(*RUN, f"resume={ckpt}"), ckpt, {"meta": {}})  # no config recorded: none read


def test_resume_auto_past_a_linked_step_leaves_the_linked_run_as_it_was(trained, tmp_path):
    """resume=auto goes on from step 2 past a step_4 linked into another run, and writes its own step_4: the link
    is replaced, never followed (the save put it aside as .step_4.old and removed what it pointed at)."""
    from tests._runner import cfg_of

    run, ckpt, _ = attacked(trained, tmp_path, linked_step)
    (run / "summary.json").unlink()
    elsewhere = tmp_path / "other" / "checkpoints" / "step_0000004"
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    with deadline(60):
        runner.train(cfg_of(*RUN, "resume=auto"), run)
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before
    assert not ckpt.is_symlink() and checkpoint.verify(ckpt)["world_size"] == 1
