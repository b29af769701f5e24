"""lint --measure: build the mechanical fixes, time them, and rank the findings by measured gain.

A bench job over lint's findings, so it lives with the measuring (it runs the training step through
the torch backend's session) and :mod:`mixprec.linting` knows nothing of it. :func:`lint` is
``mixprec.lint``: :func:`mixprec.linting.lint` plus ``measure=True``.

For every finding with a :class:`~mixprec.linting.model.Remedy`:

* the **layer**: forward + backward of the affected layer(s) on the traced shapes, under the
  policy's autocast and precision settings, before and after the fix, timed with
  ``torch.utils.benchmark``. A padded layer is timed on its padded input, i.e. as if the
  architecture used the aligned size; a layout fix times the largest affected convolutions
  in both memory formats.
* the **training step**: the whole step (forward, backward, optimizer) of the original model
  and of a fixed copy, with the bench runner (:func:`mixprec.frameworks.torch.session.run_candidate`)
  on the same batches. The fixed copy is a *drop-in* fix: zero-padded weights, its input
  padded with zeros and its output sliced back, so the model computes exactly what it did
  before; those extra pad/slice copies are part of the figure. The baseline is timed before
  and after the variants and pooled, to expose drift.

Figures are reported, never asserted: padding can help a lot, do nothing, or cost time.
"""

from __future__ import annotations

import copy
import functools
import statistics
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import UsageError
from mixprec.frameworks.session import BenchSettings, distinct_batches
from mixprec.frameworks.torch.session import make_batches, run_candidate
from mixprec.linting.model import Finding, LintResult, MeasuredGain, Remedy
from mixprec.linting.runner import run_lint
from mixprec.linting.trace import ModuleRecord, TensorInfo, memory_format_of
from mixprec.policy import Candidate, Policy
from mixprec.workload import Workload, validate_workload

Progress = Callable[[dict[str, Any]], None]
_LAYOUT_LAYERS = 3  # a layout fix is timed on this many of the largest affected convolutions
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


# --------------------------------------------------------------------------------------------------
# Padding a layer without changing what it computes


def _padded(t: torch.Tensor, sizes: dict[int, int]) -> torch.Tensor:
    """``t`` zero-padded at the end of the given dims, in ``t``'s memory format."""
    shape = list(t.shape)
    for dim, n in sizes.items():
        shape[dim] = n
    out = t.new_zeros(shape)
    fmt = memory_format_of(t)
    if fmt == "channels_last":
        out = out.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    with torch.no_grad():
        out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def _replace_parameter(root: nn.Module, old: torch.Tensor, new: nn.Parameter) -> list[nn.Module]:
    """Point every module of ``root`` that holds ``old`` (tied weights) at ``new``."""
    holders = []
    for module in root.modules():
        for key, value in list(module._parameters.items()):
            if value is old:
                module._parameters[key] = new
                holders.append(module)
    return holders


def pad_module(
    module: nn.Module, in_to: int | None, out_to: int | None, root: nn.Module | None = None
) -> None:
    """Zero-pad a Linear/Conv layer's weight (and bias) to ``in_to`` inputs / ``out_to`` outputs, in place.

    With ``root``, every module sharing the weight (a tied embedding) gets the padded weight;
    padding the outputs of a tied [vocab, dim] weight pads an embedding's rows, which is safe.
    """
    if isinstance(module, _TRANSPOSED) or not isinstance(
        module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    ):
        raise UsageError(f"cannot pad a {type(module).__name__}; only Linear and Conv1d/2d/3d layers")
    if in_to is not None and getattr(module, "groups", 1) != 1:
        raise UsageError("cannot pad the input channels of a grouped convolution")
    old = module.weight
    sizes = {}
    if out_to is not None:
        sizes[0] = out_to
    if in_to is not None:
        sizes[1] = in_to
    new = nn.Parameter(_padded(old.detach(), sizes), requires_grad=old.requires_grad)
    holders = _replace_parameter(root, old, new) if root is not None else []
    if len(holders) > 1 and in_to is not None:
        raise UsageError("cannot pad the inputs of a tied weight")
    if module not in holders:
        module.weight = new
    for holder in holders:
        if isinstance(holder, nn.Embedding):
            holder.num_embeddings = new.shape[0]
    if out_to is not None and module.bias is not None:
        module.bias = nn.Parameter(
            _padded(module.bias.detach(), {0: out_to}), requires_grad=module.bias.requires_grad
        )
    if isinstance(module, nn.Linear):
        module.in_features, module.out_features = new.shape[1], new.shape[0]
    else:
        module.in_channels, module.out_channels = new.shape[1], new.shape[0]


