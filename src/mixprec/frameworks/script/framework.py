"""The script backend: the user's training command as a source of training steps, run unchanged.

bench, check and tune run over it as over a :class:`~mixprec.Workload`: each candidate is the
script itself, in its own process, with the candidate injected (:mod:`.agent`); the strict-fp32
baseline is one such run, and the script as written (``Candidate.as_written``: its own autocast,
GradScaler and framework flags) is always one more row. What is measured is what the user runs:
for a script that trains through the HF Trainer, Lightning or Accelerate the candidate goes through
that framework's own precision switch, so a candidate its export refuses is not a candidate here.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

import torch

from mixprec.errors import UsageError
from mixprec.frameworks.base import Framework
from mixprec.frameworks.script import batch
from mixprec.frameworks.script.messages import Facts, TraceRecord
from mixprec.frameworks.script.own import as_torch
from mixprec.frameworks.script.session import ScriptFailed, ScriptSession, ScriptTimedOut, trace
from mixprec.frameworks.script.workload import TRAINED_BY, ScriptFacts, ScriptWorkload
from mixprec.frameworks.session import BenchSettings, MemoryPoint, Session
from mixprec.hardware.device import DeviceInfo
from mixprec.numerics.compare import Trajectory
from mixprec.numerics.ranges import RangeReport
from mixprec.numerics.trend import LayerSeries
from mixprec.policy import POLICY_NAMES, Candidate, Support, check_support
from mixprec.policy.candidate import OPTIMIZER_IMPLS
from mixprec.policy.support import prediction_label

VALIDATE_STEPS = 2  # strict-fp32 steps of the validating run (it also finds what the script is)
VALIDATE_SHARE = 0.5  # of the budget left, what the validating run may take at most
PEAK_STEPS = 2  # steps of a peak-memory run: the optimizer's state exists from the second on
# the export target that writes a candidate the way each framework trains it
EXPORT_OF = {"plain": "pytorch", "hf": "hf", "lightning": "lightning", "accelerate": "accelerate"}
FRAMEWORK_TITLES = TRAINED_BY


class ScriptFramework(Framework):
    """The user's own training script, after ``--``.

    Which candidates the script can run depends on what it trains through (its own loop, the HF
    Trainer, Lightning, Accelerate): the workload's facts decide :meth:`support` and :meth:`exports`
    (the backend keeps no state of its own: two scripts in one process get their own answers)."""

    name = "script"
    title = "your training script"
    workload_type = ScriptWorkload
    workload_name = "a training command after --"
    layouts = True
    compile_modes = ("default",)
    compiles_cached = True
    # the model's forward (as torch.compile of a module); the step: that, and each optimizer's update
    # compiled too (PyTorch's compiled-optimizer recipe), in a plain loop
    compile_scopes = ("model", "step")
    optimizer_impls = OPTIMIZER_IMPLS  # set where the script builds its torch optimizers
    island_kind = "fp32 modules"
    runs_as_written = True
    named = False  # entered by the command after --, not --framework
    # k micro-batches per optimizer step: the agent's in a plain loop, the framework's own switch
    # elsewhere; another micro-batch needs --batch-arg (:mod:`.batch`)
    accumulates = True

    # ------------------------------------------------------------------ workloads
    def workload_label(self, workload: ScriptWorkload) -> str:
        return workload.name

    def validate_workload(
        self, workload: ScriptWorkload, device: str, batch_size: int, *, budget: Any = None
    ) -> None:
        """A few strict-fp32 steps: the script runs, reaches optimizer steps, and shows what it is
        (its framework, its own precision, its model); a script that fails is one UsageError with its
        last line. Within half of ``budget`` where there is one: a script that never steps is said
        within the time the user gave. A script with a batch argument runs at ``batch_size`` where
        that divides its own batch (accumulating to it: ``tune --batch auto`` validates at a size
        far below any budget), else at its own."""
        if workload.facts is None:
            limit = None
            if budget is not None and math.isfinite(budget.left()):
                limit = max(budget.left() * VALIDATE_SHARE, 1.0)
            arg = batch.arg_of(workload)
            size = batch_size if arg is not None and arg.value % batch_size == 0 else None
            run, k = sized(workload, size)
            try:
                record = trace(run, self.baseline, VALIDATE_STEPS, timeout_s=limit, accumulate=k)
            except ScriptTimedOut as exc:
                given = " (half of the time the budget had left)" if limit is not None else ""
                raise UsageError(
                    f"{exc}{given}: a script that takes longer to reach its first steps needs a larger "
                    "--budget; one that never steps is not a training script mixprec can measure"
                ) from None
            except ScriptFailed as exc:
                raise UsageError(f"the script does not train in strict fp32: {exc}") from None
            workload.facts = facts_of(record)
            for name in record.facts.unknown_frameworks:
                workload.notes.append(
                    f"the script imports {name}, whose precision switches mixprec does not know: its loop "
                    "was measured as a plain one (torch.autocast, GradScaler and the optimizer step "
                    "intercepted where it calls them)"
                )

    def resolve_device(self, device: Any) -> str:
        return str(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    # ------------------------------------------------------------------ candidates
    def support(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> Support:
        if candidate.as_written:
            return Support(True, "the script's own precision")
        framework = _framework_of(workload)
        if candidate.spec.low_format is not None and framework != "plain":
            return Support(
                False,
                f"{candidate.policy} through {FRAMEWORK_TITLES[framework]}: its precision switch has no "
                f"{candidate.spec.low_format} Linear layers; mixprec converts them in plain loops",
                "bf16-mixed",
                False,
            )
        base = check_support(candidate.policy, info)
        if not base:
            return base
        if framework != "plain":
            if candidate.compile_scope == "step":
                return Support(
                    False,
                    f"the step scope through {FRAMEWORK_TITLES[framework]}: its own compile switch "
                    "compiles the model, and what it runs is what is measured",
                    None,
                    False,
                )
            return self._framework_support(candidate, info, framework, base)
        return base

    def predictable(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> str | None:
        if candidate.spec.low_format is not None and _framework_of(workload) != "plain":
            return None  # a framework's switch: the format is not applied, so nothing to predict
        return prediction_label(candidate.policy, info)

    def emulation_slowdown(self, candidate: Candidate, device: str) -> float:
        """The torch probe's figure: the script converts its Linear layers with the same policy, on
        the same torch, in a process of its own on this machine."""
        from mixprec.frameworks.torch.emulation_cost import emulation_slowdown

        return emulation_slowdown(as_torch(candidate), device)

    def _framework_support(
        self, candidate: Candidate, info: DeviceInfo, framework: str, base: Support
    ) -> Support:
        """Whether the framework's own switch expresses ``candidate`` (its export's verdict)."""
        from mixprec.exports import export_status

        if candidate.spec.param_dtype is not None and framework in ("hf", "accelerate"):
            return Support(
                False,
                f"{candidate.policy} through {FRAMEWORK_TITLES[framework]}: its flags (bf16/fp16, "
                "mixed_precision) are autocast over fp32 weights; half weights need the model cast by "
                f"hand (the '{EXPORT_OF[framework]}' export's lines), which mixprec does not measure in "
                "your script",
                "bf16-mixed",
                False,
            )
        torch_cand = as_torch(candidate)
        status = export_status(torch_cand, EXPORT_OF[framework], device=info.type)
        if not status.faithful:
            return Support(False, f"through {FRAMEWORK_TITLES[framework]}: {status.reason}", None, False)
        if candidate.channels_last or candidate.keep_fp32:
            return Support(
                False,
                f"through {FRAMEWORK_TITLES[framework]} mixprec sets the precision flag only; channels_last "
                "and fp32 islands are measured in plain loops",
                None,
                False,
            )
        return base

    def source_candidates(self, workload: ScriptWorkload) -> list[Candidate]:
        """The script as written: its own precision, named by what it asks for; none where that is
        the strict-fp32 baseline itself (an fp32 script at this device's default math mode: one run,
        not the same one measured twice)."""
        facts = workload.facts
        if facts is not None and facts.is_baseline:
            return []
        return [Candidate(facts.own_policy if facts else "fp32", framework=self.name, as_written=True)]

    def tune_candidates(self, workload: ScriptWorkload, info: DeviceInfo) -> list[Candidate]:
        """The script as written, then every policy eager (channels_last too for a model with
        convolutions, in a plain loop). The optimizer's implementations are tried on the pick
        (:meth:`optimizer_variants`), as for a workload."""
        facts = workload.facts
        layouts = (
            [False, True] if facts is not None and facts.has_conv and facts.framework == "plain" else [False]
        )
        cands = [Candidate(p, cl, framework=self.name) for p in POLICY_NAMES for cl in layouts]
        return [*self.source_candidates(workload), *cands]

    def optimizer_variants(self, workload: ScriptWorkload, candidate: Candidate) -> list[Candidate]:
        """``candidate`` with each implementation every optimizer of the script offers (as the
        validating run recorded them), but the one they all use as written already. None for the
        script as written: its optimizer is part of it."""
        facts = workload.facts if isinstance(workload, ScriptWorkload) else None
        built = (facts.own.get("optimizers") or []) if facts is not None else []
        if not built or candidate.as_written:
            return []
        own = {o["as_written"] for o in built}
        return [
            replace(candidate, optimizer=impl)
            for impl in built[0]["implementations"]
            if all(impl in o["implementations"] for o in built) and own != {impl}
        ]

    def predictions(
        self,
        workload: ScriptWorkload,
        info: DeviceInfo,
        affordable: Callable[[Candidate], bool] | None = None,
        policies: Collection[str] = POLICY_NAMES,
    ) -> tuple[list[Candidate], list[str]]:
        """The low formats this device cannot run fast but whose numerics a check predicts on the
        script's own data (as for a workload), those that convert none of its Linear layers said in
        one line each (the first layer and the fix), from one strict-fp32 step's census: a run of
        the script, not taken where the budget can pay none of their checks."""
        from mixprec.frameworks.script.session import take_census as take
        from mixprec.policy.lowformat import none_converted

        named = [self.candidate(n) for n in POLICY_NAMES if n in policies]
        predictable = [c for c in named if self.predictable(c, info, workload)]
        if not predictable or (affordable is not None and not any(map(affordable, predictable))):
            return predictable, []
        try:
            formats = take(workload, predictable[0].spec).formats
        except ScriptFailed as exc:
            return [], [f"low formats not predicted: the script's Linear census failed ({exc})"]
        cands, notes = [], []
        for cand in predictable:
            taken = formats[cand.policy]
            if taken.low:
                cands.append(cand)
            else:
                said = none_converted(cand.spec, taken.refused, "the script's model")
                notes.append(f"{cand.policy} not predicted: {said}")
        return cands, notes

    def has_convolutions(self, workload: ScriptWorkload) -> bool:
        return workload.facts is None or workload.facts.has_conv  # not yet run: assume it may

    def bench_layouts(
        self, workload: ScriptWorkload, wanted: Sequence[bool]
    ) -> tuple[list[bool], str | None]:
        if True in wanted and not self.has_convolutions(workload):
            return [False], "channels_last dropped: the script's model has no convolution"
        return list(wanted), None

    # ------------------------------------------------------------------ measuring
    def make_batches(self, workload: Any, batch_size: int, device: str, seed: int, n: int) -> list[Any]:
        # the script draws its own batches, the same for every run (seeded): what stands for one is
        # its size, the micro-batch a check runs the script at (its batch argument rewritten)
        return [batch_size] * n

    def session(
        self, workload: ScriptWorkload, candidate: Candidate, settings: BenchSettings, batches: list | None
    ) -> Session:
        """The script at the settings' micro-batch (its batch argument rewritten) with their
        accumulation; at its own batch where it has no batch argument."""
        size = settings.batch_size if batch.arg_of(workload) else candidate.micro_batch
        return ScriptSession(batch.at_size(workload, size), candidate, settings)

    def peak_memory(
        self,
        workload: ScriptWorkload,
        candidate: Candidate,
        device: str,
        batch_size: int,
        accumulation_steps: int = 1,
    ) -> MemoryPoint:
        """The script's own measured peak over :data:`PEAK_STEPS` steps at ``batch_size`` (its batch
        argument rewritten), ``accumulation_steps`` micro-batches each: ``max_memory_allocated`` on
        CUDA, the process' peak RSS on a CPU (the interpreter and its libraries too: what the
        machine must hold)."""
        settings = BenchSettings(
            device, batch_size, steps=PEAK_STEPS, warmup=0, accumulation_steps=accumulation_steps
        )
        session = ScriptSession(batch.at_size(workload, batch_size), candidate, settings)
        try:
            for _ in range(PEAK_STEPS):
                session.step(False)
            measured = session.finish()
        except BaseException:
            if session.child.process.poll() is None:  # (a run that ended has closed its side)
                session.close(keep_log=True)
            raise
        if measured.peak_memory_bytes is None:
            raise ScriptFailed("the script's run reported no peak memory")
        return MemoryPoint(batch_size, measured.peak_memory_bytes, method=measured.memory_method)

    # ------------------------------------------------------------------ checking
    def trajectory(
        self,
        workload: ScriptWorkload,
        candidate: Candidate,
        batches: Sequence[Any],
        steps: int,
        device: str,
        *,
        perturb: float = 0.0,
    ) -> Trajectory:
        traj = Trajectory(candidate.label)
        try:
            run, k = sized(workload, _size_of(batches))
            # its first step's ranges too (what layer_ranges gives): one launch of the script, not two;
            # not under torch.compile, where taking the range hooks off after step 1 would recompile
            ranges = not perturb and not candidate.compile
            record = trace(run, candidate, steps, perturb=perturb, accumulate=k, ranges=ranges)
        except ScriptFailed as exc:
            traj.error = str(exc)
            return traj
        if record.ranges is not None:
            workload.first_ranges[(candidate, _size_of(batches))] = record.ranges
        fill(traj, record)
        facts = workload.facts
        if facts is not None and candidate == self.baseline and not perturb and facts.deterministic is None:
            first, before = traj.losses[:1], facts.first_losses[:1]
            if batch.arg_of(workload) is not None and first and before:
                # another split into micro-batches sums the same mean in another order
                facts.deterministic = math.isclose(first[0], before[0], rel_tol=1e-4)
            else:
                facts.deterministic = first == before
        if facts is not None and facts.deterministic is False:
            as_trend(traj, facts)
        return traj

    def layer_ranges(
        self,
        workload: ScriptWorkload,
        candidate: Candidate,
        batch: Any,
        device: str,
        loss_scale: float | None,
    ) -> RangeReport:
        size = batch if isinstance(batch, int) else None
        kept = workload.first_ranges.get((candidate, size))  # (recorded by its trajectory's run)
        if kept is not None:
            return kept
        run, k = sized(workload, size)
        ranges = trace(run, candidate, 1, ranges=True, accumulate=k).ranges
        if ranges is None:
            raise ScriptFailed("the script's first step recorded no ranges")
        return ranges

    def linear_census(
        self, workload: ScriptWorkload, spec: Any, batch: Any, device: str, keep_fp32: Sequence[str] = ()
    ) -> Any:
        """The census of the script's own first step (:mod:`.census`): a strict-fp32 run of it."""
        from mixprec.frameworks.script.session import take_census as take

        return take(workload, spec, keep_fp32).census

    def island_names(self, workload: ScriptWorkload) -> tuple[list[str], dict[str, str]]:
        facts = workload.facts
        if facts is None:
            return [], {}
        owners = {n: n.rsplit(".", 1)[0] for n in facts.params if "." in n}
        return facts.module_names, owners

    def fix_snippet(self, candidate: Candidate, keep_fp32: Sequence[str]) -> str:
        return f"{run_line(replace(candidate, keep_fp32=tuple(keep_fp32)), [])} <your command>"

    def map_snippet(self, candidate: Candidate) -> str:
        return f"{run_line(candidate, [])} <your command>"

    # ------------------------------------------------------------------ after the pick
    def exports(
        self, candidate: Candidate, device: str, workload: Any = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """The change in the script's own terms (its framework's export), mixprec's, and the
        ``mixprec run`` line that runs the pick with no edit."""
        from mixprec.exports import export_status

        target = EXPORT_OF[_framework_of(workload)]
        texts: dict[str, str] = {}
        refusals: dict[str, str] = {}
        facts = workload.facts if isinstance(workload, ScriptWorkload) else None
        plain = candidate.policy == "fp32" and not (
            candidate.channels_last or candidate.keep_fp32 or candidate.compile or candidate.optimizer
        )
        if candidate.as_written or (plain and facts is not None and facts.is_baseline):
            return {"run": own_precision_line(candidate, workload)}, {}
        if isinstance(workload, ScriptWorkload):
            texts["run"] = run_line(candidate, batch.at_size(workload, candidate.micro_batch).given)
        torch_cand = as_torch(candidate)
        for name in dict.fromkeys([target, "mixprec"]):
            status = export_status(torch_cand, name, device=device)
            if status.faithful:
                from mixprec.exports import export

                texts[name] = export(torch_cand, name, device=device)
            else:
                refusals[name] = status.reason
        return texts, refusals


def _framework_of(workload: Any) -> str:
    """What trains the script (its facts, once a run has shown them); its own loop before that."""
    facts = workload.facts if isinstance(workload, ScriptWorkload) else None
    return facts.framework if facts is not None else "plain"


def sized(workload: ScriptWorkload, size: int | None) -> tuple[ScriptWorkload, int]:
    """``workload`` at micro-batch ``size`` and the micro-batches per optimizer step that make its
    own batch; itself and 1 where it has no batch argument (the script runs its own) or no size."""
    if size is None or batch.arg_of(workload) is None:
        return workload, 1
    return batch.at_size(workload, size), batch.accumulation(workload, size)


def _size_of(batches: Sequence[Any]) -> int | None:
    """The micro-batch :meth:`ScriptFramework.make_batches` stood for, if any."""
    return batches[0] if batches and isinstance(batches[0], int) else None


def own_precision_line(candidate: Candidate, workload: Any) -> str:
    """The answer where the script's own precision won: as it is, or at the micro-batch found."""
    if not isinstance(workload, ScriptWorkload) or batch.at_size(workload, candidate.micro_batch) is workload:
        return "keep the script as it is: its own precision was the pick"
    given = batch.at_size(workload, candidate.micro_batch).given
    if not candidate.as_written:  # strict fp32 that is the script as written: mixprec run runs it so
        return run_line(candidate, given)
    k = candidate.accumulation_steps
    return (
        f"keep the script's own precision, at micro-batch {candidate.micro_batch} with {k} micro-batches "
        "per optimizer step (gradient accumulation: in your loop, or your framework's switch): "
        f"{shlex.join(given)}"
    )


def run_line(candidate: Candidate, given: Sequence[str]) -> str:
    """``mixprec run`` with ``candidate``'s options, then the user's own command (with its batch
    argument rewritten to the candidate's micro-batch, where it has one)."""
    parts = ["mixprec", "run", "--policy", candidate.policy]
    if candidate.channels_last:
        parts.append("--channels-last")
    if candidate.keep_fp32:
        parts += ["--keep-fp32", ",".join(candidate.keep_fp32)]
    if candidate.keep_bf16:
        parts += ["--keep-bf16", ",".join(candidate.keep_bf16)]
    if candidate.compile:
        parts += ["--compile", candidate.compile]
    if candidate.compile_scope:
        parts += ["--compile-scope", candidate.compile_scope]
    if candidate.optimizer:
        parts += ["--optimizer", candidate.optimizer]
    if candidate.accumulation_steps > 1:
        parts += ["--accumulate", str(candidate.accumulation_steps)]
    return shlex.join([*parts, "--", *given])


def facts_of(record: TraceRecord) -> ScriptFacts:
    """What the validating run's record says about the script."""
    facts = record.facts
    if not record.steps:
        raise UsageError("the script never called an optimizer step")
    losses = [s.loss if s.loss is not None else math.nan for s in record.steps]
    if not all(math.isfinite(v) for v in losses):
        raise UsageError(
            f"the script's loss in strict fp32 is {losses}: mixprec sees what the script calls backward() "
            "on; fix it so it trains in fp32 first"
        )
    return ScriptFacts(
        framework=facts.framework,
        own_policy=own_policy(facts),
        own=facts.own,
        model=facts.model or "?",
        modules=facts.modules,
        params=facts.params,
        device=facts.device,
        samples_per_step=record.steps[0].samples or 1,
        first_losses=losses,
        strict_math=facts.strict_math,
    )


def own_policy(facts: Facts) -> str:
    """The policy that names what the script does itself: its framework's flags, its autocast dtype,
    its weights' dtype; fp32 where it asks for nothing."""
    own = facts.own
    framework = own.get("framework") or {}
    if framework.get("mixprec"):  # mixprec's own Policy in the script: the policy it asked for
        return str(framework["mixprec"])
    wanted = {str(v) for v in framework.values() if v}
    if framework.get("bf16") or wanted & {"bf16-mixed", "bf16"}:
        return "bf16-mixed"
    if framework.get("fp16") or wanted & {"16-mixed", "fp16"}:
        return "fp16-mixed"
    if wanted & {"bf16-true"}:
        return "bf16-true"
    if wanted & {"16-true"}:
        return "fp16-true"
    dtypes = set(facts.param_dtypes)
    if dtypes == {"bfloat16"}:
        return "bf16-true"
    if dtypes == {"float16"}:
        return "fp16-true"
    casts = {a["dtype"] for a in own.get("autocast") or []}
    if "torch.float16" in casts or (own.get("scaler") and "None" in casts):
        return "fp16-mixed"
    if casts & {"torch.bfloat16", "None"}:
        return "bf16-mixed"
    return "fp32"


def fill(traj: Trajectory, record: TraceRecord) -> None:
    """A trace record as the Trajectory a check compares."""
    steps = record.steps
    traj.losses = [s.loss if s.loss is not None else math.nan for s in steps]
    traj.stepped = [not s.skipped for s in steps]
    traj.scales = [s.scale for s in steps]
    traj.first_output = record.first_output
    traj.first_grads = dict(record.first_grads)
    stalls = [s.stall for s in steps if s.stall is not None]
    traj.stalls = [a / b if b else 0.0 for a, b in stalls]
    for a, b in stalls[:2]:
        traj.stall_counts[0] += a
        traj.stall_counts[1] += b
    traj.series = [LayerSeries.from_dict(d) for d in record.series]
    traj.observed_dtype, traj.observed_layer = record.observed.dtype, record.observed.layer
    traj.nonfinite_buffers = list(record.nonfinite_buffers)


def as_trend(traj: Trajectory, facts: ScriptFacts) -> None:
    """A script whose data differs between two identical runs: compare the loss trends (running
    means over the run so far) rather than step by step, and no first-step SQNR (another batch)."""
    means, total = [], 0.0
    for i, loss in enumerate(traj.losses):
        total += loss
        means.append(total / (i + 1))
    traj.losses = means
    traj.first_output, traj.first_grads = None, {}
    traj.note = (
        "two strict-fp32 runs of the script disagree at the first step (its data is not the same "
        f"from run to run: loss {facts.first_losses[0]:.6g} before): compared the loss trends (running "
        "means), not step by step; no output or gradient SQNR (another batch)"
    )
