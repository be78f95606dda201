"""Tests for fxtrain/_base.py: the protocol, the @transform decorator, chain, named_chain, apply_updates."""

import re

import pytest
import torch

import fxtrain as fx
from fxtrain import _base
from fxtrain.testing import assert_trees_close, nested_params


def _double():
    """A hand-written, Optax-style transform (pure update, no decorator)."""
    return fx.GradientTransformation(lambda p: fx.EmptyState(), lambda u, s, p=None: (fx.tree.map(lambda x: 2 * x, u), s))


def test_update_is_pure_and_kernel_donates():
    g = nested_params()
    tx = fx.chain(fx.scale(2.0), fx.scale(3.0))
    before = fx.tree.clone(g)
    u, _ = tx.update(g, tx.init(g))
    assert_trees_close(g, before, rtol=0, atol=0)
    assert_trees_close(u, fx.tree.map(lambda x: 6 * x, before))
    u2, _ = fx.update_(tx, g, tx.init(g))
    assert u2["dense"]["w"] is g["dense"]["w"]  # written into the donated buffer
    assert_trees_close(u2, u, rtol=0, atol=0)


def test_hand_written_transform_composes():
    tx = fx.chain(_double(), fx.scale(0.5))
    g = {"w": torch.ones(2)}
    assert tx.update(g, tx.init(g))[0]["w"].tolist() == [1.0, 1.0]
    assert repr(_double()) == "_double"


def scale_by_foo(factor):
    """A hand-written transform in Optax style: update_fn closes over the factory's argument."""
    def init_fn(params):
        del params
        return fx.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return fx.tree.map(lambda g: factor * g, updates), state

    return fx.GradientTransformation(init_fn, update_fn)


def update_fn(updates, state, params=None):
    """An update function defined at module level (no factory around it)."""
    return updates, state


def test_hand_written_transforms_print_by_name_in_a_chain():
    # Issue 19: the runner's stack line printed GradientTransformation(init=init_fn, update=update_fn).
    plain = fx.GradientTransformation(lambda p: fx.EmptyState(), update_fn)
    tx = fx.chain(fx.clip_by_global_norm(1.0), scale_by_foo(2.0), fx.named(scale_by_foo(3.0), "foo(3.0)"),
                  plain, fx.with_traits(scale_by_foo(0.5), elementwise=True), fx.scale(-0.1))
    assert repr(tx) == "chain(clip_by_global_norm(1.0), scale_by_foo, foo(3.0), update_fn, scale_by_foo, scale(-0.1))"
    assert repr(fx.accumulate(fx.named(_double(), "double"), every=2)) == "accumulate(every=2, double)"
    g = {"w": torch.full((2,), 0.5)}   # norm below the clip bound
    assert tx.update(g, tx.init(g))[0]["w"].tolist() == pytest.approx([-0.15, -0.15])   # names change nothing else
    assert fx.is_elementwise(fx.named(fx.scale(2.0), "s")) and not fx.is_elementwise(fx.named(_double(), "d"))
    with pytest.raises(ValueError, match=r"^foo\(3.0\): chain of 1 transforms got a state of 2"):
        fx.named(fx.chain(scale_by_foo(3.0)), "foo(3.0)").update(g, (fx.EmptyState(),) * 2)
    with pytest.raises(TypeError, match=r"named: name must be a non-empty string \(or a function returning one\), got ''"):
        fx.named(fx.scale(1.0), "")


def test_repr_shows_structure_and_non_default_args():
    tx = fx.named_chain(("pre", fx.chain(fx.identity(), fx.scale(-1.0))), ("post", fx.scale(2.0)))
    assert repr(tx) == "named_chain(pre=chain(identity(), scale(-1.0)), post=scale(2.0))"


