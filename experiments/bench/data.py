"""The data path at scale (issue 37, item 2): batches per second of a map-style dataset through the runner's own
data path (``fxtrain.data.from_source`` then ``for_rank``: the ``data.train[k]`` the training loop reads, step by
step), items read in the training process (``num_workers=0``: the path before this change) against 4 DataLoader
workers, and what share of a real run's step time waits for data (the run's ``loader waited ...`` line).

Two datasets, batch 64:

* ``latency``: every item sleeps 0.5 ms (a read from disk or object storage) and returns a small tensor;
* ``decode``: every item decompresses a zlib blob of a 3x32x32 image and normalizes it (CPU-bound, decode-like).

Blocks of ``--batches`` batches, each from a fresh loader (its workers' start-up counted), the variants alternating
block by block over ``--rounds`` rounds; the table gives the median batches/s and quartiles. On a machine shared with
other work the ratio moves less than the rates: read the load lines.

Usage:
    python experiments/bench/data.py [--rounds 3] [--batches 150] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from fxtrain import data as fxdata  # noqa: E402


class Latency(torch.utils.data.Dataset):
    """``n`` items, each costing ``latency_s`` of waiting (I/O latency, no CPU)."""

    def __init__(self, n: int = 20_000, latency_s: float = 0.0005):
        self.n, self.latency_s = n, latency_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.latency_s)
        return torch.full((3, 8, 8), float(i % 7)), i % 10


class Decode(torch.utils.data.Dataset):
    """``n`` items, each a zlib-compressed 3x32x32 uint8 image decompressed and normalized (CPU-bound)."""

    def __init__(self, n: int = 4096):
        rng = np.random.default_rng(0)
        base = rng.integers(0, 255, (3, 32, 32), dtype=np.uint8)
        self.blobs = [zlib.compress((base + (i % 251)).tobytes(), 9) for i in range(256)]
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        raw = np.frombuffer(zlib.decompress(self.blobs[i % 256]), dtype=np.uint8).reshape(3, 32, 32)
        x = torch.from_numpy(raw.astype(np.float32) / 255.0)
        x = (x - x.mean()) / (x.std() + 1e-6)
        for _ in range(4):   # a decode-like transform's arithmetic
            x = torch.tanh(x * 1.01)
        return x, i % 10


def latency(**_) -> Latency:   # data._target_ for the runner's rows
    return Latency()


def rate(dataset, workers: int, batches: int, batch: int = 64) -> float:
    """Batches/s of the runner's data path: ``batches`` training batches, in step order, fresh loader."""
    data = fxdata.from_source(dataset, name="bench", batch_size=batch, num_workers=workers, test_fraction=0.01)
    data, _ = fxdata.for_rank(data, 0, 1)
    t0 = time.perf_counter()
    for k in range(batches):
        data.train[k]
    return batches / (time.perf_counter() - t0)


def waited(workers: int, steps: int) -> str:
    """The ``loader waited ...`` line of a real run (``python -m fxtrain.train``'s main, in this process) on the
    latency dataset, batch 64, the default MLP."""
    from fxtrain import train as runner

    with tempfile.TemporaryDirectory() as d:
        runner.main(["data=synthetic", "data._target_=__main__.latency", "data.batch_size=64", "data.input_shape=[3,8,8]",
                     f"+data.num_workers={workers}", f"trainer.max_steps={steps}", "trainer.eval_every=1000000",
                     "trainer.checkpoint_every=0", "data.test_fraction=0.01", f"hydra.run.dir={d}/run"])
        log = (pathlib.Path(d) / "run" / "train.log").read_text()
    return re.search(r"loader (waited .*)", log).group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--steps", type=int, default=100, help="steps of each real run (the waited share)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)   # the runner's trainer.cpu_threads default: the training process's items run on one
    load_start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    sets = {"latency (0.5 ms an item)": Latency(), "decode (CPU-bound)": Decode()}
    variants = {"in the training process (before)": 0, "4 workers": 4}
    rates: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name, ds in sets.items():
            order = list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]
            for label, workers in order:
                rates.setdefault((name, label), []).append(rate(ds, workers, args.batches))
                print(name, label, f"{rates[(name, label)][-1]:.1f} batches/s", flush=True)
    rows = []
    for name in sets:
        base = statistics.median(rates[(name, "in the training process (before)")])
        for label in variants:
            got = rates[(name, label)]
            q = statistics.quantiles(got, n=4) if len(got) > 1 else [got[0]] * 3
            rows.append([name, label, statistics.median(got), q[0], q[2], f"{statistics.median(got) / base:.2f}x"])
    lines = {w: waited(w, args.steps) for w in (0, 4)}
    text = "\n".join([
        "# Data path (issue 37)", "", _common.environment(), f"- load average at the start: {load_start}",
        f"- command: `python experiments/bench/data.py --rounds {args.rounds} --batches {args.batches} "
        f"--steps {args.steps}`", "",
        f"Batches/s of the runner's data path (`from_source` + `for_rank`, then `data.train[k]` for k in 0..{args.batches - 1},"
        f" a fresh loader per block: worker start-up counted), batch 64, {args.rounds} rounds alternating the variants "
        "(goal: 4 workers >= 3.5x the in-process path on the latency-bound dataset).", "",
        _common.table(["dataset", "items read", "batches/s median", "q1", "q3", "x before"], rows), "",
        f"A real run (`python -m fxtrain.train`, the latency dataset, batch 64, the default MLP, {args.steps} steps): its "
        "`loader` line at the end, the share of the training steps' time spent waiting for batches:", "",
        f"- `data.num_workers=0`: {lines[0]}", f"- `data.num_workers=4`: {lines[4]}", ""])
    print(text)
    if not args.no_write:
        print("wrote", _common.write_result("data", text))


if __name__ == "__main__":
    main()
