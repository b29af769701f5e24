"""torch's per-layer value ranges, forward and backward, measured on one real training step.

``collect_ranges(model, step)`` hooks every module, runs ``step()`` (forward, returns the loss), runs the
backward itself and reports, for every module that ran, the range of its outputs and of the gradients
flowing back into those outputs, and what each low-precision format would do to them: overflow, underflow
to zero, precision lost as subnormals, and the headroom (in powers of two) left below the format's largest
finite value.

How the backward side is observed
---------------------------------
``nn.Module.register_full_backward_hook`` is *not* used: it wraps module inputs and outputs in a custom
autograd Function, and any in-place op on those tensors then raises (``nn.ReLU(inplace=True)`` after a
BatchNorm, as in every torchvision ResNet, is enough). Instead, nothing in the forward is touched:

* gradients w.r.t. a module's outputs (``grad_output``) come from ``Tensor.register_hook`` on each floating
  output that requires grad. A hook registered before an in-place modification sees the gradient of the
  value as the module produced it, which is what we want.
* gradients w.r.t. a module's inputs (``grad_input``, only used to find the module that *produced* a
  non-finite gradient) come from hooks on autograd graph nodes: after the module's forward, the graph is
  walked from its outputs back to its inputs' gradient edges, visiting only nodes created during this call
  (autograd sequence numbers), and a post-hook is put on every node with an edge into an input. That hook
  sees exactly this module's contribution to the input's gradient, even when the input is shared with
  other consumers (q/k/v projections, residual branches). Gradients w.r.t. parameters are not grad_input.

All hooks only read; none returns a value, so forward outputs and gradients are bitwise what they would be
without them. Every hook (module, tensor and graph-node) is removed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mixprec.numerics.limits import FORMATS
from mixprec.numerics.ranges import DEFAULT_SCALE, LayerRanges, RangeReport
from mixprec.numerics.trend import LayerSeries

__all__ = ["StepRecorder", "collect_ranges"]


# --------------------------------------------------------------------------------------------------------
# collection


def _float_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Floating tensors in a nested tuple/list/dict (each distinct tensor once)."""
    seen: set[int] = set()
    todo = [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            if o.is_floating_point() and id(o) not in seen:
                seen.add(id(o))
                yield o
        elif isinstance(o, dict):
            todo.extend(reversed(list(o.values())))
        elif isinstance(o, (list, tuple)):
            todo.extend(reversed(o))


_get_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)


def _next_sequence_nr() -> int | None:
    """Sequence number the next autograd node created on this thread will get (None: no graph now)."""
    if _get_sequence_nr is not None:
        return int(_get_sequence_nr())
    with torch.enable_grad():  # fallback: create a throwaway node
        node = torch.zeros((), requires_grad=True).mul(1).grad_fn
    return None if node is None else node._sequence_nr() + 1


@dataclass
class _Call:
    """One forward call of one module, while its backward is pending."""

    layer: LayerRanges
    inputs_finite: bool
    input_nodes: set[Any]  # gradient-edge nodes of its inputs, as they were before the call
    marker: int | None  # nodes created during the call have sequence_nr >= marker
    grad_output_nonfinite: bool = False


