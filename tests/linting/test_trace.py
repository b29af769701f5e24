"""The lint trace on its own: one forward pass on the meta device, what each module saw, the
FLOPs, the channels_last rule of real kernels, the eager fall-back, and a model left untouched."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.linting.trace import trace_workload


def workload(model: nn.Module, make_batch=None) -> mixprec.Workload:
    return mixprec.Workload(
        model=model,
        make_batch=make_batch or (lambda bs, device: (torch.randn(bs, 3, 8, 8), torch.randint(0, 4, (bs,)))),
        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    )


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))


def test_every_module_its_shapes_and_the_forward_flops_on_meta():
    model = cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace = trace_workload(workload(model), 2)
    assert trace.mode == "meta" and list(trace.modules) == ["", "0", "1", "2", "3"]
    conv, linear = trace.modules["0"], trace.modules["3"]
    assert conv.input.shape == (2, 3, 8, 8) and conv.output.shape == (2, 8, 8, 8)
    assert linear.weight.shape == (4, 512) and linear.output.dtype == "float32"
    assert conv.flops == 2 * 2 * 8 * 8 * 8 * 3 * 3 * 3 and linear.flops == 2 * 2 * 512 * 4
    assert trace.total_flops == conv.flops + linear.flops
    assert {c.name for c in trace.calls} >= {"relu"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing changed


def test_channels_last_outputs_follow_the_kernels_rule():
    trace = trace_workload(workload(cnn()), 2, channels_last=True)
    conv = trace.modules["0"]
    assert conv.input.memory_format == "channels_last" and conv.output.memory_format == "channels_last"
    plain = trace_workload(workload(cnn()), 2)
    assert plain.modules["0"].output.memory_format == "contiguous"


class NeedsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max().item() > 0:  # data-dependent: impossible on meta tensors
            x = x * 2
        return self.fc(x)


def test_a_forward_that_needs_values_is_traced_eagerly_and_says_why():
    trace = trace_workload(
        workload(NeedsValues(), lambda bs, device: (torch.randn(bs, 4), torch.randint(0, 4, (bs,)))), 3
    )
    assert trace.mode == "eager" and "meta trace failed" in trace.note
    assert trace.modules["fc"].output.shape == (3, 4)
