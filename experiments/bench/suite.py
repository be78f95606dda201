"""Benchmark suite (issues 10 and 14): fxtrain's step, eager, compiled and pure, against torch.optim,
TorchOpt and Optax+jax.jit.

One markdown table per case (``results/suite.md``), every row timed side by side in this one process
(interleaved rounds, medians; see _common.py), each ratio against rows measured in the same rounds:

* **overhead**: MLP 64-64-64-10, batch 32, clip_by_global_norm(1.0) + AdamW: Python overhead per step.
* **compute-bound**: MLP 784-1024-1024-1024-10 (2.9M params), batch 128, clip + AdamW, float32.
* **update-bound**: MLP 4096-4096-4096-4096-10 (50.4M params), batch 16, clip + AdamW (the default
  stack); plus the update alone on fixed gradients, AdamW with and without the clip, against the
  memory-bandwidth bound of a fused AdamW (28 bytes per param: read param, grad, two moments; write
  param, two moments) at the bandwidth of a triad ``a = a + s * c`` measured in this run.
* **peak memory**: each (case, variant) of the compute- and update-bound cases runs a few steps in its own
  subprocess, which reports its peak RSS above its RSS after imports and data (CPU only).

Rows: ``torch.optim foreach`` (the imperative loop: ``zero_grad``, ``backward``, ``clip_grad_norm_``,
``AdamW(foreach=True).step()``), ``torch.optim fused`` (``AdamW(fused=True)``), ``fxtrain eager``
(``fx.train_step``, donated: clip + AdamW as one fused kernel call, see fxtrain/transforms/_fused.py),
``fxtrain eager, foreach kernels`` (the same chain built by hand, so no fused kernel: the path before
issue 14), ``fxtrain compiled`` (``compile=True``), ``fxtrain pure`` (``donate=False``: transforms out of
place, inputs intact), ``TorchOpt functional`` (``torchopt.chain(clip_grad_norm, adamw)``, ``update(...,
inplace=False)`` and ``apply_updates(..., inplace=False)``; when torchopt imports: the ``bench`` extra),
``Optax+jax.jit`` (``donate_argnums=(0, 1)``, when jax imports).

Usage:
    python experiments/bench/suite.py [--cases small,mlp,big] [--rounds 40] [--big-rounds 12]
        [--small-rounds 200] [--threads 2] [--no-memory] [--no-write] [--quick]
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

CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}  # --clock; see _common.interleaved
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 1e-4, 1.0  # Optax's default decay (torch's is 1e-2), same math both sides
ADAMW_BYTES_PER_PARAM = 28  # fused AdamW: read p, g, m, v (16 B), write p, m, v (12 B), float32


class Case(NamedTuple):
    name: str
    sizes: tuple
    batch: int
    clip: bool


CASES = {
    "small": Case("overhead: MLP 64-64-64-10, batch 32, clip + AdamW", (64, 64, 64, 10), 32, True),
    "mlp": Case("compute-bound: MLP 784-1024-1024-1024-10 (2.9M params), batch 128, clip + AdamW",
                (784, 1024, 1024, 1024, 10), 128, True),
    "big": Case("update-bound: MLP 4096x4 (50.4M params), batch 16, clip + AdamW",
                (4096, 4096, 4096, 4096, 10), 16, True),
}
VARIANTS = ["torch.optim foreach", "torch.optim fused", "fxtrain eager", "fxtrain eager, foreach kernels",
            "fxtrain compiled", "fxtrain pure", "TorchOpt functional", "Optax+jax.jit"]
MEMORY_VARIANTS = ["torch.optim foreach", "torch.optim fused", "fxtrain eager", "fxtrain compiled", "fxtrain pure"]


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


def make_tx(case: Case, fused: bool = True) -> fx.GradientTransformation:
    """``chain(clip_by_global_norm, adamw)`` (or ``adamw``); ``fused=False``: the same chain built by hand,
    which declares no fused kernel (``adamw``'s own three transforms), so the step takes the foreach path."""
    if fused:
        adamw = fx.adamw(LR, weight_decay=WEIGHT_DECAY)
    else:
        adamw = fx.chain(fx.scale_by_adam(), fx.add_decayed_weights(WEIGHT_DECAY), fx.scale_by_learning_rate(LR))
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


def fx_step(case: Case, data: list, compile: bool = False, donate: bool = True,  # noqa: A002
            fused: bool = True) -> Callable:
    tx = make_tx(case, fused)
    holder = {"params": params_of(make_model(case))}
    holder["state"] = tx.init(holder["params"])
    step_fn = fx.train_step(loss_fn, tx, compile=compile, donate=donate)
    it = iter(range(1 << 62))

    def step():
        holder["params"], holder["state"], metrics = step_fn(holder["params"], holder["state"], data[next(it) % len(data)])
        return metrics["loss"]
    return step


def torchopt_step(case: Case, data: list) -> Callable | None:
    """TorchOpt's functional API, the way its docs train with it: gradients by ``torch.autograd.grad`` of
    detached leaves that require grad (as ``train_step`` does), ``update(..., inplace=False)`` and
    ``apply_updates(..., inplace=False)``: pure, new params and state each step."""
    try:
        import torchopt
    except ImportError:
        return None
    opt = torchopt.adamw(LR, weight_decay=WEIGHT_DECAY)  # Optax's decoupled decay, the same math
    if case.clip:
        opt = torchopt.chain(torchopt.clip_grad_norm(MAX_NORM), opt)
    holder = {"params": params_of(make_model(case))}
    holder["state"] = opt.init(holder["params"])
    it = iter(range(1 << 62))

    def step():
        params = holder["params"]
        leaves, spec = fx.tree.flatten(params)
        xs = [p.detach().requires_grad_() for p in leaves]
        loss = loss_fn(fx.tree.unflatten(spec, xs), data[next(it) % len(data)])
        grads = fx.tree.unflatten(spec, list(torch.autograd.grad(loss, xs)))
        updates, holder["state"] = opt.update(grads, holder["state"], params=params, inplace=False)
        holder["params"] = torchopt.apply_updates(params, updates, inplace=False)
        return loss.detach()
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
        "fxtrain eager": lambda: fx_step(case, data),
        "fxtrain eager, foreach kernels": lambda: fx_step(case, data, fused=False),
        "fxtrain compiled": lambda: fx_step(case, data, compile=True),
        "fxtrain pure": lambda: fx_step(case, data, donate=False),
        "TorchOpt functional": lambda: torchopt_step(case, data),
        "Optax+jax.jit": lambda: optax_step(case, data),
    }[variant]()


