"""Keras workloads on TensorFlow (the tensorflow extra): policies against plain Keras, the dtype
honesty probe, fp32 islands, check on a planted fp16 overflow, paired bench rows, tune and exports.
Tiny models only; the keras.applications models run in benchmarks/seed_table_tf.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import mixprec

if os.environ.get("MIXPREC_REQUIRE_FRAMEWORKS") == "1":
    import tensorflow  # noqa: F401  (make test installs the extra: a missing one is a failure)
else:
    pytest.importorskip("tensorflow", reason="tensorflow is not installed: pip install -e '.[tensorflow]'")

import keras
import tensorflow as tf

from mixprec.errors import UsageError
from mixprec.frameworks.keras.trainer import KerasTrainer, make_batches
from mixprec.frameworks.session import HonestyError
from mixprec.keras import KerasWorkload, load_keras_workload
from mixprec.policy import Candidate

pytestmark = pytest.mark.tensorflow
OVERFLOW = str(Path(__file__).parent / "keras_workloads" / "overflow.py") + ":make_workload"


def tf_cand(policy: str, **kw) -> Candidate:
    return Candidate(policy, framework="tensorflow", **kw)


@pytest.fixture(autouse=True)
def _keras_state_unchanged():
    """Every test leaves Keras' global dtype policy and TensorFlow's TF32 switch as found."""
    policy = keras.mixed_precision.global_policy().name
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    yield
    assert keras.mixed_precision.global_policy().name == policy
    assert tf.config.experimental.tensor_float_32_execution_enabled() == tf32


@pytest.fixture(scope="module")
def mlp():
    return load_keras_workload("mlp")


@pytest.fixture(scope="module")
def batches(mlp):
    return make_batches(mlp, 16, "cpu", 0, 2)


def plain_keras_step(workload, dtype_policy, batch, loss_scale):
    """One step as a Keras user writes it: global policy, float32 output layer, compile, train_on_batch."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(dtype_policy)
    try:
        model = workload.make_model()
        model.layers[-1].dtype_policy = "float32"
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        if loss_scale:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss=keras.losses.CategoricalCrossentropy(), jit_compile=False)
        loss = float(model.train_on_batch(batch[0], batch[1]))
        return loss, [w.astype(np.float32) for w in model.get_weights()]
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize(
    ("policy", "dtype_policy", "tol"),
    [
        ("fp32", "float32", 1e-6),
        ("bf16-mixed", "mixed_bfloat16", 1e-6),
        ("fp16-mixed", "mixed_float16", 1e-6),
    ],
)
def test_policy_trains_like_plain_keras(mlp, batches, policy, dtype_policy, tol):
    trainer = KerasTrainer(mlp, tf_cand(policy), "cpu", batches[0])
    loss, applied = trainer.step(batches[0])
    expected_loss, expected_weights = plain_keras_step(mlp, dtype_policy, batches[0], policy == "fp16-mixed")
    assert applied and loss == pytest.approx(expected_loss, rel=tol)
    for ours, theirs in zip(trainer.model.get_weights(), expected_weights, strict=True):
        np.testing.assert_allclose(ours.astype(np.float32), theirs, rtol=1e-5, atol=1e-6)
    assert (
        trainer.observed_dtype
        == {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[policy]
    )
    assert trainer.model.layers[-1].compute_dtype == "float32"  # the softmax output in float32
    assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer) == (policy == "fp16-mixed")


def test_true_policies_store_half_weights_copied_from_fp32(mlp, batches):
    fp32 = KerasTrainer(mlp, tf_cand("fp32"), "cpu", batches[0])
    from mixprec.frameworks.keras.trainer import reference_weights

    true = KerasTrainer(
        mlp, tf_cand("bf16-true"), "cpu", batches[0], reference_weights(mlp, tf_cand("bf16-true"), "cpu")
    )
    kernel = true.model.get_layer("fc1").kernel
    assert kernel.dtype == "bfloat16" and true.observed_dtype == "bfloat16"
    expected = tf.cast(tf.cast(fp32.model.get_layer("fc1").kernel, tf.bfloat16), tf.float32).numpy()
    np.testing.assert_array_equal(tf.cast(kernel, tf.float32).numpy(), expected)


