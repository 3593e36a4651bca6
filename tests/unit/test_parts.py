"""Multipart plans (`format.parts`): which rank uploads which part of a shared file in an object store. Pure."""

import random

import pytest

from hf_unified_ckpt.format.parts import MAX_PARTS, HandOver, Part, Run, merged_runs, plan_parts

MIB = 2**20


def _check(runs, plan, min_part, part_size):
    """The invariants every plan keeps: parts tile the file in order, every part but the last is at least
    `min_part` and at most `part_size` where cut from a long span, and the hand-overs are exactly the bytes of
    each part its uploader does not hold."""
    size = max(r.end for r in runs)
    assert [p.number for p in plan.parts] == list(range(1, len(plan.parts) + 1))
    assert plan.parts[0].start == 0 and plan.parts[-1].end == size
    assert all(a.end == b.start for a, b in zip(plan.parts, plan.parts[1:]))
    assert all(p.end - p.start >= min_part for p in plan.parts[:-1])
    def held(rank, start, end):  # bytes of [start, end) that `rank` holds
        return sum(max(0, min(end, r.end) - max(start, r.start)) for r in runs if r.rank == rank)

    for part in plan.parts:
        foreign = (part.end - part.start) - held(part.uploader, part.start, part.end)
        handed = [h for h in plan.hand_overs if part.start <= h.start < part.end]
        assert all(h.receiver == part.uploader and h.end <= part.end for h in handed)
        assert sum(h.end - h.start for h in handed) == foreign
    assert all(held(h.sender, h.start, h.end) == h.end - h.start and h.sender != h.receiver for h in plan.hand_overs)
    # what a rank's hand-over transfers ask of the plan: its sends and its receives, each in offset order
    for rank in {r.rank for r in runs}:
        for mine, side in ((plan.sent_by(rank), "sender"), (plan.received_by(rank), "receiver")):
            assert mine == sorted((h for h in plan.hand_overs if getattr(h, side) == rank), key=lambda h: h.start)


def test_big_runs_are_uploaded_by_their_own_rank_in_parts_of_about_part_size():
    runs = [Run(0, 64, 0), Run(64, 64 + 40 * MIB, 0), Run(64 + 40 * MIB, 64 + 52 * MIB, 1)]
    plan = plan_parts(runs, 5 * MIB, 16 * MIB)
    assert [(p.uploader, round((p.end - p.start) / MIB, 1)) for p in plan.parts] == \
        [(0, 13.3), (0, 13.3), (0, 13.3), (1, 12.0)]
    assert plan.hand_overs == () and plan.hand_over_bytes == 0
    _check(runs, plan, 5 * MIB, 16 * MIB)


def test_small_runs_join_a_neighbour_and_are_handed_over():
    # header (rank 0), a small tensor of rank 1, rank 0's big piece, rank 1's big piece, two small ones at the end
    runs = [Run(0, 4096, 0), Run(4096, 8192, 1), Run(8192, 8192 + 6 * MIB, 0),
            Run(8192 + 6 * MIB, 8192 + 12 * MIB, 1), Run(8192 + 12 * MIB, 12288 + 12 * MIB, 0),
            Run(12288 + 12 * MIB, 16384 + 12 * MIB, 1)]
    plan = plan_parts(runs, 5 * MIB, 16 * MIB)
    assert [p.uploader for p in plan.parts] == [0, 1]
    # the leading small runs join rank 0's big run after them; the trailing ones join rank 1's part before them
    assert plan.hand_overs == (HandOver(4096, 8192, 1, 0), HandOver(8192 + 12 * MIB, 12288 + 12 * MIB, 0, 1))
    assert plan.hand_over_bytes == 8192
    _check(runs, plan, 5 * MIB, 16 * MIB)


def test_a_file_smaller_than_a_part_is_one_part_from_the_rank_holding_most():
    runs = [Run(0, 100, 0), Run(100, 1000, 1), Run(1000, 1300, 0)]
    plan = plan_parts(runs, 5 * MIB, 16 * MIB)
    assert plan.parts == (Part(1, 0, 1300, 1),)
    assert plan.hand_over_bytes == 400 and plan.sent_by(0) and not plan.sent_by(1)
    assert plan.uploaded_by(1) == list(plan.parts) and plan.uploaded_by(0) == []


def test_small_runs_that_reach_a_part_together_make_their_own():
    runs = [Run(i * 3 * MIB, (i + 1) * 3 * MIB, i % 2) for i in range(4)]  # 3 MiB each, alternating ranks
    plan = plan_parts(runs, 5 * MIB, 16 * MIB)
    assert len(plan.parts) == 1 and plan.parts[0].uploader == 0 and plan.hand_over_bytes == 6 * MIB
    _check(runs, plan, 5 * MIB, 16 * MIB)


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_keep_every_invariant(seed):
    rng = random.Random(seed)
    runs, at = [], 0
    for _ in range(rng.randrange(1, 30)):
        length = rng.choice([rng.randrange(1, 64) * 4096, rng.randrange(1, 40) * MIB // 2])
        runs.append(Run(at, at + length, rng.randrange(3)))
        at += length
    plan = plan_parts(runs, 5 * MIB, 12 * MIB)
    _check(merged_runs(runs), plan, 5 * MIB, 12 * MIB)
    assert all(p.end - p.start <= 12 * MIB for p in plan.parts)


def test_bad_runs_and_too_many_parts_are_refused():
    with pytest.raises(ValueError, match=r"bytes \[10, 20\) uncovered"):
        plan_parts([Run(0, 10, 0), Run(20, 30, 1)], 5, 10)
    with pytest.raises(ValueError, match=r"covered twice"):
        plan_parts([Run(0, 10, 0), Run(5, 30, 1)], 5, 10)
    with pytest.raises(ValueError, match="below twice the store's smallest part"):
        plan_parts([Run(0, 10, 0)], 5, 9)
    with pytest.raises(ValueError, match=f"more than the {MAX_PARTS}"):
        plan_parts([Run(0, (MAX_PARTS + 1) * 10, 0)], 5, 10)
