"""The zoo's nanoGPT (4 layers x 256, seq 128, batch 8, AdamW) fed uniformly random tokens: data with
nothing to learn, as many users benchmark (issue 53). Its fp32 loss stays at log(vocab), so no loss
trajectory can tell a candidate from fp32: a tune over it must say its numerics are not verified.

    mixprec tune --workload benchmarks/workloads/gpt_random_tokens.py:workload --json out.json
"""

from __future__ import annotations

from dataclasses import replace

import torch

import mixprec

SEQ_LEN = 128


def workload() -> mixprec.Workload:
    base = mixprec.load_workload("gpt2", n_layer=4, n_head=4, n_embd=256, seq_len=SEQ_LEN)
    vocab = base.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (batch_size, SEQ_LEN + 1), generator=generator)
        return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

    return replace(base, make_batch=make_batch, name="gpt2-random-tokens")
