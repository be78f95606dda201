"""Tests for fxtrain/transforms/_sharding.py: sharded_apply on DTensor shards across gloo worlds of 2 and 4
CPU ranks, against the same transform on full tensors in one process.

As in tests/test_norms.py, each world size is spawned once per session and runs every case; each
case is reported as its own test.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import fxtrain as fx
from tests import _worlds

CASES, case = _worlds.registry(worlds=(2, 4))  # name -> (function(world), world sizes it runs at)
TIMEOUT_S = 360  # a limit for the worlds of this file (the layout cases train 30 steps each), not their time
STEPS = 10
OPTIMIZERS = {
    "adamw": lambda: fx.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: fx.lion(1e-3, weight_decay=1e-2),
    "sgd_momentum": lambda: fx.sgd(1e-2, momentum=0.9, nesterov=True),
}


# --- helpers run inside the ranks ---------------------------------------------------------------------

_MESHES: dict = {}


def meshes(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    if not _MESHES:
        _MESHES["1d"] = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        _MESHES["2d"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    return _MESHES


def randn(seed: int, *shape: int) -> torch.Tensor:
    """The same tensor on every rank, in multiples of 2**-10: sums of Partial pieces are exact in float32
    in any order, so a reduce-scatter matches the full gradient bit for bit."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return ((x * 1024).round() / 1024).float()


def dt(x, mesh, *placements):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(x.clone(), mesh, list(placements))  # local pieces may be views of x: donation writes there


