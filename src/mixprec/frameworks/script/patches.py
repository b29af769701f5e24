"""Every process-wide change the script agent makes to torch, installed and removed in one place.

Each patch hands the call to the agent (:class:`mixprec.frameworks.script.agent.Agent`), which
decides what the script's call does under the candidate; while the agent runs its own code
(:meth:`Agent.internal`) every patch passes the call through unchanged. :meth:`Patches.remove` puts
every original back, so the agent can be installed and removed inside one process (the unit tests do).

What is patched, and why there:

- ``torch.amp.autocast.__init__``: the script's own autocast takes the candidate's dtype (or is off).
- ``torch.amp.GradScaler`` (``__init__``, ``scale``, ``step``): the script's own loss
  scaler is on exactly when the candidate scales the loss; its steps end the script's steps.
- ``torch.autograd.backward``: every backward path (``loss.backward()``, ``backward(gradient)``,
  ``torch.autograd.backward``, the frameworks' ``manual_backward``) goes through it; the loss is
  recorded and, where the candidate scales the loss, scaled here.
- ``torch.autograd.grad`` in a plain loop (a gradient penalty): outside autocast, scaled and
  unscaled where the candidate scales the loss, as the AMP recipe's gradient penalty.
- ``torch.Tensor.grad`` (only where the agent scales the loss): the first read of a gradient after a
  scaled backward unscales its optimizer's gradients, so every clip path (``clip_grad_norm_``,
  ``get_total_norm`` + ``clip_grads_with_norm_``, a hand-written one) and every log sees the true
  gradients, as the AMP recipe's ``unscale_`` before clipping has it.
- ``torch.optim.Optimizer.__init__`` and the global step hooks: a new optimizer names the model.
- ``__init__`` of each torch.optim optimizer that takes ``foreach=``/``fused=`` (Adam, AdamW, SGD,
  ...): it is built with the candidate's implementation, as ``AdamW(..., fused=True)`` builds it.
- gradient accumulation (a plan's ``accumulate`` over 1, :mod:`.accumulation`): ``zero_grad``,
  GradScaler's ``unscale_``/``step``/``update``, ``LRScheduler.step`` and ``clip_grad_norm_``/
  ``clip_grad_value_`` (``torch.nn.utils``'s names, looked up at the call) are held on the
  micro-batches before the last, so they act once per optimizer step.
- ``torch.nn`` global forward pre-hook (armed only between a step's events): the first forward of the
  model in a step, wherever the loop calls it (the root, a part of it, a compiled wrapper); a
  checkpoint's recomputation inside the backward is none.
- ``torch.utils.checkpoint``'s ``_checkpoint_impl`` (every form of checkpoint calls it in torch
  2.14; ``checkpoint`` in a torch without it): a checkpoint the loop calls before the model's first
  forward begins the step's computation, and the candidate's autocast, there: the checkpoint
  records the autocast state its recomputation restores.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

from mixprec.frameworks.torch.probe import in_functorch

Agent = Any  # mixprec.frameworks.script.agent.Agent (which imports this module)

_TENSOR_GRAD: Any = torch._C.TensorBase.__dict__["grad"]  # the C++ property torch.Tensor inherits


def _implemented_classes() -> list[type]:
    """torch.optim's optimizers whose own constructor takes foreach= or fused=."""
    from mixprec.frameworks.torch.implementations import accepted

    return [
        cls
        for cls in vars(torch.optim).values()
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and "__init__" in cls.__dict__
        and accepted(cls)
    ]