def _pad_input(module: nn.Module, args: tuple, *, dim: int, to: int) -> tuple | None:
    x = args[0]
    d = dim % x.dim()
    if x.shape[d] >= to:
        return None
    pad = [0, 0] * (x.dim() - 1 - d) + [0, to - x.shape[d]]
    y = F.pad(x, pad)
    if memory_format_of(x) == "channels_last":
        y = y.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return (y, *args[1:])


def _slice_output(module: nn.Module, args: tuple, output: torch.Tensor, *, dim: int, n: int) -> torch.Tensor:
    return output.narrow(dim, 0, n)


def drop_in_fix(model: nn.Module, remedy: Remedy) -> nn.Module:
    """A copy of ``model`` with ``remedy``'s padding applied so that it computes the same outputs."""
    fixed = copy.deepcopy(model)
    module: Any = fixed.get_submodule(remedy.module or "")
    dim = -1 if isinstance(module, nn.Linear) else 1
    n_in = module.in_features if isinstance(module, nn.Linear) else module.in_channels
    n_out = module.out_features if isinstance(module, nn.Linear) else module.out_channels
    pad_module(module, remedy.in_to, remedy.out_to, root=fixed)
    if remedy.in_to is not None and remedy.in_to != n_in:
        module.register_forward_pre_hook(functools.partial(_pad_input, dim=dim, to=remedy.in_to))
    if remedy.out_to is not None and remedy.out_to != n_out:
        module.register_forward_hook(functools.partial(_slice_output, dim=dim, n=n_out))
    return fixed


# --------------------------------------------------------------------------------------------------
# Layer timing


def _time(fn: Callable[[], None], min_time_s: float) -> float:
    """Median milliseconds of ``fn`` (after one warm-up call) with torch.utils.benchmark."""
    fn()
    # Imported here: torch.utils.benchmark pulls in cpp_extension, which warns on machines
    # without a CUDA toolkit; `import mixprec` must stay quiet and quick.
    import torch.utils.benchmark as benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_time_s).median * 1e3


def _time_layer(
    module: nn.Module,
    inp: TensorInfo,
    policy: Policy,
    min_time_s: float,
    *,
    shape: tuple[int, ...] | None = None,
    input_channels_last: bool | None = None,
) -> float:
    """Forward + backward of ``module`` on a random input of ``shape`` (default: the traced one)."""
    device = policy.device
    dtype = getattr(torch, inp.dtype)
    module = module.to(device)
    if policy.spec.param_dtype is not None:
        module = module.to(policy.spec.param_dtype)
        dtype = policy.spec.param_dtype
    x = torch.randn(shape or inp.shape, device=device, dtype=dtype)
    cl = inp.channels_last if input_channels_last is None else input_channels_last
    if cl and x.dim() in (4, 5):
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    x.requires_grad_(True)
    with policy.precision_scope():
        with policy.autocast():
            grad = torch.randn_like(module(x))

        def step() -> None:
            with policy.autocast():
                out = module(x)
            out.backward(grad)

        return _time(step, min_time_s)


def _traced_input(rec: ModuleRecord) -> TensorInfo:
    if rec.input is None:
        raise UsageError(f"layer {rec.name!r} has no traced tensor input to time")
    return rec.input


def _pad_timings(rec: ModuleRecord, remedy: Remedy, policy: Policy, min_time_s: float) -> tuple[float, float]:
    inp = _traced_input(rec)
    before = _time_layer(copy.deepcopy(rec.module), inp, policy, min_time_s)
    fixed = copy.deepcopy(rec.module)
    pad_module(fixed, remedy.in_to, remedy.out_to)
    shape = list(inp.shape)
    if remedy.in_to is not None:
        shape[-1 if isinstance(fixed, nn.Linear) else 1] = remedy.in_to
    after = _time_layer(fixed, inp, policy, min_time_s, shape=tuple(shape))
    return before, after


def _layout_copy(module: nn.Module, channels_last: bool) -> nn.Module:
    m = copy.deepcopy(module)
    return m.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _layout_layers(finding: Finding, result: LintResult) -> list[ModuleRecord]:
    trace = result.trace
    assert trace is not None
    if finding.module:
        return [trace.modules[finding.module]]
    convs = [r for r in trace.of_type(nn.Conv2d) if r.input is not None]
    if finding.rule == "MP202":
        convs = [r for r in convs if r.module.groups > 1] or convs
    return sorted(convs, key=lambda r: -r.flops)[:_LAYOUT_LAYERS]