def full(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def partial_grad(x: torch.Tensor, mesh, dim_placements):
    """A DTensor gradient equal to ``x`` whose ``Partial`` pieces differ on every rank (as autograd makes them)."""
    from torch.distributed.tensor import DTensor, Partial

    rank = dist.get_rank()
    # rank r holds x / n + (r - mean) * noise: the pieces sum to x, none equals x / n.
    noise = (randn(999, *x.shape) * 4).round() / 4
    n = dist.get_world_size()
    piece = x / n + (rank - (n - 1) / 2) * noise
    return DTensor.from_local(piece, mesh, [Partial()])


def run_both(tx_sharded, tx_ref, params_d, params_ref, grads_fn, steps=STEPS, donate=True):
    """``steps`` updates of the sharded transform on DTensors and of the reference on full tensors."""
    state_d, state_r = tx_sharded.init(params_d), tx_ref.init(params_ref)
    for k in range(steps):
        gd, gr = grads_fn(k)
        if donate:
            u, state_d = fx.update_(tx_sharded, gd, state_d, params_d)
            params_d = apply(params_d, u)
        else:
            u, state_d = tx_sharded.update(gd, state_d, params_d)
            params_d = apply(params_d, u)
        ur, state_r = tx_ref.update(gr, state_r, params_ref)
        params_ref = fx.apply_updates(params_ref, ur)
    return params_d, state_d, params_ref, state_r


def apply(params, updates):
    """``params + updates`` leaf by leaf (fx.apply_updates' one _foreach_add_ refuses trees mixing DTensors
    and plain tensors)."""
    return fx.tree.map(lambda p, u: p if u is None else p + u, params, updates)


def assert_close(a, b, rtol=1e-6):
    from fxtrain.testing import assert_trees_close

    assert_trees_close(a, b, rtol=rtol, atol=1e-7)


def check_state_like_params(state, params, zero_dim=None):
    """Every state leaf that is a DTensor has its param's mesh and placements (Shard(0) over dp for ZeRO)."""
    from torch.distributed.tensor import DTensor, Shard

    mu = state[0].mu if hasattr(state[0], "mu") else state[0].trace
    for path, m, p in zip(fx.tree.paths(params), fx.tree.flatten(mu)[0], fx.tree.flatten(params)[0]):
        if isinstance(p, DTensor):
            assert isinstance(m, DTensor), path
            want = list(p.placements)
            if zero_dim is not None and p.ndim > 0 and want[zero_dim].is_replicate():
                want[zero_dim] = Shard(0)
            assert list(m.placements) == want and m.device_mesh is p.device_mesh and m.shape == p.shape, \
                (path, m.placements, want)
        else:
            assert not isinstance(m, DTensor), path


def state_bytes(state) -> int:
    return sum(x.numel() * x.element_size() for x in fx.distributed.local_leaves(state))


def comm_counts(fn) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn()
    return {str(k): v for k, v in comm.get_comm_counts().items()}


def mixed(world):
    """Shard (even, uneven, empty pieces), 2-D, Replicate, plain and None leaves."""
    from torch.distributed.tensor import Replicate, Shard

    ms = meshes(world)
    xs = {"even": randn(1, 4 * world, 3), "uneven": randn(2, world + 1, 5), "tiny": randn(3, 1, 4),
          "tp": randn(4, 6, 4), "rep": randn(5, 7), "plain": randn(6, 3)}
    places = {"even": (ms["1d"], Shard(0)), "uneven": (ms["1d"], Shard(0)), "tiny": (ms["1d"], Shard(0)),
              "tp": (ms["2d"], Replicate(), Shard(1)), "rep": (ms["1d"], Replicate())}
    params = {k: dt(x, places[k][0], *places[k][1:]) if k in places else x.clone() for k, x in xs.items()}
    params["frozen"] = None
    ref = {**{k: x.clone() for k, x in xs.items()}, "frozen": None}

    def grads(k):
        gs = {n: randn(100 * k + i, *x.shape) for i, (n, x) in enumerate(xs.items())}
        gd = {n: dt(g, places[n][0], *places[n][1:]) if n in places else g.clone() for n, g in gs.items()}
        gd["rep"] = partial_grad(gs["rep"], ms["1d"], None)  # data-parallel gradient: reduced first
        return {**gd, "frozen": None}, {**gs, "frozen": None}

    return params, ref, grads


# --- cases ------------------------------------------------------------------------------------------

@case()
def case_optimizers_on_local_shards_match_full_tensors(world):
    for name, build in OPTIMIZERS.items():
        for donate in (True, False):
            params, ref, grads = mixed(world)
            tx = fx.sharded_apply(build())
            pd, sd, pr, sr = run_both(tx, build(), params, ref, grads, donate=donate)
            assert_close(pd, pr)
            assert_close(sd, sr)
            check_state_like_params(sd, pd)
            for k in ("even", "uneven", "tp"):  # updates and params keep their specs
                assert pd[k].placements == params[k].placements and pd[k].stride() == params[k].stride()


@case()
def case_update_runs_without_dtensor_dispatch_or_communication(world):
    from torch.distributed.tensor import Shard

    m = meshes(world)["1d"]
    params = [dt(randn(i, 2 * world, 3), m, Shard(0)) for i in range(8)]
    grads = [dt(randn(50 + i, 2 * world, 3), m, Shard(0)) for i in range(8)]
    tx = fx.sharded_apply(fx.adamw(1e-3))
    state = tx.init(params)
    assert comm_counts(lambda: tx.update(grads, state, params)) == {}
    # The donated kernel writes in place: the very same DTensor objects come back.
    u, s = fx.update_(tx, grads, state, params)
    assert all(a is b for a, b in zip(u, grads)) and s[0].mu[0] is state[0].mu[0]


@case()
def case_shard_over_dp_matches_unsharded_with_1_over_n_state(world):
    from torch.distributed.tensor import Replicate

    m = meshes(world)["1d"]
    xs = {"even": randn(10, 4 * world, 3), "uneven": randn(11, world + 1, 5), "tiny": randn(12, 1, 3),
          "bias": randn(13, 2 * world - 1), "scalar": randn(14)}
    for name, build in OPTIMIZERS.items():
        for partial in (True, False):
            params = {k: dt(x, m, Replicate()) for k, x in xs.items()}
            ref = {k: x.clone() for k, x in xs.items()}

            def grads(k):
                gs = {n: randn(200 * k + i, *x.shape) for i, (n, x) in enumerate(xs.items())}
                if partial:
                    gd = {n: partial_grad(g, m, None) for n, g in gs.items()}
                else:
                    gd = {n: dt(g, m, Replicate()) for n, g in gs.items()}
                return gd, gs

            tx = fx.sharded_apply(build(), shard_over="dp")
            pd, sd, pr, sr = run_both(tx, build(), params, ref, grads)
            assert_close(pd, pr)
            assert_close(sd, sr)  # full_tensor of Shard(0) state = the reference state: DTensor's row split
            check_state_like_params(sd, pd, zero_dim=0)
            for k in xs:
                assert pd[k].placements == (Replicate(),)
    # Per-rank optimizer-state bytes, measured from the state trees: 1/n when the rows divide.
    params = {k: dt(randn(20 + i, 4 * world, 8), m, Replicate()) for i, k in enumerate("abc")}
    for build in OPTIMIZERS.values():
        plain = state_bytes(fx.sharded_apply(build()).init(params))
        sharded = state_bytes(fx.sharded_apply(build(), shard_over="dp").init(params))
        state = fx.sharded_apply(build(), shard_over="dp").init(params)
        counts = sum(x.numel() * x.element_size() for x in fx.tree.leaves(state) if not hasattr(x, "placements"))
        assert sharded - counts == (plain - counts) / world, (plain, sharded, counts)  # the count is not sharded


@case(4)
def case_shard_over_dp_on_2d_mesh_with_tp(world):
    from torch.distributed.tensor import Replicate, Shard

    m = meshes(world)["2d"]
    xs = {"w": randn(30, 5, 6), "b": randn(31, 3), "col": randn(32, 4, 8)}
    places = {"w": (Replicate(), Shard(1)), "b": (Replicate(), Replicate()), "col": (Replicate(), Shard(0))}
    params = {k: dt(x, m, *places[k]) for k, x in xs.items()}
    ref = {k: x.clone() for k, x in xs.items()}

    def grads(k):
        gs = {n: randn(300 * k + i, *x.shape) for i, (n, x) in enumerate(xs.items())}
        return {n: dt(g, m, *places[n]) for n, g in gs.items()}, gs

    tx = fx.sharded_apply(fx.adamw(1e-2), shard_over="dp")
    pd, sd, pr, sr = run_both(tx, fx.adamw(1e-2), params, ref, grads)
    assert_close(pd, pr)
    assert_close(sd, sr)
    assert sd[0].mu["w"].placements == (Shard(0), Shard(1))
    assert sd[0].mu["col"].placements == (Replicate(), Shard(0))  # rows split over tp already: local math


@case()
def case_shard_over_collectives_do_not_grow_with_leaves(world):
    from torch.distributed.tensor import Replicate

    m = meshes(world)["1d"]
    tx = fx.sharded_apply(fx.adamw(1e-3), shard_over="dp")
    counts = []
    for n_leaves in (1, 16):
        params = [dt(randn(i, 3, 5), m, Replicate()) for i in range(n_leaves)]
        grads = [partial_grad(randn(40 + i, 3, 5), m, None) for i in range(n_leaves)]
        state = tx.init(params)
        counts.append(comm_counts(lambda: tx.update(grads, state, params)))
    assert counts[0] == counts[1] and sum(counts[0].values()) == 2, counts  # reduce-scatter + all-gather


@case()
def case_train_step_data_parallel_with_shard_over(world):
    """Replicate params, batch Shard(0): Partial gradients reach sharded_apply unreduced (one reduce-scatter)."""
    from torch.distributed.tensor import Replicate, Shard

    m = meshes(world)["1d"]
    w0, b0 = randn(60, 3, 2), randn(61, 2)
    x, y = randn(62, 4 * world, 3), randn(63, 4 * world, 2)

    def loss_fn(p, batch):
        xb, yb = batch
        return ((xb @ p["w"] + p["b"] - yb) ** 2).sum() / (4 * world)

    tx = fx.sharded_apply(fx.adamw(1e-2), shard_over="dp")
    params = {"w": dt(w0, m, Replicate()), "b": dt(b0, m, Replicate())}
    step = fx.train_step(loss_fn, tx)
    state = tx.init(params)
    batch = (dt(x, m, Shard(0)), dt(y, m, Shard(0)))
    ref_tx = fx.adamw(1e-2)
    ref = {"w": w0.clone(), "b": b0.clone()}
    ref_step = fx.train_step(loss_fn, ref_tx)
    ref_state = ref_tx.init(ref)
    for _ in range(5):
        params, state, _ = step(params, state, batch)
        ref, ref_state, _ = ref_step(ref, ref_state, (x, y))
    assert_close(params, ref, rtol=1e-5)
    assert params["w"].placements == (Replicate(),)


@case()
def case_refuses_global_reductions(world):
    from torch.distributed.tensor import Shard

    for tx in (fx.clip_by_global_norm(1.0), fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-3))):
        with pytest.raises(ValueError, match="clip_by_global_norm"):
            fx.sharded_apply(tx)
    m = meshes(world)["1d"]
    # A Replicate gradient for a Shard(0) param (autograd gives one for RowwiseParallel's embedding) is
    # sliced to the param's rows; one that cannot be brought to the param's placements is named.
    from torch.distributed.tensor import Replicate

    p = {"w": dt(randn(1, 2 * world + 1, 2), m, Shard(0))}
    full = randn(2, 2 * world + 1, 2)
    tx = fx.sharded_apply(fx.sgd(0.1))
    u, _ = tx.update({"w": dt(full, m, Replicate())}, tx.init(p), p)
    assert u["w"].placements == (Shard(0),)
    torch.testing.assert_close(u["w"].full_tensor(), -0.1 * full, rtol=0, atol=0)
    # Moves with no bucketed collective here go through torch's redistribute (Shard -> Replicate: a gather).
    rp = {"w": dt(randn(1, 2 * world, 2), m, Replicate())}
    u, _ = tx.update({"w": dt(randn(2, 2 * world, 2), m, Shard(0))}, tx.init(rp), rp)
    assert u["w"].placements == (Replicate(),)
    torch.testing.assert_close(u["w"].full_tensor(), -0.1 * randn(2, 2 * world, 2), rtol=0, atol=0)
    # A gradient on another mesh than its param: named, with both meshes.
    m2 = meshes(world)["2d"]
    with pytest.raises(ValueError, match="'w' lives on .*but its param on"):
        tx.update({"w": dt(randn(2, 2 * world, 2), m2, Replicate(), Replicate())}, tx.init(rp), rp)


