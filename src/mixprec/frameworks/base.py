"""The seam between mixprec's one pipeline (bench, check, tune) and a training framework.

:class:`Framework` is one small base class in the way Lightning's precision plugins are built:
each hook is documented here with a default, and a backend (``frameworks/torch``,
``frameworks/keras``) overrides only what differs. ``bench``, the checker and the tune search
exist once; they never ask which framework they run, they ask the backend of the workload
(:func:`mixprec.frameworks.framework_of`).

What a backend provides, by stage:

- **workloads**: which objects it owns, how ``--model``/``--workload`` load one, its label, the
  up-front validation step, the CLI defaults per device;
- **candidates**: which axes it has (layouts, compile modes, optimizer implementations), whether a
  candidate is valid and supported on a device, the tune plan;
- **measuring**: batches, a training :class:`~mixprec.frameworks.session.Session` in this process
  and a module-level builder for a child process, what a candidate process preloads, rows it
  refuses without measuring, the env block;
- **checking**: a differential training :class:`~mixprec.numerics.compare.Trajectory` and the
  per-layer :class:`~mixprec.numerics.ranges.RangeReport` of one step, and the keep-fp32 search
  space;
- **after the pick**: exports and lint findings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from mixprec.errors import PolicyError, UnsupportedError
from mixprec.frameworks.session import BenchSettings, MemoryPoint, Session
from mixprec.hardware.device import DeviceInfo
from mixprec.numerics.compare import Trajectory
from mixprec.numerics.ranges import RangeReport
from mixprec.policy import POLICY_NAMES, Candidate, Support

if TYPE_CHECKING:
    from mixprec.budget import Budget

# A candidate process's session: (spec dict, candidate, settings) -> a Session; module-level so it
# pickles by name into the child.
SessionBuilder = Callable[[dict[str, Any], Candidate, BenchSettings], Session]
_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")
# The vision backends' defaults on CUDA: the setup of SURF's A100 benchmark, 224 px and a batch
# that fills the GPU.
CUDA_DEFAULTS: dict[str, Any] = {
    "image_size": 224,
    "batch_size": 256,
    "steps": 20,
    "warmup": 5,
    "min_time": 2.0,
}


def sized_defaults(device: str, command: str, cpu: dict[str, Any], check: dict[str, Any]) -> dict[str, Any]:
    """A vision backend's :meth:`Framework.cli_defaults`: :data:`CUDA_DEFAULTS` on CUDA, ``cpu``
    elsewhere, and for `check` its smaller sizes (``check``) on top."""
    defaults = dict(CUDA_DEFAULTS if device.startswith("cuda") else cpu)
    return {**defaults, **check} if command == "check" else defaults


class Framework:
    """A training framework mixprec measures, checks and tunes (torch, Keras on TensorFlow, ...).

    Class attributes state the facts; methods are the hooks. Defaults are the neutral answer
    (no layouts, no compile modes, no lint, no exports), so a new backend starts from what it has.

    Attributes:
        name: the value of :attr:`mixprec.Candidate.framework` and of ``--framework``.
        title: how tables and errors name it ("PyTorch", "Keras 3 on TensorFlow").
        workload_type: the workload class it owns (``isinstance`` picks the backend of a workload).
        workload_name: how users import that class ("mixprec.Workload"), for errors.
        layouts: the channels_last axis applies (NCHW vs NHWC tensors).
        compile_modes: what ``Candidate.compile`` may name here; the first is what tune compiles with.
        compile_scopes: what ``Candidate.compile_scope`` may name here (None, the default, always).
        optimizer_impls: what ``Candidate.optimizer`` may name here (foreach, fused, ...).
        emulation: ``Candidate.emulate`` (a format emulated in fp32) is available.
        island_kind: what a keep_fp32 pattern keeps in fp32, in words ("fp32 modules").
        linter: ``mixprec lint`` has rules for its models (:meth:`lint` returns findings).
        counts_flops: its sessions count a step's FLOPs (``BenchSettings.count_flops``), so rows
            have MFU; elsewhere MFU is n/a and a bench result says why once.
        scaler_name: the loss scaler's name in this framework, for reports.
        runs_as_written: its source runs unchanged as well as under a candidate (a training script),
            so ``Candidate.as_written`` is a candidate here: the source's own precision, a row of
            every sweep and check.
        compiles_cached: what a compile produces outlives its process (Inductor's on-disk caches),
            so a numerics check compiling the graphs a speed run compiled reads most of them back.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    workload_type: ClassVar[type]
    workload_name: ClassVar[str]
    layouts: ClassVar[bool] = False
    compile_modes: ClassVar[tuple[str, ...]] = ()
    compile_scopes: ClassVar[tuple[str, ...]] = ()
    optimizer_impls: ClassVar[tuple[str, ...]] = ()
    accumulates: ClassVar[bool] = False  # its sessions measure BenchSettings.accumulation_steps
    emulation: ClassVar[bool] = False
    island_kind: ClassVar[str] = "fp32 layers"
    linter: ClassVar[bool] = False
    counts_flops: ClassVar[bool] = False
    scaler_name: ClassVar[str] = "the loss scaler"
    runs_as_written: ClassVar[bool] = False
    compiles_cached: ClassVar[bool] = False
    named: ClassVar[bool] = True  # ``--framework NAME`` selects it

    # ------------------------------------------------------------------ workloads
    def owns(self, workload: Any) -> bool:
        """Whether ``workload`` is one of this framework's."""
        return isinstance(workload, self.workload_type)

    def load_workload(self, target: str, **sizes: Any) -> Any:
        """The workload ``--model NAME`` / ``--workload file.py:fn`` names, with its size options."""
        raise NotImplementedError(f"the {self.title} backend loads no workloads by name")

    def workload_label(self, workload: Any) -> str:
        """How rows and reports name the workload (its name and sizes)."""
        return str(getattr(workload, "name", type(workload).__name__))

    def validate_workload(
        self, workload: Any, device: str, batch_size: int, *, budget: Budget | None = None
    ) -> None:
        """One strict-fp32 step before anything is measured, so a broken workload is one clear
        :class:`~mixprec.errors.UsageError`, not the same failure in every row; within ``budget``
        where it is given (a script that never steps is one error within it). Default: none."""

    def default_batch_size(self, workload: Any) -> int:
        return int(workload.default_batch_size)

    def cli_defaults(self, device: str, command: str) -> dict[str, Any]:
        """Sizes and step counts ``mixprec COMMAND`` (bench, check, tune, lint, demo) uses on
        ``device`` when the user names none: image_size, max_image_size (a cap for vision models by
        name), batch_size, steps, warmup, min_time."""
        return {"batch_size": None, "steps": 4, "warmup": 1, "min_time": 1.0}

    def sized_by_defaults(self, target: str | None, is_factory: bool, defaults: dict[str, Any]) -> str | None:
        """Which size option of ``defaults`` applies to the model ``target`` names: 'image_size' (set
        it), 'max_image_size' (cap it), or None (the model's own sizes); batch_size follows."""
        return None

    # ------------------------------------------------------------------ devices
    def resolve_device(self, device: Any) -> str:
        """The device string a run uses (``device`` or the framework's default)."""
        return str(device or "cpu")

    def threads(self) -> int:
        """Intra-op threads the framework computes with (part of a row's settings)."""
        import torch

        return torch.get_num_threads()

    def use_threads(self, threads: int) -> None:
        """Compute with ``threads`` intra-op threads in this process from now on: tune's in-process
        stages (the numerics checks) run at the count its sweeps measure at. The caller puts the
        count back (:func:`mixprec.measure.threads.threads_kept`)."""
        import torch

        torch.set_num_threads(threads)

    def thread_probe(
        self, workload: Any, device: str, batch_size: int, counts: Sequence[int]
    ) -> dict[int, float] | None:
        """Median seconds of a strict-fp32 step at each intra-op thread count of ``counts`` on a CPU
        (:mod:`mixprec.measure.threads` picks from them); None where the framework cannot change
        its threads in this process (the sweep then keeps :meth:`threads`)."""
        return None

    def environment(self, device: str | None, *, full: bool = False) -> dict[str, Any]:
        """The env block of a result: versions, device, precision state (``full``: everything
        ``mixprec env`` shows); a backend adds its own facts under its ``name``."""
        from mixprec.hardware import environment

        return environment.collect(device, full=full)

    def peaks(self, info: DeviceInfo, keys: Sequence[str]) -> dict[str, tuple[float | None, str]]:
        """Peak FLOP/s per peak key (the MFU denominators), with their source."""
        from mixprec.hardware.peaks import peak_flops

        return {key: peak_flops(info, key) for key in keys}

    # ------------------------------------------------------------------ candidates
    def validate(self, candidate: Candidate) -> Candidate:
        """``candidate`` checked against this framework's axes; raises :class:`PolicyError` naming the
        bad value, the valid ones and the fix. Backends add their own rules and call this."""
        if candidate.framework != self.name:
            raise PolicyError(
                f"{candidate.label} is a {candidate.framework} candidate, not a {self.name} one."
            )
        if candidate.channels_last and not self.layouts:
            raise PolicyError(
                f"channels_last does not apply to {self.title} candidates ({candidate.label}); drop it."
            )
        if candidate.compile is not None and candidate.compile not in self.compile_modes:
            valid = ", ".join(self.compile_modes) or "none here"
            raise PolicyError(f"Unknown {self.title} compile mode {candidate.compile!r}; valid: {valid}.")
        if candidate.compile_scope is not None and candidate.compile_scope not in self.compile_scopes:
            valid = ", ".join(self.compile_scopes) or "none here (its compile mode sets what is compiled)"
            raise PolicyError(
                f"Unknown {self.title} compile scope {candidate.compile_scope!r}; valid: {valid}."
            )
        if candidate.optimizer is not None and candidate.optimizer not in self.optimizer_impls:
            valid = ", ".join(self.optimizer_impls) or "none here"
            raise PolicyError(
                f"{self.title} has no optimizer implementation {candidate.optimizer!r}; valid: {valid}."
            )
        if candidate.as_written and not self.runs_as_written:
            raise PolicyError(
                f"{candidate.label}: 'as written' is a training script's own precision; a {self.title} "
                "workload has none of its own. Drop as_written."
            )
        if candidate.emulate is not None and not self.emulation:
            raise PolicyError(
                f"{self.title} candidates cannot emulate a format ({candidate.emulate}); drop it."
            )
        return candidate

    def candidate(self, policy: str, **axes: Any) -> Candidate:
        """A validated candidate of this framework."""
        return self.validate(Candidate(policy, framework=self.name, **axes))

    @property
    def baseline(self) -> Candidate:
        """Strict fp32, eager: the reference every speedup and verdict is measured against."""
        return Candidate("fp32", framework=self.name)

    def support(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> Support:
        """Whether ``candidate`` runs on the device, natively or emulated, why, and what instead;
        ``workload``: the one being measured, where the answer depends on it (a script's framework
        expresses fewer candidates than its own loop), None where only the device is asked."""
        raise NotImplementedError

    def predictable(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> str | None:
        """Where a candidate cannot run fast here but its numerics can be computed here anyway (fp8
        through torchao's reference kernels), the label of that prediction; None otherwise.
        ``workload``: as for :meth:`support` (None: only the device is asked)."""
        return None

    def emulation_slowdown(self, candidate: Candidate, device: str) -> float:
        """How many times strict fp32's step a step of ``candidate`` takes here where its numerics
        are only predicted (:meth:`predictable`): what its check is priced at. 1.0 where the backend
        cannot tell."""
        return 1.0

    def source_candidates(self, workload: Any) -> list[Candidate]:
        """Candidates the source brings itself, measured and checked beside whatever was asked (a
        script's own precision, as written); none by default."""
        return []

    def tune_candidates(self, workload: Any, info: DeviceInfo) -> list[Candidate]:
        """What tune's speed sweep measures: every policy, in every useful layout where supported;
        unsupported ones once, so the table says why."""
        return [Candidate(name, framework=self.name) for name in POLICY_NAMES]

    def bench_layouts(self, workload: Any, wanted: Sequence[bool]) -> tuple[list[bool], str | None]:
        """The channels_last values bench measures of ``wanted``, and a note when some were dropped."""
        if True in wanted and not self.layouts:
            return [False], None
        return list(wanted), None

    def has_convolutions(self, workload: Any) -> bool:
        """Whether the workload's model has convolutions: a CNN's format speed is its conv rate, and
        only then does channels_last change anything."""
        return self.bench_layouts(workload, [True])[0] == [True]

    def optimizer_variants(self, workload: Any, candidate: Candidate) -> list[Candidate]:
        """``candidate`` with the other implementations of the workload's optimizer (tune tries them
        on its pick: same numerics, maybe faster steps)."""
        return []

    def predictions(
        self,
        workload: Any,
        info: DeviceInfo,
        affordable: Callable[[Candidate], bool] | None = None,
        policies: Collection[str] = POLICY_NAMES,
    ) -> tuple[list[Candidate], list[str]]:
        """Candidates among ``policies`` whose numerics tune predicts on this device without measuring
        their speed, and notes on why none can be (fp8 on a CPU). ``affordable(candidate)``: whether
        the budget can still pay its check; a backend whose sorting costs a run skips the run where
        none is, and hands every such candidate back unsorted (the caller says the budget ended first)."""
        return [], []

    # ------------------------------------------------------------------ measuring
    def make_batches(self, workload: Any, batch_size: int, device: str, seed: int, n: int) -> list[Any]:
        """The same ``n`` batches for every candidate, each drawn under its own fixed seed."""
        raise NotImplementedError

    def session(
        self, workload: Any, candidate: Candidate, settings: BenchSettings, batches: list | None
    ) -> Session:
        """``candidate``'s training session in this process (``batches`` from :meth:`make_batches`)."""
        raise NotImplementedError

    def session_builder(self) -> SessionBuilder | None:
        """The module-level function that builds a candidate's session in its own process from the
        workload's spec (:data:`SessionBuilder`); None: sessions run in this process only."""
        return None

    def preload(self, spec: Any) -> tuple[str, ...]:
        """Modules the candidates' fork server imports once (the framework, the model's library)."""
        return ()

    def refuse(
        self, workload: Any, candidate: Candidate, settings: BenchSettings, batches: list | None
    ) -> tuple[str, str] | None:
        """``(status, reason)`` of a supported candidate that need not be measured (a math mode that
        computes what strict fp32 does on this workload: 'no-effect'), or None: measure it."""
        return None

    def peak_memory(
        self, workload: Any, candidate: Candidate, device: str, batch_size: int, accumulation_steps: int = 1
    ) -> MemoryPoint:
        """The peak memory of ``candidate``'s real training step at ``batch_size`` samples per
        micro-batch, ``accumulation_steps`` of them per step (the gradients held between them count)
        (the memory model of :mod:`mixprec.measure.memory` is fitted on a few of these)."""
        raise UnsupportedError(
            f"no peak-memory measurement for {self.title} workloads yet; drop --batch-sizes / --batch auto."
        )

    def data_parallel(self) -> Callable[..., Any] | None:
        """The data-parallel measurement ``(spec, candidate, settings, nproc) -> outcome`` (torch DDP),
        or None where the framework has none here."""
        return None

    # ------------------------------------------------------------------ checking
    def trajectory(
        self,
        workload: Any,
        candidate: Candidate,
        batches: Sequence[Any],
        steps: int,
        device: str,
        *,
        perturb: float = 0.0,
    ) -> Trajectory:
        """A differential training run: probe the first step (output, unscaled gradients, the loss
        scale that made them finite), then train a fresh copy ``steps`` steps from the workload's
        initial weights (multiplied by ``1 + perturb * N(0, 1)`` for the chaos floor). Never raises
        for the candidate's own failure: it is recorded in ``Trajectory.error``."""
        raise NotImplementedError

    def layer_ranges(
        self, workload: Any, candidate: Candidate, batch: Any, device: str, loss_scale: float | None
    ) -> RangeReport:
        """Per-layer ranges of one step of a fresh copy under ``candidate``: forward outputs, and
        where the framework can, the gradients flowing back (scaled by ``loss_scale``)."""
        raise NotImplementedError

    def linear_census(
        self, workload: Any, spec: Any, batch: Any, device: str, keep_fp32: Sequence[str] = ()
    ) -> Any:
        """The Linear layers a low-format policy ``spec`` converts, as
        :class:`mixprec.frameworks.torch.linears.LinearCensus`; None where the framework has no
        low-format policies."""
        return None

    def island_names(self, workload: Any) -> tuple[list[str], dict[str, str]]:
        """What keep_fp32 may name (module or layer names, in model order) and which of them owns
        each parameter of a gradient report (parameter name -> its module)."""
        return [], {}

    def fix_snippet(self, candidate: Candidate, keep_fp32: Sequence[str]) -> str:
        """How a user applies ``candidate`` with ``keep_fp32`` kept in fp32, in one line."""
        return f"{candidate.policy} with {list(keep_fp32)!r} kept in fp32"

    def map_snippet(self, candidate: Candidate) -> str:
        """How a user applies a low-format ``candidate`` with its precision map (``keep_bf16``) and
        its own options, in one line: mixprec's Policy by default."""
        options = "".join(f", {k}={v!r}" for k, v in candidate.policy_options().items())
        return f"mixprec.get_policy({candidate.policy!r}{options})"

    # ------------------------------------------------------------------ after the pick
    def exports(
        self, candidate: Candidate, device: str, workload: Any = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """``({target: text}, {target: why refused})`` for the recommendation made on ``workload``."""
        return {}, {}

    def lint(self, workload: Any, candidate: Candidate, device: str) -> list[dict[str, Any]] | None:
        """Lint findings (as dicts) of the workload under the candidate; None: no linter here."""
        return None


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise PolicyError(f"A framework name must be a lower-case identifier, got {name!r}.")
    return name
