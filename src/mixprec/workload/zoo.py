"""The built-in model zoo: torchvision CNNs, a GPT-2-small-class language model and a tiny MLP.

Nothing is ever downloaded: torchvision models are built with ``weights=None`` and every batch
is synthetic. Every model is initialised under a fixed seed (without touching the caller's RNG)
and every batch comes from its own seeded generator, so each process that builds the same
workload sees the same weights and the same sequence of batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import UsageError, did_you_mean
from mixprec.workload.optimizers import TORCHVISION_RECIPE, BatchScaled, Recipe
from mixprec.workload.synthetic import BATCH_SEED as _BATCH_SEED
from mixprec.workload.synthetic import as_device as _device
from mixprec.workload.synthetic import batch_generators as _batch_generators
from mixprec.workload.synthetic import bigram_table, bigram_tokens, image_classification_task, task_workload
from mixprec.workload.synthetic import check_batch_size as _check_batch_size
from mixprec.workload.synthetic import check_positive_int as _check_positive_int
from mixprec.workload.synthetic import param_millions as _param_millions
from mixprec.workload.synthetic import reject_unknown as _reject_unknown
from mixprec.workload.synthetic import seeded_model as _seeded_model
from mixprec.workload.workload import Workload

ZOO_NAMES: tuple[str, ...] = ("resnet50", "vgg19", "densenet121", "gpt2", "mlp")

_CNN_NAMES = ("resnet50", "vgg19", "densenet121")
_NUM_CLASSES = 1000
_DEFAULT_IMAGE_SIZE = 224
_MIN_IMAGE_SIZE = 32  # vgg19 halves the image five times
_DEFAULT_SEQ_LEN = 128
_CNN_BATCH_SIZE = {"resnet50": 32, "vgg19": 16, "densenet121": 32}

_MLP_IN = 64
_MLP_CLASSES = 10
_MLP_DEFAULTS = {"hidden": 256, "depth": 2}

# The built-in tasks' optimizers (mixprec.workload.optimizers.Recipe): a recipe's learning rate at
# the batch it was tuned for, scaled to the batch a run draws with a warm-up, so the strict-fp32
# reference learns over the checked steps (a check against a reference that does not learn has no
# power). The CNNs: torchvision's classification recipe (TORCHVISION_RECIPE).
# nanoGPT's AdamW (6e-4, betas 0.9/0.95, weight decay 0.1 on matrices and embeddings), taken at the
# task's default 8 sequences: its own 0.5M-token batch scaled down by the square root would leave a
# rate that learns nothing in a check's steps.
GPT_RECIPE = Recipe(
    "nanoGPT's AdamW, at the task's 8 sequences", "adamw", 6e-4, 8, weight_decay=0.1, betas=(0.9, 0.95)
)
# SGD 0.1 with momentum for the MLP's 64 samples: the loss falls within a check's steps (at the
# default 0.01 it needs hundreds); Adam would too, but its eps (1e-8) is 0 in fp16 and fp16-true
# would divide by it.
MLP_RECIPE = Recipe("mixprec's MLP task", "sgd", 0.1, 64)


# --------------------------------------------------------------------------------------------------
# GPT-2


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 small by default (124M parameters with the tied head)."""

    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    dropout: float = 0.0


# Fields that ``build_zoo_workload("gpt2", **config)`` may override (integers, so they fit a spec).
GPT_CONFIG_KEYS: tuple[str, ...] = ("vocab_size", "n_layer", "n_head", "n_embd", "block_size")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style causal language model: ``forward(idx [B,T] int64) -> logits [B,T,V]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                "ln_f": nn.LayerNorm(config.n_embd),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = cast(nn.Embedding, self.transformer["wte"]).weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise UsageError(
                f"sequence length {t} exceeds the model's block_size {self.config.block_size}; "
                "use a shorter seq_len or build the model with a larger block_size."
            )
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        parts = self.transformer
        x = parts["drop"](parts["wte"](idx) + parts["wpe"](pos))
        for block in cast(nn.ModuleList, parts["h"]):
            x = block(x)
        return self.lm_head(parts["ln_f"](x))


# --------------------------------------------------------------------------------------------------
# Builders


def _build_cnn(name: str, image_size: int | None, config: dict[str, Any]) -> Workload:
    _reject_unknown(name, config, (), "image_size")
    sizes: dict[str, int] = {}
    if image_size is not None:
        sizes["image_size"] = _check_positive_int("image_size", image_size, name, _MIN_IMAGE_SIZE)
    size = sizes.get("image_size", _DEFAULT_IMAGE_SIZE)

    import torchvision.models as tvm  # deferred: importing torchvision costs time

    constructor = getattr(tvm, name)
    model = _seeded_model(lambda: constructor(weights=None, num_classes=_NUM_CLASSES))
    return task_workload(
        "zoo",
        name,
        model,
        image_classification_task(name, 3, size, _NUM_CLASSES),
        BatchScaled(TORCHVISION_RECIPE, _CNN_BATCH_SIZE[name]),
        sizes,
        f"{name} (torchvision, random init, {_param_millions(model):.1f}M params), "
        f"3x{size}x{size} synthetic images, {_NUM_CLASSES} classes",
    )


