"""Legacy DeepSpeed folders (`checkpoint-N/global_stepN/`, written by the plain Trainer without this plugin):
detected; resumed through DeepSpeed itself where the topology matches; read offline and resharded where it
does not (another world size, another stage, DDP, one process: what DeepSpeed refuses); the next save is
unified; and `hf-unified-ckpt convert` turns them into unified folders equal to `zero_to_fp32`'s output. The same
holds for the model folder the plain `Trainer.save_model` writes under ZeRO-3 without 16-bit weights (DeepSpeed
partitions, no trainer state), which resume refuses.

Real DeepSpeed, CPU, gloo. Tolerances as in test_deepspeed.py.
"""

import json
import shutil

import pytest
import torch

from support.specs import run_spec
from support.states import assert_resumed_matches
from support.launches import torchrun
from hf_unified_ckpt.tools.cli import main as cli
from hf_unified_ckpt.errors import IncompleteCheckpointError, UnsupportedCheckpointError
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout

LOSS_RTOL = STATE_ATOL = 1e-5
LEGACY = {"attach": False, "unified_checkpoint": False}
SAVERS = {"z2": {"zero": 2}, "z3": {"zero": 3}, "z2bf16": {"zero": 2, "overrides": {"bf16": True}}}
SAVED_MODEL = "z3-saved-model"  # the z3 saver's plain Trainer.save_model(folder) after its last step (step 6)
REFUSED = "z3-resume-save-model"  # a ZeRO-3 run at 2 ranks (DeepSpeed's own topology) told to resume from it
CELLS = [  # (legacy saved by (2 ranks), resumed as, world size, how)
    ("z2", "z2", 2, "native"), ("z2bf16", "z2bf16", 2, "native"),
    ("z2", "z3", 2, "resharded"), ("z3", "z2", 2, "resharded"), ("z2", "ddp", 2, "resharded"),
    ("z2", "z2", 3, "resharded"), ("z3", "z3", 3, "resharded"), ("z2", "z2", 1, "resharded"),
    ("z2", "single", 1, "resharded"), ("z3", "single", 1, "resharded"),
]


def _tag(c):
    return f"{c[0]}-to-{c[1]}-at{c[2]}"


def _resume_spec(tmp, cell):
    saved_by, kind, _, _ = cell
    spec = dict(SAVERS.get(kind, {}))
    spec.update(output_dir=str(tmp / _tag(cell)), result=str(tmp / f"{_tag(cell)}.pt"),
                resume=str(tmp / saved_by / "checkpoint-3"))
    return spec


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("legacy_ds")
    saves = []
    for name, spec in SAVERS.items():
        saves.append({**spec, "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt"),
                      "overrides": {**spec.get("overrides", {}), **LEGACY},
                      **({"save_model": str(tmp / SAVED_MODEL)} if name == "z3" else {})})
    saves.append({"zero": 3, "output_dir": str(tmp / REFUSED), "result": str(tmp / f"{REFUSED}.pt"),
                  "resume": str(tmp / SAVED_MODEL), "expect_error": "written by Trainer.save_model"})
    torchrun(2, saves + [_resume_spec(tmp, c) for c in CELLS if c[2] == 2], tmp)
    torchrun(3, [_resume_spec(tmp, c) for c in CELLS if c[2] == 3], tmp)
    torchrun(1, [_resume_spec(tmp, c) for c in CELLS if c[2] == 1 and c[1] != "single"], tmp)
    out = {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in [*SAVERS, REFUSED]}
    for c in CELLS:
        out[_tag(c)] = (run_spec(_resume_spec(tmp, c), 1) if c[1] == "single"
                        else torch.load(tmp / f"{_tag(c)}.pt", weights_only=False))
    return tmp, out


@pytest.mark.dist
def test_legacy_folders_are_what_the_plain_trainer_writes(legacy, capsys):
    tmp, _ = legacy
    for name in SAVERS:
        ckpt = tmp / name / "checkpoint-3"
        assert (ckpt / "global_step3").is_dir() and not (ckpt / "unified_checkpoint.json").exists()
        capsys.readouterr()
        assert cli(["info", "--json", str(ckpt)]) == 0
        info = json.loads(capsys.readouterr().out)
        assert (info["kind"], info["complete"], info["global_step"]) == ("deepspeed", True, 3)
        assert cli(["verify", str(ckpt)]) == 1