@case()
def case_function_form(world):
    from torch.distributed.tensor import Partial, Replicate, Shard

    m = meshes(world)["1d"]
    a, b = randn(70, 2 * world, 3), randn(71, 2 * world, 3)
    fma = fx.sharded_apply(lambda x, y: x * y + 1, in_placements=(Shard(0),), out_placements=(Shard(0),))
    out = fma(dt(a, m, Shard(0)), dt(b, m, Shard(0)))
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(full(out), a * b + 1)
    xa, xb = dt(a, m, Shard(0)), dt(b, m, Shard(0))
    assert comm_counts(lambda: fma(xa, xb)) == {}
    with pytest.raises(ValueError, match="in_placements asks for"):
        fma(dt(a, m, Replicate()), dt(b, m, Shard(0)))
    # Partial inputs are reduced before a non-linear function sees them.
    relu = fx.sharded_apply(torch.relu, in_placements=[(Replicate(),)], out_placements=(Replicate(),))
    torch.testing.assert_close(full(relu(partial_grad(a, m, None))), torch.relu(a), rtol=1e-6, atol=1e-6)
    # Trees in, trees out.
    step = fx.sharded_apply(lambda t: {k: v * 2 for k, v in t.items()}, out_placements=(Shard(0),))
    res = step({"a": dt(a, m, Shard(0)), "b": dt(b, m, Shard(0))})
    torch.testing.assert_close(full(res["b"]), b * 2)


