"""Files that a library insists on writing into a local folder (`save_pretrained` of configs and tokenizers,
`torch.save`), captured as bytes so that they reach a checkpoint through its store."""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable


def files_written_by(write: Callable[[str], None]) -> dict[str, bytes]:
    """Run `write(folder)` on a new temporary local folder; return the files it wrote there (name -> bytes)."""
    with tempfile.TemporaryDirectory(prefix="hf_unified_ckpt-") as folder:
        write(folder)
        out = {}
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    out[name] = f.read()
        return out


def torch_bytes(obj) -> bytes:
    """`torch.save(obj)`'s bytes (the file format the Trainer reads back with `torch.load`)."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
