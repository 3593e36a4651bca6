"""Reading checkpoint files that live on another machine.

When a checkpoint's files are spread over machine-local folders (`placement.py`), a rank that does not see a
file asks a rank that does: every rank runs a small server thread for the files of its own folder, and the
readers of `checkpoint/folder/safetensors_io.ComponentReader` send it requests for a safetensors header, a slice of one
tensor (only the rows the asking rank needs), or a whole small file: to a reader, `FileService` is the
`format.reader.FileOpener` of every file only another machine holds, and `RemoteFile` its handle. Requests and
replies travel on two gloo groups of their own, so they never interleave with the collectives the training thread
runs meanwhile (FSDP's state-dict load). Each request is answered before the asker sends the next; `close` stops
the servers.
"""

from __future__ import annotations

import json
import logging
import os
import threading

import torch
import torch.distributed as tdist

from ... import dist
from ...errors import CorruptCheckpointError
from .placement import Placement
from ...format.bounded_json import parse_json
from ..folder.safetensors_header import read_safetensors_header
from ..folder.tensor_files import open_tensors
from ...format.reader import FileHandle, FileOpener, TensorSlice
from ...store import as_ref, join, store_for

logger = logging.getLogger(__name__)

_MESSAGE_BYTES = 16384  # fixed size of a request and of a reply's head (JSON, zero-padded)
_TAG = 71


class FileService(FileOpener):
    """This rank's server for its folder, and its client (a `FileOpener`) for files other ranks hold."""

    def __init__(self, folder: str | os.PathLike, placement: Placement):
        """Start the server thread. Collective (the two groups are created on first use): all ranks must call
        it."""
        self.folder = as_ref(folder)
        self.placement = placement
        self._requests = dist.gloo_group("file-service-requests")
        self._replies = dist.gloo_group("file-service-replies")
        self._headers: dict[str, dict] = {}
        self._open: dict[str, object] = {}
        self._server = threading.Thread(target=self._serve, name="hf_unified_ckpt-file-server", daemon=True)
        self._server.start()

    # ---- client -----------------------------------------------------------------------------------------
    def is_local(self, file: str) -> bool:
        return self.placement.is_local(file)

    def exists(self, file: str) -> bool:
        """Whether some rank holds `file`."""
        return bool(self.placement.holders.get(file))

    def header(self, file: str) -> dict:
        if file not in self._headers:
            _, data = self._ask(file, {"op": "header", "file": file})
            self._headers[file] = parse_json(bytes(data.numpy()), f"the header of {file} (served by another rank)")
        return self._headers[file]

    def read_file(self, file: str) -> bytes:
        _, data = self._ask(file, {"op": "file", "file": file})
        return bytes(data.numpy()) if data is not None else b""

    def read_tensor(self, file: str, name: str, index: list[list[int]] | None = None) -> torch.Tensor:
        """Tensor `name` of `file`, or only the part `index` ([start, stop) per leading dimension) of it."""
        return tensor_from(*self._ask(file, {"op": "tensor", "file": file, "name": name, "index": index}))

    def open(self, file: str) -> "RemoteFile":
        return RemoteFile(self, file)

    def _ask(self, file: str, request: dict) -> tuple[dict, torch.Tensor | None]:
        holder = self.placement.source(file)
        tdist.send(_encode(request), dst=holder, group=self._requests, tag=_TAG)
        head = torch.empty(_MESSAGE_BYTES, dtype=torch.uint8)
        tdist.recv(head, src=holder, group=self._replies, tag=_TAG)
        reply = _decode(head)
        if not reply["ok"]:
            raise CorruptCheckpointError(f"rank {holder} could not read {file!r} of its folder {reply['folder']} "
                                         f"for rank {dist.rank()}: {reply['error']}")
        if not reply["nbytes"]:
            return reply, None
        data = torch.empty(reply["nbytes"], dtype=torch.uint8)
        tdist.recv(data, src=holder, group=self._replies, tag=_TAG)
        return reply, data

    # ---- server -----------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            buffer = torch.empty(_MESSAGE_BYTES, dtype=torch.uint8)
            asker = tdist.recv(buffer, src=None, group=self._requests, tag=_TAG)
            request = _decode(buffer)
            if request["op"] == "stop":
                return
            try:
                reply, data = answer(self.folder, self._open, request)
            except Exception as e:  # sent back: the asking rank raises it
                reply, data = {"ok": False, "error": f"{type(e).__name__}: {e}", "folder": str(self.folder)}, None
            reply["nbytes"] = 0 if data is None else data.numel()
            tdist.send(_encode(reply), dst=asker, group=self._replies, tag=_TAG)
            if data is not None and data.numel():
                tdist.send(data, dst=asker, group=self._replies, tag=_TAG)

    def close(self) -> None:
        """Stop every rank's server once no rank asks any more. Collective: all ranks must call it."""
        dist.barrier()  # every request was answered before its asker got here
        if dist.world_size() > 1:
            stop = _encode({"op": "stop"})
            tdist.send(stop, dst=(dist.rank() + 1) % dist.world_size(), group=self._requests, tag=_TAG)
        self._server.join()
        self._open.clear()


