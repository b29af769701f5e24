"""`check`: does a policy train like fp32? Where does it break, and which fp32 islands fix it?

The facade: the candidates named, validated (names, keep_fp32 patterns, tied weights) before anything
runs; the strict-fp32 reference made once (:mod:`~mixprec.checking.reference`) and each candidate
judged against it, with a fix searched on request (:mod:`~mixprec.checking.checker`).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from typing import Any

from mixprec import validation
from mixprec.budget import Budget
from mixprec.checking.checker import Checker, cured, field_rules  # noqa: F401 (importers' names)
from mixprec.checking.config import TRAIN_STEPS, CheckConfig  # noqa: F401
from mixprec.checking.reference import MAX_POWER_STEPS, POWER_FACTOR, not_learning, run_spread  # noqa: F401
from mixprec.errors import PolicyError
from mixprec.events import Events, ignore
from mixprec.frameworks import Framework, framework_of
from mixprec.hardware.device import detect
from mixprec.hardware.formats import slow_formats
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.policy import Candidate
from mixprec.policy.registry import POLICY_NAMES
from mixprec.status import Status


def make_checker(
    workload: Any,
    config: CheckConfig | None = None,
    *,
    events: Events | None = None,
    budget: Budget | None = None,
) -> Checker:
    """Run the fp32 reference, its per-layer ranges and the chaos floor once, for many checks
    (``config``'s steps, batch size, device, thresholds and run length)."""
    config = config or CheckConfig()
    framework = framework_of(workload)
    dev = framework.resolve_device(config.device)
    events = events or ignore
    bs = config.batch_size or framework.default_batch_size(workload)
    events({"event": "stage", "text": "checking the workload: one strict-fp32 step"})
    framework.validate_workload(workload, dev, bs, budget=budget)
    bs = config.batch_size or framework.default_batch_size(workload)  # a script's is known only now
    return Checker(workload, framework, dev, bs, config, events, budget)


def checked_by_all() -> list[str]:
    """What ``policies="all"`` checks: every policy but the fp32 reference (one this device cannot
    run is a row that says so)."""
    return [name for name in POLICY_NAMES if name != "fp32"]


def candidates_of(
    framework: Framework, policies: str | Sequence[str | Candidate], emulate: Sequence[str]
) -> list[Candidate]:
    """The candidates ``policies`` (names, a comma-separated string of them, ``all``: every policy
    but the fp32 reference, or Candidates) and ``emulate`` (formats) name, validated."""
    if isinstance(policies, str):  # 'bf16-mixed,fp16-mixed', as bench takes it (not its characters)
        policies = [p.strip() for p in policies.split(",") if p.strip()]
    if list(policies) == ["all"]:
        policies = checked_by_all()
    cands = [p if isinstance(p, Candidate) else Candidate(p, framework=framework.name) for p in policies] + [
        Candidate("fp32", emulate=fmt, framework=framework.name) for fmt in emulate
    ]
    return [framework.validate(c) for c in cands]


def check_islands(framework: Framework, workload: Any, cands: Sequence[Candidate]) -> None:
    """Every keep_fp32 pattern must match a module (or layer): a pattern that matches nothing keeps
    nothing in fp32, and a check of it would pass a policy the user did not ask for."""
    names, _ = framework.island_names(workload)
    if not names:  # the backend cannot list them (yet): nothing to hold the patterns against
        return
    for cand in cands:
        for pattern in cand.keep_fp32:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                continue
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.4)
            hint = f"closest: {', '.join(repr(n) for n in close)}" if close else f"e.g. {names[:3]!r}"
            raise PolicyError(
                f"keep_fp32 pattern {pattern!r} of {cand.label} matches no module of "
                f"{framework.workload_label(workload)} ({hint}); patterns are fnmatch patterns over "
                "the model's module names (model.named_modules()): fix or drop it."
            )
        refuse_split_tie(workload, cand)
        if cand.keep_bf16 and getattr(workload, "model", None) is not None:
            from mixprec.policy.lowformat import refuse_unmatched

            try:  # a map entry that names no Linear keeps nothing in bf16: refused as keep_fp32's
                refuse_unmatched(workload.model, cand.keep_bf16)
            except PolicyError as exc:
                raise PolicyError(f"{cand.label}: {exc}") from None


