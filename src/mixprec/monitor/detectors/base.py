"""The interface of a detector: what it sees of the run (:class:`Run`), of a step
(:class:`StepView`) and of a sampled step (:class:`SampleView`), and how it reports (:meth:`Run.report`).

A detector looks for one kind of trouble. The :class:`~mixprec.monitor.Monitor` owns the run's
state (the losses, the loss scale, the sampled ranges, the findings, the actions); detectors read
it and report, and the Monitor decides what becomes of a report (a finding, an action, a stop). To
add one: subclass :class:`Detector` in a module of its own, override the hooks it needs
(:meth:`~Detector.on_update`, :meth:`~Detector.on_suspect`, :meth:`~Detector.on_step`,
:meth:`~Detector.on_sample`), and add it to :func:`mixprec.monitor.detectors.detectors_for`
(:mod:`~mixprec.monitor.detectors.spike` is one that acts before the update lands).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from mixprec.monitor.config import MonitorConfig
from mixprec.monitor.findings import MonitorFinding
from mixprec.monitor.rescue import Rescuer
from mixprec.monitor.sampler import Sampler
from mixprec.monitor.scale import ScaleWatch
from mixprec.numerics.trend import LayerSeries
from mixprec.policy import Policy

LossFn = Callable[[nn.Module, Any], torch.Tensor]
Action = Callable[[], str]
"""A rescue: changes the run and says what it did ('' when it could not)."""

FEED = 32  # steps between two calls of on_losses where the host holds the losses (a CPU run)
SKIP = "skip"  # a skipped step below the scale the run settled at (not GradScaler's own rhythm)
NONFINITE = "nonfinite"  # a non-finite loss the host holds on a step the scaler did not skip
# a non-finite loss on a step the loss scaler skipped in its own rhythm (its start-up search, one
# back-off): the data's where the fp32 shadow is not finite either, else the scaler's job
SCALER_SKIPPED_NONFINITE = "scaler_skipped_nonfinite"


class Run(Protocol):
    """What a detector sees of the run (the :class:`~mixprec.monitor.Monitor` is one). Read it,
    never change it: the run changes only through an action passed to :meth:`report`."""

    model: nn.Module
    policy: Policy | None
    optimizers: list[torch.optim.Optimizer]
    loss_fn: LossFn | None
    """``loss_fn(model, batch)``, for shadows and to locate a fault (None: the loop gave none)."""
    config: MonitorConfig
    scale: ScaleWatch
    """What the loss scaler did: the steps skipped, the scale now and the level it settled at."""
    sampler: Sampler
    """The sampled steps: per-layer range series, stalled-update shares, the interval."""
    rescuer: Rescuer
    """The actions a report may ask for (``rescuer.action("island", module)``, ``rescuer.action("to_bf16")``,
    ...: named, so that data-parallel ranks take the same one)."""
    range_format: str | None
    """The low-precision format whose range the policy computes in ('fp16', 'bf16'), or None."""
    control_batch: Any
    """The latest batch whose loss was normal (None: none yet): replayed beside a suspect batch, it
    tells a bad batch from weights that fail on any batch (a run that diverges in fp32 too)."""

    @property
    def data_parallel(self) -> bool:
        """Whether the run's ranks hold all-reduced gradients and take its decisions together (a
        replay's gradients are then this rank's alone)."""
        ...

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's own precision context, to replay a batch in it: the policy's autocast, a plain
        loop's (fp16 where it has a GradScaler), or the framework's (an adapter passes it)."""
        ...

    @property
    def every(self) -> int:
        """The steps between two sampled steps now."""
        ...

    def read_losses(self) -> list[float]:
        """Every step's loss so far (reads the ones still on the device: a sync; sampled steps only)."""
        ...

    def report(
        self,
        finding: MonitorFinding,
        rescue: Action | None = None,
        *,
        per_module: bool = True,
        local: Action | None = None,
        dedupe: bool = True,
    ) -> bool:
        """Record ``finding`` and, with ``rescue=True`` in the config, run ``rescue`` (when ``hold``
        steps have passed since the last action; with ``max_rescues`` spent the run is stopped
        instead). The same kind about the same module (any module: ``per_module=False``) within
        ``hold`` steps is no news: nothing is recorded and it returns False (``dedupe=False``: each
        is news, a spike on its own step). ``local``: an action on this step's update only
        (withhold it, retry it), which changes nothing about the run: with ``rescue=True`` it runs
        whatever ``hold`` and ``max_rescues`` say, is not counted, and what it did is the finding's
        ``action``."""
        ...

    def stop(self, finding: MonitorFinding, why: str) -> None:
        """Stop the run now, whatever ``rescue`` says, for a cause no rescue answers (a broken data
        pipeline): a ``stop`` finding that names ``finding`` and ``why``."""
        ...


@dataclass(slots=True)
class StepView:
    """One step, after its optimizer step, as the detectors see it: host values only, nothing that
    syncs a device."""

    step: int
    """The step, counted from 0."""
    skipped: bool
    """The loss scaler skipped it: the weights did not move."""
    loss: float | None
    """Its loss where the host holds it already (a CPU run); None where it is still on the device
    (read at the next sampled step)."""
    batch: Any
    """Its batch, for a shadow; None where the loop gave none or the monitor has no ``loss_fn``. Valid
    for this call only."""
    suspect: str | None
    """Why the step needs explaining: :data:`SKIP`, :data:`NONFINITE`,
    :data:`SCALER_SKIPPED_NONFINITE`, or None (a normal step)."""
    explained: bool = False
    """A suspect step a detector has explained (poisoned weights, a bad batch, an overflow)."""


