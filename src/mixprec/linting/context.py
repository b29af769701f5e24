"""What a rule may look at: the traced forward pass, the policy, the device and the target."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from mixprec.hardware.device import DeviceInfo
from mixprec.linting.trace import COMPUTE_TYPES, ModuleRecord, Trace
from mixprec.policy import Policy
from mixprec.policy.islands import is_fp32_island
from mixprec.workload import Workload

# A layer doing at least this share of the model's matmul/conv FLOPs is worth a warning.
WARNING_SHARE = 0.01
# The image stem: the first convolution, when it takes at most this many channels.
STEM_CHANNELS = 4
# Elements per 16 bytes, what tensor cores read at once, per compute format.
# fp8 policies run only eligible Linear layers in fp8 (MP109 judges those); the rest is bf16.
_ALIGNMENT = {"fp16": 8, "bf16": 8, "tf32": 4, "fp8": 8}


@dataclass
class LintContext:
    """Everything a rule may look at. Built by the runner; rules only read it.

    Attributes:
        workload: the workload linted.
        policy: the policy it is judged under.
        device: the device the policy runs on.
        target: 'cuda' or 'cpu': whose hardware the tensor-core rules judge.
        trace: the traced forward pass.
        batch_size: the batch size traced.
        optimizer: the workload's optimizer, None when building it failed.
        grad_scalers: enabled GradScalers reachable from the workload.
    """

    workload: Workload
    policy: Policy
    device: DeviceInfo
    target: str
    trace: Trace
    batch_size: int
    optimizer: torch.optim.Optimizer | None = None
    grad_scalers: tuple[Any, ...] = ()

    @property
    def dtype(self) -> str:
        """What matmuls and convolutions compute in: fp16, bf16, tf32, bf32 or fp32."""
        return self.policy.spec.compute_format

    @property
    def alignment(self) -> int | None:
        """Elements per 16 bytes for the tensor-core dtype; None when no tensor core runs."""
        return _ALIGNMENT.get(self.dtype)

    @property
    def assumes(self) -> str:
        """What the alignment rules assume, for the findings' details."""
        a = self.alignment
        if a is None:
            return f"policy {self.policy.name}: no tensor cores"
        return f"policy {self.policy.name}: {self.dtype} tensor cores want multiples of {a}"

    def alignment_for(self, module: str) -> int | None:
        """The alignment for a module: None inside a keep_fp32 island (it runs in fp32)."""
        return None if is_fp32_island(module, self.policy.config.keep_fp32) else self.alignment

    @property
    def cuda_target(self) -> bool:
        """The tensor-core rules judge an NVIDIA GPU."""
        return self.target == "cuda"

    @cached_property
    def total_flops(self) -> int:
        """FLOPs of the traced forward pass: its matmul/conv layers and functional calls."""
        return self.trace.total_flops

    def share(self, flops: int) -> float:
        """``flops`` as a share of :attr:`total_flops` (0 when nothing was counted)."""
        return flops / self.total_flops if self.total_flops else 0.0

    def share_severity(self, share: float) -> str:
        """'warning' for a layer with at least :data:`WARNING_SHARE` of the FLOPs, else 'info'."""
        return "warning" if share >= WARNING_SHARE else "info"

    @cached_property
    def convs(self) -> list[ModuleRecord]:
        """The convolutions that ran, in forward order."""
        return self.trace.of_type(*COMPUTE_TYPES[1:])

    @cached_property
    def linears(self) -> list[ModuleRecord]:
        """The Linear layers that ran, in forward order."""
        return self.trace.of_type(nn.Linear)

    @cached_property
    def stem(self) -> str | None:
        """The first convolution, when it reads at most a handful of (image) channels."""
        convs = self.convs
        if convs and convs[0].module.in_channels <= STEM_CHANNELS:
            return convs[0].name
        return None

    @cached_property
    def head(self) -> str | None:
        """The last matmul/conv layer, when its output has the model output's size."""
        compute = [r for r in self.trace.modules.values() if r.calls and isinstance(r.module, COMPUTE_TYPES)]
        out = self.trace.output
        if not compute or out is None:
            return None
        last = max(compute, key=lambda r: r.order)
        return last.name if last.output is not None and last.output.numel == out.numel else None

    @cached_property
    def vocab_projections(self) -> dict[str, tuple[str, ModuleRecord, bool]]:
        """Linear name -> (embedding name, embedding record, tied) for language-model heads."""
        found: dict[str, tuple[str, ModuleRecord, bool]] = {}
        embeddings = [r for r in self.trace.modules.values() if isinstance(r.module, nn.Embedding)]
        for emb in embeddings:
            for lin in self.linears:
                tied = lin.module.weight is emb.module.weight
                if tied or lin.module.out_features == emb.module.num_embeddings:
                    found.setdefault(lin.name, (emb.name, emb, tied))
        return found


__all__ = ["STEM_CHANNELS", "WARNING_SHARE", "LintContext"]