@case()
def case_pure_update_out_of_place_and_on_copies_agree_and_leave_inputs(world):
    """The pure update on DTensors, both ways it runs: out of place (autograd recording) and the in-place
    kernel on copies (no_grad); inputs untouched, placements kept, same numbers as the donated kernel."""
    from fxtrain.testing import assert_trees_close

    for shard_over in (None, "dp"):
        params, _, grads = mixed(world)
        if shard_over == "dp":
            params = {k: v for k, v in params.items() if k != "tp"}  # a 1-D mesh for the ZeRO leaves
        tx = fx.sharded_apply(fx.adamw(1e-2, weight_decay=1e-2), shard_over=shard_over)
        state = tx.init(params)
        for k in range(3):
            g = {n: v for n, v in grads(k)[0].items() if n in params}
            g0, s0 = fx.tree.clone(g), fx.tree.clone(state)
            u, new = tx.update(g, state, params)  # grad mode on: the op layer runs out of place
            with torch.no_grad():  # the in-place kernel on copies: the donated kernel's bits
                nu, nnew = tx.update(g, state, params)
            assert_trees_close(g, g0, rtol=0, atol=0)
            assert_trees_close(state, s0, rtol=0, atol=0)
            du, dnew = fx.update_(tx, fx.tree.clone(g), fx.tree.clone(state), params)
            assert_trees_close(du, nu, rtol=0, atol=0)
            assert_trees_close(dnew, nnew, rtol=0, atol=0)
            assert_trees_close(u, nu, rtol=1e-6, atol=1e-7)  # per-leaf ops vs foreach: float32 rounding
            assert_trees_close(new, nnew, rtol=1e-6, atol=1e-7)
            for n in u:  # updates laid out like their params (a Partial gradient comes back reduced)
                if hasattr(params[n], "placements"):
                    assert u[n].placements == params[n].placements and u[n].shape == params[n].shape, n
            assert fx.tree.structure(new) == fx.tree.structure(state)
            state = new