def test_named_chain_rejects_duplicates_and_wrong_state():
    with pytest.raises(ValueError, match="duplicate"):
        fx.named_chain(("a", fx.identity()), ("a", fx.identity()))
    tx = fx.named_chain(("a", fx.identity()))
    with pytest.raises(ValueError, match="named_chain"):
        tx.update({"w": torch.ones(1)}, {"b": fx.EmptyState()})


def test_chain_state_length_checked():
    tx = fx.chain(fx.identity(), fx.identity())
    with pytest.raises(ValueError, match="chain of 2 transforms got a state of 1"):
        tx.update({"w": torch.ones(1)}, (fx.EmptyState(),))


def test_elementwise_flags_compose():
    assert fx.is_elementwise(fx.chain(fx.scale(1.0), fx.identity()))
    assert not fx.is_elementwise(fx.chain(fx.scale(1.0), fx.stateless(lambda u, p: u)))
    assert not fx.is_elementwise(_double())


def test_elementwise_is_opt_in_and_traits_show_in_their_repr():
    @fx.transform
    def undeclared():
        return fx.GradientTransformation(lambda p: fx.EmptyState(), lambda u, s, p=None: (u, s))

    @fx.transform(elementwise=True)
    def declared():
        return fx.GradientTransformation(lambda p: fx.EmptyState(), lambda u, s, p=None: (u, s))

    assert fx.traits(undeclared()) == fx.Traits() and repr(fx.traits(undeclared())) == "Traits()"
    assert repr(fx.traits(declared())) == "Traits(elementwise=True)"
    assert repr(fx.traits(fx.chain(declared(), undeclared()))) == "Traits()"
    assert repr(fx.traits(fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(0.1)))) == "Traits(fused='adamw')"
    assert repr(fx.traits(fx.contrib.reduce_on_plateau())).startswith("Traits(extra_args=True")
    with pytest.raises(ValueError, match=r"^sharded_apply: undeclared\(\) is not elementwise"):
        fx.sharded_apply(undeclared())
    assert fx.is_elementwise(fx.sharded_apply(declared()))


def test_one_needs_params_check_with_one_message():
    g = {"w": torch.ones(2)}
    for tx, name in [(fx.add_decayed_weights(0.1), "add_decayed_weights"),
                     (fx.scale_by_trust_ratio(), "scale_by_trust_ratio"), (fx.scale_by_lbfgs(), "scale_by_lbfgs"),
                     (fx.contrib.prodigy(), "prodigy"), (fx.contrib.scale_by_cocob(), "scale_by_cocob"),
                     (fx.adaptive_grad_clip(0.1), "adaptive_grad_clip"),
                     (fx.chain(fx.scale(1.0), fx.scale_by_factored_rms()), "scale_by_factored_rms")]:
        message = f"{tx!r}: {name} needs the params: call update(updates, state, params)"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            tx.update(g, tx.init(g))


def test_the_extension_api_is_what_library_wrappers_use():
    # the README's names, reachable from fx (the wrapper-writing machinery from fx.extend), and the library's own
    # wrappers are built with them
    for name in ("describe", "named", "with_traits", "traits"):
        assert getattr(fx, name) is getattr(_base, name)
    for name in ("combine", "call", "call_", "kernel", "forwarded", "describe", "check_learning_rate",
                 "check_needs_params", "check_nonnegative"):
        assert getattr(fx.extend, name) is getattr(_base, name)
    tx = fx.masked(fx.add_decayed_weights(0.1), {"w": True})
    assert fx.traits(tx) == fx.traits(fx.extend.combine(tx.init, tx.update, (fx.add_decayed_weights(0.1),)))


def test_wrap_loss_composes_first_outermost():
    calls = []

    def make(tag):
        def wrap(loss_fn, state):
            def wrapped(params, batch):
                calls.append(tag)
                return loss_fn(params, batch)
            return wrapped
        return fx.with_traits(fx.GradientTransformation(lambda p: fx.EmptyState(), lambda u, s, p=None: (u, s)), wrap_loss=wrap)

    tx = fx.chain(make("outer"), fx.identity(), make("inner"))
    loss = _base.wrap_loss(tx, lambda p, b: p + b, tx.init(None))
    assert loss(1, 2) == 3 and calls == ["outer", "inner"]
    assert _base.wrap_loss(fx.identity(), abs, None) is abs


