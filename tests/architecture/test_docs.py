"""Docs that cannot drift (issue 35): the options page states every field and config word with the code's default,
the command-line page every command and flag, the troubleshooting page every exception class the package defines;
every relative link and every test the README and docs/ name resolves; the README's quick-start blocks run.

The independent reader written from docs/format.md alone is tested in `test_docs_reader.py`."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from support.paths import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), ROOT / "bench" / "results" / "HISTORY.md"]
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TEST_REF = re.compile(r"tests/((?:\w+/)*test_\w+\.py)(?:::(test_\w+))?")  # tests/<kind>/test_x.py
BARE_TEST = re.compile(r"`(test_\w+)(?:\[[^`]*\])?`")
RUNS_MARK = "<!-- test: runs -->"


def _prose(text: str) -> str:
    """A page without its fenced code blocks (links and names inside code are examples, not references)."""
    return FENCE.sub("", text)


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(text))


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header row is exactly `header`."""
    lines = text.splitlines()
    at = lines.index(header)
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase; punctuation but `-` and `_` dropped; spaces to `-`."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = _slug(m.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


# ---- pages and links --------------------------------------------------------------------------------------------

def test_the_pages_exist_and_the_readme_stays_short():
    must = ["README", "options", "engines", "format", "async-save", "compression", "ema", "lora", "tensor-parallel",
            "moe", "multi-machine", "object-storage", "memory-tier", "preemption", "crash-safety", "cli",
            "benchmarks", "troubleshooting", "architecture"]
    missing = [name for name in must if not (DOCS / f"{name}.md").is_file()]
    assert not missing, f"docs/ lacks {missing}"
    index = (DOCS / "README.md").read_text()
    unlisted = [p.name for p in DOCS.glob("*.md") if p.name != "README.md" and f"({p.name})" not in index]
    assert not unlisted, f"docs/README.md does not link {unlisted}"
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 210, f"README.md has {lines} lines; the reference belongs in docs/"


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no {path})")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _defined_tests() -> dict[str, set[str]]:
    """Each test module's top-level tests, by its path under tests/ (`unit/test_store.py`)."""
    return {f.relative_to(ROOT / "tests").as_posix(): set(re.findall(r"^def (test_\w+)\(", f.read_text(), re.M))
            for f in (ROOT / "tests").rglob("test_*.py")}


def test_every_test_the_docs_name_exists():
    tests = _defined_tests()
    everywhere = set().union(*tests.values()) | {Path(name).stem for name in tests}
    missing = []
    for page in PAGES:
        text = page.read_text()
        for file, function in TEST_REF.findall(text):
            if file not in tests or (function and function not in tests[file]):
                missing.append(f"{page.relative_to(ROOT)}: tests/{file}{'::' + function if function else ''}")
        for name in BARE_TEST.findall(_prose(text)):
            if name not in everywhere:
                missing.append(f"{page.relative_to(ROOT)}: `{name}`")
    assert not missing, "named tests that do not exist:\n" + "\n".join(sorted(set(missing)))


# ---- options, command line, errors ------------------------------------------------------------------------------

def test_every_field_and_word_is_documented_with_the_codes_default():
    from hf_unified_ckpt.arguments import UnifiedCheckpointFields
    from hf_unified_ckpt.options import CONFIG_WORDS

    text = (DOCS / "options.md").read_text()
    documented = {}
    for row in _table_rows(text, "| field | default | meaning |"):
        name, default = row[0].strip("`"), row[1]
        assert default.startswith("`") and default.endswith("`"), f"options.md: {name}'s default is not `code`"
        documented[name] = ast.literal_eval(default.strip("`"))
    fields = {f.name: f.default for f in dataclasses.fields(UnifiedCheckpointFields)}
    assert set(documented) == set(fields), (f"options.md table vs the code: missing "
                                            f"{sorted(set(fields) - set(documented))}, not fields "
                                            f"{sorted(set(documented) - set(fields))}")
    wrong = {n: (documented[n], d) for n, d in fields.items()
             if documented[n] != d or type(documented[n]) is not type(d)}
    assert not wrong, f"defaults in options.md differ from the code (docs, code): {wrong}"
    words = {row[0].strip("`") for row in _table_rows(text, "| word | effect |")}
    assert words == set(CONFIG_WORDS), f"config words: docs {sorted(words)} vs code {sorted(CONFIG_WORDS)}"


def test_every_command_and_flag_is_documented():
    from hf_unified_ckpt.tools.cli import build_parser

    spans = _code_spans((DOCS / "cli.md").read_text())
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    missing = []
    for command, parser in sub.choices.items():
        if not any(re.search(rf"(^|hf-unified-ckpt ){command}\b", s) for s in spans):
            missing.append(command)
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and not any(re.search(rf"{flag}\b", s) for s in spans):
                    missing.append(f"{command} {flag}")
    assert not missing, f"docs/cli.md does not show in `code`: {missing}"


def _exception_classes() -> set[str]:
    """Every class in the package deriving (through the package's own classes) from a built-in exception."""
    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    classes = {}
    for source in (ROOT / "hf_unified_ckpt").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
    found, grew = set(), True
    while grew:
        new = {n for n, bases in classes.items() if n not in found and any(b in builtin or b in found for b in bases)}
        found |= new
        grew = bool(new)
    return found


def test_every_exception_class_is_in_troubleshooting():
    spans = set(_code_spans((DOCS / "troubleshooting.md").read_text()))
    classes = _exception_classes()
    assert {"UnifiedCheckpointError", "CorruptCheckpointError", "TrainingPreempted"} <= classes
    missing = sorted(c for c in classes if c not in spans)
    assert not missing, f"docs/troubleshooting.md does not name {missing}"


# ---- the quick start runs -----------------------------------------------------------------------------------------

def _runnable_blocks(page: Path) -> list[str]:
    text = page.read_text()
    blocks = re.findall(re.escape(RUNS_MARK) + r"\s*\n```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == text.count(RUNS_MARK), f"{page.name}: a `{RUNS_MARK}` not followed by a python block"
    return blocks


def test_the_readmes_quick_start_runs_on_cpu(tmp_path):
    """The README's marked blocks, in order, in one fresh process (1 CPU thread), in an empty folder; the names the
    TRL block calls "yours" come from examples/recipes/tiny.py. Each block's checkpoints must be complete."""
    blocks = _runnable_blocks(ROOT / "README.md")
    assert len(blocks) >= 3
    setup = textwrap.dedent(f"""
        import sys, torch
        torch.set_num_threads(1)
        sys.path.insert(0, {str(ROOT / "examples" / "recipes")!r})
        import tiny
        model, policy, reference, tokenizer = tiny.llama(), tiny.llama(1), tiny.llama(1), tiny.tokenizer()
        dataset, pairs = tiny.sft_dataset(16), tiny.dpo_dataset(16)
    """)
    script = tmp_path / "quickstart.py"
    script.write_text(blocks[0] + setup + "\n".join(blocks[1:]))
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for folder in ("out/checkpoint-10", "out/checkpoint-20", "sft/checkpoint-4", "dpo/checkpoint-4", "cb/checkpoint-4"):
        manifest = tmp_path / folder / "unified_checkpoint.json"
        assert manifest.is_file(), f"the quick start wrote no complete {folder}: {proc.stderr[-3000:]}"
        assert json.loads(manifest.read_text())["files"]
