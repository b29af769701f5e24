"""The agent mixprec puts into a training script's own process: it finds the model and the
optimizers the script builds, applies a candidate to them, and records or paces the script's steps.

It is imported by the ``sitecustomize`` mixprec puts first on the child's ``PYTHONPATH``
(:mod:`mixprec.frameworks.script.launch`), before the script runs, and reads its :class:`Plan` from
the environment. Nothing is edited in the script; what it does is intercepted where PyTorch and the
frameworks offer a seam (:mod:`.patches` lists each):

- **the model**: when the script builds its first optimizer, the outermost ``nn.Module`` holding most
  of that optimizer's parameters (found once among the live modules; parameters outside every module,
  a learnable temperature, train as the script has them), with every other model the script holds
  whose parameters its code hands an optimizer still to come (a GAN's generator beside the
  discriminator whose optimizer is built first): the model in parts (:mod:`.models`). An optimizer
  over a model built later starts the model anew in a run where the script holds the last no more
  (k-fold's next fold); else it is refused (a measurement ends there as at the script's own end).
- **the step**: the first optimizer built (the *lead*) paces the script: a step ends where the lead
  has stepped and the model computes again (its next forward or backward), or the lead steps again.
  Every other optimizer (a Muon/AdamW split, a GAN's discriminator) steps inside it, so a step is the
  same thing under every candidate, as written included; one over the lead's parameters that the
  lead has not stepped since it was built or last stepped (a second phase's) takes the lead. Its
  time is the wall time between two ends
  (the DataLoader included; synchronised on CUDA), its loss what the script called ``backward`` on
  (the gradient-weighted sum for ``backward(gradient)``), its samples the batch dimension of the
  model's inputs.
- **a plain loop**: the candidate's Policy prepares the model (casts, channels_last, fp32 islands,
  ``Module.compile``); its autocast runs from the model's first forward of a step (wherever the loop
  calls it: the root, one of its parts, a compiled wrapper; in train or eval mode) until the
  ``backward()``; the loss is scaled where the policy scales it, and every read of a gradient after a
  scaled backward sees it unscaled (any clip path, any log); each ``optimizer.step()`` goes through
  the Policy (skipped on non-finite gradients) and the scale is updated once per step, and before
  a backward whose gradients are all for optimizers stepped since (a WGAN's critic, n per step).
- **activation checkpointing**: what a checkpoint recomputes inside the backward (forwards, a
  reentrant checkpoint's own backward) is no step's forward, samples or loss; one the loop calls
  before the model's first forward begins the autocast there, where it reads what to recompute under.
- **the script's own AMP**: its ``torch.autocast`` and ``GradScaler`` are overridden, never stacked:
  under another candidate an enabled autocast takes the candidate's dtype (or is disabled), a
  GradScaler is enabled exactly when the candidate scales the loss. A script that uses mixprec's own
  ``Policy`` has it built under the candidate.
- **the HF Trainer, Lightning and Accelerate**: their own precision switches
  (``TrainingArguments(bf16=, fp16=)``, ``Trainer(precision=)``, ``Accelerator(mixed_precision=)``),
  set as the export for that framework sets them, patched where the framework reads them.
- **gradient accumulation** (the plan's ``accumulate``: a micro-batch search's candidate, ``mixprec
  run --accumulate``): ``k`` iterations of a plain loop as one optimizer step (:mod:`.accumulation`),
  the HF Trainer's ``gradient_accumulation_steps`` and Lightning's ``accumulate_grad_batches``
  multiplied by ``k`` where those train.
- **the optimizer's implementation** (foreach, fused): set where the script builds each torch
  optimizer (its own loop's, Lightning's ``configure_optimizers``, the HF Trainer's AdamW, named by
  ``TrainingArguments(optim=)`` too), in place of the script's own ``foreach=``/``fused=``.

The :class:`Agent` here is the core every run shares (the model, its forwards and backwards, the
step's end); what a run is for is its mode (:mod:`.modes`: measure, trace, run); the optimizers
are :mod:`.optimizers`', the script's own AMP :mod:`.own`'s, torch's patches :mod:`.patches`', and
what crosses to the parent :mod:`.messages`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.frameworks.script.accumulation import Accumulation
from mixprec.frameworks.script.copies import CompiledForward, OwnHook, copies_of, follow
from mixprec.frameworks.script.frameworks import PLAIN, UNKNOWN_FRAMEWORKS, install_import_hooks
from mixprec.frameworks.script.messages import OWNER_ENV, Facts, Observed, Plan, Step
from mixprec.frameworks.script.models import describe, named_parts, preparing
from mixprec.frameworks.script.modes import mode_for
from mixprec.frameworks.script.optimizers import Optimizers, no_backward, scale_after
from mixprec.frameworks.script.own import OwnPrecision, as_torch
from mixprec.frameworks.script.patches import Patches
from mixprec.frameworks.script.tape import StepTape
from mixprec.frameworks.torch.probe import FirstComputeLayer, nonfinite_buffers, perturb_weights


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
    """One script run under a plan (module docstring): the shared core every mode (:mod:`.modes`)
    runs on. One per process: :func:`install_from_env`."""

    def __init__(self, plan: Plan, *, exit: Callable[[int], None] | None = None) -> None:
        from mixprec.policy import Candidate

        self.plan = plan
        self.candidate = Candidate.from_dict(plan.candidate)
        self.torch_candidate = as_torch(self.candidate)  # the script's model is a torch model
        self.inject = not self.candidate.as_written
        self.framework = PLAIN
        self.framework_flags: dict[str, Any] = {}
        self.model: nn.Module | None = None
        self.policy: Any = None
        self.window = Window()
        self.steps: list[Step] = []
        self.observed: Observed | None = None
        self.probe_dtypes: list[torch.dtype] = []  # every dtype the first step's matmuls/convs computed in
        self.internal_calls = 0  # > 0 while mixprec's own code calls torch (the patches let it be)
        self.grads_scaled = False  # a backward the agent scaled ran; gradients unscaled on first read
        # each: discovered(agent), forward(...), before_update(agent), step(agent, loss, skipped),
        # new_model(agent) and summary()
        self.observers: list[Any] = []
        self.taping = False  # record each step as a replayable tape (the monitor's shadow asks for it)
        self.tracer: Any = None  # the trace mode's recorder (:mod:`.tracing`)
        self.nonfinite_at_start: set[str] = set()
        self.pid = os.getpid()
        self.patches = Patches(self)
        self.own = OwnPrecision(self)
        self.optimizers = Optimizers(self)
        self.accumulation = Accumulation(self, plan.accumulate)
        self.mode = mode_for(self)
        self.exit = exit or _exit
        self._facts = Facts()
        self._autocast: contextlib.AbstractContextManager[Any] | None = None
        self._model_ids: set[int] = set()
        self._parts: dict[int, str] = {}  # id -> name of each module the script calls ('': the model)
        self._entry: nn.Module | None = None  # the part the step's first forward calls
        self._pass_counted = False  # this forward pass's samples were counted at a submodule's call
        self._part_depth = 0  # parts' forwards in progress (a part may call another)
        self.thread: int | None = None  # the loop's (autocast is per thread)
        self.in_backward = False  # (a read of .grad inside backward, a hook's, is not the script's)
        self._probe: Any = None
        self._part_hooks: list[Any] = []  # (on each part: a new model's replace them)
        self._undo_hooks: Callable[[], None] | None = None
        self._scopes = contextlib.ExitStack()  # the candidate's fp32 math mode, for the whole run

    # ------------------------------------------------------------------ set-up
    def install(self) -> None:
        self.pid = os.getpid()  # (a DataLoader worker forked from the script is not the script)
        if self.plan.seed is not None:
            seed_everything(self.plan.seed)
        self.patches.install()
        self.own.patch_policy()
        self._undo_hooks = install_import_hooks(self)
        if self.plan.home and self.mode.sandboxed:
            from mixprec.frameworks.script import sandbox

            self.patches.add(sandbox.install(self.plan.home, os.getcwd(), own=self.plan.own))
        self.mode.install()

    def uninstall(self) -> None:
        """Put torch back as it was (the in-process tests run a loop under an agent, then this)."""
        self.leave_autocast()
        self._scopes.close()
        self.patches.remove()
        if self._undo_hooks is not None:
            self._undo_hooks()
        with contextlib.suppress(Exception):
            import atexit

            atexit.unregister(self.mode.finish)

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
        return self.loop and not self.own.scaling()

    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters(), None) if self.model is not None else None
        return p.device if p is not None else torch.device("cpu")

    def is_model(self, module: nn.Module) -> bool:
        """Whether ``module`` is the model or a part of it (or a compiled wrapper of one)."""
        if id(module) in self._model_ids:
            return True
        inner = getattr(module, "_orig_mod", None)
        return inner is not None and id(inner) in self._model_ids

    # ------------------------------------------------------------------ the model
    def discovered(self) -> None:
        """The model is known: apply the candidate (plain loop), hook its forward, read its facts."""
        from mixprec.errors import MixprecError

        model = self.model
        assert model is not None
        facts = self._facts
        facts.param_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        if not self.steps:  # (the script's own, before the candidate's: not a later model's)
            facts.strict_math = _strict_math(self.device)
        self.nonfinite_at_start = set(nonfinite_buffers(model))
        parts = named_parts(model)  # what the script calls: the model, or each of its parts
        changes = self._changes_dtypes(model)
        copies = {name: copies_of(part, within=model) if changes else [] for name, part in parts.items()}
        try:
            self._apply_candidate(model)  # (a Models' input casts go on its parts)
            for name, part in parts.items():
                follow(part, copies[name])  # (an EMA made before the optimizer: the model's dtypes too)
        except MixprecError as exc:
            self.fail(type(exc).__name__, str(exc))
        if self.plan.perturb:
            perturb_weights(model, self.plan.perturb)
        self._parts = {id(part): name for name, part in parts.items()}
        for part in parts.values():
            entering = part.register_forward_pre_hook(OwnHook(self._root_forward, part), with_kwargs=True)
            self._part_hooks += [entering, part.register_forward_hook(OwnHook(self._root_output, part))]
        self.mode.discovered()
        if self.mode.probes():  # which dtype the first matmul/conv computed in
            keep = self.candidate.keep_fp32 if self.inject else ()
            self._probe = FirstComputeLayer(model, keep, training_only=True)
        self._model_ids = {id(m) for m in model.modules()}
        for observer in self.observers:
            with self.internal():
                observer.discovered(self)
        facts.model, facts.device = describe(model), str(self.device)
        facts.modules = [(n, type(m).__name__) for n, m in model.named_modules() if n]
        facts.params = [n for n, _ in model.named_parameters()]
        self.patches.arm_forward()

    def new_model(self) -> None:
        """The script trains a new model, done with the last (k-fold's next fold, a sweep's next
        run): the step in progress ends and the last model's hooks go; the next optimizer's model
        is discovered as the first was, and the candidate applied to it."""
        if self.window.lead_stepped:
            self.boundary()
        for handle in self._part_hooks:
            handle.remove()
        assert self.model is not None
        self.mode.new_model()  # (its observers: the monitor closes the last model's, keeps its record)
        self.optimizers.forget(self.model)
        self.model, self._entry, self._part_depth, self._part_hooks = None, None, 0, []

    def _changes_dtypes(self, model: nn.Module) -> bool:
        """Whether applying the candidate changes the dtypes of the model's weights: a *-true cast,
        or the script's own half weights widened for a candidate with fp32 master weights."""
        if not self.inject or self.framework != PLAIN:
            return False
        return self.candidate.spec.param_dtype is not None or _half_parameters(model)

    def _apply_candidate(self, model: nn.Module) -> None:
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
            # a traced run is a check's, which decided the candidate may run here: supported, or a
            # low format whose numerics are predicted on a device without its kernels
            check = self.mode.name != "trace"
            self.policy = get_policy(self.torch_candidate, device=self.device, check=check)
            with preparing(model, self.candidate.label):  # (a model in parts: casts on its parts)
                if self.candidate.spec.param_dtype is None and _half_parameters(model):
                    # a script that trains half weights itself (model.to(torch.bfloat16)): fp32 master
                    # weights for this candidate (exact), and its half inputs widened to meet them
                    model._apply(lambda t: t.float() if t.is_floating_point() else t)
                    from mixprec.policy.hooks import cast_inputs

                    model.register_forward_pre_hook(cast_inputs(torch.float32), with_kwargs=True)
                    self._facts.widened = True
                self._scopes.enter_context(self.policy.precision_scope())  # as a script sets them
                self.policy.prepare(model)
            if self.candidate.compile:  # the forward only: mixprec's hooks on the model stay eager
                for part in named_parts(model).values():
                    part.forward = CompiledForward(part.forward, self.candidate.compile)

    # ------------------------------------------------------------------ forwards
    def first_forward(self, module: nn.Module, args: tuple, whole: bool = False) -> None:
        """The model's first forward since the step's last event (the global pre-hook): its
        computation begins, and a loop that calls a part's submodule first (backbone.features(x))
        has the samples counted here, once (a part counts its own: _root_forward, with kwargs), as
        does one that checkpoints a part ``whole`` (a reentrant checkpoint runs it without grad)."""
        self.compute_begins()
        self._pass_counted = whole or id(module) not in self._parts
        self.window.samples += _batch_size(args, {}) if self._pass_counted else 0

    def compute_begins(self) -> None:
        """The model computes (its first forward, or a checkpoint about to call it): the last step
        ends if the lead has stepped, and the candidate's autocast begins (never inside a backward:
        its callers pass a checkpoint's recomputation by)."""
        if self.window.lead_stepped:
            self.boundary()
        if self.window.started is None:
            self.window.started = time.perf_counter()
        self.resume_autocast()

    def resume_autocast(self) -> None:
        """The candidate's autocast begins where the loop computes and it is not on (the script's
        own, overridden to the candidate's, governs where it has one; a *-true candidate's half
        default dtype is mixprec's alone)."""
        if self.loop and self._autocast is None and threading.get_ident() == self.thread:
            device_type = self.policy.device.type
            half_default = self.candidate.spec.autocast_dtype is None
            if half_default or (not self.own.autocast_depth and not torch.is_autocast_enabled(device_type)):
                with self.internal():  # (made inside too: mixprec's, not an autocast of the script's)
                    ctx = self.policy.autocast()
                    ctx.__enter__()
                self._autocast = ctx

    def _root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or self.internal_calls or self.in_backward:
            return  # (in_backward: a checkpoint's recomputation, no new pass)
        self._part_depth += 1
        if self._part_depth > 1:
            return  # (a part called inside another part's forward: that forward's work)
        if self._entry is None:  # (not `or`: an empty Sequential is falsy)
            self._entry = module
        if module is self._entry:  # (a model in parts: the samples are those its first part takes)
            self.window.samples += 0 if self._pass_counted else _batch_size(args, kwargs)
            self._pass_counted = False
            for observer in self.observers:
                observer.forward(self, args, kwargs)
        if self.taping and self.loop:
            if self.window.tape is None:
                self.window.tape = StepTape()
            self.window.tape.model_call(self._parts[id(module)], args, kwargs)

    def _root_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled() or self.internal_calls or self.in_backward:
            return
        self._part_depth = max(self._part_depth - 1, 0)
        if self._part_depth:  # (inside another part's forward)
            return
        if self.tracer is not None:
            self.tracer.forward_output(output)
        if self.window.tape is not None:
            self.window.tape.model_output(output)

    def leave_autocast(self) -> bool:
        """The candidate's autocast ends here; whether it was on."""
        ctx, self._autocast = self._autocast, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        return ctx is not None

    # ------------------------------------------------------------------ backward
    def backward_begins(self) -> None:
        """``Tensor.backward()`` is called: the step's tape stops recording before it dispatches."""
        if self.window.tape is not None and not self.internal_calls:
            self.window.tape.pause()

    def backward(self, original: Callable, tensors: Any, grad_tensors: Any, args: tuple, kw: dict) -> Any:
        """Every backward of the script (``torch.autograd.backward``): autocast ends, the loss is
        recorded, and scaled where the candidate's Policy scales it."""
        self.leave_autocast()  # backward runs outside autocast, as the AMP recipe has it
        self._part_depth = 0  # (no forward is in progress: one that raised and was caught is over)
        if self.window.lead_stepped:  # (a loop that calls model.forward() itself: no forward hook)
            self.boundary()
        if self.window.started is None:
            self.window.started = time.perf_counter()
        self.patches.arm_forward()  # the next micro-batch's forward: autocast again
        self.window.backwards += 1
        self.accumulation.backward()
        factor = self.accumulation.loss_factor  # (1/k: the step's loss is the micro-batches' mean)
        outputs = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grads = _as_grads(grad_tensors, len(outputs))
        losses = [
            self.own.unscaled_loss.get(id(out), out) for out in outputs
        ]  # (the script's scaler's: unscaled)
        if self.window.tape is not None:
            tape = self.window.tape
            tape.backward(losses)
            if any(g is not None for g in grads):
                tape.broken = tape.broken or "backward(gradient): the tape replays a scalar loss"
            if factor != 1.0:
                tape.broken = tape.broken or "gradient accumulation: the tape replays one micro-batch's loss"
        for loss, grad in zip(losses, grads, strict=True):
            if grad is None:
                self.window.losses.append(loss.detach() * factor)
            else:  # a per-sample loss and its weights: the objective whose gradient is taken
                self.window.losses.append((loss.detach().float() * grad.detach().float()).sum() * factor)
        scale = None
        if self.routing and self.policy.scaler is not None:
            self.optimizers.before_scaled_backward(outputs)
            with self.internal():
                outputs = tuple(self.policy.scaler.scale(out) for out in outputs)
                scale = float(self.policy.scaler.get_scale())
            self.grads_scaled = True
            self.patches.grad_reads(True)
        elif any(id(out) in self.own.scaled for out in outputs):
            scale = scale_after(self)
        if self.tracer is not None:
            self.tracer.backward_starts(scale)
        if factor != 1.0:  # each micro-batch's gradient a k-th: their sum is the mean's
            outputs = tuple(out * factor for out in outputs)
        self.in_backward = True
        try:
            return original(outputs if len(outputs) > 1 else outputs[0], grad_tensors, *args, **kw)
        finally:
            self.in_backward = False  # (a read of .grad inside backward, a hook's, is not the script's)

    # ------------------------------------------------------------------ the step boundary
    def boundary(self) -> None:
        """The script's step ended: the scale updated once for what was routed, the step recorded
        and handed to the mode (the parent's pace, the trace, the observers)."""
        from mixprec.errors import MixprecError

        window = self.window
        self.leave_autocast()
        if window.tape is not None:
            window.tape.pause()
        if not window.backwards and self.mode.needs_backward:
            self.fail("UnsupportedError", no_backward(self.optimizers.lead, self.policy))
        skipped = window.skipped
        if window.routed:
            with self.internal():
                try:
                    skipped = self.optimizers.end_step(window.routed) or skipped
                except MixprecError as exc:  # persistent skips, a collapsed scale: the candidate fails
                    self.fail(type(exc).__name__, str(exc))
        self.optimizers.new_step()
        self.grads_scaled = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        loss = torch.stack([x.float().reshape(()) for x in window.losses]).sum() if window.losses else None
        step = Step(window.index, now - (window.started or now), window.samples, skipped)
        self.window = Window(index=window.index + 1)
        self.own.new_step()
        self.steps.append(step)
        if self._probe is not None:
            self._read_probe()
        self.mode.step_ended(step, loss)

    def _read_probe(self) -> None:
        """After the first step: the dtype its first matmul/conv computed in."""
        probe, self._probe = self._probe, None
        probe.remove()
        observed = str(probe.dtype).removeprefix("torch.") if probe.dtype else None
        self.observed = Observed(probe.name, observed)
        self.probe_dtypes = list(probe.dtypes)
        self.mode.observed(self.observed)

    def framework_title(self) -> str:
        from mixprec.frameworks.script.workload import TRAINED_BY

        return TRAINED_BY.get(self.framework, self.framework)

    def facts(self) -> Facts:
        """What the script is, as far as it ran."""
        facts = dataclasses.replace(self._facts)
        facts.framework, facts.framework_flags = self.framework, dict(self.framework_flags)
        if self.optimizers.applied:  # the keywords each optimizer class was built with
            facts.framework_flags["optimizer"] = dict(self.optimizers.applied)
        facts.own = self.own.as_written
        # only where the script's own loop trains: a known framework imports some of these itself
        # (transformers imports deepspeed where it is installed), and its switches are the ones set
        unknown = [name for name in UNKNOWN_FRAMEWORKS if name in sys.modules]
        facts.unknown_frameworks = unknown if self.framework == PLAIN else []
        facts.samples_per_step = self.steps[0].samples if self.steps else None
        return facts

    def fail(self, kind: str, message: str) -> None:
        """Stop the script with mixprec's reason: to the parent (the pipe, the trace record, the run
        record, whichever the mode has), then exit 2."""
        self.mode.fail(kind, message)
        print(f"mixprec: {message}", file=sys.stderr, flush=True)
        self.exit(2)

    def finish_run(self) -> None:
        """The script exits (atexit, os._exit; the in-process tests at the end of their loop)."""
        self.mode.finish()

    # ------------------------------------------------------------------ loss scales


