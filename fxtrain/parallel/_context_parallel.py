"""Context parallel under the functional step: torch's ring attention over the sequence parts of a batch.

The ``cp`` ranks of a group use the same rows of a batch (:attr:`fxtrain.distributed.ParallelDims.data_peers`);
:func:`context_parallel` wraps a layout's step so that each runs it on its part of the sequence dim, inside
``torch.distributed.tensor.experimental.context_parallel``: torch shards the batch with its head-tail load
balancer (rank ``r`` of ``n`` holds chunks ``r`` and ``2n-1-r`` of ``2n``, so the causal mask costs every rank
alike), and its ring attention (``_templated_ring_attention``, k/v all-gathered or passed rank to rank:
``set_rotate_method``) computes every ``F.scaled_dot_product_attention`` of the model over the whole sequence,
forward and backward. The positions a ``TransformerLM`` embeds are those of this rank's tokens (the same
load-balanced shard of ``arange(T)``). The gradients of the parts meet in FSDP's reduce-scatter: the cp ranks
join the shard dim (:attr:`fxtrain.distributed.ParallelDims.fsdp_mesh`, torchtitan's ``dp_shard_cp``).

On CPU, SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu``, which torch 2.13's CP dispatch does not
list (it lists the CUDA flash, efficient and cuDNN kernels: "does not have a sharding strategy registered").
:func:`cpu_ring_attention` enters that kernel and its backward into the same dispatch table, run by torch's own
ring (its signature is the flash kernel's, less the CUDA-only outputs); nothing else is added.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["context_parallel", "context_parallel_refusal", "cpu_ring_attention"]

_SEQ = 2  # the sequence dim of SDPA's (B, heads, T, head_dim) inputs, which torch's ring attention shards


def context_parallel_refusal(model: nn.Module, cp: int, context: int | None = None) -> str | None:
    """Why ``model`` cannot train with ``parallel.cp=cp``, in one line naming the key to change, or ``None``.

    Context parallel splits the sequence that a causal attention reads: the model needs one (a ``pos``
    embedding of sequence positions and ``F.scaled_dot_product_attention``: :class:`fxtrain.models.TransformerLM`,
    dense or MoE), and torch's load balancer cuts each sequence into ``2 * cp`` equal chunks.

    Example:
        >>> from fxtrain.models import MLP, TransformerLM
        >>> context_parallel_refusal(MLP((4,), (8,), 2), 2)
        'parallel.cp=2: MLP has no sequence attention to split; use model=transformer (or model=moe), or parallel.cp=1'
        >>> context_parallel_refusal(TransformerLM(context=10, d_model=8, n_heads=2), 2, context=10)
        'parallel.cp=2: data.context=10 does not split into 2 * cp = 4 equal chunks (torch load-balances causal attention so); make it a multiple of 4'
        >>> context_parallel_refusal(TransformerLM(context=16, d_model=8, n_heads=2), 2, context=16) is None
        True
    """
    if cp <= 1:
        return None
    if not isinstance(getattr(model, "pos", None), nn.Embedding):
        return (f"parallel.cp={cp}: {type(model).__name__} has no sequence attention to split; use "
                "model=transformer (or model=moe), or parallel.cp=1")
    if context is not None and context % (2 * cp):
        return (f"parallel.cp={cp}: data.context={context} does not split into 2 * cp = {2 * cp} equal chunks (torch "
                f"load-balances causal attention so); make it a multiple of {2 * cp}")
    return None


def context_parallel(step: Callable, model: nn.Module, mesh: Any) -> Callable:
    """``step(params, opt_state, buffers, (x, y))`` run by each rank of the 1-D ``mesh`` (the cp ranks) on its
    load-balanced part of the sequence dim (dim 1 of ``x`` and ``y``), the model's attention ring-exchanged by
    torch's ``context_parallel``; ``model``'s ``pos`` embedding is given those tokens' positions.

    Args:
      step: a layout's step on whole sequences (FSDP's: the cp ranks reduce their gradients there).
      model: the model the step runs (its ``pos`` embedding gets the positions).
      mesh: the cp mesh (``dims.submesh("cp")``).

    Returns:
      The step on sequence parts: the same metrics, each the mean over this rank's tokens (every rank holds as
      many, so their mean over the ranks is one process's).

    Example (two ranks; not a doctest)::

        step = fx.parallel.context_parallel(fully_sharded_placed.step, model, dims.submesh("cp"))
        params, opt_state, buffers, metrics = step(params, opt_state, buffers, (x, y))   # x, y: (B, T)
    """
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

    cpu_ring_attention()
    positions: list[torch.Tensor] = []  # this rank's positions while a step runs; empty: evaluation, whole rows
    model.pos.register_forward_pre_hook(lambda module, args: (positions[0],) if positions else None, prepend=True)

    def step_cp(params, opt_state, buffers, batch):
        x, y = batch
        # torch shards its buffers in place (resize_): copies, so the data's own tensors keep their shape.
        x, y, at = x.clone(), y.clone(), torch.arange(x.shape[1], device=x.device)
        parts = {x, y, at}
        with torch_context_parallel(mesh, buffers=[x, y, at], buffer_seq_dims=[1, 1, 0], no_restore_buffers=parts):
            positions[:] = [at]
            try:
                return step(params, opt_state, buffers, (x, y))
            finally:
                positions.clear()

    return step_cp


def cpu_ring_attention() -> None:
    """Enters the CPU SDPA kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) into
    torch's context-parallel dispatch table, run by torch's ring attention as its CUDA flash kernel is; once.

    >>> cpu_ring_attention()
    >>> from torch.distributed.tensor.experimental._context_parallel import _attention
    >>> torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in _attention.custom_ops
    True
    """
    from torch.distributed.tensor.experimental._context_parallel import _attention

    aten = torch.ops.aten
    forward, backward = (aten._scaled_dot_product_flash_attention_for_cpu.default,
                         aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    _attention.custom_ops.setdefault(forward, _cpu_ring_handler)
    _attention.custom_ops.setdefault(backward, _cpu_ring_handler)


def _cpu_ring_handler(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """DTensor's handler for the CPU kernel under ``context_parallel``: its ``Shard(2)`` inputs' local parts
    through torch's ring (``_templated_ring_attention`` or its backward), the results ``Shard(2)`` again."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention

    aten = torch.ops.aten
    mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
    local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
    kwargs = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
    if op_call is aten._scaled_dot_product_flash_attention_for_cpu.default:
        kwargs.update(zip(("query", "key", "value", "dropout_p", "is_causal"), local))
        results = _attention._templated_ring_attention(mesh.get_group(), _SEQ, op_call, **kwargs)
    else:
        names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
        kwargs.update(zip(names, local))
        results = _attention._templated_ring_attention_backward(mesh.get_group(), _SEQ, op_call,
                                                                grad_out_name="grad_out", **kwargs)
    return tuple(DTensor.from_local(t, mesh, [Shard(_SEQ)], run_check=False) for t in results)
