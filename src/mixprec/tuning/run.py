"""`tune`: the fastest configuration that trains correctly, with the evidence, for any framework.

The stages of :mod:`mixprec.tuning.search` in order (the speed sweep, the numerics of the candidates
that beat strict fp32, the rest of the sweep, compiled and optimizer variants, the race, the decision
and fp8 predictions); then lint and the exports of the pick.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from mixprec import clock
from mixprec.budget import Budget
from mixprec.events import Events, ignore
from mixprec.frameworks import framework_of
from mixprec.hardware.device import detect
from mixprec.measure.compile_cache import inductor_cache
from mixprec.measure.threads import pick_threads, threads_kept
from mixprec.policy import Candidate
from mixprec.tuning import batching
from mixprec.tuning import settle as settling
from mixprec.tuning.batching import BatchPlan
from mixprec.tuning.config import TuneConfig
from mixprec.tuning.decide import Recommendation
from mixprec.tuning.order import tune_plan
from mixprec.tuning.result import TuneResult
from mixprec.tuning.search import RESERVE_S, Search, Sweeps, complete


def tune(
    workload: Any,
    config: TuneConfig | None = None,
    *,
    events: Events | None = None,
    stop: Any = None,
    interrupt: Any = None,
    **fields: Any,
) -> TuneResult:
    """Find the fastest configuration that trains like fp32 on ``workload`` within the budget.

    ``workload``: a :class:`mixprec.Workload`, or another framework's (``mixprec.keras.KerasWorkload``).
    ``config``: a :class:`~mixprec.tuning.config.TuneConfig`; ``fields`` replace its fields, the
    nested ones by their flat names (``tune(workload, budget_s=60, steps=2, check_steps=4)``), each
    described there. ``events``: the event stream (:mod:`mixprec.events`): 'stage' lines, the
    sweeps' 'candidate', 'step', 'row' and 'output' events, and the checks' 'verdict' events.
    ``stop``: polled with the clock; True stops the search as if the budget were spent.
    ``interrupt``: polled as ``stop`` is, for a signal (the CLI's Ctrl-C): it stops the search the
    same way, and the result says it was interrupted (:attr:`TuneResult.interrupted`), not that the
    budget ran out.

    The workload is validated first, by one strict-fp32 step in this process.
    """
    config = (config or TuneConfig()).with_fields(**fields)
    framework = framework_of(workload)
    # (a script's own batch before it runs: the --batch auto default and the size it is validated at)
    bs = config.bench.batch_size or framework.default_batch_size(workload)
    modes = list(framework.compile_modes[:1] if config.compile_modes is None else config.compile_modes)
    for mode in modes:  # validated before anything runs
        framework.validate(Candidate("fp32", compile=mode, framework=framework.name))
    budget = Budget(config.budget_s, reserve_s=RESERVE_S, stop=stop, interrupt=interrupt)
    events = events or ignore
    dev = framework.resolve_device(config.device)
    info = detect(dev)
    auto = config.batch == "auto"
    if auto:
        bs = batching.effective(framework, config.effective_batch, bs)
    events({"event": "stage", "text": "checking the workload: one strict-fp32 step"})
    # under --batch auto, at the smallest size: the effective batch may not fit strict fp32 at once
    framework.validate_workload(workload, dev, batching.fit_sizes(bs)[0] if auto else bs, budget=budget)
    if not auto:  # a script's samples per step are known once its first steps ran
        bs = config.bench.batch_size or framework.default_batch_size(workload)
    # the threads every stage measures at (the fastest now on a CPU), chosen once for the whole tune
    choice = pick_threads(framework, workload, config.bench, dev, batching.fit_sizes(bs)[0] if auto else bs)
    if choice is not None:
        config = replace(config, bench=replace(config.bench, threads=choice.threads))
    started = clock.now()
    plan = _batch_plan(framework, workload, config, dev, bs, info, events, budget) if auto else None
    sweeps = Sweeps(
        workload, framework, config, device=dev, batch_size=bs, budget=budget, events=events, batches=plan
    )
    if choice is not None and choice.step_s:
        sweeps.notes += [choice.reason] + ([choice.contended] if choice.contended else [])
    if plan is not None:
        sweeps.phases["batch"] = clock.now() - started
    # the race's in-process sessions set the chosen thread count; compiled artefacts are shared by
    # every candidate process and later runs (Inductor's caches in mixprec's cache directory)
    with threads_kept(), inductor_cache():
        if isinstance(config.bench.threads, int):
            # the numerics checks run in this process: at the threads the sweeps measure at (a busy
            # 2-core EPYC ran a strict-fp32 step in 2.9 s at 1 thread and 10.2 s at the default 2)
            framework.use_threads(config.bench.threads)
        search = Search.start(sweeps, info)
        settling.reserve(search)
        rec, ranked = search.run(info, modes)
        with sweeps.phase("speed"):  # the pick's figure, to the precision a repeat reproduces
            rec, ranked = settling.settle_pick(search, rec, ranked)
    result = search.result
    # (before the pick is completed: linting it cuts nothing from the search)
    interrupted = interrupted_reason(budget)  # (then the budget did not run out: a signal stopped it)
    exhausted = exhausted_reason(config.budget_s, budget.cuts, rec, budget.cut_a_lower_precision)
    exhausted = None if interrupted else exhausted
    findings: list[dict[str, Any]] | None = None
    exports: dict[str, str] = {}
    refusals: dict[str, str] = {}
    if rec is not None:
        rec, findings = complete(search, rec, lint=config.lint)
        exports, refusals = framework.exports(rec.candidate, dev, workload)
    elapsed = budget.elapsed()
    sweeps.phases["other"] = max(0.0, elapsed - sum(sweeps.phases.values()))
    if elapsed > config.budget_s * 1.05:
        sweeps.notes.append(
            f"tune took {elapsed:.0f} s of its {config.budget_s:.0f} s budget: a step under way when the "
            "budget ran out was finished, not thrown away"
        )
    return TuneResult(
        budget_exhausted=exhausted,
        interrupted=interrupted,
        workload=result.workload,
        description=workload.description,
        device=dev,
        recommendation=rec,
        ranked=ranked,
        bench=result,
        check=search.checks.checked,
        lint=findings,
        budget_s=config.budget_s,
        elapsed_s=elapsed,
        env=result.env or framework.environment(dev),
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        notes=sweeps.notes,
        exports=exports,
        export_refusals=refusals,
        phases={name: round(seconds, 1) for name, seconds in sweeps.phases.items()},
        batches=plan.to_dict() if plan is not None else None,
    )


def _batch_plan(
    framework: Any,
    workload: Any,
    config: TuneConfig,
    device: str,
    effective_batch: int,
    info: Any,
    events: Events,
    budget: Budget,
) -> BatchPlan:
    """``--batch auto``: each supported candidate's largest micro-batch within the memory budget."""
    limit, source = batching.memory_budget(framework, device, config.memory_budget)
    candidates = [
        c
        for c in tune_plan(framework, workload, info, config.policy_names)
        if framework.support(c, info, workload).supported
    ]
    return batching.plan_micro_batches(
        framework,
        workload,
        candidates,
        device,
        effective_batch=effective_batch,
        memory_budget=limit,
        budget_source=source,
        events=events,
        budget=budget,
    )


def interrupted_reason(budget: Budget) -> str | None:
    """After how long a signal stopped tune, and what it cut; None when nothing did."""
    if not budget.interrupted():
        return None
    cut = f": {'; '.join(budget.cuts)}" if budget.cuts else ""
    return f"stopped after {budget.elapsed():.0f} s of its {budget.seconds:g} s budget{cut}"


def exhausted_reason(
    budget_s: float, cuts: list[str], rec: Recommendation | None, lower_left: bool = True
) -> str | None:
    """Why tune exits 5: the budget ran out before a lower precision than fp32 could be picked
    (None: it did not, or a lower precision was picked all the same, or ``lower_left`` is False:
    every cut kept back fp32 work alone, such as its compiles, which cannot have changed the pick's
    precision)."""
    if not cuts or (rec is not None and (rec.candidate.policy != "fp32" or not lower_left)):
        return None
    if rec is None:
        pick = "nothing could be recommended"
    else:  # (fp32 with what else it has: +compile, +cl; strict fp32 math all the same)
        label = rec.candidate.label
        pick = f"only strict fp32{f' ({label})' if label != 'fp32' else ''} could be recommended"
    reason = f"the {budget_s:g} s budget ran out: {'; '.join(cuts)}, so {pick}"
    if rec is not None and rec.untried:  # what was not tried, and the budget that would try it
        reason += f"; {rec.untried}"
    return reason
