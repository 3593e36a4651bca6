"""Which machine holds which file (placement.py): the union rule, its errors, and who verifies what. Pure logic
on real folders; the multi-process behaviour is in test_multi_machine.py."""

import json
import shutil

import pytest
import torch

from support.trainers import train
from hf_unified_ckpt.checkpoint.folder.layout import DEEPSPEED, UNIFIED
from hf_unified_ckpt.checkpoint.load.placement import Placement, Sighting, judge
from hf_unified_ckpt.checkpoint.folder.manifest import MANIFEST_NAME, read_manifest


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    run = tmp_path_factory.mktemp("placement")
    train(run, max_steps=3, save_steps=3, unified_checkpoint_max_shard_size="40KB")
    return run / "checkpoint-3"


def _split(ckpt, tmp_path):
    """Two 'machines': each copy keeps the small files and alternate tensor files."""
    manifest = read_manifest(ckpt)
    shards = sorted(f for c in manifest["components"].values() for f in c["files"])
    copies = []
    for k in range(2):
        copy = tmp_path / f"m{k}" / "checkpoint-3"
        shutil.copytree(ckpt, copy)
        for name in shards[1 - k::2]:
            (copy / name).unlink()
        copies.append(copy)
    return copies, shards


def _judge(*folders):
    """judge() as the ranks see `folders` (None: no folder), with the lowest unified rank's manifest."""
    seen = [Sighting.of(f) if f is not None else (None, None) for f in folders]
    manifest = next((m for _, m in seen if m is not None), None)
    return judge([s for s, _ in seen], manifest)


def test_union_of_two_folders_is_complete_and_names_the_holders(ckpt, tmp_path):
    (a, b), shards = _split(ckpt, tmp_path)
    verdict = _judge(a, a, b)  # ranks 0 and 1 share machine 0
    assert verdict.kind == UNIFIED and verdict.complete, verdict.reason
    assert verdict.holders[shards[0]] == (0, 1) and verdict.holders[shards[1]] == (2,)
    assert verdict.holders[MANIFEST_NAME] == (0, 1, 2)
    placement = Placement(verdict.holders, rank=2, world_size=3)
    assert not placement.everywhere and placement.source(shards[0]) in (0, 1) and placement.source(shards[1]) == 2


def test_union_missing_a_file_names_it(ckpt, tmp_path):
    (a, b), shards = _split(ckpt, tmp_path)
    (b / shards[1]).unlink()
    verdict = _judge(a, None)  # the second machine has no folder at all
    assert not verdict.complete and verdict.missing == tuple(sorted(shards[1::2]))
    assert "missing from every machine's folder" in verdict.reason and shards[1] in verdict.reason


def test_a_truncated_copy_does_not_count(ckpt, tmp_path):
    (a, b), shards = _split(ckpt, tmp_path)
    (b / shards[1]).write_bytes((b / shards[1]).read_bytes()[:-10])
    verdict = _judge(a, b)
    assert not verdict.complete and shards[1] in verdict.missing


def test_a_truncated_copy_is_named_with_its_sizes(ckpt, tmp_path):
    (a, b), shards = _split(ckpt, tmp_path)
    expected = (b / shards[1]).stat().st_size
    (b / shards[1]).write_bytes((b / shards[1]).read_bytes()[:-10])
    verdict = _judge(a, b)
    assert f"{shards[1]} ({expected - 10} bytes on disk, expected {expected})" in verdict.reason
    assert "machine" in verdict.refusal(b) and not verdict.problems


@pytest.mark.parametrize("ranks", [1, 2])  # one process, or two ranks sharing one folder
def test_one_folder_with_a_truncated_file_says_what_verify_says(ckpt, tmp_path, ranks):
    folder = tmp_path / "checkpoint-3"
    shutil.copytree(ckpt, folder)
    name = sorted(f for c in read_manifest(folder)["components"].values() for f in c["files"])[0]
    expected = (folder / name).stat().st_size
    (folder / name).write_bytes((folder / name).read_bytes()[:-10])
    verdict = _judge(*[folder] * ranks)
    line = f"{name}: {expected - 10} bytes on disk, expected {expected} (truncated or overwritten)"
    assert not verdict.complete and verdict.problems == (line,) and line in verdict.reason
    assert line in verdict.refusal(folder) and "machine" not in verdict.refusal(folder)
    assert "machine" not in verdict.reason


def test_folders_from_different_saves_are_refused(ckpt, tmp_path):
    (a, b), _ = _split(ckpt, tmp_path)
    other = read_manifest(b)
    other["files"]["trainer_state.json"]["size"] += 1
    (b / MANIFEST_NAME).write_text(json.dumps(other))
    verdict = _judge(a, b)
    assert not verdict.complete and "different saves" in verdict.reason


def test_legacy_folder_must_be_seen_by_every_machine(tmp_path):
    folder = tmp_path / "checkpoint-3"
    (folder / "global_step3").mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (folder / "global_step3" / name).write_bytes(b"x")
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    assert _judge(folder, folder).complete
    partial = _judge(folder, None)
    assert partial.kind == DEEPSPEED and not partial.complete and "visible to every machine" in partial.reason


def test_each_file_is_verified_once_by_a_holder_with_balanced_bytes():
    holders = {"a": (0, 1), "b": (0, 1), "c": (2,), "d": (0, 1, 2)}
    sizes = {"a": 100, "b": 90, "c": 80, "d": 5}
    shares = Placement(holders, rank=0, world_size=3).verification_shares(sizes)
    assert sorted(n for share in shares.values() for n in share) == ["a", "b", "c", "d"]
    assert all(r in holders[n] for r, share in shares.items() for n in share)
    assert shares[0] == ["a"] and shares[1] == ["b"] and shares[2] == ["c", "d"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_file_server_replies_carry_exact_slices_headers_and_files(tmp_path, dtype):
    from safetensors.torch import save_file

    from hf_unified_ckpt.checkpoint.load.file_service import RemoteSlice, answer, tensor_from

    tensors = {"w": torch.arange(7 * 5).reshape(7, 5).to(dtype), "s": torch.tensor(3, dtype=dtype)}
    save_file(tensors, tmp_path / "f.safetensors")
    handles = {}
    for name, index, expected in (("w", [[2, 5]], tensors["w"][2:5]), ("w", [[1, 3], [0, 2]], tensors["w"][1:3, 0:2]),
                                  ("w", None, tensors["w"]), ("s", None, tensors["s"]), ("w", [[4, 4]], tensors["w"][4:4])):
        got = tensor_from(*answer(tmp_path, handles, {"op": "tensor", "file": "f.safetensors", "name": name,
                                                       "index": index}))
        assert got.dtype == dtype and torch.equal(got, expected), (name, index)
    reply, data = answer(tmp_path, handles, {"op": "header", "file": "f.safetensors"})
    assert json.loads(bytes(data.numpy()))["w"]["shape"] == [7, 5]
    reply, data = answer(tmp_path, handles, {"op": "file", "file": "f.safetensors"})
    assert bytes(data.numpy()) == (tmp_path / "f.safetensors").read_bytes()

    class Service:  # RemoteSlice turns Python slicing into the [start, stop) bounds sent to the server
        def header(self, file):
            return {"w": {"shape": [7, 5]}}

        def read_tensor(self, file, name, bounds):
            return bounds

    assert RemoteSlice(Service(), "f", "w")[2:] == [[2, 7]]
    assert RemoteSlice(Service(), "f", "w")[1:3, :2] == [[1, 3], [0, 2]]
    with pytest.raises(TypeError, match="step-1"):
        RemoteSlice(Service(), "f", "w")[::2]
