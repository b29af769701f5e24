"""One traced forward pass of the workload's real batch: what every module saw and produced.

The trace runs ``workload.loss_fn(model, batch)`` once with the workload's real batch size,
recording for every module the shape, dtype and memory format of its first input and of
its output, and every call of a few functions that matter to the rules (activations,
``binary_cross_entropy``, attention, functional matmuls) together with the innermost module
that made it.

It runs on the ``meta`` device: a copy of the model whose parameters and buffers are meta
tensors (no data is copied), fed the batch moved to meta. Shapes, dtypes and strides
propagate without any arithmetic, so a ResNet-50 batch of 32 at 224 px takes well under a
second on a CPU and nothing of the user's model changes (not even BatchNorm statistics).
Meta convolutions always return NCHW-contiguous outputs, whereas cuDNN and oneDNN return
channels_last when the input or the weight is channels_last: the trace applies that rule
itself. A model whose forward needs real values (``.item()``, data-dependent control flow)
fails on meta; the trace then runs a deep copy eagerly under ``torch.no_grad()`` instead.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.errors import UsageError
from mixprec.workload import Workload
from mixprec.workload.validate import check_loss, checked_batch

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
COMPUTE_TYPES = (nn.Linear, *_CONV_TYPES)

# Every activation the rules know, by the name torch functions and Tensor methods share.
ACTIVATIONS = frozenset(
    {
        "relu",
        "relu_",
        "tanh",
        "tanh_",
        "sigmoid",
        "sigmoid_",
        "elu",
        "elu_",
        "gelu",
        "softplus",
        "silu",
        "leaky_relu",
        "leaky_relu_",
        "relu6",
        "hardtanh",
        "hardtanh_",
        "hardswish",
        "hardsigmoid",
        "mish",
        "selu",
        "selu_",
        "celu",
        "celu_",
        "prelu",
        "rrelu",
        "rrelu_",
        "glu",
        "logsigmoid",
        "softsign",
        "tanhshrink",
        "softshrink",
        "hardshrink",
        "threshold",
        "threshold_",
    }
)
ATTENTION = frozenset({"scaled_dot_product_attention", "multi_head_attention_forward"})
MATMULS = frozenset({"matmul", "__matmul__", "bmm", "mm", "baddbmm", "addmm", "linear"})
LOSSES = frozenset({"binary_cross_entropy"})
_RECORDED = ACTIVATIONS | ATTENTION | MATMULS | LOSSES


@dataclass(frozen=True)
class TensorInfo:
    """Shape, dtype and memory format of one tensor.

    ``memory_format`` is 'channels_last' or 'contiguous' for 4-D/5-D tensors whose layout is
    one of those and not the other, 'either' when both hold (one channel, or 1x1 spatial
    size), and None for other ranks or strided views.
    """

    shape: tuple[int, ...]
    dtype: str
    memory_format: str | None = None

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorInfo:
        return cls(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."), memory_format_of(t))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def channels_last(self) -> bool:
        return self.memory_format == "channels_last"

    @property
    def nchw(self) -> bool:
        return self.memory_format == "contiguous"

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "memory_format": self.memory_format}


def memory_format_of(t: torch.Tensor) -> str | None:
    if t.dim() not in (4, 5):
        return None
    cl_format = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    cl = t.is_contiguous(memory_format=cl_format)
    contiguous = t.is_contiguous()
    if cl and contiguous:
        return "either"
    if cl:
        return "channels_last"
    if contiguous:
        return "contiguous"
    return None


@dataclass
class ModuleRecord:
    """What one module saw on its first call (``calls`` counts them all)."""

    name: str  # qualified name; '' is the model itself
    type: str
    # the user's module, not the traced copy; Any so rules read layer attributes (in_features, groups, ...)
    # as the ints they are rather than through nn.Module.__getattr__'s Tensor | Module
    module: Any = field(repr=False, compare=False)
    order: int  # position of its first call among all module calls
    calls: int = 0
    input: TensorInfo | None = None  # the first tensor argument
    output: TensorInfo | None = None  # the first tensor of the output
    weight: TensorInfo | None = None  # for modules with a ``weight`` parameter
    flops: int = 0  # forward FLOPs over all calls (matmul/conv modules only)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "calls": self.calls,
            "input": self.input.to_dict() if self.input else None,
            "output": self.output.to_dict() if self.output else None,
            "weight": self.weight.to_dict() if self.weight else None,
            "flops": self.flops,
        }


@dataclass
class FunctionCall:
    """One call of a recorded torch function; ``module`` is the innermost module running it
    (None: outside the model, e.g. in the workload's loss function)."""

    name: str
    module: str | None
    args: tuple[TensorInfo, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)  # the scalar keyword arguments
    flops: int = 0


@dataclass
class Trace:
    batch_size: int
    modules: dict[str, ModuleRecord]  # in order of first call
    calls: list[FunctionCall]
    batch: list[TensorInfo]  # the batch's tensors, in order
    output: TensorInfo | None  # the model's output (its first tensor)
    mode: str  # 'meta' or 'eager'
    note: str = ""  # why the meta trace was not used, when it was not
    model_channels_last: bool = False  # the user's model (not the policy's copy) has channels_last convs

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.modules.values()) + sum(c.flops for c in self.calls)

    def of_type(self, *types: type) -> list[ModuleRecord]:
        """Records of the modules that are instances of ``types`` and ran, in execution order."""
        return [r for r in self.modules.values() if r.calls and isinstance(r.module, types)]

    def calls_named(self, names: frozenset[str] | set[str]) -> list[FunctionCall]:
        return [c for c in self.calls if c.name in names]