def test_keep_fp32_builds_named_layers_in_float32(mlp, batches):
    trainer = KerasTrainer(mlp, tf_cand("bf16-true", keep_fp32=("fc1",)), "cpu", batches[0])
    fc1, fc2 = trainer.model.get_layer("fc1"), trainer.model.get_layer("fc2")
    assert fc1.compute_dtype == "float32" and fc1.kernel.dtype == "float32"
    assert fc2.compute_dtype == "bfloat16" and fc2.kernel.dtype == "bfloat16"
    assert trainer.observed_layer == "fc2"  # the island is skipped by the honesty probe
    with pytest.raises(UsageError, match=r"match no layer.*fc1"):
        KerasTrainer(mlp, tf_cand("bf16-mixed", keep_fp32=("nope*",)), "cpu", batches[0])


def test_honesty_probe_catches_a_policy_that_did_not_apply(batches):
    def make_model():  # every layer pinned to float32: the global policy cannot reach them
        inputs = keras.Input((64,))
        x = keras.layers.Dense(32, activation="relu", dtype="float32", name="pinned")(inputs)
        return keras.Model(inputs, keras.layers.Dense(10, activation="softmax", dtype="float32")(x))

    pinned = KerasWorkload(make_model, lambda b: batches[0], keras.losses.CategoricalCrossentropy())
    with pytest.raises(HonestyError, match=r"'pinned' computed in float32 instead of bfloat16"):
        KerasTrainer(pinned, tf_cand("bf16-mixed"), "cpu", batches[0])


