"""MP3xx: precision mistakes. Losses autocast refuses, an Adam eps that fp16 rounds to zero,
a GradScaler with bf16, half-precision policies on devices that emulate them, and optimizer state
kept in half precision."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from mixprec.linting.context import LintContext
from mixprec.linting.model import Finding, Rule, define_rule
from mixprec.linting.rules.text import dims
from mixprec.policy import check_support
from mixprec.policy.islands import batch_norm_layers, is_fp32_island

PRECISION_RULES: dict[str, Rule] = {}
_rule = partial(define_rule, PRECISION_RULES)

_FP16_TINY = 2.0**-24  # smallest fp16 subnormal: anything below rounds to 0
_FP16_MIN_NORMAL = 2.0**-14


@_rule(
    "MP301",
    "bce-under-autocast",
    "error",
    summary="binary_cross_entropy / BCELoss under autocast: use the with-logits form.",
    rationale=(
        "binary_cross_entropy on probabilities is unsafe in half precision (the sigmoid before "
        "it saturates); CUDA autocast refuses it with a RuntimeError, while CPU autocast runs it, "
        "so code tried on a CPU crashes on the GPU. binary_cross_entropy_with_logits fuses the "
        "sigmoid and is autocast-safe. Error on a CUDA target, warning on CPU; *-mixed policies only."
    ),
    source=(
        "PyTorch AMP docs, Autocast Op Reference ('Prefer binary_cross_entropy_with_logits over "
        "binary_cross_entropy': CUDA ops only)"
    ),
)
def _bce_under_autocast(ctx: LintContext) -> Iterator[Finding]:
    if ctx.policy.spec.autocast_dtype is None:
        return
    seen: set[str | None] = set()
    for call in ctx.trace.calls_named({"binary_cross_entropy"}):
        if call.module in seen:
            continue
        seen.add(call.module)
        where = "in the loss function" if call.module is None else "in the model"
        yield PRECISION_RULES["MP301"].finding(
            "error" if ctx.cuda_target else "warning",
            call.module,
            f"binary_cross_entropy under autocast ({ctx.policy.name}) {where}: "
            + ("raises on CUDA" if ctx.cuda_target else "runs on CPU autocast, raises under CUDA autocast"),
            "return logits and use F.binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss "
            "(drop the sigmoid)",
            shape="binary_cross_entropy on " + ", ".join(dims(t.shape) for t in call.args[:2]),
            details={"scope": "loss_fn"} if call.module is None else {},
        )


@_rule(
    "MP302",
    "adam-eps-fp16",
    "error",
    summary="Adam-style eps below the fp16 range with fp16 parameters divides by zero.",
    rationale=(
        "With fp16 parameters, Adam-family optimizers keep their state in fp16 and add eps to "
        "sqrt(v) in fp16: eps=1e-8 rounds to 0 (the smallest fp16 subnormal is 6e-8), so a "
        "parameter whose gradient history underflows divides by zero. Error below 2^-24, warning "
        "below the smallest normal fp16 (6.1e-5). Mixed policies keep fp32 master weights and "
        "are not affected."
    ),
    source="pytorch/pytorch#8860",
)
def _adam_eps(ctx: LintContext) -> Iterator[Finding]:
    opt = ctx.optimizer
    if opt is None:
        return
    fp16_params = ctx.policy.spec.param_dtype == torch.float16 or any(
        p.dtype == torch.float16 for p in ctx.workload.model.parameters()
    )
    if not fp16_params:
        return
    for i, group in enumerate(opt.param_groups):
        eps = group.get("eps")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps >= _FP16_MIN_NORMAL:
            continue
        zero = eps < _FP16_TINY
        yield PRECISION_RULES["MP302"].finding(
            "error" if zero else "warning",
            None,
            f"{type(opt).__name__} eps={eps:g} "
            + ("rounds to 0 in fp16" if zero else "is subnormal in fp16")
            + " and the parameters are fp16"
            + (f" (param group {i})" if len(opt.param_groups) > 1 else ""),
            "eps=1e-4 (at least 6.1e-5, the smallest normal fp16), or keep fp32 master weights: fp16-mixed",
            details={"optimizer": type(opt).__name__, "eps": eps, "param_group": i, "scope": "optimizer"},
        )


@_rule(
    "MP303",
    "gradscaler-bf16",
    "warning",
    summary="A GradScaler with bf16 only costs time: bf16 has fp32's exponent range.",
    rationale=(
        "Loss scaling exists because fp16 gradients underflow; bf16 has fp32's exponent range, so "
        "a GradScaler with bf16 only adds a host synchronisation and needlessly skipped steps. "
        "Detected when an enabled torch.amp.GradScaler is reachable from the workload (its "
        "attributes, or its functions' closures and globals) and the policy computes in bf16."
    ),
    source="PyTorch automatic mixed precision docs (gradient scaling is for float16)",
)
def _gradscaler_bf16(ctx: LintContext) -> Iterator[Finding]:
    if ctx.dtype != "bf16" or not ctx.grad_scalers:
        return
    yield PRECISION_RULES["MP303"].finding(
        "warning",
        None,
        f"an enabled GradScaler is used with {ctx.policy.name}",
        "drop the GradScaler (mixprec's bf16 policies scale nothing; finite_check=True skips "
        "non-finite steps instead)",
        details={"scalers": len(ctx.grad_scalers), "scope": "GradScaler"},
    )


def _emulated(
    ctx: LintContext, rule: Rule, dtype: torch.dtype, native: bool, severity: str
) -> Iterator[Finding]:
    """MP304/MP305: the policy computes in ``dtype``, which the device lacks (``native`` False).

    Judged against the device the policy runs on: nothing when lint's target is another one.
    """
    if ctx.policy.spec.low_precision_dtype != dtype or ctx.target != ctx.device.type or native:
        return
    support = check_support(ctx.policy.name, ctx.device)
    yield rule.finding(
        severity,
        None,
        f"{ctx.policy.name} on {ctx.device.name}: {support.reason}",
        f"use {support.suggestion or 'fp32'} on this device",
        details={"device": ctx.device.name, "capability": ctx.device.capability, "scope": "policy"},
    )


@_rule(
    "MP304",
    "bf16-not-native",
    "error",
    summary="bf16 on a device without native bf16 is emulated and slower than fp32.",
    rationale=(
        "GPUs before compute capability 8.0 have no bf16 tensor cores: bf16 runs emulated and "
        "slower than fp32, even where torch.cuda.is_bf16_supported() says True "
        "(kubeedge/ianvs#888). CPUs without AVX512-BF16 or AMX emulate bf16 too. Error on a GPU, "
        "warning on a CPU. Judged against the device the policy runs on, so not reported when "
        "lint's target differs from that device."
    ),
    source=(
        "kubeedge/ianvs#888 (emulated bf16 on pre-Ampere GPUs); intel/ai-reference-models#64 "
        "(bf16 on CPUs without it)"
    ),
)
def _bf16_not_native(ctx: LintContext) -> Iterator[Finding]:
    severity = "error" if ctx.device.type == "cuda" else "warning"
    return _emulated(ctx, PRECISION_RULES["MP304"], torch.bfloat16, ctx.device.native_bf16, severity)


@_rule(
    "MP305",
    "fp16-not-native",
    "error",
    summary="fp16 on a device without native fp16 is emulated and far slower than fp32.",
    rationale=(
        "fp16 math needs tensor cores (compute capability >= 7.0) on a GPU and AVX512-FP16 or "
        "AMX-FP16 on a CPU; elsewhere it is emulated: fp16 autocast on an AVX512-BF16 EPYC was "
        "measured about 25x slower than fp32. Judged against the device the policy runs on."
    ),
    source=(
        "mixprec's measurement (ResNet-50 training, AVX512-BF16 AMD EPYC: fp16 autocast ~25x "
        "slower than fp32); intel/ai-reference-models#64"
    ),
)
def _fp16_not_native(ctx: LintContext) -> Iterator[Finding]:
    return _emulated(ctx, PRECISION_RULES["MP305"], torch.float16, ctx.device.native_fp16, "error")


# The per-parameter state each stock torch optimizer allocates like the parameter (zeros_like: its
# dtype), by class name; SGD and Muon keep a momentum buffer only with momentum. Checked by stepping
# each over bf16 parameters (torch 2.14).
_HALF_STATE = {
    "Adam": ("exp_avg", "exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq"),
    "NAdam": ("exp_avg", "exp_avg_sq"),
    "RAdam": ("exp_avg", "exp_avg_sq"),
    "Adamax": ("exp_avg", "exp_inf"),
    "Adafactor": ("row_var", "col_var"),
    "Adagrad": ("sum",),
    "Adadelta": ("square_avg", "acc_delta"),
    "RMSprop": ("square_avg",),
    "Rprop": ("prev", "step_size"),
    "ASGD": ("ax",),
    "LBFGS": ("d", "prev_flat_grad"),
    "SGD": ("momentum_buffer",),
    "Muon": ("momentum_buffer",),
}
_MOMENTUM_ONLY = {"SGD", "Muon"}
_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# What half state loses, measured with torch.optim.AdamW over half parameters.
_LOST = {
    "bf16": "in bf16, 0.999 * exp_avg_sq rounds back to exp_avg_sq: the second moment stops decaying",
    "fp16": "in fp16, a gradient below 5e-3 adds nothing to exp_avg_sq: 1e-3 * grad**2 underflows",
}


def _stored_half(ctx: LintContext) -> dict[int, torch.dtype]:
    """The parameters that train stored in bf16/fp16 (id -> dtype): under a *-true policy all but
    the fp32 islands' and BatchNorm's (``prepare`` keeps those fp32), else those the model holds in half."""
    model, true = ctx.workload.model, ctx.policy.spec.param_dtype
    if true is None:
        return {id(p): p.dtype for p in model.parameters() if p.dtype in _HALF}
    norms = batch_norm_layers(model)
    keep = ctx.policy.config.keep_fp32
    fp32 = {
        id(p)
        for name, module in model.named_modules()
        if name in norms or is_fp32_island(name, keep)
        for p in module.parameters(recurse=False)
    }
    return {id(p): true for p in model.parameters() if p.is_floating_point() and id(p) not in fp32}


@_rule(
    "MP306",
    "half-optimizer-state",
    "warning",
    summary="A stock torch optimizer over bf16/fp16 parameters keeps its state in bf16/fp16 too.",
    rationale=(
        "torch.optim's optimizers allocate their state like the parameter: over bf16 or fp16 "
        "parameters (a *-true policy, or a model given in half precision) Adam's exp_avg and "
        "exp_avg_sq, SGD's momentum buffer and the others are half too, and drop what is small next "
        f"to them: {_LOST['bf16']}; {_LOST['fp16']}. *-mixed policies keep fp32 master weights, "
        "so their optimizer state is fp32. Reported for the stock torch.optim optimizers that keep "
        "state (SGD and Muon with momentum only); the fp32 islands and BatchNorm layers, which *-true "
        "policies keep in fp32, are not counted."
    ),
    source=(
        "NeMo AutoModel, 'Mixed-Precision Training' (do not combine torch.optim.AdamW with bf16 "
        "resident parameters unless bf16 Adam state is accepted); Transformer Engine's FusedAdam "
        "(exp_avg_dtype, exp_avg_sq_dtype, master_weights)"
    ),
)
def _half_optimizer_state(ctx: LintContext) -> Iterator[Finding]:
    opt = ctx.optimizer
    name = type(opt).__name__
    if opt is None or getattr(torch.optim, name, None) is not type(opt) or name not in _HALF_STATE:
        return
    half = _stored_half(ctx)
    stateful = [
        p
        for group in opt.param_groups
        if name not in _MOMENTUM_ONLY or group.get("momentum", 0)
        for p in group["params"]
        if id(p) in half
    ]
    if not stateful:
        return
    short = "/".join(sorted({_HALF[half[id(p)]] for p in stateful}))
    states = ", ".join(_HALF_STATE[name])
    true = ctx.policy.spec.param_dtype is not None
    why = (
        f"{ctx.policy.name} stores the weights in {short} without fp32 master weights"
        if true
        else f"the model's parameters are {short}"
    )
    mixed = "fp16-mixed" if short == "fp16" else "bf16-mixed"
    how = (
        f"train with {mixed} (fp32 master weights, so fp32 state)"
        if true
        else f"keep the parameters fp32 and compute in {short} with {mixed}"
    )
    yield PRECISION_RULES["MP306"].finding(
        "warning",
        None,
        f"{name} keeps {states} in {short} for {len(stateful)} parameter tensors "
        f"({sum(p.numel() for p in stateful):,} values): {why}",
        f"{how}; or keep the {short} weights with an optimizer that keeps fp32 state for them "
        "(Transformer Engine's FusedAdam keeps exp_avg and exp_avg_sq in fp32 by default, "
        "master_weights=True adds an fp32 master copy; CUDA only)",
        details={
            "optimizer": name,
            "state": list(_HALF_STATE[name]),
            "dtype": short,
            "tensors": len(stateful),
            "values": sum(p.numel() for p in stateful),
            "scope": "optimizer",
        },
    )


__all__ = ["PRECISION_RULES"]
