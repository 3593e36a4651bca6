"""Hostile and damaged checkpoints (issue 55): only regular files are read and nothing hangs on a special file;
every JSON read is bounded and every field type-checked; safetensors headers are validated fully; a recorded size is
never trusted before the file on disk backs it; `export` checks CRC-32s; nothing unlisted is read from a unified
folder. Each case on a real checkpoint of the tiny model (one per module, copied per case), through the command
line and the resume. The damage is "re-signed" where it matters: the manifest's size and CRC-32 recomputed, as
anyone crafting a file does."""

import faulthandler
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest

from support.paths import ROOT
from support.trainers import train
from hf_unified_ckpt.checkpoint.folder.files import file_crc32
from hf_unified_ckpt.checkpoint.folder.manifest import verify_folder
from hf_unified_ckpt.errors import CorruptCheckpointError, UnifiedCheckpointError
from hf_unified_ckpt.tools.cli import main as cli

MANIFEST = "unified_checkpoint.json"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    run = tmp_path_factory.mktemp("hostile")
    train(run, max_steps=3, save_steps=3)
    return run / "checkpoint-3"


@pytest.fixture
def ckpt(good, tmp_path):
    copy = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(good, copy)
    return copy


@contextmanager
def watchdog(seconds: int = 120):
    """A hang (today's code on a FIFO) ends the test process with every thread's stack instead of hanging it."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _manifest(ckpt) -> dict:
    return json.loads((ckpt / MANIFEST).read_text())


def _write_manifest(ckpt, manifest) -> None:
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _resign(ckpt, name, size=None, crc=None) -> None:
    """Record `name`'s size and CRC-32 (or the ones given) in the manifest, as a crafter of the file would."""
    manifest = _manifest(ckpt)
    manifest["files"][name] = {"size": (ckpt / name).stat().st_size if size is None else size,
                               "crc32": file_crc32(ckpt / name) if crc is None else crc}
    _write_manifest(ckpt, manifest)


def _fifo(path) -> None:
    path.unlink()
    os.mkfifo(path)


def _copy_as_newer(ckpt, step: int) -> Path:
    newer = ckpt.parent / f"checkpoint-{step}"
    shutil.copytree(ckpt, newer)
    return newer


