"""One mesh object for a run: its parallel degrees, the ``DeviceMesh`` built from them once, and the answers
callers need from it (torchtitan's ``ParallelDims``).

A layout is a product of degrees, one per kind of parallelism, that equals the world size:

* ``dp_replicate``: replicas of the params; each reads its own slice of the batch.
* ``dp_shard``: FSDP ranks (params, gradients and optimizer state sharded); each reads its own slice. With
  ``dp_replicate`` too this is HSDP: sharded within a replica group, replicated across groups.
* ``ep``: expert-parallel ranks (an MoE layer's experts split over them); each reads its own slice.
* ``cp``: context-parallel ranks; they use the same slice, each its part of the sequence dim
  (:func:`fxtrain.parallel.context_parallel`), and FSDP shards over ``dp_shard x cp`` (torchtitan's).
* ``tp``: tensor-parallel ranks (Megatron's split of each block); they use the same slice.
* ``pp``: pipeline stages; they use the same slice (the first stage its inputs, the last its targets).

Ranks that use the same slice (cp, tp and pp peers: :attr:`ParallelDims.data_peers`) do not each read it: the first
of each group (:attr:`ParallelDims.reads_data`) reads it and hands it to the others
(:func:`fxtrain.distributed.broadcast_batch`).

The runner builds it from ``cfg.parallel`` and hands it to whoever needs a mesh: the data (:meth:`local_batch`),
the model (:mod:`fxtrain.parallel`), the stack (:attr:`norm_groups`, ``sharded_apply``) and checkpoints.
Nothing else makes a mesh, and no module compares layout names: they ask this object.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["ParallelDims", "DIMS"]

# The degrees in mesh order, outermost first: pipeline stages talk least (one send per micro-batch), tensor
# parallel most (every block), so tp gets the closest ranks (torchtitan's order). Context parallel ("cp")
# sits between ep and tp: its ranks use the same rows, each its part of the sequences.
DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
# Ranks along these read different slices of a batch; cp, tp and pp ranks read the same one.
_BATCH_DIMS = ("dp_replicate", "dp_shard", "ep")


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """A run's parallel degrees, checked against the world size; :meth:`build` makes the mesh.

    Args:
      world: the number of processes.
      degrees: ``{dim: size}`` for every dim of :data:`DIMS` (:meth:`of` fills and checks them).
      mesh: the ``DeviceMesh`` over the enabled dims (``None`` before :meth:`build`, or with none enabled).

    Example:
        >>> dims = ParallelDims.of(world=8, pp=2, dp_shard=-1, tp=2)
        >>> dims.mesh_dims, dims.data_world, dims.enabled("dp_replicate"), dims.params_sharded
        (('pp', 'dp_shard', 'tp'), 2, False, True)
        >>> dims.describe()
        'parallel pp=2 x dp_shard=2 x tp=2'
        >>> ParallelDims.of(world=4, dp_shard=3, tp=2)
        Traceback (most recent call last):
        ...
        ValueError: dp_shard=3 x tp=2 = 6 ranks, but the world has 4: make the product 4 (one degree -1 takes the rest)
    """

    world: int
    degrees: dict
    mesh: Any = None

    @staticmethod
    def of(*, world: int, **degrees: int | None) -> ParallelDims:
        """Resolves ``-1`` (one dim at most: the rest of the world) and checks that the product is ``world``;
        an absent or ``None`` degree is 1."""
        unknown = [d for d in degrees if d not in DIMS]
        if unknown:
            raise ValueError(f"{unknown[0]}: not a parallel degree; the degrees are {', '.join(DIMS)}")
        given = {d: 1 if degrees.get(d) is None else degrees[d] for d in DIMS}
        for d, s in given.items():
            if isinstance(s, bool) or not isinstance(s, int) or (s < 1 and s != -1):
                raise ValueError(f"{d}={s}: expected a positive whole number of ranks, or -1 for the rest of the world")
        free = [d for d, s in given.items() if s == -1]
        if len(free) > 1:
            raise ValueError(f"{' and '.join(f'{d}=-1' for d in free)}: only one degree can take the rest of the "
                             "world; give the others a size")
        fixed = math.prod(s for s in given.values() if s != -1)
        shown = " x ".join(f"{d}={s}" for d, s in given.items() if s not in (1, -1)) or "1"
        if free:
            if world % fixed:
                raise ValueError(f"{shown} = {fixed} ranks does not divide the world of {world}: pick degrees whose "
                                 "product divides it")
            given[free[0]] = world // fixed
        elif fixed != world:
            raise ValueError(f"{shown} = {fixed} ranks, but the world has {world}: make the product {world} "
                             "(one degree -1 takes the rest)")
        return ParallelDims(world, given)

    def enabled(self, dim: str) -> bool:
        """Whether ``dim`` splits the work (its degree is above 1)."""
        if dim not in self.degrees:
            raise ValueError(f"{dim}: not a parallel degree; the degrees are {', '.join(DIMS)}")
        return self.degrees[dim] > 1

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The dims of the mesh :meth:`build` makes: the enabled ones, in :data:`DIMS` order."""
        return tuple(d for d in DIMS if self.enabled(d))

    @property
    def params_sharded(self) -> bool:
        """Whether FSDP shards the params: ``dp_shard > 1``, ``cp > 1`` (the cp ranks join the shard dim), or ``ep``
        with ``tp`` or ``pp`` (the dense params over the ep ranks, torchtitan's EP x TP / PP; experts on their own
        ``ep`` dim either way)."""
        return (self.enabled("dp_shard") or self.enabled("cp")
                or (self.enabled("ep") and (self.enabled("tp") or self.enabled("pp"))))

    @property
    def data_world(self) -> int:
        """How many different slices a batch is cut into (the product of the batch-reading degrees)."""
        return math.prod(self.degrees[d] for d in _BATCH_DIMS)

    def build(self, device_type: str) -> ParallelDims:
        """This object with its ``DeviceMesh`` (``None`` with no dim enabled); every rank calls it once."""
        if not self.mesh_dims:
            return self
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(self.degrees[d] for d in self.mesh_dims)
        return dataclasses.replace(self, mesh=init_device_mesh(device_type, shape, mesh_dim_names=self.mesh_dims))

    def submesh(self, *dims: str) -> Any:
        """The mesh over ``dims`` (enabled ones, in mesh order): ``submesh("dp_shard")`` is FSDP's,
        ``submesh("dp_replicate", "dp_shard")`` HSDP's 2-D one. Needs :meth:`build`."""
        if self.mesh is None:
            raise ValueError(f"ParallelDims.submesh{dims}: the mesh is not built (call build(device_type) first)")
        off = [d for d in dims if not self.enabled(d)]
        if off:
            raise ValueError(f"ParallelDims.submesh: {', '.join(off)} is not enabled in {self.describe()}")
        names = tuple(d for d in self.mesh_dims if d in dims)
        return self.mesh if names == self.mesh_dims else self.mesh[names if len(names) > 1 else names[0]]

    @property
    def fsdp_mesh(self) -> Any:
        """The mesh ``fully_shard`` takes: ``dp_shard``'s, or ``(dp_replicate, dp_shard)`` for HSDP; with ``cp``
        its ranks join the shard dim (torchtitan's flattened ``dp_shard_cp``): the cp peers of a sequence hold
        the gradients of its parts, which FSDP's reduce-scatter averages with the data ranks'."""
        shard = tuple(d for d in ("dp_shard", "cp") if self.enabled(d))
        if len(shard) == 2:
            flat = self.submesh(*shard)._flatten("dp_shard_cp")  # the same one on every call (torch keeps it)
            if not self.enabled("dp_replicate"):
                return flat
            return type(flat)._concatenate([self.submesh("dp_replicate"), flat])
        return self.submesh(*(d for d in ("dp_replicate", *shard) if self.enabled(d)))

    @property
    def norm_groups(self) -> tuple:
        """The meshes a global norm must also sum over: the pipeline's (each stage holds other params as plain
        tensors or DTensors of its own mesh); the other dims' params are DTensors, which carry their mesh."""
        return (self.submesh("pp"),) if self.enabled("pp") else ()

    @property
    def data_rank(self) -> int:
        """Which slice this rank reads: its coordinate over the batch-reading dims (0 without a mesh)."""
        if self.mesh is None:
            return 0
        rank = 0
        for d in self.mesh_dims:
            if d in _BATCH_DIMS:
                rank = rank * self.degrees[d] + self.mesh.get_local_rank(d)
        return rank

    @property
    def data_peers(self) -> tuple[str, ...]:
        """The enabled dims whose ranks use the same slice of a batch (``cp``, ``tp``, ``pp``), in mesh order."""
        return tuple(d for d in self.mesh_dims if d not in _BATCH_DIMS)

    @property
    def reads_data(self) -> bool:
        """Whether this rank reads its slice of a batch (the first rank of its group of :attr:`data_peers`) rather
        than receiving it from that rank; a rank without peers (or without a mesh) reads.

        >>> ParallelDims.of(world=1).reads_data
        True
        """
        return self.mesh is None or all(self.mesh.get_local_rank(d) == 0 for d in self.data_peers)

    def local_batch(self, batch: tuple) -> tuple:
        """This rank's contiguous slice of every tensor in a global batch (the batch itself for one slice)."""
        n = self.data_world
        if n == 1:
            return batch
        size = len(batch[0])
        if size % n:
            raise ValueError(f"a batch of {size} does not split evenly over {n} data-parallel ranks")
        return tuple(x.tensor_split(n)[self.data_rank] for x in batch)

    def describe(self) -> str:
        """``parallel pp=2 x dp_shard=2 x tp=2`` (or ``parallel=none``) for the run's first lines and run.json."""
        shown = " x ".join(f"{d}={self.degrees[d]}" for d in self.mesh_dims)
        return f"parallel {shown}" if shown else "parallel=none"
