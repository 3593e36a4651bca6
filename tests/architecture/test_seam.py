"""The storage seam holds: no module outside `hf_unified_ckpt/store/` touches bytes at rest or types a checkpoint
as a `pathlib.Path` (the legacy readers, which read the DeepSpeed/FSDP folders a user names, may keep local paths).

The source is walked with `ast`; a new `open(...)`, `os.listdir(...)`, `shutil.*`, `Path(...)`,
`safe_open(...)`, `torch.save(path)`... anywhere above the seam fails this test, naming the file and line."""

import ast
import os

import hf_unified_ckpt

PACKAGE = os.path.dirname(hf_unified_ckpt.__file__)
#: Below the seam (the store package) and the readers of legacy folders.
ALLOWED = ("store", "legacy")

OS_FILE_FUNCTIONS = {
    "open", "fdopen", "listdir", "scandir", "stat", "lstat", "fstat", "replace", "rename", "renames", "remove",
    "unlink", "makedirs", "mkdir", "rmdir", "removedirs", "fsync", "fdatasync", "pwrite", "pread", "write", "read",
    "ftruncate", "truncate", "walk", "link", "symlink", "chmod", "utime", "sendfile", "copy_file_range",
}
OS_PATH_IO = {"exists", "lexists", "isfile", "isdir", "islink", "getsize", "getmtime", "realpath", "samefile"}
PATH_IO_METHODS = {
    "read_text", "read_bytes", "write_text", "write_bytes", "mkdir", "rmdir", "unlink", "iterdir", "glob", "rglob",
    "exists", "is_file", "is_dir", "stat", "touch", "rename", "replace", "resolve", "open", "with_name", "with_suffix",
}
LIBRARY_FILE_CALLS = {"safe_open", "save_file", "load_file", "rmtree", "copyfile", "copy2", "copytree"}


def _modules():
    for root, _, files in os.walk(PACKAGE):
        relative = os.path.relpath(root, PACKAGE)
        if relative.split(os.sep)[0] in ALLOWED:
            continue
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(node.id if isinstance(node, ast.Name) else "<expr>")
    return ".".join(reversed(parts))


def _violation(node) -> str | None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = {alias.name for alias in node.names}
        module = getattr(node, "module", None) or ""
        if module == "pathlib" or "pathlib" in names or "shutil" in names or module == "shutil":
            return f"imports {module or ', '.join(sorted(names))}"
        if "safe_open" in names or module == "safetensors.torch" and names & {"save_file", "load_file"}:
            return f"imports {sorted(names)} from {module}"
        return None
    if not isinstance(node, ast.Call):
        return None
    called = _dotted(node.func)
    last = called.rsplit(".", 1)[-1]
    if called in ("open", "Path", "PurePath") or called.startswith("shutil."):
        return f"calls {called}()"
    if called.startswith("os.path.") and last in OS_PATH_IO:
        return f"calls {called}()"
    if called.startswith("os.") and called.count(".") == 1 and last in OS_FILE_FUNCTIONS:
        return f"calls {called}()"
    if last in LIBRARY_FILE_CALLS:
        return f"calls {called}()"
    if called in ("torch.save", "torch.load") and not _in_memory(node):
        return f"calls {called}() on a path"
    if isinstance(node.func, ast.Attribute) and last in PATH_IO_METHODS and _looks_like_path(node.func.value):
        return f"calls .{last}() on a path"
    return None


def _in_memory(node: ast.Call) -> bool:
    """torch.save(obj, buffer) / torch.load(io.BytesIO(...)): bytes, not a file."""
    target = node.args[1] if _dotted(node.func) == "torch.save" and len(node.args) > 1 else (
        node.args[0] if node.args else None)
    return target is not None and "BytesIO" in ast.unparse(target) or (
        isinstance(target, ast.Name) and target.id in ("buffer", "f"))


def _looks_like_path(value) -> bool:
    text = ast.unparse(value)
    return any(word in text for word in ("path", "folder", "dir", "Path(", "checkpoint", "staging", "/"))


def test_no_file_system_calls_above_the_store():
    found = []
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            why = _violation(node)
            if why:
                found.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}: {why}")
    assert not found, ("these lines touch stored bytes or local paths above the storage seam; go through "
                       "hf_unified_ckpt.store (store_for(ref), join, read_bytes, put_bytes, ...) instead:\n  "
                       + "\n  ".join(found))


def test_the_walker_sees_what_it_forbids():
    """The check cannot pass vacuously: each kind of call it forbids is found in a sample."""
    sample = ("import shutil\nfrom pathlib import Path\nopen('x')\nos.listdir(d)\nos.path.isdir(d)\n"
              "shutil.rmtree(d)\nfolder.read_bytes()\nPath(d)\nsafe_open(p)\ntorch.load(path)\n"
              "torch.save(x, io.BytesIO())\nos.path.join(a, b)\n")
    flagged = [node.lineno for node in ast.walk(ast.parse(sample)) if _violation(node)]
    assert sorted(set(flagged)) == list(range(1, 11))
    assert _modules() and len(list(_modules())) > 20


def test_the_format_layer_is_pure():
    """`format/` does no I/O and runs no collective: it imports nothing from the layers above or below it."""
    above = ("store", "checkpoint", "engines", "trainer", "tools", "legacy", "dist")
    found = []
    folder = os.path.join(PACKAGE, "format")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                module = (node.module or "").split(".")[0] or node.names[0].name
                if module in above:
                    found.append(f"format/{name}:{node.lineno} imports {module}")
    assert not found, "\n".join(found)


def _module_names() -> dict[str, tuple[str, bool]]:
    """Every module of the package: dotted name -> (file, whether it is a package's `__init__`)."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                dotted = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = (path, name == "__init__.py")
    return out


def _imported(name: str, modules: dict) -> set[str]:
    """The package's modules that module `name` imports anywhere (inside functions too). `from pkg import sub`
    counts the submodule only; a package imported for its names counts the package's `__init__`."""
    path, is_package = modules[name]
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            subs = {f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules}
            found |= subs
            if target in modules and len(subs) < len(node.names):
                found.add(target)
    return found - {name}


def test_nothing_above_the_store_imports_a_concrete_store():
    """Above the seam a store is reached through `store_for` and the capability protocols, never by its module:
    no module outside `store/` imports `store.local`, `store.local_io`, `store.direct`, `store.fsspec_store` or
    `store.s3` (the part size comes from `Capabilities.part_size`, the staging names from `store`)."""
    concrete = {f"hf_unified_ckpt.store.{name}" for name in ("local", "local_io", "direct", "fsspec_store", "s3")}
    modules = _module_names()
    found = [f"{name} imports {', '.join(sorted(_imported(name, modules) & concrete))}" for name in sorted(modules)
             if not name.startswith("hf_unified_ckpt.store") and _imported(name, modules) & concrete]
    assert not found, "\n".join(found)
