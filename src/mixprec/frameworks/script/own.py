"""The script's own precision code, overridden by the candidate and never stacked on it.

A script that writes ``torch.autocast``, a ``GradScaler`` or mixprec's own ``Policy`` keeps them: what
it asked for is recorded (its precision *as written*), and under an injected candidate in a plain
loop each takes the candidate's settings: an enabled autocast its dtype (or none), an outermost
disabled one (``autocast(enabled=use_amp)``) the candidate's autocast, a GradScaler enabled exactly
when the candidate scales the loss, a Policy built as the candidate. :mod:`.patches` calls these
where torch and mixprec construct and enter them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mixprec.frameworks.script import scaler_state
from mixprec.frameworks.script.frameworks import MIXPREC, PLAIN

Agent = Any  # mixprec.frameworks.script.agent.Agent (which imports this module)


class OwnPrecision:
    """The script's own AMP as one agent sees it (module docstring)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        # what the script asks for itself (Facts.own): its autocasts, a scaler, its framework's switches
        self.as_written: dict[str, Any] = {"autocast": [], "scaler": None, "framework": {}}
        self.scalers: list[Any] = []  # the GradScalers the script made
        self.autocast_depth = 0  # the script's own autocast contexts entered (and not left)
        self.scaled: set[int] = set()  # ids of the losses the script's own enabled scaler scaled
        self.unscaled_loss: dict[int, torch.Tensor] = {}  # id(scaled loss) -> the loss it scaled

    @property
    def overrides(self) -> bool:
        """The candidate's settings replace the script's (an injected candidate, a plain loop)."""
        return self.agent.inject and self.agent.framework == PLAIN

    def scaling(self) -> bool:
        """The script's own GradScaler scales this step (enabled by the candidate or as written)."""
        return any(s.is_enabled() for s in self.scalers)

    def new_step(self) -> None:
        self.scaled, self.unscaled_loss = set(), {}

    # ------------------------------------------------------------------ torch.autocast
    def autocast(self, device_type: str, dtype: torch.dtype | None) -> tuple[torch.dtype | None, bool]:
        """An enabled ``torch.autocast`` the script makes: its (dtype, enabled) under the candidate."""
        if self.agent.framework != PLAIN:  # a framework's own autocast: its switch is the precision
            return dtype, True
        self.as_written["autocast"].append({"device_type": device_type, "dtype": str(dtype)})
        if self.agent.inject:
            wanted = self.agent.candidate.spec.autocast_dtype
            return (wanted if wanted is not None else dtype), wanted is not None
        return dtype, True

    def autocast_enters(self, ctx: Any) -> None:
        """The script enters one of its autocast contexts. An outermost disabled one is its AMP
        switched off: the candidate's autocast runs there; a disabled one inside an autocast is a
        region the script keeps in fp32."""
        self.autocast_depth += 1
        wanted = self.agent.candidate.spec.autocast_dtype
        outermost = self.autocast_depth == 1 and not torch.is_autocast_enabled(ctx.device)
        if self.overrides and wanted is not None and outermost and not ctx._enabled:
            ctx._enabled, ctx.fast_dtype = True, wanted

    # ------------------------------------------------------------------ GradScaler
    def scaler(self, scaler: Any, enabled: bool) -> bool:
        """A GradScaler the script makes: enabled exactly when the candidate scales the loss with
        fp32 weights (a *-true candidate's scaling is its Policy's: GradScaler refuses to unscale
        half gradients)."""
        self.as_written["scaler"] = self.as_written["scaler"] or enabled
        self.scalers.append(scaler)
        if self.overrides:
            spec = self.agent.candidate.spec
            return spec.loss_scaling and spec.param_dtype is None
        return enabled

    def loss_scaled(self, scaler: Any, loss: torch.Tensor, scaled: torch.Tensor) -> None:
        """The script's GradScaler scaled ``loss``: its backward records the loss unscaled."""
        self.unscaled_loss[id(scaled)] = loss
        if scaler.is_enabled():  # a disabled scaler hands the loss back: it is still to scale
            self.scaled.add(id(scaled))

    def scaler_stepped(self, scaler: Any, optimizer: Any) -> None:
        """The script's GradScaler stepped ``optimizer``, or skipped it (inf/NaN gradients: no
        ``optimizer.step()`` ran, so no step hook said it)."""
        if scaler.is_enabled() and scaler_state.found_inf(scaler, optimizer):
            self.agent.optimizers.stepped(scaler_state.torch_optimizer(optimizer), skipped=True)

    # ------------------------------------------------------------------ mixprec's own Policy
    def patch_policy(self) -> None:
        """A script that builds mixprec's own Policy: built under the candidate (the policy it asked
        for is its precision as written), and it runs the loop's precision itself."""
        from mixprec.policy.policy import Policy

        agent, own, original = self.agent, self, Policy.__init__

        def __init__(policy: Any, config: Any) -> None:
            if agent.internal_calls:
                return original(policy, config)
            agent.framework = MIXPREC
            own.as_written["framework"] = {"mixprec": config.name}
            if agent.inject:
                from mixprec.policy import get_policy

                with agent.internal():
                    config = get_policy(agent.torch_candidate, device=config.device, check=False).config
                agent.framework_flags = {"mixprec": config.name}
            return original(policy, config)

        agent.patches.replace(Policy, "__init__", __init__)


def as_torch(candidate: Any) -> Any:
    """The same candidate as a torch one: what the script's torch model runs under."""
    return dataclasses.replace(candidate, framework="torch", as_written=False)


def compute_dtype(candidate: Any, device: str) -> str:
    """The dtype ``candidate``'s matmuls compute in on ``device`` ("bfloat16"): what the honesty
    checks of both ends expect the script's first matmul/conv layer to have computed in."""
    from mixprec.policy import get_policy

    policy = get_policy(as_torch(candidate), device=device, check=False)
    return str(policy.compute_dtype).removeprefix("torch.")