# ---------------------------------------------------------------------- helpers
def seed_everything(seed: int) -> None:
    """The same random numbers for every candidate's run (the script may seed again itself)."""
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


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


def _half_parameters(model: nn.Module) -> bool:
    return any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())


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


def _exit(code: int) -> None:
    """End the script here, at a step boundary: what it would do next (more steps, evaluation,
    saving) is not part of the measurement."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


AGENT: Agent | None = None
# The interpreter's options that take a value (``-X opt``, ``-W arg``): skipped to find the script.
_VALUED_OPTIONS = ("-X", "-W")


def _a_rank(plan: Plan) -> bool:
    """Under a launcher, whether this process is one it started to run the script: torchrun's ranks
    carry ``LOCAL_RANK``; a one-process launch (``accelerate launch`` without ``--multi_gpu``) does
    not, so the process is known by its command line, the script's own (the launcher's names the
    launcher)."""
    if "LOCAL_RANK" in os.environ:
        return True
    argv, i = sys.orig_argv, 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c", "-"):
        i += 2 if argv[i] in _VALUED_OPTIONS else 1
    return plan.script is not None and argv[i:] == plan.script


def install_from_env() -> None:
    """Called by the child's sitecustomize: install the agent if the parent left a plan."""
    global AGENT
    owner = os.environ.get(OWNER_ENV)
    if AGENT is not None or (owner is not None and owner != str(os.getpid())):
        return
    plan = Plan.from_env()
    if plan is None or (plan.launched and not _a_rank(plan)):
        return  # (no plan; or the launcher's own process, which starts the ranks)
    os.environ[OWNER_ENV] = str(os.getpid())
    try:
        AGENT = Agent(plan)
        AGENT.install()
    except Exception:  # the script must not run half-instrumented
        traceback.print_exc()
        os._exit(3)
