"""Rich renderables for the terminal. Functions take data and return renderables; callers print."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _yes_no(value: object) -> str:
    return "yes" if value else "no"


def env_report(env: dict[str, Any], policies: list[dict[str, Any]]) -> Group:
    dev = env["device"]
    versions = Table(title="mixprec env", show_header=False, title_justify="left")
    versions.add_column("key", style="bold")
    versions.add_column("value")
    rows: list[tuple[str, object]] = [
        ("mixprec", env["mixprec_version"]),
        ("python", env["python_version"]),
        ("torch", env["torch_version"]),
        ("torch CUDA / cuDNN", f"{env['torch_cuda_version']} / {env['cudnn_version']}"),
        ("CUDA available", _yes_no(env["cuda_available"])),
        ("platform", env["platform"]),
        ("device", f"{dev['type']}: {dev['name']}"),
    ]
    if dev["capability"]:
        rows.append(("compute capability", ".".join(map(str, dev["capability"]))))
    if dev["type"] == "cpu":
        rows.append(("CPU features", ", ".join(dev["cpu_flags"]) or "none of avx512_bf16/avx512_fp16/amx"))
        rows.append(("threads", env["threads"]))
    rows += [
        ("native bf16", _yes_no(dev["native_bf16"])),
        ("native fp16", _yes_no(dev["native_fp16"])),
        ("tf32", _yes_no(dev["tf32"])),
        ("fp8", _yes_no(dev["fp8"])),
    ]
    for key, speed in env.get("format_speeds", {}).items():
        rates = [(op, speed.get(f"{op}_vs_fp32")) for op in ("matmul", "conv")]
        shown = ", ".join(f"{op} {rate:.2f}x" for op, rate in rates if rate is not None)
        rows.append((f"{key} measured (vs fp32)", shown or "not measured"))
    for key, value in env.get("system", {}).items():
        if key != "cpu_info" and value:
            rows.append((key, value))
    for key, value in rows:
        versions.add_row(key, str(value))

    precision = Table(title="effective fp32 precision (per library)", title_justify="left")
    precision.add_column("setting")
    precision.add_column("value")
    for key, value in env["precision_state"].items():
        precision.add_row(key, "unset" if value is None else str(value))

    support = Table(title=f"policies on {dev['type']}", title_justify="left")
    support.add_column("policy", style="bold")
    support.add_column("supported")
    support.add_column("reason")
    support.add_column("suggestion")
    for row in policies:
        ok = Text("yes", style="green") if row["supported"] else Text("no", style="red")
        support.add_row(row["policy"], ok, row["reason"], row["suggestion"] or "")
    return Group(versions, precision, support)


def demo_report(result: Any, baseline: Any, *, chosen_automatically: bool) -> Group:
    how = "chosen as the best supported policy here" if chosen_automatically else "as requested"
    head = Text.assemble(
        ("mixprec demo", "bold"),
        f": trained a 3-layer MLP for {result.steps} steps on {result.device} under ",
        (result.policy, "bold cyan"),
        f" ({how}), next to a strict-fp32 run from the same weights and batches.",
    )
    table = Table(title_justify="left")
    for col in (
        "run",
        "param dtype",
        "compute dtype",
        "first loss",
        "last loss",
        "skipped steps",
        "time (s)",
    ):
        table.add_column(col, justify="right" if col not in ("run",) else "left")
    for r in (baseline, result):
        table.add_row(
            r.policy,
            r.param_dtype,
            r.output_dtype,
            f"{r.losses[0]:.4f}",
            f"{r.losses[-1]:.4f}",
            str(r.stats["skipped_steps"]),
            f"{r.seconds:.2f}",
        )
    rel = abs(result.losses[-1] - baseline.losses[-1]) / max(abs(baseline.losses[-1]), 1e-12)
    tail = Text(
        f"final loss differs from fp32 by {rel:.2%}; loss scale: {result.stats['scale']}. "
        "`mixprec env` lists every policy with the reason it is or is not supported."
    )
    return Group(head, table, tail)


# Sources with more names than this list a sample unless a pattern narrows them down.
MODEL_SAMPLE = 24


def models_report(listings: list[Any], pattern: str | None = None) -> Group:
    """What ``--list-models`` shows: per source, its models (``SOURCE:NAME``) or why it is missing."""
    parts: list[Any] = []
    for listing in listings:
        title = listing.title if not listing.prefix else f"{listing.prefix}: {listing.title}"
        if listing.missing:
            parts.append(Text.assemble((title, "bold"), ("  not available: ", "yellow"), listing.missing))
            continue
        names = [f"{listing.prefix}:{n}" if listing.prefix else n for n in listing.names]
        count = f"{len(names)} of {listing.total}" if pattern else str(listing.total)
        parts.append(Text.assemble((title, "bold"), f"  ({count})"))
        shown = names if pattern or len(names) <= MODEL_SAMPLE else names[:MODEL_SAMPLE]
        if shown:
            parts.append(Text("  " + ", ".join(shown)))
        if len(shown) < len(names):
            parts.append(
                Text(
                    f"  ... and {len(names) - len(shown)} more: --list-models '{listing.prefix}:PATTERN' "
                    "lists the ones matching a glob",
                    style="dim",
                )
            )
    parts.append(
        Text(
            "--model NAME builds one with random weights and synthetic data (nothing is downloaded); "
            "--model-config key=value,... overrides its config.",
            style="dim",
        )
    )
    return Group(*parts)