def update_only(case: Case) -> dict:
    """AdamW on fixed gradients, alone and after ``clip_by_global_norm`` (the gradients are copied into
    place each call, ~1/7 of the traffic, in every row; the clip rows clip every call)."""
    fixed_tree = params_of(make_model(case, seed=1))
    fixed = [t for layer in fixed_tree["layers"] for t in (layer["w"], layer["b"])]  # model.parameters() order
    rows = {}
    torch_rows = [("torch.optim foreach", {"foreach": True}, False), ("torch.optim fused", {"fused": True}, False),
                  ("torch.optim fused + clip_grad_norm_", {"fused": True}, True)]
    for name, kw, clip in torch_rows:
        model = make_model(case)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **kw)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        grads = [p.grad for p in model.parameters()]

        def call(grads=grads, opt=opt, clip=clip, model=model):
            torch._foreach_copy_(grads, fixed)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
            opt.step()
        rows[name] = call

    for name, compiled, clip in [("fxtrain eager", False, False), ("fxtrain compiled", True, False),
                                 ("fxtrain eager, clip + AdamW", False, True),
                                 ("fxtrain compiled, clip + AdamW", True, True)]:
        tx = make_tx(case._replace(clip=clip))
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


def triad_gbps(n: int, rounds: int = 15, clock: Callable = time.perf_counter) -> dict:
    """Memory bandwidth in GB/s from triads over ``n`` float32 elements (medians of ``rounds`` calls).

    ``stream``: STREAM's ``a = b + s * c`` into a third array, counted as 12 B/element as STREAM does;
    the store to ``a`` also costs a read-for-ownership of each line, so this undercounts the traffic.
    ``in_place``: ``a = a + s * c`` (12 B/element, every line written was just read): the access
    pattern of in-place optimizer kernels, and the bandwidth the AdamW bound uses.
    """
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    times = _common.interleaved({"stream": lambda: torch.add(b, c, alpha=0.5, out=a),
                                 "in_place": lambda: a.add_(c, alpha=1e-9)}, rounds=rounds, clock=clock)
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


