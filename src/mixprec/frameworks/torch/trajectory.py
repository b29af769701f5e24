"""torch's differential training run: the first-step probe and the training trajectory of one
candidate (``Framework.trajectory`` for torch workloads).

Both runs of a comparison start from the same weights (deep copies) and see the same batches; the
probe measures the output and the unscaled gradients at the loss scale GradScaler settles on.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.frameworks.torch.probe import FirstComputeLayer, model_output, nonfinite_buffers, perturb_weights
from mixprec.frameworks.torch.ranges import StepRecorder
from mixprec.numerics.compare import Trajectory
from mixprec.numerics.limits import LOW_PRECISION_FORMATS
from mixprec.policy import Policy
from mixprec.policy.scaler import dense, values
from mixprec.workload import Workload

Context = Callable[[], contextlib.AbstractContextManager[Any]]


def _prepared_copy(workload: Workload, policy: Policy, perturb: float = 0.0) -> nn.Module:
    """A fresh prepared copy; ``perturb`` multiplies every weight by ``1 + perturb * N(0, 1)``
    with a fixed seed (the same perturbation for the probe and the training run)."""
    model = policy.prepare(copy.deepcopy(workload.model))
    model.train()
    if perturb:
        perturb_weights(model, perturb)
    return model


def _run_model(model: nn.Module, compile_mode: str | None) -> nn.Module:
    """``model`` as the candidate runs it: compiled with ``torch.compile`` (fused kernels round
    differently from eager ones) or as it is."""
    return torch.compile(model, mode=compile_mode) if compile_mode else model  # type: ignore[return-value]


def probe_first_step(
    workload: Workload,
    policy: Policy,
    batch: Any,
    traj: Trajectory,
    context: Context | None = None,
    perturb: float = 0.0,
    compile_mode: str | None = None,
) -> None:
    """Model output and unscaled parameter gradients of one forward/backward from the initial weights.

    For loss-scaled policies the scale starts at the scaler's initial value and is halved
    until the gradients are finite, as GradScaler would after skipped steps, so the SQNR
    measures precision rather than an overflow the scaler recovers from by itself.
    """
    model = _prepared_copy(workload, policy, perturb)
    names = {id(p): n for n, p in model.named_parameters()}
    ctx = context or contextlib.nullcontext
    scale = policy.scaler.get_scale() if policy.scaler is not None else 1.0
    outputs: list[torch.Tensor | None] = []
    hook = model.register_forward_hook(lambda m, a, out: outputs.append(model_output(out)))
    run = _run_model(model, compile_mode)
    try:
        with policy.precision_scope():
            for _ in range(40):
                outputs.clear()
                model.zero_grad(set_to_none=True)
                with ctx():
                    with policy.autocast():
                        loss = workload.loss_fn(run, batch)
                    (loss * scale).backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                finite = all(bool(torch.isfinite(values(g)).all()) for g in grads)
                if finite or policy.scaler is None:
                    break
                scale *= 0.5
    finally:
        hook.remove()
    if outputs and outputs[0] is not None:
        traj.first_output = _host_copy(outputs[0])
    traj.first_grads = {
        names[id(p)]: _host_copy(dense(p.grad)) / scale for p in model.parameters() if p.grad is not None
    }
    traj.probe_scale = scale if policy.scaler is not None else None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 on the host for the comparison; complex stays complex (a cast to float would
    drop its imaginary part)."""
    return t.detach().to(torch.complex64 if t.is_complex() else torch.float32).cpu().clone()


def _settled(policy: Policy, traj: Trajectory) -> Policy:
    """The same policy whose scaler starts at the scale the first-step probe needed."""
    from mixprec.policy import policy_from_config

    config = policy.config.to_dict()
    init = config["scaler"]["init_scale"]
    floor = config["scaler"]["min_scale"] or 0.0
    settled = max(float(traj.probe_scale), floor)  # type: ignore[arg-type]
    if settled >= init:
        return policy
    traj.warmup_skips = round(math.log(init / settled, 1 / config["scaler"]["backoff_factor"]))
    config["scaler"] = {**config["scaler"], "init_scale": settled}
    return policy_from_config(config)


