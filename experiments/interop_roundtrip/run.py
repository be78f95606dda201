"""Round trip through Orbax: JAX -> fxtrain and fxtrain -> JAX, against the run that never crossed.

    .venv/bin/python experiments/interop_roundtrip/run.py --write              # replaces results.md here
    .venv/bin/python experiments/interop_roundtrip/run.py --out /tmp/roundtrip  # a fresh copy (make studies)

An MLP (flax.linen Dense 16-64-64-4 / torch nn.Linear, tanh) is trained with chain(clip_by_global_norm(1.0),
adamw(1e-3, weight_decay=1e-2)) on seeded regression batches. JAX -> fxtrain: STEPS steps in JAX (jit),
saved with ocp.StandardCheckpointer, read by fx.interop.load_orbax, STEPS more in fxtrain; compared with
2 * STEPS steps in JAX. fxtrain -> JAX: STEPS steps in fxtrain, fx.interop.save_orbax, restored by Orbax
against optax's own init, STEPS more in JAX; compared with 2 * STEPS in fxtrain. fxtrain runs both the pure
step (tx.update + apply_updates, donate=False's arithmetic) and the donated fx.train_step (torch's fused
AdamW kernel, whose float64 bias corrections differ from Optax's float32 ones). float32, CPU, 1 thread.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import torch
from torch import nn

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402 - experiments/bench/_common.py: where results go

import fxtrain as fx  # noqa: E402
from fxtrain.interop import from_linen, load_orbax, save_orbax, to_jax, to_linen  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import linen  # noqa: E402

LR, WD, CLIP, BATCH, SIZES = 1e-3, 1e-2, 1.0, 64, (16, 64, 64, 4)


class FlaxMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        for width in SIZES[1:-1]:
            x = jnp.tanh(linen.Dense(width)(x))
        return linen.Dense(SIZES[-1])(x)


def torch_mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(SIZES[:-2], SIZES[1:-1]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(SIZES[-2], SIZES[-1]))


def batches(n: int):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(SIZES[0], SIZES[-1], generator=g)
    xs = torch.randn(n, BATCH, SIZES[0], generator=g)
    return [(x, torch.sin(x @ w)) for x in xs]


def txs():
    return (optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=WD)),
            fx.chain(fx.clip_by_global_norm(CLIP), fx.adamw(LR, weight_decay=WD)))


def jax_steps(params, state, data):
    otx, _ = txs()

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((FlaxMLP().apply({"params": p}, x) - y) ** 2))(params)
        updates, state = otx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for x, y in data:
        params, state, loss = step(params, state, to_jax(x), to_jax(y))
        losses.append(float(loss))
    return params, state, losses


def fx_steps(net, params, state, data, donated: bool):
    _, tx = txs()

    def loss_fn(p, batch):
        x, y = batch
        return torch.mean((torch.func.functional_call(net, p, (x,)) - y) ** 2)

    losses = []
    if donated:
        step = fx.train_step(loss_fn, tx)
        params, state = fx.tree.clone(params), fx.tree.clone(state)
        for batch in data:
            params, state, metrics = step(params, state, batch)
            losses.append(float(metrics["loss"]))
        return params, state, losses
    for batch in data:
        grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        params = fx.apply_updates(params, updates)
        losses.append(float(loss))
    return params, state, losses


def rel(got: dict, expected: dict) -> float:
    return max(float((got[k] - expected[k]).abs().max() / expected[k].abs().max()) for k in expected)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="steps on each side of the crossing")
    _common.add_output_args(parser, HERE)  # results.md
    args = parser.parse_args(argv)
    out = _common.output_dir(parser, args, HERE)
    torch.set_num_threads(1)
    n = args.steps
    data = batches(2 * n)
    otx, tx = txs()
    net = torch_mlp()
    work = pathlib.Path(tempfile.mkdtemp())
    rows = []

    # JAX -> fxtrain
    p0 = FlaxMLP().init(jax.random.key(0), jnp.zeros((1, SIZES[0])))["params"]
    p_half, s_half, _ = jax_steps(p0, otx.init(p0), data[:n])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(work / "jax", {"params": p_half, "opt_state": s_half})
    checkpointer.wait_until_finished()
    p_full, _, jax_losses = jax_steps(p0, otx.init(p0), data)
    truth = from_linen({"params": p_full}, net)
    for donated in (False, True):
        like = {k: p.detach() for k, p in net.named_parameters()}
        params, state = load_orbax(work / "jax", like, tx, module=net)
        params, _, losses = fx_steps(net, params, state, data[n:], donated)
        rows.append((f"JAX {n} -> Orbax -> fxtrain {n} ({'donated' if donated else 'pure'})", f"JAX {2 * n}",
                     rel(params, truth), losses[-1], jax_losses[-1]))

    # fxtrain -> JAX
    torch.manual_seed(0)
    start = {k: p.detach().clone() for k, p in torch_mlp().named_parameters()}
    for donated in (False, True):
        params, state, _ = fx_steps(net, start, tx.init(start), data[:n], donated)
        path = work / f"fx_{donated}"
        save_orbax(path, params, state, tx, step=n, module=net)
        target = to_linen(params, net)["params"]
        target = {"params": target, "opt_state": otx.init(target)}
        restored = ocp.StandardCheckpointer().restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, target))
        jp, _, losses = jax_steps(restored["params"], restored["opt_state"], data[n:])
        full, _, fx_losses = fx_steps(net, start, tx.init(start), data, donated)
        kind = "donated" if donated else "pure"
        rows.append((f"fxtrain {n} ({kind}) -> Orbax -> JAX {n}", f"fxtrain {2 * n} ({kind})",
                     rel(from_linen({"params": jp}, net), full), losses[-1], fx_losses[-1]))

    out.mkdir(parents=True, exist_ok=True)
    lines = [f"MLP {'-'.join(map(str, SIZES))} (tanh), batch {BATCH}, chain(clip_by_global_norm({CLIP}), "
             f"adamw({LR}, weight_decay={WD})), {n} + {n} steps against {2 * n}, float32, torch threads 1",
             "",
             "| run | compared with | final params, max relative difference per leaf | final loss | "
             "final loss (never crossed) |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {d:.2e} | {l1:.6f} | {l2:.6f} |" for a, b, d, l1, l2 in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
