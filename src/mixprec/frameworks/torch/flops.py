"""FLOPs of one torch training step (torch.utils.flop_counter, the convolution backward counted right)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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


class StepFlops(FlopCounterMode):
    """:func:`count_flops`'s counter for a step mixprec does not call itself (a script's: entered
    where the step begins, left where it ends), leaving out what runs while :meth:`paused` (mixprec's
    own GEMMs inside the step, a census's quantised ones)."""

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping=_CORRECTED)
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        if self._paused:  # (FlopCounterMode's one seam between running an op and counting it)
            return out
        return super()._count_flops(func_packet, out, args, kwargs)

    @property
    def total(self) -> int:
        return int(self.get_total_flops())
