"""Export a precision policy as ready-to-paste code or configuration for other training stacks.

``export(config, target)`` returns the text for one target, ``export_all(config)`` for all:

- ``mixprec``: the ``get_policy(...)`` call with exactly the non-default options, and the loop.
- ``pytorch``: plain PyTorch without mixprec: fp32_precision knobs, autocast, GradScaler with
  unscale-before-clip and skipped-step accounting, channels_last, half casts, fp32 islands.
- ``lightning``, ``accelerate``, ``deepspeed``, ``fsdp2``, ``hf``: the closest configuration of
  that stack, with comments for what it cannot express (and code that does it instead).

Texts that hold more than one file (``accelerate``: YAML + Python, ``deepspeed``: JSON +
Python) start each file with a ``# --- <file name> ---`` line; :func:`split_sections` splits
them. Everything comes from the policy's own definition (:mod:`mixprec.policy.registry`), so the
exported settings are the ones mixprec measured and verified. Pure text: nothing is imported from
the target stacks and no global state is touched.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass, fields, replace

import torch

from mixprec.errors import MixprecError, UsageError, did_you_mean
from mixprec.policy.policy import Policy, PolicyConfig
from mixprec.policy.registry import PolicySpec, canonical_name
from mixprec.policy.scaler import ScalerOptions

__all__ = ["EXPORT_TARGETS", "export", "export_all", "split_sections"]

EXPORT_TARGETS: tuple[str, ...] = (
    "mixprec",
    "pytorch",
    "lightning",
    "accelerate",
    "deepspeed",
    "fsdp2",
    "hf",
)

_TARGET_ALIASES = {
    "torch": "pytorch",
    "plain": "pytorch",
    "pl": "lightning",
    "pytorch-lightning": "lightning",
    "ds": "deepspeed",
    "fsdp": "fsdp2",
    "fully_shard": "fsdp2",
    "transformers": "hf",
    "huggingface": "hf",
}

_TITLES = {
    "mixprec": "mixprec",
    "pytorch": "plain PyTorch",
    "lightning": "PyTorch Lightning",
    "accelerate": "HF Accelerate",
    "deepspeed": "DeepSpeed",
    "fsdp2": "FSDP2 (fully_shard)",
    "hf": "HF Trainer",
}

_SECTION_PREFIX = "# --- "
_SECTION_SUFFIX = " ---"

# Which fp32_precision knobs matter on which device: cuBLAS/cuDNN on a GPU, oneDNN on a CPU.
_LIBRARIES = {"cuda": ("cuda", "cudnn"), "cpu": ("mkldnn",)}
_DTYPE_CODE = {torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16"}
_DTYPE_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_LIGHTNING_PRECISION = {
    "fp32": "32-true",
    "tf32": "32-true",
    "bf32": "32-true",
    "bf16-mixed": "bf16-mixed",
    "fp16-mixed": "16-mixed",
    "bf16-true": "bf16-true",
    "fp16-true": "16-true",
}
_SCALER_ARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
_EXPECTS = "# Expects: model (nn.Module), loader (iterable of batches), loss_fn(model, batch) -> scalar loss."
_OPTIMIZER = "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # yours; build it after {after}"
_SCHEDULER = "scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)  # yours"


# ------------------------------------------------------------------------------------------ public API
def export(config: PolicyConfig | Policy, target: str) -> str:
    """Ready-to-paste text that applies ``config``'s policy with ``target`` (one of :data:`EXPORT_TARGETS`).

    ``config`` is a :class:`PolicyConfig` (e.g. a recommendation's) or a :class:`Policy`. Raises
    :class:`UsageError` for an unknown target, or a config that names no known policy or device.
    """
    view = _View.of(config)
    return _BUILDERS[_check_target(target)](view)


def export_all(config: PolicyConfig | Policy) -> dict[str, str]:
    """``{target: export(config, target)}`` for every target of :data:`EXPORT_TARGETS`, in that order."""
    view = _View.of(config)
    return {target: _BUILDERS[target](view) for target in EXPORT_TARGETS}


def split_sections(text: str) -> dict[str, str]:
    """Split an exported text at its ``# --- <file name> ---`` lines into ``{file name: content}``.

    What precedes the first marker (the header comments) is returned under ``""``; a text without
    markers is a single section ``{"": text}``.
    """
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        if line.startswith(_SECTION_PREFIX) and line.endswith(_SECTION_SUFFIX) and len(line) > 10:
            current = line[len(_SECTION_PREFIX) : -len(_SECTION_SUFFIX)].strip()
            sections[current] = []
        else:
            sections[current].append(line)
    return {name: "\n".join(lines).strip("\n") + "\n" for name, lines in sections.items()}


def _check_target(target: str) -> str:
    key = target.strip().lower() if isinstance(target, str) else target
    key = _TARGET_ALIASES.get(key, key)
    if key not in EXPORT_TARGETS:
        raise UsageError(
            f"Unknown export target {target!r}; valid: {', '.join(EXPORT_TARGETS)}."
            f"{did_you_mean(str(target), EXPORT_TARGETS)}"
        )
    return key


# ------------------------------------------------------------------------------------------ the policy
@dataclass(frozen=True)
class _View:
    """The facts about one policy config that the exporters need."""

    config: PolicyConfig
    spec: PolicySpec
    device_type: str

    @classmethod
    def of(cls, config: PolicyConfig | Policy) -> _View:
        if isinstance(config, Policy):
            config = config.config
        if not isinstance(config, PolicyConfig):
            raise UsageError(
                f"export() takes a mixprec PolicyConfig or Policy, got {type(config).__name__}; "
                "e.g. mixprec.get_policy('bf16-mixed').config."
            )
        try:
            name = canonical_name(config.name)
        except MixprecError as exc:
            raise UsageError(str(exc)) from exc
        try:
            device_type = torch.device(config.device).type
        except (RuntimeError, TypeError) as exc:
            raise UsageError(f"Policy config has an invalid device {config.device!r}: {exc}") from exc
        if device_type not in _LIBRARIES:
            raise UsageError(
                f"Cannot export for device {config.device!r}; mixprec policies run on "
                f"{', '.join(_LIBRARIES)}."
            )
        config = replace(config, name=name)
        return cls(config, config.spec, device_type)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def mixed(self) -> torch.dtype | None:
        """The autocast dtype of a *-mixed policy."""
        return self.spec.autocast_dtype

    @property
    def true(self) -> torch.dtype | None:
        """The parameter dtype of a *-true policy."""
        return self.spec.param_dtype

    @property
    def low(self) -> torch.dtype | None:
        return self.spec.low_precision_dtype

    @property
    def keep(self) -> list[str]:
        return list(self.config.keep_fp32) if self.low is not None else []

    @property
    def channels_last(self) -> bool:
        return self.config.channels_last

    @property
    def scaler(self) -> ScalerOptions | None:
        if not self.spec.loss_scaling:
            return None
        return self.config.scaler or ScalerOptions()

    @property
    def finite_check(self) -> bool:
        """finite_check that matters: policies with a scaler skip non-finite steps anyway."""
        return self.config.finite_check and self.scaler is None

    @property
    def min_scale(self) -> float | None:
        return None if self.scaler is None else self.scaler.min_scale

    def scaler_changes(self) -> dict[str, object]:
        """Scaler options that differ from mixprec's defaults, in ScalerOptions' field order."""
        if self.scaler is None:
            return {}
        default = ScalerOptions()
        return {
            f.name: getattr(self.scaler, f.name)
            for f in fields(ScalerOptions)
            if getattr(self.scaler, f.name) != getattr(default, f.name)
        }

    def title(self, target: str) -> str:
        extras = []
        if self.channels_last:
            extras.append("channels_last")
        if self.keep:
            extras.append(f"keep_fp32={_py(self.keep)}")
        if self.finite_check:
            extras.append("finite_check")
        extras += [f"{k}={_py(v)}" for k, v in self.scaler_changes().items()]
        what = f"{self.name!r} on {self.device_type}" + (f" ({', '.join(extras)})" if extras else "")
        return f"# mixprec export: policy {what} -> {_TITLES[target]}"


# ------------------------------------------------------------------------------------------ text helpers
def _py(value: object) -> str:
    """A Python literal for ``value``, with double-quoted strings as ruff format writes them."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    return repr(value)


def _json_number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def _comment(text: str, indent: int = 0, width: int = 100) -> list[str]:
    """``text`` as ``# `` comment lines, wrapped at ``width`` columns (indent included)."""
    pad = " " * indent + "# "
    return textwrap.wrap(text, width=width, initial_indent=pad, subsequent_indent=pad, break_on_hyphens=False)


def _notes(notes: list[str]) -> list[str]:
    return [line for note in notes for line in _comment(note)]


def _section(name: str) -> str:
    return f"{_SECTION_PREFIX}{name}{_SECTION_SUFFIX}"


def _indent(lines: list[str], spaces: int) -> list[str]:
    return [" " * spaces + line if line else line for line in lines]


def _text(lines: list[str]) -> str:
    """Join lines; at most two blank lines in a row (PEP 8 around definitions), none at the end."""
    out: list[str] = []
    for line in lines:
        if line == "" and out[-2:] == ["", ""]:
            continue
        out.append(line)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def _imports(*names: str, fnmatch: bool = False) -> list[str]:
    """Import lines in isort order: the standard library, a blank line, third-party packages."""
    std = ["import fnmatch"] if fnmatch else []
    third = sorted(names, key=lambda s: (s.startswith("from "), s.split()[1].lower()))
    return [*std, *([""] if std and third else []), *third]


# ------------------------------------------------------------------------------------------ fp32 math
def _knobs(view: _View) -> list[tuple[str, str, str]]:
    """(backend, op, value) for the fp32_precision knobs that matter on the policy's device."""
    libraries = _LIBRARIES[view.device_type]
    return [
        (backend, op, value)
        for (backend, op), value in view.spec.precision.per_knob().items()
        if backend in libraries
    ]


def _reduced(view: _View) -> bool:
    """True when a knob is set to something other than strict 'ieee'."""
    return any(value != "ieee" for _, _, value in _knobs(view))


def _math_mode(view: _View) -> str:
    values = {value for _, _, value in _knobs(view)}
    if values == {"tf32"}:
        return "TF32 tensor cores for fp32 matmuls and convolutions (cuBLAS, cuDNN)"
    if values == {"bf16"}:
        return "oneDNN fp32 matmuls and convolutions with bf16 internals (bf32)"
    if view.device_type == "cuda":
        what = "strict IEEE fp32 for fp32 matmuls and convolutions (cuDNN convolutions default to TF32)"
    else:
        what = "strict IEEE fp32 for oneDNN fp32 matmuls and convolutions"
    return what + (", also for the ops autocast keeps in fp32" if view.mixed is not None else "")


def _precision_block(view: _View, *, legacy_note: bool = True, indent: int = 0) -> list[str]:
    text = f"fp32 math mode: {_math_mode(view)}."
    if legacy_note:
        text += (
            " This is the torch >= 2.9 fp32_precision API. Do not also use the legacy allow_tf32 flags or"
            " torch.set_float32_matmul_precision(): once both APIs were used, reading either raises"
            " RuntimeError."
        )
        if _reduced(view):
            text += (
                ' With a knob not "ieee", code that reads torch.get_float32_matmul_precision() raises too.'
            )
    knobs = [f'torch.backends.{b}.{op}.fp32_precision = "{value}"' for b, op, value in _knobs(view)]
    return _comment(text, indent) + _indent(knobs, indent)


# ------------------------------------------------------------------------------------------ shared code
_CAST_FLOATING = '''
def cast_floating(value, dtype):
    """Cast the floating-point tensors in value (nested lists, tuples, dicts) to dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value
'''

_TO_CHANNELS_LAST = '''
def to_channels_last(value):
    """4-D floating-point tensors in value (nested lists, tuples) to channels_last."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 4 and value.is_floating_point():
            return value.contiguous(memory_format=torch.channels_last)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(to_channels_last(v) for v in value)
    return value
'''

_KEEP_IN_FP32 = '''
def keep_in_fp32(module, device_type, output_dtype=None):
    """Run module outside autocast with fp32 inputs; cast its outputs to output_dtype if given."""
    if getattr(module, "_fp32_island", False):
        return module
    forward = module.forward

    def fp32_forward(*args, **kwargs):
        with torch.autocast(device_type, enabled=False):
            out = forward(*cast_floating(args, torch.float32), **cast_floating(kwargs, torch.float32))
        return out if output_dtype is None else cast_floating(out, output_dtype)

    module.forward = fp32_forward
    module._fp32_island = True
    return module
'''

_HALF_GRAD_SCALER = '''
class HalfGradScaler(torch.amp.GradScaler):
    """GradScaler that also unscales fp16 gradients (refused by default); fp16-true has only those."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # private GradScaler hook
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
'''


def _helpers(view: _View, *, casts_inputs: bool = True, half_scaler: bool = False) -> list[str]:
    """The helper definitions a snippet needs, with blank lines around them.

    ``casts_inputs``: the snippet casts *-true inputs itself (Lightning's *-true plugins do it).
    """
    blocks = []
    if view.keep or (view.true is not None and casts_inputs):
        blocks.append(_CAST_FLOATING)
    if view.channels_last:
        blocks.append(_TO_CHANNELS_LAST)
    if view.keep:
        blocks.append(_KEEP_IN_FP32)
    if half_scaler and view.true == torch.float16:
        blocks.append(_HALF_GRAD_SCALER)
    lines: list[str] = []
    for block in blocks:
        lines += ["", "", *block.strip("\n").splitlines()]
    return [*lines, "", ""] if lines else [""]


def _prep_lines(view: _View, *, move: bool) -> list[str]:
    """Model preparation in plain PyTorch, in the order Policy.prepare() applies it."""
    lines = ["model = model.to(device_type)"] if move else []
    if view.keep:
        lines += [
            f"KEEP_FP32 = {_py(view.keep)}  # module-name glob patterns, as mixprec's keep_fp32",
            "islands = {",
            "    name: module",
            "    for name, module in model.named_modules()",
            "    if name and any(fnmatch.fnmatchcase(name, p) for p in KEEP_FP32)",
            "}",
        ]
    if view.true is not None:
        short = _DTYPE_SHORT[view.true]
        lines.append(f"model = model.to({_DTYPE_CODE[view.true]})  # {short} weights, no fp32 master copy")
        if view.keep:
            lines += [
                "for module in islands.values():",
                "    module.float()  # fp32 islands keep fp32 weights",
            ]
    if view.channels_last:
        lines.append("model = model.to(memory_format=torch.channels_last)")
    if view.keep:
        back = f", output_dtype={_DTYPE_CODE[view.true]}" if view.true is not None else ""
        lines += [
            "for module in islands.values():",
            f"    keep_in_fp32(module, device_type{back})  # outside autocast, fp32 inputs",
        ]
    if view.true is None and not view.channels_last:
        return lines
    body, what = [], []
    if view.true is not None:
        dtype = _DTYPE_CODE[view.true]
        body.append(f"    args, kwargs = cast_floating(args, {dtype}), cast_floating(kwargs, {dtype})")
        what.append("floating-point inputs to the weights' dtype")
    if view.channels_last:
        body.append("    return to_channels_last(args), kwargs")
        what.append("4-D inputs to channels_last")
    else:
        body.append("    return args, kwargs")
    return [
        *lines,
        "",
        "",
        "def prepare_inputs(module, args, kwargs):",
        f'    """Forward pre-hook: {" and ".join(what)}."""',
        *body,
        "",
        "",
        "model.register_forward_pre_hook(prepare_inputs, with_kwargs=True)",
    ]


def _grad_scaler(view: _View, cls: str, device: str) -> list[str]:
    opts = view.scaler
    assert opts is not None
    return [
        f"scaler = {cls}(",
        f"    {device},",
        *(f"    {name}={_py(getattr(opts, name))}," for name in _SCALER_ARGS),
        ")",
    ]


def _plain_loop(view: _View) -> list[str]:
    """The training loop of the plain-PyTorch and FSDP2 exports."""
    lines: list[str] = []
    opts = view.scaler
    if opts is not None:
        cls = "HalfGradScaler" if view.true == torch.float16 else "torch.amp.GradScaler"
        lines += _grad_scaler(view, cls, "device_type")
    lines.append("for batch in loader:")
    if view.mixed is not None:
        lines += [
            f"    with torch.autocast(device_type, dtype={_DTYPE_CODE[view.mixed]}):",
            "        loss = loss_fn(model, batch)",
        ]
    else:
        lines.append("    loss = loss_fn(model, batch)")
    if opts is not None:
        lines += [
            "    scaler.scale(loss).backward()",
            "    scaler.unscale_(optimizer)  # before clipping: the threshold is for the true gradients",
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
            "    scale = scaler.get_scale()",
            "    scaler.step(optimizer)  # skipped when the gradients hold inf/NaN",
            "    scaler.update()",
            "    skipped = scaler.get_scale() < scale  # it backs off exactly when it skipped the step",
        ]
        if opts.min_scale is not None:
            floor = _py(opts.min_scale)
            lines += [
                f"    if scaler.get_scale() < {floor}:",
                f"        scaler.update({floor})  # min_scale floor: GradScaler has none",
            ]
        lines += ["    if not skipped:", "        scheduler.step()  # a skipped step skips the scheduler too"]
    elif view.finite_check:
        lines += [
            "    loss.backward()",
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
            "    grads = [p.grad for p in model.parameters() if p.grad is not None]",
            "    if all(bool(torch.isfinite(g).all()) for g in grads):  # finite_check: skip inf/NaN steps",
            "        optimizer.step()",
            "        scheduler.step()",
        ]
    else:
        lines += [
            "    loss.backward()",
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
            "    optimizer.step()",
            "    scheduler.step()",
        ]
    lines.append("    optimizer.zero_grad(set_to_none=True)")
    if opts is not None and opts.min_scale is not None:
        lines += _comment(
            f"mixprec also raises ScaleCollapseError after {opts.max_skips_at_min_scale} overflowing steps"
            " in a row at the floor; add such a check if you want that alarm."
        )
    return lines


def _fp16_true_warning(view: _View, stack: str, why: str) -> list[str]:
    if view.true != torch.float16:
        return []
    return _comment(
        f"WARNING: fp16-true (fp16 weights + loss scaling) cannot be expressed with {stack}: {why} Below,"
        " the model trains in fp16 WITHOUT loss scaling (small gradients flush to zero). Prefer the"
        " 'pytorch' or 'mixprec' export for fp16-true, or fp16-mixed here."
    )


_AUTOCAST_SCALER = "is autocast + GradScaler over fp32 weights, and GradScaler refuses fp16 gradients."


# ------------------------------------------------------------------------------------------ mixprec
def _export_mixprec(view: _View) -> str:
    options: dict[str, object] = {}
    if view.channels_last:
        options["channels_last"] = True
    if view.keep:
        options["keep_fp32"] = view.keep
    if view.config.finite_check:  # kept even where a scaler makes it redundant: the call rebuilds the config
        options["finite_check"] = True
    options.update(view.scaler_changes())
    args = [_py(view.name), f"device={_py(view.device_type)}", *(f"{k}={_py(v)}" for k, v in options.items())]
    call = [f"policy = mixprec.get_policy({', '.join(args)})"]
    if len(call[0]) > 100:
        call = ["policy = mixprec.get_policy(", *(f"    {a}," for a in args), ")"]
    lines = [
        view.title("mixprec"),
        _EXPECTS,
        "import torch",
        "",
        "import mixprec",
        "",
        *call,
        "model = policy.prepare(model)  # device, half casts, channels_last, fp32 islands (in place)",
        _OPTIMIZER.format(after="prepare()"),
        _SCHEDULER,
        "with policy.precision_scope():  # the fp32 math mode (TF32 / bf32 / strict), restored on exit",
        "    for batch in loader:",
        "        with policy.autocast():",
        "            loss = loss_fn(model, batch)",
        "        policy.backward(loss)  # scaled when the policy scales the loss",
        "        if policy.step(optimizer, clip_grad_norm=1.0):  # unscale -> clip -> step -> update",
        "            scheduler.step()  # a skipped (non-finite) step skips the scheduler too",
        "        optimizer.zero_grad(set_to_none=True)",
    ]
    if view.scaler is not None or view.finite_check:
        lines.append(
            "# policy.stats.as_dict(): steps, skipped_steps, scale history, last non-finite parameters"
        )
    return _text(lines)


# ------------------------------------------------------------------------------------------ pytorch
def _export_pytorch(view: _View) -> str:
    return _text(
        [
            view.title("pytorch"),
            _EXPECTS,
            *_imports("import torch", fnmatch=bool(view.keep)),
            "",
            f"device_type = {_py(view.device_type)}",
            "",
            *_precision_block(view),
            *_helpers(view, half_scaler=True),
            *_prep_lines(view, move=True),
            "",
            _OPTIMIZER.format(after="the casts"),
            _SCHEDULER,
            *_plain_loop(view),
        ]
    )


# ------------------------------------------------------------------------------------------ lightning
def _export_lightning(view: _View) -> str:
    precision = _LIGHTNING_PRECISION[view.name]
    device = _py(view.device_type)
    custom_scaler = view.mixed == torch.float16 and any(k in view.scaler_changes() for k in _SCALER_ARGS)
    imports = ["import lightning as L", "import torch"]
    if custom_scaler:
        imports.append("from lightning.pytorch.plugins.precision import MixedPrecision")
    lines = [
        view.title("lightning"),
        "# Expects: your LightningModule (add the hooks below to it) and loader.",
        *_fp16_true_warning(
            view, "Lightning", f'precision="16-true" has no loss scaler, and "16-mixed" {_AUTOCAST_SCALER}'
        ),
        *_imports(*imports, fnmatch=bool(view.keep)),
        *_helpers(view, casts_inputs=False),
        "",
        "",
        "class LitModel(L.LightningModule):  # your LightningModule: add these hooks to it",
        "    def setup(self, stage):",
        *_comment(
            "Lightning's own advice is torch.set_float32_matmul_precision(). That is the legacy API: on"
            " torch >= 2.9, once it and the per-library fp32_precision knobs were both used, reading either"
            " raises RuntimeError, and it never reached cuDNN convolutions. So set the new knobs, and here"
            " rather than at import: Lightning reads torch.get_float32_matmul_precision() when it sets up a"
            ' CUDA device, and with torch 2.14 that read raises as soon as a knob is not "ieee".',
            indent=8,
        ),
        *_precision_block(view, legacy_note=False, indent=8),
    ]
    island_match = [
        f"        keep_fp32 = {_py(view.keep)}",
        "        for name, module in self.named_modules():",
        "            if name and any(fnmatch.fnmatchcase(name, p) for p in keep_fp32):",
    ]
    relative = (
        "The patterns name modules of the model you gave mixprec: prefix them if your LightningModule holds"
        " it as an attribute (e.g. 'net.head')."
    )
    if view.channels_last or (view.keep and view.mixed is not None):
        lines += [
            "",
            "    def configure_model(self):  # before Lightning moves the model and wraps it (DDP/FSDP)",
        ]
        if view.channels_last:
            lines.append("        self.to(memory_format=torch.channels_last)")
        if view.keep and view.mixed is not None:
            lines += [
                *_comment(f"keep_fp32: outside Lightning's autocast, with fp32 inputs. {relative}", 8),
                *island_match,
                f"                keep_in_fp32(module, {device})",
            ]
    if view.keep and view.true is not None:
        lines += [
            "",
            f"    def on_fit_start(self):  # after Lightning's {precision} conversion of the whole module",
            *_comment(f"keep_fp32: fp32 weights, outside autocast, outputs cast back. {relative}", 8),
            *island_match,
            f"                keep_in_fp32(module.float(), {device}, output_dtype={_DTYPE_CODE[view.true]})",
        ]
    if view.channels_last:
        lines += [
            "",
            "    def on_after_batch_transfer(self, batch, dataloader_idx):",
            "        return to_channels_last(batch)  # channels_last inputs",
        ]
    lines += ["", ""]
    accelerator = "gpu" if view.device_type == "cuda" else "cpu"
    if custom_scaler:
        lines += [
            *_grad_scaler(view, "torch.amp.GradScaler", device),
            "# A precision plugin instead of precision=...: Lightning refuses both at once.",
            f"plugin = MixedPrecision({_py(precision)}, {device}, scaler=scaler)",
            f'trainer = L.Trainer(accelerator="{accelerator}", plugins=[plugin], gradient_clip_val=1.0)',
        ]
    else:
        flags = f'accelerator="{accelerator}", precision="{precision}", gradient_clip_val=1.0'
        lines.append(f"trainer = L.Trainer({flags})")
    lines.append("trainer.fit(LitModel(), train_dataloaders=loader)")
    notes = []
    if view.mixed == torch.float16:
        notes.append(
            "16-mixed unscales the gradients before gradient_clip_val clips them and skips overflowing"
            " steps; it steps LR schedulers on its own schedule, also after a skipped step."
        )
    if view.min_scale is not None and view.mixed is not None:
        notes.append(
            f"min_scale={_py(view.min_scale)}: not expressible; Lightning's GradScaler has no floor and no"
            " collapse alarm."
        )
    if view.finite_check:
        notes.append(
            "finite_check=True: not expressible; Lightning does not skip steps with non-finite gradients."
        )
    if view.name == "bf32":
        notes.append("bf32: no precision flag; the oneDNN knobs in setup() are what makes it bf32.")
    return _text(lines + _notes(notes))


# ------------------------------------------------------------------------------------------ accelerate
def _export_accelerate(view: _View) -> str:
    mode = _DTYPE_SHORT[view.mixed] if view.mixed is not None else "no"
    yaml = ["mixed_precision: 'no'" if mode == "no" else f"mixed_precision: {mode}"]
    kwargs = [f'mixed_precision="{mode}"']
    if view.device_type == "cpu":
        yaml.append("use_cpu: true")
        kwargs.append("cpu=True")
    imports = ["import torch", "from accelerate import Accelerator"]
    if view.mixed == torch.float16:
        imports.append("from accelerate.utils import GradScalerKwargs")
        opts = view.scaler
        assert opts is not None
        accelerator = [
            "accelerator = Accelerator(",
            *(f"    {k}," for k in kwargs),
            "    kwargs_handlers=[",
            "        GradScalerKwargs(",
            *(f"            {name}={_py(getattr(opts, name))}," for name in _SCALER_ARGS),
            "        )",
            "    ],",
            ")",
        ]
    else:
        accelerator = [f"accelerator = Accelerator({', '.join(kwargs)})"]
    fp16 = view.mixed == torch.float16
    lines = [
        view.title("accelerate"),
        "# Expects: model, loader, loss_fn(model, batch) -> loss. Run with `accelerate launch train.py`.",
        _section("default_config.yaml"),
        *yaml,
        _section("train.py"),
        *_fp16_true_warning(view, "Accelerate", f'mixed_precision="fp16" {_AUTOCAST_SCALER}'),
        *_imports(*imports, fnmatch=bool(view.keep)),
        "",
        f"device_type = {_py(view.device_type)}",
        "",
        *_precision_block(view),
        *_helpers(view),
        *accelerator,
        "# (the Accelerator argument wins over default_config.yaml when both are given)",
        *_prep_lines(view, move=False),
        "",
        _OPTIMIZER.format(after="the casts"),
        _SCHEDULER,
        "model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)",
        "for batch in loader:",
        "    with accelerator.autocast():",
        "        loss = loss_fn(model, batch)",
        "    accelerator.backward(loss)",
        "    accelerator.clip_grad_norm_(model.parameters(), 1.0)"
        + ("  # unscales the fp16 gradients first" if fp16 else ""),
        "    optimizer.step()"
        + ("  # skipped on overflow (accelerator.optimizer_step_was_skipped)" if fp16 else ""),
        "    scheduler.step()"
        + ("  # a prepared scheduler does not step after a skipped step" if fp16 else ""),
        "    optimizer.zero_grad(set_to_none=True)",
    ]
    notes = []
    if view.min_scale is not None and fp16:
        notes.append(
            f"min_scale={_py(view.min_scale)}: not expressible; GradScalerKwargs has no floor and no"
            " collapse alarm."
        )
    if view.finite_check:
        notes.append(
            "finite_check=True: not expressible; Accelerate does not skip steps with non-finite gradients."
        )
    if view.name == "bf32":
        notes.append("bf32: Accelerate has no flag for it; the oneDNN knobs above are what makes it bf32.")
    return _text(lines + _notes(notes))


# ------------------------------------------------------------------------------------------ deepspeed
def _export_deepspeed(view: _View) -> str:
    config: dict[str, object] = {}
    notes: list[str] = []
    opts = view.scaler
    if opts is not None:
        power = math.log2(opts.init_scale)
        fp16: dict[str, object] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": round(power),
            "loss_scale_window": opts.growth_interval,
            "hysteresis": 1,
        }
        if opts.min_scale is not None:
            fp16["min_loss_scale"] = _json_number(opts.min_scale)
        config["fp16"] = fp16
        notes += [
            '"loss_scale": 0 selects dynamic loss scaling; "initial_scale_power" is log2(init_scale),'
            ' "loss_scale_window" is growth_interval, "min_loss_scale" is min_scale.',
            '"hysteresis": 1 because torch.amp.GradScaler (and mixprec) back off on every overflowing step;'
            " DeepSpeed's default 2 keeps the scale on the first overflow and halves it only on the next one,"
            " which is not the scale schedule mixprec verified.",
        ]
        if not float(power).is_integer():
            notes.append(
                f"init_scale={_py(opts.init_scale)} is rounded to 2**{round(power)}:"
                " DeepSpeed takes powers of 2."
            )
        if opts.growth_factor != 2.0 or opts.backoff_factor != 0.5:
            notes.append(
                f"growth_factor={_py(opts.growth_factor)}, backoff_factor={_py(opts.backoff_factor)}: not"
                " expressible; DeepSpeed's loss scaler always doubles and halves."
            )
        if opts.min_scale is None:
            notes.append("min_scale=None: not expressible; DeepSpeed's loss scale always has a floor.")
    elif view.low == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    else:
        config["fp16"] = {"enabled": False}
        config["bf16"] = {"enabled": False}
    config["gradient_clipping"] = 1.0
    if view.low is not None:
        short = _DTYPE_SHORT[view.low]
        notes.append(
            f"DeepSpeed's \"{short}\" mode casts the model's parameters to {short} and keeps fp32 master"
            " weights in the optimizer (apex O2 style); it does not autocast: ops that autocast would keep in"
            f" fp32 (softmax, norms, losses) run in {short} unless your model upcasts them."
        )
        if view.true is not None:
            notes.append(
                f"{view.name}: DeepSpeed keeps that fp32 master copy, so this trains like {view.name} plus"
                " fp32 master weights (more memory than the policy, not less accuracy)."
            )
        if view.keep:
            notes.append(
                f"keep_fp32={_py(view.keep)}: not expressible; DeepSpeed casts every parameter to {short}."
            )
        if view.finite_check:
            notes.append("finite_check=True: no DeepSpeed config key for it.")
    if view.name in ("tf32", "bf32"):
        notes.append(f"{view.name}: no DeepSpeed config key; the fp32_precision knobs in train.py set it.")
    python = [
        *_imports("import deepspeed", "import torch"),
        "",
        *_precision_block(view),
        "",
    ]
    if view.channels_last:
        python.append(
            "model = model.to(memory_format=torch.channels_last)  # and feed channels_last 4-D inputs"
        )
    python += [
        _OPTIMIZER.format(after="the casts"),
        _SCHEDULER,
        "model_engine, optimizer, _, scheduler = deepspeed.initialize(",
        '    model=model, optimizer=optimizer, lr_scheduler=scheduler, config="ds_config.json"',
        ")",
        "for batch in loader:",
    ]
    if view.low is not None:
        short = _DTYPE_SHORT[view.low]
        python.append(
            f"    # DeepSpeed casts the parameters, not the inputs: feed {short} floating-point inputs"
        )
    python += [
        "    loss = loss_fn(model_engine, batch)",
        "    model_engine.backward(loss)" + ("  # scaled by DeepSpeed's loss scaler" if opts else ""),
        "    model_engine.step()  # clips, steps unless it overflowed (then the scheduler too), zeroes grads",
    ]
    lines = [
        view.title("deepspeed"),
        "# Expects: model, loader, loss_fn(model, batch) -> loss. Run with the `deepspeed` launcher.",
        *_notes(notes),
        _section("ds_config.json"),
        json.dumps(config, indent=2),
        _section("train.py"),
        *python,
    ]
    return _text(lines)


