"""How a model enters mixprec: a :class:`Workload`, the loader that builds one from a name or a
``file.py:function``, the built-in zoo (the CNNs of SURF's A100 benchmark, a GPT-2-class LM, a tiny
MLP), models by name from torchvision, timm and Hugging Face transformers, and the up-front
validation."""

from mixprec.workload.loader import load_workload, workload_from_spec
from mixprec.workload.models import SOURCES, ModelSource, list_models, parse_model_config, register_source
from mixprec.workload.validate import validate_workload
from mixprec.workload.workload import Workload, WorkloadSpec, default_optimizer
from mixprec.workload.zoo import ZOO_NAMES, build_zoo_workload

__all__ = [
    "SOURCES",
    "ZOO_NAMES",
    "ModelSource",
    "Workload",
    "WorkloadSpec",
    "build_zoo_workload",
    "default_optimizer",
    "list_models",
    "load_workload",
    "parse_model_config",
    "register_source",
    "validate_workload",
    "workload_from_spec",
]
