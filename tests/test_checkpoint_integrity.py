"""Integrity of fxtrain/checkpoint.py (issue 15, findings 5 and 6, and leftover cleanup).

* The manifest ``fxtrain.json`` carries a checksum over its own content: an edited value, an emptied or
  shortened ``files`` map, or a malformed manifest is refused with one ``CheckpointError`` line naming the
  checkpoint, what is wrong and what to do, never a ``KeyError`` or a silent load.
* Two leaves whose dotted paths coincide (``{"a.b": t1, "a": {"b": t2}}``, keys ``1`` and ``"1"``) are
  refused at save (both named); ``load`` refuses a ``like`` or a manifest that would alias two leaves.
* A killed or failed save leaves the previous checkpoint intact, and the next save in the same directory
  removes the leftovers of dead saves (``.<name>.saving``, ``.<name>.old``), never a live save's.

Victim processes (killed or stopped mid-save) run this file as a script.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

import fxtrain as fx
from tests import _worlds

CheckpointError = fx.CheckpointError
HERE = pathlib.Path(__file__)
ENV = _worlds.script_env()
TIMEOUT_S = 120


def small_state(seed: int = 0, step: int = 25) -> fx.TrainState:
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    return fx.TrainState(step=step, params=params, opt_state=fx.adam(1e-3).init(params))


def assert_trees_equal(a, b) -> None:
    assert fx.tree.first_mismatch(a, b) is None
    for x, y in zip(fx.tree.flatten(a)[0], fx.tree.flatten(b)[0]):
        assert (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else x == y


def rewrite(path: pathlib.Path, edit, *, redigest: bool) -> None:
    """Edits ``path``'s manifest with ``edit(manifest) -> manifest``; with ``redigest`` the checksum is
    recomputed as documented (sha256 of the JSON with sorted keys, no spaces, ``digest`` left out), as a
    tool that rewrites manifests consistently would: what is checked then is the content itself."""
    f = path / "fxtrain.json"
    m = edit(json.loads(f.read_text()))
    if redigest and isinstance(m, dict):
        body = {k: v for k, v in m.items() if k != "digest"}
        m["digest"] = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                                                 .encode()).hexdigest()
    f.write_text(json.dumps(m, indent=1))


def load_error(path: pathlib.Path, like=None) -> str:
    with pytest.raises(CheckpointError) as info:
        fx.load(path, like=small_state(1) if like is None else like)
    msg = str(info.value)
    assert msg.startswith(f"checkpoint {path}") and "\n" not in msg, msg
    return msg


# --- finding 5: the manifest is checksummed and verified ---------------------------------------------

def _set_step(m, value):
    [entry] = [e for e in m["leaves"] if e["path"] == "step"]
    entry["value"] = value
    return m


def test_an_edited_manifest_value_is_refused(tmp_path):
    path = fx.save(tmp_path / "ck", small_state(step=25))
    rewrite(path, lambda m: _set_step(m, 65), redigest=False)
    msg = load_error(path)
    assert "fxtrain.json does not match its checksum" in msg and "another checkpoint" in msg
    rewrite(path, lambda m: _set_step(m, 25), redigest=False)  # undone: the checksum matches again
    assert fx.load(path, like=small_state(1)).step == 25
    assert fx.load(path, like=small_state(1), verify=False).step == 25


@pytest.mark.parametrize("redigest", [False, True], ids=["as_edited", "checksum_recomputed"])
def test_an_emptied_or_shortened_files_map_is_refused(tmp_path, redigest):
    path = fx.save(tmp_path / "ck", small_state())
    [data] = [f.name for f in path.glob("*.distcp")]

    def drop(name):
        def edit(m):
            del m["files"][name]
            return m
        return edit

    rewrite(path, lambda m: {**m, "files": {}}, redigest=redigest)
    assert "fxtrain.json" in load_error(path)
    fx.save(path, small_state())
    rewrite(path, drop(data), redigest=redigest)
    msg = load_error(path)
    if redigest:  # consistent but incomplete: the file on disk is not listed
        assert f"{data} is not listed in fxtrain.json" in msg
    fx.save(path, small_state())
    rewrite(path, drop(".metadata"), redigest=redigest)
    load_error(path)


def _del(key):
    def edit(m):
        del m[key]
        return m
    return edit


def _leaf(i, **changes):
    def edit(m):
        m["leaves"][i] = {k: v for k, v in {**m["leaves"][i], **changes}.items() if v is not ...}
        return m
    return edit


def _tensor_leaf(m) -> int:
    return next(i for i, e in enumerate(m["leaves"]) if e["kind"] == "tensor")


MALFORMED = {  # what an edit did -> (edit, words the message must contain)
    "not_an_object": (lambda m: [m], "not a JSON object"),
    "no_leaves": (_del("leaves"), "'leaves'"),
    "no_files": (_del("files"), "'files'"),
    "no_world_size": (_del("world_size"), "'world_size'"),
    "leaves_not_a_list": (lambda m: {**m, "leaves": {"step": 1}}, "'leaves'"),
    "files_not_a_map": (lambda m: {**m, "files": [[".metadata", 1, 2]]}, "'files'"),
    "file_entry": (lambda m: {**m, "files": {**m["files"], ".metadata": "big"}}, ".metadata"),
    "file_outside": (lambda m: {**m, "files": {**m["files"], "../ck2/.metadata": [1, 2]}}, "../ck2/.metadata"),
    "leaf_no_path": (lambda m: _leaf(0, path=...)(m), "leaf 0"),
    "leaf_kind": (lambda m: _leaf(0, kind="pickle")(m), "pickle"),
    "leaf_shape": (lambda m: _leaf(_tensor_leaf(m), shape="3")(m), "shape"),
    "leaf_dtype": (lambda m: _leaf(_tensor_leaf(m), dtype="float99")(m), "float99"),
    "leaf_value": (lambda m: _set_step(m, "25"), "'step'"),
    "leaf_no_value": (lambda m: _leaf(0, value=...)(m), "'step'"),
    "leaf_twice": (lambda m: {**m, "leaves": m["leaves"] + m["leaves"][-1:]}, "twice"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_is_one_checkpoint_error(tmp_path, case):
    edit, words = MALFORMED[case]
    path = fx.save(tmp_path / "ck", small_state())
    rewrite(path, edit, redigest=False)  # edited by hand: the checksum refuses it
    assert ("not a JSON object" if case == "not_an_object" else "does not match its checksum") in load_error(path)
    fx.save(path, small_state())
    rewrite(path, edit, redigest=True)  # rewritten consistently: the content itself is checked
    msg = load_error(path)
    assert words in msg, msg


def test_a_manifest_without_checksum_or_of_another_version_is_refused(tmp_path):
    path = fx.save(tmp_path / "ck", small_state())
    rewrite(path, _del("digest"), redigest=False)
    assert "has no checksum" in load_error(path)
    fx.save(path, small_state())
    rewrite(path, lambda m: {**m, "version": 1}, redigest=True)
    assert "version 1" in load_error(path)


# --- finding 6: leaf paths never alias ----------------------------------------------------------------

@pytest.mark.parametrize("tree,first,second", [
    ({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, "state['a']['b']", "state['a.b']"),
    ({1: torch.ones(2), "1": torch.zeros(2)}, "state[1]", "state['1']"),
    ({"x": 1.0, "y": {"0": torch.ones(1)}, "y.0": None}, "state['y']['0']", "state['y.0']"),
], ids=["dotted_key", "int_and_str_key", "python_leaf"])
def test_save_refuses_two_leaves_with_one_path(tmp_path, tree, first, second):
    with pytest.raises(CheckpointError, match="same path") as info:
        fx.save(tmp_path / "ck", tree)
    msg = str(info.value)
    assert first in msg and second in msg and "\n" not in msg, msg
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_load_refuses_a_like_whose_leaves_share_a_path(tmp_path):
    path = fx.save(tmp_path / "ck", {"a": {"b": torch.ones(2)}, "c": torch.zeros(2)})
    msg = load_error(path, like={"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}})
    assert "like['a']['b']" in msg and "like['a.b']" in msg and "same path 'a.b'" in msg


def test_load_refuses_a_manifest_that_would_alias_two_leaves(tmp_path):
    path = fx.save(tmp_path / "ck", {"a": {"c": torch.ones(2)}, "a.b": torch.zeros(2)})

    def alias(m):  # as an fxtrain without the save-time check wrote {"a.b": t1, "a": {"b": t2}}
        for e in m["leaves"]:
            e["path"] = "a.b"
        return m

    rewrite(path, alias, redigest=True)
    assert "twice" in load_error(path, like={"a": {"c": torch.ones(2)}, "a.b": torch.zeros(2)})


def test_tensor_leaves_must_be_the_tensors_dcp_stored(tmp_path):
    path = fx.save(tmp_path / "ck", {"x": torch.ones(2), "y": torch.zeros(2)})

    def rename(m):
        m["leaves"][1]["path"] = "z"
        return m

    rewrite(path, rename, redigest=True)
    assert "'z'" in load_error(path, like={"x": torch.ones(2), "z": torch.zeros(2)})


# --- leftovers: a failed or killed save never costs the previous checkpoint; the next save cleans ------

def test_a_save_that_raises_leaves_the_previous_checkpoint_and_no_partial_directory(tmp_path, monkeypatch):
    fx.save(tmp_path / "ck", small_state(0))

    def full_disk(state_dict, **kw):  # a data file half written, then the disk is full
        (tmp_path / ".ck.saving" / "__0_0.distcp").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fx.checkpoint.dcp, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        fx.save(tmp_path / "ck", small_state(1))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert_trees_equal(fx.load(tmp_path / "ck", like=small_state(2)), small_state(0))


def victim(path: pathlib.Path, how: str) -> None:
    """Saves small_state(0) to ``path``, then saves small_state(1) over it and is killed or stopped there."""
    if how != "write":
        fx.save(path, small_state(0))
    real_rename = os.rename

    def fsync(fd):  # the first fsync is DCP's, of the first data file it wrote
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)

    def rename(src, dst):
        if pathlib.Path(dst) == path and how == "commit":  # the old one is aside, the new one not in
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(src, dst)
        if pathlib.Path(dst) == path and how == "cleanup":  # committed; the old one not yet removed
            os.kill(os.getpid(), signal.SIGKILL)

    if how in ("write", "stop"):
        os.fsync = fsync
    else:
        os.rename = rename
    fx.save(path, small_state(1))
    raise SystemExit("not killed")


def run_victims(root: pathlib.Path, hows: dict[str, str]) -> None:
    """Runs one victim per {checkpoint name: how}, each in a directory of its own, then moves what each left
    into ``root`` (so that no victim's save sees another's leftovers)."""
    procs = {name: subprocess.Popen([sys.executable, str(HERE), "victim", str(root / f"v_{name}" / name), how],
                                    env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name, how in hows.items()}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == -signal.SIGKILL, out.decode()
        for f in (root / f"v_{name}").iterdir():
            f.rename(root / f.name)
        (root / f"v_{name}").rmdir()


def test_the_next_save_cleans_what_dead_saves_left(tmp_path):
    run_victims(tmp_path, {"step_0000015": "write", "step_0000010": "cleanup", "step_0000005": "commit"})
    (tmp_path / ".notes.saving").mkdir()  # not fxtrain's: never touched
    (tmp_path / ".notes.old").mkdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".notes.old", ".notes.saving", ".step_0000005.old", ".step_0000005.saving", ".step_0000010.old",
        ".step_0000015.saving", "step_0000010"]
    assert fx.checkpoint.latest(tmp_path).name == "step_0000010"
    fx.save(tmp_path / "step_0000020", small_state(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".notes.old", ".notes.saving", "step_0000005", "step_0000010", "step_0000020"]
    assert_trees_equal(fx.load(tmp_path / "step_0000005", like=small_state(2)), small_state(0))
    assert_trees_equal(fx.load(tmp_path / "step_0000010", like=small_state(2)), small_state(1))
    assert_trees_equal(fx.load(tmp_path / "step_0000020", like=small_state(2)), small_state(3))


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="start times come from /proc")
def test_cleanup_tells_dead_owners_from_live_ones(tmp_path):
    ck = fx.save(tmp_path / "ck", small_state())
    me = json.loads((ck / "fxtrain.owner.json").read_text())  # the owner record of this (live) process
    done = subprocess.Popen(["true"])
    done.wait()

    def leftover(name, age_s=0.0, **changes):
        d = tmp_path / f".{name}.saving"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"half written")
        (d / "fxtrain.owner.json").write_text(json.dumps({**me, **changes}))
        for f in [*d.iterdir(), d]:
            os.utime(f, (time.time() - age_s,) * 2)

    leftover("live")                                               # kept: this process runs
    leftover("exited", pid=done.pid)                               # removed: no such process
    leftover("reused", started=me["started"] - 1)                  # removed: the pid was reused since
    leftover("elsewhere", host="another-host", age_s=3600)         # kept: cannot tell, recent
    leftover("booted", boot="another boot", age_s=3600)            # kept: a reboot, or a namesake host
    leftover("elsewhere_old", host="another-host", age_s=2 * 86400)  # removed: untouched for two days
    leftover("booted_old", boot="another boot", age_s=2 * 86400)
    fx.save(tmp_path / "ck", small_state(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".booted.saving", ".elsewhere.saving", ".live.saving",
                                                          "ck"]


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WUNTRACED | os.WNOHANG)
        if done:
            assert os.WIFSTOPPED(status), f"victim {pid} ended before it stopped mid-save: status {status}"
            return
        time.sleep(0.05)
    raise TimeoutError(f"victim {pid} did not stop mid-save")


def test_a_live_save_is_never_cleaned(tmp_path):
    p = subprocess.Popen([sys.executable, str(HERE), "victim", str(tmp_path / "ck"), "stop"], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_stopped(p.pid)
        assert (tmp_path / ".ck.saving").is_dir()
        fx.save(tmp_path / "other", small_state(2))            # a sibling save leaves it alone
        assert (tmp_path / ".ck.saving").is_dir()
        with pytest.raises(CheckpointError, match=rf"another process \(pid {p.pid} on "):
            fx.save(tmp_path / "ck", small_state(3))           # a save to the same path is refused
        assert (tmp_path / ".ck.saving").is_dir()
    finally:
        p.kill()
        p.communicate(timeout=TIMEOUT_S)
    assert_trees_equal(fx.load(tmp_path / "ck", like=small_state(2)), small_state(0))
    fx.save(tmp_path / "ck", small_state(3))                   # its owner is dead now: cleaned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "other"]
    assert_trees_equal(fx.load(tmp_path / "ck", like=small_state(2)), small_state(3))


if __name__ == "__main__":
    if sys.argv[1] == "victim":
        victim(pathlib.Path(sys.argv[2]), sys.argv[3])
