"""The README's Python blocks run, in order, as a user would paste them: the README cannot drift
from the code. The blocks see what a user's script would already have: a small ``model`` with a
``head`` (fresh for every block), a ``loader`` of batches, a ``loss_fn``, ``local_rank`` and, for
the multi-GPU block, a one-rank gloo process group.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def user_script_globals() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": TinyNet(),
        "loader": [
            (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)
        ],
        "loss_fn": lambda model, batch: F.cross_entropy(model(batch[0]).float(), batch[1]),
        "local_rank": 0,
    }


@pytest.fixture
def one_rank_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path, monkeypatch, one_rank_process_group, single_thread):
    monkeypatch.chdir(tmp_path)  # the loop block writes ckpt.pt
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 4, "the README lost its Python examples"
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        namespace.update(user_script_globals())
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as exc:  # the block and its error, not a bare traceback into exec
            pytest.fail(f"README python block {i + 1} failed: {type(exc).__name__}: {exc}\n{block}")
    assert (tmp_path / "ckpt.pt").is_file()
    assert isinstance(namespace["policy"], namespace["mixprec"].Policy)


def test_readme_names_exist_in_the_public_api():
    """Every `mixprec.<name>` the README mentions is importable from mixprec."""
    import mixprec

    text = README.read_text(encoding="utf-8")
    names = set(re.findall(r"\bmixprec\.([a-z_A-Z]+)\b", text))
    missing = sorted(
        n
        for n in names
        if not hasattr(mixprec, n) and n not in ("distributed", "tuning", "numerics", "keras")
    )
    assert not missing, f"README mentions mixprec.{missing} which `import mixprec` does not provide"
