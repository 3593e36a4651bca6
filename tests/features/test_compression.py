"""Checkpoint compression: O1 (int8) / O2 (int4) optimizer moments and exact residual master weights.

- the codecs alone: error bounds per block, no zero-point for second moments, ragged/empty/0-d/bf16 tensors, 4-bit
  packing, the residual rebuilding every fp32 value bit-exactly (ties included) and refusing weights that are not
  the bf16 rounding of the master weights;
- one process: the files (codes, scales, codec metadata, manifest version 2), `info`, `verify` catching a damaged
  compressed file, and the lineage guard (the save after a compressed restore is written at O0 while the
  restored error has not halved);
- real DDP, DeepSpeed ZeRO-2 (bf16) and ZeRO-3, FSDP2 on 2 ranks saving O1/O2, each resumed on another engine at
  3 ranks (and in one process): the state every rank loads is exactly the codec's round trip of the state the
  save wrote (so resharding of compressed state is exact), and residual master weights come back bit-exact.
"""

import json
import math

import pytest
import torch

from support.codecs import Stored, round_trip
from support.faults import resign, rewrite_tensor
from support.trainers import train
from support.launches import torchrun
from hf_unified_ckpt.tools.cli import _info, main as cli_main
from hf_unified_ckpt.format.codecs import (CHUNK, CODE_BOOKS, MomentCodec, ResidualCodec, count_ties, dequantize, quantize,
                                    rebuild_master, residual_of)
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout
from hf_unified_ckpt.format.planning import TensorSpec


