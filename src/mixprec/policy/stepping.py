"""How a :class:`~mixprec.policy.policy.Policy` steps its optimizers: GradScaler's recipe (unscale,
skip on non-finite gradients, clip, step, one scale update), the finite check where no scaler
runs, and the statistics of every step. :meth:`Policy.step` is :func:`step_optimizers` then
:func:`end_step`; a loop whose optimizers step at different points of one training step (the script
agent's) calls the first for each and the second once."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mixprec.errors import NonFiniteGradientsError, PolicyError, ScaleCollapseError, UnsupportedError
from mixprec.policy.scaler import (
    ScalerOptions,
    check_persistent_skips,
    check_scale_collapse,
    nonfinite_parameter_names,
    nonfinite_weights_error,
    values,
)

Policy = Any  # mixprec.policy.policy.Policy (which imports this module)


def step_optimizers(
    policy: Policy,
    opts: list[torch.optim.Optimizer],
    *,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
) -> list[bool]:
    """The first half of :meth:`step`: unscale, clip and step (or skip) each optimizer, without
    updating the scale or the statistics; per optimizer, whether its gradients were non-finite
    (its step skipped). A loop whose optimizers step at different points of one training step
    (the script agent's) calls this for each, then :meth:`end_step` once."""
    for name, value in (("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
        ):
            raise PolicyError(f"{name} must be a finite number > 0 or None, got {value!r}.")
    clipping = clip_grad_norm is not None or clip_grad_value is not None
    if policy.scaler is not None and policy.scaler._scale is None:
        raise PolicyError(
            f"step() under {policy.name!r} before any scaled backward: call policy.backward(loss) "
            "instead of loss.backward() so the loss is scaled."
        )

    if policy.scaler is not None and not clipping:
        for i, o in enumerate(opts):
            try:
                policy.scaler.step(o)
            except AssertionError as exc:
                if "No inf checks were recorded" not in str(exc):
                    raise  # the optimizer's own assertion, not GradScaler's missing backward
                raise PolicyError(
                    f"step() found no gradient in optimizer {i} under {policy.name!r}: call "
                    "policy.backward(loss) before every policy.step(optimizer) (zero_grad(set_to_none"
                    "=True) since the last backward leaves nothing to step)."
                ) from exc
            except NotImplementedError as exc:
                _refuse_sparse_half_step(exc, o, policy.name, policy.param_names)
                raise
        found_host = [policy.scaler.found_inf_host(o) for o in opts]  # (read once, by its step)
    else:
        total_norm = _finite_total_norm(policy, opts) if clip_grad_norm is not None else None
        if total_norm is not None:
            found_host = [False] * len(opts)
        else:
            found_host = [bool(f) for f in _find_nonfinite(policy, opts)]  # the one host read per step
        # Clip only what will be stepped: a non-finite gradient would turn the shared norm into
        # NaN and wipe out the update of the optimizers whose gradients are fine.
        stepping = (
            [
                p
                for o, found in zip(opts, found_host, strict=True)
                if not found
                for g in o.param_groups
                for p in g["params"]
                if p.grad is not None
            ]
            if clipping
            else []
        )
        if stepping and total_norm is not None and clip_grad_norm is not None:
            # clip_grad_norm_ is exactly these two calls: the norm is computed once.
            torch.nn.utils.clip_grads_with_norm_(stepping, clip_grad_norm, total_norm)
        elif stepping and clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(stepping, clip_grad_norm)
        if stepping and clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(stepping, clip_grad_value)
        for o, found in zip(opts, found_host, strict=True):
            try:
                if policy.scaler is not None:
                    policy.scaler.step(o)  # skips by itself on non-finite gradients
                elif not found:
                    o.step()
            except NotImplementedError as exc:
                _refuse_sparse_half_step(exc, o, policy.name, policy.param_names)
                raise

    return found_host


def end_step(
    policy: Policy,
    opts: Sequence[torch.optim.Optimizer],
    found_host: Sequence[bool],
    *,
    update: bool = True,
) -> bool:
    """The second half of :meth:`step`: one scale update for everything
    :meth:`step_optimizers` stepped since the last one, and the statistics of the step; returns
    whether every optimizer stepped. ``update=False``: the scale was updated since the last of
    ``opts`` stepped (:func:`update_scale`, inside a step whose optimizers step more than once)."""
    skipped = any(found_host)
    if skipped:
        params = [p for o in opts for g in o.param_groups for p in g["params"]]
        policy.stats.last_nonfinite_params = nonfinite_parameter_names(params, policy.param_names)
    scale_before = None
    if policy.scaler is not None:
        if skipped and policy.config.scaler.min_scale is not None:
            scale_before = policy.scaler.get_scale()
        if update:
            update_scale(policy, skipped)
        policy.stats.record_scale(policy.stats.steps, policy.scaler._scale)

    policy.stats.steps += 1
    if skipped:
        policy.stats.skipped_steps += 1
        policy.stats.consecutive_skips += 1
        policy.stats.last_skipped_step = policy.stats.steps - 1
        try:
            if scale_before is not None:
                check_scale_collapse(policy.stats, policy.config.scaler, scale_before)
            if policy.scaler is None:
                check_persistent_skips(policy.stats)
        except (ScaleCollapseError, NonFiniteGradientsError):
            # Before blaming the gradients: NaN weights (fp16 Adam's eps rounded to 0, say) make
            # every gradient NaN at any scale. Read only here, so a skip costs nothing more.
            weights = nonfinite_weights_error(opts, policy.param_names, policy.stats, policy.name)
            if weights is not None:
                raise weights from None
            raise
    else:
        policy.stats.skips_at_min_scale = 0
        policy.stats.consecutive_skips = 0
    return not skipped


def update_scale(policy: Policy, skipped: bool) -> None:
    """GradScaler's update of the scale (from what it found since the last), kept at or above the
    policy's ``min_scale``; no step is counted (:func:`end_step` counts them)."""
    policy.scaler.update()
    options: ScalerOptions = policy.config.scaler
    if skipped and options.min_scale is not None:
        # Only a skip lowers the scale, so only then can it cross the floor.
        policy.scaler._scale.clamp_(min=options.min_scale)


def _finite_total_norm(policy: Policy, opts: list) -> torch.Tensor | None:
    """The gradients' total 2-norm, as ``clip_grad_norm_`` computes it, when it is finite and a
    finite check is due (``finite_check``, no scaler); else None.

    The clip's own norm is the finite check: any inf or NaN gradient makes it non-finite, so a
    finite norm spares the separate pass over every gradient (its one host read is the check's).
    A non-finite norm (or one that overflowed from finite gradients) returns None, and the exact
    per-optimizer check decides."""
    if policy.scaler is not None or not policy.config.finite_check:
        return None
    grads = [p.grad for o in opts for g in o.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return None
    total_norm = torch.nn.utils.get_total_norm(grads)
    # bf16 DTensor gradient shards (FSDP2): the global norm, identical on every rank
    whole = total_norm.full_tensor() if hasattr(total_norm, "full_tensor") else total_norm
    return total_norm if math.isfinite(float(whole)) else None


def _find_nonfinite(policy: Policy, opts: list) -> list[torch.Tensor | bool]:
    """Per optimizer: a device tensor (or False) telling whether its gradients are non-finite.

    With a scaler this is ``unscale_`` (the gradients are unscaled in place for clipping)."""
    found: list[torch.Tensor | bool] = []
    if policy.scaler is not None:
        for o in opts:
            policy.scaler.unscale_(o)
            found.append(policy.scaler.found_inf(o))
        return found
    if not policy.config.finite_check:
        return [False] * len(opts)
    for o in opts:
        flag = torch.zeros((), dtype=torch.float32, device=policy.device)
        opt_params = [p for g in o.param_groups for p in g["params"]]
        for (device, _), grads in _grads_by_device_and_dtype(opt_params).items():
            found_here = _nonfinite_flag(grads, device)
            if hasattr(found_here, "full_tensor"):
                # bf16 DTensor gradient shards (FSDP2): the global answer, identical on every rank
                found_here = found_here.full_tensor()
            flag += found_here.to(policy.device)
        found.append(flag)
    return found


def _grads_by_device_and_dtype(params: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(values(p.grad))
    return groups


def _nonfinite_flag(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d float tensor on ``device``: > 0 when any gradient holds inf/NaN. No host sync."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    if grads[0].dtype in (torch.float32, torch.float16):
        # The fused check GradScaler uses, with an inverse scale of exactly 1 (x * 1.0 == x).
        one = torch.ones((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, one)
        return flag
    # bf16 gradients (bf16-true): the fused kernel only takes fp32/fp16.
    return torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any().float()


_KERNEL_DTYPES = {"Half": torch.float16, "BFloat16": torch.bfloat16}  # torch's names in its errors


def _refuse_sparse_half_step(
    exc: NotImplementedError, optimizer: torch.optim.Optimizer, policy: str, names: dict[int, str]
) -> None:
    """Raise :class:`UnsupportedError` from torch's ``"cadd_sparse" not implemented for 'Half'`` (and
    the like) when ``optimizer`` steps half-precision weights with sparse gradients: torch lacks half
    kernels for some sparse ops on some devices (SGD's momentum buffer of an
    ``nn.Embedding(sparse=True)`` weight, fp16 on a CPU, from the second step on). Returns when
    ``exc`` is another error."""
    dtype = next((t for n, t in _KERNEL_DTYPES.items() if f"not implemented for '{n}'" in str(exc)), None)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sparse = [
        (names.get(id(p), f"param[{i}]"), p)
        for i, p in enumerate(params)
        if p.grad is not None and p.grad.is_sparse and p.dtype == dtype
    ]
    if not sparse:
        return
    more = f" (+{len(sparse) - 4} more)" if len(sparse) > 4 else ""
    shown = ", ".join(repr(name) for name, _ in sparse[:4]) + more
    fmt = str(dtype).removeprefix("torch.")
    mixed = f"{policy.removesuffix('-true')}-mixed" if policy.endswith("-true") else "a *-mixed policy"
    raise UnsupportedError(
        f"{type(optimizer).__name__} cannot step the sparse gradients of {shown} under {policy!r}: torch "
        f"has no {fmt} kernel on {sparse[0][1].device.type} for an op its update needs "
        f"({str(exc).splitlines()[0]}), e.g. SGD's momentum buffer of a sparse gradient; use {mixed} "
        "(its fp32 master weights are stepped in fp32), SGD without momentum, or a dense gradient "
        "(nn.Embedding(..., sparse=False))."
    ) from exc
