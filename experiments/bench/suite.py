"""Benchmark suite (issue 10): fxtrain's step, eager and compiled, against torch.optim and Optax+jax.jit.

One markdown table per run (``results/suite.md``), every row timed side by side in this one process
(interleaved rounds, medians; see _common.py), each ratio against rows measured in the same rounds:

* **compute-bound**: MLP 784-1024-1024-1024-10, batch 128, clip_by_global_norm(1.0) + AdamW, float32.
* **update-bound**: MLP 4096-4096-4096-4096-10 (50.4M params), batch 16, AdamW alone; plus the update
  alone on fixed gradients, against the memory-bandwidth bound of a fused AdamW (28 bytes per param:
  read param, grad, two moments; write param, two moments) at the bandwidth of a triad
  ``a = b + s * c`` measured in this run.
* **peak memory**: each (case, variant) runs a few steps in its own subprocess, which reports its peak
  RSS above its RSS after imports and data (``ru_maxrss``; max_memory_allocated on GPU is not measured:
  CPU only).

Rows: ``torch.optim foreach`` (the imperative loop: ``zero_grad``, ``backward``, ``clip_grad_norm_``,
``AdamW(foreach=True).step()``), ``torch.optim fused`` (``AdamW(fused=True)``), ``fxtrain eager``
(``fx.train_step``, donated; AdamW alone takes torch's fused kernel, see fxtrain/transforms/_fused.py),
``fxtrain compiled`` (``compile=True``), ``Optax+jax.jit`` (``donate_argnums=(0, 1)``, when jax imports).

Usage:
    python experiments/bench/suite.py [--rounds 40] [--big-rounds 12] [--threads 2] [--no-memory] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import fxtrain as fx  # noqa: E402
from fxtrain.step import _CompiledUpdate  # noqa: E402 - the update halves train_step runs, timed alone
from fxtrain.transforms import _fused  # noqa: E402

LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 1e-4, 1.0  # Optax's default decay (torch's is 1e-2), same math both sides
ADAMW_BYTES_PER_PARAM = 28  # fused AdamW: read p, g, m, v (16 B), write p, m, v (12 B), float32


class Case(NamedTuple):
    name: str
    sizes: tuple
    batch: int
    clip: bool


CASES = {
    "mlp": Case("compute-bound: MLP 784-1024-1024-1024-10, batch 128, clip + AdamW", (784, 1024, 1024, 1024, 10), 128, True),
    "big": Case("update-bound: MLP 4096x4 (50.4M params), batch 16, AdamW", (4096, 4096, 4096, 4096, 10), 16, False),
}
VARIANTS = ["torch.optim foreach", "torch.optim fused", "fxtrain eager", "fxtrain compiled", "Optax+jax.jit"]


# --- models -----------------------------------------------------------------------------------------

def make_model(case: Case, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(case.sizes[:-1], case.sizes[1:])):
        layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(case.sizes) - 2 else [])
    return nn.Sequential(*layers)


def params_of(model: nn.Sequential) -> dict:
    return {"layers": [{"w": m.weight.detach().clone(), "b": m.bias.detach().clone()}
                       for m in model if isinstance(m, nn.Linear)]}


def loss_fn(params: dict, batch: tuple) -> torch.Tensor:
    x, y = batch
    *hidden, last = params["layers"]
    for layer in hidden:
        x = torch.relu(F.linear(x, layer["w"], layer["b"]))
    return F.cross_entropy(F.linear(x, last["w"], last["b"]), y)


def make_tx(case: Case) -> fx.GradientTransformation:
    adamw = fx.adamw(LR, weight_decay=WEIGHT_DECAY)
    return fx.chain(fx.clip_by_global_norm(MAX_NORM), adamw) if case.clip else adamw


def batches(case: Case, n: int = 16) -> list:
    # Random labels: the loss never reaches zero, gradients stay normal (subnormals slow x86 2x; step.py).
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(case.batch, case.sizes[0], generator=g), torch.randint(0, case.sizes[-1], (case.batch,), generator=g))
            for _ in range(n)]


# --- variants: each returns a zero-argument callable running one step on its own state -------------

def torch_step(case: Case, data: list, fused: bool) -> Callable:
    model = make_model(case)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                            **({"fused": True} if fused else {"foreach": True}))
    it = iter(range(1 << 62))

    def step():
        x, y = data[next(it) % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if case.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        opt.step()
        return loss
    return step


def fx_step(case: Case, data: list, compile: bool) -> Callable:  # noqa: A002
    tx = make_tx(case)
    holder = {"params": params_of(make_model(case))}
    holder["state"] = tx.init(holder["params"])
    step_fn = fx.train_step(loss_fn, tx, compile=compile)
    it = iter(range(1 << 62))

    def step():
        holder["params"], holder["state"], metrics = step_fn(holder["params"], holder["state"], data[next(it) % len(data)])
        return metrics["loss"]
    return step


def optax_step(case: Case, data: list) -> Callable | None:
    try:
        import jax
        import jax.numpy as jnp
        import optax
    except ImportError:
        return None
    params = jax.tree.map(lambda t: jnp.asarray(t.numpy()), params_of(make_model(case)))
    opt = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    if case.clip:
        opt = optax.chain(optax.clip_by_global_norm(MAX_NORM), opt)

    def loss(p, x, y):
        *hidden, last = p["layers"]
        for layer in hidden:
            x = jax.nn.relu(x @ layer["w"].T + layer["b"])
        logits = x @ last["w"].T + last["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def update(p, s, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    update = jax.jit(update.__wrapped__, donate_argnums=(0, 1))
    jdata = [(jnp.asarray(x.numpy()), jnp.asarray(y.numpy())) for x, y in data]
    holder = {"p": params, "s": opt.init(params)}
    it = iter(range(1 << 62))

    def step():
        x, y = jdata[next(it) % len(jdata)]
        holder["p"], holder["s"], value = update(holder["p"], holder["s"], x, y)
        return value.block_until_ready()
    return step


def build(case: Case, variant: str, data: list) -> Callable | None:
    return {
        "torch.optim foreach": lambda: torch_step(case, data, fused=False),
        "torch.optim fused": lambda: torch_step(case, data, fused=True),
        "fxtrain eager": lambda: fx_step(case, data, compile=False),
        "fxtrain compiled": lambda: fx_step(case, data, compile=True),
        "Optax+jax.jit": lambda: optax_step(case, data),
    }[variant]()


def update_only(case: Case) -> dict:
    """AdamW alone on fixed gradients (copied into place each call, ~1/7 of the traffic, in every row)."""
    fixed_tree = params_of(make_model(case, seed=1))
    fixed = [t for layer in fixed_tree["layers"] for t in (layer["w"], layer["b"])]  # model.parameters() order
    rows = {}
    for name, kw in [("torch.optim foreach", {"foreach": True}), ("torch.optim fused", {"fused": True})]:
        model = make_model(case)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **kw)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        grads = [p.grad for p in model.parameters()]
        rows[name] = lambda grads=grads, opt=opt: (torch._foreach_copy_(grads, fixed), opt.step())

    for name, compiled in [("fxtrain eager", False), ("fxtrain compiled", True)]:
        tx = fx.adamw(LR, weight_decay=WEIGHT_DECAY)
        holder = {"params": params_of(make_model(case))}
        holder["state"] = tx.init(holder["params"])
        grads = fx.tree.map(torch.zeros_like, holder["params"])
        run = _CompiledUpdate(tx) if compiled else None

        def call(tx=tx, holder=holder, grads=grads, run=run):
            torch._foreach_copy_(fx.tree.leaves(grads), fx.tree.leaves(fixed_tree))
            with torch.no_grad():
                if run is not None:
                    holder["params"], holder["state"] = run(grads, holder["state"], holder["params"])
                elif not _fused.step_(tx, grads, holder["state"], holder["params"]):
                    raise RuntimeError("expected the fused kernel")
        rows[name] = call
    grads = [torch.zeros_like(t) for t in fixed]
    rows["gradient copy alone"] = lambda: torch._foreach_copy_(grads, fixed)  # in every row above; subtracted
    return rows


def triad_gbps(n: int, rounds: int = 15) -> dict:
    """Memory bandwidth in GB/s from triads over ``n`` float32 elements (medians of ``rounds`` calls).

    ``stream``: STREAM's ``a = b + s * c`` into a third array, counted as 12 B/element as STREAM does;
    the store to ``a`` also costs a read-for-ownership of each line, so this undercounts the traffic.
    ``in_place``: ``a = a + s * c`` (12 B/element, every line written was just read): the access
    pattern of in-place optimizer kernels, and the bandwidth the AdamW bound uses.
    """
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    times = _common.interleaved({"stream": lambda: torch.add(b, c, alpha=0.5, out=a),
                                 "in_place": lambda: a.add_(c, alpha=1e-9)}, rounds=rounds)
    return {k: 3 * 4 * n / _common.summary(t)["median"] / 1e6 for k, t in times.items()}  # bytes / ms / 1e6


# --- memory: one subprocess per (case, variant) -----------------------------------------------------

def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """This process's peak RSS (``VmHWM``). Not ``ru_maxrss``: Linux carries that over from the parent
    through fork and exec, so every subprocess would report at least the parent's peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def memory_child(case_key: str, variant: str, steps: int) -> None:
    case = CASES[case_key]
    data = batches(case, 2)
    base = current_rss_mib()
    step = build(case, variant, data)
    if step is None:
        print(json.dumps(None))
        return
    step(), step()  # warm-up: compilation (torch, jax) and first-touch of every buffer
    warm_peak = peak_rss_mib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM: what follows is the steady state of the training loop
    for _ in range(steps):
        step()
    steady = peak_rss_mib()
    print(json.dumps({"base": base, "peak": max(warm_peak, steady), "steady": steady}))


