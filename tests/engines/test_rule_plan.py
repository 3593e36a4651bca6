"""Save metadata linear in the ranks (issue 57), at 4 real ranks (gloo, CPU; the tiny Llama, whose widths 30, 46, 10
split unevenly over 4: ZeRO-3 tails of 6 of 8 elements, FSDP2 rows 3, 3, 3, 1 of k_proj's 10, ZeRO-1/2 parameters
across partitions):

- under ZeRO-1/2, ZeRO-3 and FSDP2, the partition rule's pieces of every sharded tensor are exactly what every rank
  holds (one more gather, outside the count), the first save plans from the rule without gathering anything
  (no object collective at all on success), and the second save reuses the cached plan (one all-reduce of the
  rule's check, no census);
- an engine whose pieces are not the rule it declares (DeepSpeed's rule shifted by one element) is seen at the
  first save: both saves take the census, said once (the launch's log), and the files are the rule's, CRC for CRC,
  plain (the weights) and O1 (the moments, whose halos go point to point with the rule);
- `record_tree`'s rows and the bench's model of them agree (`bench_scale_sim.subtree_rows`), byte for byte, at
  every step of the reduction, with what the ranks really received.

One launch of four runs, two saves each: ZeRO-3 runs with O1 moments (its weights are plain), so one run checks
the rule, the cache, the halos and the bench's rows, and one broken run both fallbacks.
"""

import sys

import pytest
import torch

from support.paths import ROOT
from support.launches import torchrun

sys.path.insert(0, str(ROOT / "bench"))

O1 = {"ckpt_quant_stage": "O1"}
ENGINES = {"z2": {"zero": 2}, "z3": {"zero": 3, "overrides": O1}, "f2": {"fsdp": 2}}
RANKS = 4
TWO_SAVES = {"max_steps": 2, "save_steps": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rule-plan")
    specs = {name: {**spec, "record_plans": True} for name, spec in ENGINES.items()}
    specs["z3-broken"] = {"zero": 3, "record_plans": True, "break_rule": True, "overrides": O1}
    runs = [{**spec, "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt"),
             "overrides": {**TWO_SAVES, **spec.get("overrides", {})}} for name, spec in specs.items()]
    launch = torchrun(RANKS, runs, tmp)
    out = {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in specs}
    return tmp, out, launch.stdout + launch.stderr


@pytest.mark.dist
@pytest.mark.parametrize("engine", list(ENGINES))
def test_rule_pieces_are_held_and_the_second_save_reuses_the_plan(runs, engine):
    _, out, _ = runs
    first, second = out[engine]["saves"]
    assert (first["plan"], second["plan"]) == ("rule", "cached")
    for save in (first, second):
        assert save["rule_equals_held"] and save["compared"] > 0
        assert not [c for c in save["calls"] if c[0] == "all_gather_object"], save["calls"]  # no census, no gather
    assert first["uneven"] > 0  # tails and rows that do not split evenly over 4 ranks
    assert [c[:2] for c in second["calls"] if c[1] == "agree"] == [("all_reduce_ints", "agree")]


@pytest.mark.dist
def test_an_engine_off_its_rule_takes_the_census_said_once_and_writes_the_same_bytes(runs):
    """The census of an engine off its rule and the rule of the same engine write the same files, CRC for CRC: the
    weights (plain) and the moments through O1 (the halos that complete a block, here from up to three ranks whose
    pieces are smaller than a block, went point to point in one and with the census in the other)."""
    tmp, out, log = runs
    engine = "z3"
    saves = out[f"{engine}-broken"]["saves"]
    assert [s["plan"] for s in saves] == ["census", "census"]
    assert [s["plan"] for s in out[engine]["saves"]] == ["rule", "cached"]
    assert all(any(c[:2] == ("all_gather_object", "census_of_pieces") for c in s["calls"]) for s in saves)
    assert log.count("the pieces some rank holds are not the partition rule's") == 1
    from hf_unified_ckpt.checkpoint.folder.manifest import read_manifest

    for step in ("checkpoint-1", "checkpoint-2"):
        ruled, censused = (read_manifest(tmp / name / step)["files"] for name in (engine, f"{engine}-broken"))
        tensors = {n for n in ruled if n.endswith(".safetensors")}
        assert tensors and tensors == {n for n in censused if n.endswith(".safetensors")}
        assert {"model", "optimizer"} <= {n.split("-")[0].split(".")[0] for n in tensors}, tensors
        assert {n: ruled[n] for n in tensors} == {n: censused[n] for n in tensors}