def _layout_timings(
    finding: Finding, result: LintResult, policy: Policy, min_time_s: float
) -> tuple[float, float, tuple[str, ...]]:
    layers = _layout_layers(finding, result)
    on = bool(finding.remedy and finding.remedy.channels_last)
    before = after = 0.0
    for rec in layers:
        inp = _traced_input(rec)
        if finding.rule == "MP203":  # channels_last weights either way; only the input changes
            before += _time_layer(
                _layout_copy(rec.module, True), inp, policy, min_time_s, input_channels_last=False
            )
            after += _time_layer(
                _layout_copy(rec.module, True), inp, policy, min_time_s, input_channels_last=True
            )
        else:
            before += _time_layer(
                _layout_copy(rec.module, not on), inp, policy, min_time_s, input_channels_last=not on
            )
            after += _time_layer(
                _layout_copy(rec.module, on), inp, policy, min_time_s, input_channels_last=on
            )
    return before, after, tuple(r.name for r in layers)


# --------------------------------------------------------------------------------------------------
# Step timing


def _variant_key(remedy: Remedy) -> tuple:
    if remedy.kind == "layout":
        return ("layout", remedy.channels_last)
    return ("pad", remedy.module, remedy.in_to, remedy.out_to)


def _median_ms(times_s: list[float]) -> float | None:
    return statistics.median(times_s) * 1e3 if times_s else None


