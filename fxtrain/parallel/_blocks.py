"""Per-block activation checkpointing and ``torch.compile``: torchtitan's ``apply_ac`` and ``apply_compile``.

A model's *blocks* are the children of its ``blocks`` container (:class:`fxtrain.models.TransformerLM`'s
transformer blocks, a pipeline stage's share of them): the repeated units that FSDP shards one by one and that
these two wrap one by one, in place, in torchtitan's order (tensor parallel, then checkpointing, then compile,
then FSDP; :func:`fxtrain.parallel.parallelize` composes them).

* :func:`checkpoint_blocks` (``model.activation_checkpoint``): ``full`` recomputes every block's activations in
  the backward pass instead of keeping them (``torch.utils.checkpoint``, non-reentrant), ``selective`` every other
  block (torchtitan's layer-wise selective AC at frequency 2), ``none`` leaves the model as it is.
* :func:`compile_blocks` (``trainer.compile``): each block's forward ``torch.compile``-d on its own, one graph
  that every block of the same structure shares (the blocks are the same code, so dynamo compiles once); a
  model without blocks is compiled whole.

Both keep the module tree and its names (the block's ``forward`` is replaced on the instance, no wrapper module):
params, checkpoints, tensor-parallel plans and FSDP units see the same model. Torch's own hooks (FSDP's
all-gather, tensor parallel's redistributions of a block's input) stay around the wrapped forward.

Example:
    >>> import torch
    >>> from fxtrain.models import TransformerLM
    >>> lm = TransformerLM(vocab_size=16, context=8, d_model=8, n_layers=2, n_heads=2)
    >>> checkpoint_blocks(lm, "selective")
    [1]
    >>> sorted(lm.state_dict()) == sorted(TransformerLM(16, 8, 8, 2, 2).state_dict())   # same names
    True
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["AC_MODES", "blocks_of", "checkpoint_blocks", "checkpointed_blocks", "compile_blocks", "compile_refusal",
           "wrapped_note"]

#: ``model.activation_checkpoint``'s values: what each keeps for the backward pass
AC_MODES = {
    "none": "every activation (no recomputation)",
    "full": "each block's input only, recomputing the block in the backward pass",
    "selective": "every other block's input only (blocks 1, 3, ...), recomputing those",
}


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: the children of its ``blocks`` container, ``[]`` when it has none.

    >>> from fxtrain.models import MLP, TransformerLM
    >>> len(blocks_of(TransformerLM(vocab_size=16, context=8, d_model=8, n_layers=3, n_heads=2))), blocks_of(MLP((4,)))
    (3, [])
    """
    container = getattr(model, "blocks", None)
    return list(container.children()) if isinstance(container, nn.Module) else []


def checkpoint_blocks(model: nn.Module, mode: str) -> list[int]:
    """Activation checkpointing of ``model``'s blocks, in place; returns the positions of the checkpointed blocks.

    A checkpointed block keeps only its input for the backward pass and runs its forward again there
    (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the same kernels on the same inputs, so the same
    gradients bit for bit). The recomputation runs with the tensors the forward ran with: under
    :func:`fxtrain.functional` (or amp's cast copies) those are the params tree's, no longer in the module when
    the backward pass runs, so the block is re-run with them put back. Outside autograd (evaluation) the block
    runs as it is.

    Args:
      model: a module with blocks (:func:`blocks_of`), e.g. :class:`fxtrain.models.TransformerLM`.
      mode: ``none``, ``full`` or ``selective`` (:data:`AC_MODES`).

    Raises:
      ValueError: as :func:`checkpointed_blocks`.
    """
    blocks = blocks_of(model)
    chosen = checkpointed_blocks(model, mode)
    for i in chosen:
        _wrap(blocks[i], "activation_checkpoint", _checkpointed)
    return chosen


def checkpointed_blocks(model: nn.Module, mode: str) -> list[int]:
    """The positions of the blocks :func:`checkpoint_blocks` would checkpoint (changes nothing).

    Raises:
      ValueError: an unknown mode, a model without blocks, or blocks whose forward updates buffers (BatchNorm's
        running statistics would be updated twice per step).

    >>> from fxtrain.models import MLP, TransformerLM
    >>> checkpointed_blocks(TransformerLM(vocab_size=16, context=8, d_model=8, n_layers=4, n_heads=2), "selective")
    [1, 3]
    >>> checkpointed_blocks(MLP((4,)), "full")
    Traceback (most recent call last):
    ...
    ValueError: model.activation_checkpoint=full: MLP has no blocks to checkpoint (a `blocks` container of repeated layers, as model=transformer has); use model.activation_checkpoint=none
    """
    if mode not in AC_MODES:
        raise ValueError(f"model.activation_checkpoint={mode}: expected one of {', '.join(AC_MODES)}")
    if mode == "none":
        return []
    blocks = blocks_of(model)
    name = type(model).__name__
    if not blocks:
        raise ValueError(f"model.activation_checkpoint={mode}: {name} has no blocks to checkpoint (a `blocks` "
                         "container of repeated layers, as model=transformer has); use "
                         "model.activation_checkpoint=none")
    if any(True for block in blocks for _ in block.buffers()):
        raise ValueError(f"model.activation_checkpoint={mode}: {name}'s blocks hold buffers (running statistics), "
                         "which recomputing a block would update twice per step; use model.activation_checkpoint=none")
    # selective: torchtitan's layer-wise option at frequency 2, its counter from 1: the 2nd, 4th... block
    return [i for i in range(len(blocks)) if mode == "full" or i % 2 == 1]


