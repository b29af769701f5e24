"""After training under DDP/FSDP2: did every rank take the same skip decisions?"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mixprec.errors import MixprecError, PolicyError
from mixprec.policy.policy import Policy

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class StatsMismatchError(MixprecError, RuntimeError):
    """Ranks disagree on steps, skipped steps or the loss scale: their weights have diverged."""

    exit_code = 4

    def __init__(self, message: str, per_rank: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.per_rank = per_rank


def assert_stats_agree(policy: Policy, group: ProcessGroup | None = None) -> dict[str, Any]:
    """All-gather steps, skipped steps, last skipped step and scale; raise if any rank differs.

    A collective: call it on every rank of ``group``. Returns this rank's values. Without an
    initialised process group there is one rank, which trivially agrees with itself.
    """
    import torch.distributed as dist

    if not isinstance(policy, Policy):
        raise PolicyError(f"assert_stats_agree takes a mixprec Policy, got {type(policy).__name__}.")
    stats = policy.stats
    mine = {
        "steps": stats.steps,
        "skipped_steps": stats.skipped_steps,
        "last_skipped_step": stats.last_skipped_step,
        "scale": stats.scale,
    }
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if any(other != gathered[0] for other in gathered[1:]):
        keys = [k for k in mine if len({repr(g[k]) for g in gathered}) > 1]
        shown = "; ".join(
            f"rank {r}: " + ", ".join(f"{k}={g[k]}" for k in keys) for r, g in enumerate(gathered)
        )
        raise StatsMismatchError(
            f"Ranks disagree on {', '.join(keys)} ({shown}): their weights have diverged. Every rank "
            "must run policy.step() on every iteration, with the gradients DDP/FSDP2 synchronised.",
            per_rank=gathered,
        )
    return mine
