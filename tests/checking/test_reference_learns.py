"""A reference that learns: the built-in tasks' fp32 loss falls over a check, and a check says so
when it does not (its verdicts then compare two runs that do not learn, and have little power)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.checking.check import check, not_learning
from mixprec.cli import main
from mixprec.workload.zoo import build_zoo_workload


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one thread (see conftest.single_thread)."""


def test_not_learning_reads_the_trend_against_the_noise():
    assert not_learning([2.3, 2.1, 1.9, 1.8, 1.6, 1.5, 1.3, 1.2]) == ""
    assert not_learning([7.2, 5.4, 3.8, 4.4, 3.5, 4.7, 3.0, 5.7]) == ""  # noisy, but falling
    rising = not_learning([6.9, 7.0, 7.1, 7.0, 7.3, 7.4, 7.3, 7.6])
    assert "did not learn over the 8 checked steps" in rising and "little power" in rising
    assert not_learning([2.30, 2.31, 2.29, 2.30, 2.31, 2.29, 2.30, 2.30]) != ""  # flat
    assert not_learning([2.3, 2.2, 2.1]) == ""  # too few steps to say


def _ascent() -> mixprec.Workload:
    torch.manual_seed(0)
    return mixprec.Workload(
        model=nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
        make_batch=lambda b, device: (torch.randn(b, 16), torch.randint(0, 4, (b,))),
        loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.5, maximize=True),  # gradient ascent
        name="ascent",
    )


def test_a_check_says_when_its_reference_does_not_learn(capsys):
    result = check(_ascent(), policies=["bf16-mixed"], device="cpu")
    assert "did not learn" in result.reference_note
    assert result.to_dict()["reference_note"] == result.reference_note
    code = main(
        [
            "check",
            "--workload",
            f"{__file__}:_ascent",
            "--device",
            "cpu",
            "--policies",
            "bf16-mixed",
        ]
    )
    assert code in (0, 4)
    assert "did not learn" in capsys.readouterr().out


@pytest.mark.parametrize(
    "build",
    [
        lambda: build_zoo_workload("mlp"),
        lambda: build_zoo_workload("gpt2", seq_len=32, n_layer=1, n_embd=64, n_head=2, vocab_size=512),
        # the zoo CNNs' task (image_classification_task), on a model that costs less than ResNet-50
        lambda: mixprec.load_workload("torchvision:resnet18", image_size=32),
    ],
    ids=["mlp", "gpt2", "torchvision-images"],
)
def test_the_built_in_tasks_learn_in_a_check(build):
    result = check(build(), policies=["bf16-mixed"], steps=8, batch_size=16, device="cpu")
    assert result.reference_note == "", (result.reference_note, result.reference_losses)


@pytest.mark.frameworks
def test_the_hf_tasks_learn_in_a_check():
    # The BERT family's tasks are learnable too (masked tokens follow a bigram table, a class
    # shifts every token), but under BERT's fine-tuning learning rate (5e-5) a randomly initialised
    # model does not visibly learn in 8 steps: the check says so rather than judge against it.
    pytest.importorskip("transformers")
    w = mixprec.load_workload(
        "hf:gpt2", task="causal-lm", seq_len=32, n_layer=1, n_embd=64, n_head=2, vocab_size=1024
    )
    result = check(w, policies=["bf16-mixed"], steps=8, batch_size=8, device="cpu")
    assert result.reference_note == "", result.reference_losses
