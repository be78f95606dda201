"""Built-in models for experiments: an MLP, pytorch/examples' MNIST CNN, a small ResNet with BatchNorm, a causal
transformer LM.

Plain ``nn.Module`` classes, built by the Hydra ``model`` group (``_target_: fxtrain.models.MLP``) and
turned into pure functions with :func:`fxtrain.functional`. Every model maps inputs to logits: ``(B,
classes)`` for the classifiers, ``(B, T, vocab)`` for the LM, so one cross-entropy serves all of them.
Construction is seeded by the caller (``torch.manual_seed`` before building).

Example:
    >>> import torch
    >>> from fxtrain.models import MLP, ConvNet, ResNet, TransformerLM
    >>> MLP(input_shape=(1, 8, 8), hidden=(32,), num_classes=10)(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    >>> ConvNet(input_shape=(1, 8, 8), num_classes=10)(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    >>> ResNet(input_shape=(1, 8, 8), num_classes=10, width=8)(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    >>> TransformerLM(vocab_size=256, context=16, d_model=32, n_layers=1, n_heads=2)(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 256])
    >>> TransformerLM(vocab_size=256, context=16, d_model=32, n_layers=1, n_heads=2, experts=4)(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fxtrain import tree

__all__ = ["ConvNet", "MLP", "MoE", "ResNet", "TransformerLM", "count_params"]

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


def _activation(name: str, owner: str) -> type[nn.Module]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"{owner}: unknown activation {name!r}; choose one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class MLP(nn.Module):
    """Flatten, then ``Linear -> activation`` for each width in ``hidden``, then a linear classifier.

    With ``batchnorm=True`` each hidden layer is ``Linear -> BatchNorm1d -> activation`` (lightning-hydra-template's
    ``SimpleDenseNet``); the running statistics are buffers, which :func:`fxtrain.functional` threads through
    the step as state, updated in training and read in evaluation.

    Args:
      input_shape: shape of one input, e.g. ``(1, 8, 8)``; it is flattened.
      hidden: widths of the hidden layers.
      num_classes: number of output logits.
      activation: ``relu``, ``gelu``, ``tanh`` or ``silu``.
      batchnorm: a ``BatchNorm1d`` after each hidden ``Linear``, before its activation.

    Example:
        >>> import fxtrain as fx
        >>> _, params, buffers = fx.functional(MLP((1, 8, 8), hidden=(16,), batchnorm=True))
        >>> sorted(buffers)
        ['net.2.num_batches_tracked', 'net.2.running_mean', 'net.2.running_var']
    """

    def __init__(self, input_shape: Sequence[int], hidden: Sequence[int] = (256, 256), num_classes: int = 10,
                 activation: str = "relu", batchnorm: bool = False):
        super().__init__()
        act = _activation(activation, "MLP")
        if batchnorm not in (True, False):
            raise ValueError(f"MLP: batchnorm={batchnorm!r}; expected true or false")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), *([nn.BatchNorm1d(h)] if batchnorm else []), act()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    """pytorch/examples' MNIST ``Net`` (``mnist/main.py``), sized by ``input_shape``.

    ``conv 3x3 (32) -> ReLU -> conv 3x3 (64) -> ReLU -> max-pool 2 -> dropout 0.25 -> Linear (width) -> ReLU ->
    dropout 0.5 -> Linear (classes) -> log_softmax``. On 28x28 MNIST the first Linear reads 9216 features, as in
    the example; on 8x8 digits 256 (64 channels of 2x2), 53,002 parameters. The outputs are log-probabilities,
    which cross-entropy reads as logits with the same result (``log_softmax`` of log-probabilities is themselves),
    so the ``classification`` task trains it as it trains the others.

    Args:
      input_shape: ``(channels, height, width)`` of one input; height and width at least 6.
      num_classes: number of outputs.
      width: outputs of the hidden Linear layer (128 in the example).

    Example:
        >>> import fxtrain as fx
        >>> _, params, _ = fx.functional(ConvNet((1, 8, 8)))
        >>> count_params(params), params["fc1.weight"].shape
        (53002, torch.Size([128, 256]))
    """

    def __init__(self, input_shape: Sequence[int] = (1, 28, 28), num_classes: int = 10, width: int = 128):
        super().__init__()
        if len(input_shape) != 3 or min(input_shape[1:]) < 6:
            raise ValueError(f"ConvNet: input_shape must be (channels, height, width) with height and width at "
                             f"least 6 (two 3x3 convs and a 2x2 pool), got {list(input_shape)}")
        channels, height, columns = input_shape
        self.conv1 = nn.Conv2d(channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * ((height - 4) // 2) * ((columns - 4) // 2), width)
        self.fc2 = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2)).flatten(1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


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
        # q, k and v are separate Linears (not one fused 3 * d_model one) so that tensor parallelism can split
        # each by columns and hand every rank whole heads of all three (TransformerLM.tp_plan); built in this
        # order they draw the same init as the fused weight did, rows [q; k; v].
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        head_dim = C // self.n_heads
        # -1 heads: under tensor parallelism q/k/v come out with this rank's n_heads / tp heads (torchtitan's way).
        q, k, v = (lin(x).view(B, T, -1, head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


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
    (:func:`fxtrain.parallel.expert_parallel`). Each expert runs on the tokens routed to it only (one
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
    #: why ``torch.compile`` cannot take this layer into one graph (:func:`fxtrain.parallel.compile_blocks` refuses it)
    compile_refusal = ("each call reads its per-expert token counts on the host (torch.bincount(...).tolist(): "
                       "data-dependent sizes), which torch.compile cannot trace into one graph")

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
        # Where the experts run: None computes all of them here. fx.parallel.expert_parallel sets it,
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
    Its parallel layouts: :meth:`tp_plan` (torch's tensor-parallel plan) and :meth:`pipeline_stage` (a
    pipeline split); experts are sharded by :func:`fxtrain.parallel.expert_parallel`.

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
        self.context, self.n_layers, self.n_heads, self.experts = context, n_layers, n_heads, experts
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
        x = _embed(self.tok, self.pos, self.context, idx)
        return self.head(self.ln_f(self.blocks(x)))

    def tp_plan(self, *, sequence_parallel: bool = True) -> dict:
        """torch's tensor-parallel plan for this model, ``{submodule path: ParallelStyle}`` (torchtitan's layout).

        Megatron's split inside each block: ``q``, ``k``, ``v`` and the MLP's first Linear by columns (each
        rank holds ``n_heads / tp`` whole heads and ``4 * d_model / tp`` hidden units), ``proj`` and the MLP's
        second Linear by rows; the embeddings and the (tied) head split the vocabulary / positions, and the
        logits come out whole (``Replicate``) for a plain cross-entropy. With ``sequence_parallel`` the
        residual stream between blocks is split along the sequence (``Shard(1)``): the LayerNorms run on
        ``T / tp`` tokens (``SequenceParallel``) and each block all-gathers its input once per half;
        without it the LayerNorms stay plain params, identical on every rank.

        Pass it to :func:`fxtrain.parallel.tensor_parallel` (or torch's ``parallelize_module``). Keys keep
        their order: ``head`` shares ``tok.weight`` and takes it from ``tok``, parallelized first (both are
        ``Shard(0)``, rows of the vocabulary, so the tie survives: one DTensor, both gradients summed into it).

        Args:
          sequence_parallel: split the LayerNorms and the residual stream along the sequence (torchtitan's
            default); ``False`` gives Megatron's plan without it.

        Returns:
          The plan. Applying it raises ``ValueError`` when ``n_heads`` is not divisible by the tp mesh size.

        With MoE blocks (``experts > 0``) the plan is the attention's and the embeddings' without sequence
        parallel (torchtitan's EP x TP without expert tensor parallel): every tp rank routes the whole tokens
        and runs the MoE on them, its experts identical on the tp ranks, or ``Shard(0)`` over ``ep``
        (:func:`fxtrain.parallel.fully_shard_experts`), whatever ``sequence_parallel`` asks.

        Example (on 2 ranks, ``torchrun --nproc-per-node 2``; not a doctest)::

            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            model = TransformerLM(vocab_size=256, context=64, d_model=64, n_layers=2, n_heads=4)
            apply, params, buffers = fx.parallel.tensor_parallel(model, model.tp_plan(), mesh)

        >>> sorted(TransformerLM(d_model=32, n_heads=2).tp_plan())[:4]
        ['blocks.*.attn', 'blocks.*.attn.[qkv]', 'blocks.*.attn.proj', 'blocks.*.ln1']
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
        )

        heads_colwise, tied_colwise = _tp_styles()
        heads = heads_colwise(self.n_heads)
        if not sequence_parallel or self.experts:
            plan = {
                "tok": RowwiseParallel(input_layouts=Replicate()),
                "pos": RowwiseParallel(input_layouts=Replicate()),
                "blocks.*.attn.[qkv]": heads,
                "blocks.*.attn.proj": RowwiseParallel(),
                "blocks.*.mlp.0": ColwiseParallel(),
                "blocks.*.mlp.2": RowwiseParallel(),
                "head": tied_colwise(self.tok, output_layouts=Replicate()),
            }
            return {k: v for k, v in plan.items() if not (self.experts and k.startswith("blocks.*.mlp"))}
        # Each block's attention and MLP read the whole sequence: gather the Shard(1) norm output once, as a
        # plain tensor (x.shape inside the attention is then the full (B, T, C)).
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True)
        return {
            # Token rows and position rows split over tp; each lookup's partial sums are reduce-scattered
            # along the sequence, so the residual stream starts as this rank's T / tp tokens, as plain
            # tensors: (B, T/tp, C) + (T/tp, C) adds the right positions without DTensor.
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "blocks.*.ln1": SequenceParallel(),
            "blocks.*.attn": gather,
            "blocks.*.attn.[qkv]": heads,
            "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "blocks.*.ln2": SequenceParallel(),
            "blocks.*.mlp": gather,
            "blocks.*.mlp.0": ColwiseParallel(),
            "blocks.*.mlp.2": RowwiseParallel(output_layouts=Shard(1)),
            "ln_f": SequenceParallel(),
            "head": tied_colwise(self.tok, input_layouts=Shard(1), output_layouts=Replicate()),
        }

    def pipeline_stage(self, stage: int, num_stages: int) -> nn.Module:
        """Stage ``stage`` of ``num_stages`` of this model, for ``torch.distributed.pipelining.PipelineStage``.

        The blocks are split as evenly as possible, earlier stages taking one more when ``n_layers`` does not
        divide: the first stage holds the embeddings and its blocks, the last its blocks, ``ln_f`` and the
        head. The stage module shares this model's modules (no copy; build the same model on every rank,
        same seed) and keeps their names (``blocks.3.attn.q.weight``), so the stages' params together are
        exactly ``fx.functional(model)``'s.

        The head is tied to ``tok.weight``, which lives on the first stage only: each stage passes it on
        beside the activations, ``forward(x, tok_weight) -> (x, tok_weight)`` (the first stage takes the
        token ids, ``forward(idx)``), and the last stage returns the logits ``(B, T, vocab_size)``. The
        head's gradient thus comes back with the activations' and sums into ``tok.weight.grad`` on the
        first stage, as in one process; no stage holds a copy that a clip would count twice.

        Args:
          stage: this stage's index, ``0 <= stage < num_stages``.
          num_stages: the pipeline size (``parallel.pp``), at most ``n_layers``.

        Returns:
          The stage's ``nn.Module``.

        Raises:
          ValueError: more stages than blocks (a stage would have none), or ``stage`` out of range.

        >>> lm = TransformerLM(vocab_size=16, context=8, d_model=8, n_layers=3, n_heads=2)
        >>> first, last = lm.pipeline_stage(0, 2), lm.pipeline_stage(1, 2)
        >>> [len(first.blocks), len(last.blocks)], list(last.blocks._modules)
        ([2, 1], ['2'])
        >>> idx = torch.randint(0, 16, (2, 8))
        >>> torch.equal(last(*first(idx)), lm(idx))
        True
        >>> lm.pipeline_stage(0, 4)
        Traceback (most recent call last):
        ...
        ValueError: TransformerLM.pipeline_stage: parallel.pp=4 stages need at least one block each, but model.n_layers=3; lower parallel.pp or raise model.n_layers
        """
        if not 1 <= num_stages <= self.n_layers:
            raise ValueError(f"TransformerLM.pipeline_stage: parallel.pp={num_stages} stages need at least one "
                             f"block each, but model.n_layers={self.n_layers}; lower parallel.pp or raise "
                             f"model.n_layers")
        if not 0 <= stage < num_stages:
            raise ValueError(f"TransformerLM.pipeline_stage: stage={stage} is not in 0..{num_stages - 1}")
        per, extra = divmod(self.n_layers, num_stages)
        lo = stage * per + min(stage, extra)
        hi = lo + per + (stage < extra)
        return _LMStage(self, range(lo, hi), first=stage == 0, last=stage == num_stages - 1)


