"""The Linear census of a script's model (:mod:`mixprec.frameworks.torch.linears`), taken in the
script's own process over its own first step: what a low-format policy (fp8, MXFP8, NVFP4) would
convert, each layer's GEMM shapes, FLOPs and quantised-operand SQNR on the script's data; and for
every low format, which Linear layers it can take (what tune predicts and what it says it cannot).

The parent asks for it by an environment variable on one strict-fp32 traced run
(:func:`mixprec.frameworks.script.session.take_census`);
the traced run's :class:`~mixprec.frameworks.script.tracing.Tracer` reads it (:func:`from_env`)
and writes the census as JSON beside the trace record at the first step's end.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from mixprec.policy.registry import POLICIES, POLICY_NAMES

if TYPE_CHECKING:  # (imported where a census is taken: every traced run reads this module)
    from mixprec.frameworks.torch.linears import LinearCensus

CENSUS_ENV = "MIXPREC_SCRIPT_CENSUS"  # {"policy", "keep_fp32", "out"} as JSON: a census is asked for


@dataclass
class Convertible:
    """What one low format would convert of the script's model.

    Attributes:
        low: the Linear layers its kernels take, in model order.
        refused: the others, each with why and the fix (:func:`mixprec.policy.lowformat.refusal`).
    """

    low: list[str]
    refused: dict[str, str]


@dataclass
class ScriptCensus:
    """A census of the script's first step: the asked format's :class:`LinearCensus`, and per low
    format (policy name) what it would convert."""

    census: LinearCensus
    formats: dict[str, Convertible]


# ---------------------------------------------------------------------- the script's process
class Taking:
    """The census hooks on the script's model (fp32: the run is strict fp32's) and a FLOP counter
    over its first step, from the model's discovery to the step's end (:meth:`finish`)."""

    def __init__(self, model: nn.Module, request: dict[str, Any]) -> None:
        from mixprec.frameworks.torch.flops import StepFlops
        from mixprec.frameworks.torch.linears import Recorder
        from mixprec.policy.lowformat import plan_layers

        keep_fp32 = tuple(request.get("keep_fp32") or ())
        self.out = str(request["out"])
        self.formats = {}
        for name in _low_formats():
            plan = plan_layers(model, POLICIES[name], keep_fp32)
            self.formats[name] = Convertible(list(plan.low), dict(plan.refused))
        self.flops = StepFlops()
        self.recorder = Recorder(model, POLICIES[request["policy"]], keep_fp32, quiet=self.flops.paused)
        self.recorder.install()
        self.flops.__enter__()

    def finish(self) -> None:
        """The first step ended: the hooks off, the census written (whole: beside, then moved)."""
        self.flops.__exit__(None, None, None)
        found = self.recorder.remove()
        found.step_flops = float(self.flops.total)
        data = {
            "census": found.to_dict(),
            "formats": {n: dataclasses.asdict(c) for n, c in self.formats.items()},
        }
        part = f"{self.out}.{os.getpid()}.part"
        with open(part, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(part, self.out)


def from_env(model: nn.Module) -> Taking | None:
    """The census the parent asked this run for, its hooks installed; None where it asked none."""
    request = os.environ.get(CENSUS_ENV)
    return Taking(model, json.loads(request)) if request else None


def _low_formats() -> list[str]:
    return [n for n in POLICY_NAMES if POLICIES[n].low_format is not None]
