"""Measure one candidate on the real training step (in this process or in an isolated child).

The runner reports each step through ``emit`` so the caller can show progress and prune a
hopeless candidate; it returns the raw measurement. Turning it into a row (speedups, MFU,
status) is the sweep's job.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec import state
from mixprec.errors import MixprecError
from mixprec.measure.flops import count_flops
from mixprec.policy import Candidate, Policy, get_policy
from mixprec.policy.policy import is_fp32_island
from mixprec.workload import Workload

# Layers whose output dtype shows which precision really ran (autocast casts their inputs).
_COMPUTE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Bilinear)
# How many distinct batches to cycle through: same data for every candidate, bounded memory.
_DISTINCT_BATCHES = 4


class HonestyError(MixprecError):
    """What ran is not what the row would claim (e.g. autocast silently did nothing)."""


class NonFiniteLossError(MixprecError, FloatingPointError):
    """The training loss became inf/NaN."""


@dataclass(frozen=True)
class BenchSettings:
    device: str
    batch_size: int
    steps: int = 10
    warmup: int = 2
    count_flops: bool = False
    seed: int = 0
    # Keep timing past ``steps`` until this much timed time has passed (small models need
    # many steps for a stable median, big ones few), but never beyond ``max_steps``.
    min_time_s: float = 0.0
    max_steps: int = 200
    threads: int | None = None
    # cuDNN autotuning on CUDA (the warm-up steps absorb its first-call cost); no effect on CPU.
    cudnn_benchmark: bool = True


@dataclass
class Measurement:
    step_times_s: list[float] = field(default_factory=list)  # timed steps only
    warmup_times_s: list[float] = field(default_factory=list)
    first_loss: float | None = None
    last_loss: float | None = None
    flops_per_step: int | None = None
    observed_dtype: str | None = None
    observed_layer: str | None = None
    peak_memory_bytes: int | None = None
    memory_method: str = ""
    stopped_early: bool = False
    skipped_steps: int = 0


Emit = Callable[[dict[str, Any]], bool]  # returns False to stop the candidate (pruned)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(workload: Workload, batch_size: int, device: torch.device, seed: int, n: int) -> list:
    """The same ``n`` batches for every candidate: each one drawn under its own fixed seed."""
    batches = []
    for i in range(n):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed + i)
            batches.append(workload.make_batch(batch_size, device))
    return batches


def distinct_batches(settings: BenchSettings) -> int:
    return min(_DISTINCT_BATCHES, settings.warmup + settings.steps)


class _FirstComputeLayer:
    """Forward hooks that record the first matmul/conv layer to run and its output dtype."""

    def __init__(self, model: nn.Module, keep_fp32: tuple[str, ...]) -> None:
        self.name: str | None = None
        self.dtype: torch.dtype | None = None
        self.module: nn.Module | None = None
        self._handles = []
        for name, module in model.named_modules():
            if not isinstance(module, _COMPUTE_LAYERS):
                continue
            if is_fp32_island(name, keep_fp32):
                continue  # fp32 islands run in fp32 on purpose
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.name is None and isinstance(output, torch.Tensor):
                self.name, self.dtype, self.module = name, output.dtype, module

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _check_honesty(policy: Policy, probe: _FirstComputeLayer) -> None:
    if probe.name is None:
        return  # no matmul/conv layer as a module (e.g. functional-only model): nothing to check
    expected = policy.compute_dtype
    if probe.dtype != expected:
        raise HonestyError(
            f"labelled {policy.config.label} but the first matmul/conv layer {probe.name!r} produced "
            f"{probe.dtype} instead of {expected}: the policy did not take effect"
        )
    if policy.config.channels_last and isinstance(probe.module, nn.Conv2d):
        weight = probe.module.weight
        if not weight.is_contiguous(memory_format=torch.channels_last):
            raise HonestyError(
                f"labelled channels_last but the weight of {probe.name!r} is not channels_last contiguous"
            )


def run_candidate(
    workload: Workload,
    candidate: Candidate,
    settings: BenchSettings,
    emit: Emit | None = None,
    batches: list | None = None,
    wrap_model: Callable[[nn.Module, Policy], nn.Module] | None = None,
) -> Measurement:
    """Train a fresh copy of the workload's model under ``candidate`` and time every step.

    ``batches`` (from :func:`make_batches`) lets in-process sweeps feed every candidate the
    very same data even when the workload's ``make_batch`` draws from a stateful generator.
    ``wrap_model`` wraps the prepared model for training (DDP in data-parallel sweeps); the
    optimizer and the honesty probe keep seeing the unwrapped model and its parameter names.
    """
    emit = emit or (lambda event: True)
    device = torch.device(settings.device)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    policy = get_policy(candidate.policy, device=device, **candidate.policy_options())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = policy.prepare(copy.deepcopy(workload.model))
    model.train()
    trained = wrap_model(model, policy) if wrap_model is not None else model
    optimizer = workload.make_optimizer(model.parameters())
    if batches is None:
        batches = make_batches(
            workload, settings.batch_size, device, settings.seed, distinct_batches(settings)
        )
    probe = _FirstComputeLayer(model, policy.config.keep_fp32)
    result = Measurement()

    def train_step(batch: Any) -> torch.Tensor:
        with policy.autocast():
            loss = workload.loss_fn(trained, batch)
        policy.backward(loss)
        policy.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return loss

    total = settings.warmup + settings.steps
    # From here on every step is timed against the pruning limits (setup above is not).
    emit({"event": "ready"})
    i = -1
    with policy.precision_scope(), state.cudnn_benchmark(settings.cudnn_benchmark and device.type == "cuda"):
        while True:
            i += 1
            if i >= total and (
                sum(result.step_times_s) >= settings.min_time_s or i >= settings.warmup + settings.max_steps
            ):
                break
            batch = batches[i % len(batches)]
            timed = i >= settings.warmup
            _sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            if i == 0 and settings.count_flops:
                loss = None

                def counted(first_batch: Any = batch) -> None:
                    nonlocal loss
                    loss = train_step(first_batch)

                result.flops_per_step = count_flops(counted)
            else:
                loss = train_step(batch)
            if device.type == "cuda":
                end.record()
                torch.cuda.synchronize(device)
                seconds = start.elapsed_time(end) / 1e3
            else:
                seconds = time.perf_counter() - t0
            loss_value = float(loss.detach().float())  # type: ignore[union-attr]
            if i == 0:
                probe.remove()
                _check_honesty(policy, probe)
                result.observed_dtype = str(probe.dtype).removeprefix("torch.") if probe.dtype else None
                result.observed_layer = probe.name
                result.first_loss = loss_value
            if not math.isfinite(loss_value):
                raise NonFiniteLossError(f"non-finite loss ({loss_value}) at step {i}")
            result.last_loss = loss_value
            (result.step_times_s if timed else result.warmup_times_s).append(seconds)
            if not emit(
                {
                    "event": "step",
                    "index": i,
                    "seconds": seconds,
                    "timed": timed,
                    "total": max(total, i + 1),
                    "loss": loss_value,
                }
            ):
                result.stopped_early = True
                break
    probe.remove()
    result.skipped_steps = policy.stats.skipped_steps
    if device.type == "cuda":
        result.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
        result.memory_method = "torch.cuda.max_memory_allocated"
    return result
