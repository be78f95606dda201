"""Beyond one machine (docs/parallel.md, "Beyond one machine"): the runner on torch's own engine, launched by the
page's commands. Each test runs the page's line as written, on a free port, with the tiny sizes below appended.

* **Two nodes on one machine.** Two torchrun launchers meet at a c10d rendezvous on localhost and start
  ``--nproc-per-node`` ranks each; the layout's replicate dim spans them (a rank is node x nproc-per-node + local
  rank, and dp_replicate is outer to dp_shard on the mesh): ``parallel=dp`` replicates across the two nodes,
  ``parallel=hsdp`` too while it shards within each. The run equals one launcher's with the same world size bit for
  bit (metrics.jsonl, summary.json, the final checkpoint's every leaf): the same ranks read the same batches and
  run the same gloo collectives in the same order; only the process tree around them differs.
* **Restarts.** Under ``--max-restarts=1`` a rank killed with SIGKILL once the run's first checkpoint is written
  makes torchrun stop the group and start it again; ``resume=auto`` continues from the newest checkpoint in the
  run's directory, and the run ends bit for bit where the uninterrupted one (the one-launcher run) ends.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import fxtrain as fx
from fxtrain import checkpoint
from tests._runner import cfg_of, isolate, load_checkpoint, torchrun_train  # noqa: F401 - isolate: the autouse fixture
from tests.test_readme import BLOCKS, commands

# tiny_lm cut to seconds: a 2-layer LM of width 16, 24 steps in float32 without accumulation, a checkpoint every 4
# (the restart test kills a rank once the first one is written: 20 steps to go).
TINY = ["data.max_bytes=20000", "data.eval_windows=16", "model.d_model=16", "model.n_heads=2", "data.batch_size=8",
        "data.context=16", "trainer.max_steps=24", "trainer.log_every=1", "trainer.eval_every=12",
        "schedule.warmup_steps=1", "amp=off", "accumulate=off", "trainer.checkpoint_every=4"]
# layout -> (what replaces the page's line's parallel=dp, ranks per node); two nodes each. hsdp: dp_replicate=2
# across the nodes x dp_shard=2 within each, 4 ranks.
LAYOUTS = {"dp": (["parallel=dp"], 1), "hsdp": (["parallel=hsdp"], 2)}
TIMEOUT_S = 300
PAGE = "docs/parallel.md"  # where the commands are shown


def readme_command(flag: str) -> tuple[dict[str, str], list[str]]:
    """The docs' one torchrun command with the argument ``flag``: (its ``VAR=value`` prefix, its argv)."""
    found = []
    for block in (b for b in BLOCKS if b.file == PAGE and b.lang == "bash"):
        for command, _ in commands(block):
            words = shlex.split(command)
            at = words.index("torchrun") if "torchrun" in words else None
            if at is not None and all("=" in w for w in words[:at]) and flag in words:
                found.append((dict(w.split("=", 1) for w in words[:at]), words[at:]))
    assert len(found) == 1, f"{PAGE}: {len(found)} torchrun commands with {flag}, expected one"
    return found[0]


def launch_args(argv: list[str], overrides: list[str], nproc: int | None = None, port: int | None = None) -> list[str]:
    """``argv`` (a README torchrun line) run by this interpreter: ``--nproc-per-node`` and the rendezvous port
    replaced when given, and ``overrides`` instead of the line's own values of the same keys."""
    keys = {o.split("=", 1)[0] for o in overrides}
    out = [sys.executable, "-m", "torch.distributed.run"]
    for word in argv[1:]:
        if nproc is not None and word.startswith("--nproc-per-node="):
            word = f"--nproc-per-node={nproc}"
        elif port is not None and word.startswith("--rdzv-endpoint="):
            word = f"--rdzv-endpoint=localhost:{port}"
        elif "=" in word and not word.startswith("-") and word.split("=", 1)[0] in keys:
            continue
        out.append(word)
    return out + overrides


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], cwd: pathlib.Path, log: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A launcher in its own session (so that it and its workers can be ended together), output to ``cwd/log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    with open(cwd / log, "w") as out:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish(procs: list[subprocess.Popen], cwd: pathlib.Path, logs: list[str]) -> None:
    """Waits for every launcher; one that fails (or the deadline) ends the others, and the test fails with the logs."""
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the session start() made: this launcher and its workers
            p.wait()
    if any(p.returncode != 0 for p in procs):
        pytest.fail("\n".join(f"--- {log} (exit {p.returncode}):\n{(cwd / log).read_text()[-3000:]}"
                              for p, log in zip(procs, logs)))


