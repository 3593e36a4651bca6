"""Aggregated writes (issue 58): files the ranks hold in pieces written by a few aggregator ranks, each a large
aligned range, from bytes sent point-to-point — byte-identical to the same save written in place.

One launch of 3 real ranks (gloo, CPU): ZeRO-3 (synchronous save) and FSDP2 (async save, O1-compressed moments:
pieces through a codec, halos), each saved in place (the word `in_place`) and aggregated (the word `aggregate`, with
ranges of 8 KiB and cells of 4 KiB, so the tiny model's files have several aggregators, pieces cross cell and range
boundaries, and some ranks hold empty pieces: the Llama's 10-row k_proj over 3 ranks, its 30-element norms),
ZeRO-3 bf16 with residual master weights whose ties (planted every 3 steps) each rank alone can place, a GPT-2 with
tied embeddings under FSDP2 and a LoRA model under ZeRO-3; and ZeRO-3 saved through the writer processes
(`unified_checkpoint_async_executor="process"`, whose `aggregate` group is made in those processes), against the
same run saved in place. ZeRO-3's aggregated checkpoint-3 is resumed on 1 rank (in this process) exactly as the one
written in place, and within the stated tolerance of the 3-rank run left running. The pure plan
is checked on its own too: the cells tile each file, every byte is sent by its holder to the cell's
aggregator exactly once, and what the ranks send is what the aggregators receive.
"""

import math

import pytest
import torch

from support.specs import FORCED_AGGREGATION, run_spec, spec_of
from support.states import assert_resumed_matches
from support.launches import torchrun
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout
from hf_unified_ckpt.format.aggregation import (UNKNOWN, AggregationLayout, aggregate, wants_aggregation,
                                                writers_of)
from hf_unified_ckpt.format.planning import OwnOnly, Strided, TensorSpec, file_plans, plan_component

KINDS = {
    "z3": {"zero": 3},
    "f2": {"fsdp": 2, "overrides": {"ckpt_quant_stage": "O1"}},
    # bf16 with the residual master weights: their ties are pieces only their own rank can place (announced)
    "z3r": {"zero": 3, "plant_ties": 3, "overrides": {"bf16": True}},
    # tied embeddings (lm_head written once, as transformers does) under FSDP2
    "g2": {"model": "gpt2", "fsdp": 2},
    # PEFT: only the adapters (and their moments) are written, each of them in pieces over the 3 ranks
    "lz3": {"model": "lora", "zero": 3},
}
CONFIG = {"z3": "", "f2": "async_save", "z3r": "residual_master_weight", "g2": "", "lz3": ""}
#: The writer process with aggregation forced: z3's run (same model, seed and batches) saved in the background by a
#: writer process per rank, whose `aggregate` gloo group it makes at its first aggregated file's write; compared with
#: z3's files written in place (synchronously: the executors write the same bytes).
PROCESS = {"unified_checkpoint_config": "async_save aggregate", "unified_checkpoint_async_executor": "process"}
#: The file of a kind's model that must be among those aggregated: the tied model's, the adapters'.
WHOLE = {"g2": "model.safetensors", "lz3": "adapter_model.safetensors"}
#: The aggregated runs compared with which in-place run.
AGGREGATED = {**{kind: kind for kind in KINDS}, "z3p": "z3"}


def _runs(tmp):
    out = []
    for kind in KINDS:
        for mode in ("in_place", "aggregate"):
            forced = FORCED_AGGREGATION if mode == "aggregate" else {}
            extra = {"unified_checkpoint_config": f"{CONFIG[kind]} {mode}".strip(), **forced}
            out.append({**spec_of(KINDS, tmp, kind, f"{kind}-{mode}", **extra), "record_aggregation": True})
    out.append({**spec_of(KINDS, tmp, "z3", "z3p-aggregate", **PROCESS, **FORCED_AGGREGATION),
                "record_aggregation": True})
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aggregation")
    torchrun(3, _runs(tmp), tmp)
    return tmp


def _tensor_files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


def _recorded(tmp, tag):
    return [torch.load(tmp / f"{tag}.pt.aggregation.rank{r}", weights_only=False) for r in range(3)]


@pytest.mark.dist
@pytest.mark.parametrize("kind", list(AGGREGATED))
def test_aggregated_files_are_byte_identical_to_files_written_in_place(launched, kind):
    for step in (3, 6):
        in_place = _tensor_files(launched / f"{AGGREGATED[kind]}-in_place" / f"checkpoint-{step}")
        aggregated = _tensor_files(launched / f"{kind}-aggregate" / f"checkpoint-{step}")
        assert in_place and set(aggregated) == set(in_place)
        assert [n for n in in_place if aggregated[n] != in_place[n]] == []
        assert detect_layout(launched / f"{kind}-aggregate" / f"checkpoint-{step}").complete
    saves = _recorded(launched, f"{kind}-aggregate")
    assert all(len(rank) == 2 for rank in saves)  # both saves went through the aggregating writer on every rank
    files = saves[0][0]["files"]
    assert files and all(s["files"] == files for rank in saves for s in rank)  # the same plan on every rank
    assert WHOLE.get(kind, files[0]) in files
    # every rank aggregates a range, but LoRA's files (3 KiB of adapters, 8 KiB of moments): one range each, rank 0's
    assert sum(bool(rank[0]["cells"]) for rank in saves) == (1 if kind == "lz3" else 3)
    assert all(s["process"] == (kind == "z3p") for rank in saves for s in rank)  # written where it was asked
    assert not any(s["files"] for rank in _recorded(launched, f"{AGGREGATED[kind]}-in_place") for s in rank)


