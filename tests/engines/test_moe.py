"""Mixture-of-Experts models under transformers 5 (experts fused at run time into 3-D tensors, saved per expert by
`save_pretrained`), under every engine, on 1 and 2 real ranks (gloo, CPU): one launch of 2 processes, the
single-process runs in this process.

Models (`support.models.MOE`, built locally): Qwen3-MoE (also with tied embeddings, saved alone, resumed under FSDP2) (5 experts: 3 + 2 FSDP2 rows at 2 ranks, and every ZeRO partition
boundary cuts an expert), the same with square experts (intermediate = hidden: conversions that decide a
transposition by comparing shapes, transformers #47031), Qwen3-MoE loaded with `from_pretrained` from the
per-expert files `save_pretrained` wrote (under ZeRO-3: partitioned at load by zero.Init, with accelerate's MoE
leaf modules set by the user through ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES), Mixtral, DeepSeek-V3 (a dense first
layer, routed + shared experts, MLA attention, the persistent `e_score_correction_bias` buffer), and LoRA on
attention and on the fused experts (PEFT `target_parameters`).

A dense model whose conversion concatenates (HRM-text: `gate_up_proj` and `gqkv_proj` saved fused, held split;
under ZeRO-3 those saved tensors are assembled from several live tensors). Also FSDP1 (saving, resumed under ZeRO-3) and the loop options (eval, load_best_model_at_end, rotation, save_model)
under ZeRO-3. Every cell: an uninterrupted 6-step run saving at 3 and 6 vs. a resume from checkpoint-3 on another engine or
world size. Tolerances are test_deepspeed.py's: fp32 sums in another order drift about 1e-7 (allowed 1e-5 on losses,
relative, and on weights); bf16 across engines (DeepSpeed computes with bf16 weights, FSDP2 with bf16 copies of
fp32 ones) drifts 2.7e-3 on losses and 3.8e-3 on weights, as the dense llama does (measured: same figures), allowed
5e-3 / 8e-3; the same engine and world size is bit-exact. O1 compression stores the moments in int8, so the cell
with O1 is checked against the decoded moments' tolerance of test_compression.py.
"""

import json

import pytest
import torch
from safetensors import safe_open

from support.models import MOE, build_model
from support.specs import loop_spec, run_spec
from support.states import assert_from_pretrained_equals, assert_loop_options, assert_resumed_matches
from support.launches import torchrun