def refuse_split_tie(workload: Any, cand: Candidate) -> None:
    """A *-true candidate whose keep_fp32 keeps one side of a tied weight in fp32 (an LM head tied to
    its embedding) is refused up front with the reason ``Policy.prepare`` gives
    (:func:`mixprec.policy.hooks.refuse_split_ties`): its check could only crash."""
    from torch import nn

    from mixprec.policy.hooks import refuse_split_ties
    from mixprec.policy.islands import island_names

    model = getattr(workload, "model", None)
    if not cand.keep_fp32 or not isinstance(model, nn.Module) or cand.spec.param_dtype is None:
        return  # another framework's model, no islands, or fp32 master weights: nothing to split
    modules = dict(model.named_modules())
    try:
        refuse_split_ties(model, {name: modules[name] for name in island_names(model, cand.keep_fp32)})
    except ValueError as exc:
        raise PolicyError(f"{cand.label}: {exc}") from None


def check(
    workload: Any,
    config: CheckConfig | None = None,
    *,
    events: Events | None = None,
    budget: Budget | None = None,
    checker: Checker | None = None,
    **fields: Any,
) -> CheckResult:
    """Check each policy (and each emulated format) against a strict-fp32 reference on ``workload``
    (a :class:`mixprec.Workload` or another framework's, e.g. ``mixprec.keras.KerasWorkload``).

    ``config``: a :class:`CheckConfig`; ``fields`` replace its fields
    (``check(workload, policies="bf16-mixed", steps=12, fix=True)``), each described there. Its
    ``train_steps`` is the length of the run the verdicts are about: every layer's ranges are
    recorded at every checked step, and a trend predicted to overflow the candidate's format (or to
    stall its updates) within that many steps makes the candidate ``at-risk``, with the layer and the
    step; a trend beyond what the checked steps support is reported as "not enough evidence", with
    the ``steps`` that would reach it. ``budget`` stops keep-fp32 searches once spent. ``checker``
    (from :func:`make_checker`) reuses an fp32 reference, its ranges and the chaos floor across
    calls, e.g. when candidates are checked one at a time. ``events`` receives 'stage' events and
    a ``{"event": "verdict", "check": CandidateCheck, "index": i, "count": n}`` as each candidate is
    judged. The workload is validated first (one strict-fp32 step).
    """
    config = validation.with_fields(config or CheckConfig(), fields, "check")
    policies, emulate, fix = config.policies, config.emulate, config.fix
    alone = checker is None  # not one check of many (tune's): the source's own candidates too
    if checker is None:
        framework = framework_of(workload)
        cands = candidates_of(framework, policies, emulate)  # bad names fail before the reference runs
        check_islands(framework, workload, cands)
        checker = make_checker(workload, config, events=events, budget=budget)
    else:
        cands = candidates_of(checker.framework, policies, emulate)
    framework, events = checker.framework, events or checker.events
    if alone:  # a script as written, checked beside what was asked
        cands += [c for c in framework.source_candidates(checker.workload) if c not in cands]
    check_islands(framework, checker.workload, cands)  # again: Keras lists its layers once built
    info = detect(checker.device)
    if alone and info.type == "cpu":  # a format slow here, said before its check runs for minutes
        formats = {
            c.policy: c.spec.peak_key
            for c in cands
            if not c.emulate and framework.support(c, info, checker.workload)
        }
        for warning in slow_formats(formats, info, conv=framework.has_convolutions(checker.workload)):
            events({"event": "note", "text": f"warning: {warning}"})
    results = []
    for index, cand in enumerate(cands):
        support = framework.support(cand, info, checker.workload)
        predicted = None if support else framework.predictable(cand, info, checker.workload)
        if support or predicted:
            result = checker.check(cand, fix)
            result.predicted = predicted
        else:
            result = CandidateCheck(cand, Status.UNSUPPORTED, support.reason, suggestion=support.suggestion)
        results.append(result)
        events({"event": "verdict", "check": result, "index": index, "count": len(cands)})
    return checker.result(results)