def _embed(tok: nn.Embedding, pos: nn.Embedding, context: int, idx: torch.Tensor) -> torch.Tensor:
    T = idx.shape[1]
    if T > context:
        raise ValueError(f"TransformerLM: sequence of {T} tokens is longer than context={context}")
    return tok(idx) + pos(torch.arange(T, device=idx.device))


class _LMStage(nn.Module):
    """A pipeline stage of a :class:`TransformerLM` (see ``TransformerLM.pipeline_stage``)."""

    def __init__(self, lm: TransformerLM, blocks: range, first: bool, last: bool):
        super().__init__()
        self.context, self.first, self.last = lm.context, first, last
        if first:
            self.tok, self.pos = lm.tok, lm.pos
        # keyed by the model's own block indices, so params keep their names ("blocks.3.ln1.weight")
        self.blocks = nn.Sequential(collections.OrderedDict((str(i), lm.blocks[i]) for i in blocks))
        if last:
            self.ln_f = lm.ln_f

    def forward(self, x: torch.Tensor, tok_weight: torch.Tensor | None = None):
        if self.first:
            x, tok_weight = _embed(self.tok, self.pos, self.context, x), self.tok.weight
        x = self.blocks(x)
        if not self.last:
            return x, tok_weight
        return F.linear(self.ln_f(x), tok_weight)  # the tied head (bias-free), on the weight the first stage sent