# ------------------------------------------------------------------------------------------ fsdp2
def _export_fsdp2(view: _View) -> str:
    if view.device_type == "cuda":
        launch = 'torch.distributed.init_process_group("nccl") and torch.cuda.set_device(local_rank)'
    else:
        launch = 'torch.distributed.init_process_group("gloo")'
    param_dtype = _DTYPE_CODE[view.low] if view.low is not None else "torch.float32"
    notes: list[str] = []
    if view.mixed is not None:
        short = _DTYPE_SHORT[view.mixed]
        notes.append(
            f"param_dtype={short}: FSDP2 all-gathers the parameters in {short} and casts the inputs"
            f" (cast_forward_inputs), so the sharded modules' matmuls run in {short} even without autocast:"
            " for them it replaces autocast. reduce_dtype=fp32 reduce-scatters the gradients in fp32 into the"
            " fp32 sharded master weights. Keep torch.autocast around forward and loss anyway, so that the"
            " ops autocast keeps in fp32 (softmax, norms, losses) stay fp32 as on one device; this is what"
            " mixprec.distributed.shard_model does too."
        )
    elif view.true is not None:
        short = _DTYPE_SHORT[view.true]
        notes.append(
            f"The model is {short} before sharding, so FSDP2 keeps the sharded parameters and the optimizer"
            f" step in {short} (no fp32 master weights, as the policy says); reduce_dtype=fp32 sums the"
            " ranks' gradients in fp32."
        )
    else:
        notes.append(
            "fp32 shards, all-gathers and reduce-scatters; every rank sets the fp32 math mode above."
        )
    if view.scaler is not None:
        notes.append(
            "Loss scaling: the plain torch.amp.GradScaler (for fp16 gradients its subclass above) works on"
            " FSDP2's DTensor gradient shards. DTensor"
            " all-reduces found_inf inside GradScaler's unscale kernel (torch >= 2.5), so every rank skips"
            " the same steps; ShardedGradScaler (made for FSDP1) is not needed."
        )
    lines = [
        view.title("fsdp2"),
        *_comment(f"Under torchrun, after {launch}."),
        "# Expects: model (nn.Module, not sharded yet), loader (this rank's batches), loss_fn(model, batch).",
        *_imports(
            "import torch",
            "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
            fnmatch=bool(view.keep),
        ),
        "",
        f"device_type = {_py(view.device_type)}",
        "",
        *_precision_block(view),
        *_helpers(view, half_scaler=True),
        *_notes(notes),
        f"mp_policy = MixedPrecisionPolicy(param_dtype={param_dtype}, reduce_dtype=torch.float32)",
    ]
    if view.keep:
        lines.append(
            "fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)"
        )
    lines += _prep_lines(view, move=False)
    if view.keep:
        lines += [
            *_comment(
                "fp32 islands: a fully_shard group of their own with the fp32 policy (else the enclosing"
                " group would all-gather their parameters in low precision); deepest first, before their"
                " blocks."
            ),
            'for name in sorted(islands, key=lambda n: -n.count(".")):',
            "    fully_shard(islands[name], mp_policy=fp32_policy)",
        ]
    lines += [
        "for block in model.layers:  # your repeated blocks: transformer layers, ResNet stages, ...",
        "    fully_shard(block, mp_policy=mp_policy)",
        "fully_shard(model, mp_policy=mp_policy)",
        "",
        _OPTIMIZER.format(after="fully_shard"),
        _SCHEDULER,
        *_plain_loop(view),
    ]
    return _text(lines)


