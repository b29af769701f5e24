"""The script agent installed in this process (``mixprec run``'s mode) around a loop or a script the
test runs itself: ``with under("bf16-mixed") as agent: <the loop>``. The agent patches torch
process-wide; ``under`` puts torch back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from mixprec.frameworks.script.agent import Agent
from mixprec.frameworks.script.messages import Plan
from mixprec.policy import Candidate


class Exited(Exception):
    """The agent ended the script (``os._exit`` in a real run)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _exit(code: int) -> None:
    raise Exited(code)


@contextlib.contextmanager
def under(
    policy: str,
    mode: str = "run",
    observers: Sequence[Any] = (),
    optimizer: str | None = None,
    compile: str | None = None,
    compile_scope: str | None = None,
    keep_fp32: tuple[str, ...] = (),
    **plan: Any,
) -> Iterator[Agent]:
    """A loop in the body runs under an injected ``policy`` (``"P (as written)"``: the script's own),
    its optimizers built with the ``optimizer`` implementation where one is named, compiled where
    ``compile`` names a mode (``compile_scope="step"``: the optimizers' updates too)."""
    as_written = policy.endswith(" (as written)")
    name = policy.removesuffix(" (as written)")
    candidate = Candidate(
        name,
        framework="script",
        as_written=as_written,
        optimizer=optimizer,
        compile=compile,
        compile_scope=compile_scope,
        keep_fp32=keep_fp32,
    )
    agent = Agent(Plan(mode=mode, candidate=candidate.to_dict(), seed=None, **plan), exit=_exit)
    agent.observers.extend(observers)
    agent.install()
    try:
        yield agent
        agent.finish_run()  # the last step ends, as at the script's exit
    finally:
        agent.uninstall()


class Losses:
    """An observer of the agent that keeps each step's loss (run mode reads none itself)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def discovered(self, agent: Agent) -> None: ...

    def forward(self, agent: Agent, args: tuple, kwargs: dict) -> None: ...

    def before_update(self, agent: Agent) -> None: ...

    def step(self, agent: Agent, loss: Any, skipped: bool) -> None:
        self.losses.append(float(loss))

    def new_model(self, agent: Agent) -> str | None: ...

    def summary(self) -> dict[str, Any]:
        return {}
