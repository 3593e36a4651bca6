"""No circles, no arrow up (issue 48): every import of every module of `hf_unified_ckpt`, at module level and
inside functions, methods, conditionals and `try` blocks, is walked with `ast` (nothing is imported), and

- no module imports, directly or through others, a module that imports it back (a circle is reported as the list of
  modules it runs through, first module repeated last);
- no import points up the layer order documented in docs/architecture.md ("Rules between the layers", read from the
  table itself, so the doc and this test cannot drift): a module imports only from its own layer and the layers
  below, wherever the import statement stands. An import inside a function that points down stays allowed (it
  keeps `hf-unified-ckpt info` light).

A module's layer is the row of the table naming its top-level module or package (`errors.py`, `format/`): a new
module inside a package needs no edit here or in the doc; a new top-level module or package fails until the table
names it.

Inside `checkpoint/` (issue 60) the doc's "Inside checkpoint/" table names each sub-package, its modules and the
sub-packages it may import (a DAG, not a line: load and the save side never see each other): an import between two
modules of `checkpoint/` crosses sub-packages only where the importer's row allows it, and the table names exactly
the modules there are (a loose module of `checkpoint/`, or one in no row, fails until a row names it). Dynamic imports
(`importlib.import_module`, `__import__`) are not followed: the package's `__init__` loads its public names that way on
first use, and it sits in the top layer.

No probe of the project's own seams (issue 60): a `getattr`/`hasattr` call with a literal attribute name is allowed
only on a foreign object (torch, transformers, DeepSpeed, accelerate, PEFT, numpy, the standard library,
s3fs/botocore), each (file, name) on the allow-list below with its reason; what the project's own objects may have
is a runtime-checkable protocol (docs/architecture.md, "Optional capabilities"). An allow-list entry no probe
matches any more is reported too.

The test harness: no module under tests/ imports a test module; what tests share lives in `tests/support/`."""

from __future__ import annotations

import ast
import functools
import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/architecture/ -> the repository
PACKAGE = ROOT / "hf_unified_ckpt"
DOC = ROOT / "docs" / "architecture.md"
RULES_HEADING = "## Rules between the layers"
PARTS_HEADING = "## Inside checkpoint/"
#: The top-level package whose sub-packages the "Inside checkpoint/" table orders.
PARTED = "checkpoint"

#: Module name -> (source, whether it is a package's `__init__`).
Sources = Mapping[str, tuple[str, bool]]


@dataclass(frozen=True)
class Import:
    """One package module imported by another: where the statement stands and whether it is inside a function."""

    source: str
    target: str
    line: int
    local: bool

    def __str__(self) -> str:
        where = "inside a function" if self.local else "at module level"
        return f"{self.source} (line {self.line}, {where}) imports {self.target}"