def _build_gpt2(seq_len: int | None, config: dict[str, Any]) -> Workload:
    name = "gpt2"
    _reject_unknown(name, config, GPT_CONFIG_KEYS, "seq_len")
    sizes: dict[str, int] = {k: _check_positive_int(k, v, name) for k, v in config.items()}
    if seq_len is not None:
        sizes["seq_len"] = _check_positive_int("seq_len", seq_len, name)
    cfg = replace(GPTConfig(), **config)
    if cfg.n_embd % cfg.n_head:
        raise UsageError(
            f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head} for zoo model 'gpt2'; "
            "choose n_embd as a multiple of n_head."
        )
    t = sizes.get("seq_len", _DEFAULT_SEQ_LEN)
    if t > cfg.block_size:
        raise UsageError(
            f"seq_len={t} exceeds block_size={cfg.block_size} for zoo model 'gpt2'; "
            f"pass seq_len <= {cfg.block_size} or a larger block_size."
        )
    model = _seeded_model(lambda: GPT(cfg))
    generators = _batch_generators()
    vocab = cfg.vocab_size
    table = bigram_table(vocab)  # learnable: tokens walk a fixed random bigram table

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        b = _check_batch_size(batch_size, name)
        tokens = bigram_tokens(table, b, t + 1, next(generators))
        dev = _device(device)
        return tokens[:, :-1].contiguous().to(dev), tokens[:, 1:].contiguous().to(dev)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        logits = model(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return task_workload(
        "zoo",
        name,
        model,
        (make_batch, loss_fn),
        BatchScaled(GPT_RECIPE, 8),
        sizes,
        f"gpt2 ({cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} dim, "
        f"{_param_millions(model):.1f}M params), seq_len {t}, vocab {vocab}, "
        "tokens from a random bigram table",
    )


def _build_mlp(config: dict[str, Any]) -> Workload:
    name = "mlp"
    _reject_unknown(name, config, tuple(_MLP_DEFAULTS))
    sizes: dict[str, int] = {k: _check_positive_int(k, v, name) for k, v in config.items()}
    hidden = sizes.get("hidden", _MLP_DEFAULTS["hidden"])
    depth = sizes.get("depth", _MLP_DEFAULTS["depth"])  # number of hidden layers

    def build() -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(_MLP_IN, hidden), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.GELU()]
        layers.append(nn.Linear(hidden, _MLP_CLASSES))
        return nn.Sequential(*layers)

    model = _seeded_model(build)
    # Labels come from a fixed random teacher, so the task is learnable and a loss curve means something.
    teacher = torch.randn(_MLP_IN, _MLP_CLASSES, generator=torch.Generator().manual_seed(_BATCH_SEED - 1))
    generators = _batch_generators()

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        b = _check_batch_size(batch_size, name)
        x = torch.randn(b, _MLP_IN, generator=next(generators))
        y = (x @ teacher).argmax(dim=1)
        dev = _device(device)
        return x.to(dev), y.to(dev)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    return task_workload(
        "zoo",
        name,
        model,
        (make_batch, loss_fn),
        BatchScaled(MLP_RECIPE, 64),
        sizes,
        f"mlp ({depth} hidden layers of {hidden}, {_param_millions(model) * 1e3:.1f}K params), "
        f"{_MLP_IN} synthetic features, {_MLP_CLASSES} classes",
    )


def build_zoo_workload(
    name: str, *, image_size: int | None = None, seq_len: int | None = None, **config: Any
) -> Workload:
    """Build a zoo workload by name (see ``ZOO_NAMES``); no weights or data are downloaded.

    ``image_size`` applies to the CNNs (default 224), ``seq_len`` to gpt2 (default 128).
    ``config`` overrides gpt2's ``GPTConfig`` fields (vocab_size, n_layer, n_head, n_embd,
    block_size) or the mlp's ``hidden`` / ``depth``. Every size given explicitly is recorded in
    the returned workload's spec, so another process rebuilds the identical workload.
    """
    if name not in ZOO_NAMES:
        raise UsageError(
            f"unknown zoo model {name!r}; valid names: {', '.join(ZOO_NAMES)}."
            + did_you_mean(str(name), ZOO_NAMES)
            + " Pick one of those, or pass 'path/to/file.py:function' for your own model."
        )
    if image_size is not None and name not in _CNN_NAMES:
        raise UsageError(
            f"image_size={image_size!r} does not apply to zoo model {name!r}; it applies only to "
            f"{', '.join(_CNN_NAMES)}."
            + (" Use seq_len for gpt2." if name == "gpt2" else " Drop image_size.")
        )
    if seq_len is not None and name != "gpt2":
        raise UsageError(
            f"seq_len={seq_len!r} does not apply to zoo model {name!r}; it applies only to gpt2."
            + (" Use image_size for the CNNs." if name in _CNN_NAMES else " Drop seq_len.")
        )
    if name in _CNN_NAMES:
        return _build_cnn(name, image_size, config)
    if name == "gpt2":
        return _build_gpt2(seq_len, config)
    return _build_mlp(config)


__all__ = ["GPT", "GPT_CONFIG_KEYS", "ZOO_NAMES", "GPTConfig", "build_zoo_workload"]
