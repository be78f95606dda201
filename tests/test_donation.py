"""Donation that cannot bite (issue 35): a donated step writes only into buffers it owns.

Generated from the registries, not listed by hand:

* every reader of ``fx.interop`` (a function that turns JAX or numpy arrays into tensors: :data:`READERS`; the
  other names of ``fx.interop.__all__`` are in :data:`NOT_READERS` with what they are, and a new name in
  neither fails :func:`test_every_interop_function_is_classified`) gives tensors in torch's own memory by
  default, which a donated step trains while the source arrays stay as they were; with ``copy=False`` it
  shares them, and a donated step refuses them in one line naming the leaf;
* memory that numpy owns (``torch.as_tensor``, ``from_numpy``, ``frombuffer``) is refused the same way, before
  anything is written;
* every transform of the catalogue (tests/test_conformance.py's ``CASES``: one per public factory), wrapped
  in a user-written wrapper that reads what it passed to ``fx.extend.call`` (updates and child state), gives the
  same numbers pure, under ``no_grad`` and donated (``fx.testing.check_transform``);
* ``fx.testing.check_transform`` passes every transform of the catalogue (the fast suite: pure, no_grad,
  donated, elementwise; ``-m slow`` adds vmap and grad for all, the fast suite runs them on a few) and fails,
  naming the mode in one line, each kind of broken transform.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from typing import Any, Callable, NamedTuple

import numpy as np
import pytest
import torch

import fxtrain as fx
import fxtrain.step
from fxtrain.testing import MODES, check_transform, nested_params
from fxtrain.transforms import _fused
from tests.test_conformance import CASES

# --- what torch owns ------------------------------------------------------------------------------------


def _jax_array():
    jnp = pytest.importorskip("jax.numpy")
    return torch.from_dlpack(jnp.arange(3.0))


BORROWED = {  # tensors whose memory another library (or a file) owns
    "from_numpy": lambda: torch.from_numpy(np.ones(3, dtype=np.float32)),
    "as_tensor": lambda: torch.as_tensor(np.ones(3, dtype=np.float32)),
    "view of from_numpy": lambda: torch.from_numpy(np.ones(4, dtype=np.float32))[1:],
    "frombuffer": lambda: torch.frombuffer(bytearray(12), dtype=torch.float32),
    "dlpack of jax": _jax_array,
    # torch's memory, but a numpy array may point into it: refused too (conservative, see fx.tree.borrowed)
    "exported to numpy": lambda: (lambda t: (np.asarray(t), t)[1])(torch.ones(3)),
}
OWNED = {  # tensors in memory torch's allocator made
    "ones": lambda: torch.ones(3),
    "clone of from_numpy": lambda: torch.from_numpy(np.ones(3, dtype=np.float32)).clone(),
    "as_tensor with a dtype change": lambda: torch.as_tensor(np.ones(3), dtype=torch.float32),
    "parameter": lambda: torch.nn.Parameter(torch.ones(3)).detach(),
    "shared memory": lambda: torch.ones(3).share_memory_(),
    "view": lambda: torch.ones(4)[1:],
    "empty from numpy": lambda: torch.from_numpy(np.ones(0, dtype=np.float32)),  # nothing to write
    "exported through dlpack": lambda: (lambda t: (torch.utils.dlpack.to_dlpack(t), t)[1])(torch.ones(3)),
}


@pytest.mark.parametrize("name", sorted(BORROWED))
def test_borrowed_memory_is_told(name):
    assert fx.tree.borrowed(BORROWED[name]())


@pytest.mark.parametrize("name", sorted(OWNED))
def test_owned_memory_is_told(name):
    assert not fx.tree.borrowed(OWNED[name]())


def test_fx_load_gives_owned_memory(tmp_path):
    params = {"w": torch.ones(3)}
    state = fx.TrainState(step=torch.tensor(0), params=params, opt_state=fx.adam(0.1).init(params), rng=None)
    fx.save(tmp_path / "ck", state)
    assert fx.tree.first_borrowed(fx.load(tmp_path / "ck", like=state)) is None


# --- a donated step refuses what it does not own, before writing anything --------------------------------

def _loss(p, b):
    return sum(((x - b) ** 2).sum() for x in fx.tree.leaves(p) if x is not None)


@pytest.mark.parametrize("name", sorted(n for n in BORROWED if n != "frombuffer"))
@pytest.mark.parametrize("where", ["params", "opt_state"])
def test_donated_step_refuses_borrowed_leaves_in_one_line(name, where):
    x = BORROWED[name]().to(torch.float32) if name != "dlpack of jax" else BORROWED[name]()
    before = x.clone()
    tx = fx.sgd(0.1, momentum=0.9)
    if where == "params":
        params = {"layer": {"w": x}, "b": torch.zeros(())}
        state = tx.init(params)
    else:
        params = {"layer": {"w": torch.zeros_like(x)}, "b": torch.zeros(())}
        state = tx.init(params)
        state = (state[0]._replace(trace={"layer": {"w": x}, "b": state[0].trace["b"]}), *state[1:])
    step = fx.train_step(_loss, tx)
    with pytest.raises(ValueError, match=f"into {where} '.*layer.w'") as info:
        step(params, state, torch.ones(()))
    message = str(info.value)
    assert "\n" not in message and "fx.tree.clone" in message and "donate=False" in message
    assert torch.equal(x, before)  # refused before anything was written
    # The two ways out it names: a copy, or the pure step (which leaves the numpy array as it was).
    new, _, _ = step(fx.tree.clone(params), fx.tree.clone(state), torch.ones(()))
    assert torch.equal(x, before) and not torch.equal(new["b"], params["b"])
    fx.train_step(_loss, tx, donate=False)(params, state, torch.ones(()))
    assert torch.equal(x, before)


def test_the_check_runs_once_per_step_function(monkeypatch):
    calls = []
    check = fxtrain.step.check_owned
    monkeypatch.setattr(fxtrain.step, "check_owned", lambda *a: calls.append(1) or check(*a))
    tx = fx.sgd(0.1)
    step = fx.train_step(_loss, tx)
    params, state = {"w": torch.zeros(2)}, tx.init(None)
    for _ in range(3):
        params, state, _ = step(params, state, torch.ones(()))
    assert calls == [1]


def test_numpy_init_is_left_alone_by_a_donated_run():
    """The issue's measurement: a numpy init turned into tensors trained in place."""
    init = np.linspace(-1, 1, 6, dtype=np.float32)
    tx = fx.adam(0.1)
    params = fx.tree.clone({"w": torch.as_tensor(init)})  # the fix the refusal names
    state = tx.init(params)
    step = fx.train_step(_loss, tx)
    for _ in range(3):
        params, state, _ = step(params, state, torch.ones(()))
    assert np.array_equal(init, np.linspace(-1, 1, 6, dtype=np.float32))


