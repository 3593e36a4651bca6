"""EMA of the weights (word `ema`): the saved average equals one computed in float64 from the weights recorded at
every step, on one process, DDP, DeepSpeed ZeRO-2 bf16 (average of the fp32 master weights), ZeRO-3 and FSDP2;
it continues across a resume at the same world size (==) and at another one (tolerance); `ema_interval > 1`;
a checkpoint without an EMA resumed with one says so once."""

import pytest
import torch

from support.callbacks import RecordWeights
from support.trainers import make_trainer
from support.launches import torchrun
from hf_unified_ckpt.tools.cli import _info, main as cli
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout
from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

DECAY = 0.8
EMA = {"unified_checkpoint_config": "ema", "ema_decay": DECAY}
REL = 1e-6  # fp32 average vs the float64 reference, relative to the largest weight of the tensor


def reference(weights: dict, step: int, interval: int = 1) -> dict:
    """EMA after the last update at or before `step`: the first update copies, then decay."""
    average = None
    for s in sorted(k for k in weights if k <= step and k % interval == 0):
        w = {n: t.double() for n, t in weights[s].items()}
        average = w if average is None else {n: DECAY * average[n] + (1 - DECAY) * w[n] for n in w}
    return average


def saved_ema(ckpt) -> dict:
    with ComponentReader(ckpt, "ema") as reader:
        return {n: reader.get(n) for n in reader.keys()}


def assert_close(saved: dict, expected: dict, rel: float = REL) -> None:
    assert saved.keys() == expected.keys()
    for n, e in expected.items():
        assert saved[n].dtype == torch.float32
        assert float((saved[n].double() - e).abs().max()) <= rel * max(float(e.abs().max()), 1e-12), n


def test_one_process_average_and_interval(tmp_path, caplog):
    trainer = make_trainer(tmp_path / "a", **EMA)
    weights = RecordWeights(trainer)
    trainer.train()
    assert_close(saved_ema(tmp_path / "a" / "checkpoint-3"), reference(weights.record, 3))
    assert_close(saved_ema(tmp_path / "a" / "checkpoint-6"), reference(weights.record, 6))
    manifest = detect_layout(tmp_path / "a" / "checkpoint-6").manifest
    assert manifest["options"]["ema"] is True and manifest["options"]["ema_decay"] == DECAY
    trainer = make_trainer(tmp_path / "b", ema_interval=2, **EMA)
    weights = RecordWeights(trainer)
    trainer.train()
    assert_close(saved_ema(tmp_path / "b" / "checkpoint-3"), reference(weights.record, 3, 2))  # updated at 2
    assert_close(saved_ema(tmp_path / "b" / "checkpoint-6"), reference(weights.record, 6, 2))
    trainer = make_trainer(tmp_path / "plain")
    trainer.train()
    with caplog.at_level("WARNING", logger="hf_unified_ckpt"):
        make_trainer(tmp_path / "c", **EMA).train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-3"))
    assert caplog.text.count("holds no EMA of the weights") == 1


SAVERS = {"ddp": {}, "z2bf16": {"zero": 2, "overrides": {"bf16": True}}, "z3": {"zero": 3}, "f2": {"fsdp": 2}}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ema")

    def spec(name, engine, resume=None):
        return {**engine, "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt"), "record_weights": True,
                "overrides": {**engine.get("overrides", {}), **EMA},
                **({"resume": str(tmp / resume / "checkpoint-3")} if resume else {})}

    refused = {"fsdp": 1, "output_dir": str(tmp / "f1"), "result": str(tmp / "f1-refused.pt"), "overrides": EMA,
               "expect_error": "needs FSDP2"}
    torchrun(2, [spec(n, e) for n, e in SAVERS.items()] + [spec("ddp-r", SAVERS["ddp"], "ddp"), refused], tmp)
    torchrun(3, [spec("z2bf16-r3", SAVERS["z2bf16"], "z2bf16"), spec("f2-to-z3", SAVERS["z3"], "f2")], tmp)
    out = {p.stem: torch.load(p, weights_only=False) for p in tmp.glob("*.pt")}
    return tmp, out


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SAVERS))
def test_saved_average_matches_float64_reference(engines, name):
    tmp, out = engines
    for step in (3, 6):
        assert_close(saved_ema(tmp / name / "checkpoint-3" if step == 3 else tmp / name / "checkpoint-6"),
                     reference(out[name]["weights"], step))