def _cli_subprocess(commands: list[list[str]], user: int | None = None, timeout: int = 60) -> list[dict]:
    """Run `hf-unified-ckpt` commands in one fresh interpreter, each's exit code and output: a regression that
    hangs fails at `timeout` instead of hanging the suite. `user`: the interpreter, started as root (whose Python
    only root can start here), loads the command line, then becomes that user for good before running them."""
    script = ("import contextlib, io, json, os, sys\nfrom hf_unified_ckpt.tools.cli import main\nout = []\n"
              f"if {user!r} is not None:\n    os.setuid({user!r})\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    o, e = io.StringIO(), io.StringIO()\n"
              "    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):\n"
              "        code = main(argv)\n"
              "    out.append({'code': code, 'out': o.getvalue(), 'err': e.getvalue()})\n"
              "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


# ---- item 5: special files ----------------------------------------------------------------------------------------

def test_a_fifo_as_manifest_or_tensor_file_is_named_and_nothing_hangs(ckpt, tmp_path):
    """Today: `verify` and `info` block forever opening the FIFO."""
    tensor_fifo = _copy_as_newer(ckpt, 4)
    _fifo(tensor_fifo / "model.safetensors")
    _resign(tensor_fifo, "model.safetensors", size=0, crc="00000000")
    _fifo(ckpt / MANIFEST)
    (verify_m, info_m, verify_t, info_t) = _cli_subprocess([["verify", str(ckpt)], ["info", "--json", str(ckpt)],
                                                           ["verify", str(tensor_fifo)],
                                                           ["info", "--json", str(tensor_fifo)]])
    assert verify_m["code"] == 1 and "unified_checkpoint.json is a FIFO (named pipe)" in verify_m["err"]
    assert info_m["code"] == 0 and json.loads(info_m["out"])["kind"] == "unified-incomplete"
    assert verify_t["code"] == 1 and "model.safetensors is a FIFO (named pipe), not a regular file" in verify_t["err"]
    assert info_t["code"] == 0
    assert any("model.safetensors is a FIFO" in f for f in json.loads(info_t["out"])["findings"])
    assert "Traceback" not in "".join(r["err"] for r in (verify_m, info_m, verify_t, info_t))


def test_a_symlinked_file_is_refused_and_a_symlinked_folder_is_read(ckpt, tmp_path, capsys):
    """Today: `verify` follows a link to a file outside the folder and says OK."""
    outside = tmp_path / "elsewhere.json"
    shutil.move(ckpt / "trainer_state.json", outside)
    (ckpt / "trainer_state.json").symlink_to(outside)
    assert cli(["verify", str(ckpt)]) == 1
    assert "trainer_state.json is a symbolic link, not a regular file" in capsys.readouterr().err
    (ckpt / "trainer_state.json").unlink()
    shutil.move(outside, ckpt / "trainer_state.json")
    link = tmp_path / "checkpoint-9"
    link.symlink_to(ckpt)
    assert cli(["verify", str(link)]) == 0
    from hf_unified_ckpt.checkpoint.folder.commit import remove_stale
    from hf_unified_ckpt.store import store_for

    store_for(str(link)).retire(str(link), MANIFEST)  # rotation of a linked checkpoint: the link goes, not its files
    assert not os.path.lexists(link) and not list(tmp_path.glob(".checkpoint-9*"))  # removed as a link at once
    assert remove_stale(tmp_path) == [] and (ckpt / MANIFEST).is_file()
    from hf_unified_ckpt.store.node import owner_tag

    leftover = tmp_path / f".checkpoint-9.{owner_tag()}.deleting"  # one a failed rotation left: unlinked, not followed
    leftover.symlink_to(ckpt)
    assert remove_stale(tmp_path) == [str(leftover)]
    assert not os.path.lexists(leftover) and (ckpt / MANIFEST).is_file()


def test_a_fifo_in_a_legacy_folder_is_refused_before_anything_reads_it(tmp_path):
    """Today: the resume of a plain Trainer folder whose optimizer.pt is a FIFO goes on without a word, with a
    fresh optimizer (the Trainer's `os.path.isfile` takes the FIFO for a missing file); a FIFO read would hang."""
    train(tmp_path / "plain", max_steps=3, save_steps=3, attach=False)
    folder = tmp_path / "plain" / "checkpoint-3"
    _fifo(folder / "optimizer.pt")
    with watchdog(), pytest.raises(UnifiedCheckpointError, match="optimizer.pt is a FIFO"):
        train(tmp_path / "resumed", max_steps=4, resume=str(folder))


# ---- items 5 and 6: `resume_from_checkpoint="auto"` skips malformed newer folders -------------------------------

def test_auto_resume_skips_malformed_newer_folders_with_the_documented_warning(ckpt, caplog):
    """Today: a FIFO manifest hangs the job at start; `"components": [...]` raises AttributeError; a manifest
    nested 100,000 deep raises RecursionError."""
    _fifo(_copy_as_newer(ckpt, 9) / MANIFEST)
    listed = _copy_as_newer(ckpt, 8)
    _write_manifest(listed, {**_manifest(listed), "components": [1, 2]})
    (_copy_as_newer(ckpt, 7) / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with watchdog(), caplog.at_level(logging.WARNING, logger="hf_unified_ckpt"):
        trainer, _ = train(ckpt.parent, max_steps=4, save_steps=100, resume="auto")
    assert trainer.state.global_step == 4
    skipped = {r.getMessage().split()[1].rstrip(":") for r in caplog.records if r.getMessage().startswith("Skipping")}
    assert {str(ckpt.parent / f"checkpoint-{s}") for s in (7, 8, 9)} <= skipped, caplog.text
    assert "FIFO" in caplog.text and "'components' is not an object" in caplog.text and "nested deeper" in caplog.text


# ---- item 7: a recorded size is never trusted before the file backs it ------------------------------------------

def test_verify_does_not_allocate_for_a_huge_recorded_size(ckpt):
    """Today: one range object per 64 MiB of the recorded size (2**46 bytes: a million of them, ~150 MB) before the
    size on disk is compared."""
    _resign(ckpt, "model.safetensors", size=2**46)
    tracemalloc.start()
    try:
        problems = verify_folder(ckpt, _manifest(ckpt))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert any(p.startswith("model.safetensors:") and f"expected {2**46}" in p for p in problems), problems
    assert peak < 16 * 2**20, f"verify allocated {peak} bytes for a recorded size"


# ---- item 8: safetensors headers validated fully -------------------------------------------------------------------

def _edit_header(path, edit) -> None:
    """Change the header of safetensors file `path` with `edit(header)`, keeping its length (padded with spaces)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw.ljust(n) + data[8 + n:])


def _two_tensors(header):
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]


HEADERS = {
    "overlapping": (lambda h: h[_two_tensors(h)[1]].update(data_offsets=h[_two_tensors(h)[0]]["data_offsets"]),
                    "overlap"),
    "inverted": (lambda h: h[_two_tensors(h)[0]].update(data_offsets=h[_two_tensors(h)[0]]["data_offsets"][::-1]),
                 "not [begin, end]"),
    "shape vs range": (lambda h: h[_two_tensors(h)[0]].update(shape=[1]), "span"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_verify_refuses_a_header_safetensors_refuses(ckpt, case, capsys):
    """Today: `verify` says OK (the manifest re-signed), and the resume fails inside safetensors naming no file."""
    edit, words = HEADERS[case]
    _edit_header(ckpt / "model.safetensors", edit)
    _resign(ckpt, "model.safetensors")
    assert cli(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and words in err, err
    assert cli(["export", str(ckpt), str(ckpt.parent / "exported")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model.safetensors" in err and len(err.strip().splitlines()) == 1, err
    assert not (ckpt.parent / "exported").exists()


def test_resume_names_the_file_of_an_inconsistent_header(ckpt, tmp_path):
    _edit_header(ckpt / "model.safetensors", HEADERS["overlapping"][0])
    _resign(ckpt, "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.*overlap"):
        train(tmp_path / "resumed", max_steps=4, resume=str(ckpt))


# ---- item 9: export checks CRC-32s ---------------------------------------------------------------------------------

def test_export_refuses_a_bit_flip(ckpt, capsys):
    """Today: sizes only are checked, the flipped weights exported with exit 0."""
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[-5] ^= 1
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    out = ckpt.parent / "exported"
    assert cli(["export", str(ckpt), str(out)]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors: crc32" in err and "Nothing was written" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


# ---- item 10: malformed fields are named errors, never tracebacks ---------------------------------------------------

FIELDS = {
    "size as a string": (lambda c: _write_manifest(c, _with_file_field(c, "size", "92848")),
                         "'files['model.safetensors'].size'"),
    "components as a list": (lambda c: _write_manifest(c, {**_manifest(c), "components": [1]}), "'components'"),
    "deep manifest": (lambda c: (c / MANIFEST).write_text("[" * 100_000 + "]" * 100_000), "nested deeper"),
    "deep header": (lambda c: _deep_header(c / "model.safetensors"), "nested deeper"),
}


def _with_file_field(ckpt, field, value) -> dict:
    manifest = _manifest(ckpt)
    manifest["files"]["model.safetensors"][field] = value
    return manifest


def _deep_header(path) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + (b"[" * (n // 2) + b"]" * (n // 2)).ljust(n) + data[8 + n:])
    _resign(path.parent, path.name)


@pytest.mark.parametrize("case", list(FIELDS))
def test_a_malformed_field_is_a_named_error(ckpt, case, capsys, tmp_path):
    """Today: TypeError, AttributeError or RecursionError out of verify, info and the resume."""
    damage, words = FIELDS[case]
    damage(ckpt)
    assert cli(["verify", str(ckpt)]) == 1
    assert words in capsys.readouterr().err
    assert cli(["info", "--json", str(ckpt)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert any(words in f for f in info["findings"]), info
    with pytest.raises(UnifiedCheckpointError, match=re.escape(words)):  # a malformed manifest: not committed
        train(tmp_path / "resumed", max_steps=4, resume=str(ckpt))


def test_an_unreadable_folder_is_a_finding_for_an_unprivileged_user(ckpt):
    """Run as an unprivileged user, as an attacker or a colleague would: today `info` and `verify` end in a
    PermissionError traceback. As root (CI), the command line becomes `nobody` and reads root's 0700 folder; as
    another user, the folder is made unreadable to its own owner (0000), which root would read regardless."""
    root = os.geteuid() == 0
    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(shared, 0o755)
        folder = shared / "checkpoint-3"
        shutil.copytree(ckpt, folder)
        os.chmod(folder, 0o700 if root else 0o000)  # root's, unreadable to nobody; or unreadable to its owner
        info, verify = _cli_subprocess([["info", "--json", str(folder)], ["verify", str(folder)]],
                                       user=65534 if root else None)
    finally:
        os.chmod(shared / "checkpoint-3", 0o700)
        shutil.rmtree(shared)
    assert info["code"] == 0 and "Permission denied" in " ".join(json.loads(info["out"])["findings"]), info
    assert verify["code"] == 1 and "Permission denied" in verify["err"] and "Traceback" not in verify["err"], verify


# ---- item 12: nothing outside the manifest is read ----------------------------------------------------------------

def test_an_unlisted_rng_file_is_not_used(ckpt, tmp_path, caplog):
    """Today: with rng_state_0.pth gone (from the folder and the manifest) and an unlisted rng_state.pth added,
    the resume restores the generators from it without a word."""
    os.replace(ckpt / "rng_state_0.pth", ckpt / "rng_state.pth")
    manifest = _manifest(ckpt)
    del manifest["files"]["rng_state_0.pth"]
    _write_manifest(ckpt, manifest)
    with caplog.at_level(logging.WARNING, logger="hf_unified_ckpt"):
        train(tmp_path / "resumed", max_steps=4, resume=str(ckpt))
    assert "rng_state_0.pth is missing: random generators were not restored" in caplog.text


# ---- smaller ones ---------------------------------------------------------------------------------------------------

def test_info_exits_0_on_a_truncated_file(ckpt, capsys):
    """docs/cli.md: `info` exits 0 for any folder. Today: 1, from the truncated model file's header."""
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:-100])
    assert cli(["info", "--json", str(ckpt)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["complete"] is False and any("model.safetensors:" in f and "truncated" in f for f in info["findings"])


def test_a_ranged_read_is_checked_for_the_length_asked():
    """A store returns exactly the bytes asked for or names the file (today: fewer, silently)."""
    from hf_unified_ckpt.store import put_bytes, store_for

    ref = "memory://hostile-input/short.bin"
    put_bytes(ref, b"0123456789")
    assert store_for(ref).read(ref, 2, 4) == b"2345"
    with pytest.raises(CorruptCheckpointError, match=r"short.bin: asked for bytes \[4, 104\), got 6"):
        store_for(ref).read(ref, 4, 100)


# ---- the memory tier: owner-only, another user's run folder refused ------------------------------------------------

def test_memory_tier_files_are_owner_only_and_another_users_run_folder_is_refused(tmp_path):
    """Today: memory checkpoints are created 0644 in folders others can read, and a run folder someone else made
    (its name follows from the output_dir) is used as it is."""
    import stat

    import torch
    from torch import nn

    from hf_unified_ckpt.checkpoint.save.saving import SaveRequest, save_checkpoint
    from hf_unified_ckpt.engines.replicated import ReplicatedEngine
    from hf_unified_ckpt.flash.layout import CHECKPOINTS, run_folder
    from hf_unified_ckpt.options import UnifiedCheckpointOptions
    from hf_unified_ckpt.store.node import private_folder

    memory, output = tmp_path / "memory", tmp_path / "out"
    run = Path(private_folder(run_folder(str(memory), str(output))))
    model = nn.Linear(2, 2)
    request = SaveRequest(run / CHECKPOINTS / "checkpoint-1", 1, UnifiedCheckpointOptions(enabled=True),
                          show_progress=False)
    save_checkpoint(ReplicatedEngine(model, torch.optim.SGD(model.parameters(), lr=0.1)), request, {})
    modes = {str(p.relative_to(run)): stat.S_IMODE(p.stat().st_mode) for p in [run, *run.rglob("*")]}
    assert "checkpoints/checkpoint-1/model.safetensors" in modes, modes
    assert all(mode == (0o700 if (run / name).is_dir() else 0o600) for name, mode in modes.items()), modes
    os.chown(run, 65534, 65534)
    with pytest.raises(PermissionError, match="owned by user id 65534, not by this user"):
        train(output, max_steps=2, save_steps=1, unified_checkpoint_config="flash",
              unified_checkpoint_memory_dir=str(memory))
    assert not output.exists() or not any(output.glob("checkpoint-*"))
