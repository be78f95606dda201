"""One mesh object for a run: the sizes of its parallel dims, the ``DeviceMesh`` built from them once, and
which slice of each batch this rank reads (torchtitan's ``ParallelDims``).

The runner builds it from ``cfg.parallel`` and hands it to whoever needs a mesh: the data (its slice), the
model (plans, sharding), the stack (``sharded_apply(shard_over="dp")``) and checkpoints. Nothing else
makes a mesh, and no module finds one by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["ParallelDims", "STRATEGIES"]

# The mesh dims each strategy uses, in mesh order (pipeline outermost, tensor parallel innermost: its
# collectives are the most frequent and want the closest ranks). A dim of size 1 is still a mesh dim when
# the strategy names it, so plans and sharding find it; ``dp`` of size 1 is dropped where nothing needs it.
STRATEGIES: dict[str, tuple[str, ...]] = {
    "none": (),
    "dp": ("dp",),            # replicated params, each rank its slice of the batch
    "fsdp": ("dp",),          # FSDP2 fully_shard over dp
    "tp": ("dp", "tp"),       # parallelize_module on tp; dp x tp with dp > 1
    "fsdp_tp": ("dp", "tp"),  # parallelize_module on tp, fully_shard on dp
    "pp": ("pp", "dp"),       # pipeline stages over pp (dp > 1: each stage fully_shard-ed over dp)
    "ep": ("dp", "ep"),       # experts sharded over ep, dense params replicated over dp x ep
}
_DATA_DIMS = ("dp", "ep")  # ranks along these read different slices of a batch; tp and pp ranks the same one


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """The sizes of a run's parallel dims, checked against the world size; :meth:`build` makes the mesh.

    Args:
      strategy: a key of :data:`STRATEGIES`.
      world: the number of processes.
      sizes: ``{dim: size}`` for the strategy's dims; ``-1`` (one dim at most) is the rest of the world.

    Example:
        >>> dims = ParallelDims.of("tp", world=4, dp=-1, tp=2)
        >>> dims.sizes, dims.data_world
        ({'dp': 2, 'tp': 2}, 2)
        >>> ParallelDims.of("tp", world=4, dp=3, tp=2)
        Traceback (most recent call last):
        ...
        ValueError: dp=3 x tp=2 = 6 ranks, but the world has 4: make the product 4 (dp=-1 takes the rest)
    """

    strategy: str
    world: int
    sizes: dict
    mesh: Any = None

    @staticmethod
    def of(strategy: str, *, world: int, **sizes: int) -> ParallelDims:
        """Resolves ``-1`` and checks the product; dims the strategy does not use must be 1 (or absent)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
        dims = STRATEGIES[strategy]
        for name, size in sizes.items():
            if name not in dims and size not in (1, -1, None):
                raise ValueError(f"{name}={size}: strategy {strategy} has no {name} dim (its dims: "
                                 f"{', '.join(dims) or 'none'}); leave it at 1")
        given = {d: int(sizes[d]) if sizes.get(d) is not None else 1 for d in dims}
        free = [d for d, s in given.items() if s == -1]
        if len(free) > 1:
            raise ValueError(f"{' and '.join(f'{d}=-1' for d in free)}: only one dim can take the rest of the world")
        if any(s < 1 and s != -1 for s in given.values()):
            bad = next(d for d, s in given.items() if s < 1 and s != -1)
            raise ValueError(f"{bad}={given[bad]}: expected a positive size, or -1 for the rest of the world")
        fixed = math.prod(s for s in given.values() if s != -1)
        if free:
            if world % fixed:
                raise ValueError(f"{' x '.join(f'{d}={s}' for d, s in given.items() if s != -1)} = {fixed} ranks "
                                 f"does not divide the world of {world}: pick sizes whose product divides it")
            given[free[0]] = world // fixed
        total = math.prod(given.values())
        if total != world:
            shown = " x ".join(f"{d}={s}" for d, s in given.items())
            raise ValueError(f"{shown} = {total} ranks, but the world has {world}: make the product {world} "
                             f"({dims[0] if dims else 'dp'}=-1 takes the rest)")
        return ParallelDims(strategy, world, given)

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The dims of the mesh :meth:`build` makes: the strategy's, minus a ``dp`` of size 1 where nothing
        needs it (``tp`` with ``dp=1`` is a 1-D tp mesh, as ``parallelize_module`` wants)."""
        if self.strategy in ("dp", "fsdp", "fsdp_tp"):  # their dp dim is what they shard or replicate over
            return tuple(self.sizes)
        return tuple(d for d, s in self.sizes.items() if s > 1 or d != "dp")

    def build(self, device_type: str) -> ParallelDims:
        """This object with its ``DeviceMesh`` (``None`` for ``strategy=none``); every rank calls it once."""
        if not self.mesh_dims:
            return self
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(self.sizes[d] for d in self.mesh_dims)
        return dataclasses.replace(self, mesh=init_device_mesh(device_type, shape, mesh_dim_names=self.mesh_dims))

    @property
    def data_world(self) -> int:
        """How many different slices a batch is cut into (the product of the data-parallel dims)."""
        return math.prod(s for d, s in self.sizes.items() if d in _DATA_DIMS)

    @property
    def data_rank(self) -> int:
        """Which slice this rank reads: its coordinate over the data-parallel dims (0 without a mesh)."""
        if self.mesh is None:
            return 0
        rank = 0
        for d in self.mesh_dims:
            if d in _DATA_DIMS:
                rank = rank * self.mesh.size(self.mesh_dims.index(d)) + self.mesh.get_local_rank(d)
        return rank

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
        """``parallel=tp [dp=2 x tp=2]`` for the run's first lines."""
        sizes = " x ".join(f"{d}={s}" for d, s in self.sizes.items())
        return f"parallel={self.strategy}" + (f" [{sizes}]" if sizes else "")
