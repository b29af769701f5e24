"""Run the lint rules on a workload: resolve the policy, trace one forward pass, collect findings."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from mixprec import validation
from mixprec.errors import UnsupportedError, UsageError, did_you_mean
from mixprec.hardware.device import DeviceInfo, detect, resolve_device
from mixprec.linting.context import LintContext
from mixprec.linting.model import SEVERITY_RANK, Finding, LintResult
from mixprec.linting.rules import RULES
from mixprec.linting.trace import trace_workload
from mixprec.policy import Candidate, Policy, check_support, get_policy, starting_policy
from mixprec.workload import Workload

TARGETS = ("cpu", "cuda")


def parse_rule_ids(ignore: str | Iterable[str] | None) -> tuple[str, ...]:
    """Rule ids from 'MP101,MP102' or a list; rule names ('conv-channels') are accepted too.

    Raises :class:`UsageError` listing the valid ids for anything else.
    """
    if ignore is None:
        return ()
    items = ignore.split(",") if isinstance(ignore, str) else list(ignore)
    by_name = {rule.name: rule.id for rule in RULES.values()}
    ids: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise UsageError(f"rule ids must be strings, got {item!r}; valid ids: {', '.join(RULES)}.")
        key = item.strip()
        if not key:
            continue
        rule_id = key.upper() if key.upper() in RULES else by_name.get(key.lower())
        if rule_id is None:
            raise UsageError(
                f"unknown rule id {key!r}; valid ids: {', '.join(RULES)} (or their names, e.g. "
                f"'conv-channels').{did_you_mean(key.upper(), [*RULES, *by_name])} "
                "`mixprec lint --list-rules` describes them."
            )
        if rule_id not in ids:
            ids.append(rule_id)
    return tuple(ids)


def _resolve_policy(
    policy: str | Candidate | Policy | None,
    device: Any,
    device_info: DeviceInfo | None,
    channels_last: bool | None,
) -> tuple[Policy, DeviceInfo, bool]:
    if isinstance(policy, Candidate):  # whole: its layout and fp32 islands are what is judged
        if channels_last is not None:
            raise UsageError(
                f"channels_last was given both as an argument and by the candidate {policy.label!r}; "
                "pass the candidate only."
            )
        policy = get_policy(policy, device=resolve_device(device), check=False)
    if isinstance(policy, Policy):
        if device is not None and resolve_device(device) != policy.device:
            raise UsageError(
                f"device {str(device)!r} differs from the policy's device {str(policy.device)!r}; "
                "pass one of them, or build the policy for that device."
            )
        if channels_last is not None and channels_last != policy.config.channels_last:
            raise UsageError(
                "channels_last was given both as an argument and through the Policy object; "
                "pass get_policy(..., channels_last=...) only."
            )
        return policy, device_info or detect(policy.device), False
    if policy is not None and not isinstance(policy, str):
        raise UsageError(
            f"policy must be a policy name, a mixprec.Candidate or a mixprec.Policy, got "
            f"{type(policy).__name__}; e.g. policy='bf16-mixed' or mixprec.Candidate('bf16-mixed', "
            "channels_last=True)."
        )
    dev = resolve_device(device)
    info = device_info or detect(dev)
    chosen = policy is None
    if policy is None:
        policy = starting_policy(info)
    options = {} if channels_last is None else {"channels_last": channels_last}
    return get_policy(policy, device=dev, check=False, **options), info, chosen


def _check_policy_support(policy: Policy, info: DeviceInfo, target: str) -> None:
    """Unsupported here is an error, except what MP304/MP305 report, or when judging another target."""
    if target != info.type:
        return
    support = check_support(policy.name, info)
    if support or policy.spec.low_precision_dtype in (torch.bfloat16, torch.float16):
        return
    hint = f"; try {support.suggestion}" if support.suggestion else ""
    other = "cuda" if info.type == "cpu" else "cpu"
    raise UnsupportedError(
        f"Policy {policy.name!r} is not supported on {info.type}: {support.reason}{hint}, or judge "
        f"the model's shapes for {other} with --target {other} (target={other!r})."
    )


def _visit_for_scalers(value: Any, found: dict[int, Any]) -> None:
    if isinstance(value, torch.amp.GradScaler) and value.is_enabled():
        found[id(value)] = value


def find_grad_scalers(workload: Workload) -> tuple[Any, ...]:
    """Enabled GradScalers reachable from the workload: its attributes, and the closures and
    referenced globals of its functions (where a factory would keep one)."""
    found: dict[int, Any] = {}
    for value in vars(workload).values():
        _visit_for_scalers(value, found)
    for fn in (workload.make_batch, workload.loss_fn, workload.optimizer_fn):
        while isinstance(fn, functools.partial):
            for value in (*fn.args, *fn.keywords.values()):
                _visit_for_scalers(value, found)
            fn = fn.func
        if fn is None:
            continue
        owner = getattr(fn, "__self__", None)
        if owner is not None and hasattr(owner, "__dict__"):
            for value in vars(owner).values():
                _visit_for_scalers(value, found)
        fn = inspect.unwrap(getattr(fn, "__func__", fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                _visit_for_scalers(cell.cell_contents, found)
            except ValueError:  # empty cell
                continue
        code = getattr(fn, "__code__", None)
        scope = getattr(fn, "__globals__", {})
        for name in code.co_names if code is not None else ():
            _visit_for_scalers(scope.get(name), found)
    return tuple(found.values())


def _build_optimizer(workload: Workload) -> tuple[torch.optim.Optimizer | None, str]:
    try:
        return workload.make_optimizer(workload.model), ""
    except Exception as exc:  # a user's optimizer factory may refuse CPU/meta params, etc.
        return None, f"optimizer rules skipped: building the optimizer raised {type(exc).__name__}: {exc}"


def _sort_key(f: Finding) -> tuple:
    return (-SEVERITY_RANK[f.severity], -(f.flops_share or 0.0), f.order, f.rule)


def run_lint(
    workload: Workload,
    policy: str | Candidate | Policy | None = None,
    *,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    ignore: str | Iterable[str] | None = (),
    target: str | None = None,
    channels_last: bool | None = None,
    device_info: DeviceInfo | None = None,
) -> LintResult:
    """Lint ``workload`` under ``policy`` and return the findings with their context.

    ``policy``: a name or a :class:`~mixprec.Policy` (default: the best default policy for
    the device). ``batch_size`` defaults to the workload's. ``ignore``: rule ids (or names) to
    skip. ``target``: 'cuda' or 'cpu', the hardware the tensor-core rules judge (default: the
    device's type; on a CPU they report at info). ``device_info`` overrides the detected
    capabilities (tests use fake ones).
    """
    if not isinstance(workload, Workload):
        raise UsageError(
            f"lint() takes a mixprec.Workload, got {type(workload).__name__}; wrap the model: "
            "Workload(model=..., make_batch=..., loss_fn=...), or use mixprec.load_workload('resnet50')."
        )
    ignored = parse_rule_ids(ignore)
    if target is not None and target not in TARGETS:
        raise UsageError(f"unknown lint target {target!r}; valid: {', '.join(TARGETS)}.")
    validation.optional_positive_int("batch_size", batch_size)
    pol, info, chosen = _resolve_policy(policy, device, device_info, channels_last)
    target = target or info.type
    _check_policy_support(pol, info, target)
    bs = batch_size or workload.default_batch_size

    trace = trace_workload(workload, bs, channels_last=pol.config.channels_last)
    optimizer, optimizer_note = _build_optimizer(workload)
    ctx = LintContext(
        workload=workload,
        policy=pol,
        device=info,
        target=target,
        trace=trace,
        batch_size=bs,
        optimizer=optimizer,
        grad_scalers=find_grad_scalers(workload),
    )
    active: list[Finding] = []
    suppressed: list[Finding] = []
    downgraded = 0
    for rule in RULES.values():
        if rule.id in ignored:
            continue
        for finding in rule.check(ctx):
            if rule.tensor_core and not ctx.cuda_target and finding.severity != "info":
                finding.details["severity_on_cuda"] = finding.severity
                finding.severity = "info"
                downgraded += 1
            (suppressed if finding.suppressed else active).append(finding)
    active.sort(key=_sort_key)

    notes: list[str] = []
    if ctx.alignment is None:
        notes.append(
            f"tensor-core shape rules (MP101-MP109) judge nothing under {pol.name}: it computes in "
            f"{ctx.dtype}, which runs on no tensor core; lint with --policy bf16-mixed or tf32 to "
            "check shapes for them."
        )
    elif not ctx.cuda_target:
        lowered = f" ({downgraded} lowered to info)" if downgraded else ""
        notes.append(
            f"tensor-core rules judge NVIDIA GPUs ({ctx.assumes}); on this {target} target they "
            f"report at info{lowered}: --target cuda judges them at full severity."
        )
    if target != info.type:
        notes.append(
            f"MP304/MP305 judge the device the policy runs on ({info.type}), not the {target} "
            "target: skipped."
        )
    if trace.note:
        notes.append(trace.note)
    if optimizer_note:
        notes.append(optimizer_note)
    if pol.config.channels_last:
        notes.append("traced as the channels_last policy runs it (weights and 4-D inputs channels_last).")

    return LintResult(
        workload=workload.name or "workload",
        description=workload.description,
        policy=pol.config.label,
        policy_chosen=chosen,
        device=f"{info.type}: {info.name}",
        target=target,
        batch_size=bs,
        findings=active,
        suppressed=suppressed,
        ignored=ignored,
        notes=notes,
        trace_mode=trace.mode,
        policy_obj=pol,
        trace=trace,
    )


def lint(workload: Workload, policy: str | Candidate | Policy | None = None, **options: Any) -> list[Finding]:
    """Lint ``workload`` for tensor-core-unfriendly shapes and precision mistakes.

    ``policy`` is a policy name, a :class:`mixprec.Candidate` (judged whole: its layout and fp32
    islands) or a :class:`mixprec.Policy`; ``options`` are :func:`run_lint`'s (``device``,
    ``batch_size``, ``ignore``, ``target``, ``channels_last``: that option of a policy given by
    name). Returns the active findings, most important first (suppressed unavoidable cases are in
    :func:`run_lint`'s result). ``mixprec.lint`` (:func:`mixprec.measure.lint_gains.lint`) adds
    ``measure=True``: the mechanical fixes built, timed and ranked by measured gain.
    """
    return run_lint(workload, policy, **options).findings


__all__ = ["TARGETS", "find_grad_scalers", "lint", "parse_rule_ids", "run_lint"]