@case()
def case_differentiating_through_collectives_raises(world):
    from torch.distributed.tensor import Replicate, Shard

    m = meshes(world)["1d"]
    # Local math only (Shard grads, no collective): autograd sees to_local/from_local, the gradient flows.
    p = {"w": dt(randn(1, 2 * world, 3), m, Shard(0))}
    g = {"w": dt(randn(2, 2 * world, 3), m, Shard(0)).requires_grad_()}
    tx = fx.sharded_apply(fx.sgd(0.5))
    u, _ = tx.update(g, tx.init(p), p)
    (grad,) = torch.autograd.grad(u["w"].to_local().sum(), g["w"])
    torch.testing.assert_close(grad.full_tensor(), torch.full((2 * world, 3), -0.5))
    # A Partial gradient (reduced by a collective) or ZeRO (reduce-scatter): refused by name, not detached.
    gp = {"w": partial_grad(randn(3, 2 * world, 3), m, None).requires_grad_()}
    pr = {"w": dt(randn(1, 2 * world, 3), m, Replicate())}
    with pytest.raises(ValueError, match=r"sharded_apply\(sgd\(0.5\)\): cannot differentiate .* Partial"):
        tx.update(gp, tx.init(pr), pr)
    zero = fx.sharded_apply(fx.sgd(0.5), shard_over="dp")
    with pytest.raises(ValueError, match=r"cannot differentiate through sharded_apply here: its ZeRO"):
        zero.update({"w": dt(randn(4, 2 * world, 3), m, Replicate()).requires_grad_()}, zero.init(pr), pr)
    with pytest.raises(ValueError, match="torch.func does not support DTensor"):
        torch.func.grad(lambda x: tx.update({"w": g["w"] * x}, tx.init(p), p)[0]["w"].to_local().sum())(
            torch.tensor(1.0))


