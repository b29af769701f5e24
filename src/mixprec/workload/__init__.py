"""How a model enters mixprec: a :class:`Workload`, the loader that builds one from a name or a
``file.py:function``, and the built-in zoo (the seed's CNNs, a GPT-2-class LM, a tiny MLP)."""

from mixprec.workload.loader import load_workload, workload_from_spec
from mixprec.workload.workload import Workload, WorkloadSpec, default_optimizer
from mixprec.workload.zoo import ZOO_NAMES, build_zoo_workload

__all__ = [
    "ZOO_NAMES",
    "Workload",
    "WorkloadSpec",
    "build_zoo_workload",
    "default_optimizer",
    "load_workload",
    "workload_from_spec",
]
