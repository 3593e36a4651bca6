"""Real DeepSpeed AutoTP (`tensor_parallel.autotp_size: 2` in the DeepSpeed config) through the plain Trainer on
CPU with gloo: ZeRO-1 and ZeRO-2, 2 processes (TP=2) and 4 (TP=2 x data-parallel 2), fp32 and bf16, untied and
tied embeddings; every AutoTP run asserts its linears really are AutoTP layers holding a slice
(`support.states.assert_autotp`). AutoTP splits the Llama's q/k/v/gate/up/lm_head by rows (vocab 97: 49/48, intermediate
37: 19/18) and o_proj/down_proj by columns; a tied embedding shares the vocabulary-parallel head's slice.

Resume equivalence at each hop against the uninterrupted run of the engine that saved: the same topology is
bit-exact; across engines and world sizes LOSS_RTOL = STATE_ATOL = 1e-5 (fp32) and 1e-3 / 4e-3 (bf16), as in
test_tensor_parallel.py. DeepSpeed keeps AutoTP's process groups for the whole process, so each launch runs its
DeepSpeed runs without AutoTP first (`support.env._reset_deepspeed_autotp`).
"""

import math

import pytest
import torch

from support.specs import hop_tag, loop_spec, run_spec, spec_of
from support.states import assert_from_pretrained_equals, assert_loop_options, assert_resumed_matches
from support.launches import torchrun
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout

LOSS_RTOL = STATE_ATOL = 1e-5
BF16_LOSS_RTOL, BF16_STATE_ATOL = 1e-3, 4e-3
STEPS = (4, 5, 6)

KINDS = {
    "atp": {"zero": 1, "autotp": 2, "model": "llama_tp"},
    "atp_tied": {"zero": 1, "autotp": 2, "model": "llama_tp_tied"},
    "atp_bf16": {"zero": 2, "autotp": 2, "model": "llama_tp", "overrides": {"bf16": True}},
    "atp_bf16_res": {"zero": 2, "autotp": 2, "model": "llama_tp", "plant_ties": 6,  # the final save holds ties
                     "overrides": {"bf16": True, "unified_checkpoint_config": "residual_master_weight"}},
    "atp4": {"zero": 2, "autotp": 2, "model": "llama_tp"},  # at 4 processes: TP=2 x data-parallel 2
    "z2": {"zero": 2, "model": "llama_tp"},
    "single": {"model": "llama_tp"},
    "single_tied": {"model": "llama_tp_tied"},
    "single_bf16": {"model": "llama_tp", "overrides": {"bf16": True}},
}
HOPS = [  # (saved by, resumed as, processes of the resumed run)
    ("atp", "atp", 2), ("atp_bf16", "atp_bf16", 2), ("z2", "atp", 2), ("atp", "single", 1),
    ("atp_tied", "single_tied", 1), ("atp_bf16", "single_bf16", 1), ("atp4", "single", 1), ("atp", "atp4", 4),
]


def _spec(tmp, kind, tag, resume=None, **extra):
    return spec_of(KINDS, tmp, kind, tag, resume, **extra)


@pytest.fixture(scope="module")
def autotp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autotp")
    hops = {w: [_spec(tmp, h[1], hop_tag(h), (h[0], 3)) for h in HOPS if h[2] == w] for w in (1, 2, 4)}
    native = _spec(tmp, "atp", "native", unified_checkpoint=False, attach=False)
    native_resumed = _spec(tmp, "atp", "native-resumed", resume=("native", 3))
    zero3 = {**_spec(tmp, "atp", "zero3-refused"), "zero": 3, "expect_error": "ZeRO stage 3"}
    loop = loop_spec(_spec(tmp, "atp", "atp-loop"), tmp / "atp-model")
    torchrun(2, [_spec(tmp, "z2", "z2")] + [_spec(tmp, k, k) for k in ("atp", "atp_tied", "atp_bf16", "atp_bf16_res")]
             + hops[2] + [native, native_resumed, zero3, loop], tmp)
    torchrun(4, [_spec(tmp, "atp4", "atp4")] + hops[4], tmp)
    tags = ["z2", "atp", "atp_tied", "atp_bf16", "atp_bf16_res", "atp4", "native", "native-resumed", "zero3-refused", "atp-loop"]
    out = {tag: torch.load(tmp / f"{tag}.pt", weights_only=False) for tag in tags + [hop_tag(h) for h in HOPS
                                                                                    if h[2] > 1]}
    for spec, hop in zip(hops[1], [h for h in HOPS if h[2] == 1]):
        out[hop_tag(hop)] = run_spec(spec, 1)
    out["native-refused"] = run_spec({**_spec(tmp, "single", "native-refused", resume=("native", 3)),
                                      "expect_error": "AutoTP"}, 1)
    return tmp, out


@pytest.mark.dist
@pytest.mark.parametrize("hop", HOPS, ids=hop_tag)
def test_autotp_resume_matches_uninterrupted(autotp_runs, hop):
    """Save at step 3 under one engine and world size, resume under another (or the same), train to 6: losses and
    final weights match the uninterrupted run of the saver, bit-exact where the topology is the same."""
    _, out = autotp_runs
    saved_by, resumed_as, _ = hop
    bf16 = "bf16" in saved_by
    assert_resumed_matches(out[hop_tag(hop)], out[saved_by], STEPS, saved_by == resumed_as,
                           BF16_LOSS_RTOL if bf16 else LOSS_RTOL, BF16_STATE_ATOL if bf16 else STATE_ATOL)


