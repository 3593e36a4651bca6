"""PEFT/LoRA under DeepSpeed ZeRO-1/2/3, FSDP2 and FSDP1 (real processes, gloo): the checkpoint holds the adapter
(`adapter_model.safetensors` + `adapter_config.json`, keys as PEFT writes them) and the optimizer state and fp32
master weights of the trainable parameters only, never the frozen base; `PeftModel.from_pretrained(base, ckpt)`
loads it; and a resume hops engines and world sizes: ZeRO-3 x 2 -> FSDP2 x 3 -> DDP x 2 -> 1 process, each hop
compared with the uninterrupted ZeRO-3 x 2 run.

The LoRA layers (r=3) sit in q_proj (30x3, 3x30) and v_proj (30x3, 3x10): sizes 90 and 30 elements do not divide
evenly by 2 or 3 ranks... enough of them (90/4, 30/4, 10 rows over 3 ranks) to exercise uneven partitions.
Tolerance when the world size changes: fp32 reduction order, as in test_every_engine.py (1e-5).
"""

import pytest
import torch
from safetensors import safe_open

from support.models import build_model
from support.specs import run_spec
from support.states import assert_resumed_matches
from support.launches import torchrun
from hf_unified_ckpt.tools.cli import main as cli
from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

LOSS_RTOL = STATE_ATOL = 1e-5
MAX_STEPS, SAVE_STEPS = 8, 2
ENGINES = {"z1": {"zero": 1}, "z2": {"zero": 2}, "z3": {"zero": 3}, "f2": {"fsdp": 2}, "f1": {"fsdp": 1},
           "ddp": {}, "single": {}}
BF16 = {"bf16": True, "unified_checkpoint_config": "ema", "ema_decay": 0.9}  # bf16 LoRA keeps an EMA too
# (tag, engine, world size, resumed from (tag, step) or None, extra TrainingArguments)
CHAIN = [("z3", "z3", 2, None, {}), ("z3-f2x3", "f2", 3, ("z3", 2), {}), ("f2x3-ddp", "ddp", 2, ("z3-f2x3", 4), {}),
         ("ddp-single", "single", 1, ("f2x3-ddp", 6), {})]
SAVERS = [("z1", "z1", 2, None, {}), ("z2-bf16", "z2", 2, None, BF16), ("f2", "f2", 2, None, {})]
RESUMES = [("z3-same", "z3", 2, ("z3", 4), {}), ("z2-bf16-same", "z2", 2, ("z2-bf16", 4), BF16),
           ("f2-z2x3", "z2", 3, ("f2", 4), {}), ("z1-f2x3", "f2", 3, ("z1", 4), {})]


def _spec(tmp, tag, engine, resumed_from, extra):
    spec = {**ENGINES[engine], "model": "lora", "output_dir": str(tmp / tag), "result": str(tmp / f"{tag}.pt"),
            "overrides": {"max_steps": MAX_STEPS, "save_steps": SAVE_STEPS, **extra}}
    if resumed_from:
        spec["resume"] = str(tmp / resumed_from[0] / f"checkpoint-{resumed_from[1]}")
    return spec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-engines")
    runs = {r[0]: r for r in CHAIN + SAVERS + RESUMES}
    spec = {tag: _spec(tmp, tag, r[1], r[3], r[4]) for tag, r in runs.items()}
    launches = [(2, ["z3", "z1", "z2-bf16", "f2"]), (3, ["z3-f2x3", "f2-z2x3", "z1-f2x3"]),
                (2, ["f2x3-ddp", "z3-same", "z2-bf16-same"])]
    for world, tags in launches:
        torchrun(world, [spec[t] for t in tags], tmp)
    out = {tag: torch.load(tmp / f"{tag}.pt", weights_only=False) for _, tags in launches for tag in tags}
    out["ddp-single"] = run_spec(spec["ddp-single"], 1)
    return tmp, out


def _resumed_steps(resumed_from):
    return tuple(range(resumed_from[1] + 1, MAX_STEPS + 1))


@pytest.mark.dist
@pytest.mark.parametrize("tag", [r[0] for r in CHAIN[1:] + RESUMES])
def test_lora_resumes_across_engines_and_world_sizes(runs, tag):
    """Each hop of ZeRO-3 x 2 -> FSDP2 x 3 -> DDP x 2 -> 1 process (and the other resumes) continues the
    uninterrupted run of its first saver: bit-exact at the same engine and world size, else within tolerance."""
    _, out = runs
    run = {r[0]: r for r in CHAIN + RESUMES}[tag]
    reference = "z3" if run in CHAIN else run[3][0]
    exact = run in RESUMES and run[1] == {r[0]: r for r in SAVERS + CHAIN}[reference][1] and run[2] == 2
    assert_resumed_matches(out[tag], out[reference], _resumed_steps(run[3]), exact, LOSS_RTOL, STATE_ATOL)
    assert out[tag]["global_step"] == MAX_STEPS