def test_train_step_is_traced_from_the_imported_code_not_the_file_on_disk(mlp, batches, tmp_path):
    """Regression: AutoGraph re-read the train step's source file when each candidate process traced
    it; a file edited during a run (line numbers shifted) made it convert other lines, and the
    step failed with "The truth value of an array ... is ambiguous". The module is loaded from a
    copy whose lines then move, as an edit during a sweep moves them."""
    import importlib.util

    import mixprec.frameworks.keras.trainer as trainer_module

    copy = tmp_path / "trainer_copy.py"
    source = Path(trainer_module.__file__).read_text(encoding="utf-8")
    copy.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("_mixprec_trainer_copy", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    copy.write_text(source.replace("SEED = 0\n", "SEED = 0\n" + "# edited\n" * 5, 1), encoding="utf-8")
    for policy in ("fp32", "fp16-mixed"):
        trainer = module.KerasTrainer(mlp, tf_cand(policy), "cpu", batches[0])
        loss, _ = trainer.step(batches[0])
        assert np.isfinite(loss)


def test_xla_candidate_compiles_up_front_and_starts_from_the_initial_state(mlp, batches, monkeypatch):
    """An XLA step compiles on its first execution: the trainer runs it while built (timed with the
    trace, so pruning never sees a compile as a slow step) and then restores weights and optimizer,
    so its first measured step trains from the same state as the plain tf.function step."""
    steps_run_before_reset = []
    original_reset = KerasTrainer.reset

    def reset(self, *args, **kwargs):
        steps_run_before_reset.append(int(self.optimizer.iterations.numpy()))
        original_reset(self, *args, **kwargs)

    monkeypatch.setattr(KerasTrainer, "reset", reset)
    plain = KerasTrainer(mlp, tf_cand("fp32"), "cpu", batches[0])
    assert steps_run_before_reset == []  # a plain tf.function step is traced only
    xla = KerasTrainer(mlp, tf_cand("fp32", compile="xla"), "cpu", batches[0])
    assert steps_run_before_reset == [1]  # one compiling step, then the initial state back
    assert xla._step.experimental_get_tracing_count() == 1
    for restored, initial in zip(xla.model.get_weights(), plain.model.get_weights(), strict=True):
        np.testing.assert_array_equal(restored, initial)
    assert int(xla.optimizer.iterations.numpy()) == 0
    for batch in batches[:2]:
        assert xla.step(batch)[0] == pytest.approx(plain.step(batch)[0], rel=1e-4)


def test_scope_sets_and_restores_dtype_policy_and_tf32():
    from mixprec.frameworks.keras.policy import KerasPolicy

    with KerasPolicy(tf_cand("fp16-mixed")).scope():
        assert keras.mixed_precision.global_policy().name == "mixed_float16"
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    with KerasPolicy(tf_cand("tf32")).scope():
        assert tf.config.experimental.tensor_float_32_execution_enabled()


def test_check_names_the_overflowing_layer_and_verifies_the_float32_fix():
    result = mixprec.check(
        load_keras_workload(OVERFLOW), policies=["fp16-mixed", "bf16-mixed"], steps=4, device="cpu", fix=True
    )
    fp16, bf16 = result.candidates
    assert fp16.verdict == "fail" and "non-finite" in fp16.reason and "'energy'" in fp16.reason
    assert fp16.first_nonfinite_forward == "energy"
    assert fp16.fix_keep_fp32 == ["energy"] and fp16.fix_verified
    assert bf16.verdict == "pass", bf16.reason  # bf16 has fp32's range: no overflow
    assert fp16.candidate.framework == "tensorflow"


def test_check_sees_a_late_keras_overflow_coming_through_the_shared_checker():
    late = str(Path(__file__).parent / "keras_workloads" / "late_overflow.py") + ":make_workload"
    result = mixprec.check(load_keras_workload(late), policies=["fp16-mixed", "bf16-mixed"], device="cpu")
    fp16, bf16 = result.candidates
    assert fp16.verdict == "at-risk", fp16.reason
    assert "'head'" in fp16.reason and "predicted to overflow fp16" in fp16.reason
    assert 60 <= fp16.outlook["at_risk"]["step"] <= 300, fp16.outlook
    assert bf16.verdict == "pass", bf16.reason


def test_cli_check_of_the_planted_overflow_names_the_layer_and_the_fix(tmp_path, capsys):
    """The command a Keras user runs: exit 4 (a candidate failed), the overflowing layer and the
    verified keep_fp32 fix in the text, and the chart drawn from forward-only Keras ranges."""
    from mixprec.cli import main

    code = main(
        [
            "check",
            "--framework",
            "tensorflow",
            "--workload",
            OVERFLOW,
            "--policies",
            "fp16-mixed",
            "--fix",
            "--plot",
            str(tmp_path / "check.png"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 4, out
    assert "first non-finite output in 'energy'" in out
    # (over the steps power-first ran: its 8 asked for, or more where the reference had not learnt yet)
    assert re.search(
        r"least fp16 headroom over the \d+ checked steps: energy \(ScaledDense\): forward -inf \(step 0\)",
        out,
    )
    assert "fix: build the Keras layers ['energy'] with dtype=\"float32\" under fp16-mixed" in out
    assert "GradScaler" not in out and "get_policy" not in out  # torch's words, not a Keras user's
    assert "start-up steps" not in out  # an overflow in the forward pass is no scale warm-up
    assert (tmp_path / "check.png").stat().st_size > 0


def test_check_reports_sqnr_scale_and_stalled_updates(mlp):
    result = mixprec.check(mlp, policies=["fp16-mixed", "bf16-true"], steps=3, device="cpu")
    fp16, bf16_true = result.candidates
    assert fp16.output_sqnr_db > 30 and fp16.total_grad_sqnr_db > 20
    assert fp16.scales == [32768.0] * 3 and fp16.skipped_steps == 0
    assert bf16_true.stalled_update_fraction is not None and bf16_true.stalled_update_fraction > 0.05
    assert json.loads(json.dumps(result.to_dict()))["candidates"][0]["candidate"]["framework"] == "tensorflow"


@pytest.mark.slow
def test_bench_pairs_keras_candidates_in_their_own_processes(mlp, tmp_path, capfd):
    from mixprec.measure.results import BenchResult

    result = mixprec.bench(
        mlp,
        policies="fp32,bf16-mixed,tf32",
        compile="both",
        steps=2,
        warmup=1,
        device="cpu",
        jsonl=tmp_path / "r.jsonl",
    )
    rows = {r.label: r for r in result.rows}
    assert rows["bf16-mixed"].status == "ok" and rows["bf16-mixed"].observed_dtype == "bfloat16"
    assert rows["bf16-mixed"].paired_ratios and rows["bf16-mixed"].peak_memory_bytes
    assert rows["bf16-mixed+xla"].status == "ok" and rows["tf32"].status == "unsupported"
    assert rows["fp32"].first_loss == pytest.approx(rows["bf16-mixed"].first_loss, rel=1e-2)
    again = BenchResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert {r.candidate for r in again.rows} == {r.candidate for r in result.rows}
    assert all(r.candidate.framework == "tensorflow" for r in again.rows)
    # the JSON Lines log is append-only (strict fp32 is written when first measured and again, marked
    # as the repeat, when its paired repeats are done): the last line of each row is the row
    from mixprec.measure.rowstore import read_jsonl

    logged = {r.key[:4]: r.status for r in read_jsonl(tmp_path / "r.jsonl")}  # key[4]: the repeat mark
    assert logged == {r.key[:4]: r.status for r in result.rows}
    # the candidate processes (and their fork server) import TensorFlow as quietly as the parent
    chatter = capfd.readouterr().err
    assert "InitializeLog" not in chatter and "oneDNN custom operations" not in chatter, chatter[-2000:]


@pytest.mark.slow
def test_tune_recommends_a_measured_passing_candidate_with_keras_code(mlp, tmp_path):
    from mixprec.report.html import write_report
    from mixprec.tuning import TuneResult

    # the pick, its code and its report: a short budget (the race it may cut is not asserted here)
    result = mixprec.tune(mlp, budget_s=30, steps=2, check_steps=3, device="cpu", compile_modes=())
    rec = result.recommendation
    assert rec is not None and rec.candidate.framework == "tensorflow"
    ranked = {r.candidate: r for r in result.ranked}
    assert ranked[rec.candidate].status == "recommended"
    code = result.exports["keras"]
    assert "set_global_policy" in code and "enable_tensor_float_32_execution(False)" in code
    compile(code, "keras_export.py", "exec")
    again = TuneResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again.recommendation.candidate == rec.candidate
    assert (write_report(again, tmp_path)["html"]).exists()


def test_keras_code_per_policy():
    from mixprec.frameworks.keras.export import keras_code

    fp16 = keras_code(tf_cand("fp16-mixed", keep_fp32=("energy",)))
    assert (
        'set_global_policy("mixed_float16")' in fp16 and "LossScaleOptimizer(" in fp16 and "'energy'" in fp16
    )
    assert "MirroredStrategy" in fp16 and 'dtype_policy = "float32"' in fp16
    assert "LossScaleOptimizer(" not in keras_code(tf_cand("bf16-mixed"))
    assert "jit_compile=True" in keras_code(tf_cand("fp32", compile="xla"))
    assert "enable_tensor_float_32_execution(True)" in keras_code(tf_cand("tf32"))


def test_cli_bench_and_errors(tmp_path, capsys):
    from mixprec.cli import main

    out = tmp_path / "b.json"
    code = main(
        [
            "bench",
            "--framework",
            "tensorflow",
            "--model",
            "mlp",
            "--policies",
            "fp32,bf16-mixed",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--min-time",
            "0",
            "--in-process",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["label"] for r in rows] == ["fp32", "bf16-mixed"] and rows[1]["framework"] == "tensorflow"
    assert main(["bench", "--framework", "tensorflow", "--model", "mlp", "--nproc", "2"]) == 2
    assert (
        "nproc > 1 (data-parallel ranks) is not available for Keras 3 on TensorFlow"
        in capsys.readouterr().err
    )
    assert main(["bench", "--framework", "tensorflow", "--model", "gpt2"]) == 2
    assert "Keras zoo model (resnet50, vgg19, densenet121, mlp)" in capsys.readouterr().err


def test_env_states_the_tf32_override_caveat(monkeypatch):
    from mixprec.frameworks.keras.environment import tensorflow_facts

    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    facts = tensorflow_facts("cpu")
    assert facts["nvidia_tf32_override"] == "0" and facts["nvidia_tf32_override_honoured"] is False
    assert "ignores NVIDIA_TF32_OVERRIDE" in facts["tf32_note"]
    assert facts["tensorflow_version"].startswith("2.21")


def test_torchs_compiler_loads_after_tensorflow_without_a_crash():
    """``import tensorflow`` then triton (``torch._dynamo``, any ``torch.compile``) killed the process
    with a segmentation fault: mixprec's TensorFlow import loads torch's compiler stack first."""
    import subprocess
    import sys

    # the order under test: the backend's tf() first, then torch's compiler
    code = "from mixprec.frameworks.keras.backend import tf\ntf()\nimport torch._dynamo, triton\nprint(1)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "1", (done.returncode, done.stderr[-2000:])
