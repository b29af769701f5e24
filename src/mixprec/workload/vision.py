"""Image classifiers by name: ``torchvision:NAME`` and ``timm:NAME``, random init, synthetic images.

Every model is built with ``weights=None`` / ``pretrained=False`` under a fixed seed; batches
are seeded synthetic images at the model's own input size (the crop size of its reference recipe),
each its class's fixed random pattern plus noise (learnable: the fp32 reference learns), and the
loss is cross-entropy, as the libraries' training scripts compute it.
The optimizer is the library's reference recipe: torchvision's SGD (momentum 0.9, weight decay
1e-4, none on norms and biases), timm's ``create_optimizer_v2(model, "adamw", ...)``.

Options: ``image_size`` (exact), or ``max_image_size``, a cap honoured where the model takes
smaller inputs (not a ViT with a fixed input size): what a CPU-sized run asks for. The spec
records the size used, so another process rebuilds the same workload.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from torch import nn

from mixprec.errors import UsageError, did_you_mean
from mixprec.workload.optimizers import TORCHVISION_RECIPE, BatchScaled, Groups, Recipe
from mixprec.workload.synthetic import (
    check_positive_int,
    image_classification_task,
    param_millions,
    seeded_model,
    task_workload,
)
from mixprec.workload.workload import Workload

VISION_BATCH_SIZE = 32
# torchvision's Inception and GoogLeNet return (logits, aux logits) in training unless told not to.
_NO_AUX = ("googlenet", "inception_v3")


def image_classification(
    *,
    model: nn.Module,
    name: str,
    target: str,
    options: dict[str, Any],
    channels: int,
    image_size: int,
    asked_size: int | None,
    num_classes: int,
    recipe: Recipe,
    what: str,
    groups: Groups | None = None,
) -> Workload:
    """A workload around an image classifier: seeded learnable synthetic images, cross-entropy, and
    the library's ``recipe`` scaled to the task's batch (with a warm-up). Its spec names the image
    size used (``asked_size``, when one was) instead of the ``max_image_size`` cap."""
    recorded = {k: v for k, v in options.items() if k != "max_image_size"}
    if asked_size is not None:
        recorded["image_size"] = asked_size
    return task_workload(
        "model",
        target,
        model,
        image_classification_task(name, channels, image_size, num_classes),
        BatchScaled(recipe, VISION_BATCH_SIZE, groups),
        recorded,
        f"{target} ({what}, random init, {param_millions(model):.1f}M params), "
        f"{channels}x{image_size}x{image_size} synthetic images, {num_classes} classes",
    )


def _seeded_build(
    target: str,
    library: str,
    config: dict[str, Any],
    build: Callable[[], nn.Module],
    rejects: type[Exception] | tuple[type[Exception], ...],
) -> nn.Module:
    """``build()`` under the model seed; a ``TypeError`` or one of ``rejects`` (the library's
    refusals of ``config``) raised as a :class:`UsageError` naming the fix."""
    try:
        return seeded_model(build)
    except TypeError as exc:
        raise UsageError(
            f"{target} does not accept the option(s) {_options(config)}: {exc}; fix --model-config "
            f"(its options are the keyword arguments of the model's class in {library})."
        ) from None
    except rejects as exc:
        raise UsageError(f"{target} rejected {_options(config)}: {exc}; fix --model-config.") from None


# --------------------------------------------------------------------------------------------------
# torchvision


def torchvision_names() -> list[str]:
    """torchvision's image classification models (not detection, segmentation, video, ...)."""
    import torchvision.models as tvm

    return sorted(tvm.list_models(module=tvm))


def _torchvision_sizes(name: str) -> tuple[int, int]:
    """(input size of the reference recipe, smallest input the model accepts) from the weights'
    metadata: the enum, never the weights themselves."""
    import torchvision.models as tvm

    try:
        weights: Any = tvm.get_model_weights(name).DEFAULT
    except Exception:  # a model without published weights: the ImageNet default
        return 224, 32
    crop = int(getattr(weights.transforms, "keywords", {}).get("crop_size", 224))
    minimum = int(min(weights.meta.get("min_size", (32, 32))))
    return crop, minimum