@dataclass(slots=True)
class UpdateView:
    """One step after its backward and before the optimizer applies its update, as the loop handed
    it over (:meth:`~mixprec.monitor.Monitor.before_step`): host values only, read where the host
    holds them already or the loop has just synchronised (a GradScaler's inf check)."""

    step: int
    loss: float | None
    """Its loss (None where reading it would add a device sync)."""
    grad_norm: float | None
    """Its gradient norm, where the loop handed it over or ``spike_grad_norm`` computes it."""
    batch: Any
    """Its batch, to replay from the same weights (None: the loop gave none, or no ``loss_fn``)."""
    batch_index: int | None
    """Where the loop gives it, the batch's index (what a skip list names)."""
    landed: bool = False
    """The update has landed already: the loop handed nothing over before it, so the view is made
    after the step (a loss the host holds, no batch) and a spike can only be reported, undiagnosed;
    a non-finite loss there is the overflow path's."""


@dataclass(slots=True)
class SampleView:
    """A sampled step, after the sampler recorded it: the losses since the last one are read."""

    step: int
    losses: Sequence[float]
    """The losses of the steps since the last sampled step, this one included; ``losses[i]`` is
    the loss of step ``start + i``."""
    start: int
    judged: set[int]
    """Steps whose loss a finding has judged already (skipped, or explained)."""
    islands: tuple[str, ...]
    """Modules that compute in fp32 now: their ranges are fp32's and cannot overflow the policy's."""
    series: list[LayerSeries]
    """Every layer's range series, the fp32 islands' left out."""
    explained: bool = False
    """A detector before this one has explained the sample (poisoned weights, a non-finite loss
    since the last one): the trends on it are not news."""

    def first_nonfinite(self) -> int | None:
        """The first step since the last sample whose loss is not finite and not judged yet."""
        return next(
            (
                self.start + i
                for i, v in enumerate(self.losses)
                if not math.isfinite(v) and self.start + i not in self.judged
            ),
            None,
        )


class Detector:
    """One kind of trouble, looked for on suspect steps, on every step and/or at sampled steps.

    Before the optimizer applies a step's update (where the loop handed its loss and batch over and
    the loss is above a detector's :attr:`quiet_below`), the Monitor asks :meth:`on_update` until
    one explains the step; an action it reports may withhold or replace the update
    (:meth:`~mixprec.monitor.rescue.Rescuer.withhold`, :meth:`~mixprec.monitor.rescue.Rescuer.retry`).
    The losses reach :meth:`on_losses` in batches. After each optimizer step it asks, in their
    order (:func:`~mixprec.monitor.detectors.detectors_for`):

    1. :meth:`on_suspect`, only on a step that needs explaining (``view.suspect``: a skip below the
       scale the run settled at, a non-finite loss the host holds), until one explains it (returns
       True): what blames the weights or the batch comes before what blames the precision;
    2. :meth:`on_step`, every step: it must be cheap and stay on the host (``view.explained`` says
       whether step 1 explained the step);
    3. :meth:`on_sample`, at a sampled step, after the sampler recorded it: a hook that returns True
       has explained the sample, and the detectors after it see ``view.explained`` (the trends of a
       run whose weights or loss are already non-finite are not news).

    A detector reports a finding with ``run.report(finding, action)``, the action a
    :class:`~mixprec.monitor.rescue.Rescuer` method (or None: an alert only); whether the action
    runs is the Monitor's to decide (``rescue``, ``hold``, ``max_rescues``; spent, it stops the
    run). A detector's own state (a start-up baseline) goes in :meth:`state_dict`, merged into the
    Monitor's, so a resumed run judges as the straight one.
    """

    kinds: ClassVar[tuple[str, ...]] = ()
    """The kinds of finding it reports (:data:`mixprec.monitor.findings.KINDS`)."""

    quiet_below: float = -math.inf
    """An :meth:`on_update` detector's quick test: a loss at or below it (and no gradient norm)
    needs no look before the update, and the Monitor does not ask (one comparison on a normal
    step); the detector keeps it current. -inf: ask every step."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config

    def on_update(self, run: Run, view: UpdateView) -> bool:
        """Look at a step before its update lands (cheap on a normal step: host values only); True:
        explained, the detectors after it are not asked, and the step is not suspect afterwards."""
        return False

    def on_suspect(self, run: Run, view: StepView) -> bool:
        """Look at a suspect step; True: explained, the detectors after it are not asked."""
        return False

    def on_losses(self, run: Run, start: int, losses: Sequence[float], judged: set[int]) -> None:
        """The losses of the steps from ``start`` on, in batches: every :data:`FEED` steps where the
        host holds them (a CPU run), else at the sampled steps that read them; ``judged``: steps a
        finding or a skip judged already. For a running range of them, cheap per value (a hot loop
        instead of a cold line each step)."""

    def on_step(self, run: Run, view: StepView) -> bool:
        """Look at one step (every step: cheap, host values only); True: explained."""
        return False

    def on_sample(self, run: Run, view: SampleView) -> bool:
        """Look at a sampled step; True: the sample is explained."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this detector (its keys join the Monitor's state)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from the Monitor's state (this detector's keys in it)."""
