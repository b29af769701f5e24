"""mixprec: apply, measure, verify and recommend mixed-precision policies for PyTorch training.

The public API is what the README shows: policies (:func:`get_policy`, :class:`Policy`,
:class:`Candidate`), workloads (:class:`Workload`, :func:`load_workload`), the measuring and
checking commands (:func:`bench`, :func:`bench_batches`, :func:`check`, :func:`lint`), the
decision (:func:`tune`, :func:`autotune`) and :func:`export`. Importing mixprec initialises no
CUDA context and changes no global torch flag.
"""

from typing import TYPE_CHECKING

from mixprec.lazy import lazy_names

if TYPE_CHECKING:  # (what a type checker and an IDE see: the names below, where they live)
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

# The public names, each imported on first use (PEP 562): ``import mixprec`` stays light, so a training
# script that mixprec's agent runs in pays for torch and the few modules it uses, not for all of them.
_LAZY = {
    "check": "mixprec.checking.check",
    "CheckConfig": "mixprec.checking.config",
    "MixprecError": "mixprec.errors",
    "PolicyError": "mixprec.errors",
    "ScaleCollapseError": "mixprec.errors",
    "UnsupportedError": "mixprec.errors",
    "UsageError": "mixprec.errors",
    "EXPORT_TARGETS": "mixprec.exports",
    "export": "mixprec.exports",
    "export_all": "mixprec.exports",
    "export_status": "mixprec.exports",
    "DeviceInfo": "mixprec.hardware",
    "detect": "mixprec.hardware",
    "BatchSweep": "mixprec.measure.batches",
    "bench_batches": "mixprec.measure.batches",
    "BenchConfig": "mixprec.measure.config",
    "lint": "mixprec.measure.lint_gains",
    "BenchResult": "mixprec.measure.results",
    "BenchRow": "mixprec.measure.results",
    "bench": "mixprec.measure.sweep",
    "Monitor": "mixprec.monitor",
    "MonitorConfig": "mixprec.monitor",
    "CandidateCheck": "mixprec.numerics.results",
    "CheckResult": "mixprec.numerics.results",
    "POLICY_NAMES": "mixprec.policy",
    "Candidate": "mixprec.policy",
    "Policy": "mixprec.policy",
    "PolicyConfig": "mixprec.policy",
    "Support": "mixprec.policy",
    "check_support": "mixprec.policy",
    "get_policy": "mixprec.policy",
    "Status": "mixprec.status",
    "Recommendation": "mixprec.tuning",
    "TuneConfig": "mixprec.tuning",
    "Tuned": "mixprec.tuning",
    "TuneResult": "mixprec.tuning",
    "autotune": "mixprec.tuning",
    "tune": "mixprec.tuning",
    "__version__": "mixprec.version",
    "Workload": "mixprec.workload",
    "WorkloadSpec": "mixprec.workload",
    "load_workload": "mixprec.workload",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


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