class RangeCollector:
    def __init__(self, model: nn.Module, light: bool = False, light_format: str | None = None) -> None:
        """``light``: ranges only, for every training step (StepRecorder): no search for the first
        non-finite module (its input checks and autograd-graph walk cost more than the step)."""
        self.model = model
        self.light, self.light_format = light, light_format
        self.layers: dict[int, LayerRanges] = {}
        self.names: dict[int, str] = {id(m): name for name, m in model.named_modules()}
        self.stacks: dict[int, list[_Call]] = {}
        self.next_order = 0
        self.first_forward: str | None = None
        self.first_backward: str | None = None
        self.in_backward = False
        self.module_handles: list[RemovableHandle] = []
        self.graph_handles: list[Any] = []

    def install(self) -> None:
        for _, m in self.model.named_modules():
            if self.light and next(m.children(), None) is not None:
                continue  # a container's output is its last layer's: the layers are enough per step
            self.module_handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.module_handles.append(m.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        for h in (*self.module_handles, *self.graph_handles):
            h.remove()
        self.module_handles.clear()
        self.graph_handles.clear()
        self.stacks.clear()

    def restart(self) -> None:
        """Forget what was recorded and record afresh, the module hooks kept in place."""
        for h in self.graph_handles:
            h.remove()
        self.graph_handles.clear()
        self.layers, self.stacks, self.next_order = {}, {}, 0
        self.first_forward = self.first_backward = None
        self.in_backward = False

    # forward --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        # removed during this very call (a module calls the hooks it had when the call began,
        # and a removed one without its keyword arguments): nothing to record
        if self.in_backward or not self.module_handles:  # in backward: checkpoint recomputation
            return
        key = id(module)
        if key not in self.layers:
            self.layers[key] = LayerRanges(
                name=self.names.get(key, ""), type=type(module).__name__, order=self.next_order
            )
        self.next_order += 1
        if self.light:
            self.stacks.setdefault(key, []).append(_Call(self.layers[key], True, set(), None))
            return
        inputs = list(_float_tensors((args, kwargs)))
        # checked before the call: an in-place module overwrites its input
        finite = self.first_forward is not None or all(bool(torch.isfinite(t).all()) for t in inputs)
        nodes: set[Any] = set()
        for t in inputs:
            if t.requires_grad:
                node = torch.autograd.graph.get_gradient_edge(t).node
                if node is not None:
                    nodes.add(node)
        marker = _next_sequence_nr() if nodes else None
        self.stacks.setdefault(key, []).append(_Call(self.layers[key], finite, nodes, marker))

    @torch.no_grad()
    def _post(self, module: nn.Module, args: tuple, kwargs: Any, output: Any = None) -> None:
        if self.in_backward or not self.module_handles:
            return
        stack = self.stacks.get(id(module))
        if not stack:
            return
        call = stack.pop()
        layer = call.layer
        layer.calls += 1
        outputs = list(_float_tensors(output))
        nonfinite = False
        for t in outputs:
            nonfinite |= layer.forward.update_light(t, None) if self.light else layer.forward.update(t)
        if nonfinite and call.inputs_finite and self.first_forward is None:
            self.first_forward = layer.name
        grad_outputs = [t for t in outputs if t.requires_grad]
        for t in grad_outputs:
            self.graph_handles.append(t.register_hook(self._grad_output_hook(call)))
        if call.marker is not None and grad_outputs:
            self._hook_boundary(call, grad_outputs)

    # backward -------------------------------------------------------------------------------------------

    def _grad_output_hook(self, call: _Call) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            backward = call.layer.backward
            if backward.update_light(grad, self.light_format) if self.light else backward.update(grad):
                call.grad_output_nonfinite = True

        return hook

    def _hook_boundary(self, call: _Call, outputs: list[torch.Tensor]) -> None:
        """Post-hook the nodes created by this call that feed gradients into its inputs."""
        inputs, marker = call.input_nodes, call.marker
        assert marker is not None
        boundary: dict[Any, list[int]] = {}
        visited: set[Any] = set()
        todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node in visited or node in inputs:
                continue  # an output that is an input passed through: grad_input == grad_output
            seq = getattr(node, "_sequence_nr", None)
            if seq is not None and seq() < marker:
                continue  # made before this call (a captured tensor): not this module's work
            visited.add(node)
            for i, (nxt, _) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                if nxt in inputs:
                    boundary.setdefault(node, []).append(i)
                elif nxt not in visited:
                    todo.append(nxt)
        for node, idxs in boundary.items():
            self.graph_handles.append(node.register_hook(self._grad_input_hook(call, idxs)))

    def _grad_input_hook(self, call: _Call, idxs: list[int]) -> Callable[..., None]:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            if self.first_backward is not None or call.grad_output_nonfinite:
                return
            with torch.no_grad():
                for i in idxs:
                    g = grad_inputs[i] if i < len(grad_inputs) else None
                    if isinstance(g, torch.Tensor) and g.is_floating_point() and not bool(g.isfinite().all()):
                        self.first_backward = call.layer.name
                        return

        return hook


def _snapshot_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]:
    out = []
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None:
                out.append((m, name, b, b.detach().clone()))
    return out


