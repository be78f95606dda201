"""Checkpoints load no code (fxtrain/checkpoint.py, issue 25 part 4): DCP's ``.metadata`` is a pickle, and
``fx.load`` read it with ``pickle.load``; the manifest's digest is an unkeyed sha256 anyone can recompute. A
crafted ``.metadata`` (a valid DCP metadata carrying a payload that runs code when unpickled), with the
manifest's sizes, CRCs and digest recomputed to match, is refused as one CheckpointError naming the file, and
the payload never runs: through ``fx.load`` here, through the runner's resume in tests/test_train_resume.py."""

from __future__ import annotations

import hashlib
import json
import pathlib
import pickle
import zlib

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import fxtrain as fx
from fxtrain import checkpoint


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
