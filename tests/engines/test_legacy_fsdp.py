"""Legacy FSDP folders written by the plain Trainer/accelerate (sharded DCP from FSDP2 and FSDP1, and the full
`pytorch_model_fsdp.bin` + `optimizer.bin` that FSDP2 writes): detected, read offline tensor by tensor, resumed
at another world size and into other engines (the next save unified), and converted by `hf-unified-ckpt convert`.
Real FSDP on CPU through the Trainer (shim as in test_fsdp.py); tolerances as in test_resume_equivalence.py."""

import json
import shutil

import pytest
import torch

from support.specs import run_spec
from support.states import assert_resumed_matches
from support.launches import torchrun
from hf_unified_ckpt.tools.cli import main as cli
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout

LOSS_RTOL = STATE_ATOL = 1e-5
LEGACY = {"attach": False, "unified_checkpoint": False}
SAVERS = {"f2sharded": {"fsdp": 2}, "f1sharded": {"fsdp": 1},
          "f2full": {"fsdp": 2, "fsdp_state_dict_type": "FULL_STATE_DICT"}}
KINDS = {"f2": {"fsdp": 2}, "z2": {"zero": 2}, "ddp": {}, "single": {}}
CELLS = [("f2sharded", "f2", 2), ("f1sharded", "f2", 2), ("f2full", "ddp", 2), ("f2sharded", "f2", 3),
         ("f2full", "f2", 3), ("f1sharded", "z2", 3), ("f2sharded", "single", 1), ("f2full", "single", 1)]


def _tag(c):
    return f"{c[0]}-to-{c[1]}-at{c[2]}"


def _resume(tmp, cell):
    return {**KINDS[cell[1]], "output_dir": str(tmp / _tag(cell)), "result": str(tmp / f"{_tag(cell)}.pt"),
            "resume": str(tmp / cell[0] / "checkpoint-3")}


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("legacy_fsdp")
    saves = [{**spec, "overrides": LEGACY, "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt")}
             for name, spec in SAVERS.items()]
    torchrun(2, saves + [_resume(tmp, c) for c in CELLS if c[2] == 2], tmp)
    torchrun(3, [_resume(tmp, c) for c in CELLS if c[2] == 3], tmp)
    out = {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in SAVERS}
    for c in CELLS:
        out[_tag(c)] = run_spec(_resume(tmp, c), 1) if c[2] == 1 else torch.load(tmp / f"{_tag(c)}.pt",
                                                                                   weights_only=False)
    return tmp, out


@pytest.mark.dist
def test_legacy_fsdp_folders_are_detected(legacy, capsys):
    tmp, _ = legacy
    assert (tmp / "f2sharded" / "checkpoint-3" / "pytorch_model_fsdp_0").is_dir()
    assert (tmp / "f2full" / "checkpoint-3" / "pytorch_model_fsdp.bin").is_file()
    for name in SAVERS:
        capsys.readouterr()
        assert cli(["info", "--json", str(tmp / name / "checkpoint-3")]) == 0
        info = json.loads(capsys.readouterr().out)
        assert (info["kind"], info["complete"], info["global_step"]) == ("fsdp", True, 3)


