"""Mixed precision: jmp-style policies, loss scales, and ``amp_cast`` (a transform that owns the forward pass).

Three pieces, each usable alone:

* :class:`Policy`: the dtypes of params (storage), compute (the forward pass) and output (the loss),
  parsed from jmp's grammar (``"p=f32,c=bf16,o=f32"``, ``"half"``...).
* Loss scales: :class:`NoLossScale`, :class:`StaticLossScale` and :class:`DynamicLossScale` (the
  ``torch.amp.GradScaler`` rule, plus Megatron's hysteresis and floors/ceilings). Each is a small frozen
  config that makes a state (0-dim tensors) and updates it in place.
* :func:`amp_cast`: wraps a gradient transformation. Through ``wrap_loss`` the step's forward pass runs on
  params and batch cast to the compute dtype and differentiates ``loss.to(output) * scale``; its ``update``
  unscales the gradients, decides on every rank at once whether any element anywhere is not finite, and
  then either runs the inner transform or skips it (``-0.0`` updates, so params stay bit-identical; inner
  state bit-identical but for the ``grad_norm`` it reports, which says inf or NaN), and adjusts the scale.
  Master params are never cast: gradients reach them in their own dtype through the cast. Model state
  that rides in the batch (BatchNorm statistics) keeps its dtype when wrapped in :class:`Uncast`.

The presets (:func:`amp_preset`, the Hydra group ``amp/``: ``off``, ``bf16``, ``fp16``, ``naive_fp16``,
``pure_bf16``, ``pure_fp16``), the seeds' names for them (apex O0-O3, Megatron's naive amp) and how they map:
docs/stack.md ("Mixed precision presets").
The runner's ``amp=float8`` is ``bf16`` plus torchao's float8 Linear layers in the model (:mod:`fxtrain.float8`).

Example:
    >>> import torch, fxtrain as fx
    >>> tx = fx.amp_cast(fx.sgd(0.125), "p=f32,c=bf16")
    >>> tx
    amp_cast(policy='p=f32,c=bf16,o=bf16', sgd(0.125))
    >>> def loss_fn(params, x):
    ...     assert params["w"].dtype == x.dtype == torch.bfloat16   # the forward pass runs in bf16
    ...     return (x @ params["w"]).square().mean()
    >>> params = {"w": torch.ones(3)}
    >>> params, state, metrics = fx.train_step(loss_fn, tx)(params, tx.init(params), torch.ones(2, 3))
    >>> params["w"].dtype, params["w"].tolist(), metrics["loss"].dtype   # master params: float32, updated
    (torch.float32, [0.25, 0.25, 0.25], torch.bfloat16)

References:
    jmp (policies): https://github.com/google-deepmind/jmp
    Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_, 2018
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple, Sequence

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from fxtrain import distributed, tree
from fxtrain._base import (forwarded, fused_around, GradientTransformation, call_, public_factory, report, transform,
                           with_traits, wrap_loss)
from fxtrain.transforms._conditionality import seen_grad_norm, select, skip_where_
from fxtrain.transforms._hyperparams import param_device

__all__ = [
    "Policy", "NoLossScale", "StaticLossScale", "DynamicLossScale", "StaticLossScaleState",
    "DynamicLossScaleState", "AmpCastState", "amp_cast", "amp_preset", "PRESETS", "Uncast",
]

# --- policies -------------------------------------------------------------------------------------

# jmp's names, plus f64. jmp's "half" is float16 on GPU and bfloat16 on TPU; PyTorch has no TPU default,
# so here it is float16 (the GPU meaning).
_DTYPE_NAMES = {
    "f32": torch.float32, "float32": torch.float32, "full": torch.float32, "single": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "f16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "f64": torch.float64, "float64": torch.float64,
}
_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}
_KEYS = {"p": "param_dtype", "params": "param_dtype", "c": "compute_dtype", "compute": "compute_dtype",
         "o": "output_dtype", "output": "output_dtype"}
_SPELLINGS = "f32/float32/full, bf16/bfloat16, f16/float16/half, f64/float64"


def _dtype(value: Any, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _SHORT:
            raise ValueError(f"{what}: {value} is not a floating-point dtype a policy can use "
                             f"({', '.join(str(d) for d in _SHORT)})")
        return value
    if isinstance(value, str) and value.strip() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.strip()]
    raise ValueError(f"{what}: unknown dtype {value!r}; use one of {_SPELLINGS}")


@dataclasses.dataclass(frozen=True, repr=False)
class Policy:
    """Which dtype params are stored in, the forward pass computes in, and the loss comes out in (jmp's ``Policy``).

    Build it from dtypes (or their names), or parse jmp's grammar with :meth:`parse`: comma-separated
    ``key=value`` with keys ``p``/``params``, ``c``/``compute``, ``o``/``output`` and values
    ``f32``/``float32``/``full``, ``bf16``/``bfloat16``, ``f16``/``float16``/``half``, ``f64``/``float64``;
    a bare dtype name sets all three. Unset entries default as in jmp: params float32, compute = params,
    output = compute. Casting touches floating-point tensors only (integer labels, masks pass through).

    A preset's name (``off``, ``bf16``, ``fp16``, ``naive_fp16``, ``pure_bf16``, ``pure_fp16``; see
    :data:`PRESETS`) means the preset's policy, as ``amp=<name>`` does in the runner. Two of them shadow
    jmp's bare names: ``"bf16"`` is ``p=f32,c=bf16,o=f32`` here (jmp: all three bf16, which is
    ``"pure_bf16"`` or ``"p=bf16"``), and ``"off"`` casts nothing: params, inputs and loss keep their own
    dtypes (a float64 run stays float64; jmp's ``"f32"`` would cast it to float32). Other bare names keep
    jmp's meaning (``"half"``, ``"bfloat16"``: all three in that dtype). ``Policy(None, None, None)`` is
    ``"off"``: ``None`` for ``param_dtype`` means "as given", and then the other two must be ``None`` too.

    Its ``repr`` is the short grammar form in quotes, so a stack prints as
    ``amp_cast(policy='p=f32,c=bf16,o=f32', ...)`` and ``Policy.parse(eval(repr(p))) == p``.

    Example:
        >>> import torch, fxtrain as fx
        >>> fx.Policy.parse("c=bf16"), fx.Policy.parse("half"), fx.Policy(torch.float32, "f16", "f32")
        ('p=f32,c=bf16,o=bf16', 'p=f16,c=f16,o=f16', 'p=f32,c=f16,o=f32')
        >>> fx.Policy.parse("bf16"), fx.Policy.parse("pure_bf16")   # presets by name
        ('p=f32,c=bf16,o=f32', 'p=bf16,c=bf16,o=bf16')
        >>> p = fx.Policy.parse("params=float32,compute=bfloat16,output=float32")
        >>> p.cast_to_compute({"w": torch.ones(2), "label": torch.tensor([3])})["w"].dtype
        torch.bfloat16
    """

    param_dtype: torch.dtype | None = torch.float32  # None: "off", every dtype as given
    compute_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.param_dtype is None:  # "off": every dtype as given
            if self.compute_dtype is not None or self.output_dtype is not None:
                raise ValueError("Policy: param_dtype=None keeps every dtype as given ('off'); give a param "
                                 "dtype to set the compute or output dtype")
            return
        p = _dtype(self.param_dtype, "Policy param_dtype")
        c = p if self.compute_dtype is None else _dtype(self.compute_dtype, "Policy compute_dtype")
        o = c if self.output_dtype is None else _dtype(self.output_dtype, "Policy output_dtype")
        for name, value in (("param_dtype", p), ("compute_dtype", c), ("output_dtype", o)):
            object.__setattr__(self, name, value)

    @classmethod
    def parse(cls, policy: str | Policy) -> Policy:
        """A policy from jmp's grammar (``"p=f32,c=bf16,o=f32"``, ``"half"``); a :class:`Policy` passes through.

        Raises:
          ValueError: naming the part that is not understood (an unknown key or dtype, a repeated key).
        """
        if isinstance(policy, Policy):
            return policy
        if not isinstance(policy, str):
            raise ValueError(f"amp policy must be a string like 'p=f32,c=bf16,o=f32' or a fx.Policy, got {policy!r}")
        if policy.strip() == "off":
            return cls(None, None, None)
        if policy.strip() in PRESETS:  # a preset's name means the preset (the runner's amp=<name>), not jmp's
            return cls.parse(PRESETS[policy.strip()][0])
        if "=" not in policy:
            dtype = _dtype(policy, f"amp policy {policy!r}")
            return cls(dtype, dtype, dtype)
        given: dict[str, torch.dtype] = {}
        for part in policy.split(","):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep:
                raise ValueError(f"amp policy {policy!r}: part {part.strip()!r} is not key=value")
            if key not in _KEYS:
                raise ValueError(f"amp policy {policy!r}: unknown key {key!r} in {part.strip()!r}; "
                                 "keys are p/params, c/compute, o/output")
            field = _KEYS[key]
            if field in given:
                raise ValueError(f"amp policy {policy!r}: {field.removesuffix('_dtype')} dtype given twice")
            given[field] = _dtype(value, f"amp policy {policy!r}: in {part.strip()!r}")
        return cls(**given)

    def cast_to_param(self, t: Any) -> Any:
        """``t`` with its floating-point tensors cast to ``param_dtype``."""
        return tree.cast(t, self.param_dtype)

    def cast_to_compute(self, t: Any) -> Any:
        """``t`` with its floating-point tensors cast to ``compute_dtype``."""
        return tree.cast(t, self.compute_dtype)

    def cast_to_output(self, t: Any) -> Any:
        """``t`` with its floating-point tensors cast to ``output_dtype``."""
        return tree.cast(t, self.output_dtype)

    def __str__(self) -> str:
        if self.param_dtype is None:
            return "off"
        return f"p={_SHORT[self.param_dtype]},c={_SHORT[self.compute_dtype]},o={_SHORT[self.output_dtype]}"

    def __repr__(self) -> str:
        return repr(str(self))


# --- loss scales ------------------------------------------------------------------------------------

class StaticLossScaleState(NamedTuple):
    """State of :class:`NoLossScale` and :class:`StaticLossScale`: the scale (0-dim float32), never changed.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.amp_cast(fx.sgd(0.1), policy="p=f32,c=f16,o=f32", loss_scale=1024.0)
        >>> tx.init({"w": torch.zeros(2)}).loss_scale
        StaticLossScaleState(scale=tensor(1024.))
    """

    scale: torch.Tensor


class DynamicLossScaleState(NamedTuple):
    """State of :class:`DynamicLossScale` (0-dim tensors on the params' device).

    Attributes:
      scale: the loss scale, float32 (``torch.amp.GradScaler._scale``).
      growth_tracker: finite updates since the last overflow or growth, int32 (GradScaler's ``_growth_tracker``).
      hysteresis_tracker: overflows still tolerated before the next backoff, int32; re-armed to
        ``hysteresis`` at each growth (Megatron's ``_hysteresis_tracker``).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.amp_cast(fx.sgd(0.1), policy="p=f32,c=f16,o=f32").init({"w": torch.zeros(2)})
        >>> isinstance(state.loss_scale, fx.DynamicLossScaleState), state.loss_scale._fields
        (True, ('scale', 'growth_tracker', 'hysteresis_tracker'))
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_tracker: torch.Tensor


def _scalar(value: float, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((), value, dtype=dtype, device=device)


@dataclasses.dataclass(frozen=True)
class NoLossScale:
    """No loss scaling and no overflow check: the loss is differentiated as is, every update is applied.

    What bf16 and float32 need (their range is float32's). Non-finite gradients reach the inner transform
    unchanged, as without ``GradScaler``; wrap the stack in :func:`fxtrain.apply_if_finite` to skip them.

    >>> import fxtrain as fx
    >>> fx.NoLossScale().init(None).scale.item()
    1.0
    """

    scaled = False  # class attribute: amp_cast unscales and checks only when True

    def init(self, device: torch.device | None) -> StaticLossScaleState:
        """The state: a scale of 1.0."""
        return StaticLossScaleState(_scalar(1.0, device))

    def adjust_(self, state: StaticLossScaleState, overflow: torch.Tensor) -> StaticLossScaleState:
        """The state, unchanged."""
        del overflow
        return state


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale: the loss is multiplied by ``scale``, gradients divided; overflowing updates are skipped.

    Skipping follows Megatron's ``ConstantGradScaler`` (its optimizer skips a step with a non-finite
    gradient whatever the scaler); the scale itself never changes.

    >>> import fxtrain as fx
    >>> fx.StaticLossScale(128.0).init(None).scale.item()
    128.0
    """

    scale: float
    scaled = True

    def __post_init__(self):
        if isinstance(self.scale, bool) or not isinstance(self.scale, numbers.Real):
            raise ValueError(f"StaticLossScale: scale must be a positive number, got {self.scale!r}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"StaticLossScale: scale={self.scale!r} must be finite and > 0")
        object.__setattr__(self, "scale", float(self.scale))

    def init(self, device: torch.device | None) -> StaticLossScaleState:
        """The state: ``scale`` as a 0-dim float32 tensor."""
        return StaticLossScaleState(_scalar(self.scale, device))

    def adjust_(self, state: StaticLossScaleState, overflow: torch.Tensor) -> StaticLossScaleState:
        """The state, unchanged."""
        del overflow
        return state


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    r"""A loss scale that backs off on overflow and grows after a run of finite updates.

    Each update, with ``overflow`` decided on every rank at once:

    * overflow: ``growth_tracker = 0``; ``hysteresis_tracker -= 1`` (not below 0); if it reached 0,
      ``scale = max(scale * backoff_factor, min_scale)``. The update is skipped either way.
    * finite: ``growth_tracker += 1``; when it reaches ``growth_interval``: ``growth_tracker = 0``,
      ``hysteresis_tracker = hysteresis`` and ``scale = min(scale * growth_factor, max_scale)``, kept
      unchanged instead if the product is not finite in float32 (GradScaler's rule).

    With the defaults (``hysteresis=1``, no bounds) this is ``torch.amp.GradScaler`` step for step: the
    same scale, the same skipped steps (``torch._amp_update_scale_``'s arithmetic: products in float64,
    rounded to float32). With ``init_scale=2.**32, hysteresis=2, min_scale=1.0`` (and Megatron's
    ``growth_interval=1000``) it is Megatron-LM's ``DynamicGradScaler`` / ColossalAI's naive amp.

    **Hysteresis, and the choice made here.** ``hysteresis=h`` backs off on the *h-th overflow since
    the last growth*; finite steps in between do not re-arm it, only a growth does. That is what
    Megatron-LM's and ColossalAI's ``DynamicGradScaler`` code does (Megatron's docstring says "in a row",
    its code counts since the last growth). The other reading, "h *consecutive* overflows" (the
    apex-lineage ``DynamicLossScaler(delayed_shift=h, consecutive_hysteresis=True)`` kept in Megatron's
    ``fp16_deprecated`` and DeepSpeed, where every finite step re-arms the count), tolerates sporadic
    overflows forever; counting since the last growth guarantees that a scale which overflows often
    enough does come down. For ``h=1`` both readings are GradScaler's.

    Args:
      init_scale: the first scale (> 0; within the bounds).
      growth_factor: multiplies the scale after ``growth_interval`` finite updates (> 1).
      backoff_factor: multiplies the scale on a counted overflow (in (0, 1)).
      growth_interval: finite updates in a row before a growth (int >= 1).
      hysteresis: overflows since the last growth that it takes to back off (int >= 1; 1 = GradScaler).
      min_scale: floor of the scale on backoff, or ``None`` (GradScaler has none).
      max_scale: ceiling of the scale on growth, or ``None``.

    Example:
        >>> import torch, fxtrain as fx
        >>> ls = fx.DynamicLossScale(init_scale=8.0, growth_interval=2, hysteresis=2)
        >>> ls
        DynamicLossScale(init_scale=8.0, growth_interval=2, hysteresis=2)
        >>> s = ls.init(None)
        >>> scales = []
        >>> for overflow in [1, 1, 0, 0, 1, 0, 1]:
        ...     s = ls.adjust_(s, torch.tensor(bool(overflow)))
        ...     scales.append(s.scale.item())
        >>> scales   # keeps on the 1st overflow, halves on the 2nd; growth re-arms; 2 more to back off
        [8.0, 4.0, 4.0, 8.0, 8.0, 8.0, 4.0]
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    scaled = True

    def __post_init__(self):
        def number(name, value, ok, rule):
            real = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not (real and math.isfinite(value) and ok(value)):
                raise ValueError(f"DynamicLossScale: {name}={value!r} must be {rule}")
            object.__setattr__(self, name, float(value))

        def integer(name, value):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"DynamicLossScale: {name}={value!r} must be an integer >= 1")
            object.__setattr__(self, name, int(value))

        number("init_scale", self.init_scale, lambda v: v > 0, "a finite number > 0")
        number("growth_factor", self.growth_factor, lambda v: v > 1, "> 1")
        number("backoff_factor", self.backoff_factor, lambda v: 0 < v < 1, "in (0, 1)")
        integer("growth_interval", self.growth_interval)
        integer("hysteresis", self.hysteresis)
        if self.min_scale is not None:
            number("min_scale", self.min_scale, lambda v: v > 0, "None or a finite number > 0")
        if self.max_scale is not None:
            number("max_scale", self.max_scale, lambda v: v > 0, "None or a finite number > 0")
        lo = self.min_scale if self.min_scale is not None else 0.0
        hi = self.max_scale if self.max_scale is not None else math.inf
        if not lo <= self.init_scale <= hi:
            raise ValueError(f"DynamicLossScale: init_scale={self.init_scale!r} must lie within "
                             f"min_scale={self.min_scale!r} and max_scale={self.max_scale!r}")

    def __repr__(self) -> str:
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"DynamicLossScale({', '.join(changed)})"

    def init(self, device: torch.device | None) -> DynamicLossScaleState:
        """The state at the start: ``init_scale``, no finite updates yet, ``hysteresis`` overflows to go."""
        return DynamicLossScaleState(
            scale=_scalar(self.init_scale, device),
            growth_tracker=_scalar(0, device, torch.int32),
            hysteresis_tracker=_scalar(self.hysteresis, device, torch.int32),
        )

    def adjust_(self, state: DynamicLossScaleState, overflow: torch.Tensor) -> DynamicLossScaleState:
        """The state after an update whose gradients overflowed or not (0-dim bool); no host sync.

        In place (``state`` updated and returned), or a new state inside :func:`fxtrain.tree.functional`.
        """
        scale, growth, left = state
        count = growth + 1
        grow = ~overflow & (count >= self.growth_interval)
        left_next = torch.where(overflow, (left - 1).clamp_min(0), torch.where(grow, self.hysteresis, left))
        backoff = overflow & (left_next == 0)
        # torch._amp_update_scale_ computes the products in double and stores them as float.
        wide = scale.double()
        down = (wide * self.backoff_factor).float()
        if self.min_scale is not None:
            down = down.clamp_min(self.min_scale)
        up = (wide * self.growth_factor).float()
        up = torch.where(up.isfinite(), up, scale)  # GradScaler: grow only to a finite scale
        if self.max_scale is not None:
            up = up.clamp_max(self.max_scale)
        new = (torch.where(backoff, down, torch.where(grow, up, scale)), torch.where(overflow | grow, 0, count),
               left_next)
        if tree.is_functional():  # the pure, composable path: a new state
            return DynamicLossScaleState(*new)
        for dst, value in zip(state, new):
            dst.copy_(value)
        return state


LossScale = NoLossScale | StaticLossScale | DynamicLossScale


def _as_loss_scale(value: Any, policy: Policy) -> LossScale:
    """``amp_cast``'s ``loss_scale`` argument as a loss scale object (``None``: the policy's default)."""
    if value is None:
        half = torch.float16 in (policy.compute_dtype, policy.output_dtype, policy.param_dtype)
        return DynamicLossScale() if half else NoLossScale()
    if isinstance(value, (NoLossScale, StaticLossScale, DynamicLossScale)):
        return value
    if isinstance(value, str):
        if value == "none":
            return NoLossScale()
        if value == "dynamic":
            return DynamicLossScale()
        raise ValueError(f"amp_cast: loss_scale={value!r} is not understood; use 'none', 'dynamic', a positive "
                         "number (static), a mapping of DynamicLossScale arguments, or a loss scale object")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return StaticLossScale(value)
        except ValueError as e:
            raise ValueError(f"amp_cast: loss_scale={value!r}: a static loss scale must be finite and > 0") from e
    if isinstance(value, Mapping):
        kwargs = dict(value)
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(DynamicLossScale)})
        if unknown:
            raise ValueError(f"amp_cast: loss_scale has unknown keys {unknown}; DynamicLossScale takes "
                             f"{', '.join(f.name for f in dataclasses.fields(DynamicLossScale))}")
        return DynamicLossScale(**kwargs)
    raise ValueError(f"amp_cast: loss_scale={value!r} ({type(value).__name__}) is not understood; use 'none', "
                     "'dynamic', a positive number, a mapping of DynamicLossScale arguments, or a loss scale object")


_FP16_REFUSAL = (
    "dynamic loss scaling with float16 master params{where}: their gradients would be unscaled in float16, "
    "which flushes to zero the small values the scale exists to keep, and float16 weights drop updates "
    "smaller than ~1e-3 of their magnitude; torch.amp.GradScaler refuses the same ('Attempting to unscale "
    "FP16 gradients'). Keep the params in float32 (policy 'p=f32,c=f16,o=f32'), use loss_scale='none' or a "
    "static scale (apex O3), or pass allow_fp16=True to amp_cast to do it anyway"
)


# --- amp_cast -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Uncast:
    """Part of a batch that reaches the loss in its own dtype: model state, such as BatchNorm running statistics.

    ``amp_cast`` casts the floating-point leaves of the batch to the compute dtype; state that rides in the
    batch (``fx.functional``'s ``buffers``, updated by the forward pass and handed back in ``aux``) would
    then be rounded every step: a BatchNorm running mean kept in bf16 stops moving once ``momentum * (mean
    - running_mean)`` falls below half a bf16 step. Wrapped in ``Uncast``, it passes through untouched, and
    :func:`fxtrain.train_step` hands the loss function the value itself (with or without ``amp_cast``).
    Buffers so keep their own dtype unless the caller stores them otherwise (the pure half presets store
    everything in half).

    BatchNorm on CPU computes with a bf16 or f16 input but wants its weight and bias in its statistics'
    dtype: cast those params up inside the loss (the gradients flow back through the cast), as
    ``torch.autocast`` keeps them.

    >>> import torch, fxtrain as fx
    >>> batch = (fx.amp.Uncast({"running_mean": torch.zeros(2)}), torch.ones(2))
    >>> fx.Policy.parse("bf16").cast_to_compute(batch)[0].value["running_mean"].dtype
    torch.float32
    """

    value: Any


def uncast(batch: Any) -> Any:
    """``batch`` with every :class:`Uncast` replaced by its value (what the loss function receives)."""
    if isinstance(batch, Uncast):
        return batch.value
    if not isinstance(batch, (tuple, list, dict)):
        return batch
    return tree.map(lambda x: x.value if isinstance(x, Uncast) else x, batch)


class AmpCastState(NamedTuple):
    """State of :func:`amp_cast`.

    Attributes:
      loss_scale: the loss scale's state (:class:`DynamicLossScaleState` or :class:`StaticLossScaleState`).
      skipped: whether the last update was skipped for a non-finite gradient (0-dim int32, 0 or 1).
      inner_state: the state of the wrapped transform (restored on a skipped update, but for the
        ``grad_norm`` it reports: the norm of the unscaled gradients seen, inf or NaN).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.amp_cast(fx.sgd(0.1)).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.AmpCastState), state._fields
        (True, ('loss_scale', 'skipped', 'inner_state'))
    """

    loss_scale: DynamicLossScaleState | StaticLossScaleState
    skipped: torch.Tensor
    inner_state: Any

    def report(self) -> dict[str, torch.Tensor]:
        """``loss_scale`` and ``skipped`` (the inner state's reports are found by the step's walk)."""
        return {"loss_scale": self.loss_scale.scale, "skipped": self.skipped}


def _factory(inner: GradientTransformation, policy: Policy, loss_scale: LossScale | None = None, *,
             groups: Sequence[Any] = (), allow_fp16: bool = False, data_ranks: int = 1) -> GradientTransformation:
    """The transform behind :func:`amp_cast`, called with normalized arguments (so the repr shows them)."""
    scaler = _as_loss_scale(loss_scale, policy)

    dynamic = isinstance(scaler, DynamicLossScale)
    if dynamic and not allow_fp16 and policy.param_dtype == torch.float16:
        raise ValueError("amp_cast: " + _FP16_REFUSAL.format(where=f" (policy '{policy}')"))
    def init_fn(params):
        if dynamic and not allow_fp16:
            for path, x in zip(tree.paths(params), tree.flatten(params)[0]):
                if isinstance(x, torch.Tensor) and x.dtype == torch.float16:
                    raise ValueError("amp_cast: " + _FP16_REFUSAL.format(where=f" ('{path}' is float16)"))
        device = param_device(params)
        return AmpCastState(scaler.init(device), _scalar(0, device, torch.int32), inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        if not scaler.scaled:
            updates, inner_state = call_(inner, updates, state.inner_state, params, extra_args)
            return updates, AmpCastState(state.loss_scale, state.skipped, inner_state)
        local = distributed.local_leaves(updates)
        if tree.is_functional():  # out of place: the same math with ordinary ops (vmap, grad see it all)
            local, found = _unscaled(local, state.loss_scale.scale)
        else:  # in place, GradScaler's fused kernel
            found = _unscale_(local, state.loss_scale.scale)
        # Every rank that holds a piece of the tree (and every rank of `groups`) must take the same branch.
        overflow = distributed.global_count(found, updates, groups=groups).to(found.device) > 0
        # The inner kernel always runs (no host sync to branch on); its results are then selected on device.
        if tree.is_functional():  # nothing is written: no copy to keep
            before = state.inner_state
            # The inner results of a skipped step are discarded, but autograd still sends them a zero
            # cotangent, and 0 * inf = NaN in their backward (a hyperparameter's gradient): the inner
            # transform sees zeros on overflow instead.
            updates = tree.put(updates, updates, tree.zero_where_(overflow, local))
        else:  # the inner kernel writes into its state: keep a copy to restore
            before = tree.clone(state.inner_state)
        updates, inner_state = call_(inner, updates, state.inner_state, params, extra_args)
        # The norm of what was skipped (out of place the inner stack saw zeros on overflow).
        seen = seen_grad_norm(report(inner_state), overflow, local, fed_zeros=tree.is_functional())
        inner_state = select(~overflow, inner_state, before, what="inner state", seen=seen)
        # -0.0 on a skipped step (params stay bit-identical, -0.0 included); on local pieces: Partial
        # gradients stay Partial.
        updates = tree.put(updates, updates, skip_where_(overflow, tree.leaves(updates)))
        loss_scale = scaler.adjust_(state.loss_scale, overflow)
        skipped = tree.copy_([state.skipped], [overflow])[0]
        return updates, AmpCastState(loss_scale, skipped, inner_state)

    def wrap(loss_fn, state):
        fn = wrap_loss(inner, loss_fn, state.inner_state)
        scale = state.loss_scale.scale if scaler.scaled else None
        ranks = data_ranks if scale is not None else 1

        def amp_loss(params, batch):
            if ranks != 1:  # the backward in compute dtype at scale / ranks, the master gradients at scale
                params = tree.map(lambda p: _TimesInBackward.apply(p, ranks) if _floating(p) else p, params)
            objective, (loss, aux) = fn(policy.cast_to_compute(params), policy.cast_to_compute(batch))
            objective = policy.cast_to_output(objective)
            if scale is not None:  # GradScaler.scale: a 0-dim float32 product, so a float16 loss does not overflow here
                objective = objective * (scale if ranks == 1 else scale / ranks)
            return objective, (policy.cast_to_output(loss), aux)

        return amp_loss

    def fused(grads, state, params, bind_inner):
        """The inner stack's fused kernel (:mod:`fxtrain.transforms._fused`) with this update around it: the
        foreach path's unscale and overflow decision on the placed gradients, the decision as the kernel's
        ``found_inf`` (torch's kernels then leave params and moments as they were), the small state the
        kernel's caller writes (counts, injected hyperparameters) put back on overflow, the scale adjusted."""
        if policy.param_dtype in _HALF:
            # Pure half precision (apex O3): torch's kernels compute in float32 and round once to the params'
            # dtype, the foreach path rounds every op's result in it: other numbers (float16 SGD steps of the
            # whole update size apart), so these policies keep the foreach path.
            return None
        if not scaler.scaled:  # bf16, f32: the inner update on the gradients as they are
            return bind_inner(grads, state.inner_state, params)
        flags = []

        def pre(local, placed):
            found = _unscale_(local, state.loss_scale.scale)
            overflow = distributed.global_count(found, placed, groups=groups).to(found.device) > 0
            flags.append(overflow)
            return overflow.to(torch.float32)  # the kernels skip on exactly 1.0

        plan = bind_inner(grads, state.inner_state, params, pre=pre)
        if plan is None:
            return None

        def run():
            kept = _small(state.inner_state)
            before = [(x, x._version, x.clone()) for x in kept]
            plan()
            overflow = flags.pop() if flags else torch.zeros((), dtype=torch.bool, device=state.skipped.device)
            for x, (y, version, old) in zip(_small(state.inner_state), before):
                if x is not y or x._version != version:  # written or replaced by this update: restored on overflow
                    x.copy_(torch.where(overflow.to(x.device), old, x))
            scaler.adjust_(state.loss_scale, overflow)
            state.skipped.copy_(overflow)

        return run

    return with_traits(GradientTransformation(init_fn, update_fn), wrap_loss=wrap, fused=fused_around(inner, fused),
                       **forwarded(inner))


_HALF = (torch.float16, torch.bfloat16)


def _small(state: Any) -> list[torch.Tensor]:
    """The 0-dim tensors (local pieces) of an inner state a fused kernel's caller writes outside the kernel: counts,
    injected hyperparameters; not the ``grad_norm`` it reports (on overflow, the norm of what was skipped)."""
    norm = report(state).get("grad_norm")
    norm = None if norm is None else tree.local(norm)
    return [x for x in map(tree.local, tree.leaves(state))
            if isinstance(x, torch.Tensor) and x.ndim == 0 and x is not norm]


_factory.__name__ = _factory.__qualname__ = "amp_cast"  # the name the decorator prints
_amp_cast = transform(elementwise=False)(_factory)


def amp_cast(inner: GradientTransformation, policy: str | Policy = "params=float32,compute=bfloat16,output=float32",
             loss_scale: Any = None, *, groups: Sequence[Any] = (), allow_fp16: bool = False,
             data_ranks: int = 1) -> GradientTransformation:
    r"""Mixed precision around a gradient transformation: cast the forward pass, scale the loss, skip overflows.

    Forward (through ``wrap_loss``, run by :func:`fxtrain.train_step`): params and the floating-point
    leaves of the batch are cast to ``policy.compute_dtype``; the loss comes out cast to
    ``policy.output_dtype`` and is differentiated as ``loss * scale`` (``metrics["loss"]`` stays unscaled).
    Gradients flow back through the casts to the master params in their own dtype.

    Update, with :math:`s` the current scale:

    1. :math:`g \leftarrow g / s` with ``torch._amp_foreach_non_finite_check_and_unscale_`` on the local
       pieces (grouped by device and dtype), which also flags non-finite values; out of place (the pure
       ``update`` under ``vmap``, ``grad`` or autograd) the same math with ordinary ops: ``g`` times the
       float32 inverse of :math:`s`, finiteness with :func:`fxtrain.tree.all_finite`;
    2. ``overflow``: the flag summed over every rank and mesh that holds a piece of the tree
       (:func:`fxtrain.distributed.global_count`), so every rank takes the same decision;
    3. the inner transform runs; on overflow its updates are replaced by ``-0.0`` (``p + -0.0`` is ``p``
       bit for bit, ``-0.0`` included) and its state by a copy taken before it ran (bit-identical, but for
       the ``grad_norm`` it reports: the norm of the gradients skipped, inf or NaN, so that metrics say
       what happened), selected with ``torch.where`` on device (no host sync); out
       of place it sees zero gradients on overflow, so gradients through a skipped step are zero, not NaN;
    4. the loss scale adjusts (:class:`DynamicLossScale`).

    With ``loss_scale='none'`` (bf16, f32) steps 1-4 are skipped: the inner transform sees the
    gradients as they are. Cost of not syncing with the host: the inner state is copied once per update
    and the updates and state are selected elementwise, skipped or not.

    Use it inside :func:`fxtrain.accumulate` (``accumulate(amp_cast(...), every=k)``): all micro-batches
    of a window then share one scale, and the summed gradients are unscaled and checked once, so an
    overflow in any micro-batch skips that window's update and backs the scale off once.

    Args:
      inner: the transform to run on unscaled, finite gradients (e.g. ``chain(clip_by_global_norm(1.0),
        adamw(...))``: clipping sees unscaled gradients).
      policy: a :class:`Policy`, its string (jmp grammar), or a preset's name (``"off"``, ``"bf16"``,
        ``"fp16"``, ``"naive_fp16"``, ``"pure_bf16"``, ``"pure_fp16"``: the preset's policy and, unless
        ``loss_scale`` is given, its loss scale; see :data:`PRESETS`). The default computes in bf16 with
        float32 params and loss.
      loss_scale: ``None`` (the default: ``'dynamic'`` when the policy has a float16 dtype, else
        ``'none'``), ``'none'``, ``'dynamic'`` (``DynamicLossScale()``), a positive number (static
        scale), a mapping of :class:`DynamicLossScale` arguments (what a Hydra config gives), or a
        :class:`NoLossScale` / :class:`StaticLossScale` / :class:`DynamicLossScale`.
      groups: process groups (or 1-D meshes) over which the overflow decision must also agree, beyond
        the meshes of DTensor gradients: the data-parallel group when plain-tensor gradients are
        all-reduced *inside* ``inner``, pipeline stages. See :func:`fxtrain.distributed.global_sum_sq`.
      allow_fp16: accept dynamic scaling with float16 master params (refused by default, as
        ``torch.amp.GradScaler`` does).
      data_ranks: how many ranks each differentiate the mean loss of their own share of the batch, the
        gradients then averaged over them (``Partial("avg")``, DDP's and FSDP's way). A rank's gradient is
        then up to ``data_ranks`` times one process's (a token frequent in one share only, an expert's sum
        over its ep group's tokens), so its low-precision backward overflows where one process's does not:
        the loss is multiplied by ``scale / data_ranks``, which keeps each rank's backward at one process's
        magnitude, and the gradients times ``data_ranks`` as they reach the master params (in their dtype:
        exact for a power of two), so they, ``accumulate``'s held sums and checkpoints mean what they mean
        without it. Only where ``amp_cast`` casts the params (not under FSDP's ``MixedPrecisionPolicy``).

    Returns:
      A transform with an :class:`AmpCastState`; :func:`fxtrain.train_step` reports ``loss_scale`` and
      ``skipped`` (0/1) from it, along with what the inner state reports.

    Raises:
      ValueError: a malformed policy or loss scale (naming the bad part); dynamic scaling with float16
        params without ``allow_fp16``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.amp_cast(fx.sgd(1.0), "p=f32,c=f16,o=f32", loss_scale=fx.DynamicLossScale(init_scale=4.0))
        >>> tx
        amp_cast(policy='p=f32,c=f16,o=f32', loss_scale=DynamicLossScale(init_scale=4.0), sgd(1.0))
        >>> step = fx.train_step(lambda p, x: (p["w"] * x).sum(), tx)
        >>> params = {"w": torch.zeros(2)}
        >>> state = tx.init(params)
        >>> for x in [1.0, float("inf"), 1.0]:
        ...     params, state, m = step(params, state, torch.full((2,), x))
        ...     print(params["w"].tolist(), m["loss_scale"].item(), m["skipped"].item())
        [-1.0, -1.0] 4.0 0
        [-1.0, -1.0] 2.0 1
        [-2.0, -2.0] 2.0 0
    """
    if loss_scale is None and isinstance(policy, str) and policy.strip() in PRESETS:
        loss_scale = PRESETS[policy.strip()][1]  # a preset by name: its loss scale too
    policy = Policy.parse(policy)
    kwargs: dict[str, Any] = {"policy": policy}
    if loss_scale is not None:
        kwargs["loss_scale"] = _as_loss_scale(loss_scale, policy)
    if groups:
        kwargs["groups"] = tuple(groups)
    if allow_fp16:
        kwargs["allow_fp16"] = True
    if not (isinstance(data_ranks, int) and not isinstance(data_ranks, bool) and data_ranks >= 1):
        raise ValueError(f"amp_cast: data_ranks={data_ranks!r} must be an integer >= 1 (the data-parallel degree)")
    if data_ranks != 1:
        kwargs["data_ranks"] = data_ranks
    return _amp_cast(inner, **kwargs)


public_factory(amp_cast)  # public factory: the conformance test needs a case for it


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class _TimesInBackward(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``n`` (torch.func-compatible)."""

    @staticmethod
    def forward(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.n = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.n, None


def _unscaled(xs: list[torch.Tensor], scale: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``xs / scale`` as new tensors and the 0-dim float32 non-finite flag: :func:`_unscale_` out of place.

    The same numbers as GradScaler's kernel: ``x`` times the float32 inverse, computed in float32 (or
    float64) and rounded once to ``x``'s dtype; the flag says whether any input element is not finite.
    """
    inv = scale.double().reciprocal().float()  # GradScaler.unscale_'s inverse
    out = [(x.to(torch.promote_types(x.dtype, torch.float32)) * inv).to(x.dtype) for x in xs]
    return out, (~tree.all_finite(xs)).to(torch.float32).to(scale.device)


def _unscale_(xs: list[torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    """Divides ``xs`` by ``scale`` in place; returns a 0-dim float32 flag, > 0 if any element is not finite."""
    inv = scale.double().reciprocal().float()  # GradScaler.unscale_'s inverse
    found = torch.zeros((), dtype=torch.float32, device=scale.device)
    if not xs:
        return found
    # The kernel wants one device per call (and one dtype for its fast path): GradScaler groups the same way.
    for (device, _), ((group,), _) in _group_tensors_by_device_and_dtype([xs]).items():
        if device == found.device:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        else:
            here = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, here, inv.to(device))
            found += here.to(found.device)
    return found


# --- presets ------------------------------------------------------------------------------------------

PRESETS: dict[str, tuple[str, Any]] = {
    "off": ("off", "none"),  # no cast: a float64 run stays float64 end to end
    "bf16": ("p=f32,c=bf16,o=f32", "none"),
    "fp16": ("p=f32,c=f16,o=f32", DynamicLossScale()),
    "naive_fp16": ("p=f32,c=f16,o=f32",
                   DynamicLossScale(init_scale=2.0 ** 32, growth_interval=1000, hysteresis=2, min_scale=1.0)),
    "pure_bf16": ("p=bf16,c=bf16,o=bf16", "none"),
    "pure_fp16": ("p=f16,c=f16,o=f16", "none"),
}


def amp_preset(name: str) -> dict[str, Any]:
    """``amp_cast`` keyword arguments for one of the seeds' modes (the table in this module's docstring).

    >>> import fxtrain as fx
    >>> kwargs = fx.amp_preset("naive_fp16")
    >>> kwargs["policy"], kwargs["loss_scale"]
    ('p=f32,c=f16,o=f32', DynamicLossScale(init_scale=4294967296.0, growth_interval=1000, hysteresis=2, min_scale=1.0))
    >>> tx = fx.amp_cast(fx.sgd(0.1), **kwargs)
    """
    if name not in PRESETS:
        raise ValueError(f"amp_preset: unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    policy, loss_scale = PRESETS[name]
    return {"policy": policy, "loss_scale": loss_scale}