class Patches:
    """The agent's patches of torch: :meth:`install` once, :meth:`remove` to put torch back."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._undo: list[Callable[[], None]] = []
        self._forward_hook: Any = None
        self._grad_property = False

    # ------------------------------------------------------------------ bookkeeping
    def replace(self, owner: Any, name: str, new: Any) -> Any:
        """``owner.name = new``; the original is put back by :meth:`remove`. Returns the original."""
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, new)
        self._undo.append(lambda: setattr(owner, name, original))
        return original

    def add(self, undo: Callable[[], None]) -> None:
        """One more change made elsewhere (the sandbox's), undone by :meth:`remove`."""
        self._undo.append(undo)

    def on_exit(self, finish: Callable[[], None]) -> None:
        """``finish()`` before ``os._exit`` too (a script that ends with it skips ``atexit``)."""
        import os

        original = os._exit

        def _exit(code: int) -> None:
            finish()
            original(code)

        self.replace(os, "_exit", _exit)

    def install(self) -> None:
        self._autocast()
        self._grad_scaler()
        self._backward()
        self._optimizer()
        self._constructors()
        self._zero_grad()
        self._checkpoint()
        if self.agent.plan.accumulate > 1:
            self._accumulation()

    def remove(self) -> None:
        self.disarm_forward()
        self.grad_reads(False)
        while self._undo:
            self._undo.pop()()

    # ------------------------------------------------------------------ torch.autocast
    def _autocast(self) -> None:
        from torch.amp import autocast_mode

        cls = autocast_mode.autocast
        init, enter, exit_ = cls.__init__, cls.__enter__, cls.__exit__
        agent = self.agent

        @functools.wraps(init)  # its signature, which torch.compile reads
        def __init__(
            self,
            device_type: str,
            dtype: torch.dtype | None = None,
            enabled: bool = True,
            cache_enabled: bool | None = None,  # (positional too: dynamo passes all four so)
        ):
            script = not agent.internal_calls
            if script and enabled:
                dtype, enabled = agent.own.autocast(device_type, dtype)
            init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            self._mixprec_script = script

        @functools.wraps(enter)
        def __enter__(self):
            if getattr(self, "_mixprec_script", False):
                agent.own.autocast_enters(self)
            return enter(self)

        @functools.wraps(exit_)
        def __exit__(self, *exc: Any):
            try:
                return exit_(self, *exc)
            finally:
                if getattr(self, "_mixprec_script", False):
                    agent.own.autocast_depth -= 1

        for name, new in (("__init__", __init__), ("__enter__", __enter__), ("__exit__", __exit__)):
            self.replace(cls, name, new)

    # ------------------------------------------------------------------ GradScaler
    def _grad_scaler(self) -> None:
        from torch.amp import grad_scaler

        cls = grad_scaler.GradScaler
        init, scale, step = cls.__init__, cls.scale, cls.step
        agent = self.agent
        signature = inspect.signature(init)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kw: Any) -> None:
            bound = signature.bind(self, *args, **kw)
            bound.apply_defaults()
            if not agent.internal_calls:
                bound.arguments["enabled"] = agent.own.scaler(self, bool(bound.arguments["enabled"]))
            init(*bound.args, **bound.kwargs)

        @functools.wraps(scale)
        def scale_(self: Any, outputs: Any) -> Any:
            scaled = scale(self, outputs)
            if not agent.internal_calls and isinstance(outputs, torch.Tensor):
                agent.own.loss_scaled(self, outputs, scaled)
            return scaled

        @functools.wraps(step)
        def step_(self: Any, optimizer: Any, *args: Any, **kw: Any) -> Any:
            if agent.internal_calls:
                return step(self, optimizer, *args, **kw)
            if agent.accumulation.holds_step(optimizer):  # mid-accumulation: unscaled at the last
                return None
            agent.optimizers.starts(optimizer)
            out = step(self, optimizer, *args, **kw)
            agent.own.scaler_stepped(self, optimizer)
            return out

        for name, new in (("__init__", __init__), ("scale", scale_), ("step", step_)):
            self.replace(cls, name, new)

    # ------------------------------------------------------------------ backward
    def _backward(self) -> None:
        agent = self.agent
        original = torch.autograd.backward
        tensor_backward = torch.Tensor.backward

        @functools.wraps(tensor_backward)
        def backward_method(self: torch.Tensor, *args: Any, **kw: Any) -> Any:
            # before Tensor.backward dispatches to a torch function mode (the step tape's): the
            # tape stops recording at the backward, not inside its own dispatch of it
            agent.backward_begins()
            return tensor_backward(self, *args, **kw)

        self.replace(torch.Tensor, "backward", backward_method)

        @functools.wraps(original)
        def backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kw: Any) -> Any:
            # (in_backward: a reentrant checkpoint's own backward of its recomputation, no step's)
            if agent.internal_calls or agent.in_backward or torch._C._get_tracing_state():
                return original(tensors, grad_tensors, *args, **kw)
            return agent.backward(original, tensors, grad_tensors, args, kw)

        self.replace(torch.autograd, "backward", backward)
        self._grad()

    def _grad(self) -> None:
        """``torch.autograd.grad`` in the loop (a gradient penalty's, WGAN-GP's, R1's) runs as the AMP
        recipe's: outside autocast (its double-backward graph took the candidate's dtypes under it),
        and, where the candidate scales the loss, from outputs scaled by the scale, its gradients
        then unscaled (an fp16 backward of small values underflows)."""
        agent, original = self.agent, torch.autograd.grad

        @functools.wraps(original)
        def grad(outputs: Any, inputs: Any, grad_outputs: Any = None, *args: Any, **kw: Any) -> Any:
            # (the loop's thread, where the candidate's autocast is; inside an autocast block of the
            # script's own, it is the script's to say: autocast(enabled=False) around it, say)
            theirs = agent.loop and threading.get_ident() == agent.thread and not agent.own.autocast_depth
            if agent.internal_calls or agent.in_backward or not theirs or _torchs_own(outputs):
                return original(outputs, inputs, grad_outputs, *args, **kw)
            scaler = agent.policy.scaler if agent.routing else None
            was_on = agent.leave_autocast()
            agent.in_backward = True  # (what a checkpoint recomputes in it is no step's forward)
            try:
                if scaler is None:
                    return original(outputs, inputs, grad_outputs, *args, **kw)
                with agent.internal():
                    many = not isinstance(outputs, torch.Tensor)
                    scaled = [scaler.scale(o) for o in outputs] if many else scaler.scale(outputs)
                    unscale = 1.0 / float(scaler.get_scale())
                grads = original(scaled, inputs, grad_outputs, *args, **kw)
                return _times(grads, unscale)
            finally:
                agent.in_backward = False
                if was_on:  # (after the loop's backward, say a norm of its own, it stays off)
                    agent.resume_autocast()

        self.replace(torch.autograd, "grad", grad)

    def _checkpoint(self) -> None:
        agent, module = self.agent, torch.utils.checkpoint
        # torch 2.14 runs every form (checkpoint, checkpoint_sequential, the decorator) through
        # _checkpoint_impl, and torch.compile knows checkpoint itself by identity (its higher-order
        # op): that one is left as it is (patched, it broke the graph at each compiled checkpoint).
        # A torch without _checkpoint_impl: checkpoint.
        impl = hasattr(module, "_checkpoint_impl")
        name = "_checkpoint_impl" if impl else "checkpoint"
        original = getattr(module, name)

        @functools.wraps(original)
        def checkpoint(function: Any = None, *args: Any, **kw: Any) -> Any:
            # before the model's first forward of a step (checkpoint(encoder, x) in the loop,
            # checkpoint_sequential): the computation begins here, where the checkpoint records the
            # autocast state its recomputation restores (it began inside: recomputed in fp32)
            waiting = self._forward_hook is not None and function is not None and not agent.in_backward
            if waiting and not agent.internal_calls and torch.is_grad_enabled():
                if agent.is_model(function):  # (the model or a part, checkpointed whole: its batch)
                    self.disarm_forward()  # (_checkpoint_impl takes the function's arguments as one tuple)
                    agent.first_forward(function, (args[0] if args else ()) if impl else args, whole=True)
                else:  # (a function calling the model: the first module it calls counts the batch)
                    agent.compute_begins()
            return original(function, *args, **kw)

        self.replace(module, name, checkpoint)

    def grad_reads(self, on: bool) -> None:
        """Route every ``.grad`` read through :meth:`Optimizers.reading_grad` (``on``), or stop."""
        if on == self._grad_property:
            return
        self._grad_property = on
        if not on:
            del torch.Tensor.grad
            return
        agent = self.agent

        def get(tensor: torch.Tensor) -> Any:
            grad = _TENSOR_GRAD.__get__(tensor)
            if grad is not None and agent.grads_scaled and not (agent.internal_calls or agent.in_backward):
                agent.optimizers.reading_grad(tensor)  # (unscaled in place: the same tensor)
            return grad

        def set_(tensor: torch.Tensor, value: Any) -> None:
            _TENSOR_GRAD.__set__(tensor, value)

        def delete(tensor: torch.Tensor) -> None:
            _TENSOR_GRAD.__delete__(tensor)

        torch.Tensor.grad = property(get, set_, delete, _TENSOR_GRAD.__doc__)  # type: ignore[assignment]

    # ------------------------------------------------------------------ optimizers
    def _optimizer(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        base = torch.optim.Optimizer
        original = base.__init__
        agent = self.agent

        @functools.wraps(original)
        def __init__(self: torch.optim.Optimizer, *args: Any, **kw: Any) -> None:
            original(self, *args, **kw)
            if not agent.internal_calls:
                agent.optimizers.adopt(self)

        self.replace(base, "__init__", __init__)
        for handle in (
            register_optimizer_step_pre_hook(agent.optimizers.before_step),
            register_optimizer_step_post_hook(agent.optimizers.after_step),
        ):
            self._undo.append(handle.remove)

    def _constructors(self) -> None:
        for cls in _implemented_classes():
            self.replace(cls, "__init__", self._constructor(cls))

    def _constructor(self, cls: type) -> Callable[..., None]:
        """``cls.__init__`` with its arguments bound, so the agent can set foreach=/fused= however the
        script passed them; the constructor it calls itself (AdamW's Adam.__init__) runs as it is."""
        original = cls.__dict__["__init__"]
        signature = inspect.signature(original)
        optimizers = self.agent.optimizers
        agent = self.agent

        @functools.wraps(original)  # its signature, which the implementation table reads
        def __init__(self: torch.optim.Optimizer, *args: Any, **kw: Any) -> None:
            if agent.internal_calls or id(self) in optimizers.building:
                return original(self, *args, **kw)
            bound = signature.bind(self, *args, **kw)
            bound.apply_defaults()
            optimizers.constructing(self, cls, bound.arguments)
            try:
                return original(*bound.args, **bound.kwargs)
            finally:
                optimizers.building.pop(id(self), None)

        return __init__

    def _zero_grad(self) -> None:
        """``zero_grad`` reads every gradient to clear it: not a read that needs them unscaled (a
        GAN's generator clears last step's after the discriminator's scaled backward)."""
        agent = self.agent
        for owner in (torch.optim.Optimizer, torch.nn.Module):
            original = owner.__dict__["zero_grad"]

            def zero_grad(self: Any, *args: Any, _original: Callable = original, **kw: Any) -> Any:
                if not agent.internal_calls and agent.accumulation.holding():
                    return None  # the gradients of the micro-batches so far add up
                with agent.internal():
                    return _original(self, *args, **kw)

            self.replace(owner, "zero_grad", functools.wraps(original)(zero_grad))

    def _accumulation(self) -> None:
        """The calls that end an accumulation early, held on the micro-batches before the last."""
        from torch.amp import grad_scaler
        from torch.nn.utils import clip_grad

        agent = self.agent

        def held(original: Callable, returns: Callable[..., Any] = lambda *a, **k: None) -> Callable:
            @functools.wraps(original)
            def call(*args: Any, **kw: Any) -> Any:
                if agent.internal_calls or not agent.accumulation.holding():
                    return original(*args, **kw)
                return returns(*args, **kw)

            return call

        cls = grad_scaler.GradScaler
        for name in ("unscale_", "update"):
            self.replace(cls, name, held(cls.__dict__[name]))
        scheduler = torch.optim.lr_scheduler.LRScheduler
        self.replace(scheduler, "step", held(scheduler.__dict__["step"]))
        # a clip mid-accumulation clips nothing; what it returns (the norm, logged) is read as is
        norm = held(clip_grad.clip_grad_norm_, _total_norm)
        value = held(clip_grad.clip_grad_value_)
        for module in (torch.nn.utils, clip_grad):
            self.replace(module, "clip_grad_norm_", norm)
            self.replace(module, "clip_grad_value_", value)

    # ------------------------------------------------------------------ the model's forwards
    def arm_forward(self) -> None:
        """Call :meth:`Agent.first_forward` at the next forward of any module (until disarmed)."""
        if self._forward_hook is None:
            self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward)

    def disarm_forward(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _on_forward(self, module: torch.nn.Module, args: tuple) -> None:
        agent = self.agent
        if agent.internal_calls or not torch.is_grad_enabled() or not agent.is_model(module):
            return
        if agent.in_backward:  # (a checkpoint's recomputation of the step's forward)
            return
        self.disarm_forward()
        agent.first_forward(module, args)


def _torchs_own(outputs: Any) -> bool:
    """An ``autograd.grad`` torch calls itself while it transforms the script's code (torch.compile's
    AOTAutograd, on fake tensors; torch.func's grad and vjp), or one of outputs that are no plain
    tensors (a GradientEdge, a tensor subclass): not the script's gradient penalty."""
    if torch.compiler.is_compiling() or in_functorch():
        return True
    many = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return not all(type(o) in (torch.Tensor, torch.nn.Parameter) for o in many)


def _times(grads: Any, factor: float) -> Any:
    """``autograd.grad``'s gradients (a tuple, or a dict for a dict of inputs) times ``factor``."""
    if isinstance(grads, dict):
        return {k: g * factor if g is not None else None for k, g in grads.items()}
    return tuple(g * factor if g is not None else None for g in grads)


def _total_norm(
    parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """What ``clip_grad_norm_`` returns, without clipping: the gradients' total norm."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    return torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