LOSS_RTOL = STATE_ATOL = 1e-5
BF16_LOSS_RTOL, BF16_STATE_ATOL = 5e-3, 8e-3
BF16 = {"bf16": True}
O1_EMA_ASYNC = {"unified_checkpoint_config": "async_save ema", "ckpt_quant_stage": "O1", "ema_decay": 0.9}
LEAF = {"ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "Qwen3MoeSparseMoeBlock"}

# tag -> (model, where it resumes from or None, run fields); single-process savers run first, here
SINGLE_SAVERS = {"single": ("qwen3_moe", None, {}), "mixtral": ("mixtral", None, {}),
                 "deepseek": ("deepseek_v3", None, {}), "hrm": ("hrm_text", None, {}),
                 "tied": ("qwen3_moe_tied", None, {}),
                 "plain": ("qwen3_moe", None, {"overrides": {"unified_checkpoint": False}})}  # the plain Trainer's
LAUNCH = {  # 2 ranks, in this order
    "single-ddp": ("qwen3_moe", "single", {}),
    "z3": ("qwen3_moe_pretrained", None, {"zero": 3, "env": LEAF, "record_pieces": True}),
    "f2sq": ("qwen3_moe_square", None, {"fsdp": 2, "record_pieces": True}),
    "f2sq-z2": ("qwen3_moe_square", "f2sq", {"zero": 2}),
    "z2bf16": ("qwen3_moe", None, {"zero": 2, "overrides": BF16, "record_pieces": True}),
    "z2bf16-z2": ("qwen3_moe", "z2bf16", {"zero": 2, "overrides": BF16}),
    "z2bf16-f2": ("qwen3_moe", "z2bf16", {"fsdp": 2, "overrides": BF16}),
    "lora": ("lora_moe", None, {"zero": 2}),
    "mixtral-z3": ("mixtral", "mixtral", {"zero": 3}),
    "deepseek-z3": ("deepseek_v3", "deepseek", {"zero": 3}),
    "hrm-z3": ("hrm_text", "hrm", {"zero": 3}),
    "tied-f2": ("qwen3_moe_tied", "tied", {"fsdp": 2}),
    "o1": ("qwen3_moe", None, {"zero": 2, "overrides": O1_EMA_ASYNC}),
    "o1-f2": ("qwen3_moe", "o1", {"fsdp": 2, "overrides": O1_EMA_ASYNC}),
    "f1": ("qwen3_moe", None, {"fsdp": 1}),
    "f1-z3": ("qwen3_moe", "f1", {"zero": 3}),
    "plain-ddp": ("qwen3_moe", "plain", {}),
    "dslegacy": ("qwen3_moe", None, {"zero": 2, "overrides": {"unified_checkpoint": False}}),
    "fused": ("qwen3_moe", None, {"zero": 3, "fused_keys": True}),  # as the plugin wrote before: run-time names
    "ep": ("qwen3_moe_ep", None, {"tp": [0, 2], "expect_error": "expert parallelism"}),
}
AFTER = {"z3-1": ("qwen3_moe", "z3", {}), "lora-1": ("lora_moe", "lora", {}),
         "dslegacy-1": ("qwen3_moe", "dslegacy", {}), "fused-1": ("qwen3_moe", "fused", {})}
# resumed -> (saved by, exact, loss rtol, state atol)
CELLS = {
    "single-ddp": ("single", False, LOSS_RTOL, STATE_ATOL),
    "z3-1": ("z3", False, LOSS_RTOL, STATE_ATOL),
    "f2sq-z2": ("f2sq", False, LOSS_RTOL, STATE_ATOL),
    "z2bf16-z2": ("z2bf16", True, 0, 0),
    "z2bf16-f2": ("z2bf16", False, BF16_LOSS_RTOL, BF16_STATE_ATOL),
    "lora-1": ("lora", False, LOSS_RTOL, STATE_ATOL),
    "mixtral-z3": ("mixtral", False, LOSS_RTOL, STATE_ATOL),
    "deepseek-z3": ("deepseek", False, LOSS_RTOL, STATE_ATOL),
    "hrm-z3": ("hrm", False, LOSS_RTOL, STATE_ATOL),
    "tied-f2": ("tied", False, LOSS_RTOL, STATE_ATOL),
    "o1-f2": ("o1", False, 1e-3, 1e-2),  # int8 moments (test_compression.py: O1 drift about 1e-5 on losses)
    "f1-z3": ("f1", False, LOSS_RTOL, STATE_ATOL),
    "plain-ddp": ("plain", False, LOSS_RTOL, STATE_ATOL),
    "dslegacy-1": ("dslegacy", False, LOSS_RTOL, STATE_ATOL),
    "fused-1": ("fused", False, LOSS_RTOL, STATE_ATOL),
}
SAVERS = {"single": "qwen3_moe", "z3": "qwen3_moe", "f2sq": "qwen3_moe_square", "z2bf16": "qwen3_moe", "f1": "qwen3_moe",
          "mixtral": "mixtral", "deepseek": "deepseek_v3", "o1": "qwen3_moe", "hrm": "hrm_text", "hrm-z3": "hrm_text",
          "tied": "qwen3_moe_tied", "tied-f2": "qwen3_moe_tied"}


def _spec(tmp, tag, model, resume, fields):
    spec = {"output_dir": str(tmp / tag), "result": str(tmp / f"{tag}.pt"), "model": model, **fields}
    if resume:
        spec["resume"] = str(tmp / resume / "checkpoint-3")
    return spec


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    results = {tag: run_spec(_spec(tmp, tag, *cell), 1) for tag, cell in SINGLE_SAVERS.items()}
    loop = loop_spec(_spec(tmp, "loop", "qwen3_moe", None, {"zero": 3}), tmp / "loop-model")
    torchrun(2, [_spec(tmp, tag, *cell) for tag, cell in LAUNCH.items()] + [loop], tmp)
    results.update({tag: torch.load(tmp / f"{tag}.pt", weights_only=False) for tag in [*LAUNCH, "loop"]})
    results.update({tag: run_spec(_spec(tmp, tag, *cell), 1) for tag, cell in AFTER.items()})
    results["tmp"] = tmp
    return results


@pytest.mark.dist
@pytest.mark.parametrize("resumed", CELLS)
def test_moe_resume_matches_uninterrupted(moe, resumed):
    saved_by, exact, loss_rtol, state_atol = CELLS[resumed]
    got, base = moe[resumed], moe[saved_by]
    assert got["global_step"] == base["global_step"] == 6
    assert_resumed_matches(got, base, (4, 5, 6), exact, loss_rtol, state_atol)
    moments = [k for k in base["optim"] if k.endswith(("/exp_avg", "/exp_avg_sq")) and k in got["optim"]]
    assert any("experts" in k or "gate_proj" in k for k in moments), "no converted moments compared"
    for key in moments:
        assert torch.allclose(got["optim"][key].double(), base["optim"][key].double(), rtol=0,
                              atol=max(state_atol, 1e-12)), key


def _saved_keys(folder, stem: str) -> dict[str, tuple]:
    out = {}
    for path in sorted(folder.glob(f"{stem}*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                out[key] = (tuple(piece.get_shape()), piece.get_dtype())
    return out


@pytest.mark.dist
@pytest.mark.parametrize("saver", SAVERS)
def test_model_files_are_what_save_pretrained_writes(moe, saver, tmp_path):
    """Keys, shapes and dtypes as save_pretrained writes them (per expert, persistent buffers, no fused key);
    from_pretrained loads every tensor of them (no missing or unexpected key) with the trained values."""
    from transformers import AutoModelForCausalLM

    ckpt = moe["tmp"] / saver / "checkpoint-6"
    state = moe[saver]["state"]
    model = build_model(SAVERS[saver])
    model.load_state_dict(state)
    model.to(next(iter(state.values())).dtype).save_pretrained(tmp_path)
    assert _saved_keys(ckpt, "model") == _saved_keys(tmp_path, "model")
    assert any(".experts.4." in k or "gate_up_proj" in k for k in _saved_keys(ckpt, "model"))
    _, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_from_pretrained_equals(ckpt, state, tied=SAVERS[saver].endswith("_tied"))


@pytest.mark.dist
@pytest.mark.parametrize("saver,stems", [("z2bf16", ("optimizer", "master_weights")), ("o1", ("optimizer", "ema")),
                                         ("z3", ("optimizer",)), ("f2sq", ("optimizer",))])
def test_every_component_is_keyed_like_the_model_files(moe, saver, stems):
    """Optimizer state, fp32 master weights and the EMA are keyed by the names of the model files (per expert)."""
    ckpt = moe["tmp"] / saver / "checkpoint-6"
    weights = set(_saved_keys(ckpt, "model"))
    for stem in stems:
        keys = {k.partition("/")[0] for k in _saved_keys(ckpt, stem)} - {""}
        assert keys and keys <= weights, (stem, sorted(keys - weights)[:3])
        assert any(".experts.4." in k for k in keys) and not any("gate_up_proj" in k for k in keys), stem


@pytest.mark.dist
@pytest.mark.parametrize("saver", ["z3", "f2sq", "z2bf16"])
def test_ranks_write_their_experts_in_place(moe, saver):
    """No new gathering: every per-expert tensor of a sharded component is written by the ranks holding its
    elements, in place (ZeRO partitions are ranges: a range of the fused tensor is a range of each expert it covers;
    FSDP2 holds whole experts, rows of dimension 0)."""
    pieces = moe[saver]["pieces"]
    sharded = ["optimizer"] + (["model"] if saver != "z2bf16" else ["master_weights"])
    for component in sharded:
        experts = [k for k in pieces[component] if ".experts." in k]
        assert len(experts) == len({k for k in _saved_keys(moe["tmp"] / saver / "checkpoint-6", component)
                                    if ".experts." in k and k.partition("/")[2] not in ("step",)}) > 0, component


@pytest.mark.dist
def test_loop_options_under_zero3(moe):
    """Evaluation, load_best_model_at_end, rotation and save_model of an MoE model under ZeRO-3: the best checkpoint
    is loaded back (per-expert files, put together again), save_model writes per-expert files from_pretrained loads."""
    assert_loop_options(moe["tmp"] / "loop", moe["loop"], moe["tmp"] / "loop-model")


@pytest.mark.dist
def test_lora_on_experts_is_keyed_as_peft_saves_it(moe, tmp_path):
    ckpt = moe["tmp"] / "lora" / "checkpoint-6"
    keys = set(_saved_keys(ckpt, "adapter_model"))
    assert any(".mlp.experts." in k and "lora_A" in k for k in keys) and any("q_proj.lora_A" in k for k in keys)
    assert json.loads((ckpt / "adapter_config.json").read_text())["target_parameters"]


@pytest.mark.dist
def test_expert_parallelism_is_refused_before_the_first_step(moe):
    out = moe["ep"]
    assert out["global_step"] == 0 and "ep_size" in out["error"] and "FSDP2 or DeepSpeed ZeRO" in out["error"]


@pytest.mark.dist
def test_legacy_deepspeed_folder_converts_and_exports_per_expert(moe, tmp_path):
    from hf_unified_ckpt.tools.convert import convert
    from hf_unified_ckpt.tools.export import export

    legacy = moe["tmp"] / "dslegacy" / "checkpoint-6"
    assert any(p.name.startswith("global_step") for p in legacy.iterdir())
    converted = convert(legacy, tmp_path / "unified", show_progress=False)
    assert any(".experts.4." in k for k in _saved_keys(tmp_path / "unified", "optimizer"))
    exported = export(converted, tmp_path / "exported", show_progress=False)
    for folder in (converted, exported):
        assert_from_pretrained_equals(folder, moe["dslegacy"]["state"])


def test_every_moe_model_converts_as_transformers_reverts_it():
    """The conversion worked out on index tensors gives, tensor by tensor, what transformers' own
    revert_weight_conversion gives, for every MoE test model; the live tensors come back through LiveReader."""
    from transformers.core_model_loading import revert_weight_conversion

    from hf_unified_ckpt.engines.conversion import weight_conversion
    from hf_unified_ckpt.format.planning import TensorSpec

    for kind in [*MOE, "hrm_text"]:
        model = build_model(kind)
        live = model.state_dict()
        conversion = weight_conversion(model, [TensorSpec.of(n, t) for n, t in live.items()])
        expected = revert_weight_conversion(model, dict(live))
        saved = conversion.tensors(live, [s for n in live for s in conversion.saved_names(n)])
        assert set(saved) == set(expected), kind
        assert all(torch.equal(saved[k], expected[k]) for k in expected), kind
        reader = conversion.reader(_DictReader(saved))
        for name, tensor in live.items():
            assert torch.equal(reader.get(name), tensor), name
            assert torch.equal(reader.get_slice(name)[1:3], tensor[1:3]), name


class _DictReader:
    """A TensorReader over tensors in memory."""

    metadata: dict = {}

    def __init__(self, tensors):
        self.tensors = tensors

    def keys(self):
        return list(self.tensors)

    def __contains__(self, name):
        return name in self.tensors

    def specs(self):
        return {k: (tuple(t.shape), "F32") for k, t in self.tensors.items()}

    def get(self, name):
        return self.tensors[name]

    def get_slice(self, name):
        return self.tensors[name]


def test_a_transposed_view_is_written_whole_or_assembled_and_read_back():
    """Views that are not one range of the live tensor (a transposition): a rank holding all of it writes it whole,
    a rank holding part of it leaves it to be assembled; reading back puts every element where it was."""
    from hf_unified_ckpt.engines.base import Fragment
    from hf_unified_ckpt.format.conversion import View, WeightConversion

    live = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    views = tuple(View(f"e.{e}.w", (4, 3), (1, 4), e * 12) for e in range(2))  # expert e, transposed
    conversion = WeightConversion({"w": views}, {"w": (2, 3, 4)})
    saved = conversion.tensors({"w": live}, ["e.0.w", "e.1.w"])
    assert torch.equal(saved["e.1.w"], live[1].T)
    flat = live.reshape(-1)
    first = conversion.fragments({"w": Fragment((2, 3, 4), 0, flat[:15])})  # all of expert 0, part of expert 1
    assert set(first) == {"e.0.w"} and torch.equal(first["e.0.w"].values, live[0].T.reshape(-1))
    reader = conversion.reader(_DictReader(saved))
    assert torch.equal(reader.get("w"), live) and torch.equal(reader.get_slice("w")[1:2], live[1:2])


def test_a_conversion_that_interleaves_is_refused_in_train_before_the_first_step(tmp_path):
    """A model whose conversion interleaves the rows of a saved tensor (transformers' `Interleave`, as some fused
    gate/up checkpoints store them) cannot be saved piece by piece from its tensors: refused in train(), naming the
    tensor and the model type, before anything trains; nothing is written."""
    from transformers.core_model_loading import Interleave, WeightConverter

    from support.trainers import make_trainer
    from hf_unified_ckpt.errors import UnsupportedCheckpointError

    trainer = make_trainer(tmp_path / "run")
    # what from_pretrained attaches for a checkpoint whose up_proj rows are stored interleaved
    trainer.model._weight_conversions = [WeightConverter("mlp.up_proj.weight", "mlp.up_proj.weight",
                                                          operations=[Interleave(dim=0)])]
    with pytest.raises(UnsupportedCheckpointError, match=r"'llama'.*'model.layers.0.mlp.up_proj.weight'"):
        trainer.train()
    assert trainer.state.global_step == 0 and not list((tmp_path / "run").glob("checkpoint-*"))
