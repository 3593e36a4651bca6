"""Hostile checkpoint content for tests: a pickled object whose unpickling runs code (it writes a marker file), and
a fingerprint of a folder to show that a refusal changed nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path


class WritesMarker:
    """Unpickled, it runs `eval` (the global `builtins.eval`), which writes `marker`; the value it then stands for
    is `value` (so a folder holding it stays loadable where unpickling is trusted)."""

    def __init__(self, marker: Path, value=None):
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return eval, (f"(open({self.marker!r}, 'w').write('ran'), {self.value!r})[1]",)


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path) -> the SHA-256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused_unless_trusted(run: Path, hostile: Path, marker: Path, out: Path, capsys) -> None:
    """The checks both legacy engines' malicious-pickle tests make of `run/checkpoint-3`, whose file `hostile`
    writes `marker` when unpickled: `convert` and a one-process resume refuse it, naming the global, the file and
    both opt-ins; nothing runs, `out` is not written, `run` is unchanged; `convert --trust-pickles` runs it."""
    from support.specs import run_spec

    from hf_unified_ckpt.tools.cli import main as cli

    before = fingerprint(run)
    assert cli(["convert", str(run / "checkpoint-3"), str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "builtins.eval" in err and str(hostile) in err and "--trust-pickles" in err and "trust_pickles" in err, err
    refused = run_spec({"output_dir": str(run), "resume": str(run / "checkpoint-3"),
                        "expect_error": "builtins.eval"}, 1)
    assert refused["error"].startswith("UnsupportedCheckpointError") and refused["global_step"] == 0
    assert str(hostile) in refused["error"] and "trust_pickles" in refused["error"]
    assert not marker.exists() and not out.exists() and fingerprint(run) == before
    assert cli(["convert", str(run / "checkpoint-3"), str(out), "--quiet", "--trust-pickles"]) == 0
    assert marker.exists()
