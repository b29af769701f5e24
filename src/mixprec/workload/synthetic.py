"""What every built-in workload shares: seeded weights, seeded synthetic batches, argument checks.

Every model is initialised under a fixed seed (without touching the caller's RNG) and every
batch comes from its own seeded generator, so each process that builds the same workload sees
the same weights and the same sequence of batches. Nothing is ever downloaded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import UsageError, did_you_mean

MODEL_SEED = 0
BATCH_SEED = 1234

M = TypeVar("M", bound=nn.Module)


def seeded_model(build: Callable[[], M]) -> M:
    """Build under a fixed CPU seed, leaving the caller's RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(MODEL_SEED)
        return build()


def batch_generators() -> Iterator[torch.Generator]:
    """One freshly seeded CPU generator per call: the n-th batch is the same in every process."""
    for n in itertools.count():
        yield torch.Generator().manual_seed(BATCH_SEED + n)


def check_batch_size(batch_size: Any, name: str) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(
            f"batch_size {batch_size!r} for workload {name!r} is invalid; pass a positive integer."
        )
    return batch_size


def check_positive_int(key: str, value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{key}={value!r} for model {name!r} is invalid; pass an integer >= {minimum}.")
    return value


def reject_unknown(name: str, config: dict[str, Any], valid: tuple[str, ...], size_option: str = "") -> None:
    options = (size_option, *valid) if size_option else valid
    for key in config:
        if key not in valid:
            listing = ", ".join(options) if options else "none"
            raise UsageError(
                f"unknown option {key!r} for model {name!r}; valid options: {listing}."
                + did_you_mean(key, options)
                + " Remove it or use one of those."
            )


def as_device(device: Any) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def param_millions(model: nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


ImageBatch = tuple[torch.Tensor, torch.Tensor]


def image_classification_task(
    name: str, channels: int, image_size: int, num_classes: int
) -> tuple[Callable[[int, torch.device], ImageBatch], Callable[[nn.Module, ImageBatch], torch.Tensor]]:
    """``make_batch`` (seeded random images and labels, the same for every candidate) and a
    cross-entropy ``loss_fn`` for an image classifier, as the zoo CNNs and models by name use."""
    generators = batch_generators()

    def make_batch(batch_size: int, device: torch.device) -> ImageBatch:
        b = check_batch_size(batch_size, name)
        gen = next(generators)
        images = torch.randn(b, channels, image_size, image_size, generator=gen)
        labels = torch.randint(0, num_classes, (b,), generator=gen)
        dev = as_device(device)
        return images.to(dev), labels.to(dev)

    def loss_fn(model: nn.Module, batch: ImageBatch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    return make_batch, loss_fn