# --- the interop readers: a copy by default, shared (and refused) when asked -----------------------------

class Made(NamedTuple):
    tree: Any                       # what the reader returned
    kind: str                       # "params" or "opt_state"
    sources: list                   # the other library's arrays the result came from
    like: Any = None                # params a state belongs to


def _jnp():
    return pytest.importorskip("jax.numpy")


def _read_from_jax(copy):
    jnp = _jnp()
    src = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    return Made(fx.interop.from_jax(src, **copy), "params", [src["w"], src["b"]])


def _read_from_linen(copy):
    jnp = _jnp()
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    variables = fx.interop.to_linen({k: p.detach() for k, p in net.named_parameters()}, net)
    variables = {"params": fx.tree.map(lambda a: jnp.array(a, copy=True), variables["params"])}  # JAX's own
    import jax
    return Made(fx.interop.from_linen(variables, net, **copy), "params", jax.tree.leaves(variables))


def _read_from_nnx(copy):
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    return Made(fx.interop.from_nnx(model, torch.nn.Linear(3, 2), **copy), "params", [model.kernel[...],
                                                                                   model.bias[...]])


def _read_state_from_optax(copy):
    optax = pytest.importorskip("optax")
    import jax
    params = {"w": torch.ones(3), "b": torch.zeros(2)}
    otx = optax.sgd(0.1, momentum=0.9)
    p = fx.interop.to_jax(fx.tree.clone(params))
    _, ostate = otx.update(p, otx.init(p), p)
    state = fx.interop.state_from_optax(ostate, fx.sgd(0.1, momentum=0.9).init(params), **copy)
    return Made(state, "opt_state", jax.tree.leaves(ostate), params)