@pytest.mark.dist
@pytest.mark.parametrize("resumed,saved,atol", [("ddp-r", "ddp", 0.0), ("z2bf16-r3", "z2bf16", 4e-3),
                                                ("f2-to-z3", "f2", 1e-5)])
def test_average_continues_across_a_resume(engines, resumed, saved, atol):
    """The resumed run's average = the checkpoint's average at 3 folded with the resumed run's own weights at 4-6
    (relative 1e-6), and is within the resume tolerance of the uninterrupted run's (== at the same topology; bf16
    at another world size: one bf16 ulp, 4e-3, as in test_deepspeed.py; fp32: 1e-5)."""
    tmp, out = engines
    start = {n: t.double() for n, t in saved_ema(tmp / saved / "checkpoint-3").items()}
    continued = dict(start)
    for step in (4, 5, 6):
        w = out[resumed]["weights"][step]
        continued = {n: DECAY * continued[n] + (1 - DECAY) * w[n].double() for n in continued}
    after = saved_ema(tmp / resumed / "checkpoint-6")
    assert_close(after, continued)
    base = saved_ema(tmp / saved / "checkpoint-6")
    assert all(float((after[n] - base[n]).abs().max()) <= atol for n in base)


def _loaded(folder, dtype="auto") -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).state_dict()


@pytest.mark.dist
def test_export_ema_and_master_as_model_folders(engines, tmp_path, capsys):
    tmp, _ = engines
    ckpt = tmp / "z3" / "checkpoint-6"
    assert "ema" in _info(str(ckpt))["components"]
    out = tmp_path / "ema-bf16"
    assert cli(["export", str(ckpt), str(out), "--weights", "ema", "--dtype", "bf16", "--max-shard-size", "20KB",
                "--quiet"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    state, ema = _loaded(out), saved_ema(ckpt)
    assert all(state[n].dtype == torch.bfloat16 and torch.equal(state[n], t.to(torch.bfloat16)) for n, t in ema.items())
    master_ckpt = tmp / "z2bf16" / "checkpoint-6"
    assert cli(["export", str(master_ckpt), str(tmp_path / "master"), "--weights", "master", "--quiet"]) == 0
    with ComponentReader(master_ckpt, "master_weights") as reader:
        state = _loaded(tmp_path / "master", torch.float32)
        assert all(torch.equal(state[n], reader.get(n)) for n in reader.keys())
    assert cli(["export", str(ckpt), str(out), "--quiet"]) == 1  # never over an existing folder
    assert "not empty" in capsys.readouterr().err


def test_export_of_a_tied_model_and_of_a_checkpoint_without_ema(tmp_path, capsys):
    trainer = make_trainer(tmp_path / "run", "gpt2", **EMA)
    trainer.train()
    out = tmp_path / "out"
    assert cli(["export", str(tmp_path / "run" / "checkpoint-6"), str(out), "--weights", "ema", "--quiet"]) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert torch.equal(model.transformer.wte.weight, saved_ema(tmp_path / "run" / "checkpoint-6")["transformer.wte.weight"])
    make_trainer(tmp_path / "plain").train()
    assert cli(["export", str(tmp_path / "plain" / "checkpoint-6"), str(tmp_path / "x"), "--weights", "ema"]) == 1
    assert "has no 'ema' weights" in capsys.readouterr().err
    assert cli(["export", str(tmp_path / "plain" / "checkpoint-6"), str(tmp_path / "y"), "--merge-lora"]) == 1
    assert "needs a PEFT/LoRA checkpoint" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_ema_fields_parse_from_the_command_line_and_are_validated():
    from transformers import HfArgumentParser

    from hf_unified_ckpt import UnifiedCheckpointArguments

    (args,) = HfArgumentParser(UnifiedCheckpointArguments).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/x", "--unified_checkpoint", "true", "--unified_checkpoint_config", "ema",
         "--ema_decay", "0.99", "--ema_interval", "4", "--use_cpu", "true"])
    options = args.unified_checkpoint_options
    assert options.ema and options.ema_decay == 0.99 and options.ema_interval == 4
    for bad in (["--ema_decay", "1.0"], ["--ema_interval", "0"]):
        with pytest.raises(ValueError, match=bad[0].removeprefix("--")):
            HfArgumentParser(UnifiedCheckpointArguments).parse_args_into_dataclasses(
                ["--output_dir", "/tmp/x", "--unified_checkpoint_config", "ema", "--use_cpu", "true", *bad])


