"""fxtrain/interop/__init__.py: JAX stays optional. Without it the core imports and trains, interop calls
name the extra, and interop doctests skip."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import fxtrain as fx

ROOT = pathlib.Path(__file__).resolve().parents[1]

BLOCK_JAX = textwrap.dedent('''
    import sys

    class BlockJax:  # as if the `jax` extra were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("jax", "jaxlib", "optax", "flax"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, BlockJax())
''')


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_JAX + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_public_names():
    assert fx.interop.__all__ == ["to_jax", "from_jax", "state_to_optax", "state_from_optax", "to_linen",
                                  "from_linen", "linen_names", "jax_function", "from_nnx", "to_nnx",
                                  "state_from_nnx_optimizer", "state_to_nnx_optimizer", "save_safetensors",
                                  "load_safetensors", "save_orbax", "load_orbax"]


def test_without_jax_the_core_trains_and_interop_names_the_extra():
    r = run('''
        import torch, fxtrain as fx
        assert "jax" not in sys.modules
        tx = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(0.1))
        step = fx.train_step(lambda p, b: ((p["w"] - b) ** 2).sum(), tx)
        p = {"w": torch.zeros(3)}
        s = tx.init(p)
        for _ in range(3):
            p, s, m = step(p, s, torch.ones(3))
        assert float(p["w"][0]) > 0
        # linen naming without JAX: torch leaves
        net = torch.nn.Linear(2, 3)
        assert fx.interop.to_linen(dict(net.named_parameters()), net, as_jax=False)["params"]["kernel"].shape == (2, 3)
        for call in (lambda: fx.interop.to_jax(p), lambda: fx.interop.from_jax(p),
                     lambda: fx.interop.state_to_optax(s, s), lambda: fx.interop.jax_function(lambda x: x)(p["w"])):
            try:
                call()
            except ImportError as e:
                assert "pip install 'fxtrain[jax]'" in str(e), e
            else:
                raise AssertionError("expected ImportError")
        print("ok")
    ''')
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_without_jax_interop_doctests_skip_and_a_core_test_file_passes():
    r = run('''
        import pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "fxtrain/interop", "tests/test_momentum.py",
                              "tests/test_interop_arrays.py"]))
    ''')
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    progress = r.stdout.splitlines()[0]
    assert "s" in progress and "." in progress and "F" not in progress and "E" not in progress  # skips and passes