def compile_blocks(model: nn.Module, **options: Any) -> int:
    """``torch.compile`` of each of ``model``'s blocks (the whole model's forward when it has none), in place;
    returns how many forwards were compiled. ``options`` go to ``torch.compile`` (default ``fullgraph=True``,
    as torchtitan: a graph break is an error, not a silent slow path).

    The first call of each new input shape, grad mode or dtype compiles (seconds on a CPU); the blocks share the
    compiled code. Apply it after :func:`checkpoint_blocks`: a checkpointed block is compiled with its checkpoint
    inside the graph (torch's compiled activation checkpointing, as torchtitan's AC then compile).

    >>> import torch
    >>> from fxtrain.models import MLP
    >>> mlp = MLP((4,), (8,), 2)
    >>> compile_blocks(mlp)
    1
    """
    options = {"fullgraph": True, **options}
    refused = compile_refusal(model)
    if refused:
        raise ValueError(refused)
    targets = blocks_of(model) or [model]
    for module in targets:
        _wrap(module, "compile", lambda module, forward: torch.compile(forward, **options))
    return len(targets)


def _checkpointed_original(module: nn.Module) -> Callable:
    """A checkpointed block's own forward, checkpointed inside what is compiled: dynamo traces
    ``torch.utils.checkpoint`` as one region whose backward recomputes from the graph's inputs (the tensors the
    forward ran with), so the eager re-run with them put back is not needed; it also keeps torch from handing the
    eager checkpoint a compiled DTensor block's saved ``DeviceMesh``, which it cannot hold (tensor parallel,
    torch 2.13: an AssertionError in AOT autograd)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.__dict__["_fx_forward"]

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed


def compile_refusal(model: nn.Module) -> str | None:
    """Why :func:`compile_blocks` refuses ``model`` (one line naming the layer), or ``None``: a submodule whose class
    declares a ``compile_refusal`` (:class:`fxtrain.models.MoE`'s host read of its token counts).

    >>> from fxtrain.models import TransformerLM
    >>> compile_refusal(TransformerLM(vocab_size=16, context=8, d_model=8, n_layers=1, n_heads=2)) is None
    True
    >>> print(compile_refusal(TransformerLM(vocab_size=16, context=8, d_model=8, n_layers=1, n_heads=2, experts=2)))
    trainer.compile=true: TransformerLM's blocks.0.mlp (MoE): each call reads its per-expert token counts on the host ...; use trainer.compile=false
    """
    for name, module in model.named_modules():
        why = getattr(type(module), "compile_refusal", None)
        if isinstance(why, str):
            return (f"trainer.compile=true: {type(model).__name__}'s {name} ({type(module).__name__}): {why}; "
                    "use trainer.compile=false")
    return None


def wrapped_note(model: nn.Module) -> str:
    """What :func:`checkpoint_blocks` and :func:`compile_blocks` did to ``model`` (for the run's ``model`` line), or
    ``""``.

    >>> from fxtrain.models import TransformerLM
    >>> lm = TransformerLM(vocab_size=16, context=8, d_model=8, n_layers=4, n_heads=2)
    >>> _ = checkpoint_blocks(lm, "selective"); wrapped_note(lm)
    ', 2 of 4 blocks checkpointed'
    """
    units = blocks_of(model) or [model]
    counts = {what: sum(what in m.__dict__.get("_fx_wrapped", ()) for m in units)
              for what in ("activation_checkpoint", "compile")}
    said = []
    if counts["activation_checkpoint"]:
        said.append(f"{counts['activation_checkpoint']} of {len(units)} blocks checkpointed")
    if counts["compile"]:
        n = counts["compile"]
        said.append(f"{n} {'forward' if units[0] is model else 'block' if n == 1 else 'blocks'} compiled")
    return "".join(f", {x}" for x in said)


def _wrap(module: nn.Module, what: str, wrapper: Callable[[nn.Module, Callable], Callable]) -> None:
    """``module.forward`` replaced on the instance by ``wrapper(module, forward)``; the wrappers it already has are
    kept in its ``_fx_wrapped`` list (each applied once: a second application of the same one is refused)."""
    done = module.__dict__.setdefault("_fx_wrapped", [])
    if what in done:
        raise ValueError(f"{type(module).__name__}: {what} is applied to this module already")
    if "compile" in done:
        raise ValueError(f"{type(module).__name__}: apply {what} before compile")
    module.__dict__.setdefault("_fx_forward", module.forward)  # the module's own forward, before any wrapper
    # Compiling a checkpointed block compiles the checkpoint with it (_checkpointed_original), not the eager one.
    inner = _checkpointed_original(module) if what == "compile" and "activation_checkpoint" in done else module.forward
    module.forward = wrapper(module, inner)
    done.append(what)


def _checkpointed(block: nn.Module, forward: Callable) -> Callable:
    from torch.utils.checkpoint import checkpoint

    def run(tensors: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        # The forward pass finds these tensors in the block; the recomputation in the backward pass may not
        # (fx.functional's tree was swapped out when functional_call returned, amp's cast copies too): it puts
        # them back for the re-run, so the recomputed activations are the forward's own, bit for bit.
        now = dict(_tensors(block))
        if all(now.get(k) is v for k, v in tensors.items()):
            return forward(*args, **kwargs)
        with torch.nn.utils.stateless._reparametrize_module(block, tensors):
            return forward(*args, **kwargs)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward pass anyway
            return forward(*args, **kwargs)
        return checkpoint(run, dict(_tensors(block)), *args, use_reentrant=False, **kwargs)

    return checkpointed


def _tensors(module: nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()
