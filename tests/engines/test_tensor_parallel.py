"""Real tensor parallelism (transformers' TP plan: `from_pretrained(..., distributed_config=DistributedConfig(...))`,
DTensor parameters, colwise Shard(0) and rowwise Shard(1) linears, a vocab-parallel embedding) through the Trainer
on CPU with gloo, at 2 processes (TP=2) and 4 (FSDP2 x TP, 2 x 2), fp32 and bf16 (autocast), with the test-only
`tp_on_cpu` shim; every TP run asserts its linears really are sharded (`support.states.assert_tensor_parallel`).

Resume equivalence at each hop against the uninterrupted run of the engine that saved: TP=2 -> TP=2 is bit-exact
(same reduction order); across engines and world sizes the fp32 reduction order changes (measured ~1e-7), allowed
LOSS_RTOL = STATE_ATOL = 1e-5 as in test_fsdp.py (bf16: 1e-3 and 4e-3, one bf16 ulp, as the README states).
Sizes do not divide evenly (vocab 97, intermediate 37).
"""

import pytest
import torch

from support.specs import hop_tag, loop_spec, run_spec, spec_of
from support.states import assert_from_pretrained_equals, assert_loop_options, assert_resumed_matches
from support.launches import torchrun
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout

LOSS_RTOL = STATE_ATOL = 1e-5
BF16_LOSS_RTOL, BF16_STATE_ATOL = 1e-3, 4e-3  # bf16 autocast, another reduction order: as test_resume_equivalence.py
STEPS = (4, 5, 6)

KINDS = {  # spec fields of each way of training the TP-shardable Llama
    "tp": {"tp": [2, 1], "model": "llama_tp"},
    "tp_tied": {"tp": [2, 1], "model": "llama_tp_tied"},
    "tp_bf16": {"tp": [2, 1], "model": "llama_tp", "overrides": {"bf16": True}},
    "fsdp_tp": {"tp": [2, 2], "model": "llama_tp"},
    "f2": {"fsdp": 2, "model": "llama_tp"},
    "z3": {"zero": 3, "model": "llama_tp"},
    "single": {"model": "llama_tp"},
    "single_tied": {"model": "llama_tp_tied"},
    "single_bf16": {"model": "llama_tp", "overrides": {"bf16": True}},
}
HOPS = [  # (saved by, resumed as, processes of the resumed run)
    ("tp", "tp", 2), ("tp_tied", "tp_tied", 2), ("tp_bf16", "tp_bf16", 2), ("tp", "single", 1),
    ("tp_tied", "single_tied", 1), ("tp_bf16", "single_bf16", 1), ("tp", "f2", 2), ("z3", "tp", 2), ("fsdp_tp", "tp", 2), ("tp", "fsdp_tp", 4),
]
NATIVE_REFUSAL = "written by the Trainer's own save"


_tag = hop_tag


def _spec(tmp, kind, tag, resume=None, **extra):
    return spec_of(KINDS, tmp, kind, tag, resume, **extra)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    hops = {w: [_spec(tmp, h[1], _tag(h), (h[0], 3)) for h in HOPS if h[2] == w] for w in (1, 2, 4)}
    native = {**_spec(tmp, "tp", "native", save_only_model=True, max_steps=3, attach=False), "result": None}
    refused = {**_spec(tmp, "tp", "native-refused", resume=("native", 3)), "expect_error": NATIVE_REFUSAL}
    ema = {**_spec(tmp, "tp", "ema-refused", unified_checkpoint_config="ema"), "expect_error": "tensor parallelism"}
    loop = loop_spec(_spec(tmp, "tp", "tp-loop"), tmp / "tp-model")
    torchrun(4, [_spec(tmp, "fsdp_tp", "fsdp_tp")], tmp)
    torchrun(2, [_spec(tmp, kind, kind) for kind in ("tp", "tp_tied", "tp_bf16", "z3")]
             + hops[2] + [native, refused, ema, loop], tmp)
    torchrun(4, hops[4], tmp)
    out = {tag: torch.load(tmp / f"{tag}.pt", weights_only=False)
           for tag in ["tp", "tp_tied", "tp_bf16", "z3", "fsdp_tp", "native-refused", "ema-refused", "tp-loop"]
           + [_tag(h) for h in HOPS if h[2] > 1]}
    for spec, hop in zip(hops[1], [h for h in HOPS if h[2] == 1]):
        out[_tag(hop)] = run_spec(spec, 1)
    return tmp, out