def run_case(key: str, rounds: int, mem: bool, clock: Callable = time.perf_counter) -> tuple[str, dict]:
    case = CASES[key]
    data = batches(case)
    fns = {v: f for v in VARIANTS if (f := build(case, v, data)) is not None}
    t0 = time.perf_counter()
    for f in fns.values():  # compile (torch and jax) outside the timed rounds
        f(), f(), f()
    warm = time.perf_counter() - t0
    stats = {v: _common.summary(t) for v, t in _common.interleaved(fns, rounds=rounds, warmup=2, clock=clock).items()}
    mems = {v: memory(key, v) for v in fns if v in MEMORY_VARIANTS} if mem else {}
    ref, fused = stats["torch.optim foreach"]["median"], stats["torch.optim fused"]["median"]
    jax_ref = stats.get("Optax+jax.jit", {}).get("median")
    imperative = (mems.get("torch.optim foreach") or {})
    headers = ["variant", "median ms", "IQR ms", "min ms", "vs torch foreach", "vs torch fused", "vs Optax+jit"]
    if mems:
        headers += ["peak RSS MiB", "vs imperative", "steady RSS MiB", "vs imperative"]
    rows = []
    for v, s in stats.items():
        m = mems.get(v)
        row = [v, s["median"], f"{s['q1']:.1f}-{s['q3']:.1f}", s["min"], s["median"] / ref, s["median"] / fused,
               s["median"] / jax_ref if jax_ref else "-"]
        for k in ("peak", "steady") if mems else ():
            growth = m[k] - m["base"] if m else None
            ref_growth = imperative[k] - imperative["base"] if imperative else None
            row += [f"{growth:.0f}" if m else "-", growth / ref_growth if m and ref_growth else "-"]
        rows.append(row)
    clip = "`clip_grad_norm_(1.0, foreach=True)` in both torch.optim rows. " if case.clip else ""
    text = "\n\n".join([f"## {case.name}",
                        f"{rounds} interleaved rounds after warm-up (compilation took {warm:.0f} s in all). {clip}",
                        _common.table(headers, rows)])
    return text, {"stats": stats, "mems": mems}


