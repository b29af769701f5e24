"""A Hugging Face model from a config (nothing downloaded), trained as the HF examples train it.

``loss_fn`` returns ``out.loss``, the scalar: returning the model's output object itself
(``SequenceClassifierOutput``) is the mistake ``mixprec`` stops before measuring. The
optimizer is the HF examples' AdamW, with no weight decay on biases and LayerNorm weights
(``no_decay = ["bias", "LayerNorm.weight"]``), built from the model mixprec trains.

    mixprec tune --workload examples/hf_model.py:make_workload
    mixprec tune --model hf:bert          # the same kind of model, by name
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

import mixprec


def optimizer_fn(model: nn.Module) -> torch.optim.Optimizer:
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": 0.01,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    return torch.optim.AdamW(groups, lr=5e-5)


def make_workload(
    hidden_size: int = 256, num_hidden_layers: int = 4, seq_len: int = 128, num_labels: int = 2
) -> mixprec.Workload:
    config = BertConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=max(1, hidden_size // 64),
        intermediate_size=4 * hidden_size,
        num_labels=num_labels,
        hidden_dropout_prob=0.0,  # the numerics check compares formats, not dropout masks
        attention_probs_dropout_prob=0.0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)

    def make_batch(batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, config.vocab_size, (batch_size, seq_len), generator=generator)
        labels = torch.randint(0, num_labels, (batch_size,), generator=generator)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        return {k: v.to(device) for k, v in batch.items()}

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    return mixprec.Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        name="bert-from-config",
        default_batch_size=8,
        description=f"BERT from a config ({num_hidden_layers} layers, {hidden_size} wide), seq_len {seq_len}",
    )