@torch.no_grad()
def _restore_buffers(saved: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]) -> None:
    for m, name, original, copy in saved:
        original.copy_(copy)
        if m._buffers.get(name) is not original:
            m._buffers[name] = original


@torch.no_grad()
def _grad_underflow_fp16(grads: list[torch.Tensor], divisor: float, scale: float) -> dict[str, float]:
    """Fractions over ``grads / divisor`` (the unscaled gradients, in fp32)."""
    lim = FORMATS["fp16"]
    half_sub = lim.smallest_subnormal / 2
    nonzero = unscaled = scaled = overflow = 0.0
    for g in grads:
        a = g.detach().to_dense().abs().float()  # abs first: a complex gradient's magnitude
        if divisor != 1.0:
            a = a / divisor
        nz = torch.isfinite(a) & (a != 0)
        c = torch.stack(
            [
                nz.sum(),
                (nz & (a <= half_sub)).sum(),
                (nz & (a <= half_sub / scale)).sum(),
                (a > lim.max_finite / scale).sum(),
            ]
        ).tolist()
        nonzero += c[0]
        unscaled += c[1]
        scaled += c[2]
        overflow += c[3]
    total = float(sum(g.numel() for g in grads))
    return {
        "unscaled": unscaled / nonzero if nonzero else 0.0,
        "scaled": scaled / nonzero if nonzero else 0.0,
        "scale": float(scale),
        "overflow_scaled": overflow / total if total else 0.0,
        "nonzero_elements": nonzero,
    }


def collect_ranges(
    model: nn.Module, step: Callable[[], torch.Tensor], *, loss_scale: float | None = None
) -> RangeReport:
    """Measure per-layer forward/backward ranges over one training step.

    ``step()`` runs the forward (any number of model calls, under autocast if wanted) and returns the
    scalar loss; it must not call ``backward`` itself: ``collect_ranges`` runs ``(loss * loss_scale)
    .backward()`` (plain ``loss.backward()`` without a scale), so the backward ranges are those a
    GradScaler at that scale would see. No optimizer step is taken.

    Side effects: every parameter's ``.grad`` is replaced by this step's gradient, unscaled (divided by
    ``loss_scale``); earlier ``.grad`` values are discarded (restored if the step raises). Buffers changed
    by the forward (BatchNorm running statistics, ``num_batches_tracked``) are restored to their values
    before the call; parameters are not written. Forward outputs and gradients are bitwise those of the
    same step without ``collect_ranges``. Module forwards re-run during backward (activation
    checkpointing) are not measured twice. An error raised by the step or the backward propagates after
    every hook has been removed.

    ``grad_underflow_fp16`` is computed from the unscaled parameter gradients in fp32: ``"unscaled"`` is the
    fraction of finite non-zero elements that would round to zero in fp16, ``"scaled"`` the same after
    multiplying by ``"scale"`` (``loss_scale``, or GradScaler's initial 2**16 when None), and
    ``"overflow_scaled"`` the fraction of all elements that the scale would push past fp16's max.
    """
    if loss_scale is not None and not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale must be a positive finite number, got {loss_scale!r}")
    params = list(dict.fromkeys(p for p in model.parameters()))
    old_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    collector = RangeCollector(model)
    buffers = _snapshot_buffers(model)
    ok = False
    try:
        collector.install()
        loss = step()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("step() must return the scalar loss tensor (and not call backward itself)")
        if not loss.requires_grad:
            raise ValueError("the loss returned by step() does not require grad: nothing to backpropagate")
        loss_value = float(loss.detach().float().reshape(()))
        collector.in_backward = True
        (loss.reshape(()) * loss_scale if loss_scale is not None else loss.reshape(())).backward()
        ok = True
    finally:
        collector.remove()
        _restore_buffers(buffers)
        if not ok:
            for p, g in zip(params, old_grads, strict=True):
                p.grad = g
    grads = [p.grad for p in params if p.grad is not None]
    report = collected_report(collector, grads, loss_scale, loss_value)
    if loss_scale is not None:
        with torch.no_grad():
            for g in grads:
                g.div_(loss_scale)
    return report


