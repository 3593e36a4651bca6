"""The pure layer and the on-disk format: golden index/manifest layout, planning, optimizer flattening."""

import json
import math

import pytest
import torch
from torch import nn

from hf_unified_ckpt.engines.replicated import ReplicatedEngine
from hf_unified_ckpt.format.names import canonical_name, split_optimizer_key
from hf_unified_ckpt.format.optim_state import flatten_optimizer_state, unflatten_optimizer_state
from hf_unified_ckpt.options import UnifiedCheckpointOptions
from hf_unified_ckpt.format.planning import TensorSpec, plan_component
from hf_unified_ckpt.checkpoint.save.saving import SaveRequest, save_checkpoint
from hf_unified_ckpt.checkpoint.folder.safetensors_io import read_safetensors_header


def _fixed_model_and_optimizer():
    """Two linear layers with arange weights and one AdamW step on fixed gradients: deterministic bytes."""
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / (10 + i))
            p.grad = torch.full_like(p, 0.5 - i)
    opt.step()
    return model, opt


@pytest.fixture
def golden_checkpoint(tmp_path):
    model, opt = _fixed_model_and_optimizer()
    final = tmp_path / "checkpoint-7"
    options = UnifiedCheckpointOptions(enabled=True, max_shard_size=200)
    save_checkpoint(ReplicatedEngine(model, opt), SaveRequest(final, 7, options, show_progress=False), {})
    return final


def test_golden_model_index(golden_checkpoint):
    index = json.loads((golden_checkpoint / "model.safetensors.index.json").read_text())
    assert index == {
        "metadata": {"total_size": 264},
        "weight_map": {"0.bias": "model-00001-of-00002.safetensors", "0.weight": "model-00001-of-00002.safetensors",
                       "1.bias": "model-00002-of-00002.safetensors", "1.weight": "model-00002-of-00002.safetensors"},
    }