@pytest.mark.dist
@pytest.mark.parametrize("cell", CELLS, ids=_tag)
def test_legacy_deepspeed_resumes_and_next_save_is_unified(legacy, cell):
    tmp, out = legacy
    saved_by, _, _, how = cell
    resumed, base = out[_tag(cell)], out[saved_by]
    exact = how == "native"
    assert_resumed_matches(resumed, base, (4, 5, 6), exact, LOSS_RTOL, STATE_ATOL)
    layout = detect_layout(tmp / _tag(cell) / "checkpoint-6")
    assert layout.kind == "unified" and layout.complete


@pytest.mark.parametrize("name", list(SAVERS))
def test_convert_matches_zero_to_fp32_and_verifies(legacy, name, tmp_path, capsys):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    src = legacy[0] / name / "checkpoint-3"
    out = tmp_path / "converted"
    assert cli(["convert", str(src), str(out), "--max-shard-size", "20KB", "--quiet"]) == 0
    assert cli(["verify", str(out)]) == 0
    layout = detect_layout(out)
    assert layout.kind == "unified" and layout.manifest["saved_by"]["converted_from"] == "deepspeed-legacy"
    stem = "master_weights" if name == "z2bf16" else "model"
    assert len(list(out.glob(f"{stem}-*.safetensors"))) > 1  # 20KB shards: bounded memory, many files
    ours = {}
    for f in out.glob(f"{stem}*.safetensors"):
        ours.update(load_file(str(f)))
    reference = get_fp32_state_dict_from_zero_checkpoint(str(src))
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert torch.equal(ours[key], value), key
    assert cli(["convert", str(src), str(out)]) == 1  # never overwrites
    assert "not empty" in capsys.readouterr().err


