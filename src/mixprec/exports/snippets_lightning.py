"""Lightning helper code the ``lightning`` export emits; real Python, linted, run by the frameworks tier.

Never imported by mixprec itself (importing lightning takes seconds and it is optional):
:func:`mixprec.exports.lightning.source` reads the blocks from this file's text. The export emits
the :mod:`mixprec.policy.hooks` helpers they call (``keep_batch_norm_fp32``) above them.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import HalfPrecision

from mixprec.policy.hooks import keep_batch_norm_fp32


class HalfPrecisionKeepBatch(HalfPrecision):
    """Lightning's bf16-true/16-true precision without its cast of the whole batch, BatchNorm kept fp32.

    HalfPrecision.convert_input casts every floating-point tensor of the batch to the half dtype,
    float targets included. mixprec casts only the model's inputs (a forward pre-hook), so targets
    keep their precision: this plugin leaves the batch alone and the LightningModule's pre-hook casts.
    HalfPrecision.convert_module casts the whole module, BatchNorm included (an fp16 running variance
    overflows to inf on large activations); this plugin keeps BatchNorm's weights and running
    statistics fp32 as mixprec does, with the values they had before the cast (fit(ckpt_path=...)
    loads a checkpoint before it): BatchNorm takes the half inputs and returns their dtype.
    """

    def convert_input(self, data: object) -> object:
        return data

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        norm = torch.nn.modules.batchnorm._BatchNorm
        saved = {
            name: {k: v.clone() for k, v in m.state_dict().items()}
            for name, m in module.named_modules()
            if isinstance(m, norm)
        }
        module = super().convert_module(module)  # the whole module to the half dtype
        for name in keep_batch_norm_fp32(module):  # back to fp32, then the values before the cast
            module.get_submodule(name).load_state_dict(saved[name])
        return module