@pytest.mark.dist
@pytest.mark.parametrize("kind", list(AGGREGATED))
def test_a_rank_receives_only_what_it_writes_and_its_buffers_stay_within_the_configured_memory(launched, kind):
    saves = _recorded(launched, f"{kind}-aggregate")
    for rank in saves:
        for save in rank:
            written = sum(b - a for _, a, b in save["cells"])
            assert save["received"] <= written  # nobody receives bytes it does not write
            assert (0 < save["peak"] <= save["buffer"]) if save["cells"] else save["peak"] == 0
    for step in range(2):  # what the ranks sent is what the aggregators received
        assert sum(r[step]["sent"] for r in saves) == sum(r[step]["received"] for r in saves) > 0


#: A resume at another world size and engine (1 rank, no DeepSpeed) against the 3-rank ZeRO-3 run left running:
#: the gradients are reduced in another order, which moves losses and weights by about 1e-7
#: (measured here: 1e-7 relative on losses, 1e-8 on weights); allowed 1e-5, far below the 6e-3 the weights move in
#: the 3 steps after the checkpoint.
LOSS_RTOL = STATE_ATOL = 1e-5


@pytest.fixture(scope="module")
def resumed_at_one(launched):
    """z3's checkpoint-3 written in place and aggregated, each resumed on 1 rank (this process) to step 6."""
    return {mode: run_spec({"model": "llama", "output_dir": str(launched / f"z3-{mode}-at1"),
                            "resume": str(launched / f"z3-{mode}" / "checkpoint-3"),
                            "overrides": {"save_steps": 100}}, 1) for mode in ("in_place", "aggregate")}


@pytest.mark.dist
def test_a_resume_at_another_world_size_from_aggregated_files_is_the_resume_from_files_written_in_place(
        launched, resumed_at_one):
    aggregated, in_place = resumed_at_one["aggregate"], resumed_at_one["in_place"]
    assert aggregated["resumed_from"] == str(launched / "z3-aggregate" / "checkpoint-3")
    assert aggregated["global_step"] == in_place["global_step"] == 6
    assert_resumed_matches(aggregated, in_place, (4, 5, 6), exact=True, loss_rtol=0, state_atol=0)
    assert set(aggregated["optim"]) == set(in_place["optim"]) and aggregated["optim"]
    assert all(torch.equal(v, in_place["optim"][k]) for k, v in aggregated["optim"].items())
    left_running = torch.load(launched / "z3-in_place.pt", weights_only=False)  # 3 ranks, ZeRO-3, steps 1-6
    assert_resumed_matches(aggregated, left_running, (4, 5, 6), exact=False, loss_rtol=LOSS_RTOL,
                           state_atol=STATE_ATOL)


