"""torch's training session: one candidate's model, optimizer and batches, stepped and timed.

The session reports each step as an event so the sweep can show progress and prune a hopeless
candidate; it returns the raw :class:`~mixprec.frameworks.session.Measurement`. Turning it into a
row (speedups, MFU, status) is the sweep's job.
"""

from __future__ import annotations

import copy
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from mixprec import state
from mixprec.frameworks.session import (
    BenchSettings,
    Emit,
    HonestyError,
    Measurement,
    SessionBase,
    distinct_batches,
    steady,
)
from mixprec.frameworks.torch.flops import count_flops
from mixprec.frameworks.torch.probe import FirstComputeLayer
from mixprec.policy import Candidate, Policy, get_policy
from mixprec.workload import Workload


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


def _check_honesty(policy: Policy, probe: FirstComputeLayer) -> None:
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


class TrainingSession(SessionBase):
    """One candidate's model, optimizer and batches, stepped on demand and timed step by step.

    Sweeps alternate the steps of two sessions (the strict-fp32 baseline and a candidate), so each
    step applies its own policy's fp32 math mode and cuDNN setting and puts the previous ones back:
    two sessions in one process never see each other's global state.
    """

    def __init__(
        self,
        workload: Workload,
        candidate: Candidate,
        settings: BenchSettings,
        batches: list | None = None,
        wrap_model: Callable[[nn.Module, Policy], nn.Module] | None = None,
    ) -> None:
        self.workload, self.candidate, self.settings = workload, candidate, settings
        self.device = torch.device(settings.device)
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.policy = get_policy(candidate, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model = self.policy.prepare(copy.deepcopy(workload.model))
        self.model.train()
        self.trained = wrap_model(self.model, self.policy) if wrap_model is not None else self.model
        self.optimizer = workload.make_optimizer(self.model)
        if candidate.optimizer:
            self.optimizer = with_implementation(self.optimizer, candidate.optimizer)
        self._compile_counts: dict[str, int] | None = None
        self._step_fn: Callable[[Any], torch.Tensor] = self._train_step
        if candidate.compile:
            # Compile cold, as a training run starts: code dynamo already compiled in this process
            # (an earlier candidate of the same model class) would otherwise be reused, hiding the
            # compile time and the graph counts. Inductor's on-disk caches stay, as they would.
            torch._dynamo.reset()
            self._compile_counts = _dynamo_counts()
            if candidate.compile_scope == "step":  # forward, loss, backward and optimizer step together
                self._step_fn = torch.compile(self._train_step, mode=candidate.compile)
            else:
                self.trained = cast(nn.Module, torch.compile(self.trained, mode=candidate.compile))
        micro = batches or make_batches(
            workload, settings.batch_size, self.device, settings.seed, distinct_batches(settings)
        )
        k = settings.accumulation_steps
        # with accumulation a step takes k micro-batches at once
        self.batches = micro if k == 1 else [micro[i : i + k] for i in range(0, len(micro) - k + 1, k)]
        self._probe: FirstComputeLayer | None = FirstComputeLayer(self.model, self.policy.config.keep_fp32)
        self.result = Measurement()
        self.index = 0
        self._clean_warmup: list[float] = []  # warm-up steps without an instrument

    def _train_step(self, batch: Any) -> torch.Tensor:
        k = self.settings.accumulation_steps
        if k == 1:
            with self.policy.autocast():
                loss = self.workload.loss_fn(self.trained, batch)
            self.policy.backward(loss)
        else:  # the mean over k micro-batches: each loss / k, the gradients summed, one step
            parts = []
            for micro in batch:
                with self.policy.autocast():
                    loss = self.workload.loss_fn(self.trained, micro) / k
                self.policy.backward(loss)
                parts.append(loss.detach())
            loss = torch.stack(parts).sum()
        self.policy.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def step(self, timed: bool) -> dict[str, Any]:
        """Run and time one training step; returns its 'step' event (index, seconds, loss, timed)."""
        i, device, settings = self.index, self.device, self.settings
        batch = self.batches[i % len(self.batches)]
        cudnn = settings.cudnn_benchmark and device.type == "cuda"
        with self.policy.precision_scope(), state.cudnn_benchmark(cudnn):
            _sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            instrument = self._instrument(i, timed)
            if instrument == "flops":
                box: list[torch.Tensor] = []
                self.result.flops_per_step = count_flops(lambda: box.append(self._step_fn(batch)))
                loss = box[0]
            elif instrument == "profile":
                loss = self._profiled_step(batch)
            else:
                loss = self._step_fn(batch)
            if device.type == "cuda":
                end.record()
                torch.cuda.synchronize(device)
                seconds = start.elapsed_time(end) / 1e3
            else:
                seconds = time.perf_counter() - t0
        loss_value = float(loss.detach().float())
        if self._probe is not None:
            if self._compile_counts is not None:
                self.result.graphs = _dynamo_counts()["graphs"] - self._compile_counts["graphs"]
            self._probe.remove()
            _check_honesty(self.policy, self._probe)
            self.result.observed_dtype = (
                str(self._probe.dtype).removeprefix("torch.") if self._probe.dtype else None
            )
            self.result.observed_layer = self._probe.name
            self._probe = None
        if instrument is None and not timed:
            self._clean_warmup.append(seconds)
        return self.recorded(seconds, loss_value, timed)

    def _instrument(self, index: int, timed: bool) -> str | None:
        """Which warm-up step carries an instrument: FLOP counting on the second step and profiling
        on the third (the first stays a plain cold step: pruning compares cold steps), on the first
        when the warm-up is a fixed single step (data-parallel ranks)."""
        if timed:
            return None
        settings = self.settings
        flops_at, profile_at = (1, 2) if settings.adaptive_warmup else (0, None)
        if settings.count_flops and index == flops_at:
            return "flops"
        if settings.profile and index == profile_at:
            return "profile"
        return None

    def _profiled_step(self, batch: Any) -> torch.Tensor:
        """One step under torch.profiler: the share of its operator time spent in matmuls and
        convolutions (the rest is elementwise work, normalisation, the optimizer: what fusion saves)."""
        from torch.profiler import ProfilerActivity, profile

        # Kineto logs every profiler start/stop (and, on a CUDA build without a GPU, an error) to
        # stderr; level 6 keeps it quiet. Read once, when the first profiler starts.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            loss = self._step_fn(batch)
            _sync(self.device)
        # (on CUDA key_averages attributes each kernel's device time to the op that launched it)
        events = prof.key_averages() if self.device.type == "cuda" else cpu_op_times(prof)
        self.result.compute_share = compute_share(events, self.device.type == "cuda")
        self.result.optimizer_share = optimizer_share(events)
        return loss

    def warm_enough(self, times: list[float]) -> bool:
        """Whether warm-up steps taking ``times`` seconds are enough (:func:`steady`); the
        instrumented steps (FLOP counting, profiling) are run but not judged for steadiness."""
        if self.settings.adaptive_warmup and self.settings.profile and len(times) < 3:
            return False  # the profiled warm-up step has not run yet
        return steady(self.settings, times, self._clean_warmup)

    def finish(self) -> Measurement:
        """The measurement so far, with the peak memory (CUDA), skipped steps and, for compiled
        candidates, the graph breaks and recompiles filled in."""
        if self._compile_counts is not None:
            now = _dynamo_counts()
            self.result.graph_breaks = now["breaks"] - self._compile_counts["breaks"]
            total = now["graphs"] - self._compile_counts["graphs"]
            self.result.recompiles = total - (self.result.graphs or total)
            self.result.graphs = total
        if self._probe is not None:
            self._probe.remove()
        self.result.skipped_steps = self.policy.stats.skipped_steps
        if self.device.type == "cuda":
            self.result.peak_memory_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.result.memory_method = "torch.cuda.max_memory_allocated"
        return self.result


def _dynamo_counts() -> dict[str, int]:
    """Graph breaks and graphs compiled so far in this process (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters

    return {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}


_COMPUTE_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "linear",
    "conv",
    "convolution",
    "scaled_dot_product",
)


@dataclass(frozen=True)
class OpTime:
    """One operator's CPU time in a profiled step, in microseconds, as ``key_averages()`` rows name
    it: its own (``self_cpu_time_total``) and with what it called (``cpu_time_total``)."""

    key: str
    self_cpu_time_total: float
    cpu_time_total: float


def cpu_op_times(prof: Any) -> list[Any]:
    """Per operator name, the CPU time of a profiled step, read from the profiler's raw events: each
    thread's events nest (a call inside its caller), so an event's own time is its span less its
    direct children's. The same figures as ``prof.key_averages()``, which turns every event into a
    Python object and builds their tree: 0.65 s for one ResNet-50 step, 7.5 s for a convnext_atto
    one (118k events), per candidate; this reads them in 0.03 s. Where the raw events are not
    there (another torch), ``key_averages()`` it is."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is None:
        return list(prof.key_averages())
    cpu = torch._C._autograd.DeviceType.CPU
    threads: dict[int, list[tuple[int, int, str]]] = {}
    for event in raw.events():
        if event.device_type() == cpu:  # (sorted below by start, the enclosing span first)
            span = (event.start_ns(), -event.end_ns(), event.name())
            threads.setdefault(event.start_thread_id(), []).append(span)
    own: dict[str, list[int]] = {}

    def close(start: int, end: int, name: str, children: int) -> None:
        times = own.setdefault(name, [0, 0])
        times[0] += end - start - children
        times[1] += end - start

    for events in threads.values():
        events.sort()
        open_spans: list[list[Any]] = []  # [start, end, name, the direct children's time]
        for start, minus_end, name in events:
            end = -minus_end
            while open_spans and open_spans[-1][1] <= start:
                close(*open_spans.pop())
            if open_spans:
                open_spans[-1][3] += end - start
            open_spans.append([start, end, name, 0])
        while open_spans:
            close(*open_spans.pop())
    return [OpTime(name, times[0] / 1e3, times[1] / 1e3) for name, times in own.items()]


def compute_share(events: Any, on_cuda: bool) -> float | None:
    """Share of the profiled time in matmul/convolution/attention operators: device time on CUDA,
    CPU self time elsewhere."""
    total = matmul = 0.0
    for event in events:
        t = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        total += t
        name = event.key.removeprefix("aten::")
        if any(op in name for op in _COMPUTE_OPS):
            matmul += t
    return matmul / total if total > 0 else None


def optimizer_share(events: Any) -> float | None:
    """Share of the profiled step's CPU time inside the optimizer's ``step`` (torch.optim marks it
    ``Optimizer.step#<class>.step``): what compiling the step can fuse beyond the model's graphs.
    CPU time on every device (a GPU step's optimizer is as launch-bound as its CPU side shows);
    None where no optimizer step ran eagerly (a compiled step inlines it)."""
    total = sum(event.self_cpu_time_total for event in events)
    inside = sum(event.cpu_time_total for event in events if event.key.startswith("Optimizer.step#"))
    return min(1.0, inside / total) if total > 0 and inside > 0 else None


def with_implementation(optimizer: torch.optim.Optimizer, implementation: str) -> torch.optim.Optimizer:
    """The same optimizer (class, hyperparameters, parameter groups) with another implementation:
    'for-loop', 'foreach' (multi-tensor kernels) or 'fused' (one kernel). Raises
    :class:`UnsupportedError` when its class has no such implementation."""
    from mixprec.errors import UnsupportedError
    from mixprec.frameworks.torch.implementations import keywords

    cls = type(optimizer)
    chosen = keywords(cls, implementation)
    if optimizer.state:
        raise UnsupportedError(
            f"{cls.__name__} already holds state: switch its implementation before the first step"
        )
    groups = [{**g, **chosen} for g in optimizer.param_groups]
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return cls(groups, **{**defaults, **chosen})


def run_candidate(
    workload: Workload,
    candidate: Candidate,
    settings: BenchSettings,
    emit: Emit | None = None,
    batches: list | None = None,
    wrap_model: Callable[[nn.Module, Policy], nn.Module] | None = None,
) -> Measurement:
    """Train a fresh copy of the workload's model under ``candidate``: warm up until steady, then
    time at least ``settings.steps`` steps (and ``min_time_s``), unpaired.

    ``batches`` (from :func:`make_batches`) lets in-process runs feed every candidate the very
    same data even when the workload's ``make_batch`` draws from a stateful generator.
    ``wrap_model`` wraps the prepared model for training (DDP in data-parallel sweeps); the
    optimizer and the honesty probe keep seeing the unwrapped model and its parameter names.
    """
    emit = emit or (lambda event: True)
    session = TrainingSession(workload, candidate, settings, batches, wrap_model)
    # From here on every step is timed against the pruning limits (setup above is not).
    emit({"event": "ready"})
    if not session.warm_up(emit):
        session.result.stopped_early = True
        return session.finish()
    result = session.result
    while len(result.step_times_s) < settings.steps or (
        sum(result.step_times_s) < settings.min_time_s and len(result.step_times_s) < settings.max_steps
    ):
        event = session.step(timed=True)
        if not emit({**event, "total": len(result.warmup_times_s) + settings.steps}):
            result.stopped_early = True
            break
    return session.finish()


def build_session(spec: dict[str, Any], candidate: Candidate, settings: BenchSettings) -> TrainingSession:
    """A candidate process's session (``Framework.session_builder``), its workload rebuilt from ``spec``."""
    from mixprec.workload import WorkloadSpec
    from mixprec.workload.loader import workload_from_spec

    workload = workload_from_spec(WorkloadSpec(spec["kind"], spec["target"], tuple(spec["sizes"].items())))
    return TrainingSession(workload, candidate, settings)
