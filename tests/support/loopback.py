"""A `FileOpener` whose other machine is this process (`Loopback`): a file served by `file_service` read without a
second machine or a process group."""

from __future__ import annotations

import json

from hf_unified_ckpt.checkpoint.load.file_service import RemoteFile, answer, tensor_from
from hf_unified_ckpt.format.reader import FileOpener


class Loopback(FileOpener):
    """A `FileService` whose other machine is this process: each request is answered by the server's own `answer`,
    and recorded."""

    def __init__(self, folder):
        self.folder, self.handles, self.asked = folder, {}, []

    def is_local(self, file):
        return False

    def exists(self, file):
        return (self.folder / file).is_file()

    def header(self, file):
        return json.loads(bytes(answer(self.folder, self.handles, {"op": "header", "file": file})[1].numpy()))

    def read_tensor(self, file, name, index=None):
        self.asked.append((name, index))
        request = {"op": "tensor", "file": file, "name": name, "index": index}
        return tensor_from(*answer(self.folder, self.handles, request))

    def open(self, file):
        return RemoteFile(self, file)