def measure_findings(
    workload: Workload,
    result: LintResult,
    *,
    steps: int | None = None,
    warmup: int | None = None,
    max_step_variants: int = 6,
    layer_min_time_s: float | None = None,
    step_min_time_s: float | None = None,
    progress: Progress | None = None,
) -> LintResult:
    """Time the mechanical fixes of ``result``'s findings and rank the findings by measured gain.

    Every mechanical finding gets its layer timed; the whole training step is timed for at
    most ``max_step_variants`` distinct fixes (layout fixes first, then by FLOP share), with
    ``steps`` timed steps after ``warmup`` (default 3 and 1 on CPU, 10 and 3 on CUDA), and
    more until ``step_min_time_s`` of timed steps (default 1 s on CPU, 2 s on CUDA; at most 50).
    Updates ``result`` in place (``finding.measured``, order, notes) and returns it.
    """
    policy = result.policy_obj
    if policy is None or result.trace is None:
        raise UsageError("measure_findings() needs the result of run_lint() on the same workload.")
    validate_workload(workload, device=policy.device, batch_size=result.batch_size)
    emit = progress or (lambda event: None)
    on_cuda = policy.device.type == "cuda"
    steps = steps or (10 if on_cuda else 3)
    warmup = warmup or (3 if on_cuda else 1)
    min_time = layer_min_time_s if layer_min_time_s is not None else (0.5 if on_cuda else 0.2)
    mechanical = [f for f in result.findings if f.remedy is not None]
    result.measured = True
    if not mechanical:
        result.notes.append("--measure: no finding has a mechanical fix to time.")
        return result
    if result.target != policy.device.type:
        result.notes.append(
            f"--measure timed on {policy.device.type}, not on the {result.target} target the rules judged."
        )

    # Layers.
    for i, finding in enumerate(mechanical):
        emit(
            {
                "event": "measure",
                "what": f"{finding.rule} {finding.where}: layer",
                "index": i,
                "count": len(mechanical),
            }
        )
        gain = MeasuredGain(device=str(policy.device))
        finding.measured = gain
        remedy = finding.remedy
        assert remedy is not None
        try:
            if remedy.kind == "pad":
                rec = result.trace.modules[remedy.module or ""]
                gain.layer_before_ms, gain.layer_after_ms = _pad_timings(rec, remedy, policy, min_time)
                gain.layers = (rec.name,)
            else:
                gain.layer_before_ms, gain.layer_after_ms, gain.layers = _layout_timings(
                    finding, result, policy, min_time
                )
        except Exception as exc:  # report, don't fail the lint
            gain.note = f"layer not timed: {type(exc).__name__}: {exc}"

    # Whole training steps.
    variants: dict[tuple, list[Finding]] = {}
    ranked = sorted(mechanical, key=lambda f: (f.remedy.kind != "layout", -(f.flops_share or 0.0)))  # type: ignore[union-attr]
    for finding in ranked:
        key = _variant_key(finding.remedy)  # type: ignore[arg-type]
        if key in variants or len(variants) < max_step_variants:
            variants.setdefault(key, []).append(finding)
    untimed = [f for f in mechanical if not any(f in group for group in variants.values())]
    for finding in untimed:
        finding.measured.note = f"step not timed (at most {max_step_variants} step variants)"  # type: ignore[union-attr]

    settings = BenchSettings(
        device=str(policy.device),
        batch_size=result.batch_size,
        steps=steps,
        warmup=warmup,
        min_time_s=step_min_time_s if step_min_time_s is not None else (2.0 if on_cuda else 1.0),
        max_steps=max(steps, 50),
    )
    batches = make_batches(
        workload, settings.batch_size, policy.device, settings.seed, distinct_batches(settings)
    )
    baseline = Candidate(policy.name, policy.config.channels_last)
    count = len(variants) + 2
    base_times: list[float] = []

    def run(index: int, what: str, wl: Workload, candidate: Candidate) -> list[float]:
        emit({"event": "measure", "what": f"{what}: training step", "index": index, "count": count})
        return run_candidate(wl, candidate, settings, batches=batches).step_times_s

    try:
        base_times += run(0, "baseline", workload, baseline)
    except Exception as exc:
        note = f"step not timed: the baseline failed ({type(exc).__name__}: {exc})"
        for finding in mechanical:
            finding.measured.note = "; ".join(filter(None, [finding.measured.note, note]))  # type: ignore[union-attr]
        result.notes.append("--measure: " + note)
        _rank(result)
        return result
    after: dict[tuple, float | None] = {}
    for i, (key, group) in enumerate(variants.items(), start=1):
        remedy = group[0].remedy
        assert remedy is not None
        try:
            if remedy.kind == "layout":
                candidate = replace(baseline, channels_last=bool(remedy.channels_last))
                times = run(
                    i, f"channels_last {'on' if remedy.channels_last else 'off'}", workload, candidate
                )
            else:
                fixed = replace(workload, model=drop_in_fix(workload.model, remedy))
                times = run(i, f"padded {remedy.module}", fixed, baseline)
            after[key] = _median_ms(times)
        except Exception as exc:
            after[key] = None
            for finding in group:
                finding.measured.note = f"step not timed: {type(exc).__name__}: {exc}"  # type: ignore[union-attr]
    try:
        repeat_times = run(count - 1, "baseline (repeat)", workload, baseline)
    except Exception:
        repeat_times = []
    first, repeat = _median_ms(base_times), _median_ms(repeat_times)
    if first is not None and repeat is not None:
        drift = abs(repeat - first) / min(first, repeat) * 100.0
        result.notes.append(
            f"--measure: baseline step {first:.1f} ms, repeated after the variants {repeat:.1f} ms "
            f"(drift {drift:.1f}%): step differences smaller than that are noise."
        )
    before = _median_ms(base_times + repeat_times)
    for key, group in variants.items():
        for finding in group:
            if after.get(key) is not None:
                finding.measured.step_before_ms = before  # type: ignore[union-attr]
                finding.measured.step_after_ms = after[key]  # type: ignore[union-attr]
    _rank(result)
    return result


def _rank(result: LintResult) -> None:
    """Measured findings first, by gain (largest first); the rest keep their order."""

    def key(f: Finding) -> tuple:
        gain = f.measured.gain_pct if f.measured is not None else None
        return (gain is None, -(gain or 0.0))

    result.findings.sort(key=key)


def lint(
    workload: Workload,
    policy: str | Candidate | Policy | None = None,
    *,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    ignore: str | Iterable[str] | None = (),
    target: str | None = None,
    channels_last: bool | None = None,
    measure: bool = False,
) -> list[Finding]:
    """Lint ``workload`` for tensor-core-unfriendly shapes and precision mistakes.

    :func:`mixprec.linting.lint` (the arguments are its own), and with ``measure=True`` the
    mechanical fixes are built and timed (:func:`measure_findings`) and the findings are ranked by
    measured gain.
    """
    result = run_lint(
        workload,
        policy,
        device=device,
        batch_size=batch_size,
        ignore=ignore,
        target=target,
        channels_last=channels_last,
    )
    if measure:
        measure_findings(workload, result)
    return result.findings


__all__ = ["drop_in_fix", "lint", "measure_findings", "pad_module"]
