"""torch's peak memory of one training step at a batch size (``Framework.peak_memory``).

On a GPU it is the allocator's own figure (``torch.cuda.max_memory_allocated``, and
``max_memory_reserved`` for what the caching allocator held). A CPU keeps no such statistics, so
there the tensor bytes alive at the step's peak are tracked by PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch mode: parameters, gradients,
optimizer state, activations, temporaries, rounded to the CUDA allocator's 512-byte blocks). A
compiled step allocates inside its generated code, out of the dispatcher's sight: on a CPU its
eager twin is measured and the method says so.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import torch
from torch.utils._pytree import tree_leaves

from mixprec.frameworks.session import BenchSettings, MemoryPoint
from mixprec.frameworks.torch.session import TrainingSession
from mixprec.policy import Candidate
from mixprec.workload import Workload


def peak_memory(
    workload: Workload, candidate: Candidate, device: str, batch_size: int, accumulation_steps: int = 1
) -> MemoryPoint:
    """The peak of ``candidate``'s second training step at ``batch_size`` per micro-batch (the first
    creates the optimizer's state, which the steady state holds); with ``accumulation_steps`` > 1
    the step runs that many micro-batches, the gradients of the first held through the next."""
    dev = torch.device(device)
    eager_twin = candidate.compile is not None and dev.type != "cuda"
    # MemTracker follows one forward per step; on a CPU an accumulating step is one micro-batch's
    # step plus the gradients held into the next forward (an upper bound: part of them is already in
    # the backward's peak)
    held = accumulation_steps > 1 and dev.type != "cuda"
    if held:
        accumulation_steps = 1
    measured = replace(candidate, compile=None, compile_scope=None) if eager_twin else candidate
    settings = BenchSettings(
        device=device,
        batch_size=batch_size,
        steps=1,
        warmup=1,
        profile=False,
        adaptive_warmup=False,
        accumulation_steps=accumulation_steps,
    )
    session = TrainingSession(workload, measured.unbatched, settings)
    try:
        session.step(timed=False)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            session.step(timed=False)
            return MemoryPoint(
                batch_size,
                int(torch.cuda.max_memory_allocated(dev)),
                int(torch.cuda.max_memory_reserved(dev)),
                {},
                "torch.cuda.max_memory_allocated (the allocator's whole device, this step's peak)",
            )
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        inputs = [t for t in tree_leaves(session.batches) if isinstance(t, torch.Tensor)]
        tracker.track_external(session.model, session.optimizer, *inputs)
        with tracker:
            session.step(timed=False)
        peak = tracker.get_tracker_snapshot("peak").get(dev, {})
        parts = {str(getattr(k, "value", k)): int(v) for k, v in peak.items() if str(k) != "Total"}
        method = "tensor bytes at the step's peak (torch MemTracker)" + (
            ", of the eager twin (a compiled step allocates out of its sight)" if eager_twin else ""
        )
        total = int(peak.get("Total", sum(parts.values())))
        if held:
            grads = sum(p.numel() * p.element_size() for p in session.model.parameters() if p.requires_grad)
            parts["Gradient held between micro-batches"] = grads
            total += grads
            method += ", plus the gradients held between micro-batches"
        return MemoryPoint(batch_size, total, None, parts, method)
    finally:
        del session
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