@pytest.mark.dist
@pytest.mark.parametrize("engine", ["z3", "f2"])
def test_the_bench_counts_what_the_ranks_receive(runs, engine):
    """The bench's rows of a block of ranks (`subtree_rows`, from the plan's closed forms) have the bytes the real
    ranks received at each step of `record_tree`, and every rank's plan-time traffic is the bench's (one
    all-reduce of four integers; no halo without a codec, halos point to point only with O1: ZeRO-3's run)."""
    from bench_scale_sim import messages
    from hf_unified_ckpt.checkpoint.save.record_tree import halving_steps

    tmp, out, _ = runs
    halos = []
    for rank in range(RANKS):
        for save in torch.load(tmp / f"{engine}.pt.rank{rank}", weights_only=False):
            files = save["files"]
            swaps = [b for kind, caller, b in save["calls"] if caller == "_swap" and kind == "recv_bytes"]
            model = messages(lambda: files, RANKS, rank)
            expected = [8 + len(model["_swap"](step[0], {})) for step in halving_steps(rank, RANKS, len(files))[0]]
            assert swaps == expected, (rank, swaps, expected)
            plan_calls = [c for c in save["calls"] if c[1] in ("agree", "exchange_halos")]
            assert plan_calls[0] == ("all_reduce_ints", "agree", 64)
            halos += [c[0] for c in plan_calls[1:]]
    assert set(halos) == ({"exchange_tensors"} if engine == "z3" else set()), halos


def test_owners_are_the_least_loaded_writer_in_f_log_n():
    """Largest file first to the least-loaded writer, ties to the lowest rank, as the linear scan does, but without
    walking the N writers per file (16,384 ranks x thousands of files): a million writers take no time."""
    import random
    import time

    from hf_unified_ckpt.format.planning import assign_owners

    def scan(sizes, writers):
        load, owners = [0] * writers, {}
        for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
            rank = min(range(writers), key=lambda r: (load[r], r))
            owners[name], load[rank] = rank, load[rank] + size
        return owners

    rng = random.Random(57)
    for _ in range(200):
        sizes = {f"f{i}": rng.choice([0, 1, 5, rng.randrange(100)]) for i in range(rng.randrange(1, 40))}
        writers = rng.randrange(1, 12)
        assert assign_owners(sizes, writers) == scan(sizes, writers)
    started = time.process_time()
    owners = assign_owners({f"f{i}": 10**9 - i for i in range(3000)}, 10**6)
    assert time.process_time() - started < 1.0 and sorted(owners.values()) == list(range(3000))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8, 12, 1024])
def test_the_halving_leaves_every_file_to_exactly_one_rank(world):
    """`record_tree`'s reduce-scatter: partners agree on the files they split, and at the end every file is held by
    exactly one rank (ranks above the largest power of two hold none)."""
    from hf_unified_ckpt.checkpoint.save.record_tree import halving_steps

    files = 37
    held = [0] * files
    for rank in range(world):
        steps, (lo, hi) = halving_steps(rank, world, files)
        for partner, k0, k1, s0, s1 in steps:
            theirs = next(s for s in halving_steps(partner, world, files)[0] if s[0] == rank)
            assert (theirs[1], theirs[2], theirs[3], theirs[4]) == (s0, s1, k0, k1)
        for f in range(lo, hi):
            held[f] += 1
    assert held == [1] * files


def test_halos_from_many_ranks_are_one_halo_per_tensor_in_element_order():
    """A block whose elements five ranks hold (pieces smaller than a block): the halos of two tensors from each,
    received one message per rank, are one halo per tensor, source after source (stacked where the layouts are
    the same, sliced where they differ: the last rank's partial piece, a rank that holds one tensor only)."""
    from hf_unified_ckpt.checkpoint.save.rule_plan import _by_tensor

    wanted = {q: [("optimizer", ("a",), 10 + 3 * (q - 1), 3), ("optimizer", ("b",), 20 + 2 * (q - 1), 2)]
              for q in (1, 2, 3)}
    wanted[4] = [("optimizer", ("a",), 19, 1)]
    wanted[6] = [("optimizer", ("b",), 26, 2)]  # not next to rank 3 in this list: a run of its own
    wanted[9] = [("optimizer", ("c", "d"), 40, 2)]  # two tensors split alike: c's 2 elements, then d's
    wanted[10] = [("optimizer", ("c", "d"), 42, 2)]
    received = {q: torch.arange(sum(len(a) * k for _, a, _, k in parts), dtype=torch.float32) + 100 * q
                for q, parts in wanted.items()}
    got = {key: sorted((start, t.tolist()) for start, t in chunks) for key, chunks in _by_tensor(wanted, received).items()}
    expected_a = [100, 101, 102, 200, 201, 202, 300, 301, 302, 400]
    expected_b = [103, 104, 203, 204, 303, 304, 600, 601]
    assert [x for _, part in got[("optimizer", "a")] for x in part] == expected_a
    assert [x for _, part in got[("optimizer", "b")] for x in part] == expected_b
    assert got[("optimizer", "a")][0][0] == 10 and got[("optimizer", "b")][0][0] == 20
    assert [x for _, part in got[("optimizer", "c")] for x in part] == [900, 901, 1000, 1001]
    assert [x for _, part in got[("optimizer", "d")] for x in part] == [902, 903, 1002, 1003]