# --- single process ----------------------------------------------------------------------------------

def test_repr_and_refusal_names_the_transform():
    assert repr(fx.sharded_apply(fx.adamw(0.001))) == "sharded_apply(adamw(0.001))"
    assert repr(fx.sharded_apply(fx.adamw(0.001), shard_over="dp")) == "sharded_apply(shard_over='dp', adamw(0.001))"
    for tx, name in ((fx.clip_by_global_norm(1.0), "clip_by_global_norm(1.0)"),
                     (fx.stateless(lambda u, p: u), "stateless(<lambda>)"),
                     (fx.chain(fx.clip_by_global_norm(2.0), fx.sgd(0.1)), "clip_by_global_norm(2.0)")):
        with pytest.raises(ValueError, match=r"sharded_apply: .*" + name.replace("(", r"\(").replace(")", r"\)")):
            fx.sharded_apply(tx)
    assert fx.is_elementwise(fx.sharded_apply(fx.lion(1e-4)))
    assert not fx.is_elementwise(fx.sharded_apply(fx.lion(1e-4), shard_over="dp"))
    with pytest.raises(TypeError, match="for functions"):
        fx.sharded_apply(fx.sgd(0.1), out_placements=())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shard_over", [None, "dp"])
def test_plain_leaves_pass_through_the_inner_transform(name, shard_over):
    from fxtrain.testing import nested_params

    params, ref = nested_params(0), nested_params(0)
    tx, inner = fx.sharded_apply(OPTIMIZERS[name](), shard_over=shard_over), OPTIMIZERS[name]()
    s, sr = tx.init(params), inner.init(ref)
    for k in range(3):
        u, s = tx.update(nested_params(k + 1), s, params)
        ur, sr = inner.update(nested_params(k + 1), sr, ref)
        params, ref = fx.apply_updates(params, u), fx.apply_updates(ref, ur)
    from fxtrain.testing import assert_trees_close

    assert_trees_close(params, ref, rtol=0, atol=0)
    assert_trees_close(s, sr, rtol=0, atol=0)


@pytest.mark.parametrize("shard_over", [None, "dp"])
def test_plain_leaves_compose_with_vmap_and_grad(shard_over):
    """On plain leaves sharded_apply is its inner transform: under vmap (4 models) and grad through 3
    updates it gives the inner transform's numbers (the same kernel: bit for bit)."""
    from fxtrain.testing import assert_trees_close, nested_params

    inner = fx.adamw(1e-2, weight_decay=1e-2)
    tx = fx.sharded_apply(inner, shard_over=shard_over)
    stacked = fx.tree.map(lambda *xs: torch.stack(xs), *[nested_params(seed=i) for i in range(4)])
    grads = fx.tree.map(lambda x: 0.5 * x, stacked)
    ours = torch.func.vmap(tx.update)(grads, torch.func.vmap(tx.init)(stacked), stacked)
    ref = torch.func.vmap(inner.update)(grads, torch.func.vmap(inner.init)(stacked), stacked)
    assert_trees_close(ours, ref, rtol=0, atol=0)

    def loss(t, p):
        state = t.init(p)
        for _ in range(3):
            u, state = t.update(fx.tree.map(lambda x: 0.5 * x + 0.1, p), state, p)
            p = fx.apply_updates(p, u)
        return sum((x ** 2).sum() for x in fx.tree.leaves(p))

    params = nested_params()
    ours, ref = torch.func.grad(lambda p: loss(tx, p))(params), torch.func.grad(lambda p: loss(inner, p))(params)
    assert_trees_close(ours, ref, rtol=0, atol=0)


# --- the fused kernel on every parallel layout (fxtrain/transforms/_fused.py) -------------------------------
#
# The runner's default stack, chain(clip_by_global_norm, sharded_apply(inject_hyperparams(adamw))) with a
# warmup_cosine learning rate (a 0-dim tensor in the state, new every step), trained 30 float32 steps on a
# tiny TransformerLM under each of the runner's layouts, against one process with plain tensors (where the
# same kernel runs). torch's own DDP/FSDP2 + fused AdamW end ~2e-6 from one process; the unfused out-of-place
# path ended ~8e-6 away. The dp case also runs plain adamw (its numbers in the spec, no state to read).

