"""The output a check takes its SQNR of (``model_output``), on outputs as models return them: a
tensor, an HF ``ModelOutput`` (with and without ``loss``), a dict, a ``return_dict=False`` tuple.
The torch path compared an HF output's first value, its scalar loss, where labels were given."""

from __future__ import annotations

import torch

from extras import require
from mixprec.frameworks.torch.probe import model_output

LOGITS = torch.randn(2, 5)
LOSS = torch.tensor(1.5)


def test_the_output_is_the_logits_never_the_loss():
    assert model_output(LOGITS) is LOGITS
    assert model_output({"loss": LOSS, "logits": LOGITS, "hidden": torch.randn(2, 3)}) is LOGITS
    assert model_output((LOSS, LOGITS)) is LOGITS  # (HF's return_dict=False with labels)
    assert model_output({"loss": LOSS}) is None  # (nothing but a loss: no output to compare)
    assert model_output([torch.arange(3), LOGITS]) is LOGITS  # (integer outputs are not compared)


def test_an_hf_model_output_gives_its_logits():
    require("transformers", "hf")
    from transformers.modeling_outputs import CausalLMOutput

    out = CausalLMOutput(loss=LOSS, logits=LOGITS)
    assert model_output(out) is LOGITS
