"""What predicting a format's numerics costs here: one Linear layer's training step timed under the
candidate and under strict fp32, before its check is priced.

A prediction runs the format where the device has no kernels for it (fp8 on a CPU, through
torchao's recipe), and its check was priced at strict fp32's step. On a 2-core Xeon with AMX,
torchao's scaled matmul falls to oneDNN's reference kernel: one Linear(256, 1024) over 1024 rows
took 13.4 s in fp8-rowwise against 8.8 ms in fp32 (1500x), and the nanoGPT tune (4 x 256, its
50257-wide head) spent over 20 minutes of a 300 s budget in one fp8 prediction, then made a
Ctrl-C wait for the step under way. Timed on one small layer first, the ratio prices the check at
what it would take, and the tune says why it is not run.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import nn

from mixprec.numerics.emulate import emulation_context
from mixprec.policy import Candidate, get_policy

# The probe's layer and rows: a shape every low format's kernels take (multiples of 32), small
# enough that the slowest emulation measured (fp8 on the Xeon above: 600-2000x fp32) times it in
# well under a second, large enough that a matmul, not Python, is what is timed.
FEATURES = 256
ROWS = 64
TRIES = 2  # the first pays one-time costs (dispatch, a kernel's set-up): the faster one counts


def emulation_slowdown(candidate: Candidate, device: str) -> float:
    """How many times strict fp32's time one Linear layer's forward and backward take under
    ``candidate`` on ``device`` (at least 1.0: a prediction is never priced below strict fp32's
    step); the RNG, the math mode and the grad mode are left as they were. A probe that cannot run
    prices the check as before, at strict fp32's step: the check itself says what failed."""
    try:
        own = _layer_seconds(candidate, device)
        fp32 = _layer_seconds(Candidate("fp32"), device)
    except Exception:  # an optimisation of the price, never a reason for the tune to fail
        return 1.0
    if not (math.isfinite(own) and fp32 > 0):
        return 1.0
    return max(1.0, own / fp32)


def _layer_seconds(candidate: Candidate, device: str) -> float:
    policy = get_policy(candidate, device=device, check=False)
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = policy.prepare(nn.Sequential(nn.Linear(FEATURES, FEATURES)).to(device))
    x = torch.randn(ROWS, FEATURES, generator=generator).to(device)
    context = emulation_context(candidate.emulate) or contextlib.nullcontext
    best = math.inf
    with torch.enable_grad(), policy.precision_scope():
        for _ in range(TRIES):
            started = time.perf_counter()
            with context(), policy.autocast():
                out = layer(x)
            out.float().sum().backward()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
    return best
