"""`bench` for Keras workloads: every candidate paired with strict fp32 in its own process, the
same rows (:class:`mixprec.BenchResult`) as a torch sweep, so tables, tune and reports read them
unchanged. The loop itself is :func:`mixprec.measure.sweep.run_paired`; only the sessions differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from mixprec.errors import UsageError
from mixprec.hardware.device import DeviceInfo, detect
from mixprec.keras import backend
from mixprec.keras.environment import collect
from mixprec.keras.policy import keras_support
from mixprec.keras.session import KerasSession, build_keras_session
from mixprec.keras.workload import KerasWorkload, workload_label
from mixprec.measure import isolate as isolation
from mixprec.measure import noise
from mixprec.measure.isolate import ChildSession, LocalSession
from mixprec.measure.paired import PairedSweep, Session
from mixprec.measure.results import KERAS_MFU_NOTE, BenchResult, BenchRow
from mixprec.measure.runner import BenchSettings
from mixprec.measure.sweep import RowRecorder, _validate, parse_policies, resume_key, run_paired
from mixprec.policy import Candidate
from mixprec.status import Status

Progress = Callable[[dict[str, Any]], None]
BASELINE = Candidate("fp32", framework="tensorflow")
XLA_CHOICES = ("off", "on", "both")


class KerasPairedSweep(PairedSweep):
    """The paired sweep with Keras sessions (in child processes, or in this one)."""

    baseline_candidate = BASELINE

    def _open(self, candidate: Candidate, settings: BenchSettings) -> Session:
        stop = self.should_stop if candidate != BASELINE else (lambda: False)
        workload = cast(KerasWorkload, self.workload)
        if self.isolate:
            assert workload.spec is not None
            return ChildSession(
                workload.spec, candidate, settings, should_stop=stop, build=build_keras_session
            )
        return LocalSession(
            cast(Any, workload),
            candidate,
            settings,
            should_stop=stop,
            factory=lambda: KerasSession(workload, candidate, settings, self.batches),
        )


def plan_candidates(policies: Sequence[str], xla: str) -> list[Candidate]:
    """Strict fp32 first (the baseline), then each policy with the plain tf.function step and/or XLA."""
    xla_modes: dict[str, list[str | None]] = {"off": [None], "on": ["xla"], "both": [None, "xla"]}
    modes = xla_modes[xla]
    cands = [Candidate(p, compile=m, framework="tensorflow") for p in policies for m in modes]
    return [BASELINE, *[c for c in cands if c != BASELINE]]


def refusal(cand: Candidate, label: str, settings: BenchSettings, info: DeviceInfo) -> BenchRow | None:
    support = keras_support(cand, info)
    if support:
        return None
    hint = f"; try {support.suggestion}" if support.suggestion else ""
    return BenchRow(
        label, cand, settings.device, settings.batch_size, Status.UNSUPPORTED, support.reason + hint
    )


def bench(
    workload: KerasWorkload,
    *,
    policies: str | Sequence[str] | None = "all",
    xla: str = "off",
    batch_size: int | None = None,
    steps: int = 10,
    warmup: int = 2,
    min_time_s: float = 0.0,
    device: str | None = None,
    jsonl: str | Path | None = None,
    resume: bool = False,
    isolate: bool | None = None,
    prune_factor: float = 5.0,
    progress: Progress | None = None,
    candidates: Sequence[Candidate] | None = None,
    deadline: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> BenchResult:
    """Measure Keras candidates on ``workload``'s compiled train step, paired with strict fp32.

    Arguments as :func:`mixprec.bench`, plus ``xla``: 'off' (the tf.function train step), 'on'
    (``jit_compile=True``) or 'both'. Policies without a Keras equivalent (bf32) and tf32 off a
    GPU become 'unsupported' rows; the torch-only axes (channels_last, optimizer implementations,
    data-parallel ranks) do not apply.
    """
    if not isinstance(workload, KerasWorkload):
        raise UsageError(f"mixprec.keras.bench() takes a KerasWorkload, got {type(workload).__name__}.")
    if xla not in XLA_CHOICES:
        raise UsageError(f"Invalid xla {xla!r}; valid: {', '.join(XLA_CHOICES)}.")
    _validate(steps, warmup, batch_size, min_time_s, prune_factor)
    device = str(device or backend.default_device())
    backend.device_name(device)  # a clear error for a device TensorFlow cannot see
    isolate = workload.spec is not None if isolate is None else isolate
    if isolate and workload.spec is None:
        raise UsageError("isolate=True needs a Keras workload with a spec (built by load_keras_workload).")
    info = detect(device)
    names = parse_policies(policies)
    label = workload_label(workload)
    bs = batch_size or workload.default_batch_size
    plan = plan_candidates(names, xla) if candidates is None else [BASELINE]
    plan += [c for c in (candidates or []) if c not in plan]
    threads = backend.tf().config.threading.get_intra_op_parallelism_threads() or _torch_threads()
    settings = BenchSettings(
        device=device,
        batch_size=bs,
        steps=steps,
        warmup=warmup,
        threads=threads,
        min_time_s=min_time_s,
        profile=False,
    )
    result = BenchResult(
        workload=label,
        description=workload.description,
        device=device,
        batch_size=bs,
        settings={
            "framework": "tensorflow",
            "steps": steps,
            "warmup": warmup,
            "prune_factor": prune_factor,
            "isolate": isolate,
            "policies": names,
            "xla": xla,
            "threads": threads,
            "min_time_s": min_time_s,
            "paired": True,
        },
        env=collect(device),
        notes=[KERAS_MFU_NOTE],
    )
    progress = progress or (lambda event: None)
    key = resume_key(label, settings, prune_factor=prune_factor, isolate=isolate, nproc=1)
    rows = RowRecorder(result, progress, len(plan), jsonl, {**key, "framework": "tensorflow"}, resume=resume)
    done, record = rows.done, rows.record
    try:
        _sweep(
            workload,
            plan,
            settings,
            label,
            device,
            bs,
            isolate,
            prune_factor,
            info,
            result,
            done,
            record,
            progress,
            deadline,
            should_stop,
        )
    finally:
        rows.close()
    return result


def _sweep(
    workload: KerasWorkload,
    plan: list[Candidate],
    settings: BenchSettings,
    label: str,
    device: str,
    bs: int,
    isolate: bool,
    prune_factor: float,
    info: Any,
    result: BenchResult,
    done: dict[tuple, BenchRow],
    record: Callable[..., None],
    progress: Progress,
    deadline: float | None,
    should_stop: Callable[[], bool] | None,
) -> None:

    def stop_requested() -> bool:
        return (deadline is not None and time.perf_counter() > deadline) or bool(
            should_stop and should_stop()
        )

    todo = [(i, c) for i, c in enumerate(plan) if (label, c, device, bs, False) not in done or c == BASELINE]
    for i, cand in enumerate(plan):
        if (label, cand, device, bs, False) in done and cand != BASELINE:
            record(done[(label, cand, device, bs, False)], i, resumed=True)
    start = noise.snapshot(device)
    if len(todo) > 1 or not done:
        if isolate:
            # TensorFlow imported once in the fork server, not again in every candidate's process
            isolation.preload_also("mixprec.keras.preloaded", "mixprec.keras.session")
        sweep = KerasPairedSweep(
            cast(Any, workload),
            settings,
            label=label,
            isolate=isolate,
            prune_factor=prune_factor,
            progress=progress,
            should_stop=stop_requested,
        )
        run_paired(
            sweep,
            plan,
            todo,
            result,
            record,
            stop_requested,
            progress,
            refuse=lambda cand: refusal(cand, label, settings, info),
        )
    order = {cand: i for i, cand in enumerate(plan)}
    result.measured.sort(key=lambda r: order.get(r.candidate, len(plan)))
    base = result.baseline
    result.noise = noise.summarize(start, noise.snapshot(device), base.step_times_ms if base else ())


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
