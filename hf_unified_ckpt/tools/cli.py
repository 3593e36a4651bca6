"""`hf-unified-ckpt` command line: `info PATH [--json]`, `verify PATH`,
`convert LEGACY_DIR OUT_DIR [--ckpt-quant-stage] [--trust-pickles]`,
`export CHECKPOINT OUT_DIR [--weights model|master|ema] [--dtype] [--merge-lora [--base-model]]`. A checkpoint PATH
or OUT_DIR is a local path or a URL of a registered store (memory://...); LEGACY_DIR is a local folder."""

from __future__ import annotations

import argparse
import json
import math
import sys

# `info` and `verify` read file names, JSON and safetensors headers only: keep these imports free of torch,
# transformers and accelerate (tests/architecture/test_imports.py), so the command answers at once. `convert` imports its own.
from ..errors import UnifiedCheckpointError
from ..checkpoint.folder.layout import UNIFIED, detect_layout
from ..format.headers import tensor_specs
from ..checkpoint.folder.safetensors_header import read_safetensors_header
from ..checkpoint.folder.manifest import spread_hint, verify_folder
from ..checkpoint.folder.state_check import recorded_state_problems
from ..store import is_folder, join


def _info(path: str) -> dict:
    if not is_folder(path):
        raise FileNotFoundError(f"{path}: no such folder (info describes a checkpoint folder)")
    layout = detect_layout(path)
    info = {"path": str(layout.path), "kind": layout.kind, "complete": layout.complete,
            "global_step": layout.global_step, "reason": layout.reason or None,
            "trainer_state": layout.trainer_state, "findings": _findings(layout)}
    if layout.manifest:
        m = layout.manifest
        info.update({
            "format_version": m.get("format_version"), "library_version": m.get("library", {}).get("version"),
            "saved_by": m.get("saved_by"), "options": m.get("options"),
            "components": {k: {"file_stem": v["file_stem"], "files": len(v["files"]), "tensors": v["tensors"],
                               "bytes": v["bytes"], **({"codec": v["codec"]} if v.get("codec") else {})}
                           for k, v in m.get("components", {}).items()},
            "files": len(m.get("files", {})),
            "total_bytes": sum(f["size"] for f in m.get("files", {}).values()),
        })
        try:
            info.update(_per_parameter(layout.path, m))
        except (UnifiedCheckpointError, OSError):  # a damaged model file: one of the findings already
            pass
    return info


def _findings(layout) -> list[str]:
    """Every problem `info` sees, one line each: for a unified folder what `verify` says of each file without
    checksumming it (present, of its recorded size, a regular file, its header or index well formed), else why the
    folder is incomplete."""
    if layout.manifest:
        problems = verify_folder(layout.path, layout.manifest, checksums=False)
        if problems:
            return problems
    return [layout.reason] if layout.reason and not layout.complete else []


def _per_parameter(folder, manifest: dict) -> dict:
    """The model's parameter count (from the model files' headers) and each component's stored bytes per parameter
    (a file's bytes, headers included, counted by its component)."""
    model = manifest.get("components", {}).get("model")
    if not model:
        return {}
    parameters = 0
    for file in model["files"]:
        for shape, _ in tensor_specs(read_safetensors_header(join(folder, file))).values():
            parameters += math.prod(shape)
    if not parameters:
        return {}
    sizes = {name: rec["size"] for name, rec in manifest.get("files", {}).items()}
    per = {name: sum(sizes.get(f, 0) for f in c["files"]) / parameters
           for name, c in manifest.get("components", {}).items()}
    return {"parameters": parameters, "bytes_per_parameter": {**per, "all": sum(per.values())}}


def _print_info(info: dict) -> None:
    print(f"{info['path']}\n  kind:        {info['kind']}\n  complete:    {info['complete']}"
          f"\n  global_step: {info['global_step']}")
    if info.get("reason"):
        print(f"  note:        {info['reason']}")
    for finding in info["findings"]:
        if finding != info.get("reason"):
            print(f"  problem:     {finding}")
    if "saved_by" in info:
        print(f"  saved by:    {json.dumps(info['saved_by'], sort_keys=True)}")
        print(f"  options:     {json.dumps(info['options'], sort_keys=True)}")
        print(f"  files:       {info['files']} ({info['total_bytes']:,} bytes)")
        per = info.get("bytes_per_parameter", {})
        for name, c in info["components"].items():
            print(f"  {name:<14} {c['tensors']:>6} tensors {c['bytes']:>15,} bytes in {c['files']} "
                  f"{c['file_stem']}*.safetensors file(s)"
                  + (f", {per[name]:.3f} bytes/parameter" if name in per else ""))
            if c.get("codec"):
                print(f"  {'':<14} codec: {json.dumps(c['codec'], sort_keys=True)}")
        if per:
            print(f"  parameters:  {info['parameters']:,}; all components: {per['all']:.3f} bytes/parameter")