def run_trajectory(
    workload: Workload,
    policy: Policy,
    batches: Sequence[Any],
    steps: int,
    *,
    label: str | None = None,
    context: Context | None = None,
    perturb: float = 0.0,
    settle_scale: bool = True,
    compile_mode: str | None = None,
    compile_scope: str | None = None,
) -> Trajectory:
    """Probe the first step, then train a fresh copy for ``steps`` steps under ``policy``.

    ``context`` wraps every forward and backward (used for emulation). ``perturb`` multiplies
    every initial weight by ``1 + perturb * N(0, 1)`` (the chaos-floor run). With
    ``settle_scale`` a loss-scaled policy starts at the scale its probe found finite, i.e.
    the steady state GradScaler reaches after ``warmup_skips`` skipped start-up steps, so the
    comparison measures numerics rather than the scaler's start-up. ``compile_mode`` runs the
    model under ``torch.compile`` (``compile_scope="step"``: the whole training step, forward to
    optimizer step, as the candidate trains). Exceptions inside the run are recorded in ``error``
    so one broken candidate does not end a check.
    """
    traj = Trajectory(label or policy.config.label)
    ctx = context or contextlib.nullcontext
    # Every run draws the same random numbers (dropout masks, ...): differences between runs
    # are then the format's, not the RNG's. The caller's RNG state is left as it was.
    cuda = [policy.device] if policy.device.type == "cuda" else []
    # Every warning of the run is recorded (the steps' would repeat each step); a complex tensor cast
    # to real (*-true's model.to(half), autocast, a dtype-following cast) makes another model.
    with torch.random.fork_rng(devices=cuda), warnings.catch_warnings(record=True) as caught:
        torch.manual_seed(0)
        warnings.simplefilter("always")
        try:
            _steps(
                workload,
                policy,
                batches,
                steps,
                traj,
                ctx,
                context,
                perturb,
                settle_scale,
                compile_mode,
                compile_scope,
            )
        except Exception as exc:  # a candidate that crashes is a failed candidate, not a crashed check
            traj.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    traj.dropped_imaginary = next((str(w.message) for w in caught if _COMPLEX_CAST in str(w.message)), None)
    return traj


# Steps whose lost updates make the stalled fraction of the verdict (later steps make its trend).
_STALL_STEPS = 2
# What torch warns when autocast or a cast drops a complex tensor's imaginary part.
_COMPLEX_CAST = "Casting complex values to real discards the imaginary part"


def _count_stalls(traj: Trajectory, before: Sequence[tuple[torch.Tensor, torch.Tensor]], tally: bool) -> None:
    """Weights with a non-zero gradient that the optimizer step left bit-identical: the update
    was smaller than half an ulp of the weight (bf16(1.0) - bf16(1e-3) == 1.0). Without fp32
    master weights such updates are lost for good. Read after the step, before ``zero_grad``;
    every step's fraction goes into ``traj.stalls``, the first steps' into the verdict (``tally``)."""
    stalled = total = 0
    for p, old in before:
        if p.grad is None:
            continue
        had_grad = dense(p.grad) != 0
        unchanged = p.detach() == old
        stalled += int((unchanged & had_grad).sum())
        total += int(had_grad.sum())
    traj.stalls.append(stalled / total if total else 0.0)
    if tally:
        traj.stall_counts[0] += stalled
        traj.stall_counts[1] += total


def _steps(
    workload: Workload,
    policy: Policy,
    batches: Sequence[Any],
    steps: int,
    traj: Trajectory,
    ctx: Context,
    context: Context | None,
    perturb: float,
    settle_scale: bool,
    compile_mode: str | None,
    compile_scope: str | None,
) -> None:
    """The first-step probe, then ``steps`` training steps recorded into ``traj``."""
    whole_step = compile_mode is not None and compile_scope == "step"
    # A compiled step's first-step SQNRs are probed on the eager model: compiling the model for the
    # probe as well would compile a second graph for one forward/backward (the losses that follow
    # come from the compiled step)
    probe_first_step(
        workload, policy, batches[0], traj, context, perturb, None if whole_step else compile_mode
    )
    if settle_scale and policy.scaler is not None and traj.probe_scale is not None:
        policy = _settled(policy, traj)
    torch.manual_seed(0)
    model = _prepared_copy(workload, policy, perturb)
    run = model if whole_step else _run_model(model, compile_mode)
    optimizer = workload.make_optimizer(model)

    def train_step(batch: Any) -> tuple[torch.Tensor, bool]:
        with ctx():
            with policy.autocast():
                loss = workload.loss_fn(run, batch)
            policy.backward(loss)
        return loss, policy.step(optimizer)

    step = torch.compile(train_step, mode=compile_mode) if whole_step else train_step
    # ranges at every step where the hooks cannot change what runs (not inside a compiled graph)
    low = policy.spec.range_format if policy.spec.range_format in LOW_PRECISION_FORMATS else None
    recorder = StepRecorder(model, underflow_format=low) if compile_mode is None else None
    # (not inside a compiled step: taking its hooks off after the first step recompiles the step;
    # the speed run's session saw what a compiled candidate computes in)
    probe = None if whole_step else FirstComputeLayer(model, policy.config.keep_fp32)
    with policy.precision_scope():
        for i in range(steps):
            watch = policy.spec.param_dtype is not None
            before = [(p, p.detach().clone()) for p in model.parameters()] if watch else []
            scale = policy.stats.scale if policy.scaler is not None else None
            with recorder.step(scale) if recorder is not None else contextlib.nullcontext():
                loss, stepped = step(batches[i % len(batches)])
            if probe is not None:
                probe.remove()
                traj.observed_layer = probe.name
                traj.observed_dtype = str(probe.dtype).removeprefix("torch.") if probe.dtype else None
                probe = None
            traj.losses.append(float(loss.detach().float()))
            traj.stepped.append(stepped)
            if watch and stepped:
                _count_stalls(traj, before, tally=i < _STALL_STEPS)
            traj.scales.append(policy.stats.scale)
            optimizer.zero_grad(set_to_none=True)
    traj.series = list(recorder.series.values()) if recorder is not None else []
    traj.nonfinite_buffers = nonfinite_buffers(model)
