"""FLOPs of one torch training step (torch.utils.flop_counter, the convolution backward counted right)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count


def conv_backward_flops(
    grad_out_shape: list[int],
    x_shape: list[int],
    w_shape: list[int],
    _bias: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    _groups: int,
    output_mask: list[bool],
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """FLOPs of ``aten.convolution_backward``: the forward's FLOPs once per gradient computed.

    The gradient of the input is a (transposed) convolution of the output gradient with the
    weight, the gradient of the weight a convolution of the input with the output gradient:
    each multiplies exactly the pairs the forward did. torch's own formula (2.14) computes the
    weight gradient without the groups, so a depthwise layer's backward counts ``channels``
    times too many FLOPs (EfficientNet: 164 GFLOP of backward against 4 GFLOP of forward).
    """
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed=transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


_CORRECTED = {torch.ops.aten.convolution_backward: conv_backward_flops}


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs PyTorch's FlopCounterMode attributes to running ``fn`` once (matmuls, convs, attention).

    Elementwise ops, norms and optimizer updates count as zero, which is the usual MFU convention.
    A backward pass counts too: a Linear layer's backward is 2x its forward when the input needs a
    gradient and 1x when only the weight does; grouped convolutions' backward is counted with
    :func:`conv_backward_flops`.
    """
    with FlopCounterMode(display=False, custom_mapping=_CORRECTED) as counter:
        fn()
    return int(counter.get_total_flops())
