"""mixprec: apply, measure, verify and recommend mixed-precision policies for PyTorch training.

The public API is what the README shows: policies (:func:`get_policy`, :class:`Policy`,
:class:`Candidate`), workloads (:class:`Workload`, :func:`load_workload`), the measuring and
checking commands (:func:`bench`, :func:`bench_batches`, :func:`check`, :func:`lint`), the
decision (:func:`tune`, :func:`autotune`) and :func:`export`. Importing mixprec initialises no
CUDA context and changes no global torch flag.
"""

from mixprec.checking.check import check
from mixprec.checking.config import CheckConfig
from mixprec.errors import MixprecError, PolicyError, ScaleCollapseError, UnsupportedError, UsageError
from mixprec.exports import EXPORT_TARGETS, export, export_all, export_status
from mixprec.hardware import DeviceInfo, detect
from mixprec.measure.batches import BatchSweep, bench_batches
from mixprec.measure.config import BenchConfig
from mixprec.measure.lint_gains import lint
from mixprec.measure.results import BenchResult, BenchRow
from mixprec.measure.sweep import bench
from mixprec.monitor import Monitor, MonitorConfig
from mixprec.numerics.results import CandidateCheck, CheckResult
from mixprec.policy import (
    POLICY_NAMES,
    Candidate,
    Policy,
    PolicyConfig,
    Support,
    check_support,
    get_policy,
)
from mixprec.status import Status
from mixprec.tuning import Recommendation, TuneConfig, Tuned, TuneResult, autotune, tune
from mixprec.version import __version__
from mixprec.workload import Workload, WorkloadSpec, load_workload

__all__ = [
    "EXPORT_TARGETS",
    "POLICY_NAMES",
    "BatchSweep",
    "BenchConfig",
    "BenchResult",
    "BenchRow",
    "Candidate",
    "CandidateCheck",
    "CheckConfig",
    "CheckResult",
    "DeviceInfo",
    "MixprecError",
    "Monitor",
    "MonitorConfig",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "Recommendation",
    "ScaleCollapseError",
    "Status",
    "Support",
    "TuneConfig",
    "TuneResult",
    "Tuned",
    "UnsupportedError",
    "UsageError",
    "Workload",
    "WorkloadSpec",
    "__version__",
    "autotune",
    "bench",
    "bench_batches",
    "check",
    "check_support",
    "detect",
    "export",
    "export_all",
    "export_status",
    "get_policy",
    "lint",
    "load_workload",
    "tune",
]
