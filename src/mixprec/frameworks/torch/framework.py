"""The torch backend: :class:`mixprec.Workload` models trained under a :class:`mixprec.Policy`."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch

from mixprec.frameworks.base import Framework, SessionBuilder, sized_defaults
from mixprec.frameworks.session import BenchSettings, MemoryPoint, Session
from mixprec.frameworks.torch import session as torch_session
from mixprec.frameworks.torch.implementations import offered
from mixprec.frameworks.torch.ranges import collect_ranges
from mixprec.frameworks.torch.trajectory import run_trajectory
from mixprec.hardware.device import DeviceInfo, resolve_device
from mixprec.numerics.compare import Trajectory
from mixprec.numerics.emulate import emulation_context
from mixprec.numerics.ranges import RangeReport
from mixprec.policy import POLICY_NAMES, Candidate, Policy, Support, check_support, get_policy
from mixprec.policy.candidate import COMPILE_MODES, COMPILE_SCOPES, OPTIMIZER_IMPLS, check_torch_axes
from mixprec.policy.support import fp8_predictable, prediction_label
from mixprec.status import Status
from mixprec.workload import Workload, WorkloadSpec, load_workload, validate_workload
from mixprec.workload.models import preload_modules, source_of

# Sized so the default sweep (resnet50, every CPU policy, both layouts) ends in about two minutes
# on a 2-core CPU, at a size where compute (not per-op overhead) dominates so the ranking means
# something (on CUDA: the base's CUDA_DEFAULTS). A vision model by name gets the same on a CPU: at
# most 128 px (where the model takes smaller inputs than its recipe's) and batch 16.
CPU_DEFAULTS: dict[str, Any] = {
    "image_size": 128,
    "max_image_size": 128,
    "batch_size": 16,
    "steps": 4,
    "warmup": 1,
    "min_time": 1.0,
}
# `check` trains three runs per candidate: small enough for a CPU, the default model (and vision
# models by name) at a small image size and batch.
CHECK_DEFAULTS: dict[str, Any] = {"image_size": 64, "max_image_size": 64, "batch_size": 8}
# What a candidate process imports once in the fork server (the model's library comes on top).
_PRELOAD = ("torch", "torchvision", "mixprec.frameworks.torch.session", "mixprec.workload.loader")


def has_4d_weights(model: torch.nn.Module) -> bool:
    return any(p.dim() == 4 for p in model.parameters())


# Timed steps per thread count of the thread probe (after one untimed): the median of three.
PROBE_STEPS = 3


class TorchFramework(Framework):
    """PyTorch: eager or ``torch.compile``d steps, channels_last, the optimizer's implementations,
    emulated formats, DDP ranks, lint and every export target."""

    name: ClassVar[str] = "torch"
    title: ClassVar[str] = "PyTorch"
    workload_type: ClassVar[type] = Workload
    workload_name: ClassVar[str] = "mixprec.Workload"
    layouts: ClassVar[bool] = True
    compile_modes: ClassVar[tuple[str, ...]] = COMPILE_MODES
    compiles_cached: ClassVar[bool] = True
    compile_scopes: ClassVar[tuple[str, ...]] = COMPILE_SCOPES
    optimizer_impls: ClassVar[tuple[str, ...]] = OPTIMIZER_IMPLS
    accumulates: ClassVar[bool] = True
    emulation: ClassVar[bool] = True
    island_kind: ClassVar[str] = "fp32 modules"
    linter: ClassVar[bool] = True
    counts_flops: ClassVar[bool] = True
    scaler_name: ClassVar[str] = "GradScaler"

    # ------------------------------------------------------------------ workloads
    def load_workload(self, target: str, **sizes: Any) -> Workload:
        return load_workload(target, **sizes)

    def workload_label(self, workload: Workload) -> str:
        sizes = dict(workload.spec.sizes) if workload.spec else {}
        inner = ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))
        return f"{workload.name}({inner})" if inner else str(workload.name)

    def validate_workload(
        self, workload: Workload, device: str, batch_size: int, *, budget: Any = None
    ) -> None:
        validate_workload(workload, device=device, batch_size=batch_size)

    def cli_defaults(self, device: str, command: str) -> dict[str, Any]:
        if command == "lint":
            return {}  # lint traces on the meta device: the model's own sizes cost nothing
        return sized_defaults(device, command, CPU_DEFAULTS, CHECK_DEFAULTS)

    def sized_by_defaults(self, target: str | None, is_factory: bool, defaults: dict[str, Any]) -> str | None:
        if is_factory:
            return None
        if target in (None, "resnet50"):
            return "image_size" if "image_size" in defaults else None
        source = source_of(target or "")
        if source is not None and "image_size" in source.sizes and "max_image_size" in defaults:
            return "max_image_size"
        return None

    def thread_probe(
        self, workload: Workload, device: str, batch_size: int, counts: Sequence[int]
    ) -> dict[int, float] | None:
        import statistics
        import time

        model = copy.deepcopy(workload.model).to(device)
        optimizer = workload.make_optimizer(model)
        batch = torch_session.make_batches(workload, batch_size, torch.device(device), 0, 1)[0]
        policy = get_policy("fp32", device=device)

        def step() -> float:
            start = time.perf_counter()
            loss = workload.loss_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        before = torch.get_num_threads()
        found: dict[int, float] = {}
        try:
            with policy.precision_scope():
                for n in counts:
                    torch.set_num_threads(n)
                    step()  # the first at a new count pays OpenMP's thread start
                    found[n] = statistics.median(step() for _ in range(PROBE_STEPS))
        finally:
            torch.set_num_threads(before)
        return found

    # ------------------------------------------------------------------ devices
    def resolve_device(self, device: Any) -> str:
        return str(resolve_device(device))

    # ------------------------------------------------------------------ candidates
    def validate(self, candidate: Candidate) -> Candidate:
        super().validate(candidate)
        check_torch_axes(candidate)
        return candidate

    def support(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> Support:
        return check_support(candidate.policy, info)

    def predictable(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> str | None:
        return prediction_label(candidate.policy, info)

    def tune_candidates(self, workload: Workload, info: DeviceInfo) -> list[Candidate]:
        layouts = (False, True) if has_4d_weights(workload.model) else (False,)
        return [
            Candidate(p, cl) for p in POLICY_NAMES for cl in (layouts if check_support(p, info) else (False,))
        ]

    def has_convolutions(self, workload: Workload) -> bool:
        return has_4d_weights(workload.model)

    def bench_layouts(self, workload: Workload, wanted: Sequence[bool]) -> tuple[list[bool], str | None]:
        if True in wanted and not self.has_convolutions(workload):
            return [False], (
                "channels_last candidates skipped: the model has no 4-D (conv) weights, so it changes nothing"
            )
        return list(wanted), None

    def optimizer_variants(self, workload: Workload, candidate: Candidate) -> list[Candidate]:
        # the optimizer's class, from the factory as written (it may need the module itself)
        probe = workload.make_optimizer(workload.model)
        return [replace(candidate, optimizer=impl) for impl in offered(type(probe))]

    def predictions(
        self,
        workload: Workload,
        info: DeviceInfo,
        affordable: Callable[[Candidate], bool] | None = None,
        policies: Collection[str] = POLICY_NAMES,
    ) -> tuple[list[Candidate], list[str]]:  # (its sorting reads the model: no run to skip)
        from mixprec.policy.lowformat import none_converted, plan_layers

        cands: list[Candidate] = []
        notes: list[str] = []
        for name in (n for n in POLICY_NAMES if n in policies and fp8_predictable(n, info)):
            spec = Candidate(name).spec
            plan = plan_layers(workload.model, spec)
            if plan.low:
                cands.append(Candidate(name))
            else:
                n = len(plan.ineligible)
                notes.append(
                    f"{name} would convert none of this model's Linear layers ({n} "
                    f"{'has' if n == 1 else 'have'} a dimension its kernels cannot take): nothing to "
                    f"predict; {none_converted(spec, plan.refused)}"
                )
        return cands, list(dict.fromkeys(notes))

    def emulation_slowdown(self, candidate: Candidate, device: str) -> float:
        from mixprec.frameworks.torch.emulation_cost import emulation_slowdown

        return emulation_slowdown(candidate, device)

    def linear_census(
        self, workload: Workload, spec: Any, batch: Any, device: str, keep_fp32: Sequence[str] = ()
    ) -> Any:
        from mixprec.frameworks.torch.linears import census

        return census(workload, spec, batch, device, keep_fp32)

    # ------------------------------------------------------------------ measuring
    def make_batches(self, workload: Workload, batch_size: int, device: str, seed: int, n: int) -> list[Any]:
        return torch_session.make_batches(workload, batch_size, torch.device(device), seed, n)

    def session(
        self, workload: Workload, candidate: Candidate, settings: BenchSettings, batches: list | None
    ) -> Session:
        return torch_session.TrainingSession(workload, candidate, settings, batches)

    def peak_memory(
        self,
        workload: Workload,
        candidate: Candidate,
        device: str,
        batch_size: int,
        accumulation_steps: int = 1,
    ) -> MemoryPoint:
        from mixprec.frameworks.torch.memory import peak_memory

        return peak_memory(workload, candidate, device, batch_size, accumulation_steps)

    def session_builder(self) -> SessionBuilder:
        return torch_session.build_session

    def preload(self, spec: WorkloadSpec | None) -> tuple[str, ...]:
        return _PRELOAD + (preload_modules(spec.target) if spec is not None else ())

    def refuse(
        self, workload: Workload, candidate: Candidate, settings: BenchSettings, batches: list | None
    ) -> tuple[str, str] | None:
        if not (candidate.spec.is_math_mode and candidate.policy != "fp32"):
            return None
        from mixprec.frameworks.torch.effect import math_mode_effect

        device = torch.device(settings.device)
        try:
            batch = (
                batches or self.make_batches(workload, settings.batch_size, settings.device, settings.seed, 1)
            )[0]
            # at the threads the candidate runs at: oneDNN picks its kernels (and whether the bf32
            # mode reaches them) by thread count
            before = torch.get_num_threads()
            torch.set_num_threads(settings.threads or before)
            try:
                effect = math_mode_effect(workload, candidate, batch, device)
            finally:
                torch.set_num_threads(before)
        except Exception:  # the probe is an optimisation: when it cannot run, measure instead
            return None
        return (Status.NO_EFFECT, effect.describe(candidate)) if effect.no_effect else None

    def data_parallel(self) -> Callable[..., Any] | None:
        from mixprec.frameworks.torch.data_parallel import run_data_parallel

        return run_data_parallel

    # ------------------------------------------------------------------ checking
    def policy(self, candidate: Candidate, device: str) -> Policy:
        # the check decided it may run here (supported, or an fp8 prediction)
        return get_policy(candidate, device=device, check=False)

    def trajectory(
        self,
        workload: Workload,
        candidate: Candidate,
        batches: Sequence[Any],
        steps: int,
        device: str,
        *,
        perturb: float = 0.0,
    ) -> Trajectory:
        return run_trajectory(
            workload,
            self.policy(candidate, device),
            batches,
            steps,
            label=candidate.label,
            context=emulation_context(candidate.emulate),
            perturb=perturb,
            compile_mode=candidate.compile,
            compile_scope=candidate.compile_scope,
        )

    def layer_ranges(
        self, workload: Workload, candidate: Candidate, batch: Any, device: str, loss_scale: float | None
    ) -> RangeReport:
        policy = self.policy(candidate, device)
        model = policy.prepare(copy.deepcopy(workload.model))
        model.train()
        context = emulation_context(candidate.emulate) or contextlib.nullcontext

        def step() -> torch.Tensor:
            with context(), policy.autocast():
                return workload.loss_fn(model, batch)

        with policy.precision_scope(), context():
            return collect_ranges(model, step, loss_scale=loss_scale)

    def island_names(self, workload: Workload) -> tuple[list[str], dict[str, str]]:
        names = [n for n, _ in workload.model.named_modules() if n]
        owners = {n: n.rsplit(".", 1)[0] for n, _ in workload.model.named_parameters() if "." in n}
        return names, owners

    def fix_snippet(self, candidate: Candidate, keep_fp32: Sequence[str]) -> str:
        return f"mixprec.get_policy({candidate.policy!r}, keep_fp32={list(keep_fp32)!r})"

    # ------------------------------------------------------------------ after the pick
    def exports(
        self, candidate: Candidate, device: str, workload: Any = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        from mixprec.exports import export_all

        results = export_all(candidate, device=device, model=getattr(workload, "model", None))
        texts = {target: r.text for target, r in results.items() if r.text is not None}
        refusals = {target: r.refused for target, r in results.items() if r.refused is not None}
        return texts, refusals

    def lint(self, workload: Workload, candidate: Candidate, device: str) -> list[dict[str, Any]] | None:
        from mixprec.linting import lint

        return [f.to_dict() for f in lint(workload, candidate, device=device)]
