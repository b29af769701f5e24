"""The built-in tasks' optimizers: a recipe's learning rate scaled to the task's batch (linearly for
SGD, by the square root for Adam) with a warm-up every implementation applies (issue 38)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.frameworks.torch.session import with_implementation
from mixprec.workload import load_workload
from mixprec.workload.optimizers import TORCHVISION_RECIPE, Recipe, WarmupAdamW, WarmupSGD
from warmup_step import warm_up_rates

CPU = torch.device("cpu")


def test_the_rate_scales_linearly_for_sgd_and_by_the_square_root_for_adam():
    assert TORCHVISION_RECIPE.lr_at(256) == pytest.approx(0.1)
    assert TORCHVISION_RECIPE.lr_at(16) == pytest.approx(0.1 * 16 / 256)
    adam = Recipe("r", "adamw", 6e-4, 8)
    assert adam.lr_at(32) == pytest.approx(6e-4 * 2) and adam.lr_at(2) == pytest.approx(3e-4)


GPT = {"seq_len": 8, "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64}


@pytest.mark.parametrize(("name", "sizes", "rate"), [
    ("resnet50", {"image_size": 32}, 0.1 * 32 / 256),
    ("gpt2", GPT, 6e-4),
    ("mlp", {}, 0.1),
])  # fmt: skip
def test_a_built_in_task_trains_at_its_recipes_rate_whatever_batch_was_drawn_last(name, sizes, rate):
    """One rate per workload: the fp32 reference and every candidate train alike, whichever batch
    another checker, the thread probe or a sweep drew in between."""
    w = load_workload(name, **sizes)
    for batch in (4, 16):
        w.make_batch(batch, CPU)
        opt = w.make_optimizer(w.model)
        assert [g["base_lr"] for g in opt.param_groups] == pytest.approx([rate] * len(opt.param_groups))
    assert "scaled" in w.description and "warm-up" in w.description


@pytest.mark.parametrize("cls", [WarmupSGD, WarmupAdamW])
def test_the_warm_up_ramps_the_rate_and_survives_another_implementation(cls):
    model = nn.Linear(4, 2)
    opt = cls(model.parameters(), lr=0.3, warmup_steps=3)
    seen = []
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        seen.append(float(opt.param_groups[0]["lr"]))
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.3])
    for impl in ("for-loop", "foreach", "fused"):
        other = with_implementation(cls(model.parameters(), lr=0.3, warmup_steps=3), impl)
        assert type(other) is cls and other.param_groups[0]["base_lr"] == pytest.approx(0.3)
        model(torch.randn(2, 4)).sum().backward()
        other.step()  # every implementation warms up alike (Adam's foreach with a float rate)
        assert float(other.param_groups[0]["lr"]) == pytest.approx(0.1)
        other.zero_grad()


def test_a_step_compiled_whole_warms_up_like_the_eager_step():
    """torch.compile around the whole step (compile_scope='step'). Adam's foreach kernels take a float
    rate, set on the host each warm-up step: inside the compiled step torch 2.14's Dynamo dropped
    the optimizer's counter update (the rate stayed at a third for the whole run) and torch 2.11's
    refused it (the H200 run's `bf16-mixed+compile-step` error row; foreach is AdamW's default on
    CUDA). (The for-loop kernels take a tensor rate, updated in place: test_compile_step.py.)"""
    torch._dynamo.reset()

    def run(compiled: bool) -> list[float]:
        make = lambda params: WarmupAdamW(params, lr=6e-3, warmup_steps=3, foreach=True)  # noqa: E731
        return warm_up_rates(make, compiled)[0]

    eager = run(False)
    assert eager == pytest.approx([2e-3, 4e-3, 6e-3, 6e-3, 6e-3])
    assert run(True) == pytest.approx(eager)


@pytest.mark.parametrize(
    ("cls", "options", "on_params"),
    [
        (WarmupSGD, {}, False),  # for-loop: param.add_(grad, alpha=-lr), one read per parameter
        (WarmupSGD, {"foreach": True}, False),  # one read per parameter group
        (WarmupAdamW, {"foreach": False}, False),  # for-loop Adam: step_size as a number
        (WarmupSGD, {"fused": True}, True),  # the fused kernels take the rate on their device
        (WarmupAdamW, {"capturable": True, "foreach": True}, True),
    ],
)
def test_a_tensor_rate_stays_off_the_gpu_where_the_step_reads_it_as_a_number(cls, options, on_params):
    """On the H200 the recipes' tensor rate lived with the weights: SGD's for-loop and foreach steps
    read it with `.item()` (each a host-device sync, every step; 161 per ResNet-50 step for the
    for-loop). The meta device stands in for the GPU: the rate is made where the parameters live
    only for the kernels that take it there."""
    model = nn.Linear(4, 2, device="meta")
    opt = cls(model.parameters(), lr=0.3, warmup_steps=3, **options)
    where = {g["lr"].device.type for g in opt.param_groups} | {opt._warm_count.device.type}
    assert where == ({"meta"} if on_params else {"cpu"})