@pytest.mark.dist
@pytest.mark.parametrize("tag", ["z3", "z1", "z2-bf16", "f2", "z3-f2x3", "f2x3-ddp"])
def test_lora_checkpoint_holds_the_adapter_and_trainable_state_only(runs, tag):
    """The files PEFT writes (adapter only), optimizer state and master weights of the trainable parameters only;
    the optimizer keyed by parameter name (as under DDP), the master weights by adapter key."""
    tmp, out = runs
    ckpt = tmp / tag / f"checkpoint-{MAX_STEPS}"
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in names), names
    trainable = {n for n, p in build_model("lora").named_parameters() if p.requires_grad}
    with safe_open(ckpt / "adapter_model.safetensors", "pt") as f:
        adapter = set(f.keys())
    assert adapter == {n.replace(".default", "") for n in trainable}
    optimizer = _keys(ckpt, "optimizer")
    assert {k.split("/")[0] for k in optimizer} == trainable
    master = _keys(ckpt, "master_weights")
    assert master == (adapter if tag == "z2-bf16" else set())  # keyed like the weights files, as EMA weights are
    assert _keys(ckpt, "ema") == (adapter if tag == "z2-bf16" else set())


@pytest.mark.dist
@pytest.mark.parametrize("tag", ["z3", "z2-bf16", "f2", "ddp-single"])
def test_lora_checkpoint_loads_with_peft_from_pretrained(runs, tag):
    """`PeftModel.from_pretrained(base, checkpoint)` gives the trained adapter (bf16 training: its bf16 weights)."""
    from peft import PeftModel

    tmp, out = runs
    model = PeftModel.from_pretrained(build_model("llama"), tmp / tag / f"checkpoint-{MAX_STEPS}")
    state = model.state_dict()
    lora = [k for k in out[tag]["state"] if "lora_" in k]
    assert lora
    for key in lora:
        assert torch.equal(state[key].to(out[tag]["state"][key].dtype), out[tag]["state"][key]), key
    assert torch.equal(state["base_model.model.lm_head.weight"], build_model("llama").lm_head.weight)


def _keys(ckpt, stem):
    keys = set()
    for path in ckpt.glob(f"{stem}*.safetensors"):
        with safe_open(path, "pt") as f:
            keys |= set(f.keys())
    return keys


@pytest.mark.dist
def test_lora_ema_resumes_exactly_and_exports_as_an_adapter(runs, tmp_path):
    """The EMA of a bf16 LoRA run under ZeRO-2 continues bit-exactly after a same-topology resume, and
    `export --weights ema` gives an adapter folder that `PeftModel.from_pretrained` loads."""
    from peft import PeftModel

    tmp, _ = runs
    ckpt = tmp / "z2-bf16" / f"checkpoint-{MAX_STEPS}"
    with ComponentReader(ckpt, "ema") as a, ComponentReader(tmp / "z2-bf16-same" / f"checkpoint-{MAX_STEPS}", "ema") as b:
        ema = {k: a.get(k) for k in a.keys()}
        assert all(torch.equal(ema[k], b.get(k)) for k in ema)
    assert cli(["export", str(ckpt), str(tmp_path / "ema"), "--weights", "ema", "--quiet"]) == 0
    state = PeftModel.from_pretrained(build_model("llama"), tmp_path / "ema").state_dict()
    assert all(torch.equal(state[k.replace(".weight", ".default.weight")], t) for k, t in ema.items())


@pytest.mark.dist
def test_export_merge_lora_gives_a_plain_model_folder(runs, tmp_path, capsys):
    """`export --merge-lora`: PEFT's merge of the adapter into the base model, loadable by `from_pretrained`, with
    the same outputs as base + adapter; from the fp32 master weights with `--weights master`; without a base model
    (the tiny model was built from a config) a clear error and nothing written."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, _ = runs
    build_model("llama").save_pretrained(tmp_path / "base")
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    ckpt = tmp / "f2" / f"checkpoint-{MAX_STEPS}"
    out = tmp_path / "merged"
    assert cli(["export", str(ckpt), str(out), "--merge-lora", "--base-model", str(tmp_path / "base"),
                "--max-shard-size", "20KB", "--quiet"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        expected = PeftModel.from_pretrained(build_model("llama"), ckpt)(ids).logits
        assert torch.allclose(merged(ids).logits, expected, atol=1e-5)
    bf16 = tmp / "z2-bf16" / f"checkpoint-{MAX_STEPS}"
    assert cli(["export", str(bf16), str(tmp_path / "master"), "--merge-lora", "--weights", "master",
                "--base-model", str(tmp_path / "base"), "--quiet"]) == 0
    with ComponentReader(bf16, "master_weights") as master:
        a, b = (master.get(f"base_model.model.model.layers.0.self_attn.q_proj.lora_{x}.weight") for x in "AB")
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "master").model.layers[0].self_attn.q_proj.weight
    assert torch.allclose(q, build_model("llama").model.layers[0].self_attn.q_proj.weight + 2.0 * b @ a, atol=1e-6)
    assert cli(["export", str(ckpt), str(tmp_path / "nobase"), "--merge-lora", "--quiet"]) == 1
    assert "names no base model" in capsys.readouterr().err and not (tmp_path / "nobase").exists()