# --------------------------------------------------------------------------------------------------
# FLOPs of the forward pass (2 per multiply-add, bias ignored)


def _module_flops(module: nn.Module, inp: TensorInfo | None, out: TensorInfo | None) -> int:
    if inp is None or out is None:
        return 0
    if isinstance(module, nn.Linear):
        return 2 * inp.numel * module.out_features
    if isinstance(module, _CONV_TYPES):
        kernel = math.prod(module.kernel_size)
        if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
            return 2 * inp.numel * (module.out_channels // module.groups) * kernel
        return 2 * out.numel * (module.in_channels // module.groups) * kernel
    return 0


def _call_flops(name: str, args: tuple[TensorInfo, ...], kwargs: dict[str, Any]) -> int:
    try:
        if name == "scaled_dot_product_attention" and len(args) >= 3:
            q, k, v = args[:3]
            batch = math.prod(q.shape[:-2])
            return 2 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        if name == "multi_head_attention_forward" and args:
            t, n, e = args[0].shape[:3]
            s = args[1].shape[0] if len(args) > 1 else t
            return 2 * n * (t + 2 * s) * e * e + 4 * n * t * s * e + 2 * n * t * e * e
        if name in ("matmul", "__matmul__", "bmm", "mm") and len(args) >= 2:
            a, b = args[0].shape, args[1].shape
            if len(a) >= 2 and len(b) >= 2:
                batch = max(math.prod(a[:-2]), math.prod(b[:-2]))
                return 2 * batch * a[-2] * a[-1] * b[-1]
        if name in ("baddbmm", "addmm") and len(args) >= 3:
            a, b = args[1].shape, args[2].shape
            return 2 * math.prod(a[:-2] or (1,)) * a[-2] * a[-1] * b[-1]
        if name == "linear" and len(args) >= 2:
            return 2 * args[0].numel * args[1].shape[0]
    except (IndexError, ValueError):
        return 0
    return 0


# --------------------------------------------------------------------------------------------------
# Tracing machinery


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _first_info(value: Any) -> TensorInfo | None:
    """The :class:`TensorInfo` of the first tensor in ``value`` (nested lists, tuples, dicts)."""
    t = next(_tensors(value), None)
    return TensorInfo.of(t) if t is not None else None


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    return value


def _to_channels_last(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if t.is_floating_point() and t.dim() == 5:
        return t.contiguous(memory_format=torch.channels_last_3d)
    return t


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (no data copied).

    Tied parameters stay tied and strides (memory formats) are kept.
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


class _Recorder(TorchFunctionMode):
    """Module hooks plus a torch-function mode: per-module records and recorded function calls."""

    def __init__(self, model: nn.Module, originals: dict[str, nn.Module], *, fix_conv_format: bool) -> None:
        super().__init__()
        self.records: dict[str, ModuleRecord] = {}
        self.calls: list[FunctionCall] = []
        self.output: TensorInfo | None = None
        self._stack: list[str] = []
        self._order = 0
        self._handles: list[Any] = []
        self._fix_conv_format = fix_conv_format
        for name, module in model.named_modules():
            original = originals.get(name, module)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name, original)))
            self._handles.append(module.register_forward_hook(self._post_hook(name)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, name: str, original: nn.Module) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            record = self.records.get(name)
            if record is None:
                record = ModuleRecord(name, type(original).__name__, original, self._order)
                self.records[name] = record
                weight = getattr(module, "weight", None)
                if isinstance(weight, torch.Tensor):
                    record.weight = TensorInfo.of(weight)
            self._order += 1
            if record.input is None:
                record.input = _first_info(args)
            self._stack.append(name)

        return hook

    def _post_hook(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            record = self.records.get(name)
            if record is None:
                return None
            record.calls += 1
            replaced = None
            if self._fix_conv_format and isinstance(module, _CONV_TYPES) and isinstance(output, torch.Tensor):
                replaced = _cudnn_output_format(module, args, output)
                output = replaced if replaced is not None else output
            info = _first_info(output)
            if record.output is None:
                record.output = info
            record.flops += _module_flops(module, _first_info(args), info)
            if name == "":
                self.output = info
            return replaced

        return hook

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _RECORDED:
            infos = tuple(TensorInfo.of(a) for a in args if isinstance(a, torch.Tensor))
            scalars = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))}
            if name == "multi_head_attention_forward" and len(args) > 4:
                scalars["num_heads"] = args[4]
            module = self._stack[-1] if self._stack else None
            call = FunctionCall(name, module, infos, scalars)
            # A Linear/Conv module's own F.linear/F.conv call is already counted by the module.
            inside_compute = module is not None and isinstance(self.records[module].module, COMPUTE_TYPES)
            if not (name == "linear" and inside_compute):
                call.flops = _call_flops(name, infos, scalars)
            self.calls.append(call)
        return func(*args, **kwargs)


