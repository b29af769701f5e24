"""The agent mixprec puts into a training script's own process: it finds the model and the
optimizers the script builds, applies a candidate to them, and records or paces the script's steps.

It is imported by the ``sitecustomize`` mixprec puts first on the child's ``PYTHONPATH``
(:mod:`mixprec.frameworks.script.launch`), before the script runs, and reads its :class:`Plan` from
the environment. Nothing is edited in the script; what it does is intercepted where PyTorch and the
frameworks offer a seam (:mod:`.patches` lists each):

- **the model**: when the script builds its first optimizer, the outermost ``nn.Module`` holding most
  of that optimizer's parameters (found once among the live modules; parameters outside every module,
  a learnable temperature, train as the script has them). An optimizer over another model is refused:
  mixprec measures one model.
- **the step**: the first optimizer built (the *lead*) paces the script: a step ends where the lead
  has stepped and the model computes again (its next forward or backward), or the lead steps again.
  Every other optimizer (a Muon/AdamW split, a GAN's discriminator) steps inside it, so a step is the
  same thing under every candidate, as written included. Its time is the wall time between two ends
  (the DataLoader included; synchronised on CUDA), its loss what the script called ``backward`` on
  (the gradient-weighted sum for ``backward(gradient)``), its samples the batch dimension of the
  model's inputs.
- **a plain loop**: the candidate's Policy prepares the model (casts, channels_last, fp32 islands,
  ``Module.compile``); its autocast runs from the model's first forward of a step (wherever the loop
  calls it: the root, one of its parts, a compiled wrapper; in train or eval mode) until the
  ``backward()``; the loss is scaled where the policy scales it, and every read of a gradient after a
  scaled backward sees it unscaled (any clip path, any log); each ``optimizer.step()`` goes through
  the Policy (skipped on non-finite gradients) and the scale is updated once per step.
- **the script's own AMP**: its ``torch.autocast`` and ``GradScaler`` are overridden, never stacked:
  under another candidate an enabled autocast takes the candidate's dtype (or is disabled), a
  GradScaler is enabled exactly when the candidate scales the loss. A script that uses mixprec's own
  ``Policy`` has it built under the candidate.
- **the HF Trainer, Lightning and Accelerate**: their own precision switches
  (``TrainingArguments(bf16=, fp16=)``, ``Trainer(precision=)``, ``Accelerator(mixed_precision=)``),
  set as the export for that framework sets them, patched where the framework reads them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import importlib
import json
import os
import random
import resource
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.frameworks.script.frameworks import MIXPREC, PLAIN, UNKNOWN_FRAMEWORKS, install_import_hooks
from mixprec.frameworks.script.patches import Patches

PLAN_ENV = "MIXPREC_SCRIPT_PLAN"
OWNER_ENV = "MIXPREC_SCRIPT_OWNER"  # the process the plan is for (a spawned DataLoader worker is not)
EXIT_REFUSED = 3  # `mixprec run`: the candidate did not take effect (what the CLI's 3 means)


@dataclasses.dataclass
class Plan:
    """What the parent asks of one run of the script.

    Attributes:
        mode: "measure" (steps paced by the parent over a pipe), "trace" (record ``steps`` steps for
            a numerics check, then stop), "run" (the user's run, to its end).
        candidate: the candidate's dict (:meth:`mixprec.Candidate.to_dict`); ``as_written`` runs the
            script's own precision.
        steps: "trace": the steps to record.
        read_fd / write_fd: "measure": the pipe ends to the parent.
        out: "trace": where the record goes (``torch.save``); "run": the folder for run.json.
        seed: seeds Python's, NumPy's and torch's generators before the script runs (None: the
            script's own randomness, as ``mixprec run`` leaves it).
        perturb: "trace": the initial weights times ``1 + perturb * N(0, 1)`` (the chaos floor).
        ranges: "trace": also the full per-layer ranges of the first step.
        scratch: where the frameworks' output folders go in "measure" and "trace" modes.
        home: "measure"/"trace": the user's folder, which the run's scratch working folder mirrors
            (:mod:`.sandbox`: reads as there, writes never there); None: no sandbox.
        observer: "run": ``module:function`` building an observer of the run from the agent and
            ``observe`` (the monitor's adapter: :mod:`mixprec.monitor.script`), or None.
        observe: the observer's settings (the Monitor's: :class:`mixprec.monitor.MonitorConfig` fields).
    """

    mode: str
    candidate: dict[str, Any]
    steps: int = 0
    read_fd: int | None = None
    write_fd: int | None = None
    out: str | None = None
    seed: int | None = 0
    perturb: float = 0.0
    ranges: bool = False
    scratch: str | None = None
    home: str | None = None
    observer: str | None = None
    observe: dict[str, Any] | None = None

    @classmethod
    def from_env(cls) -> Plan | None:
        path = os.environ.get(PLAN_ENV)
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))


@dataclasses.dataclass
class Window:
    """The script's step in progress (from the end of the last one to the end of this one)."""

    index: int = 0
    started: float | None = None  # perf_counter() where it began (its first forward or backward)
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)  # each backward's, unscaled
    samples: int = 0
    lead_stepped: bool = False  # the lead optimizer stepped (or its GradScaler skipped it)
    skipped: bool = False  # the lead's update was not applied
    backwards: int = 0  # the backward() calls the agent saw
    tape: Any = None  # the step as a program to replay (:mod:`.tape`), where an observer asks for it
    routed: list[tuple[torch.optim.Optimizer, bool]] = dataclasses.field(default_factory=list)


