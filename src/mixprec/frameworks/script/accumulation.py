"""Gradient accumulation in a script's own loop: ``k`` iterations of the loop as one optimizer step.

The plan's ``accumulate`` (``tune --batch auto`` at micro-batch ``m``, ``mixprec run --accumulate
K``) asks that the script, run at a ``k`` times smaller batch, train as it does at its own: the
gradient of each micro-batch's loss divided by ``k`` (at ``backward``), and every call that would
end the accumulation early held for the first ``k - 1`` iterations: the optimizers' ``step``, their
and the model's ``zero_grad``, the script's GradScaler ``unscale_``/``step``/``update``, the LR
scheduler's ``step`` and a gradient clip (clipped once, on the summed gradients, as the
accumulation recipe clips). The optimizer then steps once per ``k`` micro-batches over the summed
gradients, and the agent's step (:class:`~.agent.Window`) spans them: its samples add up.

An iteration is delimited by the lead optimizer's ``step``: the ``k``-th since the last update
applies it. The HF Trainer and Lightning accumulate themselves (their switch is set instead:
:mod:`.frameworks`), so there this holds nothing.
"""

from __future__ import annotations

from typing import Any

Agent = Any  # mixprec.frameworks.script.agent.Agent (which imports this module)

IDLE, MICRO, HELD, STEPPED = "idle", "micro", "held", "stepped"


class Accumulation:
    """The agent's count of micro-batches toward the next optimizer update (module docstring)."""

    def __init__(self, agent: Agent, steps: int) -> None:
        self.agent, self.steps = agent, steps
        self.held = 0  # lead steps held since the last update
        # idle: nothing since the start; micro: a backward since the lead's last step; held /
        # stepped: the lead's last step call was held / applied, and no backward since
        self.phase = IDLE

    @property
    def on(self) -> bool:
        """The agent accumulates: more than one micro-batch a step, in a loop it steps itself."""
        from mixprec.frameworks.script.frameworks import HF, LIGHTNING

        return self.steps > 1 and self.agent.framework not in (HF, LIGHTNING)

    @property
    def loss_factor(self) -> float:
        """What each micro-batch's loss is multiplied by at ``backward`` (the mean over ``k``)."""
        return 1.0 / self.steps if self.on else 1.0

    def backward(self) -> None:
        """A micro-batch's backward: its iteration's lead step is still to come."""
        self.phase = MICRO

    def holding(self) -> bool:
        """Whether a call that ends an accumulation (a zero_grad, a scheduler's step, a clip, an
        unscale) is to be held now: after a held lead step, or inside an iteration that will be one."""
        if not self.on:
            return False
        return self.phase == HELD or (self.phase == MICRO and self.held < self.steps - 1)

    def holds_step(self, optimizer: Any) -> bool:
        """Whether ``optimizer.step()`` is held. The lead's decides the iteration (once: a GradScaler's
        step and the optimizer's own inside it are one call); another optimizer follows it."""
        if not self.on:
            return False
        if optimizer is not self.agent.optimizers.lead:
            return self.holding()
        if self.phase in (HELD, STEPPED):
            return self.phase == HELD
        if self.held < self.steps - 1:
            self.held += 1
            self.phase = HELD
            return True
        self.held, self.phase = 0, STEPPED
        return False
