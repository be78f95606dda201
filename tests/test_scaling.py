"""scale, scale_by_learning_rate, scale_by_schedule (fxtrain/transforms/_scaling.py)."""

import pytest
import torch

import fxtrain as fx
from tests._parity import assert_dtypes, assert_none_passthrough, assert_pure


def _sched(count):
    return 0.1 * 0.9 ** count


def test_schedule_sees_the_count_before_the_update():
    seen = []
    tx = fx.scale_by_schedule(lambda count: seen.append(int(count)) or 1.0)
    state = tx.init({"w": torch.ones(1)})
    for _ in range(3):
        _, state = tx.update({"w": torch.ones(1)}, state)
    assert seen == [0, 1, 2] and int(state.count) == 3 and state.count.dtype == torch.int32


def test_tensor_learning_rate():
    tx = fx.scale_by_learning_rate(torch.tensor(0.5))
    assert tx.update({"w": torch.ones(1)}, tx.init(None))[0]["w"].tolist() == [-0.5]


def test_states():
    p = {"w": torch.ones(1)}
    assert fx.scale_by_learning_rate(0.1).init(p) == fx.EmptyState()
    assert isinstance(fx.scale_by_learning_rate(_sched).init(p), fx.ScaleByScheduleState)


@pytest.mark.parametrize("tx", [fx.scale(2.0), fx.scale_by_schedule(_sched), fx.scale_by_learning_rate(0.1),
                                fx.scale_by_learning_rate(_sched)], ids=repr)
def test_pure_dtypes_and_none_leaves(tx):
    assert_pure(tx)
    assert_none_passthrough(tx)
    assert_dtypes(tx)


def test_negative_learning_rate_names_it():
    with pytest.raises(ValueError, match=r"scale_by_learning_rate: learning_rate=-0.1 must be >= 0"):
        fx.scale_by_learning_rate(-0.1)


def test_repr():
    expected = "scale_by_learning_rate(learning_rate=0.1, flip_sign=False)"
    assert repr(fx.scale_by_learning_rate(0.1, flip_sign=False)) == expected
    assert repr(fx.scale_by_schedule(_sched)) == "scale_by_schedule(_sched)"