class Agent:
    """One script run under a plan (module docstring). One per process: :func:`install_from_env`."""

    def __init__(self, plan: Plan, *, exit: Callable[[int], None] | None = None) -> None:
        from mixprec.policy import Candidate

        self.plan = plan
        self.candidate = Candidate.from_dict(plan.candidate)
        self.inject = not self.candidate.as_written
        self.framework = PLAIN
        self.framework_flags: dict[str, Any] = {}
        self.model: nn.Module | None = None
        self.policy: Any = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lead: torch.optim.Optimizer | None = None
        self.script_scalers: list[Any] = []
        self.own: dict[str, Any] = {"autocast": [], "scaler": None, "framework": {}}
        self.window = Window()
        self.record: dict[str, Any] = {"steps": [], "facts": {}}
        self.internal_calls = 0  # > 0 while mixprec's own code calls torch (the patches let it be)
        self.script_autocast_depth = 0  # the script's own autocast contexts entered (and not left)
        self.grads_scaled = False  # a backward the agent scaled ran; gradients unscaled on first read
        self.observers: list[Any] = []  # each: discovered(agent), step(agent, loss, skipped), summary()
        self.patches = Patches(self)
        self._exit = exit or _exit
        self._autocast: contextlib.AbstractContextManager[Any] | None = None
        self._model_ids: set[int] = set()
        self._thread: int | None = None
        self._owner: dict[int, torch.optim.Optimizer] = {}  # id(param) -> its optimizer
        self._unscaled: set[int] = set()  # optimizers unscaled since the last scale update
        self._scaled_by_script: set[int] = set()  # tensors the script's own enabled scaler scaled
        self._in_backward = False
        self.taping = False  # record each step as a replayable tape (the monitor's shadow asks for it)
        self._unscaled_loss: dict[int, torch.Tensor] = {}  # id(scaled loss) -> the loss the script scaled
        self._probe: Any = None
        self._tracer: Any = None
        self._nonfinite_at_start: set[str] = set()
        self._widened = False  # a half-precision script's model, widened to fp32 for this candidate
        self._finished = False
        self._pid = os.getpid()
        self._pipe_in: Any = None
        self._pipe_out: Any = None
        self._undo_hooks: Callable[[], None] | None = None
        self._scopes = contextlib.ExitStack()  # the candidate's fp32 math mode, for the whole run

    # ------------------------------------------------------------------ set-up
    def install(self) -> None:
        self._pid = os.getpid()  # (a DataLoader worker forked from the script is not the script)
        if self.plan.seed is not None:
            seed_everything(self.plan.seed)
        if self.plan.mode == "measure":
            assert self.plan.read_fd is not None and self.plan.write_fd is not None
            self._pipe_out = os.fdopen(self.plan.write_fd, "w", buffering=1)
            self._pipe_in = os.fdopen(self.plan.read_fd, "r")
        self.patches.install()
        self._patch_own_policy()
        self._undo_hooks = install_import_hooks(self)
        if self.plan.home and self.plan.mode in ("measure", "trace"):
            from mixprec.frameworks.script import sandbox

            self.patches.add(sandbox.install(self.plan.home, os.getcwd()))
        if self.plan.mode == "run":
            if self.plan.observer:  # built from the top (mixprec run): the monitor sits above this layer
                module, _, name = self.plan.observer.partition(":")
                self.observers.append(
                    getattr(importlib.import_module(module), name)(self, self.plan.observe or {})
                )
            atexit.register(self.finish_run)
            self.patches.on_exit(self.finish_run)

    def uninstall(self) -> None:
        """Put torch back as it was (the in-process tests run a loop under an agent, then this)."""
        self.leave_autocast()
        self._scopes.close()
        self.patches.remove()
        if self._undo_hooks is not None:
            self._undo_hooks()
        with contextlib.suppress(Exception):
            atexit.unregister(self.finish_run)

    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """mixprec's own calls (its Policy's autocast, GradScaler, step): the patches let them be."""
        self.internal_calls += 1
        try:
            yield
        finally:
            self.internal_calls -= 1

    @property
    def loop(self) -> bool:
        """mixprec applies the candidate to the script's own loop (a plain loop, an injected
        candidate): its Policy prepared the model and its autocast wraps forward and loss."""
        return self.inject and self.framework == PLAIN and self.policy is not None

    @property
    def routing(self) -> bool:
        """The script's optimizer steps go through the candidate's Policy (loss scaling, the finite
        check): a plain loop with no enabled GradScaler of its own (one it has does the scaling,
        enabled exactly when the candidate scales the loss with fp32 weights)."""
        return self.loop and not any(s.is_enabled() for s in self.script_scalers)

    def is_model(self, module: nn.Module) -> bool:
        """Whether ``module`` is the model or a part of it (or a compiled wrapper of one)."""
        if id(module) in self._model_ids:
            return True
        inner = getattr(module, "_orig_mod", None)
        return inner is not None and id(inner) in self._model_ids

    # ------------------------------------------------------------------ the script's own precision
    def script_autocast(self, device_type: str, dtype: torch.dtype | None) -> tuple[Any, bool]:
        """An enabled ``torch.autocast`` the script makes: under an injected candidate in a plain
        loop it takes the candidate's dtype (or is disabled)."""
        if self.framework != PLAIN:  # a framework's own autocast: its switch is the precision
            return dtype, True
        self.own["autocast"].append({"device_type": device_type, "dtype": str(dtype)})
        if self.inject:
            wanted = self.candidate.spec.autocast_dtype
            return (wanted if wanted is not None else dtype), wanted is not None
        return dtype, True

    def script_autocast_enters(self, ctx: Any) -> None:
        """The script enters one of its autocast contexts. An outermost disabled one is its AMP
        switched off (``autocast(enabled=use_amp)``): under an injected candidate it runs the
        candidate's autocast; a disabled one inside an autocast is a region the script keeps in fp32."""
        self.script_autocast_depth += 1
        wanted = self.candidate.spec.autocast_dtype
        outermost = self.script_autocast_depth == 1 and not torch.is_autocast_enabled(ctx.device)
        if self.inject and self.framework == PLAIN and wanted is not None and outermost and not ctx._enabled:
            ctx._enabled, ctx.fast_dtype = True, wanted

    def script_scaler(self, scaler: Any, enabled: bool) -> bool:
        """A GradScaler the script makes: enabled exactly when the candidate scales the loss with
        fp32 weights (a *-true candidate's scaling is its Policy's: GradScaler refuses to unscale
        half gradients)."""
        self.own["scaler"] = self.own["scaler"] or enabled
        self.script_scalers.append(scaler)
        if self.inject and self.framework == PLAIN:
            spec = self.candidate.spec
            return spec.loss_scaling and spec.param_dtype is None
        return enabled

    def script_scaled(self, scaler: Any, loss: torch.Tensor, scaled: torch.Tensor) -> None:
        """The script's GradScaler scaled ``loss``: its backward records the loss unscaled."""
        self._unscaled_loss[id(scaled)] = loss
        if scaler.is_enabled():  # a disabled scaler hands the loss back: it is still to scale
            self._scaled_by_script.add(id(scaled))

    def script_scaler_stepped(self, scaler: Any, optimizer: Any) -> None:
        """The script's GradScaler stepped ``optimizer``, or skipped it (inf/NaN gradients: no
        ``optimizer.step()`` ran, so no step hook said it)."""
        if scaler.is_enabled() and _found_inf(scaler, optimizer):
            self.optimizer_stepped(_torch_optimizer(optimizer), skipped=True)

    def _patch_own_policy(self) -> None:
        """A script that builds mixprec's own Policy: built under the candidate (the policy it asked
        for is its precision as written), and it runs the loop's precision itself."""
        from mixprec.policy.policy import Policy

        agent, original = self, Policy.__init__

        def __init__(policy: Any, config: Any) -> None:
            if agent.internal_calls:
                return original(policy, config)
            agent.framework = MIXPREC
            agent.own["framework"] = {"mixprec": config.name}
            if agent.inject:
                from mixprec.policy import get_policy

                with agent.internal():
                    wanted = dataclasses.replace(agent.candidate, framework="torch", as_written=False)
                    config = get_policy(wanted, device=config.device, check=False).config
                agent.framework_flags = {"mixprec": config.name}
            return original(policy, config)

        self.patches.replace(Policy, "__init__", __init__)

    # ------------------------------------------------------------------ optimizers and the model
    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """A new optimizer of the script's: the first names the model; one over another model is refused."""
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if self.model is None:
            owner = find_model(params)
            if owner is None:
                self.fail(
                    "UsageError",
                    "the script's first optimizer holds no parameter of any nn.Module: mixprec measures "
                    "the model an optimizer trains",
                )
            self.model, self.lead = owner, optimizer
            self._thread = threading.get_ident()  # (autocast is per thread: the loop's)
            self._register(optimizer)
            self._discovered()
            return
        owner = find_model(params - {id(p) for p in self.model.parameters()})
        if owner is not None and owner is not self.model and not _inside(owner, self.model):
            self.fail(
                "UsageError",
                f"the script trains a second model ({type(owner).__name__}, beside "
                f"{type(self.model).__name__}) with its own optimizer: mixprec measures one model per "
                "run (put both in one nn.Module, as a GAN's generator and discriminator can be)",
            )
        self._register(optimizer)

    def _register(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizers.append(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._owner[id(p)] = optimizer
        self._wrap_step(optimizer)

    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Route ``optimizer.step()`` through the Policy where the agent injects the loop. A bound
        method, as the optimizer's own is: an LR scheduler made later wraps it through ``__func__``."""
        agent = self
        klass_step = type(optimizer).step

        def step(opt: torch.optim.Optimizer, *args: Any, **kw: Any) -> Any:
            if agent.internal_calls:
                return klass_step(opt, *args, **kw)
            if opt is agent.lead and agent.observers and not args and not kw:
                agent.before_update()
            if not agent.routing:
                return klass_step(opt, *args, **kw)
            return agent.routed_step(opt, klass_step, args, kw)

        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def routed_step(
        self, optimizer: torch.optim.Optimizer, klass_step: Callable, args: tuple, kw: dict
    ) -> Any:
        """The script's ``optimizer.step()`` in an injected plain loop: through the candidate's Policy
        (unscaled where it scales, skipped on inf/NaN gradients); the scale is updated once, when the
        step ends."""
        self.leave_autocast()
        closure = kw.get("closure", args[0] if args else None)
        if closure is not None:
            if self.policy.scaler is not None:
                self.fail(
                    "UnsupportedError",
                    f"optimizer.step(closure) ({type(optimizer).__name__}) under {self.candidate.policy}: "
                    "a closure re-evaluates the loss inside the step, where loss scaling cannot reach it "
                    "(GradScaler refuses closures); use a *-mixed policy without loss scaling (bf16-mixed)",
                )
            # the closure's forward and backward are seen as any; the step is the optimizer's own
            return klass_step(optimizer, *args, **kw)
        from mixprec.errors import MixprecError

        self.optimizer_starts(optimizer)
        if self.policy.scaler is not None and not self.window.backwards:
            self.fail("UnsupportedError", self._no_backward(optimizer))
        with self.internal():
            try:
                found = self.policy.step_optimizers([optimizer])[0]
            except MixprecError as exc:
                self.fail(type(exc).__name__, f"the script's {type(optimizer).__name__}.step(): {exc}")
        self.window.routed.append((optimizer, found))
        self._unscaled.add(id(optimizer))  # (stepped: its gradients are not read scaled again)
        self.optimizer_stepped(optimizer, skipped=found)
        return None

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Every optimizer step's pre-hook (the script's, or the Policy's for a routed step)."""
        if optimizer is not self.lead:
            return
        if not self.internal_calls:
            self.optimizer_starts(optimizer)
        if self._tracer is not None:
            half = self.inject and self.candidate.spec.param_dtype is not None
            self._tracer.before_update(self._scale(), half)

    def before_update(self) -> None:
        """The lead optimizer is about to step (called before its step runs, outside the optimizer's
        own hooks, which an observer may register): the observers see the step's loss and batch."""
        if self.window.lead_stepped:
            self.boundary()
            self.window.started = time.perf_counter()
        for observer in self.observers:
            with self.internal():
                observer.before_update(self)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.internal_calls:
            self.optimizer_stepped(optimizer, skipped=False)

    def optimizer_starts(self, optimizer: Any) -> None:
        """The lead steps again with no forward or backward since: the last step ends here."""
        if optimizer is self.lead and self.window.lead_stepped:
            self.boundary()
            self.window.started = time.perf_counter()

    def optimizer_stepped(self, optimizer: Any, skipped: bool) -> None:
        if optimizer is self.lead:
            self.window.lead_stepped = True
            self.window.skipped |= skipped
            self.patches.arm_forward()  # the model's next forward ends the step

    def _discovered(self) -> None:
        """The model is known: apply the candidate (plain loop), hook its forward, report its facts."""
        from mixprec.errors import MixprecError

        model = self.model
        assert model is not None
        device = _device_of(model)
        facts = self.record["facts"]
        facts["param_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        facts["strict_math"] = _strict_math(device)  # (the script's own, before the candidate's)
        self._nonfinite_at_start = _nonfinite_buffers(model)
        try:
            self._apply_candidate(model, device)
        except MixprecError as exc:
            self.fail(type(exc).__name__, str(exc))
        if self.plan.perturb:
            perturb_weights(model, self.plan.perturb)
        model.register_forward_pre_hook(self._root_forward, with_kwargs=True)
        model.register_forward_hook(self._root_output)
        if self.plan.mode == "trace":
            compiled = bool(self.candidate.compile) and self.inject
            self._tracer = _tracer(model, self.candidate.spec.range_format, compiled, self.plan.ranges)
        if self.inject or self.plan.mode != "run":  # which dtype the first matmul/conv computed in
            from mixprec.frameworks.torch.probe import FirstComputeLayer

            keep = self.candidate.keep_fp32 if self.inject else ()
            self._probe = FirstComputeLayer(model, keep, training_only=True)
        self._model_ids = {id(m) for m in model.modules()}
        for observer in self.observers:
            with self.internal():
                observer.discovered(self)
        facts.update(
            model=type(model).__name__,
            device=str(device),
            modules=[(n, type(m).__name__) for n, m in model.named_modules() if n],
            params=[n for n, _ in model.named_parameters()],
        )
        self.patches.arm_forward()

    def _apply_candidate(self, model: nn.Module, device: torch.device) -> None:
        """The candidate on the model: its Policy in a plain loop; the fp32 math mode where a
        framework's switch holds the dtypes."""
        if not self.inject:
            return
        if self.framework != PLAIN:
            from mixprec import state

            self._scopes.enter_context(state.precision_settings(self.candidate.spec.precision))
            return
        from mixprec.policy import get_policy

        with self.internal():  # the script's model is a torch model: the torch candidate's Policy
            torch_candidate = dataclasses.replace(self.candidate, framework="torch", as_written=False)
            self.policy = get_policy(torch_candidate, device=device)
            if self.candidate.spec.param_dtype is None and _half_parameters(model):
                # a script that trains half weights itself (model.to(torch.bfloat16)): fp32 master
                # weights for this candidate (exact), and its half inputs widened to meet them
                model._apply(lambda t: t.float() if t.is_floating_point() else t)
                from mixprec.policy.hooks import cast_inputs

                model.register_forward_pre_hook(cast_inputs(torch.float32), with_kwargs=True)
                self._widened = True
            self._scopes.enter_context(self.policy.precision_scope())  # as a script sets them
            self.policy.prepare(model)
            if self.candidate.compile:  # the forward only: mixprec's hooks on the model stay eager
                model.forward = torch.compile(model.forward, mode=self.candidate.compile)

    # ------------------------------------------------------------------ forwards
    def first_forward(self, module: nn.Module, args: tuple) -> None:
        """The model's first forward since the step's last event (the global pre-hook): the last
        step ends if the lead has stepped, and the candidate's autocast begins."""
        if self.window.lead_stepped:
            self.boundary()
        if self.window.started is None:
            self.window.started = time.perf_counter()
        if module is not self.model:  # (the root counts its own samples: _root_forward)
            self.window.samples += _batch_size(args, {})
        if self.loop and self._autocast is None and threading.get_ident() == self._thread:
            # the script's own autocast (overridden to the candidate's) governs where it has one;
            # a *-true candidate's half default dtype is mixprec's alone
            device_type = self.policy.device.type
            half_default = self.candidate.spec.autocast_dtype is None
            if half_default or (
                not self.script_autocast_depth and not torch.is_autocast_enabled(device_type)
            ):
                ctx = self.policy.autocast()
                with self.internal():
                    ctx.__enter__()
                self._autocast = ctx

    def _root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or self.internal_calls:
            return
        self.window.samples += _batch_size(args, kwargs)
        for observer in self.observers:
            observer.forward(self, args, kwargs)
        if self.taping and self.loop:
            if self.window.tape is None:
                from mixprec.frameworks.script.tape import StepTape

                self.window.tape = StepTape()
            self.window.tape.model_call(args, kwargs)

    def _root_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled() or self.internal_calls:
            return
        if self._tracer is not None:
            self._tracer.forward_output(output)
        if self.window.tape is not None:
            self.window.tape.model_output(output)

    def leave_autocast(self) -> None:
        if self._autocast is not None:
            ctx, self._autocast = self._autocast, None
            ctx.__exit__(None, None, None)

    # ------------------------------------------------------------------ backward
    def backward_begins(self) -> None:
        """``Tensor.backward()`` is called: the step's tape stops recording before it dispatches."""
        if self.window.tape is not None and not self.internal_calls:
            self.window.tape.pause()

    def backward(self, original: Callable, tensors: Any, grad_tensors: Any, args: tuple, kw: dict) -> Any:
        """Every backward of the script (``torch.autograd.backward``): autocast ends, the loss is
        recorded, and scaled where the candidate's Policy scales it."""
        self.leave_autocast()  # backward runs outside autocast, as the AMP recipe has it
        if self.window.lead_stepped:  # (a loop that calls model.forward() itself: no forward hook)
            self.boundary()
        if self.window.started is None:
            self.window.started = time.perf_counter()
        self.patches.arm_forward()  # the next micro-batch's forward: autocast again
        self.window.backwards += 1
        outputs = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grads = _as_grads(grad_tensors, len(outputs))
        losses = [
            self._unscaled_loss.get(id(out), out) for out in outputs
        ]  # (the script's scaler's: unscaled)
        if self.window.tape is not None:
            tape = self.window.tape
            tape.backward(losses)
            if any(g is not None for g in grads):
                tape.broken = tape.broken or "backward(gradient): the tape replays a scalar loss"
        for loss, grad in zip(losses, grads, strict=True):
            if grad is None:
                self.window.losses.append(loss.detach())
            else:  # a per-sample loss and its weights: the objective whose gradient is taken
                self.window.losses.append((loss.detach().float() * grad.detach().float()).sum())
        scale = None
        if self.routing and self.policy.scaler is not None:
            with self.internal():
                outputs = tuple(self.policy.scaler.scale(out) for out in outputs)
                scale = float(self.policy.scaler.get_scale())
            self.grads_scaled = True
            self.patches.grad_reads(True)
        elif any(id(out) in self._scaled_by_script for out in outputs):
            scale = self._scale_after()
        if self._tracer is not None:
            self._tracer.backward_starts(scale)
        self._in_backward = True
        try:
            return original(outputs if len(outputs) > 1 else outputs[0], grad_tensors, *args, **kw)
        finally:
            self._in_backward = False

    def reading_grad(self, tensor: torch.Tensor) -> None:
        """A gradient is read after a scaled backward (a clip, a norm, a log): its optimizer's
        gradients are unscaled first, once per step, as ``GradScaler.unscale_`` before clipping."""
        if self._in_backward:
            return
        optimizer = self._owner.get(id(tensor))
        if optimizer is None or id(optimizer) in self._unscaled:
            return
        self._unscaled.add(id(optimizer))
        with self.internal():
            self.policy.scaler.unscale_(optimizer)

    # ------------------------------------------------------------------ the step boundary
    def boundary(self) -> None:
        """The script's step ended: the scale updated once for what was routed, the step recorded,
        reported to the parent (measure) or the observers (run), the run stopped where the plan ends."""
        from mixprec.errors import MixprecError

        window = self.window
        self.leave_autocast()
        if window.tape is not None:
            window.tape.pause()
        if not window.backwards and self.plan.mode != "run":
            self.fail("UnsupportedError", self._no_backward(self.lead))
        skipped = window.skipped
        if window.routed:
            found = [f for _, f in window.routed]
            with self.internal():
                try:
                    self.policy.end_step([o for o, _ in window.routed], found)
                except MixprecError as exc:  # persistent skips, a collapsed scale: the candidate fails
                    self.fail(type(exc).__name__, str(exc))
            skipped = skipped or any(found)
        self._unscaled.clear()
        self.grads_scaled = False
        device = _device_of(self.model)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        loss = torch.stack([x.float().reshape(()) for x in window.losses]).sum() if window.losses else None
        event: dict[str, Any] = {
            "event": "step",
            "index": window.index,
            "seconds": now - (window.started or now),
            "samples": window.samples,
            "skipped": skipped,
        }
        self.window = Window(index=window.index + 1)
        self._scaled_by_script, self._unscaled_loss = set(), {}
        if self._probe is not None:
            self._finish_probe()
        if self.plan.mode == "run":
            for observer in self.observers:
                with self.internal():
                    stop = observer.step(self, loss, skipped)
                if stop:  # the observer gave up on the run: stop it, with the record
                    self.stop_run(stop, 4)
        else:
            event["loss"] = float(loss) if loss is not None else float("nan")
        self.record["steps"].append(event)
        if self._tracer is not None:
            self._tracer.end_step(event, skipped, self._scale_after())
        if self.plan.mode == "measure":
            self._pace(event)
        elif self.plan.mode == "trace" and window.index + 1 >= self.plan.steps:
            self._write_trace()
            self._exit(0)

    def _no_backward(self, optimizer: Any) -> str:
        return (
            f"the script's {type(optimizer).__name__} stepped with no backward() mixprec saw: its "
            "gradients come from elsewhere (torch.func.grad, torch.autograd.grad), where mixprec can "
            f"read no loss to compare{' nor scale one' if self.policy and self.policy.scaler else ''}; "
            "compute them with loss.backward() to have the script measured and checked"
        )

    def _pace(self, event: dict[str, Any]) -> None:
        """Measure mode: report the step, then wait for the parent's next word."""
        if event["index"] == 0:
            self.send({"event": "ready", "facts": self.facts()})
        self.send(event)
        line = self._pipe_in.readline()
        command = json.loads(line) if line else {"cmd": "stop"}
        if command["cmd"] == "stop":
            self.send({"event": "done", "measurement": self.measurement()})
            self._exit(0)

    def _finish_probe(self) -> None:
        """After the first step: the dtype its first matmul/conv computed in. ``mixprec run`` stops a
        run whose candidate did not take effect (fp32 training is never called bf16)."""
        probe, self._probe = self._probe, None
        probe.remove()
        observed = str(probe.dtype).removeprefix("torch.") if probe.dtype else None
        self.record["observed"] = {"observed_layer": probe.name, "observed_dtype": observed}
        if self.plan.mode != "run" or not self.inject or observed is None:
            return
        expected = self.expected_dtype()
        computed = sorted(str(d).removeprefix("torch.") for d in probe.dtypes)
        if expected not in computed:  # (a layer the model keeps in fp32 on purpose is not this)
            self.stop_run(
                f"labelled {self.candidate.label} but no matmul/conv layer of the script's first step "
                f"computed in {expected} (they computed in {', '.join(computed)}; the first was "
                f"{probe.name!r}): the candidate did not take effect in {self.framework_title()}, so the "
                "run is stopped rather than trained in another precision than the one named",
                EXIT_REFUSED,
            )

    def expected_dtype(self) -> str:
        from mixprec.policy import get_policy

        with self.internal():
            wanted = dataclasses.replace(self.candidate, framework="torch", as_written=False)
            policy = get_policy(wanted, device=str(_device_of(self.model)), check=False)
        return str(policy.compute_dtype).removeprefix("torch.")

    def framework_title(self) -> str:
        from mixprec.frameworks.script.workload import TRAINED_BY

        return TRAINED_BY.get(self.framework, self.framework)

    # ------------------------------------------------------------------ what the parent reads
    def facts(self) -> dict[str, Any]:
        facts = dict(self.record["facts"])
        facts.update(framework=self.framework, framework_flags=self.framework_flags, own=self.own)
        # only where the script's own loop trains: a known framework imports some of these itself
        # (transformers imports deepspeed where it is installed), and its switches are the ones set
        unknown = [name for name in UNKNOWN_FRAMEWORKS if name in sys.modules]
        facts["unknown_frameworks"] = unknown if self.framework == PLAIN else []
        facts["samples_per_step"] = self.record["steps"][0]["samples"] if self.record["steps"] else None
        facts["widened"] = self._widened
        return facts

    def measurement(self) -> dict[str, Any]:
        device = _device_of(self.model)
        if device.type == "cuda":
            peak, method = int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
        else:  # ru_maxrss is KiB on Linux
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            method = "peak RSS of the script's process (the data, the interpreter and the libraries too)"
        out: dict[str, Any] = {"peak_memory_bytes": peak, "memory_method": method}
        out["skipped_steps"] = sum(1 for s in self.record["steps"] if s["skipped"])
        out.update(self.record.get("observed", {}))
        return out

    def send(self, event: dict[str, Any]) -> None:
        self._pipe_out.write(json.dumps(event, default=str) + "\n")
        self._pipe_out.flush()

    def fail(self, kind: str, message: str) -> None:
        """Stop the script with mixprec's reason: to the parent (the pipe, the trace record, the run
        record, whichever the mode has), then exit 2."""
        if self._pipe_out is not None:
            self.send({"event": "error", "type": kind, "message": message})
        if self.plan.mode == "trace" and self.plan.out:
            torch.save({"error": f"{kind}: {message}", "facts": self.facts()}, self.plan.out)
        if self.plan.mode == "run":
            self.stop_run(message, 2)
        print(f"mixprec: {message}", file=sys.stderr, flush=True)
        self._exit(2)

    def _write_trace(self) -> None:
        assert self.plan.out
        data = {
            "steps": self.record["steps"],
            "facts": self.facts(),
            "observed": self.record.get("observed", {}),
        }
        if self._tracer is not None:
            data.update(self._tracer.record(self._nonfinite_at_start))
        torch.save(data, self.plan.out)

    def _scale(self) -> float | None:
        """The loss scale the lead's gradients carry now (None: none, or already unscaled: by a read
        of them, or by GradScaler.step itself before it steps)."""
        scalers = [self.policy.scaler] if self.routing and self.policy.scaler is not None else []
        scalers += [s for s in self.script_scalers if s.is_enabled()]
        if not scalers:
            return None
        return None if _unscaled(scalers[0], self.lead) else float(scalers[0].get_scale())

    def _scale_after(self) -> float | None:
        if self.routing and self.policy.scaler is not None:
            return float(self.policy.scaler.get_scale())
        enabled = [s for s in self.script_scalers if s.is_enabled()]
        return float(enabled[0].get_scale()) if enabled else None

    # ------------------------------------------------------------------ run mode (mixprec run)
    def finish_run(self) -> None:
        """Run mode, at the script's exit: its last step ends, and ``run.json`` is written."""
        if self._finished or self.plan.mode != "run" or os.getpid() != self._pid:
            return
        self._finished = True
        if self.window.lead_stepped:
            self.boundary()
        self.write_run()

    def stop_run(self, why: str, code: int) -> None:
        """Run mode: end the run now with ``why`` in its record (the CLI prints it), exit ``code``."""
        self._finished = True
        self.write_run(error=why)
        self._exit(code)

    def write_run(self, error: str | None = None) -> None:
        """Run mode: ``run.json`` in the plan's folder: the candidate, the facts, the step times and
        each observer's summary (the monitor's losses, findings, health)."""
        if not self.plan.out:
            return
        from pathlib import Path

        out = Path(self.plan.out)
        out.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {
            "candidate": self.candidate.to_dict(),
            "facts": self.facts(),
            "pid": os.getpid(),
        }
        data["steps"] = len(self.record["steps"])
        data["step_seconds"] = [s["seconds"] for s in self.record["steps"]]
        data["observed"] = self.record.get("observed", {})
        if error is not None:
            data["error"] = error
        for observer in self.observers:
            with self.internal():
                data.update(observer.summary())
        (out / "run.json").write_text(json.dumps(data, indent=1, default=str))


# ---------------------------------------------------------------------- helpers
def seed_everything(seed: int) -> None:
    """The same random numbers for every candidate's run (the script may seed again itself)."""
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


def find_model(params: set[int]) -> nn.Module | None:
    """The outermost live ``nn.Module`` holding most of the parameters in ``params`` (ids; those of
    no module, a bare ``nn.Parameter``, are the script's own), or None when no module holds any."""
    with warnings.catch_warnings():  # isinstance() on every live object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if isinstance(o, nn.Module)]
    children = {id(c) for m in modules for c in m.children()}
    best: tuple[int, int] | None = None
    model = None
    for root in modules:
        if id(root) in children:
            continue
        own = [id(p) for p in root.parameters()]
        held = len(params.intersection(own))
        # most of the optimizer's parameters; among equals, the smallest module holding them
        if held and (best is None or (held, -len(own)) > best):
            best, model = (held, -len(own)), root
    inner = getattr(model, "_orig_mod", None)  # a torch.compile wrapper: the model it compiles
    return inner if isinstance(inner, nn.Module) else model


def _strict_math(device: torch.device) -> bool:
    """Whether the fp32 math mode on ``device`` is strict IEEE now (what the strict-fp32 baseline
    sets), read before any candidate's is set: the script's own choice, or the default."""
    from mixprec import state
    from mixprec.policy.registry import POLICIES

    prefixes = ("mkldnn.",) if device.type == "cpu" else ("cuda.", "cudnn.")
    now = state.effective_state()
    with state.precision_settings(POLICIES["fp32"].precision):
        strict = state.effective_state()
    return all(now[k] == v for k, v in strict.items() if k.startswith(prefixes))


def _inside(module: nn.Module, model: nn.Module) -> bool:
    return any(m is module for m in model.modules())


def _half_parameters(model: nn.Module) -> bool:
    return any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())


def _nonfinite_buffers(model: nn.Module) -> set[str]:
    return {
        n
        for n, b in model.named_buffers()
        if b is not None and b.is_floating_point() and not bool(torch.isfinite(b).all())
    }


def _tracer(model: nn.Module, range_format: str | None, compiled: bool, ranges: bool) -> Any:
    from mixprec.frameworks.script.tracing import Tracer

    return Tracer(model, range_format, compiled=compiled, ranges=ranges)


def _device_of(model: nn.Module | None) -> torch.device:
    p = next(model.parameters(), None) if model is not None else None
    return p.device if p is not None else torch.device("cpu")


def _batch_size(args: tuple, kwargs: dict) -> int:
    """The first tensor input's leading dimension (the samples of this forward)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def _as_grads(grad_tensors: Any, n: int) -> list[torch.Tensor | None]:
    if grad_tensors is None:
        return [None] * n
    if isinstance(grad_tensors, torch.Tensor):
        return [grad_tensors]
    grads = list(grad_tensors)
    return grads + [None] * (n - len(grads))


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Lightning's, Accelerate's)."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _per_optimizer_state(scaler: Any, optimizer: Any) -> dict[str, Any]:
    """GradScaler's private per-optimizer state (``found_inf_per_device``, ``stage``), read where
    torch keeps it (2.4 to 2.14 alike); empty where it is not there."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return {}
    return states.get(id(_torch_optimizer(optimizer)), {}) or {}


def _found_inf(scaler: Any, optimizer: Any) -> bool:
    """Whether the scaler found inf/NaN in ``optimizer``'s gradients this step."""
    found = _per_optimizer_state(scaler, optimizer).get("found_inf_per_device") or {}
    return any(float(v) > 0 for v in found.values())


def _unscaled(scaler: Any, optimizer: Any) -> bool:
    stage = _per_optimizer_state(scaler, optimizer).get("stage")
    return getattr(stage, "name", "") == "UNSCALED"


def perturb_weights(model: nn.Module, perturb: float) -> None:
    """Every weight times ``1 + perturb * N(0, 1)``, from a fixed generator (the chaos floor)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            p.mul_(1 + perturb * noise)


def _exit(code: int) -> None:
    """End the script here, at a step boundary: what it would do next (more steps, evaluation,
    saving) is not part of the measurement."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


AGENT: Agent | None = None


def install_from_env() -> None:
    """Called by the child's sitecustomize: install the agent if the parent left a plan."""
    global AGENT
    owner = os.environ.get(OWNER_ENV)
    if AGENT is not None or (owner is not None and owner != str(os.getpid())):
        return
    plan = Plan.from_env()
    if plan is None:
        return
    os.environ[OWNER_ENV] = str(os.getpid())
    try:
        AGENT = Agent(plan)
        AGENT.install()
    except Exception:  # the script must not run half-instrumented
        traceback.print_exc()
        os._exit(3)
