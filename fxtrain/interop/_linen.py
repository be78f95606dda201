"""Flax linen naming and layout: ``to_linen``, ``from_linen``, ``linen_names``.

A pure tree conversion between the flat params of a torch module (``fx.functional``'s ``params``, keyed
like ``named_parameters()``: ``net.1.weight``) and the variables a ``flax.linen`` module with the same
layers would have (``{"params": {"Dense_0": {"kernel": ...}}}``). Flax itself is not needed (nor
imported): the result is a plain nested dict that ``flax.linen.Module.apply`` accepts.

Layouts (torch -> linen):

=====================  ===================  ====================================================
torch                  linen                parameters
=====================  ===================  ====================================================
``nn.Linear``          ``Dense``            ``weight (out, in)`` -> ``kernel (in, out)``; ``bias``
``nn.Conv1d/2d/3d``    ``Conv``             ``weight (O, I, *spatial)`` (OIHW) -> ``kernel (*spatial, I, O)``
                                            (HWIO); ``bias``. Inputs are NHWC in Flax, NCHW in torch.
``nn.LayerNorm``       ``LayerNorm``        ``weight`` -> ``scale``; ``bias``. Flax's default epsilon is
                                            1e-6, torch's 1e-5: pass ``epsilon=1e-5`` for equal outputs.
``nn.GroupNorm``       ``GroupNorm``        ``weight`` -> ``scale``; ``bias``
``nn.RMSNorm``         ``RMSNorm``          ``weight`` -> ``scale``
``nn.BatchNorm1d/2d``  ``BatchNorm``        ``weight`` -> ``scale``; ``bias``; with ``buffers``:
                                            ``running_mean/var`` -> ``batch_stats`` ``mean/var``
``nn.Embedding``       ``Embed``            ``weight`` -> ``embedding`` (same layout)
``nn.Multihead-        ``MultiHeadDot-      ``in_proj_weight (3E, E)`` -> ``query/key/value`` ``kernel (E, H, D)``
Attention``            ProductAttention``   (``q/k/v_proj_weight`` likewise); ``in_proj_bias`` -> ``bias (H, D)``
                                            each; ``out_proj.weight (E, H*D)`` -> ``out/kernel (H, D, E)``;
                                            ``out_proj.bias`` -> ``out/bias``. Flax is batch-first: use
                                            ``batch_first=True`` in torch. ``add_bias_kv`` has no counterpart.
=====================  ===================  ====================================================

Naming. ``naming="compact"`` (the default) gives the names of a ``@nn.compact`` Flax module that creates
the same layers in the same order: within each scope, layers are named ``{FlaxClass}_{i}``, counted per
class in definition order (``Dense_0``, ``Dense_1``, ``LayerNorm_0``); ``nn.Sequential``,
``nn.ModuleList`` and ``nn.ModuleDict`` are transparent (as a Python list of layers in a compact module);
a custom submodule opens a scope named ``{TorchClass}_{i}``. ``naming="attribute"`` gives the names of a
``setup``-style module whose attributes are named as in torch: ``blocks.0.attn.qkv`` ->
``blocks_0/attn/qkv`` (Flax names list entries ``name_i``). Parameters of other modules (an
``nn.Parameter`` held by a custom module) keep their attribute name in their scope, as ``self.param``.
Tied parameters appear once, under their first name (as in :func:`fxtrain.functional`).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from fxtrain.interop._arrays import owned, tensor_to_jax, to_torch

__all__ = ["to_linen", "from_linen", "linen_names"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.t()


def _conv_to_linen(w: torch.Tensor) -> torch.Tensor:  # (O, I, *k) -> (*k, I, O)
    return w.permute(*range(2, w.dim()), 1, 0)


def _conv_from_linen(k: torch.Tensor) -> torch.Tensor:  # (*k, I, O) -> (O, I, *k)
    n = k.dim()
    return k.permute(n - 1, n - 2, *range(n - 2))


class Leaf(NamedTuple):
    """Where one torch parameter lives in the linen variables, and how its layout changes.

    ``split`` lists the paths of a torch tensor that Flax keeps as several leaves (attention's
    ``in_proj_weight``: ``query``, ``key``, ``value``): the tensor is cut in ``len(split)`` equal chunks
    along dim 0, and ``to_linen``/``from_linen`` convert each chunk; ``path`` is then ``split[0]``.
    """

    path: tuple[str, ...]  # e.g. ("params", "Dense_0", "kernel")
    to_linen: Callable[[torch.Tensor], torch.Tensor] | None  # None: same layout
    from_linen: Callable[[torch.Tensor], torch.Tensor] | None
    split: tuple[tuple[str, ...], ...] = ()

    @property
    def paths(self) -> tuple[tuple[str, ...], ...]:
        return self.split or (self.path,)


_NORM = {"weight": ("scale", None), "bias": ("bias", None)}
_LAYERS: list[tuple[type, str, dict]] = [  # torch class, Flax class, {torch name: (linen name, layout)}
    (nn.Linear, "Dense", {"weight": ("kernel", (_transpose, _transpose)), "bias": ("bias", None)}),
    (nn.modules.conv._ConvNd, "Conv", {"weight": ("kernel", (_conv_to_linen, _conv_from_linen)),
                                       "bias": ("bias", None)}),
    (nn.LayerNorm, "LayerNorm", _NORM),
    (nn.GroupNorm, "GroupNorm", _NORM),
    (nn.RMSNorm, "RMSNorm", _NORM),
    (nn.modules.batchnorm._BatchNorm, "BatchNorm", _NORM),
    (nn.Embedding, "Embed", {"weight": ("embedding", None)}),
]
_BATCH_STATS = {"running_mean": "mean", "running_var": "var"}


def _heads(heads: int, head_major: bool) -> tuple[Callable, Callable]:
    """Layouts of an attention projection: torch ``(H*D, in)`` <-> Flax ``(in, H, D)`` (a projection in)
    or torch ``(out, H*D)`` <-> Flax ``(H, D, out)`` (``head_major``: the output projection); the
    biases in ``(H*D,)`` <-> ``(H, D)``, the output's unchanged."""
    def to(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 1:
            return t if head_major else t.reshape(heads, -1)
        return t.t().reshape(heads, -1, t.shape[0]) if head_major else t.t().reshape(t.shape[1], heads, -1)

    def back(t: torch.Tensor) -> torch.Tensor:
        if t.dim() <= 2:  # a bias: (H, D) in, (out,) out
            return t.reshape(-1)
        return t.reshape(-1, t.shape[-1]).t() if head_major else t.reshape(t.shape[0], -1).t()

    return to, back


def _attention_leaves(m: nn.MultiheadAttention, full: str, scope: tuple) -> list[tuple[str, torch.Tensor, Leaf]]:
    """``nn.MultiheadAttention``'s parameters as Flax ``MultiHeadDotProductAttention``'s leaves."""
    if m.bias_k is not None or m.bias_v is not None:
        raise ValueError(f"to_linen: MultiheadAttention at '{full}' has add_bias_kv=True, which Flax's "
                         "MultiHeadDotProductAttention has no parameter for; use add_bias_kv=False")
    proj, out = _heads(m.num_heads, False), _heads(m.num_heads, True)
    qkv = tuple(("params", *scope, n) for n in ("query", "key", "value"))
    leaves = []
    for pname, p in m.named_parameters():
        if pname in ("in_proj_weight", "in_proj_bias"):
            kind = "kernel" if pname.endswith("weight") else "bias"
            split = tuple((*path, kind) for path in qkv)
            leaves.append((pname, p, Leaf(split[0], *proj, split)))
        elif pname in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            leaves.append((pname, p, Leaf(("params", *scope, {"q": "query", "k": "key", "v": "value"}[pname[0]],
                                           "kernel"), *proj)))
        else:  # out_proj.weight, out_proj.bias
            leaves.append((pname, p, Leaf(("params", *scope, "out", "kernel" if pname.endswith("weight")
                                           else "bias"), *out)))
    return leaves


def _layer(m: nn.Module) -> tuple[str, dict] | None:
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        return None  # Flax's ConvTranspose has its own kernel layout: not mapped (named in the error)
    for cls, flax_name, names in _LAYERS:
        if isinstance(m, cls):
            return flax_name, names
    if isinstance(m, nn.MultiheadAttention):
        return "MultiHeadDotProductAttention", {}
    return None


def linen_names(module: nn.Module, *, naming: str = "compact", buffers: bool = False) -> dict[str, Leaf]:
    """Where each parameter of ``module`` goes in the Flax linen variables, in ``named_parameters()`` order.

    Args:
      module: the torch module.
      naming: ``"compact"`` (``Dense_0``...), ``"attribute"`` (``blocks_0/attn/qkv``), see the module
        docstring, or ``"nnx"``: the paths of ``nnx.state`` of a Flax NNX module whose attributes are
        named as in torch (``blocks/0/attn/qkv``, list entries as ``int``), after the collection.
      buffers: also map BatchNorm's running statistics to the ``batch_stats`` collection.

    Returns:
      ``{torch name: Leaf(path, to_linen, from_linen)}``, e.g. ``{"net.1.weight": Leaf(("params",
      "Dense_0", "kernel"), ...)}``.

    Raises:
      ValueError: ``naming`` is unknown, or a layer holds parameters with no known linen layout
        (``nn.ConvTranspose2d``, ``nn.MultiheadAttention``...), named by its path.

    Example:
        >>> import torch
        >>> from fxtrain.interop import linen_names
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> {k: "/".join(v.path) for k, v in linen_names(net).items()}
        {'0.weight': 'params/Dense_0/kernel', '0.bias': 'params/Dense_0/bias', '2.weight': 'params/Dense_1/kernel', '2.bias': 'params/Dense_1/bias'}
    """
    if naming not in ("compact", "attribute", "nnx"):
        raise ValueError(f"linen_names: naming={naming!r} must be 'compact', 'attribute' or 'nnx'")
    out: dict[str, Leaf] = {}
    seen: set[int] = set()

    def add(name: str, t: torch.Tensor, path: tuple, layout: tuple | None) -> None:
        if id(t) in seen:
            return  # tied: the first name holds it
        seen.add(id(t))
        out[name] = path if isinstance(path, Leaf) else Leaf(path, *(layout or (None, None)))

    def visit(mod: nn.Module, prefix: str, scope: tuple, counters: collections.Counter) -> None:
        for pname, p in mod.named_parameters(recurse=False):
            add(prefix + pname, p, ("params", *scope, pname), None)
        for cname, child in mod.named_children():
            full = prefix + cname
            if isinstance(child, _CONTAINERS):
                visit(child, full + ".", scope, counters)  # no scope of its own (attribute: name_i)
                continue
            layer = _layer(child)
            if layer is None and not any(True for _ in child.parameters()):
                continue  # activations, dropout, parameter-free modules
            if layer is None and _is_unmapped_layer(child):
                raise ValueError(f"to_linen: no Flax linen layout for {type(child).__name__} at '{full}'; "
                                 f"supported: {', '.join(c.__name__ for c, _, _ in _LAYERS)}")
            if naming == "compact":
                flax_cls = layer[0] if layer else type(child).__name__
                child_scope = scope + (f"{flax_cls}_{counters[flax_cls]}",)
                counters[flax_cls] += 1
            elif naming == "nnx":  # nnx.state's paths: attributes as in torch, list entries as ints
                child_scope = tuple(int(part) if part.isdigit() else part for part in full.split("."))
            else:
                child_scope = _attribute_scope(full)
            if layer is None:
                visit(child, full + ".", child_scope, collections.Counter())
                continue
            flax_cls, names = layer
            if isinstance(child, nn.MultiheadAttention):
                for pname, p, leaf in _attention_leaves(child, full, child_scope):
                    add(f"{full}.{pname}", p, leaf, None)
                continue
            for pname, p in child.named_parameters(recurse=False):
                lname, layout = names.get(pname, (pname, None))
                add(f"{full}.{pname}", p, ("params", *child_scope, lname), layout)
            if buffers and flax_cls == "BatchNorm":
                for bname, b in child.named_buffers(recurse=False):
                    if bname in _BATCH_STATS:
                        add(f"{full}.{bname}", b, ("batch_stats", *child_scope, _BATCH_STATS[bname]), None)

    root = _layer(module)
    if isinstance(module, nn.MultiheadAttention):
        for pname, p, leaf in _attention_leaves(module, type(module).__name__, ()):
            add(pname, p, leaf, None)
        return out
    if root is not None:  # the module is itself one layer: a lone flax Dense has {"kernel", "bias"}
        for pname, p in module.named_parameters(recurse=False):
            lname, layout = root[1].get(pname, (pname, None))
            add(pname, p, ("params", lname), layout)
        if buffers and root[0] == "BatchNorm":
            for bname, b in module.named_buffers(recurse=False):
                if bname in _BATCH_STATS:
                    add(bname, b, ("batch_stats", _BATCH_STATS[bname]), None)
        return out
    visit(module, "", (), collections.Counter())
    return out


def _attribute_scope(dotted: str) -> tuple[str, ...]:
    """``blocks.0.attn.qkv`` -> ``("blocks_0", "attn", "qkv")``; a leading index is ``layers_i``
    (``flax.linen.Sequential``'s names)."""
    scope: list[str] = []
    for part in dotted.split("."):
        if part.isdigit():
            scope.append(f"{scope.pop()}_{part}" if scope else f"layers_{part}")
        else:
            scope.append(part)
    return tuple(scope)


def _is_unmapped_layer(m: nn.Module) -> bool:
    """A built-in torch layer holding parameters directly, with a layout this module does not know."""
    return type(m).__module__.startswith("torch.nn") and any(True for _ in m.parameters(recurse=False))


def to_linen(params: dict[str, Any], module: nn.Module, *, naming: str = "compact",
             buffers: dict[str, Any] | None = None, as_jax: bool = True) -> dict:
    """The params of a torch module as Flax linen variables: Flax names, Flax layouts.

    Args:
      params: ``{name: tensor}`` keyed like ``module.named_parameters()`` (``fx.functional``'s
        ``params``, or the parameter entries of a ``state_dict``). ``None`` values are skipped.
      module: the module the params belong to (read for its layer types and order only).
      naming: ``"compact"`` or ``"attribute"`` (see the module docstring).
      buffers: ``fx.functional``'s ``buffers``; BatchNorm running statistics then fill ``batch_stats``.
      as_jax: leaves as ``jax.Array`` (through DLPack: no copy where the layout is unchanged; transposed
        kernels are one copy). ``False`` keeps torch tensors (no JAX needed).

    Returns:
      ``{"params": {...}}`` (and ``"batch_stats"`` with ``buffers``), nested dicts as Flax has them.

    Raises:
      ValueError: a key of ``params`` is not a parameter of ``module``, or a layer has no linen layout.

    Example:
        >>> import torch
        >>> from fxtrain.interop import to_linen
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> v = to_linen(dict(net.named_parameters()), net, as_jax=False)
        >>> {k: tuple(x.shape) for k, x in v["params"]["Dense_0"].items()}   # kernel is (in, out)
        {'kernel': (4, 8), 'bias': (8,)}
    """
    where = linen_names(module, naming=naming, buffers=buffers is not None)
    out: dict = {}
    for what, tensors in (("params", params), ("buffers", buffers or {})):
        for name, t in tensors.items():
            if t is None:
                continue
            leaf = where.get(name)
            if leaf is None:
                if what == "buffers":
                    continue  # BatchNorm's num_batches_tracked and other buffers Flax does not keep
                raise ValueError(f"to_linen: '{name}' is not a parameter of {type(module).__name__} "
                                 f"(or is tied to an earlier one); its parameters are {', '.join(where)}")
            t = t.detach()
            for path, part in zip(leaf.paths, t.chunk(len(leaf.paths)) if leaf.split else (t,)):
                if leaf.to_linen is not None:
                    part = leaf.to_linen(part).contiguous()
                node = out
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = tensor_to_jax(part, where=name) if as_jax else part
    return out


def from_linen(variables: dict, module: nn.Module, *, naming: str = "compact",
               copy: bool = True) -> dict[str, torch.Tensor]:
    """Flax linen variables as the params of a torch module: the inverse of :func:`to_linen`.

    Args:
      variables: ``{"params": {...}}`` as ``flax.linen.Module.init`` returns (a ``FrozenDict`` works),
        or the ``params`` collection alone; leaves may be JAX arrays (read through DLPack) or tensors.
      module: the torch module whose params to produce.
      naming: the naming used (see the module docstring).
      copy: every tensor in memory torch owns (the default): a donated step may then train them in place
        while the JAX arrays stay as they were. ``False`` shares the memory of the arrays whose layout is
        unchanged (DLPack, no copy); a donated step refuses those (see :mod:`fxtrain.interop._arrays`).

    Returns:
      ``{name: tensor}`` in ``module.named_parameters()`` order, torch layouts, contiguous: ready for
      :func:`fxtrain.functional`'s ``apply_fn`` or ``module.load_state_dict(..., strict=False)``.

    Raises:
      ValueError: a parameter is missing from ``variables`` or has the wrong shape (naming both paths),
        or ``variables`` holds params the module does not have.

    Example:
        >>> import torch
        >>> from fxtrain.interop import from_linen, to_linen
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.LayerNorm(2))
        >>> back = from_linen(to_linen(dict(net.named_parameters()), net, as_jax=False), net)
        >>> all(torch.equal(back[k], p) for k, p in net.named_parameters())
        True
    """
    tree = dict(variables)
    if "params" not in tree:
        tree = {"params": tree}
    where = linen_names(module, naming=naming)
    shapes = {k: tuple(p.shape) for k, p in module.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    used: set[tuple] = set()
    for name, leaf in where.items():
        parts = []
        for path in leaf.paths:
            node = tree
            for i, key in enumerate(path):
                if not hasattr(node, "keys") or key not in node:
                    raise ValueError(f"from_linen: '{name}' expects '{'/'.join(map(str, path))}', but the variables "
                                     f"have no '{'/'.join(map(str, path[:i + 1]))}'")
                node = node[key]
            used.add(path)
            t = to_torch(node, copy=False)  # shared here; copied below where the layout change has not
            parts.append(leaf.from_linen(t).contiguous() if leaf.from_linen is not None else t)
        t = torch.cat(parts) if leaf.split else parts[0]
        t = owned(t) if copy else t
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"from_linen: '{'/'.join(map(str, leaf.path))}' gives '{name}' the shape "
                             f"{tuple(t.shape)}, expected {shapes[name]}")
        out[name] = t
    extra = [p for p in _paths(tree.get("params", {}), ("params",)) if p not in used]
    if extra:
        raise ValueError(f"from_linen: '{'/'.join(map(str, extra[0]))}' is not a parameter of "
                         f"{type(module).__name__} (naming={naming!r})")
    return out


def _paths(node: Any, prefix: tuple) -> list[tuple]:
    if not hasattr(node, "keys"):
        return [prefix]
    return [p for k in node.keys() for p in _paths(node[k], prefix + (k,))]