def test_apply_updates_keeps_dtype_and_none():
    p = {"w": torch.ones(2, dtype=torch.bfloat16), "frozen": torch.ones(1), "absent": None}
    u = {"w": torch.full((2,), 0.5), "frozen": None, "absent": None}
    out = fx.apply_updates(p, u)
    assert out["w"].dtype == torch.bfloat16 and out["w"].tolist() == [1.5, 1.5]
    assert out["frozen"] is p["frozen"] and out["absent"] is None
    assert p["w"].tolist() == [1.0, 1.0]
    out_ = fx.apply_updates_(p, u)
    assert out_["w"] is p["w"] and p["w"].tolist() == [1.5, 1.5]


def test_apply_updates_names_mismatching_path():
    with pytest.raises(ValueError, match="differ at 'layer.v'"):
        fx.apply_updates({"layer": {"w": torch.ones(1)}}, {"layer": {"v": torch.ones(1)}})


def test_update_error_names_transform():
    tx = fx.chain(fx.identity())

    def bad(u, s, p=None):
        raise ValueError("boom")

    tx = fx.chain(fx.GradientTransformation(lambda p: fx.EmptyState(), bad))
    with pytest.raises(ValueError, match=r"^chain\(test_update_error_names_transform\): boom"):
        tx.update({}, tx.init({}))


def test_update_error_subclass_keeps_its_type():
    """A ValueError subclass raised inside an update (a user's, or checkpoint/donation errors) comes out as
    itself, message untouched, the transform named in a note (issue 25: it was rewrapped as a plain ValueError)."""

    class UserError(ValueError):
        def __init__(self, code):
            super().__init__(f"code {code}")
            self.code = code

    def bad(u, s, p=None):
        raise UserError(7)

    tx = fx.chain(fx.GradientTransformation(lambda p: fx.EmptyState(), bad))
    with pytest.raises(UserError) as info:
        tx.update({}, tx.init({}))
    assert type(info.value) is UserError and info.value.code == 7 and str(info.value) == "code 7"
    assert any(note.startswith("in the update of chain(") for note in info.value.__notes__)


def test_report_collects_from_nested_states():
    class S(tuple):
        pass

    from typing import NamedTuple

    class Reporting(NamedTuple):
        value: torch.Tensor

        def report(self):
            return {"thing": self.value}

    state = (fx.EmptyState(), {"x": Reporting(torch.tensor(2.0)), "y": Reporting(torch.tensor(3.0))})
    assert _base.report(state) == {"thing": torch.tensor(2.0)}
    assert _base.report((fx.EmptyState(),)) == {}


def test_report_cache_tells_apart_states_with_the_same_treespec():
    class Counting:  # not a pytree node: a leaf for optree
        def report(self):
            return {"calls": torch.tensor(1)}

    assert _base.report(torch.zeros(())) == {}
    assert _base.report(Counting()) == {"calls": torch.tensor(1)}
    assert _base.report((torch.zeros(()), fx.EmptyState())) == {}
    assert _base.report((Counting(), fx.EmptyState())) == {"calls": torch.tensor(1)}


def test_report_finds_reporting_nodes_inside_reporting_nodes_outer_first():
    from typing import NamedTuple

    class Inner(NamedTuple):
        grad_norm: torch.Tensor

        def report(self):
            return {"grad_norm": self.grad_norm, "shared": torch.tensor(1.0)}

    class Outer(NamedTuple):
        scale: torch.Tensor
        inner_state: tuple

        def report(self):
            return {"loss_scale": self.scale, "shared": torch.tensor(2.0)}

    state = Outer(torch.tensor(8.0), (fx.EmptyState(), Inner(torch.tensor(3.0))))
    assert _base.report(state) == {"loss_scale": torch.tensor(8.0), "shared": torch.tensor(2.0),
                                   "grad_norm": torch.tensor(3.0)}


