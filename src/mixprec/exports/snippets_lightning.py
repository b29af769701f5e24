"""Lightning helper code the ``lightning`` export emits; real Python, linted, run by the frameworks tier.

Never imported by mixprec itself (importing lightning takes seconds and it is optional):
:func:`mixprec.exports.lightning.source` reads the blocks from this file's text.
"""

from __future__ import annotations

from lightning.pytorch.plugins.precision import HalfPrecision


class HalfPrecisionKeepBatch(HalfPrecision):
    """Lightning's bf16-true/16-true precision without its cast of the whole batch.

    HalfPrecision.convert_input casts every floating-point tensor of the batch to the half dtype,
    float targets included. mixprec casts only the model's inputs (a forward pre-hook), so targets
    keep their precision: this plugin leaves the batch alone and the LightningModule's pre-hook casts.
    """

    def convert_input(self, data: object) -> object:
        return data
