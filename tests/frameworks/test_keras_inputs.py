"""A Keras workload that cannot train is refused before anything is measured, as a torch one is
(issue 39: a model with no trainable weights passed `check`, exit 0)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("MIXPREC_REQUIRE_FRAMEWORKS") == "1":
    import tensorflow  # noqa: F401  (make test installs the extra: a missing one is a failure)
else:
    pytest.importorskip("tensorflow", reason="tensorflow is not installed: pip install -e '.[tensorflow]'")

from mixprec.cli import main

pytestmark = pytest.mark.tensorflow
FROZEN = str(Path(__file__).parent / "keras_workloads" / "frozen.py") + ":make_workload"


def test_check_refuses_a_keras_model_without_trainable_weights(capsys):
    code = main(
        [
            "check",
            "--framework",
            "tensorflow",
            "--workload",
            FROZEN,
            "--policies",
            "bf16-mixed",
            "--steps",
            "2",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "no trainable weights" in err and "4 weights, all frozen" in err and "trainable = True" in err