def test_apply_updates_to_no_params_is_none():
    """Optax's update_test.test_none_argument: ``apply_updates(None, x)`` is ``None`` (an empty tree), not a TypeError."""
    assert fx.apply_updates(None, torch.tensor([1.0, 2.0, 3.0])) is None


# --- extra update arguments (Optax's GradientTransformationExtraArgs) ------------------------------------

@fx.transform(elementwise=True, extra_args=True)
def _scale_by_value():
    """Multiplies updates by the ``value=`` passed to update (a transform that reads an extra argument)."""
    def init_fn(params):
        del params
        return fx.EmptyState()

    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        del params, extra_args
        if value is None:
            raise ValueError("_scale_by_value needs value=")
        return fx.tree.put(updates, updates, fx.tree.scale_(fx.tree.leaves(updates), value)), state

    return fx.GradientTransformation(init_fn, update_fn)


@pytest.mark.parametrize("wrap", ["chain", "named_chain", "amp_cast", "sharded_apply", "inject_hyperparams"])
def test_extra_args_reach_the_transform_that_reads_them(wrap):
    inner = fx.chain(fx.scale(2.0), _scale_by_value())
    tx = {"chain": lambda: fx.chain(fx.identity(), inner),
          "named_chain": lambda: fx.named_chain(("a", fx.identity()), ("b", inner)),
          "amp_cast": lambda: fx.amp_cast(inner, policy="p=f32,c=f32,o=f32", loss_scale="dynamic"),
          "sharded_apply": lambda: fx.sharded_apply(inner),
          "inject_hyperparams": lambda: fx.chain(fx.inject_hyperparams(fx.sgd)(learning_rate=0.5), inner)}[wrap]()
    assert fx.traits(tx).extra_args
    g = {"w": torch.ones(2)}
    state = tx.init(g)
    if wrap == "amp_cast":  # gradients of the scaled loss
        g = {"w": torch.ones(2) * state.loss_scale.scale}
    u, _ = tx.update(g, state, g, value=torch.tensor(3.0), grad=g)  # grad=: read by nobody, dropped
    expected = 6.0 * (-0.5 if wrap == "inject_hyperparams" else 1.0)
    assert u["w"].tolist() == [expected, expected]
    with pytest.raises(ValueError, match="needs value="):
        tx.update(g, tx.init(g), g)


def test_extra_args_are_dropped_by_transforms_that_do_not_read_them():
    tx = fx.adam(0.1)
    assert not fx.traits(tx).extra_args
    g = {"w": torch.ones(2)}
    u, _ = tx.update(g, tx.init(g), g, value=torch.tensor(1.0))
    v, _ = fx.update_(tx, fx.tree.clone(g), tx.init(g), g, value=torch.tensor(1.0))
    assert u["w"].tolist() == v["w"].tolist()
    torch.testing.assert_close(u["w"], torch.full((2,), -0.1))


@pytest.mark.parametrize("donate", [True, False])
def test_train_step_passes_the_loss_as_value(donate):
    seen = []

    @fx.transform(elementwise=True, extra_args=True)
    def record():
        def update_fn(updates, state, params=None, *, value=None, **extra_args):
            seen.append(float(value))
            return updates, state
        return fx.GradientTransformation(lambda p: fx.EmptyState(), update_fn)

    tx = fx.chain(record(), fx.sgd(0.1))
    step = fx.train_step(lambda p, b: (p["w"] * b).sum(), tx, donate=donate)
    params = {"w": torch.ones(2)}
    params, state, metrics = step(params, tx.init(params), torch.full((2,), 2.0))
    assert seen == [4.0] and float(metrics["loss"]) == 4.0
