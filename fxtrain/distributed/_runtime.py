"""Process runtime: joining torchrun's world, the device, one run stamp, batch slices and metric averages."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

__all__ = ["init_from_env", "rank_and_world", "shared_stamp", "gather_objects", "world_mesh", "device",
           "mean_across_ranks", "shutdown"]


def init_from_env() -> tuple[int, int]:
    """Joins the process group torchrun describes (``WORLD_SIZE`` > 1); returns ``(rank, world_size)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # gloo for CPU tensors always; NCCL for CUDA tensors when this build has it.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        hazard = _restart_hazard(os.environ)
        if hazard and os.environ.get("RANK", "0") == "0":  # said at the start: the restart comes after a failure
            logging.getLogger("fxtrain").warning(f"warning: {hazard}")
        dist.init_process_group(backend=backend)
    return rank_and_world()


def _restart_hazard(env: Mapping[str, str]) -> str | None:
    """Why a restart of this torchrun group would fail, or ``None``.

    torchrun (torch 2.13) keeps the store it shares with its workers (``TORCHELASTIC_USE_AGENT_STORE``) across
    the restarts of ``--max-restarts``: a restarted group finds the failed group's keys there, and its gloo ranks
    connect to the dead ranks' addresses, so the restart fails or hangs (pytorch/pytorch#135712).
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes a c10d rendezvous (``--standalone`` included) give every
    start a store of its own; a static one (``--master-addr``/``--master-port``) always shares its store.

    >>> _restart_hazard({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}).split(":")[0]
    'torchrun --max-restarts=1 shares its store with every start of the group'
    >>> _restart_hazard({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    True
    """
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts == "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (f"torchrun --max-restarts={restarts} shares its store with every start of the group: a restarted group "
            "reads the failed one's addresses there and fails or hangs (pytorch/pytorch#135712). Launch torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and a c10d rendezvous (--standalone, or --rdzv-backend=c10d) "
            "to give every start its own")


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


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (``[obj]`` without a process group): the
    runner records each rank's data-stream position in a checkpoint with it."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def world_mesh(device_type: str, name: str | None = None):
    """A 1-D ``DeviceMesh`` over all ranks (its repr names the ranks, unlike a process group's).

    ``name`` names its one dim (``"dp"``: what ``sharded_apply(..., shard_over="dp")`` looks for).
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=(name,) if name else None)


def device(name: str) -> torch.device:
    """``auto``: this rank's CUDA device when there is one, else CPU; anything else as ``torch.device``."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(name)


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
