"""safetensors files, the format Hugging Face models ship in: ``save_safetensors`` and ``load_safetensors``.

The names are the module's ``state_dict`` keys, which :func:`fxtrain.functional` uses for its trees, so a
params tree saved here is a ``model.safetensors`` that ``transformers``' ``from_pretrained`` loads for the
same config (with the config's ``config.json`` beside it), and a file ``save_pretrained`` wrote loads back
into the tree. Tied weights are stored once, as ``transformers`` does: ``fx.functional`` already keeps a
tied pair (GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) as one leaf under its first name,
and when a tree holds several names for one tensor (a ``state_dict``) only the first is written;
``from_pretrained`` ties the others back. ``safetensors`` is an optional dependency (in the ``dev`` extra),
imported when called.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Mapping

import torch

from fxtrain._deferred import DTensor

from fxtrain.interop._arrays import owned

__all__ = ["save_safetensors", "load_safetensors"]


def save_safetensors(path: str | os.PathLike, params: Mapping[str, torch.Tensor], *,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Writes a flat tree of tensors to a safetensors file, keyed by its names (``state_dict`` keys).

    Tensors that share storage (the same tensor under two names, as tied weights in a ``state_dict``) are
    written once, under the first name. Non-contiguous tensors are written as their contiguous copy;
    a DTensor as its full value (``full_tensor()``: every rank of its mesh must call). The file's metadata
    carries ``{"format": "pt"}``, which ``transformers`` reads, plus ``metadata``.

    Args:
      path: the file to write (``model.safetensors`` in a ``from_pretrained`` directory).
      params: a dict of name to tensor (``fx.functional``'s ``params``, or ``{**params, **buffers}``).
      metadata: extra string-to-string metadata for the file header.

    Raises:
      ImportError: safetensors is not installed (``pip install safetensors``).
      TypeError: ``params`` is not a flat dict of str to tensor; the error names the entry.

    Example:
        >>> import pytest, tempfile, os; _ = pytest.importorskip("safetensors")
        >>> import torch, fxtrain as fx
        >>> from fxtrain.interop import save_safetensors, load_safetensors
        >>> _, params, _ = fx.functional(torch.nn.Linear(3, 2))
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_safetensors(path, params)
        >>> back = load_safetensors(path, params)
        >>> sorted(back), torch.equal(back["weight"], params["weight"])
        (['bias', 'weight'], True)
    """
    st = _require("safetensors.torch", "fxtrain.interop.save_safetensors")
    if not isinstance(params, Mapping):
        raise TypeError(f"save_safetensors: params must be a dict of name to tensor, got {type(params).__name__}")
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in params.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"save_safetensors: entry {name!r} must be a str name and a tensor, got "
                            f"{type(t).__name__}; flatten nested trees to state_dict names first")
        if isinstance(t, DTensor):
            t = t.full_tensor()
        t = t.detach()
        alias = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and alias in seen:
            continue  # tied: the first name holds it
        seen.add(alias)
        out[name] = t.contiguous()
    st.save_file(out, os.fspath(path), metadata={"format": "pt", **dict(metadata or {})})


def load_safetensors(path: str | os.PathLike, like: Mapping[str, torch.Tensor], *,
                     strict: bool = True) -> dict[str, torch.Tensor]:
    """Reads a safetensors file into a new tree shaped like ``like`` (same names, dtypes and devices).

    Each entry of ``like`` is read from the file under its name, checked for shape, and cast to the
    entry's dtype and device (a bfloat16 checkpoint loads into float32 params). The result is a new
    dict; ``like`` is not written. Entries the file holds that ``like`` lacks are an error with
    ``strict`` (a tied name ``from_pretrained`` would tie back is never in a transformers file).

    Args:
      path: a safetensors file (``model.safetensors`` from ``save_pretrained`` or :func:`save_safetensors`).
      like: a dict of name to tensor, e.g. ``fx.functional``'s ``params``.
      strict: refuse names in the file that ``like`` does not have.

    Returns:
      A dict with ``like``'s names and the file's values, in memory torch owns (a donated step may train them).

    Raises:
      ImportError: safetensors is not installed.
      KeyError: a name of ``like`` is missing from the file, or (``strict``) the file has names ``like`` lacks.
      ValueError: a shape differs; the error names the entry.

    Example:
        >>> import pytest, tempfile, os; _ = pytest.importorskip("safetensors")
        >>> import torch
        >>> from fxtrain.interop import save_safetensors, load_safetensors
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> save_safetensors(path, {"w": torch.ones(2, dtype=torch.bfloat16)})
        >>> load_safetensors(path, {"w": torch.zeros(2)})["w"]   # cast to like's dtype
        tensor([1., 1.])
    """
    st = _require("safetensors", "fxtrain.interop.load_safetensors")
    out: dict[str, torch.Tensor] = {}
    with st.safe_open(os.fspath(path), framework="pt") as f:
        names = set(f.keys())
        missing = [k for k in like if k not in names]
        if missing:
            raise KeyError(f"load_safetensors: '{missing[0]}' is not in {os.fspath(path)} "
                           f"({len(missing)} names of like missing); the file has e.g. {sorted(names)[:3]}")
        extra = sorted(names - set(like))
        if strict and extra:
            raise KeyError(f"load_safetensors: {os.fspath(path)} has '{extra[0]}' ({len(extra)} names) that like "
                           "lacks; pass strict=False to ignore them")
        for name, ref in like.items():
            t = f.get_tensor(name)
            if tuple(t.shape) != tuple(ref.shape):
                raise ValueError(f"load_safetensors: '{name}' has shape {tuple(t.shape)} in the file, "
                                 f"{tuple(ref.shape)} in like")
            # safe_open's tensors wrap the file's mapping (not torch's memory): copied, so a donated step may
            # train them in place (see fxtrain/interop/_arrays.py)
            out[name] = owned(t.to(device=ref.device, dtype=ref.dtype))
    return out


def _require(name: str, what: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{what} needs safetensors: pip install safetensors") from e