LAYOUT_STEPS, LAYOUT_TOL, VOCAB = 30, 3e-6, 16


def lm(experts: int = 0):
    from fxtrain.models import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(vocab_size=VOCAB, context=8, d_model=8, n_layers=2, n_heads=2, experts=experts)


def lm_batches(world: int) -> list:
    """LAYOUT_STEPS global batches (inputs, targets) of 2 sequences per rank, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(LAYOUT_STEPS):
        x = torch.randint(0, VOCAB, (2 * world, 9), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def xent(logits, y):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def lm_loss(apply, buffers):
    def loss_fn(params, b):
        return xent(apply(params, buffers, b[0], train=True)[0], b[1])

    return loss_fn


def default_stack(groups=(), injected=True):
    if injected:  # as fxtrain/build.py builds it from conf/ (optim.chain=[clip_by_global_norm,adamw], schedule)
        lr = fx.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=3, decay_steps=LAYOUT_STEPS)
        adamw = fx.inject_hyperparams(fx.adamw)(learning_rate=lr, weight_decay=0.1)
    else:
        adamw = fx.adamw(1e-2, weight_decay=0.1)
    return fx.chain(fx.clip_by_global_norm(0.5, groups=groups), fx.sharded_apply(adamw))


class FusedCalls:
    """Records what every fused-kernel attempt of the steps returned (True: the kernel ran, False: fallback)."""

    def __enter__(self):
        from fxtrain.transforms import _fused

        self.module, self.real, self.calls = _fused, _fused.step_, []
        _fused.step_ = lambda *a: self.calls.append(self.real(*a)) or self.calls[-1]
        return self.calls

    def __exit__(self, *exc):
        self.module.step_ = self.real


_ONE_PROCESS: dict = {}


def one_process(world: int, experts: int = 0, injected: bool = True) -> dict:
    """The default stack's params after LAYOUT_STEPS steps in this process, plain tensors, whole batches."""
    key = (world, experts, injected)
    if key not in _ONE_PROCESS:
        apply, params, buffers = fx.functional(lm(experts))
        tx = default_stack(injected=injected)
        step, state = fx.train_step(lm_loss(apply, buffers), tx), tx.init(params)
        with FusedCalls() as calls:
            for b in lm_batches(world):
                params, state, _ = step(params, state, b)
        assert calls == [True] * LAYOUT_STEPS, calls
        _ONE_PROCESS[key] = params
    return _ONE_PROCESS[key]


def train_layout(step, params, tx, batches) -> dict:
    """LAYOUT_STEPS steps of ``step``; asserts every one ran the fused kernel. The params, gathered."""
    state = tx.init(params)
    with FusedCalls() as calls:
        for b in batches:
            params, state, _ = step(params, state, b)
    assert calls == [True] * LAYOUT_STEPS, f"the fused kernel did not run on every step: {calls}"
    return {k: full(v).detach() for k, v in params.items()}


def assert_near_one_process(params: dict, ref: dict) -> None:
    """Within LAYOUT_TOL of one process, except the attention key biases: softmax ignores a bias added to every
    key, so their gradient is zero in exact arithmetic and rounding noise of ~1e-10 is all Adam sees, which it
    normalises into steps of lr (1e-4 apart after 30 steps on any two reduction orders, one process too)."""
    assert params.keys() <= ref.keys() and params, sorted(params)
    errs = {k: float((params[k] - ref[k]).abs().max()) for k in params if not k.endswith("attn.k.bias")}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= LAYOUT_TOL, \
        f"{worst} is {errs[worst]:.2g} from one process after {LAYOUT_STEPS} steps (> {LAYOUT_TOL})"


