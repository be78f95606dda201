"""``make gpu-check`` (experiments/gpu/check.py) where there is no GPU: it skips in one line with exit code 0,
its CPU fallback runs every phase's code at toy sizes and writes the report, the ``cuda`` tests skip cleanly;
and the device plumbing it relies on (fxtrain/data.py's batches reach a CUDA device through pinned memory
without making the host wait; the runner builds everything on the device it is given).
"""

import importlib.util
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

import fxtrain as fx
from fxtrain import data as data_module, train as runner
from fxtrain.data import from_source, stdlib_text, synthetic
from tests._runner import cfg_of, isolate  # noqa: F401 - isolate: autouse (runs write under tmp_path)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu" / "check.py"


def check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the script ------------------------------------------------------------------------------------------

def test_without_cuda_it_skips_in_one_line_and_exits_0():
    results = sorted((SCRIPT.parent / "results").glob("*")) if (SCRIPT.parent / "results").exists() else []
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, even on a GPU machine
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [proc.stdout.strip()]
    assert proc.stdout.startswith("gpu-check: skipped, no CUDA device here (")
    assert proc.stderr == ""
    assert (sorted((SCRIPT.parent / "results").glob("*")) if (SCRIPT.parent / "results").exists() else []) == results


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_runs_the_script():
    # Under `make test` the environment carries the outer make's MAKEFLAGS/MAKELEVEL, which make a nested make
    # print "Entering/Leaving directory" lines: the command is read from a make of its own.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(["make", "-n", "--no-print-directory", "gpu-check", "ARGS=--phases amp"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == ".venv/bin/python experiments/gpu/check.py --phases amp"


def test_bad_arguments_are_named(capsys):
    check = check_module()
    with pytest.raises(SystemExit) as info:
        check.main(["--cpu-fallback", "--phases", "amp,bench", "--no-write"])
    assert info.value.code == 2 and "--phases amp,bench: bench is not a phase; choose from tests, amp, sweep" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):  # a toy CPU run never lands where the GPU's results are committed
        check.main(["--cpu-fallback"])
    assert "--cpu-fallback measures toy sizes on the CPU: pass --out DIR or --no-write" in capsys.readouterr().err


def test_the_cpu_fallback_writes_the_amp_table_from_the_amp_study(tmp_path, capsys):
    assert check_module().main(["--cpu-fallback", "--phases", "amp", "--presets", "off,fp16", "--out",
                                str(tmp_path)]) == 0
    text = (tmp_path / "gpu_check.md").read_text()
    assert text == capsys.readouterr().out.split("written to")[0].rstrip("\n") + "\n"
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| resnet_baseline", "| tiny_lm"))]
    assert [(r[0], r[1]) for r in rows] == [("| resnet_baseline", "`off`"), ("| resnet_baseline", "`fp16`"),
                                            ("| tiny_lm", "`off`"), ("| tiny_lm", "`fp16`")]
    for r in rows:
        params, ms, vs, train_loss, test_loss, skipped, scale = (r[3], r[5], r[6], r[7], r[8], r[9], r[10].rstrip(" |"))
        assert int(params.replace(",", "")) > 1000 and float(ms.split()[0]) > 0 and float(vs) > 0
        assert math.isfinite(float(train_loss)) and 0 < float(test_loss) < 10 and skipped == "0"
        assert float(scale) == (65536.0 if r[1] == "`fp16`" else 1.0)  # GradScaler's initial scale, kept
    assert "Overrides: resnet_baseline: `model.width=4 data.batch_size=16`" in text
    assert "CPU fallback (toy sizes, a check of the script, not a result)" in text


def test_the_cpu_fallback_runs_the_cuda_tests_which_all_skip():
    outcome = check_module().run_tests()
    n = len(re.findall(r"^def test_", (ROOT / "tests" / "test_cuda.py").read_text(), flags=re.M))
    # Every test of test_cuda.py is marked cuda and skips without a device (parametrized ones count several).
    assert outcome["ok"] and set(outcome["counts"]) == {"skipped"} and outcome["counts"]["skipped"] >= n > 5
    assert outcome["failures"] == []


@pytest.mark.slow  # the vmapped group vs the basic launcher: tests/test_vmap_launcher.py in the fast suite
def test_the_cpu_fallback_times_both_launchers_of_the_sweep():
    check = check_module()
    sweep = check.sweep_rows("cpu", check.sizes(cpu_fallback=True))
    assert sweep["jobs"] == 2 and sweep["diff"] < 1e-4  # the vmapped group's numbers are the basic launcher's
    assert [r[0] for r in sweep["rows"]] == ["basic", "vmap"] and sweep["rows"][0][3:] == ["1.00x", "1.00x"]
    assert all(r[1] > r[2] > 0 for r in sweep["rows"])  # wall > train > 0 seconds