def answer(folder: str | os.PathLike, handles: dict, request: dict) -> tuple[dict, torch.Tensor | None]:
    """The server's reply to one request on the files of `folder` (`handles`: its open file handles)."""
    path = join(folder, request["file"])
    if request["op"] == "header":
        return {"ok": True}, _bytes_tensor(json.dumps(read_safetensors_header(path)).encode())
    if request["op"] == "file":
        return {"ok": True}, _bytes_tensor(store_for(path).read(path))
    if request["file"] not in handles:
        handles[request["file"]] = open_tensors(path)
    handle, index = handles[request["file"]], request["index"]
    tensor = handle.get_tensor(request["name"]) if index is None else \
        handle.get_slice(request["name"])[tuple(slice(a, b) for a, b in index)]
    tensor = tensor.contiguous()
    reply = {"ok": True, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    return reply, tensor.reshape(-1).view(torch.uint8) if tensor.numel() else None


def tensor_from(reply: dict, data: torch.Tensor | None) -> torch.Tensor:
    """The tensor a `tensor` reply carries (its bytes reinterpreted with the reply's dtype and shape)."""
    dtype = getattr(torch, reply["dtype"])
    if data is None:
        return torch.empty(reply["shape"], dtype=dtype)
    return data.view(dtype).reshape(reply["shape"])


class RemoteFile(FileHandle):
    """A file on another machine, with the part of `safe_open`'s interface readers use."""

    def __init__(self, service: FileService, file: str):
        self.service, self.file = service, file

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.service.read_tensor(self.file, name)

    def get_slice(self, name: str) -> "RemoteSlice":
        return RemoteSlice(self.service, self.file, name)


class RemoteSlice(TensorSlice):
    """`safe_open(...).get_slice(name)` for a remote file: indexing with step-1 slices fetches only that part."""

    def __init__(self, service: FileService, file: str, name: str):
        self.service, self.file, self.name = service, file, name

    def get_shape(self) -> list[int]:
        return list(self.service.header(self.file)[self.name]["shape"])

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        shape = self.get_shape()
        if len(index) > len(shape) or not all(isinstance(i, slice) for i in index):
            raise TypeError(f"a remote tensor slice takes up to {len(shape)} slices, got {index!r}")
        bounds = []
        for i, size in zip(index, shape):
            start, stop, step = i.indices(size)
            if step != 1:
                raise TypeError(f"a remote tensor slice takes step-1 slices, got {i!r}")
            bounds.append([start, max(start, stop)])
        return self.service.read_tensor(self.file, self.name, bounds)


def _encode(message: dict) -> torch.Tensor:
    raw = json.dumps(message).encode()
    if len(raw) > _MESSAGE_BYTES:
        raise ValueError(f"file-service message of {len(raw)} bytes exceeds {_MESSAGE_BYTES}: {raw[:200]!r}...")
    buffer = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    buffer[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buffer


def _decode(buffer: torch.Tensor) -> dict:
    raw = bytes(buffer.numpy()).rstrip(b"\0")
    return json.loads(raw)


def _bytes_tensor(data: bytes) -> torch.Tensor | None:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