def _read_state_from_nnx_optimizer(copy):
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    import jax
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    opt.opt_state[0].trace["kernel"][...] = 1.0 + opt.opt_state[0].trace["kernel"][...]  # a nonzero momentum
    net = torch.nn.Linear(3, 2)
    params = {k: p.detach().clone() for k, p in net.named_parameters()}
    state = fx.interop.state_from_nnx_optimizer(opt, net, fx.sgd(0.1, momentum=0.9).init(params), **copy)
    return Made(state, "opt_state", jax.tree.leaves(nnx.to_pure_dict(nnx.state(opt, nnx.optimizer.OptState))),
                params)


def _read_orbax(copy):
    pytest.importorskip("orbax.checkpoint")
    params, tx = {"w": torch.ones(3)}, fx.sgd(0.1, momentum=0.9)
    _, state = tx.update({"w": torch.ones(3)}, tx.init(params), params)
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    fx.interop.save_orbax(path, params, state, tx)
    p, s = fx.interop.load_orbax(path, {"w": torch.zeros(3)}, tx, **copy)
    return Made({"params": p, "opt_state": s}, "both", [])


def _read_safetensors(copy):
    pytest.importorskip("safetensors")
    path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    fx.interop.save_safetensors(path, {"w": torch.ones(3), "b": torch.zeros(2)})
    return Made(fx.interop.load_safetensors(path, {"w": torch.zeros(3), "b": torch.zeros(2)}, **copy), "params", [])


READERS: dict[str, Callable[[dict], Made]] = {
    "from_jax": _read_from_jax, "from_linen": _read_from_linen, "from_nnx": _read_from_nnx,
    "state_from_optax": _read_state_from_optax, "state_from_nnx_optimizer": _read_state_from_nnx_optimizer,
    "load_orbax": _read_orbax, "load_safetensors": _read_safetensors,
}
NOT_READERS = {
    "to_jax": "torch -> JAX (the array reads the tensor's memory; nothing of JAX's is written)",
    "state_to_optax": "torch -> Optax", "to_linen": "torch -> Flax", "to_nnx": "torch -> Flax NNX (copies in)",
    "state_to_nnx_optimizer": "torch -> Flax NNX", "save_orbax": "writes a checkpoint",
    "save_safetensors": "writes a file", "linen_names": "names only",
    "jax_function": "its outputs are activations and gradients, never params or state; a donated step copies a "
                    "gradient whose memory is borrowed (fxtrain/step.py's _owned)",
}


def test_every_interop_function_is_classified():
    public = set(fx.interop.__all__)
    assert public == set(READERS) | set(NOT_READERS), sorted(public ^ (set(READERS) | set(NOT_READERS)))


def _shares(name: str) -> bool:
    return "copy" in inspect.signature(getattr(fx.interop, name)).parameters


def _train(made: Made, donate: bool = True) -> None:
    """Three steps of a donated (or pure) step on what the reader made, as params or as state."""
    trees = {"params": made.tree} if made.kind == "params" else {"opt_state": made.tree}
    if made.kind == "both":
        trees = made.tree
    tx = fx.sgd(0.1, momentum=0.9)
    params = trees.get("params", made.like)
    state = trees.get("opt_state", tx.init(params))
    step = fx.train_step(_loss, tx, donate=donate)
    for _ in range(3):
        params, state, _ = step(params, state, torch.ones(()))


@pytest.mark.jax
@pytest.mark.parametrize("name", sorted(READERS))
def test_readers_copy_by_default_and_a_donated_run_leaves_the_sources(name):
    made = READERS[name]({})
    assert fx.tree.first_borrowed(made.tree) is None
    before = [np.array(a, copy=True) for a in made.sources]
    _train(made)
    for a, b in zip(made.sources, before):
        assert np.array_equal(np.asarray(a), b)


@pytest.mark.jax
@pytest.mark.parametrize("name", sorted(n for n in READERS if _shares(n)))
def test_readers_share_when_asked_and_a_donated_step_refuses_them(name):
    made = READERS[name]({"copy": False})
    path = fx.tree.first_borrowed(made.tree)
    assert path is not None
    with pytest.raises(ValueError, match=f"into {made.kind} '{path}'"):
        _train(made)
    _train(made, donate=False)  # the pure step reads them and writes nothing


