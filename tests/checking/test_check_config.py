"""CheckConfig: what a check records of its settings is all of them, its thresholds too."""

from __future__ import annotations

import dataclasses
import json

from mixprec.checking.config import CheckConfig
from mixprec.policy import Candidate, Thresholds


def test_to_dict_records_the_thresholds_and_makes_the_same_config_again():
    """The thresholds were dropped from the record: a check judged under other thresholds read as the
    defaults' (no from_dict: the record's values make the config again through its own checks)."""
    thresholds = {
        "bf16-mixed": Thresholds(max_rel_loss_diff=0.2, min_output_sqnr_db=12.0, min_grad_sqnr_db=6.0)
    }
    config = CheckConfig(policies=("bf16-mixed", Candidate("fp16-mixed")), thresholds=thresholds, steps=4)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["thresholds"] == {"bf16-mixed": dataclasses.asdict(thresholds["bf16-mixed"])}
    assert data["policies"] == ["bf16-mixed", "fp16-mixed"]  # a Candidate by its label
    again = CheckConfig(**{**data, "thresholds": {k: Thresholds(**v) for k, v in data["thresholds"].items()}})
    assert again == dataclasses.replace(config, policies=("bf16-mixed", "fp16-mixed"))
    assert CheckConfig().to_dict()["thresholds"] is None
