"""JAX parity study: the same MLP trained in Optax+JAX and in fxtrain, from the same initial parameters
and the same batches. Writes results.md (table) and loss_curves.png next to this file.

    .venv/bin/python experiments/jax_parity/run.py [--steps 300] [--hidden 128 128] [--batch 64]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fxtrain as fx
from fxtrain import tree
from fxtrain.data import digits
from fxtrain.interop import from_jax, to_jax, to_linen
from fxtrain.models import MLP

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402 - experiments/bench/_common.py: where results go


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 128])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    _common.add_output_args(ap, HERE)  # results.md and loss_curves.png
    args = ap.parse_args(argv)
    args.out = _common.output_dir(ap, args, HERE)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    import jax
    import jax.numpy as jnp
    import optax

    # --- build: one torch init, one data order, for both frameworks
    torch.manual_seed(0)
    net = MLP(input_shape=(1, 8, 8), hidden=args.hidden, num_classes=10)
    apply, params, buffers = fx.functional(net)
    data = digits(batch_size=args.batch, seed=0)
    batches = [data.train[k] for k in range(args.steps)]
    jparams = to_linen(tree.clone(params), net)["params"]  # a copy: the donated fxtrain step writes in place
    n_dense = len(args.hidden) + 1

    def torch_loss(p, batch):
        x, y = batch
        return F.cross_entropy(apply(p, buffers, x, train=True)[0], y)

    def jax_loss(p, x, y):
        h = x.reshape(x.shape[0], -1)
        for i in range(n_dense):
            h = h @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
            h = jax.nn.relu(h) if i < n_dense - 1 else h
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(args.lr, weight_decay=1e-4))
    otx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=1e-4))
    step = fx.train_step(torch_loss, tx)  # donated: this stack runs as torch's fused AdamW kernel (clip in grad_scale)
    pure_step = fx.train_step(torch_loss, tx, donate=False)  # out of place, one torch op per leaf: Optax's order
    pparams = tree.clone(params)

    @jax.jit
    def jstep(p, s, x, y):
        loss, g = jax.value_and_grad(jax_loss)(p, x, y)
        u, s = otx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    # --- loop: both frameworks, step by step, timed
    def params_diff(torch_params) -> float:  # max over leaves of max |torch - jax| / max |jax|
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in
                   zip(tree.leaves(to_linen(torch_params, net, as_jax=False)["params"]), tree.leaves(from_jax(jparams))))

    state, pstate, jstate = tx.init(params), tx.init(pparams), otx.init(jparams)
    jbatches = [(to_jax(x), to_jax(y.to(torch.int32))) for x, y in batches]
    losses, plosses, jlosses, times, jtimes = [], [], [], [], []
    for k in range(args.steps):
        t0 = time.perf_counter()
        params, state, metrics = step(params, state, batches[k])
        losses.append(float(metrics["loss"]))  # the host read ends the step
        t1 = time.perf_counter()
        jparams, jstate, jloss = jstep(jparams, jstate, *jbatches[k])
        jlosses.append(float(jloss))
        t2 = time.perf_counter()
        times.append(t1 - t0)
        jtimes.append(t2 - t1)
        pparams, pstate, pmetrics = pure_step(pparams, pstate, batches[k])
        plosses.append(float(pmetrics["loss"]))
        if k == 0:
            first = params_diff(params), params_diff(pparams)

    warm = slice(10, None)  # the first steps include jit compilation and allocator warm-up
    ms, jms = statistics.median(times[warm]) * 1e3, statistics.median(jtimes[warm]) * 1e3
    report(args, losses, plosses, jlosses, ms, jms, first, (params_diff(params), params_diff(pparams)))


def report(args, losses, plosses, jlosses, ms, jms, first, final) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({0, 1, 2, 5, 10, *range(25, args.steps, 25), args.steps - 1})
    lines = [
        f"MLP 64-{'-'.join(map(str, args.hidden))}-10, digits, batch {args.batch}, "
        f"chain(clip_by_global_norm(1.0), adamw({args.lr}, weight_decay=1e-4)), {args.steps} steps, "
        f"torch threads {args.threads}",
        "",
        "| step | Optax+JAX loss | fxtrain loss (donated) | abs diff | fxtrain loss (pure) | abs diff |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {k} | {jlosses[k]:.6f} | {losses[k]:.6f} | {abs(losses[k] - jlosses[k]):.1e} | {plosses[k]:.6f} | "
              f"{abs(plosses[k] - jlosses[k]):.1e} |" for k in rows]
    lines += [
        "",
        "| difference from Optax+JAX | fxtrain donated (fused AdamW kernel) | fxtrain pure (donate=False) |",
        "|---|---:|---:|",
        f"| params after the first step, max relative difference per leaf | {first[0]:.2e} | {first[1]:.2e} |",
        f"| loss, max abs difference over all steps | {max(abs(a - b) for a, b in zip(losses, jlosses)):.2e} | "
        f"{max(abs(a - b) for a, b in zip(plosses, jlosses)):.2e} |",
        f"| final params, max relative difference per leaf | {final[0]:.2e} | {final[1]:.2e} |",
    ]
    lines += [
        "",
        "| | fxtrain (train_step, donated, eager) | Optax+JAX (jax.jit) |",
        "|---|---:|---:|",
        f"| median step time (ms, steps 10+) | {ms:.3f} | {jms:.3f} |",
    ]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(losses, label="fxtrain (donated)", lw=2)
    ax.plot(jlosses, label="Optax+JAX", lw=1, ls="--")
    ax.set(xlabel="step", ylabel="training loss", yscale="log", title="Loss curves (same init, same batches)")
    ax.legend()
    ax2.plot([abs(a - b) + 1e-12 for a, b in zip(losses, jlosses)], label="donated (fused AdamW kernel)")
    ax2.plot([abs(a - b) + 1e-12 for a, b in zip(plosses, jlosses)], label="pure (donate=False)")
    ax2.legend()
    ax2.set(xlabel="step", ylabel="|loss_fxtrain - loss_optax|", yscale="log", title="Difference")
    fig.tight_layout()
    fig.savefig(args.out / "loss_curves.png", dpi=100)


if __name__ == "__main__":
    main()
