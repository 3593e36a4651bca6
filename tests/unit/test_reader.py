"""The declared read side (`storage.reader`): every reader is a `TensorReader` giving the same values for the same
tensor (local files, files served by another machine, legacy tensors computed on demand), and a codec sits between
the stored tensors and what engines see."""

import pytest
import torch
from safetensors.torch import save_file

from support.loopback import Loopback
from hf_unified_ckpt.errors import CorruptCheckpointError
from hf_unified_ckpt.checkpoint.load.file_service import FileService, RemoteSlice
from hf_unified_ckpt.legacy.sources import TensorSource
from hf_unified_ckpt.format.reader import FileHandle, FileOpener, LoadedSlice, TensorReader, TensorSlice
from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader, LocalFiles, write_index

A = torch.arange(40, dtype=torch.float32).reshape(8, 5)
B = torch.tensor(7, dtype=torch.int64)


@pytest.fixture
def folder(tmp_path):
    """A two-file `model` component with an index."""
    save_file({"a": A}, str(tmp_path / "model-1.safetensors"), metadata={"format": "pt"})
    save_file({"b": B}, str(tmp_path / "model-2.safetensors"), metadata={"format": "pt"})
    write_index(tmp_path, "model", {"a": "model-1.safetensors", "b": "model-2.safetensors"}, A.nbytes + B.nbytes)
    return tmp_path


def test_every_reader_is_a_tensor_reader_with_the_same_values(folder):
    remote = Loopback(folder)
    legacy = TensorSource({"a": ((8, 5), torch.float32, lambda: A.clone()), "b": ((), torch.int64, lambda: B)},
                          {"total_size": A.nbytes + B.nbytes})
    readers = {"local": ComponentReader(folder, "model"), "remote": ComponentReader(folder, "model", remote),
               "legacy": legacy}
    for kind, reader in readers.items():
        with reader:
            assert isinstance(reader, TensorReader), kind
            assert reader.keys() == ["a", "b"] and "a" in reader and "c" not in reader, kind
            assert reader.specs() == {"a": ((8, 5), "F32"), "b": ((), "I64")}, kind
            assert reader.metadata["total_size"] == A.nbytes + B.nbytes, kind
            assert torch.equal(reader.get("a"), A) and torch.equal(reader.get("b"), B), kind
            assert isinstance(reader.get_slice("a"), TensorSlice), kind
            assert torch.equal(reader.get_slice("a")[3:5], A[3:5]), kind
            assert torch.equal(reader.get_slice("a")[1:4, 2:5], A[1:4, 2:5]), kind
            with pytest.raises(KeyError, match="'c' is not in"):
                reader.get("c")
    assert remote.asked == [("a", None), ("b", None), ("a", [[3, 5]]), ("a", [[1, 4], [2, 5]])]  # only those rows


def test_file_openers_and_handles_are_declared(folder):
    assert isinstance(LocalFiles(folder), FileOpener) and issubclass(FileService, FileOpener)
    assert isinstance(LocalFiles(folder).open("model-1.safetensors"), FileHandle)
    assert isinstance(Loopback(folder).open("model-1.safetensors"), FileHandle)
    assert issubclass(RemoteSlice, TensorSlice) and issubclass(LoadedSlice, TensorSlice)


def test_an_index_naming_a_tensor_its_file_lacks_is_corrupt(folder):
    write_index(folder, "model", {"a": "model-1.safetensors", "b": "model-1.safetensors"}, 0)
    with pytest.raises(CorruptCheckpointError, match="puts 'b' in model-1.safetensors, whose header does not list"):
        ComponentReader(folder, "model").specs()


class HalfCodes:
    """A fake codec: a float tensor `<name>` is stored as int8 `<name>.codes` and a per-row `<name>.scale`."""

    def logical_specs(self, stored_specs, metadata):
        out = {}
        for name, (shape, dtype) in stored_specs.items():
            if name.endswith(".codes"):
                out[name.removesuffix(".codes")] = (shape, metadata["logical_dtype"])
            elif not self.hidden(name):
                out[name] = (shape, dtype)
        return out

    def decode(self, name, reader):
        return reader.get(f"{name}.codes").to(torch.float32) * reader.get(f"{name}.scale")

    def hidden(self, name):
        return name.endswith((".codes", ".scale"))

    def problems(self, stored_specs):
        return []  # nothing checked of its stored tensors


@pytest.mark.parametrize("served", [False, True], ids=["local", "remote"])
def test_a_codec_shows_engines_logical_tensors_only(tmp_path, served):
    codes = torch.tensor([[1, -2, 3], [4, 5, -6], [7, 8, 9], [0, 1, 2]], dtype=torch.int8)
    scale = torch.tensor([[0.5], [0.25], [2.0], [1.0]])
    stored = {"x/exp_avg.codes": codes, "x/exp_avg.scale": scale, "x/step": torch.tensor(3.0), "w": A}
    save_file(stored, str(tmp_path / "optimizer.safetensors"), metadata={"format": "pt"})
    write_index(tmp_path, "optimizer", dict.fromkeys(stored, "optimizer.safetensors"), 0, {"logical_dtype": "F32"})
    decoded = codes.to(torch.float32) * scale
    with ComponentReader(tmp_path, "optimizer", Loopback(tmp_path) if served else None, HalfCodes()) as reader:
        assert isinstance(reader, TensorReader)
        assert reader.specs() == {"w": ((8, 5), "F32"), "x/exp_avg": ((4, 3), "F32"), "x/step": ((), "F32")}
        assert sorted(reader.keys()) == ["w", "x/exp_avg", "x/step"] and "x/exp_avg.scale" not in reader
        assert torch.equal(reader.get("x/exp_avg"), decoded)
        assert torch.equal(reader.get_slice("x/exp_avg")[1:3], decoded[1:3])
        assert torch.equal(reader.get("x/step"), torch.tensor(3.0))
        assert not isinstance(reader.get_slice("w"), LoadedSlice)  # stored as it is seen: still read lazily
        assert torch.equal(reader.get_slice("w")[2:4], A[2:4])
        for auxiliary in ("x/exp_avg.codes", "x/exp_avg.scale"):
            with pytest.raises(KeyError, match=f"{auxiliary!r} is not in the optimizer files of"):
                reader.get(auxiliary)