@pytest.mark.jax
def test_a_jax_baseline_continued_from_linen_params_is_unchanged():
    """The issue's measurement: a torch run trained from Flax variables, then the JAX run continued from the same
    variables. The variables must be the ones JAX made, whatever the torch run did."""
    jnp = _jnp()
    import jax
    net = torch.nn.Linear(4, 1)
    variables = {"params": {"kernel": jnp.full((4, 1), 0.5), "bias": jnp.zeros(1)}}
    kept = jax.tree.map(lambda a: np.array(a, copy=True), variables)
    params = fx.interop.from_linen(variables, net)
    apply, _, _ = fx.functional(net)
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.ones(8, 1)

    def loss_fn(p, b):
        return ((apply(p, {}, b[0], train=True)[0] - b[1]) ** 2).mean()

    tx = fx.adam(0.1)
    step, state = fx.train_step(loss_fn, tx), tx.init(params)
    for _ in range(5):
        params, state, _ = step(params, state, (x, y))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), variables, kept)


# --- wrappers: what they pass to fx.extend.call they can read afterwards --------------------------------------

class SelectState(NamedTuple):
    count: torch.Tensor
    inner: Any


@fx.transform(elementwise=None)
def every_other(tx: fx.GradientTransformation) -> fx.GradientTransformation:
    """fx.extend.combine's docstring example, keeping the child's state only on the steps it applies: it reads both
    the updates and the child state it passed to fx.extend.call after the call."""
    def init_fn(params):
        return SelectState(torch.zeros((), dtype=torch.int32), tx.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        new, inner = fx.extend.call(tx, updates, state.inner, params, extra_args)
        odd = state.count % 2 == 0
        new = fx.tree.map(lambda n, u: n if u is None else torch.where(odd, n, u), new, updates)
        inner = fx.tree.map(lambda n, o: torch.where(odd, n, o) if isinstance(n, torch.Tensor) and n.dtype != torch.bool
                            and n.shape == o.shape else n, inner, state.inner)
        return new, SelectState(state.count + 1, inner)

    return fx.extend.combine(init_fn, update_fn, (tx,), lambda s: (s.inner,))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrapper_reading_what_it_passed_is_the_same_pure_and_donated(name):
    state_meaningful = name != "accumulate"  # its sum is meaningless right after an emission (documented)
    check_transform(every_other(CASES[name]()), nested_params(seed=0), steps=4,
                    modes=("pure", "no_grad", "donated"), state=state_meaningful)


def test_every_other_in_a_step_matches_by_hand():
    """The docstring example in a training step: 0.9 pure and -0.2 donated before (issue 35)."""
    tx = every_other(fx.scale(-0.1))
    loss = lambda p, b: (p["w"] * b).sum()  # noqa: E731 - gradient b
    results = []
    for donate in (False, True):
        params = {"w": torch.ones(1)}
        state, step = tx.init(params), fx.train_step(loss, tx, donate=donate)
        with torch.no_grad():
            for _ in range(2):  # -0.1 * 1, then the raw gradient 1 (every other)
                params, state, _ = step(params, state, torch.ones(1))
        results.append(params["w"].item())
    assert results == pytest.approx([1 - 0.1 + 1.0] * 2, abs=1e-7)


def _clip_adamw_doubled() -> fx.GradientTransformation:
    """The issue's wrapper: fx.extend.combine over (clip_by_global_norm, adamw), whose own update doubles the result."""
    clip, opt = fx.clip_by_global_norm(1.0), fx.adamw(0.1)

    def update_fn(updates, state, params=None, **extra_args):
        updates, clip_state = fx.extend.call(clip, updates, state[0], params, extra_args)
        updates, opt_state = fx.extend.call(opt, updates, state[1], params, extra_args)
        return fx.tree.map(lambda u: 2 * u, updates), (clip_state, opt_state)

    return fx.extend.combine(lambda p: (clip.init(p), opt.init(p)), update_fn, (clip, opt), lambda s: s)


def test_a_combine_wrapper_does_not_inherit_the_fused_kernel():
    """The issue's measurement (2.02 vs 0.26): the step ran the fused clip+adamw kernel instead of the update."""
    assert _fused.spec(fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(0.1))) is not None  # chain's is its children's
    tx = _clip_adamw_doubled()
    assert _fused.spec(tx) is None
    results = []
    for donate in (False, True):
        params = {"w": torch.linspace(-1, 1, 4)}
        state, step = tx.init(params), fx.train_step(_loss, tx, donate=donate)
        with torch.no_grad():
            for _ in range(3):
                params, state, _ = step(params, state, torch.full((), 3.0))
        results.append(params["w"])
    # the reference: the same wrapper out of place, by hand
    params = {"w": torch.linspace(-1, 1, 4)}
    state = tx.init(params)
    for _ in range(3):
        g = {"w": 2 * (params["w"] - 3.0)}
        u, state = tx.update(g, state, params)
        params = fx.apply_updates(params, u)
    torch.testing.assert_close(results[0], params["w"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1], params["w"], rtol=1e-5, atol=1e-6)


