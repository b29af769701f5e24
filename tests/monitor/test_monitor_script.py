"""The monitor inside a script run by `mixprec run --monitor -- python train.py` (mixprec.monitor.script):
it watches the script's own model and optimizer and writes the run's record."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from mixprec.cli import main

SCRIPTS = Path(__file__).parents[1] / "frameworks" / "scripts"


def test_run_with_the_monitor_records_every_step_and_ends_healthy(tmp_path):
    out = tmp_path / "run"
    args = ["run", "--policy", "fp16-mixed", "--monitor", "--every", "4", "--out", str(out), "--"]
    assert main([*args, sys.executable, str(SCRIPTS / "by_hand.py"), "--out", str(tmp_path / "w.pt")]) == 0
    record = json.loads((out / "run.json").read_text())
    assert record["steps"] == 12 and len(record["losses"]) == 12 and record["healthy"] is True
    assert record["candidate"]["policy"] == "fp16-mixed" and record["facts"]["framework"] == "plain"
    assert (out / "events.jsonl").read_text() == ""  # written, with nothing found (it was missing)


def _run(tmp_path, *args, rescue=True, out="run"):
    """``mixprec run --rescue`` (or ``--monitor``) of bad_data.py in ``tmp_path`` (the test's folder:
    the script saves its ckpt.pt there, as a user's does); its exit code and run.json."""
    flag = "--rescue" if rescue else "--monitor"
    code = main(
        [
            "run",
            "--policy",
            "bf16-mixed",
            flag,
            "--out",
            out,
            "--",
            sys.executable,
            str(SCRIPTS / "bad_data.py"),
            *args,
        ]
    )
    record = json.loads((tmp_path / out / "run.json").read_text())
    return code, record


def _finite(path) -> bool:
    import torch

    return all(bool(torch.isfinite(v).all()) for v in torch.load(path).values() if v.is_floating_point())


def test_a_bad_batch_in_a_script_is_found_at_its_step_diagnosed_and_withheld(tmp_path, monkeypatch):
    """Issue 51 theme 7: one NaN batch under bf16-mixed --rescue gave one finding two steps late with
    empty evidence, 35 NaN steps and a NaN checkpoint saved by the script. The step is replayed from
    its tape in fp32: the batch (data), its update withheld and the BatchNorm statistics it moved put
    back; the same for targets 1000x too large; the run ends healthy and every checkpoint is finite."""
    monkeypatch.chdir(tmp_path)
    code, record = _run(tmp_path, "--steps", "100", "--nan-at", "25", "--spike-at", "80")
    assert code == 0 and record["healthy"] is True
    spikes = [(f["step"], f["evidence"].get("verdict")) for f in record["findings"] if f["kind"] == "spike"]
    assert spikes == [(25, "data"), (80, "data")], record["findings"]
    assert record["withheld"] == [25, 80]
    assert all(math.isfinite(v) for v in record["losses"][26:])
    assert _finite(tmp_path / "ckpt.pt")


def test_a_data_pipeline_that_turns_nan_stops_the_script(tmp_path, monkeypatch):
    """It was never stopped (docs: after 8 bad batches in a row): exit 4, the reason in run.json."""
    monkeypatch.chdir(tmp_path)
    code, record = _run(tmp_path, "--steps", "100", "--broken-from", "60")
    assert code == 4
    assert "the data pipeline is broken" in record["error"] and record["steps"] < 100


def test_a_scripts_checkpoint_of_nonfinite_state_is_refused(tmp_path, monkeypatch, capsys):
    """Watched without --rescue, the NaN batch's update lands and the weights go NaN: the script's
    own torch.save of them is refused (a finding, a line), so ckpt.pt keeps the last finite state."""
    monkeypatch.chdir(tmp_path)
    code, record = _run(tmp_path, "--steps", "40", "--nan-at", "25", rescue=False)
    assert code == 4 and record["healthy"] is False
    assert any(f["kind"] == "checkpoint_refused" for f in record["findings"])
    assert _finite(tmp_path / "ckpt.pt")


def test_a_lightning_scripts_fp16_overflow_is_watched_through_its_own_scaler(tmp_path, monkeypatch):
    """Round 3: a Lightning script under fp16-mixed with one module past fp16's range crashed the
    monitor's adapter ('NoneType' has no attribute 'findings'); a framework's loop steps its optimizer
    with a closure, so the monitor is built at the end of the first step and reads the skips of the
    Lightning plugin's GradScaler."""
    from extras import require

    require("lightning", "frameworks")
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "overflow.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "import lightning.pytorch as pl\n"
        "from torch import nn\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "class Big(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x * 30000.0  # past 65504 in fp16; LayerNorm brings it back in fp32\n"
        "class M(pl.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Linear(16, 32), Big(), nn.LayerNorm(32), nn.Linear(32, 4))\n"
        "    def training_step(self, batch, i):\n"
        "        return F.cross_entropy(self.net(batch[0]), batch[1])\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=1e-3)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, y = 10 * torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g)\n"
        "trainer = pl.Trainer(max_steps=6, accelerator='cpu', logger=False, enable_checkpointing=False,\n"
        "                     enable_progress_bar=False, enable_model_summary=False)\n"
        "trainer.fit(M(), DataLoader(TensorDataset(x, y), batch_size=32))\n"
    )
    out = tmp_path / "run"
    code = main(
        ["run", "--policy", "fp16-mixed", "--monitor", "--out", str(out), "--", sys.executable, str(script)]
    )
    record = json.loads((out / "run.json").read_text())
    assert record["steps"] == 6 and record["facts"]["framework"] == "lightning"
    assert record["findings"] and code == 4 and record["healthy"] is False


def test_a_k_fold_script_is_watched_fold_by_fold_to_its_end(tmp_path, capfd):
    """`mixprec run --monitor` of a k-fold script stopped it at the second fold (exit 2): the
    monitor was built for one model. Each fold is watched by its own; a NaN batch in the second is
    withheld and said with its model; every fold trains and the run exits 0."""
    out = tmp_path / "run"
    args = ["run", "--policy", "bf16-mixed", "--rescue", "--out", str(out), "--"]
    code = main([*args, sys.executable, str(SCRIPTS / "kfold.py"), "--nan-at", "1:3"])
    said = capfd.readouterr()
    assert code == 0, said.err
    record = json.loads((out / "run.json").read_text())
    assert record["steps"] == 18 and [m["withheld"] for m in record["models"]] == [[], [3], []], record
    assert "fold scores" in said.out and "step 3: spike (model 2)" in said.err, said.err
