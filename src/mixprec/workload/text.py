"""Hugging Face transformers by architecture: ``hf:bert``, ``hf:gpt2``, ``hf:llama``, ...

The model is built from a config (``AutoConfig.for_model`` + ``AutoModelFor<Task>.from_config``):
nothing is downloaded. Each architecture has a small default config (a few million to ~20M
parameters, so a CPU can tune it) that ``--model-config key=value,...`` overrides field by
field, and a natural task: sequence classification for the encoders (BERT's fine-tuning),
causal language modelling for the decoders (``task=...`` picks another). Batches are seeded
random token ids with an attention mask and labels; the loss is the model's own ``out.loss``.
The optimizer is the Hugging Face examples' AdamW: no weight decay on biases and norm weights.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.errors import UsageError, did_you_mean
from mixprec.workload.optimizers import BatchScaled, Recipe
from mixprec.workload.synthetic import (
    as_device,
    batch_generators,
    bigram_table,
    bigram_tokens,
    check_batch_size,
    check_positive_int,
    param_millions,
    seeded_model,
    task_workload,
)
from mixprec.workload.workload import Workload

TEXT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 128
TASKS = ("causal-lm", "masked-lm", "sequence-classification")
# The transformers mapping (model_type -> class name) that says which architectures have a head.
_TASK_MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
}
_AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
}
MASKED_FRACTION = 0.15  # BERT's masking rate
# Dropout off by default: the numerics check compares number formats, and dropout masks drawn for
# tensors of another dtype differ; --model-config hidden_dropout_prob=0.1 (etc.) turns it back on.
_NO_DROPOUT_KEYS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout",
    "attention_dropout",
    "seq_classif_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_first_dropout",
    "classifier_dropout",
)


# AdamW's settings in the architecture's reference training recipe, taken at the task's default 8
# sequences and scaled by the square root to the batch a run draws, with a warm-up
# (mixprec.workload.optimizers.Recipe): the recipes' own batches (millions of tokens) scaled down
# that way would leave rates that learn nothing in a check's steps.
BERT_RECIPE = Recipe(  # BERT fine-tuning, the HF examples' no_decay
    "BERT fine-tuning, at the task's 8 sequences", "adamw", 5e-5, TEXT_BATCH_SIZE, weight_decay=0.01
)
LLM_RECIPE = Recipe(  # GPT-3 / LLaMA pre-training
    "GPT-3 / LLaMA pre-training's AdamW, at the task's 8 sequences",
    "adamw",
    3e-4,
    TEXT_BATCH_SIZE,
    weight_decay=0.1,
    betas=(0.9, 0.95),
)


@dataclass(frozen=True)
class Arch:
    """An architecture's small default config, its task and what the size corresponds to."""

    task: str
    config: dict[str, Any] = field(default_factory=dict)
    size_note: str = ""
    recipe: Recipe = BERT_RECIPE


_SMALL_DECODER = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 688,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}

ARCHS: dict[str, Arch] = {
    "bert": Arch(
        "sequence-classification",
        {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024},
        "BERT-mini: 4 layers, 256 wide (google/bert_uncased_L-4_H-256_A-4)",
    ),
    "roberta": Arch(
        "sequence-classification",
        {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024},
        "4 layers, 256 wide",
    ),
    "distilbert": Arch(
        "sequence-classification",
        {"dim": 256, "n_layers": 4, "n_heads": 4, "hidden_dim": 1024},
        "4 layers, 256 wide",
    ),
    "gpt2": Arch(
        "causal-lm",
        {"n_embd": 256, "n_layer": 4, "n_head": 4},
        "4 layers, 256 wide, GPT-2's 50257-token vocabulary",
        LLM_RECIPE,
    ),
    "llama": Arch(
        "causal-lm",
        _SMALL_DECODER,
        "4 layers, 256 wide, grouped-query attention (2 KV heads), 32000-token vocabulary",
        LLM_RECIPE,
    ),
    "mistral": Arch(
        "causal-lm",
        {**_SMALL_DECODER, "sliding_window": None},
        "4 layers, 256 wide, grouped-query attention (2 KV heads), 32000-token vocabulary",
        LLM_RECIPE,
    ),
    "qwen2": Arch(
        "causal-lm",
        _SMALL_DECODER,
        "4 layers, 256 wide, grouped-query attention (2 KV heads), 32000-token vocabulary",
        LLM_RECIPE,
    ),
}


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def hf_names() -> list[str]:
    return sorted(ARCHS)


