"""Peak memory of one training step, in units of P (the params' bytes), and its time (issue 36, item 4).

A GPT-2-shaped model (:class:`fxtrain.models.TransformerLM`: pre-LayerNorm blocks, learned positions, tied
LM head), float32 on the CPU. Each row trains a few steps; the probe is :class:`fxtrain.testing.TensorMemory`
(bytes of the tensor storages torch ops create, a deterministic count: not RSS, not the allocator's
rounding), around:

* **steady step**: one step after two warm-up steps (the optimizer state exists): growth above what was
  live before it (params, state, batch), peak and what stays (`kept`: the new trees of a pure step);
* **first step**: the state created inside the probe (torch's lazy AdamW state, ``tx.init`` for fxtrain), as
  a first step on a fresh model sees it.

Rows: torch.optim AdamW(fused=True) and AdamW(foreach=True) with ``clip_grad_norm_`` (``loss.backward()``,
``zero_grad(set_to_none=True)``); ``fx.train_step`` donated (default) and pure (``donate=False``, called
as a training loop calls it, autograd on) on the default stack ``chain(clip_by_global_norm(1.0),
adamw(...))`` and on the recommended stack ``accumulate(amp_cast(chain(clip, adamw)), every=4)`` (bf16
compute; one call is one micro-batch: its steady row is the emitting 4th call). Times: milliseconds per
call, interleaved rounds in this process, median; ``pure / donated`` compares the two of one stack in the
same rounds.

Usage:
    python experiments/bench/memory.py [--rounds 20] [--threads 1] [--no-write] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import fxtrain as fx  # noqa: E402
from fxtrain.models import TransformerLM  # noqa: E402
from fxtrain.testing import TensorMemory  # noqa: E402

LR, WD, MAX_NORM, EVERY = 1e-3, 1e-2, 1.0, 4
SHAPE = dict(vocab_size=8192, context=128, d_model=256, n_layers=4, n_heads=4)  # ~5.3M params, GPT-2's shape
BATCH = 1


def model_and_batch(seed: int = 0):
    torch.manual_seed(seed)
    model = TransformerLM(**SHAPE)
    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["context"] + 1))
    return model, (tokens[:, :-1], tokens[:, 1:])


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def stacks() -> dict:
    default = lambda: fx.chain(fx.clip_by_global_norm(MAX_NORM), fx.adamw(LR, weight_decay=WD))  # noqa: E731
    return {"default": default,
            "recommended": lambda: fx.accumulate(fx.amp_cast(default(), "bf16"), every=EVERY)}


class TorchLoop:
    """The imperative loop: backward, clip_grad_norm_, AdamW.step, zero_grad(set_to_none=True)."""

    def __init__(self, fused: bool):
        self.model, self.batch = model_and_batch()
        self.fused = fused
        self.opt = None

    def params(self):
        return list(self.model.parameters())

    def init(self):
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WD,
                                     **({"fused": True} if self.fused else {"foreach": True}))

    def __call__(self):
        x, y = self.batch
        lm_loss(self.model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class FxLoop:
    """``fx.train_step`` on the functional model; the returned trees replace the old ones (the loop's own)."""

    def __init__(self, stack: str, donate: bool):
        model, self.batch = model_and_batch()
        apply, self.p, buffers = fx.functional(model)
        self.tx = stacks()[stack]()
        self.step = fx.train_step(lambda p, b: lm_loss(apply(p, buffers, b[0], train=True)[0], b[1]), self.tx, donate=donate)
        self.state = None

    def params(self):
        return fx.tree.leaves(self.p)

    def init(self):
        self.state = self.tx.init(self.p)

    def __call__(self):
        self.p, self.state, _ = self.step(self.p, self.state, self.batch)


def rows() -> dict:
    out = {"torch.optim AdamW(fused) + clip_grad_norm_": lambda: TorchLoop(True),
           "torch.optim AdamW(foreach) + clip_grad_norm_": lambda: TorchLoop(False)}
    for stack in stacks():
        for donate in (True, False):
            out[f"fxtrain {stack} stack, {'donated' if donate else 'pure (donate=False)'}"] = (
                lambda s=stack, d=donate: FxLoop(s, d))
    return out


def calls_per_update(name: str) -> int:
    return EVERY if "recommended" in name else 1


def memory(make, calls: int) -> dict:
    """Peak growth in bytes of the first update (state created inside the probe) and of a steady one (after
    two warm-up updates), and what the steady one leaves live; ``calls`` calls make one update."""
    loop = make()
    P = sum(p.numel() * p.element_size() for p in loop.params())
    with TensorMemory() as first:
        loop.init()
        for _ in range(calls):
            loop()
    for _ in range(2 * calls - 1):
        loop()
    with TensorMemory() as steady:
        loop()
    return {"P": P, "first": first.peak / P, "steady": steady.peak / P, "kept": steady.live / P}


def timing(rounds: int, threads: int) -> dict:
    loops = {}
    for name, make in rows().items():
        loop = make()
        loop.init()
        calls = calls_per_update(name)

        def update(loop=loop, calls=calls):
            for _ in range(calls):
                loop()
        loops[name] = update
    times = _common.interleaved(loops, rounds=rounds, warmup=2, clock=time.process_time)
    return {name: _common.summary(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--quick", action="store_true", help="5 rounds, no write")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.no_write = 5, True
    torch.set_num_threads(args.threads)
    load = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
    mem = {name: memory(make, calls_per_update(name)) for name, make in rows().items()}
    times = timing(args.rounds, args.threads)
    P = next(iter(mem.values()))["P"]
    body = []
    for name in rows():
        m, t = mem[name], times[name]
        ratio = "-"
        if "pure" in name:
            ref = times[name.replace("pure (donate=False)", "donated")]
            ratio = f"{t['median'] / ref['median']:.2f}"
        body.append([name, f"{m['steady']:.2f}", f"{m['kept']:.2f}", f"{m['first']:.2f}", t["median"],
                     f"{t['q1']:.1f}-{t['q3']:.1f}", ratio])
    table = _common.table(["row", "steady step: peak growth / P", "kept / P", "first update: peak growth / P",
                           "median ms per update", "IQR ms", "pure / donated"], body)
    argv = " ".join(sys.argv[1:])
    text = (f"# Peak memory of one step (issue 36, item 4)\n\nCommand: `python experiments/bench/memory.py"
            f"{' ' + argv if argv else ''}`; load average at the start: {load}.\n\n"
            f"TransformerLM({', '.join(f'{k}={v}' for k, v in SHAPE.items())}), batch {BATCH}, float32 on the "
            f"CPU: P = {P / 2 ** 20:.1f} MiB ({P // 4:,} params). Memory: `fxtrain.testing.TensorMemory` (bytes of "
            "the tensor storages torch ops create, deterministic); steady: one update after two, growth above "
            "what was live before it (params, state, batch), `kept`: what it leaves live (a pure step's new "
            "trees: new params and state, 3P for AdamW); first update: the optimizer state created inside the "
            "probe. The recommended stack is `accumulate(amp_cast(chain(clip, adamw), 'bf16'), every=4)`: an "
            f"update is {EVERY} calls, its steady row the emitting call. Time: CPU time of this process "
            f"(`time.process_time`), {args.rounds} interleaved rounds, {args.threads} thread(s).\n\n"
            f"{table}\n\n{_common.environment()}\n")
    print(text)
    if not args.no_write:
        print(_common.write_result("memory", text))


if __name__ == "__main__":
    main()
