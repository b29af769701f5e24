"""What the commands that train a workload share: its arguments, framework, defaults and progress."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import Any

from mixprec.cli.progress import CandidateProgress, sweep_progress
from mixprec.errors import UnsupportedError, UsageError
from mixprec.frameworks import Framework, framework_named, framework_names
from mixprec.hardware.device import DeviceInfo, detect
from mixprec.hardware.formats import slow_formats
from mixprec.measure.results import BenchRow
from mixprec.policy import Candidate, canonical_name
from mixprec.status import Status
from mixprec.workload.models import SOURCES, parse_model_config
from mixprec.workload.zoo import ZOO_NAMES

__all__ = [
    "CandidateProgress",
    "Defaults",
    "add_workload_arguments",
    "first_failure",
    "positive_int",
    "require_supported",
    "sweep_progress",
    "workload_from_args",
]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def threads_arg(text: str) -> int | str:
    """--threads: 'auto' (the fastest count now) or a positive count."""
    return "auto" if text == "auto" else positive_int(text)


THREADS_HELP = (
    "intra-op threads on a CPU: auto (default) times the strict-fp32 step at 1..N threads and measures "
    "at the fastest now (fewer on a busy machine), or a count"
)


def add_batch_arg(p: argparse.ArgumentParser, searched_by: str) -> None:
    """--batch-arg NAME: the script's own batch-size flag, rewritten per micro-batch."""
    p.add_argument(
        "--batch-arg",
        metavar="NAME",
        help=f"with {searched_by} over a script: the flag your script takes its batch size from (batch-size "
        "for python train.py --batch-size 64); each micro-batch runs the script with --NAME rewritten, "
        "gradient accumulation making up the effective batch",
    )


def check_batch_arg(args: argparse.Namespace, option: str, searched: bool) -> None:
    """--batch-arg goes with the micro-batch search (``option``, given: ``searched``) over a script,
    and that search over a script needs it: a one-line UsageError naming the fix otherwise."""
    script = getattr(args, "script", None) is not None
    if args.batch_arg and not searched:
        raise UsageError(f"--batch-arg applies to the micro-batch search; pass {option} too.")
    if script and searched and not args.batch_arg:
        raise UsageError(
            f"{option} over a script needs --batch-arg NAME: the flag your script takes its batch size "
            "from, rewritten for each micro-batch (e.g. --batch-arg batch-size for -- python train.py "
            "--batch-size 64)."
        )


def add_workload_arguments(p: argparse.ArgumentParser, *, verbose: bool = True) -> None:
    """--model / --workload, --model-config, --list-models, the size options and --framework, shared
    by the commands that train a workload (``verbose``: also --verbose, for what child processes print)."""
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
        choices=framework_names(),
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


class Defaults:
    """The framework, device and default sizes of one command: the backend's defaults for the
    command on the device (``Framework.cli_defaults``)."""

    def __init__(self, args: argparse.Namespace, command: str) -> None:
        self.args = args
        if getattr(args, "script", None) is not None:  # the command after --: the script backend
            if args.framework != "torch":
                raise UsageError(
                    f"--framework {args.framework} and a command after '--': your script trains "
                    "with whatever it imports; drop --framework."
                )
            self.framework: Framework = framework_named("script")
        else:
            self.framework = framework_named(args.framework)
        self.device = self.framework.resolve_device(args.device)
        self.values = self.framework.cli_defaults(self.device, command)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def _sized(self) -> str | None:
        """Which size option the defaults set for the model named ('image_size', 'max_image_size')."""
        args = self.args
        return self.framework.sized_by_defaults(args.model, bool(args.workload), self.values)

    def batch_size(self) -> int | None:
        """--batch-size, else the defaults' batch for the models they size (None: the workload's)."""
        if self.args.batch_size:
            return int(self.args.batch_size)
        return self.values.get("batch_size") if self._sized() else None


