"""The script's optimizers as the agent sees them: the first names the model and paces the steps
(the *lead*), each one's ``step()`` goes through the candidate's Policy where the agent injects the
loop, and a gradient read after a scaled backward is unscaled first.

The candidate's optimizer implementation (``Candidate.optimizer``: for-loop, foreach, fused) is set
where the script builds each optimizer: the torch.optim constructor that takes ``foreach=``/``fused=``
gets the candidate's keywords in place of the script's own (a fused optimizer is only fused when built
so: :mod:`mixprec.frameworks.torch.implementations`). An optimizer with no such implementation fails
the candidate; what each optimizer offers and uses as written is recorded for tune's variants.

``optimizer.step`` is replaced on the instance by a bound method, as the optimizer's own is: an LR
scheduler made afterwards wraps it through ``__func__`` (a plain function broke every one).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.errors import UnsupportedError
from mixprec.frameworks.script import scaler_state
from mixprec.frameworks.script.copies import copies_of
from mixprec.frameworks.script.models import (
    describe,
    find_models,
    live_modules,
    model_of,
    models_to_come,
    script_holds,
)
from mixprec.frameworks.torch.implementations import accepted, keywords, named, offered

Agent = Any  # mixprec.frameworks.script.agent.Agent (which imports this module)


@dataclasses.dataclass
class Built:
    """An optimizer in construction by a torch.optim constructor that has implementations."""

    cls: type  # the outermost such constructor's class (AdamW's, not the Adam.__init__ it calls)
    own: dict[str, Any]  # its foreach=/fused= as the script passed them
    chosen: dict[str, bool]  # the candidate's keywords, passed instead ({}: none asked)


class Optimizers:
    """The script's optimizers, their steps and their gradients' unscaling (module docstring)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.all: list[torch.optim.Optimizer] = []
        self.lead: torch.optim.Optimizer | None = None
        self.building: dict[int, Built] = {}  # id(optimizer) -> its constructor's, while it runs
        self.applied: dict[str, dict[str, bool]] = {}  # class name -> the implementation keywords set
        self._owner: dict[int, torch.optim.Optimizer] = {}  # id(param) -> its optimizer
        self._indexed_this_step = False
        self._unscaled: set[int] = set()  # optimizers unscaled since the last scale update
        self._unscaled_grads = UnscaledGrads()  # (two optimizers may hold one)
        self._read_unscaled: set[int] = set()  # of those, unscaled by a read and not stepped yet
        self._lead_steps = 0  # the lead's steps so far (one it skipped too)
        # each optimizer's: the lead's steps so far when it was built or last stepped
        self._last: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._let_go: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # leads taken over from
        self._stepped: set[int] = set()  # optimizers the Policy stepped since the last scale update
        self._forgotten: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # a last model's
        self._retired: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the models the script is done with

    # ------------------------------------------------------------------ construction
    def constructing(self, optimizer: torch.optim.Optimizer, cls: type, arguments: dict[str, Any]) -> None:
        """``cls.__init__`` (a torch.optim constructor that takes foreach=/fused=) starts building
        ``optimizer`` with ``arguments`` (bound, defaults applied): the candidate's implementation
        replaces the script's own there."""
        own = {k: arguments.get(k) for k in accepted(cls)}
        chosen: dict[str, bool] = {}
        impl = self.agent.candidate.optimizer
        if impl is not None:
            try:
                chosen = keywords(cls, impl)
            except UnsupportedError as exc:
                self.agent.fail("UnsupportedError", f"the script's {exc}: optimizer={impl!r} does not apply")
            arguments.update(chosen)
        self.building[id(optimizer)] = Built(cls, own, chosen)

    def _implementation(self, optimizer: torch.optim.Optimizer) -> None:
        """A new optimizer is built: what it offers and uses as written is recorded, and the
        candidate's implementation checked to be the one it was built with."""
        agent, name = self.agent, type(optimizer).__name__
        built = self.building.get(id(optimizer))
        agent.own.as_written.setdefault("optimizers", []).append(
            {
                "class": name,
                "implementations": offered(built.cls) if built else [],
                "as_written": named(built.own) if built else None,
            }
        )
        impl = agent.candidate.optimizer
        if impl is None:
            return
        if built is not None:
            self.applied[name] = built.chosen
            return
        # not built by a torch.optim constructor mixprec sets: right only where there is nothing to set
        try:
            unset = keywords(type(optimizer), impl)
        except UnsupportedError as exc:
            agent.fail("UnsupportedError", f"the script's {exc}: optimizer={impl!r} does not apply")
            return
        if unset:
            flags = ", ".join(f"{k}={v}" for k, v in unset.items())
            agent.fail(
                "UnsupportedError",
                f"the script's {name} is not a torch.optim optimizer: mixprec sets optimizer={impl!r} "
                f"({flags}) where torch.optim's constructors build one",
            )
        self.applied[name] = unset

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """A new optimizer of the script's: the first names the model; one over a model built after
        it starts the model anew where the script is done with the last, else it is refused."""
        agent = self.agent
        self._implementation(optimizer)
        order = [id(p) for g in optimizer.param_groups for p in g["params"]]
        if agent.model is not None and self._new_model(order):
            agent.new_model()
        if agent.model is None:
            parts = find_models(order, live_modules())
            if not parts:
                agent.fail(
                    "UsageError",
                    "the script's first optimizer holds no parameter of any nn.Module: mixprec measures "
                    "the model an optimizer trains",
                )
            parts += self._models_to_come(parts, set(order))
            # (the model in parts, a backbone and a head, a GAN's two: all, named as the script names them)
            agent.model, self.lead = model_of(parts), optimizer
            agent.thread = threading.get_ident()  # (autocast is per thread: the loop's)
            self._register(optimizer)
            agent.discovered()
            return
        self._register(optimizer)

    def forget(self, model: nn.Module) -> None:
        """The script is done with ``model``: its optimizers (and their state) are let go, and it is
        no model to come beside the next (a variable about to be rebound may still hold it)."""
        self._forgotten.update([*self.all, *self._let_go])
        self.all, self.lead, self._owner = [], None, {}
        self._let_go = weakref.WeakSet()
        self.building.clear()
        self._retired.update(model.modules())

    def _new_model(self, order: list[int]) -> bool:
        """Whether an optimizer over a model built after the first optimizer (``order``: its
        parameters' ids) starts the model anew: the script trained the last and holds it no more
        (k-fold's folds, a sweep's runs, a model per seed), in a run of the script. A measurement
        ends there as at the script's own end (its session starts it again for more steps of the
        first model); anywhere else the script is stopped with the reason (:func:`second_model`)."""
        agent = self.agent
        assert agent.model is not None
        mine = {id(p) for p in agent.model.parameters()}
        others = find_models([p for p in order if p not in mine], live_modules())
        owner = others[0] if others else None
        if owner is None or any(m is owner for m in agent.model.modules()):
            return False
        began = bool(agent.steps or agent.window.lead_stepped)
        held = script_holds(agent.model, {type(m) for m in others})
        if began and not held and agent.mode.name == "run":
            return True
        if began and not held and agent.mode.name == "measure":
            agent.mode.ending("the script trains a new model once done with the first (k-fold's next fold)")
            agent.exit(0)
        agent.fail("UsageError", second_model(agent, owner, began, held))
        return False

    def _paces(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` steps. One over parameters the lead holds that the lead has not stepped
        since it was built or last stepped paces the steps from here: it takes the lead (a second
        phase's, built after the first's last step: at its first step; built earlier, or an
        earlier phase's stepped again: at its second), and the last lead is let go (held weakly:
        its state goes with the script's last reference; taken back if it steps again). Two that
        both step each iteration (an auxiliary loss's over a shared encoder) keep the lead where it
        is; one over parameters of its own (a GAN's, a Muon/AdamW split) steps inside the lead's
        step. One over a model the script was done with is refused."""
        if optimizer in self._forgotten:
            self.agent.fail("UsageError", still_trained(self.agent, optimizer))
        if not any(o is optimizer for o in self.all):
            self.all.append(optimizer)  # (a lead let go, stepped again: an earlier phase's)
            self._let_go.discard(optimizer)
            self._index()
        quiet = self._quiet_since(optimizer)
        self._last[optimizer] = self._lead_steps
        if optimizer is self.lead or self.lead is None or not quiet or not self._lead_steps:
            return  # (not before the lead's first step: SAM's, Lookahead's inner one; Reptile's)
        if self._overlaps_lead(optimizer):
            self._let_go.add(self.lead)  # (held weakly: the script may step it again, or let it go)
            self.all = [o for o in self.all if o is not self.lead]
            self.lead = optimizer
            self._index()

    def _quiet_since(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the lead has not stepped since ``optimizer`` was built or last stepped."""
        return self._last.get(optimizer) == self._lead_steps

    def _overlaps_lead(self, optimizer: torch.optim.Optimizer) -> bool:
        assert self.lead is not None
        held = {id(p) for group in self.lead.param_groups for p in group["params"]}
        return any(id(p) in held for group in optimizer.param_groups for p in group["params"])

    def _models_to_come(self, parts: list[nn.Module], held: set[int]) -> list[nn.Module]:
        """The other models whose optimizers come next (:func:`models_to_come`: a GAN's generator
        beside the discriminator whose optimizer is built first), so the candidate is applied to
        both before the script computes. A module that holds a copy of the model (an EMA:
        ``AveragedModel``, timm's ``ModelEmaV3``, a ``copy.deepcopy``) follows the model instead."""
        coming = [m for m in models_to_come(held, parts) if m not in self._retired]
        if not coming:
            return []
        copied = {id(c) for part in parts for c in copies_of(part)}
        coming = [m for m in coming if not any(id(sub) in copied for sub in m.modules())]
        return find_models([id(p) for m in coming for p in m.parameters()], coming)

    def _register(self, optimizer: torch.optim.Optimizer) -> None:
        self.all.append(optimizer)
        self._last[optimizer] = self._lead_steps
        self._index()
        agent, klass_step = self.agent, type(optimizer).step
        update: list[Callable] = []  # the update as the candidate runs it, chosen at the first step

        def updating(opt: torch.optim.Optimizer, *args: Any, **kw: Any) -> Any:
            if not update:
                update.append(self.compiled_update(opt, klass_step) or klass_step)
            # (a closure, or GradScaler's arguments to a fused step: the optimizer's own, eager)
            return (klass_step if args or kw else update[0])(opt, *args, **kw)

        def step(opt: torch.optim.Optimizer, *args: Any, **kw: Any) -> Any:
            if agent.internal_calls:
                return updating(opt, *args, **kw)
            self._paces(opt)
            if agent.accumulation.holds_step(opt):  # a micro-batch before the last: gradients add up
                return None
            if opt is self.lead and agent.observers and not args and not kw:
                self.before_update()
            if not agent.routing:
                return updating(opt, *args, **kw)
            return self.routed_step(opt, klass_step, args, kw)

        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def compiled_update(self, optimizer: torch.optim.Optimizer, klass_step: Callable) -> Callable | None:
        """The step scope over a script (a plain loop the candidate's Policy runs): the optimizer's
        update compiled, as PyTorch's compiled-optimizer recipe has it (the model's forward is
        compiled beside it, the backward with it by AOTAutograd; the script's own loss code stays
        eager). A learning rate its scheduler changes recompiles once, then is traced as a value.
        None: the candidate compiles no update."""
        agent = self.agent
        if not (agent.loop and agent.candidate.compile and agent.candidate.compile_scope == "step"):
            return None
        compiled = torch.compile(lambda: klass_step(optimizer), mode=agent.candidate.compile)
        agent.framework_flags.setdefault("compiled", []).append(f"{type(optimizer).__name__}.step")
        return lambda opt: compiled()

    def routed_step(
        self, optimizer: torch.optim.Optimizer, klass_step: Callable, args: tuple, kw: dict
    ) -> Any:
        """The script's ``optimizer.step()`` in an injected plain loop: through the candidate's Policy
        (unscaled where it scales, skipped on inf/NaN gradients); the scale is updated once, when the
        step ends."""
        from mixprec.errors import MixprecError

        agent = self.agent
        agent.leave_autocast()
        closure = kw.get("closure", args[0] if args else None)
        if closure is not None:
            if agent.policy.scaler is not None:
                agent.fail(
                    "UnsupportedError",
                    f"optimizer.step(closure) ({type(optimizer).__name__}) under {agent.candidate.policy}: "
                    "a closure re-evaluates the loss inside the step, where loss scaling cannot reach it "
                    "(GradScaler refuses closures); use a *-mixed policy without loss scaling (bf16-mixed)",
                )
            # the closure's forward and backward are seen as any; the step is the optimizer's own
            return klass_step(optimizer, *args, **kw)
        self.starts(optimizer)
        if agent.policy.scaler is not None and not agent.window.backwards:
            agent.fail("UnsupportedError", no_backward(optimizer, agent.policy))
        if id(optimizer) in self._stepped:  # (a backward whose graph hid its parameters: see update_scale)
            self.update_scale(rescaling=optimizer)
        if agent.policy.scaler is not None and id(optimizer) not in self._unscaled:
            self._unscaling(optimizer)  # (its step unscales them)
        with agent.internal():
            try:
                found = agent.policy.step_optimizers([optimizer])[0]
            except MixprecError as exc:
                agent.fail(type(exc).__name__, f"the script's {type(optimizer).__name__}.step(): {exc}")
        agent.window.routed.append((optimizer, found))
        self._unscaled.add(id(optimizer))  # (stepped: its gradients are not read scaled again)
        self._read_unscaled.discard(id(optimizer))
        if agent.policy.scaler is not None:
            self._unscaled_grads.record(optimizer, self.agent)
            self._stepped.add(id(optimizer))  # (it steps again after a scale update)
        self.stepped(optimizer, skipped=found)
        return None

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Every optimizer step's pre-hook (the script's, or the Policy's for a routed step)."""
        agent = self.agent
        if optimizer is not self.lead:
            return
        if not agent.internal_calls:
            self.starts(optimizer)
        if agent.tracer is not None:
            half = agent.inject and agent.candidate.spec.param_dtype is not None
            agent.tracer.before_update(scale_now(agent), half)

    def before_update(self) -> None:
        """The lead optimizer is about to step (called before its step runs, outside the optimizer's
        own hooks, which an observer may register): the observers see the step's loss and batch."""
        agent = self.agent
        self.starts(self.lead)
        for observer in agent.observers:
            with agent.internal():
                observer.before_update(agent)

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.agent.internal_calls:
            self.stepped(optimizer, skipped=False)

    def starts(self, optimizer: Any) -> None:
        """The lead steps again with no forward or backward since: the last step ends here."""
        agent = self.agent
        if optimizer is self.lead and agent.window.lead_stepped:
            agent.boundary()
            agent.window.started = time.perf_counter()

    def stepped(self, optimizer: Any, skipped: bool) -> None:
        agent = self.agent
        if optimizer is self.lead:
            self._lead_steps += 1
            agent.window.lead_stepped = True
            agent.window.skipped |= skipped
            agent.patches.arm_forward()  # the model's next forward ends the step

    def reading_grad(self, tensor: torch.Tensor) -> None:
        """A gradient is read after a scaled backward (a clip, a norm, a log): its optimizer's
        gradients are unscaled first, once per step, as ``GradScaler.unscale_`` before clipping."""
        optimizer = self._owner.get(id(tensor))
        if optimizer is None and not self._indexed_this_step:
            self._index()  # (a group added since: a backbone unfrozen with add_param_group)
            optimizer = self._owner.get(id(tensor))
        if optimizer is None or id(optimizer) in self._unscaled or self.agent.accumulation.holding():
            return  # (mid-accumulation the sum stays scaled: the next micro-batch adds to it)
        self._unscaling(optimizer)
        self._unscaled.add(id(optimizer))
        self._read_unscaled.add(id(optimizer))
        with self.agent.internal():
            self.agent.policy.scaler.unscale_(optimizer)
        self._unscaled_grads.record(optimizer, self.agent)

    # ------------------------------------------------------------------ the scale within a step
    def before_scaled_backward(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """A backward the Policy scales is about to run. Where its gradients are for optimizers that
        all stepped since the last scale update, they step again: the scale is updated first, where
        the AMP recipe has to call ``scaler.update()`` (GradScaler steps an optimizer once per
        update): a WGAN's critic stepped n times per generator step, the generator's optimizer the
        lead. A backward that also reaches one yet to step (the generator's, through the critic)
        is the iteration's own: its one update comes when the step ends, as the recipe's does."""
        if self._read_unscaled:
            self._refuse_a_second_pass(outputs)
        if not self._stepped:
            return
        reached = False
        for opt in reached_optimizers(outputs, self._owner):  # (walked as far as needed only)
            if id(opt) not in self._stepped:
                return  # (what it leaves on the others is not for their step: as in the recipe)
            reached = True
        if reached:  # (a graph that hides every parameter: updated at the optimizer's next step)
            self.update_scale()

    def _refuse_a_second_pass(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """A scaled backward reaches an optimizer whose gradients a read unscaled and that has not
        stepped since (SAM's two passes: the first's gradients read, then a second backward): its
        gradients would mix the two scales, and GradScaler unscales an optimizer once per update."""
        for opt in reached_optimizers(outputs, self._owner):
            if id(opt) in self._read_unscaled:
                self.agent.fail("UnsupportedError", second_pass(self.agent, opt))

    def update_scale(self, rescaling: torch.optim.Optimizer | None = None) -> None:
        """The scale updated within the step, for the optimizers stepped since the last update.
        ``rescaling``: an optimizer about to step again on gradients made at the scale before (the
        backward hid its parameters from :func:`reached_optimizers`, or reached one yet to step
        too): they are brought to the new scale, a power of two apart, so exactly as if made after
        the update where it grew; where it backed off, they were made at the scale that overflowed,
        and the step skips again where they overflow again (the recipe's, at the lower scale, might
        not). A read of gradients is no such moment: what it reads may be no step's (a
        generator's backward leaves some on the critic), as in the recipe."""
        from mixprec.policy.stepping import update_scale

        agent = self.agent
        scaler = agent.policy.scaler
        found = [f for o, f in agent.window.routed if id(o) in self._stepped]
        with agent.internal():
            before = scaler.get_scale() if rescaling is not None else None  # (a host read: only then)
            update_scale(agent.policy, any(found))
            factor = scaler.get_scale() / before if rescaling is not None and before else 1.0
            if rescaling is not None and factor != 1.0:
                grads = [p.grad for g in rescaling.param_groups for p in g["params"] if p.grad is not None]
                torch._foreach_mul_(grads, factor)
        self._stepped.clear()
        self._unscaled.clear()
        self._unscaled_grads.clear()
        self._read_unscaled.clear()

    def end_step(self, routed: list[tuple[torch.optim.Optimizer, bool]]) -> bool:
        """The step's routed optimizer steps end: the scale updated where it was not since the last
        of them (:meth:`update_scale`), the Policy's statistics; whether any of them skipped."""
        found = [f for _, f in routed]
        self.agent.policy.end_step([o for o, _ in routed], found, update=bool(self._stepped))
        return any(found)

    def _unscaling(self, optimizer: torch.optim.Optimizer) -> None:
        """GradScaler is about to unscale ``optimizer``'s gradients. Those of its parameters another
        optimizer holds too, unscaled through that one since the last update (a clip's read before
        a second phase's first step, the other optimizer holding the model still), are scaled back
        first (a power of two: exact), so each gradient is unscaled once."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with self.agent.internal():  # (its own reads of .grad)
            again = [p.grad for p in params if self._unscaled_grads.holds(p)]
            if again:
                torch._foreach_mul_(again, float(self.agent.policy.scaler.get_scale()))

    def new_step(self) -> None:
        self._unscaled.clear()
        self._unscaled_grads.clear()
        self._read_unscaled.clear()
        self._stepped.clear()
        self._indexed_this_step = False

    def _index(self) -> None:
        """Which optimizer each parameter is in, as their groups hold them now (a group added or
        its parameters replaced since: read again where a gradient it did not know is read)."""
        owners = [*self._let_go, *self.all]  # (a parameter two hold: the one built, or taken back, last)
        self._owner = {id(p): opt for opt in owners for group in opt.param_groups for p in group["params"]}
        self._indexed_this_step = True  # (a gradient of no optimizer's, read each step: once a step)


def reached_optimizers(
    outputs: tuple[torch.Tensor, ...], owner: dict[int, torch.optim.Optimizer]
) -> Iterator[torch.optim.Optimizer]:
    """The optimizers (``owner``: id(parameter) -> its optimizer) whose parameters a backward from
    ``outputs`` accumulates gradients into, each once, as a walk of the autograd graph toward its
    leaves reaches them (it goes no further than asked). A reentrant checkpoint's node stands for
    the module it recomputes (whose weights are leaves of the graph its own backward makes)."""
    found: set[int] = set()
    seen: set[Any] = set()
    todo: list[Any] = [out.grad_fn for out in outputs if out.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # (an AccumulateGrad: a leaf's)
        run = getattr(node, "run_function", None)  # (CheckpointFunction's: what it recomputes)
        leaves = [variable] if variable is not None else []
        for module in modules_called(run) if run is not None else ():
            leaves += list(module.parameters())
        for param in leaves:
            opt = owner.get(id(param))
            if opt is not None and id(opt) not in found:
                found.add(id(opt))
                yield opt
        todo.extend(child for child, _ in node.next_functions)


class UnscaledGrads:
    """The gradient tensors GradScaler unscaled since the last update, at the version it left them
    (a later backward into one, or a new one after ``zero_grad``, is scaled again)."""

    def __init__(self) -> None:
        # id(param) -> its gradient then (weakly: a new one may take a freed one's id) and version
        self._grads: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

    def record(self, optimizer: torch.optim.Optimizer, agent: Agent) -> None:
        with agent.internal():  # (the agent's own reads of .grad)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._grads[id(p)] = (weakref.ref(p.grad), p.grad._version)

    def holds(self, param: torch.Tensor) -> bool:
        grad, then = param.grad, self._grads.get(id(param))
        return grad is not None and then is not None and then[0]() is grad and then[1] == grad._version

    def clear(self) -> None:
        self._grads.clear()


def _scalers(agent: Agent) -> list[Any]:
    """The loss scalers of this step: the candidate's Policy's where it routes, or the script's own."""
    scalers = [agent.policy.scaler] if agent.routing and agent.policy.scaler is not None else []
    return scalers + [s for s in agent.own.scalers if s.is_enabled()]


def scale_now(agent: Agent) -> float | None:
    """The loss scale the lead's gradients carry now (None: none, or already unscaled: by a read
    of them, or by GradScaler.step itself before it steps)."""
    scalers = _scalers(agent)
    if not scalers or scaler_state.unscaled(scalers[0], agent.optimizers.lead):
        return None
    return float(scalers[0].get_scale())


def scale_after(agent: Agent) -> float | None:
    """The loss scale after this step's update."""
    scalers = _scalers(agent)
    return float(scalers[0].get_scale()) if scalers else None


def modules_called(function: Any) -> list[nn.Module]:
    """The modules a function a reentrant checkpoint recomputes calls, as far as its object says:
    the module itself, a module's method, or those a function's closure or named globals hold (an
    object's there: one level of its attributes; HF's ``create_custom_forward(module)``)."""
    if isinstance(function, nn.Module):
        return [function]
    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        return [owner]
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    values = [cell.cell_contents for cell in cells if cell.cell_contents is not None]
    if code is not None:
        names = getattr(function, "__globals__", {})
        values += [names[name] for name in code.co_names if name in names]
    if owner is not None:
        values.append(owner)
    found = [v for v in values if isinstance(v, nn.Module)]
    for value in values:
        if not isinstance(value, (nn.Module, type, types.ModuleType)) and hasattr(value, "__dict__"):
            found += [v for v in vars(value).values() if isinstance(v, nn.Module)]
    return found


def second_pass(agent: Agent, optimizer: torch.optim.Optimizer) -> str:
    """Why a backward into gradients a read unscaled, before their optimizer steps, stops the script."""
    return (
        f"the script reads {type(optimizer).__name__}'s gradients, then runs another backward into "
        f"them before it steps (SAM's two passes) under {agent.candidate.policy}: loss scaling "
        "unscales an optimizer's gradients once per step; use a policy without a loss scale (bf16-mixed)"
    )


def still_trained(agent: Agent, optimizer: torch.optim.Optimizer) -> str:
    """Why an optimizer of a model the script was taken to be done with, stepped again, stops it."""
    return (
        f"the script steps {type(optimizer).__name__} of a model it trained before its current one "
        f"({describe(agent.model)}), after it built that: mixprec applies a candidate to one model at a "
        "time; train them in two runs (the first saves the model the second loads), or build both "
        "before the first optimizer"
    )


def second_model(agent: Agent, owner: nn.Module, began: bool, held: bool) -> str:
    """Why the script's optimizer over ``owner``, a model built after the first optimizer, is
    refused: ``began``: the first model had trained; ``held``: the script still holds it."""
    model, new = describe(agent.model), type(owner).__name__
    if not began:
        return (
            f"the script trains a second model ({new}, beside {model}) that was not yet built, or not "
            "handed to an optimizer in its code, when the first optimizer was: mixprec applies the "
            "candidate to the models there are then; build every model, then their optimizers, each "
            "as optim.Adam(netG.parameters(), ...) (the DCGAN tutorial's order), or put them in one "
            "nn.Module"
        )
    steps = len(agent.steps) + agent.window.lead_stepped  # (the last one's end is the next forward)
    after = f"the script trains a new model ({new}) after {steps} steps of {model}"
    if held:
        return (
            f"{after}, which it still holds (a teacher for the new one?): mixprec applies a candidate "
            "to one model at a time, and to the models there are at the first optimizer; train them "
            "in two runs (the first saves the model the second loads), or build both first"
        )
    doing = "watches" if agent.observers else "checks"
    return (
        f"{after} (one model after another: k-fold's folds, a sweep's runs): mixprec {doing} one "
        "model's steps; have the script train one model here (one fold: an argument for it), or the "
        "first model for more steps (`mixprec run` trains each model in turn under the candidate)"
    )


def no_backward(optimizer: torch.optim.Optimizer | None, policy: Any) -> str:
    """Why a step whose gradients no ``backward()`` made cannot be measured (``policy``: the
    candidate's, None where the script's own loop is not run by one)."""
    return (
        f"the script's {type(optimizer).__name__} stepped with no backward() mixprec saw: its "
        "gradients come from elsewhere (torch.func.grad, torch.autograd.grad), where mixprec can "
        f"read no loss to compare{' nor scale one' if policy and policy.scaler else ''}; "
        "compute them with loss.backward() to have the script measured and checked"
    )