def collected_report(
    collector: RangeCollector, grads: list[torch.Tensor], loss_scale: float | None, loss: float | None
) -> RangeReport:
    """What ``collector`` saw over one step, as a report: the layers in forward order, the first
    non-finite module forward and backward, and the fp16 underflow of ``grads`` (scaled by
    ``loss_scale``; GradScaler's initial scale where None). A training script's step is collected
    this way too (:mod:`mixprec.frameworks.script.agent`): its own backward, not ``collect_ranges``'."""
    divisor = 1.0 if loss_scale is None else float(loss_scale)
    underflow = _grad_underflow_fp16(grads, divisor, loss_scale if loss_scale is not None else DEFAULT_SCALE)
    return RangeReport(
        layers=sorted(collector.layers.values(), key=lambda lr: lr.order),
        first_nonfinite_forward=collector.first_forward,
        first_nonfinite_backward=collector.first_backward,
        grad_underflow_fp16=underflow,
        loss=loss,
    )


class StepRecorder:
    """Per-layer ranges of the real training steps, one step at a time: the hooks of
    :func:`collect_ranges` around a step the caller runs itself (forward under the policy, its own
    backward and optimizer step), so the ranges are those of the run being judged, at every step.

    Use: ``with recorder.step(): loss = forward(); recorder.backward_starts(); backward(loss)``,
    then read :attr:`series`. The step's outputs and gradients are bitwise unchanged.
    """

    def __init__(self, model: nn.Module, underflow_format: str | None = None) -> None:
        """``underflow_format``: the low-precision format whose flush-to-zero share of each layer's
        gradients is recorded (the run's; None: not recorded)."""
        self.model = model
        self.underflow_format = underflow_format
        self.series: dict[str, LayerSeries] = {}
        self.steps = 0
        self._collector: RangeCollector | None = None

    @contextlib.contextmanager
    def step(self, loss_scale: float | None) -> Iterator[None]:
        """Record one step; ``loss_scale``: what the loss was multiplied by before backward (the
        gradients are recorded unscaled)."""
        self.begin()
        try:
            yield
        except BaseException:
            self.abandon()
            raise
        self.end(loss_scale)

    def begin(self) -> None:
        """Hook the model: the next forward and backward are recorded (until :meth:`end`)."""
        self.abandon()
        self._collector = RangeCollector(self.model, light=True, light_format=self.underflow_format)
        self._collector.install()

    def abandon(self) -> None:
        """Remove the hooks without recording anything."""
        if self._collector is not None:
            self._collector.remove()
            self._collector = None

    def end(self, loss_scale: float | None) -> None:
        """Remove the hooks and record what they saw as one more step of :attr:`series`."""
        collector = self._collector
        if collector is None:
            return
        self.abandon()
        self._record(collector, loss_scale)

    def next_step(self, loss_scale: float | None) -> None:
        """:meth:`end` then :meth:`begin`, the module hooks kept installed: for a step that ends
        inside a forward of the model (the script agent's), where hooks removed and added again
        would miss that forward's module."""
        collector = self._collector
        if collector is None:
            self.begin()
            return
        self._record(collector, loss_scale)
        collector.restart()

    def _record(self, collector: RangeCollector, loss_scale: float | None) -> None:
        divisor = loss_scale or 1.0
        for layer in collector.layers.values():
            if not layer.name:
                continue  # the root's output is the loss input: its last layer is recorded already
            series = self.series.get(layer.name)
            if series is None:
                series = self.series[layer.name] = LayerSeries(layer.name, layer.type)
                series.forward += [math.nan] * self.steps
                series.backward += [math.nan] * self.steps
                series.underflow += [math.nan] * self.steps if self.underflow_format else []
            series.forward.append(layer.forward.absmax if layer.forward.count else math.nan)
            series.backward.append(layer.backward.absmax / divisor if layer.backward.count else math.nan)
            if self.underflow_format:
                grads = layer.backward
                series.underflow.append(
                    grads.underflow_fraction(self.underflow_format) if grads.count else math.nan
                )
        self.steps += 1
        for series in self.series.values():  # a layer that did not run this step
            kept = (series.forward, series.backward, *([series.underflow] if self.underflow_format else []))
            for values in kept:
                values += [math.nan] * (self.steps - len(values))

    def backward_starts(self) -> None:
        """Module forwards from here on are activation-checkpoint recomputation: not measured twice."""
        if self._collector is not None:
            self._collector.in_backward = True