def workers(launcher: int) -> dict[int, int]:
    """``{RANK: pid}`` of the workers torchrun's agent (process ``launcher``) runs now: its children, from /proc."""
    out = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0") if parent == launcher else []
        except (OSError, ValueError):  # a process that ended while we looked
            continue
        out.update({int(v[5:]): int(stat.parent.name) for v in environ if v.startswith(b"RANK=")})
    return out


def records(run: pathlib.Path) -> list[dict]:
    """metrics.jsonl without its wall times."""
    return [{k: v for k, v in json.loads(line).items() if k != "time_s"}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(run: pathlib.Path, ref: pathlib.Path, overrides: list[str]) -> None:
    """``run`` logged, summarized and checkpointed what ``ref`` did, bit for bit."""
    assert records(run) == records(ref)
    summary = lambda r: json.loads((r / "summary.json").read_text())["metrics"]  # noqa: E731
    assert summary(run) == summary(ref)
    cfg = cfg_of("experiment=tiny_lm", *overrides)
    final = f"checkpoints/step_{cfg.trainer.max_steps:07d}"
    got, want = load_checkpoint(run / final, cfg), load_checkpoint(ref / final, cfg)
    for path, x, y in zip(fx.tree.paths(want), fx.tree.leaves(want), fx.tree.leaves(got)):
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), path


@pytest.fixture(scope="module")
def one_launcher(tmp_path_factory):
    """``layout -> run directory`` of one launcher (``--standalone``) with the two nodes' world size, run once."""
    runs = {}

    def run(layout: str) -> pathlib.Path:
        if layout not in runs:
            overrides, nproc = LAYOUTS[layout]
            _, runs[layout] = torchrun_train(tmp_path_factory.mktemp(layout), "experiment=tiny_lm", *overrides, *TINY,
                                             nproc=2 * nproc, timeout=TIMEOUT_S)
        return runs[layout]

    return run


@pytest.mark.multiprocess
# dp in the fast suite; hsdp (a node per replica, 4 ranks) in make test-all: the same launcher path, twice the ranks
@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.slow] if n != "dp" else []) for n in LAYOUTS])
def test_two_nodes_equal_one_launcher(tmp_path, one_launcher, layout):
    overrides, nproc = LAYOUTS[layout]
    env, argv = readme_command("--nnodes=2")
    argv = launch_args(argv, [*overrides, *TINY], nproc=nproc, port=free_port())
    logs = ["node0.log", "node1.log"]
    finish([start(argv, tmp_path, log, env) for log in logs], tmp_path, logs)
    (run,) = [p.parent for p in (tmp_path / "outputs").rglob("summary.json")]
    texts = [(tmp_path / log).read_text() for log in logs]
    assert sum(f"[{2 * nproc} ranks" in t for t in texts) == 1  # one world; rank 0 (on either node) says so
    assert_same_run(run, one_launcher(layout), [*overrides, *TINY])


@pytest.mark.multiprocess
def test_a_killed_rank_restarts_the_group_and_resumes(tmp_path, one_launcher):
    overrides, _ = LAYOUTS["dp"]
    env, argv = readme_command("--max-restarts=1")
    proc = start(launch_args(argv, [*overrides, *TINY]), tmp_path, "restart.log", env)
    deadline = time.monotonic() + TIMEOUT_S
    while not [p for p in (tmp_path / "outputs").glob("**/checkpoints") if checkpoint.latest(p)]:
        if proc.poll() is not None or time.monotonic() > deadline:
            finish([proc], tmp_path, ["restart.log"])
            pytest.fail(f"the run ended (exit {proc.returncode}) before its first checkpoint was seen")
        time.sleep(0.01)
    ranks = workers(proc.pid)
    assert 0 in ranks, f"rank 0 ended before the kill (the run outpaced the test): {ranks}"
    os.kill(ranks[0], signal.SIGKILL)  # rank 0: the writer of the run's files, and the lock holder
    finish([proc], tmp_path, ["restart.log"])
    log = (tmp_path / "restart.log").read_text()
    assert "failed (exitcode: -9) local_rank: 0" in log, log[-3000:]  # torchrun saw the kill, and went on
    assert "shares its store" not in log  # the runner's warning for restarts that cannot work (_runtime.py)
    starts = re.findall(r"^start  from (.*)$", log, flags=re.M)  # rank 0's start line: once per start of the group
    assert len(starts) == 2, log[-3000:]
    resumed = re.search(r"\(step (\d+)\)$", starts[1])
    assert starts[0].startswith("step 0") and resumed and 4 <= int(resumed.group(1)) < 24, starts
    (run,) = [p.parent for p in (tmp_path / "outputs").rglob("run.json")]  # one directory, reused by the restart
    assert_same_run(run, one_launcher("dp"), [*overrides, *TINY])