# ---- the codecs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_round_trip_error_is_bounded_per_block(kind, bits):
    """Each value lands on the nearest grid point in the grid's own coordinate t (v's square root, then the
    power's root, over the block's scale): |t - t'| <= step / 2, or <= first below the zero-free grid's first."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-6, 0, 1000)  # blocks of very different magnitudes
    x = x.abs() if kind == "sqrt" else x
    grid = CODE_BOOKS[(kind, bits)]
    codes, scales = quantize(x, grid, kind, 128)
    y = dequantize(codes, scales, grid, kind, x.numel(), 128)
    book = torch.tensor(grid.values(), dtype=torch.float64)
    assert bool((book[1:] > book[:-1]).all()) and float(book[-1]) == 1.0 and (kind == "signed") == (book[0] < 0)
    per_element = scales.repeat_interleave(128)[:1000].double()

    def t(values):
        domain = values.double().sqrt() if kind == "sqrt" else values.double()
        return torch.sign(domain) * (domain.abs() / per_element) ** (1 / grid.power)

    tx, ty = t(x), t(y)
    bound = torch.where(tx < grid.first - grid.step / 2, grid.first, grid.step / 2)
    assert bool(((tx - ty).abs() <= bound * (1 + 1e-5) + 1e-7).all())
    assert codes.numel() == math.ceil(x.numel() * bits / 8) and scales.numel() == math.ceil(1000 / 128)


@pytest.mark.parametrize("stage", ["O1", "O2"])
def test_a_second_moment_never_decodes_to_zero(stage):
    v = torch.tensor([1.0] + [1e-12] * 127 + [0.0, 3e-30])  # a block with a 1e12 range, a zero, a ragged block
    out = round_trip(stage, "w/exp_avg_sq", v)
    assert bool((out[v > 0] > 0).all())
    assert float(out[0]) == 1.0  # a block's largest element is exact
    m = torch.tensor([0.5, -1e-3, 1e-9, 0.0])
    assert round_trip(stage, "w/exp_avg", m)[0] == 0.5 and round_trip(stage, "w/exp_avg", m)[3] == 0


def test_zero_empty_ragged_scalar_and_bf16_tensors():
    assert torch.equal(round_trip("O1", "w/exp_avg", torch.zeros(300)), torch.zeros(300))
    assert torch.equal(round_trip("O2", "w/exp_avg_sq", torch.zeros(5)), torch.zeros(5))
    assert round_trip("O2", "w/exp_avg", torch.zeros(0, 4)).shape == (0, 4)
    g = torch.Generator().manual_seed(0)
    odd = torch.randn(3, 43, generator=g)  # 129 values: a last block of one, an odd count of 4-bit codes
    assert round_trip("O2", "w/exp_avg", odd).shape == (3, 43)
    bf16 = torch.randn(7, 9, generator=g).to(torch.bfloat16)
    out = round_trip("O1", "w/exp_avg", bf16)
    assert out.dtype == torch.bfloat16 and float((out.float() - bf16.float()).abs().max()) < 0.02
    codec = MomentCodec("O1")
    for spec in (TensorSpec("w/step", (), torch.float32), TensorSpec("w/exp_inf", (4,), torch.float32),
                 TensorSpec("w/exp_avg", (4,), torch.int64)):
        assert codec.stored_specs(spec) == [spec]  # scalars, unknown states and integers stay exact


@pytest.mark.parametrize("stage", ["O1", "O2"])
def test_rows_decode_from_the_blocks_that_cover_them_only(stage):
    """What a rank loading its rows reads: equal to decoding the whole tensor, then slicing."""
    g = torch.Generator().manual_seed(0)  # unseeded, about 1 run in 65 drew a natural tie beside the planted one
    x = torch.randn(37, 29, generator=g)  # rows of 29 values: rows start mid-block and mid-byte
    for key, value in (("w/exp_avg", x), ("w/exp_avg_sq", x.square())):
        codec = MomentCodec(stage)
        codec.stored_specs(TensorSpec(key, tuple(value.shape), value.dtype))
        stored = Stored(codec.encode(key, value))
        whole = codec.decode(key, stored)
        for rows in (slice(0, 37), slice(3, 4), slice(5, 22), slice(36, 37), slice(10, 10), slice(30, None)):
            assert torch.equal(codec.decode_rows(key, stored, rows), whole[rows]), (key, rows)
    master = torch.randn(37, 29, generator=g)
    master.view(-1)[7] = 1.00390625  # 0x3F808000: a tie rounded down to even, listed by index
    census = {"w": count_ties(master, master.to(torch.bfloat16))}
    residual = ResidualCodec(census)
    residual.stored_specs(TensorSpec("w", (37, 29), torch.float32))
    stored = Stored(residual.encode("w", master))
    reader = ResidualCodec.from_metadata(residual.metadata(), anchor=Stored({"w": master.to(torch.bfloat16)}))
    assert census["w"] == 1 and torch.equal(reader.decode("w", stored).view(torch.int32), master.view(torch.int32))
    for rows in (slice(0, 1), slice(4, 9), slice(36, 37)):
        assert torch.equal(reader.decode_rows("w", stored, rows).view(torch.int32), master[rows].view(torch.int32))


def test_the_residual_rebuilds_every_fp32_value_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2_000_000, generator=g) * torch.logspace(-30, 30, 2_000_000)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45,
                            1.00390625, 1.01171875, -1.00390625])  # ties rounded down (listed) and up
    x = torch.cat([x, special])
    x[CHUNK - 1:CHUNK + 1] = 1.00390625  # ties on both sides of a chunk boundary (the codec works chunk by chunk)
    residual, ties = residual_of(x)
    assert residual.dtype == torch.int16 and ties.numel() > 0  # ties rounded down are the only exceptions
    rebuilt = rebuild_master(x.to(torch.bfloat16), residual, ties)
    assert torch.equal(rebuilt.view(torch.int32), x.view(torch.int32))
    assert count_ties(x, x.to(torch.bfloat16)) == ties.numel()
    wrong = x.to(torch.bfloat16).clone()
    wrong[5] = wrong[5] * 2
    assert count_ties(x, wrong) is None  # weights that are not the master's rounding: no residual
    assert {CHUNK - 1, CHUNK} <= set(ties.tolist())
    payload = x.clone()
    payload.view(torch.int32)[CHUNK + 5] = 0x7F812345  # a NaN whose payload its bf16 rounding does not keep
    assert count_ties(payload, payload.to(torch.bfloat16)) is None  # stored as plain fp32 instead
    with pytest.raises(ValueError, match="not within 16 bits"):
        residual_of(payload)


def test_the_ties_of_many_fragments_are_counted_in_shared_windows():
    """`count_ties_many` (the residual census of a rank's fragments: a 405B ZeRO-3 rank at 16,384 ranks holds 1,137)
    lays small fragments end to end in one window and a large one over several: each fragment gets its own ties
    (as many as `residual_of` lists), including ties at fragment, mask-word and window edges, and None where its
    weights are not its master's rounding, round to a NaN, or are not bf16 of its length; the others are unaffected."""
    from hf_unified_ckpt.format.codecs import count_ties_many

    g = torch.Generator().manual_seed(57)
    sizes = [0, 1, 7, 9, 1000, CHUNK - 3, 5, CHUNK + 5, 2 * CHUNK + 1, 3, 16, 40_000]
    fragments, expected = [], {}
    for i, n in enumerate(sizes):
        x = torch.randn(n, generator=g)
        for at in {0, n - 1, 7, 8, CHUNK - 1, CHUNK} & set(range(n)):
            x[at] = 1.00390625  # a tie rounded down: at fragment edges, 64-bit mask words' edges, window edges
        fragments.append((f"t{i}", x, x.to(torch.bfloat16)))
        expected[f"t{i}"] = residual_of(x)[1].numel()
    assert sum(expected.values()) > len(sizes)
    wrong, nan = torch.randn(300, generator=g), torch.randn(50, generator=g)
    low = wrong.to(torch.bfloat16)
    low[299] = low[299] * 2
    nan.view(torch.int32)[3] = 0x7F812345
    fragments[3:3] = [("wrong", wrong, low), ("nan", nan, nan.to(torch.bfloat16)),
                      ("fp32 weights", nan, nan), ("short", wrong, wrong[:-1].to(torch.bfloat16))]
    expected.update({"wrong": None, "nan": None, "fp32 weights": None, "short": None})
    assert count_ties_many(fragments) == expected
    assert count_ties_many([]) == {}


def _write_as_ranks(folder, component: str, tensors: dict, pieces: dict | None, codec, max_shard_size: int):
    """Plan `tensors` (3 writers) through `codec` and write every file the way the ranks do: each rank its pieces
    of `pieces` (logical name -> ((rank, first element, count), ...)) in place, encoded piece by piece, and the
    header rank the rest whole (everything whole without `pieces`). Returns the component plan."""
    from hf_unified_ckpt.format.planning import file_plans, plan_component
    from hf_unified_ckpt.checkpoint.write.writer import write_ranges

    folder.mkdir()
    plan = plan_component(component, [TensorSpec.of(n, t) for n, t in tensors.items()], writers=3,
                          max_shard_size=max_shard_size, codec=codec)
    for file in file_plans(plan, pieces):
        for rank in sorted(file.writers):
            mine = {n: tensors[n].reshape(-1)[first:first + count]
                    for n in file.pieces_held(rank) for r, first, count in file.held[n] if r == rank}
            if rank == file.header_rank:
                mine.update({n: tensors[n] for n in file.whole_names})
            write_ranges(folder / file.name, file, rank, file.encoded(mine, rank))
    return plan


@pytest.mark.parametrize("stage", ["O1", "O2"])
def test_ranks_encoding_their_blocks_of_moments_in_place_make_the_file_a_whole_encode_makes(tmp_path, stage):
    """Three ranks each encode the O1/O2 blocks that start among their elements (uneven pieces cutting blocks, one
    shorter than a block, one holding no block start, an odd element count for O2's two codes per byte, a tensor
    no rank holds in pieces): with every rank's halo, each file is byte for byte the one encoding whole tensors on
    one writer makes. Without a halo, the owner of a cut block refuses to write."""
    from hf_unified_ckpt.format.planning import file_plans, tiling

    g = torch.Generator().manual_seed(4)
    state = {"a/exp_avg": torch.randn(37, 29, generator=g), "a/exp_avg_sq": torch.rand(37, 29, generator=g),
             "b/exp_avg": torch.randn(301, generator=g), "c/exp_avg": torch.randn(9, 7, generator=g),
             "a/step": torch.tensor(3.0)}
    bounds = {"a/exp_avg": [(1, 0, 300), (0, 300, 50), (2, 350, 723)],  # rank 0: 300..350, no block start
              "a/exp_avg_sq": [(2, 0, 129), (0, 129, 944)], "b/exp_avg": [(0, 0, 200), (1, 200, 101)]}
    pieces = {n: tiling(state[n].numel(), b) for n, b in bounds.items()}

    def codec_with_halos(share: bool) -> MomentCodec:
        codec = MomentCodec(stage)
        for n, t in state.items():
            codec.stored_specs(TensorSpec.of(n, t))
        halos = {}
        for n, held in pieces.items():
            for _, first, count in held:
                halo = codec.halo(n, first, state[n].reshape(-1)[first:first + count])
                if halo is not None and share:
                    halos.setdefault(n, {})[first] = halo
        codec.receive_halos(halos)
        return codec

    def write(folder, codec, in_place):
        return _write_as_ranks(folder, "optimizer", state, pieces if in_place else None, codec, 6000)

    plan = write(tmp_path / "in_place", codec_with_halos(True), True)
    in_place = {n for f in file_plans(plan, pieces) for n in f.pieces}
    assert in_place == {n + s for n in pieces for s in ("", ":scales")}
    write(tmp_path / "whole", codec_with_halos(True), False)
    for name in plan.files:
        assert (tmp_path / "in_place" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    with pytest.raises(ValueError, match=r"rank \d lacks elements \[\d+, \d+\) of its last block"):
        write(tmp_path / "no_halos", codec_with_halos(False), True)


def _with_ties(x: torch.Tensor, every: int) -> torch.Tensor:
    """`x` with every `every`-th element whose bf16 rounding has an even last bit made a tie rounded down to it."""
    flat = x.reshape(-1)
    high = flat.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[::every] = (high[::every] & 1) == 0
    return torch.where(chosen, (high << 16) | 0x8000, flat.view(torch.int32)).view(torch.float32).reshape(x.shape)


def test_ranks_encoding_their_pieces_of_the_residual_in_place_make_the_file_a_whole_encode_makes(tmp_path):
    """Three ranks each encode and write their own uneven pieces of master weights (ties on every rank, a rank
    holding none, a tensor that is not the bf16 rounding's master stored as plain fp32, one no rank holds in
    pieces, written whole): each file is byte for byte the one encoding whole tensors on one writer makes, and the
    reader rebuilds every master bit for bit. A rank whose ties differ from the census refuses to write."""
    from hf_unified_ckpt.format.planning import file_plans, tiling
    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

    g = torch.Generator().manual_seed(3)
    masters = {"a": _with_ties(torch.randn(37, 29, generator=g), 7), "b": _with_ties(torch.randn(50, generator=g), 3),
               "c": _with_ties(torch.randn(13, 7, generator=g), 5), "plain": torch.randn(6, 4, generator=g)}
    bf16 = {n: m.to(torch.bfloat16) for n, m in masters.items()}
    bf16["plain"] = (masters["plain"] * 2).to(torch.bfloat16)  # not its master's rounding: no residual
    bounds = {"a": [(1, 0, 400), (0, 400, 0), (2, 400, 673)], "b": [(2, 0, 21), (0, 21, 29)],
              "plain": [(0, 0, 10), (1, 10, 14)]}
    pieces = {n: tiling(masters[n].numel(), b) for n, b in bounds.items()}
    by_rank = {n: {} for n in masters}
    for n, held in pieces.items():
        for rank, first, count in held:
            part = masters[n].reshape(-1)[first:first + count]
            by_rank[n][rank] = count_ties(part, bf16[n].reshape(-1)[first:first + count])
    by_rank["c"] = {0: count_ties(masters["c"], bf16["c"])}
    assert all(ties for n in ("a", "b") for rank, ties in by_rank[n].items() if rank != 0) and by_rank["plain"][0] is None
    census = {n: sum(r.values()) for n, r in by_rank.items() if None not in r.values()}

    def write(folder, codec, in_place):
        return _write_as_ranks(folder, "master_weights", masters, pieces if in_place else None, codec, 4000)

    plan = write(tmp_path / "in_place", ResidualCodec(census, by_rank=by_rank), True)
    assert {n for f in file_plans(plan, pieces) for n in f.pieces} == {"a", "a:ties", "b", "b:ties", "plain"}
    write(tmp_path / "whole", ResidualCodec(census), False)
    for name in plan.files:
        assert (tmp_path / "in_place" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    (tmp_path / "in_place" / "master_weights.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"codec": plan.codec.metadata()}, "weight_map": plan.weight_map}))
    reader = ComponentReader(tmp_path / "in_place", "master_weights", anchor=Stored(bf16))
    for n, m in masters.items():
        assert torch.equal(reader.get(n).view(torch.int32), m.view(torch.int32)), n
    moved = ResidualCodec(census, by_rank={**by_rank, "a": {**by_rank["a"], 2: by_rank["a"][2] + 1,
                                                              1: by_rank["a"][1] - 1}})
    moved.stored_specs(TensorSpec.of("a", masters["a"]))
    with pytest.raises(ValueError, match="changed between planning the save and writing it"):
        moved.encode_piece("a", masters["a"].reshape(-1)[:400], 0, 1)
    short = ResidualCodec(census, by_rank={**by_rank, "a": {1: by_rank["a"][1]}})
    short.stored_specs(TensorSpec.of("a", masters["a"]))
    assert short.stored_pieces("a", pieces["a"]) is None  # ties unaccounted for: assembled and encoded whole


# ---- one process: files, info, verify, the lineage guard ----------------------------------------------------------
@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    train(tmp / "o1", ckpt_quant_stage="O1")
    train(tmp / "guarded", resume=str(tmp / "o1" / "checkpoint-3"), ckpt_quant_stage="O1")
    fast = {"ckpt_quant_stage": "O1", "adam_beta1": 0.5, "adam_beta2": 0.5}  # resuming restores the saved betas
    train(tmp / "o1-fast", **fast)
    train(tmp / "fast", resume=str(tmp / "o1-fast" / "checkpoint-3"), **fast)
    return tmp


def test_o1_files_metadata_and_info(single, capsys):
    ckpt = single / "o1" / "checkpoint-3"
    manifest = detect_layout(ckpt).manifest
    assert manifest["format_version"] == 2 and manifest["options"]["ckpt_quant_stage"] == "O1"
    codec = manifest["components"]["optimizer"]["codec"]
    assert codec["name"] == "blockwise_codebook" and codec["bits"] == 8 and codec["block_size"] == 128
    assert "codec" not in manifest["components"]["model"]  # from_pretrained reads plain files
    index = json.loads((ckpt / "optimizer.safetensors.index.json").read_text())
    assert any(k.endswith("/exp_avg:scales") for k in index["weight_map"])
    assert index["metadata"]["codec"]["books"]["sqrt"][0] > 0  # the second moment's book has no zero
    info = _info(str(ckpt))
    assert info["components"]["optimizer"]["codec"]["stage"] == "O1"
    assert info["bytes_per_parameter"]["optimizer"] < 3  # O0: over 8 (two fp32 moments); O1: ~2.06 + headers
    cli_main(["info", str(ckpt)])
    assert "blockwise_codebook" in capsys.readouterr().out


def test_compressed_files_read_alike_locally_and_from_another_machine(single):
    """Rows of compressed moments decode from the byte ranges that cover them, also when another machine serves
    the file (machine-local folders)."""
    from support.loopback import Loopback
    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

    ckpt = single / "o1" / "checkpoint-3"
    remote = Loopback(ckpt)
    with ComponentReader(ckpt, "optimizer") as local, ComponentReader(ckpt, "optimizer", remote) as served:
        key = next(k for k in local.keys() if k.endswith("/exp_avg_sq") and len(local.specs()[k][0]) == 2)
        rows = local.specs()[key][0][0]
        assert torch.equal(served.get(key), local.get(key))
        assert torch.equal(served.get_slice(key)[1:rows - 1], local.get(key)[1:rows - 1])
    assert any(name == key and index is not None for name, index in remote.asked)  # only the covering bytes


def test_verify_catches_a_damaged_compressed_file(single, tmp_path):
    import shutil

    ckpt = tmp_path / "checkpoint-3"
    shutil.copytree(single / "o1" / "checkpoint-3", ckpt)
    assert cli_main(["verify", str(ckpt)]) == 0
    data = bytearray((ckpt / "optimizer.safetensors").read_bytes())
    data[-3] ^= 0xFF  # a code byte of the last tensor
    (ckpt / "optimizer.safetensors").write_bytes(bytes(data))
    assert cli_main(["verify", str(ckpt)]) == 1


def test_the_save_after_a_compressed_restore_is_exact_until_the_error_halved(single):
    guarded = detect_layout(single / "guarded" / "checkpoint-6").manifest
    assert guarded["options"]["ckpt_quant_stage"] == "O0"  # AdamW beta2 0.999: 693 steps to halve
    assert guarded["options"]["ckpt_quant_stage_requested"] == "O1"
    assert guarded["options"]["quantized_restore_step"] == 3 and guarded["format_version"] == 1
    fast = detect_layout(single / "fast" / "checkpoint-6").manifest
    assert fast["options"]["ckpt_quant_stage"] == "O1"  # betas 0.5: halved after 1 step
    assert fast["options"]["quantized_restore_step"] == 3


def test_residual_master_weight_without_master_weights_says_so_once(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="hf_unified_ckpt"):
        train(tmp_path, max_steps=1, save_steps=1, unified_checkpoint_config="residual_master_weight")
    assert caplog.text.count("residual_master_weight has no effect") == 1
    assert "master_weights" not in detect_layout(tmp_path / "checkpoint-1").manifest["components"]


# ---- real engines: save at 2 ranks, load at 3 ranks (another engine) and in one process ---------------------------
SAVES = {  # name: (engine spec, precision, options)
    "z2-o1": ({"zero": 2}, {"bf16": True}, {"ckpt_quant_stage": "O1",
                                             "unified_checkpoint_config": "residual_master_weight"}),
    "z2-res": ({"zero": 2, "plant_ties": 3}, {"bf16": True}, {"unified_checkpoint_config": "residual_master_weight"}),
    "z2-async": ({"zero": 2, "plant_ties": 3}, {"bf16": True}, {"ckpt_quant_stage": "O2", "unified_checkpoint_config":
                                                                   "async_save residual_master_weight"}),
    "z3-o2": ({"zero": 3}, {}, {"ckpt_quant_stage": "O2"}),
    "z3-res": ({"zero": 3, "plant_ties": 3}, {"bf16": True}, {"ckpt_quant_stage": "O1",
                                             "unified_checkpoint_config": "residual_master_weight"}),
    "fsdp2-o1": ({"fsdp": 2}, {}, {"ckpt_quant_stage": "O1"}),
    "ddp-o2": ({}, {}, {"ckpt_quant_stage": "O2"}),
}
LOADS = {  # name: (saved by, engine spec at 3 ranks, precision); each records what it loaded, then trains on
    "z2-o1>fsdp2": ("z2-o1", {"fsdp": 2}, {}),
    "z2-o1>z2": ("z2-o1", {"zero": 2}, {"bf16": True}),
    "z2-res>z2": ("z2-res", {"zero": 2}, {"bf16": True}),
    "z2-async>z2": ("z2-async", {"zero": 2}, {"bf16": True}),
    "z3-o2>z2": ("z3-o2", {"zero": 2}, {}),
    "z3-res>z2": ("z3-res", {"zero": 2}, {"bf16": True}),
    "fsdp2-o1>z3": ("fsdp2-o1", {"zero": 3}, {}),
    "ddp-o2>fsdp2": ("ddp-o2", {"fsdp": 2}, {}),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engines")
    saves = [{**engine, "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt"), "record_at": 3,
              "overrides": {**precision, **options}} for name, (engine, precision, options) in SAVES.items()]
    torchrun(2, saves, tmp)
    loads = [{**engine, "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt"), "record_at": 3,
              "resume": str(tmp / saved / "checkpoint-3"), "overrides": precision}
             for name, (saved, engine, precision) in LOADS.items()]
    torchrun(3, loads, tmp)
    out = {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in [*SAVES, *LOADS]}
    return tmp, out


def _moments(optim: dict) -> dict:
    return {k: v for k, v in optim.items() if k.rsplit("/", 1)[1] in ("exp_avg", "exp_avg_sq")}


@pytest.mark.dist
@pytest.mark.parametrize("load", list(LOADS))
def test_a_compressed_checkpoint_loads_on_another_engine_and_world_size_exactly_as_decoded(engines, load):
    _, out = engines
    saved = LOADS[load][0]
    stage = SAVES[saved][2].get("ckpt_quant_stage", "O0")
    truth, loaded = _moments(out[saved]["at"]["optim"]), _moments(out[load]["at"]["optim"])
    assert loaded.keys() == truth.keys() and out[load]["global_step"] == 6
    for key, value in truth.items():
        expected = value if stage == "O0" else round_trip(stage, key, value)
        assert torch.equal(loaded[key], expected.to(loaded[key].dtype)), key
    if stage != "O0":  # and the codec did change the moments (the test would notice a silent O0)
        assert any(not torch.equal(loaded[k], truth[k].to(loaded[k].dtype)) for k in truth)


@pytest.mark.dist
@pytest.mark.parametrize("saved,loaded", [("z2-res", "z2-res>z2"), ("z3-res", "z3-res>z2"),
                                          ("z2-async", "z2-async>z2")])
def test_residual_master_weights_come_back_bit_exact_at_another_world_size(engines, saved, loaded):
    tmp, out = engines
    manifest = detect_layout(tmp / saved / "checkpoint-3").manifest
    codec = manifest["components"]["master_weights"]["codec"]
    assert codec["name"] == "bf16_residual" and codec["encoded_tensors"] == manifest["components"]["master_weights"]["tensors"]
    assert manifest["components"]["master_weights"]["bytes"] < 1.1 * manifest["components"]["model"]["bytes"]
    truth, after = out[saved]["at"], out[loaded]["at"]
    masters = {k: v for k, v in truth["optim"].items() if k.endswith("/master")}
    assert masters and all(torch.equal(after["optim"][k], v) for k, v in masters.items())
    assert all(torch.equal(after["state"][k], v) for k, v in truth["state"].items())
    # the save planted ties (`PlantTies`): each rank wrote its own ties in place, at the offsets the census gave it
    index = json.loads((tmp / saved / "checkpoint-3" / "master_weights.safetensors.index.json").read_text())
    listed = {n: e["ties"] for n, e in index["metadata"]["codec"]["tensors"].items()}
    planted = {k[:-len("/master")]: int(((v.view(torch.int32) & 0x1FFFF) == 0x8000).sum()) for k, v in masters.items()}
    assert sum(listed.values()) > 100 and listed == {n: planted[n] for n in listed}


@pytest.mark.dist
def test_o1_with_residual_master_weights_into_fp32_fsdp2(engines):
    _, out = engines
    o1 = out["z2-o1>fsdp2"]["at"]["state"]  # the exact fp32 master becomes the fp32 weights
    assert all(torch.equal(o1[k[:-len("/master")]], v)
               for k, v in out["z2-o1"]["at"]["optim"].items() if k.endswith("/master"))


@pytest.mark.dist
def test_training_continues_after_a_compressed_resume(engines):
    _, out = engines
    base, resumed = out["z2-o1"]["losses"], out["z2-o1>z2"]["losses"]
    assert {4, 5, 6} <= set(resumed)
    for step in (4, 5, 6):  # int8 moments + world size 2 -> 3: measured 8.3e-6 relative at most
        assert abs(resumed[step] - base[step]) <= 1e-3 * abs(base[step]), (step, resumed[step], base[step])


def test_a_compressed_checkpoint_resumes_in_one_process(engines, tmp_path):
    tmp, out = engines
    from support.callbacks import RecordAt
    from support.trainers import make_trainer

    trainer = make_trainer(tmp_path / "single")
    at = RecordAt(trainer, 3)
    trainer.train(resume_from_checkpoint=str(tmp / "ddp-o2" / "checkpoint-3"))
    loaded = _moments(at.record["optim"])
    for key, value in _moments(out["ddp-o2"]["at"]["optim"]).items():
        assert torch.equal(loaded[key], round_trip("O2", key, value)), key


# ---- codec metadata and stored codes that disagree (re-signed: checksums match) -------------------------------------
def _edit_codec(ckpt, change) -> None:
    index = json.loads((ckpt / "optimizer.safetensors.index.json").read_text())
    change(index["metadata"]["codec"])
    (ckpt / "optimizer.safetensors.index.json").write_text(json.dumps(index))
    resign(ckpt, "optimizer.safetensors.index.json")


EMBED = "model.embed_tokens.weight/exp_avg"  # 97 x 30 = 2910 elements: 23 blocks of 128
CODEC_FAULTS = {  # case -> (how the checkpoint is changed, the line naming it; the same in the resume's error)
    "block size halved in the index": (
        lambda c: _edit_codec(c, lambda m: m.update(block_size=64)),
        f"optimizer.safetensors: '{EMBED}:scales' is F32 [23], expected F32 [46] (its scales, per the codec metadata)"),
    "block size 0 in the index": (
        lambda c: _edit_codec(c, lambda m: m.update(block_size=0)),
        "optimizer.safetensors.index.json: the 'blockwise_codebook' codec metadata is malformed: block_size 0 is not "
        "a positive integer"),
    "a moment's shape in the index": (
        lambda c: _edit_codec(c, lambda m: m["tensors"][EMBED].update(shape=[97, 300])),
        f"optimizer.safetensors: '{EMBED}' is U8 [2910], expected U8 [29100] (its codes, per the codec metadata)"),
    "scales cut short": (
        lambda c: rewrite_tensor(c, "optimizer", EMBED + ":scales", lambda t: t[:5]),
        f"optimizer.safetensors: '{EMBED}:scales' is F32 [5], expected F32 [23] (its scales, per the codec metadata)"),
}


@pytest.mark.parametrize("case", list(CODEC_FAULTS))
def test_codec_metadata_that_disagrees_with_the_stored_codes_is_refused_before_anything_is_decoded(
        single, case, tmp_path, monkeypatch, capsys):
    """Issue 55 item 3: O1/O2 block sizes, scale counts and moment shapes checked against the headers, by verify and
    by a resume, before any moment is decoded (`dequantize` allocates what the metadata says)."""
    import shutil

    from support.trainers import make_trainer
    from hf_unified_ckpt.errors import CorruptCheckpointError
    from hf_unified_ckpt.format import codecs

    ckpt = tmp_path / "checkpoint-3"
    shutil.copytree(single / "o1" / "checkpoint-3", ckpt)
    damage, line = CODEC_FAULTS[case]
    damage(ckpt)
    assert cli_main(["verify", str(ckpt)]) == 1
    assert line in capsys.readouterr().err
    monkeypatch.setattr(codecs, "dequantize", lambda *a, **k: pytest.fail("a moment was decoded"))
    trainer = make_trainer(tmp_path / "resumed", max_steps=6)
    with pytest.raises(CorruptCheckpointError) as e:
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert line in str(e.value) and "nothing was" in str(e.value)
    assert trainer.state.global_step == 3 and not list((tmp_path / "resumed").glob("*checkpoint-*"))
