"""`tune`: the fastest configuration that trains correctly, with the evidence, for any framework.

The stages (:class:`mixprec.tuning.search.Search`) in order: the speed sweep, the numerics of the
candidates that beat strict fp32 (with keep-fp32 rescues), the rest of the sweep, compiled and
optimizer variants, the decision and the re-measurement of a tie, fp8 predictions; then lint and
the exports of the pick.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import torch

from mixprec.budget import Budget
from mixprec.checking.check import TRAIN_STEPS
from mixprec.errors import UsageError
from mixprec.events import Events, ignore
from mixprec.frameworks import framework_of
from mixprec.hardware.device import detect
from mixprec.policy import Candidate
from mixprec.policy.islands import batch_norm_layers
from mixprec.tuning import batching
from mixprec.tuning.batching import BatchPlan
from mixprec.tuning.result import TuneResult
from mixprec.tuning.search import RESERVE_S, Search


def tune(
    workload: Any,
    *,
    budget_s: float = 300.0,
    device: Any = None,
    batch_size: int | None = None,
    steps: int = 4,
    warmup: int = 1,
    check_steps: int = 6,
    fix: bool = True,
    lint: bool = True,
    noise: float = 0.03,
    compile_modes: Sequence[str] | None = None,
    optimizers: bool = True,
    train_steps: int = TRAIN_STEPS,
    events: Events | None = None,
    stop: Any = None,
    batch: str | None = None,
    memory_budget: int | str | None = None,
    effective_batch: int | None = None,
) -> TuneResult:
    """Find the fastest configuration that trains like fp32 on ``workload`` within ``budget_s`` seconds.

    Args:
        workload: a :class:`mixprec.Workload`, or another framework's (``mixprec.keras.KerasWorkload``).
        budget_s: seconds for the whole search (measuring, checking, compiling, re-measuring).
        device: 'cpu', 'cuda[:N]' (default: the framework's: CUDA when available).
        batch_size: samples per step (default: the workload's).
        steps / warmup: paired rounds and (at least) untimed steps per candidate.
        check_steps: training steps compared with the strict-fp32 reference.
        fix: search a keep_fp32 rescue for a candidate that fails its check.
        lint: lint the model under the recommended candidate (where the framework has a linter).
        noise: the smallest relative speed difference treated as real.
        compile_modes: compile modes tried on the best eager candidates (() for none; default: the
            framework's first, torch.compile's "default" or Keras' "xla").
        optimizers: try the pick with its optimizer's other implementations (foreach, fused).
        train_steps: the length of the training run compile time is amortised over: a compile
            that costs 90 s to save 5 ms per step is not recommended for a 100-step job.
        events: the event stream (:mod:`mixprec.events`): 'stage' lines, the sweeps' 'candidate',
            'step', 'row' and 'output' events, and the checks' 'verdict' events.
        stop: polled with the clock; True stops the search as if the budget were spent.
        batch: "auto" to search the micro-batch with the precision (:mod:`mixprec.tuning.batching`):
            each candidate at the largest micro-batch that fits ``memory_budget`` (bytes; on CUDA by
            default the free memory less 10%), with gradient accumulation to ``effective_batch``
            samples per optimizer step (default ``batch_size``, else the workload's); None: every
            candidate at ``batch_size``.

    The workload is validated first, by one strict-fp32 step in this process.
    """
    framework = framework_of(workload)
    if isinstance(budget_s, bool) or not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise UsageError(f"budget must be a number of seconds > 0, got {budget_s!r}.")
    if isinstance(train_steps, bool) or not isinstance(train_steps, int) or train_steps < 1:
        raise UsageError(f"train_steps must be an integer >= 1, got {train_steps!r}.")
    modes = list(framework.compile_modes[:1] if compile_modes is None else compile_modes)
    for mode in modes:  # validated before anything runs
        framework.validate(Candidate("fp32", compile=mode, framework=framework.name))
    budget = Budget(budget_s, reserve_s=RESERVE_S, stop=stop)
    events = events or ignore
    dev = framework.resolve_device(device)
    info = detect(dev)
    bs = batch_size or framework.default_batch_size(workload)
    if batch is not None and batch != "auto":
        raise UsageError(f"batch must be 'auto' (or None: batch_size for every candidate), got {batch!r}.")
    if batch is None and (memory_budget is not None or effective_batch is not None):
        raise UsageError(
            "memory_budget and effective_batch apply to batch='auto' (--batch auto); pass it too."
        )
    plan: BatchPlan | None = None
    if batch == "auto":
        bs = batching.effective(framework, effective_batch, bs)
        limit, source = batching.memory_budget(framework, dev, memory_budget)
    events({"event": "stage", "text": "checking the workload: one strict-fp32 step"})
    # under --batch auto, at the smallest size: the effective batch may not fit strict fp32 at once
    framework.validate_workload(workload, dev, batching.fit_sizes(bs)[0] if batch == "auto" else bs)
    if batch == "auto":
        start = time.perf_counter()
        plan = batching.plan_micro_batches(
            framework,
            workload,
            [
                framework.validate(c)
                for c in framework.tune_candidates(workload, info)
                if framework.support(c, info).supported
            ],
            dev,
            effective_batch=bs,
            memory_budget=limit,
            budget_source=source,
            events=events,
            budget=budget,
        )
        batch_s = time.perf_counter() - start
    search = Search(
        workload,
        framework,
        dev,
        dict(batch_size=bs, steps=steps, warmup=warmup, device=dev),
        check_steps=check_steps,
        fix=fix,
        noise=noise,
        train_steps=train_steps,
        budget=budget,
        events=events,
        batches=plan,
    )
    if plan is not None:
        search.phases["batch"] = batch_s
    with search.phase("speed"):
        search.measure_speed(info)
    with search.phase("numerics"):
        search.check_faster()
    with search.phase("speed"):
        search.finish_speed(info)
    with search.phase("numerics"):
        search.check_faster()  # the candidates measured late, if any beat strict fp32
    with search.phase("compile"):
        search.try_compile(modes)
    with search.phase("race"):
        search.race_finalists()
    rec, ranked = search.decide()
    if rec is not None and optimizers and not rec.candidate.compile_scope:
        with search.phase("speed"):  # the pick's optimizer implementations: same numerics, maybe faster
            search.try_optimizers(rec)
        rec, ranked = search.decide()
    if rec is not None and plan is not None:
        with search.phase("speed"):
            search.try_smaller_batch(rec)
        rec, ranked = search.decide()
    with search.phase("prediction"):
        search.predict(info)  # a note for hardware that runs them; it cannot change the pick here
    result = search.result
    assert result is not None
    findings = None
    exports: dict[str, str] = {}
    refusals: dict[str, str] = {}
    if rec is not None:
        rec.micro_batch = rec.candidate.micro_batch or bs
        rec.accumulation_steps = rec.candidate.accumulation_steps
        row = next((r for r in result.rows if r.candidate == rec.candidate), None)
        measured = plan.peak(rec.candidate) if plan is not None else None
        rec.peak_memory_bytes = measured if measured is not None else (row.peak_memory_bytes if row else None)
        if plan is not None:
            model = getattr(workload, "model", None)  # a torch workload's: BatchNorm follows the micro-batch
            batch_norm = isinstance(model, torch.nn.Module) and bool(batch_norm_layers(model))
            search.notes += batching.notes(plan, framework.default_batch_size(workload), batch_norm)
        search.note_compute_share(rec)
        if lint and budget.elapsed() < budget.seconds:
            findings = search.lint(rec)
            if findings:
                rec.lint_worth_fixing = [f for f in findings if f.get("severity") in ("warning", "error")][:5]
        exports, refusals = framework.exports(rec.candidate, dev)
    elapsed = budget.elapsed()
    search.phases["other"] = max(0.0, elapsed - sum(search.phases.values()))
    if elapsed > budget_s * 1.05:
        search.notes.append(
            f"tune took {elapsed:.0f} s of its {budget_s:.0f} s budget: a step under way when the budget "
            "ran out was finished, not thrown away"
        )
    exhausted = None
    if budget.cuts and (rec is None or rec.candidate.policy == "fp32"):
        pick = "nothing could be recommended" if rec is None else "only strict fp32 could be recommended"
        exhausted = f"the {budget_s:g} s budget ran out: {'; '.join(budget.cuts)}, so {pick}"
    return TuneResult(
        budget_exhausted=exhausted,
        workload=result.workload,
        description=workload.description,
        device=dev,
        recommendation=rec,
        ranked=ranked,
        bench=result,
        check=search.checked,
        lint=findings,
        budget_s=budget_s,
        elapsed_s=elapsed,
        env=result.env or framework.environment(dev),
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        notes=search.notes,
        exports=exports,
        export_refusals=refusals,
        phases={name: round(seconds, 1) for name, seconds in search.phases.items()},
        batches=plan.to_dict() if plan is not None else None,
    )
