"""The package imports light: pure and storage modules load no training stack, and `hf-unified-ckpt info` /
`verify` load no torch (the command line starts in a fraction of a second); the public names still import."""

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

import hf_unified_ckpt
from hf_unified_ckpt.checkpoint.folder.manifest import ComponentEntry, build_manifest, write_manifest
from hf_unified_ckpt.checkpoint.folder.safetensors_io import write_shard

TRAINING_STACK = "{'transformers', 'accelerate', 'deepspeed', 'peft', 'trl'}"


def _loaded_after(code: str, roots: str = TRAINING_STACK) -> list[str]:
    """The modules under `roots` that a fresh interpreter has loaded after running `code`."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {roots}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1].replace("'", '"'))


@pytest.fixture
def unified(tmp_path):
    """A small complete unified checkpoint, written with the storage layer alone."""
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    record = write_shard(folder / "model.safetensors", {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    entry = ComponentEntry("model", (record.name,), None, 1, record.size)
    write_manifest(folder, build_manifest(1, {"engine": "single"}, {}, {"model": entry}, [record]))
    return folder


def test_pure_and_storage_modules_import_no_training_stack():
    modules = ("hf_unified_ckpt.store, hf_unified_ckpt.format.planning, hf_unified_ckpt.checkpoint.folder.layout, "
               "hf_unified_ckpt.tools.cli")
    assert _loaded_after(f"import {modules}") == []


def test_info_and_verify_import_no_torch(unified):
    run = (f"from hf_unified_ckpt.tools.cli import main\nassert main(['info', {str(unified)!r}]) == 0\n"
           f"assert main(['verify', {str(unified)!r}]) == 0")
    assert _loaded_after(run, TRAINING_STACK[:-1] + ", 'torch'}") == []


def test_public_names_load_on_first_use():
    assert _loaded_after("import hf_unified_ckpt", "{'hf_unified_ckpt'}") == ["hf_unified_ckpt",
                                                                             "hf_unified_ckpt._version"]
    assert hf_unified_ckpt.__version__ == importlib.metadata.version("hf_unified_ckpt")
    for name in hf_unified_ckpt.__all__:
        assert getattr(hf_unified_ckpt, name) is not None
    from hf_unified_ckpt import attach
    from hf_unified_ckpt.trainer.attach import attach as defined

    assert attach is defined and "attach" in dir(hf_unified_ckpt)
    with pytest.raises(AttributeError, match="no_such_name"):
        hf_unified_ckpt.no_such_name