def workload_from_args(args: argparse.Namespace, defaults: Defaults) -> Any:
    """The source of training steps: the user's command after ``--`` (run unchanged), or the
    workload --model / --workload names, in --framework's terms, with the size options."""
    if getattr(args, "script", None) is not None:
        from mixprec.frameworks.script import ScriptWorkload

        names = ("model", "workload", "model_config", "image_size", "seq_len", "batch_size")
        given = [flag for flag in names if getattr(args, flag, None)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UsageError(
                f"{flag} and a command after '--' both name what to train: your script builds its own "
                f"model; drop {flag}."
            )
        workload = ScriptWorkload.from_command(args.script)
        if getattr(args, "batch_arg", None):
            from mixprec.frameworks.script.batch import batched

            return batched(workload, args.batch_arg)
        return workload
    if getattr(args, "batch_arg", None):
        raise UsageError(
            "--batch-arg names the batch-size flag of your training script: it applies to a command "
            "after '--' (a --model or --workload takes --batch-size)."
        )
    sizes: dict[str, Any] = {}
    target = args.workload or args.model or "resnet50"
    sized = defaults._sized()
    if args.image_size:
        sizes["image_size"] = args.image_size
    elif sized:
        sizes[sized] = defaults.values[sized]
    if args.seq_len:
        sizes["seq_len"] = args.seq_len
    config = parse_model_config(getattr(args, "model_config", None))
    for key in set(config) & set(sizes):
        option = "--" + key.replace("_", "-").removeprefix("max-")
        raise UsageError(f"--model-config sets {key} and so does {option}; keep one of them.")
    return defaults.framework.load_workload(target, **sizes, **config)


def require_supported(
    policies: Sequence[str],
    defaults: Defaults,
    option: str = "--policies",
    allowed: Callable[[Candidate, DeviceInfo], bool] = lambda cand, info: False,
) -> None:
    """Exit 3 before any work when the user named a policy this device cannot run, as ``lint
    --policy`` and ``demo --policy`` do (``--policies all`` lists unsupported ones instead).
    ``allowed(candidate, info)`` exempts what the command can still do here (check's fp8 predictions)."""
    framework = defaults.framework
    info = detect(defaults.device)
    for name in policies:
        cand = Candidate(name, framework=framework.name)
        support = framework.support(cand, info)
        if not support and not allowed(cand, info):
            hint = f"; try {support.suggestion}" if support.suggestion else ""
            raise UnsupportedError(
                f"{option} names {canonical_name(name)!r}, which is not supported on {info.type}: "
                f"{support.reason}{hint} (drop it, or pass {option} all to list it as unsupported)."
            )


def slow_format_warnings(
    policies: Sequence[str], framework: Framework, workload: Any, device: str
) -> list[str]:
    """Warnings for the formats that are slow on this device for ``workload`` (measured: a CPU flag
    is not a fast kernel), to print before a check or a run spends minutes in them."""
    info = detect(device)
    if info.type != "cpu":
        return []
    formats = {name: Candidate(name).spec.peak_key for name in map(canonical_name, policies)}
    return slow_formats(formats, info, conv=framework.has_convolutions(workload))


def first_failure(rows: Sequence[BenchRow]) -> UsageError | None:
    """When no candidate produced a figure (every row an error or an out-of-memory), the error that
    says so with the first failure; None when anything ran."""
    measured = [r for r in rows if not r.baseline_repeat]
    failed = [r for r in measured if r.status in (Status.ERROR, Status.OOM)]
    if not measured or len(failed) != len(measured):
        return None
    first = failed[0]
    if all(r.status == Status.OOM for r in failed):
        tried = re.search(r"(?i)tried to allocate (\d+ bytes|[0-9.]+ ?[KMGT]i?B)", first.reason)
        needed = f" (it tried to allocate {tried.group(1)})" if tried else ""
        return UsageError(
            f"out of memory at batch {first.batch_size} for every candidate{needed}: lower --batch-size, "
            "or find the largest that fits with --batch-sizes and --memory-budget"
        )
    return UsageError(
        f"every candidate failed ({len(failed)} rows), so nothing was measured; the first, "
        f"{first.label}: {first.status}: {first.reason}"
    )
