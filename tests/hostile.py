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