#: (file under the package, literal attribute name) -> why the object probed is foreign and may lack it.
FOREIGN_PROBES: dict[tuple[str, str], str] = {
    ("dist.py", "_device_types"): "torch: a private ProcessGroup attribute, absent in some versions",
    ("checkpoint/folder/rng.py", "_core"): "numpy: `numpy._core` in numpy 2, `numpy.core` in numpy 1",
    ("engines/conversion.py", "config"): "transformers: a PreTrainedModel has a config, a plain nn.Module none",
    ("engines/conversion.py", "model_type"): "transformers: the config of a PreTrainedModel (any object otherwise)",
    ("engines/conversion.py", "all_tied_weights_keys"): "transformers 5: a PreTrainedModel vs a plain nn.Module",
    ("engines/deepspeed.py", "optimizer"): "deepspeed: the torch optimizer a ZeRO optimizer wraps (version-dependent)",
    ("engines/deepspeed.py", "autotp_size"): "deepspeed: an engine attribute of versions with AutoTP only",
    ("engines/deepspeed.py", "bit16_groups"): "deepspeed: ZeRO-1/2's name of its parameter groups",
    ("engines/deepspeed.py", "bf16_groups"): "deepspeed: the bf16 optimizer's name of its parameter groups",
    ("engines/deepspeed.py", "dynamic"): "deepspeed: a DynamicLossScaler has it, a static LossScaler not",
    ("engines/deepspeed.py", "allreduce"): "deepspeed: set on MoE expert parameters only",
    ("engines/deepspeed.py", "_hp_mapping"): "deepspeed: a parameter's link to its fp32 fragment, once linked",
    ("engines/fsdp.py", "module"): "torch: FSDP1 wraps the model (`.module`), FSDP2 does not",
    ("engines/fsdp.py", "optimizer"): "accelerate: an AcceleratedOptimizer wraps the torch optimizer",
    ("engines/replicated.py", "optimizer"): "accelerate: an AcceleratedOptimizer wraps the torch optimizer",
    ("engines/hf_model.py", "all_tied_weights_keys"): "transformers 5: a PreTrainedModel vs a plain nn.Module",
    ("engines/hf_model.py", "config"): "transformers: a PreTrainedModel or PEFT model vs a plain nn.Module",
    ("engines/hf_model.py", "save_pretrained"): "transformers: a PretrainedConfig vs another config object",
    ("engines/hf_model.py", "dtype"): "transformers: a PreTrainedModel has `dtype`, a plain nn.Module not",
    ("engines/hf_model.py", "generation_config"): "transformers: models that generate have one",
    ("engines/hf_model.py", "can_generate"): "transformers: a PreTrainedModel vs a plain nn.Module",
    ("legacy/dcp.py", "storage_meta"): "torch: the DCP Metadata of older torch versions lacks it",
    ("legacy/deepspeed.py", "value"): "deepspeed: the unpickled `zero_stage` is an enum member or an int",
    ("preemption/signals.py", "sigwaitinfo"): "stdlib: `signal.sigwaitinfo` exists on some platforms only",
    ("preemption/signals.py", "num_workers"): "torch/accelerate: a DataLoader, or accelerate's wrapper of one",
    ("store/direct.py", "O_DIRECT"): "stdlib: `os.O_DIRECT` exists on Linux only",
    ("store/local_io.py", "MAP_POPULATE"): "stdlib: `mmap.MAP_POPULATE` exists on Linux only",
    ("store/s3.py", "_s3"): "s3fs: the private botocore client of an S3FileSystem, made lazily",
    ("store/s3.py", "response"): "botocore: a ClientError carries the response, other errors not",
    ("tools/merge_lora.py", "value"): "peft: `task_type` is a TaskType enum member or a str",
    ("tools/merge_lora.py", "unexpected_keys"): "peft: the load result's type differs by version",
    ("trainer/attach.py", "callback_handler"): "transformers: the Trainer's handler (set late in `__init__`)",
    ("trainer/capture.py", "scaler"): "accelerate: the accelerator has a grad scaler only with fp16",
    ("trainer/capture.py", "save_pretrained"): "transformers: `processing_class` may be any object",
    ("trainer/engines.py", "is_distributed_loading_by_transformers"): "transformers: a Trainer attribute of 5.x",
    ("trainer/engines.py", "is_deepspeed_enabled"): "transformers: set by Trainer.__init__ (a Trainer being built)",
    ("trainer/engines.py", "is_fsdp_enabled"): "transformers: set by Trainer.__init__ (a Trainer being built)",
    ("trainer/engines.py", "device_mesh"): "torch: DTensor parameters have a mesh, plain tensors not",
    ("trainer/engines.py", "mesh_dim_names"): "torch: a DeviceMesh has dimension names where they were given",
    ("trainer/mixin.py", "is_distributed_loading_by_transformers"): "transformers: a model attribute of 5.x",
    ("trainer/preempt.py", "jit_manager"): "transformers: the JIT checkpoint callback's manager (version-dependent)",
    ("trainer/preempt.py", "_original_sigterm_handler"): "transformers: private to its JIT checkpoint manager",
    ("trainer/session.py", "state"): "torch: an optimizer's step state (an optimizer-like object may lack it)",
}

#: Probes of the project's own seams that another change of issue 60 removes (allowed until it is merged).


# ---- reading the package -----------------------------------------------------------------------------------------


def package_sources(package: Path = PACKAGE) -> dict[str, tuple[str, bool]]:
    """Every module of the package (namespace sub-packages included), by dotted name: (source, is a package)."""
    sources = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        sources[".".join(parts[:-1] if is_package else parts)] = (path.read_text(), is_package)
    return sources


