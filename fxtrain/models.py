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
    >>> TransformerLM(vocab_size=256, context=16, d_model=32, n_layers=1, n_heads=2, experts=4)(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fxtrain import tree

__all__ = ["MLP", "MoE", "ResNet", "TransformerLM", "count_params"]

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
    def __init__(self, d_model: int, n_heads: int, experts: int = 0, top_k: int = 2):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), _Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        if experts:
            self.mlp = MoE(d_model, 4 * d_model, experts, top_k=top_k)
        else:
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MoE(nn.Module):
    """A mixture-of-experts MLP: a top-k router with softmax gates over ``num_experts`` GELU MLPs.

    For each token ``x`` (the last dim; any leading dims), the router's logits ``x @ router.weight.T`` pick
    the ``top_k`` experts, whose gates are the softmax of their logits (Mixtral's choice: the gates of a
    token sum to 1)::

        y = sum over the chosen e of  gate_e * (gelu(x @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e])

    The expert weights are stacked params with the expert index first (``w_in`` is ``[E, d_model,
    d_hidden]``), so sharding them over ranks is one ``Shard(0)``
    (:func:`fxtrain.distributed.expert_parallel`). Each expert runs on the tokens routed to it only (one
    host sync per call for the token counts); no load-balancing loss and no capacity limit: every routed
    token is computed.

    Args:
      d_model: width of a token.
      d_hidden: hidden width of each expert.
      num_experts: number of experts ``E``.
      top_k: experts per token, at most ``E``.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> moe = MoE(d_model=8, d_hidden=16, num_experts=4, top_k=2)
        >>> moe(torch.randn(2, 5, 8)).shape
        torch.Size([2, 5, 8])
        >>> sorted(name for name, _ in moe.named_parameters())
        ['b_in', 'b_out', 'router.weight', 'w_in', 'w_out']
    """

    #: the stacked params, expert index first: what expert parallelism shards
    expert_params = ("w_in", "b_in", "w_out", "b_out")

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, top_k: int = 2):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k = top_k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        # nn.Linear's default init, per expert: uniform(+-1/sqrt(fan_in)).
        bound_in, bound_out = 1 / math.sqrt(d_model), 1 / math.sqrt(d_hidden)
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, d_hidden).uniform_(-bound_in, bound_in))
        self.b_in = nn.Parameter(torch.empty(num_experts, d_hidden).uniform_(-bound_in, bound_in))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_hidden, d_model).uniform_(-bound_out, bound_out))
        self.b_out = nn.Parameter(torch.empty(num_experts, d_model).uniform_(-bound_out, bound_out))
        # Where the experts run: None computes all of them here. fx.distributed.expert_parallel sets it,
        # for the duration of a call, to a dispatcher that moves tokens to the ranks holding their experts.
        self.dispatch = None

    @property
    def num_experts(self) -> int:
        return self.w_in.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits, chosen = self.router(tokens).topk(self.top_k, dim=-1)
        gates = logits.softmax(dim=-1)
        weights = (self.w_in, self.b_in, self.w_out, self.b_out)
        if self.dispatch is None:
            y = experts_forward(tokens, gates, chosen, weights, first=0)
        else:
            y = self.dispatch(tokens, gates, chosen, weights)
        return y.reshape(x.shape)


def experts_forward(tokens: torch.Tensor, gates: torch.Tensor, chosen: torch.Tensor,
                    weights: Sequence[torch.Tensor], first: int) -> torch.Tensor:
    """The gated sum of the experts ``first ... first + len(weights[0]) - 1`` over ``tokens``; other experts add 0.

    Args:
      tokens: ``[T, d_model]``.
      gates: ``[T, top_k]`` gate of each chosen expert.
      chosen: ``[T, top_k]`` global expert index of each choice.
      weights: ``(w_in, b_in, w_out, b_out)`` of the experts held here (stacked, expert index first).
      first: global index of ``weights``' first expert.

    Returns:
      ``[T, d_model]``: for each token, the sum of ``gate * expert(token)`` over its chosen experts held here.

    >>> w = (torch.ones(1, 2, 3), torch.zeros(1, 3), torch.ones(1, 3, 2), torch.zeros(1, 2))
    >>> y = experts_forward(torch.ones(2, 2), torch.full((2, 1), 0.5), torch.tensor([[0], [1]]), w, first=0)
    >>> y.tolist()   # token 0: 0.5 * 3 * gelu(2); token 1 chose expert 1, held elsewhere
    [[2.93..., 2.93...], [0.0, 0.0]]
    """
    w_in, b_in, w_out, b_out = weights
    n, k = w_in.shape[0], chosen.shape[1]
    local = chosen.reshape(-1) - first
    # Sort the (token, choice) pairs by local expert; choices of experts held elsewhere sort last (key n).
    key = torch.where((local >= 0) & (local < n), local, n)
    order = key.argsort(stable=True)
    counts = torch.bincount(key, minlength=n + 1).tolist()  # the one host sync: per-expert sizes
    picked = order[:len(order) - counts[n]]
    token = picked.div(k, rounding_mode="floor")
    xs = tokens[token].split(counts[:n])
    ys = [F.gelu(xe @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e] for e, xe in enumerate(xs)]
    ys = torch.cat(ys) * gates.reshape(-1)[picked].unsqueeze(-1)
    return torch.zeros_like(tokens).index_add(0, token, ys)


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
      experts: ``0`` (default) for a dense MLP in every block; ``E > 0`` replaces it with an :class:`MoE` of
        ``E`` experts of width ``4 * d_model`` (params ``blocks.<i>.mlp.router.weight``, ``...mlp.w_in`` ...).
      top_k: experts per token when ``experts > 0``.
    """

    def __init__(self, vocab_size: int = 256, context: int = 128, d_model: int = 128, n_layers: int = 2,
                 n_heads: int = 4, experts: int = 0, top_k: int = 2):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"TransformerLM: d_model={d_model} is not divisible by n_heads={n_heads}")
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*[_TransformerBlock(d_model, n_heads, experts, top_k) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: appears once in fx.functional's params, as tok.weight
        for name, p in self.named_parameters():
            if name.endswith("mlp.w_out"):  # MoE experts (experts > 0): initialised like the dense MLP
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))
            elif name.endswith("mlp.w_in"):
                nn.init.normal_(p, std=0.02)
            elif name.endswith(("mlp.b_in", "mlp.b_out")):
                nn.init.zeros_(p)
            elif name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
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