@pytest.mark.dist
@pytest.mark.parametrize("cell", CELLS, ids=_tag)
def test_legacy_fsdp_resumes_elsewhere_and_next_save_is_unified(legacy, cell):
    tmp, out = legacy
    resumed, base = out[_tag(cell)], out[cell[0]]
    exact = cell[2] == 2 and cell[1] == "f2"
    assert_resumed_matches(resumed, base, (4, 5, 6), exact, LOSS_RTOL, STATE_ATOL)
    layout = detect_layout(tmp / _tag(cell) / "checkpoint-6")
    assert layout.kind == "unified" and layout.complete


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SAVERS))
def test_convert_legacy_fsdp(legacy, name, tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = legacy[0] / name / "checkpoint-3"
    out = tmp_path / "converted"
    assert cli(["convert", str(src), str(out), "--quiet"]) == 0
    assert cli(["verify", str(out)]) == 0
    ours = load_file(str(out / "model.safetensors"))
    if name == "f2full":
        reference = torch.load(src / "pytorch_model_fsdp.bin", weights_only=True)
    else:
        dcp_to_torch_save(str(src / "pytorch_model_fsdp_0"), str(tmp_path / "reference.pt"))
        reference = torch.load(tmp_path / "reference.pt", weights_only=True)["model"]
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert torch.equal(ours[key], value), key


@pytest.mark.dist
def test_convert_into_a_bucket(legacy, s3_bucket, tmp_path, capsys):
    """`convert` writes its unified checkpoint straight into object storage (a real S3 server): the same tensors
    as a local conversion, verified by URL, and a prefix that holds anything is never overwritten."""
    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader

    src = legacy[0] / "f2sharded" / "checkpoint-3"
    url, local = f"{s3_bucket}/converted", tmp_path / "converted"
    assert cli(["convert", str(src), url, "--quiet"]) == 0
    assert cli(["convert", str(src), str(local), "--quiet"]) == 0
    assert cli(["verify", url]) == 0 and detect_layout(url).complete
    for stem in ("model", "optimizer"):
        with ComponentReader(url, stem) as remote, ComponentReader(local, stem) as here:
            assert sorted(remote.keys()) == sorted(here.keys())
            assert all(torch.equal(remote.get(k), here.get(k)) for k in here.keys())
    assert cli(["convert", str(src), url]) == 1  # never overwrites
    assert "not empty" in capsys.readouterr().err


def test_a_dcp_metadata_file_that_pickles_code_is_refused_unless_the_folder_is_trusted(legacy, tmp_path, capsys):
    """DCP reads `.metadata` with a plain `pickle.load`. One whose unpickling runs code (it writes a marker file):
    `convert` and a plugin resume of a plain one-process job refuse the folder before anything loads, naming the
    global, the file and the opt-in; nothing runs, nothing is written. Trusted (`--trust-pickles`), DCP's own read
    runs it and the folder converts."""
    import pickle

    from support.hostile import WritesMarker, refused_unless_trusted

    run, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(legacy[0] / "f2sharded" / "checkpoint-3", run / "checkpoint-3")
    shutil.copytree(legacy[0] / "f2sharded" / "checkpoint-6", run / "checkpoint-6")
    hostile = run / "checkpoint-3" / "optimizer_0" / ".metadata"
    metadata = pickle.loads(hostile.read_bytes())
    metadata.planner_data = {**(metadata.planner_data or {}), "extra": WritesMarker(marker)}
    hostile.write_bytes(pickle.dumps(metadata))
    refused_unless_trusted(run, hostile, marker, tmp_path / "converted", capsys)


def test_legacy_fsdp_reads_no_entry_with_dcps_full_unpickle(legacy, tmp_path, monkeypatch):
    """DCP unpickles a non-tensor entry (`DefaultLoadPlanner.load_bytes`) with `torch.load(weights_only=False)`:
    converting a sharded folder never calls it (tensors are asked for by key, the param groups read with
    `weights_only`), and gives the same optimizer as before."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    src = legacy[0] / "f1sharded" / "checkpoint-3"
    assert cli(["convert", str(src), str(tmp_path / "trusted"), "--quiet", "--trust-pickles"]) == 0  # DCP's reads
    read = []
    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", lambda self, item, value: read.append(item.dest_index.fqn))
    assert cli(["convert", str(src), str(tmp_path / "converted"), "--quiet"]) == 0
    assert read == []
    for name in ("optimizer.safetensors", "optimizer.safetensors.index.json", "model.safetensors"):
        assert (tmp_path / "converted" / name).read_bytes() == (tmp_path / "trusted" / name).read_bytes(), name
    index = json.loads((tmp_path / "converted" / "optimizer.safetensors.index.json").read_text())
    assert index["metadata"]["param_groups"][0]["lr"] > 0 and index["metadata"]["param_groups"][0]["params"]