def _local_statements(tree: ast.Module) -> set[int]:
    """The ids of the import statements that stand inside a function or method (run when it is called)."""
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            local |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return local


def _from_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` statement of `module` names."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> Iterator[str]:
    """The package modules one import statement imports (`from . import x` is module `x` where one exists)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = _from_base(module, is_package, node)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in known else base


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> list[Import]:
    """Every import of another module of the package by `module`, wherever the statement stands."""
    tree = ast.parse(source)
    local = _local_statements(tree)
    root = module.split(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(module, is_package, node, known):
                if target.split(".")[0] == root and target != module:
                    found.append(Import(module, target, node.lineno, id(node) in local))
    return sorted(set(found), key=lambda i: (i.line, i.target))


def import_graph(sources: Sources) -> dict[str, list[Import]]:
    """Module -> its imports of other modules of the package."""
    known = set(sources)
    return {name: imports_of(name, source, is_package, known) for name, (source, is_package) in sources.items()}


# ---- circles ------------------------------------------------------------------------------------------------------


def _strongly_connected(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of a directed graph (each a list of its nodes)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def _cycle_through(start: str, members: set[str], edges: Mapping[str, set[str]]) -> list[str]:
    """A shortest circle from `start` back to it inside one strongly connected component (breadth first)."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(edges.get(path[-1], ()) & members):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    raise AssertionError(f"{start} is in no circle of {sorted(members)}")


def circles(graph: Mapping[str, list[Import]]) -> list[list[str]]:
    """One circle per group of modules that import each other, as the modules it runs through."""
    edges = {name: {i.target for i in found} for name, found in graph.items()}
    return [_cycle_through(component[0], set(component), edges)
            for component in _strongly_connected(edges) if len(component) > 1]


# ---- the layer order ----------------------------------------------------------------------------------------------


def _first_table(text: str) -> list[list[str]]:
    """The cells of each body row of the first markdown table in `text` (its header and rule left out)."""
    lines = text.splitlines()
    start = next((n for n, line in enumerate(lines) if line.startswith("|")), len(lines))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows[2:]]


def documented_layers(doc: str) -> list[list[str]]:
    """The layers of the doc's "Rules between the layers" table, bottom first: the top-level modules its second
    column names (`errors.py` -> `errors`, `format/` -> `format`, `__init__.py` -> the package itself)."""
    rows = _first_table(doc.split(RULES_HEADING, 1)[-1])
    assert rows, f"no table of layers under {RULES_HEADING!r}"
    return [[re.sub(r"(\.py|/)$", "", name) for name in re.findall(r"`([^`]+)`", cells[1])] for cells in rows]


def layer_index(layers: list[list[str]]) -> dict[str, int]:
    """Top-level module name -> its layer (0: the bottom)."""
    index = {}
    for level, names in enumerate(layers):
        for name in names:
            assert name not in index, f"{name} is in two layers of the table"
            index[name] = level
    return index


def top_level(module: str) -> str:
    """The documented name a module's layer goes by: its top-level module or package (`__init__`: the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def up_arrows(graph: Mapping[str, list[Import]], index: Mapping[str, int]) -> list[str]:
    """Every import that points up the layer order (or from or to a module no layer names)."""
    found = []
    for name, imports in sorted(graph.items()):
        if top_level(name) not in index:
            found.append(f"{name} is in no layer of the table")
            continue
        for i in imports:
            source, target = index[top_level(name)], index.get(top_level(i.target))
            if target is None or target > source:
                found.append(f"{i}: layer {source} -> {'no layer' if target is None else target}")
    return found


# ---- the parts of checkpoint/ --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One row of the "Inside checkpoint/" table: the modules of a sub-package and the sub-packages it may import."""

    modules: frozenset[str]
    may_import: frozenset[str]


def _names(cell: str) -> list[str]:
    """The backticked names of a cell, `.py` and a trailing `/` stripped (`folder/` -> `folder`)."""
    return [re.sub(r"(\.py|/)$", "", name) for name in re.findall(r"`([^`]+)`", cell)]


def documented_parts(doc: str) -> dict[str, Part]:
    """The doc's "Inside checkpoint/" table: sub-package -> its modules (second column) and the sub-packages its last
    column names."""
    rows = _first_table(doc.split(PARTS_HEADING, 1)[-1]) if PARTS_HEADING in doc else []
    assert rows, f"no table of sub-packages under {PARTS_HEADING!r}"
    parts = {}
    for cells in rows:
        name = _names(cells[0])[0]
        assert name not in parts, f"{name} is in two rows of the table"
        parts[name] = Part(frozenset(_names(cells[1])), frozenset(_names(cells[-1])))
    return parts


def part_of(module: str) -> str | None:
    """The sub-package of `checkpoint/` a module is in (its first name below `checkpoint`; a loose module's own
    name), or None for a module outside `checkpoint/` and for `checkpoint/__init__` itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == PARTED else None


def cross_arrows(graph: Mapping[str, list[Import]], parts: Mapping[str, Part]) -> list[str]:
    """Every import between two modules of `checkpoint/` that crosses sub-packages against the table (to a module
    in no row, too)."""
    found = []
    for name, imports in sorted(graph.items()):
        source = part_of(name)
        if source not in parts:  # outside checkpoint/, or in no row (`unlisted_modules` reports it)
            continue
        for i in imports:
            target = part_of(i.target)
            if target is not None and target != source and target not in parts[source].may_import:
                found.append(f"{i}: {source} -> {target}, which the row of {source} does not allow")
    return found


def unlisted_modules(modules: set[str], parts: Mapping[str, Part]) -> list[str]:
    """The modules of `checkpoint/` in no row (a loose module, a sub-package the table lacks, a module its row does
    not name), and those a row names that do not exist."""
    inside = sorted(m for m in modules if part_of(m) is not None)
    found = [f"{m} is in no sub-package of the table" for m in inside if part_of(m) not in parts]
    present = {(m.split(".")[2], ".".join(m.split(".")[3:])) for m in inside
               if part_of(m) in parts and len(m.split(".")) > 3}
    documented = {(part, module) for part, row in parts.items() for module in row.modules}
    return (found + [f"{part}/{module}.py is in no row of the table" for part, module in sorted(present - documented)]
            + [f"{part}/{module}.py is in the table but not in the package"
               for part, module in sorted(documented - present)])


# ---- the tests ----------------------------------------------------------------------------------------------------


def literal_probes(sources: Sources) -> list[tuple[str, str, int]]:
    """(file under the package, attribute name, line) of every `getattr(x, "name", ...)` / `hasattr(x, "name")`
    call with a literal name, in every module of `sources` (nested calls included)."""
    out = []
    for module, (source, is_package) in sources.items():
        file = "/".join(module.split(".")[1:]) + ("/__init__.py" if is_package else ".py")
        file = file.lstrip("/")
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                out.append((file, node.args[1].value, node.lineno))
    return sorted(out)


def unallowed_probes(probes: list[tuple[str, str, int]], allowed: Mapping[tuple[str, str], str]) -> list[str]:
    """The probes whose (file, name) is not on `allowed`."""
    return [f"{file}:{line} probes {name!r} with getattr/hasattr" for file, name, line in probes
            if (file, name) not in allowed]


def stale_entries(probes: list[tuple[str, str, int]], allowed: Mapping[tuple[str, str], str]) -> list[str]:
    """The entries of `allowed` that no probe matches."""
    seen = {(file, name) for file, name, _ in probes}
    return [f"{file}: {name!r} ({why})" for (file, name), why in sorted(allowed.items()) if (file, name) not in seen]


@functools.cache
def _package_sources() -> dict[str, tuple[str, bool]]:
    """The package's modules, read once for the tests of this module."""
    return package_sources()


@functools.cache
def _package_graph() -> dict[str, list[Import]]:
    """The import graph of the package, walked once for the tests of this module."""
    return import_graph(_package_sources())


def test_no_circle_between_modules():
    found = circles(_package_graph())
    assert not found, "import circles (each: the modules it runs through):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_no_import_points_up_the_documented_layers():
    found = up_arrows(_package_graph(), layer_index(documented_layers(DOC.read_text())))
    assert not found, f"imports against the layer order of {DOC.name}:\n" + "\n".join(found)


def test_the_documented_layers_name_every_top_level_module():
    documented = {name for layer in documented_layers(DOC.read_text()) for name in layer}
    present = {top_level(name) for name in _package_graph()}
    assert documented == present, (f"in {DOC.name} but not in the package: {sorted(documented - present)}; "
                                   f"in the package but in no layer: {sorted(present - documented)}")


def test_no_import_crosses_the_documented_parts_of_checkpoint():
    found = cross_arrows(_package_graph(), documented_parts(DOC.read_text()))
    assert not found, f"imports against the table {PARTS_HEADING!r} of {DOC.name}:\n" + "\n".join(found)


def test_the_documented_parts_name_every_module_of_checkpoint():
    found = unlisted_modules(set(_package_graph()), documented_parts(DOC.read_text()))
    assert not found, f"the table {PARTS_HEADING!r} of {DOC.name} and checkpoint/ differ:\n" + "\n".join(found)


def test_the_walker_sees_what_it_forbids():
    """A synthetic package with a circle closed inside a function and arrows up (one local, one under TYPE_CHECKING,
    relative and absolute): both checks report them, and a local import pointing down passes."""
    doc = "\n".join([RULES_HEADING, "", "| layer | modules |", "|---|---|", "| 0 | `low.py` |", "| 1 | `mid/` |",
                     "| 2 | `__init__.py` |", "", "| another | table |", "|---|---|", "| 3 | `low.py` |"])
    sources = {
        "pkg": ("", True),
        "pkg.low": ("import os\ndef f():\n    from .mid import c\n", False),
        "pkg.mid": ("", True),
        "pkg.mid.a": ("from . import b\nfrom .. import low\n", False),
        "pkg.mid.b": ("try:\n    pass\nfinally:\n    def g():\n        import pkg.mid.a as a\n", False),
        "pkg.mid.c": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import x\n", False),
    }
    graph = import_graph(sources)
    assert circles(graph) == [["pkg.mid.a", "pkg.mid.b", "pkg.mid.a"]]
    arrows = up_arrows(graph, layer_index(documented_layers(doc)))
    assert arrows == ["pkg.low (line 3, inside a function) imports pkg.mid.c: layer 0 -> 1",
                      "pkg.mid.c (line 3, at module level) imports pkg: layer 1 -> 2"]
    assert Import("pkg.mid.a", "pkg.low", 2, False) in graph["pkg.mid.a"]  # a down arrow: seen, allowed


def test_the_walker_sees_arrows_between_the_parts_of_checkpoint():
    """A synthetic `checkpoint/` with a load -> write arrow inside a function, a folder -> save arrow (relative), a
    loose module, a module no row names and one a row names but the package lacks: each is reported; save -> folder,
    save -> write and an import inside one sub-package pass."""
    doc = "\n".join([PARTS_HEADING, "", "| part | modules | job | may import |", "|---|---|---|---|",
                     "| [`folder/`](x/) | `files.py` | folder | nothing of checkpoint/ |",
                     "| `write/` | `writer.py` | write | `folder/` |",
                     "| `save/` | `saving.py`, `rules.py`, `gone.py` | save | `folder/`, `write/` |",
                     "| `load/` | `loading.py` | load | `folder/` |"])
    sources = {
        "pkg.checkpoint": ("", True),
        "pkg.checkpoint.folder": ("", True),
        "pkg.checkpoint.folder.files": ("from ..save import saving\n", False),
        "pkg.checkpoint.folder.extra": ("", False),
        "pkg.checkpoint.write": ("", True),
        "pkg.checkpoint.write.writer": ("from ..folder import files\n", False),
        "pkg.checkpoint.save": ("", True),
        "pkg.checkpoint.save.saving": ("from ..folder.files import x\nfrom ..write.writer import y\n"
                                       "from . import rules\n", False),
        "pkg.checkpoint.save.rules": ("", False),
        "pkg.checkpoint.load": ("", True),
        "pkg.checkpoint.load.loading": ("def f():\n    import pkg.checkpoint.write.writer\n", False),
        "pkg.checkpoint.loose": ("", False),
    }
    graph = import_graph(sources)
    parts = documented_parts(doc)
    assert parts["folder"] == Part(frozenset({"files"}), frozenset())
    assert cross_arrows(graph, parts) == [
        "pkg.checkpoint.folder.files (line 1, at module level) imports pkg.checkpoint.save.saving: folder -> save, "
        "which the row of folder does not allow",
        "pkg.checkpoint.load.loading (line 2, inside a function) imports pkg.checkpoint.write.writer: load -> write, "
        "which the row of load does not allow"]
    assert Import("pkg.checkpoint.save.saving", "pkg.checkpoint.save.rules", 3, False) in graph[
        "pkg.checkpoint.save.saving"]  # inside one sub-package: seen, allowed
    assert unlisted_modules(set(sources), parts) == ["pkg.checkpoint.loose is in no sub-package of the table",
                                                      "folder/extra.py is in no row of the table",
                                                      "save/gone.py is in the table but not in the package"]


@functools.cache
def _package_probes() -> list[tuple[str, str, int]]:
    """The package's literal probes, walked once for the tests of this module."""
    return literal_probes(_package_sources())


def test_no_literal_probe_of_the_projects_own_objects():
    allowed = FOREIGN_PROBES
    found = unallowed_probes(_package_probes(), allowed)
    assert not found, ("getattr/hasattr with a literal name on what may be the project's own object: declare the "
                       "member, or a runtime-checkable protocol for an optional capability (docs/architecture.md, "
                       "'Optional capabilities'); a foreign object's goes on FOREIGN_PROBES with its reason:\n"
                       + "\n".join(found))


def test_every_allowed_probe_is_still_there():
    found = stale_entries(_package_probes(), FOREIGN_PROBES)
    assert not found, "allow-list entries no getattr/hasattr of the package matches any more:\n" + "\n".join(found)


def test_the_walker_sees_literal_probes():
    """A synthetic package: a `hasattr` in a method, a nested `getattr` with a default, a probe in a package's
    `__init__` are found; a non-literal name and an attribute access are not; an allowed (file, name) passes,
    another name in the same file does not, and an entry no probe matches is stale."""
    sources = {
        "pkg": ("x = getattr(obj, 'marker', None)\n", True),
        "pkg.mod": ("class A:\n    def f(self, e):\n        return hasattr(e, 'rule') and getattr(getattr(e, 'c', None),"
                    " 'rule', 1)\n", False),
        "pkg.sub.other": ("name = 'rule'\ngetattr(e, name)\ne.rule\nsetattr(e, 'rule', 1)\n", False),
    }
    probes = literal_probes(sources)
    assert probes == [("__init__.py", "marker", 1), ("mod.py", "c", 3), ("mod.py", "rule", 3), ("mod.py", "rule", 3)]
    allowed = {("mod.py", "c"): "foreign", ("sub/other.py", "rule"): "foreign"}
    assert unallowed_probes(probes, allowed) == ["__init__.py:1 probes 'marker' with getattr/hasattr",
                                                 "mod.py:3 probes 'rule' with getattr/hasattr",
                                                 "mod.py:3 probes 'rule' with getattr/hasattr"]
    assert stale_entries(probes, allowed) == ["sub/other.py: 'rule' (foreign)"]


# ---- the test harness ----------------------------------------------------------------------------------------------

TESTS = ROOT / "tests"


def imports_of_test_modules(sources: Mapping[str, str]) -> list[str]:
    """`file:line imports test_x` for every import of a test module (`test_*`) in `sources` (file -> source)."""
    found = []
    for file, source in sources.items():
        for node in sorted(ast.walk(ast.parse(source)), key=lambda n: getattr(n, "lineno", 0)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{file}:{node.lineno} imports {n}" for n in names if n.split(".")[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    """What tests share lives in `tests/support/` (docs/testing.md): a test module imported by basename resolves only
    in the pytest process, not in the ranks a launch forks or the workers it starts by path."""
    sources = {str(p.relative_to(TESTS)): p.read_text() for p in sorted(TESTS.rglob("*.py"))}
    assert imports_of_test_modules({"a.py": "import os\nfrom support import x\ndef f():\n    from test_b import y\n"
                                            "import support.test_c\n"}) == ["a.py:4 imports test_b",
                                                                          "a.py:5 imports support.test_c"]
    found = imports_of_test_modules(sources)
    assert not found, "move what these share into tests/support/:\n" + "\n".join(found)
