"""What the commands that train a workload share: its arguments, defaults and progress bar."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mixprec.errors import UnsupportedError, UsageError
from mixprec.hardware.device import DeviceInfo, detect
from mixprec.measure.results import BenchRow
from mixprec.policy import canonical_name, check_support
from mixprec.status import Status
from mixprec.workload.loader import load_workload
from mixprec.workload.zoo import ZOO_NAMES

# Sized so the default sweep (resnet50, every CPU policy, both layouts) ends in about two
# minutes on a 2-core CPU, at a size where compute (not per-op overhead) dominates so the
# ranking means something; on CUDA the seed's setup: 224 px and a batch that fills the GPU.
CPU_DEFAULTS: dict[str, Any] = {"image_size": 128, "batch_size": 16, "steps": 4, "warmup": 1, "min_time": 1.0}
CUDA_DEFAULTS: dict[str, Any] = {
    "image_size": 224,
    "batch_size": 256,
    "steps": 20,
    "warmup": 5,
    "min_time": 2.0,
}


def sweep_progress(console: Console) -> Progress:
    """The progress bar (on stderr) of the commands that measure candidates one by one."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """--model / --workload and the size options, shared by the commands that train a workload."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--model", help=f"built-in model: {', '.join(ZOO_NAMES)} (default: resnet50)")
    group.add_argument("--workload", help="your factory: path/to/file.py:function or package.module:function")
    p.add_argument("--image-size", type=positive_int, help="image side for CNN models")
    p.add_argument("--seq-len", type=positive_int, help="sequence length for the language model")
    p.add_argument("--batch-size", type=positive_int)
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")


def workload_from_args(args: argparse.Namespace, defaults: dict[str, Any]) -> Any:
    sizes = {}
    target = args.workload or args.model or "resnet50"
    if args.image_size:
        sizes["image_size"] = args.image_size
    elif target == "resnet50" and not args.workload and "image_size" in defaults:
        sizes["image_size"] = defaults["image_size"]
    if args.seq_len:
        sizes["seq_len"] = args.seq_len
    return load_workload(target, **sizes)


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