def test_golden_optimizer_index(golden_checkpoint):
    index = json.loads((golden_checkpoint / "optimizer.safetensors.index.json").read_text())
    assert index["metadata"] == {
        "total_size": 544,
        "state_types": {},
        "param_groups": [{
            "amsgrad": False, "betas": {"__tuple__": [0.9, 0.999]}, "capturable": False,
            "decoupled_weight_decay": True, "differentiable": False, "eps": 1e-08, "foreach": None, "fused": None,
            "lr": 0.1, "maximize": False, "weight_decay": 0.01,
            "params": ["0.weight", "0.bias", "1.weight", "1.bias"],
        }],
    }
    assert sorted(index["weight_map"]) == sorted(f"{p}/{s}" for p in ("0.weight", "0.bias", "1.weight", "1.bias")
                                                 for s in ("exp_avg", "exp_avg_sq", "step"))
    assert set(index["weight_map"].values()) == {f"optimizer-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}


def test_golden_manifest(golden_checkpoint):
    manifest = json.loads((golden_checkpoint / "unified_checkpoint.json").read_text())
    files = manifest.pop("files")
    assert manifest == {
        "format": "hf-unified-checkpoint", "format_version": 1, "checksum_algorithm": "crc32",
        "library": {"name": "hf_unified_ckpt", "version": "0.1.0"}, "global_step": 7,
        "saved_by": {"engine": "single", "world_size": 1, "zero_stage": None, "fsdp_version": None,
                     "param_dtypes": ["float32"], "master_weights": False},
        "options": {"ckpt_quant_stage": "O0", "skip_save_model_weight": False, "remove_master_weight": False,
                    "residual_master_weight": False, "async_save": False, "ema": False},
        "components": {
            "model": {"file_stem": "model", "index": "model.safetensors.index.json", "tensors": 4, "bytes": 264,
                      "files": ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]},
            "optimizer": {"file_stem": "optimizer", "index": "optimizer.safetensors.index.json", "tensors": 12,
                          "bytes": 544, "files": [f"optimizer-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]},
        },
    }
    assert sorted(files) == sorted(p.name for p in golden_checkpoint.iterdir() if p.name != "unified_checkpoint.json")
    assert files["model-00001-of-00002.safetensors"] == {"size": 336, "crc32": "f6dc1623"}
    assert all(set(rec) == {"size", "crc32"} and len(rec["crc32"]) == 8 for rec in files.values())


def test_golden_safetensors_header(golden_checkpoint):
    header = read_safetensors_header(golden_checkpoint / "model-00001-of-00002.safetensors")
    assert header == {
        "__metadata__": {"format": "pt"},
        "0.bias": {"dtype": "F32", "shape": [7], "data_offsets": [0, 28]},
        "0.weight": {"dtype": "F32", "shape": [7, 5], "data_offsets": [28, 168]},
    }


def test_saving_twice_gives_identical_bytes(tmp_path, golden_checkpoint):
    model, opt = _fixed_model_and_optimizer()
    again = tmp_path / "again" / "checkpoint-7"
    save_checkpoint(ReplicatedEngine(model, opt),
                    SaveRequest(again, 7, UnifiedCheckpointOptions(enabled=True, max_shard_size=200), show_progress=False),
                    {})
    assert (again / "unified_checkpoint.json").read_bytes() == (golden_checkpoint / "unified_checkpoint.json").read_bytes()


@pytest.mark.parametrize("name,expected", [
    ("module.model.layers.0.weight", "model.layers.0.weight"),
    ("module._orig_mod.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
    ("lm_head.weight", "lm_head.weight"),
])
def test_canonical_name(name, expected):
    assert canonical_name(name) == expected


def test_optimizer_key_split():
    assert split_optimizer_key("model.layers.0.mlp.up_proj.weight/exp_avg") == ("model.layers.0.mlp.up_proj.weight", "exp_avg")
    with pytest.raises(ValueError, match="not of the form"):
        split_optimizer_key("no_slash")


def test_plan_spreads_files_over_writers_and_never_splits_a_tensor():
    specs = [TensorSpec(f"t{i}", (100 + i,), torch.float32) for i in range(10)] + [TensorSpec("big", (5000,), torch.float32)]
    plan = plan_component("optimizer", specs, writers=3, max_shard_size=2000, min_parallel=1)
    names = [n for f in plan.files.values() for n in f]
    assert sorted(names) == sorted(s.name for s in specs)  # each tensor exactly once
    sizes = {f: sum(plan.specs[n].nbytes for n in ns) for f, ns in plan.files.items()}
    assert all(size <= 2000 or len(plan.files[f]) == 1 for f, size in sizes.items())
    assert set(plan.owners.values()) == {0, 1, 2}
    assert plan.weight_map["big"] in plan.files and len(plan.files[plan.weight_map["big"]]) == 1


def test_plan_keeps_small_states_in_one_file():
    plan = plan_component("model", [TensorSpec("a", (10,), torch.float32)], writers=4, max_shard_size=10**9)
    assert list(plan.files) == ["model.safetensors"] and not plan.is_sharded


class _Stored:
    """What a reader of the optimizer component gives: keys, tensors, the index metadata (through JSON)."""

    def __init__(self, tensors, meta):
        self.keys, self.get, self.metadata = lambda: list(tensors), tensors.__getitem__, json.loads(json.dumps(meta))


def _roundtrip(opt, names):
    tensors, meta = flatten_optimizer_state(opt.state_dict(), dict(enumerate(names)))
    groups = [[names[i] for i in g["params"]] for g in opt.state_dict()["param_groups"]]
    return unflatten_optimizer_state(_Stored(tensors, meta), groups, opt.param_groups)


def _assert_state_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert type(v) is type(w), k
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1),  # momentum 0: momentum_buffer is None
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    lambda ps: __import__("transformers").Adafactor(ps, lr=0.01, relative_step=False, scale_parameter=False),
    lambda ps: torch.optim.Adafactor(ps, lr=0.01),  # factored second moments (row_var, col_var)
    lambda ps: torch.optim.Adamax(ps, lr=0.01),
    lambda ps: torch.optim.NAdam(ps, lr=0.01),  # a 0-d mu_product
    lambda ps: torch.optim.ASGD(ps, lr=0.01),
    lambda ps: torch.optim.AdamW([{"params": ps[:1], "weight_decay": 0.0}, {"params": ps[1:], "lr": 0.5}], lr=0.1),
])
def test_any_torch_optimizer_state_round_trips(make):
    """... and fits its parameters by the rules a resume and `verify` check (`format.state_shapes`)."""
    from hf_unified_ckpt.format.headers import safetensors_dtype
    from hf_unified_ckpt.format.state_shapes import optimizer_state_problems

    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    opt = make(list(model.parameters()))
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    _assert_state_equal(_roundtrip(opt, names), opt.state_dict())
    tensors, meta = flatten_optimizer_state(opt.state_dict(), dict(enumerate(names)))
    specs = {k: (tuple(t.shape), safetensors_dtype(t.dtype)) for k, t in tensors.items()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert optimizer_state_problems(specs, shapes.get, meta["state_types"]) == []


def test_state_rules_refuse_what_an_optimizer_cannot_hold():
    """A moment is its parameter's shape exactly, a factored second moment a factored shape, both floating point; a
    step count is 0-d; a state name not known is not judged; master weights and EMA are their weight's shape; a
    residual's ties and bf16 weights are as its codec metadata lists them."""
    from hf_unified_ckpt.format.state_shapes import (codec_metadata_problems, codec_stored_problems,
                                                     optimizer_state_problems, parameter_state_problems)

    shapes = {"w": (4, 6), "b": (6,)}
    specs = {"w/exp_avg": ((4,), "F32"), "w/exp_avg_sq": ((6, 4), "F32"), "b/exp_avg": ((6,), "I32"),
             "w/step": ((1,), "F32"), "w/row_var": ((4, 1), "F32"), "b/step": ((), "I64"), "w/eta": ((), "F32"),
             "w/exp_inf": ((), "F32"), "x/exp_avg": ((9,), "F32"), "b/count": ((6,), "F32"),
             "w/col_var": ((4, 6), "F32"), "w/state1": ((4, 6), "U8"), "w/absmax1": ((1,), "F32")}
    found = dict(optimizer_state_problems(specs, shapes.get, {"b/count": "int"}))
    assert sorted(found) == ["b/count", "b/exp_avg", "w/col_var", "w/exp_avg", "w/exp_avg_sq", "w/exp_inf",
                             "w/step"], found
    assert found["w/exp_avg_sq"] == "has shape [6, 4], expected [4, 6] (its parameter's shape)"
    assert found["b/exp_avg"].startswith("is I32, expected a floating-point dtype")
    assert parameter_state_problems({"w": ((24,), "F32"), "b": ((6,), "I16")}, shapes) == [
        ("w", "has shape [24], expected [4, 6] (its weight's shape)"), ("b", "is I16, expected F32 (fp32 values of "
                                                                            "the weight)")]
    residual = {"name": "bf16_residual", "version": 1, "anchor": "model",
                "tensors": {"w": {"shape": [4, 6], "ties": 2}, "b": {"shape": [6], "ties": 0}}}
    stored = {"w": ((4, 6), "I16"), "w:ties": ((3,), "I64"), "b": ((6,), "I16")}
    anchor = {"w": ((4, 6), "BF16"), "b": ((6,), "F16")}
    assert codec_stored_problems(residual, stored, anchor) == [
        ("w:ties", "is I64 [3], expected I64 [2] (its ties, per the codec metadata)"),
        ("b", "is F16 [6], expected BF16 [6] (its bf16 model weight, per the codec metadata)")]
    residual["tensors"]["b"]["ties"] = 7
    assert codec_metadata_problems(residual) == ["tensors['b'] lists 7 ties in 6 elements"]


def test_hparams_with_tensors_and_non_finite_values_round_trip():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["custom_tensor"] = torch.tensor([1.5, 2.5])
    opt.param_groups[0]["max_norm"] = math.inf
    out = _roundtrip(opt, ["w"])
    assert torch.equal(out["param_groups"][0]["custom_tensor"], torch.tensor([1.5, 2.5]))
    assert out["param_groups"][0]["max_norm"] == math.inf


def test_mismatched_param_groups_name_the_parameters():
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    tensors, meta = flatten_optimizer_state(opt.state_dict(), dict(enumerate(["a", "b", "c", "d"])))
    with pytest.raises(ValueError, match=r"\['e'\]"):
        unflatten_optimizer_state(_Stored(tensors, meta), [["a", "b", "c", "e"]], opt.param_groups)


def test_empty_param_groups_match_on_either_side():
    """DeepSpeed drops empty groups (a LoRA model's no-weight-decay group); DDP and FSDP keep them: non-empty groups
    match in order, an empty current group keeps its own hyper-parameters."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    saved = torch.optim.AdamW([{"params": list(model.parameters()), "lr": 0.3}], lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    saved.step()
    names = ["a", "b", "c", "d"]
    tensors, meta = flatten_optimizer_state(saved.state_dict(), dict(enumerate(names)))
    current = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [], "weight_decay": 0.0}], lr=0.1)
    out = unflatten_optimizer_state(_Stored(tensors, meta), [names, []], current.param_groups)
    assert out["param_groups"][0]["lr"] == 0.3 and out["param_groups"][1]["params"] == []
    assert out["param_groups"][1]["weight_decay"] == 0.0 and out["param_groups"][1]["lr"] == 0.1
    current.load_state_dict(out)
    assert torch.equal(current.state[next(model.parameters())]["exp_avg"], saved.state[next(model.parameters())]["exp_avg"])


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 1 << 16])
def test_crc32_combine_matches_zlib(n):
    """ISA-L's compiled combine and the Python one (where python-isal is missing) agree with zlib over A + B."""
    import os
    import zlib

    from hf_unified_ckpt.format.checksum import crc32_combine, crc32_combine_py

    a, b = os.urandom(333), os.urandom(n)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine_py(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_the_checksum_is_zlibs_crc32():
    """Files are checked with ISA-L's CRC-32 when python-isal is installed (it is, with the package): the same
    values as zlib's, for bytes, a tensor's memory and a mapped range, from any starting value."""
    import os
    import zlib

    from hf_unified_ckpt.format.checksum import crc32

    data = os.urandom(1 << 20)
    tensor = memoryview(torch.randn(333).numpy()).cast("B")
    for buf, start in ((b"", 0), (data, 0), (memoryview(data)[5:70001], 12345), (tensor, 7)):
        assert crc32(buf, start) == zlib.crc32(buf, start)
    assert crc32.__module__ == "isal.isal_zlib"


def test_whole_files_go_through_the_same_direct_writers_or_the_page_cache_where_refused(tmp_path, monkeypatch):
    """`LocalStore.write_whole(direct_io=True)` (machine-local folders, the persister, save_model): the writers of
    `write_at_direct` over a new file, ranges consumed one at a time, sizes that are no multiple of any block, each
    range's CRC-32; page-aligned memory (a mapped memory checkpoint) written straight from where it lies; ranges
    that do not tile the file refused; a filesystem that refuses O_DIRECT (the probe) written through the page
    cache, no O_DIRECT open tried; `direct_io=False` never opens with O_DIRECT."""
    import errno
    import mmap
    import os
    import zlib

    from hf_unified_ckpt.store import direct
    from hf_unified_ckpt.store.local import LocalStore

    store, data = LocalStore(), os.urandom(3 * 2**20 + 77)
    bounds = ((0, 13), (13, 9000), (9000, 2**20 + 1), (2**20 + 1, len(data)))
    ranges = [(a, memoryview(data)[a:b]) for a, b in bounds]
    expected = [(a, b - a, zlib.crc32(data[a:b])) for a, b in bounds]
    assert store.write_whole(str(tmp_path / "f"), iter(ranges), len(data), direct_io=True) == expected
    assert (tmp_path / "f").read_bytes() == data
    with pytest.raises(ValueError, match="starts at byte 9000, expected 13"):
        store.write_whole(str(tmp_path / "gap"), ranges[:1] + ranges[2:], len(data), direct_io=True)
    with pytest.raises(ValueError, match="the file is"):
        store.write_whole(str(tmp_path / "short"), ranges, len(data) + 1, direct_io=True)

    straight, real_straight = [], direct._ChunkWriters._straight
    monkeypatch.setattr(direct._ChunkWriters, "_straight",
                        lambda self, o, p: real_straight(self, o, p) and not straight.append(o))
    (tmp_path / "source").write_bytes(data)
    with open(tmp_path / "source", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        chunks = [(a, view[a:a + 2**20]) for a in range(0, len(data), 2**20)]
        assert direct.write_whole_direct(tmp_path / "mapped", iter(chunks), len(data), chunk=2**20) == [
            (a, len(v), zlib.crc32(v)) for a, v in chunks]
        del chunks
        view.release()
    assert (tmp_path / "mapped").read_bytes() == data and sorted(straight) == [0, 2**20, 2 * 2**20]  # by 4 threads
    monkeypatch.undo()

    real_open, opened_direct = os.open, []

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            opened_direct.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs answers on some kernels
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    assert store.write_whole(str(tmp_path / "buffered"), iter(ranges), len(data), direct_io=False) == expected
    assert not opened_direct
    monkeypatch.setattr(direct, "_support", {})
    assert store.write_whole(str(tmp_path / "refused"), iter(ranges), len(data), direct_io=True) == expected
    assert len(opened_direct) == 1 and "direct_probe" in str(opened_direct[0])  # the probe only
    assert (tmp_path / "refused").read_bytes() == data == (tmp_path / "buffered").read_bytes()


def test_direct_writes_of_ranks_pieces_tile_a_shared_file_with_their_edges_buffered(tmp_path):
    """`write_at_direct` (the save's path to a local disk): two writers' interleaved runs of ranges, of random
    lengths at random offsets (edges sharing a block with the other writer's bytes, runs under and over
    `SMALL_RUN`, chunks of one block up to the default), written one writer after the other into one file grown to
    its size by the first: the file holds every byte, each range's record is its offset, length and CRC-32; the
    aligned blocks really went through direct writes (counted), the small runs and the edges did not."""
    import os
    import zlib

    import numpy as np

    from hf_unified_ckpt.store import direct

    assert direct.direct_io_works(tmp_path)
    rng = np.random.default_rng(0)
    direct_writes = []
    real_write = direct._ChunkWriters._write
    direct._ChunkWriters._write = lambda self, o, n, p: direct_writes.append(n) or real_write(self, o, n, p)
    try:
        for trial in range(12):
            size = int(rng.integers(1, 20_000_000))
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            cuts = sorted({0, size} | {int(x) for x in rng.integers(0, size, int(rng.integers(0, 12)))})
            runs = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
            path = tmp_path / f"f{trial}"
            for writer in range(2):
                ranges = []
                for a, b in runs[writer::2]:
                    step = max(1, (b - a) // int(rng.integers(1, 4)))  # a run of one to three ranges
                    ranges += [(o, memoryview(data)[o:min(o + step, b)]) for o in range(a, b, step)]
                chunk = int(rng.choice([4096, 4096 * 3, 2**20, direct.CHUNK]))
                records = direct.write_at_direct(path, iter(ranges), size if writer == 0 else None, chunk=chunk)
                assert records == [(o, len(v), zlib.crc32(v)) for o, v in ranges]
            assert path.read_bytes() == data, trial
            os.unlink(path)
    finally:
        direct._ChunkWriters._write = real_write
    assert direct_writes and all(n % 4096 == 0 for n in direct_writes)
    small = tmp_path / "small"
    assert direct.write_at_direct(small, [(0, memoryview(b"x" * 5000))], 5000) == [(0, 5000, zlib.crc32(b"x" * 5000))]
    assert small.read_bytes() == b"x" * 5000


def test_memory_laid_out_as_the_file_is_written_straight_from_it(tmp_path, monkeypatch):
    """A host buffer that starts as far into a page as its bytes do in the file (`device_copy.paged_buffer`, as the
    snapshot's buffers made ahead are) goes to disk without a copy: every whole chunk of it alone straight from it
    (the first chunk, which holds the header too, through a writer's buffer); the same bytes one byte off go
    through the writers' buffers."""
    import zlib

    import torch

    from hf_unified_ckpt.checkpoint.save.device_copy import paged_buffer
    from hf_unified_ckpt.store import direct

    copied = []
    real = direct._ChunkWriters._through_buffer
    monkeypatch.setattr(direct._ChunkWriters, "_through_buffer",
                        lambda self, o, n, p: copied.append(o) or real(self, o, n, p))
    head, n = b"h" * 1000, 3 * 2**20 + 4096 * 5  # data from byte 1000 of the file: four chunks of 1 MiB
    for phase, expect_copies in ((1000, [0]), (1001, [0, 2**20, 2 * 2**20, 3 * 2**20])):  # the first has the header
        buffer = paged_buffer((n,), torch.uint8, phase)
        buffer.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        data = memoryview(buffer.numpy())
        copied.clear()
        path = tmp_path / f"f{phase}"
        records = direct.write_at_direct(path, [(0, memoryview(head)), (1000, data)], 1000 + n, chunk=2**20)
        assert records[1] == (1000, n, zlib.crc32(data)) and path.read_bytes() == head + bytes(data)
        assert copied == expect_copies, (phase, copied)


def test_a_ranges_checksum_is_joined_from_its_parts_each_read_once_where_it_is_written(tmp_path, monkeypatch):
    """The tensors' memory is read once: a range's CRC-32 is joined from its parts' (no checksum is taken over more
    than one chunk), each part's taken by the writer thread that copies or writes it (the edges, through the page
    cache, by the caller); the joined records are zlib's over each range."""
    import threading
    import zlib

    from hf_unified_ckpt.store import direct

    taken = []
    real = direct.crc32
    monkeypatch.setattr(direct, "crc32", lambda data, *a: taken.append((threading.current_thread().name,
                                                                       len(data))) or real(data, *a))
    data = torch.randint(0, 256, (5 * 2**20 + 333,), dtype=torch.uint8)
    views = [memoryview(data[:777].numpy()), memoryview(data[777:].numpy())]
    ranges = [(0, views[0]), (777, views[1])]
    records = direct.write_at_direct(tmp_path / "f", iter(ranges), len(data), chunk=2**20)
    assert records == [(0, 777, zlib.crc32(views[0])), (777, len(views[1]), zlib.crc32(views[1]))]
    assert (tmp_path / "f").read_bytes() == bytes(data.numpy())
    assert max(n for _, n in taken) <= 2**20 and sum(n for _, n in taken) == len(data)
    by_writers = sum(n for name, n in taken if name.startswith("hf_unified_ckpt-direct"))
    assert by_writers >= 5 * 2**20 - 4096  # all but the edges


def test_straight_writes_learn_the_memory_alignment_the_kernel_asks_for(tmp_path, monkeypatch):
    """Memory that sits as the file does is written straight from it wherever the kernel takes its alignment (its
    `dma_alignment`: 4 bytes on many NVMe drives, 512 on virtio disks, not a whole page); a refusal (EINVAL) raises the
    alignment tried, so a file's chunks are refused once, not each: here a kernel that asks for 4 KiB, with memory
    512 bytes into a page and 64 bytes into one. The bytes and records are right either way."""
    import errno
    import fcntl
    import os
    import zlib

    from hf_unified_ckpt.checkpoint.save.device_copy import paged_buffer
    from hf_unified_ckpt.store import direct

    refused, copied = [], []
    real, real_copy = direct.pwrite_all, direct._ChunkWriters._through_buffer

    def page_aligned_only(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and direct._address(data) % 4096:
            refused.append(direct._address(data) % 4096)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct, "pwrite_all", page_aligned_only)
    monkeypatch.setattr(direct._ChunkWriters, "_through_buffer",
                        lambda self, o, n, p: copied.append(o) or real_copy(self, o, n, p))
    head, n = b"h" * 1000, 6 * 2**20
    for into_page in (512, 64, 0):
        buffer = paged_buffer((n,), torch.uint8, (1000 + into_page) % 4096)  # chunks start `into_page` into a page
        buffer.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        data = memoryview(buffer.numpy())
        refused.clear(), copied.clear()
        path = tmp_path / f"f{into_page}"
        records = direct.write_at_direct(path, [(0, memoryview(head)), (1000, data)], 1000 + n, chunk=2**20)
        assert records[1] == (1000, n, zlib.crc32(data)) and path.read_bytes() == head + bytes(data)
        assert refused == ([into_page] if into_page else []), into_page  # one refusal a file, at most
        # six chunks: the first (the header's too) through a buffer; the others straight where the kernel took them
        assert len(copied) == (1 if not into_page else 6), (into_page, copied)


def test_memory_as_aligned_as_the_disk_asks_is_written_straight_on_this_kernel(tmp_path):
    """On this machine's kernel and disk: memory sitting as the file does, 512 bytes into a page (a sector, not a
    page), written with direct I/O gives the file's bytes and records (straight where the disk's `dma_alignment`
    takes it, else through the writers' buffers)."""
    import zlib

    from hf_unified_ckpt.checkpoint.save.device_copy import paged_buffer
    from hf_unified_ckpt.store import direct

    head, n = b"h" * 1000, 3 * 2**20 + 123
    buffer = paged_buffer((n,), torch.uint8, 1512)
    buffer.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    data = memoryview(buffer.numpy())
    records = direct.write_at_direct(tmp_path / "f", [(0, memoryview(head)), (1000, data)], 1000 + n, chunk=2**20)
    assert records == [(0, 1000, zlib.crc32(head)), (1000, n, zlib.crc32(data))]
    assert (tmp_path / "f").read_bytes() == head + bytes(data)


def test_a_failed_direct_write_is_raised_after_every_write_ended(tmp_path, monkeypatch):
    """A write that fails in a writer thread (ENOSPC) is raised by `write_at_direct`, once no write is in flight."""
    import errno
    import os

    from hf_unified_ckpt.store import direct

    real = direct.pwrite_all
    calls = []

    def full(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(direct, "pwrite_all", full)
    data = os.urandom(6 * 2**20 + 123)
    with pytest.raises(OSError, match="No space"):
        direct.write_at_direct(tmp_path / "f", [(0, memoryview(data))], len(data), chunk=2**20, writers=2)
    assert len(calls) >= 3


def test_small_files_are_written_while_the_tensors_are_and_a_failure_waits_for_the_writes(tmp_path):
    """`PersistJob.run` writes the small files while its writer thread writes the tensor files, adds their records
    after the tensors'; when the small files fail (their store's `put`), the error is raised only once every tensor
    write and fsync has finished (the failed save then removes a staging folder nothing writes into any more)."""
    import contextlib
    import threading
    import time

    from support.faulty_store import fail_with, injected, no_space, on

    import hf_unified_ckpt.checkpoint.save.persist as persist

    class SlowWriter:  # a StorageWriter whose every file takes 0.2 s to write, and whose fsyncs are tracked
        def __init__(self):
            self.finished, self.synced = [], None

        def assemble(self, engine, file):
            pass

        def writes(self, file, rank):
            return True

        def local_tensors(self, engine, file):
            return {}

        def write(self, folder, file, tensors):
            time.sleep(0.2)
            self.finished.append(file)
            return [f"record of {file}"]

        @contextlib.contextmanager
        def syncing(self):  # as SharedFileWriter's: waits for the fsyncs however the block ends
            try:
                yield
            finally:
                self.synced = len(self.finished)

    writer, seen, small = SlowWriter(), {}, {"rng_state_0.pth": b"rng"}

    def first_small_file(call):
        seen.setdefault("writes done", list(writer.finished))
        seen.setdefault("thread", threading.current_thread())
        return call.proceed()

    with injected(on("put", lambda call: True, first_small_file)):
        records = persist.PersistJob(str(tmp_path), writer, [(f, {}) for f in ["a", "b"]], small).run()
    assert records[:2] == ["record of a", "record of b"] and [r.name for r in records[2:]] == ["rng_state_0.pth"]
    assert seen["writes done"] == [] and seen["thread"] is threading.main_thread()  # overlapped, not after

    writer = SlowWriter()
    with injected(on("put", lambda call: True, fail_with(no_space))), pytest.raises(OSError, match="No space left"):
        persist.PersistJob(str(tmp_path), writer, [(f, {}) for f in ["a", "b", "c"]], small).run()
    assert writer.finished == ["a", "b", "c"] and writer.synced == 3  # all written before the fsync wait ended


def test_write_shard_checksum_equals_reading_the_file(tmp_path):
    from hf_unified_ckpt.checkpoint.folder.files import file_crc32
    from hf_unified_ckpt.checkpoint.folder.safetensors_io import write_shard

    flat = torch.arange(40, dtype=torch.float32)
    tensors = {"b": flat[:12].view(3, 4), "a": torch.randn(5).to(torch.bfloat16), "c": torch.tensor(2.0, dtype=torch.float64),
               "d": flat[12:], "step": torch.tensor(3.0), "step2": None, "e": torch.zeros(0)}
    tensors["step2"] = tensors["step"]  # one scalar under two names: written as two copies
    record = write_shard(tmp_path / "x.safetensors", tensors)
    assert record.crc32 == file_crc32(tmp_path / "x.safetensors")
    assert record.size == (tmp_path / "x.safetensors").stat().st_size


def test_file_plan_is_the_file_save_file_writes(tmp_path):
    """The planner fixes every file's header and byte ranges before any byte is written; the whole-file writer's
    output has exactly that header, and the write items tile the data section."""
    from hf_unified_ckpt.format.planning import file_plans
    from hf_unified_ckpt.checkpoint.folder.safetensors_header import read_safetensors_header
    from hf_unified_ckpt.checkpoint.write.writer import WholeFileWriter

    tensors = {"w": torch.randn(5, 3), "b": torch.randn(7, dtype=torch.float64),
               "h": torch.zeros(3, dtype=torch.bfloat16), "m/step": torch.tensor(4), "flag": torch.tensor(True)}
    plan = plan_component("optimizer", [TensorSpec.of(n, t) for n, t in tensors.items()], writers=3,
                          max_shard_size=60, owners={"w": 2})
    files = file_plans(plan)
    assert [f.name for f in files] == list(plan.files) and {f.header_rank for f in files} <= {0, 1, 2}
    for file in files:
        assert file.writers <= {file.header_rank} and list(file.tensor_names) == plan.files[file.name]
        ranges = sorted((i.start, i.end) for i in file.items)
        assert [s for s, _ in ranges] == [0] + [e for _, e in ranges[:-1]] and file.data_bytes == sum(
            plan.specs[n].nbytes for n in file.tensor_names)
        WholeFileWriter().write(tmp_path, file, {n: tensors[n] for n in file.tensor_names})
        assert read_safetensors_header(tmp_path / file.name) == file.header
    assert files[[f.name for f in files].index(plan.weight_map["w"])].header_rank == 2


def test_a_whole_file_written_with_direct_io_is_the_file_save_file_writes(tmp_path, monkeypatch):
    """`WholeFileWriter(direct_io=True)` (machine-local folders, save_model under a sharded engine): the bytes and
    CRC-32 of safetensors' `save_file`, its aligned blocks written by the direct writers."""
    from safetensors.torch import save_file

    from hf_unified_ckpt.checkpoint.folder.files import file_crc32
    from hf_unified_ckpt.checkpoint.write.writer import WholeFileWriter
    from hf_unified_ckpt.format.planning import file_plans
    from hf_unified_ckpt.store import direct

    chunks, real = [], direct._ChunkWriters._write
    monkeypatch.setattr(direct._ChunkWriters, "_write", lambda self, o, n, p: chunks.append(n) or real(self, o, n, p))
    tensors = {"w": torch.randn(1001, 333), "v": torch.randn(77_777).to(torch.bfloat16), "s": torch.tensor(3)}
    plan = plan_component("model", [TensorSpec.of(n, t) for n, t in tensors.items()], writers=1,
                          max_shard_size=10**9)
    (file,) = file_plans(plan)
    (record,) = WholeFileWriter(direct_io=True).write(tmp_path, file, tensors)
    save_file(tensors, tmp_path / "native.safetensors", metadata={"format": "pt"})
    assert (tmp_path / file.name).read_bytes() == (tmp_path / "native.safetensors").read_bytes()
    assert record.crc32 == file_crc32(tmp_path / file.name) and sum(chunks) > 1_000_000


def test_ranks_writing_their_pieces_in_place_make_the_file_save_file_writes(tmp_path):
    """Three ranks write their own ranges of shared files in place (uneven pieces, an empty one, a tensor no rank
    holds in pieces written whole by the header rank, bf16 beside fp32): every file is byte for byte what
    safetensors' `save_file` writes, and the CRC-32 combined from the ranks' range records is the file's."""
    from safetensors.torch import save_file

    from hf_unified_ckpt.format.planning import file_plans, tiling
    from hf_unified_ckpt.checkpoint.folder.files import file_crc32
    from hf_unified_ckpt.checkpoint.folder.files import combine_ranges
    from hf_unified_ckpt.checkpoint.write.writer import write_ranges

    tensors = {"w": torch.randn(7, 3), "v": torch.randn(11).to(torch.bfloat16), "b": torch.randn(5),
               "m/step": torch.tensor(4.0)}
    bounds = {"w": [(0, 0, 9), (1, 9, 0), (2, 9, 12)], "v": [(2, 0, 4), (0, 4, 7)], "b": [(1, 0, 5)]}
    pieces = {n: tiling(tensors[n].numel(), b) for n, b in bounds.items()}
    assert pieces["w"] == ((0, 0, 9), (2, 9, 12)) and pieces["v"] == ((2, 0, 4), (0, 4, 7))
    plan = plan_component("optimizer", [TensorSpec.of(n, t) for n, t in tensors.items()], writers=3,
                          max_shard_size=80)
    records = []
    for file in file_plans(plan, pieces):
        assert set(file.whole_names) == {"m/step"} & set(file.tensor_names)
        for rank in sorted(file.writers):
            mine = {n: tensors[n].reshape(-1)[first:first + count] for n, held in file.pieces.items()
                    for r, first, count in held if r == rank}
            if rank == file.header_rank:
                mine.update({n: tensors[n] for n in file.whole_names})
            records += write_ranges(tmp_path / file.name, file, rank, mine)
        save_file({n: tensors[n] for n in file.tensor_names}, str(tmp_path / "ref.safetensors"),
                  metadata={"format": "pt"})
        assert (tmp_path / file.name).read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    combined = combine_ranges({f.name: f.size for f in file_plans(plan, pieces)}, records)
    assert len(combined) == len(plan.files) >= 2
    for record in combined:
        assert record.crc32 == file_crc32(tmp_path / record.name)
        assert record.size == (tmp_path / record.name).stat().st_size


def test_a_device_tensor_is_written_a_host_slice_at_a_time(tmp_path, monkeypatch):
    """A tensor on a device is copied to the host a slice at a time as the writer asks (`item_ranges`: the copy of
    one slice runs while the one before is written; a host tensor is one range from its own memory). Here the host
    slices of CPU tensors, 7 bytes each, stand in for a device's: the file is byte for byte `save_file`'s, and the
    ranges' records join into the file's CRC-32."""
    import dataclasses

    from safetensors.torch import save_file

    from hf_unified_ckpt.checkpoint.folder.files import combine_ranges, file_crc32
    from hf_unified_ckpt.checkpoint.write import writer
    from hf_unified_ckpt.format.planning import file_plans

    tensors = {"w": torch.randn(7, 3), "v": torch.randn(11).to(torch.bfloat16), "e": torch.empty(0)}
    plan = plan_component("model", [TensorSpec.of(n, t) for n, t in tensors.items()], writers=1,
                          max_shard_size=10**6)
    (file,) = file_plans(plan, {})
    item = next(i for i in file.items_of(0) if i.name == "w")
    assert list(writer.item_ranges(item, tensors["w"], 100)) == [(100, memoryview(tensors["w"].numpy()).cast("B"))]
    slices = list(writer.host_slices(tensors["w"].reshape(-1).view(torch.uint8), 100, 8))  # 84 bytes
    assert [(o, len(v)) for o, v in slices] == [(100 + 8 * k, 8) for k in range(10)] + [(180, 4)]
    assert b"".join(bytes(v) for _, v in slices) == tensors["w"].numpy().tobytes()
    monkeypatch.setattr(writer, "item_ranges", lambda item, tensor, offset: writer.host_slices(
        writer._flat_bytes(item, tensor.detach()), offset, 7))
    records = writer.write_ranges(tmp_path / file.name, file, 0, tensors)
    assert len(records) > len(tensors) + 1  # the header, then several slices a tensor
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / file.name).read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    (combined,) = combine_ranges({file.name: file.size}, records)
    assert combined.crc32 == file_crc32(tmp_path / file.name)
    with pytest.raises(ValueError, match="holds 84 bytes of the 88"):
        list(writer.item_ranges(dataclasses.replace(item, end=item.end + 4), tensors["w"], 0))


def test_pieces_that_do_not_tile_are_assembled_and_bad_ranges_fail_the_save():
    """Overlapping pieces (replicas: HSDP, a tensor-parallel shard held by every data-parallel rank), gaps or a
    short cover are not written in place; range records that leave a hole or write twice fail the save."""
    from hf_unified_ckpt.format.planning import tiling
    from hf_unified_ckpt.checkpoint.folder.files import RangeRecord, combine_ranges

    assert tiling(10, [(0, 0, 5), (1, 0, 5), (2, 5, 5), (3, 5, 5)]) is None  # two replicas of two shards
    assert tiling(10, [(0, 0, 4), (1, 5, 5)]) is None and tiling(10, [(0, 0, 9)]) is None
    assert tiling(0, []) is None and tiling(10, [(1, 0, 10)]) == ((1, 0, 10),)
    with pytest.raises(RuntimeError, match=r"bytes \[4, 6\) unwritten"):
        combine_ranges({"f": 10}, [RangeRecord("f", 0, 4, 0), RangeRecord("f", 6, 4, 0)])
    with pytest.raises(RuntimeError, match="written twice"):
        combine_ranges({"f": 10}, [RangeRecord("f", 0, 6, 0), RangeRecord("f", 4, 6, 0)])
    with pytest.raises(RuntimeError, match="wrote 8 bytes of the 10"):
        combine_ranges({"f": 10}, [RangeRecord("f", 0, 8, 0)])


def test_scheduler_state_follows_the_matched_param_groups():
    """A scheduler saved with DeepSpeed's one group resumes over DDP/FSDP's two (the empty group keeps its own
    values), and back; torch's schedulers refuse per-group lists of another length."""
    from hf_unified_ckpt.format.optim_state import fit_scheduler_state, match_groups

    p = nn.Parameter(torch.ones(2))
    one = torch.optim.AdamW([{"params": [p]}], lr=0.1)
    two = torch.optim.AdamW([{"params": [p]}, {"params": [], "weight_decay": 0.0}], lr=0.1)
    saved = torch.optim.lr_scheduler.LambdaLR(one, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        one.step()
        saved.step()
    fresh = torch.optim.lr_scheduler.LambdaLR(two, lambda s: 1.0 / (s + 1))
    fresh.load_state_dict(fit_scheduler_state(saved.state_dict(), fresh.state_dict(), match_groups([["w"]], [["w"], []])))
    fresh.step()
    saved.step()
    assert fresh.get_last_lr()[0] == saved.get_last_lr()[0] and fresh.get_last_lr()[1] == 0.1 * (1.0 / 5)
    back = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW([p], lr=0.1), lambda s: 1.0 / (s + 1))
    back.load_state_dict(fit_scheduler_state(fresh.state_dict(), back.state_dict(), match_groups([["w"], []], [["w"]])))
    assert back.get_last_lr() == [saved.get_last_lr()[0]]