@pytest.mark.dist
@pytest.mark.parametrize("hop", HOPS, ids=_tag)
def test_tp_resume_matches_uninterrupted(tp_runs, hop):
    """Save at step 3 under one engine and world size, resume under another (or the same), train to 6: losses and
    final weights match the uninterrupted run of the saver, bit-exact where TP=2 resumes TP=2."""
    _, out = tp_runs
    saved_by, resumed_as, _ = hop
    bf16 = "bf16" in saved_by
    assert_resumed_matches(out[_tag(hop)], out[saved_by], STEPS, saved_by == resumed_as,
                           BF16_LOSS_RTOL if bf16 else LOSS_RTOL, BF16_STATE_ATOL if bf16 else STATE_ATOL)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["tp", "fsdp_tp"])
def test_tp_checkpoint_is_unified_and_records_the_mesh(tp_runs, kind):
    """A TP run writes the same name-keyed files as every engine (full global shapes: colwise and rowwise shards
    put together), with the optimizer state, and records its device mesh."""
    from safetensors import safe_open

    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

    tmp, out = tp_runs
    ckpt = tmp / kind / "checkpoint-6"
    layout = detect_layout(ckpt)
    saved_by = layout.manifest["saved_by"]
    assert layout.complete and saved_by["engine"] == "tensor_parallel"
    assert saved_by["world_size"] == {"tp": 2, "fsdp_tp": 4}[kind]
    assert saved_by["device_mesh"] == ({"tp": 2} if kind == "tp" else {"fsdp": 2, "tp": 2})
    state = out[kind]["state"]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(state)
        for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
                     "model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(f.get_tensor(name), state[name]), name
    optim = out[kind]["optim"]
    with ComponentReader(ckpt, "optimizer") as reader:
        for key in ("model.layers.0.mlp.down_proj.weight/exp_avg_sq", "model.layers.1.self_attn.q_proj.weight/exp_avg"):
            assert torch.equal(reader.get(key), optim[key]), key


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["tp", "tp_tied", "fsdp_tp"])
def test_tp_checkpoint_loads_with_from_pretrained(tp_runs, kind):
    tmp, out = tp_runs
    assert_from_pretrained_equals(tmp / kind / "checkpoint-6", out[kind]["state"], tied=kind == "tp_tied")


@pytest.mark.dist
def test_native_tp_checkpoint_is_refused_before_the_first_step(tp_runs):
    """The Trainer's own checkpoint of a TP run holds model weights only (transformers refuses to save optimizer
    state for models sharded at load time), so it cannot be resumed: refused, with what to do, before any step."""
    tmp, out = tp_runs
    native = detect_layout(tmp / "native" / "checkpoint-3")
    assert native.complete and native.kind == "hf-trainer"
    assert out["native-refused"]["global_step"] == 0, out["native-refused"]
    assert "from_pretrained" in out["native-refused"]["error"]


@pytest.mark.dist
def test_ema_under_tp_is_refused_before_the_first_step(tp_runs):
    _, out = tp_runs
    assert out["ema-refused"]["global_step"] == 0 and "drop the word 'ema'" in out["ema-refused"]["error"]


@pytest.mark.dist
def test_trainer_loop_options_under_tp(tp_runs):
    """Eval every 2 steps, `load_best_model_at_end` with `save_total_limit=2`, then `trainer.save_model(dir)`, on a
    TP=2 run: the best (earlier) checkpoint is kept and loaded, and `from_pretrained(dir)` gives the final weights."""
    tmp, out = tp_runs
    assert_loop_options(tmp / "tp-loop", out["tp-loop"], tmp / "tp-model")
