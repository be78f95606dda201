"""Tiny fixtures of the data formats of fxtrain/sources.py, generated in the test (no downloads), and the command-line
overrides that train on each: ``FORMATS[option](folder)`` writes the files of ``data=<option>`` under ``folder`` and
returns the overrides. Tests enumerate :data:`FORMATS`, so a format added there is covered by every one of them
(tests/test_sources.py, tests/test_train.py's every-option test)."""

from __future__ import annotations

import pathlib

import numpy as np

VOCAB, CONTEXT = 64, 16
LM = ["model=transformer", "task=lm", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
      f"data.context={CONTEXT}", f"data.vocab_size={VOCAB}"]
FEATURES, CLASSES = 4, 3
CLASSIFIER = ["model=mlp", "model.hidden=[8]", f"data.input_shape=[{FEATURES}]", f"data.num_classes={CLASSES}"]


def token_files(folder: pathlib.Path, n: int = 4096, dtype=np.uint16, splits=("train", "val")) -> pathlib.Path:
    """``<split>.bin`` of ``n`` tokens each, as nanoGPT's prepare.py writes them: a learnable sequence (token t+1 is
    token t + 1 mod VOCAB, restarting at random places)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split in splits:
        tokens = (np.arange(n) + np.repeat(rng.integers(0, VOCAB, n // 64 + 1), 64)[:n]) % VOCAB
        tokens.astype(dtype).tofile(folder / f"{split}.bin")
    return folder


def rows(n: int, seed: int = 0) -> dict:
    """``n`` rows of a classification table: ``features`` (FEATURES floats around the class's prototype), ``label``."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, CLASSES, n)
    features = np.eye(CLASSES, FEATURES)[label] * 3 + rng.normal(size=(n, FEATURES))
    return {"features": features.astype(np.float32).tolist(), "label": label.tolist()}


def parquet_file(folder: pathlib.Path, n: int = 96, name: str = "rows.parquet", seed: int = 0) -> pathlib.Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows(n, seed)), folder / name)
    return folder / name


def shards(folder: pathlib.Path, count: int = 4, per_shard: int = 12, seed: int = 0) -> pathlib.Path:
    """``count`` WebDataset shards of ``per_shard`` samples each (``x.npy`` features, ``cls`` label)."""
    import webdataset as wds
    folder.mkdir(parents=True, exist_ok=True)
    table = rows(count * per_shard, seed)
    for s in range(count):
        with wds.TarWriter(str(folder / f"shard-{s:03d}.tar")) as w:
            for i in range(s * per_shard, (s + 1) * per_shard):
                w.write({"__key__": f"{i:06d}", "x.npy": np.asarray(table["features"][i], np.float32),
                         "cls": table["label"][i]})
    return folder


def tokens(folder: pathlib.Path) -> list[str]:
    d = token_files(folder / "tokens")
    return ["data=tokens", f"data.dir={d}", "data.batch_size=8", "data.eval_windows=8", *LM]


def hf(folder: pathlib.Path) -> list[str]:
    path = parquet_file(folder / "hf")
    return ["data=hf", f"data.data_files={path}", f"data.cache_dir={folder / 'hf_cache'}", "data.batch_size=8",
            *CLASSIFIER]


def webdataset(folder: pathlib.Path) -> list[str]:
    train, test = shards(folder / "wds" / "train"), shards(folder / "wds" / "test", count=1, seed=1)
    return ["data=webdataset", f"data.train_shards={train}", f"data.test_shards={test}", "data.batch_size=8",
            *CLASSIFIER]


def grain(folder: pathlib.Path) -> list[str]:
    d = token_files(folder / "grain")
    return ["data=grain", f"data.train.path={d / 'train.bin'}", f"data.test.path={d / 'val.bin'}",
            "data.batch_size=8", "data.eval_examples=8", *LM]


FORMATS = {"tokens": tokens, "hf": hf, "webdataset": webdataset, "grain": grain}

# The module each optional format imports, the package named and the extra that installs it (fxtrain.extras).
EXTRAS = {"hf": ("datasets", "datasets", "hf"), "webdataset": ("webdataset", "webdataset", "webdataset"),
          "grain": ("grain", "grain", "grain")}


def grain_iter(path: str, context: int, dtype: str = "uint16", **_):
    """``data=grain``'s training windows as a ``grain.IterDataset`` (no random access: not split by rank)."""
    import grain
    from fxtrain.sources import TokenWindows
    return grain.MapDataset.source(TokenWindows(path, context, dtype)).to_iter_dataset()


def grain_iter_by_process(path: str, context: int, dtype: str = "uint16", **_):
    """:func:`grain_iter` starting at another window in each process (by its rank): an order that differs between
    processes, which a stream not split by rank must not have."""
    import grain
    import torch.distributed as dist
    from fxtrain.sources import TokenWindows
    return grain.MapDataset.source(TokenWindows(path, context, dtype))[dist.get_rank():].to_iter_dataset()


def variants(option: str, folder: pathlib.Path) -> dict[str, list[str]]:
    """The kinds of training source ``data=<option>`` builds, each as extra overrides: ``tokens`` in every order,
    ``hf`` with one split (the runner splits it) and with a test split, ``grain`` on a MapDataset and an
    IterDataset; one (no overrides) for the other options."""
    from fxtrain.sources import ORDERS
    if option == "tokens":
        return {order: [f"data.order={order}"] for order in ORDERS}
    if option == "hf":
        train, test = parquet_file(folder / "hf"), parquet_file(folder / "hf", n=16, name="test.parquet", seed=1)
        return {"one split": [], "test split": [f"data.data_files={{train:'{train}',test:'{test}'}}",
                                                "data.test_split=test"]}
    if option == "grain":
        return {"MapDataset": [], "IterDataset": ["data.train._target_=tests._formats.grain_iter"]}
    return {"": []}