@functools.cache
def _tp_styles() -> tuple[type, type]:
    """TransformerLM.tp_plan's two ColwiseParallel variants, made on first use (torch.distributed loads lazily)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    class HeadsColwise(ColwiseParallel):
        """ColwiseParallel for q / k / v that first checks every rank gets whole heads."""

        def __init__(self, n_heads: int):
            super().__init__()
            self.n_heads = n_heads

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            if self.n_heads % device_mesh.size():
                raise ValueError(f"TransformerLM.tp_plan: model.n_heads={self.n_heads} is not divisible by the tp "
                                 f"size {device_mesh.size()}; pick n_heads a multiple of parallel.tp")
            return super()._apply(module, device_mesh)

    class TiedColwise(ColwiseParallel):
        """ColwiseParallel for a Linear whose weight is an embedding's, already sharded by rows (``Shard(0)``)."""

        def __init__(self, embedding: nn.Module, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            shared = self.embedding.weight
            if not (isinstance(shared, DTensor) and shared.placements == (Shard(0),)):
                raise ValueError("TransformerLM.tp_plan: the head is tied to tok.weight, which must be parallelized "
                                 "first (Shard(0)); keep 'tok' ahead of 'head' in the plan")
            module.weight = shared  # already laid out as ColwiseParallel wants: distribute_tensor keeps it
            out = super()._apply(module, device_mesh)
            module.weight = shared  # ... but wraps it in a new nn.Parameter: tie the very same one again
            return out

    return HeadsColwise, TiedColwise


def count_params(params) -> int:
    """Number of elements in a params tree (tied weights appear once in ``fx.functional``'s params).

    >>> count_params({"w": torch.zeros(3, 4), "b": [torch.zeros(4)]})
    16
    """
    return sum(p.numel() for p in tree.leaves(params))
