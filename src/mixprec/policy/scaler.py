"""Dynamic loss scaling: torch.amp.GradScaler's arithmetic, plus the accounting it lacks.

The scale arithmetic is GradScaler's own (we subclass it), so a loop through mixprec leaves
bitwise the same weights and scale as a loop written with GradScaler directly. On top:
skip statistics, a bounded scale history, the names of the parameters that overflowed, and a
``min_scale`` floor that raises :class:`ScaleCollapseError` instead of skipping forever (for
policies without a scaler, ``finite_check`` raises :class:`NonFiniteGradientsError` after
:data:`MAX_CONSECUTIVE_SKIPS` skipped steps in a row).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from mixprec.errors import NonFiniteGradientsError, NonFiniteWeightsError, PolicyError, ScaleCollapseError


@dataclass(frozen=True)
class ScalerOptions:
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    # GradScaler lets the scale fall towards 0; below 1 fp16 gradients only lose range.
    min_scale: float | None = 1.0
    # Consecutive overflowing steps at the floor before we call the scale collapsed.
    max_skips_at_min_scale: int = 3

    def validate(self) -> None:
        def bad(option: str, value: object, rule: str) -> PolicyError:
            return PolicyError(f"Invalid loss-scaler option {option}={value!r}: {rule}.")

        if not (_is_number(self.init_scale) and math.isfinite(self.init_scale) and self.init_scale > 0):
            raise bad("init_scale", self.init_scale, "must be a finite number > 0, e.g. 65536.0")
        if not (
            _is_number(self.growth_factor) and math.isfinite(self.growth_factor) and self.growth_factor > 1.0
        ):
            raise bad("growth_factor", self.growth_factor, "must be a finite number > 1.0, e.g. 2.0")
        if not (_is_number(self.backoff_factor) and 0.0 < self.backoff_factor < 1.0):
            raise bad("backoff_factor", self.backoff_factor, "must be a number in (0, 1), e.g. 0.5")
        if not (_is_int(self.growth_interval) and self.growth_interval >= 1):
            raise bad("growth_interval", self.growth_interval, "must be an integer >= 1, e.g. 2000")
        if self.min_scale is not None and not (
            _is_number(self.min_scale) and 0 < self.min_scale <= self.init_scale
        ):
            raise bad(
                "min_scale", self.min_scale, f"must be None or a number in (0, init_scale={self.init_scale}]"
            )
        if not (_is_int(self.max_skips_at_min_scale) and self.max_skips_at_min_scale >= 1):
            raise bad(
                "max_skips_at_min_scale", self.max_skips_at_min_scale, "must be an integer >= 1, e.g. 3"
            )


# Policies without a loss scaler but with finite_check=True raise NonFiniteGradientsError after
# this many consecutive skipped steps: a transient spike skips a step or two, a model whose
# gradients stay non-finite would otherwise skip forever without training.
MAX_CONSECUTIVE_SKIPS = 20


def _is_number(value: object) -> bool:
    """An int or float, and not a bool (True is 1 to Python, never a scale or a factor here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def scaler_state_problem(state: object) -> str:
    """What is wrong with a GradScaler ``state_dict`` (types and ranges), or '' when it is valid."""
    if not isinstance(state, dict):
        return f"'scaler' must be a dict (GradScaler.state_dict()), got {type(state).__name__}"
    rules: dict[str, tuple[Any, str]] = {
        "scale": (lambda v: _is_number(v) and math.isfinite(v) and v > 0, "a finite number > 0"),
        "growth_factor": (lambda v: _is_number(v) and math.isfinite(v) and v > 1, "a finite number > 1"),
        "backoff_factor": (lambda v: _is_number(v) and 0 < v < 1, "a number in (0, 1)"),
        "growth_interval": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
        "_growth_tracker": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    }
    for key, (ok, rule) in rules.items():
        if key not in state:
            return f"scaler state lacks {key!r}"
        if not ok(state[key]):
            return f"scaler {key}={state[key]!r} must be {rule}"
    return ""


class _GradScaler(torch.amp.GradScaler):
    """GradScaler that may unscale fp16 gradients (fp16-true keeps fp16 parameters)."""

    def __init__(self, device: str, options: ScalerOptions, allow_fp16_grads: bool) -> None:
        super().__init__(
            device,
            init_scale=options.init_scale,
            growth_factor=options.growth_factor,
            backoff_factor=options.backoff_factor,
            growth_interval=options.growth_interval,
        )
        self._allow_fp16_grads = allow_fp16_grads
        # optimizer id: whether its inf flag was set, as GradScaler's step() read it (see below)
        self._found_read: dict[int, bool] = {}

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        allow_fp16 = allow_fp16 or self._allow_fp16_grads
        complex_params = [
            p
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and p.grad.is_complex()
        ]
        if not complex_params:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # GradScaler's fused check-and-unscale kernel has no complex dtypes ("not implemented for
        # 'ComplexFloat'"): the real parameters go through it as usual, the complex ones through
        # their real view (the same storage, so unscaled in place; inf/NaN in either part counts).
        skip = {id(p) for p in complex_params}
        real = SimpleNamespace(
            param_groups=[
                {**g, "params": [p for p in g["params"] if id(p) not in skip]} for g in optimizer.param_groups
            ]
        )
        found = super()._unscale_grads_(real, inv_scale, found_inf, allow_fp16)
        groups: dict[tuple, list[torch.Tensor]] = {}
        with torch.no_grad():
            for p in complex_params:
                if p.grad.is_sparse:
                    p.grad = p.grad.coalesce()
                grad = p.grad._values() if p.grad.is_sparse else p.grad
                groups.setdefault((grad.device, grad.dtype), []).append(torch.view_as_real(grad))
            for (device, _), grads in groups.items():
                if device not in found:
                    found[device] = found_inf.to(device=device, non_blocking=True, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv_scale.to(device))
        return found

    def _maybe_opt_step(
        self, optimizer: Any, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        # GradScaler's own: one host read of the inf flag, then the step or not. The value is kept
        # for found_inf_host: read again after the step, the flag waited for the optimizer's kernels
        # queued behind it (the H200's sync debug mode: two reads a step, one of them a stall)
        found = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self._found_read[id(optimizer)] = found
        return None if found else optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        self._found_read.clear()  # (a step's flags, read or not, end with its scale update)
        super().update(new_scale)

    def found_inf_host(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s last step found inf/NaN: the value :meth:`step` read (no second
        read), else the flag read now (a fused optimizer takes the flag into its kernel unread)."""
        found = self._found_read.pop(id(optimizer), None)
        return bool(self.found_inf(optimizer)) if found is None else found

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Device tensor > 0 when ``optimizer``'s gradients had inf/NaN (after ``unscale_``)."""
        per_device = list(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        if len(per_device) == 1 and per_device[0].device == self._scale.device:  # type: ignore[union-attr]
            return per_device[0]  # the common case: no extra kernel on the step's hot path
        return sum(v.to(self._scale.device, non_blocking=True) for v in per_device)  # type: ignore[union-attr,return-value]


@dataclass
class StepStats:
    """Counters of a Policy. Host integers only change on ``step()``; the scale is read lazily."""

    history_len: int = 1000
    steps: int = 0
    skipped_steps: int = 0
    last_skipped_step: int | None = None
    last_nonfinite_params: list[str] = field(default_factory=list)
    skips_at_min_scale: int = 0  # consecutive
    consecutive_skips: int = 0  # skipped steps since the last one that stepped
    _scale_history: deque = field(default_factory=deque, repr=False)
    _scale_source: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._scale_history = deque(self._scale_history, maxlen=self.history_len)

    def record_scale(self, step: int, scale: torch.Tensor) -> None:
        # A device-side copy: no host-device synchronisation until someone reads the history.
        self._scale_history.append((step, scale.detach().clone()))

    @property
    def scale(self) -> float | None:
        return None if not self._scale_history else float(self._scale_history[-1][1])

    @property
    def scale_history(self) -> list[tuple[int, float]]:
        """(step, scale after that step's update), oldest first, at most ``history_len`` entries."""
        return [(s, float(t)) for s, t in self._scale_history]

    @property
    def skip_rate(self) -> float:
        return self.skipped_steps / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "skip_rate": self.skip_rate,
            "scale": self.scale,
            "last_skipped_step": self.last_skipped_step,
            "last_nonfinite_params": list(self.last_nonfinite_params),
            "skips_at_min_scale": self.skips_at_min_scale,
            "consecutive_skips": self.consecutive_skips,
            "scale_history": self.scale_history,
        }

    def state_dict(self) -> dict[str, object]:
        """:meth:`as_dict` less what it derives (``skip_rate``, ``scale``)."""
        return {k: v for k, v in self.as_dict().items() if k not in ("skip_rate", "scale")}

    @staticmethod
    def state_problem(state: object) -> str:
        """What is wrong with a :meth:`state_dict` (keys, types, ranges), or '' when it is valid."""
        if not isinstance(state, dict):
            return f"'stats' must be a dict (StepStats.state_dict()), got {type(state).__name__}"
        for key in ("steps", "skipped_steps", "skips_at_min_scale", "consecutive_skips"):
            if key not in state and key != "consecutive_skips":  # absent in older checkpoints
                return f"stats lack {key!r}"
            value = state.get(key, 0)
            if not (_is_int(value) and value >= 0):
                return f"stats {key}={value!r} must be an integer >= 0"
        if state["skipped_steps"] > state["steps"]:
            return f"stats skipped_steps={state['skipped_steps']} exceeds steps={state['steps']}"
        last = state.get("last_skipped_step")
        if last is not None and not (_is_int(last) and 0 <= last < state["steps"]):
            return f"stats last_skipped_step={last!r} must be None or a step index below steps"
        names = state.get("last_nonfinite_params", [])
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            return f"stats last_nonfinite_params={names!r} must be a list of parameter names"
        history = state.get("scale_history", [])
        if not isinstance(history, list) or not all(
            isinstance(e, (list, tuple))
            and len(e) == 2
            and _is_int(e[0])
            and _is_number(e[1])
            and math.isfinite(e[1])
            for e in history
        ):
            return "stats scale_history must be a list of (step, finite scale) pairs"
        return ""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; validated first, so a bad one raises and loads nothing."""
        problem = self.state_problem(state)
        if problem:
            raise PolicyError(f"Invalid policy state: {problem}.")
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.last_skipped_step = state.get("last_skipped_step")
        self.last_nonfinite_params = list(state.get("last_nonfinite_params", []))
        self.skips_at_min_scale = int(state["skips_at_min_scale"])
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self._scale_history.clear()
        for step, scale in state.get("scale_history", []):
            self._scale_history.append((int(step), torch.tensor(float(scale))))


def values(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's values: a sparse one's stored values (``nn.Embedding(sparse=True)``: dense ops
    like ``!=`` and ``isfinite`` do not run on the sparse layout), a dense one as it is."""
    return grad.coalesce().values() if grad.is_sparse else grad


def dense(grad: torch.Tensor) -> torch.Tensor:
    """A gradient laid out like its weight (a sparse one densified), for element-wise comparisons
    with the weight; read on sampled or checked steps only."""
    return grad.to_dense() if grad.is_sparse else grad


@torch.no_grad()
def rounded_away(before: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
    """(weights the update left bit-identical though their gradient was non-zero, weights with a
    non-zero gradient) over ``(parameter, its value before the update)`` pairs: half-precision
    updates that round away (a stall)."""
    stalled = total = 0
    for p, old in before:
        if p.grad is None:
            continue
        moved = dense(p.grad) != 0
        stalled += int(((p.detach() == old) & moved).sum())
        total += int(moved.sum())
    return stalled, total


def _has_nonfinite(grad: torch.Tensor) -> bool:
    if hasattr(grad, "full_tensor"):
        # A sharded DTensor gradient (FSDP2): ask the whole tensor, so every rank reports the same
        # names. Only skipped steps get here, so the gather's cost does not matter.
        grad = grad.full_tensor()
    return not bool(torch.isfinite(values(grad)).all())


def nonfinite_parameter_names(params: Sequence[torch.nn.Parameter], names: dict[int, str]) -> list[str]:
    """Names of the parameters whose gradient holds inf or NaN (synchronises; call on skips only)."""
    return [
        names.get(id(p), f"param[{i}]")
        for i, p in enumerate(params)
        if p.grad is not None and _has_nonfinite(p.grad)
    ]


def _eps_rounds_away(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> str:
    """Why ``optimizer``'s eps cannot guard its division in ``param``'s half dtype (Adam's default
    1e-8 is 0 in fp16: where the squared gradient underflows to 0 the update is m/0), or ''."""
    eps, dtype = group.get("eps"), param.dtype
    if not isinstance(eps, (int, float)) or not _is_number(eps):
        return ""
    if dtype not in (torch.float16, torch.bfloat16) or group.get("fused"):
        return ""  # a fused kernel computes in fp32
    tiny = torch.finfo(dtype).tiny  # the smallest normal number
    if eps >= tiny:
        return ""
    fmt = str(dtype).removeprefix("torch.")
    how = "rounds to 0" if float(torch.tensor(eps, dtype=dtype)) == 0 else f"is subnormal (below {tiny:.2g})"
    floor = f"1e{math.ceil(math.log10(tiny))}"
    return (
        f"{type(optimizer).__name__} eps={eps:g} {how} in {fmt}, so its update divides by (nearly) 0 "
        f"where a squared gradient underflows; pass eps>={floor} ({type(optimizer).__name__}(..., "
        f"eps={floor}))"
    )


def nonfinite_weights_error(
    optimizers: Sequence[torch.optim.Optimizer], names: dict[int, str], stats: StepStats, policy: str
) -> NonFiniteWeightsError | None:
    """The error to raise instead of blaming the gradients when the weights the ``optimizers`` step
    hold inf/NaN (then every loss and gradient is NaN, whatever the scale); None when they are finite.
    Reads every weight: call it only where skipped steps are about to raise."""
    bad: list[tuple[str, torch.Tensor, dict, torch.optim.Optimizer]] = []
    stepped = [(p, group, o) for o in optimizers for group in o.param_groups for p in group["params"]]
    with torch.no_grad():
        for i, (p, group, o) in enumerate(stepped):
            if _has_nonfinite(p.detach()):
                bad.append((names.get(id(p), f"param[{i}]"), p, group, o))
    if not bad:
        return None
    first, param, group, optimizer = bad[0]
    more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
    half = param.dtype in (torch.float16, torch.bfloat16)
    mixed = f"{policy.removesuffix('-true')}-mixed" if policy.endswith("-true") else "a *-mixed policy"
    if stats.steps == stats.skipped_steps:  # no step was applied: they were non-finite from the start
        what = "The weights were non-finite before any optimizer step"
        fix = (
            f"a value beyond {str(param.dtype).removeprefix('torch.')}'s range becomes inf when prepare() "
            f"casts it: check the model's initial weights, or use {mixed} (fp32 master weights)"
            if half
            else "check the model's initial weights"
        )
    else:
        what = "The weights became non-finite after an optimizer step"
        eps = _eps_rounds_away(optimizer, group, param)
        if eps:
            fix = f"{eps}, or use {mixed}, whose fp32 master weights and optimizer state hold it"
        elif half:
            fix = f"lower the learning rate or clip the gradients, or use {mixed} (fp32 master weights)"
        else:
            fix = "lower the learning rate or clip the gradients (step(optimizer, clip_grad_norm=1.0))"
    return NonFiniteWeightsError(
        f"{what}: {first!r}{more} holds inf/NaN under {policy!r}, so every loss and gradient since is "
        f"NaN and {stats.consecutive_skips} steps in a row were skipped; the gradients are not the cause. "
        f"{fix[0].upper()}{fix[1:]}.",
        parameters=[name for name, *_ in bad],
    )


def _shown_params(stats: StepStats) -> str:
    """The first 8 names of the parameters whose gradients were non-finite, and how many more."""
    names = stats.last_nonfinite_params
    more = f" (+{len(names) - 8} more)" if len(names) > 8 else ""
    return f"{', '.join(names[:8]) or '(none recorded)'}{more}"


def check_persistent_skips(stats: StepStats, limit: int = MAX_CONSECUTIVE_SKIPS) -> None:
    """Raise when a policy without a scaler (finite_check) has skipped ``limit`` steps in a row."""
    if stats.consecutive_skips < limit:
        return
    raise NonFiniteGradientsError(
        f"{stats.consecutive_skips} consecutive optimizer steps skipped on non-finite gradients "
        f"(finite_check=True): training is not recovering; non-finite gradients in: "
        f"{_shown_params(stats)}. Look for the first NaN/inf (mixprec check locates "
        "it), lower the learning rate, or keep those modules in fp32 (keep_fp32=[...]).",
        parameters=list(stats.last_nonfinite_params),
    )


def check_scale_collapse(stats: StepStats, options: ScalerOptions, scale_before: float) -> None:
    """Raise when overflow keeps happening with the scale already at its floor."""
    if options.min_scale is None or scale_before > options.min_scale:
        stats.skips_at_min_scale = 0
        return
    stats.skips_at_min_scale += 1
    if stats.skips_at_min_scale >= options.max_skips_at_min_scale:
        raise ScaleCollapseError(
            f"Loss scale collapsed: {stats.skips_at_min_scale} consecutive steps overflowed with the "
            f"scale at its floor min_scale={options.min_scale}; non-finite gradients in: "
            f"{_shown_params(stats)}. fp16 cannot represent this model's values: "
            "keep those modules in fp32 (keep_fp32=[...]), lower the learning rate, or use bf16-mixed.",
            parameters=list(stats.last_nonfinite_params),
        )
