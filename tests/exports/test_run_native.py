"""The mixprec and plain-PyTorch exports, run on CPU: hooks confirm each policy, and both train the
same weights bit for bit (the plain text is everything Policy does, written out)."""

from __future__ import annotations

import pytest
import torch
from harness import CASES, STEPS, run_case, run_plain

# tf32 is a CUDA math mode: on a CPU it would be plain fp32 under a tf32 label.
REFUSED = {"tf32"}


@pytest.mark.parametrize("target", ["mixprec", "pytorch"])
@pytest.mark.parametrize("case", CASES)
def test_export_runs_the_policy(target, case):
    run_case(target, case, REFUSED, lambda config: run_plain(config, target))


@pytest.mark.parametrize("case", [c for c in CASES if c not in REFUSED])
def test_plain_and_mixprec_train_identically(case):
    config = CASES[case]
    plain = run_plain(config, "pytorch")
    via_mixprec = run_plain(config, "mixprec")
    weights = plain.model.state_dict(), via_mixprec.model.state_dict()
    for key, value in weights[0].items():
        assert value.dtype == weights[1][key].dtype
        # bit for bit; NaN where both are (fp16-true with AdamW: its eps underflows in fp16)
        torch.testing.assert_close(value, weights[1][key], rtol=0, atol=0, equal_nan=True, msg=key)
    stats = via_mixprec.namespace["policy"].stats
    assert stats.steps == STEPS
    assert plain.namespace["scheduler"].last_epoch == stats.steps - stats.skipped_steps
    if config.spec.loss_scaling:
        assert plain.scaler.get_scale() == stats.scale
        if config.spec.autocast_dtype is not None:
            assert stats.skipped_steps == 1  # the planted overflow (fp16-true's AdamW makes NaN weights)
