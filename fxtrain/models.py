"""Built-in models for experiments: an MLP, a small ResNet with BatchNorm, a causal transformer LM.

Plain ``nn.Module`` classes, built by the Hydra ``model`` group (``_target_: fxtrain.models.MLP``) and
turned into pure functions with :func:`fxtrain.functional`. Every model maps inputs to logits: ``(B,
classes)`` for the classifiers, ``(B, T, vocab)`` for the LM, so one cross-entropy serves all of them.
Construction is seeded by the caller (``torch.manual_seed`` before building).

Example:
    >>> import torch
    >>> from fxtrain.models import MLP, ResNet, TransformerLM
    >>> MLP(input_shape=(1, 8, 8), hidden=(32,), num_classes=10)(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    >>> ResNet(input_shape=(1, 8, 8), num_classes=10, width=8)(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    >>> TransformerLM(vocab_size=256, context=16, d_model=32, n_layers=1, n_heads=2)(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fxtrain import tree

__all__ = ["MLP", "ResNet", "TransformerLM", "count_params"]

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


def _activation(name: str, owner: str) -> type[nn.Module]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"{owner}: unknown activation {name!r}; choose one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class MLP(nn.Module):
    """Flatten, then ``Linear -> activation`` for each width in ``hidden``, then a linear classifier.

    Args:
      input_shape: shape of one input, e.g. ``(1, 8, 8)``; it is flattened.
      hidden: widths of the hidden layers.
      num_classes: number of output logits.
      activation: ``relu``, ``gelu``, ``tanh`` or ``silu``.
    """

    def __init__(self, input_shape: Sequence[int], hidden: Sequence[int] = (256, 256), num_classes: int = 10,
                 activation: str = "relu"):
        super().__init__()
        act = _activation(activation, "MLP")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), act()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _Block(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm, identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet for small images (CIFAR-style stem, no max-pool), with BatchNorm.

    Stages of basic blocks at widths ``width * 2**i``; every stage after the first halves the resolution.
    Global average pooling and a linear classifier follow. With the defaults on 8x8 digits: 8x8 -> 4x4
    -> 2x2, about 78k parameters.

    Args:
      input_shape: ``(channels, height, width)`` of one input; the channels count (1 for digits, 3 for CIFAR).
      num_classes: number of output logits.
      width: channels of the first stage.
      blocks: number of basic blocks per stage.
    """

    def __init__(self, input_shape: Sequence[int] = (1, 8, 8), num_classes: int = 10, width: int = 16,
                 blocks: Sequence[int] = (1, 1, 1)):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"ResNet: input_shape must be (channels, height, width), got {list(input_shape)}")
        in_channels = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                stages.append(_Block(cin, cout, stride=2 if i > 0 and j == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


class _Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class _TransformerBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), _Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """A GPT-2-style causal language model (pre-LayerNorm blocks, learned positions, tied LM head).

    Input ``(B, T)`` token ids with ``T <= context``; output ``(B, T, vocab_size)`` next-token logits.
    Initialised like GPT-2: normal(0, 0.02), residual projections scaled by ``1/sqrt(2 * n_layers)``.

    Args:
      vocab_size: number of tokens (256 for bytes).
      context: longest sequence (size of the position table).
      d_model: width of the residual stream; divisible by ``n_heads``.
      n_layers: number of transformer blocks.
      n_heads: attention heads per block.
    """

    def __init__(self, vocab_size: int = 256, context: int = 128, d_model: int = 128, n_layers: int = 2,
                 n_heads: int = 4):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"TransformerLM: d_model={d_model} is not divisible by n_heads={n_heads}")
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*[_TransformerBlock(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: appears once in fx.functional's params, as tok.weight
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.context:
            raise ValueError(f"TransformerLM: sequence of {T} tokens is longer than context={self.context}")
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


def count_params(params) -> int:
    """Number of elements in a params tree (tied weights appear once in ``fx.functional``'s params).

    >>> count_params({"w": torch.zeros(3, 4), "b": [torch.zeros(4)]})
    16
    """
    return sum(p.numel() for p in tree.leaves(params))