def test_partitions_are_read_without_deepspeed_and_without_running_pickled_code(legacy, tmp_path):
    """The partition files are unpickled with `weights_only` and stand-ins for DeepSpeed's classes: a fresh process
    reads every saver's tensors without importing DeepSpeed. A file pickling anything else is refused, naming the
    global and the opt-in, and read whole only with it; a damaged one is a clear error."""
    import subprocess
    import sys
    from fractions import Fraction

    from hf_unified_ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError
    from hf_unified_ckpt.legacy.deepspeed import _load

    folders = [str(legacy[0] / name / "checkpoint-3") for name in SAVERS]
    code = ("import sys; from hf_unified_ckpt.legacy.deepspeed import LegacyDeepSpeedCheckpoint as L\n"
            "for f in sys.argv[1:]:\n"
            "    c = L(f); [c.fp32(n, k) for n in c.shape_of for k in (None, 'exp_avg')]\n"
            "    print(c.stage, c.topology()['bf16'], [f.start for f in c.optim[0].get('param_slice_mappings', [{}])[0].values()][:1])\n"
            "print('deepspeed imported:', 'deepspeed' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *folders], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["2 False [0]", "3 False []", "2 True [0]", "deepspeed imported: False"]
    other = tmp_path / "other.pt"
    torch.save({"scale": Fraction(1, 3), "t": torch.ones(3)}, other)
    with pytest.raises(UnsupportedCheckpointError, match=r"other.pt pickles fractions.Fraction: .*trust_pickles"):
        _load(other)
    assert _load(other, trust_pickles=True)["scale"] == Fraction(1, 3)
    other.write_bytes(other.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match="other.pt cannot be read"):
        _load(other)


def test_convert_can_compress_the_optimizer_moments(legacy, tmp_path):
    from hf_unified_ckpt.checkpoint.folder.safetensors_io import ComponentReader
    from support.codecs import round_trip

    src = legacy[0] / "z2bf16" / "checkpoint-3"
    exact, small = tmp_path / "exact", tmp_path / "o1"
    assert cli(["convert", str(src), str(exact), "--quiet", "--verify"]) == 0  # re-reads every CRC-32
    assert cli(["convert", str(src), str(small), "--ckpt-quant-stage", "O1", "--quiet"]) == 0
    assert cli(["verify", str(small)]) == 0
    buffered = tmp_path / "buffered"  # through the page cache: the same bytes
    assert cli(["convert", str(src), str(buffered), "--quiet", "--no-direct-io"]) == 0
    tensor_files = sorted(p.name for p in exact.glob("*.safetensors"))
    assert tensor_files and tensor_files == sorted(p.name for p in buffered.glob("*.safetensors"))
    assert all((exact / n).read_bytes() == (buffered / n).read_bytes() for n in tensor_files)
    assert detect_layout(small).manifest["components"]["optimizer"]["codec"]["stage"] == "O1"
    with ComponentReader(exact, "optimizer") as a, ComponentReader(small, "optimizer") as b:
        assert a.keys() == b.keys()
        moments = [k for k in a.keys() if k.endswith(("/exp_avg", "/exp_avg_sq"))]
        assert moments
        for key in a.keys():
            expected = round_trip("O1", key, a.get(key)) if key in moments else a.get(key)
            assert torch.equal(b.get(key), expected), key


def test_converted_folder_resumes_on_one_process(legacy, tmp_path):
    tmp, out = legacy
    converted = tmp_path / "run" / "checkpoint-3"
    assert cli(["convert", str(tmp / "z2" / "checkpoint-3"), str(converted), "--quiet"]) == 0
    resumed = run_spec({"output_dir": str(tmp_path / "resumed"), "resume": str(converted)}, 1)
    for step in (4, 5, 6):
        assert abs(resumed["losses"][step] - out["z2"]["losses"][step]) <= LOSS_RTOL * abs(out["z2"]["losses"][step])


def test_convert_refuses_what_it_cannot_read(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert cli(["convert", str(tmp_path / "x"), str(tmp_path / "y")]) == 1
    assert "convert reads complete DeepSpeed folders" in capsys.readouterr().err


def _info(path, capsys) -> dict:
    capsys.readouterr()
    assert cli(["info", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def test_convert_reads_the_folder_save_model_writes(legacy, tmp_path, capsys):
    """Trainer.save_model under ZeRO-3 without 16-bit weights writes config.json and DeepSpeed's partitions, but no
    weights file and no trainer_state.json: convert makes a folder that from_pretrained loads (zero_to_fp32's
    weights), with the partitions' optimizer state and the step of the DeepSpeed tag."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp, out = legacy
    src = tmp / SAVED_MODEL
    names = {p.name for p in src.iterdir()}
    assert {"config.json", "latest", "global_step6", "zero_to_fp32.py"} <= names, names
    assert not names & {"trainer_state.json", "model.safetensors", "pytorch_model.bin"}, names
    info = _info(src, capsys)
    assert (info["kind"], info["complete"], info["global_step"], info["trainer_state"]) == ("deepspeed", True, 6, False)
    assert "save_model" in info["reason"]
    converted = tmp_path / "converted"
    assert cli(["convert", str(src), str(converted), "--quiet"]) == 0
    assert cli(["verify", str(converted)]) == 0
    layout = detect_layout(converted)
    assert (layout.kind, layout.global_step, layout.trainer_state) == ("unified", 6, False)
    weights = AutoModelForCausalLM.from_pretrained(converted).state_dict()
    reference = get_fp32_state_dict_from_zero_checkpoint(str(src))
    assert set(weights) == set(reference)
    for key, value in reference.items():
        assert torch.equal(weights[key], value) and torch.equal(value, out["z3"]["state"][key]), key
    optimizer = {}
    for f in converted.glob("optimizer*.safetensors"):
        optimizer.update(load_file(str(f)))
    moments = {k: v for k, v in out["z3"]["optim"].items() if not k.endswith("/master")}
    assert moments and all(torch.equal(optimizer[k], v) for k, v in moments.items())
    with pytest.raises(UnsupportedCheckpointError, match="holds no trainer_state.json"):  # not a fresh start
        run_spec({"output_dir": str(tmp_path / "resumed"), "resume": str(converted)}, 1)


@pytest.mark.dist
def test_resume_refuses_the_folder_save_model_writes(legacy, tmp_path, capsys):
    """It holds no trainer state: resuming from it is refused (under DeepSpeed with its own topology, and on one
    process) with the way out (convert), never a fresh start. The same files named checkpoint-N are an interrupted
    Trainer checkpoint: refused by resume and by convert."""
    tmp, out = legacy
    src = tmp / SAVED_MODEL
    assert out[REFUSED]["error"].startswith("UnsupportedCheckpointError") and out[REFUSED]["global_step"] == 0
    assert not (tmp / REFUSED).exists() or not any((tmp / REFUSED).iterdir())
    with pytest.raises(UnsupportedCheckpointError, match="written by Trainer.save_model") as refused:
        run_spec({"output_dir": str(tmp_path / "resumed"), "resume": str(src)}, 1)
    assert "hf-unified-ckpt convert" in str(refused.value)
    interrupted = tmp_path / "run" / "checkpoint-6"
    shutil.copytree(src, interrupted)
    with pytest.raises(IncompleteCheckpointError, match="trainer_state.json is missing"):
        run_spec({"output_dir": str(tmp_path / "run"), "resume": str(interrupted)}, 1)
    assert cli(["convert", str(interrupted), str(tmp_path / "converted"), "--quiet"]) == 1
    assert "trainer_state.json is missing" in capsys.readouterr().err


def test_a_partition_file_that_pickles_code_is_refused_unless_the_folder_is_trusted(legacy, tmp_path, capsys):
    """A `zero_pp_rank_0_mp_rank_00_optim_states.pt` holding a pickle whose unpickling runs code (it writes a marker
    file): `convert` and a plugin resume of a plain one-process job refuse the folder before anything loads, naming
    the global, the file and the opt-in; nothing runs, nothing is written, the run's other checkpoints stay as they
    were. Trusted (`--trust-pickles`, `trust_pickles`), it is unpickled whole, as DeepSpeed would: the code runs and
    the folder converts and resumes."""
    from support.hostile import WritesMarker, refused_unless_trusted

    run, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(legacy[0] / "z2" / "checkpoint-3", run / "checkpoint-3")
    shutil.copytree(legacy[0] / "z2" / "checkpoint-6", run / "checkpoint-6")
    hostile = run / "checkpoint-3" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(hostile, weights_only=False)  # the real file, with DeepSpeed's classes
    torch.save({**state, "extra": WritesMarker(marker)}, hostile)
    refused_unless_trusted(run, hostile, marker, tmp_path / "converted", capsys)
    marker.unlink()
    resumed = run_spec({"output_dir": str(tmp_path / "trusted"), "resume": str(run / "checkpoint-3"),
                        "overrides": {"unified_checkpoint_config": "trust_pickles"}}, 1)
    assert marker.exists() and resumed["global_step"] == 6


def test_files_deepspeed_alone_would_unpickle_are_vetted_before_it_loads_the_folder(legacy, tmp_path):
    """Where the topology matches, DeepSpeed's own `load_checkpoint` reads the folder and unpickles every file it
    opens whole, MoE experts' files included, which this library's reader never opens: every `.pt` file of the step
    folder is checked first, statically (nothing runs), and one that pickles code is refused naming it and the
    opt-in; a clean folder passes, and a trusted one is left to DeepSpeed."""
    from support.hostile import WritesMarker

    from hf_unified_ckpt.legacy import open_legacy

    folder, marker = tmp_path / "checkpoint-3", tmp_path / "marker"
    shutil.copytree(legacy[0] / "z2" / "checkpoint-3", folder)
    open_legacy(detect_layout(str(folder))).vet_for_deepspeed()  # the files DeepSpeed 0.19.8 writes pass
    expert = folder / "global_step3" / "layer_0_expert_0_mp_rank_00_model_states.pt"
    torch.save({"weight": torch.zeros(2), "extra": WritesMarker(marker)}, expert)
    with pytest.raises(UnsupportedCheckpointError) as refused:
        open_legacy(detect_layout(str(folder))).vet_for_deepspeed()
    assert str(expert) in str(refused.value) and "builtins.eval" in str(refused.value)
    assert "trust_pickles" in str(refused.value) and not marker.exists()
    open_legacy(detect_layout(str(folder)), trust_pickles=True).vet_for_deepspeed()  # trusted: DeepSpeed's call
    assert not marker.exists()
