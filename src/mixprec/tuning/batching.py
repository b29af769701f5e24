"""`tune --batch auto`: each candidate's micro-batch under a memory budget, at a fixed effective batch.

Lower precision halves activations, so under the same memory a candidate may fit a larger
micro-batch, and a larger micro-batch is often where the throughput is. Before the speed sweep,
each eager candidate (policy x layout) gets the largest micro-batch that divides the effective batch
and fits the budget, found from its memory model (:mod:`mixprec.measure.memory`: two measured
steps, then a search over the divisors guided by the model, every answer a measured size); it
then runs as ``Candidate(micro_batch=m, accumulation_steps=E // m)``, so every candidate trains the same
samples per optimizer step and their step times pair. The grid of (candidate x micro-batch) is
never timed whole: the sweep times one micro-batch per candidate, the largest that fits, and the
pick once more one size down (:meth:`mixprec.tuning.search.Search.try_smaller_batch`): faster
there, it wins; as fast within the noise, a note says so (the knee: less memory, the same speed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mixprec import validation
from mixprec.budget import Budget
from mixprec.errors import UsageError
from mixprec.events import Events
from mixprec.frameworks import Framework
from mixprec.frameworks.session import MemoryPoint
from mixprec.measure.batches import measure_peak
from mixprec.measure.memory import MemoryModel, fit_and_check
from mixprec.policy import Candidate
from mixprec.status import Status

# On CUDA without --memory-budget: half the device's free memory (the paired baseline is resident
# beside each candidate) less this share (fragmentation, the allocator's rounding, another
# process' growth).
CUDA_MARGIN = 0.10


@dataclass
class MicroBatch:
    """One eager candidate's micro-batch under the budget (searched, or taken from a candidate with
    the same :func:`memory_key`: then ``reason`` names it).

    Attributes:
        micro_batch: the largest size that divides the effective batch and fits; None when none does.
        peak_bytes: its measured peak (the step at that size ran).
        status: ``ok``, ``over-budget`` (not even the smallest size fits) or the failure's status.
        failures: the sizes whose memory step failed (an out-of-memory: past the budget, and the
            search went on below it), with the failure.
    """

    candidate: Candidate
    micro_batch: int | None
    accumulation_steps: int
    peak_bytes: int | None = None
    model: MemoryModel | None = None
    status: str = Status.OK
    reason: str = ""
    failures: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.candidate.label,
            "failures": {str(size): why for size, why in self.failures.items()},
            "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "peak_memory_bytes": self.peak_bytes,
            "memory_model": self.model.to_dict() if self.model else None,
            "status": str(self.status),
            "reason": self.reason,
        }


@dataclass
class BatchPlan:
    """The micro-batch of each eager candidate (keyed by its unbatched self), and what finding them cost.

    Attributes:
        budget_source: where ``memory_budget`` came from (the user's figure, or CUDA's free memory).
        grid: (candidate x micro-batch) points an exhaustive search would time: per candidate, every
            divisor of the effective batch up to its largest that fits.
        memory_steps: steps measured for peak memory (the fits and their confirmations).
        timed: (candidate x micro-batch) points the search timed (set by the search as it goes).
    """

    effective_batch: int
    memory_budget: int
    budget_source: str
    choices: dict[Candidate, MicroBatch] = field(default_factory=dict)
    memory_steps: int = 0
    timed: set[Candidate] = field(default_factory=set)

    @property
    def timed_points(self) -> int:
        """The (eager candidate x micro-batch) points of the grid the search timed; compiled,
        optimizer and rescued variants are beyond the grid and not counted."""
        return len({c for c in self.timed if c.compile is None and c.optimizer is None and not c.keep_fp32})

    @property
    def grid(self) -> int:
        sizes = divisors(self.effective_batch)
        return sum(
            len([s for s in sizes if s <= c.micro_batch]) for c in self.choices.values() if c.micro_batch
        )

    def choice(self, candidate: Candidate) -> MicroBatch | None:
        """The choice of ``candidate``'s eager twin (its policy and layout), which the plan searched."""
        return self.choices.get(
            Candidate(candidate.policy, candidate.channels_last, framework=candidate.framework)
        )

    def batched(self, candidate: Candidate) -> Candidate | None:
        """``candidate`` at its eager twin's micro-batch (compile, optimizer and islands do not
        change which fits by much); None when none fits."""
        choice = self.choice(candidate)
        if choice is None or choice.micro_batch is None:
            return None
        return replace(
            candidate, micro_batch=choice.micro_batch, accumulation_steps=choice.accumulation_steps
        )

    def smaller(self, candidate: Candidate) -> Candidate | None:
        """``candidate`` one divisor of the effective batch down (None below 1, and for a step
        compiled whole: over accumulated micro-batches dynamo would not compile it)."""
        if candidate.micro_batch is None or candidate.compile_scope == "step":
            return None
        below = [s for s in divisors(self.effective_batch) if s < candidate.micro_batch]
        if not below:
            return None
        size = below[-1]
        return replace(candidate, micro_batch=size, accumulation_steps=self.effective_batch // size)

    def peak(self, candidate: Candidate) -> int | None:
        """The measured peak of ``candidate``'s micro-batch, where its eager twin was measured there."""
        choice = self.choice(candidate)
        return choice.peak_bytes if choice and choice.micro_batch == candidate.micro_batch else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "effective_batch": self.effective_batch,
            "memory_budget_bytes": self.memory_budget,
            "budget_source": self.budget_source,
            "grid_points": self.grid,
            "timed_points": self.timed_points,
            "timed_beyond_grid": len(self.timed) - self.timed_points,
            "memory_steps": self.memory_steps,
            "candidates": [c.to_dict() for c in self.choices.values()],
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fit_sizes(effective_batch: int) -> list[int]:
    """The two micro-batches each memory model is fitted on: the two smallest divisors of the
    effective batch from an eighth of it up (cheap, and far below any budget that lets strict fp32
    train at all): 8 and 16 for 64, 12 and 16 for 96; 1 and 7 for a prime 7."""
    sizes = divisors(effective_batch)
    small = [s for s in sizes if s >= effective_batch // 8] or sizes
    return small[:2]


def effective(framework: Framework, effective_batch: int | None, batch_size: int) -> int:
    """The samples per optimizer step every candidate trains: ``effective_batch``, else the run's
    batch size; checked, and refused where the framework cannot accumulate gradients."""
    if not framework.accumulates:
        raise UsageError(f"--batch auto needs gradient accumulation, not measured for {framework.title} yet.")
    size = batch_size if effective_batch is None else effective_batch
    return validation.positive_int("effective_batch", size)


def notes(plan: BatchPlan, workload_batch: int, batch_norm: bool = False) -> list[str]:
    """What the batch search did, for tune's notes: the share of the grid it timed, where the
    effective batch is not the workload's, that the learning rate was tuned for another batch, and
    for a model with BatchNorm, that its statistics follow the micro-batch, not the effective batch."""
    said = [
        f"--batch auto: timed {plan.timed_points} (candidate x micro-batch) points of a grid of {plan.grid} "
        f"(every micro-batch dividing {plan.effective_batch} that fits "
        f"{plan.memory_budget / 2**20:,.1f} MiB, {plan.budget_source}), after {plan.memory_steps} "
        "memory steps"
    ]
    if plan.effective_batch != workload_batch:
        said.append(
            f"the effective batch is {plan.effective_batch} samples per optimizer step, the workload's "
            f"batch {workload_batch}: a learning rate tuned at {workload_batch} may want scaling (linearly "
            "for SGD, by the square root for Adam, as a starting point)"
        )
    smallest = min((c.micro_batch for c in plan.choices.values() if c.micro_batch), default=None)
    if batch_norm and smallest is not None and smallest < plan.effective_batch:
        said.append(
            f"the model has BatchNorm: its statistics are computed over each micro-batch (down to "
            f"{smallest} samples here), not the {plan.effective_batch} of an optimizer step; accumulation "
            "keeps the gradient's batch, not BatchNorm's (the numerics check compares at the same "
            "micro-batch, so it does not see this)"
        )
    return said


def memory_budget(framework: Framework, device: str, budget: int | str | None) -> tuple[int, str]:
    """The budget in bytes (a number, or a size such as ``"2GiB"``) and where it came from: the
    user's, or on CUDA half the free memory less :data:`CUDA_MARGIN`. A CPU has no device memory to
    fill, so there the user names it."""
    if budget is not None:  # TuneConfig's is checked, and held as bytes, when the config is made
        return validation.byte_size("memory_budget", budget), "--memory-budget"
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        # half: a paired measurement holds the strict-fp32 baseline's session beside each candidate's
        return int(free * (1 - CUDA_MARGIN) / 2), (
            f"half the free CUDA memory less {CUDA_MARGIN:.0%}: the strict-fp32 baseline runs beside each "
            "candidate while they are measured in pairs"
        )
    raise UsageError(
        f"--batch auto on {device} needs --memory-budget SIZE (e.g. 2GB): a CPU has no device memory "
        "whose free share sets the micro-batch."
    )


def plan_micro_batches(
    framework: Framework,
    workload: Any,
    candidates: Sequence[Candidate],
    device: str,
    *,
    effective_batch: int,
    memory_budget: int,
    budget_source: str,
    events: Events,
    budget: Budget,
) -> BatchPlan:
    """The largest micro-batch dividing ``effective_batch`` that fits ``memory_budget``, per eager
    candidate, each confirmed by a measured step. A failure (an out-of-memory included) is recorded
    on its candidate; the others go on."""
    plan = BatchPlan(effective_batch, memory_budget, budget_source)
    sizes = fit_sizes(effective_batch)
    searched: dict[tuple, MicroBatch] = {}
    for cand in candidates:
        key = memory_key(cand)
        if key in searched:  # the same bytes as one searched already: its answer, not another search
            twin = searched[key]
            plan.choices[cand] = replace(
                twin, candidate=cand, reason=twin.reason or f"the memory of {twin.candidate.label}"
            )
            continue
        if budget.expired():  # a row says so (search.py's _over_budget), and the pick may be cut short
            plan.choices[cand] = MicroBatch(
                cand,
                None,
                1,
                status=Status.UNCHECKED,
                reason=f"{budget.why_ended('the time budget ran out')} before its memory search",
            )
            budget.cut(f"the memory search of {cand.label} did not run")
            continue
        plan.choices[cand] = searched[key] = _choose(framework, workload, cand, device, plan, sizes, events)
    return plan


def memory_key(cand: Candidate) -> tuple:
    """What sets a candidate's memory: the dtype its weights are stored in, the dtype it computes
    and keeps activations in (bf16 and fp16 alike take two bytes), the fp8 recipe and the layout.
    fp32, tf32 and bf32 share one; bf16-mixed and fp16-mixed another; bf16-true and fp16-true a third."""
    spec = cand.spec
    width = lambda dtype: dtype.itemsize if dtype is not None else None  # noqa: E731
    return (width(spec.param_dtype), width(spec.low_precision_dtype), spec.fp8_recipe, cand.channels_last)


def _choose(
    framework: Framework,
    workload: Any,
    cand: Candidate,
    device: str,
    plan: BatchPlan,
    sizes: list[int],
    events: Events,
) -> MicroBatch:
    peaks: dict[int, MemoryPoint] = {}
    failures: dict[int, str] = {}

    def measure(size: int) -> MemoryPoint | tuple[str, str]:
        events({"event": "stage", "text": f"peak memory of {cand.label} at micro-batch {size}"})
        plan.memory_steps += 1
        # two micro-batches where the candidate would accumulate: the gradients held between them
        # are part of its step's peak (a plain step frees them before the next forward)
        got = measure_peak(framework, workload, cand, device, size, min(2, plan.effective_batch // size))
        if isinstance(got, MemoryPoint):
            peaks[size] = got
        else:
            failures[size] = f"{got[0]}: {got[1]}"
        return got

    choice = _search(cand, plan, sizes, peaks, measure)
    choice.failures = failures
    return choice


def _search(
    cand: Candidate,
    plan: BatchPlan,
    sizes: list[int],
    peaks: dict[int, MemoryPoint],
    measure: Callable[[int], MemoryPoint | tuple[str, str]],
) -> MicroBatch:
    """Fit on ``sizes``, then the largest divisor of the effective batch that fits: a search over the
    divisors, bounded by what was measured, probing first where the memory model predicts the answer,
    then the divisor next to it, then halving what is left (an out-of-memory counts as past the
    budget: the model can promise more than a device holds). An error that is not an out-of-memory
    ends the candidate's search: no other size cures it."""
    limit = plan.memory_budget
    options = divisors(plan.effective_batch)
    for size in sizes:
        got = measure(size)
        if not isinstance(got, MemoryPoint):
            if got[0] != Status.OOM:
                return MicroBatch(cand, None, 1, status=got[0], reason=got[1])
            break
    model = fit_and_check(cand.label, list(peaks.values())) if len(peaks) >= 2 else None
    fits = {options.index(s): p.peak_bytes <= limit for s, p in peaks.items()}
    fits.update({options.index(s): False for s in sizes if s not in peaks})  # out of memory there
    lo = max((i for i, ok in fits.items() if ok), default=-1)  # the largest known to fit
    hi = min((i for i, ok in fits.items() if not ok), default=len(options))  # the smallest known not to
    guess = model.max_batch(limit) if model is not None else None
    probe = max((i for i, s in enumerate(options) if guess is not None and s <= guess), default=None)
    while hi - lo > 1:
        if probe is None or not lo < probe < hi:
            probe = (lo + hi) // 2
        got = measure(options[probe])
        if isinstance(got, MemoryPoint) and got.peak_bytes <= limit:
            lo, probe = probe, probe + 1  # fits: is the next one up past the budget?
        elif isinstance(got, MemoryPoint) or got[0] == Status.OOM:
            hi, probe = probe, probe - 1  # past it: does the next one down fit?
        else:
            return MicroBatch(cand, None, 1, model=model, status=got[0], reason=got[1])
    if lo < 0:
        smallest = min(peaks.items(), default=None)
        why = (
            f"its step peaks at {smallest[1].peak_bytes} bytes at micro-batch {smallest[0]}, past the budget"
            if smallest
            else "out of memory at every size tried"
        )
        status = Status.OVER_BUDGET if smallest else Status.OOM
        return MicroBatch(cand, None, 1, model=model, status=status, reason=why)
    micro = options[lo]
    return MicroBatch(cand, micro, plan.effective_batch // micro, peaks[micro].peak_bytes, model)