def memory(case_key: str, variant: str, steps: int = 4) -> dict | None:
    out = subprocess.run([sys.executable, __file__, "--memory-child", case_key, variant, str(steps),
                          "--threads", str(torch.get_num_threads())], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- report -------------------------------------------------------------------------------------------

def verdict(value: float, target: float) -> str:
    return f"{value:.2f} (target <= {target}: {'met' if value <= target else '**MISSED**'})"


def run_case(key: str, rounds: int, mem: bool) -> tuple[str, dict]:
    case = CASES[key]
    data = batches(case)
    fns = {v: f for v in VARIANTS if (f := build(case, v, data)) is not None}
    t0 = time.perf_counter()
    for f in fns.values():  # compile (torch and jax) outside the timed rounds
        f(), f(), f()
    warm = time.perf_counter() - t0
    stats = {v: _common.summary(t) for v, t in _common.interleaved(fns, rounds=rounds, warmup=2).items()}
    mems = {v: memory(key, v) for v in fns} if mem else {}
    ref, fused = stats["torch.optim foreach"]["median"], stats["torch.optim fused"]["median"]
    jax_ref = stats.get("Optax+jax.jit", {}).get("median")
    imperative = (mems.get("torch.optim foreach") or {})
    rows = []
    for v, s in stats.items():
        m = mems.get(v)
        row = [v, s["median"], f"{s['q1']:.1f}-{s['q3']:.1f}", s["median"] / ref, s["median"] / fused,
               s["median"] / jax_ref if jax_ref else "-"]
        for key in ("peak", "steady"):
            growth = m[key] - m["base"] if m else None
            ref_growth = imperative[key] - imperative["base"] if imperative else None
            row += [f"{growth:.0f}" if m else "-", growth / ref_growth if m and ref_growth else "-"]
        rows.append(row)
    text = "\n\n".join([f"## {case.name}",
                        f"{rounds} interleaved rounds after warm-up (compilation took {warm:.0f} s in all).",
                        _common.table(["variant", "median ms", "IQR ms", "vs torch foreach", "vs torch fused",
                                       "vs Optax+jit", "peak RSS MiB", "vs imperative", "steady RSS MiB",
                                       "vs imperative"], rows)])
    return text, {"stats": stats, "mems": mems}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds of the compute-bound case")
    ap.add_argument("--big-rounds", type=int, default=12, help="timed rounds of the update-bound case")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-write", action="store_true", help="print only; leave results/suite.md alone")
    ap.add_argument("--memory-child", nargs=3, metavar=("CASE", "VARIANT", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        case_key, variant, steps = args.memory_child
        memory_child(case_key, variant, int(steps))
        return
    start, load0 = time.perf_counter(), ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at the start: {load0}", flush=True)

    mlp_text, mlp = run_case("mlp", args.rounds, not args.no_memory)
    print(mlp_text, flush=True)
    big_text, big = run_case("big", args.big_rounds, not args.no_memory)
    print(big_text, flush=True)

    big_case = CASES["big"]
    n = sum(p.numel() for p in make_model(big_case).parameters())
    upd = {v: _common.summary(t) for v, t in _common.interleaved(update_only(big_case), rounds=args.big_rounds * 2).items()}
    bw = triad_gbps(n)
    gbps = bw["in_place"]
    bound = ADAMW_BYTES_PER_PARAM * n / gbps / 1e6  # ms
    copy_ms = upd["gradient copy alone"]["median"]
    upd_rows = [[v, s["median"], f"{s['q1']:.1f}-{s['q3']:.1f}", s["median"] / upd["torch.optim fused"]["median"],
                 (s["median"] - copy_ms) / bound if v != "gradient copy alone" else "-"] for v, s in upd.items()]
    upd_text = "\n\n".join([
        f"## update alone: AdamW on {n / 1e6:.1f}M params, fixed gradients",
        f"Triads on {n / 1e6:.1f}M floats: in place `a = a + s*c` **{gbps:.1f} GB/s**, STREAM's `a = b + s*c` "
        f"{bw['stream']:.1f} GB/s (12 B/element counted; its stores also read each line first). Bandwidth "
        f"bound of one fused "
        f"AdamW update ({ADAMW_BYTES_PER_PARAM} B/param): **{bound:.1f} ms**. Every row also copies the fixed "
        f"gradients into place (the `gradient copy alone` row); `vs bound` is (median - that copy) / bound.",
        _common.table(["variant", "median ms", "IQR ms", "vs torch fused", "vs bound"], upd_rows)])
    print(upd_text, flush=True)

    ms = lambda st, v: st["stats"][v]["median"]  # noqa: E731
    best = lambda st: min(ms(st, "fxtrain eager"), ms(st, "fxtrain compiled"))  # noqa: E731
    targets = [
        f"- compute-bound step, best fxtrain / torch.optim foreach: "
        f"{verdict(best(mlp) / ms(mlp, 'torch.optim foreach'), 0.9)}",
    ]
    if "Optax+jax.jit" in mlp["stats"]:
        targets.append(f"- compute-bound step, best fxtrain / Optax+jax.jit: {verdict(best(mlp) / ms(mlp, 'Optax+jax.jit'), 1.05)}")
    targets += [
        f"- compute-bound step, fxtrain eager / torch.optim foreach: "
        f"{verdict(ms(mlp, 'fxtrain eager') / ms(mlp, 'torch.optim foreach'), 1.1)}",
        f"- update-bound step, best fxtrain / torch.optim fused: {verdict(best(big) / ms(big, 'torch.optim fused'), 1.1)}",
        f"- update alone, best fxtrain / bandwidth bound: "
        f"{verdict((min(upd['fxtrain eager']['median'], upd['fxtrain compiled']['median']) - copy_ms) / bound, 1.3)}",
    ]
    for label, st in [("compute-bound", mlp), ("update-bound", big)]:
        m = st["mems"]
        if m.get("torch.optim foreach"):
            ref = m["torch.optim foreach"]["peak"] - m["torch.optim foreach"]["base"]
            steady_ref = m["torch.optim foreach"]["steady"] - m["torch.optim foreach"]["base"]
            for v in ("fxtrain eager", "fxtrain compiled"):
                if m.get(v):
                    targets.append(f"- {label} peak RSS growth, {v} / imperative loop: "
                                   f"{verdict((m[v]['peak'] - m[v]['base']) / ref, 1.05)}; steady state (after "
                                   f"warm-up and compilation): {verdict((m[v]['steady'] - m[v]['base']) / steady_ref, 1.05)}")
    load1 = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    text = "\n\n".join([
        "# Benchmark suite: fxtrain vs torch.optim vs Optax+jax.jit (CPU)",
        "Milliseconds per training step, medians over interleaved rounds in one process; ratios against "
        "rows of the same rounds. RSS: growth over the subprocess's RSS after imports and data, one "
        "subprocess per row; `peak` over the whole run (2 warm-up steps with any compilation, then 4), "
        "`steady` over the 4 steps after warm-up (VmHWM reset through /proc/self/clear_refs). "
        "GPU table: not run (no GPU in this session).",
        mlp_text, big_text, upd_text, "## Targets (issue 10)", "\n".join(targets),
        f"Load average at the start: {load0}; total runtime {time.perf_counter() - start:.0f} s.",
        _common.environment()])
    print("\n" + "\n".join(targets) + f"\n\nload average at the end: {load1}")
    if not args.no_write:
        print(f"written to {_common.write_result('suite', text)}")


if __name__ == "__main__":
    main()