def _cudnn_output_format(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """cuDNN/oneDNN return channels_last when the input or the weight is; meta kernels do not."""
    if output.dim() not in (4, 5):
        return None
    fmt = torch.channels_last if output.dim() == 4 else torch.channels_last_3d
    inp = next(_tensors(args), None)
    weight = getattr(module, "weight", None)
    wants = any(isinstance(t, torch.Tensor) and memory_format_of(t) == "channels_last" for t in (inp, weight))
    if wants and not output.is_contiguous(memory_format=fmt):
        return output.contiguous(memory_format=fmt)
    return None


@contextmanager
def _channels_last_inputs(model: nn.Module) -> Iterator[None]:
    """What ``Policy.prepare`` does for channels_last policies: convert the model's 4-D inputs."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _map_tensors(args, _to_channels_last), kwargs

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _model_channels_last(model: nn.Module) -> bool:
    return any(
        isinstance(m, _CONV_TYPES) and memory_format_of(m.weight) == "channels_last" for m in model.modules()
    )


def _half_param_dtype(model: nn.Module) -> torch.dtype | None:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype if p.dtype in (torch.float16, torch.bfloat16) else None
    return None


def _run(
    model: nn.Module,
    originals: dict[str, nn.Module],
    workload: Workload,
    batch: Any,
    *,
    channels_last: bool,
    meta: bool,
) -> tuple[_Recorder, Any]:
    """The recorder of one forward pass, and what ``loss_fn`` returned."""
    recorder = _Recorder(model, originals, fix_conv_format=meta)
    try:
        with torch.no_grad(), recorder:
            if channels_last:
                with _channels_last_inputs(model):
                    loss = workload.loss_fn(model, batch)
            else:
                loss = workload.loss_fn(model, batch)
    finally:
        recorder.remove()
    return recorder, loss


def trace_workload(workload: Workload, batch_size: int, *, channels_last: bool = False) -> Trace:
    """Run one forward pass of ``workload`` on a batch of ``batch_size`` and record it.

    ``channels_last`` traces the model as a channels_last policy would run it (weights and
    4-D inputs converted). The user's model, its buffers and the caller's RNG are unchanged.
    """
    model = workload.model
    originals = dict(model.named_modules())
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        batch = checked_batch(workload, batch_size, device)
        half = _half_param_dtype(model)
        if half is not None:  # a model already cast to half: feed it half inputs, as a *-true policy would
            batch = _map_tensors(batch, lambda t: t.to(half) if t.is_floating_point() else t)
        batch_infos = [TensorInfo.of(t) for t in _tensors(batch)]
        mode, note = "meta", ""
        try:
            traced = meta_copy(model)
            if channels_last:
                traced.to(memory_format=torch.channels_last)
            recorder, loss = _run(
                traced,
                originals,
                workload,
                _map_tensors(batch, lambda t: t.to("meta")),
                channels_last=channels_last,
                meta=True,
            )
        except Exception as exc:  # data-dependent forward: fall back to a real pass on a copy
            mode, note = "eager", f"meta trace failed ({type(exc).__name__}: {exc}); traced eagerly"
            try:
                traced = copy.deepcopy(model)
                if channels_last:
                    traced.to(memory_format=torch.channels_last)
                recorder, loss = _run(
                    traced, originals, workload, batch, channels_last=channels_last, meta=False
                )
            except Exception as exc2:
                raise UsageError(
                    f"lint could not run one forward pass of workload {workload.name!r}: "
                    f"{type(exc2).__name__}: {exc2}. Check that loss_fn(model, make_batch({batch_size}, "
                    f"{str(device)!r})) runs (use --debug for the traceback)."
                ) from exc2
    check_loss(loss, values=False)  # its type and shape; values and gradients are not traced
    return Trace(
        batch_size=batch_size,
        modules=recorder.records,
        calls=recorder.calls,
        batch=batch_infos,
        output=recorder.output,
        mode=mode,
        note=note,
        model_channels_last=_model_channels_last(model),
    )


__all__ = [
    "ACTIVATIONS",
    "ATTENTION",
    "COMPUTE_TYPES",
    "FunctionCall",
    "ModuleRecord",
    "TensorInfo",
    "Trace",
    "memory_format_of",
    "meta_copy",
    "trace_workload",
]