@pytest.mark.dist
def test_fsdp1_with_ema_is_refused_before_the_first_step(engines):
    _, out = engines
    assert out["f1-refused"]["global_step"] == 0 and "needs FSDP2" in out["f1-refused"]["error"]


def _static_isinstance(obj, capability) -> bool:
    """`isinstance(obj, capability)` as Python 3.12 answers it for a runtime protocol: each member looked up with
    `inspect.getattr_static` (on the class, never through `__getattr__`)."""
    import inspect

    members = [n for n, v in vars(capability).items() if callable(v) and not n.startswith("_")]
    return all(inspect.getattr_static(obj, n, None) is not None for n in members)


def test_wrapped_adapters_have_exactly_the_capabilities_of_the_adapter_they_wrap():
    """`WithEma` and `WithConversion` (alone and nested, as the session builds them) answer `isinstance` on every
    optional engine capability as the adapter they wrap does, also as Python 3.12 answers (statically: these
    wrappers pass everything else on through `__getattr__`, which 3.12's protocol check never calls); a forwarded
    capability reaches the inner adapter. `WithConversion` declares its own partition rule (none)."""
    import itertools

    from hf_unified_ckpt.checkpoint.save.ema import ExponentialAverage, WithEma
    from hf_unified_ckpt.engines.base import CAPABILITIES, ConfirmsRule, MasterPrecision, PartitionRule
    from hf_unified_ckpt.engines.conversion import WithConversion

    def inner_with(capabilities):
        calls = []
        members = {n: (lambda n: lambda self, *a, **k: calls.append(n) or (None, n))(n)
                   for c in capabilities for n, v in vars(c).items() if callable(v) and not n.startswith("_")}
        return type("Inner", (), {"engine": "inner", **members})(), calls

    checked = 0
    for k in range(len(CAPABILITIES) + 1):
        for capabilities in itertools.combinations(CAPABILITIES, k):
            inner, calls = inner_with(capabilities)
            ema = WithEma(inner, ExponentialAverage(0.9))
            for wrapper in (ema, WithConversion(inner, None), WithConversion(ema, None)):
                for c in CAPABILITIES:
                    expected = c in capabilities or (c is PartitionRule and isinstance(wrapper, WithConversion))
                    assert isinstance(wrapper, c) == _static_isinstance(wrapper, c) == expected, (capabilities, c)
                    checked += 1
                if ConfirmsRule in capabilities:
                    wrapper.confirm_rule()
                    assert calls.pop() == "confirm_rule"
                if MasterPrecision in capabilities:
                    assert wrapper.needs_fp32_master() == (None, "needs_fp32_master")
                    assert calls.pop() == "needs_fp32_master"
            assert not calls
    assert checked == 2 ** len(CAPABILITIES) * 3 * len(CAPABILITIES)