def _verify(path: str, checksums: bool = True) -> int:
    layout = detect_layout(path)
    if layout.kind != UNIFIED or layout.manifest is None:
        print(f"FAIL {path}: not a complete unified checkpoint (kind {layout.kind}): {layout.not_unified_why}",
              file=sys.stderr)
        return 1
    problems = verify_folder(layout.path, layout.manifest, checksums=checksums)
    if not problems:  # sound files: then what they hold fits the weights' recorded shapes
        problems = recorded_state_problems(layout.path, layout.manifest)
    if problems:
        print(f"FAIL {path}: {len(problems)} problem(s)", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        if hint := spread_hint(problems):
            print(hint.strip(), file=sys.stderr)
        return 1
    what = "sizes and checksums match" if checksums else "complete, sizes match"
    print(f"OK {path}: {len(layout.manifest['files'])} files, {what} (step {layout.global_step})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every command and flag (docs/cli.md documents each; `tests/architecture/test_docs.py` checks)."""
    parser = argparse.ArgumentParser(prog="hf-unified-ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="what a checkpoint folder is, whether it is complete, what it holds")
    p_info.add_argument("path")
    p_info.add_argument("--json", action="store_true", help="print one JSON object")
    p_verify = sub.add_parser("verify", help="exit 0 only if complete and every checksum matches")
    p_verify.add_argument("path")
    p_convert = sub.add_parser("convert", help="turn a legacy DeepSpeed or FSDP checkpoint folder into a unified one, "
                                               "offline (no GPU, no process group), one shard in memory at a time")
    p_convert.add_argument("legacy_dir")
    p_convert.add_argument("out_dir", help="new folder to create (must not exist or be empty)")
    p_convert.add_argument("--max-shard-size", default="100MB",
                           help="largest file written, and about the memory convert holds (default 100MB)")
    p_convert.add_argument("--ckpt-quant-stage", choices=["O0", "O1", "O2"], default="O0",
                           help="compress the optimizer moments: O1 int8, O2 int4 (default O0: exact)")
    p_convert.add_argument("--verify", action="store_true",
                           help="then re-read every file from disk and check its CRC-32, as `verify` does (default: "
                                "the checksums are computed from the bytes as they are written, and the folder is "
                                "checked complete with the sizes its manifest records)")
    p_convert.add_argument("--no-direct-io", dest="direct_io", action="store_false",
                           help="write through the page cache (default: direct I/O where the filesystem takes it, as "
                                "unified_checkpoint_direct_io)")
    p_convert.add_argument("--trust-pickles", action="store_true",
                           help="unpickle the legacy files whole, as DeepSpeed and torch.distributed.checkpoint do "
                                "(runs any code they hold): only for a folder you trust. Default: only tensors, "
                                "plain values and known classes; a file that needs more is refused")
    p_convert.add_argument("--quiet", action="store_true", help="no progress bar")
    p_export = sub.add_parser("export", help="a unified checkpoint's weights (model, fp32 master or EMA) as a plain "
                                             "Hugging Face model folder that from_pretrained loads")
    p_export.add_argument("checkpoint")
    p_export.add_argument("out_dir", help="new folder to create (must not exist or be empty)")
    p_export.add_argument("--weights", choices=["model", "master", "ema"], default="model",
                          help="which weights: the model files (default), the fp32 master weights or the EMA")
    p_export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                          help="cast to this dtype (default: each tensor's own; master and EMA are fp32)")
    p_export.add_argument("--max-shard-size", default="5GB", help="largest file written (default 5GB)")
    p_export.add_argument("--merge-lora", action="store_true",
                          help="a LoRA checkpoint: merge the adapter into its base model (PEFT's merge_and_unload) "
                               "and write the whole merged model")
    p_export.add_argument("--base-model", default=None,
                          help="with --merge-lora: the base model folder or Hub id (default: the adapter config's "
                               "base_model_name_or_path)")
    p_export.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            from .export import export

            out = export(args.checkpoint, args.out_dir, args.weights, args.dtype, args.max_shard_size,
                         show_progress=not args.quiet, merge_lora=args.merge_lora, base_model=args.base_model)
            merged = " merged into the base model" if args.merge_lora else ""
            print(f"exported the {args.weights} weights of {args.checkpoint}{merged} -> {out}")
            return 0
        if args.command == "convert":
            from .convert import convert

            out = convert(args.legacy_dir, args.out_dir, args.max_shard_size, show_progress=not args.quiet,
                          ckpt_quant_stage=args.ckpt_quant_stage, direct_io=args.direct_io,
                          trust_pickles=args.trust_pickles)
            print(f"converted {args.legacy_dir} -> {out}")
            return _verify(str(out), checksums=args.verify)
        if args.command == "info":
            info = _info(args.path)
            print(json.dumps(info, sort_keys=True)) if args.json else _print_info(info)
            return 0
        return _verify(args.path)
    except (UnifiedCheckpointError, OSError, ValueError) as e:  # a bad path or flag, a file that cannot be read
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