def _tasks_of(arch: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    return [task for task, mapping in _TASK_MAPPINGS.items() if arch in getattr(modeling_auto, mapping)]


def _config(arch: str, spec: Arch, overrides: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    target = f"hf:{arch}"
    fields = AutoConfig.for_model(arch).to_dict()
    valid = sorted(k for k in fields if not k.startswith("_") and k != "transformers_version")
    for key in overrides:
        if key not in fields:
            raise UsageError(
                f"unknown option {key!r} for {target}: not a field of transformers' "
                f"{type(AutoConfig.for_model(arch)).__name__}.{did_you_mean(key, valid)} Its fields "
                f"include {', '.join(k for k in spec.config)}, ...; besides them mixprec takes task "
                f"({', '.join(TASKS)}) and seq_len. Fix --model-config."
            )
    no_dropout = {k: 0.0 for k in _NO_DROPOUT_KEYS if k in fields}
    return AutoConfig.for_model(arch, **{**no_dropout, **spec.config, **overrides})


def build_hf(arch: str, options: dict[str, Any]) -> Workload:
    import transformers

    target = f"hf:{arch}"
    spec = ARCHS[arch]
    overrides = dict(options)
    seq_len = check_positive_int("seq_len", overrides.pop("seq_len", DEFAULT_SEQ_LEN), target)
    task = overrides.pop("task", spec.task)
    tasks = _tasks_of(arch)
    if task not in tasks:
        raise UsageError(
            f"task={task!r} is not available for {target}; its tasks: {', '.join(tasks)}."
            + did_you_mean(str(task), tasks)
            + " Fix task= in --model-config."
        )
    config = _config(arch, spec, overrides)
    if task == "sequence-classification" and config.pad_token_id is None:
        config.pad_token_id = 0  # HF's classification heads find the last non-pad token with it
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise UsageError(
            f"seq_len={seq_len} exceeds {target}'s {limit} positions; pass --seq-len <= {limit} or "
            f"raise max_position_embeddings in --model-config."
        )
    auto = getattr(transformers, _AUTO_CLASSES[task])
    try:
        model = seeded_model(lambda: auto.from_config(config))
    except (ValueError, TypeError, AttributeError) as exc:
        raise UsageError(
            f"transformers could not build {target} from its config ({type(exc).__name__}: {exc}); "
            "fix --model-config."
        ) from None
    vocab = int(config.vocab_size)
    num_labels = int(config.num_labels)
    # Token ids from 1: id 0 is the pad token a classification head looks for.
    low = 1 if vocab > 1 else 0
    generators = batch_generators()
    # Learnable: tokens walk a fixed bigram table; a sequence of class c has its tokens shifted by
    # c * vocab / num_labels, so every position tells the class (to a head that pools the first
    # token, as BERT's, or the last, as GPT-2's).
    table = bigram_table(vocab, low)
    shift = max((vocab - low) // max(num_labels, 1), 1)

    def make_batch(batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        b = check_batch_size(batch_size, target)
        gen = next(generators)
        ids = bigram_tokens(table, b, seq_len, gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if task == "causal-lm":
            batch["labels"] = ids.clone()  # the model shifts them by one position
        elif task == "masked-lm":
            masked = torch.rand(b, seq_len, generator=gen) < MASKED_FRACTION
            batch["labels"] = torch.where(masked, ids, torch.full_like(ids, -100))
            batch["input_ids"] = torch.where(masked, torch.full_like(ids, vocab - 1), ids)
        else:
            labels = torch.randint(0, num_labels, (b,), generator=gen)
            batch["input_ids"] = low + (ids - low + labels[:, None] * shift) % (vocab - low)
            batch["attention_mask"] = torch.ones_like(ids)
            batch["labels"] = labels
        dev = as_device(device)
        return {k: v.to(dev) for k, v in batch.items()}

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    what = (
        spec.size_note
        if not overrides
        else "config overridden: " + ", ".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    )
    return task_workload(
        "model",
        target,
        model,
        (make_batch, loss_fn),
        BatchScaled(spec.recipe, TEXT_BATCH_SIZE),
        options,
        f"{target} ({type(model).__name__}, transformers {transformers.__version__}, {what}, "
        f"{param_millions(model):.1f}M params), {task}, seq_len {seq_len}, "
        "tokens from a random bigram table",
    )