# --- the device plumbing ---------------------------------------------------------------------------------

@pytest.fixture
def fake_cuda_copies(monkeypatch):
    """``Tensor.pin_memory`` and ``Tensor.to(<cuda device>)`` recorded (and left on the CPU): what fxtrain.data
    asks of a copy to a CUDA device, on a machine without one."""
    calls = []
    real_to = torch.Tensor.to

    def pin_memory(self):
        calls.append(("pin", self.data_ptr()))
        return self

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            calls.append(("to", self.data_ptr(), str(target), kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return calls


def test_host_tensors_reach_cuda_through_pinned_memory_without_waiting(fake_cuda_copies):
    x = torch.arange(6)
    for device in ("cuda", torch.device("cuda", 1)):
        assert data_module._to_device(x, device) is x  # (left on the CPU by the fake)
    assert fake_cuda_copies == [("pin", x.data_ptr()), ("to", x.data_ptr(), "cuda", True),
                                ("pin", x.data_ptr()), ("to", x.data_ptr(), "cuda:1", True)]
    del fake_cuda_copies[:]
    assert data_module._to_device(x, "cpu") is x and data_module._to_device(x, "meta").device.type == "meta"
    assert fake_cuda_copies == []


def test_batches_collated_on_the_host_reach_cuda_through_pinned_memory(fake_cuda_copies):
    data = from_source(TensorDataset(torch.randn(40, 3), torch.arange(40)), name="mine", batch_size=8).to("cuda")
    del fake_cuda_copies[:]  # the test split's one move
    for k in range(3):
        data.train[k]
    assert [c[0] for c in fake_cuda_copies] == ["pin", "to"] * 6  # x and y of every step
    assert {c[2:] for c in fake_cuda_copies if c[0] == "to"} == {("cuda", True)}


@pytest.mark.parametrize("source", ["windows", "shuffled"])
def test_indices_made_on_the_host_follow_the_data_to_its_device(source, monkeypatch):
    # The tokens (rows) live on the device; each step's window offsets (each epoch's permutation) are drawn
    # on the host and go where the data is, through _to_device (pinned for CUDA, above).
    moves = []
    real = data_module._to_device
    monkeypatch.setattr(data_module, "_to_device", lambda x, device: moves.append((x.device.type, str(device))) or
                        real(x, device))
    data = (stdlib_text(batch_size=4, context=8, max_bytes=5000) if source == "windows"
            else synthetic(batch_size=8, num_examples=64)).to("meta")
    for k in range(7):  # the synthetic rows: 48 training examples, 6 batches an epoch
        x, y = data.train[k]
        assert x.device.type == y.device.type == "meta"
    assert moves == [("cpu", "meta")] * (7 if source == "windows" else 2)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_batches_for_other_devices_are_not_pinned(device, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pytest.fail("pinned for " + device))
    for data in (from_source(TensorDataset(torch.randn(40, 3), torch.arange(40)), name="mine", batch_size=8),
                 stdlib_text(batch_size=4, context=8, max_bytes=5000), synthetic(batch_size=8, num_examples=64)):
        x, y = data.to(device).train[3]
        assert x.device.type == y.device.type == device


@pytest.mark.parametrize("experiment", ["digits_mlp", "resnet_baseline", "tiny_lm"])
def test_the_runner_builds_everything_on_the_device_it_is_given(experiment):
    # On the meta device nothing is allocated: a tensor the build made on the CPU by mistake shows as "cpu".
    built = runner.build_run(cfg_of(f"experiment={experiment}", "trainer.device=cpu"), torch.device("meta"))
    devices = {x.device.type for x in fx.tree.leaves((built.params, built.buffers, built.data.test,
                                                      built.data.train[0]))}
    assert devices == {"meta"}
    # The optimizer state too, but for the counters a transform reads on the host to decide its path
    # (accumulate's mini_step and emitted: integers on the CPU, never a device sync).
    on_host = [x for x in fx.tree.leaves(built.opt_state) if isinstance(x, torch.Tensor) and x.device.type == "cpu"]
    assert all(x.ndim == 0 and not x.is_floating_point() for x in on_host)
    assert len(on_host) == (2 if experiment == "tiny_lm" else 0)
    if experiment == "resnet_baseline":  # a whole step (BatchNorm buffers, weight decay, SGD) stays on the device
        params, state, buffers, metrics = built.step(built.params, built.opt_state, built.buffers, built.data.train[0])
        assert {x.device.type for x in fx.tree.leaves((params, state, buffers, metrics))} == {"meta"}