@pytest.mark.dist
def test_autotp_trains_like_one_process(autotp_runs):
    """The ground the hops stand on: AutoTP at 2 and at 2 x 2 computes the losses of ZeRO-2 without AutoTP."""
    _, out = autotp_runs
    for kind in ("atp", "atp4"):
        for step, loss in out["z2"]["losses"].items():
            assert math.isclose(out[kind]["losses"][step], loss, rel_tol=LOSS_RTOL), (kind, step)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["atp", "atp4", "atp_bf16", "atp_bf16_res"])
def test_autotp_checkpoint_is_unified_and_records_the_mesh(autotp_runs, kind):
    """Full tensors by name (row and column slices put together), fp32 master weights and optimizer moments equal
    to DeepSpeed's own gathered state, and the mesh recorded. With `residual_master_weight` (and ties planted in
    every tensor, `support.callbacks.PlantTies`), the master weights are stored as the residual, each tie counted once although
    TP ranks hold copies of the replicated parameters, and rebuild bit for bit."""
    from safetensors import safe_open

    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

    tmp, out = autotp_runs
    ckpt = tmp / kind / "checkpoint-6"
    layout = detect_layout(ckpt)
    saved_by = layout.manifest["saved_by"]
    assert layout.complete and saved_by["engine"] == "deepspeed" and saved_by["zero_stage"] == KINDS[kind]["zero"]
    assert saved_by["device_mesh"] == {"dp": 2 if kind == "atp4" else 1, "tp": 2}
    state, optim = out[kind]["state"], out[kind]["optim"]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(state)
        for name in state:
            assert torch.equal(f.get_tensor(name), state[name]), name
    names = ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight",
             "model.layers.1.mlp.gate_proj.weight", "model.embed_tokens.weight", "model.norm.weight")
    with ComponentReader(ckpt, "optimizer") as reader:
        for name in names:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(reader.get(f"{name}/{key}"), optim[f"{name}/{key}"]), (name, key)
    if kind.startswith("atp_bf16"):
        with ComponentReader(ckpt, "model") as model, ComponentReader(ckpt, "master_weights", anchor=model) as reader:
            for name in names:
                assert torch.equal(reader.get(name), optim[f"{name}/master"]), name
            codec = reader.metadata.get("codec")
    if kind == "atp_bf16_res":
        ties = {n: e["ties"] for n, e in codec["tensors"].items()}
        assert codec["name"] == "bf16_residual" and ties.keys() == set(state)
        assert all(ties[n] for n in names if "norm" not in n)  # replicated, row- and column-split tensors


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["atp", "atp_tied", "atp4"])
def test_autotp_checkpoint_loads_with_from_pretrained(autotp_runs, kind):
    tmp, out = autotp_runs
    assert_from_pretrained_equals(tmp / kind / "checkpoint-6", out[kind]["state"], tied=kind == "atp_tied")


@pytest.mark.dist
def test_native_autotp_checkpoint_resumes_natively_and_is_refused_elsewhere(autotp_runs):
    """DeepSpeed's own AutoTP checkpoint (one mp_rank file per slice): resumed by DeepSpeed itself in the topology
    that wrote it (bit-exact with the uninterrupted run), refused with what to do before any step elsewhere."""
    tmp, out = autotp_runs
    assert detect_layout(tmp / "native" / "checkpoint-3").kind == "deepspeed"
    assert_resumed_matches(out["native-resumed"], out["native"], STEPS, True, 0, 0)
    assert detect_layout(tmp / "native-resumed" / "checkpoint-6").kind == "unified"
    refused = out["native-refused"]
    assert refused["global_step"] == 0 and "autotp_size': 2" in refused["error"], refused


@pytest.mark.dist
def test_autotp_with_zero3_is_refused_before_the_first_step(autotp_runs):
    _, out = autotp_runs
    assert out["zero3-refused"]["global_step"] == 0 and "autotp_size=2" in out["zero3-refused"]["error"]


class _RecordingReader:
    """A reader of one full tensor that records the rows each read asks for."""

    def __init__(self, full: torch.Tensor):
        self.full, self.rows = full, []

    def get_slice(self, name):
        outer = self

        class _Slice:
            def __getitem__(self, rows):
                outer.rows.append((rows.start, rows.stop))
                return outer.full[rows]

        return _Slice()


@pytest.mark.parametrize("dim", [0, 1])
def test_split_range_reads_only_the_rows_it_covers(dim):
    """A rank's fragment of its AutoTP slice (rows or columns, uneven 19/18) is read from the rows that cover it
    only, and equals the same elements of the slice cut from the full tensor."""
    from hf_unified_ckpt.engines.autotp import TPSplit, read_split_range

    full = torch.arange(37 * 32, dtype=torch.float32).view(37, 32) if dim == 0 else \
        torch.arange(32 * 37, dtype=torch.float32).view(32, 37)
    for index in (0, 1):
        split = TPSplit(dim, (19, 18), index, tuple(full.shape))
        local = full.split(split.sizes, dim=dim)[index].reshape(-1)
        for start, count in ((0, local.numel()), (5, 40), (local.numel() - 7, 7)):
            reader = _RecordingReader(full)
            got = read_split_range(reader, "w", split, start, count)
            assert torch.equal(got, local[start:start + count]), (index, start, count)
            (first, last), = reader.rows
            assert last - first <= -(-count // split.local_shape[1]) + 1, reader.rows


@pytest.mark.dist
def test_trainer_loop_options_under_autotp(autotp_runs):
    """Eval every 2 steps, `load_best_model_at_end` with `save_total_limit=2`, then `trainer.save_model(dir)`, on an
    AutoTP=2 run: the best (earlier) checkpoint is kept and loaded, and `from_pretrained(dir)` gives the final
    weights."""
    tmp, out = autotp_runs
    assert_loop_options(tmp / "atp-loop", out["atp-loop"], tmp / "atp-model")