# ------------------------------------------------------------------------------------------ hf
def _export_hf(view: _View) -> str:
    flags = ['    output_dir="out",']
    if view.mixed == torch.bfloat16:
        flags.append("    bf16=True,  # autocast(bf16) over fp32 weights")
    elif view.mixed == torch.float16:
        flags.append("    fp16=True,  # autocast(fp16) + GradScaler over fp32 weights")
    clip_note = (
        "  # the Trainer unscales fp16 gradients before clipping" if view.mixed == torch.float16 else ""
    )
    flags.append(f"    max_grad_norm=1.0,{clip_note}")
    if view.device_type == "cpu":
        flags.append("    use_cpu=True,")
    notes: list[str] = []
    if view.mixed == torch.float16:
        changed = {k: v for k, v in view.scaler_changes().items() if k in _SCALER_ARGS}
        if changed:
            shown = ", ".join(f"{k}={_py(v)}" for k, v in changed.items())
            notes.append(f"- {shown}: no TrainingArguments flag; the Trainer's GradScaler uses its defaults.")
        if view.min_scale is not None:
            notes.append(f"- min_scale={_py(view.min_scale)}: GradScaler has no floor and no collapse alarm.")
    if view.keep:
        notes.append(
            f"- keep_fp32={_py(view.keep)}: no flag; keep_in_fp32() above does it, inside the autocast."
        )
    if view.channels_last:
        notes.append("- channels_last: no flag; the model and its inputs are converted above.")
    if view.finite_check:
        notes.append(
            "- finite_check=True: no flag; the Trainer does not skip steps with non-finite gradients."
        )
    if view.name in ("fp32", "tf32", "bf32"):
        notes.append(
            f"- {view.name}: set by the fp32_precision knobs above (tf32=... stays unset, see there)."
        )
    if view.true == torch.bfloat16:
        notes.append("- bf16-true: no flag; the model itself is bf16 (cast above), so bf16=... stays off.")
    lines = [
        view.title("hf"),
        "# Expects: model (nn.Module or PreTrainedModel) and train_dataset.",
        *_fp16_true_warning(view, "the HF Trainer", f"fp16=True {_AUTOCAST_SCALER}"),
        *_imports(
            "import torch", "from transformers import Trainer, TrainingArguments", fnmatch=bool(view.keep)
        ),
        "",
        f"device_type = {_py(view.device_type)}",
        "",
        *_precision_block(view),
        *_comment(
            "TrainingArguments(tf32=...) stays unset on purpose: depending on the transformers release it"
            " sets the legacy allow_tf32 flags (mixing the APIs raises) or only the global"
            " torch.backends.fp32_precision, which does not reach cuDNN convolutions (their own knob"
            ' defaults to "tf32").'
        ),
        *_helpers(view),
        *_prep_lines(view, move=False),
        "",
        "args = TrainingArguments(",
        *flags,
        ")",
        "trainer = Trainer(model=model, args=args, train_dataset=train_dataset)",
        "trainer.train()",
    ]
    if notes:
        lines += ["# Not expressible in TrainingArguments:", *_notes(notes)]
    return _text(lines)


_BUILDERS = {
    "mixprec": _export_mixprec,
    "pytorch": _export_pytorch,
    "lightning": _export_lightning,
    "accelerate": _export_accelerate,
    "deepspeed": _export_deepspeed,
    "fsdp2": _export_fsdp2,
    "hf": _export_hf,
}