def test_named_chain_keeps_the_fused_kernel():
    assert _fused.spec(fx.named_chain(("clip", fx.clip_by_global_norm(1.0)), ("opt", fx.adamw(0.1)))) is not None


# --- check_transform over the catalogue ---------------------------------------------------------------

# Modes a transform leaves out, with why (each is a refusal or a known defect, never a silent pass).
NOT_BATCHED = {"snapshot": "its measure (fx.tree.norm: torch._foreach_norm) has no vmap batching rule: it raises"}
GRAD_PENDING: dict[str, str] = {}  # grad through the update differs from central differences (xfail, not strict)
FAST_FULL = ("adamw", "chain", "masked", "apply_if_finite", "inject_hyperparams", "sharded_apply", "lookahead")


def _modes(name: str, wanted: tuple) -> tuple:
    return tuple(m for m in wanted if not (m == "vmap" and name in NOT_BATCHED))


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_transform_passes_the_catalogue(name):
    check_transform(CASES[name](), nested_params(seed=0), modes=("pure", "no_grad", "donated", "elementwise"),
                    state=name != "accumulate")


def _full(name):
    marks = [pytest.mark.xfail(reason=GRAD_PENDING[name], strict=False)] if name in GRAD_PENDING else []
    if name not in FAST_FULL:
        marks.append(pytest.mark.slow)
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_full(n) for n in sorted(CASES)])
def test_check_transform_vmap_and_grad_over_the_catalogue(name):
    check_transform(CASES[name](), nested_params(seed=0), modes=_modes(name, ("vmap", "grad")),
                    state=name != "accumulate")


# --- check_transform catches each kind of broken transform, in one line naming the mode -------------------

def _plain(update_fn, elementwise=False):
    @fx.transform(elementwise=elementwise)
    def broken():
        return fx.GradientTransformation(lambda p: fx.EmptyState(), update_fn)
    return broken()


def _writes_its_input(updates, state, params=None):
    for x in fx.tree.leaves(updates):
        if x is not None:
            x.mul_(2.0)
    return updates, state


def _reads_what_it_donated(updates, state, params=None):
    new, _ = fx.extend.call_(fx.scale(3.0), updates, fx.EmptyState(), params)
    return fx.tree.map(lambda n, g: n + g, new, updates), state


def _per_leaf_norm(updates, state, params=None):
    return fx.tree.map(lambda g: g / g.norm(), updates), state


def _host_sync(updates, state, params=None):
    return fx.tree.map(lambda g: g * float(g.reshape(-1)[0].item() > 0), updates), state


def _detached(updates, state, params=None):
    return fx.tree.map(lambda g: 2 * g.detach(), updates), state


BROKEN = {  # name -> (transform, the mode that must fail, words of the message)
    "writes its input": (lambda: _plain(_writes_its_input), "pure", "wrote into its input updates"),
    "reads what it donated": (lambda: _plain(_reads_what_it_donated), "no_grad", "updates differ"),
    "false elementwise claim": (lambda: _plain(_per_leaf_norm, elementwise=True), "elementwise", "two halves"),
    "host sync": (lambda: _plain(_host_sync), "vmap", "raised"),
    "detached": (lambda: _plain(_detached), "grad", "central differences"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_transform_names_the_mode_that_fails(name):
    build, mode, words = BROKEN[name]
    with pytest.raises(AssertionError, match=f"mode '{mode}'") as info:
        check_transform(build(), nested_params(seed=0))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_check_transform_refuses_unknown_modes():
    with pytest.raises(ValueError, match="unknown modes"):
        check_transform(fx.sgd(0.1), {"w": torch.ones(2)}, modes=("pure", "donate"))
    assert set(MODES) == {"pure", "no_grad", "donated", "vmap", "grad", "elementwise"}