def update_alone(case: Case, rounds: int, clock: Callable = time.perf_counter) -> tuple[str, dict]:
    n = sum(p.numel() for p in make_model(case).parameters())
    upd = {v: _common.summary(t) for v, t in _common.interleaved(update_only(case), rounds=rounds, clock=clock).items()}
    bw = triad_gbps(n, clock=clock)
    gbps = bw["in_place"]
    bound = ADAMW_BYTES_PER_PARAM * n / gbps / 1e6  # ms
    copy_ms = upd["gradient copy alone"]["median"]
    fused, fused_clip = upd["torch.optim fused"]["median"], upd["torch.optim fused + clip_grad_norm_"]["median"]
    rows = [[v, s["median"], f"{s['q1']:.1f}-{s['q3']:.1f}", s["median"] / fused, s["median"] / fused_clip,
             (s["median"] - copy_ms) / bound if v != "gradient copy alone" else "-"] for v, s in upd.items()]
    text = "\n\n".join([
        f"## update alone: AdamW on {n / 1e6:.1f}M params, fixed gradients, with and without the clip",
        f"Triads on {n / 1e6:.1f}M floats: in place `a = a + s*c` **{gbps:.1f} GB/s**, STREAM's `a = b + s*c` "
        f"{bw['stream']:.1f} GB/s (12 B/element counted; its stores also read each line first). Bandwidth "
        f"bound of one fused AdamW update ({ADAMW_BYTES_PER_PARAM} B/param): **{bound:.1f} ms** (a clip adds at "
        f"least one read of the gradients, 4 B/param). Every row also copies the fixed gradients into place "
        f"(the `gradient copy alone` row); `vs bound` is (median - that copy) / bound. {rounds} interleaved rounds.",
        _common.table(["variant", "median ms", "IQR ms", "vs torch fused", "vs torch fused + clip", "vs bound"], rows)])
    return text, {"stats": upd, "bound": bound, "copy": copy_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="small,mlp,big", help="comma-separated cases: small, mlp, big")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds of the compute-bound case")
    ap.add_argument("--big-rounds", type=int, default=12, help="timed rounds of the update-bound case")
    ap.add_argument("--small-rounds", type=int, default=300, help="timed rounds of the overhead case")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--clock", choices=list(CLOCK), default="wall",
                    help="wall time, or this process's CPU time (robust on a busy machine; use --threads 1)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-write", action="store_true", help="print only; leave results/suite.md alone")
    ap.add_argument("--out", default="suite", help="write results/<OUT>.md (default: suite)")
    ap.add_argument("--quick", action="store_true", help="a look in about a minute: few rounds, no memory, no write")
    ap.add_argument("--memory-child", nargs=3, metavar=("CASE", "VARIANT", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        case_key, variant, steps = args.memory_child
        memory_child(case_key, variant, int(steps))
        return
    if args.quick:
        args.rounds, args.big_rounds, args.small_rounds = 10, 4, 60
        args.no_memory = args.no_write = True
    cases = args.cases.split(",")
    start, load0 = time.perf_counter(), ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at the start: {load0}", flush=True)

    rounds = {"small": args.small_rounds, "mlp": args.rounds, "big": args.big_rounds}
    texts, res = [], {}
    for key in cases:
        text, res[key] = run_case(key, rounds[key], not args.no_memory and key != "small", CLOCK[args.clock])
        print(text, flush=True)
        texts.append(text)
    if "big" in cases:
        text, upd = update_alone(CASES["big"], args.big_rounds * 2, CLOCK[args.clock])
        print(text, flush=True)
        texts.append(text)

    ms = lambda key, v, stat="median": res[key]["stats"][v][stat]  # noqa: E731

    def ratio(key: str, v: str, refs: tuple, target: float) -> str:
        """Median ratio against the faster of ``refs`` with its verdict, then the ratio of minimums."""
        med = ms(key, v) / min(ms(key, r) for r in refs)
        low = ms(key, v, "min") / min(ms(key, r, "min") for r in refs)
        return f"{verdict(med, target)}; minimums {low:.2f}"

    targets = []
    if "mlp" in res:
        targets.append("- compute-bound step (2.9M), fxtrain eager / torch.optim foreach: "
                       + ratio("mlp", "fxtrain eager", ("torch.optim foreach",), 0.95))
    if "big" in res:
        targets.append("- update-bound step (50M), default stack: fxtrain eager / torch.optim fused + clip: "
                       + ratio("big", "fxtrain eager", ("torch.optim fused",), 1.05))
    for key, label in [("mlp", "compute-bound"), ("big", "update-bound"), ("small", "overhead")]:
        if key in res:
            targets.append(f"- {label} step, fxtrain compiled / torch.optim fused + clip (torch's best): "
                           + ratio(key, "fxtrain compiled", ("torch.optim fused",), 1.0))
    if "small" in res:
        targets.append("- overhead step (MLP 64x3, batch 32), fxtrain eager / the faster torch.optim loop: "
                       + ratio("small", "fxtrain eager", ("torch.optim foreach", "torch.optim fused"), 1.1))
    for key, label in [("small", "overhead"), ("mlp", "compute-bound"), ("big", "update-bound")]:
        if key in res:
            line = (f"- {label} step, fxtrain pure (donate=False) / torch.optim foreach: "
                    f"{ms(key, 'fxtrain pure') / ms(key, 'torch.optim foreach'):.2f} (no target)")
            if "TorchOpt functional" in res[key]["stats"]:
                line += f"; / TorchOpt functional: {ms(key, 'fxtrain pure') / ms(key, 'TorchOpt functional'):.2f}"
            targets.append(line)
    kept = []
    if "mlp" in res and "Optax+jax.jit" in res["mlp"]["stats"]:
        best = min(ms("mlp", "fxtrain eager"), ms("mlp", "fxtrain compiled"))
        kept.append(f"- compute-bound step, best fxtrain / Optax+jax.jit: {verdict(best / ms('mlp', 'Optax+jax.jit'), 1.05)}")
    if "big" in cases:
        u = upd["stats"]
        best = min(u["fxtrain eager"]["median"], u["fxtrain compiled"]["median"])
        kept.append(f"- update alone, best fxtrain AdamW / bandwidth bound: "
                    f"{verdict((best - upd['copy']) / upd['bound'], 1.3)}")
    for key, label in [("mlp", "compute-bound"), ("big", "update-bound")]:
        m = res.get(key, {}).get("mems", {})
        if m.get("torch.optim foreach"):
            ref = m["torch.optim foreach"]["peak"] - m["torch.optim foreach"]["base"]
            steady_ref = m["torch.optim foreach"]["steady"] - m["torch.optim foreach"]["base"]
            for v in ("fxtrain eager", "fxtrain compiled"):
                if m.get(v):
                    kept.append(f"- {label} peak RSS growth, {v} / imperative loop: "
                                f"{verdict((m[v]['peak'] - m[v]['base']) / ref, 1.05)}; steady state (after "
                                f"warm-up and compilation): {verdict((m[v]['steady'] - m[v]['base']) / steady_ref, 1.05)}")
    command = " ".join(["python experiments/bench/suite.py"] + sys.argv[1:])
    clock_text = ("wall time" if args.clock == "wall" else "CPU time of this process, `time.process_time`: "
                  "waiting for a core held by another process is not counted; Optax+jit's own threads are")
    load1 = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    text = "\n\n".join([
        "# Benchmark suite: fxtrain vs torch.optim, TorchOpt and Optax+jax.jit (CPU)",
        f"Command: `{command}`. Milliseconds per training step ({clock_text}), medians over interleaved rounds "
        "in one process; ratios against rows of the same rounds. RSS: growth over the subprocess's RSS after imports "
        "and data, one subprocess per row; `peak` over the whole run (2 warm-up steps with any compilation, "
        "then 4), `steady` over the 4 steps after warm-up (VmHWM reset through /proc/self/clear_refs). "
        "GPU table: not run (no GPU in this session).",
        *texts, "## Targets (issue 14)", "\n".join(targets), "## Targets kept from issue 10", "\n".join(kept),
        f"Load average at the start: {load0}; total runtime {time.perf_counter() - start:.0f} s.",
        _common.environment()])
    print("\n" + "\n".join(targets + kept) + f"\n\nload average at the end: {load1}")
    if not args.no_write:
        print(f"written to {_common.write_result(args.out, text)}")


if __name__ == "__main__":
    main()
