"""Bench result rows: dataclasses, and their JSON Lines / CSV round trips."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

STATUSES = ("ok", "unsupported", "oom", "error", "pruned")


@dataclass(frozen=True)
class Candidate:
    """One point of a sweep: a policy name and its channels_last flag."""

    policy: str
    channels_last: bool = False
    keep_fp32: tuple[str, ...] = ()  # fp32 islands, e.g. a failing candidate rescued by `check --fix`

    @property
    def label(self) -> str:
        islands = f"+fp32[{','.join(self.keep_fp32)}]" if self.keep_fp32 else ""
        return self.policy + ("+cl" if self.channels_last else "") + islands


@dataclass
class StepTime:
    median_ms: float
    iqr_ms: float
    n: int

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median_ms, "iqr": self.iqr_ms, "n": self.n}


@dataclass
class BenchRow:
    """One measured (or refused) candidate. Keys follow DESIGN §4."""

    workload: str
    policy: str
    channels_last: bool
    device: str
    batch_size: int
    status: str
    reason: str = ""
    throughput: float | None = None  # samples/s
    step_time_ms: StepTime | None = None
    peak_memory_bytes: int | None = None
    memory_method: str = ""
    speedup_vs_fp32: float | None = None
    first_loss: float | None = None
    flops_per_step: int | None = None
    achieved_tflops: float | None = None
    mfu: float | None = None
    peak_flops: float | None = None
    peak_flops_source: str = ""
    observed_dtype: str | None = None  # output dtype of the first matmul/conv, as it really ran
    step_times_ms: list[float] = field(default_factory=list)
    first_step_ms: float | None = None  # the cold first (warm-up) step, for pruning later candidates
    wall_s: float | None = None
    baseline_repeat: bool = False  # the fp32 re-measurement at the end of a sweep (drift check)
    keep_fp32: list[str] = field(default_factory=list)
    world_size: int = 1  # data-parallel ranks (DDP); throughput counts every rank's batch
    rank_step_time_ms: list[float] = field(default_factory=list)  # median per rank
    rank_peak_memory_bytes: list[int | None] = field(default_factory=list)

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.policy, self.channels_last, tuple(self.keep_fp32))

    @property
    def label(self) -> str:
        return self.candidate.label + (" (repeat)" if self.baseline_repeat else "")

    @property
    def key(self) -> tuple:
        """Identity for --resume: the same candidate on the same workload, device and batch size."""
        return (
            self.workload,
            self.policy,
            self.channels_last,
            tuple(self.keep_fp32),
            self.device,
            self.batch_size,
            self.baseline_repeat,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step_time_ms"] = self.step_time_ms.to_dict() if self.step_time_ms else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchRow:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in d.items() if k in known}
        st = data.get("step_time_ms")
        if isinstance(st, dict):
            data["step_time_ms"] = StepTime(st["median"], st["iqr"], st["n"])
        return cls(**data)


def append_jsonl(path: str | os.PathLike[str], row: BenchRow) -> None:
    """Append one row and fsync, so a crash or Ctrl-C right after loses nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row.to_dict()) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike[str]) -> list[BenchRow]:
    """Rows of a JSON Lines file; a torn last line (killed mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(BenchRow.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError, KeyError):
            continue
    return rows


CSV_COLUMNS = (
    "workload",
    "policy",
    "channels_last",
    "device",
    "batch_size",
    "status",
    "reason",
    "throughput",
    "step_time_median_ms",
    "step_time_iqr_ms",
    "step_time_n",
    "peak_memory_bytes",
    "speedup_vs_fp32",
    "first_loss",
    "flops_per_step",
    "achieved_tflops",
    "mfu",
    "observed_dtype",
    "baseline_repeat",
)


def write_csv(path: str | os.PathLike[str], rows: list[BenchRow]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            d = row.to_dict()
            st = row.step_time_ms
            d.update(
                step_time_median_ms=st.median_ms if st else None,
                step_time_iqr_ms=st.iqr_ms if st else None,
                step_time_n=st.n if st else None,
            )
            writer.writerow({k: d.get(k) for k in CSV_COLUMNS})
    return path


def read_csv(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    with Path(path).open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))
