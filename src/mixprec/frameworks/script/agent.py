"""The agent mixprec puts into a training script's own process: it finds the model and the
optimizer the script builds, applies a candidate to them, and records or paces the optimizer steps.

It is imported by the ``sitecustomize`` mixprec puts first on the child's ``PYTHONPATH``
(:mod:`mixprec.frameworks.script.launch`), before the script runs, and reads its :class:`Plan` from
the environment. Nothing is edited in the script; what it does is intercepted where PyTorch and the
frameworks offer a seam:

- **the model**: when the script builds its first optimizer, the outermost ``nn.Module`` that holds
  the optimizer's parameters (found once among the live modules). A second optimizer over another
  model is refused: mixprec measures one model.
- **a plain loop**: the candidate's Policy prepares the model (casts, channels_last, fp32 islands,
  ``Module.compile``); its autocast runs from the model's first forward of a step until the loss's
  ``backward()`` (autocast around forward and loss, as the PyTorch AMP recipe has it); the loss is
  scaled where the policy scales it, gradients are unscaled before the script's own
  ``clip_grad_norm_``, and the script's ``optimizer.step()`` goes through ``Policy.step`` (skipped on
  non-finite gradients, the scale updated).
- **the script's own AMP**: its ``torch.autocast`` and ``GradScaler`` are overridden, never stacked:
  under another candidate an enabled autocast takes the candidate's dtype (or is disabled), a
  GradScaler is enabled exactly when the candidate scales the loss.
- **the HF Trainer, Lightning and Accelerate**: their own precision switches
  (``TrainingArguments(bf16=, fp16=)``, ``Trainer(precision=)``, ``Accelerator(mixed_precision=)``),
  set as the export for that framework sets them, patched where the framework reads them.
- **the steps**: a step ends at the optimizer's step (or at ``GradScaler.update()`` where a scaler
  runs: a skipped step calls no ``optimizer.step()``); its time is the wall time since the last
  one (the DataLoader included; synchronised on CUDA), its loss the tensor the script called
  ``backward`` on (before scaling).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import importlib
import inspect
import json
import os
import random
import resource
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.frameworks.script.frameworks import PLAIN, UNKNOWN_FRAMEWORKS, install_import_hooks

PLAN_ENV = "MIXPREC_SCRIPT_PLAN"
OWNER_ENV = "MIXPREC_SCRIPT_OWNER"  # the process the plan is for (a spawned DataLoader worker is not)


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
        out: "trace": where the record goes (``torch.save``); "run": the folder for train.json.
        seed: seeds Python's, NumPy's and torch's generators before the script runs.
        perturb: "trace": the initial weights times ``1 + perturb * N(0, 1)`` (the chaos floor).
        ranges: "trace": also the full per-layer ranges of the first step.
        scratch: where checkpoints and output folders go in "measure" and "trace" modes.
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
    seed: int = 0
    perturb: float = 0.0
    ranges: bool = False
    scratch: str | None = None
    observer: str | None = None
    observe: dict[str, Any] | None = None

    @classmethod
    def from_env(cls) -> Plan | None:
        path = os.environ.get(PLAN_ENV)
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))


class Agent:
    """One script run under a plan (module docstring). One per process: :func:`install`."""

    def __init__(self, plan: Plan) -> None:
        from mixprec.policy import Candidate

        self.plan = plan
        self.candidate = Candidate.from_dict(plan.candidate)
        self.inject = not self.candidate.as_written
        self.framework = PLAIN
        self.framework_flags: dict[str, Any] = {}
        self.model: nn.Module | None = None
        self.policy: Any = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.script_scalers: list[Any] = []
        self.own: dict[str, Any] = {"autocast": [], "scaler": None, "framework": {}}
        self.step = 0
        self.t_start: float | None = None
        self.losses: list[torch.Tensor] = []  # this step's, unscaled
        self.samples = 0  # this step's
        self.skipped = False
        self.record: dict[str, Any] = {"steps": [], "facts": {}}
        self._internal = 0
        self._autocast: contextlib.AbstractContextManager[Any] | None = None
        self._scaled: set[int] = set()  # ids of tensors GradScaler.scale returned this step, scaled
        self._recorded: set[int] = set()  # ids of losses recorded this step (by GradScaler.scale)
        self._unscaled: set[int] = set()  # optimizers unscaled this step (before a clip)
        self._recorder: Any = None
        self._ranges: Any = None
        self._probe: Any = None
        self._first_output: torch.Tensor | None = None
        self._first_grads: dict[str, torch.Tensor] | None = None
        self._stall_before: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._step_scale: float | None = None  # the loss scale of this step's backward (trace mode)
        self.observers: list[Any] = []  # each: discovered(agent), step(agent, loss, skipped), summary()
        self._pipe_in: Any = None
        self._pipe_out: Any = None

    # ------------------------------------------------------------------ set-up
    def install(self) -> None:
        seed_everything(self.plan.seed)
        if self.plan.mode == "measure":
            assert self.plan.read_fd is not None and self.plan.write_fd is not None
            self._pipe_out = os.fdopen(self.plan.write_fd, "w", buffering=1)
            self._pipe_in = os.fdopen(self.plan.read_fd, "r")
        self._patch_autocast()
        self._patch_grad_scaler()
        self._patch_backward()
        self._patch_clip()
        self._patch_optimizer()
        install_import_hooks(self)
        if self.plan.mode == "run":
            if self.plan.observer:  # built from the top (mixprec run): the monitor sits above this layer
                module, _, name = self.plan.observer.partition(":")
                self.observers.append(
                    getattr(importlib.import_module(module), name)(self, self.plan.observe or {})
                )
            atexit.register(self.write_run)

    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """mixprec's own calls (its Policy's autocast, GradScaler, step): the patches let them be."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

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

    # ------------------------------------------------------------------ torch.autocast
    def _patch_autocast(self) -> None:
        from torch.amp import autocast_mode

        original = autocast_mode.autocast.__init__
        agent = self

        @functools.wraps(original)  # its signature, which torch.compile reads
        def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True, **kw):
            if not agent._internal and enabled:
                agent.own["autocast"].append({"device_type": device_type, "dtype": str(dtype)})
                if agent.inject and agent.framework == PLAIN:
                    wanted = agent.candidate.spec.autocast_dtype
                    enabled = wanted is not None
                    dtype = wanted if wanted is not None else dtype
            original(self, device_type, dtype=dtype, enabled=enabled, **kw)

        autocast_mode.autocast.__init__ = __init__  # type: ignore[method-assign,assignment]

    # ------------------------------------------------------------------ GradScaler
    def _patch_grad_scaler(self) -> None:
        from torch.amp import grad_scaler

        cls = grad_scaler.GradScaler
        init, scale, update = cls.__init__, cls.scale, cls.update
        agent = self

        signature = inspect.signature(init)

        @functools.wraps(init)
        def __init__(self, *args: Any, **kw: Any) -> None:
            bound = signature.bind(self, *args, **kw)
            bound.apply_defaults()
            if not agent._internal:
                agent.own["scaler"] = agent.own["scaler"] or bool(bound.arguments["enabled"])
                if agent.inject and agent.framework == PLAIN:
                    # fp16 weights: GradScaler refuses to unscale fp16 gradients; the Policy's own
                    # scaler does the loss scaling of a *-true candidate (the script's stays off)
                    spec = agent.candidate.spec
                    bound.arguments["enabled"] = spec.loss_scaling and spec.param_dtype is None
                agent.script_scalers.append(self)
            init(*bound.args, **bound.kwargs)

        def scale_(self, outputs: Any) -> Any:
            scaled = scale(self, outputs)
            if not agent._internal and isinstance(outputs, torch.Tensor):
                agent.losses.append(outputs.detach())
                agent._recorded.add(id(scaled))  # its backward() is this loss's: not counted twice
                if self.is_enabled():  # a disabled scaler hands the loss back: it is still to scale
                    agent._scaled.add(id(scaled))
            return scaled

        def update_(self, new_scale: Any = None) -> None:
            update(self, new_scale)
            if not agent._internal and self.is_enabled():
                agent.boundary(skipped=bool(_found_inf(self)))

        cls.__init__, cls.scale, cls.update = __init__, scale_, update_  # type: ignore[method-assign]

    # ------------------------------------------------------------------ backward
    def _patch_backward(self) -> None:
        original = torch.Tensor.backward
        agent = self

        @functools.wraps(original)
        def backward(self: torch.Tensor, *args: Any, **kw: Any) -> None:
            if agent._internal or torch._C._get_tracing_state():
                return original(self, *args, **kw)
            agent.leave_autocast()  # backward runs outside autocast, as the AMP recipe has it
            agent.backward_starts()
            if id(self) in agent._scaled or self.numel() != 1:
                return original(self, *args, **kw)
            if id(self) not in agent._recorded:
                agent.losses.append(self.detach())
            if agent.routing and agent.policy.scaler is not None:
                with agent.internal():
                    return original(agent.policy.scaler.scale(self), *args, **kw)
            return original(self, *args, **kw)

        torch.Tensor.backward = backward  # type: ignore[method-assign]

    # ------------------------------------------------------------------ clipping
    def _patch_clip(self) -> None:
        utils = torch.nn.utils
        agent = self
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            original = getattr(utils, name)

            def clip(parameters: Any, *args: Any, _original: Callable = original, **kw: Any) -> Any:
                if agent.routing and agent.policy.scaler is not None and not agent._internal:
                    with agent.internal():
                        for opt in agent.optimizers:  # the true gradients are clipped, not the scaled ones
                            if id(opt) not in agent._unscaled:
                                agent.policy.scaler.unscale_(opt)
                                agent._unscaled.add(id(opt))
                return _original(parameters, *args, **kw)

            setattr(utils, name, clip)
            if hasattr(utils, "clip_grad"):
                setattr(utils.clip_grad, name, clip)

    # ------------------------------------------------------------------ optimizers
    def _patch_optimizer(self) -> None:
        base = torch.optim.Optimizer
        original = base.__init__
        agent = self

        def __init__(self: torch.optim.Optimizer, *args: Any, **kw: Any) -> None:
            original(self, *args, **kw)
            if not agent._internal:
                agent.adopt(self)

        base.__init__ = __init__  # type: ignore[method-assign]
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(self._after_optimizer_step)

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """A new optimizer of the script's: the first names the model; one over another model is refused."""
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        owner = find_model(params)
        if self.model is None:
            if owner is None:
                self.fail(
                    "UsageError",
                    "the script's optimizer holds parameters of no single nn.Module: mixprec measures one "
                    "model",
                )
            self.model = owner
            self.optimizers.append(optimizer)
            self._wrap_step(optimizer)
            self._discovered()
            return
        if owner is not None and owner is not self.model and not _inside(owner, self.model):
            self.fail(
                "UsageError",
                f"the script trains a second model ({type(owner).__name__}, beside "
                f"{type(self.model).__name__}): mixprec measures one model per run",
            )
        self.optimizers.append(optimizer)
        self._wrap_step(optimizer)

    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Route ``optimizer.step()`` through the Policy where the agent injects the loop."""
        agent = self
        klass_step = type(optimizer).step

        def step(*args: Any, **kw: Any) -> Any:
            if agent._internal or not agent.routing or args or kw:
                return klass_step(optimizer, *args, **kw)
            agent.leave_autocast()
            with agent.internal():
                stepped = agent.policy.step(optimizer)
            agent.boundary(skipped=not stepped)
            return None

        optimizer.step = step  # type: ignore[method-assign]

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._internal or self.routing or not self.optimizers or optimizer is not self.optimizers[0]:
            return
        if any(s.is_enabled() for s in self.script_scalers):
            return  # GradScaler.update() ends the step (a skipped step calls no optimizer.step)
        self.boundary(skipped=False)

    # ------------------------------------------------------------------ the model
    def _discovered(self) -> None:
        """The model is known: apply the candidate (plain loop), hook its forward, report its facts."""
        model = self.model
        assert model is not None
        device = _device_of(model)
        if self.inject and self.framework == PLAIN:
            from mixprec.policy import get_policy

            with self.internal():  # the script's model is a torch model: the torch candidate's Policy
                torch_candidate = dataclasses.replace(self.candidate, framework="torch", as_written=False)
                self.policy = get_policy(torch_candidate, device=device)
                self.policy.precision_scope().__enter__()  # for the whole run, as a script sets them
                self.policy.prepare(model)
                if self.candidate.compile:  # the forward only: mixprec's hooks on the model stay eager
                    model.forward = torch.compile(model.forward, mode=self.candidate.compile)
        elif self.inject:  # the framework's switches hold the dtypes; the fp32 math mode is mixprec's
            from mixprec import state

            state.precision_settings(self.candidate.spec.precision).__enter__()
        if self.plan.perturb:
            perturb_weights(model, self.plan.perturb)
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        model.register_forward_hook(self._after_forward)
        if self.plan.mode != "run":  # which dtype the first matmul/conv really computed in
            from mixprec.frameworks.torch.session import FirstComputeLayer

            self._probe = FirstComputeLayer(model, self.candidate.keep_fp32 if self.inject else ())
        if self.plan.mode == "trace":
            self._trace_hooks(model)
        for observer in self.observers:
            with self.internal():
                observer.discovered(self)
        facts = self.record["facts"]
        facts.update(
            model=type(model).__name__,
            device=str(device),
            modules=[(n, type(m).__name__) for n, m in model.named_modules() if n],
            params=[n for n, _ in model.named_parameters()],
            param_dtypes=sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
        )

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        if self.t_start is None:
            self.t_start = time.perf_counter()
        self.samples += _batch_size(args, kwargs)
        device_type = self.policy.device.type if self.policy is not None else "cpu"
        # the script's own autocast (overridden to the candidate's dtype) already wraps its forward
        if self.loop and self._autocast is None and not torch.is_autocast_enabled(device_type):
            ctx = self.policy.autocast()
            with self.internal():
                ctx.__enter__()
            self._autocast = ctx

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._first_output is None and self.plan.mode == "trace" and module.training:
            first = _first_tensor(output)
            if first is not None:
                self._first_output = first.detach().float().cpu().clone()

    def backward_starts(self) -> None:
        """Trace mode: forwards from here on are activation-checkpoint recomputation, and the
        gradients recorded are scaled by the scale the step runs at."""
        if self.plan.mode != "trace":
            return
        if self._recorder is not None:
            self._recorder.backward_starts()
        if self._ranges is not None:
            self._ranges.in_backward = True
        if self._step_scale is None:
            self._step_scale = self._scale_after()

    def leave_autocast(self) -> None:
        if self._autocast is not None:
            ctx, self._autocast = self._autocast, None
            ctx.__exit__(None, None, None)

    # ------------------------------------------------------------------ the step boundary
    def boundary(self, *, skipped: bool) -> None:
        """One optimizer step of the script ended (``skipped``: its update was not applied)."""
        self.leave_autocast()
        if self.model is not None and self.model.training is False:
            return
        device = _device_of(self.model) if self.model is not None else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        seconds = now - (self.t_start or now)
        loss_t = torch.stack([x.float().reshape(()) for x in self.losses]).sum() if self.losses else None
        event = {
            "event": "step",
            "index": self.step,
            "seconds": seconds,
            "samples": self.samples,
            "skipped": skipped,
        }
        if self.plan.mode == "run":
            for observer in self.observers:
                with self.internal():
                    stop = observer.step(self, loss_t, skipped)
                if stop:  # the observer gave up on the run: stop it, with the record
                    print(f"mixprec: {stop}", file=sys.stderr, flush=True)
                    self.write_run()
                    _exit(4)
        else:
            event["loss"] = float(loss_t) if loss_t is not None else float("nan")
            if self._probe is not None:
                self._finish_probe()
        self.record["steps"].append(event)
        if self.plan.mode == "trace":
            self._trace_step(event, skipped)
        self.losses, self.samples, self._scaled, self._unscaled, self._recorded = [], 0, set(), set(), set()
        self.step += 1
        if self.plan.mode == "measure":
            self._pace(event)
        elif self.plan.mode == "trace" and self.step >= self.plan.steps:
            self._write_trace()
            _exit(0)
        self.t_start = time.perf_counter()

    def _pace(self, event: dict[str, Any]) -> None:
        """Measure mode: report the step, then wait for the parent's next word."""
        if self.step == 1:
            self.send({"event": "ready", "facts": self.facts()})
        self.send(event)
        line = self._pipe_in.readline()
        command = json.loads(line) if line else {"cmd": "stop"}
        if command["cmd"] == "stop":
            self.send({"event": "done", "measurement": self.measurement()})
            _exit(0)

    # ------------------------------------------------------------------ what the parent reads
    def facts(self) -> dict[str, Any]:
        facts = dict(self.record["facts"])
        facts.update(framework=self.framework, framework_flags=self.framework_flags, own=self.own)
        # only where the script's own loop trains: a known framework imports some of these itself
        # (transformers imports deepspeed where it is installed), and its switches are the ones set
        unknown = [name for name in UNKNOWN_FRAMEWORKS if name in sys.modules]
        facts["unknown_frameworks"] = unknown if self.framework == PLAIN else []
        facts["samples_per_step"] = self.record["steps"][0]["samples"] if self.record["steps"] else None
        return facts

    def measurement(self) -> dict[str, Any]:
        device = _device_of(self.model) if self.model is not None else torch.device("cpu")
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
        """Stop the script with mixprec's reason: to the parent in measure mode, on stderr always."""
        print(f"mixprec: {message}", file=sys.stderr, flush=True)
        if self._pipe_out is not None:
            self.send({"event": "error", "type": kind, "message": message})
        if self.plan.mode == "trace" and self.plan.out:
            torch.save({"error": f"{kind}: {message}", "facts": self.facts()}, self.plan.out)
        _exit(2)

    # ------------------------------------------------------------------ trace mode (the check)
    def _trace_hooks(self, model: nn.Module) -> None:
        from mixprec.frameworks.torch.ranges import StepRecorder
        from mixprec.numerics.limits import LOW_PRECISION_FORMATS

        fmt = self.candidate.spec.range_format
        compiled = bool(self.candidate.compile) and self.inject
        self._recorder = (
            None if compiled else StepRecorder(model, fmt if fmt in LOW_PRECISION_FORMATS else None)
        )
        if self._recorder is not None:
            self._recorder.begin()
        if self.plan.ranges:
            from mixprec.frameworks.torch.ranges import _Collector

            self._ranges = _Collector(model)
            self._ranges.install()
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Trace mode, the first step: the gradients the step would apply, unscaled."""
        if self.model is None or not self.optimizers or optimizer is not self.optimizers[0]:
            return
        if self._first_grads is None:
            scale = self._scale()
            self._first_grads = {
                n: p.grad.detach().float().cpu().clone() / (scale or 1.0)
                for n, p in self.model.named_parameters()
                if p.grad is not None
            }
        if self.candidate.spec.param_dtype is not None and self.inject:
            self._stall_before = [
                (p, p.detach().clone()) for p in self.model.parameters() if p.grad is not None
            ]

    def _scale(self) -> float | None:
        """The loss scale this step's gradients carry (None: none), unless already unscaled."""
        scalers = [self.policy.scaler] if self.routing and self.policy.scaler is not None else []
        scalers += [s for s in self.script_scalers if s.is_enabled()]
        for s in scalers:
            states = getattr(s, "_per_optimizer_states", {})
            stage = states.get(id(self.optimizers[0]), {}).get("stage")
            if stage is not None and getattr(stage, "name", "") == "UNSCALED":
                return None
            return float(s.get_scale())
        return None

    def _finish_probe(self) -> None:
        probe, self._probe = self._probe, None
        probe.remove()
        self.record["observed"] = {
            "observed_layer": probe.name,
            "observed_dtype": str(probe.dtype).removeprefix("torch.") if probe.dtype else None,
        }

    def _trace_step(self, event: dict[str, Any], skipped: bool) -> None:
        step_scale, self._step_scale = self._step_scale, None
        event["scale"] = self._scale_after()
        if self._recorder is not None:
            self._recorder.end(step_scale)
            self._recorder.begin()
        if self._ranges is not None:
            from mixprec.frameworks.torch.ranges import collected_report

            grads = [p.grad for p in self.model.parameters() if p.grad is not None] if self.model else []
            self.record["ranges"] = collected_report(self._ranges, grads, step_scale, event["loss"])
            self._ranges.remove()
            self._ranges = None
        if self._stall_before is not None and not skipped:
            from mixprec.policy.scaler import dense

            stalled = total = 0
            for p, old in self._stall_before:
                if p.grad is None:
                    continue
                had = dense(p.grad) != 0
                stalled += int(((p.detach() == old) & had).sum())
                total += int(had.sum())
            event["stall"] = [stalled, total]
        self._stall_before = None

    def _scale_after(self) -> float | None:
        if self.routing and self.policy.scaler is not None:
            return float(self.policy.scaler.get_scale())
        enabled = [s for s in self.script_scalers if s.is_enabled()]
        return float(enabled[0].get_scale()) if enabled else None

    def _write_trace(self) -> None:
        assert self.plan.out
        buffers = []
        if self.model is not None:
            buffers = [
                n
                for n, b in self.model.named_buffers()
                if b is not None and b.is_floating_point() and not bool(torch.isfinite(b).all())
            ]
        series = list(self._recorder.series.values()) if self._recorder is not None else []
        torch.save(
            {
                "steps": self.record["steps"],
                "facts": self.facts(),
                "first_output": self._first_output,
                "first_grads": self._first_grads or {},
                "series": [s.to_dict() for s in series],
                "nonfinite_buffers": buffers,
                "observed": self.record.get("observed", {}),
                "ranges": self.record.get("ranges"),
            },
            self.plan.out,
        )

    # ------------------------------------------------------------------ run mode (mixprec run)
    def write_run(self) -> None:
        """Run mode: ``run.json`` in the plan's folder: the candidate, the facts, the step times and
        each observer's summary (the monitor's losses, findings, health)."""
        if not self.plan.out:
            return
        from pathlib import Path

        out = Path(self.plan.out)
        out.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {"candidate": self.candidate.to_dict(), "facts": self.facts()}
        data["steps"] = len(self.record["steps"])
        data["step_seconds"] = [s["seconds"] for s in self.record["steps"]]
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
    """The outermost live ``nn.Module`` holding every parameter in ``params`` (ids), or None."""
    with warnings.catch_warnings():  # isinstance() on every live object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if isinstance(o, nn.Module)]
    children = {id(c) for m in modules for c in m.children()}
    roots = [m for m in modules if id(m) not in children]
    holders = [m for m in roots if params <= {id(p) for p in m.parameters()}]
    if not holders:
        return None
    model = min(holders, key=lambda m: sum(1 for _ in m.parameters()))
    inner = getattr(model, "_orig_mod", None)  # a torch.compile wrapper: the model it compiles
    return inner if isinstance(inner, nn.Module) else model


def _inside(module: nn.Module, model: nn.Module) -> bool:
    return any(m is module for m in model.modules())


def _device_of(model: nn.Module | None) -> torch.device:
    p = next(model.parameters(), None) if model is not None else None
    return p.device if p is not None else torch.device("cpu")


def _batch_size(args: tuple, kwargs: dict) -> int:
    """The first tensor input's leading dimension (the samples of this forward)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, dict):
        value = [value[k] for k in ("logits", *value) if k in value and k != "loss"]
    elif hasattr(value, "logits"):
        value = [value.logits]
    if isinstance(value, (list, tuple)):
        for v in value:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def _found_inf(scaler: Any) -> bool:
    """Whether the scaler found inf/NaN gradients in its last step (read before update() resets)."""
    states = getattr(scaler, "_per_optimizer_states", None) or {}
    for state in states.values():
        for found in state.get("found_inf_per_device", {}).values():
            if float(found) > 0:
                return True
    return False


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
