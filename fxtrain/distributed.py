"""Everything that talks to torch.distributed lives here (meshes and process groups passed explicitly).

Example:
    >>> import torch
    >>> from fxtrain.distributed import global_norm
    >>> float(global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0])]}))
    5.0
"""

from __future__ import annotations

from typing import Any

import torch

from fxtrain import tree


def global_norm(t: Any, *, groups: tuple = ()) -> torch.Tensor:
    """The L2 norm of the whole tree as a 0-dim float32 (or wider) tensor.

    Single-process version for now: DTensor leaves and ``groups`` are the subject of the distributed issue.
    """
    del groups
    return tree.norm(t)
