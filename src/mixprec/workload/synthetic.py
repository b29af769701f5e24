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

from mixprec import validation
from mixprec.errors import UsageError, did_you_mean
from mixprec.workload.optimizers import BatchScaled
from mixprec.workload.workload import Workload, WorkloadSpec

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
    return validation.positive_int(f"batch_size for workload {name!r}", batch_size)


def check_positive_int(key: str, value: Any, name: str, minimum: int = 1) -> int:
    return validation.positive_int(f"{key} for model {name!r}", value, minimum=minimum)


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


def task_workload(
    kind: str,
    name: str,
    model: nn.Module,
    task: tuple[Callable[..., Any], Callable[..., torch.Tensor]],
    optimizer: BatchScaled,
    options: dict[str, Any],
    description: str,
) -> Workload:
    """A built-in task's :class:`Workload`: ``task`` is its (make_batch, loss_fn), its default batch
    the ``optimizer``'s, its spec records ``options`` and its description ends with the recipe's."""
    make_batch, loss_fn = task
    return Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        optimizer_fn=optimizer,
        name=name,
        default_batch_size=optimizer.batch,
        spec=WorkloadSpec(kind, name, tuple(sorted(options.items()))),
        description=f"{description}; {optimizer.recipe.describe()}",
    )


ImageBatch = tuple[torch.Tensor, torch.Tensor]


# The synthetic tasks are learnable, so the fp32 reference learns and a check compares two runs that
# converge (random labels make both diverge, and the chaos floor of a reference that does not
# learn is itself chaos). Each comes from a fixed random "teacher" seeded apart from the batches.
TEACHER_SEED = BATCH_SEED - 1
PROTOTYPE_SIZE = 4  # an image class's pattern, in pixels a side before it is upsampled
PROTOTYPE_WEIGHT = 1.0  # against unit noise: a clear signal, still far from a trivial one
SUCCESSORS = 4  # a token's possible next tokens in the bigram table (next-token entropy: 2 bits)
ACTIVE_VOCAB = 1024  # the token ids the bigram table uses
ACTIVE_CLASSES = 10  # the classes the images are drawn from (the head learns the others never come)


def teacher_generator(salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(TEACHER_SEED - salt)


def class_prototypes(num_classes: int, channels: int) -> torch.Tensor:
    """One fixed random low-resolution pattern per class, (classes, channels, 4, 4)."""
    return torch.randn(num_classes, channels, PROTOTYPE_SIZE, PROTOTYPE_SIZE, generator=teacher_generator())


def bigram_table(vocab: int, low: int = 0) -> torch.Tensor:
    """A fixed random bigram table, (vocab, SUCCESSORS): the tokens that may follow each token, all
    in a fixed active vocabulary of ``ACTIVE_VOCAB`` ids >= ``low`` (as real text uses a small part of
    a large vocabulary most of the time: the loss falls fast from log(vocab), then learns the pairs)."""
    gen = teacher_generator(1)
    active = low + torch.randperm(vocab - low, generator=gen)[: min(ACTIVE_VOCAB, vocab - low)]
    return active[torch.randint(0, len(active), (vocab, SUCCESSORS), generator=gen)]


def bigram_tokens(table: torch.Tensor, batch_size: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Token sequences walking ``table``: each token one of its predecessor's successors, drawn
    uniformly; the first one a successor of a uniform random token."""
    vocab, successors = table.shape
    picks = torch.randint(0, successors, (batch_size, length), generator=gen)
    tokens = torch.empty(batch_size, length, dtype=torch.long)
    tokens[:, 0] = table[torch.randint(0, vocab, (batch_size,), generator=gen), picks[:, 0]]
    for i in range(1, length):
        tokens[:, i] = table[tokens[:, i - 1], picks[:, i]]
    return tokens


def image_classification_task(
    name: str,
    channels: int,
    image_size: int,
    num_classes: int,
) -> tuple[Callable[[int, torch.device], ImageBatch], Callable[[nn.Module, ImageBatch], torch.Tensor]]:
    """``make_batch`` (seeded images and labels, the same for every candidate) and a cross-entropy
    ``loss_fn`` for an image classifier, as the zoo CNNs and models by name use. An image is its
    class's fixed random pattern (:func:`class_prototypes`, upsampled) plus unit noise, from a fixed
    set of ``ACTIVE_CLASSES`` classes: learnable, and learnt from the first steps on."""
    generators = batch_generators()
    active = torch.randperm(num_classes, generator=teacher_generator(3))[:ACTIVE_CLASSES]
    # upsampled per batch: 1000 full-size ones would take 600 MB
    prototypes = class_prototypes(num_classes, channels)

    def make_batch(batch_size: int, device: torch.device) -> ImageBatch:
        b = check_batch_size(batch_size, name)
        gen = next(generators)
        labels = active[torch.randint(0, len(active), (b,), generator=gen)]
        noise = torch.randn(b, channels, image_size, image_size, generator=gen)
        pattern = F.interpolate(prototypes[labels], size=(image_size, image_size), mode="bilinear")
        images = noise + PROTOTYPE_WEIGHT * pattern
        dev = as_device(device)
        return images.to(dev), labels.to(dev)

    def loss_fn(model: nn.Module, batch: ImageBatch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    return make_batch, loss_fn
