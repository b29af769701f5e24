"""mixprec: apply, measure, verify and recommend mixed-precision policies for PyTorch training.

Importing mixprec initialises no CUDA context and changes no global torch flag.
"""

from mixprec import lint  # a callable package: mixprec.lint(workload, ...) and mixprec.lint.RULES
from mixprec.errors import MixprecError, PolicyError, ScaleCollapseError, UnsupportedError, UsageError
from mixprec.hardware import DeviceInfo, detect
from mixprec.measure.results import BenchRow
from mixprec.measure.sweep import BenchResult, bench
from mixprec.policy import POLICY_NAMES, Policy, PolicyConfig, Support, check_support, get_policy
from mixprec.workload import Workload, WorkloadSpec
from mixprec.workload_loader import load_workload

__version__ = "0.1.0"

__all__ = [
    "POLICY_NAMES",
    "BenchResult",
    "BenchRow",
    "Workload",
    "WorkloadSpec",
    "bench",
    "lint",
    "load_workload",
    "DeviceInfo",
    "MixprecError",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "ScaleCollapseError",
    "Support",
    "UnsupportedError",
    "UsageError",
    "__version__",
    "check_support",
    "detect",
    "get_policy",
]
