"""fxtrain/interop/_arrays.py: zero-copy trees through DLPack, both ways, every dtype."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
from typing import NamedTuple

import pytest
import torch

import fxtrain as fx
from fxtrain.interop import from_jax, to_jax

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytestmark = pytest.mark.jax

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int16, torch.int8, torch.uint8,
          torch.bool, torch.complex64]


def sample(dtype: torch.dtype, shape=(3, 4)) -> torch.Tensor:
    x = torch.randn(shape) * 50
    return (x > 0) if dtype == torch.bool else x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_exact_and_zero_copy_both_ways(dtype):
    t = sample(dtype)
    a = to_jax(t)
    assert a.dtype == jnp.dtype(str(dtype).removeprefix("torch."))
    assert a.shape == t.shape
    assert a.unsafe_buffer_pointer() == t.data_ptr()  # torch -> jax shares the buffer
    back = from_jax(a, copy=False)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()  # jax -> torch too, when asked
    assert torch.equal(back, t)
    copied = from_jax(a)  # the default: torch's own memory, which a donated step may write
    assert copied.dtype == dtype and copied.data_ptr() != t.data_ptr() and torch.equal(copied, t)
    assert not fx.tree.borrowed(copied) and fx.tree.borrowed(back)


def test_jax_created_arrays_come_over_without_copy_when_asked():
    a = jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4)
    t = from_jax(a, copy=False)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert t.dtype == torch.bfloat16 and t.tolist() == a.astype(jnp.float32).tolist()


class Pair(NamedTuple):
    a: object
    b: object


def test_containers_none_and_non_array_leaves_pass_through():
    t = {"w": torch.ones(2), "frozen": None, "meta": ("name", 3, 0.5), "pair": Pair(torch.zeros(()), [None])}
    out = to_jax(t)
    assert isinstance(out["w"], jax.Array) and out["frozen"] is None and out["meta"] == ("name", 3, 0.5)
    assert isinstance(out["pair"], Pair) and out["pair"].b == [None] and out["pair"].a.shape == ()
    back = from_jax(out)
    assert back["frozen"] is None and back["meta"] == ("name", 3, 0.5) and isinstance(back["pair"], Pair)
    assert torch.equal(back["w"], t["w"])


def test_parameters_and_views_are_detached_and_shared():
    p = torch.nn.Parameter(torch.randn(4, 3))
    a = to_jax({"w": p})["w"]  # requires_grad: detached, still the same memory
    assert a.unsafe_buffer_pointer() == p.data_ptr()
    view = p.detach().t()  # strided view: shared as is
    assert (to_jax(view) == jnp.asarray(view.numpy())).all()


def test_64_bit_needs_jax_x64_and_names_the_leaf():
    with pytest.raises(TypeError, match=r"'ids'.*torch.int64.*jax_enable_x64"):
        to_jax({"ids": torch.arange(3)})
    with jax.enable_x64(True):
        for t in (torch.randn(3, dtype=torch.float64), torch.arange(3)):
            a = to_jax(t)
            assert a.dtype == jnp.dtype(str(t.dtype).removeprefix("torch.")) and from_jax(a).dtype == t.dtype
            assert a.unsafe_buffer_pointer() == t.data_ptr()


_DTENSOR_SCRIPT = textwrap.dedent('''
    import os, sys
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def run(rank, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        import jax
        from fxtrain.interop import from_jax, to_jax
        mesh = init_device_mesh("cpu", (2,))
        full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        d = distribute_tensor(full, mesh, [Shard(0)])
        tree = {"w": d, "b": None}
        whole = to_jax(tree)["w"]
        assert whole.shape == (4, 3) and (from_jax(whole) == full).all(), whole
        local = to_jax(tree, local=True)["w"]
        assert local.shape == (2, 3) and (from_jax(local) == full[2 * rank:2 * rank + 2]).all()
        assert local.unsafe_buffer_pointer() == d.to_local().data_ptr()  # the shard, no copy
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(run, args=(int(sys.argv[1]),), nprocs=2)
        print("ok")
''')


def test_dtensor_leaves_give_the_full_value_or_with_local_the_shard(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "dtensor_to_jax.py"
    script.write_text(_DTENSOR_SCRIPT)
    root = pathlib.Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(script), str(port)], cwd=root, capture_output=True, text=True,
                       timeout=240, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
