"""`bench`: every candidate on the same workload, weights, batches and batch size, paired with
strict fp32, for any framework (the workload's backend builds the sessions).

Strict fp32 runs first (the baseline every speedup refers to) and again at the end so drift
shows. Each finished row is appended to a JSON Lines file at once; ``resume`` skips the rows
already there. A candidate whose steps are far slower than the best so far is pruned. A
:class:`~mixprec.budget.Budget` that runs out ends the sweep early: it returns the rows measured
so far.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields, replace
from typing import Any

from mixprec import validation
from mixprec.budget import Budget
from mixprec.errors import UsageError
from mixprec.events import Events, ignore
from mixprec.frameworks import Framework, framework_of
from mixprec.frameworks.session import BenchSettings, distinct_batches
from mixprec.hardware.device import DeviceInfo, detect
from mixprec.hardware.peaks import cpu_peak
from mixprec.measure import noise, record
from mixprec.measure.config import BenchConfig, parse_choice
from mixprec.measure.data_parallel import measure_data_parallel
from mixprec.measure.failure import exception_status
from mixprec.measure.isolate import SessionEnded
from mixprec.measure.pace import Paces, pace_key
from mixprec.measure.paired import BaselineEnded, PairedSweep
from mixprec.measure.recorder import RowRecorder
from mixprec.measure.repeats import Repeats
from mixprec.measure.results import NO_FLOPS_NOTE, SPARED, BenchResult, BenchRow, median_ci
from mixprec.measure.rowstore import resumed_threads
from mixprec.measure.settle import settle_rows
from mixprec.measure.threads import pick_threads, threads_kept, user_fixed
from mixprec.policy import Candidate
from mixprec.policy.registry import carrier
from mixprec.status import Status

# A candidate in a format this device only emulates (bf16 or fp16 on a CPU without their units) runs
# at most this much faster than another candidate in that format measured here (half weights
# against autocast, another layout: bf16 weights 1.04-1.07x bf16 autocast where bf16 is native, on
# the EPYC's ResNet-50 and GPT in benchmarks/results/cpu-amd-epyc): one measured
# slower than strict fp32 by more spares the others of its format their measurement.
EMULATED_SIBLING_GAIN = 1.5


def stopped_measuring(candidate: Candidate, by: str) -> str:
    """Why a sweep ended where ``by`` (the deadline or an interrupt: ``Budget.ended_by``) stopped
    ``candidate``'s own session (tune keeps what a compile cut off there had taken:
    ``BenchResult.stopped`` is compared with this)."""
    return f"stopped by {by} while measuring {candidate.label}"


def _format(cand: Candidate) -> str | None:
    """The low-precision format ``cand`` computes in ("bfloat16", "float16"; None: fp32's)."""
    dtype = cand.spec.low_precision_dtype
    return None if dtype is None else str(dtype).removeprefix("torch.")


def plan_candidates(
    framework: Framework, policies: Iterable[str], layouts: Iterable[bool], compiled: Iterable[bool]
) -> list[Candidate]:
    """Strict fp32 eager first (the baseline), then every policy x layout x compile, in that order."""
    mode = framework.compile_modes[0] if framework.compile_modes else None
    cands = [
        Candidate(p, cl, compile=mode if on else None, framework=framework.name)
        for p in policies
        for cl in layouts
        for on in compiled
    ]
    return [framework.baseline, *[c for c in cands if c != framework.baseline]]


def bench(
    workload: Any,
    config: BenchConfig | None = None,
    *,
    events: Events | None = None,
    budget: Budget | None = None,
    **fields: Any,
) -> BenchResult:
    """Measure every candidate policy on ``workload``'s real training step, paired with strict fp32.

    ``workload``: the model, its batches, loss and optimizer: a :class:`mixprec.Workload`, or another
    framework's (``mixprec.keras.KerasWorkload``). ``config``: a :class:`BenchConfig`; ``fields``
    replace its fields (``bench(workload, policies="fp32,bf16-mixed", steps=5)``), each described
    there. ``events``: the event stream (:mod:`mixprec.events`): 'stage', 'candidate', 'step',
    'row', 'note' and 'output' (what rebuilding the workload printed in a candidate's process).
    ``budget``: stops the sweep between steps when it runs out; it returns what it has.

    Before measuring, one strict-fp32 step in this process validates the workload
    (``Framework.validate_workload``): a broken ``make_batch``, ``loss_fn`` or ``optimizer_fn``
    raises one :class:`UsageError` instead of failing every row alike.
    """
    config = validation.with_fields(config or BenchConfig(), fields, "bench")
    framework = framework_of(workload)
    device = framework.resolve_device(config.device)
    events = events or ignore
    reference = baseline_of(framework, config)
    # One strict-fp32 step here first: a broken make_batch / loss_fn / optimizer_fn is one clear
    # error now, not the same failure in every row.
    events({"event": "stage", "text": "checking the workload: one strict-fp32 step"})
    size = reference.micro_batch or config.batch_size or framework.default_batch_size(workload)
    framework.validate_workload(workload, device, size, budget=budget)  # a size the budget fits
    resumed = resumed_threads(config.jsonl) if config.resume and config.jsonl else None
    if resumed is not None and config.threads == "auto" and not user_fixed():
        # A resume measures what its rows did: chosen again, the count followed the machine's load of
        # the moment (2 threads quiet, 1 beside a busy process) and the resume was refused, "rows
        # measured under other settings: threads=2 (now 1)".
        config = replace(config, threads=resumed)
        resume_notes = [f"threads: {resumed}, the count the resumed rows were measured at (not chosen again)"]
    else:
        resume_notes = []
    choice = pick_threads(framework, workload, config, device, size)
    if choice is not None:
        config = replace(config, threads=choice.threads)
    pool = bool(config.settle)  # (a settled figure pools the machine's record of it too)
    result = run_sweep(workload, framework, config, device=device, events=events, budget=budget, pool=pool)
    if config.settle:  # every row's rounds pooled over more sessions until its interval is narrow

        def again(candidates: Sequence[Candidate], rounds: int) -> BenchResult:
            fresh = replace(config, candidates=tuple(candidates), steps=rounds, jsonl=None, resume=False)
            return run_sweep(
                workload, framework, fresh, device=device, events=events, budget=budget, pool=pool
            )

        settle_rows(result, again, config.settle, config.settle_rounds)
    if choice is not None and choice.step_s:
        result.notes += [choice.reason] + ([choice.contended] if choice.contended else [])
    if resume_notes:
        result.notes += resume_notes
    return result


def baseline_of(framework: Framework, config: BenchConfig) -> Candidate:
    """What every candidate of ``config`` is paired with: strict fp32, eager, NCHW (at any micro-batch)."""
    reference = framework.baseline if config.baseline is None else framework.validate(config.baseline)
    if reference.policy != "fp32" or reference.channels_last or reference.compile or reference.keep_fp32:
        raise UsageError(
            f"the baseline must be strict fp32, eager, NCHW (at any micro-batch), got {reference.label}."
        )
    return reference


def run_sweep(
    workload: Any,
    framework: Framework,
    config: BenchConfig,
    *,
    device: str,
    events: Events,
    budget: Budget | None = None,
    finish_within: Callable[[BenchResult], Budget] | None = None,
    earlier: Sequence[BenchRow] = (),
    pool: bool = False,
) -> BenchResult:
    """The sweep under :func:`bench`, for a workload already validated on ``device``: `tune` and
    `bench_batches` run one per stage or size with a ``replace`` of their config.

    ``budget`` ends the sweep: no candidate starts once it has run out. ``finish_within``, given the
    rows so far, is the longer budget within which a candidate under way at that moment may still
    finish (tune's speed share: its rounds are lost otherwise); by default it is stopped there.
    ``earlier``: rows this run measured in sweeps before this one (a format this device only
    emulates, found far slower there, spares its other candidates here as in one sweep). ``pool``:
    each row's figure pools the machine's earlier sessions of its configuration (a settled figure:
    :mod:`mixprec.measure.record`)."""
    if config.nproc > 1 and framework.data_parallel() is None:
        raise UsageError(f"nproc > 1 (data-parallel ranks) is not available for {framework.title}; drop it.")
    if config.accumulation_steps > 1 and not framework.accumulates:
        raise UsageError(f"gradient accumulation is not measured for {framework.title} yet; drop it.")
    if config.nproc > 1 and workload.spec is None:
        raise UsageError("nproc > 1 needs a workload with a spec (built by load_workload or the zoo).")
    processes = workload.spec is not None and framework.session_builder() is not None
    isolate = processes if config.isolate is None else config.isolate
    if isolate and not processes:
        raise UsageError(
            "isolate=True needs a workload with a spec (built by load_workload or the zoo) and a framework "
            f"whose candidates can run in their own process ({framework.title}: "
            f"{'yes' if framework.session_builder() else 'no'})."
        )
    notes = [] if framework.counts_flops else [NO_FLOPS_NOTE]
    notes += list(getattr(workload, "notes", None) or [])  # what a source says of how it ran (one rank)
    layouts, dropped = framework.bench_layouts(workload, parse_choice(config.channels_last, "channels_last"))
    if dropped:
        notes.append(dropped)
    compiled = parse_choice(config.compile, "compile")
    if True in compiled and not framework.compile_modes:
        raise UsageError(f"{framework.title} has no compile mode; drop compile.")
    reference = baseline_of(framework, config)
    plan = (
        plan_candidates(framework, config.policy_names, layouts, compiled)
        if config.candidates is None
        else []
    )
    plan = [reference, *(c for c in plan if c != framework.baseline)]
    if config.candidates is None:  # a script's own precision, beside the grid
        plan += [c for c in framework.source_candidates(workload) if c not in plan]
    plan += [framework.validate(c) for c in (config.candidates or ()) if c not in plan]
    for cand in plan:
        if cand.micro_batch is not None and config.nproc > 1:
            raise UsageError(f"{cand.label}: a candidate's own micro-batch is not measured on DDP ranks yet.")
    settings = BenchSettings(
        device=device,
        batch_size=config.batch_size or framework.default_batch_size(workload),
        steps=config.steps,
        warmup=config.warmup,
        threads=config.threads if isinstance(config.threads, int) else framework.threads(),
        min_time_s=config.min_time_s,
        cudnn_benchmark=config.cudnn_benchmark,
        accumulation_steps=config.accumulation_steps,
    )
    for cand in plan:  # a candidate with its own micro-batch must train the run's samples per step
        settings.for_candidate(cand)
    info = detect(device)
    with threads_kept():  # MFU's denominators at the count the rows run at, not the caller's: a resume
        if settings.threads:  # from a 1-thread process read a 2-thread sweep's MFU 2x
            framework.use_threads(settings.threads)
        peaks = framework.peaks(info, list(dict.fromkeys(c.spec.peak_key for c in plan)))
    repeats = Repeats()
    between_run_sd, between_run_basis = repeats.between_run_sd(info.name)
    result = BenchResult(
        workload=framework.workload_label(workload),
        description=workload.description,
        device=device,
        batch_size=settings.batch_size,
        settings=recorded_settings(framework, config, settings, isolate),
        env=framework.environment(device) | _launched(workload),
        notes=notes,
        peaks=peaks,
        between_run_sd=between_run_sd,
        between_run_basis=between_run_basis,
    )
    sweep = Sweep(
        framework,
        workload,
        plan,
        settings,
        result,
        info=info,
        isolate=isolate,
        prune_factor=config.prune_factor,
        nproc=config.nproc,
        budget=budget or Budget.unlimited(),
        finish_within=finish_within,
        earlier=earlier,
        events=events,
        baseline=reference,
    )
    key = resume_key(
        framework,
        result.workload,
        settings,
        prune_factor=config.prune_factor,
        isolate=isolate,
        nproc=config.nproc,
    )
    rows = RowRecorder(
        result, events, len(plan), config.jsonl, key, resume=config.resume, resume_anyway=config.resume_anyway
    )
    try:
        with threads_kept():
            sweep.run(rows)
    finally:
        rows.close()
        # Speedups over strict fp32, paired, of a workload its label names (a model or script of the
        # user's own may change under one name: two such were once one configuration's "repeats").
        # Also when interrupted: the rows measured are runs; a resume reads them back.
        if (
            reference == framework.baseline
            and config.nproc == 1
            and record.poolable(framework.name, workload)
        ):
            _record_repeats(repeats, info.name, key, result, resumed=rows.resumed)
            record.keep(info.name, key, result, resumed=rows.resumed, pool=pool)
    return result


def _record_repeats(
    repeats: Repeats, device: str, key: dict[str, Any], result: BenchResult, resumed: set[tuple]
) -> None:
    """Keep each speedup this run measured, so a later run of the same configuration on this
    machine teaches the spread between runs its intervals include (:mod:`mixprec.measure.repeats`).
    A row read back from the stream by ``--resume`` (its key in ``resumed``) was no run of its own:
    recorded again, it would be a repeat that agrees exactly, narrowing every interval."""
    for row in result.measured:
        within = median_ci(row.paired_ratios)
        if row.status != Status.OK or row.baseline_repeat or within is None or row.key in resumed:
            continue
        config = record.configuration(key, result.description, row.candidate)
        repeats.record(device, config, statistics.median(row.paired_ratios), within)
    repeats.save()


def recorded_settings(
    framework: Framework, config: BenchConfig, settings: BenchSettings, isolate: bool
) -> dict[str, Any]:
    """What a result records of its settings (``BenchResult.settings``): the config as given, with
    what was resolved from it (the framework, threads, isolation, pairing)."""
    recorded = {
        k: v
        for k, v in config.to_dict().items()
        if k not in ("jsonl", "resume", "resume_anyway", "device", "batch_size", "candidates", "baseline")
    }
    return {
        "framework": framework.name,
        **recorded,
        "isolate": isolate,
        "threads": settings.threads,
        "cudnn_benchmark": config.cudnn_benchmark and settings.device.startswith("cuda"),
        "paired": config.nproc == 1,
    }


def resume_key(
    framework: Framework,
    label: str,
    settings: BenchSettings,
    *,
    prune_factor: float,
    isolate: bool,
    nproc: int,
) -> dict[str, Any]:
    """Every setting that changes a figure of a row: rows measured under another key are not
    comparable with this run's (a resumed sweep refuses them)."""
    import torch

    from mixprec.version import __version__

    return {
        "framework": framework.name,
        "workload": label,
        "device": settings.device,
        "batch_size": settings.batch_size,
        "accumulation_steps": settings.accumulation_steps,
        "steps": settings.steps,
        "warmup": settings.warmup,
        "min_time_s": settings.min_time_s,
        "threads": settings.threads,
        "cudnn_benchmark": settings.cudnn_benchmark and settings.device.startswith("cuda"),
        "prune_factor": prune_factor,
        "isolate": isolate,
        "nproc": nproc,
        "torch": torch.__version__,
        "mixprec": __version__,
    }


def riding_last(
    measured: Candidate, row: BenchRow, rest: list[tuple[int, Candidate]]
) -> list[tuple[int, Candidate]]:
    """``rest`` with the low formats that ride on ``measured`` moved to its end when ``measured``
    ran no faster than strict fp32 (its paired median at or below 1x, or pruned as far slower).
    fp8, MXFP8 and NVFP4 run everything but their eligible GEMMs in their carrier (bf16-mixed) and
    add scaling casts (eager fp8 ran at 0.75x bf16-mixed on an H200): where the carrier does not
    beat strict fp32 they lose to it. The H200's tune of a small nanoGPT-style script (2026-11-30):
    bf16-mixed 0.80x [0.61-0.95], then fp8-rowwise 0.30x and fp8-tensorwise 0.33x took 30 s of the
    120 s budget, and tf32, fp16-mixed and compile were never measured; the fifth lease's (the
    same script): bf16-mixed 0.96x [0.88-1.02], an interval that reaches 1x, and the time the
    checks left went to fp8 (0.31x, 0.32x: 28 s) before fp16-mixed, bf16-true and tf32. It orders;
    it never prunes."""
    slower = row.status == Status.PRUNED or (
        row.status == Status.OK and bool(row.paired_ratios) and statistics.median(row.paired_ratios) <= 1.0
    )
    if not slower:
        return rest
    # the same layout, compile and optimizer on the carrier (a low format's own keep_bf16 aside)
    same = [f.name for f in fields(Candidate) if f.name not in ("policy", "keep_bf16")]
    riding = [
        (i, c)
        for i, c in rest
        if carrier(c.policy) == measured.policy and all(getattr(c, k) == getattr(measured, k) for k in same)
    ]
    return [item for item in rest if item not in riding] + riding


def after_slow_carriers(todo: list[Candidate], rows: Iterable[BenchRow]) -> list[Candidate]:
    """``todo`` (a sweep's candidates not measured yet) with the low formats whose carrier's row
    is among ``rows`` and ran no faster than strict fp32 moved to its end (:func:`riding_last`):
    the order of a sweep's late part, whose carriers were measured in its first."""
    queue = list(enumerate(todo))
    for row in rows:
        queue = riding_last(row.candidate, row, queue)
    return [cand for _, cand in queue]


def retried(first: BenchRow, again: BenchRow) -> BenchRow:
    """``again``, the row of a pruned candidate's second attempt, saying what the first was."""
    if again.status == Status.PRUNED:
        return replace(again, reason=f"pruned twice: {first.reason}; again: {again.reason}")
    note = f"pruned on the first attempt ({first.reason}); measured on a retry"
    return replace(again, notes=(*again.notes, note))


def stalled(rows: Iterable[BenchRow], prune_factor: float) -> list[BenchRow]:
    """The pruned rows a stalled step pruned, not the candidate's speed, and not retried: a step ran
    past the limit after paired rounds that put the candidate within ``prune_factor`` of the best
    (the AMX Xeon VM, 2026-11-30: a bf16-mixed row of ResNet-50 pruned after rounds at 1.88x
    strict fp32, its steps about 0.5 s against a limit of about 4 s; the sweep's share of tune's
    budget was spent, so it was not retried, and the row stood as pruned). A row pruned while
    warming up has no rounds to say so: it is left."""
    rows = list(rows)
    best = max(
        (statistics.median(r.paired_ratios) for r in rows if r.status == Status.OK and r.paired_ratios),
        default=1.0,
    )
    return [
        r
        for r in rows
        if r.status == Status.PRUNED
        and r.paired_ratios
        and statistics.median(r.paired_ratios) * prune_factor >= best
        and not r.reason.startswith("pruned twice")
        and not any(n.startswith("not retried") for n in r.notes)  # (a format only emulated here)
    ]


class Sweep:
    """One bench run: the plan, the settings it is measured under, where rows go and the clock.

    :meth:`run` measures the plan paired with strict fp32 (or on data-parallel ranks), keeps the
    rows a resumed stream already had, and leaves the finished :class:`BenchResult` in ``result``.
    """

    def __init__(
        self,
        framework: Framework,
        workload: Any,
        plan: list[Candidate],
        settings: BenchSettings,
        result: BenchResult,
        *,
        info: DeviceInfo,
        isolate: bool,
        prune_factor: float,
        nproc: int,
        budget: Budget,
        events: Events,
        baseline: Candidate | None = None,
        finish_within: Callable[[BenchResult], Budget] | None = None,
        earlier: Sequence[BenchRow] = (),
    ) -> None:
        self.framework, self.workload, self.plan, self.settings = framework, workload, plan, settings
        self.baseline = framework.baseline if baseline is None else baseline
        self.result, self.info, self.isolate, self.prune_factor = result, info, isolate, prune_factor
        self.nproc, self.budget, self.events = nproc, budget, events
        self.finish_within, self.earlier = finish_within, earlier
        self._finish: Budget | None = None  # finish_within's budget, once ``budget`` ran out
        self.batches: list | None = None

    def run(self, rows: RowRecorder) -> BenchResult:
        result, dev = self.result, self.settings.device
        result.flops_per_step = next((r.flops_per_step for r in rows.done.values() if r.flops_per_step), None)
        start = noise.snapshot(dev)
        if self.nproc > 1:
            self._data_parallel(rows)
        else:
            self._paired(rows)
        order = {cand: i for i, cand in enumerate(self.plan)}
        result.measured.sort(key=lambda r: order.get(r.candidate, len(self.plan)))  # resumed rows too
        base = result.baseline
        result.noise = noise.summarize(start, noise.snapshot(dev), base.step_times_ms if base else ())
        if base is not None and base.status == Status.OK and base.step_time_ms:
            self._against_pace(result, base.step_time_ms.median_ms / 1e3)
        self._revalidate_cpu_peaks()
        return result

    def _against_pace(self, result: BenchResult, step_s: float) -> None:
        """Strict fp32's step against the fastest this machine gave the workload before
        (:mod:`mixprec.measure.pace`): contention said where no other rule saw it; kept where faster."""
        paces = Paces()
        key = pace_key(
            self.framework.name,
            result.workload,
            self.settings.batch_size,
            result.flops_per_step,
            f"{self.settings.device} {self.info.name}",  # (a cache directory shared by unlike machines)
            self.settings.threads,
        )
        if result.noise is not None and not result.noise.get("contended"):
            result.noise["contended"] = paces.slower(key, step_s)
        paces.record(key, step_s)

    def row(self, candidate: Candidate, status: str, reason: str = "", **fields: Any) -> BenchRow:
        own = self.settings.for_candidate(candidate)
        fields.setdefault("accumulation_steps", own.accumulation_steps)
        return BenchRow(self.result.workload, candidate, own.device, own.batch_size, status, reason, **fields)

    def resumed_or_todo(
        self, rows: RowRecorder, *, baseline_again: bool = False
    ) -> list[tuple[int, Candidate]]:
        """Record the rows a resumed stream already has; (index, candidate) of the rest to measure
        (with ``baseline_again`` the baseline always: every paired row is measured against it)."""
        todo = []
        for i, cand in enumerate(self.plan):
            own = self.settings.for_candidate(cand)
            key = (self.result.workload, cand, own.device, own.batch_size, False)
            if key in rows.done and not (baseline_again and cand == self.baseline):
                rows.record(rows.done[key], i, resumed=True)
            else:
                todo.append((i, cand))
        return todo

    def _paired(self, rows: RowRecorder) -> None:
        todo = self.resumed_or_todo(rows, baseline_again=True)
        if self._complete(rows, todo):
            return
        # shared batches are the run's size; a baseline at its own micro-batch (tune --batch auto) makes
        # its own, as each candidate with one does: batches of the whole effective batch could be past
        # the memory budget every candidate was sized for
        if not self.isolate and self.baseline.micro_batch is None:
            try:
                self.batches = self.framework.make_batches(
                    self.workload,
                    self.settings.batch_size,
                    self.settings.device,
                    self.settings.seed,
                    distinct_batches(self.settings),
                )
            except Exception as exc:  # e.g. a batch larger than the device: every row fails alike
                status, reason = exception_status(exc), f"{type(exc).__name__}: {_first_line(exc)}"
                for i, cand in todo:
                    rows.record(self.row(cand, status, reason), i)
                return
        sweep = PairedSweep(
            self.framework,
            self.workload,
            self.settings,
            label=self.result.workload,
            isolate=self.isolate,
            prune_factor=self.prune_factor,
            events=self.events,
            should_stop=self._stops_measuring,
            batches=self.batches,
            reference=self.baseline,
        )
        try:
            self._measure_paired(sweep, todo, rows)
        finally:
            sweep.close()

    def _stops_measuring(self) -> bool:
        """Whether the candidate under way is stopped: when the budget runs out, unless
        ``finish_within`` gives it longer. Stopped part-way, a candidate leaves no row: `make demo`
        beside two busy processes stopped bf16-mixed 33 s into its 71 s at the end of tune's speed
        share, and the late sweep measured it again from its start (issue 53)."""
        if not self.budget.expired():
            return False
        if self.finish_within is None or self.budget.asked_to_stop():
            return True  # (asked to stop, as by a signal: nothing is finished past that)
        if self._finish is None:
            self._finish = self.finish_within(self.result)
        return self._finish.expired()

    def _say_if_finished_late(self, row: BenchRow) -> None:
        """The note for a candidate measured in full though the budget ran out while it ran
        (``finish_within``'s budget paid; nothing is started after it, so this is said once)."""
        if self._finish is not None and row.status == Status.OK:
            past = max(0.0, -self.budget.left())
            self.result.notes.append(
                f"{row.label} was finished {past:.0f} s after the sweep's time ran out: a candidate "
                "stopped part-way leaves no row"
            )

    def _complete(self, rows: RowRecorder, todo: list[tuple[int, Candidate]]) -> bool:
        """A resumed stream that holds every row, the baseline's too: nothing to measure (measuring
        the baseline again would only append more fp32 rows)."""
        baseline = self.baseline
        if any(cand != baseline for _, cand in todo):
            return False
        own = self.settings.for_candidate(baseline)
        key = (self.result.workload, baseline, own.device, own.batch_size, False)
        if key not in rows.done:
            return False
        rows.record(rows.done[key], 0, resumed=True)
        self.result.notes.append(
            "resumed a complete sweep: every row was in the stream, nothing was measured"
        )
        return True

    def _measure_paired(
        self, sweep: PairedSweep, todo: list[tuple[int, Candidate]], rows: RowRecorder
    ) -> None:
        """The baseline, then each candidate of ``todo`` paired with it (or the row :meth:`refused`
        gives instead), the pruned ones retried once, and the baseline's final row."""
        result, baseline, count = self.result, self.baseline, len(self.plan)
        self.events({"event": "candidate", "label": baseline.label, "index": 0, "count": count})
        try:
            rows.record(sweep.start_baseline(count_flops=result.flops_per_step is None), 0)
        except SessionEnded as ended:
            if ended.status == "stopped":
                result.stopped = f"stopped by {self.budget.ended_by()} before strict fp32 was measured"
                return
            row = self.row(
                baseline,
                Status(ended.status),
                f"strict fp32 failed: {ended.reason}",
                error_traceback=ended.traceback,
            )
            for i, cand in todo:
                rows.record(replace(row, candidate=cand), i)
            return
        pruned: list[tuple[int, BenchRow]] = []
        emulated: dict[str | None, BenchRow] = {}  # format -> its pruned or far slower row, where emulated
        for row in self.earlier:  # (the late sweep measured bf16-mixed+cl 61 s after bf16-mixed's 0.41x)
            variant = row.candidate  # (a compiled or rescued variant's cost is not the emulation's alone)
            if not (row.spared or variant.compile or variant.keep_fp32 or variant.keep_bf16) and (
                (row.status == Status.PRUNED and self._emulated(variant))
                or self._emulated_and_slow(variant, row)
            ):
                emulated.setdefault(_format(variant), row)
        quickest: float | None = None  # the shortest wall time of a candidate measured in full so far
        queue, at = list(todo), 0
        while at < len(queue):
            i, cand = queue[at]
            at += 1
            if cand == baseline:
                continue
            if self.budget.expired():
                result.stopped = f"stopped by {self.budget.ended_by()} before {cand.label}"
                break
            refused = self.refused(cand) or self._as_hopeless_as(cand, emulated)
            if refused is None and quickest is not None and not self.budget.can_pay(quickest):
                # A candidate stopped part-way leaves no row: its time is lost to the stages after
                # the sweep. Beside two busy processes, `make demo`'s sweep started bf16-mixed+cl
                # with 18 s of its share left (a candidate took 32 s there) and was stopped 24 s
                # later; bf16-mixed's check then missed its 151 s price by 2 s (issue 53).
                left = max(self.budget.left(), 0.0)
                result.stopped = (  # (not "by the deadline": it has not passed)
                    f"stopped before {cand.label}: the {left:.0f} s left could not pay for it "
                    f"(the quickest candidate so far took {quickest:.0f} s)"
                )
                break
            self.events({"event": "candidate", "label": cand.label, "index": i, "count": count})
            try:
                row = refused or sweep.measure(cand)
            except BaselineEnded as ended:  # nothing can be paired after it; the rows so far stand
                result.stopped = result.baseline_ended = f"{ended.reason} while measuring {cand.label}"
                break
            except SessionEnded:  # told to stop while measuring it
                result.stopped = stopped_measuring(cand, self.budget.ended_by())
                break
            hopeless = refused is None and self._emulated_and_slow(cand, row)
            if refused is None and row.status == Status.OK and row.wall_s:
                self._say_if_finished_late(row)
                # A format this device only emulates, far slower than strict fp32, prices no
                # candidate in another format: the busy demo's late sweep measured bf16-mixed at
                # 0.42x in 78 s, then did not start fp16-mixed with 78 s left, where its cold step
                # is pruned in about 17 s (tune exit 5).
                if not hopeless:
                    quickest = row.wall_s if quickest is None else min(quickest, row.wall_s)
            if row.status == Status.PRUNED:
                support = self.framework.support(cand, self.info, self.workload)
                if support.native:
                    pruned.append((i, row))
                else:  # a format this device only emulates: far slower is expected, no second attempt
                    if not row.notes or not row.notes[-1].startswith("not retried"):
                        row = replace(row, notes=(*row.notes, f"not retried: {support.reason}"))
                    emulated.setdefault(_format(cand), row)
            elif hopeless:
                emulated.setdefault(_format(cand), row)
            rows.record(row, i)
            if refused is None:
                queue[at:] = riding_last(cand, row, queue[at:])
        # A transient must not prune a candidate for good: one more attempt, when time is left.
        for i, first in pruned:
            if result.stopped or self.budget.expired():
                break
            label = f"{first.candidate.label} (retry)"
            self.events({"event": "candidate", "label": label, "index": i, "count": count})
            try:
                again = sweep.measure(first.candidate)
            except BaselineEnded as ended:
                why = f"{ended.reason} while retrying {first.candidate.label}"
                result.stopped = result.baseline_ended = why
                break
            except SessionEnded:
                result.stopped = f"stopped by {self.budget.ended_by()} while retrying {first.candidate.label}"
                break
            rows.record(retried(first, again), i)
            self._say_if_finished_late(again)
        final = sweep.finish_baseline()
        result.flops_per_step = result.flops_per_step or final.flops_per_step
        rows.record(final, 0, closing=True)

    def _data_parallel(self, rows: RowRecorder) -> None:
        """Each candidate on ``nproc`` ranks, one after another (no pairing, no pruning)."""
        result, count, run = self.result, len(self.plan), self.framework.data_parallel()
        assert run is not None, "bench() refuses nproc > 1 for a framework without data parallelism"
        for i, cand in self.resumed_or_todo(rows):
            if self.budget.expired():
                result.stopped = f"stopped by {self.budget.ended_by()} before {cand.label}"
                break
            self.events({"event": "candidate", "label": cand.label, "index": i, "count": count})
            support = self.framework.support(cand, self.info, self.workload)
            if not support:
                hint = f"; try {support.suggestion}" if support.suggestion else ""
                rows.record(self.row(cand, Status.UNSUPPORTED, support.reason + hint), i)
                continue
            settings = replace(self.settings, count_flops=result.flops_per_step is None)
            outcome = run(self.workload.spec, cand, settings, self.nproc)
            row = measure_data_parallel(self.row(cand, Status.OK), outcome)
            result.flops_per_step = result.flops_per_step or row.flops_per_step
            rows.record(row, i)

    def _emulated(self, cand: Candidate) -> str | None:
        """The low-precision format ``cand`` computes in where this device only emulates it, else None."""
        fmt = _format(cand)
        if fmt is None or self.framework.support(cand, self.info, self.workload).native:
            return None
        return fmt

    def _emulated_and_slow(self, cand: Candidate, row: BenchRow) -> bool:
        """Whether ``row`` measured an eager candidate in a format this device only emulates, slower
        than strict fp32 by more than another candidate in that format could gain on it
        (:data:`EMULATED_SIBLING_GAIN`), its interval's upper end included."""
        if row.status != Status.OK or cand.compile or self._emulated(cand) is None:
            return False  # (support before the bootstrap: most devices compute their half formats natively)
        interval = median_ci(row.paired_ratios)
        return interval is not None and interval[1] * EMULATED_SIBLING_GAIN < 1.0

    def _as_hopeless_as(self, cand: Candidate, emulated: dict[str | None, BenchRow]) -> BenchRow | None:
        """A pruned row, unmeasured, for an eager candidate in a format this device only emulates
        when another candidate in that format (another layout, autocast or half weights) was already
        pruned or measured far slower than strict fp32: the emulation, not the layout or the
        policy, is the cost."""
        fmt = None if cand.compile else self._emulated(cand)
        first = emulated.get(fmt) if fmt is not None else None
        if first is None:
            return None
        if first.status == Status.PRUNED:
            why = f"{first.label} was pruned ({first.reason}) and this device only emulates {fmt}"
        else:
            ratio = statistics.median(first.paired_ratios)
            low, high = median_ci(first.paired_ratios) or (ratio, ratio)
            why = (
                f"{first.label} measured {ratio:.2f}x strict fp32 [{low:.2f}-{high:.2f}] and this device "
                f"only emulates {fmt}: another candidate in it gains at most "
                f"{EMULATED_SIBLING_GAIN:g}x on that"
            )
        return self.row(cand, Status.PRUNED, f"{SPARED}{why}")

    def refused(self, cand: Candidate) -> BenchRow | None:
        """The row of a candidate that is not measured: unsupported here, or one the backend need
        not time (a math mode computing what strict fp32 computes: 'no-effect'); None: measure it."""
        support = self.framework.support(cand, self.info, self.workload)
        if not support:
            hint = f"; try {support.suggestion}" if support.suggestion else ""
            return self.row(cand, Status.UNSUPPORTED, support.reason + hint)
        refusal = self.framework.refuse(self.workload, cand, self.settings, self.batches)
        return self.row(cand, Status(refusal[0]), refusal[1]) if refusal else None

    def _revalidate_cpu_peaks(self) -> None:
        """A run faster than the measured CPU peak proves the peak low: measure it again (keeping the
        larger), once per sweep; what still exceeds it is shown as MFU n/a by ``assemble``."""
        if self.info.type != "cpu":
            return
        result = self.result
        beaten = {
            r.candidate.spec.peak_key
            for r in result.rows
            if r.achieved_tflops and r.peak_flops and r.achieved_tflops * 1e12 > r.peak_flops
        }
        for key in beaten:
            try:
                result.peaks[key] = cpu_peak(key, self.info, refresh=True)
            except (RuntimeError, OSError, UsageError):
                continue


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def _launched(workload: Any) -> dict[str, Any]:
    """A source run as a launch of several processes (torchrun): its launcher and world size."""
    launch = getattr(workload, "launch_record", None)
    return {"launch": launch} if launch else {}
