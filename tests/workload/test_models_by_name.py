"""Models by name: torchvision:NAME, timm:NAME and hf:ARCH build the library's own model (checked
against building it directly), train one step, rebuild identically from their spec, and every bad
name, option or missing extra fails with one line naming the valid ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from extras import require
from mixprec.cli import main
from mixprec.errors import UsageError
from mixprec.workload import SOURCES, load_workload, parse_model_config, validate_workload, workload_from_spec
from mixprec.workload.models import list_models
from mixprec.workload.synthetic import MODEL_SEED

CPU = torch.device("cpu")


def _seeded(build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        return build()


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _groups(optimizer: torch.optim.Optimizer) -> list[tuple[float, set[int]]]:
    return sorted((g["weight_decay"], {id(p) for p in g["params"]}) for g in optimizer.param_groups)


# --------------------------------------------------------------------------------------------------
# torchvision


@pytest.mark.usefixtures("single_thread")
def test_torchvision_model_is_torchvisions_own_and_trains():
    import torchvision

    w = load_workload("torchvision:mobilenet_v3_small", image_size=64)
    plain = _seeded(lambda: torchvision.models.get_model("mobilenet_v3_small", weights=None))
    _same_weights(w.model, plain)
    assert w.name == "torchvision:mobilenet_v3_small" and w.spec.kind == "model"
    assert "3x64x64" in w.description and "torchvision" in w.description
    images, labels = w.make_batch(2, CPU)
    assert images.shape == (2, 3, 64, 64) and labels.shape == (2,) and int(labels.max()) < 1000
    # torchvision's recipe: SGD with momentum, no weight decay on norms and biases
    opt = w.make_optimizer(w.model)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9
    assert _groups(opt) == [
        (0.0, {id(p) for p in w.model.parameters() if p.dim() < 2}),
        (1e-4, {id(p) for p in w.model.parameters() if p.dim() >= 2}),
    ]
    validate_workload(w, device="cpu", batch_size=2)
    again = workload_from_spec(w.spec)
    _same_weights(again.model, w.model)


def test_torchvision_input_size_comes_from_the_recipe():
    w = load_workload("torchvision:inception_v3", num_classes=10)
    assert "3x299x299" in w.description and "10 classes" in w.description
    with pytest.raises(
        UsageError, match=r"image_size for model 'torchvision:inception_v3' must be an integer >= 75, got 32"
    ):
        load_workload("torchvision:inception_v3", image_size=32)
    # a CPU-sized cap applies where the model takes it, and the spec records the size used
    capped = load_workload("torchvision:mobilenet_v3_small", max_image_size=64)
    assert "3x64x64" in capped.description and dict(capped.spec.sizes) == {"image_size": 64}
    kept = load_workload("torchvision:inception_v3", max_image_size=64, num_classes=10)
    assert "3x299x299" in kept.description and "image_size" not in dict(kept.spec.sizes)


# --------------------------------------------------------------------------------------------------
# timm


@pytest.mark.usefixtures("single_thread")
def test_timm_model_is_timms_own_with_timms_optimizer():
    timm = require("timm", "timm")
    from timm.optim import create_optimizer_v2

    w = load_workload("timm:convnext_atto", image_size=32)
    plain = _seeded(lambda: timm.create_model("convnext_atto", pretrained=False))
    _same_weights(w.model, plain)
    images, _ = w.make_batch(2, CPU)
    assert images.shape == (2, 3, 32, 32)
    reference = create_optimizer_v2(w.model, "adamw", lr=1e-3, weight_decay=0.05)
    opt = w.make_optimizer(w.model)
    # timm's AdamW and its parameter groups, the rate scaled by the square root to the task's batch
    assert isinstance(opt, type(reference)) and _groups(opt) == _groups(reference)
    # (at the task's default batch: one rate for every run of the workload, whatever was drawn)
    assert opt.param_groups[0]["base_lr"] == pytest.approx(1e-3 * (w.default_batch_size / 32) ** 0.5)
    validate_workload(w, device="cpu", batch_size=2)
    assert load_workload("timm:convnext_atto").description.count("3x224x224") == 1  # timm's input_size


def test_timm_options_and_names():
    require("timm", "timm")
    assert "3x64x64" in load_workload("timm:convnext_atto", max_image_size=64).description
    vit = load_workload("timm:vit_tiny_patch16_224", max_image_size=64)  # a fixed input size
    assert "3x224x224" in vit.description and "image_size" not in dict(vit.spec.sizes)
    assert load_workload("timm:convnext_atto", num_classes=10, image_size=32).model.num_classes == 10
    # an explicit size builds a ViT for it (it asserted "Input height (32) doesn't match model (224)")
    small = load_workload("timm:vit_tiny_patch16_224", image_size=32, patch_size=8)
    assert "3x32x32" in small.description
    validate_workload(small, device="cpu", batch_size=2)
    with pytest.raises(UsageError, match=r"unknown timm model 'convnext_atoo'.*Close matches: convnext_atto"):
        load_workload("timm:convnext_atoo")
    with pytest.raises(UsageError, match=r"timm:convnext_atto does not accept.*bogus_option"):
        load_workload("timm:convnext_atto", bogus_option=1)


def test_a_missing_extra_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(SOURCES, "timm", dataclasses.replace(SOURCES["timm"], available=lambda: False))
    with pytest.raises(UsageError, match=r"pip install 'mixprec\[timm\]'"):
        load_workload("timm:convnext_atto")
    assert main(["tune", "--model", "timm:convnext_atto"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'mixprec[timm]'" in err
    assert main(["bench", "--list-models"]) == 0
    out = capsys.readouterr().out
    assert "not available" in out and "mixprec[timm]" in out


# --------------------------------------------------------------------------------------------------
# Hugging Face


HF_ARCHS = ("bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "qwen2")


@pytest.mark.parametrize("arch", HF_ARCHS)
@pytest.mark.usefixtures("single_thread")
def test_hf_architecture_builds_from_a_config_and_trains(arch):
    require("transformers", "hf")
    w = load_workload(f"hf:{arch}", seq_len=16)
    batch = w.make_batch(2, CPU)
    assert batch["input_ids"].shape == (2, 16) and set(batch) == {"input_ids", "attention_mask", "labels"}
    validate_workload(w, device="cpu", batch_size=2)
    # the HF examples' AdamW: no decay on biases and norm weights
    opt = w.make_optimizer(w.model)
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups][1] == 0.0
    assert {id(p) for p in opt.param_groups[1]["params"]} == {
        id(p) for p in w.model.parameters() if p.dim() < 2
    }


@pytest.mark.usefixtures("single_thread")
def test_hf_bert_is_transformers_own_model_and_loss():
    require("transformers", "hf")
    from transformers import BertConfig, BertForSequenceClassification

    w = load_workload("hf:bert", seq_len=16, num_hidden_layers=2)
    config = BertConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=1024,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        pad_token_id=0,
    )
    plain = _seeded(lambda: BertForSequenceClassification(config))
    _same_weights(w.model, plain)
    batch = w.make_batch(2, CPU)
    torch.testing.assert_close(w.loss_fn(w.model, batch), plain(**batch).loss)
    assert w.spec.to_dict() == {
        "kind": "model",
        "target": "hf:bert",
        "sizes": {"num_hidden_layers": 2, "seq_len": 16},
    }
    _same_weights(workload_from_spec(w.spec).model, w.model)


def test_hf_tasks_and_config_errors():
    require("transformers", "hf")
    w = load_workload("hf:bert", task="masked-lm", seq_len=32, num_hidden_layers=1)
    assert type(w.model).__name__ == "BertForMaskedLM"
    labels = w.make_batch(4, CPU)["labels"]
    assert (labels == -100).any() and (labels != -100).any()  # loss only on the masked positions
    with pytest.raises(UsageError, match=r"task='masked-lm' is not available for hf:llama.*causal-lm"):
        load_workload("hf:llama", task="masked-lm")
    with pytest.raises(UsageError, match=r"'num_hiden_layers'.*Did you mean 'num_hidden_layers'"):
        load_workload("hf:bert", num_hiden_layers=2)
    with pytest.raises(UsageError, match=r"seq_len=4096 exceeds hf:bert's 512 positions"):
        load_workload("hf:bert", seq_len=4096)
    with pytest.raises(UsageError, match=r"image_size=64 does not apply to hf:bert.*--seq-len"):
        load_workload("hf:bert", image_size=64)
    with pytest.raises(UsageError, match=r"unknown hf model 'bret'.*bert"):
        load_workload("hf:bret")


# --------------------------------------------------------------------------------------------------
# Names, listing, --model-config


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("tim:convnext_atto", r"unknown model source 'tim'.*torchvision, timm, hf.*Did you mean 'timm'"),
        ("torchvision:resnet5", r"unknown torchvision model 'resnet5'.*Close matches: resnet50"),
        ("torchvision:fasterrcnn_resnet50_fpn", r"unknown torchvision model"),  # detection: not a classifier
    ],
)
def test_unknown_names_fail_with_the_close_matches(target, fragment):
    with pytest.raises(UsageError, match=fragment):
        load_workload(target)


def test_list_models(capsys):
    listings = {entry.prefix: entry for entry in list_models("resnet1*")}
    assert listings[""].names == () and "resnet18" in listings["torchvision"].names
    assert main(["bench", "--list-models", "torchvision:efficientnet_b*"]) == 0
    out = capsys.readouterr().out
    assert "torchvision:efficientnet_b0" in out and "torchvision:resnet50" not in out
    assert main(["tune", "--list-models"]) == 0
    out = capsys.readouterr().out
    assert "resnet50, vgg19, densenet121, gpt2, mlp" in out and "hf:bert" in out


def test_parse_model_config():
    assert parse_model_config("n_layer=2, lr=1e-3,bias=false,task=masked-lm,x=none") == {
        "n_layer": 2,
        "lr": 1e-3,
        "bias": False,
        "task": "masked-lm",
        "x": None,
    }
    assert parse_model_config(None) == {} and parse_model_config("") == {}
    for bad, fragment in (("n_layer", "not key=value"), ("a=1,a=2", "twice"), ("=3", "not key=value")):
        with pytest.raises(UsageError, match=fragment):
            parse_model_config(bad)


def test_vision_models_by_name_are_cpu_sized_like_the_default_model():
    from mixprec.cli import build_parser
    from mixprec.cli.common import Defaults, workload_from_args

    def defaults(args, device):
        chosen = Defaults(args, "tune")
        chosen.values = chosen.framework.cli_defaults(device, "tune")  # as on that device
        return chosen

    args = build_parser().parse_args(["tune", "--model", "torchvision:mobilenet_v3_small"])
    cpu, cuda = defaults(args, "cpu"), defaults(args, "cuda")
    assert dict(workload_from_args(args, cpu).spec.sizes) == {"image_size": 128}
    assert cpu.batch_size() == 16
    assert "image_size" not in dict(workload_from_args(args, cuda).spec.sizes)
    assert cuda.batch_size() is None  # the workload's own
    explicit = build_parser().parse_args(
        ["tune", "--model", "torchvision:mobilenet_v3_small", "--image-size", "96"]
    )
    assert dict(workload_from_args(explicit, defaults(explicit, "cpu")).spec.sizes) == {"image_size": 96}
    text = build_parser().parse_args(["tune", "--model", "gpt2", "--seq-len", "16"])
    assert defaults(text, "cpu").batch_size() is None


def test_model_config_reaches_the_builtin_gpt2_and_conflicts_are_refused(capsys):
    from mixprec.cli import build_parser
    from mixprec.cli.common import Defaults, workload_from_args

    args = build_parser().parse_args(
        ["bench", "--model", "gpt2", "--model-config", "n_layer=1,n_embd=64,n_head=2", "--seq-len", "16"]
    )
    w = workload_from_args(args, Defaults(args, "bench"))
    assert len(w.model.transformer.h) == 1 and dict(w.spec.sizes)["n_embd"] == 64
    assert main(["bench", "--model", "gpt2", "--seq-len", "16", "--model-config", "seq_len=8"]) == 2
    assert "sets seq_len and so does --seq-len" in capsys.readouterr().err
