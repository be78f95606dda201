"""``fx.functional``: an ``nn.Module`` as a pure function of (params, buffers) trees.

The module becomes the program; its tensors become two trees the caller owns. ``apply_fn`` never reads
the module's own tensors and never writes into the trees it is given: BatchNorm's running statistics (and
any other buffer a forward pass updates) come back as a new ``buffers`` tree, like Haiku's
``transform_with_state`` or Flax's ``mutable=["batch_stats"]``. Train or eval mode is an argument of every
call, so it cannot be left set by accident.

Example:
    >>> import torch, fxtrain as fx
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    >>> apply, params, buffers = fx.functional(net)
    >>> sorted(params), sorted(buffers)
    (['0.bias', '0.weight', '1.bias', '1.weight'], ['1.num_batches_tracked', '1.running_mean', '1.running_var'])
    >>> y, new_buffers = apply(params, buffers, torch.randn(8, 3), train=True)
    >>> int(new_buffers["1.num_batches_tracked"]), int(buffers["1.num_batches_tracked"])   # input untouched
    (1, 0)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

from fxtrain import tree
from fxtrain._deferred import FSDPModule

Params = Buffers = dict[str, torch.Tensor]
ApplyFn = Callable[..., tuple[Any, Buffers]]


def functional(module: nn.Module) -> tuple[ApplyFn, Params, Buffers]:
    """Splits ``module`` into a pure ``apply_fn`` and its ``params`` and ``buffers`` trees.

    ``apply_fn(params, buffers, *args, train, **kwargs) -> (output, new_buffers)`` runs ``module(*args,
    **kwargs)`` through :func:`torch.func.functional_call` with the given trees, in train mode when
    ``train=True`` and eval mode otherwise (the module's own mode is restored afterwards). In train mode
    the buffers are copied before the call, so in-place updates (BatchNorm's running statistics) land in
    ``new_buffers`` and never in ``buffers``; in eval mode ``new_buffers`` is ``buffers`` itself.
    Differentiating ``apply_fn`` with respect to ``params`` (``torch.func.grad``, ``torch.autograd.grad``)
    works for plain and DTensor leaves.

    Args:
      module: any ``nn.Module``. Tied parameters (an LM head sharing the embedding) appear once in
        ``params``, under their first name, and stay tied.

    Returns:
      ``(apply_fn, params, buffers)``. ``params`` and ``buffers`` are flat dicts keyed by
      ``module.named_parameters()`` / ``named_buffers()`` names (the ``state_dict`` keys). Their leaves
      are detached and share storage with the module (no copy): from here on the trees are the state,
      and a donated :func:`fxtrain.train_step` updates them in place.

    Raises:
      TypeError: ``module`` is not an ``nn.Module``, or it (or a submodule) is ``fully_shard``-ed (FSDP2):
        use :func:`fxtrain.parallel.fully_sharded` and :func:`fxtrain.parallel.fully_sharded_step`.

    Example:
        >>> import torch, fxtrain as fx
        >>> apply, params, buffers = fx.functional(torch.nn.Linear(2, 1))
        >>> params = {k: torch.ones_like(v) for k, v in params.items()}
        >>> out, _ = apply(params, buffers, torch.tensor([[1.0, 2.0]]), train=False)
        >>> out.tolist()
        [[4.0]]
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fx.functional expects an nn.Module, got {type(module).__name__}")
    _refuse_fully_sharded(module)
    params = {name: p.detach() for name, p in module.named_parameters()}
    buffers = {name: b.detach() for name, b in module.named_buffers()}
    label = type(module).__name__

    def apply_fn(params: Params, buffers: Buffers, *args: Any, train: bool, **kwargs: Any) -> tuple[Any, Buffers]:
        if not isinstance(train, bool):
            raise TypeError(f"{label} apply_fn: train must be True or False, got {train!r}")
        if train:
            # The forward pass may update buffers in place (BatchNorm); give it copies so the caller's
            # tree stays as it was, and hand the copies back as the new state.
            buffers = tree.clone(buffers)
        was_training = module.training
        module.train(train)
        try:
            out = functional_call(module, (params, buffers), args, kwargs, strict=True)
        finally:
            module.train(was_training)
        return out, buffers

    apply_fn.__name__ = apply_fn.__qualname__ = f"apply_{label}"
    return apply_fn, params, buffers


def _refuse_fully_sharded(module: nn.Module) -> None:
    """FSDP2's hooks replace the params ``functional_call`` passes with their own all-gathered ones, so no
    gradient would reach the trees: refuse by name instead of training nothing (issue 16)."""
    names = fully_sharded_modules(module)
    if names:
        where = "it" if names[0] == "" else f"its submodule '{names[0]}'"
        raise TypeError(f"fx.functional({module_label(module)}): {where} is fully_shard-ed (FSDP2), whose hooks "
                        "compute with their own all-gathered parameters, so no gradient would reach the params "
                        "tree; use `apply, params, buffers = fx.parallel.fully_sharded(module)` and "
                        "fx.parallel.fully_sharded_step(loss_fn, tx, module)")


def fully_sharded_modules(module: nn.Module) -> list[str]:
    """The names of ``module``'s submodules (``''`` for itself) on which ``fully_shard`` was called.

    >>> import torch
    >>> fully_sharded_modules(torch.nn.Linear(2, 2))
    []
    """
    return [name for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def module_label(module: nn.Module) -> str:
    """The class the user wrote: ``fully_shard`` swaps a module's class for a subclass named ``FSDP<Class>``."""
    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next((c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule)), cls)
    return cls.__name__