def test_a_later_residual_save_with_as_many_ties_keeps_the_headers_and_lays_out_this_saves_ties():
    """A cached plan's residual files at a later save whose tensors have as many ties (`FilePlan.with_pieces`): the
    same headers, and this rank's items, writes and pieces those of files planned afresh for its new offsets."""
    from hf_unified_ckpt.format.codecs import ResidualCodec
    from hf_unified_ckpt.format.planning import Strided, TensorSpec, file_plans, plan_component, stored_pieces

    specs = [TensorSpec(f"w{i}", (13, 7 + i), torch.float32) for i in range(5)]
    pieces = {s.name: Strided(13 * s.shape[1], 20) for s in specs}

    def planned(offset: int, mine: int):
        codec = ResidualCodec({s.name: 9 for s in specs}, by_rank={s.name: {2: mine} for s in specs})
        codec.own_offset = {s.name: (2, offset) for s in specs}
        return plan_component("master", specs, 4, 400, codec=codec)

    cached, later = file_plans(planned(1, 3), pieces), planned(4, 2)
    kept = [f.with_pieces(later.codec, stored_pieces(later, pieces)) for f in cached]
    fresh = file_plans(later, pieces)
    assert len(fresh) == 5
    for f, k, c in zip(fresh, kept, cached):
        assert k.header_bytes == f.header_bytes == c.header_bytes
        assert k.items_of(2) == f.items_of(2) != c.items_of(2)
        assert (k.writes(2), k.pieces_held(2), k.codec) == (f.writes(2), f.pieces_held(2), later.codec)


def test_a_rank_plans_only_the_aggregated_files_it_has_a_part_in():
    """At 16,384 ranks under ZeRO-1/2 a rank holds bytes of a few files and aggregates a few ranges:
    `AggregationPlans` numbers every file's aggregators from its data size alone and plans a file only when it is
    asked for; `has_part` says without planning exactly which ranks hold its bytes or aggregate one of its ranges
    (8 ranks per machine, and one rank per machine where the ranks do not divide evenly)."""
    from hf_unified_ckpt.format.aggregation import AggregationLayout, AggregationPlans, aggregate, range_count
    from hf_unified_ckpt.format.planning import Strided, TensorSpec, file_plans, plan_component

    for world, local in ((64, 8), (13, 8)):
        specs = [TensorSpec(f"w{i}", (40 + i, 33), torch.float32) for i in range(12)]
        # each tensor held by a few consecutive ranks, the higher ranks holding none: parts in a few files only
        pieces = {s.name: Strided(s.shape[0] * 33, 97 * (1 + i % 3)) for i, s in enumerate(specs)}
        files = file_plans(plan_component("optimizer", specs, world, 4 * 40 * 33 * 2), pieces)
        layout = AggregationLayout(world, local, 4096, 4096, 3, 4096)
        plans, index = AggregationPlans(layout), 0
        for file in files:
            index += plans.add(file, index)
        assert index == sum(range_count(f, layout) for f in files) and len(files) > 3
        parts = {(f.name, r): plans.has_part(f.name, r) for f in files for r in range(world)}
        assert plans.planned == frozenset()  # asked, not planned
        first, made = 0, {}
        for file in files:
            made[file.name] = aggregate(file, layout, first)
            first += range_count(file, layout)
            for r in range(world):
                assert parts[file.name, r] == (file.writes(r) or r in made[file.name].aggregators), (file.name, r)
        # a rank with a part in some files but not all (the high ranks aggregate a range here and there)
        probe = next(r for r in range(world - 1, -1, -1) if 0 < sum(parts[f.name, r] for f in files) < len(files))
        mine = frozenset(f.name for f in files if parts[f.name, probe])
        assert all(plans[name] == made[name] for name in mine)
        assert plans.planned == mine