def my_rows(b: tuple, index: int, parts: int) -> tuple:
    n = len(b[1]) // parts
    return tuple(t[index * n:(index + 1) * n] for t in b)


@case(2)
def case_fused_kernel_on_dp_replicated_params(world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh, rank = init_device_mesh("cpu", (world,)), dist.get_rank()
    batches = [my_rows(b, rank, world) for b in lm_batches(world)]
    for injected in (True, False):
        apply, params, buffers = fx.parallel.data_parallel(lm(), mesh)
        tx = default_stack(injected=injected)
        assert_near_one_process(train_layout(fx.train_step(lm_loss(apply, buffers), tx), params, tx, batches),
                                one_process(world, injected=injected))


def train_fully_sharded(world, mesh):
    """``fully_shard`` per block and the root on ``mesh`` (1-D: FSDP; 2-D ``(dp_replicate, dp_shard)``: HSDP,
    sharded over dp_shard and all-reduced over dp_replicate), against one process. Every rank reads its own
    rows: all of the world is data parallel."""
    from torch.distributed.fsdp import fully_shard

    model = lm()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    apply, params, buffers = fx.parallel.fully_sharded(model)
    tx, rank = default_stack(), dist.get_rank()
    step = fx.parallel.fully_sharded_step(lm_loss(apply, buffers), tx, model)
    batches = [my_rows(b, rank, world) for b in lm_batches(world)]
    assert_near_one_process(train_layout(step, params, tx, batches), one_process(world))


@case(2)
def case_fused_kernel_on_fsdp_shards(world):
    from torch.distributed.device_mesh import init_device_mesh

    train_fully_sharded(world, init_device_mesh("cpu", (world,)))


@case(2)
def case_fused_kernel_on_tp_shards(world):
    from torch.distributed.device_mesh import init_device_mesh

    model = lm()
    apply, params, buffers = fx.parallel.tensor_parallel(model, model.tp_plan(),
                                                         init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    tx = default_stack()
    step = fx.train_step(lm_loss(apply, buffers), tx)
    assert_near_one_process(train_layout(step, params, tx, lm_batches(world)), one_process(world))


@case(4)
def case_fused_kernel_on_fsdp_x_tp_shards(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = lm()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], model.tp_plan())
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    apply, params, buffers = fx.parallel.fully_sharded(model)
    tx = default_stack()
    step = fx.parallel.fully_sharded_step(lm_loss(apply, buffers), tx, model)
    batches = [my_rows(b, mesh["dp"].get_local_rank(), world // 2) for b in lm_batches(world)]
    assert_near_one_process(train_layout(step, params, tx, batches), one_process(world))


@case(4)
def case_fused_kernel_on_hsdp_shards(world):
    from torch.distributed.device_mesh import init_device_mesh

    train_fully_sharded(world, init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard")))


@case(2)
def case_fused_kernel_on_pipeline_stages(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pp, rank = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",)), dist.get_rank()
    module = lm().pipeline_stage(rank, world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=pp.get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=xent)
    _, params, _ = fx.functional(module)
    tx = default_stack(groups=(pp,))  # stages hold disjoint params: the norm sums over the pp group
    step = fx.parallel.pipeline_step(schedule, tx, pp_group=pp)
    batches = [(x if rank == 0 else None, y if rank == world - 1 else None) for x, y in lm_batches(world)]
    assert_near_one_process(train_layout(step, params, tx, batches), one_process(world))


@case(2)
def case_fused_kernel_on_expert_shards_and_replicated_dense_params(world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    apply, params, buffers = fx.parallel.expert_parallel(lm(experts=4), mesh)
    tx, rank = default_stack(), dist.get_rank()
    batches = [my_rows(b, rank, world) for b in lm_batches(world)]
    step = fx.train_step(lm_loss(apply, buffers), tx)
    assert_near_one_process(train_layout(step, params, tx, batches), one_process(world, experts=4))


# --- the pytest side: one spawned world per world size runs every case (tests/_worlds.py) ----------------

test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
