"""A transformers-examples-style script: a small causal LM built from its config (no download), a
dataset of token blocks, TrainingArguments from the command line, Trainer.train().

    python hf_trainer.py --output_dir out --max_steps 200 [--bf16] [--per_device_train_batch_size 8] [--tiny]

An evaluation split is there for the arguments that need one (``--eval_strategy steps
--load_best_model_at_end``); ``--tiny``: a one-layer model of width 64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments

BLOCK = 64


class Blocks(Dataset):
    """Token blocks from a fixed random bigram table (learnable, the same every run)."""

    def __init__(self, n: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        table = torch.softmax(torch.randn(vocab, vocab, generator=g) * 3, dim=-1)
        ids = torch.empty(n, BLOCK, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        cdf = table.cumsum(-1)  # (inverse-CDF sampling: 25x faster here than multinomial per step)
        for t in range(BLOCK - 1):
            u = torch.rand(n, 1, generator=g)
            ids[:, t + 1] = torch.searchsorted(cdf[ids[:, t]], u).squeeze(1).clamp_(max=vocab - 1)
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@dataclass
class ScriptArguments:
    tiny: bool = False


def main() -> None:
    args, own = HfArgumentParser((TrainingArguments, ScriptArguments)).parse_args_into_dataclasses()
    torch.manual_seed(0)
    width, layers = (64, 1) if own.tiny else (256, 4)
    config = GPT2Config(vocab_size=512, n_positions=BLOCK, n_embd=width, n_layer=layers, n_head=4)
    model = GPT2LMHeadModel(config)
    data = Blocks(4096, config.vocab_size)
    trainer = Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=torch.utils.data.Subset(data, range(64))
    )
    trainer.train()


if __name__ == "__main__":
    main()
