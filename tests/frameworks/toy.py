"""A third framework in one file: linear regression in NumPy, fp32 or fp16 storage.

It is what docs/architecture.md promises: a backend is one subclass of
:class:`mixprec.frameworks.Framework` registered with ``register_framework``; bench, check, tune and
the CLI then take its workloads without a change anywhere else in mixprec.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from mixprec.frameworks import Framework
from mixprec.frameworks.session import BenchSettings, Measurement
from mixprec.hardware.device import DeviceInfo
from mixprec.numerics.compare import Trajectory
from mixprec.numerics.ranges import LayerRanges, RangeReport
from mixprec.policy import Candidate, Support

DTYPES = {"fp32": np.float32, "fp16-true": np.float16}


@dataclass
class ToyWorkload:
    """y = x @ w_true: ``features`` inputs, SGD on the squared error."""

    features: int = 8
    scale: float = 1.0  # of the inputs: large ones overflow fp16
    lr: float = 0.05
    fp32_fails_at: int | None = None  # strict fp32's session raises at this step (a crash mid-sweep)
    name: str = "toy"
    description: str = "linear regression in NumPy"
    default_batch_size: int = 16
    spec: Any = None
    w_true: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.w_true = np.random.default_rng(0).standard_normal(self.features)

    def batch(self, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.random.default_rng(seed).standard_normal((batch_size, self.features)) * self.scale
        return x, x @ self.w_true


class ToyTrainer:
    def __init__(self, workload: ToyWorkload, candidate: Candidate, perturb: float = 0.0) -> None:
        self.workload, self.dtype = workload, DTYPES[candidate.policy]
        w = np.zeros(workload.features) + 0.1
        if perturb:
            w = w * (1 + perturb * np.random.default_rng(1).standard_normal(w.shape))
        self.w = w.astype(self.dtype)

    def grad(self, batch: tuple) -> tuple[float, np.ndarray, np.ndarray]:
        x, y = (a.astype(self.dtype) for a in batch)
        out = x @ self.w
        err = out - y
        return float(np.mean(err.astype(np.float64) ** 2)), out, (2 * x.T @ err / len(y)).astype(self.dtype)

    def step(self, batch: tuple) -> float:
        loss, _, g = self.grad(batch)
        self.w = (self.w - self.dtype(self.workload.lr) * g).astype(self.dtype)
        return loss


class ToySession:
    def __init__(
        self, workload: ToyWorkload, candidate: Candidate, settings: BenchSettings, batches: list
    ) -> None:
        self.trainer, self.settings, self.batches = ToyTrainer(workload, candidate), settings, batches
        self.result, self.index = Measurement(), 0

    def step(self, timed: bool) -> dict[str, Any]:
        fails_at = self.trainer.workload.fp32_fails_at
        if fails_at is not None and self.index >= fails_at and self.trainer.dtype is np.float32:
            raise RuntimeError(f"corrupt shard at step {self.index}")
        start = time.perf_counter()
        loss = self.trainer.step(self.batches[self.index % len(self.batches)])
        seconds = time.perf_counter() - start
        (self.result.step_times_s if timed else self.result.warmup_times_s).append(seconds)
        self.result.first_loss = self.result.first_loss if self.index else loss
        self.result.observed_dtype = np.dtype(self.trainer.dtype).name
        self.index += 1
        return {"event": "step", "index": self.index - 1, "seconds": seconds, "timed": timed, "loss": loss}

    def warm_enough(self, times: list[float]) -> bool:
        return len(times) >= self.settings.warmup

    def warm_up(self, emit: Any) -> bool:
        while not self.warm_enough(self.result.warmup_times_s):
            if not emit(self.step(timed=False)):
                return False
        return True

    def finish(self) -> Measurement:
        return self.result


class ToyFramework(Framework):
    name: ClassVar[str] = "toy"
    title: ClassVar[str] = "NumPy toy"
    workload_type: ClassVar[type] = ToyWorkload
    workload_name: ClassVar[str] = "tests.frameworks.toy.ToyWorkload"

    def load_workload(self, target: str, **sizes: Any) -> ToyWorkload:
        return ToyWorkload(**sizes)

    def support(self, candidate: Candidate, info: DeviceInfo, workload: Any = None) -> Support:
        if candidate.policy in DTYPES:
            return Support(True, f"NumPy {np.dtype(DTYPES[candidate.policy]).name}")
        return Support(False, f"NumPy has no {candidate.policy}", "fp32", native=False)

    def make_batches(self, workload: ToyWorkload, batch_size: int, device: str, seed: int, n: int) -> list:
        return [workload.batch(batch_size, seed + i) for i in range(n)]

    def session(
        self, workload: ToyWorkload, candidate: Candidate, settings: BenchSettings, batches: list | None
    ):
        return ToySession(
            workload,
            candidate,
            settings,
            batches or self.make_batches(workload, settings.batch_size, "cpu", 0, 4),
        )

    def trajectory(self, workload, candidate, batches, steps, device, *, perturb=0.0) -> Trajectory:
        traj = Trajectory(candidate.label)
        try:
            trainer = ToyTrainer(workload, candidate, perturb)
            _, out, g = trainer.grad(batches[0])
            traj.first_output = torch.from_numpy(out.astype(np.float64))
            traj.first_grads = {"w": torch.from_numpy(g.astype(np.float64))}
            for i in range(steps):
                loss = trainer.step(batches[i % len(batches)])
                traj.losses.append(loss)
                traj.stepped.append(True)
                traj.scales.append(None)
        except FloatingPointError as exc:  # np.errstate below turns overflow into an error
            traj.error = f"FloatingPointError: {exc}"
        return traj

    def layer_ranges(self, workload, candidate, batch, device, loss_scale) -> RangeReport:
        _, out, _ = ToyTrainer(workload, candidate).grad(batch)
        layer = LayerRanges("linear", "ToyLinear", 0)
        layer.forward.update(torch.from_numpy(out.astype(np.float64)))
        return RangeReport([layer])

    def island_names(self, workload: ToyWorkload) -> tuple[list[str], dict[str, str]]:
        return ["linear"], {"w": "linear"}

    def exports(
        self, candidate: Candidate, device: str, workload: Any = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        return {"numpy": f"w = w.astype(np.{np.dtype(DTYPES[candidate.policy]).name})\n"}, {}