def build_torchvision(name: str, options: dict[str, Any]) -> Workload:
    import torchvision.models as tvm

    target = f"torchvision:{name}"
    config = dict(options)
    image_size = config.pop("image_size", None)
    cap = config.pop("max_image_size", None)
    default_size, min_size = _torchvision_sizes(name)
    size = default_size
    if image_size is None and cap is not None and not name.startswith("vit_"):
        cap = check_positive_int("max_image_size", cap, target)
        if min_size <= cap < default_size:
            image_size = cap
    if image_size is not None:
        size = check_positive_int("image_size", image_size, target, max(min_size, 16))
        if size != default_size and name.startswith("vit_"):
            config["image_size"] = size  # a ViT's position embeddings are built for one input size
    if name in _NO_AUX:
        config.setdefault("aux_logits", False)
        config.setdefault("init_weights", True)
    num_classes = config.setdefault("num_classes", 1000)
    model = _seeded_build(
        target, "torchvision", config, lambda: tvm.get_model(name, weights=None, **config), ValueError
    )
    return image_classification(
        model=model,
        name=name,
        target=target,
        options=options,
        channels=3,
        image_size=size,
        asked_size=image_size,
        num_classes=int(num_classes),
        recipe=TORCHVISION_RECIPE,
        what="torchvision",
    )


# --------------------------------------------------------------------------------------------------
# timm


def timm_available() -> bool:
    return importlib.util.find_spec("timm") is not None


def timm_names() -> list[str]:
    import timm

    return list(timm.list_models())


# timm's AdamW settings of the ConvNeXt / DeiT recipes (lr 1e-3, weight decay 0.05), taken at the
# task's default batch of 32 and scaled by the square root from there (timm's own --lr-base-scale
# for Adam); the recipes' batch of 1024 scaled down that way would leave a rate that learns nothing
# in a check's steps.
TIMM_RECIPE = Recipe(
    "timm's AdamW, at the task's 32 images", "adamw", 1e-3, VISION_BATCH_SIZE, weight_decay=0.05
)


def _timm_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """timm's parameter groups (``create_optimizer_v2``'s): no decay on biases, norm weights and
    ``model.no_weight_decay()``."""
    from timm.optim import param_groups_weight_decay

    skip: set[str] = set(getattr(model, "no_weight_decay", lambda: set())())
    return list(param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip))


def build_timm(name: str, options: dict[str, Any]) -> Workload:
    import timm
    from timm.models import get_pretrained_cfg

    target = f"timm:{name}"
    config = dict(options)
    image_size = config.pop("image_size", None)
    cap = config.pop("max_image_size", None)
    recipe: Any = get_pretrained_cfg(name)
    native = int(recipe.input_size[-1]) if recipe is not None else 224
    fixed = recipe is not None and recipe.fixed_input_size
    if image_size is None and cap is not None:
        cap = check_positive_int("max_image_size", cap, target)
        if cap < native and not fixed:
            image_size = cap
    if image_size is not None and fixed and "img_size" not in config:
        # a ViT's patch grid and position embeddings are built for one input size: build them for it
        config["img_size"] = check_positive_int("image_size", image_size, target, 16)
    model = _seeded_build(
        target,
        "timm",
        config,
        lambda: timm.create_model(name, pretrained=False, **config),
        (RuntimeError, ValueError, AssertionError),
    )
    pretrained_cfg: Any = getattr(model, "pretrained_cfg", None) or {}
    channels, height, _ = pretrained_cfg.get("input_size", (3, 224, 224))
    size = int(height)
    if image_size is not None:
        size = check_positive_int("image_size", image_size, target, 16)
    return image_classification(
        model=model,
        name=name,
        target=target,
        options=options,
        channels=int(channels),
        image_size=size,
        asked_size=image_size,
        num_classes=int(getattr(model, "num_classes", 1000)),
        recipe=TIMM_RECIPE,
        what=f"timm {timm.__version__}",
        groups=_timm_groups,
    )


# --------------------------------------------------------------------------------------------------


def _options(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items()) or "(none)"


def close_matches(name: str, names: list[str]) -> str:
    """' Close matches: a, b, c.' for a misspelt model name, else ''."""
    import difflib

    matches = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    if not matches:
        return did_you_mean(name, names)
    return f" Close matches: {', '.join(matches)}."