def _plan(world, shapes, pieces_as_tuples=False):
    specs = [TensorSpec(f"t{i}", s, torch.float32 if i % 3 else torch.bfloat16) for i, s in enumerate(shapes)]
    plan = plan_component("model", specs, world, 10**9)
    pieces = {s.name: Strided(math.prod(s.shape), -(-math.prod(s.shape) // world)) for s in specs
              if math.prod(s.shape) >= 5}
    return file_plans(plan, {n: tuple(p) for n, p in pieces.items()} if pieces_as_tuples else pieces)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("listed", [False, True], ids=["closed-form", "listed"])
def test_the_plan_tiles_every_file_and_every_byte_goes_from_its_holder_to_its_aggregator_once(world, listed):
    layout = AggregationLayout(world, 1, 4096, 8192, 3, 4096)
    for file in _plan(world, [(7, 13), (1000, 3), (4,), (3, 3000), (17,), (2, 2)], listed):
        agg = aggregate(file, layout, 0)
        assert len(agg.aggregators) <= 3 and agg.aggregators[0] == file.header_rank
        end = 0
        for a, b, _ in agg.cells:
            assert a == end and a % 4096 == 0 and b > a
            covered = a
            for h in agg.holders(a, b):
                assert h.start == covered
                covered = h.end
            assert covered == b
            end = b
        assert end == file.size
        key = lambda h: (h.sender, h.receiver, h.start)  # noqa: E731
        sent = sorted((h for r in range(world) for h in agg.sent_by(r)), key=key)
        assert sent == sorted((h for r in range(world) for h in agg.received_by(r)), key=key)
        assert all(h.sender != h.receiver for h in sent)


def test_auto_aggregates_files_with_more_writers_than_allowed_or_small_pieces_from_several_machines():
    many = _plan(16, [(4096, 64)])[0]
    assert writers_of(many) == 16
    one_machine = AggregationLayout(16, 16, 4096, 2**28, 8, 2**28)
    assert wants_aggregation(many, one_machine, "auto")  # 16 writers > 8
    assert not wants_aggregation(many, one_machine, "never")
    few = _plan(4, [(4096, 64)])[0]
    assert not wants_aggregation(few, AggregationLayout(4, 4, 4096, 2**28, 8, 2**28), "auto")  # one machine
    assert wants_aggregation(few, AggregationLayout(4, 2, 4096, 2**28, 8, 2**28), "auto")  # two: 256 KiB pieces
    assert wants_aggregation(few, AggregationLayout(4, 4, 4096, 2**28, 8, 2**28), "always")


def test_aggregators_are_spread_machine_by_machine_and_numbered_back():
    """A file's aggregators are numbered in one pass (`spread_from`), the same as index by index (`spread`): machine
    0's first rank, machine 1's first rank, ..., wrapping over the world; `index_of` is its inverse (ranks that do
    not divide into machines evenly count one per machine)."""
    for world, local in ((16, 4), (13, 8), (1, 1), (4096, 8)):
        layout = AggregationLayout(world, local, 4096, 2**28, 8, 2**28)
        run = layout.spread_from(world - 3, world + 5)
        assert run == [layout.spread(world - 3 + k) for k in range(world + 5)]
        assert sorted(layout.spread_from(0, world)) == list(range(world))
        assert all(layout.index_of(layout.spread(i)) == i for i in range(world))
    assert AggregationLayout(16, 4, 4096, 2**28, 8, 2**28).spread_from(0, 5) == [0, 4, 8, 12, 1]


@pytest.mark.parametrize("world", [3, 64, 4096])
def test_bucket_cells_are_parts_of_at_least_the_smallest_part_but_the_last(world):
    """For an object store every cell is one part: none under the store's smallest part (5 MiB) but the file's
    last, none over the part size asked unless a range needs it to keep its parts large enough, parts numbered in
    offset order; the transfers still tile each cell."""
    layout = AggregationLayout(world, 8 if world % 8 == 0 else 1, 4096, 2**28, 8, 2**28)
    mib = 2**20
    for file in _plan(world, [(4096, 1537), (10, 4099), (7,), (1000, 2000)]):
        agg = aggregate(file, layout, 0, min_range=5 * mib, cell_bytes=16 * mib)
        parts = agg.parts
        assert [p.number for p in parts] == list(range(1, len(parts) + 1))
        assert all(p.end - p.start >= 5 * mib for p in parts[:-1]) and parts[-1].end == file.size
        assert all(p.end - p.start <= 2 * 16 * mib for p in parts)
        for p in parts[:3]:
            held = sum(h.end - h.start for h in agg.holders(p.start, p.end))
            assert held == p.end - p.start
        assert agg.hand_over_bytes == sum(h.end - h.start for r in range(world) for h in agg.sent_by(r)) \
            if world <= 64 else agg.hand_over_bytes > 0


def test_pieces_only_their_rank_can_place_are_announced_to_the_aggregator_that_expects_exactly_them():
    """Residual ties: each rank's plan knows only its own piece (`OwnOnly`); a rank announces what it holds of
    other ranks' cells, and each aggregator's own plan expects, per cell, exactly the bytes the others announce."""
    world, counts = 4, [300, 0, 517, 1201]
    total = sum(counts)
    specs = [TensorSpec("w", (64, 96), torch.float32), TensorSpec("ties", (total,), torch.int64)]
    plan = plan_component("master", specs, world, 10**9)
    layout = AggregationLayout(world, 1, 4096, 8192, 3, 4096)
    base = Strided(total, -(-total // world))

    def file_of(rank):
        pieces = {"w": Strided(64 * 96, -(-64 * 96 // world)),
                  "ties": OwnOnly(rank, sum(counts[:rank]), counts[rank], base)}
        return file_plans(plan, pieces)[0]

    plans = [aggregate(file_of(r), layout, 0) for r in range(world)]
    assert plans[0].cells == plans[3].cells and len(set(plans[0].aggregators)) > 1
    for a, b, owner in plans[0].cells:
        expected = plans[owner].unknown_bytes(a, b)
        announced = sum(min(b, h.end) - max(a, h.start) for r in range(world) for h in plans[r].announced_by(r)
                        if h.receiver == owner and h.start < b and h.end > a)
        assert expected == announced
        known = sum(h.end - h.start for h in plans[owner].holders(a, b) if h.sender != UNKNOWN)
        assert known + expected == b - a
    head = len(plans[0].file.header_bytes)
    a, b = next((head + start, head + end) for name, start, end, *_ in plans[0].file.layout if name == "ties")
    for r in range(world):  # the ties never travel as known hand-overs, always announced
        assert not [h for h in plans[r].sent_by(r) if h.start < b and h.end > a]
        assert all(a <= h.start < h.end <= b for h in plans[r].announced_by(r))
    assert sum(h.end - h.start for r in range(world) for h in plans[r].announced_by(r)) > 0
