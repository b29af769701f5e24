"""What the commands that train a workload share: its arguments, defaults and progress."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from mixprec.cli.progress import CandidateProgress, sweep_progress
from mixprec.errors import UnsupportedError, UsageError
from mixprec.hardware.device import DeviceInfo, detect
from mixprec.measure.results import BenchRow
from mixprec.policy import canonical_name, check_support
from mixprec.policy.candidate import FRAMEWORKS
from mixprec.status import Status
from mixprec.workload.loader import load_workload
from mixprec.workload.models import SOURCES, parse_model_config, source_of
from mixprec.workload.workload import Workload
from mixprec.workload.zoo import ZOO_NAMES

__all__ = [
    "CPU_DEFAULTS",
    "CUDA_DEFAULTS",
    "CandidateProgress",
    "add_workload_arguments",
    "default_batch_size",
    "first_failure",
    "positive_int",
    "require_supported",
    "sweep_progress",
    "workload_from_args",
]

# Sized so the default sweep (resnet50, every CPU policy, both layouts) ends in about two
# minutes on a 2-core CPU, at a size where compute (not per-op overhead) dominates so the
# ranking means something; on CUDA the seed's setup: 224 px and a batch that fills the GPU.
# A vision model by name gets the same on a CPU: at most 128 px (where the model takes smaller
# inputs than its recipe's) and batch 16.
CPU_DEFAULTS: dict[str, Any] = {
    "image_size": 128,
    "max_image_size": 128,
    "batch_size": 16,
    "steps": 4,
    "warmup": 1,
    "min_time": 1.0,
}
CUDA_DEFAULTS: dict[str, Any] = {
    "image_size": 224,
    "batch_size": 256,
    "steps": 20,
    "warmup": 5,
    "min_time": 2.0,
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_workload_arguments(p: argparse.ArgumentParser, *, verbose: bool = True) -> None:
    """--model / --workload, --model-config, --list-models and the size options, shared by the
    commands that train a workload (``verbose``: also --verbose, for what child processes print)."""
    group = p.add_mutually_exclusive_group()
    sources = ", ".join(f"{s}:NAME" for s in SOURCES)
    group.add_argument(
        "--model",
        help=f"a model by name: {', '.join(ZOO_NAMES)}, or {sources} (--list-models; default: resnet50)",
    )
    group.add_argument("--workload", help="your factory: path/to/file.py:function or package.module:function")
    p.add_argument(
        "--model-config",
        metavar="KEY=VALUE,...",
        help="the model's config: n_layer=2,n_embd=128 (gpt2), num_hidden_layers=2 or task=masked-lm "
        "(hf:*), num_classes=10 (torchvision:, timm:); keyword arguments of a --workload factory",
    )
    p.add_argument(
        "--list-models",
        nargs="?",
        const="",
        metavar="PATTERN",
        help="list the models loadable by name here (PATTERN: a glob such as 'timm:convnext*') and exit",
    )
    p.add_argument("--image-size", type=positive_int, help="image side for vision models")
    p.add_argument("--seq-len", type=positive_int, help="sequence length for language models")
    p.add_argument("--batch-size", type=positive_int)
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    p.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        default="torch",
        help="torch (default) or tensorflow: Keras 3 models (--model resnet50|vgg19|densenet121|mlp, or "
        "--workload file.py:fn returning a mixprec.keras.KerasWorkload); needs mixprec[tensorflow]",
    )
    if verbose:
        p.add_argument(
            "--verbose",
            "-v",
            action="store_true",
            help="also show stage messages and what the workload prints in each candidate's process",
        )


def _sized_by_defaults(args: argparse.Namespace, defaults: dict[str, Any]) -> bool:
    """The default model, or a vision model by name where the defaults cap the image size (CPU)."""
    if args.workload:
        return False
    if args.model in (None, "resnet50"):
        return True
    source = source_of(args.model)
    return source is not None and "image_size" in source.sizes and "max_image_size" in defaults


def default_batch_size(args: argparse.Namespace, defaults: dict[str, Any]) -> int | None:
    """--batch-size, else the defaults' batch for the models they size (None: the workload's)."""
    if args.batch_size:
        return int(args.batch_size)
    return defaults.get("batch_size") if _sized_by_defaults(args, defaults) else None


def workload_from_args(args: argparse.Namespace, defaults: dict[str, Any]) -> Workload:
    sizes: dict[str, Any] = {}
    target = args.workload or args.model or "resnet50"
    if args.image_size:
        sizes["image_size"] = args.image_size
    elif target == "resnet50" and not args.workload and "image_size" in defaults:
        sizes["image_size"] = defaults["image_size"]
    elif _sized_by_defaults(args, defaults):
        sizes["max_image_size"] = defaults["max_image_size"]
    if args.seq_len:
        sizes["seq_len"] = args.seq_len
    config = parse_model_config(getattr(args, "model_config", None))
    for key in set(config) & set(sizes):
        option = "--" + key.replace("_", "-")
        raise UsageError(f"--model-config sets {key} and so does {option}; keep one of them.")
    return load_workload(target, **sizes, **config)


def require_supported(
    policies: Sequence[str],
    device: str | None,
    option: str = "--policies",
    allowed: Callable[[str, DeviceInfo], bool] = lambda name, info: False,
) -> None:
    """Exit 3 before any work when the user named a policy this device cannot run, as ``lint
    --policy`` and ``demo --policy`` do (``--policies all`` lists unsupported ones instead).
    ``allowed(name, info)`` exempts what the command can still do here (check's fp8 predictions)."""
    info = detect(device)
    for name in policies:
        support = check_support(name, info)
        if not support and not allowed(name, info):
            hint = f"; try {support.suggestion}" if support.suggestion else ""
            raise UnsupportedError(
                f"{option} names {canonical_name(name)!r}, which is not supported on {info.type}: "
                f"{support.reason}{hint} (drop it, or pass {option} all to list it as unsupported)."
            )


def first_failure(rows: Sequence[BenchRow]) -> UsageError | None:
    """When no candidate produced a figure (every row an error or an out-of-memory), the error that
    says so with the first failure; None when anything ran."""
    measured = [r for r in rows if not r.baseline_repeat]
    failed = [r for r in measured if r.status in (Status.ERROR, Status.OOM)]
    if not measured or len(failed) != len(measured):
        return None
    first = failed[0]
    return UsageError(
        f"every candidate failed ({len(failed)} rows), so nothing was measured; the first, "
        f"{first.label}: {first.status}: {first.reason}"
    )
