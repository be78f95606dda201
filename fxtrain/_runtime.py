"""Process runtime of the training script: torchrun ranks, the device, plain data parallelism.

Interim home of the few ``torch.distributed`` calls the Hydra runner needs (DESIGN: everything
distributed belongs in ``fxtrain/distributed.py``; these move there when that module grows them):
process-group setup from torchrun's environment, one shared run stamp, a gradient all-reduce
transform for ``parallel=dp`` on plain tensors, and metric averaging for logs.

Example:
    >>> from fxtrain import _runtime
    >>> _runtime.rank_and_world()          # not under torchrun
    (0, 1)
    >>> _runtime.local_batch(("x", "y"), rank=0, world=1)
    ('x', 'y')
"""

from __future__ import annotations

import datetime
import os
import torch
import torch.distributed as dist

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, transform

__all__ = ["init_from_env", "rank_and_world", "shared_stamp", "world_mesh", "device", "local_batch", "all_reduce_mean",
           "mean_across_ranks", "shutdown"]


def init_from_env() -> tuple[int, int]:
    """Joins the process group torchrun describes (``WORLD_SIZE`` > 1); returns ``(rank, world_size)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # gloo for CPU tensors always; NCCL for CUDA tensors when this build has it.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return rank_and_world()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shared_stamp() -> str:
    """A ``YYYY-MM-DD/HH-MM-SS`` stamp taken on rank 0 and given to every rank (one run directory for all)."""
    stamp = [datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    return stamp[0]


def world_mesh(device_type: str):
    """A 1-D ``DeviceMesh`` over all ranks (its repr names the ranks, unlike a process group's)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dist.get_world_size(),))


def device(name: str) -> torch.device:
    """``auto``: this rank's CUDA device when there is one, else CPU; anything else as ``torch.device``."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(name)


def local_batch(batch: tuple, rank: int, world: int) -> tuple:
    """This rank's contiguous 1/world slice of every tensor in a global batch (the batch itself for one rank)."""
    if world == 1:
        return batch
    n = len(batch[0])
    if n % world:
        raise ValueError(f"data.batch_size={n} does not split evenly over {world} ranks (parallel=dp)")
    return tuple(x.tensor_split(world)[rank] for x in batch)


@transform(elementwise=False)
def all_reduce_mean(world_size: int) -> GradientTransformation:
    """Averages the gradients across all ranks of the default process group (one all_reduce per update).

    Data parallelism on plain tensors: every rank computes the gradient of its share of the batch, and
    after this transform every rank holds the gradient of the whole batch (equal shares assumed).
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        leaves = tree.leaves(updates)
        if leaves:
            # One flat buffer, one collective: per-leaf all_reduces cost a round trip each.
            flat = torch.cat([g.reshape(-1) for g in leaves])
            dist.all_reduce(flat)
            flat.div_(world_size)
            chunks = flat.split([g.numel() for g in leaves])
            torch._foreach_copy_(leaves, [c.view_as(g) for c, g in zip(chunks, leaves)])
        return updates, state

    return GradientTransformation(init_fn, update_fn)


def mean_across_ranks(metrics: dict[str, float], world: int) -> dict[str, float]:
    """The average over ranks of each (float) metric; identical on every rank. For logs, not the hot path."""
    if world == 1 or not metrics:
        return metrics
    values = torch.tensor(list(metrics.values()), dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(metrics, (values / world).tolist()))


def shutdown() -> None:
    """Leaves the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
