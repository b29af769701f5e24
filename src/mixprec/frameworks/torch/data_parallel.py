"""Measure one candidate data-parallel: ``nproc`` ranks under DDP, one process each.

Each rank rebuilds the workload from its spec, trains the candidate wrapped with
:func:`mixprec.distributed.apply_ddp` (gloo on CPU, nccl on CUDA, rank r on cuda:r) and writes
its measurement to a file; the parent combines them. Global throughput counts every rank's
batch per step of the slowest rank; the per-rank step times show the spread. Pruning is not
applied here: every rank has to finish its steps for the collectives to complete.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mixprec.frameworks.session import BenchSettings, Measurement
from mixprec.policy import Candidate
from mixprec.process import current_rss_bytes, let_gloo_workers_finish, main_module_hidden, peak_rss
from mixprec.workload import WorkloadSpec
from mixprec.workload.output import captured_fds


@dataclass
class DataParallelOutcome:
    status: str  # ok | error
    reason: str = ""
    ranks: list[Measurement] | None = None
    nproc: int = 1
    wall_s: float = 0.0  # the whole run: starting the ranks, training, joining them


def _rank_main(
    rank: int,
    nproc: int,
    spec: dict[str, Any],
    candidate: Candidate,
    settings: BenchSettings,
    init_file: str,
    out_dir: str,
) -> None:
    """One rank: everything it learns goes to out_dir/rank{rank}.json; errors are written, not raised."""
    import torch
    import torch.distributed as dist

    from mixprec.distributed import apply_ddp
    from mixprec.workload.loader import workload_from_spec

    out = Path(out_dir) / f"rank{rank}.json"
    try:
        cuda = settings.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(rank)
        torch.set_num_threads(max(1, (settings.threads or torch.get_num_threads()) // nproc))
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=nproc
        )
        try:
            rss_before = current_rss_bytes()
            with captured_fds():  # the factory's prints: shown once by the parent, not once per rank
                workload = workload_from_spec(
                    WorkloadSpec(spec["kind"], spec["target"], tuple(spec["sizes"].items()))
                )
            from mixprec.frameworks.torch.session import run_candidate

            # every rank must run the same steps for the collectives: fixed counts, no time target
            rank_settings = replace(
                settings,
                device=f"cuda:{rank}" if cuda else "cpu",
                seed=settings.seed + rank,
                adaptive_warmup=False,
                min_time_s=0.0,
            )
            m = run_candidate(
                workload, candidate, rank_settings, wrap_model=lambda model, policy: apply_ddp(model, policy)
            )
            if m.peak_memory_bytes is None:
                # (its own high-water mark: ru_maxrss would carry the spawning process's across exec)
                m.peak_memory_bytes = max(0, peak_rss() - rss_before)
                m.memory_method = "peak RSS per rank minus its RSS before building"
            out.write_text(json.dumps({"ok": True, "measurement": asdict(m)}), encoding="utf-8")
        finally:
            dist.destroy_process_group()
            let_gloo_workers_finish()  # (this rank's DDP model can outlive the group: see the function)
    except BaseException as exc:  # the parent reads the reason from the file
        out.write_text(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), encoding="utf-8")


def run_data_parallel(
    spec: WorkloadSpec, candidate: Candidate, settings: BenchSettings, nproc: int
) -> DataParallelOutcome:
    """Run ``candidate`` on ``nproc`` DDP ranks and return every rank's measurement."""
    start = time.perf_counter()
    outcome = _run(spec, candidate, settings, nproc)
    outcome.nproc, outcome.wall_s = nproc, time.perf_counter() - start
    return outcome


def _run(
    spec: WorkloadSpec, candidate: Candidate, settings: BenchSettings, nproc: int
) -> DataParallelOutcome:
    import torch.multiprocessing as tmp_mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "pg_init")
        try:
            with main_module_hidden():
                tmp_mp.start_processes(
                    _rank_main,
                    args=(nproc, spec.to_dict(), candidate, settings, init_file, tmp),
                    nprocs=nproc,
                    join=True,
                    start_method="spawn",
                )
        except Exception as exc:  # a rank that died without writing its file (killed, segfault)
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return DataParallelOutcome("error", f"data-parallel run failed: {first}")
        ranks, errors = [], []
        for r in range(nproc):
            path = Path(tmp) / f"rank{r}.json"
            data: dict[str, Any] = (
                json.loads(path.read_text(encoding="utf-8"))
                if path.exists()
                else {"ok": False, "error": "no result"}
            )
            if data["ok"]:
                ranks.append(Measurement(**data["measurement"]))
            else:
                errors.append(f"rank {r}: {data['error']}")
    if errors:
        return DataParallelOutcome("error", "; ".join(errors))
    return DataParallelOutcome("ok", ranks=ranks)
